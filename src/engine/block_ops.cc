// A block's ops (trainer.h): its forward, the head's forward and backward, its
// backward (recomputed or from its kept graph), and evaluation as the eval
// schedule's forwards; trainer.cc runs them in the order of the step's
// schedule.
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <optional>

#include "engine/compute_stream.h"
#include "engine/trainer.h"
#include "util/errors.h"
#include "util/trace.h"

namespace strata {

namespace {

// Leaf copies of weight views that autograd can differentiate with respect to;
// they share storage with the views.
std::vector<at::Tensor> as_leaves(const std::vector<at::Tensor>& views) {
  std::vector<at::Tensor> leaves;
  leaves.reserve(views.size());
  for (const at::Tensor& v : views) leaves.push_back(v.detach().requires_grad_(true));
  return leaves;
}

}  // namespace

// Note [Step order]
// Forward runs every block but the head without autograd and keeps each
// block's input (the activation checkpoint). The head runs with autograd, so
// the loss gives d(loss)/d(head input). Backward then walks the blocks in
// reverse: recompute the block from its saved input with autograd over leaf
// views of its weights, and ask autograd for the gradients of the input and of
// the weights given the output gradient. Weight gradients go to the gradient
// path (Note [Gradient path]) block by block, so when recomputing nothing
// but one block's graph is alive at a time (kept graphs, one per block and
// micro-batch held: Note [Recompute]). A tied head's output-projection gradient is added
// into the embedding block's gradient, which backward reaches last. The
// order of blocks and micro-batches is the schedule's (Note [Step schedules]
// in memory/schedule.h); each op is one of the three below.

// Block b's forward for micro-batch m (training keeps its input, or its
// graph: Note [Recompute]); shared by training and evaluation.
at::Tensor Trainer::forward_block(size_t b, int64_t m, const at::Tensor& x, bool train) {
  const bool keep = train && keep_graphs_;
  std::optional<at::NoGradGuard> no_grad;
  if (!keep) no_grad.emplace();
  if (train && !keep) activations_->save(b, m, x);
  DevicePtr gathered[2];
  blocks_->next(gathered);
  at::Tensor y;
  {
    TraceSpan span(TraceTrack::kCompute, span_name(Pass::kForward, b, m));
    if (keep) {
      // Note [Recompute]: the graph over leaf views of the weights and a
      // leaf input, kept for the backward.
      KeptGraph& g = graphs_[graph_key(b, m)];
      g.w = as_leaves(weights(b, gathered[0]));
      g.xin = b == ctx_.embedding_block ? x : x.detach().requires_grad_(true);
      g.y = model_.forward(b, g.w, g.xin);
      y = g.y.detach();
    } else {
      std::vector<at::Tensor> w = weights(b, gathered[0]);
      y = model_.forward(b, w, x);
    }
  }
  blocks_->end();
  return y;
}

// The head and the loss with autograd: the loss (detached), *dx the gradient
// of the head's input; the head's weight gradients go to the gradient path.
at::Tensor Trainer::head_forward_backward(const at::Tensor& x, const at::Tensor& targets, double loss_scale,
                                          int64_t m, at::Tensor* dx) {
  DevicePtr gathered[2];
  at::Tensor xin = x.detach().requires_grad_(true);
  blocks_->next(gathered);
  std::vector<at::Tensor> w = as_leaves(weights(ctx_.head_block, gathered[0]));
  at::Tensor tied;
  if (cfg_.model.tie_embeddings) tied = as_leaves(weights(ctx_.embedding_block, gathered[1]))[0];
  TraceSpan span(TraceTrack::kCompute, span_name(Pass::kHead, ctx_.head_block, m));
  at::Tensor loss = loss_of(model_.forward(ctx_.head_block, w, xin, tied), targets);
  std::vector<at::Tensor> wrt{xin};
  wrt.insert(wrt.end(), w.begin(), w.end());
  if (tied.defined()) wrt.push_back(tied);
  std::vector<at::Tensor> grads =
      torch::autograd::grad({loss * loss_scale}, wrt, /*grad_outputs=*/{}, /*retain_graph=*/false);
  loss = loss.detach();
  xin = at::Tensor();
  *dx = grads[0];
  // The head's gradient for the tied embedding is added when the embedding's
  // own gradient of the micro-batch is, so the embedding's home is written
  // once per micro-batch (micro_batch) or per step (layer).
  if (tied.defined()) grads_->set_tied(m, grads.back());
  w.clear();
  tied = at::Tensor();
  blocks_->end();
  optimizer_->wait_committed(ctx_.shard_offset[ctx_.head_block]);  // Note [Speculative optimizer]
  grads_->add(ctx_.head_block, grads, 1, m);
  return loss;
}

// Block b's backward given the gradient of its output: its weight gradients
// to the gradient path; returns the gradient of its input (none for the
// embedding).
at::Tensor Trainer::block_backward(size_t b, int64_t m, const at::Tensor& dx) {
  if (backward_hook_) backward_hook_(b, m);
  const bool is_embedding = b == ctx_.embedding_block;
  DevicePtr gathered[2];
  blocks_->next(gathered);
  std::vector<at::Tensor> w, grads;
  at::Tensor xin, y;
  if (keep_graphs_) {
    KeptGraph& g = graphs_[graph_key(b, m)];
    w = std::move(g.w);
    xin = std::move(g.xin);
    y = std::move(g.y);
    g = KeptGraph();
  } else {
    w = as_leaves(weights(b, gathered[0]));
    at::Tensor saved = activations_->restore(b, m);
    xin = is_embedding ? saved : saved.detach().requires_grad_(true);
  }
  {
    TraceSpan span(TraceTrack::kCompute, span_name(Pass::kBackward, b, m));
    if (!y.defined()) y = model_.forward(b, w, xin);
    std::vector<at::Tensor> wrt;
    if (!is_embedding) wrt.push_back(xin);
    wrt.insert(wrt.end(), w.begin(), w.end());
    grads = torch::autograd::grad({y}, wrt, {dx}, /*retain_graph=*/false);
  }
  y = at::Tensor();
  xin = at::Tensor();
  w.clear();
  blocks_->end();
  optimizer_->wait_committed(ctx_.shard_offset[b]);  // Note [Speculative optimizer]
  grads_->add(b, grads, is_embedding ? 0 : 1, m);
  return is_embedding ? at::Tensor() : grads[0];
}

at::Tensor Trainer::loss_of(const at::Tensor& logits, const at::Tensor& targets) const {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                targets.reshape({-1}));
}

