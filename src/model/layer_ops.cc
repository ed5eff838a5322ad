// A layer's forward and backward written op by op, with named saved tensors
// (model/saved_activations.h). Note [Saved activations].
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <numeric>
#include <tuple>

#include "model/model.h"
#include "model/saved_activations.h"
#include "util/errors.h"
#include "util/logging.h"

namespace strata {

// Note [Saved activations]
// Model::forward runs a layer as LibTorch ops and lets autograd keep what its
// backward needs, out of sight: the engine could only keep the whole graph or
// recompute the layer from its input (Note [Recompute] in engine/trainer.h).
// Model::layer_forward_saving runs the same ops and keeps each tensor the
// backward needs under a name (Saved); Model::layer_backward is the layer's
// backward written out with LibTorch's ops and their backward ops (the GEMMs
// as mm, the attention kernel's own backward, RMSNorm, rope and SwiGLU by
// hand). So each entry is a tensor the engine can place: keep it, send it to
// the host and bring it back, or drop it and have it again — the cheap entries
// (SavedSpec::cheap) by layer_recompute_cheap from the entries they are made
// of, any entry by running layer_forward_saving again from the input.
//
// Same bits wherever an entry comes from: a recomputed entry is the same ops
// on the same inputs as the forward's (norm_apply, rope, silu(g) * u), and
// the backward reads only entries. A recompute from the input
// (Model::layer_recompute) stops before the layer's last matrix: w2's product
// and the residual add make the output, which only the next layer reads, so
// recomputing costs the forward less 2 x dim x ffn_dim FLOPs a token
// (plan/bound.h, step_flops). Against autograd's path the results agree
// to rounding, not bit for bit: the attention is the flash kernel called
// directly (GQA's k and v repeated to H heads, their gradients summed back),
// and sums of gradients may associate differently.

// Note [LoRA layers]
// With model.lora a targeted linear (PEFT's names: q_proj = wq, k_proj, v_proj,
// o_proj = wo, gate_proj = w1, up_proj = w3, down_proj = w2) computes what
// PEFT 0.21's lora.Linear.forward computes: the frozen base's output in the
// compute dtype, and beside it the adapter in the adapters' dtype, fp32 (PEFT
// casts adapter weights to fp32 under a 16-bit base, autocast_adapter_dtype):
//   u = ((dropout(x.float()) A^T) B^T) * scaling,  y = (base.float() + u).to(base dtype)
// (in fp32 the casts are no-ops). The middle dropout(x) A^T, [B, T, r] in
// fp32, is a saved entry (Saved::kLora*), tiny beside the rest. The dropout
// mask of module m is drawn from a CPU generator seeded by (LayerSaved::
// dropout_key, m), the key a function of (run.seed, step, micro-batch,
// layer) alone (lora_dropout_key): the backward draws it again rather than
// keep it, and a recompute, a placement or a rank count gives the same mask.
// Like torch's dropout the kept values are scaled by 1 / (1 - p).
// The backward takes input gradients through the frozen weights and weight
// gradients for the adapters only: the base's matrices, norms and biases get
// none (their entries in *dw stay undefined), which saves the base's weight
// gradient GEMMs, a third of a dense layer's backward FLOPs.

namespace {

// RMSNorm in two halves, the same ops as rms_norm (model.cc): the statistics
// (fp32, kept) and their application.
at::Tensor rms_rstd(const at::Tensor& x, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  return at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
}
at::Tensor norm_apply(const at::Tensor& x, const at::Tensor& rstd, const at::Tensor& weight) {
  return (x.to(at::kFloat) * rstd).to(x.scalar_type()) * weight;
}

// RMSNorm's backward: d(input) in the input's dtype; *dw the weight's
// gradient summed over the leading dimensions (in the compute dtype, as
// autograd's sum does), unless dw is null (a frozen norm).
at::Tensor rms_norm_backward(const at::Tensor& dout, const at::Tensor& x, const at::Tensor& rstd,
                             const at::Tensor& weight, at::Tensor* dw) {
  at::Tensor n = x.to(at::kFloat) * rstd;
  std::vector<int64_t> lead(size_t(dout.dim() - 1));
  std::iota(lead.begin(), lead.end(), int64_t(0));
  if (dw != nullptr) *dw = (dout * n.to(dout.scalar_type())).sum(lead);
  at::Tensor dn = (dout * weight).to(at::kFloat);
  // d/dx of x * (mean(x^2) + eps)^-1/2 = rstd * (dn - n * mean(dn * n)).
  return (rstd * (dn - n * (dn * n).mean(-1, /*keepdim=*/true))).to(x.scalar_type());
}

// apply_rope's backward: y = x cos + rot(x) sin with rot(x) = [-x2, x1].
at::Tensor rope_backward(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = dy.size(-1) / 2;
  at::Tensor g = dy * sin;
  return dy * cos + at::cat({g.narrow(-1, half, half), -g.narrow(-1, 0, half)}, -1);
}

// k or v [B, KV, T, hd] repeated to the query's H heads (head j serves query
// heads j G .. j G + G - 1, as scaled_dot_product_attention's enable_gqa).
at::Tensor expand_heads(const at::Tensor& t, int64_t groups) {
  return groups == 1 ? t : t.repeat_interleave(groups, 1);
}
at::Tensor sum_heads(const at::Tensor& t, int64_t groups) {
  if (groups == 1) return t;
  return t.reshape({t.size(0), t.size(1) / groups, groups, t.size(2), t.size(3)}).sum(2);
}

// The causal attention kernel and its backward, called directly: the flash
// kernels (CPU; CUDA at 16 bits), the memory-efficient one for fp32 on CUDA.
struct AttentionOut {
  at::Tensor out, lse, seed, offset;
};
AttentionOut attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  if (q.is_cpu()) {
    auto [o, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, /*dropout_p=*/0.0, /*is_causal=*/true);
    return {o, lse, {}, {}};
  }
  if (q.scalar_type() != at::kFloat) {
    auto r = at::_scaled_dot_product_flash_attention(q, k, v, /*dropout_p=*/0.0, /*is_causal=*/true);
    return {std::get<0>(r), std::get<1>(r), std::get<6>(r), std::get<7>(r)};
  }
  auto r = at::_scaled_dot_product_efficient_attention(q, k, v, /*attn_bias=*/std::nullopt,
                                                       /*compute_log_sumexp=*/true, 0.0, /*is_causal=*/true);
  // Its log-sum-exp comes padded to a multiple of 32 queries; the entry is
  // the T of them that exist (Saved::kAttnLse's size; dense, as an offload
  // needs), padded again for the backward (attention_backward).
  return {std::get<0>(r), std::get<1>(r).narrow(-1, 0, q.size(2)).contiguous(), std::get<2>(r), std::get<3>(r)};
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const at::Tensor& dout, const at::Tensor& q,
                                                                  const at::Tensor& k, const at::Tensor& v,
                                                                  const at::Tensor& out, const at::Tensor& lse,
                                                                  const at::Tensor& seed, const at::Tensor& offset) {
  if (q.is_cpu()) {
    return at::_scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, true);
  }
  const int64_t t = q.size(2);
  if (q.scalar_type() != at::kFloat) {
    return at::_scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, /*cum_seq_q=*/{},
                                                            /*cum_seq_k=*/{}, t, t, 0.0, true, seed, offset);
  }
  at::Tensor padded = lse;
  if (t % 32 != 0) {  // the shape its forward returned (rows past T unused)
    padded = at::zeros({lse.size(0), lse.size(1), (t + 31) / 32 * 32}, lse.options());
    padded.narrow(-1, 0, t).copy_(lse);
  }
  auto r = at::_scaled_dot_product_efficient_attention_backward(dout, q, k, v, /*attn_bias=*/{}, out, padded, seed,
                                                                offset, 0.0, {true, true, true, false}, true);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
}

