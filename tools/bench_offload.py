#!/usr/bin/env python3
"""What NVMe bandwidth costs a training step: Strata's optimizer state swept
over NVMe shares, timed against the I/O bound measured in the same run.

For a model whose optimizer state is several GB (default: ~250M parameters,
3 GB of fp32 master + exp_avg + exp_avg_sq), each round
  1. measures the swap directory's write, read and both-at-once bandwidth
     with `strata bench-io` (the same block size, queue depth and rings as the
     training config's aio section),
  2. trains a few steps with 0, 25, 50, 75 and 100 % of the optimizer state on
     NVMe (the rest, and the gradients, in host RAM) and reads the metrics.
It prints, per share, the median step time, optimizer time and bytes per
link, and two same-run ratios:
  - optimizer step with 100 % on NVMe, run on its own (run.overlap_optimizer
    false, one more run per round) / its I/O bound, where the bound is
    nvme_read_bytes / read GB/s + nvme_write_bytes / write GB/s;
  - full step with 100 % on NVMe / full step with it in RAM (0 %).
It also prints each share's step bound (`bound_s` from the metrics: the
model of docs/design.md "The step's bound" over the step's own byte counts,
with this round's bench-io figures as the NVMe rates and this round's
`strata plan --probe-seconds` probes for compute, CPU Adam, the CRC-32C of
the swap checksums, memcpy and the gradient adds, the same for every share) and step / bound.
With --speculate-ab each share is run again right after with optimizer.speculate
on (the optimizer behind the backward: docs/design.md; run.overlap_optimizer on,
which it needs), and the speculated step
is reported against the share's own step and the 0% step (--speculate sets the
sweep's own value; --clip gradient_clipping, 0 for none).
With --ab-strata OTHER each share is run again right after with the build OTHER
(e.g. the commit before a change; before it in every second round), the same
config and data: the step time of
--strata over OTHER's, medians of the rounds (a same-run A/B of a change's speed).
With --plot FILE it draws step time, the bound and bytes per link against the share
(needs matplotlib: tools/setup.sh installs it into .venv).

Usage:
  .venv/bin/python tools/bench_offload.py --strata build/strata --dir /mnt/nvme/strata-bench \\
      [--rounds 3] [--steps 3] [--layers 20] [--dim 1024] [--plot out/bench-offload.png]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from benchlib import LICENSES, read_metrics
from plan_rates import run_rates


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1].upper() in units:
        return int(float(text[:-1]) * units[text[-1].upper()])
    return int(text)


def make_config(args, share, swap_dir, metrics, overlap=None, checksums=True, io=None, speculate=None):
    nvme = share / 100.0
    split = {"device": 0.0, "host": round(1.0 - nvme, 6), "nvme": nvme}
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "steps_per_print": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0},
                      # The optimizer behind the backward (docs/design.md), for the sweep only.
                      "speculate": speculate or (args.speculate if overlap is None else "off")},
        "zero_optimization": {"stage": 3, "sub_group_size": args.sub_group_size,
                              # The optimizer pipeline's staging sets (docs/config.md).
                              "offload_optimizer": {"device": "nvme", "nvme_path": swap_dir,
                                                    "buffer_count": args.buffer_count}},
        "placement": {"param16": {"device": 1.0}, "grad": {"host": 1.0}, "optimizer": split,
                      "nvme_path": swap_dir},
        "aio": {"block_size": parse_size(args.block_size), "queue_depth": args.queue_depth,
                "intra_op_parallelism": args.rings},
        "model": {"vocab_size": 256, "dim": args.dim, "n_layers": args.layers, "n_heads": args.dim // 64,
                  "n_kv_heads": args.dim // 64, "seq_len": args.seq_len, "tie_embeddings": True},
        "data": {"path": [p for p in LICENSES if os.path.exists(p)], "format": "text",
                 "val_fraction": 0.0, "eval_interval": 0},
        "run": {"steps": args.steps + args.warmup, "seed": 1, "metrics": metrics,
                # run.overlap_optimizer: --overlap for the sweep ("auto" by default), false for the runs
                # of the optimizer alone.
                "overlap_optimizer": {"on": True, "off": False, "auto": "auto"}[overlap if overlap is not None
                                                                                else args.overlap],
                "swap_checksums": checksums,
                # The step's bound over this round's rates: bench-io's for the
                # disk, `strata plan`'s probes for the rest (probe_rates).
                "rates": ({"nvme_read_gbps": io["read"], "nvme_write_gbps": io["write"],
                           "nvme_both_gbps": io["both"]} | io.get("probed", {})) if io else None},
    }


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        sys.exit(f"bench_offload: {' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p.stdout


def bench_io(args, directory):
    out = run([args.strata, "bench-io", "--dir", directory, "--size-mb", str(args.io_size_mb),
               "--block-size", args.block_size, "--queue-depth", str(args.queue_depth),
               "--rings", str(args.rings), "--ops", "write,read,both", "--json"])
    bw = {}
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("{"):
            m = json.loads(line)
            bw[m["op"]] = m["gbps"]
    if "read" not in bw or "write" not in bw or "both" not in bw:
        sys.exit("bench_offload: bench-io printed no read/write/both figures:\n" + out)
    return bw


def probe_rates(args, work, io):
    """The rest of the bound's rates, once per round for every share: `strata
    plan --probe-seconds` (longer than strata train's 0.2 s at start) on the
    100% configuration with the disk's rates given."""
    plan = json.loads(run([args.strata, "plan", "--json", "--probe-seconds", str(args.probe_seconds), "--reprobe",
                           _write(work, "probe.json", make_config(args, 100, os.path.join(work, "swap"),
                                                                  "/dev/null", io=io))]))
    # The disk's are this round's bench-io figures (given to the plan).
    return {k: v for k, v in run_rates(plan["bound"]["rates"]).items() if not k.startswith("nvme_")}


def train(args, share, work, overlap=None, checksums=True, io=None, tag="", speculate=None, strata=None):
    swap = os.path.join(work, "swap")
    os.makedirs(swap, exist_ok=True)
    metrics = os.path.join(work, f"metrics-{share}.jsonl")
    cfg_path = os.path.join(work, f"config-{share}.json")
    with open(cfg_path, "w") as f:
        json.dump(make_config(args, share, swap, metrics, overlap, checksums, io, speculate), f, indent=1)
    cmd = [strata or args.strata, "train", cfg_path]
    if args.trace:  # a Chrome trace per run (`strata train --trace`)
        os.makedirs(args.trace, exist_ok=True)
        cmd += ["--trace", os.path.join(args.trace, f"trace-{share}{tag}.json")]
    run(cmd)
    steps = read_metrics(metrics)
    timed = steps[args.warmup:]
    shutil.rmtree(swap, ignore_errors=True)
    med = lambda k: statistics.median(s[k] for s in timed)
    out = {k: med(k) for k in ("step_s", "optimizer_s", "wait_s", "h2d_bytes", "d2h_bytes",
                                "nvme_read_bytes", "nvme_write_bytes", "bound_s")}
    out["step_over_bound"] = statistics.median(x["step_s"] / x["bound_s"] for x in timed)
    # Note [Speculative optimizer]: seconds of the optimizer beside the
    # backward, and how the steps ended.
    out["optimizer_hidden_s"] = statistics.median(x.get("optimizer_hidden_s", 0.0) for x in timed)
    out["speculation"] = ",".join(sorted({x.get("speculation", "") for x in timed}))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strata", default="build/strata")
    ap.add_argument("--dir", help="directory on the NVMe device to benchmark (created); required unless --replot")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (bench-io + sweep); medians across rounds")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--shares", default="0,25,50,75,100", help="NVMe shares of optimizer state, percent")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--sub-group-size", type=int, default=10_000_000)
    ap.add_argument("--buffer-count", type=int, default=4,
                    help="zero_optimization.offload_optimizer.buffer_count: the optimizer pipeline's staging "
                         "sets, max(N, 8) up to 128 (the placement block still decides each share)")
    ap.add_argument("--block-size", default="4M")
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--rings", type=int, default=2)
    ap.add_argument("--io-size-mb", type=int, default=2048)
    ap.add_argument("--probe-seconds", type=float, default=1.0,
                    help="each rate probe of `strata plan` per round (the bound's compute, Adam, CRC, memcpy)")
    ap.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                    help="run.overlap_optimizer of the sweep (auto: the config's default)")
    ap.add_argument("--no-overlap-all", action="store_true",
                    help="also train every share with run.overlap_optimizer=false (same round) and report both")
    ap.add_argument("--speculate", choices=["auto", "on", "off"], default="auto",
                    help="optimizer.speculate for the sweep (the optimizer behind the backward)")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (0: none)")
    ap.add_argument("--speculate-ab", action="store_true",
                    help="after each share's run, the same share with optimizer.speculate on (same round)")
    ap.add_argument("--ab-strata", metavar="OTHER", help="run each share again with this strata build (A/B)")
    ap.add_argument("--json", help="write all figures to this file")
    ap.add_argument("--trace", metavar="DIR", help="write each run's Chrome trace (strata train --trace) into DIR")
    ap.add_argument("--plot", help="draw step time and bytes per link against the share into this PNG")
    ap.add_argument("--replot", metavar="JSON", help="only draw --plot from a --json file of an earlier run")
    args = ap.parse_args()
    shares = [int(s) for s in args.shares.split(",")]
    if args.replot:
        if not args.plot:
            sys.exit("bench_offload: --replot needs --plot FILE")
        summary = json.load(open(args.replot))
        plot(summary, [int(s) for s in summary["shares"]], args.plot)
        print(f"plot: {args.plot}")
        return

    if not args.dir:
        sys.exit("bench_offload: --dir DIR is required")
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-offload-", dir=args.dir)
    plan = json.loads(run([args.strata, "plan", "--json",
                           _write(work, "plan.json", make_config(args, 100, os.path.join(work, "swap"), "/dev/null"))]))
    opt_bytes = sum(sum(plan["state_bytes"][c].values()) for c in ("master", "exp_avg", "exp_avg_sq"))
    params = sum(plan["state_bytes"]["master"].values()) // 4
    print(f"model: {params / 1e6:.0f}M parameters; optimizer state "
          f"{opt_bytes / 1e9:.2f} GB; {args.rounds} round(s) x {len(shares)} shares x "
          f"{args.warmup}+{args.steps} steps", flush=True)

    rounds = []
    try:
        for r in range(args.rounds):
            io = bench_io(args, work)
            io["probed"] = probe_rates(args, work, io)
            p = io["probed"]
            print(f"round {r + 1}: bench-io write {io['write']:.2f} GB/s, read {io['read']:.2f} GB/s, "
                  f"both at once {io['both']:.2f} GB/s; probes: compute {p['device_tflops'] * 1e3:.1f} GFLOP/s, "
                  f"Adam {p['adam_gelems']:.2f} G elements/s, CRC-32C {p['checksum_gbps']:.1f} GB/s, "
                  f"memcpy {p['d2h_gbps']:.1f} GB/s", flush=True)
            per_share = {}
            for s in shares:
                # --ab-strata: the other build first in every second round (no order favoured).
                other_first = bool(args.ab_strata) and r % 2 == 1
                if other_first:
                    n_ab = train(args, s, work, io=io, tag=f"-round{r + 1}-ab", strata=args.ab_strata)
                m = train(args, s, work, io=io, tag=f"-round{r + 1}")
                per_share[s] = m
                print(f"  nvme {s:3d}%: step {m['step_s']:.2f} s, bound {m['bound_s']:.2f} s, "
                      f"optimizer {m['optimizer_s']:.2f} s, "
                      f"nvme read {m['nvme_read_bytes'] / 1e9:.2f} GB, write {m['nvme_write_bytes'] / 1e9:.2f} GB",
                      flush=True)
                if args.speculate_ab:
                    # The same share with the optimizer behind the backward, right after.
                    n = train(args, s, work, overlap="on", io=io, tag=f"-round{r + 1}-speculated", speculate="on")
                    m["speculated"] = n
                    print(f"  nvme {s:3d}% speculated: step {n['step_s']:.2f} s, bound {n['bound_s']:.2f} s, "
                          f"optimizer {n['optimizer_s']:.2f} s (hidden {n['optimizer_hidden_s']:.2f} s; "
                          f"{n['speculation']}), nvme read {n['nvme_read_bytes'] / 1e9:.2f} GB "
                          f"(speculated / not: {n['step_s'] / m['step_s']:.3f})", flush=True)
                if args.ab_strata:
                    # The same share with the other build, right before or after.
                    n = n_ab if other_first else train(args, s, work, io=io, tag=f"-round{r + 1}-ab",
                                                        strata=args.ab_strata)
                    m["ab"] = n
                    print(f"  nvme {s:3d}% with {args.ab_strata}: step {n['step_s']:.2f} s "
                          f"(--strata / it: {m['step_s'] / n['step_s']:.3f})", flush=True)
                if args.no_overlap_all:
                    n = train(args, s, work, overlap="off", io=io, tag=f"-round{r + 1}-no-overlap")
                    m["no_overlap"] = n
                    print(f"  nvme {s:3d}% without the overlap: step {n['step_s']:.2f} s, bound {n['bound_s']:.2f} s "
                          f"(overlapped / not: {m['step_s'] / n['step_s']:.3f})", flush=True)
            # The optimizer alone (not overlapped with compute) against the I/O bound.
            inline = None
            if 100 in shares and args.no_overlap_all and args.overlap != "off":
                inline = per_share[100]["no_overlap"]  # the same run, made above
            elif 100 in shares:
                inline = train(args, 100, work, overlap="off", io=io, tag=f"-round{r + 1}-inline")
                print(f"  nvme 100%, optimizer not overlapped: step {inline['step_s']:.2f} s, "
                      f"bound {inline['bound_s']:.2f} s, optimizer {inline['optimizer_s']:.2f} s", flush=True)
            # What the swap checksums cost the step.
            unchecked = None
            if 100 in shares:
                unchecked = train(args, 100, work, checksums=False, io=io, tag=f"-round{r + 1}-unchecked")
                print(f"  nvme 100%, run.swap_checksums=false: step {unchecked['step_s']:.2f} s, "
                      f"optimizer {unchecked['optimizer_s']:.2f} s", flush=True)
            rounds.append({"io": io, "shares": per_share, "inline100": inline, "unchecked100": unchecked})
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def bound(rd, s, m=None):
        m = m or rd["shares"][s]
        return m["nvme_read_bytes"] / (rd["io"]["read"] * 1e9) + m["nvme_write_bytes"] / (rd["io"]["write"] * 1e9)

    summary = {"parameters": params, "optimizer_state_bytes": opt_bytes, "shares": {}}
    print(f"\n{'nvme %':>6} {'step s':>8} {'optim s':>8} {'wait s':>7} {'nvme rd GB':>10} {'nvme wr GB':>10} "
          f"{'h2d GB':>7} {'d2h GB':>7} {'io bound s':>10} {'bound s':>8} {'step/bound':>10}")
    for s in shares:
        med = lambda k: statistics.median(rd["shares"][s][k] for rd in rounds)
        b = statistics.median(bound(rd, s) for rd in rounds)
        row = {k: med(k) for k in rounds[0]["shares"][s] if k not in ("no_overlap", "speculated", "speculation", "ab")}
        row["io_bound_s"] = b
        summary["shares"][s] = row
        print(f"{s:6d} {row['step_s']:8.2f} {row['optimizer_s']:8.2f} {row['wait_s']:7.2f} "
              f"{row['nvme_read_bytes'] / 1e9:10.2f} {row['nvme_write_bytes'] / 1e9:10.2f} "
              f"{row['h2d_bytes'] / 1e9:7.2f} {row['d2h_bytes'] / 1e9:7.2f} {b:10.2f} {row['bound_s']:8.2f} "
              f"{row['step_over_bound']:10.3f}")
    if args.speculate_ab:
        print(f"\n{'nvme %':>6} {'speculated: step s':>18} {'hidden s':>9} {'speculated / not':>17} "
              f"{'/ the 0% step':>14}   (the sweep: --speculate {args.speculate}; medians over rounds)")
        for s in shares:
            med = lambda f: statistics.median(f(rd) for rd in rounds)
            row = {"step_s": med(lambda rd: rd["shares"][s]["speculated"]["step_s"]),
                   "optimizer_hidden_s": med(lambda rd: rd["shares"][s]["speculated"]["optimizer_hidden_s"]),
                   "speculated_over_not": med(lambda rd: rd["shares"][s]["speculated"]["step_s"] /
                                                       rd["shares"][s]["step_s"]),
                   "over_zero_share": (med(lambda rd: rd["shares"][s]["speculated"]["step_s"] /
                                                      rd["shares"][shares[0]]["step_s"]))}
            summary["shares"][s]["speculated"] = row
            print(f"{s:6d} {row['step_s']:18.2f} {row['optimizer_hidden_s']:9.2f} {row['speculated_over_not']:17.3f} "
                  f"{row['over_zero_share']:14.3f}")
    if args.ab_strata:
        print(f"\n{'nvme %':>6} {'step s':>8} {'other: step s':>14} {'step / other':>13}   "
              f"(--ab-strata {args.ab_strata}; medians over rounds of the same-round ratio)")
        for s in shares:
            med = lambda f: statistics.median(f(rd["shares"][s]) for rd in rounds)
            row = {"step_s": med(lambda m: m["ab"]["step_s"]),
                   "step_over_other": med(lambda m: m["step_s"] / m["ab"]["step_s"])}
            summary["shares"][s]["ab"] = row
            print(f"{s:6d} {summary['shares'][s]['step_s']:8.2f} {row['step_s']:14.2f} {row['step_over_other']:13.3f}")
    if args.no_overlap_all:
        print(f"\n{'nvme %':>6} {'sweep: step s':>15} {'step/bound':>10} {'no overlap: step s':>18} {'step/bound':>10} "
              f"{'sweep / not':>16}   (the sweep: --overlap {args.overlap})")
        for s in shares:
            med = lambda f: statistics.median(f(rd["shares"][s]) for rd in rounds)
            row = {"step_s": med(lambda m: m["no_overlap"]["step_s"]),
                   "step_over_bound": med(lambda m: m["no_overlap"]["step_over_bound"]),
                   "overlapped_over_not": med(lambda m: m["step_s"] / m["no_overlap"]["step_s"])}
            summary["shares"][s]["no_overlap"] = row
            print(f"{s:6d} {summary['shares'][s]['step_s']:15.2f} {summary['shares'][s]['step_over_bound']:10.3f} "
                  f"{row['step_s']:18.2f} {row['step_over_bound']:10.3f} {row['overlapped_over_not']:16.3f}")
    if 100 in shares:
        opt_ratio = statistics.median(rd["inline100"]["optimizer_s"] / bound(rd, 100, rd["inline100"])
                                      for rd in rounds)
        summary["optimizer_over_io_bound"] = opt_ratio
        print(f"\noptimizer step alone (run.overlap_optimizer=false), 100% on NVMe / I/O bound (same round): "
              f"{opt_ratio:.3f}x (target <= 1.10)")
        inline_step = statistics.median(rd["inline100"]["step_s"] for rd in rounds)
        inline_ratio = statistics.median(rd["inline100"]["step_over_bound"] for rd in rounds)
        summary["inline100"] = {"step_s": inline_step, "step_over_bound": inline_ratio}
        print(f"full step at 100% without run.overlap_optimizer: {inline_step:.2f} s, step / bound {inline_ratio:.3f}")
        if 0 in shares:
            step_ratio = statistics.median(rd["shares"][100]["step_s"] / rd["shares"][0]["step_s"] for rd in rounds)
            summary["step_nvme_over_ram"] = step_ratio
            io_vs_compute = statistics.median(
                bound(rd, 100) / (rd["shares"][0]["step_s"] - rd["shares"][0]["optimizer_s"]) for rd in rounds)
            summary["io_bound_over_compute"] = io_vs_compute
            print(f"full step, optimizer 100% on NVMe / in RAM (same round): {step_ratio:.3f}x (target <= 1.10; "
                  f"I/O bound is {io_vs_compute:.2f}x the compute time)")
            unchecked_ratio = statistics.median(rd["unchecked100"]["step_s"] / rd["shares"][0]["step_s"]
                                                for rd in rounds)
            summary["step_nvme_unchecked_over_ram"] = unchecked_ratio
            print(f"full step, 100% on NVMe with run.swap_checksums=false / in RAM: {unchecked_ratio:.3f}x")
    summary["rounds"] = rounds
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if args.plot:
        plot(summary, shares, args.plot)
        print(f"plot: {args.plot}")


def _write(work, name, obj):
    path = os.path.join(work, name)
    with open(path, "w") as f:
        json.dump(obj, f)
    return path


def plot(summary, shares, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [summary["shares"][str(s)] if str(s) in summary["shares"] else summary["shares"][s] for s in shares]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.4))
    a.bar(shares, [r["step_s"] for r in rows], width=12, color="#9ecae1", label="training step")
    a.plot(shares, [r["optimizer_s"] for r in rows], color="#e6550d", marker="s",
           label="optimizer incl. swapping (run.overlap_optimizer as --overlap)")
    a.plot(shares, [r["io_bound_s"] for r in rows], "k--", marker="o", label="NVMe I/O bound (bench-io, same run)")
    a.plot(shares, [r["wait_s"] for r in rows], color="#31a354", marker="^", label="compute waiting for data")
    if all("bound_s" in r for r in rows):
        a.plot(shares, [r["bound_s"] for r in rows], color="#756bb1", marker="D",
               label="the step's bound (strata, bound_s)")
    a.set_xlabel("optimizer state on NVMe (%)")
    a.set_ylabel("seconds per step (median)")
    a.set_xticks(shares)
    a.set_ylim(0, max(r["step_s"] for r in rows) * 1.35)
    a.legend(fontsize=8, loc="upper left")
    a.set_title("step time")
    for key, label, style in (("nvme_read_bytes", "NVMe read", "o-"), ("nvme_write_bytes", "NVMe write", "x--"),
                              ("h2d_bytes", "host to device", "^-"), ("d2h_bytes", "device to host", "v-")):
        b.plot(shares, [r[key] / 1e9 for r in rows], style, label=label)
    b.set_xlabel("optimizer state on NVMe (%)")
    b.set_ylabel("GB per step")
    b.set_xticks(shares)
    b.legend(fontsize=8)
    b.set_title("bytes per link")
    fig.suptitle(f"Strata: {summary['parameters'] / 1e6:.0f}M parameters, "
                 f"{summary['optimizer_state_bytes'] / 1e9:.1f} GB optimizer state")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
