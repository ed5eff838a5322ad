#!/usr/bin/env bash
# The most layers of CONFIG's model that `strata plan` says fit a machine (its verdict, exit 0), by
# bisection over model.n_layers; then that plan's state rows. BENCHMARKS.md ("LoRA over a frozen base")
# sizes the largest base LoRA trains on with it.
# Usage: tools/plan_largest_layers.sh CONFIG [strata plan flags...], e.g.
#   tools/plan_largest_layers.sh configs/lora-70b-h100.json --gpu h200 --host-memory-gb 124 --nvme-gb 60
set -euo pipefail
STRATA="${STRATA:-build/strata}"
cfg="$1"; shift
fits() { "$STRATA" plan "$cfg" "$@" --no-bound --set "model.n_layers=$n" >/dev/null 2>&1; }
lo=1; hi=4096
n=$lo; fits "$@" || { echo "not even 1 layer fits" >&2; exit 2; }
while [ $((hi - lo)) -gt 1 ]; do
  n=$(((lo + hi) / 2))
  if fits "$@"; then lo=$n; else hi=$n; fi
done
echo "largest model.n_layers that fits: $lo"
"$STRATA" plan "$cfg" "$@" --no-bound --set "model.n_layers=$lo" | grep -E "frozen base  |state total|^  total|this machine has"
