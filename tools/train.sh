#!/usr/bin/env bash
# Quick start, command 1: installs what is missing, builds, and runs the
# default training job (configs/tiny-cpu.json). Extra arguments go to
# `strata train`, e.g. tools/train.sh --steps 100.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/tools/setup.sh"
cd "$ROOT"
exec "${STRATA_BUILD_DIR:-build}/strata" train configs/tiny-cpu.json "$@"
