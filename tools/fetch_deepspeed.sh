#!/usr/bin/env bash
# Fetches, here (where PyPI and Debian are reachable), what GPU benchmark (d)
# needs on a GPU host that reaches nothing: DeepSpeed's source distribution
# (its ops are JIT-built there, against the host's torch), the wheels of the
# dependencies that host lacks (hjson, pydantic and its own), and the libaio
# .debs its async I/O op builds against. Into .dev/deepspeed/ (git-ignored),
# carried with the call (carry [".dev"]); tools/bench_deepspeed.py --install
# installs them there. The GPU host runs Python 3.12.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEST=.dev/deepspeed
PIP=${PIP:-.venv/bin/pip}
mkdir -p "$DEST/whl" "$DEST/deb"
"$PIP" download -q --no-deps --no-binary=:all: "deepspeed==${DEEPSPEED_VERSION:-0.19.8}" -d "$DEST/whl"
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST/whl" hjson "pydantic==2.14.3" "pydantic-core==2.50.4" annotated-types typing-inspection typing-extensions
(cd "$DEST/deb" && apt-get download libaio1 libaio-dev >/dev/null)
ls -la "$DEST/whl" "$DEST/deb"
du -sh "$DEST"
