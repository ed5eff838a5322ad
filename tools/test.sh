#!/usr/bin/env bash
# Quick start, command 2: installs what is missing, builds, and runs the whole
# test suite with CTest. Under CI (CI=true) warnings are errors and the CUDA
# path is required (-DSTRATA_CUDA=ON: a missing nvcc or CPU-only LibTorch fails
# the configure instead of silently leaving the .cu files out). Then the leaf
# libraries' suites under ASan + UBSan (tools/test_sanitize.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ "${CI:-}" = "true" ]; then
  export STRATA_CMAKE_ARGS="${STRATA_CMAKE_ARGS:-} -DSTRATA_WERROR=ON -DSTRATA_CUDA=ON"
fi
"$ROOT/tools/setup.sh"
BUILD_DIR="${STRATA_BUILD_DIR:-build}"
rc=0
ctest --test-dir "$BUILD_DIR" -j "$(nproc)" --output-on-failure "$@" || rc=$?
# Then the libraries without LibTorch and their suites under ASan + UBSan, in a build folder of their own
# (tools/test_sanitize.sh; STRATA_SANITIZE_LEAF=0 leaves them out of a run by hand).
if [ "${STRATA_SANITIZE_LEAF:-1}" != 0 ]; then
  "$ROOT/tools/test_sanitize.sh" || rc=$?
fi
exit "$rc"
