#!/usr/bin/env bash
# Prepares .dev/ (git-ignored) for a lent GPU host, here on the dev machine, so that the device call spends
# its minutes on the GPU: the build's binaries stripped into .dev/bin (strata, bench_train_torch,
# rank_worker, step_test and kernels_test and, with --tests, every test binary), the Debian libraries they load into .dev/lib, and
# DeepSpeed's carried set into .dev/deepspeed (tools/fetch_deepspeed.sh, once: its ops compiled for the
# host's Python 3.12); then checks the build holds sm_90 code (an H100's), runs `gpu-proof-2` in its dry run
# with these very binaries, and prints what the call carries (at most 64 MiB).
#
# Then, through the device tool: `bash tools/gpu_host_check.sh gpu-proof-2` with carry [".dev"]
# (about 9 minutes; PROOF_PARTS=c,d ... for a second call).
#
# Usage: bash tools/gpu_prepare.sh [--tests] [--no-deepspeed] [BUILD_DIR (default build)]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TESTS=0 DS=1 BUILD=build
for a in "$@"; do
  case "$a" in
    --tests) TESTS=1 ;;
    --no-deepspeed) DS=0 ;;
    -*) echo "gpu_prepare.sh: unknown option $a" >&2; exit 2 ;;
    *) BUILD=$a ;;
  esac
done
for f in "$BUILD/strata" "$BUILD/tests/bench_train_torch" "$BUILD/tests/rank_worker"; do
  [ -x "$f" ] || { echo "gpu_prepare.sh: no $f: build first (tools/setup.sh)" >&2; exit 2; }
done
# The CUDA kernels' targets, as nvcc is told (build.ninja): an H100 runs sm_90 code.
if ! grep -q 'code=sm_90\|sm_90\]' "$BUILD/build.ninja"; then
  echo "gpu_prepare.sh: $BUILD has no CUDA code for an H100 (sm_90): cmake -S . -B $BUILD -DSTRATA_CUDA=ON" \
       "-DCMAKE_CUDA_ARCHITECTURES=90 && cmake --build $BUILD -j2" >&2
  exit 2
fi
rm -rf .dev/bin .dev/lib
mkdir -p .dev/bin .dev/lib
strip -o .dev/bin/strata "$BUILD/strata"
# The test binaries gpu-proof-2's part "suite" runs, beside the tools.
for t in "$BUILD/tests/bench_train_torch" "$BUILD/tests/bench_adam_torch" "$BUILD/tests/rank_worker" \
         "$BUILD/tests/step_test" "$BUILD/tests/kernels_test"; do
  [ -x "$t" ] && strip -o ".dev/bin/${t##*/}" "$t"
done
if [ "$TESTS" = 1 ]; then
  for t in "$BUILD"/tests/*_test; do strip -o ".dev/bin/${t##*/}" "$t"; done
fi
for l in libtbb.so.12 liburing.so.2 libspdlog.so.1.10 libfmt.so.9; do cp -L "/lib/x86_64-linux-gnu/$l" .dev/lib/; done
if [ "$DS" = 1 ] && ! ls .dev/deepspeed/whl/deepspeed-*.whl >/dev/null 2>&1; then
  bash tools/fetch_deepspeed.sh
fi
echo "== gpu-proof-2, dry run with the carried binaries"
DRY_RUN=1 BIN=$PWD/.dev/bin PYTHON=$PWD/.venv/bin/python OUT=/tmp/gpu-prepare-dry bash tools/gpu_host_check.sh gpu-proof-2 |
  grep -E '^part |^gpu-proof-2 done'
du -sh .dev/* && du -sh .dev
# What travels: the tracked tree and .dev, 64 MiB in all.
size=$(( $(du -sm .dev | cut -f1) + $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) / 1048576 + 1 ))
if [ "$size" -gt 64 ]; then echo "gpu_prepare.sh: the call would carry ${size} MiB: at most 64" >&2; exit 2; fi
echo "the call carries about ${size} MiB (the tracked tree and .dev; at most 64)"
echo "ready: run \`bash tools/gpu_host_check.sh gpu-proof-2\` on the GPU host with carry [\".dev\"]"
