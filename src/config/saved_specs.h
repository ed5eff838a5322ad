// A layer's saved activations by name, from the model's shape alone (no
// LibTorch: the plan sizes them for models far larger than the machine):
// what the layer's explicit forward keeps for its explicit backward (Note
// [Saved activations] in model/layer_ops.cc), each entry with its size per
// token, its element type, and whether it is cheap to have again
// (elementwise work over other entries) or not (a GEMM's or the attention's
// output, or the input).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "config/config.h"

namespace strata {

// One layer of B x T tokens; D = dim, F = ffn_dim, H = n_heads, KV =
// kv_heads, hd = head_dim. "cheap": elementwise from the entries named.
enum class Saved : uint8_t {
  kInput,       // x  [B, T, D]: the layer's input (today's activation checkpoint)
  kAttnRstd,    // r1 [B, T, 1] fp32: 1 / rms(x)
  kAttnNormed,  // a  [B, T, D]: rms_norm(x) * attn_norm            cheap (x, r1)
  kQProj,       // qp [B, T, H * hd]: a wq^T (+ bq)                  Qwen3 only (q_norm's input)
  kKProj,       // kp [B, T, KV * hd]: a wk^T (+ bk)                 Qwen3 only
  kQRstd,       // [B, T, H, 1] fp32: q_norm's 1 / rms               Qwen3 only
  kKRstd,       // [B, T, KV, 1] fp32                                Qwen3 only
  kQ,           // q  [B, H, T, hd]: the attention's q, after rope   cheap with Qwen3 (qp, r_q)
  kK,           // k  [B, KV, T, hd]: after rope                     cheap with Qwen3 (kp, r_k)
  kV,           // v  [B, KV, T, hd]
  kAttnOut,     // o  [B, T, H * hd]: the attention's output
  kAttnLse,     // [B, H, T] fp32: the attention's log-sum-exp per row
  kMid,         // h  [B, T, D]: x + o wo^T
  kMlpRstd,     // r2 [B, T, 1] fp32: 1 / rms(h)
  kMlpNormed,   // m  [B, T, D]: rms_norm(h) * mlp_norm              cheap (h, r2)
  kGate,        // g  [B, T, F]: m w1^T
  kUp,          // u  [B, T, F]: m w3^T
  kSwiglu,      // p  [B, T, F]: silu(g) * u                         cheap (g, u)
  // Experts (Note [Experts] in model/layer_ops.cc; E = num_experts, k =
  // num_experts_per_tok, I = the expert width). kGate, kUp and kSwiglu are
  // then the shared expert's (qwen2_moe; F its width), absent without one.
  kRouterLogits,  // [B T, E]: m router^T (the routing is made again from it)
  kExpertGateUp,  // [B T k, 2 I]: each token copy's gate and up, sorted by expert
  kExpertAct,     // [B T k, I]: silu(gate) * up                      cheap (gate_up)
  kSharedGate,    // [B T, 1]: the shared expert's gate logit, m shared_gate^T   qwen2_moe
  // LoRA (model.lora): per targeted linear, its adapter's middle
  // dropout(x) A^T [B, T, r] in fp32 (Note [LoRA layers] in model/layer_ops.cc).
  kLoraQ,
  kLoraK,
  kLoraV,
  kLoraO,
  kLoraGate,
  kLoraUp,
  kLoraDown,
};
inline constexpr size_t kSavedCount = size_t(Saved::kLoraDown) + 1;
// The adapter middle of LoRA module m (LoraModule's order).
inline Saved lora_saved(LoraModule m) { return Saved(size_t(Saved::kLoraQ) + size_t(m)); }

const char* saved_name(Saved s);  // "input", "attn_rstd", ... (strata plan's names)

// What a saved entry is.
struct SavedSpec {
  Saved id;
  int64_t elems_per_token;  // elements per token of the micro-batch
  bool fp32;                // fp32, else the compute dtype
  bool cheap;               // elementwise from other entries (no GEMM, no attention)
};
// The entries a layer of `cfg` saves, in Saved's order (the Qwen3-only ones
// only for Qwen3, a LoRA middle only for a targeted module).
std::vector<SavedSpec> layer_saved_specs(const ModelConfig& cfg);
// Bytes of one entry for `tokens` tokens at compute dtype `dtype_bytes`.
inline int64_t saved_bytes(const SavedSpec& s, int64_t tokens, int dtype_bytes) {
  return s.elems_per_token * tokens * (s.fp32 ? 4 : dtype_bytes);
}

// Bytes per token of the entries a layer keeps when it keeps them (those not
// cheap, input included), and of all its entries (what one layer's forward
// makes).
int64_t kept_entry_bytes_per_token(const ModelConfig& cfg, int dtype_bytes);
int64_t all_entry_bytes_per_token(const ModelConfig& cfg, int dtype_bytes);

}  // namespace strata
