// The gradient path between ranks (Note [Gradient path] in gradient_path.h):
// gradients summed in a stage and reduced while the next block's backward runs.
#include "engine/gradient_path.h"

#include <algorithm>

#include "cpu_adam/grad_ops.h"
#include "util/errors.h"
#include "util/trace.h"

namespace strata {

// ---- ranks ------------------------------------------------------------------------

// G summed in fp32 and reduced while the next block's backward runs (Note
// [Gathered blocks] in trainer.h): each micro-batch's in a stage, or with
// CommPlan::reduce_per_step the step's sum, kept per block in the
// whole-model buffer, reduced on the last micro-batch.
void GradientPath::add_to_reduce(size_t b, const std::vector<at::Tensor>& grads, size_t first) {
  if (!accum_flat_.empty()) {
    if (first_micro_) accum_flat_[b].zero_();
    sum_into(accum_views_[b], b, grads, first);
    if (!last_micro_) return;
    const int k = turn_;
    complete_reduction(k);  // the shard slot's previous block is delivered
    stage_free();
    reduce(k, b, accum_flat_[b]);
    return;
  }
  if (sums_each_block_) {
    // Note [Step schedules]: the block's micro-batches summed in a stage, in
    // order, as per_step sums them in its whole-model buffer; reduced once.
    if (first_micro_) {
      sum_turn_ = turn_;
      complete_reduction(sum_turn_);  // the stage's previous block is reduced
      stage_free();
      stage_flat_[sum_turn_][b].zero_();
    }
    sum_into(stage_views_[sum_turn_][b], b, grads, first);
    if (last_micro_) reduce(sum_turn_, b, stage_flat_[sum_turn_][b]);
    return;
  }
  const int k = turn_;
  complete_reduction(k);  // the stage's previous block is reduced
  stage_free();
  const at::Tensor& stage = stage_flat_[k][b];
  stage.zero_();
  sum_into(stage_views_[k][b], b, grads, first);
  reduce(k, b, stage);
}

// dst += the head's share of the tied embedding (first, as autograd would
// sum it) and block b's gradients.
void GradientPath::sum_into(const std::vector<at::Tensor>& dst, size_t b, const std::vector<at::Tensor>& grads,
                            size_t first) {
  if (b == ctx_.embedding_block && tied_.defined()) {
    dst[0].add_(tied_);
    tied_ = at::Tensor();
  }
  for (size_t i = 0; i < dst.size() && first + i < grads.size(); ++i) {
    const at::Tensor& g = grads[first + i];
    if (g.defined()) dst[i].add_(g);
  }
}

// Issues block b's reduction from `stage` (its fp32 sum) with slot k's shard.
void GradientPath::reduce(int k, size_t b, const at::Tensor& stage) {
  const DevicePtr full(static_cast<std::byte*>(stage.data_ptr()));
  const int64_t n = ctx_.shard_numel(b);
  Reduction& r = reduction_[k];
  r.block = int(b);
  r.last = last_micro_;
  // communication_data_type: the reductions carry the stage rounded to 16 bits.
  const bool narrow = comm16_.bytes() > 0;
  DevicePtr send = full;
  DType t = DType::kF32;
  if (narrow) {
    comm_flat_[k][b].copy_(stage);
    send = DevicePtr(static_cast<std::byte*>(comm_flat_[k][b].data_ptr()));
    t = comm_type_ == at::kHalf ? DType::kF16 : DType::kBF16;
  }
  if (reduce_scatter_) {
    const DevicePtr shard = shards_mem_.ptr() + int64_t(k) * largest_shard_numel_ * 4;
    r.wire = narrow ? comm_shard_[k] : shard;
    r.done = ctx_.collectives->reduce_scatter(send, r.wire, n, t);
    r.shard = shard;
  } else {
    r.done = ctx_.collectives->all_reduce(send, ctx_.layout->block(b).padded_numel, t);
    r.shard = full + ctx_.shard_rank * n * 4;
    r.wire = send + ctx_.shard_rank * n * dtype_bytes(t);
  }
  seq_[k] = ++issued_;
  turn_ = 1 - k;
}

void GradientPath::complete_reduction(int k) {
  Reduction& r = reduction_[k];
  if (r.block < 0) return;
  {
    // Its readers (the add into a device home, the D2H to a host one) are
    // queued after the compute stream's wait (Note [Device collectives]).
    TraceSpan span(TraceTrack::kComm, "wait gradient reduction");
    ctx_.device->stream_wait(Stream::kCompute, r.done);
    r.done = Completion();
  }
  const size_t b = size_t(r.block);
  const bool last = r.last;
  r.block = -1;
  if (!(r.wire == r.shard)) {
    const int64_t n = ctx_.shard_numel(b);
    ctx_.device_tensor(r.shard, n, at::kFloat).copy_(ctx_.device_tensor(r.wire, n, comm_type_));
  }
  deliver(b, r.shard, last);
}

void GradientPath::deliver(size_t b, DevicePtr src, bool last) {
  if (!home_on_device_[b]) {
    land(b, src, cpu_adam::GradType::kF32, last);
    return;
  }
  const int64_t n = ctx_.shard_numel(b);
  const DevicePtr home = ctx_.state->resident_on_device(Category::kGrad, ctx_.shard_offset[b], n);
  at::Tensor h = ctx_.device_tensor(home, n, at::kFloat);
  const at::Tensor s = ctx_.device_tensor(src, n, at::kFloat);
  if (!written_[b]) {
    h.copy_(s);
  } else {
    h.add_(s);
  }
  written_[b] = 1;
  if (last) {
    device_norm(b, home);
    if (track_finals_) mark_final(b, ctx_.device->record(Stream::kCompute));
  }
}

}  // namespace strata
