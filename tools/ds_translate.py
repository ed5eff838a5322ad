"""One Strata config as the two other programs of the DeepSpeed side-by-side see it (tools/bench_deepspeed.py):
Hugging Face's LlamaConfig (the model DeepSpeed trains) and DeepSpeed's JSON config (its batch, clipping,
optimizer, schedule, precision and ZeRO-3 placement). Pure Python, no DeepSpeed or torch: tested by
tests/ds_translate_test.py.

Every key of the Strata config that changes the step's arithmetic is either carried into one of the two or
refused by name (TranslationError, one line naming the key): the comparison is of the same work or of none.
Keys that change how Strata runs the work but not its result (schedule, speculation, threads, placement
details, checkpoints, metrics) are not DeepSpeed's business and are not carried.
"""

# Strata's model defaults (docs/config.md, "model"), for keys a config leaves out.
MODEL_DEFAULTS = {"vocab_size": 256, "dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 0, "ffn_hidden": 0,
                  "multiple_of": 32, "seq_len": 128, "tie_embeddings": True, "rope_theta": 10000.0,
                  "norm_eps": 1e-5, "init_std": 0.02, "family": "llama", "head_dim": 0, "rope_scaling": None,
                  "sliding_window": 0, "init_from": "", "num_experts": 0, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 0, "norm_topk_prob": False, "shared_expert_intermediate_size": 0,
                  "router_aux_loss_coef": 0.001, "output_router_logits": False}
# DeepSpeed's defaults where Strata's differ or where DeepSpeed needs the value spelled out.
OPTIMIZER_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
PLACEMENTS = {  # --placement: (offload_optimizer.device, offload_param.device)
    "nvme": ("nvme", "nvme"),             # (1) ZeRO-Infinity
    "optimizer-nvme": ("nvme", "cpu"),    # (2) optimizer state on NVMe, parameters in RAM
    "cpu": ("cpu", "cpu"),                # (3) everything in RAM (ZeRO-Offload)
}


class TranslationError(ValueError):
    """A key whose meaning the other side cannot reproduce: the message names it."""

    def __init__(self, key, why):
        super().__init__(f"{key}: {why}")
        self.key = key


def model_section(cfg):
    m = dict(MODEL_DEFAULTS)
    m.update(cfg.get("model", {}))
    return m


