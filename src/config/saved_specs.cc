#include "config/saved_specs.h"

namespace strata {

const char* saved_name(Saved s) {
  static constexpr const char* kNames[kSavedCount] = {
      "input", "attn_rstd", "attn_normed", "q_proj", "k_proj", "q_rstd", "k_rstd", "q",
      "k",     "v",         "attn_out",    "attn_lse", "mid",  "mlp_rstd", "mlp_normed",
      "gate",  "up",        "swiglu", "router_logits", "expert_gate_up", "expert_act", "shared_gate",
      "lora.q_proj", "lora.k_proj", "lora.v_proj", "lora.o_proj",
      "lora.gate_proj", "lora.up_proj", "lora.down_proj"};
  return kNames[size_t(s)];
}

std::vector<SavedSpec> layer_saved_specs(const ModelConfig& cfg) {
  const int64_t d = cfg.dim, h = cfg.n_heads, kv = cfg.kv_heads(), hd = cfg.head_dim();
  const int64_t f = cfg.is_moe() ? cfg.moe.shared_expert_intermediate_size : cfg.ffn_dim();
  const bool qk = cfg.qk_norm();
  std::vector<SavedSpec> specs = {
      {Saved::kInput, d, false, false},
      {Saved::kAttnRstd, 1, true, false},
      {Saved::kAttnNormed, d, false, true},
  };
  if (qk) {
    specs.push_back({Saved::kQProj, h * hd, false, false});
    specs.push_back({Saved::kKProj, kv * hd, false, false});
    specs.push_back({Saved::kQRstd, h, true, false});
    specs.push_back({Saved::kKRstd, kv, true, false});
  }
  const std::vector<SavedSpec> rest = {
      {Saved::kQ, h * hd, false, qk},
      {Saved::kK, kv * hd, false, qk},
      {Saved::kV, kv * hd, false, false},
      {Saved::kAttnOut, h * hd, false, false},
      {Saved::kAttnLse, h, true, false},
      {Saved::kMid, d, false, false},
      {Saved::kMlpRstd, 1, true, false},
      {Saved::kMlpNormed, d, false, true},
  };
  specs.insert(specs.end(), rest.begin(), rest.end());
  if (f > 0) {  // the dense MLP, or the shared expert
    specs.push_back({Saved::kGate, f, false, false});
    specs.push_back({Saved::kUp, f, false, false});
    specs.push_back({Saved::kSwiglu, f, false, true});
  }
  if (cfg.is_moe()) {
    const int64_t k = cfg.moe.num_experts_per_tok, i = cfg.expert_dim();
    specs.push_back({Saved::kRouterLogits, cfg.moe.num_experts, false, false});
    specs.push_back({Saved::kExpertGateUp, k * 2 * i, false, false});
    specs.push_back({Saved::kExpertAct, k * i, false, true});
    if (cfg.shared_expert()) specs.push_back({Saved::kSharedGate, 1, false, false});
  }
  for (size_t m = 0; m < kLoraModuleCount; ++m) {
    if (cfg.lora.targets_module(LoraModule(m))) specs.push_back({lora_saved(LoraModule(m)), cfg.lora.r, true, false});
  }
  return specs;
}

int64_t kept_entry_bytes_per_token(const ModelConfig& cfg, int dtype_bytes) {
  int64_t n = 0;
  for (const SavedSpec& s : layer_saved_specs(cfg)) n += s.cheap ? 0 : saved_bytes(s, 1, dtype_bytes);
  return n;
}

int64_t all_entry_bytes_per_token(const ModelConfig& cfg, int dtype_bytes) {
  int64_t n = 0;
  for (const SavedSpec& s : layer_saved_specs(cfg)) n += saved_bytes(s, 1, dtype_bytes);
  return n;
}

}  // namespace strata
