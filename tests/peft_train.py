"""LoRA training steps under transformers + PEFT + torch AdamW, the reference of
tests/lora_train_test.cc.

Usage: peft_train.py DIR
DIR holds spec.json (base model directory, LoRA keys, optimizer, steps, batch
shape, each adapter's name and shape), the adapters' initial values as raw
little-endian fp32 files (lora_A.q_proj.L.bin ... by Strata's names and layer),
and tokens.bin (int64 [steps, sequences, seq + 1]). Runs the steps in fp32:
per micro-batch the mean cross-entropy over its tokens divided by the
micro-batches, backward, then clip_grad_norm_ over the adapters, AdamW, as
Strata's step does. With spec "masked": labels -100 where a token is flagged
not counted, each micro-batch's loss transformers' own with the step's
num_items_in_batch. Writes DIR/reference.json: per step the loss (mean over
micro-batches) and the gradient norm before clipping.
"""
import json
import sys

import numpy as np
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers.loss.loss_utils import ForCausalLMLoss

PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def main():
    d = sys.argv[1]
    spec = json.load(open(f"{d}/spec.json"))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["base"], torch_dtype=torch.float32,
                                                              attn_implementation="sdpa")
    lcfg = LoraConfig(r=spec["r"], lora_alpha=spec["lora_alpha"], lora_dropout=0.0,
                      target_modules=spec["target_modules"], use_rslora=spec["use_rslora"])
    model = get_peft_model(model, lcfg)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for layer in range(spec["n_layers"]):
            for name, shape in spec["adapters"].items():
                kind, module = name.split(".")
                key = (f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}.{kind}.default.weight")
                t = np.fromfile(f"{d}/{name}.{layer}.bin", dtype="<f4").reshape(shape)
                params[key].copy_(torch.from_numpy(t.copy()))
    trainable = [p for n, p in model.named_parameters() if p.requires_grad]
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(trainable, lr=spec["lr"], betas=(spec["beta1"], spec["beta2"]), eps=spec["eps"],
                            weight_decay=spec["weight_decay"])
    steps, seqs, width = spec["steps"], spec["sequences"], spec["seq_len"] + 1
    tokens = torch.from_numpy(np.fromfile(f"{d}/tokens.bin", dtype="<i8").reshape(steps, seqs, width).copy())
    micro = spec["micro_batch"]
    accum = seqs // micro
    out = []
    model.train()
    masked = spec.get("masked", False)
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        if masked:
            # Strata's counted targets (docs/token-format.md): bit 40 of a
            # token marks it not counted as a target; its id is the low 32
            # bits. transformers' labels are -100 there, and the loss of each
            # micro-batch is its counted targets' sum over the step's count
            # (its num_items_in_batch), as its Trainer does.
            flag = 1 << 40
            step_tokens = tokens[s]
            num_items = int(((step_tokens[:, 1:] & flag) == 0).sum())
        for m in range(accum):
            batch = tokens[s, m * micro:(m + 1) * micro]
            if masked:
                ids = batch & ((1 << 32) - 1)
                shift_labels = torch.where((batch[:, 1:] & flag) != 0, torch.full_like(ids[:, 1:], -100), ids[:, 1:])
                logits = model(input_ids=ids[:, :-1]).logits
                loss = ForCausalLMLoss(logits, None, logits.shape[-1], num_items_in_batch=num_items,
                                       shift_labels=shift_labels)
                loss.backward()
                total += loss.item() * accum
                continue
            logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                     batch[:, 1:].reshape(-1))
            (loss / accum).backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(trainable, spec["clip"])
        opt.step()
        out.append({"loss": total / accum, "grad_norm": float(norm)})
    json.dump(out, open(f"{d}/reference.json", "w"))
    print("ok")


if __name__ == "__main__":
    main()
