#include "model/model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/core/Generator.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "util/errors.h"

namespace strata {

namespace {

// Per targeted linear W [out, in], after the layer's base parameters:
// lora_A.<module> [r, in] and lora_B.<module> [out, r] (PEFT's shapes). A is
// PEFT's init: kaiming_uniform_(a = sqrt 5), i.e. U(-1/sqrt(in), 1/sqrt(in)),
// or normal with std 1/r ("gaussian"); B zeros, so the adapted model starts
// as the base.
void add_lora_adapters(const ModelConfig& cfg, std::vector<ParamSpec>* p) {
  const LoraConfig& l = cfg.lora;
  for (size_t i = 0; i < kLoraModuleCount; ++i) {
    const LoraModule m = LoraModule(i);
    if (!l.targets_module(m)) continue;
    const auto [out, in] = lora_module_shape(cfg, m);
    const std::string name = lora_module_name(m);
    if (l.init == LoraInit::kGaussian) {
      p->push_back({"lora_A." + name, {l.r, in}, Init::kNormal, 1.0 / double(l.r)});
    } else {
      p->push_back({"lora_A." + name, {l.r, in}, Init::kUniform, 1.0 / std::sqrt(double(in))});
    }
    p->push_back({"lora_B." + name, {out, l.r}, Init::kZeros, 0.0});
  }
}

}  // namespace

std::vector<BlockDesc> model_blocks(const ModelConfig& cfg) {
  std::vector<BlockDesc> blocks_;
  const int64_t d = cfg.dim, hd = cfg.head_dim(), h = cfg.n_heads, kv = cfg.kv_heads();
  const int64_t f = cfg.ffn_dim(), v = cfg.vocab_size;
  const double std = cfg.init_std;
  // Residual output projections start smaller so the residual stream's
  // variance does not grow with depth (GPT-2's scheme).
  const double out_std = std / std::sqrt(2.0 * double(cfg.n_layers));

  blocks_.push_back({BlockKind::kEmbedding, "embedding", {{"tok_embedding", {v, d}, Init::kNormal, std}}});
  const int64_t e = cfg.moe.num_experts, ei = cfg.expert_dim(), si = cfg.moe.shared_expert_intermediate_size;
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    blocks_.push_back({BlockKind::kLayer,
                       "layer." + std::to_string(l),
                       {
                           {"attn_norm", {d}, Init::kOnes, 0.0},
                           {"wq", {h * hd, d}, Init::kNormal, std},
                           {"wk", {kv * hd, d}, Init::kNormal, std},
                           {"wv", {kv * hd, d}, Init::kNormal, std},
                           {"wo", {d, h * hd}, Init::kNormal, out_std},
                           {"mlp_norm", {d}, Init::kOnes, 0.0},
                       }});
    std::vector<ParamSpec>& p = blocks_.back().params;
    if (cfg.is_moe()) {
      // Note [Experts] (layer_ops.cc): the router and the experts in
      // transformers 5's fused layout, gate rows before up rows.
      p.push_back({"router", {e, d}, Init::kNormal, std});
      p.push_back({"experts.gate_up", {e, 2 * ei, d}, Init::kNormal, std});
      p.push_back({"experts.down", {e, d, ei}, Init::kNormal, out_std});
    } else {
      p.push_back({"w1", {f, d}, Init::kNormal, std});       // gate
      p.push_back({"w3", {f, d}, Init::kNormal, std});       // up
      p.push_back({"w2", {d, f}, Init::kNormal, out_std});  // down
    }
    // Family extras go after Llama's nine, so that a Llama layer's layout
    // (and every checkpoint of one) is the same as before they existed.
    if (cfg.qkv_bias()) {
      p.push_back({"bq", {h * hd}, Init::kZeros, 0.0});
      p.push_back({"bk", {kv * hd}, Init::kZeros, 0.0});
      p.push_back({"bv", {kv * hd}, Init::kZeros, 0.0});
    }
    if (cfg.qk_norm()) {
      p.push_back({"q_norm", {hd}, Init::kOnes, 0.0});
      p.push_back({"k_norm", {hd}, Init::kOnes, 0.0});
    }
    if (cfg.shared_expert()) {  // qwen2_moe
      p.push_back({"shared.w1", {si, d}, Init::kNormal, std});
      p.push_back({"shared.w3", {si, d}, Init::kNormal, std});
      p.push_back({"shared.w2", {d, si}, Init::kNormal, out_std});
      p.push_back({"shared.gate", {1, d}, Init::kNormal, std});
    }
    add_lora_adapters(cfg, &p);
  }
  BlockDesc head{BlockKind::kHead, "head", {{"final_norm", {d}, Init::kOnes, 0.0}}};
  if (!cfg.tie_embeddings) head.params.push_back({"output", {v, d}, Init::kNormal, std});
  blocks_.push_back(std::move(head));
  if (cfg.lora.enabled) {  // Note [State kinds]: the base is frozen, in the embedding and head too
    for (BlockDesc& b : blocks_) {
      for (ParamSpec& s : b.params) s.frozen = s.name.rfind("lora_", 0) != 0;
    }
  }
  return blocks_;
}

