// The training step (trainer.h): one step reads top to bottom here; its parts
// are engine/gathered_blocks.h (the uses and their gathered blocks),
// gradient_path.h (gradients into their homes, norms), optimizer_pass.h (the
// optimizer) and state_checkpoints.h (save and load). Start-up and the state
// accessors follow the step.
#include "engine/trainer.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "checkpoint/safetensors.h"
#include "engine/compute_stream.h"
#include "engine/lr_schedule.h"
#include "memory/bound.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"
#include "util/progress.h"
#include "util/trace.h"

namespace strata {

namespace {

at::ScalarType dtype_of(ComputeDtype d) {
  switch (d) {
    case ComputeDtype::kBf16: return at::kBFloat16;
    case ComputeDtype::kFp16: return at::kHalf;
    case ComputeDtype::kFp32: break;
  }
  return at::kFloat;
}

// Leaf copies of weight views that autograd can differentiate with respect to;
// they share storage with the views.
std::vector<at::Tensor> as_leaves(const std::vector<at::Tensor>& views) {
  std::vector<at::Tensor> leaves;
  leaves.reserve(views.size());
  for (const at::Tensor& v : views) leaves.push_back(v.detach().requires_grad_(true));
  return leaves;
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

// The step: every micro-batch's forward and backward (gradients on their way
// to their homes as each block's backward ends), one all-reduce of the norm,
// loss and stop flag, then the optimizer (on its own thread, or inline).
StepResult Trainer::step(const int64_t* tokens, bool stop_requested) {
  if (optimizer_->broken()) {
    throw Error("an earlier step failed part-way through the optimizer; the state is inconsistent "
                "and training cannot continue (restart from a checkpoint)");
  }
  const int64_t accum = cfg_.gradient_accumulation_steps;
  const int64_t micro = cfg_.train_micro_batch_size_per_gpu;
  Communicator& comm = *ctx_.comm;
  const int64_t ranks = comm.world_size();
  // This thread's transfers in this step, plus (below) the gradient path's
  // and those of the optimizer step reported with it.
  LinkBytes moved;
  TieredState::TallyScope tally(&moved);
  ComputeStreamScope on_compute_stream(*ctx_.device);
  const double param_wait0 = blocks_->window().wait_seconds();
  const double opt_wait0 = optimizer_->wait_seconds();
  auto data_sent = [&] { return collectives_ ? collectives_->bytes_sent() : int64_t(0); };
  auto node_sent = [&] { return collectives_ ? collectives_->node_bytes_sent() : int64_t(0); };
  const int64_t node0 = node_sent();
  auto data_wait = [&] { return collectives_ ? collectives_->wait_seconds() : 0.0; };
  const int64_t net0 = comm.bytes_sent() + data_sent();
  const double comm_wait0 = comm.wait_seconds() + data_wait();
  grads_->begin_step();
  activations_->reset();
  for (KeptGraph& g : graphs_) g = KeptGraph();  // a failed step's
  for (at::Tensor& f : flow_) f = at::Tensor();
  blocks_->begin(/*train=*/true);

  // Each micro-batch's loss is scaled by 1 / (accum x ranks): the reduced
  // gradient is then the gradient of the global batch's mean loss. fp16
  // multiplies it by the loss scale too (Note [Loss scaling]).
  const double loss_scale = scaler_ ? scaler_->scale() : 1.0;
  double sums[3] = {0.0, 0.0, stop_requested ? 1.0 : 0.0};  // squared norm, loss, stop
  StepResult r;
  r.lr = learning_rate(cfg_.scheduler, cfg_.optimizer.lr, applied_steps_ + 1);
  // Note [Speculative optimizer]: the update as if the clip coefficient were
  // 1 and nothing overflowed, behind the backward, block by block.
  const bool speculating = speculate_this_step();
  const OptimizerThread::Job speculated{float(1.0 / loss_scale), r.lr, applied_steps_ + 1, Completion(),
                                        OptimizerThread::Kind::kSpeculate};
  if (speculating) optimizer_->speculate(speculated);
  double param_wait = 0.0;
  try {
    sums[1] = run_schedule(tokens, loss_scale / double(accum * ranks));
    param_wait = blocks_->window().wait_seconds() - param_wait0;
    // This rank's squared norm (Note [Gradient path]), the loss and the stop
    // requests: one all-reduce of three numbers.
    sums[0] = grads_->finish_step(&moved);
    {
      TraceSpan span(TraceTrack::kComm, "all_reduce norm, loss, stop");
      comm.all_reduce(sums, 3, DType::kF64, ReduceOp::kSum).wait();
    }
  } catch (...) {
    if (speculating) abandon_speculation(speculated);
    throw;
  }
  r.tokens = accum * micro * cfg_.model.seq_len * ranks;
  r.grad_norm = std::sqrt(sums[0]) / loss_scale;
  r.loss = sums[1];
  r.stop = sums[2] > 0.0;
  auto finish_result = [&] {
    ++step_;
    r.optimizer_wait_s = optimizer_->wait_seconds() - opt_wait0;
    r.wait_s = param_wait + r.optimizer_wait_s;
    r.checkpoint_wait_s = optimizer_->take_checkpoint_wait();
    r.links += moved;
    r.net_bytes = comm.bytes_sent() + data_sent() - net0;
    r.intra_node_bytes = node_sent() - node0;
    r.comm_wait_s = comm.wait_seconds() + data_wait() - comm_wait0;
    return r;
  };
  if (scaler_) {
    // Note [Loss scaling]: the norm is all-reduced, so every rank skips the
    // same steps. The gradients in their homes are overwritten by the next
    // step's first add; nothing else has changed.
    r.loss_scale = loss_scale;
    r.skipped = !std::isfinite(r.grad_norm);
    scaler_->update(r.skipped, step_ + 1);
  }
  if (speculating) {
    settle_speculation(r, speculated);
    return finish_result();
  }
  if (r.skipped) return finish_result();
  apply_optimizer(r, loss_scale);
  return finish_result();
}

// A step failed before its verdict: nothing of the state was written; the
// working copy is put back. Called while an exception is in flight.
void Trainer::abandon_speculation(const OptimizerThread::Job& speculated) {
  grads_->cancel_waits();
  blocks_->invalidate();
  try {
    optimizer_->abandon_speculation(speculated);
  } catch (...) {
    // The optimizer failed too: broken() says so; the step's own error follows.
  }
}

// torch.nn.utils.clip_grad_norm_'s coefficient for `norm` (1 without clipping).
double Trainer::clip_coefficient(double norm) const {
  return cfg_.gradient_clipping > 0.0 ? std::min(1.0, cfg_.gradient_clipping / (norm + 1e-6)) : 1.0;
}

bool Trainer::speculate_this_step() const {
  return optimizer_->speculates() && step_ >= speculation_paused_until_;
}

// Note [Speculative optimizer]: the verdict on a speculated step. The clip
// coefficient and the scale are apply_optimizer's, bit for bit.
void Trainer::settle_speculation(StepResult& r, const OptimizerThread::Job& speculated) {
  try {
    blocks_->invalidate();  // the speculation rewrote the working copy
    ctx_.device->synchronize(Stream::kH2D);  // as apply_optimizer: this step's fetches are done
  } catch (...) {
    abandon_speculation(speculated);
    throw;
  }
  auto report = [&](const OptimizerPass::Report& opt) {
    r.optimizer_s = opt.seconds;
    r.optimizer_hidden_s = opt.speculated_s;
    r.links += opt.links;
  };
  if (!std::isfinite(r.grad_norm)) {
    report(optimizer_->settle(OptimizerPass::Verdict::kRestore, speculated));
    r.speculation = "restored";
    if (r.skipped) return;  // fp16: a skipped step
    optimizer_->finish();
    apply_optimizer(r, 1.0);  // throws: a non-finite norm without a loss scaler
    return;
  }
  const double coef = clip_coefficient(r.grad_norm);
  const double scale = r.loss_scale > 0.0 ? r.loss_scale : 1.0;
  const OptimizerThread::Job job{float(coef / scale), r.lr, applied_steps_ + 1, ctx_.device->record(Stream::kCompute)};
  if (job.grad_scale == speculated.grad_scale) {
    report(optimizer_->settle(OptimizerPass::Verdict::kCommit, job));
    r.speculation = "committed";
    redos_in_a_row_ = 0;
  } else {
    report(optimizer_->settle(OptimizerPass::Verdict::kRedo, job));
    r.speculation = "redone";
    r.redone_elements = optimizer_->speculated_numel();
    if (++redos_in_a_row_ >= kSpeculationRedosToPause && cfg_.optimizer.speculate == Speculate::kAuto) {
      speculation_paused_until_ = step_ + 1 + kSpeculationPauseSteps;
      redos_in_a_row_ = 0;
    }
  }
  ++applied_steps_;
}

// The step's ops in the order of its schedule (Note [Step schedules] in
// memory/schedule.h: micro_batch or layer, the list the parameter window
// prefetches by), each loss scaled by `loss_scale` for the backward; returns
// this rank's share of the global batch's mean loss.
double Trainer::run_schedule(const int64_t* tokens, double loss_scale) {
  const int64_t accum = cfg_.gradient_accumulation_steps;
  const int64_t micro = cfg_.train_micro_batch_size_per_gpu;
  const at::Tensor batch = stage_tokens(tokens, accum * micro);
  double sum = 0.0;
  try {
    for (const StepOp& op : blocks_->train_ops()) run_op(op, batch.narrow(0, op.micro * micro, micro), loss_scale);
    // Read once the backward is queued: on a GPU, .item() waits for it.
    for (at::Tensor& l : micro_loss_) {
      sum += l.item<double>() / double(accum * ctx_.comm->world_size());
      l = at::Tensor();
    }
  } catch (const c10::OutOfMemoryError& e) {
    out_of_memory(e);
  }
  return sum;
}

// One op of the schedule on micro-batch op.micro (`tokens`: its windows).
// flow_[m] carries the micro-batch between ops: the input of its next
// forward, then the gradient of the output of its next backward.
void Trainer::run_op(const StepOp& op, const at::Tensor& tokens, double loss_scale) {
  const int64_t T = cfg_.model.seq_len;
  const size_t b = size_t(op.block[0]);
  at::Tensor& flow = flow_[size_t(op.micro)];
  switch (op.pass) {
    case Pass::kForward:
      flow = forward_block(b, op.micro, b == ctx_.embedding_block ? tokens.narrow(1, 0, T) : flow, /*train=*/true);
      break;
    case Pass::kHead:
      micro_loss_[size_t(op.micro)] = head_forward_backward(flow, tokens.narrow(1, 1, T), loss_scale, op.micro, &flow);
      break;
    case Pass::kBackward:
      flow = block_backward(b, op.micro, flow);
      // The micro-batch's backward is queued: its last reductions complete.
      if (b == ctx_.embedding_block) grads_->end_micro();
      break;
  }
}

// The optimizer step for `r`'s norm and learning rate: global-norm clipping
// folded into it as a gradient scale, with torch.nn.utils.clip_grad_norm_'s
// formula; fp16 unscales in the same multiply.
void Trainer::apply_optimizer(StepResult& r, double loss_scale) {
  if (!std::isfinite(r.grad_norm)) {
    // Stepping would turn every tier's optimizer state into NaN for good. The
    // norm is all-reduced, so every rank stops here.
    throw Error(strprintf("gradient norm is %f at step %lld: the optimizer step was skipped and the "
                          "state is unchanged; lower optimizer.params.lr or enable gradient_clipping",
                          r.grad_norm, (long long)(step_ + 1)));
  }
  const double coef = clip_coefficient(r.grad_norm);
  blocks_->invalidate();  // the optimizer rewrites the working copy
  // CPU Adam rewrites host-tier working copies that fetches of this step
  // read: those copies are done (they are, since the norm's read waited for
  // the backward that used them; this says so).
  ctx_.device->synchronize(Stream::kH2D);
  const OptimizerThread::Job job{float(coef / loss_scale), r.lr, applied_steps_ + 1,
                                 ctx_.device->record(Stream::kCompute)};
  const OptimizerPass::Report opt = optimizer_->step(job);
  r.optimizer_s = opt.seconds;
  r.links = opt.links;
  ++applied_steps_;
}

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
      if (op.pass == Pass::kForward) x = forward_block(size_t(op.block[0]), 0, x, /*train=*/false);
    }
    DevicePtr gathered[2];
    blocks_->next(gathered);
    at::Tensor tied;
    if (cfg_.model.tie_embeddings) tied = weights(ctx_.embedding_block, gathered[1])[0];
    at::Tensor logits = model_.forward(ctx_.head_block, weights(ctx_.head_block, gathered[0]), x, tied);
    total += loss_of(logits, batch.narrow(1, 1, T)).item<double>();
    tied = at::Tensor();
    blocks_->end();
  }
  return total / double(batches);
}

