#!/usr/bin/env bash
# Start-up time of `strata train`, interleaved A/B between binaries: seconds from the command to the
# "model:" line (probes, allocations, the initial weights) and from "initial working copy" to it (the
# weights drawn and written to their tiers). The model: configs/tiny-cpu.json widened to 0.62 B parameters
# (dim 2048, 12 layers), one step, state in RAM (about 10 GiB). BENCHMARKS.md, "GPU, round 2".
#
# Usage: bash tools/bench_startup.sh [ROUNDS (3)] STRATA [STRATA ...]
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
    python3 - "$b" "$r" "$s" "$out" <<'PY'
import datetime as dt, re, sys
b, r, s, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
def at(pat):
    m = re.search(r"^\[(\d\d:\d\d:\d\d\.\d+)\][^\n]*" + pat, out, re.M)
    return dt.datetime.strptime(m.group(1), "%H:%M:%S.%f") if m else None
start = dt.datetime.fromtimestamp(s, tz=dt.timezone.utc).replace(tzinfo=None, year=1900, month=1, day=1)
model, init = at("model: "), at("initial working copy")
print(f"{b} round {r}: command to model line {(model - start).total_seconds():.2f} s, "
      f"initial weights {(model - init).total_seconds():.2f} s")
PY
  done
done
