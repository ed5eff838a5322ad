#!/usr/bin/env python3
"""The step with fine-tuning data (docs/token-format.md, "Examples and loss
masks") against windows of the same tokens, in the same run.

Writes a synthetic example set as tools/tokenize.py writes one (uint16 ids,
OUT.mask, OUT.idx, a version 2 sidecar): examples of 40 to 600 tokens, their
first 40% (the prompt) not counted; and the same ids as a plain token file.
Then, per round, `strata train` of one small model on each of
  windows    the plain file: random windows, every target counted (the reference)
  masked     random windows of the example file, its mask applied
  examples   data.sampling examples: one example a sequence, padded
  packed     data.sampling packed: whole examples back to back
and prints each one's median step time (steps after the first two), its
counted targets per step and counted targets per second, and its step time
over the windows run's of the same round (1.0: the masks, the padding and the
count cost nothing in the step; the sequences have the same shape).

Usage:
  .venv/bin/python tools/bench_finetune_data.py --dir /tmp/bench-ft [--examples 4000] [--rounds 3]
      [--steps 12] [--strata build/strata]
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from array import array

VOCAB = 4096


def write_files(d, n):
    rng = random.Random(7)
    ids, mask, index = array("H"), bytearray(), array("Q", [0])
    counted = 0
    for _ in range(n):
        length = rng.randint(40, 600)
        first = rng.randrange(VOCAB)
        step = rng.randint(1, 7)
        prompt = int(length * 0.4)
        for t in range(length):
            ids.append((first + step * t + (t * t) % 5) % VOCAB)
            mask.append(0 if t < prompt else 1)
        counted += length - prompt
        index.append(len(ids))
    ex = os.path.join(d, "ex.bin")
    with open(ex, "wb") as f:
        ids.tofile(f)
    with open(ex + ".mask", "wb") as f:
        f.write(mask)
    with open(ex + ".idx", "wb") as f:
        index.tofile(f)
    with open(ex + ".json", "w") as f:
        json.dump({"format": "strata-tokens", "version": 2, "vocab_size": VOCAB, "tokens": len(ids),
                   "dtype": "uint16", "examples": n, "counted": counted, "mask": "ex.bin.mask",
                   "index": "ex.bin.idx"}, f)
    plain = os.path.join(d, "plain.bin")
    with open(plain, "wb") as f:
        ids.tofile(f)
    with open(plain + ".json", "w") as f:
        json.dump({"format": "strata-tokens", "vocab_size": VOCAB, "tokens": len(ids), "dtype": "uint16"}, f)
    return len(ids), counted


def config(path, sampling, steps):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "model": {"vocab_size": VOCAB, "dim": 256, "n_layers": 4, "n_heads": 4, "seq_len": 512},
        "data": {"path": path, "sampling": sampling, "val_fraction": 0.0, "eval_interval": 0,
                 "truncate": True},
        "run": {"steps": steps, "seed": 3, "log_level": "warn"},
    }


def run(strata, d, name, cfg):
    c = os.path.join(d, name + ".json")
    m = os.path.join(d, name + ".jsonl")
    with open(c, "w") as f:
        json.dump(cfg, f)
    p = subprocess.run([strata, "train", c, "--metrics", m], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{name}: strata train failed: {p.stderr[-2000:]}")
    lines = [json.loads(x) for x in open(m) if x.strip()]
    steps = lines[2:]
    return (statistics.median(x["step_s"] for x in steps),
            statistics.median(x.get("counted_tokens", x["tokens"]) for x in steps), lines[0]["tokens"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--examples", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--strata", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build",
                                                      "strata"))
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    tokens, counted = write_files(args.dir, args.examples)
    print(f"{args.examples} examples, {tokens:,} tokens, {counted:,} counted; model dim 256 x 4 layers, "
          f"seq 512, 8 sequences a step; {os.cpu_count()} cores", flush=True)
    ex = os.path.join(args.dir, "ex.bin")
    modes = {"windows": (os.path.join(args.dir, "plain.bin"), "windows"), "masked": (ex, "windows"),
             "examples": (ex, "examples"), "packed": (ex, "packed")}
    res = {k: [] for k in modes}
    for r in range(args.rounds):
        row = {}
        for k, (path, sampling) in modes.items():
            row[k] = run(args.strata, args.dir, k, config(path, sampling, args.steps))
            res[k].append(row[k] + (row[k][0] / row["windows"][0],))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[0]:.3f} s" for k, v in row.items()), flush=True)
    print(f"\n{'mode':9s} {'step s':>8s} {'counted/step':>13s} {'counted/s':>10s} {'step / windows':>15s}")
    for k, v in res.items():
        step = statistics.median(x[0] for x in v)
        cnt = statistics.median(x[1] for x in v)
        ratio = statistics.median(x[3] for x in v)
        print(f"{k:9s} {step:8.3f} {cnt:13.0f} {cnt / step:10.0f} {ratio:15.3f}")


if __name__ == "__main__":
    main()
