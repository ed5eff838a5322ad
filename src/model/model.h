// The model as blocks: a LLaMA-style decoder (token embedding; N layers of
// RMSNorm, multi-head attention with rotary embeddings and optional grouped
// key/value heads, RMSNorm, SwiGLU MLP; final RMSNorm and output head), with
// the extras of its family (model.family: Qwen2's q/k/v biases, Qwen3's
// per-head q/k RMSNorm) and rotary scaling (model.rope_scaling).
// Each block declares its parameter specs; its forward is a pure function of
// weight VIEWS into the block's flat buffer (memory/layout.h) and its input.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

#include "config/config.h"
#include "memory/layout.h"
#include "model/saved_activations.h"

namespace strata {

enum class BlockKind { kEmbedding, kLayer, kHead };

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

  // Runs block `b`. `w` holds one tensor per ParamSpec of the block, in order.
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
  // 6 x matrix parameters + attention scores, the usual MFU convention.
  double flops_per_token() const;

 private:
  at::Tensor layer_forward(const std::vector<at::Tensor>& w, const at::Tensor& x) const;
  // layer_forward_saving's ops; the output (its last matrix and residual
  // add) only when `output`.
  at::Tensor layer_saving(const std::vector<at::Tensor>& w, const at::Tensor& x, LayerSaved* s, bool output) const;
  // cos/sin tables [seq_len, head_dim] in `dtype` on `device`, cast once per
  // dtype and device from the fp32 tables. Not thread-safe (one compute thread).
  std::pair<at::Tensor, at::Tensor> rope(at::ScalarType dtype, c10::Device device, int64_t t) const;

  ModelConfig cfg_;
  std::vector<BlockDesc> blocks_;
  at::Tensor cos_f32_, sin_f32_;
  mutable at::Tensor cos_cast_, sin_cast_;
};

// Views of each parameter of `layout` into `flat_block`, the block's range of
// a flat buffer (numel >= layout.numel). The views share its storage.
std::vector<at::Tensor> param_views(const BlockLayout& layout, const at::Tensor& flat_block);

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
// The generator seed of chunk `chunk` of parameter `param_index` of a block.
uint64_t init_chunk_seed(uint64_t seed, size_t block_index, size_t param_index, int64_t chunk);

}  // namespace strata
