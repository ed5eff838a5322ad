// The training step (trainer.h): one step reads top to bottom here; its parts
// are engine/gathered_blocks.h (the uses and their gathered blocks),
// gradient_path.h (gradients into their homes, norms), optimizer_pass.h (the
// optimizer) and state_checkpoints.h (save and load); a block's ops are in
// block_ops.cc, start-up in trainer_setup.cc, checkpoints and the state
// accessors in trainer_state.cc.
#include "engine/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/compute_stream.h"
#include "engine/lr_schedule.h"
#include "util/errors.h"
#include "util/logging.h"
#include "util/trace.h"

namespace strata {


// The figures a step reports as differences (its waits, the bytes it sent):
// read when the step begins, differenced into its result by fill().
class StepCounters {
 public:
  StepCounters(const GatheredBlocks& blocks, const OptimizerPass& optimizer, const Communicator& comm,
               const DeviceCollectives* collectives)
      : blocks_(blocks), optimizer_(optimizer), comm_(comm), collectives_(collectives),
        param_wait0_(blocks.window_wait_seconds()), opt_wait0_(optimizer.wait_seconds()), net0_(net_sent()),
        node0_(node_sent()), comm_wait0_(comm_wait()) {}

  // The parameter windows' wait so far (read once the backward is queued).
  double param_wait() const { return blocks_.window_wait_seconds() - param_wait0_; }

  void fill(StepResult& r, double param_wait) const {
    r.optimizer_wait_s = optimizer_.wait_seconds() - opt_wait0_;
    r.wait_s = param_wait + r.optimizer_wait_s;
    r.net_bytes = net_sent() - net0_;
    r.intra_node_bytes = node_sent() - node0_;
    r.comm_wait_s = comm_wait() - comm_wait0_;
  }

 private:
  int64_t net_sent() const { return comm_.bytes_sent() + (collectives_ ? collectives_->bytes_sent() : 0); }
  int64_t node_sent() const { return collectives_ ? collectives_->node_bytes_sent() : 0; }
  double comm_wait() const { return comm_.wait_seconds() + (collectives_ ? collectives_->wait_seconds() : 0.0); }

