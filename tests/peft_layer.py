"""One decoder layer under PEFT's LoRA, the reference of tests/lora_test.cc.

Usage: peft_layer.py DIR DTYPE
DIR holds spec.json (the model's shape, the LoRA keys, each tensor's name and
shape) and one raw little-endian fp32 file per tensor (x, dy, the layer's
weights by Strata's names). Builds transformers' model of the family with one
layer, wraps it with peft.get_peft_model, loads the weights, runs the layer on
x in DTYPE (fp32 or bf16; the base is cast to DTYPE, PEFT keeps the adapters in
fp32) and backpropagates dy. Writes DIR/DTYPE-y.bin, DTYPE-dx.bin and, per
adapter, DTYPE-d<name>.bin (fp32).
"""
import json
import sys

import numpy as np
import torch
import transformers
from peft import LoraConfig, get_peft_model

HF_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w1": "mlp.gate_proj.weight",
    "w3": "mlp.up_proj.weight",
    "w2": "mlp.down_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}
MODULE_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                 "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def load(d, name, shape):
    return torch.from_numpy(np.fromfile(f"{d}/{name}.bin", dtype="<f4").reshape(shape).copy())


def main():
    d, dtype_name = sys.argv[1], sys.argv[2]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    spec = json.load(open(f"{d}/spec.json"))
    torch.manual_seed(0)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[spec["family"]]
    cfg = cls(vocab_size=spec["vocab_size"], hidden_size=spec["dim"], intermediate_size=spec["ffn"],
              num_hidden_layers=1, num_attention_heads=spec["n_heads"], num_key_value_heads=spec["n_kv_heads"],
              head_dim=spec["head_dim"], rms_norm_eps=spec["norm_eps"], max_position_embeddings=spec["seq"],
              rope_theta=spec["rope_theta"], tie_word_embeddings=True, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    lcfg = LoraConfig(r=spec["r"], lora_alpha=spec["lora_alpha"], lora_dropout=0.0,
                      target_modules=spec["target_modules"], use_rslora=spec["use_rslora"])
    peft_model = get_peft_model(model, lcfg)
    layer = peft_model.base_model.model.model.layers[0]
    params = dict(layer.named_parameters())
    with torch.no_grad():
        for name, shape in spec["tensors"].items():
            if name in ("x", "dy"):
                continue
            t = load(d, name, shape)
            if name.startswith("lora_"):
                kind, module = name.split(".")
                hf = f"{MODULE_PARENT[module]}.{module}.{kind}.default.weight"
            else:
                hf = HF_NAMES[name]
                if hf not in params:  # a targeted linear's frozen weight moved under base_layer
                    head, leaf = hf.rsplit(".", 1)
                    hf = f"{head}.base_layer.{leaf}"
            p = params[hf]
            assert tuple(p.shape) == tuple(t.shape), (name, hf, p.shape, t.shape)
            p.copy_(t.to(p.dtype))
    for name, p in params.items():
        if "lora_" in name:
            assert p.dtype == torch.float32, (name, p.dtype)  # PEFT's autocast_adapter_dtype
    x = load(d, "x", spec["tensors"]["x"]).to(dtype).requires_grad_(True)
    dy = load(d, "dy", spec["tensors"]["dy"]).to(dtype)
    pos = torch.arange(x.shape[1])[None, :]
    cos_sin = peft_model.base_model.model.model.rotary_emb(x, pos)
    out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
    y = out[0] if isinstance(out, tuple) else out
    y.backward(dy)
    y.detach().float().numpy().astype("<f4").tofile(f"{d}/{dtype_name}-y.bin")
    x.grad.float().numpy().astype("<f4").tofile(f"{d}/{dtype_name}-dx.bin")
    for name in spec["tensors"]:
        if name.startswith("lora_"):
            kind, module = name.split(".")
            g = params[f"{MODULE_PARENT[module]}.{module}.{kind}.default.weight"].grad
            g.float().numpy().astype("<f4").tofile(f"{d}/{dtype_name}-d{name}.bin")
    base_grads = [n for n, p in params.items() if "lora_" not in n and p.grad is not None]
    assert not base_grads, base_grads  # PEFT freezes the base
    print("ok", dtype_name)


if __name__ == "__main__":
    main()
