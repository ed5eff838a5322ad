#!/usr/bin/env bash
# The test suites under AddressSanitizer + UndefinedBehaviorSanitizer (README, "Tests"). Run after
# tools/setup.sh (it installs the Debian packages both builds need).
#   tools/test_sanitize.sh [CTEST ARGS]         the libraries that never include LibTorch (util, nvme, cpu_adam,
#                                               config, data, memory, plan) and their suites, in build-asan-leaf: what
#                                               every CI run does after the main suite (tools/test.sh), minutes
#   tools/test_sanitize.sh --full [CTEST ARGS]  the whole project in build-asan (CUDA path off): about 20 minutes
#                                               to build and 15 to test on 2 cores
# A UBSan finding ends its process (-fno-sanitize-recover), so it fails its test. Leak checks run in the leaf
# build; the full build turns them off (LibTorch's own start-up allocations are reported as leaks).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MODE=leaf
if [ "${1:-}" = --full ]; then MODE=full; shift; fi
say() { echo "[sanitize] $*" >&2; }
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
WERROR=""
[ "${CI:-}" = "true" ] && WERROR="-DSTRATA_WERROR=ON"
if [ "$MODE" = leaf ]; then
  BUILD=build-asan-leaf
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
  if [ ! -f "$BUILD/build.ninja" ]; then
    say "configuring $BUILD (ASan + UBSan, the libraries without LibTorch)"
    cmake -S . -B "$BUILD" -G Ninja -DSTRATA_LEAF_ONLY=ON -DSTRATA_SANITIZE=ON $WERROR >/dev/null
  fi
  say "building $BUILD"
  cmake --build "$BUILD" -j "${STRATA_JOBS:-$(nproc)}"
else
  BUILD=build-asan
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0}"
  STRATA_BUILD_DIR="$BUILD" STRATA_CMAKE_ARGS="-DSTRATA_SANITIZE=ON -DSTRATA_CUDA=OFF $WERROR" "$ROOT/tools/setup.sh"
fi
say "testing $BUILD (ASAN_OPTIONS=$ASAN_OPTIONS UBSAN_OPTIONS=$UBSAN_OPTIONS)"
exec ctest --test-dir "$BUILD" -j "$(nproc)" --output-on-failure --timeout 900 "$@"
