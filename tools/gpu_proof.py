#!/usr/bin/env python3
"""GPU proof, part 2, in one device call (`bash tools/gpu_host_check.sh gpu-proof-2` runs it).

Parts, in this order (or the order --parts names them), each with a time budget (seconds; PROOF_BUDGET_<PART> overrides one, a part's unused
time goes to the next ones; --parts picks some), each ending in one line "part NAME: ..." even when it fails
or runs out of time, with its figure beside its target and the plan's prediction:

  suite  the GPU test cases since the last GPU run (step_test's OnAGpu*: every placement against the CPU,
         the optimizer behind the backward bit for bit against the inline one; kernels_test): every case
         passes, none skipped.
  b      (b) (configs/gpu-b-llama8b.json: Llama-3-8B's shape, 1.76x HBM of state) against its compute-only
         step (bench_train_torch --compute-only): the old schedule (run.schedule micro_batch: the optimizer
         after the backward), the new one (layer, optimizer.speculate on, traced) and the new one with every
         step clipped (gradient_clipping 1e-4: each speculation redone); the rates probed once by
         `strata plan` and given to every run; target >= 0.9x the compute-only step (docs/design.md,
         "The optimizer behind the backward").
  det    run.deterministic: (b)'s first two steps twice with it on (must agree bit for bit: losses and
         gradient norms) and its cost against the new schedule's run of part b (or a run with it off).
  e      a checkpoint save's overhead while training (tools/bench_checkpoint.py, one round, on the device):
         target < 10% of the save's write time.
  ranks  two ranks sharing the device over Gloo at ZeRO stage 3 against one rank (configs/tiny-cpu.json's model
         on random token ids):
         losses side by side (target: equal within fp32 rounding, 1e-4 relative), bytes per rank.
  c      a model past HBM + RAM: the (b) shape with the fewest layers whose plan puts at least
         --c-nvme-gb GB of state on NVMe (state larger than HBM + RAM; capped at the largest that fits),
         trained --c-steps steps: tokens/s, MFU, bytes per link, step_s against bound_s; beside it the
         plan's largest trainable layer count and the capacity bound (HBM + RAM + disk - non-state bytes)
         / bytes per parameter.
  act    (b) under the layer schedule with the optimizer behind the backward, run.recompute always against
         auto (activations placed like state: docs/design.md, "Activation placement"), the rates probed once
         and given to both (part b's when it ran in this call), against the compute-only step (part b's, or
         measured here): tokens/s, MFU of the nominal peak, the activations' PCIe bytes, the plan's choice;
         target: auto's MFU >= 50% at >= 0.95x the compute-only step.
  lora   LoRA r 16 on all seven linears over (b)'s shape as a frozen base (docs/design.md, "State kinds"): the
         base in HBM (the reference) against half of it in host RAM, the layer schedule, the same rates:
         tokens/s, MFU, PCIe bytes, losses bit for bit the same.
  d      DeepSpeed ZeRO-Infinity (tools/bench_deepspeed.py, offload nvme, the carried prebuilt ops) on the
         (b) shape with the most layers whose state fits the disk, descending, and the same global batch;
         then Strata on exactly the model and batch DeepSpeed started (or the smallest it tried); then, if
         time is left, DeepSpeed on part c's model (how it fails). Last: it takes the time the others leave.

Everything goes under --out: gpu-proof-2.json (a key per part, rewritten after each; "target_met" where a
part has a target; "startup": each training run's wall time less its steps', and its start's own account of
the initial weights and slow host allocations, a line each as it ends), gpu-proof-2.txt (what was printed) and gpu-proof-2-logs.tgz (each command's log,
metrics and trace, files under 64 MiB). A command past its part's time gets SIGTERM (strata stops after its
step and removes its swap files; bench_deepspeed reports), then SIGKILL 10 s later; parts c and d first
remove what a killed run left in the scratch folder. The exit status is 0 when every part ran (a missed
target is a finding, said in its line, not a failure of the script).

--dry-run runs every part on the CPU device with tiny configs (about a minute on 2 cores), so that a broken
script is found on the dev machine, not on the GPU host: tests/gpu_proof_dry_run.sh runs it in the suite.
Its figures mean nothing and it asserts nothing about speed.

Usage:
  python3 tools/gpu_proof.py --bin .dev/bin --out $OUT [--parts suite,b,det,e,ranks,c,act,d] [--budget 530]
  python3 tools/gpu_proof.py --dry-run --bin build --out /tmp/proof-dry
"""
import argparse
import copy
import json
import os
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tarfile
import time

# 540 s: a 600 s device call. (b) starts in tens of seconds (84 GB of pinned optimizer state), so b and
# det are its longest; what a budget cuts is reported, and a second call runs the rest (--parts).
# DeepSpeed's part comes last: it takes what the others leave (its attempts start slowly and may not finish).
# 530 s leaves the call's 600 s room for the script's start, killed commands' exits and the archive. Round 2
# (BENCHMARKS.md, "GPU, round 2") showed that every part does not fit one call on a lent host: run
# PROOF_PARTS in two calls (e.g. "suite,b,det,e,ranks" then "c,act,d"); a subset gets the whole budget.
BUDGETS = {"suite": 25, "b": 140, "det": 85, "e": 100, "ranks": 20, "c": 90, "act": 150, "d": 70, "lora": 90,
           "moe": 90}
GRACE_S = 10  # a command past its time gets SIGTERM, then SIGKILL this much later
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from benchlib import (NOMINAL_TFLOPS, PartStop, capacity_bound, ensure_tokens,  # noqa: E402
                      largest_true, read_metrics)
from plan_rates import run_rates  # noqa: E402

LOG = []


def say(msg):
    print(msg, flush=True)
    LOG.append(msg)


