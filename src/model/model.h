// The model as blocks: a LLaMA-style decoder (token embedding; N layers of
// RMSNorm, multi-head attention with rotary embeddings and optional grouped
// key/value heads, RMSNorm, SwiGLU MLP; final RMSNorm and output head), with
// the extras of its family (model.family: Qwen2's q/k/v biases, Qwen3's
// per-head q/k RMSNorm) and rotary scaling (model.rope_scaling).
// Each block declares its parameter specs; its forward is a pure function of
// weight VIEWS into the block's flat buffer (memory/layout.h) and its input.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <string>
#include <utility>
#include <vector>

#include "config/config.h"
#include "memory/layout.h"
#include "model/saved_activations.h"

namespace strata {

enum class BlockKind { kEmbedding, kLayer, kHead };

// A block's parameters in declaration order: with model.lora, the base's
// (frozen: ParamSpec::frozen) before the adapters (Note [State kinds] in
// memory/layout.h).
struct BlockDesc {
  BlockKind kind;
  std::string name;
  std::vector<ParamSpec> params;
};


// The blocks and their parameter specs, from the config alone: no tensors, so
// that `strata plan` can size a model far too large for the machine.
std::vector<BlockDesc> model_blocks(const ModelConfig& cfg);
// (name, specs) per block, the input of StateLayout.
std::vector<std::pair<std::string, std::vector<ParamSpec>>> model_layout_specs(const ModelConfig& cfg);

class Model {
 public:
  // REQUIRES: cfg validated by parse_config.
  explicit Model(const ModelConfig& cfg);

  const ModelConfig& config() const { return cfg_; }
  const std::vector<BlockDesc>& blocks() const { return blocks_; }
  size_t num_blocks() const { return blocks_.size(); }
  // (name, specs) per block, the input of StateLayout.
  std::vector<std::pair<std::string, std::vector<ParamSpec>>> layout_specs() const;

  // Runs block `b`. `w` holds one tensor per ParamSpec of the block, in order
  // (with model.lora: the frozen base's, then the adapters'). The LoRA
  // adapters apply without dropout here (PEFT in eval mode); the explicit
  // forward below applies lora_dropout (Note [LoRA layers] in layer_ops.cc).
  //   embedding: x = tokens (int64, [B, T])      -> [B, T, dim]
  //   layer:     x = [B, T, dim]                  -> [B, T, dim]
  //   head:      x = [B, T, dim]                  -> logits [B, T, vocab]
  // `tied` is the embedding weight [vocab, dim] when the head is tied, else
  // undefined. Pure: records autograd only if its inputs require grad.
  at::Tensor forward(size_t b, const std::vector<at::Tensor>& w, const at::Tensor& x,
                     const at::Tensor& tied = {}) const;

  // A layer's forward written op by op, keeping in *s every tensor its
  // backward needs, by name (Note [Saved activations], model/layer_ops.cc).
  // Returns the layer's output: forward()'s up to rounding. No autograd.
  at::Tensor layer_forward_saving(const std::vector<at::Tensor>& w, const at::Tensor& x, LayerSaved* s) const;
  // The same saved tensors again from the layer's input, for its backward
  // (run.recompute): layer_forward_saving's ops up to the last matrix (w2,
  // whose product only the next layer reads), so without the output.
  void layer_recompute(const std::vector<at::Tensor>& w, const at::Tensor& x, LayerSaved* s) const;
  // Fills the cheap entries (SavedSpec::cheap) missing from *s from those
  // they are made of: the same bits as the forward's.
  void layer_recompute_cheap(const std::vector<at::Tensor>& w, LayerSaved* s) const;
  // The layer's backward from its saved tensors, given d(output) dy: returns
  // d(input); (*dw)[i] is the gradient of w[i]. Consumes *s (each entry
  // released once used, so its memory goes back as the backward runs).
  at::Tensor layer_backward(const std::vector<at::Tensor>& w, LayerSaved* s, const at::Tensor& dy,
                            std::vector<at::Tensor>* dw) const;

  // Model FLOPs per trained token (forward + backward, without recompute):
  // 6 x matrix parameters + attention scores, the usual MFU convention. With
  // model.lora the frozen base's matrices count 4 (no weight gradient) and
  // the adapters' 6.
  double flops_per_token() const;
  // With model.lora: the index in a layer's weights of module m's lora_A
  // (lora_B follows it), or -1 when m is not targeted.
  int lora_index(LoraModule m) const { return lora_index_[size_t(m)]; }

 private:
  at::Tensor layer_forward(const std::vector<at::Tensor>& w, const at::Tensor& x) const;
  // layer_forward_saving's ops; the output (its last matrix and residual
  // add) only when `output`.
  at::Tensor layer_saving(const std::vector<at::Tensor>& w, const at::Tensor& x, LayerSaved* s, bool output) const;
  // cos/sin tables [seq_len, head_dim] in `dtype` on `device`, cast once per
  // dtype and device from the fp32 tables. Not thread-safe (one compute thread).
  std::pair<at::Tensor, at::Tensor> rope(at::ScalarType dtype, c10::Device device, int64_t t) const;

