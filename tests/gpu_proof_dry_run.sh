#!/usr/bin/env bash
# GpuProofDryRun: `tools/gpu_host_check.sh gpu-proof-2` end to end on this machine's CPU with tiny configs
# (DRY_RUN=1), so that a broken proof script is found here and not in a GPU host's short device time; then
# checks what each part reported. Usage: tests/gpu_proof_dry_run.sh BUILD_DIR [WITH_CUDA: ON (default) or OFF]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="$(cd "$1" && pwd)"
OUT="$(mktemp -d)"
WORK="$(mktemp -d)"
trap 'rm -rf "$OUT" "$WORK"' EXIT
PY="$ROOT/.venv/bin/python"
rc=0
DRY_RUN=1 BIN="$BUILD" PYTHON="$PY" OUT="$OUT" TMPDIR="$WORK" bash "$ROOT/tools/gpu_host_check.sh" gpu-proof-2 || rc=$?
"$PY" - "$OUT" "$rc" "${2:-ON}" <<'PY'
import json, os, sys
out, rc = sys.argv[1], int(sys.argv[2])
with_cuda = sys.argv[3].upper() in ("ON", "TRUE", "1", "YES")
r = json.load(open(os.path.join(out, "gpu-proof-2.json")))
p = r["parts"]
bad = []
def check(ok, what):
    if not ok:
        bad.append(what)
check(r["dry_run"], "the report does not say it was a dry run")
check(sorted(p) == sorted(["suite", "b", "det", "c", "act", "d", "e", "ranks", "lora", "moe"]), f"parts reported: {sorted(p)}")
# On a machine without a GPU the suite's GPU cases run and skip; none may fail. A build without the CUDA path
# has no kernels_test: the dry run must say it skipped it, and only there.
st = p.get("suite", {}).get("tests", {})
check(set(st) == {"step_test", "kernels_test"}, f"suite: binaries {sorted(st)}")
ran = {n: c for n, c in st.items() if not c.get("missing")}
want_ran = {"step_test", "kernels_test"} if with_cuda else {"step_test"}
check(set(ran) == want_ran, f"suite: binaries run {sorted(ran)}, wanted {sorted(want_ran)} (CUDA path: {with_cuda})")
check(all(c["failed"] == 0 and c["ok"] + c["skipped"] > 0 for c in ran.values()), f"suite: {st}")
for name, part in p.items():
    check(part.get("status") == "ok", f"part {name}: {part.get('status')}: {part.get('line')}")
    check(any(l.startswith(f"part {name}: ") for l in r["log"]), f"part {name}: no line printed")
b = p.get("b", {}).get("runs", {})
check(set(b) == {"micro_batch", "layer+speculate", "clipped"}, f"part b's runs: {sorted(b)}")
if b:
    check(all(s == "committed" for s in b["layer+speculate"]["speculation"]), "unclipped speculation not committed: "
          + str(b["layer+speculate"]["speculation"]))
    check(all(s == "redone" for s in b["clipped"]["speculation"]), "clipped speculation not redone: "
          + str(b["clipped"]["speculation"]))
    check(all(x["tokens_per_s"] > 0 and x["bound_s"] > 0 for x in b.values()), "a run without tokens/s or bound")
    check(p["b"]["compute_only"]["tokens_per_s"] > 0, "no compute-only reference")
check(p.get("det", {}).get("bit_for_bit") is True, "deterministic runs differ")
act = p.get("act", {})
check(set(act.get("runs", {})) == {"auto", "always"}, f"part act's runs: {sorted(act.get('runs', {}))}")
check(all(x["tokens_per_s"] > 0 and x["mfu_nominal"] > 0 for x in act.get("runs", {}).values()),
      "part act: a run without tokens/s or MFU")
check(act.get("same_losses") is True, "part act: auto and always trained differently")
check(act.get("plan_activations", {}).get("recomputed_layers") == 0, "part act: auto recomputed on the CPU device "
      f"with room for every layer's entries: {act.get('plan_activations')}")
lo = p.get("lora", {})
check(set(lo.get("runs", {})) == {"base-in-hbm", "base-half-in-host"}, f"part lora's runs: {sorted(lo.get('runs', {}))}")
check(lo.get("same_losses") is True, "part lora: the base's placements trained differently")
check(lo.get("runs", {}).get("base-half-in-host", {}).get("h2d_bytes", 0) > 0, "part lora: nothing of the base crossed")
check(sum((lo.get("plan_frozen_bytes") or {}).values()) > 0, "part lora: the plan has no frozen base")
mo = p.get("moe", {})
check(set(mo.get("runs", {})) == {"loop", "grouped"}, f"part moe's runs: {sorted(mo.get('runs', {}))}")
check(mo.get("losses_agree") is True, f"part moe: loop and grouped GEMMs trained apart: {mo.get('loss_rel_diff')}")
check(all(x > 0 for r in mo.get("runs", {}).values() for x in r.get("aux_loss", [0])), "part moe: no aux_loss")
check((mo.get("plan_experts") or {}).get("num_experts") == 16, f"part moe: the plan's experts: {mo.get('plan_experts')}")
c = p.get("c", {})
check(c.get("state_bytes", {}).get("nvme", 0) > 0, "part c placed nothing on NVMe")
check(c.get("run", {}).get("nvme_read_bytes", 0) > 0, "part c's training read nothing from NVMe")
check(0 < c.get("layers", 0) <= c.get("largest_trainable_layers", 0), "part c's layers past the largest trainable")
d = p.get("d", {})
check(d.get("deepspeed") is not None, "part d: no DeepSpeed report")
check(d.get("strata", {}).get("tokens_per_s", 0) > 0, "part d: Strata did not train DeepSpeed's model")
check(p.get("e", {}).get("checkpoint_bytes", 0) > 0, "part e: no checkpoint")
rk = p.get("ranks", {})
check(rk.get("max_rel_loss_diff", 1) < 1e-4 and len(rk.get("losses_two", [])) > 0, "part ranks: losses differ")
check(rk.get("plan_net_bytes_per_rank") == rk.get("bytes", {}).get("2 rank(s), rank 0", {}).get("net_bytes"),
      "part ranks: network bytes per rank are not the plan's")
# Every training run's start-up is accounted for, with the weights' line of the start (round 2's budgets
# went to start-ups).
su = r.get("startup", {})
check({"b-layer+speculate", "det-on-1", "c"} <= set(su), f"start-ups recorded: {sorted(su)}")
check(all(0 <= x["startup_s"] <= x["wall_s"] and "weights_drawn_s" in x for x in su.values()),
      f"a start-up without its weights' line: {su}")
check(all(x["to_first_log_line_s"] is not None and x["to_model_line_s"] is not None
          and x["to_first_log_line_s"] <= x["to_model_line_s"] <= x["wall_s"] + 1 for x in su.values()),
      f"a start-up's log times do not fit its wall time: {su}")
for f in ("gpu-proof-2.json", "gpu-proof-2.txt", "gpu-proof-2-logs.tgz"):
    check(os.path.getsize(os.path.join(out, f)) > 0, f"no {f}")
check(rc == 0, f"gpu_host_check.sh gpu-proof-2 exited {rc}")
for x in bad:
    print("FAILED:", x)
print("gpu-proof-2 dry run:", "every part ran and reported" if not bad else f"{len(bad)} check(s) failed")
sys.exit(1 if bad else 0)
PY
