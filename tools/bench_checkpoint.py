#!/usr/bin/env python3
"""What a checkpoint costs: its write and read bandwidth against `strata bench-io` on the same
disk, and the time a save adds to the step it happens in, measured in one run.

Each round (interleaved, so the disk's drift hits both alike):
  1. `strata bench-io --dir DIR` writes and reads as many bytes as the checkpoint holds
     (the same block size and queue depth as the checkpoint's I/O engine: 4 MiB, 32), and
     writes them again with `--fsync` (timed to the end of fdatasync: the durable rate that
     a checkpoint, which syncs, is compared with);
  2. `strata train` without checkpoints, then saving every --every steps while training and at
     the end: the save at the end (the machine to itself, as bench-io has it) gives the write
     bandwidth from its checkpoint_write_s (start to file synced) and checkpoint_bytes; the
     step intervals (elapsed_s) a save in flight overlapped (from the step it began after to
     the one after its publication) against the median of the others give the time it added;
     the save thread's own CPU time comes from its debug line, and /proc/stat's steal counter
     over both runs gives the CPU time the hypervisor took per save (on a VM, its virtual
     disk's I/O is done on the same cores: stolen from training, not from an idle machine);
  3. `strata train --resume` loads the checkpoint (the log's "resumed ... in X s");
  4. `strata export` writes its weights as bf16 safetensors (whole command, timed).
It prints medians over rounds and the same-run ratios to bench-io.

Usage:
  .venv/bin/python tools/bench_checkpoint.py --strata build/strata --dir /tmp/bench-ckpt \\
      [--dim 1024] [--layers 8] [--rounds 3] [--device cpu|cuda] [--json out.json]
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

from benchlib import read_metrics


def run(cmd, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
    return p.stdout + p.stderr


def steal_ticks():
    """The CPU time the hypervisor took from this VM so far (/proc/stat 'steal', in USER_HZ ticks)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) if len(fields) > 8 else 0


