#!/usr/bin/env python3
"""What keeping activations saves: the same model trained with every layer
recomputed in its backward (run.recompute "always", a quarter more FLOPs) and
with the plan's activation placement (run.recompute "auto": on the CPU device,
every layer's entries kept in RAM when they fit; docs/design.md, "Activation
placement"), in one run.

The model (default 8 layers of dim 768, seq 256, fp32, state in RAM on the CPU
device) trains A micro-batches a step. Each round trains both modes (in
alternating order), each for --warmup + --steps steps, and reads the metrics:
per mode the median step time and the model FLOPs the plan counts per step
(`strata plan --json`: bound.flops when given, the recomputed FLOPs from
activations.recomputed_flops_per_step); the same-round ratios auto / always
of the step time and their median over the rounds.

Usage:
  .venv/bin/python tools/bench_activations.py --strata build/strata --dir /tmp/bench-act \\
      [--rounds 3] [--steps 3] [--accum 2] [--layers 8] [--dim 768] [--seq-len 256] [--json out.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

from benchlib import LICENSES, read_metrics

MODES = ["always", "auto"]


def make_config(args, mode, metrics):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "model": {"vocab_size": 256, "dim": args.dim, "n_layers": args.layers, "n_heads": max(1, args.dim // 64),
                  "seq_len": args.seq_len},
        "data": {"path": [p for p in LICENSES if os.path.exists(p)], "eval_interval": 0},
        "run": {"steps": args.warmup + args.steps, "log_level": "warn", "recompute": mode, "metrics": metrics},
    }


def plan_of(args, cfg_path):
    p = subprocess.run([args.strata, "plan", cfg_path, "--json", "--no-bound"], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench_activations: strata plan {cfg_path} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return json.loads(p.stdout)


def run_once(args, mode, tag):
    metrics = os.path.join(args.dir, f"{tag}.jsonl")
    cfg_path = os.path.join(args.dir, f"{tag}.json")
    with open(cfg_path, "w") as f:
        json.dump(make_config(args, mode, metrics), f)
    if os.path.exists(metrics):
        os.remove(metrics)
    act = plan_of(args, cfg_path)["activations"]
    p = subprocess.run([args.strata, "train", cfg_path], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench_activations: strata train {cfg_path} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    lines = read_metrics(metrics)[args.warmup:]
    return {"step_s": statistics.median(l["step_s"] for l in lines), "loss": lines[-1]["loss"],
            "recomputed_layers": act["recomputed_layers"], "kept_layers": act["keep_device_layers"] + act["keep_device_micro_batches"] / act["micro_batches"],
            "recomputed_flops_per_step": act["recomputed_flops_per_step"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata", default="build/strata")
    ap.add_argument("--dir", required=True, help="scratch directory (configs, metrics)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per step (gradient_accumulation_steps)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    results = {m: [] for m in MODES}
    for rnd in range(args.rounds):
        for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):
            r = run_once(args, mode, f"{mode}-r{rnd}")
            results[mode].append(r)
            print(f"round {rnd + 1}: {mode:6} step {r['step_s']:.3f} s, layers kept {r['kept_layers']}, "
                  f"recomputed {r['recomputed_layers']} ({r['recomputed_flops_per_step'] / 1e9:.1f} GFLOP a step), "
                  f"loss {r['loss']:.6f}", flush=True)
    ratio = [b["step_s"] / a["step_s"] for a, b in zip(results["always"], results["auto"])]
    losses_equal = all(a["loss"] == b["loss"] for a, b in zip(results["always"], results["auto"]))
    print(f"\nmedians of {args.rounds} rounds (A = {args.accum}, {args.layers} layers of dim {args.dim}, "
          f"seq {args.seq_len}):")
    for mode in MODES:
        print(f"  {mode:6} step {statistics.median(r['step_s'] for r in results[mode]):.3f} s")
    print(f"auto / always, same round: {', '.join(f'{x:.3f}' for x in ratio)} (median {statistics.median(ratio):.3f}); "
          f"last losses equal: {losses_equal}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "ratio": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
