// A block's ops (trainer.h): its forward, the head's forward and backward, its
// backward (from its kept entries, or recomputed from its input), and
// evaluation as the eval schedule's forwards; trainer.cc runs them in the order of the step's
// schedule.
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <iterator>
#include <tuple>

#include "engine/compute_stream.h"
#include "engine/trainer.h"
#include "model/cross_entropy.h"

#include "util/counted_tokens.h"
#include "util/errors.h"
#include "util/trace.h"

namespace strata {

namespace {

// Leaf copies of weight views that autograd can differentiate with respect to;
// they share storage with the views. The first `frozen` (a block's frozen
// parameters: Note [State kinds] in memory/layout.h) get no gradient.
std::vector<at::Tensor> as_leaves(const std::vector<at::Tensor>& views, size_t frozen = 0) {
  std::vector<at::Tensor> leaves;
  leaves.reserve(views.size());
  for (size_t i = 0; i < views.size(); ++i) leaves.push_back(views[i].detach().requires_grad_(i >= frozen));
  return leaves;
}

}  // namespace

// Note [Step order]
// Forward runs every block but the head without autograd. An embedding keeps
// its input (the token ids); a layer runs its explicit forward (Note [Saved
// activations] in model/layer_ops.cc) and keeps its input or its entries
// (Note [Activation placement] in memory/placement.h). The head runs with
// autograd, so the loss gives d(loss)/d(head input). Backward then walks the
// blocks in reverse: a layer's explicit backward from its entries (first
// recomputed from its input when it kept only that), the embedding's by
// autograd over leaf views of its weights. Weight gradients go to the
// gradient path (Note [Gradient path]) block by block. A tied head's
// output-projection gradient is added into the embedding block's gradient,
// which backward reaches last. The order of blocks and micro-batches is the
// schedule's (Note [Step schedules] in memory/schedule.h); each op is one of
// the three below.

// Block b's forward for micro-batch m (training keeps what its backward
// needs); shared by training and evaluation.
at::Tensor Trainer::forward_block(size_t b, int64_t m, const at::Tensor& x, bool train) {
  at::NoGradGuard no_grad;
  const bool is_embedding = b == ctx_.embedding_block;
  DevicePtr gathered[2], frozen[2];
  blocks_->next(gathered, frozen);
  at::Tensor y;
  LayerSaved saved;
  if (train && !is_embedding && cfg_.model.lora.dropout > 0) {  // Note [LoRA layers]: training only
    saved.dropout = true;
    saved.dropout_key = dropout_key(b, m);
  }
  if (train && !is_embedding && !moe_tally_.empty()) {  // Note [Load balancing] in model/experts.cc
    saved.tally = &moe_tally_[size_t(m)];
    saved.tally->load = expert_load_.select(0, int64_t(b) - 1);
  }
  {
    TraceSpan span(TraceTrack::kCompute, span_name(Pass::kForward, b, m));
    std::vector<at::Tensor> w = weights(b, gathered[0], frozen[0]);
    y = is_embedding ? model_.forward(b, w, x) : model_.layer_forward_saving(w, x, &saved);
  }
  blocks_->end();
  if (train) {
    // A pack kept in gradient homes: the previous step's commit has read
    // them (Note [Packs in gradient homes] in memory/placement.h).
    const int64_t home = activations_->commit_wait(b, m);
    if (home >= 0) optimizer_->wait_committed(home);
    activations_->save(b, m, is_embedding ? std::vector<at::Tensor>{x} : pack_of(b, m, &saved));
  }
  return y;
}

std::vector<at::Tensor> Trainer::pack_of(size_t b, int64_t m, LayerSaved* s) {
  if (!keeps_entries_[act_key(b, m)]) return {(*s)[Saved::kInput]};
  std::vector<at::Tensor> pack;
  pack.reserve(kept_ids_.size());
  for (Saved e : kept_ids_) pack.push_back(std::move((*s)[e]));
  attn_rng_[act_key(b, m)] = {s->attn_seed, s->attn_offset};
  return pack;
}

void Trainer::unpack(size_t b, int64_t m, std::vector<at::Tensor> pack, LayerSaved* s) {
  STRATA_CHECK(pack.size() == kept_ids_.size(), "a layer's pack is not its kept entries");
  for (size_t i = 0; i < pack.size(); ++i) (*s)[kept_ids_[i]] = std::move(pack[i]);
  std::tie(s->attn_seed, s->attn_offset) = std::move(attn_rng_[act_key(b, m)]);
  attn_rng_[act_key(b, m)] = {};
}

// The head and the loss with autograd: the loss (detached), *dx the gradient
// of the head's input; the head's weight gradients go to the gradient path.
at::Tensor Trainer::head_forward_backward(const at::Tensor& x, const at::Tensor& targets, double loss_scale,
                                          int64_t m, at::Tensor* dx) {
  DevicePtr gathered[2], frozen[2];
  at::Tensor xin = x.detach().requires_grad_(true);
  blocks_->next(gathered, frozen);
  const size_t head_frozen = layout_.block(ctx_.head_block).frozen.size();
  std::vector<at::Tensor> w = as_leaves(weights(ctx_.head_block, gathered[0], frozen[0]), head_frozen);
  at::Tensor tied;
  if (cfg_.model.tie_embeddings) {
    const size_t emb_frozen = layout_.block(ctx_.embedding_block).frozen.size();
    tied = as_leaves(weights(ctx_.embedding_block, gathered[1], frozen[1]), emb_frozen)[0];
  }
  TraceSpan span(TraceTrack::kCompute, span_name(Pass::kHead, ctx_.head_block, m));
  const at::Tensor logits = model_.forward(ctx_.head_block, w, xin, tied);
  // Gradients for the head's input and its trained weights only (a frozen
  // head has none: its weight-gradient GEMM is not run).
  std::vector<at::Tensor> wrt{xin};
  wrt.insert(wrt.end(), w.begin() + std::ptrdiff_t(head_frozen), w.end());
  if (tied.defined() && !tied.requires_grad()) tied = at::Tensor();
  if (tied.defined()) wrt.push_back(tied);
  std::vector<at::Tensor> grads;
  at::Tensor loss;
  if (fused_cross_entropy_applies(logits)) {
    // Note [Fused cross-entropy] (cpu_adam/cross_entropy.h): the loss and its
    // gradient in one pass, the gradient written over the logits (no node of
    // the head's graph keeps them), which the backward then takes in.
    const double denom = double(counted_ >= 0 ? std::max<int64_t>(counted_, 1) : logits.numel() / logits.size(-1));
    const double sum = fused_cross_entropy(logits.detach(), targets, float(loss_scale / denom), row_loss_, head_isa_);
    // Written through a pointer: the version bump makes a node that kept the
    // logits (none does today) an autograd error, not a wrong gradient.
    torch::autograd::impl::bump_version(logits);
    loss = at::scalar_tensor(sum / denom, at::kFloat);
    grads = torch::autograd::grad({logits}, wrt, {logits.detach()}, /*retain_graph=*/false);
  } else {
    loss = loss_of(logits, targets);
    grads = torch::autograd::grad({loss * loss_scale}, wrt, /*grad_outputs=*/{}, /*retain_graph=*/false);
    loss = loss.detach();
  }
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
  DevicePtr gathered[2], frozen[2];
  blocks_->next(gathered, frozen);
  std::vector<at::Tensor> pack = activations_->restore(b, m);
  std::vector<at::Tensor> grads;
  // Note [State kinds]: a block's gradients start after its input's and its
  // frozen parameters' (which have none).
  const size_t frozen_params = layout_.block(b).frozen.size();
  {
    TraceSpan span(TraceTrack::kCompute, span_name(Pass::kBackward, b, m));
    if (is_embedding) {
      // A frozen embedding (LoRA) has nothing to train: no backward.
      if (layout_.block(b).numel > 0) {
        std::vector<at::Tensor> w = as_leaves(weights(b, gathered[0], frozen[0]));
        grads = torch::autograd::grad({model_.forward(b, w, pack[0])}, w, {dx}, /*retain_graph=*/false);
      }
    } else {
      at::NoGradGuard no_grad;
      const std::vector<at::Tensor> w = weights(b, gathered[0], frozen[0]);
      LayerSaved saved;
      if (cfg_.model.lora.dropout > 0) {
        saved.dropout = true;
        saved.dropout_key = dropout_key(b, m);
      }
      if (!aux_grad_.empty()) saved.aux_grad = aux_grad_[size_t(m)];
      if (keeps_entries_[act_key(b, m)]) {
        unpack(b, m, std::move(pack), &saved);
      } else {
        model_.layer_recompute(w, pack[0], &saved);  // recompute the layer's entries from its input
      }
      pack.clear();
      std::vector<at::Tensor> dw;
      grads.push_back(model_.layer_backward(w, &saved, dx, &dw));
      grads.insert(grads.end(), std::make_move_iterator(dw.begin()), std::make_move_iterator(dw.end()));
    }
  }
  pack.clear();
  blocks_->end();
  optimizer_->wait_committed(ctx_.shard_offset[b]);  // Note [Speculative optimizer]
  grads_->add(b, grads, (is_embedding ? 0 : 1) + (is_embedding ? 0 : frozen_params), m);
  return is_embedding ? at::Tensor() : grads[0];
}

at::Tensor Trainer::loss_of(const at::Tensor& logits, const at::Tensor& targets) const {
  const at::Tensor flat = logits.reshape({-1, logits.size(-1)}).to(at::kFloat);
  if (counted_ < 0) return at::cross_entropy_loss(flat, targets.reshape({-1}));
  // Note [Counted tokens]: transformers' loss with num_items_in_batch, the
  // sum over counted targets (-100 ignored) over the global batch's count. A
  // batch of none counted: a zero loss, no NaN.
  return at::cross_entropy_loss(flat, targets.reshape({-1}), {}, at::Reduction::Sum, -100) /
         double(std::max<int64_t>(counted_, 1));
}

// Note [Counted tokens]: ids without their flags; targets with -100 where
// flagged.
at::Tensor Trainer::inputs_of(const at::Tensor& window) const {
  const at::Tensor in = window.narrow(1, 0, cfg_.model.seq_len);
  return counted_ >= 0 || cfg_.data.masked() ? at::bitwise_and(in, kTokenIdMask) : in;
}

at::Tensor Trainer::targets_of(const at::Tensor& window, bool masked) const {
  const at::Tensor t = window.narrow(1, 1, cfg_.model.seq_len);
  if (!masked) return t;
  return at::where(at::bitwise_and(t, kNotCounted).ne(0), at::full({}, int64_t(-100), t.options()),
                   at::bitwise_and(t, kTokenIdMask));
}

// Evaluation shares the forward (forward_block) and the gathered blocks with
// training. Every rank evaluates the same windows (collective: at stage 3 the
// blocks are gathered), so every rank returns the same loss.
double Trainer::eval_loss(const int64_t* tokens, int64_t batches, bool masked) {
  finish();
  STRATA_CHECK(!optimizer_->broken(), "eval after a failed optimizer step");
  at::NoGradGuard no_grad;
  ComputeStreamScope on_compute_stream(*ctx_.device);
  const int64_t micro = cfg_.train_micro_batch_size_per_gpu;
  const int64_t T = cfg_.model.seq_len;
  double total = 0.0;
  int64_t counted = 0;
  for (int64_t i = 0; i < batches; ++i) {
    const at::Tensor batch = stage_tokens(tokens + i * micro * (T + 1), micro);
    blocks_->begin(/*train=*/false);
    at::Tensor x = masked ? at::bitwise_and(batch.narrow(1, 0, T), kTokenIdMask) : batch.narrow(1, 0, T);
    for (const StepOp& op : blocks_->eval_ops()) {
      if (op.pass == Pass::kForward) {
        x = forward_block(size_t(op.block[0]), 0, x, /*train=*/false);
      } else {
        const auto [loss, n] = eval_head(x, targets_of(batch, masked), masked);
        total += loss;
        counted += n;
      }
    }
  }
  if (masked) return counted > 0 ? total / double(counted) : 0.0;
  return total / double(batches);
}

// The eval schedule's head op: the head's forward and the loss, no backward.
std::pair<double, int64_t> Trainer::eval_head(const at::Tensor& x, const at::Tensor& targets, bool masked) {
  DevicePtr gathered[2], frozen[2];
  blocks_->next(gathered, frozen);
  at::Tensor tied;
  if (cfg_.model.tie_embeddings) tied = weights(ctx_.embedding_block, gathered[1], frozen[1])[0];
  at::Tensor logits = model_.forward(ctx_.head_block, weights(ctx_.head_block, gathered[0], frozen[0]), x, tied);
  std::pair<double, int64_t> out;
  const int64_t n_masked = masked ? targets.ne(-100).sum().item<int64_t>() : 0;
  if (fused_cross_entropy_applies(logits)) {  // Note [Fused cross-entropy], read only
    const double sum = fused_cross_entropy(logits, targets, std::nullopt, row_loss_, head_isa_);
    out = {masked ? sum : sum / double(logits.numel() / logits.size(-1)), n_masked};
  } else {
    const at::Tensor flat = logits.reshape({-1, logits.size(-1)}).to(at::kFloat);
    out.first = masked ? at::cross_entropy_loss(flat, targets.reshape({-1}), {}, at::Reduction::Sum, -100).item<double>()
                       : at::cross_entropy_loss(flat, targets.reshape({-1})).item<double>();
    out.second = n_masked;
  }
  tied = at::Tensor();
  blocks_->end();
  return out;
}

}  // namespace strata