at::Tensor scaled_inv_freq(const at::Tensor& inv_freq, const RopeScaling& r) {
  switch (r.type) {
    case RopeType::kNone:
      return inv_freq;
    case RopeType::kLinear:  // positions divided by the factor
      return inv_freq / r.factor;
    case RopeType::kLlama3: {
      // Llama 3.1's scheme: wavelengths longer than the original context's
      // low-frequency limit are stretched by `factor`, shorter than its
      // high-frequency limit kept, and those between interpolated smoothly.
      const double old_len = double(r.original_max_position_embeddings);
      const double low_wavelen = old_len / r.low_freq_factor, high_wavelen = old_len / r.high_freq_factor;
      at::Tensor wavelen = 2.0 * M_PI / inv_freq;
      at::Tensor stretched = at::where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq);
      at::Tensor smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
      at::Tensor smoothed = (1.0 - smooth) * stretched / r.factor + smooth * stretched;
      at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
      return at::where(medium, smoothed, stretched);
    }
  }
  throw InternalError(__FILE__, __LINE__, "unknown rope type");
}

Model::Model(const ModelConfig& cfg) : cfg_(cfg), blocks_(model_blocks(cfg)) {
  for (const SavedSpec& s : layer_saved_specs(cfg)) saves_[size_t(s.id)] = true;
  lora_index_.fill(-1);
  if (cfg.n_layers > 0) {
    const std::vector<ParamSpec>& p = blocks_.at(1).params;
    for (size_t i = 0; i < p.size(); ++i) {
      for (size_t m = 0; m < kLoraModuleCount; ++m) {
        if (p[i].name == std::string("lora_A.") + lora_module_name(LoraModule(m))) lora_index_[m] = int(i);
      }
    }
  }
  const int64_t hd = cfg.head_dim();
  // Rotary tables: angle(t, i) = t * theta^(-2i/hd), duplicated over both halves.
  auto opts = at::TensorOptions().dtype(at::kFloat);
  at::Tensor inv_freq = scaled_inv_freq(
      at::pow(cfg.rope_theta, at::arange(0, hd, 2, opts.dtype(at::kDouble)) / double(hd)).reciprocal(),
      cfg.rope_scaling);
  at::Tensor t = at::arange(cfg.seq_len, opts.dtype(at::kDouble));
  at::Tensor angles = at::outer(t, inv_freq);           // [T, hd/2]
  angles = at::cat({angles, angles}, /*dim=*/-1);       // [T, hd]
  cos_f32_ = angles.cos().to(at::kFloat);
  sin_f32_ = angles.sin().to(at::kFloat);
}

std::vector<std::pair<std::string, std::vector<ParamSpec>>> model_layout_specs(const ModelConfig& cfg) {
  std::vector<std::pair<std::string, std::vector<ParamSpec>>> out;
  for (const BlockDesc& b : model_blocks(cfg)) out.emplace_back(b.name, b.params);
  return out;
}

std::vector<std::pair<std::string, std::vector<ParamSpec>>> Model::layout_specs() const {
  std::vector<std::pair<std::string, std::vector<ParamSpec>>> out;
  for (const BlockDesc& b : blocks_) out.emplace_back(b.name, b.params);
  return out;
}

