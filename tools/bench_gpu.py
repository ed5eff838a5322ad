#!/usr/bin/env python3
"""GPU benchmarks of BENCHMARKS.md ("GPU"), run on a GPU host in one call each.

  a   A model that fits in HBM, no offload (configs/gpu-a-fits-hbm.json):
      `strata train` against a plain LibTorch training loop of the same model,
      dtype and recompute policy with LibTorch's fused AdamW
      (tools/bench_train_torch.cc), interleaved over rounds; tokens/s medians,
      the same-run ratio, and MFU = model FLOPs per token x tokens/s against
      the H100's nominal 989 TFLOP/s (bf16 dense) and against a large bf16 GEMM
      measured in the same run.

  b   A LLaMA-style model whose training state is at least 1.5x HBM
      (configs/gpu-b-llama8b.json: Llama-3-8B's shape, 8.03B parameters,
      placement auto, recompute always): `strata train` against the same
      model's compute-only step (bench_train_torch --compute-only: the 16-bit
      weights in HBM, no master weights, no optimizer) in the same run; MFU as
      in (a); the NVMe bytes a step moves against what `strata bench-io`
      measures on the swap directory times the compute-only step time (the
      time there is to hide them).
  c   The largest model the host can train: the (b) shape with as many layers
      as `strata plan` (placement auto) says fit, found by bisection; that
      model trains --steps steps; its parameters against (HBM + RAM + free
      disk - the plan's non-state bytes) / bytes per parameter.

Each run trains --steps steps and takes the median of the steps after the
first --warmup. The token file the configs read (out/gpu-tokens.bin: uint16
tokens drawn at random; the data do not change the speed) is written first if
missing.

Usage (on the GPU host, from the repository root):
  python3 tools/bench_gpu.py a|b|c --strata .dev/bin/strata --torch-ref .dev/bin/bench_train_torch \\
      [--config CONFIG] [--rounds 2] [--steps N] [--warmup W] [--json OUT]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchlib import NOMINAL_TFLOPS, PartStop, capacity_bound, ensure_tokens, largest_true, read_metrics

DEADLINE = None          # time.time() by which everything must have ended (--deadline)
RESULT = {}              # what is known so far: written to --json even when a step fails or times out


class Stop(Exception):
    """A step failed or ran out of time: report what is known and stop."""


def run(cmd, log, timeout):
    t0 = time.time()
    limit = min(timeout, DEADLINE - t0)
    if limit < 10:
        raise Stop(f"no time left for {' '.join(cmd[:2])} (--deadline)")
    try:
        with open(log, "w") as f:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        raise Stop(f"{' '.join(cmd)} ran past {limit:.0f} s (log: {log})")
    if p.returncode != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        raise Stop(f"{' '.join(cmd)} failed (rc {p.returncode}) after {time.time() - t0:.0f} s:\n{tail}")
    return p.stdout


def strata_tokens_per_s(args, config, tag):
    metrics = os.path.join(args.dir, f"{tag}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    run([args.strata, "train", config, "--steps", str(args.steps), "--metrics", metrics,
         "--set", "run.log_level=\"warn\"", "--set", "data.eval_interval=0"],
        os.path.join(args.dir, f"{tag}.log"), args.timeout)
    lines = read_metrics(metrics)
    steps = [l for l in lines if "tokens_per_s" in l][args.warmup:]
    if not steps:
        raise Stop(f"{metrics}: no steps after the warm-up")
    return statistics.median(l["tokens_per_s"] for l in steps), steps[-1]


def bench_a(args):
    os.makedirs(args.dir, exist_ok=True)
    ensure_tokens("out/gpu-tokens.bin")
    rows = {"strata": [], "torch": []}
    ref = None
    for r in range(args.rounds):
        ref = json.loads(run([args.torch_ref, "--config", args.config, "--steps", str(args.steps - args.warmup),
                              "--warmup", str(args.warmup), "--gemm-n", str(args.gemm_n), "--device", args.ref_device],
                             os.path.join(args.dir, f"torch-{r}.log"), args.timeout).strip().splitlines()[-1])
        rows["torch"].append(ref)
        tps, last = strata_tokens_per_s(args, args.config, f"strata-{r}")
        rows["strata"].append({"tokens_per_s": tps, "last": last})
        RESULT.update({"benchmark": "a", "rounds": rows})
        print(f"round {r}: strata {tps:.0f} tok/s, LibTorch {ref['tokens_per_s']:.0f} tok/s, "
              f"ratio {tps / ref['tokens_per_s']:.3f}, GEMM {ref['gemm_tflops']:.0f} TFLOP/s", flush=True)
    ratios = [s["tokens_per_s"] / t["tokens_per_s"] for s, t in zip(rows["strata"], rows["torch"])]
    s_med = statistics.median(s["tokens_per_s"] for s in rows["strata"])
    t_med = statistics.median(t["tokens_per_s"] for t in rows["torch"])
    gemm = statistics.median(t["gemm_tflops"] for t in rows["torch"])
    fpt = ref["flops_per_token"]
    out = {
        "benchmark": "a", "config": args.config, "parameters": ref["parameters"],
        "strata_tokens_per_s": s_med, "torch_tokens_per_s": t_med,
        "ratio_median": statistics.median(ratios), "ratios": ratios,
        "flops_per_token": fpt, "gemm_tflops": gemm,
        "strata_mfu_nominal": s_med * fpt / (NOMINAL_TFLOPS * 1e12),
        "strata_mfu_gemm": s_med * fpt / (gemm * 1e12),
        "torch_mfu_nominal": t_med * fpt / (NOMINAL_TFLOPS * 1e12),
        "rounds": rows,
    }
    print(f"(a) strata {s_med:.0f} tok/s vs LibTorch fused AdamW {t_med:.0f} tok/s: ratio "
          f"{out['ratio_median']:.3f} ({', '.join(f'{x:.3f}' for x in ratios)}); MFU {100 * out['strata_mfu_nominal']:.1f}% "
          f"of {NOMINAL_TFLOPS:.0f} TFLOP/s, {100 * out['strata_mfu_gemm']:.1f}% of the measured GEMM ({gemm:.0f} TFLOP/s)")
    return out


def bench_io(args, swap):
    os.makedirs(swap, exist_ok=True)
    out = run([args.strata, "bench-io", "--dir", swap, "--size-mb", str(args.io_mb), "--json", "--rounds", "2"],
              os.path.join(args.dir, "bench-io.log"), args.timeout)
    rows = [json.loads(l) for l in out.splitlines() if l.strip().startswith("{")]
    return {op: statistics.median(r["gbps"] for r in rows if r["op"] == op) for op in ("write", "read")}


def bench_b(args):
    os.makedirs(args.dir, exist_ok=True)
    ensure_tokens("out/gpu-tokens.bin")
    cfg = json.load(open(args.config))
    plan = plan_of(args, args.config)
    state = sum(plan["state_total_bytes"].values())
    RESULT.update({"benchmark": "b", "config": args.config, "plan_state_bytes": plan["state_total_bytes"],
                   "plan_capacity_bytes": plan["capacity_bytes"], "plan_recompute": plan["recompute"],
                   "state_over_hbm": state / max(1, plan["capacity_bytes"]["device"])})
    print(f"plan: state {state / 1e9:.1f} GB = {RESULT['state_over_hbm']:.2f}x the device's "
          f"{plan['capacity_bytes']['device'] / 1e9:.1f} GB; on NVMe {plan['state_total_bytes']['nvme'] / 1e9:.1f} GB; "
          f"recompute {plan['recompute']}; fits {plan['fits']}", flush=True)
    if not plan["fits"]:
        raise Stop("the plan does not fit: " + "; ".join(plan.get("shortfalls", [])))
    if plan["recompute"] != cfg["run"]["recompute"]:
        raise Stop(f"the plan resolved recompute to {plan['recompute']}, the reference runs {cfg['run']['recompute']}")
    io = bench_io(args, cfg["placement"]["nvme_path"])
    RESULT["bench_io_gbps"] = io
    ref = json.loads(run([args.torch_ref, "--config", args.config, "--compute-only", "--steps", str(args.ref_steps),
                          "--warmup", "1", "--gemm-n", str(args.gemm_n), "--device", args.ref_device],
                         os.path.join(args.dir, "torch-compute-only.log"), args.timeout).strip().splitlines()[-1])
    RESULT["compute_only"] = ref
    print(f"compute-only reference: {ref['tokens_per_s']:.0f} tok/s, step {ref['step_s']:.2f} s; "
          f"GEMM {ref.get('gemm_tflops', 0):.0f} TFLOP/s; bench-io write {io['write']:.2f} read {io['read']:.2f} GB/s",
          flush=True)
    metrics = os.path.join(args.dir, "strata-b.jsonl")
    tps, last = strata_tokens_per_s(args, args.config, "strata-b")
    steps = read_metrics(metrics)
    steps = [l for l in steps if "tokens_per_s" in l][args.warmup:]
    nvme = statistics.median(l["nvme_read_bytes"] + l["nvme_write_bytes"] for l in steps)
    fpt = ref["flops_per_token"]
    gemm = ref.get("gemm_tflops") or float("nan")
    hide = ref["step_s"]
    out = dict(RESULT)
    out.update({
        "parameters": ref["parameters"],
        "strata_tokens_per_s": tps, "compute_only_tokens_per_s": ref["tokens_per_s"],
        "ratio": tps / ref["tokens_per_s"], "flops_per_token": fpt, "gemm_tflops": gemm,
        "strata_mfu_nominal": tps * fpt / (NOMINAL_TFLOPS * 1e12), "strata_mfu_gemm": tps * fpt / (gemm * 1e12),
        "nvme_bytes_per_step": nvme, "bench_io_gbps": io, "compute_step_s": hide,
        "nvme_gbps_needed_to_hide": nvme / hide / 1e9,
        "steps": steps,
    })
    print(f"(b) strata {tps:.0f} tok/s vs compute-only {ref['tokens_per_s']:.0f} tok/s: ratio {out['ratio']:.3f}; "
          f"MFU {100 * out['strata_mfu_nominal']:.1f}% of {NOMINAL_TFLOPS:.0f}, {100 * out['strata_mfu_gemm']:.1f}% of the GEMM; "
          f"NVMe {nvme / 1e9:.1f} GB/step = {out['nvme_gbps_needed_to_hide']:.2f} GB/s over the {hide:.2f} s compute step "
          f"(bench-io: write {io['write']:.2f}, read {io['read']:.2f} GB/s)")
    return out


def plan_of(args, cfg_path, bound=True):
    """`strata plan --json`; without `bound` no rate probes (the bisection of (c) needs only the verdict:
    on the H100 host a plan with its probes took about 10 s of the short device time)."""
    cmd = [args.strata, "plan", cfg_path, "--json"] + ([] if bound else ["--no-bound"])
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    if not p.stdout.strip():
        sys.exit(f"strata plan {cfg_path} printed nothing (rc {p.returncode}): {p.stderr[-2000:]}")
    return json.loads(p.stdout)


def bench_c(args):
    os.makedirs(args.dir, exist_ok=True)
    ensure_tokens("out/gpu-tokens.bin")
    base = json.load(open(args.config))
    path = os.path.join(args.dir, "gpu-c.json")

    def config(layers, bound=False):
        cfg = json.loads(json.dumps(base))
        cfg["model"]["n_layers"] = layers
        cfg["run"]["metrics"] = os.path.join(args.dir, "strata-c.jsonl")
        with open(path, "w") as f:
            json.dump(cfg, f, indent=1)
        return plan_of(args, path, bound)

    # gpu-proof-2's part c searches the same way (benchlib.largest_true).
    try:
        lo = largest_true(lambda n: config(n)["fits"], 8)
    except PartStop as e:
        sys.exit(f"the plan fits any model: is the capacity measured? ({e})")
    if lo == 0:
        sys.exit("not even one layer fits")
    # Without the bound: the largest model leaves the disk no room for the NVMe probe's files (the training's
    # metrics carry bound_s, from its own rates).
    plan = config(lo)
    cap = plan["capacity_bytes"]
    bound, per_param, non_state = capacity_bound(plan)
    print(f"(c) largest that fits: {lo} layers, {plan['parameters'] / 1e9:.2f}B parameters; bound (HBM {cap['device'] / 1e9:.1f}"
          f" + RAM {cap['host'] / 1e9:.1f} + disk {cap['nvme'] / 1e9:.1f} - non-state {non_state / 1e9:.1f} GB) / "
          f"{per_param:.1f} B/param = {bound / 1e9:.2f}B: {100 * plan['parameters'] / bound:.1f}%", flush=True)
    with open(path) as f:
        cfg = json.load(f)
    RESULT.update({"benchmark": "c", "layers": lo, "parameters": plan["parameters"], "bound_parameters": bound,
                   "fraction_of_bound": plan["parameters"] / bound, "bytes_per_parameter": per_param,
                   "non_state_bytes": non_state, "capacity_bytes": cap, "config": cfg, "plan": plan})
    save(args)  # what the plan says, before the (long) training
    tps, last = strata_tokens_per_s(args, path, "strata-c")
    print(f"(c) trained {args.steps} steps: {tps:.0f} tok/s, loss {last['loss']:.3f}")
    return {"benchmark": "c", "layers": lo, "parameters": plan["parameters"], "bound_parameters": bound,
            "fraction_of_bound": plan["parameters"] / bound, "bytes_per_parameter": per_param,
            "non_state_bytes": non_state, "capacity_bytes": cap, "tokens_per_s": tps, "last_step": last,
            "config": cfg, "plan": plan}


def save(args):
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULT, f, indent=1)


def main():
    global DEADLINE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=["a", "b", "c"])
    ap.add_argument("--strata", default=".dev/bin/strata")
    ap.add_argument("--torch-ref", default=".dev/bin/bench_train_torch")
    ap.add_argument("--config", help="default: configs/gpu-a-fits-hbm.json for a, gpu-b-llama8b.json for b and c")
    ap.add_argument("--ref-steps", type=int, default=3, help="(b) timed steps of the compute-only reference")
    ap.add_argument("--io-mb", type=int, default=4096, help="(b) MiB per bench-io pass")
    ap.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench-gpu"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--timeout", type=int, default=420, help="seconds per command at most")
    ap.add_argument("--deadline", type=int, default=560,
                    help="seconds for everything (a device call's limit is 600): what is known is reported then")
    ap.add_argument("--ref-device", default="cuda", help="the reference's device (cpu: a smoke test anywhere)")
    ap.add_argument("--gemm-n", type=int, default=8192)
    ap.add_argument("--json")
    args = ap.parse_args()
    defaults = {"a": ("configs/gpu-a-fits-hbm.json", 12, 4), "b": ("configs/gpu-b-llama8b.json", 6, 2),
                "c": ("configs/gpu-b-llama8b.json", 3, 1)}[args.which]
    args.config = args.config or defaults[0]
    args.steps = args.steps or defaults[1]
    args.warmup = defaults[2] if args.warmup is None else args.warmup
    if args.steps <= args.warmup:
        sys.exit("--steps must exceed --warmup")
    DEADLINE = time.time() + args.deadline
    os.makedirs(args.dir, exist_ok=True)
    try:
        RESULT.update({"benchmark": args.which, "result": "ok"})
        out = {"a": bench_a, "b": bench_b, "c": bench_c}[args.which](args)
        RESULT.update(out)
    except Stop as e:
        RESULT["result"] = "stopped"
        RESULT["why"] = str(e)
        save(args)
        sys.exit(f"bench_gpu.py {args.which}: stopped: {e}")
    save(args)


if __name__ == "__main__":
    main()