def bench_io(strata, d, mib, args, extra=()):
    out = run([strata, "bench-io", "--dir", d, "--size-mb", str(mib), "--json", "--block-size",
               str(args.block_size), "--queue-depth", str(args.queue_depth), *extra])
    res = {}
    for line in out.splitlines():
        if line.startswith("{"):
            j = json.loads(line)
            res[j["op"]] = j["gbps"]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strata", default="build/strata")
    ap.add_argument("--dir", required=True, help="scratch directory on the disk to measure")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps (micro-batches a step)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--block-size", type=int, default=4 << 20)
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--device", default="cpu", help="run.device of the training (cuda: the state in HBM, "
                    "a save copies it to the host first)")
    ap.add_argument("--json")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every training run (strata train --set), repeatable")
    args = ap.parse_args()

    os.makedirs(args.dir, exist_ok=True)
    data = os.path.join(args.dir, "data.txt")
    with open(data, "w") as f:
        f.write("The quick brown fox jumps over the lazy dog. " * 20000)
    ck = os.path.join(args.dir, "ckpt")
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "aio": {"block_size": args.block_size, "queue_depth": args.queue_depth},
        "model": {"dim": args.dim, "n_layers": args.layers, "n_heads": 8, "seq_len": args.seq_len},
        "data": {"path": data, "eval_interval": 0, "val_fraction": 0.0},
        "run": {"steps": args.steps, "threads": args.threads, "log_level": "info", "device": args.device,
                "checkpoint": {"dir": ck, "every": args.every, "keep": 1}},
    }
    cfg_path = os.path.join(args.dir, "c.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)

    sets = [x for kv in args.set for x in ("--set", kv)]
    rows = []
    for rnd in range(args.rounds):
        shutil.rmtree(ck, ignore_errors=True)
        metrics = os.path.join(args.dir, f"m{rnd}.jsonl")
        # The same run without checkpoints: the CPU time the hypervisor steals from training alone.
        s0 = steal_ticks()
        run([args.strata, "train", cfg_path, "--set", "run.checkpoint.every=0", "--set", 'run.checkpoint.dir=""', *sets])
        s1 = steal_ticks()
        log = run([args.strata, "train", cfg_path, "--metrics", metrics, "--set", "run.log_level=debug", *sets])
        s2 = steal_ticks()
        hz = os.sysconf("SC_CLK_TCK")
        thread_cpu = [float(u) + float(y) for u, y in
                      re.findall(r"the thread used ([0-9.]+) s user, ([0-9.]+) s system CPU", log)]
        fsyncs = [float(x) for x in re.findall(r"rank 0 wrote .* fsync ([0-9.]+) s", log)]
        lines = read_metrics(metrics)
        saves = [x for x in lines if "checkpoint_s" in x]
        ck_bytes = saves[0]["checkpoint_bytes"]
        # Durable write bandwidth of the save at the end, which has the machine to itself as bench-io
        # does: bytes over the time from the start of the save to its file synced.
        final = saves[-1]
        write_gbps = final["checkpoint_bytes"] / final["checkpoint_write_s"] / 1e9
        save_s = final["checkpoint_write_s"]
        # Without the fsync (what bench-io's plain write pass measures: it does not sync).
        nosync_gbps = final["checkpoint_bytes"] / (final["checkpoint_write_s"] - fsyncs[-1]) / 1e9
        # The saves while training share the cores with it (their thread runs at nice 10).
        overlapped = saves[:-1]
        if not overlapped or len(thread_cpu) < 2:
            sys.exit(f"no save while training: --steps {args.steps} must exceed --every {args.every}")
        write_training_gbps = statistics.median(x["checkpoint_bytes"] / x["checkpoint_write_s"] / 1e9
                                                for x in overlapped)
        el = {x["step"]: x["elapsed_s"] for x in lines}
        # A save begun after step b and published at the line of step f (its finish is timed in the
        # interval f -> f + 1) affects the intervals b -> f + 1; the others are the reference.
        begun = {x["step"]: x["step"] for x in lines if "checkpoint_begun" in x}
        windows = []
        for x in lines:
            for rec in [x.get("checkpoint_earlier"), x] if "checkpoint_step" in x else []:
                if rec and rec["checkpoint_step"] in begun:
                    windows.append((rec["checkpoint_step"], x["step"] + 1))
        affected = set()
        for b, e in windows:
            affected.update(range(b + 1, e + 1))  # interval k = el[k] - el[k - 1]
        normal = [el[k] - el[k - 1] for k in range(3, args.steps + 1) if k not in affected]
        step_s = statistics.median(normal)
        added = [el[e] - el[b] - (e - b) * step_s for b, e in windows if e in el]
        added_s = statistics.median(added)
        save_write_s = statistics.median(x["checkpoint_write_s"] for x in saves if x["checkpoint_step"] in begun)
        # What the optimizer waited for saves in flight (each step line's checkpoint_wait_s), per save
        # while training, and the bytes those saves wrote from the snapshot pool (run.checkpoint.snapshot_gb).
        gate_wait_s = sum(x.get("checkpoint_wait_s", 0.0) for x in lines) / len(overlapped)
        snapshot_bytes = statistics.median(x.get("checkpoint_snapshot_bytes", 0) for x in overlapped)
        out = run([args.strata, "train", cfg_path, "--resume", "--steps", str(args.steps), *sets])
        m = re.search(r"resumed from \S+ \(step \d+, saved by \d+ rank\(s\)\) in ([0-9.]+) s", out)
        if not m:
            sys.exit("no 'resumed ... in X s' line in:\n" + out)
        read_s = float(m.group(1))
        # Export: the master weights (a third of the checkpoint) to bf16 safetensors.
        exp_dir = os.path.join(args.dir, "export")
        shutil.rmtree(exp_dir, ignore_errors=True)
        t0 = time.monotonic()
        run([args.strata, "export", ck, "--out", exp_dir, "--dtype", "bf16"])
        export_s = time.monotonic() - t0
        export_out = sum(os.path.getsize(os.path.join(exp_dir, f)) for f in os.listdir(exp_dir))
        io = bench_io(args.strata, args.dir, max(64, ck_bytes >> 20), args)
        io_sync = bench_io(args.strata, args.dir, max(64, ck_bytes >> 20), args, ("--fsync", "--ops", "write"))
        row = {"round": rnd, "checkpoint_bytes": ck_bytes, "save_s": save_s, "write_gbps": write_gbps,
               "write_nosync_gbps": nosync_gbps, "fsync_s": fsyncs[-1],
               "write_while_training_gbps": write_training_gbps,
               "save_thread_cpu_s": statistics.median(thread_cpu[:-1]),
               "steal_per_save_s": ((s2 - s1) - (s1 - s0)) / hz / len(saves),
               "read_s": read_s, "read_gbps": ck_bytes / read_s / 1e9, "bench_io_write_gbps": io["write"],
               "bench_io_read_gbps": io["read"], "bench_io_write_fsync_gbps": io_sync["write"], "step_s": step_s,
               "added_s": added_s, "save_while_training_s": save_write_s, "export_s": export_s,
               "optimizer_waited_s": gate_wait_s, "snapshot_bytes": snapshot_bytes,
               "export_read_gbps": ck_bytes / 3 / export_s / 1e9, "export_write_gbps": export_out / export_s / 1e9}
        row["write_ratio"] = row["write_gbps"] / row["bench_io_write_fsync_gbps"]
        row["write_nosync_ratio"] = row["write_nosync_gbps"] / row["bench_io_write_gbps"]
        row["read_ratio"] = row["read_gbps"] / row["bench_io_read_gbps"]
        row["added_over_save"] = added_s / save_write_s
        rows.append(row)
        print(json.dumps(row), flush=True)

    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "round"}
    print(f"\nmedians of {args.rounds} rounds; checkpoint {med['checkpoint_bytes'] / 1e9:.2f} GB "
          f"(dim {args.dim}, {args.layers} layers), step {med['step_s']:.2f} s:")
    print(f"  write (durable, the save at the end) {med['write_gbps']:.2f} GB/s vs bench-io --fsync "
          f"{med['bench_io_write_fsync_gbps']:.2f} GB/s: ratio {med['write_ratio']:.2f} (same-run ratios, median); "
          f"saves while training {med['write_while_training_gbps']:.2f} GB/s")
    print(f"  write without its fsync ({med['fsync_s']:.2f} s) {med['write_nosync_gbps']:.2f} GB/s vs bench-io "
          f"{med['bench_io_write_gbps']:.2f} GB/s: ratio {med['write_nosync_ratio']:.2f}")
    print(f"  read   {med['read_gbps']:.2f} GB/s vs bench-io {med['bench_io_read_gbps']:.2f} GB/s: "
          f"ratio {med['read_ratio']:.2f}")
    print(f"  export (bf16, whole command) {med['export_s']:.2f} s: reads {med['export_read_gbps']:.2f} GB/s of fp32 "
          f"master weights, writes {med['export_write_gbps']:.2f} GB/s of safetensors")
    print(f"  a save while training adds {med['added_s']:.2f} s to the steps it overlaps: "
          f"{100 * med['added_over_save']:.0f}% of its write time {med['save_while_training_s']:.2f} s; its thread used "
          f"{med['save_thread_cpu_s']:.2f} s of CPU, the hypervisor stole {med['steal_per_save_s']:.2f} CPU-s more per "
          f"save than in the same run without saves (/proc/stat steal); the optimizer waited "
          f"{med['optimizer_waited_s']:.2f} s for it, {med['snapshot_bytes'] / 1e9:.2f} GB went through the snapshot pool")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rows, "median": med}, f, indent=1)


if __name__ == "__main__":
    main()