at::Tensor rows(const at::Tensor& t) { return t.reshape({-1, t.size(-1)}); }  // [..., n] -> [N, n]

// Weight indexes of a layer (model_blocks' order; the family's extras after).
enum : size_t { kAttnNormW, kWq, kWk, kWv, kWo, kMlpNormW, kW1, kW3, kW2, kExtras };

}  // namespace

// The CUDA kernels called directly skip SDPA's own checks of the head's
// width: flash (16 bits) takes a multiple of 8 up to 256, the
// memory-efficient kernel (fp32) a multiple of 4. Refused here, naming the key.
static void check_cuda_head(const ModelConfig& cfg, at::ScalarType dtype) {
  const int64_t hd = cfg.head_dim();
  const bool flash = dtype != at::kFloat;
  if (flash ? hd % 8 == 0 && hd <= 256 : hd % 4 == 0) return;
  throw ConfigError(cfg.explicit_head_dim > 0 ? "model.head_dim" : "model.n_heads",
                    strprintf("heads of %lld values: the CUDA attention kernel for %s needs %s", (long long)hd,
                              flash ? "16-bit training" : "fp32",
                              flash ? "a multiple of 8 up to 256" : "a multiple of 4"));
}

at::Tensor Model::lora_noise(LoraModule m, const at::Tensor& like, uint64_t key) const {
  const double keep = 1.0 - cfg_.lora.dropout;
  at::Generator gen = at::detail::createCPUGenerator(key ^ (0x9E3779B97F4A7C15ull * (uint64_t(m) + 1)));
  at::Tensor noise = at::empty({like.numel()}, at::TensorOptions().dtype(at::kFloat));
  noise.bernoulli_(keep, gen).div_(keep);
  return noise.view(like.sizes()).to(like.device());
}

