"""transformers' side of tests/moe_test.cc: tiny random mixture-of-experts
models, their logits and load-balancing loss, and training steps under
torch AdamW, all in fp32.

usage:
  moe_ref.py make OUT_DIR SPEC_JSON
      A random model of SPEC's family (norms, biases and routers random too),
      saved twice: OUT_DIR/per_expert (save_pretrained's default layout) and
      OUT_DIR/fused (save_original_format=False).
  moe_ref.py logits MODEL_DIR TOKENS.bin BATCH SEQ OUT.bin
      The model's logits (float32 [BATCH, SEQ, vocab]) on int64 [BATCH, SEQ]
      tokens; prints its class, its aux_loss (output_router_logits=True) and per
      layer the busiest expert's routed tokens over the mean.
  moe_ref.py train DIR
      DIR/spec.json: {"model", "steps", "sequences", "seq_len", "micro_batch",
      "lr", "beta1", "beta2", "eps", "weight_decay", "clip"}; DIR/tokens.bin:
      int64 [steps, sequences, seq_len + 1]. Per micro-batch, with
      output_router_logits on, (cross-entropy + router_aux_loss_coef x aux)
      / micro-batches, backward; then clip_grad_norm_ and AdamW, as Strata's
      step (Note [Load balancing] in src/model/experts.cc). Writes
      DIR/reference.json: per step the cross-entropy (mean over micro-batches),
      aux_loss (mean) and the gradient norm before clipping.
SPEC_JSON: {"family": "mixtral"|"qwen2_moe"|"qwen3_moe", "tied": bool,
            "experts": int, "top_k": int, "width": int, "norm_topk_prob": bool,
            "shared": int (qwen2_moe), "coef": float}
"""
import json
import sys

import numpy as np
import torch
import transformers


def make(out, spec):
    torch.manual_seed(0)
    family = spec["family"]
    fields = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                  tie_word_embeddings=spec["tied"], num_experts_per_tok=spec["top_k"],
                  router_aux_loss_coef=spec["coef"], output_router_logits=False)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=spec["width"], num_local_experts=spec["experts"], **fields)
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=spec["width"],
                                          num_experts=spec["experts"], norm_topk_prob=spec["norm_topk_prob"],
                                          head_dim=32, **fields)
    else:
        cfg = transformers.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=spec["width"],
                                          num_experts=spec["experts"], norm_topk_prob=spec["norm_topk_prob"],
                                          shared_expert_intermediate_size=spec["shared"], **fields)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight"):  # routers (and the shared expert's gate): spread-out routing
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(f"{out}/per_expert")
    model.save_pretrained(f"{out}/fused", save_original_format=False)
    print(f"class {type(model).__name__}")


def logits(model_dir, tokens_path, batch, seq, out_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    model.eval()
    tokens = torch.from_numpy(np.fromfile(tokens_path, dtype="<i8").reshape(int(batch), int(seq)).copy())
    with torch.no_grad():
        out = model(input_ids=tokens, output_router_logits=True)
    with open(out_path, "wb") as f:
        f.write(out.logits.float().contiguous().numpy().tobytes())
    print(f"class {type(model).__name__}")
    print(f"aux {out.aux_loss.item():.10e}")
    # Per layer, the busiest expert's routed tokens over the mean (Strata's expert_load).
    k, e = model.config.num_experts_per_tok, out.router_logits[0].shape[-1]
    loads = []
    for logits_l in out.router_logits:
        chosen = torch.topk(torch.softmax(logits_l.float(), -1), k, -1).indices.reshape(-1)
        counts = torch.bincount(chosen, minlength=e).double()
        loads.append(counts.max().item() / counts.mean().item())
    print("load " + " ".join(f"{x:.10e}" for x in loads))


def train(d):
    spec = json.load(open(f"{d}/spec.json"))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32,
                                                              attn_implementation="sdpa")
    coef = model.config.router_aux_loss_coef
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=spec["lr"], betas=(spec["beta1"], spec["beta2"]), eps=spec["eps"],
                            weight_decay=spec["weight_decay"])
    steps, seqs, width = spec["steps"], spec["sequences"], spec["seq_len"] + 1
    tokens = torch.from_numpy(np.fromfile(f"{d}/tokens.bin", dtype="<i8").reshape(steps, seqs, width).copy())
    micro = spec["micro_batch"]
    accum = seqs // micro
    model.train()
    out = []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        ce_total, aux_total = 0.0, 0.0
        for m in range(accum):
            batch = tokens[s, m * micro:(m + 1) * micro]
            o = model(input_ids=batch[:, :-1], output_router_logits=True)
            ce = torch.nn.functional.cross_entropy(o.logits.reshape(-1, o.logits.shape[-1]).float(),
                                                   batch[:, 1:].reshape(-1))
            ((ce + coef * o.aux_loss) / accum).backward()
            ce_total += ce.item()
            aux_total += o.aux_loss.item()
        norm = torch.nn.utils.clip_grad_norm_(params, spec["clip"])
        opt.step()
        out.append({"loss": ce_total / accum, "aux_loss": aux_total / accum, "grad_norm": float(norm)})
    json.dump(out, open(f"{d}/reference.json", "w"))
    print("ok")


def main():
    mode = sys.argv[1]
    if mode == "make":
        make(sys.argv[2], json.loads(sys.argv[3]))
    elif mode == "logits":
        logits(*sys.argv[2:7])
    elif mode == "train":
        train(sys.argv[2])
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
