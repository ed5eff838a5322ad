#!/usr/bin/env python3
"""placement "auto" by the step's bound against the greedy fill, measured.

A model whose state does not fit the host RAM auto may use (placement.headroom
keeps most of it free), so auto must spill to NVMe and its candidate fills
differ (docs/design.md, "The step's bound": which category goes down a tier
first). Each round
  1. probes the bound's rates once (`strata plan --json --probe-seconds`, the
     disk through the I/O engine in the swap directory),
  2. plans with those rates given (run.rates) with placement.by_bound true and
     false: auto's choice, its bound, the runner-up's, and the greedy fill's,
  3. trains both, interleaved, with the same rates (so both runs place as
     their plans said), and reads each run's median step and bound_s.
It prints per round and as medians: the choice, bound and step of each, and
the same-run ratio step(by the bound) / step(greedy).

Usage:
  .venv/bin/python tools/bench_auto.py --strata build/strata --dir /tmp/bench-auto \\
      [--rounds 3] [--steps 4] [--headroom 0.9] [--layers 20] [--dim 1024] [--json out.json]
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


def make_config(args, swap):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "sub_group_size": 1 << 22},
        "placement": {"auto": True, "nvme_path": swap, "headroom": args.headroom},
        "model": {"vocab_size": 256, "dim": args.dim, "n_layers": args.layers, "n_heads": args.dim // 64,
                  "n_kv_heads": args.dim // 64, "seq_len": args.seq_len, "tie_embeddings": True},
        "data": {"path": [p for p in LICENSES if os.path.exists(p)], "format": "text", "val_fraction": 0.0,
                 "eval_interval": 0},
        "run": {"steps": args.steps + 2, "seed": 1, "log_level": "warn"},
    }


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench_auto: {' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p.stdout


def tiers(plan):
    """Where each category went, in words ("grad host 2.1 GB, nvme 0.3 GB; ...")."""
    out = []
    for cat, by_tier in plan["state_bytes"].items():
        parts = [f"{t} {b / 1e9:.2f} GB" for t, b in by_tier.items() if b]
        out.append(f"{cat} " + ", ".join(parts))
    return "; ".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata", default="build/strata")
    ap.add_argument("--dir", required=True, help="scratch directory (configs, metrics, NVMe swap)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run (after 2 warm-up steps)")
    ap.add_argument("--headroom", type=float, default=0.9, help="placement.headroom: the share of RAM auto keeps free")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--probe-seconds", type=float, default=1.0)
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    swap = os.path.join(args.dir, "swap")
    cfg_path = os.path.join(args.dir, "auto.json")
    with open(cfg_path, "w") as f:
        json.dump(make_config(args, swap), f, indent=1)
    rounds = []
    try:
        for rnd in range(args.rounds):
            os.makedirs(swap, exist_ok=True)
            probed = json.loads(run([args.strata, "plan", "--json", "--probe-seconds", str(args.probe_seconds), "--reprobe",
                                     cfg_path]))["bound"]["rates"]
            rates = run_rates(probed)
            sets = [f"--set=run.rates.{k}={v:.6g}" for k, v in rates.items()]
            rd = {"rates": rates, "runs": {}}
            for name, by_bound in (("by bound", True), ("greedy", False)):
                plan = json.loads(run([args.strata, "plan", "--json", cfg_path, *sets,
                                       f"--set=placement.by_bound={str(by_bound).lower()}"]))
                choice = plan.get("auto_choice") or "(greedy fill, not judged)"
                rd["runs"][name] = {"plan_bound_s": plan["bound"]["seconds"], "binding": plan["bound"]["binding"],
                                    "choice": choice, "placement": tiers(plan)}
            print(f"round {rnd + 1}: rates " + ", ".join(f"{k} {v:.3g}" for k, v in rates.items()), flush=True)
            for name in ("by bound", "greedy"):
                r = rd["runs"][name]
                print(f"  {name}: plan bound {r['plan_bound_s']:.3f} s by {r['binding']}; "
                      f"choice: {r['choice']}\n    {r['placement']}", flush=True)
            for name, by_bound in (("by bound", True), ("greedy", False)):
                metrics = os.path.join(args.dir, f"metrics-{name.replace(' ', '-')}.jsonl")
                run([args.strata, "train", cfg_path, "--metrics", metrics, *sets,
                     f"--set=placement.by_bound={str(by_bound).lower()}"])
                steps = read_metrics(metrics)[2:]
                r = rd["runs"][name]
                r["step_s"] = statistics.median(s["step_s"] for s in steps)
                r["bound_s"] = statistics.median(s["bound_s"] for s in steps)
                r["step_over_bound"] = statistics.median(s["step_s"] / s["bound_s"] for s in steps)
                print(f"  {name}: step {r['step_s']:.3f} s, bound_s {r['bound_s']:.3f} s, "
                      f"step / bound {r['step_over_bound']:.3f}", flush=True)
                shutil.rmtree(swap, ignore_errors=True)
                os.makedirs(swap, exist_ok=True)
            rd["by_bound_over_greedy"] = rd["runs"]["by bound"]["step_s"] / rd["runs"]["greedy"]["step_s"]
            print(f"  step by the bound / greedy: {rd['by_bound_over_greedy']:.3f}", flush=True)
            rounds.append(rd)
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    print(f"\nmedians of {args.rounds} rounds:")
    print(f"{'placement':10} {'plan bound s':>12} {'bound_s':>8} {'step s':>8} {'step/bound':>10}")
    for name in ("by bound", "greedy"):
        med = lambda k: statistics.median(rd["runs"][name][k] for rd in rounds)
        print(f"{name:10} {med('plan_bound_s'):12.3f} {med('bound_s'):8.3f} {med('step_s'):8.3f} "
              f"{med('step_over_bound'):10.3f}")
    print(f"step by the bound / greedy (same round): "
          f"{statistics.median(rd['by_bound_over_greedy'] for rd in rounds):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rounds, f, indent=1)


if __name__ == "__main__":
    main()
