#!/usr/bin/env python3
"""Medians over rounds of tools/bench_adam_sweep.sh's JSON lines, as the
markdown table of BENCHMARKS.md: per size, threads and kernel the memory roof,
the step, the fused step with the bf16 emit and the two-pass variant (all ms,
from `strata bench-adam`), and LibTorch's AdamW against Strata's step (from
bench_adam_torch, which runs the CPU's best kernel)."""
import json
import statistics
import sys
from collections import defaultdict


def main(path):
    adam = defaultdict(list)
    torch = defaultdict(list)
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r["tool"] == "bench_adam_torch":
                torch[(r["numel"], r["threads"])].append(r)
            else:
                if r.get("state", "fp32") != "fp32":
                    continue  # bf16 moments are another comparison (BENCHMARKS.md)
                adam[(r["numel"], r["threads"], r["isa"])].append(r)
    rounds = max((r["round"] for v in adam.values() for r in v), default=0)
    print(f"medians of {rounds} rounds ({path})\n")
    print("| params | threads | kernel | roof ms (GB/s) | step ms | step / roof speed (>= 0.95) "
          "| fused + bf16 ms | two-pass ms | two-pass / fused (>= 1.3) | torch AdamW ms | Strata step ms "
          "| torch / Strata (>= 10) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (numel, threads, isa), rows in sorted(adam.items()):
        med = lambda key: statistics.median(r[key] for r in rows)
        cells = [f"{numel / 1e6:g}M", str(threads), isa,
                 f"{med('roof_ms'):.1f} ({med('roof_gbps'):.0f})", f"{med('step_ms'):.1f}",
                 f"{med('step_vs_roof'):.2f}", f"{med('strata_ms'):.1f}", f"{med('two_pass_ms'):.1f}",
                 f"{med('two_pass_vs_fused'):.2f}"]
        t = torch.get((numel, threads), [])
        if t and t[0]["isa"] == isa:
            tm = lambda key: statistics.median(r[key] for r in t)
            cells += [f"{tm('torch_ms'):.0f}", f"{tm('strata_ms'):.1f}", f"{tm('torch_vs_strata'):.1f}"]
        else:
            cells += ["", "", ""]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: bench_adam_summary.py FILE.jsonl")
    main(sys.argv[1])