at::Tensor Model::lora_input(LoraModule m, const at::Tensor& x, const LayerSaved& s) const {
  at::Tensor xf = x.to(at::kFloat);
  if (cfg_.lora.dropout == 0.0 || !s.dropout) return xf;
  return xf * lora_noise(m, xf, s.dropout_key);
}

at::Tensor Model::linear(LoraModule m, const std::vector<at::Tensor>& w, const at::Tensor& x, size_t weight,
                         const at::Tensor& bias, LayerSaved* s) const {
  at::Tensor base = at::linear(x, w[weight], bias);
  const int ia = lora_index_[size_t(m)];
  if (ia < 0) return base;
  at::Tensor& mid = (*s)[lora_saved(m)];
  mid = at::linear(lora_input(m, x, *s), w[size_t(ia)]);
  at::Tensor u = at::linear(mid, w[size_t(ia) + 1]) * cfg_.lora.scaling();
  return (base + u).to(base.scalar_type());
}

at::Tensor Model::lora_backward(LoraModule m, const std::vector<at::Tensor>& w, const LayerSaved& s,
                                const at::Tensor& dout, const at::Tensor& x, std::vector<at::Tensor>* dw) const {
  const size_t ia = size_t(lora_index_[size_t(m)]);
  const at::Tensor &A = w[ia], &Bm = w[ia + 1];
  at::Tensor du = dout.to(at::kFloat) * cfg_.lora.scaling();        // [N, out]
  const at::Tensor mid = rows(s[lora_saved(m)]);                    // [N, r]
  (*dw)[ia + 1] = at::mm(du.t(), mid);                              // d lora_B [out, r]
  at::Tensor dmid = at::mm(du, Bm);                                 // [N, r]
  du = at::Tensor();
  const bool masked = cfg_.lora.dropout != 0.0 && s.dropout;
  const at::Tensor noise = masked ? lora_noise(m, x, s.dropout_key) : at::Tensor();
  const at::Tensor xin = masked ? x.to(at::kFloat) * noise : x.to(at::kFloat);
  (*dw)[ia] = at::mm(dmid.t(), xin);                                // d lora_A [r, in]
  at::Tensor dx = at::mm(dmid, A);                                  // [N, in]
  if (masked) dx = dx * noise;
  return dx.to(x.scalar_type());
}

at::Tensor Model::layer_forward_saving(const std::vector<at::Tensor>& w, const at::Tensor& x,
                                       LayerSaved* s) const {
  return layer_saving(w, x, s, /*output=*/true);
}

void Model::layer_recompute(const std::vector<at::Tensor>& w, const at::Tensor& x, LayerSaved* s) const {
  layer_saving(w, x, s, /*output=*/false);
}

