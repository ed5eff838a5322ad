#!/usr/bin/env python3
"""tools/trace_summary.py on a trace made here with known spans: seconds a step per track and kind, the
first --skip steps left out, evaluations between steps not counted as steps, and a trace with too few steps
refused in one line."""
import json
import os
import subprocess
import sys
import tempfile

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "trace_summary.py")


def span(name, tid, ts, dur):
    return {"ph": "X", "name": name, "tid": tid, "pid": 1, "ts": ts, "dur": dur}


def main():
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "strata"}}]
    # 4 steps of 1 s; step k's layer 0 and 1 backward take (k + 1) x 0.1 s each, its head 0.3 s, Adam 0.5 s.
    for k in range(4):
        t = k * 1_000_000
        events.append(span("forward embedding mb 0", 1, t, 1_000))
        events.append(span("head forward + backward head mb 0", 1, t + 10_000, 300_000))
        for layer in (0, 1):
            events.append(span(f"backward layer.{layer} mb 0", 1, t + 400_000 + layer * 200_000, (k + 1) * 100_000))
        events.append(span("adam sub-group 3", 4, t + 50_000, 500_000))
        # An evaluation after every step: its forward only (no head span), 0.05 s.
        events.append(span("forward embedding mb 0", 1, t + 900_000, 50_000))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.json")
        with open(path, "w") as f:
            json.dump(events, f)
        out = os.path.join(d, "rows.json")
        subprocess.run([sys.executable, TOOL, path, "--skip", "2", "--json", out], check=True,
                       stdout=subprocess.DEVNULL)
        with open(out) as f:
            got = json.load(f)
        rows = {(r["track"], r["kind"]): r["s_per_step"] for r in got["rows"]}
        assert got["steps"] == 2, got
        # Steps 2 and 3: 2 layers x 0.3 s and 2 x 0.4 s, over 2 steps.
        assert abs(rows[("compute", "backward layer.# mb #")] - 0.7) < 1e-9, rows
        assert abs(rows[("compute", "head forward + backward head mb #")] - 0.3) < 1e-9, rows
        # Steps 2 and 3's embedding forwards and the evaluations after them: 2 x (0.001 + 0.05) s over 2 steps.
        assert abs(rows[("compute", "forward embedding mb #")] - 0.051) < 1e-9, rows
        assert abs(rows[("adam", "adam sub-group #")] - 0.5) < 1e-9, rows
        assert got["rows"][0]["kind"] == "backward layer.# mb #", got["rows"][0]
        bad = subprocess.run([sys.executable, TOOL, path, "--skip", "4"], capture_output=True, text=True)
        assert bad.returncode != 0 and "leaves none" in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr
    print("trace_summary_test: ok")


if __name__ == "__main__":
    main()
