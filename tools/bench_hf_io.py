#!/usr/bin/env python3
"""Hugging Face weights in and out at ~1B parameters: time and peak RSS of
`model.init_from` and `strata export`, against transformers' own load of the
same files in the same run.

A random Llama-3.2-1B-shaped model (vocab 128256, dim 2048, 16 layers, 32
heads, 8 kv heads, ffn 8192, tied, Llama 3.1 rope scaling; 1.24B parameters)
is built and saved by transformers in bf16 (one 2.5 GB safetensors file).
Each round then measures, each in its own process (/usr/bin/time: wall
seconds and maximum resident set):
  ref      transformers: AutoModelForCausalLM.from_pretrained(dir, dtype=bf16)
  random   strata train, 1 step, every state category on NVMe, random init
  import   the same with model.init_from = the model (the import's cost is
           import - random, in time and in peak RSS)
  export   strata export of import's checkpoint, bf16 and fp32
and prints the medians. What the import and the export hold at once is one
block (the largest is the 128256 x 2048 embedding: 1.05 GB in fp32), not the
model.

Usage:
  .venv/bin/python tools/bench_hf_io.py --strata build/strata --dir /tmp/bench-hf [--rounds 3]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

MAKE = r'''
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                  rms_norm_eps=1e-5, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192})
torch.manual_seed(0)
with torch.device("meta"):
    m = LlamaForCausalLM(cfg)
m = m.to_empty(device="cpu").to(torch.bfloat16)
m.tie_weights()  # to_empty gives the head storage of its own
with torch.no_grad():
    for n, p in m.named_parameters():
        p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
m.save_pretrained(sys.argv[1], safe_serialization=True)
print(sum(p.numel() for p in m.parameters()))
'''

REF = r'''
import sys, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
print(sum(p.numel() for p in m.parameters()))
'''


def timed(cmd, env=None):
    """(wall seconds, peak RSS bytes) of cmd, run under /usr/bin/time."""
    r = subprocess.run(["/usr/bin/time", "-f", "TIME %e %M"] + cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    line = [x for x in r.stderr.splitlines() if x.startswith("TIME ")][-1]
    _, wall, kb = line.split()
    return float(wall), int(kb) * 1024


def config(work, init_from, ck):
    swap = os.path.join(work, "swap")
    c = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap,
                                                             "buffer_size": 262668288}},
        "placement": {"param16": {"nvme": 1.0}, "grad": {"nvme": 1.0}, "optimizer": {"nvme": 1.0},
                      "nvme_path": swap},
        "model": {"seq_len": 32},
        "data": {"path": os.path.join(work, "tokens.bin"), "format": "uint32", "val_fraction": 0.0},
        "run": {"steps": 1, "checkpoint": {"dir": ck}},
    }
    if init_from:
        c["model"]["init_from"] = init_from
    else:  # the same model, random
        c["model"].update({"vocab_size": 128256, "dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8,
                           "ffn_hidden": 8192, "rope_theta": 500000.0,
                           "rope_scaling": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    path = os.path.join(work, "import.json" if init_from else "random.json")
    with open(path, "w") as f:
        json.dump(c, f)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strata", default="build/strata")
    ap.add_argument("--dir", required=True, help="work directory (about 30 GB: the model, swap, checkpoints)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    py = sys.executable
    os.makedirs(args.dir, exist_ok=True)
    model = os.path.join(args.dir, "llama-1b")
    if not os.path.exists(os.path.join(model, "config.json")):
        print("building the model with transformers ...", flush=True)
        subprocess.run([py, "-c", MAKE, model], check=True)
    with open(os.path.join(args.dir, "tokens.bin"), "wb") as f:
        f.write(b"".join(int(i * 7919 % 128000).to_bytes(4, "little") for i in range(4096)))
    model_bytes = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if f.endswith(".safetensors"))
    results = {k: [] for k in ("ref", "random", "import", "export_bf16", "export_fp32")}
    for r in range(args.rounds):
        for k in ("ck-random", "ck-import", "swap", "out-bf16", "out-fp32"):
            shutil.rmtree(os.path.join(args.dir, k), ignore_errors=True)
        results["ref"].append(timed([py, "-c", REF, model]))
        results["random"].append(timed([args.strata, "train", config(args.dir, None, os.path.join(args.dir, "ck-random"))]))
        shutil.rmtree(os.path.join(args.dir, "swap"), ignore_errors=True)
        ck = os.path.join(args.dir, "ck-import")
        results["import"].append(timed([args.strata, "train", config(args.dir, model, ck)]))
        shutil.rmtree(os.path.join(args.dir, "swap"), ignore_errors=True)
        results["export_bf16"].append(timed([args.strata, "export", ck, "--out", os.path.join(args.dir, "out-bf16"),
                                             "--dtype", "bf16"]))
        results["export_fp32"].append(timed([args.strata, "export", ck, "--out", os.path.join(args.dir, "out-fp32"),
                                             "--dtype", "fp32"]))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1][0]:.1f} s {v[-1][1] / 2**30:.2f} GiB"
                                             for k, v in results.items()), flush=True)
    med = {k: (statistics.median(t for t, _ in v), statistics.median(m for _, m in v)) for k, v in results.items()}
    gib = 2**30
    print(f"\nmodel: {model_bytes / 1e9:.2f} GB of bf16 safetensors; largest tensor (embedding) 0.53 GB bf16, "
          f"1.05 GB fp32; medians of {args.rounds} rounds")
    print(f"{'':28s} {'wall s':>8s} {'peak RSS GiB':>13s}")
    for k, (t, m) in med.items():
        print(f"{k:28s} {t:8.1f} {m / gib:13.2f}")
    print(f"{'import - random':28s} {med['import'][0] - med['random'][0]:8.1f} "
          f"{(med['import'][1] - med['random'][1]) / gib:13.2f}")
    print(f"export bf16 peak RSS / model bytes: {med['export_bf16'][1] / model_bytes:.2f}; "
          f"transformers' load peak RSS / model bytes: {med['ref'][1] / model_bytes:.2f}")


if __name__ == "__main__":
    main()
