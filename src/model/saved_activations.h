// A layer's saved activations as tensors, by the names of
// config/saved_specs.h (Note [Saved activations] in model/layer_ops.cc).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>

#include "config/saved_specs.h"

namespace strata {

// A micro-batch's routing statistics (Note [Load balancing] in
// model/experts.cc), added to by each MoE layer's training forward.
struct MoeTally {
  at::Tensor selected;  // [E] fp32: times each expert is among a row's top k, over all layers
  at::Tensor prob_sum;  // [E] fp32: the router's probabilities summed over the rows of all layers
  int64_t rows = 0;     // rows over all layers
  // [E]: this layer's tokens per expert (a row of the step's expert load),
  // or undefined; the forward's caller points it at the layer's row.
  at::Tensor load;
};

// One layer's saved tensors for one micro-batch: an entry is undefined until
// the forward saves it or it is recomputed.
struct LayerSaved {
  std::array<at::Tensor, kSavedCount> t;
  // The attention kernel's random-state tensors (empty without dropout; the
  // CUDA kernels' backward takes them): tiny, never moved.
  at::Tensor attn_seed, attn_offset;
  // With lora_dropout, in training (`dropout`): the key of this layer's and
  // micro-batch's dropout masks in this step (lora_dropout_key in
  // model/model.h), set by the caller before the forward, any recompute and
  // the backward: the masks are made again from it, never kept. Without
  // `dropout` (evaluation) the adapters see their input unmasked, as PEFT's in
  // eval mode.
  uint64_t dropout_key = 0;
  bool dropout = false;
  // Experts (Note [Load balancing] in model/experts.cc): a training forward
  // adds its routing statistics to *tally (null: evaluation, a recompute);
  // the backward takes aux_grad [E] fp32, the load-balancing loss's gradient
  // per router probability times its coefficient and the loss scale
  // (undefined: not in the loss).
  MoeTally* tally = nullptr;
  at::Tensor aux_grad;

  at::Tensor& operator[](Saved s) { return t[size_t(s)]; }
  const at::Tensor& operator[](Saved s) const { return t[size_t(s)]; }
  void clear() {
    for (at::Tensor& x : t) x = at::Tensor();
    attn_seed = attn_offset = at::Tensor();
  }
};

}  // namespace strata
