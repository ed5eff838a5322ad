"""A Hugging Face causal LM for hf_test's init_from checks: built by
transformers with random weights (norms and biases too, so that each is
tested), saved with save_pretrained (safetensors), and its loss on the given
token windows printed.

usage: hf_make.py OUT_DIR TOKENS.bin BATCH WINDOW SPEC_JSON
SPEC_JSON: {"family": "llama"|"mistral"|"qwen2"|"qwen3", "tied": bool,
            "kv": int, "head_dim": int (optional), "rope": {...} (optional,
            Hugging Face's rope_parameters without rope_theta),
            "config": {...} (optional, more config fields)}
"""
import json
import sys

import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, AutoModelForCausalLM

CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


def main():
    out, tokens_path, batch, window, spec = sys.argv[1:6]
    spec = json.loads(spec)
    torch.manual_seed(0)
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=spec["kv"], max_position_embeddings=64,
                  rms_norm_eps=1e-5, tie_word_embeddings=spec["tied"])
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    rope.update(spec.get("rope", {}))
    fields["rope_parameters"] = rope
    if "head_dim" in spec:
        fields["head_dim"] = spec["head_dim"]
    fields.update(spec.get("config", {}))
    cfg = CONFIGS[spec["family"]](**fields)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    with open(tokens_path, "rb") as f:
        tokens = torch.frombuffer(bytearray(f.read()), dtype=torch.int64).reshape(int(batch), int(window))
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=tokens, labels=tokens).loss
    print(f"class {type(model).__name__}")
    print(f"loss {loss.item():.10e}")


if __name__ == "__main__":
    main()