// Evaluation shares the forward (forward_block) and the gathered blocks with
// training. Every rank evaluates the same windows (collective: at stage 3 the
// blocks are gathered), so every rank returns the same loss.
double Trainer::eval_loss(const int64_t* tokens, int64_t batches) {
  finish();
  STRATA_CHECK(!optimizer_->broken(), "eval after a failed optimizer step");
  at::NoGradGuard no_grad;
  ComputeStreamScope on_compute_stream(*ctx_.device);
  const int64_t micro = cfg_.train_micro_batch_size_per_gpu;
  const int64_t T = cfg_.model.seq_len;
  double total = 0.0;
  for (int64_t i = 0; i < batches; ++i) {
    const at::Tensor batch = stage_tokens(tokens + i * micro * (T + 1), micro);
    blocks_->begin(/*train=*/false);
    at::Tensor x = batch.narrow(1, 0, T);
    for (const StepOp& op : blocks_->eval_ops()) {
      if (op.pass == Pass::kForward) {
        x = forward_block(size_t(op.block[0]), 0, x, /*train=*/false);
      } else {
        total += eval_head(x, batch.narrow(1, 1, T));
      }
    }
  }
  return total / double(batches);
}

// The eval schedule's head op: the head's forward and the loss, no backward.
double Trainer::eval_head(const at::Tensor& x, const at::Tensor& targets) {
  DevicePtr gathered[2];
  blocks_->next(gathered);
  at::Tensor tied;
  if (cfg_.model.tie_embeddings) tied = weights(ctx_.embedding_block, gathered[1])[0];
  at::Tensor logits = model_.forward(ctx_.head_block, weights(ctx_.head_block, gathered[0]), x, tied);
  const double loss = loss_of(logits, targets).item<double>();
  tied = at::Tensor();
  blocks_->end();
  return loss;
}

}  // namespace strata
