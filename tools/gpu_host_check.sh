#!/usr/bin/env bash
# Runs a build made on the dev machine on a lent GPU host (device tool): the
# test binaries on that host's CPU (AVX-512) and GPU, then the CPU Adam
# benchmarks. The host has LibTorch 2.11.0+cu130 in its python3 (the same
# build the binaries link) but none of the Debian libraries, so those travel.
#
# Here, before the call (the folder .dev/ is git-ignored): `bash tools/gpu_prepare.sh [--tests]` does all
# of the following, fetches DeepSpeed's carried set and dry-runs gpu-proof-2 with the copies; by hand:
#   rm -rf .dev/bin && mkdir -p .dev/bin .dev/lib   (no test binary left from an earlier build)
#   strip -o .dev/bin/strata build/strata
#   for t in build/tests/*_test build/tests/bench_adam_torch build/tests/bench_train_torch build/tests/rank_worker; do strip -o .dev/bin/${t##*/} $t; done
#   cp -L /lib/x86_64-linux-gnu/{libtbb.so.12,liburing.so.2,libspdlog.so.1.10,libfmt.so.9} .dev/lib/
# Then run `bash tools/gpu_host_check.sh [tests|bench|ranks|gpu-a|gpu-b|gpu-c|gpu-ranks|gpu-suite|gpu-race|
# gpu-plans|gpu-proof|gpu-proof-2|gpu-b-trace|gpu-b-schedules|gpu-b-speculate|gpu-b-determinism|all]` there with carry [".dev"]; logs and
# JSON lines go to $OUT (or out/gpu-host). BENCH_THREADS and BENCH_ROUNDS set the sweep
# (tools/bench_adam_sweep.sh; default "1 2 16" threads, 2 rounds). `ranks` runs
# tools/bench_ranks.py at world sizes RANKS_SIZES (default 1,2,4,8) on all cores. `gpu-a`, `gpu-b`,
# `gpu-c` run GPU benchmarks (a)-(c) (tools/bench_gpu.py a|b|c: (a) strata against a plain LibTorch
# loop, GPU_ROUNDS rounds, default 2); `gpu-ranks` trains configs/tiny-cpu.json on the GPU at stage 3
# with one rank, then two ranks sharing it over Gloo with the same global batch (staged collectives:
# docs/design.md, "Ranks on a device"), and prints both runs' losses and per-rank bytes side by side; `gpu-suite` runs the test
# binaries that have GPU cases; `gpu-race` the race probe (tools/gpu_race.json: three GPU runs that must
# agree bit for bit); `gpu-plans` `strata plan` of configs/gpu-*.json with every rate probed on the host;
# `gpu-proof` all three and one round of (a) in one call; `gpu-b-trace` (b)'s plan, then B_STEPS
# (default 3) of its steps with the trace; `gpu-b-schedules` and `gpu-b-speculate` part b of
# gpu-proof-2 alone ((b) under layer with the optimizer behind the backward, under micro_batch, and clipped,
# against its compute-only step), `gpu-b-determinism` its part det (run.deterministic: two runs bit for bit,
# and the cost).
# `gpu-proof-2` runs tools/gpu_proof.py: the parts of the GPU proof's second round in a call of about
# 9 minutes, a time budget per part (PROOF_BUDGET, PROOF_BUDGET_<PART>; PROOF_PARTS picks parts: on a lent
# host every part takes two calls, "suite,b,det,e,ranks" then "c,act,d"; act is (b) with run.recompute auto
# against always, the activations' MFU), one line per part and $OUT/gpu-proof-2.json. DRY_RUN=1 runs that mode on this
# machine's CPU with tiny configs and the build folder's binaries (BIN=build PYTHON=.venv/bin/python: what
# the test GpuProofDryRun does); it copies nothing into the build folder.
# `all` includes none of the GPU modes.
set -uo pipefail
WHAT=${1:-all}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BIN=${BIN:-$ROOT/.dev/bin}
PY=${PYTHON:-python3}
DEST=${OUT:-$ROOT/out/gpu-host}
mkdir -p "$DEST"