// Waits for the last step's optimizer; the thread's progress is INT64_MAX
// only once it has finished.
void Trainer::finish() { optimizer_->finish(); }

at::Tensor Trainer::stage_tokens(const int64_t* tokens, int64_t rows) {
  const int64_t window = cfg_.model.seq_len + 1;
  const int64_t bytes = rows * window * 8;
  STRATA_CHECK(bytes <= tokens_host_.bytes(), "more token windows than the step's staging");
  Device& dev = *ctx_.device;
  tokens_copied_.wait();  // the host side's previous copy has been read
  std::memcpy(tokens_host_.data(), tokens, size_t(bytes));
  dev.stream_wait(Stream::kH2D, dev.record(Stream::kCompute));  // the compute that read the device side
  dev.copy_to_device(tokens_device_.ptr(), tokens_host_.data(), bytes, Stream::kH2D);
  tokens_copied_ = dev.record(Stream::kH2D);
  dev.stream_wait(Stream::kCompute, tokens_copied_);
  return ctx_.device_tensor(tokens_device_.ptr(), rows * window, at::kLong).view({rows, window});
}

// LibTorch's activations did not fit beside the state: the plan's verdict in
// the same terms, not an allocator's trace.
void Trainer::out_of_memory(const c10::OutOfMemoryError& e) const {
  const DeviceMemoryInfo m = ctx_.device->memory_info();
  std::string torch_line = e.what_without_backtrace();
  torch_line = torch_line.substr(0, torch_line.find('\n'));
  throw OutOfMemoryError(strprintf(
      "%s ran out of memory in the forward/backward of step %lld: the device has %s in all, %s free; Strata's "
      "state and buffers take %s there and the plan estimated %s for activations; lower "
      "train_micro_batch_size_per_gpu, set run.recompute \"always\" or activation_checkpointing.cpu_checkpointing, "
      "%sor move state off the device (strata plan shows the split). LibTorch: %s",
      ctx_.device->name().c_str(), (long long)(step_ + 1), format_bytes(double(m.total_bytes)).c_str(),
      format_bytes(double(m.free_bytes)).c_str(), format_bytes(double(peak_bytes()[0])).c_str(),
      format_bytes(double(state_->plan().activation_bytes)).c_str(),
      // Note [Step schedules]: the layer schedule holds every micro-batch's activations.
      state_->plan().layer_major() && state_->plan().held_micro > 1
          ? strprintf("set run.schedule \"micro_batch\" (the layer schedule holds %lld micro-batches' activations), ",
                      (long long)state_->plan().held_micro).c_str()
          : "",
      torch_line.c_str()));
}