at::Tensor Model::layer_saving(const std::vector<at::Tensor>& w, const at::Tensor& x, LayerSaved* s,
                               bool output) const {
  LayerSaved& S = *s;
  const int64_t B = x.size(0), T = x.size(1);
  const int64_t H = cfg_.n_heads, KV = cfg_.kv_heads(), hd = cfg_.head_dim();
  const size_t qk_norm_w = cfg_.qkv_bias() ? kExtras + 3 : kExtras;
  at::Tensor bq, bk, bv;
  if (cfg_.qkv_bias()) bq = w[kExtras], bk = w[kExtras + 1], bv = w[kExtras + 2];

  if (!x.is_cpu()) check_cuda_head(cfg_, x.scalar_type());
  S[Saved::kInput] = x;
  S[Saved::kAttnRstd] = rms_rstd(x, cfg_.norm_eps);
  const at::Tensor& a = S[Saved::kAttnNormed] = norm_apply(x, S[Saved::kAttnRstd], w[kAttnNormW]);
  at::Tensor q = linear(LoraModule::kQ, w, a, kWq, bq, s).view({B, T, H, hd});
  at::Tensor k = linear(LoraModule::kK, w, a, kWk, bk, s).view({B, T, KV, hd});
  S[Saved::kV] = linear(LoraModule::kV, w, a, kWv, bv, s).view({B, T, KV, hd}).transpose(1, 2);
  if (cfg_.qk_norm()) {  // Qwen3: each head of q and k normalised before rotary
    S[Saved::kQProj] = q;
    S[Saved::kKProj] = k;
    S[Saved::kQRstd] = rms_rstd(q, cfg_.norm_eps);
    S[Saved::kKRstd] = rms_rstd(k, cfg_.norm_eps);
    q = norm_apply(q, S[Saved::kQRstd], w[qk_norm_w]);
    k = norm_apply(k, S[Saved::kKRstd], w[qk_norm_w + 1]);
  }
  auto [cos, sin] = rope(x.scalar_type(), x.device(), T);
  S[Saved::kQ] = apply_rope(q.transpose(1, 2), cos, sin);
  S[Saved::kK] = apply_rope(k.transpose(1, 2), cos, sin);
  AttentionOut att = attention_forward(S[Saved::kQ], expand_heads(S[Saved::kK], H / KV),
                                       expand_heads(S[Saved::kV], H / KV));
  S[Saved::kAttnOut] = att.out.transpose(1, 2).reshape({B, T, H * hd});
  S[Saved::kAttnLse] = att.lse;
  S.attn_seed = att.seed;
  S.attn_offset = att.offset;
  S[Saved::kMid] = x + linear(LoraModule::kO, w, S[Saved::kAttnOut], kWo, {}, s);

  S[Saved::kMlpRstd] = rms_rstd(S[Saved::kMid], cfg_.norm_eps);
  const at::Tensor& m = S[Saved::kMlpNormed] = norm_apply(S[Saved::kMid], S[Saved::kMlpRstd], w[kMlpNormW]);
  if (cfg_.is_moe()) {  // Note [Experts] in experts.cc
    at::Tensor mlp = moe_saving(w, m, s, output);
    return output ? S[Saved::kMid] + mlp : at::Tensor();
  }
  S[Saved::kGate] = linear(LoraModule::kGate, w, m, kW1, {}, s);
  S[Saved::kUp] = linear(LoraModule::kUp, w, m, kW3, {}, s);
  S[Saved::kSwiglu] = at::silu(S[Saved::kGate]) * S[Saved::kUp];
  if (!output) {
    // A recompute: the backward reads entries only. The down projection's
    // adapter middle is an entry, though its product is not.
    if (const int ia = lora_index_[size_t(LoraModule::kDown)]; ia >= 0) {
      S[Saved::kLoraDown] = at::linear(lora_input(LoraModule::kDown, S[Saved::kSwiglu], S), w[size_t(ia)]);
    }
    return at::Tensor();
  }
  return S[Saved::kMid] + linear(LoraModule::kDown, w, S[Saved::kSwiglu], kW2, {}, s);
}

