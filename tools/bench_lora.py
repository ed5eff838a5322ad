#!/usr/bin/env python3
"""LoRA over a frozen base on NVMe against full fine-tuning of the same model, on this machine's CPU.

Each round trains the same model, data and seed twice, one right after the other (the order alternates
between rounds):
  - full: every parameter trained, parameters and optimizer state on NVMe (ZeRO-3 offload_param and
    offload_optimizer nvme, max_in_cpu 0), gradients in host RAM;
  - lora: the same model frozen (its base on NVMe the same way) with LoRA adapters of rank --r on all
    seven linears; the adapters' state on the device tier.
and reads the metrics: per run the median step time (the first --skip steps left out), NVMe bytes read
and written per step, and the process's peak RSS (its own rusage, os.wait4). It prints each round's figures
and the medians over rounds of the same-round ratio lora / full of the step time.

Usage:
  .venv/bin/python tools/bench_lora.py --strata build/strata --dir out/bench-lora \\
      [--rounds 3] [--steps 8] [--layers 8] [--dim 512] [--r 16] [--json out/bench-lora.json]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

from benchlib import LICENSES, read_metrics


def make_config(args, lora, swap, metrics):
    c = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0},
        },
        "model": {"vocab_size": 256, "dim": args.dim, "n_layers": args.layers, "n_heads": args.dim // 64,
                  "n_kv_heads": max(1, args.dim // 256), "seq_len": args.seq, "tie_embeddings": False},
        "data": {"path": LICENSES, "format": "text", "val_fraction": 0.0, "eval_interval": 0},
        "run": {"steps": args.steps, "seed": 3, "metrics": metrics},
    }
    if lora:
        c["lora"] = {"r": args.r, "lora_alpha": 2 * args.r, "target_modules": "all-linear"}
    else:
        c["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": swap}
    return c


def run(args, name, lora):
    os.makedirs(args.dir, exist_ok=True)
    swap = os.path.join(args.dir, "swap-" + name)
    shutil.rmtree(swap, ignore_errors=True)
    os.makedirs(swap, mode=0o700)
    metrics = os.path.join(args.dir, name + ".jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cfg_path = os.path.join(args.dir, name + ".json")
    with open(cfg_path, "w") as f:
        json.dump(make_config(args, lora, swap, metrics), f, indent=1)
    log = os.path.join(args.dir, name + ".log")
    with open(log, "w") as out:
        p = subprocess.Popen([args.strata, "train", cfg_path], stdout=out, stderr=subprocess.STDOUT)
        # This child's own rusage (its peak RSS), not the largest of all children.
        _, status, usage = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        with open(log) as f:
            sys.exit(f"{name}: strata train failed:\n{f.read()[-3000:]}")
    lines = read_metrics(metrics)[args.skip:]
    shutil.rmtree(swap, ignore_errors=True)
    return {
        "step_s": statistics.median(l["step_s"] for l in lines),
        "bound_s": statistics.median(l["bound_s"] for l in lines),
        "nvme_read_bytes": statistics.median(l["nvme_read_bytes"] for l in lines),
        "nvme_write_bytes": statistics.median(l["nvme_write_bytes"] for l in lines),
        "tokens_per_s": statistics.median(l["tokens_per_s"] for l in lines),
        "peak_rss_gib": usage.ru_maxrss / 2**20,  # KiB on Linux
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strata", default="build/strata")
    ap.add_argument("--dir", default="out/bench-lora")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the medians")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--json", help="write every round's figures here")
    args = ap.parse_args()
    rounds = []
    for k in range(args.rounds):
        order = [("full", False), ("lora", True)] if k % 2 == 0 else [("lora", True), ("full", False)]
        fig = {name: run(args, name, lora) for name, lora in order}
        fig["ratio"] = fig["lora"]["step_s"] / fig["full"]["step_s"]
        rounds.append(fig)
        for name in ("full", "lora"):
            f = fig[name]
            print(f"round {k + 1} {name}: step {f['step_s']:.3f} s (bound {f['bound_s']:.3f} s), "
                  f"{f['tokens_per_s']:.0f} tokens/s, NVMe read {f['nvme_read_bytes'] / 2**20:.1f} MiB "
                  f"write {f['nvme_write_bytes'] / 2**20:.1f} MiB a step, peak RSS {f['peak_rss_gib']:.2f} GiB")
        print(f"round {k + 1}: lora / full step time {fig['ratio']:.3f}")
    print(f"median over {args.rounds} rounds: lora / full step time {statistics.median(r['ratio'] for r in rounds):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
