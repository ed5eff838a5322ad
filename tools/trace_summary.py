#!/usr/bin/env python3
"""Where a training step's time goes, from a `strata train --trace FILE` trace.

Sums the trace's spans per track (compute, copy, nvme, adam, comm) and kind (the span's name with its
numbers made '#': "backward layer.# mb #" is every layer's backward of every micro-batch), over the steps
after the first --skip, and prints seconds a step, largest first. A step is counted at its head's span for
micro-batch 0 (evaluation's head has no span) and starts at the last forward of the embedding for micro-batch 0
before it; an evaluation's forward spans, where data.eval_interval runs one, count in the forward rows. Spans of
one track do not overlap; spans of different tracks run beside each
other (the optimizer's and the copies' threads), so the rows of different tracks do not add up to the step.

Usage:
  build/strata train CONFIG --trace /tmp/run.trace.json
  python3 tools/trace_summary.py /tmp/run.trace.json [--skip 2] [--top 15] [--json OUT]
"""
import argparse
import collections
import json
import re
import sys

TRACKS = {1: "compute", 2: "copy", 3: "nvme", 4: "adam", 5: "comm"}
STEP_START = "forward embedding mb 0"
STEP_HEAD = "head forward + backward head mb 0"


def summarise(events, skip):
    spans = [e for e in events if e.get("ph") == "X"]
    heads = sorted(e["ts"] for e in spans if e["name"] == STEP_HEAD)
    if len(heads) <= skip:
        raise SystemExit(f"trace_summary: the trace has {len(heads)} steps ('{STEP_HEAD}' spans); "
                         f"--skip {skip} leaves none")
    starts = [e["ts"] for e in spans if e["name"] == STEP_START and e["ts"] <= heads[skip]]
    t0 = max(starts) if starts else heads[skip]
    steps = len(heads) - skip
    sums = collections.defaultdict(float)
    for e in spans:
        if e["ts"] < t0:
            continue
        kind = re.sub(r"\d+", "#", e["name"])
        sums[(TRACKS.get(e.get("tid"), str(e.get("tid"))), kind)] += e["dur"] / 1e6
    rows = [{"track": t, "kind": k, "s_per_step": v / steps} for (t, k), v in sums.items()]
    rows.sort(key=lambda r: -r["s_per_step"])
    return steps, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--skip", type=int, default=2, help="steps left out at the start (default 2)")
    ap.add_argument("--top", type=int, default=15, help="rows printed (default 15)")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    try:
        with open(a.trace) as f:
            events = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"trace_summary: {a.trace}: {e}")
    steps, rows = summarise(events, a.skip)
    print(f"{a.trace}: {steps} steps after the first {a.skip}; seconds a step")
    for r in rows[:a.top]:
        print(f"  {r['s_per_step']:8.3f}  {r['track']:8s} {r['kind']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"steps": steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
