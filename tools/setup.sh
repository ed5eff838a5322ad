#!/usr/bin/env bash
# Installs what is missing (Debian packages, LibTorch in .venv), configures and
# builds Strata into build/. Idempotent: a second run only rebuilds what changed.
#   tools/setup.sh            Release-ish build (RelWithDebInfo)
# Environment: STRATA_BUILD_DIR (default build), STRATA_CMAKE_ARGS (extra cmake
# arguments), STRATA_JOBS (default: number of cores), CMAKE_PREFIX_PATH (a
# LibTorch of your own; then no .venv is made).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD_DIR="${STRATA_BUILD_DIR:-build}"
JOBS="${STRATA_JOBS:-$(nproc)}"
TORCH_VERSION="2.11.0"
TRANSFORMERS_VERSION="5.23.0"
SAFETENSORS_VERSION="0.8.0"
TOKENIZERS_VERSION="0.23.3"
TENSORBOARD_VERSION="2.21.0"
PYARROW_VERSION="26.0.1"
PEFT_VERSION="0.21.2"

say() { echo "[setup] $*" >&2; }

# ---- Debian packages --------------------------------------------------------
PKGS=(cmake g++ pkg-config python3-venv liburing-dev libtbb-dev libspdlog-dev nlohmann-json3-dev
      libcli11-dev libgtest-dev libgmock-dev libbenchmark-dev ninja-build ccache fio libgloo-dev)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# ---- LibTorch from PyPI's torch wheel, in a project-local venv ---------------
if [ -z "${CMAKE_PREFIX_PATH:-}" ]; then
  if ! .venv/bin/python -c "import torch,sys; sys.exit(0 if torch.__version__.split('+')[0]=='$TORCH_VERSION' else 1)" 2>/dev/null; then
    say "installing torch==$TORCH_VERSION into .venv (LibTorch for the C++ build)"
    python3 -m venv .venv
    .venv/bin/pip install -q --disable-pip-version-check "torch==$TORCH_VERSION"
  fi
  # matplotlib: the plots of tools/bench_offload.py and other benchmark scripts.
  if ! .venv/bin/python -c "import matplotlib" 2>/dev/null; then
    say "installing matplotlib into .venv (benchmark plots)"
    .venv/bin/pip install -q --disable-pip-version-check matplotlib
  fi
  # transformers, safetensors and tokenizers (pinned): the Hugging Face checks
  # of export and model.init_from compare Strata with transformers' models;
  # tools/tokenize.py encodes with tokenizers.
  if ! .venv/bin/python -c "import transformers, safetensors, tokenizers, sys; sys.exit(0 if (transformers.__version__, safetensors.__version__, tokenizers.__version__) == ('$TRANSFORMERS_VERSION', '$SAFETENSORS_VERSION', '$TOKENIZERS_VERSION') else 1)" 2>/dev/null; then
    say "installing transformers==$TRANSFORMERS_VERSION safetensors==$SAFETENSORS_VERSION tokenizers==$TOKENIZERS_VERSION into .venv (Hugging Face checks, tools/tokenize.py)"
    .venv/bin/pip install -q --disable-pip-version-check "transformers==$TRANSFORMERS_VERSION" \
      "safetensors==$SAFETENSORS_VERSION" "tokenizers==$TOKENIZERS_VERSION"
  fi
  # tensorboard (pinned): monitors_test reads the event files of the
  # `tensorboard` config block back; pyarrow (pinned): tools/tokenize.py's
  # Parquet input.
  if ! .venv/bin/python -c "import tensorboard, pyarrow, sys; sys.exit(0 if (tensorboard.__version__, pyarrow.__version__) == ('$TENSORBOARD_VERSION', '$PYARROW_VERSION') else 1)" 2>/dev/null; then
    say "installing tensorboard==$TENSORBOARD_VERSION pyarrow==$PYARROW_VERSION into .venv (monitor checks, Parquet input)"
    .venv/bin/pip install -q --disable-pip-version-check "tensorboard==$TENSORBOARD_VERSION" "pyarrow==$PYARROW_VERSION"
  fi
  # peft (pinned): the LoRA checks compare Strata's adapters with PEFT's
  # layers and files (tests/lora_test.cc).
  if ! .venv/bin/python -c "import peft, sys; sys.exit(0 if peft.__version__ == '$PEFT_VERSION' else 1)" 2>/dev/null; then
    say "installing peft==$PEFT_VERSION into .venv (LoRA checks)"
    .venv/bin/pip install -q --disable-pip-version-check "peft==$PEFT_VERSION"
  fi
  TORCH_PREFIX="$(.venv/bin/python -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)"
  export CMAKE_PREFIX_PATH="$TORCH_PREFIX"
fi

# ---- configure and build ----------------------------------------------------
export PATH="/usr/local/cuda/bin:$PATH"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
# Configure when there is no build yet or when extra arguments are given
# (cmake keeps its cache, so a re-configure is quick).
if [ ! -f "$BUILD_DIR/build.ninja" ] || [ -n "${STRATA_CMAKE_ARGS:-}" ]; then
  say "configuring $BUILD_DIR"
  # shellcheck disable=SC2086
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_PREFIX_PATH="$CMAKE_PREFIX_PATH" ${STRATA_CMAKE_ARGS:-} >/dev/null
fi
say "building $BUILD_DIR with $JOBS jobs"
cmake --build "$BUILD_DIR" -j "$JOBS"