// ---- checkpoints (engine/state_checkpoints.h) ---------------------------------------

void Trainer::begin_checkpoint(const CheckpointOptions& options, Manifest header) {
  checkpoints_->begin(options, std::move(header), TrainerCounters{step_, applied_steps_}, scaler_.get());
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
  const TrainerCounters c = checkpoints_->load(reader, scaler_.get());
  blocks_->invalidate();  // nothing fetched before the load is valid now
  step_ = c.step;
  applied_steps_ = c.optimizer_step;
}

// ---- start-up ---------------------------------------------------------------------

std::string apply_determinism(bool on) {
  if (!on) return "";
  ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  // Not warn_only: LibTorch's attention backwards (cuDNN, flash, memory-
  // efficient) pick their deterministic algorithm only when a
  // non-deterministic op is an error (warn_only left them atomic:
  // BENCHMARKS.md, "GPU, round 2"); an op with no deterministic
  // implementation then stops the run naming itself.
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  at::globalContext().setDeterministicCuDNN(true);
  at::globalContext().setBenchmarkCuDNN(false);
  return std::string("deterministic algorithms on (an op without one is an error), CUBLAS_WORKSPACE_CONFIG=") +
         std::getenv("CUBLAS_WORKSPACE_CONFIG");
}

Trainer::Trainer(const Config& cfg, const Model& model, std::shared_ptr<nvme::FaultPlan> faults,
                 Communicator* comm, int local_ranks, Device* device, StreamCollectives* stream,
                 StreamCollectives* node_stream)
    : cfg_(cfg), model_(model), layout_(model.layout_specs(), shard_count(cfg)) {
  apply_determinism(cfg.run.deterministic);  // strata train has, before its probes; a library user may not have
  make_context(comm, device, stream);
  const cpu_adam::Isa isa = cpu_adam::parse_isa(cfg.run.cpu_adam_isa);
  if (!cpu_adam::isa_supported(isa)) {
    throw ConfigError("run.cpu_adam_isa", std::string(cpu_adam::isa_name(isa)) +
                                              " is not supported by this CPU (best: " +
                                              cpu_adam::isa_name(cpu_adam::best_isa()) + ")");
  }
  MachineCapacity cap;
  // run.rates (filled by strata train's measurements): auto judges its
  // candidates by the step's bound (memory/bound.h).
  const Rates rates = rates_from_config(cfg.run.rates);
  const PlacementPlan plan =
      plan_for_machine(cfg, layout_, &cap, ctx_.comm->rank(), local_ranks, ctx_.device, GivenCapacity{}, &rates);
  agree_on_collectives(plan, node_stream);
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
  so.device = ctx_.device;  // the compute device's memory is the device tier
  state_ = std::make_unique<TieredState>(plan, so);
  ctx_.state = state_.get();
  for (const PlacementUnit& u : plan.units[size_t(Category::kParam16)]) {
    ctx_.shard_offset.push_back(u.offset);
    ctx_.block_end.push_back(u.offset + u.numel);
  }
  int64_t global = 0;
  for (const BlockLayout& bl : layout_.blocks()) {
    ctx_.global_index.push_back(global);
    global += bl.numel;
  }
  // The trace's span names, by pass, block and micro-batch, made once.
  const int64_t A = std::max<int64_t>(cfg.gradient_accumulation_steps, 1);
  for (int pass = 0; pass < 3; ++pass) {
    static const char* const kPass[3] = {"forward", "head forward + backward", "backward"};
    for (const BlockLayout& bl : layout_.blocks()) {
      for (int64_t m = 0; m < A; ++m) {
        span_names_.push_back(strprintf("%s %s mb %lld", kPass[pass], bl.name.c_str(), (long long)m));
      }
    }
  }

  optimizer_ = std::make_unique<OptimizerPass>(ctx_, plan, isa);
  blocks_ = std::make_unique<GatheredBlocks>(ctx_, plan, *optimizer_);
  grads_ = std::make_unique<GradientPath>(ctx_, plan);
  optimizer_->set_gradients(grads_.get());
  checkpoints_ = std::make_unique<StateCheckpoints>(ctx_, *optimizer_);
  activations_ = std::make_unique<ActivationCheckpoints>(
      plan, layout_.num_blocks(), std::vector<int64_t>{cfg.train_micro_batch_size_per_gpu, cfg.model.seq_len, cfg.model.dim},
      ctx_.compute_dtype, state_.get(), blocks_->train_ops());
  keep_graphs_ = plan.keep_graphs;
  graphs_.resize(layout_.num_blocks() * size_t(A));
  micro_loss_.resize(size_t(A));
  flow_.resize(size_t(A));
  tokens_host_ = ctx_.device->allocate_pinned(plan.staging.tokens, "token windows (host)");
  tokens_device_ = ctx_.device->allocate(plan.staging.tokens, "token windows");
  initialise_state(plan);
}

