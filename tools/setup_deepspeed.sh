#!/usr/bin/env bash
# DeepSpeed for the side-by-side benchmark on this machine's CPU (tools/bench_deepspeed.py --device cpu;
# README "Benchmarks"). Idempotent: a second run checks and returns in seconds.
#   - its own virtual environment, .deps/deepspeed-cpu/venv (git-ignored), holding deepspeed==0.19.8 from
#     PyPI and what it needs; torch 2.11.0 and transformers are the project's .venv's (tools/setup.sh), seen
#     through a .pth file, so both engines run the same LibTorch;
#   - Debian's libaio-dev (DeepSpeed's async_io op links libaio);
#   - DeepSpeed's CPU ops (cpu_adam, async_io and the pin_memory op it loads, the shared-memory
#     communication op its CPU accelerator loads at start) JIT-built once into .deps/deepspeed-cpu/ext, the
#     TORCH_EXTENSIONS_DIR the benchmark sets, so that no timing ever includes a build. The build's seconds
#     are printed and kept in .deps/deepspeed-cpu/build.json (the benchmark's report carries them).
# Needs tools/setup.sh first (.venv with torch). About 2 minutes of pip and 2-4 of compiling on 2 cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
DS_VERSION=0.19.8
DEST=.deps/deepspeed-cpu
VENV=$DEST/venv
EXT=$ROOT/$DEST/ext
say() { echo "[setup_deepspeed] $*" >&2; }

if ! .venv/bin/python -c "import torch, transformers" 2>/dev/null; then
  echo "setup_deepspeed.sh: .venv has no torch/transformers: run tools/setup.sh first" >&2
  exit 2
fi
if ! dpkg-query -W -f='${Status}' libaio-dev 2>/dev/null | grep -q "install ok installed"; then
  say "installing Debian's libaio-dev (DeepSpeed's async_io op)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends libaio-dev >/dev/null
fi

PY=$VENV/bin/python
if ! "$PY" -c "import deepspeed, sys; sys.exit(deepspeed.__version__ != '$DS_VERSION')" 2>/dev/null; then
  say "virtual environment $VENV with deepspeed==$DS_VERSION (torch and transformers from .venv)"
  rm -rf "$VENV"
  mkdir -p "$DEST"
  # The same interpreter as .venv's, so that its site-packages (torch's extension modules) load.
  BASE_PY=$("$ROOT/.venv/bin/python" -c 'import sys, os; print(os.path.join(sys.base_prefix, "bin", "python3"))')
  "$BASE_PY" -m venv "$VENV"
  SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' >"$SITE/strata-dotvenv.pth"
  "$PY" -m pip install -q --disable-pip-version-check setuptools wheel
  # An sdist whose setup.py imports torch: no build isolation, so that it sees .venv's torch (an isolated
  # build would download another). DS_BUILD_OPS=0: ops are JIT-built below, for this CPU.
  DS_ACCELERATOR=cpu DS_BUILD_OPS=0 "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation \
    "deepspeed==$DS_VERSION"
fi

if [ ! -f "$DEST/build.json" ] || ! ls "$EXT"/deepspeed_shm_comm/*.so "$EXT"/cpu_adam/*.so "$EXT"/async_io/*.so >/dev/null 2>&1; then
  say "building DeepSpeed's CPU ops (cpu_adam, async_io, pin_memory, deepspeed_shm_comm) into $EXT, once"
  rm -rf "$EXT"
  mkdir -p "$EXT"
  DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$EXT MAX_JOBS=2 "$PY" - "$DEST/build.json" <<'EOF'
import json, sys, time
t0 = time.time()
from deepspeed.accelerator import get_accelerator
acc = get_accelerator()
assert acc.device_name() == "cpu", acc.device_name()
seconds = {}
for op in ("CPUAdamBuilder", "AsyncIOBuilder", "ShareMemCommBuilder"):
    t = time.time()
    acc.create_op_builder(op).load(verbose=False)
    seconds[op] = round(time.time() - t, 1)
out = {"ops_build_s": seconds, "total_s": round(time.time() - t0, 1), "when": time.strftime("%Y-%m-%d %H:%M:%S")}
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
print(json.dumps(out))
EOF
  say "built: $(cat "$DEST/build.json")"
else
  say "DeepSpeed $DS_VERSION and its CPU ops are ready ($(cat "$DEST/build.json"))"
fi