  // Note [LoRA layers]: a targeted linear's output, base + adapter, keeping
  // the adapter's middle in *s; and its backward.
  at::Tensor linear(LoraModule m, const std::vector<at::Tensor>& w, const at::Tensor& x, size_t weight,
                    const at::Tensor& bias, LayerSaved* s) const;
  // d(input) of module m's adapter (in x's dtype) given d(output) `dout`
  // [N, out] and its input x [N, in]; sets (*dw) of its lora_A and lora_B.
  at::Tensor lora_backward(LoraModule m, const std::vector<at::Tensor>& w, const LayerSaved& s,
                           const at::Tensor& dout, const at::Tensor& x, std::vector<at::Tensor>* dw) const;
  // dropout(x) in the adapters' dtype (fp32) for module m under s's key
  // (x itself without s.dropout).
  at::Tensor lora_input(LoraModule m, const at::Tensor& x, const LayerSaved& s) const;
  at::Tensor lora_noise(LoraModule m, const at::Tensor& like, uint64_t key) const;

  // Note [Experts] (experts.cc): an MoE layer's MLP over its normed input m
  // [B, T, D] with autograd (moe_forward), op by op keeping its entries
  // (moe_saving; the output only when `output`), and its backward given
  // d(output) dy2 [N, D]: returns d(m) [N, D], sets the MLP's weight
  // gradients in *dw unless !base_grads (LoRA's frozen experts).
  at::Tensor mlp_backward(const std::vector<at::Tensor>& w, LayerSaved* s, const at::Tensor& dy,
                          std::vector<at::Tensor>* dw, bool base_grads) const;
  struct Routing;
  bool grouped(const at::Tensor& like) const;
  Routing route(const at::Tensor& logits) const;
  at::Tensor combine(const Routing& r, const at::Tensor& ys, const at::Tensor& ws) const;
  at::Tensor moe_forward(const std::vector<at::Tensor>& w, const at::Tensor& m) const;
  at::Tensor moe_saving(const std::vector<at::Tensor>& w, const at::Tensor& m, LayerSaved* s, bool output) const;
  at::Tensor moe_backward(const std::vector<at::Tensor>& w, LayerSaved* s, const at::Tensor& dy2,
                          std::vector<at::Tensor>* dw, bool base_grads) const;
  at::Tensor experts_backward(const std::vector<at::Tensor>& w, const LayerSaved& S, const Routing& r,
                              const at::Tensor& xs, const at::Tensor& dys, const at::Tensor& ws, at::Tensor* dws,
                              std::vector<at::Tensor>* dw, bool base_grads) const;
  at::Tensor shared_expert_backward(const std::vector<at::Tensor>& w, LayerSaved* s, const at::Tensor& dy2,
                                    const at::Tensor& m2, const at::Tensor& dm2, std::vector<at::Tensor>* dw,
                                    bool base_grads) const;
  void moe_tally(const at::Tensor& logits, const Routing& r, MoeTally* t) const;
  // The index in a layer's weights of qwen2_moe's shared expert (shared.w1;
  // w3, w2 and gate follow), after the family's extras.
  size_t shared_index() const { return 9 + (cfg_.qkv_bias() ? 3 : 0) + (cfg_.qk_norm() ? 2 : 0); }

  ModelConfig cfg_;
  std::vector<BlockDesc> blocks_;
  std::array<int, kLoraModuleCount> lora_index_{};
  std::array<bool, kSavedCount> saves_{};  // the entries a layer saves (layer_saved_specs)
  at::Tensor cos_f32_, sin_f32_;
  mutable at::Tensor cos_cast_, sin_cast_;
};

// Views of each trained parameter of `layout` into `flat_block`, the block's
// range of a flat buffer (numel >= layout.numel). The views share its storage.
std::vector<at::Tensor> param_views(const BlockLayout& layout, const at::Tensor& flat_block);
// A block's weights in declaration order (Note [State kinds] in
// memory/layout.h): views of its frozen parameters into `frozen_block` (its
// frozen range; numel >= layout.frozen_numel), then of its trained ones into
// `flat_block`. Either may be undefined when the block has no such part.
std::vector<at::Tensor> param_views(const BlockLayout& layout, const at::Tensor& frozen_block,
                                    const at::Tensor& flat_block);

// The key of LoRA's dropout masks for one layer (0-based) and micro-batch of
// step `step` (1-based) of a run seeded `seed`: the same wherever the layer
// runs, is recomputed or placed (Note [LoRA layers] in layer_ops.cc).
uint64_t lora_dropout_key(uint64_t seed, int64_t step, int64_t micro_batch, int64_t layer);

// Rotary inverse frequencies after model.rope_scaling (none, linear, llama3),
// as Hugging Face's rope_parameters define them; double in, double out.
at::Tensor scaled_inv_freq(const at::Tensor& inv_freq, const RopeScaling& scaling);

// RMSNorm as the model computes it (exposed for tests): statistics in fp32.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// Rotary embedding, "rotate half" form, over x [B, H, T, head_dim].
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// Fills `flat_block` (fp32, at least the block's padded length) with the
// initial values of the parameters of block `block_index`, from `seed` (Note
// [Initial weights] in model.cc: chunks of kInitChunk elements, each from its
// own generator, drawn on LibTorch's intra-op threads); padding is left as it is.
inline constexpr int64_t kInitChunk = int64_t(1) << 20;
void init_block(const BlockLayout& layout, const at::Tensor& flat_block, uint64_t seed, size_t block_index);
// The same for the block's frozen part (Note [State kinds] in memory/layout.h),
// `flat_block` at least its frozen padded length.
void init_frozen_block(const BlockLayout& layout, const at::Tensor& flat_block, uint64_t seed, size_t block_index);
// The generator seed of chunk `chunk` of parameter `param_index` of a block.
uint64_t init_chunk_seed(uint64_t seed, size_t block_index, size_t param_index, int64_t chunk);

}  // namespace strata
