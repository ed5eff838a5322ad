#!/usr/bin/env python3
"""GPU benchmarks of BENCHMARKS.md ("GPU"), run on a GPU host in one call each.

  a   A model that fits in HBM, no offload (configs/gpu-a-fits-hbm.json):
      `strata train` against a plain LibTorch training loop of the same model,
      dtype and recompute policy with LibTorch's fused AdamW
      (tools/bench_train_torch.cc), interleaved over rounds; tokens/s medians,
      the same-run ratio, and MFU = model FLOPs per token x tokens/s against
      the H100's nominal 989 TFLOP/s (bf16 dense) and against a large bf16 GEMM
      measured in the same run.

Each run trains --steps steps and takes the median of the steps after the
first --warmup. The token file the configs read (out/gpu-tokens.bin: uint16
tokens drawn at random; the data do not change the speed) is written first if
missing.

Usage (on the GPU host, from the repository root):
  python3 tools/bench_gpu.py a --strata .dev/bin/strata --torch-ref .dev/bin/bench_train_torch \\
      [--config configs/gpu-a-fits-hbm.json] [--rounds 2] [--steps 12] [--warmup 4] [--json OUT]
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

NOMINAL_TFLOPS = 989.0  # H100 SXM, dense bf16


def ensure_tokens(path, count=8_000_000, vocab=32000):
    if os.path.exists(path) and os.path.getsize(path) >= 2 * count:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    rng = random.Random(0)
    import array
    a = array.array("H", (rng.randrange(vocab) for _ in range(count)))
    with open(path + ".tmp", "wb") as f:
        a.tofile(f)
    os.replace(path + ".tmp", path)


def run(cmd, log, timeout):
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, timeout=timeout)
    if p.returncode != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        sys.exit(f"{' '.join(cmd)} failed (rc {p.returncode}) after {time.time() - t0:.0f} s:\n{tail}")
    return p.stdout


def strata_tokens_per_s(args, config, tag):
    metrics = os.path.join(args.dir, f"{tag}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    run([args.strata, "train", config, "--steps", str(args.steps), "--metrics", metrics,
         "--set", "run.log_level=\"warn\"", "--set", "data.eval_interval=0"],
        os.path.join(args.dir, f"{tag}.log"), args.timeout)
    lines = [json.loads(l) for l in open(metrics) if l.strip()]
    steps = [l for l in lines if "tokens_per_s" in l][args.warmup:]
    if not steps:
        sys.exit(f"{metrics}: no steps after the warm-up")
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=["a"])
    ap.add_argument("--strata", default=".dev/bin/strata")
    ap.add_argument("--torch-ref", default=".dev/bin/bench_train_torch")
    ap.add_argument("--config", default="configs/gpu-a-fits-hbm.json")
    ap.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench-gpu"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--ref-device", default="cuda", help="the reference's device (cpu: a smoke test anywhere)")
    ap.add_argument("--gemm-n", type=int, default=8192)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        sys.exit("--steps must exceed --warmup")
    out = bench_a(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