  const GatheredBlocks& blocks_;
  const OptimizerPass& optimizer_;
  const Communicator& comm_;
  const DeviceCollectives* collectives_;
  const double param_wait0_, opt_wait0_;
  const int64_t net0_, node0_;
  const double comm_wait0_;
};

// The step: every micro-batch's forward and backward (gradients on their way
// to their homes as each block's backward ends), one all-reduce of the norm,
// loss and stop flag, then the optimizer (on its own thread, or inline).
StepResult Trainer::step(const int64_t* tokens, bool stop_requested, int64_t counted) {
  if (optimizer_->broken()) {
    throw Error("an earlier step failed part-way through the optimizer; the state is inconsistent "
                "and training cannot continue (restart from a checkpoint)");
  }
  // This thread's transfers in this step, plus (below) the gradient path's
  // and those of the optimizer step reported with it.
  LinkBytes moved;
  TieredState::TallyScope tally(&moved);
  ComputeStreamScope on_compute_stream(*ctx_.device);
  const StepCounters counters(*blocks_, *optimizer_, *ctx_.comm, collectives_.get());
  begin_step();
  counted_ = counted;
  // fp16 multiplies each loss by the loss scale (Note [Loss scaling]).
  const double loss_scale = scaler_ ? scaler_->scale() : 1.0;
  StepResult r;
  r.lr = learning_rate(cfg_.scheduler, cfg_.optimizer.lr, applied_steps_ + 1);
  // Note [Speculative optimizer]: the update as if the clip coefficient were
  // 1 and nothing overflowed, behind the backward, block by block.
  const bool speculating = speculation_.speculates(step_);
  const OptimizerThread::Job speculated{float(1.0 / loss_scale), r.lr, applied_steps_ + 1, Completion(),
                                        OptimizerThread::Kind::kSpeculate};
  if (speculating) optimizer_->speculate(speculated);
  double param_wait = 0.0;
  try {
    forward_backward(tokens, loss_scale, stop_requested, r, moved, counters, param_wait);
  } catch (...) {
    if (speculating) abandon_speculation(speculated);
    throw;
  }
  if (scaler_) skip_on_overflow(r, loss_scale);
  if (speculating) {
    settle_speculation(r, speculated);
  } else if (!r.skipped) {
    apply_optimizer(r, loss_scale);
  }
  ++step_;
  counters.fill(r, param_wait);
  r.checkpoint_wait_s = optimizer_->take_checkpoint_wait();
  r.links += moved;
  return r;
}

// Note [Loss scaling]: the norm is all-reduced, so every rank skips the same
// steps. The gradients in their homes are overwritten by the next step's
// first add; nothing else has changed.
void Trainer::skip_on_overflow(StepResult& r, double loss_scale) {
  r.loss_scale = loss_scale;
  r.skipped = !std::isfinite(r.grad_norm);
  scaler_->update(r.skipped, step_ + 1);
}

// What a step starts from: no gradient, activation, kept entry or flow of a
// failed step's left; the blocks' uses from the top.
void Trainer::begin_step() {
  grads_->begin_step();
  activations_->reset();
  for (auto& r : attn_rng_) r = {};  // a failed step's
  for (at::Tensor& f : flow_) f = at::Tensor();
  for (MoeTally& t : moe_tally_) {
    t.selected.zero_();
    t.prob_sum.zero_();
    t.rows = 0;
  }
  for (at::Tensor& a : aux_grad_) a = at::Tensor();
  if (expert_load_.defined()) expert_load_.zero_();
  blocks_->begin(/*train=*/true);
}

// The step's forward and backward (the parameter window's wait in
// `param_wait`), then one all-reduce of this rank's squared norm (Note
// [Gradient path]), loss and stop request: r's tokens, norm, loss and stop.
void Trainer::forward_backward(const int64_t* tokens, double loss_scale, bool stop_requested, StepResult& r,
                               LinkBytes& moved, const StepCounters& counters, double& param_wait) {
  const int64_t accum = cfg_.gradient_accumulation_steps;
  const int64_t ranks = ctx_.comm->world_size();
  // Each micro-batch's loss is scaled by 1 / (accum x ranks): the reduced
  // gradient is then the gradient of the global batch's mean loss. With
  // counted targets (Note [Counted tokens]) each micro-batch's loss is
  // already its sum over the global count: the reduced gradient is that of
  // the global batch's loss over its counted targets.
  double sums[4] = {0.0, 0.0, stop_requested ? 1.0 : 0.0, 0.0};  // squared norm, loss, stop, aux loss
  // Note [Load balancing]: each micro-batch's load-balancing loss weighs
  // 1 / (accum x ranks), with or without counted targets.
  const MoeConfig& moe = cfg_.model.moe;
  aux_scale_ = moe.output_router_logits ? moe.router_aux_loss_coef * loss_scale / double(accum * ranks) : 0.0;
  sums[1] = run_schedule(tokens, counted_ >= 0 ? loss_scale : loss_scale / double(accum * ranks));
  for (at::Tensor& a : aux_loss_) {
    sums[3] += a.item<double>() / double(accum * ranks);
    a = at::Tensor();
  }
  if (expert_load_.defined()) {
    expert_load_host_.copy_(expert_load_);
    ctx_.comm->all_reduce(expert_load_host_.data_ptr<double>(), expert_load_host_.numel(), DType::kF64, ReduceOp::kSum)
        .wait();
  }
  param_wait = counters.param_wait();
  sums[0] = grads_->finish_step(&moved);
  {
    TraceSpan span(TraceTrack::kComm, "all_reduce norm, loss, stop");
    // (An MoE model's aux loss the fourth: plan.step_sums, counted in the plan's network bytes.)
    ctx_.comm->all_reduce(sums, expert_load_.defined() ? 4 : 3, DType::kF64, ReduceOp::kSum).wait();
  }
  if (expert_load_.defined()) {
    r.aux_loss = sums[3];
    const int64_t E = expert_load_host_.size(1);
    for (int64_t l = 0; l < expert_load_host_.size(0); ++l) {
      const double* row = expert_load_host_.data_ptr<double>() + l * E;
      double total = 0.0, most = 0.0;
      for (int64_t e = 0; e < E; ++e) total += row[e], most = std::max(most, row[e]);
      r.expert_load.push_back(total > 0.0 ? most / (total / double(E)) : 0.0);
    }
  }
  r.tokens = accum * cfg_.train_micro_batch_size_per_gpu * cfg_.model.seq_len * ranks;
  r.counted_tokens = counted_ >= 0 ? counted_ : r.tokens;
  r.grad_norm = std::sqrt(sums[0]) / loss_scale;
  r.loss = sums[1];
  r.stop = sums[2] > 0.0;
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
    speculation_.committed();
  } else {
    report(optimizer_->settle(OptimizerPass::Verdict::kRedo, job));
    r.speculation = "redone";
    r.redone_elements = optimizer_->speculated_numel();
    speculation_.redone(step_);
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
      // (Counted targets: each loss is already over the global count.)
      sum += counted_ >= 0 ? l.item<double>() : l.item<double>() / double(accum * ctx_.comm->world_size());
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
  const size_t b = size_t(op.block[0]);
  at::Tensor& flow = flow_[size_t(op.micro)];
  switch (op.pass) {
    case Pass::kForward:
      flow = forward_block(b, op.micro, b == ctx_.embedding_block ? inputs_of(tokens) : flow, /*train=*/true);
      break;
    case Pass::kHead:
      if (!moe_tally_.empty()) finish_aux(op.micro);
      micro_loss_[size_t(op.micro)] = head_forward_backward(flow, targets_of(tokens, counted_ >= 0), loss_scale, op.micro, &flow);
      break;
    case Pass::kBackward:
      flow = block_backward(b, op.micro, flow);
      // The micro-batch's backward is queued: its last reductions complete.
      if (b == ctx_.embedding_block) grads_->end_micro();
      break;
  }
}

// Note [Load balancing] (model/experts.cc): every layer's forward of
// micro-batch m has added its statistics; its load-balancing loss, and the
// gradient its backward takes per router probability, E f_e / rows times
// the coefficient and scale.
void Trainer::finish_aux(int64_t m) {
  MoeTally& t = moe_tally_[size_t(m)];
  const double rows = double(std::max<int64_t>(t.rows, 1));
  const double E = double(cfg_.model.moe.num_experts);
  const at::Tensor f = t.selected / rows;
  aux_loss_[size_t(m)] = (f * (t.prob_sum / rows)).sum() * E;
  if (aux_scale_ != 0.0) aux_grad_[size_t(m)] = f * (aux_scale_ * E / rows);
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
      format_bytes(double(state_->plan().activations.bytes)).c_str(),
      // Note [Step schedules]: the layer schedule holds every micro-batch's activations.
      state_->plan().step.held_micro > 1
          ? strprintf("set run.schedule \"micro_batch\" (the layer schedule holds %lld micro-batches' activations), ",
                      (long long)state_->plan().step.held_micro).c_str()
          : "",
      torch_line.c_str()));
}

}  // namespace strata
