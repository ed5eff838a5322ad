#!/usr/bin/env python3
"""What the layer schedule saves when parameters live on NVMe: the same model
and placement trained under run.schedule "micro_batch" and "layer" in one run.

The model (default ~200M parameters, bf16) keeps its 16-bit parameters on
NVMe (param16 on nvme, every block windowed), its gradients and optimizer
state in host RAM, and trains A micro-batches a step (default 8). The
parameter window may hold only a few blocks at once
(zero_optimization.stage3_max_live_parameters, default 4 layers' worth, as
on a GPU whose memory cannot hold the model), so under micro_batch a block
is read from NVMe up to 2A + 1 times a step, under layer at most twice
(docs/design.md, "Bytes per link"). Each round trains both schedules (in
alternating order), each for --warmup + --steps steps, and reads the
metrics: per schedule the median step time, NVMe read and write bytes, H2D
and D2H bytes per step and the step's bound; and the same-round ratios
layer / micro_batch of the step time and of the NVMe read bytes, with
their medians over the rounds.

Usage:
  .venv/bin/python tools/bench_schedule.py --strata build/strata --dir /tmp/bench-schedule \\
      [--rounds 3] [--steps 2] [--accum 8] [--layers 16] [--dim 1024] [--live-layers 4] [--json out.json]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

from benchlib import LICENSES, read_metrics


def layer_numel(dim):
    # q, k, v, o (n_kv_heads = n_heads) and gate/up/down with ffn 8/3 x dim
    # rounded to 256, plus two norms: an upper bound is enough for the knob.
    ffn = ((8 * dim // 3 + 255) // 256) * 256
    return 4 * dim * dim + 3 * dim * ffn + 2 * dim


def make_config(args, schedule, swap, metrics):
    live = args.live_layers * layer_numel(args.dim)
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "sub_group_size": 10_000_000,
                              "stage3_param_persistence_threshold": 0,
                              "stage3_max_live_parameters": live,
                              "stage3_prefetch_bucket_size": live // 2},
        "placement": {"param16": {"nvme": 1.0}, "grad": {"host": 1.0}, "optimizer": {"host": 1.0},
                      "nvme_path": swap},
        "model": {"vocab_size": 256, "dim": args.dim, "n_layers": args.layers, "n_heads": max(1, args.dim // 64),
                  "seq_len": args.seq_len},
        "data": {"path": [p for p in LICENSES if os.path.exists(p)], "eval_interval": 0},
        "run": {"steps": args.warmup + args.steps, "log_level": "warn", "schedule": schedule, "metrics": metrics},
    }


def run_once(args, schedule, tag):
    swap = os.path.join(args.dir, "swap")
    os.makedirs(swap, exist_ok=True)
    metrics = os.path.join(args.dir, f"{tag}.jsonl")
    cfg_path = os.path.join(args.dir, f"{tag}.json")
    with open(cfg_path, "w") as f:
        json.dump(make_config(args, schedule, swap, metrics), f)
    if os.path.exists(metrics):
        os.remove(metrics)
    p = subprocess.run([args.strata, "train", cfg_path], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench_schedule: strata train {cfg_path} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    lines = read_metrics(metrics)[args.warmup:]
    med = lambda k: statistics.median(l[k] for l in lines)
    return {"step_s": med("step_s"), "bound_s": med("bound_s"), "nvme_read_bytes": med("nvme_read_bytes"),
            "nvme_write_bytes": med("nvme_write_bytes"), "h2d_bytes": med("h2d_bytes"), "d2h_bytes": med("d2h_bytes"),
            "wait_s": med("wait_s"), "loss": lines[-1]["loss"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata", default="build/strata")
    ap.add_argument("--dir", required=True, help="scratch directory on the NVMe device (configs, metrics, swap)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--accum", type=int, default=8, help="micro-batches per step (gradient_accumulation_steps)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--live-layers", type=int, default=4,
                    help="stage3_max_live_parameters in layers' worth (the window's limit)")
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    schedules = ["micro_batch", "layer"]
    results = {s: [] for s in schedules}
    try:
        for rnd in range(args.rounds):
            order = schedules if rnd % 2 == 0 else schedules[::-1]
            for s in order:
                r = run_once(args, s, f"{s}-r{rnd}")
                results[s].append(r)
                print(f"round {rnd + 1}: {s:11} step {r['step_s']:.3f} s, bound {r['bound_s']:.3f} s, "
                      f"NVMe read {r['nvme_read_bytes'] / 2**30:.2f} GiB, write {r['nvme_write_bytes'] / 2**30:.2f} GiB, "
                      f"h2d {r['h2d_bytes'] / 2**30:.2f} GiB, d2h {r['d2h_bytes'] / 2**30:.2f} GiB, "
                      f"waited {r['wait_s']:.3f} s, loss {r['loss']:.4f}", flush=True)
    finally:
        shutil.rmtree(os.path.join(args.dir, "swap"), ignore_errors=True)
    print(f"\nmedians of {args.rounds} rounds (A = {args.accum}, {args.layers} layers of dim {args.dim}, "
          f"param16 on NVMe, window of {args.live_layers} layers):")
    print(f"{'schedule':12} {'step s':>8} {'bound s':>8} {'NVMe read GiB':>13} {'NVMe write GiB':>14} "
          f"{'h2d GiB':>8} {'d2h GiB':>8}")
    for s in schedules:
        rs = results[s]
        m = lambda k: statistics.median(r[k] for r in rs)
        print(f"{s:12} {m('step_s'):8.3f} {m('bound_s'):8.3f} {m('nvme_read_bytes') / 2**30:13.2f} "
              f"{m('nvme_write_bytes') / 2**30:14.2f} {m('h2d_bytes') / 2**30:8.2f} {m('d2h_bytes') / 2**30:8.2f}")
    step_ratio = [l["step_s"] / m["step_s"] for l, m in zip(results["layer"], results["micro_batch"])]
    read_ratio = [l["nvme_read_bytes"] / m["nvme_read_bytes"] for l, m in zip(results["layer"], results["micro_batch"])]
    print(f"layer / micro_batch, same round: step {', '.join(f'{x:.3f}' for x in step_ratio)} "
          f"(median {statistics.median(step_ratio):.3f}); NVMe read {statistics.median(read_ratio):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "step_ratio": step_ratio, "read_ratio": read_ratio},
                      f, indent=1)


if __name__ == "__main__":
    main()
