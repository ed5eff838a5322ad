#!/usr/bin/env bash
# The CPU Adam figures of BENCHMARKS.md: `strata bench-adam` (the CPU's best
# kernel and AVX2 forced) and `bench_adam_torch` for 25M and 100M parameters
# at each thread count, in rounds, appended as JSON lines to one file; then the
# table of medians over rounds (tools/bench_adam_summary.py).
#   tools/bench_adam_sweep.sh [--strata PATH] [--torch-tool PATH] [--threads "1 2"]
#                             [--rounds N] [--out FILE]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STRATA=$ROOT/build/strata
TORCH_TOOL=$ROOT/build/tests/bench_adam_torch
THREADS="1 2"
ROUNDS=3
OUTFILE=$ROOT/out/bench-adam.jsonl
while [ $# -gt 0 ]; do
  case "$1" in
    --strata) STRATA=$2; shift 2 ;;
    --torch-tool) TORCH_TOOL=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --out) OUTFILE=$2; shift 2 ;;
    *) echo "bench_adam_sweep.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
for f in "$STRATA" "$TORCH_TOOL"; do
  [ -x "$f" ] || { echo "bench_adam_sweep.sh: '$f' is not an executable (build it first)" >&2; exit 2; }
done
mkdir -p "$(dirname "$OUTFILE")"
: >"$OUTFILE"
LOG=$OUTFILE.log  # the tools' own progress lines and errors
: >"$LOG"
trap 'echo "bench_adam_sweep.sh: a run failed; see $LOG" >&2' ERR
tag() {  # adds the round (and a tool name) to one JSON object on stdin
  python3 -c "import json, sys; t = sys.stdin.read(); t.strip() or sys.exit(1); print(json.dumps({**json.loads(t), **json.loads(sys.argv[1])}))" "$1"
}
for round in $(seq "$ROUNDS"); do
  for n in 25000000 100000000; do
    if [ $n = 25000000 ]; then reps=15; treps=5; else reps=9; treps=3; fi
    for t in $THREADS; do
      echo "round $round/$ROUNDS: $n parameters, $t threads" >&2
      for isa in auto avx2; do
        "$STRATA" bench-adam --numel $n --threads $t --reps $reps --isa $isa --json 2>>"$LOG" \
          | tag "{\"round\": $round, \"tool\": \"bench-adam\"}" >>"$OUTFILE"
      done
      "$TORCH_TOOL" --numel $n --threads $t --reps $treps --json 2>>"$LOG" \
        | tag "{\"round\": $round, \"tool\": \"bench_adam_torch\"}" >>"$OUTFILE"
    done
  done
done
python3 "$ROOT/tools/bench_adam_summary.py" "$OUTFILE"