void Trainer::agree_on_collectives(const PlacementPlan& plan, StreamCollectives* node_stream) {
  Communicator& comm = *ctx_.comm;
  if (comm.world_size() <= 1) return;
  // FNV-1a over the choices that decide which collectives run, in 62 bits.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  for (char k : plan.keep_gathered) mix(uint64_t(k));
  mix(plan.reduce_per_step);
  mix(plan.secondary_shard);
  mix(uint64_t(plan.ranks_per_node));
  mix(uint64_t(plan.schedule));  // the order of the reductions and gathers (Note [Step schedules])
  const int64_t mine = int64_t(h >> 2);
  int64_t v[2] = {mine, -mine};
  comm.all_reduce(v, 2, DType::kI64, ReduceOp::kMax).wait();
  if (v[0] != -v[1]) {
    throw ConfigError("comm.keep_gathered",
                      "the ranks planned different collectives from their own free memory (blocks kept gathered, "
                      "comm.gradient_reduction, comm.secondary_shard or run.schedule) or their nodes have different "
                      "numbers of ranks: set comm.keep_gathered to a number, and comm.gradient_reduction, "
                      "comm.secondary_shard and run.schedule to explicit values");
  }
  if (!plan.secondary_shard) return;
  // Note [Secondary shard]: the node's group, in the data group's mode.
  const int per_node = plan.ranks_per_node;
  switch (collectives_->mode()) {
    case DeviceCommMode::kInPlace: {
      DataGroupOptions o;
      o.backend = "gloo";
      collectives_->attach_node_group(comm.open_node_group(o), nullptr, per_node);
      break;
    }
    case DeviceCommMode::kStaged:
      collectives_->attach_node_group(comm.open_node_group(data_options_), nullptr, per_node);
      break;
    case DeviceCommMode::kStream:
      if (node_stream == nullptr) {
        CollectiveGroup& node = *comm.open_node_group(data_options_);
        STRATA_CHECK(node.orders_streams(), "the node's group of a stream's collectives does not order streams");
        own_node_stream_ = stream_collectives_over(node);
        node_stream = own_node_stream_.get();
      }
      collectives_->attach_node_group(nullptr, node_stream, per_node);
      break;
  }
}

