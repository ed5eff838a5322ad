#!/usr/bin/env bash
# Prepares, here (where PyPI and Debian are reachable), what GPU benchmark (d) needs on a GPU host that
# reaches nothing, whose Python 3.12 holds torch 2.11.0+cu130, transformers 5.17.0, numpy and more
# (HOST_PACKAGES below) but no DeepSpeed: DeepSpeed built into a wheel with its ops compiled (cpu_adam,
# async_io and the pin_memory op async_io loads; none compiles CUDA source, and the torch they link is the
# host's wheel, built for cp312), the wheels of what DeepSpeed needs that the host lacks (hjson, pydantic
# and its own), and the libaio .debs async_io loads. Into .dev/deepspeed/ (git-ignored), carried with the
# call (carry [".dev"]); `tools/bench_deepspeed.py --install` unpacks them on the host with no pip,
# compiler or network. Then it checks, in a virtual environment of Python 3.12 holding torch and
# HOST_PACKAGES (what the host has), that the carried set imports, loads its ops and builds nothing
# (`tools/bench_deepspeed.py --check-carried`).
#
# Needs python3.12 (PY312; default: the first python3.12 on PATH or under ~/.pyenv/versions), the CUDA
# toolkit at /usr/local/cuda (headers only: the ops include them), and about 6 GB in .deps/ for the two
# virtual environments (torch's CUDA wheels). Takes about 10 minutes on 2 cores, most of it the compile
# (kept in .deps/deepspeed/built: a later run reuses it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
DEST=.dev/deepspeed
DEPS=.deps/deepspeed
DS_VERSION=${DEEPSPEED_VERSION:-0.19.8}
TORCH_VERSION=2.11.0
is312() { [ -n "$1" ] && "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; }
if [ -z "${PY312:-}" ]; then
  for c in "$(command -v python3.12 || true)" "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    if is312 "$c"; then PY312=$c; break; fi
  done
fi
if ! is312 "${PY312:-}"; then
  echo "fetch_deepspeed.sh: no Python 3.12 (the GPU host's): set PY312" >&2; exit 2
fi
say() { echo "[fetch_deepspeed] $*"; }
rm -rf "$DEST"
mkdir -p "$DEST/whl" "$DEST/deb" "$DEPS"

venv() {  # venv DIR: Python 3.12 with torch and its own dependencies only
  if ! "$1/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    say "virtual environment $1 (Python 3.12, torch==$TORCH_VERSION)"
    rm -rf "$1"
    "$PY312" -m venv "$1"
    "$1/bin/pip" install -q --disable-pip-version-check "torch==$TORCH_VERSION"
  fi
}
venv "$DEPS/build"
venv "$DEPS/check"
# The GPU host's image holds these beside torch (the device docs' package list, 2026-11; versions where
# they give them): the check environment gets them too, and they are not carried.
HOST_PACKAGES="transformers==5.17.0 numpy==2.5.2 safetensors==0.8.0 tokenizers==0.23.2 einops msgpack ninja psutil
  py-cpuinfo packaging tqdm pyyaml regex"
# shellcheck disable=SC2086
"$DEPS/check/bin/pip" install -q --disable-pip-version-check $HOST_PACKAGES

say "DeepSpeed $DS_VERSION source, libaio .debs"
"$DEPS/build/bin/pip" download -q --disable-pip-version-check --no-deps --no-binary=:all: "deepspeed==$DS_VERSION" -d "$DEPS/src"
(cd "$DEST/deb" && apt-get download libaio1 libaio-dev 2>&1 | grep -v "unsandboxed" || true)
rm -rf "$DEPS/aio" && mkdir -p "$DEPS/aio"
for d in "$DEST"/deb/*.deb; do dpkg -x "$d" "$DEPS/aio"; done
AIOLIB=$ROOT/$DEPS/aio/usr/lib/x86_64-linux-gnu
ln -sfn libaio.so.1 "$AIOLIB/libaio.so" 2>/dev/null || true
[ -e "$AIOLIB/libaio.so" ] || ln -sfn "$(basename "$(ls "$AIOLIB"/libaio.so.1.* | head -1)")" "$AIOLIB/libaio.so"

say "DeepSpeed's dependencies the host lacks (cp312 wheels)"
REQS=$(tar xzf "$DEPS/src/deepspeed-$DS_VERSION.tar.gz" -O "deepspeed-$DS_VERSION/requirements/requirements.txt" | grep -v '^torch')
rm -rf "$DEPS/wheels" && mkdir -p "$DEPS/wheels"
# shellcheck disable=SC2086
"$DEPS/build/bin/pip" download -q --disable-pip-version-check --only-binary=:all: -d "$DEPS/wheels" $REQS
# What the host has already: the check environment's packages (torch's own and HOST_PACKAGES).
"$DEPS/check/bin/pip" freeze --all | sed 's/==.*//' | tr 'A-Z_' 'a-z-' >"$DEPS/host-has.txt"
# Carried whatever the check environment holds: DeepSpeed's config models need pydantic 2, which the
# device docs' package list does not name (here typer brings it in).
ALWAYS=" pydantic pydantic-core annotated-types typing-inspection hjson "
for w in "$DEPS"/wheels/*.whl; do
  name=$(basename "$w" | cut -d- -f1 | tr 'A-Z_' 'a-z-')
  case "$ALWAYS" in *" $name "*) cp "$w" "$DEST/whl/"; continue ;; esac
  grep -qx "$name" "$DEPS/host-has.txt" || cp "$w" "$DEST/whl/"
done

BUILT=$DEPS/built
if ls "$BUILT"/deepspeed-"$DS_VERSION"-*.whl >/dev/null 2>&1 && [ -z "${FORCE_BUILD:-}" ]; then
  say "DeepSpeed's wheel with its ops compiled: an earlier run's ($BUILT; FORCE_BUILD=1 builds it again)"
else
say "building DeepSpeed with cpu_adam and async_io compiled (MAX_JOBS=2)"
rm -rf "$BUILT" && mkdir -p "$BUILT"
# DeepSpeed compiles its CPU ops with -march=native: this machine's CPU (an AMD EPYC) is not the GPU
# host's (an Intel Xeon). A g++ ahead on PATH swaps it for what both have: x86-64-v4 (AVX-512 F, BW, CD,
# DQ, VL) and AVX-512 BF16 (csrc's __AVX512__ path with BF16_AVAILABLE).
mkdir -p "$DEPS/cc"
REAL_GXX=$(command -v g++)
for n in g++ c++; do
  printf '#!/bin/sh\n# tools/fetch_deepspeed.sh: -march=native -> a portable AVX-512 target\nfor a; do shift; case "$a" in -march=native) set -- "$@" -march=x86-64-v4 -mavx512bf16;; *) set -- "$@" "$a";; esac; done\nexec %s "$@"\n' "$REAL_GXX" >"$DEPS/cc/$n"
  chmod +x "$DEPS/cc/$n"
done
"$DEPS/build/bin/pip" install -q --disable-pip-version-check setuptools wheel $REQS
# (An earlier run's tree is kept: its compiled objects are reused.)
[ -d "$DEPS/src/deepspeed-$DS_VERSION" ] || tar xzf "$DEPS/src/deepspeed-$DS_VERSION.tar.gz" -C "$DEPS/src"
# async_io links -lcuda: the toolkit's stub here (no driver); the GPU host's driver has the real one.
STUBS=/usr/local/cuda/lib64/stubs
(
  cd "$DEPS/src/deepspeed-$DS_VERSION"
  export PATH="$ROOT/$DEPS/cc:$PATH" DS_ACCELERATOR=cuda DS_BUILD_OPS=0 DS_BUILD_CPU_ADAM=1 DS_BUILD_AIO=1 DS_BUILD_PIN_MEMORY=1 \
    DS_BUILD_STRING="" CUDA_HOME=/usr/local/cuda MAX_JOBS=2 TORCH_CUDA_ARCH_LIST="9.0" \
    CPATH="$ROOT/$DEPS/aio/usr/include" LIBRARY_PATH="$AIOLIB:$STUBS" LD_LIBRARY_PATH="$AIOLIB" \
    CFLAGS="-I$ROOT/$DEPS/aio/usr/include" LDFLAGS="-L$AIOLIB -L$STUBS"
  "$ROOT/$DEPS/build/bin/pip" wheel -v --disable-pip-version-check --no-deps --no-build-isolation . \
    -w "$ROOT/$BUILT" >"$ROOT/$DEPS/build.log" 2>&1 ||
    { tail -40 "$ROOT/$DEPS/build.log"; exit 1; }
)
# The ops are built with -g: without their debug sections the wheel is a seventh of its size (a device
# call carries at most 64 MiB). wheel unpack/pack rewrite its RECORD.
rm -rf "$DEPS/unpacked"
"$DEPS/build/bin/python" -m wheel unpack -d "$DEPS/unpacked" "$BUILT"/deepspeed-*.whl >/dev/null
find "$DEPS/unpacked" -name '*.so' -exec strip --strip-debug {} +
rm "$BUILT"/deepspeed-*.whl
"$DEPS/build/bin/python" -m wheel pack -d "$BUILT" "$DEPS"/unpacked/deepspeed-* >/dev/null
fi
cp "$BUILT"/deepspeed-"$DS_VERSION"-*.whl "$DEST/whl/"
ls -la "$DEST/whl" "$DEST/deb"
du -sh "$DEST"
size=$(du -sm "$DEST" | cut -f1)
[ "$size" -le 16 ] || echo "fetch_deepspeed.sh: WARNING: $DEST is $size MiB (the GPU host's packages carried too?): a call carries 64 MiB in all" >&2

say "checking the carried set in a Python 3.12 environment holding what the host does ($DEPS/check)"
"$DEPS/check/bin/python" tools/bench_deepspeed.py --check-carried --json "$DEPS/check.json"