double Model::flops_per_token() const {
  // 2 FLOPs per MAC forward, 2 for the input gradient, 2 for the weight
  // gradient, which a frozen matrix has not.
  double matrix_flops = 0;
  for (const BlockDesc& b : blocks_) {
    if (b.kind == BlockKind::kEmbedding) continue;  // a lookup, no FLOPs
    for (const ParamSpec& p : b.params) {
      if (p.shape.size() == 2) matrix_flops += (p.frozen ? 4.0 : 6.0) * double(p.numel());
    }
  }
  if (cfg_.tie_embeddings) matrix_flops += (cfg_.lora.enabled ? 4.0 : 6.0) * double(cfg_.vocab_size * cfg_.dim);
  if (cfg_.is_moe()) {
    // The experts ([E, ., .], not counted above) a token meets: its top k.
    const double active = double(cfg_.moe.num_experts_per_tok) * 3.0 * double(cfg_.dim) * double(cfg_.expert_dim());
    matrix_flops += (cfg_.lora.enabled ? 4.0 : 6.0) * double(cfg_.n_layers) * active;
  }
  // Attention scores and the weighted sum: 2 matmuls of T x hd per head and
  // token, forward 2 FLOPs per MAC, backward twice the forward; halved for the
  // causal mask is ignored, as is customary.
  const double attn = 12.0 * double(cfg_.n_layers) * double(cfg_.seq_len) * double(cfg_.q_dim());
  return matrix_flops + attn;
}

std::pair<at::Tensor, at::Tensor> Model::rope(at::ScalarType dtype, c10::Device device, int64_t t) const {
  STRATA_CHECK(t <= cfg_.seq_len, "sequence longer than model.seq_len");
  if (dtype == at::kFloat && device.is_cpu()) return {cos_f32_.narrow(0, 0, t), sin_f32_.narrow(0, 0, t)};
  if (!cos_cast_.defined() || cos_cast_.scalar_type() != dtype || cos_cast_.device() != device) {
    // Once per dtype and device (computed in double on the CPU, then cast).
    cos_cast_ = cos_f32_.to(device, dtype);
    sin_cast_ = sin_f32_.to(device, dtype);
  }
  return {cos_cast_.narrow(0, 0, t), sin_cast_.narrow(0, 0, t)};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return normed.to(x.scalar_type()) * weight;
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor x1 = x.narrow(-1, 0, half);
  at::Tensor x2 = x.narrow(-1, half, half);
  at::Tensor rotated = at::cat({-x2, x1}, -1);
  return x * cos + rotated * sin;
}

