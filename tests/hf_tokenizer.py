"""Helpers for tokenize_test and the README walk-through test, with the
`tokenizers` and `transformers` packages of .venv.

usage:
  hf_tokenizer.py train DIR VOCAB CORPUS...   a byte-level BPE with <|endoftext|>, saved as DIR/tokenizer.json
  hf_tokenizer.py expect TOKENIZER_JSON EOS_ID OUT FILE...
        the token file a plain loop over the package writes: each file one
        document (*.jsonl: one per line, field "text"), encoded whole, EOS
        after each; uint16
  hf_tokenizer.py model DIR VOCAB   a tiny random LlamaForCausalLM saved into DIR (beside its tokenizer)
  hf_tokenizer.py parquet JSONL OUT ROWS [null]   the JSON lines' "id" and "text" as a Parquet file of
        ROWS rows per row group (pyarrow); with "null", the second row's text is null
"""
import json
import os
import sys
from array import array


def train(out, vocab, corpus):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(vocab), special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(corpus, trainer)
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    print(f"vocab {tok.get_vocab_size()}")


def expect(tokenizer_json, eos, out, files):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tokenizer_json)
    ids = array("H")
    for path in files:
        if path.endswith(".jsonl"):
            with open(path) as f:
                docs = [json.loads(line)["text"] for line in f if line.strip()]
        else:
            with open(path, encoding="utf-8") as f:
                docs = [f.read()]
        for d in docs:
            ids.extend(tok.encode(d, add_special_tokens=False).ids)
            ids.append(int(eos))
    with open(out, "wb") as f:
        ids.tofile(f)


def model(out, vocab):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=int(vocab), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        with open(sys.argv[2]) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        texts = [r["text"] for r in rows]
        if len(sys.argv) > 5 and sys.argv[5] == "null":
            texts[1] = None
        table = pa.table({"id": [r["id"] for r in rows], "text": pa.array(texts, pa.string())})
        pq.write_table(table, sys.argv[3], row_group_size=int(sys.argv[4]))
        print(f"parquet {pq.ParquetFile(sys.argv[3]).num_row_groups} row groups")
        sys.exit(0)
    if cmd == "train":
        train(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif cmd == "expect":
        expect(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    elif cmd == "model":
        model(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"unknown command {cmd}")
