#!/usr/bin/env python3
"""What sharding a step over ranks costs: the same global batch at ZeRO stage 3
on 1, 2, 4, ... ranks of one machine (threads per rank = cores / ranks),
with the optimizer state in host RAM and on NVMe, timed in one run.

Each round trains a few steps per (world size, tier) under `strata launch`,
interleaved, and reads rank 0's metrics (median step time after the first
step) and every rank's Chrome trace (the time in collectives per step: the
spans of its "collectives" track, i.e. issuing and waiting for all-gathers,
reduce-scatters and all-reduces). It prints medians over rounds and the
same-run ratio step(world size N) / step(world size 1) per tier.

Each run's step bound (`bound_s`, docs/design.md "The step's bound") takes
its rates from probes made just before it in the same round: as many
`strata plan --probe-seconds` processes as the run has ranks, at once, each
with the rank's threads (so they contend for the cores, memory and disk as
the ranks will), and the first one's rates given to every rank as
run.rates (training takes rank 0's too). The network's rate is still
measured by the ranks at start (all-reduces). --probe-seconds 0 leaves
every rate to `strata train`'s 0.2 s probes at start.

Usage:
  .venv/bin/python tools/bench_ranks.py --strata build/strata --dir /tmp/bench-ranks \\
      [--world-sizes 1,2] [--rounds 3] [--steps 4] [--dim 512] [--layers 4] [--json out.json] \\
      [--probe-seconds 1] \\
      [--variants "before:comm.gradient_reduction=per_micro_batch,comm.keep_gathered=none;now:"]

--variants: configurations measured side by side, ';'-separated, each NAME:KEY=VALUE,KEY=VALUE
(--set overrides; default "default:", the config as it is).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

from benchlib import LICENSES, read_metrics
from plan_rates import run_rates



def make_config(args, tier, swap_dir):
    cfg = {
        "train_batch_size": args.global_batch,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_clipping": 1.0,
        "steps_per_print": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "sub_group_size": 1 << 20},
        "model": {"vocab_size": 256, "dim": args.dim, "n_layers": args.layers, "n_heads": max(1, args.dim // 64),
                  "seq_len": args.seq_len},
        "data": {"path": [p for p in LICENSES[:4] if os.path.exists(p)], "eval_interval": 0},
        "run": {"steps": args.steps, "log_level": "warn"},
        "comm": {"timeout_s": 120},
    }
    if tier == "nvme":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": swap_dir}
    return cfg


def collective_seconds(trace_path):
    with open(trace_path) as f:
        events = json.load(f)
    return sum(e.get("dur", 0.0) for e in events if e.get("ph") == "X" and e.get("tid") == 5) / 1e6


def write_config(args, tier, tag):
    os.makedirs(args.dir, exist_ok=True)
    swap = os.path.join(args.dir, "swap")
    os.makedirs(swap, exist_ok=True)
    cfg_path = os.path.join(args.dir, f"{tag}.json")
    with open(cfg_path, "w") as f:
        json.dump(make_config(args, tier, swap), f)
    return cfg_path


def probe_rates(args, ws, tier, tag, sets=()):
    """The bound's rates for one run: `ws` concurrent `strata plan` probes
    with the rank's threads; the first process's rates, as run.rates sets."""
    cfg_path = write_config(args, tier, tag + "-probe")
    threads = max(1, args.cores // ws)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [args.strata, "plan", "--json", "--probe-seconds", str(args.probe_seconds), "--reprobe", cfg_path,
           "--world-size", str(ws), "--set", f"run.threads={threads}"]
    for kv in sets:
        cmd += ["--set", kv]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(ws)]
    outs = [p.communicate() for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            sys.exit(f"bench_ranks: {' '.join(cmd)} failed ({p.returncode}):\n{err[-3000:]}")
    return run_rates(json.loads(outs[0][0])["bound"]["rates"])


def run_once(args, ws, tier, tag, sets=(), rates=None):
    cfg_path = write_config(args, tier, tag)
    metrics = os.path.join(args.dir, f"{tag}.jsonl")
    trace = os.path.join(args.dir, f"{tag}.rank{{rank}}.trace.json")
    threads = max(1, args.cores // ws)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [args.strata, "launch", "--nproc", str(ws), "--", "strata", "train", cfg_path, "--metrics", metrics,
           "--trace", trace, "--set", f"run.threads={threads}"]
    for kv in sets:
        cmd += ["--set", kv]
    for k, v in (rates or {}).items():
        cmd += ["--set", f"run.rates.{k}={v:.6g}"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench_ranks: {' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    lines = read_metrics(metrics)
    steps = [l["step_s"] for l in lines[1:]]  # the first step warms up
    comm = [collective_seconds(trace.replace("{rank}", str(r))) / len(lines) for r in range(ws)]
    return {"step_s": statistics.median(steps), "collectives_s": statistics.mean(comm),
            "comm_wait_s": statistics.median(l["comm_wait_s"] for l in lines[1:]),
            "net_bytes": lines[-1]["net_bytes"], "tokens_per_s": statistics.median(l["tokens_per_s"] for l in lines[1:]),
            "bound_s": statistics.median(l["bound_s"] for l in lines[1:]),
            "step_over_bound": statistics.median(l["step_s"] / l["bound_s"] for l in lines[1:])}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata", default="build/strata")
    ap.add_argument("--dir", required=True, help="scratch directory (configs, metrics, traces, NVMe swap)")
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--tiers", default="ram,nvme")
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--probe-seconds", type=float, default=1.0,
                    help="each rate probe of the concurrent `strata plan` runs before every training run "
                         "(0: strata train's own 0.2 s probes at start)")
    ap.add_argument("--variants", default="default:", help="NAME:KEY=VALUE,...;NAME:... (--set overrides)")
    args = ap.parse_args()
    sizes = [int(x) for x in args.world_sizes.split(",")]
    variants = {}
    for v in args.variants.split(";"):
        name, _, kvs = v.partition(":")
        variants[name] = [kv for kv in kvs.split(",") if kv]
    tiers = [(t, name) for t in args.tiers.split(",") for name in variants]
    results = {}
    for rnd in range(args.rounds):
        for tier, red in tiers:
            for ws in sizes:  # interleaved: each round measures every point once
                tag = f"ws{ws}-{tier}-{red}"
                rates = probe_rates(args, ws, tier, tag, variants[red]) if args.probe_seconds > 0 else None
                r = run_once(args, ws, tier, tag, variants[red], rates)
                r["rates"] = rates
                results.setdefault(((tier, red), ws), []).append(r)
                probed = ""
                if rates:
                    probed = (f" (probes: compute {rates.get('device_tflops', 0) * 1e3:.1f} GFLOP/s, Adam "
                              f"{rates.get('adam_gelems', 0):.2f} G el/s" +
                              (f", NVMe write {rates.get('nvme_write_gbps', 0):.2f} read "
                               f"{rates['nvme_read_gbps']:.2f} GB/s" if "nvme_read_gbps" in rates else "") + ")")
                print(f"round {rnd + 1}: {tier:4} {red} ws {ws}{probed}: step {r['step_s']:.3f} s, "
                      f"bound {r['bound_s']:.3f} s, "
                      f"collectives "
                      f"{r['collectives_s']:.3f} s/step, comm wait {r['comm_wait_s']:.3f} s, "
                      f"net {r['net_bytes'] / 2**20:.1f} MiB/step", flush=True)
    print(f"\nmedians of {args.rounds} rounds (global batch {args.global_batch}, stage 3, {args.cores} cores):")
    print(f"{'tier, variant':24} {'ranks':>5} {'threads':>7} {'step s':>8} {'vs 1 rank':>9} {'collectives s':>13} "
          f"{'net MiB/step':>12} {'bound s':>8} {'step/bound':>10}")
    out = []
    for tier in tiers:
        for ws in sizes:
            rs = results[(tier, ws)]
            step = statistics.median(r["step_s"] for r in rs)
            # Same-run ratio: each round's step against that round's 1-rank step.
            ratios = [r["step_s"] / b["step_s"] for r, b in zip(rs, results[(tier, sizes[0])])]
            ratio = statistics.median(ratios)
            coll = statistics.median(r["collectives_s"] for r in rs)
            net = rs[-1]["net_bytes"] / 2**20
            bound = statistics.median(r["bound_s"] for r in rs)
            over = statistics.median(r["step_over_bound"] for r in rs)
            print(f"{tier[0] + ', ' + tier[1]:24} {ws:5d} {max(1, args.cores // ws):7d} {step:8.3f} {ratio:9.2f} {coll:13.3f} {net:12.1f} "
                  f"{bound:8.3f} {over:10.3f}")
            out.append({"tier": tier[0], "variant": tier[1], "world_size": ws, "step_s": step, "ratio_vs_first": ratio,
                        "bound_s": bound, "step_over_bound": over,
                        "collectives_s": coll, "net_bytes": rs[-1]["net_bytes"], "rounds": rs})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