SITE=$("$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
LD=$ROOT/.dev/lib:$SITE/torch/lib
for d in "$SITE"/nvidia/*/lib; do LD=$LD:$d; done
export LD_LIBRARY_PATH=$LD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# cli_test runs the strata binary from the build folder it was compiled for;
# ranks_test starts its worker from there too. Always the carried ones: a warm
# host keeps an earlier call's copies.
if [ -z "${DRY_RUN:-}" ]; then
  install -D -m755 "$BIN/strata" /work/main/build/strata
  if [ -x "$BIN/rank_worker" ]; then install -D -m755 "$BIN/rank_worker" /work/main/build/tests/rank_worker; fi
fi

{
  echo "== host"; date -u; uname -r; nproc; free -g | head -2
  lscpu | grep -E 'Model name|Socket|Thread|Core|NUMA node\(s\)|L3'
  echo "avx512 flags: $(grep -o 'avx512[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
  "$PY" -c 'import sys, torch; print("torch", torch.__version__, "python", sys.version.split()[0])'
  df -h "${TMPDIR:-/tmp}" "$ROOT" | tail -n +2
} 2>&1 | tee "$DEST/host.txt"

if [ "$WHAT" = gpu-proof-2 ]; then
  echo "== gpu-proof-2 (tools/gpu_proof.py)"
  PYTHONUNBUFFERED=1 "$PY" "$ROOT/tools/gpu_proof.py" --bin "$BIN" --out "$DEST" ${DRY_RUN:+--dry-run} \
    ${PROOF_PARTS:+--parts "$PROOF_PARTS"} ${PROOF_BUDGET:+--budget "$PROOF_BUDGET"}
  exit $?
fi

if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  echo "== tests"
  export OMP_NUM_THREADS=1
  pids=()
  for t in "$BIN"/*_test; do
    name=${t##*/}
    ( timeout 400 "$t" --gtest_brief=1 >"$DEST/$name.log" 2>&1; echo "$name rc=$?" >>"$DEST/tests.txt" ) &
    pids+=($!)
  done
  wait "${pids[@]}"
  sort "$DEST/tests.txt"
  grep -h -E '^\[  (PASSED|SKIPPED|FAILED) ' "$DEST"/*_test.log | sort | uniq -c
  grep -h -E '^\[  (FAILED|SKIPPED) +\]' "$DEST"/*_test.log | head -40
  # One file for the logs ($OUT brings back at most 8 files).
  (cd "$DEST" && tar czf test-logs.tgz *_test.log tests.txt && rm -f *_test.log)
  unset OMP_NUM_THREADS
fi

if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  echo "== bench-adam and bench_adam_torch"
  bash "$ROOT/tools/bench_adam_sweep.sh" --strata "$BIN/strata" --torch-tool "$BIN/bench_adam_torch" \
    --threads "${BENCH_THREADS:-1 2 16}" --rounds "${BENCH_ROUNDS:-2}" --out "$DEST/bench-adam.jsonl"
fi

if [ "$WHAT" = ranks ] || [ "$WHAT" = all ]; then
  echo "== bench_ranks"
  python3 "$ROOT/tools/bench_ranks.py" --strata "$BIN/strata" --dir "${TMPDIR:-/tmp}/bench-ranks" \
    --world-sizes "${RANKS_SIZES:-1,2,4,8}" --rounds "${BENCH_ROUNDS:-2}" --steps 4 \
    --json "$DEST/bench-ranks.json" 2>&1 | tee "$DEST/bench-ranks.log"
fi

if [ "$WHAT" = gpu-ranks ]; then
  # Part "ranks" of tools/gpu_proof.py: tiny-cpu on the GPU at stage 3, one rank, then two sharing it over
  # Gloo, the same global batch; losses side by side and bytes per rank.
  PYTHONUNBUFFERED=1 "$PY" "$ROOT/tools/gpu_proof.py" --bin "$BIN" --out "$DEST" --parts ranks ${DRY_RUN:+--dry-run}
fi

if [ "$WHAT" = gpu-suite ] || [ "$WHAT" = gpu-proof ]; then
  echo "== GPU suite (device, kernels, step, layer_ops, comm, cli tests on the GPU host)"
  suite="${TMPDIR:-/tmp}/gpu-suite"
  rm -rf "$suite" && mkdir -p "$suite"
  pids=()
  for name in device_test kernels_test step_test layer_ops_test comm_test cli_test; do
    ( cd "$suite" && OMP_NUM_THREADS=2 timeout "${SUITE_TIMEOUT:-240}" "$BIN/$name" >"$suite/$name.log" 2>&1
      echo "$name rc=$?" >>"$suite/tests.txt" ) &
    pids+=($!)
  done
fi

if [ "$WHAT" = gpu-race ] || [ "$WHAT" = gpu-proof ]; then
  # The race probe: a tiny fp32 model with the 16-bit parameters on NVMe, cpu_checkpointing,
  # gradients split device/host and the optimizer device/host/NVMe (tools/gpu_race.json), 5 steps,
  # twice as it runs and once with CUDA_LAUNCH_BLOCKING=1. Every loss and gradient norm must agree
  # bit for bit: a difference means a missing wait. The CPU device's run is printed beside them.
  echo "== race probe"
  race="${TMPDIR:-/tmp}/gpu-race"
  rm -rf "$race" && mkdir -p "$race/swap"
  cp "$ROOT/tools/gpu_race.json" "$race/race.json"
  python3 -c "
import array, random
r = random.Random(0)
array.array('H', (r.randrange(256) for _ in range(200000))).tofile(open('$race/tok.bin', 'wb'))"
  for run in first second blocking cpu; do
    env=(); sets=()
    [ $run = blocking ] && env=(CUDA_LAUNCH_BLOCKING=1)
    [ $run = cpu ] && sets=(--set 'run.device="cpu"')
    ( cd "$race" && env ${env[@]+"${env[@]}"} timeout 120 "$BIN/strata" train race.json ${sets[@]+"${sets[@]}"} --metrics "m-$run.jsonl" \
        --trace "t-$run.json" >"$race/$run.log" 2>&1; echo "race $run rc=$?" )
  done
  python3 - "$race" <<'PY' | tee "$DEST/race.txt"
import json, sys
w = sys.argv[1]
runs = {}
for r in ("first", "second", "blocking", "cpu"):
    try:
        runs[r] = [json.loads(l) for l in open(f"{w}/m-{r}.jsonl") if l.strip()]
    except OSError as e:
        print(f"{r}: no metrics ({e})")
print("step " + "  ".join(f"{r:>24s}" for r in runs))
n = max((len(v) for v in runs.values()), default=0)
for i in range(n):
    print(f"{i + 1:4d} " + "  ".join(f"{v[i]['loss']:.17g}/{v[i]['grad_norm']:.6g}" if i < len(v) else "-" for v in runs.values()))
gpu = [runs[r] for r in ("first", "second", "blocking") if r in runs]
same = len(gpu) == 3 and all(len(g) == 5 for g in gpu) and all(
    (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]) for g in gpu[1:] for a, b in zip(gpu[0], g))
print("race probe:", "the three GPU runs agree bit for bit" if same else "THE GPU RUNS DIFFER (or one failed)")
if "cpu" in runs and gpu:
    d = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(gpu[0], runs["cpu"]))
    print(f"largest relative loss difference from the CPU device: {d:.3g}")
PY
  tar czf "$DEST/gpu-race.tgz" -C "$race" --exclude=swap --exclude=tok.bin . 2>/dev/null || true
fi

if [ "$WHAT" = gpu-suite ] || [ "$WHAT" = gpu-proof ]; then
  wait "${pids[@]}"
  sort "$suite/tests.txt" | tee "$DEST/gpu-suite.txt"
  grep -h -E '^\[  (PASSED|SKIPPED|FAILED) ' "$suite"/*_test.log | sort | uniq -c | tee -a "$DEST/gpu-suite.txt"
  grep -h -B30 -E '^\[  FAILED  \] [A-Za-z]' "$suite"/*_test.log | head -120 | tee -a "$DEST/gpu-suite.txt"
  grep -h -E '^\[  SKIPPED \] [A-Za-z]' "$suite"/*_test.log | head -40 | tee -a "$DEST/gpu-suite.txt"
  tar czf "$DEST/gpu-suite.tgz" -C "$suite" . 2>/dev/null || true
fi

if [ "$WHAT" = gpu-plans ] || [ "$WHAT" = gpu-proof ]; then
  # The step's bound of the GPU configs with every rate probed on this host.
  echo "== strata plan of configs/gpu-*.json, rates probed here"
  mkdir -p out/swap
  for c in configs/gpu-*.json; do
    timeout 120 "$BIN/strata" plan "$c" --probe-seconds 1 2>&1 | tee -a "$DEST/gpu-plans.txt"
    timeout 120 "$BIN/strata" plan "$c" --probe-seconds 1 --json 2>>"$DEST/gpu-plans.txt" |
      python3 -c 'import json, sys; print(json.dumps(json.load(sys.stdin)))' >>"$DEST/gpu-plans.jsonl"
  done
fi

if [ "$WHAT" = gpu-proof ]; then
  echo "== GPU benchmark (a), one round"
  PYTHONUNBUFFERED=1 timeout "${GPU_A_TIMEOUT:-200}" python3 "$ROOT/tools/bench_gpu.py" a --strata "$BIN/strata" \
    --torch-ref "$BIN/bench_train_torch" --rounds 1 --deadline "${GPU_A_TIMEOUT:-200}" --dir "${TMPDIR:-/tmp}/bench-gpu-a" \
    --json "$DEST/bench-gpu-a.json" 2>&1 | tee "$DEST/bench-gpu-a.log"
fi

if [ "$WHAT" = gpu-b-trace ]; then
  # (b)'s model: its plan with every rate probed here, then B_STEPS steps with the trace and
  # metrics (step_s against bound_s, the optimizer's seconds and the compute's wait for it).
  echo "== kernels_test"
  timeout 120 "$BIN/kernels_test" 2>&1 | grep -E '^\[  (PASSED|FAILED|SKIPPED) |Failure|Which is' | tee "$DEST/kernels.txt"
  work="${TMPDIR:-/tmp}/gpu-b-trace"
  rm -rf "$work" && mkdir -p "$work" out/swap
  python3 -c "import sys; sys.path.insert(0, 'tools'); import benchlib; benchlib.ensure_tokens('out/gpu-tokens.bin')"
  echo "== strata plan configs/gpu-b-llama8b.json"
  timeout 120 "$BIN/strata" plan configs/gpu-b-llama8b.json --probe-seconds 1 2>&1 | tee "$DEST/plan-b.txt" | tail -14
  echo "== (b), ${B_STEPS:-3} steps with the trace"
  timeout "${B_TIMEOUT:-190}" "$BIN/strata" train configs/gpu-b-llama8b.json --steps "${B_STEPS:-3}" \
    --set data.eval_interval=0 --metrics "$work/m.jsonl" --trace "$work/t.json" >"$work/log.txt" 2>&1
  echo "rc=$?"; grep -v '^train ' "$work/log.txt" | cut -c1-240 | tail -12
  python3 -c "
import json
for l in open('$work/m.jsonl'):
    d = json.loads(l)
    print(f\"step {d['step']}: {d['step_s']:.3f} s, bound {d['bound_s']:.3f}, optimizer {d['optimizer_s']:.3f} (wait {d['optimizer_wait_s']:.3f}), {d['tokens_per_s']:.0f} tok/s\")
" 2>&1
  tar czf "$DEST/gpu-b-trace.tgz" -C "$work" . 2>/dev/null || true
fi

# (b) under both schedules with the optimizer behind the backward, and run.deterministic: parts b and det
# of tools/gpu_proof.py (gpu-proof-2 runs them with the rest).
case "$WHAT" in
  gpu-b-schedules|gpu-b-speculate) part=b ;;
  gpu-b-determinism) part=det ;;
  *) part= ;;
esac
if [ -n "$part" ]; then
  PYTHONUNBUFFERED=1 "$PY" "$ROOT/tools/gpu_proof.py" --bin "$BIN" --out "$DEST" --parts "$part" ${DRY_RUN:+--dry-run}
fi

case "$WHAT" in
  gpu-a|gpu-b|gpu-c)
    which=${WHAT#gpu-}
    echo "== GPU benchmark ($which)"
    work="${TMPDIR:-/tmp}/bench-gpu-$which"
    rm -rf "$work"
    PYTHONUNBUFFERED=1 python3 "$ROOT/tools/bench_gpu.py" "$which" --strata "$BIN/strata" \
      --torch-ref "$BIN/bench_train_torch" --rounds "${GPU_ROUNDS:-2}" --deadline "${GPU_DEADLINE:-560}" --dir "$work" \
      --json "$DEST/bench-gpu-$which.json" 2>&1 | tee "$DEST/bench-gpu-$which.log"
    # One file for every log and metrics file ($OUT brings back at most 8).
    tar czf "$DEST/bench-gpu-$which-logs.tgz" -C "$work" . 2>/dev/null || true
    ;;
esac