at::Tensor Model::layer_forward(const std::vector<at::Tensor>& w, const at::Tensor& x) const {
  const at::Tensor &attn_norm = w[0], &wq = w[1], &wk = w[2], &wv = w[3], &wo = w[4];
  const at::Tensor& mlp_norm = w[5];
  const int64_t B = x.size(0), T = x.size(1);
  const int64_t H = cfg_.n_heads, KV = cfg_.kv_heads(), hd = cfg_.head_dim();

  // Family extras follow Llama's nine weights (model_blocks).
  size_t extra = 9;
  at::Tensor bq, bk, bv;
  if (cfg_.qkv_bias()) {
    bq = w[extra], bk = w[extra + 1], bv = w[extra + 2];
    extra += 3;
  }

  // A targeted linear adds its adapter: PEFT's Linear.forward in eval mode.
  auto lin = [&](LoraModule mod, const at::Tensor& in, const at::Tensor& weight, const at::Tensor& bias) {
    at::Tensor base = at::linear(in, weight, bias);
    const int ia = lora_index_[size_t(mod)];
    if (ia < 0) return base;
    const at::Tensor& A = w[size_t(ia)];
    const at::Tensor& Bm = w[size_t(ia) + 1];
    at::Tensor u = at::linear(at::linear(in.to(A.scalar_type()), A), Bm) * cfg_.lora.scaling();
    return (base + u).to(base.scalar_type());
  };
  at::Tensor a = rms_norm(x, attn_norm, cfg_.norm_eps);
  at::Tensor q = lin(LoraModule::kQ, a, wq, bq).view({B, T, H, hd});   // [B, T, H, hd]
  at::Tensor k = lin(LoraModule::kK, a, wk, bk).view({B, T, KV, hd});  // [B, T, KV, hd]
  at::Tensor v = lin(LoraModule::kV, a, wv, bv).view({B, T, KV, hd}).transpose(1, 2);
  if (cfg_.qk_norm()) {  // Qwen3: each head of q and k normalised before rotary
    q = rms_norm(q, w[extra], cfg_.norm_eps);
    k = rms_norm(k, w[extra + 1], cfg_.norm_eps);
  }
  q = q.transpose(1, 2);  // [B, H, T, hd]
  k = k.transpose(1, 2);  // [B, KV, T, hd]
  auto [cos, sin] = rope(x.scalar_type(), x.device(), T);
  q = apply_rope(q, cos, sin);
  k = apply_rope(k, cos, sin);
  at::Tensor y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                                  /*is_causal=*/true, /*scale=*/std::nullopt,
                                                  /*enable_gqa=*/KV != H);
  y = y.transpose(1, 2).reshape({B, T, H * hd});
  at::Tensor h = x + lin(LoraModule::kO, y, wo, {});

  at::Tensor m = rms_norm(h, mlp_norm, cfg_.norm_eps);
  if (cfg_.is_moe()) return h + moe_forward(w, m);  // Note [Experts] in experts.cc
  const at::Tensor &w1 = w[6], &w3 = w[7], &w2 = w[8];
  at::Tensor gate = at::silu(lin(LoraModule::kGate, m, w1, {}));
  return h + lin(LoraModule::kDown, gate * lin(LoraModule::kUp, m, w3, {}), w2, {});
}

at::Tensor Model::forward(size_t b, const std::vector<at::Tensor>& w, const at::Tensor& x,
                          const at::Tensor& tied) const {
  const BlockDesc& desc = blocks_.at(b);
  STRATA_CHECK(w.size() == desc.params.size(), "wrong number of weights for block " + desc.name);
  switch (desc.kind) {
    case BlockKind::kEmbedding:
      return at::embedding(w[0], x);
    case BlockKind::kLayer:
      return layer_forward(w, x);
    case BlockKind::kHead: {
      const at::Tensor& out = cfg_.tie_embeddings ? tied : w[1];
      STRATA_CHECK(out.defined(), "tied head needs the embedding weight");
      return at::linear(rms_norm(x, w[0], cfg_.norm_eps), out);
    }
  }
  throw InternalError(__FILE__, __LINE__, "unknown block kind");
}

std::vector<at::Tensor> param_views(const BlockLayout& layout, const at::Tensor& frozen_block,
                                    const at::Tensor& flat_block) {
  std::vector<at::Tensor> views;
  views.reserve(layout.frozen.size() + layout.params.size());
  if (!layout.frozen.empty()) {
    STRATA_CHECK(frozen_block.defined() && frozen_block.dim() == 1 && frozen_block.numel() >= layout.frozen_numel,
                 "frozen buffer too small for block " + layout.name);
    for (const ParamLayout& p : layout.frozen) {
      views.push_back(frozen_block.narrow(0, p.offset, p.spec.numel()).view(p.spec.shape));
    }
  }
  if (!layout.params.empty()) {
    for (at::Tensor& v : param_views(layout, flat_block)) views.push_back(std::move(v));
  }
  return views;
}

std::vector<at::Tensor> param_views(const BlockLayout& layout, const at::Tensor& flat_block) {
  STRATA_CHECK(flat_block.dim() == 1 && flat_block.numel() >= layout.numel,
               "flat buffer too small for block " + layout.name);
  std::vector<at::Tensor> views;
  views.reserve(layout.params.size());
  for (const ParamLayout& p : layout.params) {
    views.push_back(flat_block.narrow(0, p.offset, p.spec.numel()).view(p.spec.shape));
  }
  return views;
}