void Model::layer_recompute_cheap(const std::vector<at::Tensor>& w, LayerSaved* s) const {
  LayerSaved& S = *s;
  if (!S[Saved::kAttnNormed].defined()) {
    S[Saved::kAttnNormed] = norm_apply(S[Saved::kInput], S[Saved::kAttnRstd], w[kAttnNormW]);
  }
  if (cfg_.qk_norm() && !(S[Saved::kQ].defined() && S[Saved::kK].defined())) {
    const size_t qk_norm_w = cfg_.qkv_bias() ? kExtras + 3 : kExtras;
    const at::Tensor& qp = S[Saved::kQProj];
    auto [cos, sin] = rope(qp.scalar_type(), qp.device(), qp.size(1));
    if (!S[Saved::kQ].defined()) {
      S[Saved::kQ] = apply_rope(norm_apply(qp, S[Saved::kQRstd], w[qk_norm_w]).transpose(1, 2), cos, sin);
    }
    if (!S[Saved::kK].defined()) {
      S[Saved::kK] = apply_rope(norm_apply(S[Saved::kKProj], S[Saved::kKRstd], w[qk_norm_w + 1]).transpose(1, 2),
                                cos, sin);
    }
  }
  if (!S[Saved::kMlpNormed].defined()) {
    S[Saved::kMlpNormed] = norm_apply(S[Saved::kMid], S[Saved::kMlpRstd], w[kMlpNormW]);
  }
  if (saves_[size_t(Saved::kSwiglu)] && !S[Saved::kSwiglu].defined()) {
    S[Saved::kSwiglu] = at::silu(S[Saved::kGate]) * S[Saved::kUp];
  }
  if (saves_[size_t(Saved::kExpertAct)] && !S[Saved::kExpertAct].defined()) {
    const at::Tensor& gu = S[Saved::kExpertGateUp];
    const int64_t ei = cfg_.expert_dim();
    S[Saved::kExpertAct] = at::silu(gu.narrow(-1, 0, ei)) * gu.narrow(-1, ei, ei);
  }
}

// The dense MLP's backward (layer_backward's): out = h + p w2^T, p =
// silu(gate) * up, gate = m w1^T, up = m w3^T; returns d(m) [B, T, D].
at::Tensor Model::mlp_backward(const std::vector<at::Tensor>& w, LayerSaved* s, const at::Tensor& dy,
                               std::vector<at::Tensor>* dw, bool base_grads) const {
  LayerSaved& S = *s;
  std::vector<at::Tensor>& g = *dw;
  auto drop = [&](Saved e) { S[e] = at::Tensor(); };
  auto plus_lora = [&](LoraModule m, at::Tensor dx, const at::Tensor& dout, const at::Tensor& x) {
    if (lora_index_[size_t(m)] < 0) return dx;
    return dx + lora_backward(m, w, S, dout, x, dw);
  };
  const at::Tensor dy2 = rows(dy);
  const at::Tensor p2 = rows(S[Saved::kSwiglu]);
  if (base_grads) g[kW2] = at::mm(dy2.t(), p2);
  at::Tensor dp = plus_lora(LoraModule::kDown, at::mm(dy2, w[kW2]), dy2, p2);
  drop(Saved::kSwiglu);
  const at::Tensor gate = rows(S[Saved::kGate]), up = rows(S[Saved::kUp]);
  at::Tensor d_up = dp * at::silu(gate);
  at::Tensor d_gate = at::silu_backward(dp * up, gate);
  dp = at::Tensor();
  drop(Saved::kGate);
  drop(Saved::kUp);
  const at::Tensor m2 = rows(S[Saved::kMlpNormed]);
  if (base_grads) {
    g[kW1] = at::mm(d_gate.t(), m2);
    g[kW3] = at::mm(d_up.t(), m2);
  }
  at::Tensor dm2 = at::mm(d_gate, w[kW1]) + at::mm(d_up, w[kW3]);
  dm2 = plus_lora(LoraModule::kGate, dm2, d_gate, m2);
  dm2 = plus_lora(LoraModule::kUp, dm2, d_up, m2);
  drop(Saved::kMlpNormed);
  return dm2.view_as(dy);
}