// The communicator, the device and what the parts share before the state.
void Trainer::make_context(Communicator* comm, Device* device, StreamCollectives* stream) {
  if (comm == nullptr) {
    own_comm_ = make_local_communicator();
    comm = own_comm_.get();
  }
  STRATA_CHECK(comm->world_size() == cfg_.world_size, "the communicator's world size is not the config's");
  if (device == nullptr) {
    if (cfg_.run.device == DeviceKind::kCpu) {
      device = &cpu_device();
    } else {
      own_device_ = make_device(device_kind_name(cfg_.run.device));
      device = own_device_.get();
    }
  }
  if (comm->world_size() > 1) {
    // Note [Device collectives]: in place, staged over Gloo, or on the comm stream.
    if (device->host_addressable()) {
      collectives_ = std::make_unique<DeviceCollectives>(*device, *comm);
    } else if (stream != nullptr) {
      collectives_ = std::make_unique<DeviceCollectives>(*device, *comm, *stream);
    } else {
      DataGroupOptions o;
      o.backend = cfg_.comm.backend == "auto" ? (device->is_cuda() ? "nccl" : "gloo") : cfg_.comm.backend;
      if (o.backend == "nccl" && !device->is_cuda()) {
        throw ConfigError("comm.backend", "\"nccl\" needs GPU memory, and " + device->name() +
                                              " is not a GPU; use \"gloo\"");
      }
      o.stream = device->native_stream(Stream::kComm);
      o.device_index = device->ordinal();
      data_options_ = o;
      CollectiveGroup& data = *comm->open_data_group(o);
      if (data.orders_streams()) {
        own_stream_ = stream_collectives_over(data);
        collectives_ = std::make_unique<DeviceCollectives>(*device, *comm, *own_stream_);
      } else {
        collectives_ = std::make_unique<DeviceCollectives>(*device, *comm, data);
      }
    }
    log::info("collectives on %s: %s, over %s", device->name().c_str(), device_comm_mode_name(collectives_->mode()),
              collectives_->mode() == DeviceCommMode::kInPlace ? comm->backend() : "the data group");
  }
  ctx_.collectives = collectives_.get();
  ctx_.cfg = &cfg_;
  ctx_.layout = &layout_;
  ctx_.device = device;
  ctx_.comm = comm;
  ctx_.torch_device = torch_device(*device);
  ctx_.compute_dtype = dtype_of(cfg_.run.compute_dtype);
  ctx_.compute_bytes = compute_dtype_bytes(cfg_.run.compute_dtype);
  if (ctx_.compute_dtype == at::kHalf) scaler_ = std::make_unique<LossScaler>(cfg_.fp16);
  for (size_t b = 0; b < model_.num_blocks(); ++b) {
    if (model_.blocks()[b].kind == BlockKind::kEmbedding) ctx_.embedding_block = b;
    if (model_.blocks()[b].kind == BlockKind::kHead) ctx_.head_block = b;
  }
  STRATA_CHECK(ctx_.embedding_block == 0 && ctx_.head_block == model_.num_blocks() - 1,
               "the embedding must be the first block and the head the last");
  ctx_.shards = layout_.world_size();
  ctx_.shard_rank = ctx_.shards > 1 ? comm->rank() : 0;
}

