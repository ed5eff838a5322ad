"""What the benchmark scripts of tools/ share: bench_gpu.py and gpu_proof.py (the token file of the GPU
configs, the capacity bound of `strata plan --json`, the search for the largest layer count that fits),
and with bench_auto.py, bench_schedule.py, bench_offload.py, bench_ranks.py and bench_checkpoint.py (the
text files their configs train on, a metrics file's lines). A module of plain functions: it runs nothing when imported, and imports none of
the scripts, so that none of them imports another for these.

The scripts import it as a sibling module, as they import plan_rates.py (tools/ on sys.path: the
script's own directory when run as `python3 tools/X.py`).
"""
import array
import json
import os
import random

NOMINAL_TFLOPS = 989.0  # H100 SXM, dense bf16 (BENCHMARKS.md, "GPU")

# Text files most Linux hosts have: training data for the benchmarks' small models.
LICENSES = ["/usr/share/common-licenses/" + n for n in
            ("GPL-3", "GPL-2", "LGPL-2.1", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "Artistic")]


class PartStop(Exception):
    """A command failed or the part's time ran out."""


def ensure_tokens(path, count=8_000_000, vocab=32000):
    """Writes `count` uint16 token ids drawn at random (seed 0) to `path` unless a file that large is there."""
    if os.path.exists(path) and os.path.getsize(path) >= 2 * count:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    rng = random.Random(0)
    a = array.array("H", (rng.randrange(vocab) for _ in range(count)))
    with open(path + ".tmp", "wb") as f:
        a.tofile(f)
    os.replace(path + ".tmp", path)


def read_metrics(path):
    """The JSON objects of a metrics file (`strata train --metrics`), one per non-blank line."""
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def capacity_bound(plan):
    """The most parameters a machine could hold by `strata plan --json`'s figures: (HBM + RAM + free disk
    - the plan's non-state bytes) / its state bytes per parameter. Returns (that, bytes per parameter,
    non-state bytes); a capacity not measured (-1: the CPU device's own tier) counts 0."""
    cap = plan["capacity_bytes"]
    state = sum(plan["state_total_bytes"].values())
    non_state = sum(plan["total_bytes"].values()) - state
    per_param = state / plan["parameters"]
    return (max(cap["device"], 0) + cap["host"] + cap["nvme"] - non_state) / per_param, per_param, non_state


def largest_true(ok, guess, limit=4096):
    """The largest n >= 1 with ok(n), for ok true up to some n and false past it (0 when ok(1) is false):
    from the guess, steps of 1, 2, 4, ... outward to a bracket, then bisection; ok is asked O(log error)."""
    g = min(max(1, guess), limit)
    if ok(g):
        lo, step = g, 1
        while lo + step <= limit and ok(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step
        if hi > limit:
            raise PartStop(f"past {limit}: is the capacity measured?")
    else:
        hi, step = g, 1
        while hi - step >= 1 and not ok(hi - step):
            hi, step = hi - step, step * 2
        lo = hi - step
        if lo < 1:
            if hi == 1 or not ok(1):
                return 0
            lo = 1
    while hi - lo > 1:  # ok(lo), not ok(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