namespace {

// splitmix64's finaliser: a 64-bit mix whose every output bit depends on every
// input bit, so neighbouring keys give unrelated generator seeds.
uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t lora_dropout_key(uint64_t seed, int64_t step, int64_t micro_batch, int64_t layer) {
  uint64_t h = mix64(seed ^ 0x4C6F5241ull);  // "LoRA": apart from init_chunk_seed's keys
  h = mix64(h ^ uint64_t(step));
  h = mix64(h ^ uint64_t(micro_batch));
  return mix64(h ^ uint64_t(layer));
}

uint64_t init_chunk_seed(uint64_t seed, size_t block_index, size_t param_index, int64_t chunk) {
  uint64_t h = mix64(seed);
  h = mix64(h ^ uint64_t(block_index));
  h = mix64(h ^ uint64_t(param_index));
  return mix64(h ^ uint64_t(chunk));
}

// Note [Initial weights]
// A parameter's normal draws come in chunks of kInitChunk elements, chunk c of
// parameter p of block b from its own generator seeded by
// init_chunk_seed(run.seed, b, p, c). The chunks are independent, so they are
// drawn on every intra-op thread (one generator drew 8 B parameters in about
// 50 s on the H200 host, the start-up's largest part: BENCHMARKS.md, "GPU,
// round 2"), and the values depend on the seed and the model's shape alone
// (on one kind of CPU: LibTorch's normal_ has vectorised variants): not on
// threads, placement, world size or the order blocks are drawn in.
namespace {

// init_block over one part's parameters; parameter i of the part is the
// block's parameter `first + i` in declaration order (its chunk seeds').
void init_params(const std::vector<ParamLayout>& params, int64_t padded_numel, size_t first,
                 const at::Tensor& flat_block, uint64_t seed, size_t block_index) {
  STRATA_CHECK(flat_block.scalar_type() == at::kFloat && flat_block.dim() == 1 && flat_block.is_contiguous(),
               "init writes a flat fp32 block");
  STRATA_CHECK(flat_block.numel() >= padded_numel, "init's buffer is smaller than its block");
  struct Chunk {
    size_t param;
    int64_t index, start, count;
  };
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamLayout& p = params[i];
    const int64_t n = p.spec.numel();
    switch (p.spec.init) {
      case Init::kNormal:
      case Init::kUniform:
        for (int64_t c = 0; c * kInitChunk < n; ++c) {
          chunks.push_back({i, c, p.offset + c * kInitChunk, std::min(kInitChunk, n - c * kInitChunk)});
        }
        break;
      case Init::kOnes: flat_block.narrow(0, p.offset, n).fill_(1.0); break;
      case Init::kZeros: flat_block.narrow(0, p.offset, n).zero_(); break;
    }
  }
  // oneTBB, not at::parallel_for: this library is built without OpenMP, which
  // would make LibTorch's inline parallel_for run serially here.
  tbb::task_arena arena(std::max(1, at::get_num_threads()));
  arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, chunks.size(), 1), [&](const tbb::blocked_range<size_t>& r) {
      for (size_t k = r.begin(); k < r.end(); ++k) {
        const Chunk& c = chunks[k];
        at::Generator gen =
            at::detail::createCPUGenerator(init_chunk_seed(seed, block_index, first + c.param, c.index));
        const ParamSpec& spec = params[c.param].spec;
        if (spec.init == Init::kUniform) {
          flat_block.narrow(0, c.start, c.count).uniform_(-spec.std, spec.std, gen);
        } else {
          flat_block.narrow(0, c.start, c.count).normal_(0.0, spec.std, gen);
        }
      }
    });
  });
}

}  // namespace

// A block's parameters are numbered in declaration order, its frozen ones
// first (Note [State kinds]): a LoRA run's base draws what the dense model of
// the same seed draws.
void init_block(const BlockLayout& layout, const at::Tensor& flat_block, uint64_t seed, size_t block_index) {
  init_params(layout.params, layout.padded_numel, layout.frozen.size(), flat_block, seed, block_index);
}

void init_frozen_block(const BlockLayout& layout, const at::Tensor& flat_block, uint64_t seed, size_t block_index) {
  init_params(layout.frozen, layout.frozen_padded_numel, 0, flat_block, seed, block_index);
}

}  // namespace strata
