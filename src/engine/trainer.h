// The training step: forward over blocks without autograd (keeping each
// block's input), loss with autograd over the head, backward over blocks in
// reverse by recomputing each block from its saved input with autograd over
// weight views, gradient accumulation, global-norm clipping, and the optimizer
// over the flat fp32 master buffers (see Note [Step order]).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "config/config.h"
#include "cpu_adam/adam.h"
#include "memory/buffer.h"
#include "memory/layout.h"
#include "model/model.h"

namespace strata {

struct StepResult {
  double loss = 0.0;       // mean over the micro-batches of the step
  double grad_norm = 0.0;  // global L2 norm before clipping
  double lr = 0.0;
  int64_t tokens = 0;      // tokens trained on in this step
};

// Bytes of each state category, for the start-up report.
struct StateBytes {
  int64_t param16 = 0;     // 16-bit working copy (0 in fp32 compute: the master is used)
  int64_t master = 0;      // fp32 parameters
  int64_t grad = 0;        // fp32 gradients
  int64_t optimizer = 0;   // exp_avg + exp_avg_sq
  int64_t total() const { return param16 + master + grad + optimizer; }
};

// Owns the model's state: one flat buffer per category, shaped by the layout.
// Not thread-safe.
class Trainer {
 public:
  // Allocates and initialises all state from cfg.run.seed.
  Trainer(const Config& cfg, const Model& model);

  // One optimizer step over `accum` micro-batches. `tokens` holds
  // accum x micro_batch windows of seq_len + 1 tokens (int64, row-major).
  StepResult step(const int64_t* tokens);

  // Mean loss over `batches` windows of micro_batch x (seq_len + 1) tokens,
  // without gradients.
  double eval_loss(const int64_t* tokens, int64_t batches);

  const StateLayout& layout() const { return layout_; }
  StateBytes state_bytes() const;
  int64_t steps_done() const { return step_; }
  at::ScalarType compute_dtype() const { return compute_dtype_; }

  // fp32 master weights, model-wide flat [layout.total_numel()] (for tests,
  // export and checkpoints). Views of block b: param_views(layout.block(b), ...).
  const at::Tensor& master() const { return master_; }
  const at::Tensor& grad() const { return grad_; }
  // Weights of block b as the forward uses them (compute dtype).
  std::vector<at::Tensor> block_weights(size_t b) const;

  // Copies the master weights into the 16-bit working copy (after loading
  // or editing the master). No-op in fp32.
  void sync_working_copy();

 private:
  at::Tensor block_range(const at::Tensor& flat, size_t b) const;
  // Forward + backward of one micro-batch; adds weight gradients into grad_
  // (scaled by `loss_scale`); returns the (unscaled) loss.
  double forward_backward(const at::Tensor& tokens, double loss_scale);
  void accumulate_grad(size_t b, const std::vector<at::Tensor>& grads, size_t first);
  at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& targets) const;

  Config cfg_;
  const Model& model_;
  StateLayout layout_;
  at::ScalarType compute_dtype_;
  size_t embedding_block_ = 0;
  size_t head_block_ = 0;

  HostBuffer master_buf_, grad_buf_, exp_avg_buf_, exp_avg_sq_buf_, param16_buf_;
  at::Tensor master_, grad_, exp_avg_, exp_avg_sq_, param16_;
  std::vector<at::Tensor> saved_inputs_;  // per block, the activation checkpoint
  std::unique_ptr<cpu_adam::CpuAdam> adam_;
  int64_t step_ = 0;
};

}  // namespace strata
