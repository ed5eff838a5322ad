"""A Hugging Face LlamaForCausalLM for hf_test's init_from check: built
with random weights (norms too), saved with save_pretrained (safetensors),
and its loss on the given token windows printed.

usage: hf_make.py OUT_DIR TOKENS.bin BATCH WINDOW tied|untied KV_HEADS
"""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    out, tokens_path, batch, window, tie, kv = sys.argv[1:7]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=int(kv), max_position_embeddings=64,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=(tie == "tied"),
                      attention_bias=False, mlp_bias=False)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    with open(tokens_path, "rb") as f:
        tokens = torch.frombuffer(bytearray(f.read()), dtype=torch.int64).reshape(int(batch), int(window))
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=tokens, labels=tokens).loss
    print(f"loss {loss.item():.10e}")


if __name__ == "__main__":
    main()
