#!/usr/bin/env bash
# Start-up time of `strata train`, interleaved A/B between binaries: seconds from the command to the
# "model:" line (probes, allocations, the initial weights) and from "initial working copy" to it (the
# weights drawn and written to their tiers). The model: configs/tiny-cpu.json widened to 0.62 B parameters
# (dim 2048, 12 layers), one step, state in RAM (about 10 GiB). BENCHMARKS.md, "GPU, round 2".
#
# Usage: bash tools/bench_startup.sh [ROUNDS (3)] STRATA [STRATA ...]   (STRATA paths from the repository root)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROUNDS=3
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then ROUNDS=$1; shift; fi
[ $# -ge 1 ] || { echo "usage: bash tools/bench_startup.sh [ROUNDS] STRATA [STRATA ...]" >&2; exit 2; }
for r in $(seq 1 "$ROUNDS"); do
  for b in "$@"; do
    s=$(date +%s.%N)
    out=$("$b" train configs/tiny-cpu.json --steps 1 --set model.dim=2048 --set model.n_layers=12 \
      --set model.n_heads=16 --set model.n_kv_heads=16 --set model.ffn_hidden=5632 --set model.seq_len=64 \
      --set train_micro_batch_size_per_gpu=1 --set data.eval_interval=0 --set 'run.log_level="info"' 2>&1) ||
      { echo "$out" | tail -3 >&2; exit 1; }
    printf '%s' "$out" | python3 -c '
import datetime as dt, re, sys
b, r, s = sys.argv[1], sys.argv[2], float(sys.argv[3])
out = sys.stdin.read()
def at(pat):  # the log line times are local (spdlog), as is the start below
    m = re.search(r"^\[(\d\d:\d\d:\d\d\.\d+)\][^\n]*" + pat, out, re.M)
    if not m:
        sys.exit(f"{b}: no line matching {pat!r} in its output")
    return dt.datetime.strptime(m.group(1), "%H:%M:%S.%f")
start = dt.datetime.fromtimestamp(s).replace(year=1900, month=1, day=1)
model, init = at("model: "), at("initial working copy")
day = dt.timedelta(days=1)
since = lambda a, z: ((z - a) % day).total_seconds()  # across midnight too
print(f"{b} round {r}: command to model line {since(start, model):.2f} s, "
      f"initial weights {since(init, model):.2f} s")
' "$b" "$r" "$s"
  done
done
