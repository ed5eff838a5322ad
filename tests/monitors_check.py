"""Reads back what Strata's `tensorboard` and `csv_monitor` blocks wrote
(docs/monitors.md) and checks every scalar against the run's metrics JSON
lines: TensorBoard's own reader (the `tensorboard` package, no TensorFlow)
for the event files, Python's csv module for DeepSpeed's per-tag CSV files.

usage: monitors_check.py METRICS.jsonl TB_DIR CSV_DIR BATCH
Prints one line and exits 0 when every point is where and what it should be.
"""
import csv
import glob
import json
import os
import struct
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

# metrics field -> tag: DeepSpeed's tags where DeepSpeed has them (docs/monitors.md).
DEEPSPEED = {"loss": "Train/Samples/train_loss", "lr": "Train/Samples/lr",
             "loss_scale": "Train/Samples/loss_scale", "eval_loss": "Train/Samples/eval_loss"}
STRATA = ["grad_norm", "tokens_per_s", "flops_per_s", "step_s", "bound_s", "h2d_bytes", "d2h_bytes",
          "nvme_read_bytes", "nvme_write_bytes", "net_bytes", "wait_s", "optimizer_s", "optimizer_wait_s",
          "comm_wait_s", "optimizer_hidden_s"]


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def main():
    metrics_path, tb_dir, csv_dir, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    lines = [json.loads(l) for l in open(metrics_path) if l.strip()]
    want = {}  # tag -> {x: value}
    for m in lines:
        s = m["step"]
        for field, value in m.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            tag = DEEPSPEED.get(field) or ("Strata/" + field if field in STRATA else None)
            if tag is None:
                continue
            x = (s - 1) * batch if field == "loss" else s * batch  # DeepSpeed's x: global samples
            want.setdefault(tag, {})[x] = f32(value)
    errors = []
    if not glob.glob(os.path.join(tb_dir, "events.out.tfevents.*")):
        errors.append(f"no event file in {tb_dir}")
    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    acc.Reload()
    got_tags = set(acc.Tags()["scalars"])
    for tag, points in want.items():
        if tag not in got_tags:
            errors.append(f"tensorboard: no tag {tag}")
            continue
        got = {e.step: e.value for e in acc.Scalars(tag)}
        if got != points:
            errors.append(f"tensorboard {tag}: {got} != {points}")
        name = os.path.join(csv_dir, tag.replace("/", "_").replace(" ", "_") + ".csv")
        if not os.path.exists(name):
            errors.append(f"csv_monitor: no file {name}")
            continue
        with open(name, newline="") as f:
            rows = list(csv.reader(f))
        if rows[0] != ["step", tag.split("/")[-1]]:
            errors.append(f"{name}: header {rows[0]}")
        got = {int(r[0]): f32(float(r[1])) for r in rows[1:]}
        if got != points:
            errors.append(f"{name}: {got} != {points}")
    if not want:
        errors.append("the metrics file has no steps")
    if errors:
        print("monitors_check: " + "; ".join(errors[:5]))
        sys.exit(1)
    print(f"monitors_check: ok, {sum(len(p) for p in want.values())} points of {len(want)} tags")


if __name__ == "__main__":
    main()