class Proof:
    def __init__(self, args):
        self.args = args
        self.work = args.work
        self.result = {"dry_run": args.dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                       "parts": {}}
        self.deadline = None     # the current part's
        self.n = 0

    # ---- commands --------------------------------------------------------------------------------------
    def left(self):
        return self.deadline - time.monotonic()

    def run(self, cmd, tag, limit=None, env=None, capture=False, ok=(0,)):
        """Runs cmd with its output in work/tag.log; stops the part when it fails (an exit status not in ok)
        or outlives the part."""
        self.n += 1
        log = os.path.join(self.work, f"{self.n:02d}-{tag}.log")
        limit = min(limit or 1e9, self.left() - GRACE_S)
        if limit < 5:
            raise PartStop(f"no time left for {tag}")
        t0 = time.monotonic()
        self.last_start = time.time()  # wall clock, for the log lines' local times (startup())
        with open(log, "w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE if capture else f, stderr=f, text=True, env=env,
                                 cwd=self.work, start_new_session=True)
            try:
                out, _ = p.communicate(timeout=limit)
            except subprocess.TimeoutExpired:
                # SIGTERM first: strata stops after its step and removes its swap files, bench_deepspeed
                # reports what it has; then SIGKILL for the command and what it started.
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.communicate(timeout=GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.communicate()
                raise PartStop(f"{tag} ran past its {limit:.0f} s (log {os.path.basename(log)})")
        if p.returncode not in ok:
            with open(log, errors="replace") as f:
                tail = [l for l in f.read().splitlines() if l.strip()][-3:]
            raise PartStop(f"{tag} failed (rc {p.returncode}) after {time.monotonic() - t0:.0f} s: "
                           + " | ".join(t[:200] for t in tail))
        self.last_log, self.last_wall_s = log, time.monotonic() - t0
        return out if capture else None

    def strata(self, *a, **kw):
        return self.run([self.args.strata, *a], **kw)

    def plan(self, cfg, tag, *extra, bound=True):
        out = self.strata("plan", cfg, "--json", *(["--probe-seconds", str(self.args.probe_seconds), "--reprobe"] if bound
                                                    else ["--no-bound"]), *self.args.plan_flags, *extra,
                          tag=tag, capture=True, ok=(0, 2))  # 2: the plan does not fit
        return json.loads(out)

    def train(self, cfg, tag, steps, sets=(), trace=False):
        m = os.path.join(self.work, f"m-{tag}.jsonl")
        if os.path.exists(m):
            os.remove(m)
        extra = ["--trace", os.path.join(self.work, f"trace-{tag}.json")] if trace else []
        self.strata("train", cfg, "--steps", str(steps), "--set", "data.eval_interval=0", *sets, "--metrics", m,
                    *extra, tag=tag)
        lines = read_metrics(m)
        steps = [l for l in lines if "step_s" in l]
        self.startup(tag, steps)
        return steps

    def startup(self, tag, steps):
        """Where a training run's start went (round 2's budgets were spent there): the command's wall time
        less its steps', and the start's own lines (the initial weights, slow host allocations)."""
        with open(self.last_log, errors="replace") as f:
            text = f.read()
        su = {"wall_s": self.last_wall_s, "steps_s": sum(x.get("step_s", 0) or 0 for x in steps)}
        su["startup_s"] = su["wall_s"] - su["steps_s"]
        w = re.search(r"initial weights: (?:drawn|read) in ([0-9.]+) s.*written to their tiers in ([0-9.]+) s", text)
        if w:
            su["weights_drawn_s"], su["weights_written_s"] = float(w.group(1)), float(w.group(2))
        su["slow_allocations"] = re.findall(r"allocated ([0-9.]+ \w+) for ([^(\n]+) \(faulted in and zeroed in "
                                            r"([0-9.]+) s\)", text)
        # Seconds from the launch to the first log line (the probes and the plan come before it) and to
        # the model line (training starts after it); the log's times are local, to the millisecond.
        start = time.localtime(self.last_start)
        base = start.tm_hour * 3600 + start.tm_min * 60 + start.tm_sec + (self.last_start % 1)

        def since(line_re):
            m = re.search(r"^\[(\d\d):(\d\d):(\d\d\.\d+)\][^\n]*" + line_re, text, re.M)
            if not m:
                return None
            t = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
            return (t - base) % 86400
        su["to_first_log_line_s"], su["to_model_line_s"] = since(""), since("model: ")
        self.result.setdefault("startup", {})[tag] = su
        say(f"  {tag}: start-up {su['startup_s']:.1f} s of {su['wall_s']:.1f} s; first log line after "
            f"{su['to_first_log_line_s'] or 0:.1f} s, model line after {su['to_model_line_s'] or 0:.1f} s"
            + (f" (weights drawn {su['weights_drawn_s']:.1f} s, written {su['weights_written_s']:.1f} s)" if w else ""))

    def save(self):
        with open(os.path.join(self.args.out, "gpu-proof-2.json"), "w") as f:
            json.dump(self.result, f, indent=1)


# ---- figures ---------------------------------------------------------------------------------------------

def summary(steps, warmup):
    """Medians over the steps after the warm-up (all of them when there are no more)."""
    timed = steps[warmup:] or steps
    if not timed:
        raise PartStop("the run wrote no step to its metrics")
    med = lambda k: statistics.median(s.get(k, 0) or 0 for s in timed)
    return {"steps": len(steps), "timed_steps": len(timed), "tokens_per_s": med("tokens_per_s"),
            "step_s": med("step_s"), "bound_s": med("bound_s"), "optimizer_s": med("optimizer_s"),
            "optimizer_hidden_s": med("optimizer_hidden_s"), "optimizer_wait_s": med("optimizer_wait_s"),
            "mfu_nominal": med("flops_per_s") / (NOMINAL_TFLOPS * 1e12),
            "h2d_bytes": med("h2d_bytes"), "d2h_bytes": med("d2h_bytes"),
            "nvme_read_bytes": med("nvme_read_bytes"), "nvme_write_bytes": med("nvme_write_bytes"),
            "speculation": [s.get("speculation") for s in steps], "loss": [s.get("loss") for s in steps],
            "grad_norm": [s.get("grad_norm") for s in steps],
            "peak_nvme_bytes": max((s.get("peak_nvme_bytes") or 0 for s in steps), default=0)}


def gb(x):
    x = (x or 0) / 1e9
    return f"{x:.1f}" if abs(x) >= 0.1 else f"{x:.4f}"


def bits(x):
    return "null" if x is None else struct.pack("<d", x).hex()


# ---- configs ---------------------------------------------------------------------------------------------

def b_config(p):
    """(b)'s config; in a dry run a tiny CPU model with the optimizer half in RAM, half on NVMe."""
    if not p.args.dry_run:
        ensure_tokens(os.path.join(ROOT, "out/gpu-tokens.bin"))
        cfg = json.load(open(os.path.join(ROOT, "configs/gpu-b-llama8b.json")))
        cfg["data"]["path"] = os.path.join(ROOT, cfg["data"]["path"])
        cfg["placement"]["nvme_path"] = os.path.join(p.work, "swap")
        cfg["run"].pop("metrics", None)
    else:
        cfg = json.load(open(os.path.join(ROOT, "configs/tiny-cpu.json")))
        cfg.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
        cfg["model"]["n_layers"] = 2
        cfg["zero_optimization"] = {"stage": 3, "sub_group_size": 20000}
        cfg["placement"] = {"optimizer": {"host": 0.5, "nvme": 0.5}, "nvme_path": os.path.join(p.work, "swap")}
        cfg["run"] = {"seed": 1234, "device": "cpu", "threads": 1, "recompute": "always", "overlap_optimizer": True}
        cfg.pop("scheduler", None)
    return cfg


def write(p, name, cfg):
    path = os.path.join(p.work, name)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path


# ---- the parts -------------------------------------------------------------------------------------------

# (b)'s gradient norm is about 23 at its first steps: clipping at its config's 1.0 would clip every step, and
# every speculation would be redone. The unclipped runs clip at 1e4 (never, here); part b's "clipped" run
# clips every step on purpose (1e-4), for the cost of a redo.
OLD = ["run.schedule=micro_batch", "optimizer.speculate=off", "gradient_clipping=10000"]
NEW = ["run.schedule=layer", "optimizer.speculate=on", "gradient_clipping=10000"]

# The test cases that need a GPU and have not run on one since the code they test changed: every placement on
# the GPU against the CPU, and the optimizer behind the backward bit for bit against the inline optimizer.
SUITE = [("step_test", "*OnAGpu*"), ("kernels_test", "*")]


def part_suite(p, res):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    counts = {}
    for name, pattern in SUITE:
        binary = p.args.find(name)
        if binary is None and p.args.dry_run:
            # A build without the CUDA path has no kernels_test: a dry run says what it skips.
            counts[name] = {"ok": 0, "skipped": 0, "failed": 0, "failed_names": [], "missing": True}
            say(f"  {name} {pattern}: skipped, not in {p.args.bin} (a build without the CUDA path has none)")
            continue
        if binary is None:
            raise PartStop(f"no {name} in {p.args.bin} (tools/gpu_prepare.sh copies it)")
        out = p.run([binary, f"--gtest_filter={pattern}"], tag=f"suite-{name}", env=env, capture=True, ok=(0, 1))
        # One line per test as it ends: "[       OK ] Suite.Name (12 ms)" (the summary repeats names, no time).
        ended = re.findall(r"^\[ +(OK|SKIPPED|FAILED) +\] (\S+)(?:, where .*)? \(\d+ ms\)$", out, re.M)
        c = {k: sum(1 for v, _ in ended if v == k.upper()) for k in ("ok", "skipped", "failed")}
        c["failed_names"] = [n for v, n in ended if v == "FAILED"]
        counts[name] = c
        say(f"  {name} {pattern}: {c['ok']} passed, {c['failed']} failed, {c['skipped']} skipped "
            + (str(c["failed_names"]) if c["failed_names"] else ""))
    res["tests"] = counts
    ran = sum(c["ok"] + c["failed"] for c in counts.values())
    res["target_met"] = ran > 0 and all(c["failed"] == 0 and c["skipped"] == 0 for c in counts.values())
    return ("; ".join(f"{n}: not in this build" if c.get("missing") else
                      f"{n}: {c['ok']} passed, {c['failed']} failed, {c['skipped']} skipped" for n, c in counts.items())
            + f" (target: every GPU case passes, none skipped: {'met' if res['target_met'] else 'NOT MET'})")


def part_b(p, res):
    cfg = write(p, "b.json", b_config(p))
    ref = compute_only(p, cfg, "b-compute-only")
    res["compute_only"] = ref
    say(f"  compute-only reference: {ref['tokens_per_s']:.0f} tok/s, step {ref['step_s']:.2f} s")
    plan = p.plan(cfg, "b-plan")
    rates = run_rates(plan["bound"]["rates"])
    res["rates"] = rates
    rate_sets = [x for k, v in rates.items() for x in ("--set", f"run.rates.{k}={v:.6g}")]
    # The plan's prediction for the new schedule, a committed and a clipped step (the old one's: its bound_s).
    pl = p.plan(cfg, "b-plan-new", *[x for s in NEW for x in ("--set", s)], *rate_sets)["bound"]
    res["plan_bound_s"], res["plan_clipped_step_s"] = pl["seconds"], pl.get("clipped_step_seconds")
    # The most wanted first: what is cut by the part's budget is the last.
    runs = [("layer+speculate", NEW, True), ("micro_batch", OLD, False),
            ("clipped", NEW + ["gradient_clipping=0.0001"], False)]
    cut = train_runs(p, cfg, "b", runs, ref, rate_sets, res, lambda s: (
        f"{s['tokens_per_s']:.0f} tok/s = {s['ratio_to_compute_only']:.3f}x compute-only; step "
        f"{s['step_s']:.2f} s against bound_s {s['bound_s']:.2f}; optimizer {s['optimizer_s']:.2f} s, hidden "
        f"{s['optimizer_hidden_s']:.2f}, wait {s['optimizer_wait_s']:.2f}; {s['speculation']}"))
    r = res["runs"]
    if "layer+speculate" not in r:
        raise PartStop(cut or "no run")
    res["target_met"] = r["layer+speculate"]["ratio_to_compute_only"] >= 0.9
    line = (f"new schedule {r['layer+speculate']['ratio_to_compute_only']:.3f}x the compute-only step (target >= 0.9: "
            f"{'met' if res['target_met'] else 'NOT MET'}; plan {ref['step_s'] / res['plan_bound_s']:.3f}x)")
    if "micro_batch" in r:
        line += f", old schedule {r['micro_batch']['ratio_to_compute_only']:.3f}x"
    if "clipped" in r:
        line += (f", a clipped step {r['clipped']['step_s']:.2f} s against {r['layer+speculate']['step_s']:.2f} (plan "
                 f"{res['plan_clipped_step_s'] or 0:.2f} against {res['plan_bound_s']:.2f})")
    return line + (f"; {cut}" if cut else "")


def train_runs(p, cfg, tag, runs, ref, rate_sets, res, describe):
    """Trains each (name, --set strings, traced) of `runs` on cfg for --b-steps steps into res["runs"][name]
    (the medians after the first step, against the compute-only step `ref`), saving the report after each and
    printing describe(summary); a run the part's budget cuts ends the list (the runs before it stand).
    Returns what was cut, or None."""
    res["runs"] = {}
    for name, sets, trace in runs:
        flags = [x for s in sets for x in ("--set", s)] + rate_sets
        try:
            s = summary(p.train(cfg, f"{tag}-{name}", p.args.b_steps, flags, trace=trace), 1)
        except PartStop as e:
            say(f"  {name} cut: {e}")
            return f"{name} cut: {e}"
        s["ratio_to_compute_only"] = s["tokens_per_s"] / ref["tokens_per_s"]
        res["runs"][name] = s
        p.save()
        say(f"  {name}: " + describe(s))
    return None


def compute_only(p, cfg, tag):
    """bench_train_torch --compute-only on cfg: the step's compute alone (no offload), its last JSON line."""
    dev = "cpu" if p.args.dry_run else "cuda"
    return json.loads(p.run([p.args.torch_ref, "--config", cfg, "--compute-only", "--steps", "2", "--warmup", "1",
                             "--device", dev] + (["--gemm-n", "256"] if p.args.dry_run else []),
                            tag=tag, capture=True).strip().splitlines()[-1])


def part_act(p, res):
    cfg = write(p, "act.json", b_config(p))
    b = p.result["parts"].get("b", {})
    ref = b.get("compute_only") or compute_only(p, cfg, "act-compute-only")
    res["compute_only"] = ref
    rates = b.get("rates") or run_rates(p.plan(cfg, "act-plan")["bound"]["rates"])
    res["rates"] = rates
    rate_sets = [x for k, v in rates.items() for x in ("--set", f"run.rates.{k}={v:.6g}")]
    # What the plan chooses under auto with these rates: its activation placement and bound.
    pl = p.plan(cfg, "act-plan-auto", *[x for s in NEW + ["run.recompute=auto"] for x in ("--set", s)], *rate_sets)
    res["plan_activations"], res["plan_bound_s"] = pl["activations"], pl["bound"]["seconds"]
    a = pl["activations"]
    say(f"  plan under auto: {a['choice']}; bound {res['plan_bound_s']:.2f} s; recomputed "
        f"{a['recomputed_flops_per_step'] / 1e12:.1f} TFLOP a step; {gb(a['d2h_bytes_per_step'])} GB down and up")
    # The one the target is about first.
    runs = [(name, NEW + [f"run.recompute={name}"], False) for name in ("auto", "always")]
    cut = train_runs(p, cfg, "act", runs, ref, rate_sets, res, lambda s: (
        f"{s['tokens_per_s']:.0f} tok/s = {s['ratio_to_compute_only']:.3f}x compute-only, MFU "
        f"{s['mfu_nominal'] * 100:.1f}% of {NOMINAL_TFLOPS:.0f} TFLOP/s; step {s['step_s']:.2f} s against bound_s "
        f"{s['bound_s']:.2f}; PCIe {gb(s['h2d_bytes'])} GB up, {gb(s['d2h_bytes'])} GB down"))
    r = res["runs"]
    if "auto" not in r:
        raise PartStop(cut or "no run")
    au = r["auto"]
    res["target_met"] = au["mfu_nominal"] >= 0.5 and au["ratio_to_compute_only"] >= 0.95
    line = (f"auto {au['mfu_nominal'] * 100:.1f}% MFU at {au['ratio_to_compute_only']:.3f}x the compute-only step "
            f"(target >= 50% at >= 0.95x: {'met' if res['target_met'] else 'NOT MET'}; plan {a['choice']})")
    if "always" in r:
        # Every placement runs the same ops on the same values (docs/design.md, "Activation placement").
        res["same_losses"] = au["loss"] == r["always"]["loss"] and au["grad_norm"] == r["always"]["grad_norm"]
        line += (f", always {r['always']['mfu_nominal'] * 100:.1f}% at {r['always']['ratio_to_compute_only']:.3f}x; "
                 f"auto / always step {au['step_s'] / r['always']['step_s']:.3f}; losses and norms "
                 f"{'bit for bit the same' if res['same_losses'] else 'DIFFER'}")
    return line + (f"; {cut}" if cut else "")


def part_det(p, res):
    cfg = os.path.join(p.work, "b.json")
    if not os.path.exists(cfg):
        cfg = write(p, "b.json", b_config(p))
    # Part b's probed rates, when it ran: the same placement as its run with determinism off (the cost's
    # reference), and no probes at each start.
    rates = p.result["parts"].get("b", {}).get("rates") or {}
    flags = [x for s in NEW for x in ("--set", s)] + [x for k, v in rates.items()
                                                      for x in ("--set", f"run.rates.{k}={v:.6g}")]
    runs = {}
    for v in ("on-1", "on-2"):
        runs[v] = p.train(cfg, f"det-{v}", 2, flags + ["--set", "run.deterministic=true"])
    off = p.result["parts"].get("b", {}).get("runs", {}).get("layer+speculate")
    if off and off.get("tokens_per_s"):
        off_tps, off_src = off["tokens_per_s"], "part b's layer+speculate run, median after its warm-up"
    else:
        off_tps, off_src = p.train(cfg, "det-off", 2, flags)[-1]["tokens_per_s"], "a run with it off, step 2"
    a, b = runs["on-1"], runs["on-2"]
    same = len(a) == len(b) == 2 and all(x["loss"] == y["loss"] and bits(x.get("grad_norm")) == bits(y.get("grad_norm"))
                                         for x, y in zip(a, b))
    res.update({"bit_for_bit": same, "on_1": [(x["loss"], bits(x.get("grad_norm"))) for x in a],
                "on_2": [(x["loss"], bits(x.get("grad_norm"))) for x in b],
                "on_tokens_per_s": b[-1]["tokens_per_s"], "off_tokens_per_s": off_tps, "off_from": off_src,
                "cost": b[-1]["tokens_per_s"] / off_tps if off_tps else None})
    for v, st in runs.items():
        for x in st:
            say(f"  {v} step {x['step']}: loss {x['loss']!r} norm {x.get('grad_norm')!r} ({bits(x.get('grad_norm'))})")
    res["target_met"] = same
    return (f"two runs with run.deterministic {'AGREE' if same else 'DIFFER'} bit for bit (target: agree); "
            f"tokens/s on / off = {res['cost'] or float('nan'):.3f} (off: {off_src})")


def clear_leftovers(p):
    """Swap files of a run killed past its budget (strata removes its own only when it exits) and part e's
    checkpoints: disk the next parts measure as free."""
    for d in ("swap", "ckpt"):
        shutil.rmtree(os.path.join(p.work, d), ignore_errors=True)
    os.makedirs(os.path.join(p.work, "swap"), exist_ok=True)


def part_c(p, res):
    clear_leftovers(p)
    base = b_config(p)
    if p.args.dry_run:
        base["model"].update(dim=128, n_heads=4, n_kv_heads=2)
        base["placement"] = {"auto": True, "nvme_path": os.path.join(p.work, "swap")}
    path = os.path.join(p.work, "c.json")
    want = p.args.c_nvme_gb * 1e9

    def plan_for(layers, bound=False):
        cfg = copy.deepcopy(base)
        cfg["model"]["n_layers"] = layers
        write(p, "c.json", cfg)
        return p.plan(path, f"c-plan-L{layers}", bound=bound)

    # Plans without the bound (no probes; still a few seconds each on a GPU host: LibTorch's and CUDA's
    # start), so as few as can be: the state's bytes are linear in the layer count, so two plans give a
    # guess of each boundary, then a search outward from the guess and a bisection confirm it exactly.
    tried = {}

    def plan_of(n):
        if n not in tried:
            tried[n] = plan_for(n)
        return tried[n]

    fits = lambda n: plan_of(n)["fits"]
    n0 = base["model"]["n_layers"]
    n1 = max(1, n0 // 2)
    if n1 == n0:
        n0 = n1 + 1
    s0, s1 = (sum(plan_of(n)["state_total_bytes"].values()) for n in (n0, n1))
    all0 = sum(plan_of(n0)["total_bytes"].values())
    per_layer = max(1.0, (s0 - s1) / (n0 - n1))  # state bytes a layer adds
    cap = plan_of(n0)["capacity_bytes"]
    room = max(cap["device"], 0) + cap["host"] + cap["nvme"]
    guess_fit = n0 + int((room - all0) // per_layer)
    largest = largest_true(fits, guess_fit)
    if largest == 0:
        raise PartStop("not even one layer fits: " + "; ".join(plan_of(1).get("shortfalls", [])))
    # The fewest layers whose plan puts `want` bytes of state on NVMe (the state past HBM + RAM): one past
    # the most whose NVMe share is below it.
    nvme = lambda n: plan_of(n)["state_total_bytes"]["nvme"]
    spill = nvme(largest)
    guess_pick = largest - int((spill - want) // per_layer) if spill >= want else largest
    pick = min(largest, largest_true(lambda n: n <= largest and nvme(n) < want, guess_pick - 1) + 1)
    res["plans"] = len(tried)
    top = tried[largest]
    bound_params = capacity_bound(top)[0]
    plan_for(pick)  # c.json: the picked model
    plan = tried[pick]
    cfg = json.load(open(path))
    if p.args.dry_run:  # train has no capacity flags: the plan's split, as fixed shares
        sb = plan["state_bytes"]
        share = lambda c: {t: sb[c][t] / max(1, sum(sb[c].values())) for t in ("device", "host", "nvme")}
        cfg["placement"] = dict({c: share(c) for c in sb}, nvme_path=os.path.join(p.work, "swap"))
        write(p, "c.json", cfg)
    st = plan["state_total_bytes"]
    res.update({"layers": pick, "parameters": plan["parameters"], "state_bytes": st,
                "capacity_bytes": plan["capacity_bytes"], "largest_trainable_layers": largest,
                "largest_trainable_parameters": top["parameters"], "capacity_bound_parameters": bound_params,
                "speculate": plan.get("speculate"),
                "schedule": plan.get("schedule")})
    p.save()
    say(f"  {pick} layers, {plan['parameters'] / 1e9:.2f}B parameters: state HBM {gb(st['device'])} + RAM "
        f"{gb(st['host'])} + NVMe {gb(st['nvme'])} GB; capacity {gb(plan['capacity_bytes']['device'])} / "
        f"{gb(plan['capacity_bytes']['host'])} / {gb(plan['capacity_bytes']['nvme'])} GB; largest trainable "
        f"{largest} layers ({top['parameters'] / 1e9:.2f}B; capacity bound {bound_params / 1e9:.2f}B)")
    s = summary(p.train(path, "c", p.args.c_steps), 1)
    res["run"] = s
    return (f"{pick} layers ({plan['parameters'] / 1e9:.2f}B, {gb(st['nvme'])} GB of state on NVMe): "
            f"{s['tokens_per_s']:.0f} tok/s, MFU {100 * s['mfu_nominal']:.1f}% of {NOMINAL_TFLOPS:.0f}, step "
            f"{s['step_s']:.2f} s against bound_s {s['bound_s']:.2f} ({s['step_s'] / max(s['bound_s'], 1e-9):.2f}x); "
            f"per step H2D {gb(s['h2d_bytes'])} D2H {gb(s['d2h_bytes'])} NVMe read {gb(s['nvme_read_bytes'])} "
            f"write {gb(s['nvme_write_bytes'])} GB; the plan's largest: {largest} layers, "
            f"{top['parameters'] / 1e9:.2f}B (capacity bound {bound_params / 1e9:.2f}B)")


def part_d(p, res):
    clear_leftovers(p)
    base = b_config(p)
    cfg_path = write(p, "d.json", base)
    m = base["model"]
    dim, ffn = m["dim"], m.get("ffn_hidden") or 4 * m["dim"]
    kv = m["dim"] // m["n_heads"] * m.get("n_kv_heads", m["n_heads"])
    per_layer = 2 * dim * dim + 2 * dim * kv + 3 * dim * ffn
    fixed = m["vocab_size"] * dim * (1 if m.get("tie_embeddings", True) else 2)
    swap = os.path.join(p.work, "ds-swap")
    os.makedirs(swap, exist_ok=True)
    free = shutil.disk_usage(swap).free
    # DeepSpeed's ZeRO-Infinity keeps about 18 bytes per parameter on NVMe: bf16 weights, fp32 master and
    # moments, and the fp32 gradients its optimizer swapper writes out too.
    fit = max(1, int((0.8 * free / 18 - fixed) // per_layer))
    top = min(fit, m["n_layers"]) if not p.args.dry_run else 2
    counts = sorted({top, max(1, top // 2), max(1, top // 4)}, reverse=True)
    ds_json = os.path.join(p.work, "ds-d.json")
    ds_cmd = [p.args.ds_python, os.path.join(ROOT, "tools/bench_deepspeed.py"), "--install", "--strata-config", cfg_path,
              "--offload", "nvme", "--nvme-path", swap, "--steps", str(p.args.d_steps), "--warmup", "1",
              "--out-dir", os.path.join(p.work, "ds"), "--json", ds_json]
    say(f"  disk free {free / 1e9:.0f} GB: DeepSpeed tries {counts} layers (18 B/parameter on NVMe)")
    ds = None
    try:
        p.run(ds_cmd + ["--search-layers", ",".join(map(str, counts)), "--timeout", str(p.args.d_attempt_s),
                        "--budget", str(max(30, p.left() - p.args.d_strata_s))], tag="d-deepspeed")
    except PartStop as e:
        say(f"  DeepSpeed: {e}")
    if os.path.exists(ds_json):
        ds = json.load(open(ds_json))
    res["deepspeed"] = ds
    p.save()
    started = ds and ds.get("ok")
    tried = [a["layers"] for a in (ds or {}).get("attempts", []) if a.get("layers")] or \
        ([ds["layers"]] if ds and ds.get("layers") else [counts[0]])
    layers = ds["layers"] if started else min(tried)
    why = "" if started else (f" (DeepSpeed failed at {ds.get('failed_at')}: {(ds.get('error') or '').splitlines()[:1]})"
                              if ds else " (DeepSpeed reported nothing)")
    say(f"  DeepSpeed: " + (f"{layers} layers, {ds['tokens_per_s']:.0f} tok/s, steps {ds['step_s']}" if started
                             else "did not train" + why))
    cfg = copy.deepcopy(base)
    cfg["model"]["n_layers"] = layers
    path = write(p, "d-strata.json", cfg)
    s = summary(p.train(path, f"d-strata-L{layers}", p.args.d_steps), 1)
    res["strata"] = dict(s, layers=layers)
    p.save()
    line = (f"{layers} layers, global batch {base['train_micro_batch_size_per_gpu'] * base['gradient_accumulation_steps']}"
            f" x {m['seq_len']} tokens: Strata {s['tokens_per_s']:.0f} tok/s (bound {s['bound_s']:.2f} s, step "
            f"{s['step_s']:.2f}), DeepSpeed " + (f"{ds['tokens_per_s']:.0f} tok/s: Strata "
                                                   f"{s['tokens_per_s'] / ds['tokens_per_s']:.2f}x" if started else
                                                   "did not train" + why))
    c = p.result["parts"].get("c", {}).get("layers")
    if c and not p.args.dry_run and p.left() > 60:
        # Installed by the first call; its attempt ends 30 s before the part does, so it reports.
        again = [x for x in ds_cmd[:-1] if x != "--install"]
        try:
            p.run(again + [os.path.join(p.work, "ds-c.json"), "--layers", str(c), "--timeout",
                           str(max(10, p.left() - 30)), "--budget", str(max(10, p.left() - 30))],
                  tag="d-deepspeed-on-c")
        except PartStop as e:
            say(f"  DeepSpeed on part c's model: {e}")
        if os.path.exists(os.path.join(p.work, "ds-c.json")):
            dc = json.load(open(os.path.join(p.work, "ds-c.json")))
            res["deepspeed_on_c"] = dc
            line += (f"; on part c's {c} layers DeepSpeed " + (f"trained {dc['tokens_per_s']:.0f} tok/s" if dc.get("ok")
                     else f"failed at {dc.get('failed_at')}: {(dc.get('error') or '').splitlines()[:1]}"))
    return line


def part_e(p, res):
    j = os.path.join(p.work, "ckpt.json")
    cmd = [sys.executable, os.path.join(ROOT, "tools/bench_checkpoint.py"), "--strata", p.args.strata,
           "--dir", os.path.join(p.work, "ckpt"), "--rounds", "1", "--json", j,
           "--device", "cpu" if p.args.dry_run else "cuda"]
    if p.args.dry_run:
        cmd += ["--dim", "128", "--layers", "2", "--threads", "1", "--steps", "9", "--every", "3"]
    else:
        # On a GPU the tool's default model (0.1 B, 32-token sequences) steps in 25 ms, so the next step's
        # optimizer waits for most of a 0.55 s save (round 2: 96%): an update waits until the save has
        # written what it overwrites (Note [Saving while training]), so what a save can hide is one step's
        # forward and backward. A run's shape instead: 0.5 M tokens a step (16 x 4096 x 8 micro-batches,
        # about 2.5 s on an H200) against a save of 0.4 B parameters' state (about 5 GB: 2-3 s here).
        cmd += ["--dim", "2048", "--layers", "8", "--seq-len", "4096", "--micro-batch", "16", "--accumulation",
                "8", "--steps", "12", "--every", "4"]
    # A snapshot pool as large as the save (the plan caps it there; Note [Save snapshots]): an optimizer pass
    # that overtakes the save copies what it overwrites instead of waiting for the disk.
    cmd += ["--set", "run.checkpoint.snapshot_gb=16"]
    p.run(cmd, tag="e-checkpoint")
    med = json.load(open(j))["median"]
    res.update(med)
    res["target_met"] = med["added_over_save"] < 0.10
    return (f"a save while training adds {med['added_s']:.2f} s = {100 * med['added_over_save']:.1f}% of its write "
            f"time {med['save_while_training_s']:.2f} s (target < 10%: {'met' if res['target_met'] else 'NOT MET'}); checkpoint {gb(med['checkpoint_bytes'])} GB, "
            f"written {med['write_gbps']:.2f} GB/s against bench-io --fsync {med['bench_io_write_fsync_gbps']:.2f}; "
            f"the optimizer waited {med['optimizer_waited_s']:.2f} s a save, {gb(med['snapshot_bytes'])} GB through "
            f"the snapshot pool")


def part_ranks(p, res):
    dev = "cpu" if p.args.dry_run else "cuda"
    # The same global batch at both world sizes: 16 sequences = 8 x 2 accumulation x 1 rank = 8 x 1 x 2 ranks.
    tiny = json.load(open(os.path.join(ROOT, "configs/tiny-cpu.json")))
    tiny.pop("gradient_accumulation_steps", None)
    tiny.update(train_batch_size=16, train_micro_batch_size_per_gpu=8)
    # Token ids drawn once (the host may lack the config's text files).
    import array
    import random
    rng = random.Random(0)
    tok = os.path.join(p.work, "ranks-tokens.bin")
    with open(tok, "wb") as f:
        array.array("H", (rng.randrange(tiny["model"]["vocab_size"]) for _ in range(200_000))).tofile(f)
    tiny["data"] = {"path": tok, "format": "uint16", "val_fraction": 0.0}
    cfg = write(p, "ranks.json", tiny)
    sets = ["run.device=" + dev, "zero_optimization.stage=3", "run.steps=" + str(p.args.ranks_steps),
            "data.eval_interval=0", "comm.timeout_s=120", "comm.backend=gloo", "run.threads=1"]
    flags = [x for s in sets for x in ("--set", s)]
    runs = {}
    for n in (1, 2):
        pat = os.path.join(p.work, f"ranks{n}.m{{rank}}.jsonl")
        p.strata("launch", "--nproc", str(n), "--", p.args.strata, "train", cfg, *flags, "--metrics", pat,
                 tag=f"ranks-{n}", limit=90)
        runs[n] = [read_metrics(pat.replace("{rank}", str(r))) for r in range(n)]
    one, two = runs[1][0], runs[2]
    diffs = [abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(one, two[0])]
    per_rank = lambda st, k: statistics.median(x[k] for x in st)
    res.update({"steps": len(one), "max_rel_loss_diff": max(diffs), "losses_one": [x["loss"] for x in one],
                "losses_two": [x["loss"] for x in two[0]],
                "bytes": {f"{n} rank(s), rank {r}": {k: per_rank(runs[n][r], k) for k in ("h2d_bytes", "d2h_bytes", "net_bytes")}
                          for n in (1, 2) for r in range(n)}})
    ok = len(one) == len(two[0]) == p.args.ranks_steps and max(diffs) < 1e-4
    res["target_met"] = ok
    b2 = res["bytes"]["2 rank(s), rank 0"]
    plan = p.strata("plan", cfg, "--world-size", "2", "--no-bound", "--json", *flags, tag="ranks-plan", capture=True,
                    ok=(0, 2))
    res["plan_net_bytes_per_rank"] = json.loads(plan)["network"]["bytes_per_step_per_rank"]
    return (f"{len(one)} steps, losses of 2 ranks against 1 {'agree' if ok else 'DIFFER'}: largest relative difference "
            f"{max(diffs):.2e} (target < 1e-4); per rank with 2: H2D {b2['h2d_bytes']:.0f} D2H {b2['d2h_bytes']:.0f} "
            f"network {b2['net_bytes']:.0f} bytes a step (plan: {res['plan_net_bytes_per_rank']})")


def part_lora(p, res):
    """LoRA over a frozen base (docs/design.md, "State kinds"): (b)'s shape with r 16 adapters on all seven
    linears, the base in HBM (the reference: no base traffic) against the base half in host RAM (read twice a
    step under the layer schedule), the rates probed once and given to both: tokens/s, MFU, PCIe bytes, the
    plan's bound; losses and norms bit for bit the same (placement moves bytes, not arithmetic)."""
    base = b_config(p)
    base["lora"] = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
    swap = os.path.join(p.work, "swap")
    # The frozen base follows placement.param16 (the adapters' working copy with it).
    placements = {"base-in-hbm": {"param16": {"device": 1.0, "host": 0.0, "nvme": 0.0}, "nvme_path": swap},
                  "base-half-in-host": {"param16": {"device": 0.5, "host": 0.5, "nvme": 0.0}, "nvme_path": swap}}
    paths = {}
    for name, pl in placements.items():
        cfg = copy.deepcopy(base)
        cfg["placement"] = pl
        paths[name] = write(p, f"lora-{name}.json", cfg)
    plan = p.plan(paths["base-half-in-host"], "lora-plan", "--set", "run.schedule=layer")
    rates = run_rates(plan["bound"]["rates"])
    res["rates"] = rates
    res["plan_bound_s"] = plan["bound"]["seconds"]
    res["plan_frozen_bytes"] = plan["state_bytes"].get("frozen")
    rate_sets = [x for k, v in rates.items() for x in ("--set", f"run.rates.{k}={v:.6g}")] + ["--set", "run.schedule=layer"]
    res["runs"] = {}
    for name in ("base-in-hbm", "base-half-in-host"):
        s = summary(p.train(paths[name], f"lora-{name}", p.args.b_steps, rate_sets), 1)
        res["runs"][name] = s
        p.save()
        say(f"  {name}: {s['tokens_per_s']:.0f} tok/s, MFU {s['mfu_nominal'] * 100:.1f}% of {NOMINAL_TFLOPS:.0f} "
            f"TFLOP/s; step {s['step_s']:.2f} s against bound_s {s['bound_s']:.2f}; PCIe {gb(s['h2d_bytes'])} GB up")
    ref, half = res["runs"]["base-in-hbm"], res["runs"]["base-half-in-host"]
    res["ratio"] = half["tokens_per_s"] / ref["tokens_per_s"]
    res["same_losses"] = half["loss"] == ref["loss"] and half["grad_norm"] == ref["grad_norm"]
    return (f"base half in host RAM at {res['ratio']:.3f}x the base in HBM ({half['tokens_per_s']:.0f} against "
            f"{ref['tokens_per_s']:.0f} tok/s, MFU {half['mfu_nominal'] * 100:.1f}%); losses and norms "
            f"{'bit for bit the same' if res['same_losses'] else 'DIFFER'}; plan bound {res['plan_bound_s']:.2f} s")


def moe_config(p):
    """Qwen3-30B-A3B's layer shape (dim 2048, 32 heads of 128, 4 k/v heads, 128 experts of 768, top 8,
    renormalised) over 6 layers, bf16, seq 4096, micro-batch 1 x 4 accumulation, the optimizer state in host
    RAM; in a dry run a tiny CPU model of the same kind (16 experts of 64, top 4)."""
    cfg = b_config(p)
    if not p.args.dry_run:
        cfg["model"] = {"family": "qwen3_moe", "vocab_size": 151936, "dim": 2048, "n_layers": 6, "n_heads": 32,
                        "n_kv_heads": 4, "head_dim": 128, "seq_len": 4096, "tie_embeddings": False,
                        "rope_theta": 1000000.0, "norm_eps": 1e-6, "num_experts": 128, "num_experts_per_tok": 8,
                        "moe_intermediate_size": 768, "norm_topk_prob": True, "output_router_logits": True}
        cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=4)
        cfg["placement"] = {"optimizer": {"host": 1.0}, "nvme_path": os.path.join(p.work, "swap")}
    else:
        cfg["model"] = {"family": "qwen3_moe", "vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4,
                        "n_kv_heads": 2, "head_dim": 16, "seq_len": 64, "num_experts": 16, "num_experts_per_tok": 4,
                        "moe_intermediate_size": 64, "norm_topk_prob": True, "output_router_logits": True}
    return cfg


def part_moe(p, res):
    """Mixture of experts (docs/design.md, "Experts"): Qwen3-30B-A3B's layers with the experts' products as a
    loop of GEMMs against LibTorch's grouped GEMM (run.expert_gemm), the rates probed once and given to both:
    tokens/s, MFU over the active FLOPs (flops_per_s counts a token's 8 experts), the step against the bound,
    aux_loss and expert_load; the losses of the two agree to bf16 rounding (the products' sums differ)."""
    cfg = moe_config(p)
    path = write(p, "moe.json", cfg)
    plan = p.plan(path, "moe-plan")
    res["plan_experts"] = plan.get("experts")
    res["plan_bound_s"] = plan["bound"]["seconds"]
    rates = run_rates(plan["bound"]["rates"])
    rate_sets = [x for k, v in rates.items() for x in ("--set", f"run.rates.{k}={v:.6g}")]
    res["runs"] = {}
    for name in ("loop", "grouped"):
        steps = p.train(path, f"moe-{name}", p.args.b_steps, rate_sets + ["--set", f"run.expert_gemm={name}"])
        s = summary(steps, 1)
        s["aux_loss"] = [x.get("aux_loss") for x in steps]
        s["expert_load"] = steps[-1].get("expert_load")
        res["runs"][name] = s
        p.save()
        say(f"  {name}: {s['tokens_per_s']:.0f} tok/s, MFU {s['mfu_nominal'] * 100:.1f}% of {NOMINAL_TFLOPS:.0f} "
            f"TFLOP/s (active FLOPs); step {s['step_s']:.2f} s against bound_s {s['bound_s']:.2f}; aux "
            f"{s['aux_loss'][-1]:.3f}")
    loop, grouped = res["runs"]["loop"], res["runs"]["grouped"]
    res["ratio"] = grouped["tokens_per_s"] / loop["tokens_per_s"]
    res["loss_rel_diff"] = max(abs(a - b) / abs(a) for a, b in zip(loop["loss"], grouped["loss"]))
    res["losses_agree"] = res["loss_rel_diff"] < 2e-2
    return (f"grouped GEMM at {res['ratio']:.3f}x the loop ({grouped['tokens_per_s']:.0f} against "
            f"{loop['tokens_per_s']:.0f} tok/s, MFU {grouped['mfu_nominal'] * 100:.1f}% over active FLOPs); losses "
            f"{'agree' if res['losses_agree'] else 'DIFFER'} (largest relative difference {res['loss_rel_diff']:.1e}); "
            f"plan bound {res['plan_bound_s']:.2f} s")


PARTS = {"suite": part_suite, "b": part_b, "det": part_det, "e": part_e, "ranks": part_ranks, "c": part_c,
         "act": part_act, "d": part_d, "lora": part_lora, "moe": part_moe}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, ".dev/bin"), help="strata and bench_train_torch (or tests/)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "out/gpu-host"))
    ap.add_argument("--work", help="scratch: swap files, logs (default: out/gpu-proof-2 in the repository, on its "
                    "disk; a dry run: $TMPDIR/gpu-proof-2)")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--budget", type=float, default=float(os.environ.get("PROOF_BUDGET", sum(BUDGETS.values()))),
                    help="seconds for every part together (the parts' budgets are scaled to it)")
    ap.add_argument("--dry-run", action="store_true", help="tiny configs on the CPU device")
    ap.add_argument("--b-steps", type=int, default=3)
    ap.add_argument("--c-steps", type=int, default=3)
    ap.add_argument("--c-nvme-gb", type=float, default=12.0, help="(c): at least this much state on NVMe")
    ap.add_argument("--d-steps", type=int, default=2)
    ap.add_argument("--d-attempt-s", type=int, default=120, help="(d): seconds per DeepSpeed attempt at most")
    ap.add_argument("--d-strata-s", type=int, default=40, help="(d): seconds kept for Strata's run")
    ap.add_argument("--ds-python", default=sys.executable,
                    help="(d): the Python that runs DeepSpeed (the host's: the one with torch; the carried set is "
                         "built for Python 3.12)")
    ap.add_argument("--ranks-steps", type=int, default=20)
    ap.add_argument("--probe-seconds", type=float, default=1.0)
    args = ap.parse_args()
    args.plan_flags = []
    args.work = os.path.abspath(args.work or (os.path.join(os.environ.get("TMPDIR", "/tmp"), "gpu-proof-2")
                                              if args.dry_run else os.path.join(ROOT, "out", "gpu-proof-2")))
    if args.dry_run:
        args.probe_seconds = 0.1
        args.c_nvme_gb = 0.002
        args.ranks_steps = 4
        args.d_attempt_s, args.d_strata_s = 30, 15
        # The CPU device's memory is the host's: a small node, so that part c's state spills to NVMe.
        args.plan_flags = ["--host-memory-gb", "0.05", "--nvme-gb", "0.2"]
        args.c_steps = 2
    def find(name):
        c = next((c for c in (os.path.join(args.bin, name), os.path.join(args.bin, "tests", name))
                  if os.access(c, os.X_OK)), None)
        return os.path.abspath(c) if c else None
    args.find = find
    args.strata, args.torch_ref = find("strata"), find("bench_train_torch")
    if not args.strata or not args.torch_ref:
        sys.exit(f"gpu_proof.py: {args.bin} has no strata or bench_train_torch (nor under tests/)")
    args.strata, args.torch_ref = os.path.abspath(args.strata), os.path.abspath(args.torch_ref)
    os.makedirs(args.out, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(os.path.join(args.work, "swap"))
    parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        sys.exit(f"gpu_proof.py: --parts: unknown part(s) {bad}; the parts: {','.join(PARTS)}")
    scale = args.budget / sum(BUDGETS[x] for x in parts)
    budget = {x: float(os.environ.get(f"PROOF_BUDGET_{x.upper()}", BUDGETS[x] * scale)) for x in parts}
    p = Proof(args)
    t_start, spare = time.monotonic(), 0.0
    say(f"gpu-proof-2{' (dry run: CPU device, tiny configs)' if args.dry_run else ''}: parts {parts}, budgets "
        + ", ".join(f"{x} {budget[x]:.0f} s" for x in parts))
    for name in parts:
        t0 = time.monotonic()
        p.deadline = t0 + budget[name] + spare
        res = p.result["parts"].setdefault(name, {})
        say(f"== part {name} ({budget[name] + spare:.0f} s)")
        try:
            line = PARTS[name](p, res)
            res["status"] = "ok"
        except PartStop as e:
            res["status"], line = "stopped", f"STOPPED: {e}"
        except Exception as e:  # a bug in this script: the other parts still run
            res["status"], line = "error", f"ERROR in the script: {type(e).__name__}: {e}"
        res["seconds"] = time.monotonic() - t0
        res["line"] = line
        spare = max(0.0, p.deadline - time.monotonic())
        say(f"part {name}: {line} [{res['seconds']:.0f} s]")
        p.save()
    # The device tool's reply carries the end of the output: every part's line again, last.
    say("== summary")
    for x in parts:
        say(f"part {x}: {p.result['parts'][x]['line']}")
    target = lambda r: "" if "target_met" not in r else (", target met" if r["target_met"] else ", TARGET NOT MET")
    say(f"gpu-proof-2 done in {time.monotonic() - t_start:.0f} s: " +
        "; ".join(f"{x} {p.result['parts'][x]['status']}{target(p.result['parts'][x])}" for x in parts))
    p.result["log"] = LOG
    p.save()
    with open(os.path.join(args.out, "gpu-proof-2.txt"), "w") as f:
        f.write("\n".join(LOG) + "\n")
    # One archive of the logs, metrics and traces (a trace over 64 MiB stays on the host: the call brings back
    # files of limited size).
    small = lambda ti: ti if ti.isdir() or (re.search(r"\.(log|json|jsonl|txt)$", ti.name) and ti.size < 64 << 20) else None
    try:
        with tarfile.open(os.path.join(args.out, "gpu-proof-2-logs.tgz"), "w:gz") as t:
            for name in sorted(os.listdir(args.work)):
                full = os.path.join(args.work, name)
                if os.path.isfile(full):
                    t.add(full, arcname=name, filter=small)
            for sub in ("ds", "ckpt"):
                d = os.path.join(args.work, sub)
                if os.path.isdir(d):
                    t.add(d, arcname=sub, filter=small)
    except OSError as e:
        say(f"gpu-proof-2: the logs' archive failed: {e}")
    sys.exit(0 if all(p.result["parts"][x]["status"] == "ok" for x in parts) else 1)


if __name__ == "__main__":
    main()