def ffn_hidden(m):
    """Strata's SwiGLU width: ffn_hidden, or int(8 dim / 3) rounded up to multiple_of."""
    if m["ffn_hidden"]:
        return int(m["ffn_hidden"])
    mult = int(m["multiple_of"])
    return (8 * int(m["dim"]) // 3 + mult - 1) // mult * mult


def hf_llama_config(cfg, layers=0):
    """LlamaConfig keyword arguments for the model of a Strata config (`layers` overrides n_layers)."""
    m = model_section(cfg)
    if m["family"] not in ("llama", "mistral", "mixtral"):  # qwen2's q/k/v biases, qwen3's q/k norms: another class
        raise TranslationError("model.family", f"{m['family']!r}: only llama and mistral (LlamaForCausalLM) and "
                                               "mixtral (MixtralForCausalLM) are translated")
    if m["rope_scaling"] is not None:
        raise TranslationError("model.rope_scaling", "not translated (plain RoPE only)")
    if m["sliding_window"] and m["sliding_window"] < m["seq_len"]:
        raise TranslationError("model.sliding_window", "shorter than seq_len: LlamaForCausalLM has no window")
    dim, heads = int(m["dim"]), int(m["n_heads"])
    head_dim = int(m["head_dim"]) or dim // heads
    return {"vocab_size": int(m["vocab_size"]), "hidden_size": dim, "intermediate_size": ffn_hidden(m),
            "num_hidden_layers": int(layers or m["n_layers"]), "num_attention_heads": heads,
            "num_key_value_heads": int(m["n_kv_heads"]) or heads, "head_dim": head_dim,
            "max_position_embeddings": int(m["seq_len"]), "rope_theta": float(m["rope_theta"]),
            "rms_norm_eps": float(m["norm_eps"]), "tie_word_embeddings": bool(m["tie_embeddings"]),
            "initializer_range": float(m["init_std"]), "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, **moe_fields(m)}


def moe_fields(m):
    """MixtralConfig's keywords for a mixtral model section (its experts' width is intermediate_size), with
    model_type "mixtral" (the class); nothing for a dense model."""
    if m["family"] != "mixtral":
        return {}
    if not int(m["num_experts"]):
        raise TranslationError("model.num_experts", "required for family mixtral")
    return {"model_type": "mixtral", "num_local_experts": int(m["num_experts"]),
            "num_experts_per_tok": int(m["num_experts_per_tok"]),
            "intermediate_size": int(m["moe_intermediate_size"]) or ffn_hidden(m),
            "router_aux_loss_coef": float(m["router_aux_loss_coef"]),
            "output_router_logits": bool(m["output_router_logits"]), "router_jitter_noise": 0.0}


def batch(cfg, world_size=1):
    """(micro-batch, accumulation) per rank, as Strata infers them (DeepSpeed's rule)."""
    micro = cfg.get("train_micro_batch_size_per_gpu")
    accum = cfg.get("gradient_accumulation_steps")
    total = cfg.get("train_batch_size")
    if micro is None:
        micro = total // ((accum or 1) * world_size) if total else 8
    if accum is None:
        accum = max(1, total // (micro * world_size)) if total else 1
    if total is not None and total != micro * accum * world_size:
        raise TranslationError("train_batch_size", f"{total} != {micro} x {accum} x {world_size} ranks")
    return int(micro), int(accum)


def precision(cfg, device):
    """'bf16', 'fp16' or 'fp32': the compute dtype both engines use."""
    bf16 = cfg.get("bf16", {}).get("enabled", False)
    fp16 = cfg.get("fp16", {}).get("enabled", False)
    if fp16 and device == "cpu":
        raise TranslationError("fp16.enabled", "DeepSpeed's CPU accelerator trains bf16 or fp32 only")
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def check_run(cfg):
    """The run keys that change the arithmetic: both engines must recompute the same way, store moments alike."""
    run = cfg.get("run", {})
    recompute = run.get("recompute", "auto")
    if recompute not in ("always", "never"):
        raise TranslationError("run.recompute", f"{recompute!r}: set \"always\" (DeepSpeed's gradient "
                                                "checkpointing) or \"never\" so that both engines do the same work")
    if run.get("optimizer_state_dtype", "fp32") != "fp32":
        raise TranslationError("run.optimizer_state_dtype", "DeepSpeed's CPU Adam keeps fp32 moments")
    return recompute == "always"


def ds_config(cfg, placement, nvme_path, world_size=1, device="cpu", tuning=None):
    """DeepSpeed's JSON config for the Strata config's work at `placement` (a PLACEMENTS key) with swap files
    under `nvme_path`; `tuning` (dict) adds DeepSpeed's own knobs: "param_buffer_count", "param_buffer_size",
    "optimizer_buffer_count", "optimizer_pipeline" (bool), "aio" (a dict), "sub_group_size", "prefetch_bucket_size", "max_live_parameters",
    "max_reuse_distance", "persistence_threshold"."""
    tuning = dict(tuning or {})
    micro, accum = batch(cfg, world_size)
    prec = precision(cfg, device)
    check_run(cfg)
    opt = cfg.get("optimizer", {})
    kind = opt.get("type", "AdamW")
    if kind not in ("Adam", "AdamW"):
        raise TranslationError("optimizer.type", f"{kind!r}")
    params = dict(OPTIMIZER_DEFAULTS)
    params.update({k: v for k, v in opt.get("params", {}).items() if k in ("lr", "betas", "eps", "weight_decay")})
    # Strata: type AdamW, or Adam with adam_w_mode true (its default), decays decoupled; DeepSpeed's "Adam"
    # type reads adam_w_mode the same way. Carried as given.
    ds_opt = {"type": kind, "params": {"lr": params["lr"], "betas": list(params["betas"]), "eps": params["eps"],
                                        "weight_decay": params["weight_decay"]}}
    if "adam_w_mode" in opt.get("params", {}):
        ds_opt["params"]["adam_w_mode"] = bool(opt["params"]["adam_w_mode"])
    if placement not in PLACEMENTS:
        raise TranslationError("placement", f"{placement!r}: one of {', '.join(PLACEMENTS)}")
    opt_dev, param_dev = PLACEMENTS[placement]
    model = hf_llama_config(cfg)
    off_opt = {"device": opt_dev, "pin_memory": True}
    if opt_dev == "nvme":
        off_opt.update(nvme_path=nvme_path, buffer_count=int(tuning.get("optimizer_buffer_count", 4)))
        if tuning.get("optimizer_pipeline"):  # read sub-group j+1 and write j-1 while j is updated
            off_opt.update(pipeline_read=True, pipeline_write=True)
    off_param = {"device": param_dev, "pin_memory": True}
    if param_dev == "nvme":
        # Every swapped parameter holds one buffer while in use, each at least as large as the largest
        # tensor (the embedding); max_in_cpu 0: nothing kept back in RAM (DeepSpeed's 1e9 keeps small
        # models whole).
        largest = model["vocab_size"] * model["hidden_size"]
        off_param.update(nvme_path=nvme_path, max_in_cpu=0,
                         buffer_count=int(tuning.get("param_buffer_count", 16)),
                         buffer_size=int(max(largest, tuning.get("param_buffer_size", 0))))
    zero = {"stage": 3, "offload_optimizer": off_opt, "offload_param": off_param, "overlap_comm": True,
            "contiguous_gradients": True}
    for key, ds_key in (("sub_group_size", "sub_group_size"), ("prefetch_bucket_size", "stage3_prefetch_bucket_size"),
                        ("max_live_parameters", "stage3_max_live_parameters"),
                        ("max_reuse_distance", "stage3_max_reuse_distance"),
                        ("persistence_threshold", "stage3_param_persistence_threshold")):
        if key in tuning:
            zero[ds_key] = int(tuning[key])
    out = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
           "gradient_clipping": float(cfg.get("gradient_clipping", 1.0)), "steps_per_print": 1_000_000,
           "optimizer": ds_opt, "zero_optimization": zero}
    if prec == "bf16":
        out["bf16"] = {"enabled": True}
    elif prec == "fp16":
        out["fp16"] = dict(cfg.get("fp16", {}), enabled=True)
    if "scheduler" in cfg:  # the same DeepSpeed scheduler block: both engines read its keys alike
        out["scheduler"] = cfg["scheduler"]
    if "aio" in tuning:
        out["aio"] = dict(tuning["aio"])
    elif "aio" in cfg:
        out["aio"] = dict(cfg["aio"])
    return out


def strata_config(cfg, placement, nvme_path):
    """The Strata side of the same placement: the user's config with DeepSpeed's placement keys (no DeepSpeed
    tuning: Strata runs its own defaults)."""
    if placement not in PLACEMENTS:
        raise TranslationError("placement", f"{placement!r}: one of {', '.join(PLACEMENTS)}")
    out = {k: v for k, v in cfg.items() if k not in ("zero_optimization", "placement")}
    opt_dev, param_dev = PLACEMENTS[placement]
    zero = {"stage": 3, "offload_optimizer": {"device": opt_dev}, "offload_param": {"device": param_dev}}
    if opt_dev == "nvme":
        zero["offload_optimizer"]["nvme_path"] = nvme_path
    if param_dev == "nvme":
        # Strata's staging buffers must hold the largest block's shard (checked at start): a DeepSpeed
        # user sizes buffer_size the same way for DeepSpeed's largest tensor.
        zero["offload_param"].update(nvme_path=nvme_path, max_in_cpu=0,
                                     buffer_size=max(100_000_000, largest_block(cfg)))
    out["zero_optimization"] = zero
    return out


def largest_block(cfg, layers=0):
    """Elements of the model's largest block (a layer, or the embedding / head with the final norm), rounded
    up to 1 Mi (above any shard padding)."""
    h = hf_llama_config(cfg, layers)
    dim, hd = h["hidden_size"], h["head_dim"]
    layer = dim * hd * (2 * h["num_attention_heads"] + 2 * h["num_key_value_heads"]) + \
        3 * dim * h["intermediate_size"] * h.get("num_local_experts", 1) + 2 * dim + \
        dim * h.get("num_local_experts", 0)
    largest = max(layer, h["vocab_size"] * dim + dim)
    return (largest + (1 << 20) - 1) >> 20 << 20


def parameters(cfg, layers=0):
    """The model's parameter count from the LlamaConfig keywords (embedding, untied head, layers, final norm)."""
    h = hf_llama_config(cfg, layers)
    dim, hd = h["hidden_size"], h["head_dim"]
    attn = dim * hd * (2 * h["num_attention_heads"] + 2 * h["num_key_value_heads"])
    layer = attn + 3 * dim * h["intermediate_size"] * h.get("num_local_experts", 1) + 2 * dim + \
        dim * h.get("num_local_experts", 0)
    embed = h["vocab_size"] * dim * (1 if h["tie_word_embeddings"] else 2)
    return embed + h["num_hidden_layers"] * layer + dim
