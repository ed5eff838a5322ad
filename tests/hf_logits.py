"""Logits of the Hugging Face model a `strata export` wrote, loaded with
AutoModelForCausalLM (so config.json picks the class), on the given tokens,
in the given dtype. Prints the class it built.

usage: hf_logits.py MODEL_DIR TOKENS.bin BATCH SEQ fp32|bf16 OUT.bin
TOKENS.bin: int64 [BATCH, SEQ]; OUT.bin: float32 [BATCH, SEQ, vocab].
"""
import sys

import torch
from transformers import AutoModelForCausalLM


def main():
    model_dir, tokens_path, batch, seq, dtype, out_path = sys.argv[1:7]
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt, attn_implementation="eager")
    model.eval()
    with open(tokens_path, "rb") as f:
        tokens = torch.frombuffer(bytearray(f.read()), dtype=torch.int64).reshape(int(batch), int(seq))
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float().contiguous()
    with open(out_path, "wb") as f:
        f.write(logits.numpy().tobytes())
    print(f"class {type(model).__name__}")


if __name__ == "__main__":
    main()