// The optimizer thread and a save in flight go first (the parts' own
// destructors, in reverse order of declaration); device memory is freed
// after them, so nothing queued may still use it.
Trainer::~Trainer() {
  checkpoints_.reset();  // an unfinished save's thread first: it may wait for the optimizer
  optimizer_.reset();
  // Collectives a failed step left queued must not touch the parts' buffers
  // once those are freed (Note [Device collectives]).
  if (collectives_) collectives_->shutdown();
  try {
    for (int s = 0; s < kNumStreams; ++s) ctx_.device->synchronize(Stream(s));
  } catch (...) {
    // A failed device: its error was reported by the call that failed.
  }
}

// Every rank draws every block and keeps its shard; the draws depend on the
// seed and the model's shape alone (Note [Initial weights] in model/model.cc),
// so the same seed gives the same weights whatever the placement, threads or
// world size.
// With model.init_from, the weights come from Hugging Face safetensors
// instead, one block at a time.
constexpr int64_t kInitProgressNumel = int64_t(1) << 30;

void Trainer::initialise_state(const PlacementPlan& plan) {
  std::unique_ptr<SafetensorsSet> hf;
  if (!cfg_.model.init_from.empty()) hf = std::make_unique<SafetensorsSet>(cfg_.model.init_from);
  // Start-up only: host memory for a block's fp32 weights and its working copy
  // (page-aligned for NVMe), registered with the device: copies into HBM from
  // pageable memory are staged by the driver (on the H200 host the weights'
  // writes took about 23 s of (b)'s 50 s start: BENCHMARKS.md, "GPU, round 2").
  const PinnedHostBuffer master_mem =
      ctx_.device->allocate_pinned(plan.largest_block_numel * 4, "initial weights");
  const PinnedHostBuffer working_mem =
      ctx_.device->allocate_pinned(plan.largest_block_numel * ctx_.compute_bytes, "initial working copy");
  // A model of a billion elements or more takes seconds to tens of seconds here.
  std::unique_ptr<ProgressBar> bar;
  if (ctx_.shard_rank == 0 && layout_.total_numel() >= kInitProgressNumel) {
    bar = std::make_unique<ProgressBar>(hf ? "load weights" : "init weights", int64_t(layout_.num_blocks()));
  }
  double draw_s = 0.0;  // for the start line: drawing (or reading) against the rest
  const auto start = std::chrono::steady_clock::now();
  for (size_t b = 0; b < layout_.num_blocks(); ++b) {
    const BlockLayout& bl = layout_.block(b);
    const int64_t n = bl.shard_numel();
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor master = at::from_blob(master_mem.data(), {bl.padded_numel}, at::TensorOptions().dtype(at::kFloat));
    master.zero_();
    if (hf) {
      for (const ParamLayout& p : bl.params) {
        const std::string name = hf_tensor_name(bl.name + "." + p.spec.name);
        if (!hf->has(name)) {
          throw InputError(cfg_.model.init_from, "no tensor " + name + " (Strata's " + bl.name + "." + p.spec.name + ")");
        }
        if (hf->shape(name) != p.spec.shape) {
          throw InputError(hf->file(name), "tensor " + name + " has shape " + shape_text(hf->shape(name)) +
                                               ", but the model (config.json) needs " + shape_text(p.spec.shape));
        }
        hf->read_f32(name, master.data_ptr<float>() + p.offset);
      }
    } else {
      init_block(bl, master, cfg_.run.seed, b);
    }
    draw_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state_->write(Category::kMaster, ctx_.shard_offset[b], n, master.data_ptr<float>() + ctx_.shard_rank * n);
    at::Tensor working =
        at::from_blob(working_mem.data(), {bl.padded_numel}, at::TensorOptions().dtype(ctx_.compute_dtype));
    working.copy_(master);
    state_->write(Category::kParam16, ctx_.shard_offset[b], n,
                  working_mem.data() + ctx_.shard_rank * n * ctx_.compute_bytes);
    if (bar) bar->update(int64_t(b) + 1, bl.name);
  }
  bar.reset();
  const double rest_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() - draw_s;
  if (hf) {
    log::info("initial weights: read in %.1f s, written to their tiers in %.1f s", draw_s, rest_s);
  } else {
    log::info("initial weights: drawn in %.1f s on %d threads, written to their tiers in %.1f s", draw_s,
              at::get_num_threads(), rest_s);
  }
  // Adam moments start at zero; resident homes are zero already, swapped ones
  // are written once so that reading them is valid. The zeros come from the
  // optimizer's exp_avg staging (zero-initialised, `sets` pieces long): a
  // sub-group is written in runs of that size.
  const OptimizerStaging& staging = optimizer_->staging();
  std::byte* zeros = staging.slot(Category::kExpAvg, 0);
  if (zeros == nullptr) return;
  const int64_t run = int64_t(staging.sets()) * staging.piece_numel();
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
  t[0] = state_->device_arena_bytes() + blocks_->window().shape().bytes(ctx_.compute_bytes) +
         blocks_->device_bytes() + grads_->device_bytes() + activations_->device_slot_bytes() + tokens_device_.bytes();
  t[1] = state_->host_arena_bytes() + optimizer_->staging().bytes() + activations_->host_slot_bytes() +
         grads_->host_bytes() + blocks_->window().bounce_bytes() + tokens_host_.bytes() + checkpoints_->host_bytes() +
         (collectives_ ? collectives_->host_bytes() : 0);
  t[2] = state_->swap() != nullptr ? state_->swap()->used_bytes() : 0;
  return t;
}

