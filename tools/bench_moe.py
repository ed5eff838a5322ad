#!/usr/bin/env python3
"""A mixture of experts with its state on NVMe against a dense model of the same active parameters, on this
machine's CPU.

Each round trains two models on the same data and seed, one right after the other (the order alternates
between rounds), both with parameters and optimizer state on NVMe (ZeRO-3 offload_param and
offload_optimizer nvme, max_in_cpu 0):
  - moe: configs/moe-cpu.json's model (mixtral: --experts experts of --width a layer, top --top-k, the
    load-balancing loss in the loss);
  - dense: the same model with one SwiGLU of top-k x width a layer instead of the experts: the matrices a
    token meets are the same (the router's E x dim aside), its parameters 1/(E / k) of the experts'.
and reads the metrics: per run the median step time and bound (the first --skip steps left out), NVMe bytes
read and written per step, tokens/s, the parameters and the process's peak RSS. It prints each round's figures
and the medians over rounds of the same-round ratios moe / dense of the step time, and of each run's step over
its own bound.

Usage:
  .venv/bin/python tools/bench_moe.py --strata build/strata --dir out/bench-moe \\
      [--rounds 3] [--steps 6] [--json out/bench-moe.json]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

from benchlib import read_metrics

HERE = os.path.dirname(os.path.abspath(__file__))


def make_config(args, moe, swap, metrics):
    with open(os.path.join(HERE, "..", "configs", "moe-cpu.json")) as f:  # its // comments dropped
        c = json.loads("\n".join(l for l in f.read().splitlines() if not l.lstrip().startswith("//")))
    m = c["model"]
    m.update(num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.width)
    if not moe:
        for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "router_aux_loss_coef",
                  "output_router_logits"):
            m.pop(k, None)
        m.update(family="llama", ffn_hidden=args.top_k * args.width)
    c["zero_optimization"]["offload_param"]["nvme_path"] = swap
    c["zero_optimization"]["offload_optimizer"]["nvme_path"] = swap
    c["data"] = dict(c["data"], val_fraction=0.0, eval_interval=0)
    c["run"] = dict(c.get("run", {}), steps=args.steps, metrics=metrics)
    c["run"].pop("checkpoint", None)
    return c


def run(args, name, moe):
    swap = os.path.join(args.dir, "swap-" + name)
    shutil.rmtree(swap, ignore_errors=True)
    os.makedirs(swap, mode=0o700)
    metrics = os.path.join(args.dir, name + ".jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cfg_path = os.path.join(args.dir, name + ".json")
    with open(cfg_path, "w") as f:
        json.dump(make_config(args, moe, swap, metrics), f, indent=1)
    plan = json.loads(subprocess.run([args.strata, "plan", cfg_path, "--json", "--no-bound"], check=True,
                                     capture_output=True, text=True).stdout)
    log = os.path.join(args.dir, name + ".log")
    with open(log, "w") as out:
        p = subprocess.Popen([args.strata, "train", cfg_path], stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(p.pid, 0)  # this child's own peak RSS
    shutil.rmtree(swap, ignore_errors=True)
    if os.waitstatus_to_exitcode(status) != 0:
        with open(log) as f:
            sys.exit(f"{name}: strata train failed:\n{f.read()[-3000:]}")
    lines = read_metrics(metrics)[args.skip:]
    med = lambda k: statistics.median(l[k] for l in lines)  # noqa: E731
    out = {k: med(k) for k in ("step_s", "bound_s", "nvme_read_bytes", "nvme_write_bytes", "tokens_per_s")}
    out.update(parameters=plan["parameters"], peak_rss_gib=usage.ru_maxrss / 2**20,
               step_over_bound=statistics.median(l["step_s"] / l["bound_s"] for l in lines),
               losses=[l["loss"] for l in read_metrics(metrics)])
    if moe:
        out.update(active_parameters=plan["experts"]["active_parameters"],
                   aux_loss=[l["aux_loss"] for l in read_metrics(metrics)],
                   expert_load_last=read_metrics(metrics)[-1]["expert_load"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strata", default="build/strata")
    ap.add_argument("--dir", default="out/bench-moe")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the medians")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--json", help="write every round's figures here")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    rounds = []
    for k in range(args.rounds):
        order = [("moe", True), ("dense", False)] if k % 2 == 0 else [("dense", False), ("moe", True)]
        fig = {name: run(args, name, moe) for name, moe in order}
        fig["ratio"] = fig["moe"]["step_s"] / fig["dense"]["step_s"]
        rounds.append(fig)
        for name in ("moe", "dense"):
            f = fig[name]
            print(f"round {k + 1} {name}: {f['parameters'] / 1e6:.1f} M parameters"
                  + (f" ({f['active_parameters'] / 1e6:.1f} M active)" if name == "moe" else "")
                  + f"; step {f['step_s']:.3f} s (bound {f['bound_s']:.3f} s, step/bound {f['step_over_bound']:.2f}), "
                  f"{f['tokens_per_s']:.0f} tokens/s, NVMe read {f['nvme_read_bytes'] / 2**20:.1f} MiB "
                  f"write {f['nvme_write_bytes'] / 2**20:.1f} MiB a step, peak RSS {f['peak_rss_gib']:.2f} GiB",
                  flush=True)
        print(f"round {k + 1}: moe / dense step time {fig['ratio']:.3f}", flush=True)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    print(f"median over {args.rounds} rounds: moe / dense step time {med(r['ratio'] for r in rounds):.3f}; "
          f"step/bound moe {med(r['moe']['step_over_bound'] for r in rounds):.2f}, "
          f"dense {med(r['dense']['step_over_bound'] for r in rounds):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