at::Tensor Model::layer_backward(const std::vector<at::Tensor>& w, LayerSaved* s, const at::Tensor& dy,
                                 std::vector<at::Tensor>* dw) const {
  layer_recompute_cheap(w, s);
  LayerSaved& S = *s;
  for (size_t i = 0; i < kSavedCount; ++i) {
    STRATA_CHECK(S.t[i].defined() || !saves_[i], std::string("layer backward without its saved ") + saved_name(Saved(i)));
  }
  const int64_t B = dy.size(0), T = dy.size(1);
  const int64_t H = cfg_.n_heads, KV = cfg_.kv_heads(), hd = cfg_.head_dim(), G = H / KV;
  dw->assign(w.size(), at::Tensor());
  std::vector<at::Tensor>& g = *dw;
  // Note [LoRA layers]: a frozen base has no weight gradients.
  const bool base_grads = !cfg_.lora.enabled;
  auto norm_grad = [&](size_t i) -> at::Tensor* { return base_grads ? &g[i] : nullptr; };
  auto drop = [&](Saved e) { S[e] = at::Tensor(); };
  // d(input) of a targeted linear's adapter, added to the base's.
  auto plus_lora = [&](LoraModule m, at::Tensor dx, const at::Tensor& dout, const at::Tensor& x) {
    if (lora_index_[size_t(m)] < 0) return dx;
    return dx + lora_backward(m, w, S, dout, x, dw);
  };

  at::Tensor dm;
  if (cfg_.is_moe()) {
    dm = moe_backward(w, s, rows(dy), dw, base_grads).view_as(dy);  // Note [Experts] in experts.cc
    drop(Saved::kMlpNormed);
  } else {
    dm = mlp_backward(w, s, dy, dw, base_grads);
  }
  at::Tensor dh = dy + rms_norm_backward(dm, S[Saved::kMid], S[Saved::kMlpRstd], w[kMlpNormW], norm_grad(kMlpNormW));
  dm = at::Tensor();
  drop(Saved::kMid);


  // Attention: h = x + o wo^T, o = attention(rope(q), rope(k), v).
  const at::Tensor dh2 = rows(dh);
  const at::Tensor o2 = rows(S[Saved::kAttnOut]);
  if (base_grads) g[kWo] = at::mm(dh2.t(), o2);
  at::Tensor d_o = plus_lora(LoraModule::kO, at::mm(dh2, w[kWo]), dh2, o2).view({B, T, H, hd}).transpose(1, 2);
  auto [dq, dk, dv] = attention_backward(d_o, S[Saved::kQ], expand_heads(S[Saved::kK], G),
                                         expand_heads(S[Saved::kV], G),
                                         S[Saved::kAttnOut].view({B, T, H, hd}).transpose(1, 2),
                                         S[Saved::kAttnLse], S.attn_seed, S.attn_offset);
  d_o = at::Tensor();
  for (Saved e : {Saved::kQ, Saved::kK, Saved::kV, Saved::kAttnOut, Saved::kAttnLse}) drop(e);
  auto [cos, sin] = rope(dy.scalar_type(), dy.device(), T);
  dq = rope_backward(dq, cos, sin).transpose(1, 2);                    // [B, T, H, hd]
  dk = rope_backward(sum_heads(dk, G), cos, sin).transpose(1, 2);      // [B, T, KV, hd]
  dv = sum_heads(dv, G).transpose(1, 2);                               // [B, T, KV, hd]
  size_t extra = kExtras;
  if (cfg_.qkv_bias()) extra += 3;
  if (cfg_.qk_norm()) {
    dq = rms_norm_backward(dq, S[Saved::kQProj], S[Saved::kQRstd], w[extra], norm_grad(extra));
    dk = rms_norm_backward(dk, S[Saved::kKProj], S[Saved::kKRstd], w[extra + 1], norm_grad(extra + 1));
  }
  const at::Tensor dq2 = dq.reshape({B * T, H * hd}), dk2 = dk.reshape({B * T, KV * hd});
  const at::Tensor dv2 = dv.reshape({B * T, KV * hd});
  if (cfg_.qkv_bias() && base_grads) {
    g[kExtras] = dq2.sum(0);
    g[kExtras + 1] = dk2.sum(0);
    g[kExtras + 2] = dv2.sum(0);
  }
  const at::Tensor a2 = rows(S[Saved::kAttnNormed]);
  if (base_grads) {
    g[kWq] = at::mm(dq2.t(), a2);
    g[kWk] = at::mm(dk2.t(), a2);
    g[kWv] = at::mm(dv2.t(), a2);
  }
  at::Tensor da2 = at::mm(dq2, w[kWq]) + at::mm(dk2, w[kWk]) + at::mm(dv2, w[kWv]);
  da2 = plus_lora(LoraModule::kQ, da2, dq2, a2);
  da2 = plus_lora(LoraModule::kK, da2, dk2, a2);
  da2 = plus_lora(LoraModule::kV, da2, dv2, a2);
  at::Tensor dx = dh + rms_norm_backward(da2.view_as(dy), S[Saved::kInput], S[Saved::kAttnRstd], w[kAttnNormW],
                                         norm_grad(kAttnNormW));
  S.clear();
  return dx;
}

}  // namespace strata
