// The optimizer behind the backward (Note [Speculative optimizer] in
// optimizer_pass.h): a piece's speculative pass and its restore, and the
// pass's speculation from the trainer's side (start, verdict, abandon, the
// waits of the blocks it updates). The rest of the pass is optimizer_pass.cc.
#include "engine/optimizer/optimizer_pass.h"

#include <algorithm>
#include <cstring>

#include "util/errors.h"
#include "util/trace.h"

namespace strata {

// Note [Speculative optimizer], pass 1: once the gradients of piece j's
// blocks are final, the step's new working copy, the state read only (in
// scratch: CpuAdam::step_keeping_state, where some of it is resident; on the
// staged copies, which are then dropped, where none is).
void OptimizerPass::speculate_piece(size_t j, const OptimizerThread::Job& job, const cpu_adam::AdamParams& h) {
  OptSet& sp = sets_[size_t(set_of_[j])];
  const PlacementUnit& g = pieces_[j];
  // A device-side read of the gradient goes after the completion of the
  // block that became final last: the piece's lowest (the backward runs
  // down; runs are in ascending block order, so walk them in reverse). One
  // stream records them all, so the latest covers the others. (The test
  // device's compute completions fire at once: only a GPU shows this order.)
  Completion after;
  {
    TraceSpan span(TraceTrack::kAdam, "wait for final gradients");
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<AdamRun>& runs = piece_runs_[j];
    for (auto run = runs.rbegin(); run != runs.rend(); ++run) {
      Completion c;
      if (!gradients_->wait_final(size_t(run->block), &c)) throw Abandoned();
      after = c;
    }
    speculation_waited_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  TieredState& state = *ctx_.state;
  std::byte* grad = state.resident(Category::kGrad, g.offset, g.numel);
  if (grad == nullptr) {
    grad = staging_->slot(Category::kGrad, set_of_[j]);
    STRATA_CHECK(grad != nullptr, "optimizer staging without a gradient slot");
    TraceSpan span(TraceTrack::kAdam, "read the final gradient");
    state.read_async(Category::kGrad, g.offset, g.numel, grad, grad_read_, &after).wait();
  }
  sp.adam.grad = grad;
  int64_t lowest = INT64_MAX;
  for (const AdamRun& run : piece_runs_[j]) lowest = std::min<int64_t>(lowest, run.block);
  reached_block_.store(lowest, std::memory_order_release);
  const int64_t moment_bytes = ctx_.state->elem_bytes(Category::kExpAvg);
  const bool fp32 = ctx_.param_dtype == at::kFloat;
  TraceSpan span(TraceTrack::kAdam, speculate_names_[j].c_str());
  for (const AdamRun& run : piece_runs_[j]) {
    const cpu_adam::AdamSpans part = run_part(sp.adam, run.start, run.numel, moment_bytes, ctx_.param_bytes);
    const cpu_adam::StepArgs args{job.step, job.grad_scale, run.key};
    if (sp.keeps_state) {
      adam_->step_keeping_state(h, args, part, fp32 ? reinterpret_cast<float*>(sp.working) + run.start : nullptr);
    } else {
      adam_->step(h, args, part);  // staged copies: dropped afterwards
      if (fp32) std::memcpy(reinterpret_cast<float*>(sp.working) + run.start, part.param, size_t(run.numel) * 4);
    }
  }
}

// Note [Speculative optimizer], a skipped step: piece j's working copy from
// its (unchanged) master weights, rounded as start-up and checkpoint loads
// round them.
void OptimizerPass::restore_piece(size_t j) {
  const OptSet& sp = sets_[size_t(set_of_[j])];
  const int64_t n = pieces_[j].numel;
  TraceSpan span(TraceTrack::kAdam, "restore the working copy");
  if (ctx_.param_dtype == at::kFloat) {
    std::memcpy(sp.working, sp.adam.param, size_t(n) * 4);
  } else {
    adam_->convert(sp.adam.param, sp.working, sp.adam.emit_type, n);
  }
}

void OptimizerPass::speculate(const OptimizerThread::Job& job) {
  STRATA_CHECK(thread_ && speculates_ && gradients_ != nullptr, "speculation without its thread or gradients");
  OptimizerThread::Job j = job;
  j.kind = OptimizerThread::Kind::kSpeculate;
  reached_block_.store(INT64_MAX, std::memory_order_release);  // this step's speculation has begun nothing
  thread_->queue(j);
}

OptimizerPass::Report OptimizerPass::settle(Verdict verdict, const OptimizerThread::Job& job) {
  finish();  // the speculation has ended (and the commit before it)
  Report r = thread_->take_report();
  // The speculation's seconds without its waits for gradients (the backward's).
  r.seconds -= speculation_waited_s_;
  r.speculated_s = std::max(0.0, r.speculated_s - speculation_waited_s_);
  speculation_waited_s_ = 0.0;
  OptimizerThread::Job j = job;
  try {
    switch (verdict) {
      case Verdict::kCommit:
        launch_device_pieces(job);
        j.kind = OptimizerThread::Kind::kCommit;
        break;
      case Verdict::kRedo: j.kind = OptimizerThread::Kind::kFull; break;
      case Verdict::kRestore: j.kind = OptimizerThread::Kind::kRestore; break;
    }
  } catch (...) {
    broken_ = true;  // some device pieces may be updated, the others not
    throw;
  }
  thread_->start(j);
  return r;
}

void OptimizerPass::abandon_speculation(const OptimizerThread::Job& job) {
  finish();  // the speculation stops at its next wait for a gradient
  speculation_waited_s_ = 0.0;
  OptimizerThread::Job j = job;
  j.kind = OptimizerThread::Kind::kRestore;
  thread_->start(j);
  finish();
}

void OptimizerPass::wait_committed(int64_t offset) {
  if (!thread_) return;
  try {
    thread_->wait_low(offset, &wait_s_);
  } catch (...) {
    broken_ = true;
    throw;
  }
}

}  // namespace strata
