#include "engine/trainer.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <optional>

#include "checkpoint/safetensors.h"
#include "engine/compute_stream.h"
#include "engine/lr_schedule.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/trace.h"
#include "util/logging.h"

#ifdef STRATA_WITH_CUDA
#include "kernels/adam.h"
#endif

namespace strata {

namespace {

at::ScalarType dtype_of(const std::string& name) {
  if (name == "bf16") return at::kBFloat16;
  if (name == "fp16") return at::kHalf;
  return at::kFloat;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Leaf copies of weight views that autograd can differentiate with respect to;
// they share storage with the views.
std::vector<at::Tensor> as_leaves(const std::vector<at::Tensor>& views) {
  std::vector<at::Tensor> leaves;
  leaves.reserve(views.size());
  for (const at::Tensor& v : views) leaves.push_back(v.detach().requires_grad_(true));
  return leaves;
}

// Device-tier copies of optimizer state and working copies that no kernel
// reads or writes while the optimizer runs (Note [Optimizer overlap]: the next
// forward waits for a block's range to be published): not ordered after the
// compute queued so far. (The copy stream may still carry waits for compute
// that the other thread queued, e.g. a window fetch's: slower, never wrong.)
const Completion kNoKernel;

LinkBytes operator+(const LinkBytes& a, const LinkBytes& b) {
  return {a.h2d + b.h2d, a.d2h + b.d2h, a.nvme_read + b.nvme_read, a.nvme_write + b.nvme_write};
}

nvme::EngineOptions engine_options(const AioConfig& aio) {
  nvme::EngineOptions o;
  o.block_size_bytes = aio.block_size;
  o.queue_depth = int(aio.queue_depth);
  o.rings = int(aio.intra_op_parallelism);
  o.single_submit = aio.single_submit;
  o.overlap_events = aio.overlap_events;
  return o;
}

}  // namespace

// The step: every micro-batch's forward and backward (gradients reduced into
// their homes as each block's backward ends), one all-reduce of the norm,
// loss and stop flag, then the optimizer (on its own thread, or inline).
StepResult Trainer::step(const int64_t* tokens, bool stop_requested) {
  if (broken_) {
    throw Error("an earlier step failed part-way through the optimizer; the state is inconsistent "
                "and training cannot continue (restart from a checkpoint)");
  }
  const int64_t accum = cfg_.gradient_accumulation_steps;
  const int64_t micro = cfg_.train_micro_batch_size_per_gpu;
  const int64_t window = cfg_.model.seq_len + 1;
  const int64_t ranks = comm_->world_size();
  // This thread's transfers in this step, plus (below) those of the
  // optimizer step reported with it.
  LinkBytes moved;
  TieredState::TallyScope tally(&moved);
  ComputeStreamScope on_compute_stream(*device_);
  std::fill(grad_written_.begin(), grad_written_.end(), 0);
  for (at::Tensor& n : block_norm_) n = at::Tensor();
  checkpoints_->reset();
  for (KeptGraph& g : graphs_) g = KeptGraph();  // a failed step's
  if (landing_.block >= 0) {
    // A failed step's gradient in flight: let its copy end, drop it.
    try {
      landing_.copied.wait();
    } catch (...) {
    }
    landing_ = Landing();
  }
  StepResult r;
  const double wait0 = window_->wait_seconds();
  const double opt_wait0 = opt_wait_s_;
  const int64_t net0 = comm_->bytes_sent();
  const double comm_wait0 = comm_->wait_seconds();
  window_->set_ready(ready_blocks());
  begin_uses(&train_schedule_);
  // Each micro-batch's loss is scaled by 1 / (accum x ranks): the reduced
  // gradient is then the gradient of the global batch's mean loss. fp16
  // multiplies it by the loss scale too (Note [Loss scaling]).
  const double loss_scale = scaler_ ? scaler_->scale() : 1.0;
  double local_loss = 0.0;
  try {
    for (int64_t m = 0; m < accum; ++m) {
      at::Tensor batch = at::from_blob(const_cast<int64_t*>(tokens + m * micro * window),
                                       {micro, window}, at::TensorOptions().dtype(at::kLong))
                             .to(torch_device_);
      last_micro_ = m + 1 == accum;
      micro_loss_[size_t(m)] = forward_backward(batch, loss_scale / double(accum * ranks));
    }
    // Read once the backward is queued: on a GPU, .item() waits for it.
    for (int64_t m = 0; m < accum; ++m) {
      local_loss += micro_loss_[size_t(m)].item<double>() / double(accum * ranks);
      micro_loss_[size_t(m)] = at::Tensor();
    }
  } catch (const c10::OutOfMemoryError& e) {
    // LibTorch's activations did not fit beside the state: the plan's verdict
    // in the same terms, not an allocator's trace.
    const DeviceMemoryInfo m = device_->memory_info();
    std::string torch_line = e.what_without_backtrace();
    torch_line = torch_line.substr(0, torch_line.find('\n'));
    throw OutOfMemoryError(strprintf(
        "%s ran out of memory in the forward/backward of step %lld: the device has %s in all, %s free; Strata's "
        "state and buffers take %s there and the plan estimated %s for activations; lower "
        "train_micro_batch_size_per_gpu, set run.recompute \"always\" or activation_checkpointing.cpu_checkpointing, "
        "or move state off the device (strata plan shows the split). LibTorch: %s",
        device_->name().c_str(), (long long)(step_ + 1), format_bytes(double(m.total_bytes)).c_str(),
        format_bytes(double(m.free_bytes)).c_str(), format_bytes(double(peak_bytes()[0])).c_str(),
        format_bytes(double(state_->plan().activation_bytes)).c_str(), torch_line.c_str()));
  }
  const double param_wait = window_->wait_seconds() - wait0;
  r.tokens = accum * micro * cfg_.model.seq_len * ranks;

  // The gradient norm, the global batch's loss and the stop requests: one
  // all-reduce of three numbers. Each rank's squared norm was accumulated
  // as its last micro-batch's gradient reached its home (flush_grad), summed
  // here in block order: the fp32 norm LibTorch computed, squared in double.
  const auto t_opt = std::chrono::steady_clock::now();
  double sums[3] = {0.0, local_loss, stop_requested ? 1.0 : 0.0};
  for (at::Tensor& n : block_norm_) {
    if (!n.defined()) continue;
    const double norm = n.item<double>();
    sums[0] += norm * norm;
    n = at::Tensor();
  }
  {
    TraceSpan span(TraceTrack::kComm, "all_reduce norm, loss, stop");
    comm_->all_reduce(sums, 3, DType::kF64, ReduceOp::kSum).wait();
  }
  r.grad_norm = std::sqrt(sums[0]) / loss_scale;
  r.loss = sums[1];
  r.stop = sums[2] > 0.0;
  r.lr = learning_rate(cfg_.scheduler, cfg_.optimizer.lr, applied_steps_ + 1);
  if (scaler_) {
    // Note [Loss scaling]: the norm is all-reduced, so every rank skips the
    // same steps. The gradients in their homes are overwritten by the next
    // step's first flush; nothing else has changed.
    r.loss_scale = loss_scale;
    r.skipped = !std::isfinite(r.grad_norm);
    scaler_->update(r.skipped, step_ + 1);
    if (r.skipped) {
      ++step_;
      r.links = moved;
      r.optimizer_wait_s = opt_wait_s_ - opt_wait0;
      r.wait_s = param_wait + r.optimizer_wait_s;
      r.net_bytes = comm_->bytes_sent() - net0;
      r.comm_wait_s = comm_->wait_seconds() - comm_wait0;
      return r;
    }
  }
  // Global-norm clipping folded into the optimizer as a gradient scale, with
  // torch.nn.utils.clip_grad_norm_'s formula; fp16 unscales in the same
  // multiply.
  double coef = 1.0;
  if (cfg_.gradient_clipping > 0.0) coef = std::min(1.0, cfg_.gradient_clipping / (r.grad_norm + 1e-6));
  const float grad_scale = float(coef / loss_scale);
  if (!std::isfinite(r.grad_norm)) {
    // Stepping would turn every tier's optimizer state into NaN for good. The
    // norm is all-reduced, so every rank stops here.
    throw Error(strprintf("gradient norm is %f at step %lld: the optimizer step was skipped and the "
                          "state is unchanged; lower optimizer.params.lr or enable gradient_clipping",
                          r.grad_norm, (long long)(step_ + 1)));
  }
  window_->invalidate();  // the optimizer rewrites the working copy
  // CPU Adam rewrites host-tier working copies that fetches of this step
  // read: those copies are done (they are, since the norm's read waited for
  // the backward that used them; this says so).
  device_->synchronize(Stream::kH2D);
  std::fill(gathered_valid_.begin(), gathered_valid_.end(), 0);
  const OptimizerThread::Job job{grad_scale, r.lr, applied_steps_ + 1, device_->record(Stream::kCompute)};
  if (opt_thread_) {
    finish();  // the previous step's write-backs are done and its staging is free
    const OptimizerThread::Report last = opt_thread_->take_report();  // the previous step's
    r.optimizer_s = last.seconds;
    r.links = last.links;
    opt_thread_->start(job);
  } else {
    try {
      TieredState::TallyScope opt_tally(&r.links);
      optimizer_step(job);
    } catch (...) {
      // Some sub-groups may have been updated and others not.
      broken_ = true;
      throw;
    }
    r.optimizer_s = seconds_since(t_opt);
  }
  ++step_;
  ++applied_steps_;
  r.optimizer_wait_s = opt_wait_s_ - opt_wait0;
  r.wait_s = param_wait + r.optimizer_wait_s;
  r.links = r.links + moved;
  r.net_bytes = comm_->bytes_sent() - net0;
  r.comm_wait_s = comm_->wait_seconds() - comm_wait0;
  return r;
}

// Note [Step order]
// Forward runs every block but the head without autograd and keeps each
// block's input (the activation checkpoint). The head runs with autograd, so
// the loss gives d(loss)/d(head input). Backward then walks the blocks in
// reverse: recompute the block from its saved input with autograd over leaf
// views of its weights, and ask autograd for the gradients of the input and of
// the weights given the output gradient. Weight gradients are staged per block
// and reduced into the block's gradient home (Note [Gathered blocks]), so
// nothing but one block's graph is alive at a time. A tied head adds its
// output-projection gradient into the embedding block's gradient, which
// backward reaches last.
at::Tensor Trainer::forward_backward(const at::Tensor& tokens, double loss_scale) {
  const int64_t T = cfg_.model.seq_len;
  at::Tensor inputs = tokens.narrow(1, 0, T);
  at::Tensor targets = tokens.narrow(1, 1, T);
  STRATA_CHECK(head_block_ == layout_.num_blocks() - 1, "the head must be the last block");

  at::Tensor x = forward_layers(inputs, /*train=*/true);

  // Head and loss, with autograd.
  DevicePtr gathered[2];
  at::Tensor dx;
  at::Tensor loss_value;
  {
    at::Tensor xin = x.detach().requires_grad_(true);
    next_use(gathered);
    std::vector<at::Tensor> w = as_leaves(weights(head_block_, gathered[0]));
    at::Tensor tied;
    if (cfg_.model.tie_embeddings) tied = as_leaves(weights(embedding_block_, gathered[1]))[0];
    TraceSpan span(TraceTrack::kCompute, "head forward + backward");
    at::Tensor loss = loss_of(model_.forward(head_block_, w, xin, tied), targets);
    loss_value = loss.detach();
    std::vector<at::Tensor> wrt{xin};
    wrt.insert(wrt.end(), w.begin(), w.end());
    if (tied.defined()) wrt.push_back(tied);
    std::vector<at::Tensor> grads =
        torch::autograd::grad({loss * loss_scale}, wrt, /*grad_outputs=*/{}, /*retain_graph=*/false);
    dx = grads[0];
    // The head's gradient for the tied embedding is added when the embedding's
    // own gradient is staged, so the embedding is flushed once per micro-batch.
    if (tied.defined()) tied_grad_ = grads.back();
    w.clear();
    tied = at::Tensor();
    end_use();
    accumulate_grad(head_block_, grads, 1);
  }

  // Layers and embedding, in reverse: recomputed from their saved inputs, or
  // through the graphs their forward kept (Note [Recompute]).
  for (size_t b = head_block_; b-- > 0;) {
    next_use(gathered);
    const bool is_embedding = model_.blocks()[b].kind == BlockKind::kEmbedding;
    std::vector<at::Tensor> w, grads;
    at::Tensor xin, y;
    if (keep_graphs_) {
      KeptGraph& g = graphs_[b];
      w = std::move(g.w);
      xin = std::move(g.xin);
      y = std::move(g.y);
      g = KeptGraph();
    } else {
      w = as_leaves(weights(b, gathered[0]));
      at::Tensor saved = checkpoints_->restore(b);
      xin = is_embedding ? saved : saved.detach().requires_grad_(true);
    }
    {
      TraceSpan span(TraceTrack::kCompute, backward_names_[b].c_str());
      if (!y.defined()) y = model_.forward(b, w, xin);
      std::vector<at::Tensor> wrt;
      if (!is_embedding) wrt.push_back(xin);
      wrt.insert(wrt.end(), w.begin(), w.end());
      grads = torch::autograd::grad({y}, wrt, {dx}, /*retain_graph=*/false);
    }
    y = at::Tensor();
    xin = at::Tensor();
    w.clear();
    end_use();
    accumulate_grad(b, grads, is_embedding ? 0 : 1);
    if (!is_embedding) dx = grads[0];
  }
  // The last reductions, oldest first.
  if (comm_->world_size() > 1) {
    const int first = grad_seq_[0] < grad_seq_[1] ? 0 : 1;
    complete_grad_sync(first);
    complete_grad_sync(1 - first);
  }
  finish_landing();  // the embedding's gradient, on its way to a host home
  return loss_value;
}

// The blocks before the head, in order; training keeps each block's input.
// Shared by training and evaluation.
at::Tensor Trainer::forward_layers(at::Tensor x, bool train) {
  const bool keep = train && keep_graphs_;
  std::optional<at::NoGradGuard> no_grad;
  if (!keep) no_grad.emplace();
  DevicePtr gathered[2];
  for (size_t b = 0; b < head_block_; ++b) {
    if (train && !keep) checkpoints_->save(b, x);
    next_use(gathered);
    TraceSpan span(TraceTrack::kCompute, forward_names_[b].c_str());
    if (keep) {
      // Note [Recompute]: the graph over leaf views of the weights and a
      // leaf input, kept for the backward.
      KeptGraph& g = graphs_[b];
      g.w = as_leaves(weights(b, gathered[0]));
      g.xin = b == embedding_block_ ? x : x.detach().requires_grad_(true);
      g.y = model_.forward(b, g.w, g.xin);
      x = g.y.detach();
    } else {
      std::vector<at::Tensor> w = weights(b, gathered[0]);
      x = model_.forward(b, w, x);
    }
    end_use();
  }
  return x;
}

// Evaluation shares the forward (forward_layers) and the gathered blocks with
// training. Every rank evaluates the same windows (collective: at stage 3 the
// blocks are gathered), so every rank returns the same loss.
double Trainer::eval_loss(const int64_t* tokens, int64_t batches) {
  finish();
  STRATA_CHECK(!broken_, "eval after a failed optimizer step");
  window_->set_ready(INT32_MAX);
  at::NoGradGuard no_grad;
  ComputeStreamScope on_compute_stream(*device_);
  const int64_t micro = cfg_.train_micro_batch_size_per_gpu;
  const int64_t window = cfg_.model.seq_len + 1;
  const int64_t T = cfg_.model.seq_len;
  double total = 0.0;
  for (int64_t i = 0; i < batches; ++i) {
    at::Tensor batch = at::from_blob(const_cast<int64_t*>(tokens + i * micro * window),
                                     {micro, window}, at::TensorOptions().dtype(at::kLong))
                           .to(torch_device_);
    begin_uses(&eval_schedule_);
    at::Tensor x = forward_layers(batch.narrow(1, 0, T), /*train=*/false);
    DevicePtr gathered[2];
    next_use(gathered);
    at::Tensor tied;
    if (cfg_.model.tie_embeddings) tied = weights(embedding_block_, gathered[1])[0];
    at::Tensor logits = model_.forward(head_block_, weights(head_block_, gathered[0]), x, tied);
    total += loss_of(logits, batch.narrow(1, 1, T)).item<double>();
    tied = at::Tensor();
    end_use();
  }
  return total / double(batches);
}

// ---- Note [Gathered blocks]: uses of a schedule -------------------------------

void Trainer::begin_uses(const std::vector<WindowUse>* schedule) {
  // A failed pass may have left gathers in flight: their buffers are reused.
  for (auto& slot : gather_done_) for (Completion& c : slot) c.wait();
  window_->begin(schedule);
  uses_ = schedule;
  use_ = 0;
  use_issued_ = false;
}

// Acquires use u's shards from the window and starts gathering them.
void Trainer::issue_gather(size_t u) {
  const WindowUse& use = (*uses_)[u];
  DevicePtr shard[2];
  acquire(shard, size_t(use.block[0]), use.count > 1 ? size_t(use.block[1]) : SIZE_MAX);
  const int slot = int(u % 2);
  const DType dt = compute_dtype_ == at::kFloat ? DType::kF32 : DType::kBF16;
  for (int i = 0; i < use.count; ++i) {
    const size_t b = size_t(use.block[i]);
    const int64_t n = layout_.block(b).shard_numel();
    const DevicePtr src = shard[i] ? shard[i] : device_resident(Category::kParam16, shard_offset_[b], n);
    STRATA_CHECK(src, "a block neither fetched nor resident on the device");
    if (gather_once_) {
      gathered_[slot][i] = gather_mem_.ptr() + layout_.block(b).offset * compute_bytes_;
      if (gathered_valid_[b]) continue;
      gathered_valid_[b] = 1;
    } else {
      gathered_[slot][i] = gather_mem_.ptr() + int64_t(slot * 2 + i) * state_->plan().largest_block_numel * compute_bytes_;
    }
    TraceSpan span(TraceTrack::kComm, "all_gather");
    gather_done_[slot][i] = comm_->all_gather(src.raw(), gathered_[slot][i].raw(), n, dt);
  }
}

void Trainer::next_use(DevicePtr out[2]) {
  if (shards_ == 1) {
    // One shard: the shard is the block, used in place (fetched or resident).
    const WindowUse& use = (*uses_)[use_];
    acquire(out, size_t(use.block[0]), use.count > 1 ? size_t(use.block[1]) : SIZE_MAX);
    for (int i = 0; i < use.count; ++i) {
      if (!out[i]) {
        const size_t b = size_t(use.block[i]);
        out[i] = device_resident(Category::kParam16, shard_offset_[b], layout_.block(b).shard_numel());
      }
    }
    return;
  }
  if (!use_issued_) issue_gather(use_);
  const int slot = int(use_ % 2);
  {
    TraceSpan span(TraceTrack::kComm, "wait all_gather");
    for (Completion& c : gather_done_[slot]) c.wait();
  }
  window_->release();  // the shards are in the gathered buffers now
  // The next use's gather runs while this one computes.
  use_issued_ = use_ + 1 < uses_->size();
  if (use_issued_) issue_gather(use_ + 1);
  out[0] = gathered_[slot][0];
  out[1] = gathered_[slot][1];
}

void Trainer::end_use() {
  if (shards_ == 1) window_->release();
  ++use_;
}

// ---- the optimizer thread (Note [Optimizer overlap] in optimizer_thread.h) --------

void Trainer::wait_optimizer(int64_t offset) {
  if (!opt_thread_) return;
  try {
    opt_thread_->wait(offset, &opt_wait_s_);
  } catch (...) {
    // Some sub-groups may have been updated and others not.
    broken_ = true;
    throw;
  }
}

// The thread's progress is INT64_MAX only once it has finished.
void Trainer::finish() { wait_optimizer(INT64_MAX); }

int32_t Trainer::ready_blocks() {
  if (!opt_thread_) return INT32_MAX;
  const int64_t progress = opt_thread_->progress();
  int32_t n = 0;
  while (size_t(n) < block_end_.size() && block_end_[size_t(n)] <= progress) ++n;
  return n;
}

void Trainer::acquire(DevicePtr out[2], size_t b0, size_t b1) {
  int64_t end = block_end_[b0];
  if (b1 != SIZE_MAX) end = std::max(end, block_end_[b1]);
  wait_optimizer(end);
  window_->set_ready(ready_blocks());
  window_->acquire(out);
}

// ---- gradients ------------------------------------------------------------------

void Trainer::accumulate_grad(size_t b, const std::vector<at::Tensor>& grads, size_t first) {
  const int k = comm_->world_size() > 1 ? grad_turn_ : 0;
  if (comm_->world_size() > 1) complete_grad_sync(k);  // the stage's previous block is reduced
  // Views over the staging buffer, built once per block in the constructor.
  const at::Tensor& stage = grad_stage_flat_[k][b];
  // A GPU: the stage's last D2H (flush_grad) must have read it first.
  if (landing_.copied.pending()) device_->stream_wait(Stream::kCompute, landing_.copied);
  stage.zero_();
  const std::vector<at::Tensor>& dst = grad_stage_views_[k][b];
  if (b == embedding_block_ && tied_grad_.defined()) {
    dst[0].add_(tied_grad_);  // the head's share first, as autograd would sum it
    tied_grad_ = at::Tensor();
  }
  for (size_t i = 0; i < dst.size() && first + i < grads.size(); ++i) {
    const at::Tensor& g = grads[first + i];
    if (g.defined()) dst[i].add_(g);  // fp32 accumulation of 16-bit gradients
  }
  const DevicePtr full(static_cast<std::byte*>(stage.data_ptr()));
  if (comm_->world_size() == 1) {
    flush_grad(b, full);
    return;
  }
  // Note [Gathered blocks]: reduce while the next block's backward runs.
  const int64_t n = layout_.block(b).shard_numel();
  GradSync& gs = grad_sync_[k];
  gs.block = int(b);
  if (cfg_.zero.stage >= 2) {
    const DevicePtr shard = grad_shards_.ptr() + int64_t(k) * state_->plan().largest_block_shard_numel * 4;
    gs.done = comm_->reduce_scatter(full.raw(), shard.raw(), n, DType::kF32);
    gs.shard = shard;
  } else {
    gs.done = comm_->all_reduce(full.raw(), layout_.block(b).padded_numel, DType::kF32, ReduceOp::kSum);
    gs.shard = full + shard_rank_ * n * 4;
  }
  grad_seq_[k] = ++grad_issued_;
  grad_turn_ = 1 - k;
}

void Trainer::complete_grad_sync(int k) {
  GradSync& gs = grad_sync_[k];
  if (gs.block < 0) return;
  {
    TraceSpan span(TraceTrack::kComm, "wait gradient reduction");
    gs.done.wait();
  }
  const int b = gs.block;
  gs.block = -1;
  flush_grad(size_t(b), gs.shard);
}

// Adds the rank's shard of block b's gradient into its home: the first time
// in a step a plain copy, afterwards an add (in place when resident, else
// read, add, write). The arithmetic is the same on every tier. On the last
// micro-batch the rank's part of the final gradient gives its norm (as a
// tensor: on a GPU it is read once, when the step's backward is done).
void Trainer::flush_grad(size_t b, DevicePtr shard) {
  const int64_t n = layout_.block(b).shard_numel();
  const int64_t off = shard_offset_[b];
  auto host = [&](const void* p) {
    return at::from_blob(const_cast<void*>(p), {n}, at::TensorOptions().dtype(at::kFloat));
  };
  at::Tensor final_values;
  if (const DevicePtr home = device_resident(Category::kGrad, off, n)) {
    // On the device: added in place, on the compute stream.
    at::Tensor h = device_tensor(home, n, at::kFloat);
    if (!grad_written_[b]) {
      h.copy_(device_tensor(shard, n, at::kFloat));
    } else {
      h.add_(device_tensor(shard, n, at::kFloat));
    }
    final_values = h;
  } else if (device_->host_addressable()) {
    // The device's memory is host memory: the shard is read where it is.
    const float* src = reinterpret_cast<const float*>(shard.raw());
    if (!grad_written_[b]) {
      if (reinterpret_cast<uintptr_t>(src) % kPageBytes == 0) {
        state_->write(Category::kGrad, off, n, src);
        final_values = host(src);
      } else {
        std::memcpy(grad_rmw_.data(), src, size_t(n * 4));  // aligned for O_DIRECT
        state_->write(Category::kGrad, off, n, grad_rmw_.data());
        final_values = host(grad_rmw_.data());
      }
    } else {
      at::Tensor acc = host(grad_rmw_.data());
      state_->read(Category::kGrad, off, n, acc.data_ptr());
      acc.add_(host(src));
      state_->write(Category::kGrad, off, n, acc.data_ptr());
      final_values = acc;
    }
  } else {
    // A GPU: the shard comes to registered host memory (D2H, after the
    // backward that wrote it) and is added into its home while the next
    // block's backward runs (finish_landing): two landing halves, one
    // filling while the other is added.
    TraceSpan span(TraceTrack::kCopy, "gradient D2H");
    const int half = landing_turn_;
    landing_turn_ ^= 1;
    std::byte* landed = grad_host_.data() + int64_t(half) * state_->plan().largest_block_numel * 4;
    device_->stream_wait(Stream::kD2H, device_->record(Stream::kCompute));
    device_->copy_to_host(landed, shard, n * 4, Stream::kD2H);
    const Completion copied = device_->record(Stream::kD2H);
    // The stage is zeroed for the next block only after this read
    // (accumulate_grad waits for landing_.copied; world size 1 fills stage 0 only).
    finish_landing();  // the previous block's, if any
    landing_ = Landing{int(b), copied, landed, !grad_written_[b]};
    grad_written_[b] = 1;
    return;
  }
  grad_written_[b] = 1;
  if (last_micro_) {
    // fp32 norm as LibTorch computes it; squared in double and summed in
    // block (shard) order when the step ends, never in completion order.
    block_norm_[b] = final_values.narrow(0, norm_lo_[b], norm_hi_[b] - norm_lo_[b]).norm();
  }
}

// The host half of flush_grad on a GPU for the block whose D2H is in flight:
// waits for it, then writes or adds the shard into its home, and on the last
// micro-batch takes its norm.
void Trainer::finish_landing() {
  if (landing_.block < 0) return;
  Landing l = landing_;
  landing_ = Landing();
  const size_t b = size_t(l.block);
  const int64_t n = layout_.block(b).shard_numel();
  const int64_t off = shard_offset_[b];
  auto host = [&](const void* p) {
    return at::from_blob(const_cast<void*>(p), {n}, at::TensorOptions().dtype(at::kFloat));
  };
  {
    TraceSpan span(TraceTrack::kCopy, "wait gradient D2H");
    l.copied.wait();
  }
  at::Tensor final_values;
  if (l.first) {
    state_->write(Category::kGrad, off, n, l.landed);  // counts the D2H
    final_values = host(l.landed);
  } else if (std::byte* home = state_->resident(Category::kGrad, off, n)) {
    state_->count_copy(/*to_device=*/false, n * 4);
    final_values = host(home).add_(host(l.landed));
  } else {
    state_->count_copy(/*to_device=*/false, n * 4);
    std::byte* acc = grad_host_.data() + 2 * state_->plan().largest_block_numel * 4;
    state_->read(Category::kGrad, off, n, acc);
    host(acc).add_(host(l.landed));
    state_->write(Category::kGrad, off, n, acc);
    final_values = host(acc);
  }
  if (last_micro_) block_norm_[b] = final_values.narrow(0, norm_lo_[b], norm_hi_[b] - norm_lo_[b]).norm();
}

at::Tensor Trainer::loss_of(const at::Tensor& logits, const at::Tensor& targets) const {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                targets.reshape({-1}));
}

// ---- the optimizer ----------------------------------------------------------------

// Per sub-group, wherever its state lives: resident state is updated in place,
// swapped state is read into staging, updated and written back. The working
// copy comes out of the same pass (bf16: emitted by CPU Adam; fp32: copied).
//
// Note [Optimizer pipeline]
// The loop walks pipeline pieces (sub-groups cut to at most
// kPipelineChunkElems, Note [Pipeline pieces]); "sub-group" below means a
// piece. Staging comes in `opt_sets` sets. With two or more, sub-group j+1's
// reads are issued before sub-group j is updated, and j's write-backs are
// issued right after it, so NVMe transfers run on the I/O threads while CPU Adam
// runs on its own. A set is reused for j + opt_sets only once the write-backs
// of the sub-group that used it last have completed. With one set the loop is
// sequential. Arithmetic does not depend on the depth.
//
// On a GPU (a device host code may not touch), a piece whose state, gradient
// and working copy all live in HBM is updated there by the fused kernel
// (kernels/adam.h, bit for bit CPU Adam's), queued on the compute stream, with
// nothing staged; every other piece is CPU Adam's as above, its device-tier
// parts staged through host memory like NVMe ones.
void Trainer::optimizer_step(const OptimizerThread::Job& job) {
  cpu_adam::AdamParams h;
  h.lr = job.lr;
  h.beta1 = cfg_.optimizer.beta1;
  h.beta2 = cfg_.optimizer.beta2;
  h.eps = cfg_.optimizer.eps;
  h.weight_decay = cfg_.optimizer.weight_decay;
  h.adamw = cfg_.optimizer.adam_w_mode;
  const PlacementPlan& plan = state_->plan();
  const std::vector<PlacementUnit>& groups = pieces_;  // Note [Pipeline pieces] in placement.h
  OptimizerStaging& st = *staging_;
  const int sets = st.sets();

  auto issue_reads = [&](size_t j) {
    const int k = int(j % size_t(sets));
    const PlacementUnit& g = groups[j];
    st.write_done(k).wait();  // the set's previous user is written back
    OptSet& sp = opt_spans_[size_t(k)];
    sp.adam = cpu_adam::AdamSpans();
    sp.adam.state_type = plan.bf16_moments() ? cpu_adam::StateType::kBF16 : cpu_adam::StateType::kF32;
    sp.adam.grad_type = cpu_adam::GradType::kF32;
    sp.adam.numel = g.numel;
    if (piece_on_device_[j]) return;  // updated in place on the device (launch_device_run)
    auto fetch = [&](Category c) -> std::byte* {
      std::byte* p = state_->resident(c, g.offset, g.numel);
      if (p != nullptr) return p;
      std::byte* dst = st.slot(c, k);
      STRATA_CHECK(dst != nullptr, "optimizer staging without a slot for a piece that needs one");
      // Device-tier parts (a GPU) after the backward that wrote the gradient,
      // not behind the next step's forward this thread may run beside.
      st.read_done(k) = state_->read_async(c, g.offset, g.numel, dst, st.reads(k), &job.backward_done);
      return dst;
    };
    sp.adam.grad = fetch(Category::kGrad);
    sp.adam.param = reinterpret_cast<float*>(fetch(Category::kMaster));
    sp.adam.exp_avg = fetch(Category::kExpAvg);
    sp.adam.exp_avg_sq = fetch(Category::kExpAvgSq);
    sp.working = state_->resident(Category::kParam16, g.offset, g.numel);
    sp.working_resident = sp.working != nullptr;
    if (!sp.working_resident) sp.working = st.slot(Category::kParam16, k);
    STRATA_CHECK(sp.working != nullptr, "optimizer staging without a working-copy slot");
    if (compute_dtype_ != at::kFloat) {
      sp.adam.emit = sp.working;
      sp.adam.emit_type = compute_dtype_ == at::kBFloat16 ? cpu_adam::EmitType::kBF16 : cpu_adam::EmitType::kF16;
    }
  };

  // A save of an earlier step in flight (Note [Saving while training]):
  // each piece waits until the save has written what its update overwrites.
  std::shared_ptr<InFlightSave> save;
  {
    std::lock_guard<std::mutex> lock(save_mu_);
    if (save_ && job.step > save_->applied) save = save_;
  }
  if (!groups.empty()) issue_reads(0);
  const int64_t moment_bytes = plan.elem_bytes[size_t(Category::kExpAvg)];
  for (size_t j = 0; j < groups.size(); ++j) {
    const int k = int(j % size_t(sets));
    const PlacementUnit& g = groups[j];
    if (sets > 1 && j + 1 < groups.size()) issue_reads(j + 1);  // read ahead
    st.read_done(k).wait();
    int64_t end = g.offset + g.numel;  // what this piece's update overwrites
    if (piece_on_device_[j]) {
      for (const DeviceRun& r : device_launch_[j]) end = std::max(end, r.offset + r.numel);
    }
    if (save) {
      const size_t n =
          size_t(std::lower_bound(save->offsets.begin(), save->offsets.end(), end) - save->offsets.begin());
      TraceSpan span(TraceTrack::kAdam, "wait for checkpoint");
      save->save->wait_written(n);
    }
    if (piece_on_device_[j]) {
      TraceSpan span(TraceTrack::kAdam, "adam on the device");
      for (const DeviceRun& r : device_launch_[j]) launch_device_run(h, job, r);
      if (opt_thread_) opt_thread_->publish(g.offset + g.numel);
      if (sets == 1 && j + 1 < groups.size()) issue_reads(j + 1);
      continue;
    }
    OptSet& sp = opt_spans_[size_t(k)];
    {
      TraceSpan span(TraceTrack::kAdam, "adam sub-group");
      // One call per run inside a block shard: the rounding of bf16 moments
      // is keyed by the global unpadded parameter index (Note [bf16 state]),
      // so it depends on neither pieces, placement nor world size.
      for (const AdamRun& run : piece_runs_[j]) {
        cpu_adam::AdamSpans part = sp.adam;
        part.param += run.start;
        part.grad = static_cast<const float*>(part.grad) + run.start;
        part.exp_avg = static_cast<std::byte*>(part.exp_avg) + run.start * moment_bytes;
        part.exp_avg_sq = static_cast<std::byte*>(part.exp_avg_sq) + run.start * moment_bytes;
        if (part.emit != nullptr) part.emit = static_cast<std::byte*>(part.emit) + run.start * compute_bytes_;
        part.numel = run.numel;
        adam_->step(h, cpu_adam::StepArgs{job.step, job.grad_scale, run.key}, part);
      }
    }
    if (compute_dtype_ == at::kFloat) std::memcpy(sp.working, sp.adam.param, size_t(g.numel * 4));
    PendingIo& w = st.writes(k);
    Completion& written = st.write_done(k);
    if (!state_->resident(Category::kMaster, g.offset, g.numel)) {
      written = state_->write_async(Category::kMaster, g.offset, g.numel, sp.adam.param, w, &kNoKernel);
    }
    if (!state_->resident(Category::kExpAvg, g.offset, g.numel)) {
      written = state_->write_async(Category::kExpAvg, g.offset, g.numel, sp.adam.exp_avg, w, &kNoKernel);
    }
    if (!state_->resident(Category::kExpAvgSq, g.offset, g.numel)) {
      written = state_->write_async(Category::kExpAvgSq, g.offset, g.numel, sp.adam.exp_avg_sq, w, &kNoKernel);
    }
    if (!sp.working_resident) {
      if (opt_thread_) {
        // The next forward may read it as soon as the progress says so.
        state_->write_async(Category::kParam16, g.offset, g.numel, sp.working, opt_param_write_, &kNoKernel).wait();
      } else {
        written = state_->write_async(Category::kParam16, g.offset, g.numel, sp.working, w, &kNoKernel);
      }
    }
    if (opt_thread_) opt_thread_->publish(g.offset + g.numel);
    if (sets == 1 && j + 1 < groups.size()) issue_reads(j + 1);  // sequential: after the write-back
  }
  for (int k = 0; k < sets; ++k) st.write_done(k).wait();
}

// One launch over a stretch of device-resident state (DeviceRun): master,
// moments and gradient in place, the working copy emitted (bf16/fp16) or
// copied (fp32) on the compute stream.
void Trainer::launch_device_run(const cpu_adam::AdamParams& h, const OptimizerThread::Job& job, const DeviceRun& r) {
  auto home = [&](Category c) {
    const DevicePtr p = state_->resident_on_device(c, r.offset, r.numel);
    STRATA_CHECK(p, "a device optimizer run that is not resident on the device");
    return p;
  };
  cpu_adam::AdamSpans s;
  s.grad = home(Category::kGrad).raw();
  s.param = reinterpret_cast<float*>(home(Category::kMaster).raw());
  s.exp_avg = home(Category::kExpAvg).raw();
  s.exp_avg_sq = home(Category::kExpAvgSq).raw();
  s.state_type = state_->plan().bf16_moments() ? cpu_adam::StateType::kBF16 : cpu_adam::StateType::kF32;
  s.grad_type = cpu_adam::GradType::kF32;
  s.numel = r.numel;
  const DevicePtr working = home(Category::kParam16);
  if (compute_dtype_ != at::kFloat) {
    s.emit = working.raw();
    s.emit_type = compute_dtype_ == at::kBFloat16 ? cpu_adam::EmitType::kBF16 : cpu_adam::EmitType::kF16;
  }
  device_adam(h, cpu_adam::StepArgs{job.step, job.grad_scale, r.key}, s);
  if (compute_dtype_ == at::kFloat) {
    device_->copy_on_device(working, home(Category::kMaster), r.numel * 4, Stream::kCompute);
  }
}

void Trainer::device_adam(const cpu_adam::AdamParams& h, const cpu_adam::StepArgs& args,
                          const cpu_adam::AdamSpans& spans) {
#ifdef STRATA_WITH_CUDA
  if (device_->is_cuda()) {
    device_->make_current();  // the optimizer thread's launches go to this GPU
    kernels::adam_step(cpu_adam::detail::make_constants(h, args), spans, /*nonfinite=*/nullptr,
                       device_->native_stream(Stream::kCompute));
    return;
  }
#endif
  // A device that is neither CUDA nor host-addressable is a test's, with
  // host memory behind it and a compute stream that runs at once: CPU Adam
  // on that memory is its kernel (the same bits, as kernels_test shows for
  // CUDA's).
  STRATA_CHECK(!device_->is_cuda(), "a CUDA device in a build without the CUDA path");
  adam_->step(h, args, spans);
}

// ---- checkpoints ------------------------------------------------------------------

std::vector<ShardRange> Trainer::checkpoint_ranges(bool save) const {
  std::vector<ShardRange> out;
  const int64_t world = comm_->world_size(), rank = comm_->rank();
  int64_t j = 0;  // chunk counter: with replicated state, chunk j is saved by rank j % world
  for (Category c : kSavedCategories) {
    for (size_t b = 0; b < layout_.num_blocks(); ++b) {
      const BlockLayout& bl = layout_.block(b);
      const int64_t sn = bl.shard_numel();
      const int64_t first = shard_rank_ * sn;  // the held range's first element within the block
      const int64_t real = std::clamp<int64_t>(bl.numel - first, 0, sn);
      for (int64_t a = 0; a < real; a += kCheckpointChunkElems, ++j) {
        if (save && shards_ == 1 && j % world != rank) continue;
        ShardRange r;
        r.category = c;
        r.numel = std::min(kCheckpointChunkElems, real - a);
        r.shard_offset = shard_offset_[b] + a;
        r.shard_numel = std::min(sn - a, (r.numel + kShardAlignElems - 1) / kShardAlignElems * kShardAlignElems);
        r.start = global_index_[b] + first + a;
        out.push_back(r);
      }
    }
  }
  return out;
}

std::vector<TensorEntry> Trainer::tensor_entries() const {
  std::vector<TensorEntry> out;
  for (size_t b = 0; b < layout_.num_blocks(); ++b) {
    for (const ParamLayout& p : layout_.block(b).params) {
      out.push_back({layout_.block(b).name + "." + p.spec.name, p.spec.shape, global_index_[b] + p.offset});
    }
  }
  return out;
}

std::vector<ShardRange> Trainer::save_ranges() const {
  std::vector<ShardRange> ranges = checkpoint_ranges(true);
  std::stable_sort(ranges.begin(), ranges.end(),
                   [](const ShardRange& a, const ShardRange& b) { return a.shard_offset < b.shard_offset; });
  return ranges;
}

void Trainer::begin_checkpoint(const CheckpointOptions& options, Manifest header) {
  STRATA_CHECK(!save_, "a checkpoint save is already in flight");
  auto f = std::make_shared<InFlightSave>();
  f->t0 = std::chrono::steady_clock::now();
  header.step = step_;
  header.trainer["step"] = step_;
  header.trainer["optimizer_step"] = applied_steps_;
  header.trainer["loss_scale"] = scaler_ ? scaler_->to_json() : nlohmann::json();
  header.parameters = layout_.parameter_count();
  header.tensors = tensor_entries();
  for (Category c : kSavedCategories) header.elem_bytes[c] = state_->elem_bytes(c);
  // In the order the optimizer walks the shard space (all categories of a
  // piece together): it waits for a prefix of them.
  f->ranges = save_ranges();
  for (const ShardRange& r : f->ranges) f->offsets.push_back(r.shard_offset);
  f->applied = applied_steps_;
  InFlightSave* raw = f.get();
  RangeSource source;
  source.resident = [this, raw](size_t i) -> const std::byte* {
    const ShardRange& r = raw->ranges[i];
    return state_->resident(r.category, r.shard_offset, r.shard_numel);
  };
  source.fill = [this, raw](size_t i, int64_t at, int64_t numel, std::byte* buf) {
    const ShardRange& r = raw->ranges[i];
    state_->read_async(r.category, r.shard_offset + at, numel, buf, save_io_).wait();
  };
  // The step being saved may still be updating (run.overlap_optimizer):
  // each range waits until the update is final there.
  std::function<bool(size_t)> ready;
  if (opt_thread_) {
    ready = [this, raw](size_t i) {
      const ShardRange& r = raw->ranges[i];
      return opt_thread_->wait_for_job(raw->applied, r.shard_offset + r.shard_numel);
    };
  }
  TraceSpan span(TraceTrack::kNvme, "checkpoint begin");
  f->save = std::make_unique<CheckpointSave>(options, *comm_, std::move(header), f->ranges, std::move(source),
                                             std::move(ready));
  std::lock_guard<std::mutex> lock(save_mu_);
  save_ = std::move(f);
}

std::optional<Trainer::FinishedSave> Trainer::poll_checkpoint(bool wait) {
  if (!save_) return std::nullopt;
  if (!wait && !save_->save->done_everywhere()) return std::nullopt;
  std::shared_ptr<InFlightSave> f = save_;
  // Dropped only once finish() has joined the save's thread: an optimizer
  // pass that starts (takes its reference) late must still find it while
  // anything remains to be written.
  auto drop = [&] {
    std::lock_guard<std::mutex> lock(save_mu_);
    save_.reset();  // a running optimizer pass keeps its own reference
  };
  TraceSpan span(TraceTrack::kNvme, "checkpoint finish");
  FinishedSave done;
  try {
    done.dir = f->save->finish();
  } catch (...) {
    drop();
    throw;
  }
  drop();
  done.step = f->save->step();
  done.seconds = seconds_since(f->t0);
  done.write_seconds = f->save->write_seconds();
  done.bytes = f->save->bytes();
  return done;
}

std::string Trainer::save_checkpoint(const CheckpointOptions& options, Manifest header) {
  poll_checkpoint(true);  // one in flight first
  finish();               // the last step's optimizer has written its state
  TraceSpan span(TraceTrack::kNvme, "checkpoint save");
  begin_checkpoint(options, std::move(header));
  return poll_checkpoint(true)->dir;
}

void Trainer::load_checkpoint(CheckpointReader& reader) {
  STRATA_CHECK(step_ == 0, "a checkpoint is loaded before the first step");
  const Manifest& m = reader.manifest();
  const std::string mpath = reader.dir() + "/manifest.json";
  const std::vector<TensorEntry> mine = tensor_entries();
  auto shape_text = [](const std::vector<int64_t>& s) {
    std::string t = "[";
    for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
    return t + "]";
  };
  if (m.tensors.size() != mine.size() || m.parameters != layout_.parameter_count()) {
    throw InputError(mpath, strprintf("a checkpoint of another model shape: %zu tensors, %lld parameters there; "
                                      "%zu tensors, %lld parameters here",
                                      m.tensors.size(), (long long)m.parameters, mine.size(),
                                      (long long)layout_.parameter_count()));
  }
  for (size_t i = 0; i < mine.size(); ++i) {
    const TensorEntry& a = m.tensors[i];
    const TensorEntry& b = mine[i];
    if (a.name != b.name || a.shape != b.shape || a.start != b.start) {
      throw InputError(mpath, "a checkpoint of another model shape: tensor " + std::to_string(i) + " is " + a.name +
                                  " " + shape_text(a.shape) + " there, " + b.name + " " + shape_text(b.shape) + " here");
    }
  }
  for (Category c : kSavedCategories) {
    if (reader.elem_bytes(c) != state_->elem_bytes(c)) {
      throw InputError(mpath, std::string("dtypes.") + category_name(c) +
                                  " differs from this run's (run.optimizer_state_dtype)");
    }
  }
  // The counters first: nothing is written before every check has passed.
  int64_t applied = m.step;
  if (m.trainer.contains("optimizer_step")) {
    const nlohmann::json& o = m.trainer["optimizer_step"];
    if (!o.is_number_integer() || o.get<int64_t>() < 0 || o.get<int64_t>() > m.step) {
      throw InputError(mpath, "manifest trainer.optimizer_step: must be an integer in [0, step]");
    }
    applied = o.get<int64_t>();
  }
  LossScaler scaler(cfg_.fp16);
  if (scaler_) {
    const nlohmann::json ls = m.trainer.value("loss_scale", nlohmann::json());
    if (!ls.is_null()) scaler.load_json(ls, mpath);
  }
  TraceSpan span(TraceTrack::kNvme, "checkpoint load");
  const std::vector<ShardRange> ranges = checkpoint_ranges(false);
  std::vector<CheckpointReader::Target> targets;
  targets.reserve(ranges.size());
  std::vector<std::byte*> homes;
  std::vector<std::byte*> working_homes;  // the param16 home of each master range, where resident
  int64_t largest_staged = 0;
  int64_t largest_working = 0;
  for (const ShardRange& r : ranges) {
    // Resident ranges are read into their homes in place; the others through `buf`.
    std::byte* home = state_->resident(r.category, r.shard_offset, r.shard_numel);
    homes.push_back(home);
    if (home == nullptr) largest_staged = std::max(largest_staged, r.shard_numel);
    std::byte* p16 = nullptr;
    if (r.category == Category::kMaster) {
      p16 = state_->resident(Category::kParam16, r.shard_offset, r.shard_numel);
      if (p16 == nullptr) largest_working = std::max(largest_working, r.shard_numel);
    }
    working_homes.push_back(p16);
  }
  // Start-up only, and only what some range needs: staging for one chunk
  // that is not resident, and for a working copy whose home is not.
  HostBuffer buf;
  if (largest_staged > 0) buf = HostBuffer(size_t(largest_staged * 4), "checkpoint load staging");
  HostBuffer working;
  if (largest_working > 0) working = HostBuffer(size_t(largest_working * compute_bytes_), "checkpoint load working copy");
  for (size_t k = 0; k < ranges.size(); ++k) {
    const ShardRange& r = ranges[k];
    const int64_t own = homes[k] != nullptr ? r.shard_numel * state_->elem_bytes(r.category) : 0;
    targets.push_back({r.category, r.start, r.numel, homes[k] != nullptr ? homes[k] : buf.as<std::byte>(), own});
  }
  // The reader reads ahead while each chunk is placed.
  reader.read_all(targets, [&](size_t k) {
    const ShardRange& r = ranges[k];
    const int eb = state_->elem_bytes(r.category);
    std::byte* data = targets[k].out;
    std::memset(data + r.numel * eb, 0, size_t((r.shard_numel - r.numel) * eb));  // padding
    if (homes[k] == nullptr) state_->write(r.category, r.shard_offset, r.shard_numel, data);
    if (r.category == Category::kMaster) {
      // The working copy is the master weights in the compute dtype, as the
      // optimizer emits it: converted straight into its home where resident.
      std::byte* dst = working_homes[k] != nullptr ? working_homes[k] : working.as<std::byte>();
      if (compute_dtype_ == at::kFloat) {
        std::memcpy(dst, data, size_t(r.shard_numel * 4));
      } else {
        at::from_blob(dst, {r.shard_numel}, at::TensorOptions().dtype(compute_dtype_))
            .copy_(at::from_blob(data, {r.shard_numel}, at::TensorOptions().dtype(at::kFloat)));
      }
      if (working_homes[k] == nullptr) state_->write(Category::kParam16, r.shard_offset, r.shard_numel, dst);
    }
  });
  window_->invalidate();  // nothing fetched before the load is valid now
  std::fill(gathered_valid_.begin(), gathered_valid_.end(), 0);
  step_ = m.step;
  applied_steps_ = applied;
  if (scaler_) *scaler_ = scaler;
}

// ---- start-up ---------------------------------------------------------------------

Trainer::Trainer(const Config& cfg, const Model& model, std::shared_ptr<nvme::FaultPlan> faults,
                 Communicator* comm, int local_ranks, Device* device)
    : cfg_(cfg), model_(model), layout_(model.layout_specs(), shard_count(cfg)),
      compute_dtype_(dtype_of(cfg.run.compute_dtype)) {
  if (comm == nullptr) {
    own_comm_ = make_local_communicator();
    comm = own_comm_.get();
  }
  comm_ = comm;
  STRATA_CHECK(comm_->world_size() == cfg.world_size, "the communicator's world size is not the config's");
  if (device == nullptr) {
    if (cfg.run.device == "cpu") {
      device = &cpu_device();
    } else {
      own_device_ = make_device(cfg.run.device);
      device = own_device_.get();
    }
  }
  device_ = device;
  torch_device_ = torch_device(*device_);
  if (!device_->host_addressable() && comm_->world_size() > 1) {
    // Collectives on device memory need NCCL on the device's comm stream.
    throw ConfigError("run.device", "training on " + device_->name() +
                                        " with more than one rank is not supported yet; use world size 1");
  }
  if (compute_dtype_ == at::kHalf) scaler_ = std::make_unique<LossScaler>(cfg.fp16);
  compute_bytes_ = compute_dtype_ == at::kFloat ? 4 : 2;
  for (size_t b = 0; b < model_.num_blocks(); ++b) {
    if (model_.blocks()[b].kind == BlockKind::kEmbedding) embedding_block_ = b;
    if (model_.blocks()[b].kind == BlockKind::kHead) head_block_ = b;
  }
  STRATA_CHECK(embedding_block_ == 0 && head_block_ == model_.num_blocks() - 1,
               "the embedding must be the first block and the head the last");
  const cpu_adam::Isa isa = cpu_adam::parse_isa(cfg.run.cpu_adam_isa);
  if (!cpu_adam::isa_supported(isa)) {
    throw ConfigError("run.cpu_adam_isa", std::string(cpu_adam::isa_name(isa)) +
                                              " is not supported by this CPU (best: " +
                                              cpu_adam::isa_name(cpu_adam::best_isa()) + ")");
  }

  // Placement and state.
  shards_ = layout_.world_size();
  shard_rank_ = shards_ > 1 ? comm_->rank() : 0;
  gather_each_use_ = shards_ > 1 && cfg.zero.stage == 3;
  gather_once_ = shards_ > 1 && cfg.zero.stage < 3;
  MachineCapacity cap;
  PlacementPlan plan = plan_for_machine(cfg, layout_, &cap, comm_->rank(), local_ranks);
  if (plan.device_addressable != device_->host_addressable()) {
    // A device given by a caller, not the config's: its staging differs.
    plan.device_addressable = device_->host_addressable();
    plan.staging = staging_needs(plan);
  }
  // Like DeepSpeed, create missing swap directories (private to the user).
  for (const std::string& dir : plan.nvme_paths) {
    if (!path_exists(dir)) {
      make_dirs(dir, 0700);
      log::info("created swap directory %s", dir.c_str());
    }
  }
  TieredStateOptions so;
  so.engine = engine_options(cfg.aio);
  so.engine.faults = std::move(faults);
  so.checksums = cfg.run.swap_checksums;
  so.device_transient_bytes = plan.staging.device_bytes();
  so.device_budget_bytes = cfg.run.device_memory_mb > 0 ? cfg.run.device_memory_mb << 20 : -1;
  so.device = device_;  // the compute device's memory is the device tier
  state_ = std::make_unique<TieredState>(plan, so);

  keep_graphs_ = plan.keep_graphs;
  graphs_.resize(layout_.num_blocks());
  allocate_step_buffers(plan);
  micro_loss_.resize(size_t(cfg.gradient_accumulation_steps));
  initialise_state(plan);
  adam_ = std::make_unique<cpu_adam::CpuAdam>(int(cfg.run.threads), isa);
  if (cfg.run.overlap_optimizer) {
    opt_thread_ = std::make_unique<OptimizerThread>([this](const OptimizerThread::Job& job) { optimizer_step(job); });
  }
}

// The optimizer thread goes first (its destructor waits for a running job):
// it uses the buffers below.
Trainer::~Trainer() {
  save_.reset();  // an unfinished save's thread first: it may wait for the optimizer
  opt_thread_.reset();
  // Device memory is freed below: nothing queued may still use it.
  try {
    for (int s = 0; s < kNumStreams; ++s) device_->synchronize(Stream(s));
  } catch (...) {
    // A failed device: its error was reported by the call that failed.
  }
}

// Buffers exactly as the plan counted them (placement.h, StagingNeeds), and
// what is computed once per block and per piece.
void Trainer::allocate_step_buffers(const PlacementPlan& plan) {
  const StagingNeeds& need = plan.staging;
  for (const PlacementUnit& u : plan.units[size_t(Category::kParam16)]) {
    shard_offset_.push_back(u.offset);
    block_end_.push_back(u.offset + u.numel);
  }
  int64_t global = 0;
  for (const BlockLayout& bl : layout_.blocks()) {
    global_index_.push_back(global);
    global += bl.numel;
  }

  window_ = make_param_window(plan);
  window_->attach(state_.get(), need.window, compute_bytes_);
  train_schedule_ = train_schedule(int(layout_.num_blocks()), plan.tied, plan.accum);
  eval_schedule_ = eval_schedule(int(layout_.num_blocks()), plan.tied);
  if (need.gathered > 0) {
    log::info("parameter window: %d slot(s) of %s, %s of persistent blocks", need.window.slots,
              format_bytes(double(need.window.slot_numel * compute_bytes_)).c_str(),
              format_bytes(double(need.window.persistent_numel * compute_bytes_)).c_str());
  }
  Device& dev = *device_;
  if (need.gather > 0) gather_mem_ = dev.allocate(need.gather, "gathered blocks");
  gathered_valid_.assign(layout_.num_blocks(), 0);

  grad_stage_ = dev.allocate(need.grad_stage, "gradient staging");
  if (need.grad_sync > 0) {
    grad_stage2_ = dev.allocate(need.grad_stage, "gradient staging (2nd)");
    const int64_t shard_bytes = need.grad_sync - need.grad_stage;
    if (shard_bytes > 0) grad_shards_ = dev.allocate(shard_bytes, "reduce-scattered gradient shards");
  }
  if (need.grad_rmw > 0) grad_rmw_ = HostBuffer(size_t(need.grad_rmw), "gradient read-modify-write");
  if (need.grad_host > 0) grad_host_ = dev.allocate_pinned(need.grad_host, "gradients on their way to host homes");
  // What NVMe gradient reads and writes use (Note [Registered buffers]).
  grad_io_.push_back(state_->register_io_buffer(Category::kGrad, grad_rmw_.data(), int64_t(grad_rmw_.bytes())));
  grad_io_.push_back(state_->register_io_buffer(Category::kGrad, grad_host_.data(), grad_host_.bytes()));
  for (const DeviceBuffer* m : {&grad_stage_, &grad_stage2_, &grad_shards_}) {
    grad_io_.push_back(state_->register_io_buffer(Category::kGrad, *m));
  }
  for (int k = 0; k < 2; ++k) {
    const DevicePtr mem = k == 0 ? grad_stage_.ptr() : grad_stage2_.ptr();
    if (!mem) break;
    for (size_t b = 0; b < layout_.num_blocks(); ++b) {
      grad_stage_flat_[k].push_back(block_flat(b, mem, at::kFloat));
      grad_stage_views_[k].push_back(param_views(layout_.block(b), grad_stage_flat_[k].back()));
    }
  }
  grad_written_.assign(layout_.num_blocks(), 0);
  block_norm_.resize(layout_.num_blocks());
  // The gradient norm (Note [Gathered blocks]): each rank sums the squares of
  // its shards; with one shard but several ranks (stage 0) each takes an
  // equal part of every block, so that the all-reduced sum counts every
  // element once.
  for (size_t b = 0; b < layout_.num_blocks(); ++b) {
    const int64_t n = layout_.block(b).shard_numel();
    const int64_t ws = comm_->world_size(), r = comm_->rank();
    norm_lo_.push_back(shards_ == 1 ? n * r / ws : 0);
    norm_hi_.push_back(shards_ == 1 ? n * (r + 1) / ws : n);
  }

  checkpoints_ = std::make_unique<ActivationCheckpoints>(
      plan, layout_.num_blocks(),
      std::vector<int64_t>{cfg_.train_micro_batch_size_per_gpu, cfg_.model.seq_len, cfg_.model.dim}, compute_dtype_,
      state_.get());

  pieces_ = pipeline_pieces(plan);
  for (const PlacementUnit& piece : pieces_) piece_on_device_.push_back(device_adam_piece(plan, piece) ? 1 : 0);
  staging_ = std::make_unique<OptimizerStaging>(plan, *state_);
  opt_spans_.resize(size_t(staging_->sets()));
  // Runs of each optimizer piece inside one block shard.
  for (const PlacementUnit& piece : pieces_) {
    std::vector<AdamRun> runs;
    for (size_t b = 0; b < layout_.num_blocks(); ++b) {
      const int64_t lo = std::max(piece.offset, shard_offset_[b]);
      const int64_t hi = std::min(piece.offset + piece.numel, shard_offset_[b] + layout_.block(b).shard_numel());
      if (lo >= hi) continue;
      const int64_t in_block = shard_rank_ * layout_.block(b).shard_numel() + (lo - shard_offset_[b]);
      runs.push_back({lo - piece.offset, hi - lo, uint64_t(global_index_[b] + in_block), int32_t(b)});
    }
    piece_runs_.push_back(std::move(runs));
  }
  // Device pieces: runs merged while they continue the same block shard.
  device_launch_.assign(pieces_.size(), {});
  size_t open_piece = SIZE_MAX;
  DeviceRun open;
  int32_t open_block = -1;
  auto close = [&] {
    if (open_piece != SIZE_MAX) device_launch_[open_piece].push_back(open);
    open_piece = SIZE_MAX;
  };
  for (size_t j = 0; j < pieces_.size(); ++j) {
    if (!piece_on_device_[j]) {
      close();
      continue;
    }
    for (const AdamRun& r : piece_runs_[j]) {
      const int64_t at = pieces_[j].offset + r.start;
      if (open_piece != SIZE_MAX && open.offset + open.numel == at && open_block == r.block &&
          open.key + uint64_t(open.numel) == r.key) {
        open.numel += r.numel;
      } else {
        close();
        open = DeviceRun{at, r.numel, r.key};
        open_piece = j;
        open_block = r.block;
      }
    }
  }
  close();
  for (const BlockLayout& bl : layout_.blocks()) {
    forward_names_.push_back("forward " + bl.name);
    backward_names_.push_back("backward " + bl.name);
  }
}

// One generator, blocks initialised in model order: every rank draws every
// block (the draws follow the unpadded parameters in model order) and keeps
// its shard, so the same seed gives the same weights whatever the placement
// or world size.
// With model.init_from, the weights come from Hugging Face safetensors
// instead, one block at a time.
void Trainer::initialise_state(const PlacementPlan& plan) {
  at::Generator gen = at::detail::createCPUGenerator(cfg_.run.seed);
  std::unique_ptr<SafetensorsSet> hf;
  if (!cfg_.model.init_from.empty()) hf = std::make_unique<SafetensorsSet>(cfg_.model.init_from);
  // Start-up only: host memory for a block's fp32 weights (the gradient
  // stage where that is host memory).
  HostBuffer master_mem;
  std::byte* master_at = device_->host_addressable() ? grad_stage_.ptr().raw() : nullptr;
  if (master_at == nullptr) {
    master_mem = HostBuffer(size_t(plan.largest_block_numel * 4), "initial weights");
    master_at = master_mem.as<std::byte>();
  }
  for (size_t b = 0; b < layout_.num_blocks(); ++b) {
    const BlockLayout& bl = layout_.block(b);
    const int64_t n = bl.shard_numel();
    at::Tensor master = at::from_blob(master_at, {bl.padded_numel}, at::TensorOptions().dtype(at::kFloat));
    master.zero_();
    if (hf) {
      for (const ParamLayout& p : bl.params) {
        const std::string name = hf_tensor_name(bl.name + "." + p.spec.name);
        if (!hf->has(name)) {
          throw InputError(cfg_.model.init_from, "no tensor " + name + " (Strata's " + bl.name + "." + p.spec.name + ")");
        }
        if (hf->shape(name) != p.spec.shape) {
          throw InputError(cfg_.model.init_from, "tensor " + name + " has another shape than the model's");
        }
        hf->read_f32(name, master.data_ptr<float>() + p.offset);
      }
    } else {
      init_block(bl, master, gen);
    }
    state_->write(Category::kMaster, shard_offset_[b], n, master.data_ptr<float>() + shard_rank_ * n);
    // Start-up only: a temporary for the working copy (4 KiB-aligned for NVMe).
    HostBuffer tmp(size_t(bl.padded_numel * compute_bytes_), "initial working copy");
    at::Tensor working = at::from_blob(tmp.data(), {bl.padded_numel}, at::TensorOptions().dtype(compute_dtype_));
    working.copy_(master);
    state_->write(Category::kParam16, shard_offset_[b], n, tmp.as<std::byte>() + shard_rank_ * n * compute_bytes_);
  }
  // Adam moments start at zero; resident homes are zero already, swapped ones
  // are written once so that reading them is valid. The zeros come from the
  // optimizer's exp_avg staging (zero-initialised, `sets` pieces long): a
  // sub-group is written in runs of that size.
  std::byte* zeros = staging_->slot(Category::kExpAvg, 0);
  if (zeros == nullptr) return;
  const int64_t run = int64_t(staging_->sets()) * staging_->piece_numel();
  STRATA_CHECK(run % kShardAlignElems == 0 || run == plan.shard_space_numel, "optimizer staging not aligned");
  for (Category c : {Category::kExpAvg, Category::kExpAvgSq}) {
    for (const PlacementUnit& g : plan.units[size_t(c)]) {
      if (g.tier != Tier::kNvme) continue;
      for (int64_t o = 0; o < g.numel; o += run) state_->write(c, g.offset + o, std::min(run, g.numel - o), zeros);
    }
  }
}

// ---- state accessors --------------------------------------------------------------

StateBytes Trainer::state_bytes() const {
  const PlacementPlan& p = state_->plan();
  StateBytes s;
  s.param16 = p.category_total(Category::kParam16);
  s.master = p.category_total(Category::kMaster);
  s.grad = p.category_total(Category::kGrad);
  s.optimizer = p.category_total(Category::kExpAvg) + p.category_total(Category::kExpAvgSq);
  return s;
}

// Measured from what was allocated: the arenas, the swap store's regions and
// the step's buffers (all sized at start-up, so current = peak).
std::array<int64_t, kNumTiers> Trainer::peak_bytes() const {
  std::array<int64_t, kNumTiers> t{};
  t[0] = state_->device_arena_bytes() + window_->shape().bytes(compute_bytes_) + grad_stage_.bytes() +
         int64_t(grad_rmw_.bytes()) + gather_mem_.bytes() + grad_stage2_.bytes() + grad_shards_.bytes() +
         checkpoints_->device_slot_bytes();
  t[1] = state_->host_arena_bytes() + staging_->bytes() + checkpoints_->host_slot_bytes() + grad_host_.bytes() +
         window_->bounce_bytes();
  t[2] = state_->swap() != nullptr ? state_->swap()->used_bytes() : 0;
  return t;
}

DevicePtr Trainer::device_resident(Category c, int64_t offset, int64_t numel) const {
  return state_->resident_on_device(c, offset, numel);  // null unless on the device tier
}

at::Tensor Trainer::device_tensor(DevicePtr p, int64_t numel, at::ScalarType dtype) const {
  return at::from_blob(p.raw(), {numel}, at::TensorOptions().dtype(dtype).device(torch_device_));
}

at::Tensor Trainer::block_flat(size_t b, DevicePtr p, at::ScalarType dtype) {
  return device_tensor(p, layout_.block(b).padded_numel, dtype);
}

// Compute uses device-resident weights in place; the others come through the
// window (in place would hide the H2D copy a GPU must make).
// `p`: the block's gathered weights (Note [Gathered blocks]).
std::vector<at::Tensor> Trainer::weights(size_t b, DevicePtr p) {
  STRATA_CHECK(p, "a block neither gathered nor resident on the device");
  return param_views(layout_.block(b), block_flat(b, p, compute_dtype_));
}

// For tests and export, not the step: a copy through a temporary buffer.
std::vector<at::Tensor> Trainer::block_weights(size_t b) {
  at::Tensor flat = gathered_copy(Category::kParam16, b, compute_dtype_);
  std::vector<at::Tensor> w = param_views(layout_.block(b), flat);
  for (at::Tensor& t : w) t = t.clone();
  return w;
}

// A copy of block b's state of category c gathered from every rank (the
// shard staged through an aligned buffer: NVMe reads need 4 KiB alignment).
at::Tensor Trainer::gathered_copy(Category c, size_t b, at::ScalarType dtype) {
  finish();
  const BlockLayout& bl = layout_.block(b);
  const int64_t n = bl.shard_numel();
  const int eb = state_->elem_bytes(c);
  HostBuffer shard(size_t(n * eb), "shard copy");
  state_->read(c, shard_offset_[b], n, shard.data());
  at::Tensor out = at::empty({bl.padded_numel}, at::TensorOptions().dtype(dtype));
  STRATA_CHECK(int64_t(out.element_size()) == eb, "dtype does not match the category's element size");
  if (shards_ == 1) {
    std::memcpy(out.data_ptr(), shard.data(), size_t(n * eb));
  } else {
    comm_->all_gather(shard.data(), out.data_ptr(), n, eb == 4 ? DType::kF32 : DType::kBF16).wait();
  }
  return out;
}

at::Tensor Trainer::master_block(size_t b) { return gathered_copy(Category::kMaster, b, at::kFloat); }
at::Tensor Trainer::grad_block(size_t b) { return gathered_copy(Category::kGrad, b, at::kFloat); }
at::Tensor Trainer::state_block(Category c, size_t b) {
  const int eb = state_->elem_bytes(c);
  const at::ScalarType t = eb == 4 ? at::kFloat : c == Category::kParam16 ? compute_dtype_ : at::kBFloat16;
  return gathered_copy(c, b, t);
}

}  // namespace strata
