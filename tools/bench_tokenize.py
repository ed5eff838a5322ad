#!/usr/bin/env python3
"""tools/tokenize.py's throughput against a plain loop over the `tokenizers`
package's batch encode, in the same run.

Builds a synthetic corpus (JSON lines, {"text": ...}; words drawn from a
Zipf-like distribution over 50k pseudo-words, documents of 100-2000 words)
and a 32k byte-level BPE trained on part of it, then per round times, each in
its own process:
  tool   tools/tokenize.py --tokenizer DIR --out FILE CORPUS_DIR (reads, encodes, writes the token
         file and its sidecar)
  loop   the reference: read the same JSON lines, encode_batch in batches of 512 documents, count
         the ids, write nothing
  fast   the same loop over encode_batch_fast (the ids without offsets, which the tool uses)
and prints MB of text per second and tokens per second of each, medians of
the rounds, and the tool's throughput over each loop's (1.0 = no slower).

With --chat, instead: conversations (system, then 1-4 user/assistant
turns of the corpus's words) as JSON lines {"messages": [...]}, a ChatML
template in tokenizer_config.json beside the BPE (its <|im_start|> and
<|im_end|> added as special tokens), and per round
  tool   tools/tokenize.py on them (renders every conversation and each
         assistant turn's prefix, encodes, writes tokens, mask and index)
  loop   the reference: apply_chat_template(messages, tokenize=True) per
         conversation, one at a time, counting the ids, writing nothing
and the tool's throughput over the loop's.

With --parquet, instead: the corpus's first quarter, half and whole as one
Parquet file each (row groups of 2000 documents), tokenized by the tool in
its own process, and the peak RSS of each against the file's size: reading
row group by row group keeps it flat.

Usage:
  .venv/bin/python tools/bench_tokenize.py --dir /tmp/bench-tok [--mb 200] [--rounds 3] [--parquet | --chat N]
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

LOOP = r'''
import json, os, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
encode = getattr(tok, sys.argv[3])
t0 = time.monotonic()
n = 0
batch = []
for name in sorted(os.listdir(sys.argv[2])):
    with open(os.path.join(sys.argv[2], name), "rb") as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            if len(batch) == 512:
                n += sum(len(e.ids) + 1 for e in encode(batch, add_special_tokens=False))
                batch = []
if batch:
    n += sum(len(e.ids) + 1 for e in encode(batch, add_special_tokens=False))
print(f"TOKENS {n} SECONDS {time.monotonic() - t0}")
'''

TRAIN = r'''
import sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tr = trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"],
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tok.train([sys.argv[2]], tr)
tok.save(sys.argv[1] + "/tokenizer.json")
'''


def corpus(d, mb):
    rng = random.Random(1)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 10))) for _ in range(50000)]
    weights = [1.0 / (i + 1) for i in range(len(words))]
    cum, s = [], 0.0
    for w in weights:
        s += w
        cum.append(s)
    os.makedirs(os.path.join(d, "corpus"), exist_ok=True)
    target, written, part = mb * 10**6, 0, 0
    sample = open(os.path.join(d, "sample.txt"), "w")
    while written < target:
        with open(os.path.join(d, "corpus", f"part-{part:03d}.jsonl"), "w") as f:
            for _ in range(2000):
                n = rng.randint(100, 2000)
                ws = rng.choices(words, cum_weights=cum, k=n)
                for i in range(12, n, 13):
                    ws[i] += rng.choice([".", ",", "!", "?", ";", ".\n"])
                text = " ".join(ws)
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                if written < 20 * 10**6:
                    sample.write(text + "\n")
                written += len(line)
                if written >= target:
                    break
        part += 1
    sample.close()
    return written


# Runs argv[1:] and prints its peak RSS in KiB (its stdout dropped).
PEAK = r'''
import os, sys
pid = os.fork()
if pid == 0:
    fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 1)
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
if status != 0:
    sys.exit(1)
print(usage.ru_maxrss)
'''


CHAT_LOOP = r'''
import json, sys, time
from transformers import AutoTokenizer
hf = AutoTokenizer.from_pretrained(sys.argv[1])
t0 = time.monotonic()
n = 0
with open(sys.argv[2]) as f:
    for line in f:
        r = hf.apply_chat_template(json.loads(line)["messages"], tokenize=True)
        n += len(r["input_ids"] if hasattr(r, "keys") else r)
print(f"TOKENS {n} SECONDS {time.monotonic() - t0}")
'''

CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def chat_bench(args, py, tool, cdir):
    from tokenizers import AddedToken, Tokenizer
    tdir = os.path.join(args.dir, "chat-tokenizer")
    os.makedirs(tdir, exist_ok=True)
    tok = Tokenizer.from_file(os.path.join(args.dir, "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.save(os.path.join(tdir, "tokenizer.json"))
    with open(os.path.join(tdir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": CHATML}, f)
    data = os.path.join(args.dir, "chat.jsonl")
    rng = random.Random(2)
    words = []
    for name in sorted(os.listdir(cdir))[:2]:
        with open(os.path.join(cdir, name)) as f:
            for line in f:
                words.extend(json.loads(line)["text"].split()[:400])
    with open(data, "w") as f:
        for _ in range(args.chat):
            msgs = [{"role": "system", "content": "You are a helpful assistant."}]
            for _ in range(rng.randint(1, 4)):
                for role, lo, hi in (("user", 10, 80), ("assistant", 20, 300)):
                    k = rng.randint(lo, hi)
                    at = rng.randrange(len(words) - k)
                    msgs.append({"role": role, "content": " ".join(words[at:at + k])})
            f.write(json.dumps({"messages": msgs}) + "\n")
    mb = os.path.getsize(data) / 1e6
    out = os.path.join(args.dir, "chat.bin")
    res = {"tool": [], "loop": []}
    tokens = None
    for r in range(args.rounds):
        t0 = time.monotonic()
        subprocess.run([py, tool, "--tokenizer", tdir, "--out", out, "--no-progress", data], check=True,
                       stdout=subprocess.DEVNULL)
        res["tool"].append(time.monotonic() - t0)
        with open(out + ".json") as f:
            side = json.load(f)
        t0 = time.monotonic()
        p = subprocess.run([py, "-c", CHAT_LOOP, tdir, data], check=True, capture_output=True, text=True)
        res["loop"].append(time.monotonic() - t0)
        tokens = int(p.stdout.split()[1])
        if tokens != side["tokens"]:
            sys.exit(f"token counts differ: tool {side['tokens']}, loop {tokens}")
        print(f"round {r + 1}: tool {res['tool'][-1]:.1f} s, loop {res['loop'][-1]:.1f} s", flush=True)
    print(f"\nchat: {args.chat:,} conversations, {mb:.0f} MB of JSON lines, {tokens:,} tokens "
          f"({side['counted']:,} counted); {os.cpu_count()} cores; medians of {args.rounds} rounds, each a whole process")
    for k in res:
        t = statistics.median(res[k])
        print(f"{k:6s} {t:7.1f} s  {args.chat / t:9.0f} conversations/s  {tokens / t / 1e6:6.3f} M tokens/s")
    print(f"tool / loop throughput: {statistics.median(res['loop']) / statistics.median(res['tool']):.2f}")


def parquet_memory(args, py, tool, cdir):
    import pyarrow as pa
    import pyarrow.parquet as pq
    parts = sorted(os.listdir(cdir))
    print(f"{'parquet file':>14} {'text':>9} {'rows':>7} {'peak RSS':>9} {'tool s':>7}")
    for share in (4, 2, 1):
        chosen = parts[:max(1, len(parts) // share)]
        path = os.path.join(args.dir, f"corpus-1of{share}.parquet")
        texts = []
        for name in chosen:
            with open(os.path.join(cdir, name)) as f:
                texts.extend(json.loads(line)["text"] for line in f)
        pq.write_table(pa.table({"text": texts}), path, row_group_size=2000)
        text_mb = sum(len(t.encode()) for t in texts) / 1e6
        del texts
        t0 = time.monotonic()
        # Through a small process (PEAK): a child forked (or vforked) from
        # this one, which holds the texts just written, would start its peak
        # RSS at this process's (Linux keeps the larger across exec).
        p = subprocess.run([py, "-c", PEAK, py, tool, "--tokenizer", args.dir, "--out",
                            os.path.join(args.dir, "pq.bin"), "--no-progress", path],
                           capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"tokenize.py failed on {path}: {p.stderr[-2000:]}")
        peak_kb = int(p.stdout.split()[-1])
        rows = pq.ParquetFile(path).metadata.num_rows
        print(f"{os.path.getsize(path) / 1e6:11.0f} MB {text_mb:6.0f} MB {rows:7d} {peak_kb / 1024:6.0f} MB "
              f"{time.monotonic() - t0:7.1f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--mb", type=int, default=200, help="corpus size in MB of JSON lines")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parquet", action="store_true", help="peak memory of Parquet input by file size instead")
    ap.add_argument("--chat", type=int, default=0, help="N conversations through the chat template instead")
    args = ap.parse_args()
    py = sys.executable
    tool = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenize.py")
    os.makedirs(args.dir, exist_ok=True)
    cdir = os.path.join(args.dir, "corpus")
    if not os.path.isdir(cdir):
        print("writing the corpus ...", flush=True)
        corpus(args.dir, args.mb)
    if not os.path.exists(os.path.join(args.dir, "tokenizer.json")):
        print("training a 32k BPE ...", flush=True)
        subprocess.run([py, "-c", TRAIN, args.dir, os.path.join(args.dir, "sample.txt")], check=True)
    if args.parquet:
        parquet_memory(args, py, tool, cdir)
        return
    if args.chat > 0:
        chat_bench(args, py, tool, cdir)
        return
    mb = sum(os.path.getsize(os.path.join(cdir, f)) for f in os.listdir(cdir)) / 1e6
    out = os.path.join(args.dir, "tokens.bin")
    res = {"tool": [], "loop": [], "fast": []}
    tokens = None
    for r in range(args.rounds):
        t0 = time.monotonic()
        subprocess.run([py, tool, "--tokenizer", args.dir, "--out", out, "--no-progress", cdir], check=True,
                       stdout=subprocess.DEVNULL)
        res["tool"].append(time.monotonic() - t0)
        with open(out + ".json") as f:
            tool_tokens = json.load(f)["tokens"]
        for k, method in (("loop", "encode_batch"), ("fast", "encode_batch_fast")):
            t0 = time.monotonic()
            p = subprocess.run([py, "-c", LOOP, os.path.join(args.dir, "tokenizer.json"), cdir, method], check=True,
                               capture_output=True, text=True)
            res[k].append(time.monotonic() - t0)
            tokens = int(p.stdout.split()[1])
            if tokens != tool_tokens:
                sys.exit(f"token counts differ: tool {tool_tokens}, {k} {tokens}")
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in res.items()), flush=True)
    print(f"\ncorpus: {mb:.0f} MB of JSON lines, {tokens:,} tokens (EOS included); {os.cpu_count()} cores; "
          f"medians of {args.rounds} rounds, each a whole process")
    for k in res:
        t = statistics.median(res[k])
        print(f"{k:6s} {t:7.1f} s  {mb / t:7.2f} MB/s  {tokens / t / 1e6:6.2f} M tokens/s")
    for k in ("loop", "fast"):
        print(f"tool / {k} throughput: {statistics.median(res[k]) / statistics.median(res['tool']):.2f}")


if __name__ == "__main__":
    main()