// Compute uses device-resident weights in place; the others come through the
// window (in place would hide the H2D copy a GPU must make).
// `p`: the block's gathered weights (Note [Gathered blocks]).
std::vector<at::Tensor> Trainer::weights(size_t b, DevicePtr p) {
  STRATA_CHECK(p, "a block neither gathered nor resident on the device");
  return param_views(layout_.block(b), ctx_.device_tensor(p, layout_.block(b).padded_numel, ctx_.compute_dtype));
}

// For tests and export, not the step: a copy through a temporary buffer.
std::vector<at::Tensor> Trainer::block_weights(size_t b) {
  at::Tensor flat = gathered_copy(Category::kParam16, b, ctx_.compute_dtype);
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
  state_->read(c, ctx_.shard_offset[b], n, shard.data());
  at::Tensor out = at::empty({bl.padded_numel}, at::TensorOptions().dtype(dtype));
  STRATA_CHECK(int64_t(out.element_size()) == eb, "dtype does not match the category's element size");
  if (ctx_.shards == 1) {
    std::memcpy(out.data_ptr(), shard.data(), size_t(n * eb));
  } else {
    ctx_.comm->all_gather(shard.data(), out.data_ptr(), n, eb == 4 ? DType::kF32 : DType::kBF16).wait();
  }
  return out;
}

at::Tensor Trainer::master_block(size_t b) { return gathered_copy(Category::kMaster, b, at::kFloat); }
at::Tensor Trainer::grad_block(size_t b) { return gathered_copy(Category::kGrad, b, at::kFloat); }
at::Tensor Trainer::state_block(Category c, size_t b) {
  const int eb = state_->elem_bytes(c);
  const at::ScalarType t = eb == 4 ? at::kFloat : c == Category::kParam16 ? ctx_.compute_dtype : at::kBFloat16;
  return gathered_copy(c, b, t);
}

}  // namespace strata
