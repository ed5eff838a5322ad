// Uses of a schedule and their gathered blocks (gathered_blocks.h).
#include "engine/gathered_blocks.h"

#include <algorithm>
#include <climits>

#include "util/errors.h"
#include "util/logging.h"
#include "util/trace.h"

namespace strata {

GatheredBlocks::GatheredBlocks(const StepContext& ctx, const PlacementPlan& plan, OptimizerPass& optimizer)
    : ctx_(ctx), optimizer_(optimizer), gather_once_(ctx.shards > 1 && ctx.cfg->zero.stage < 3),
      per_use_(plan.tied ? 2 : 1),
      largest_block_numel_(plan.largest_block_numel) {
  const StagingNeeds& need = plan.staging;
  const int blocks = int(ctx.layout->num_blocks());
  window_ = make_param_window(plan);
  window_->attach(ctx.state, need.window, plan.state.elem_bytes[size_t(Category::kParam16)], Category::kParam16,
                  need.window_bounce);
  frozen_window_ = make_frozen_window(plan);
  if (frozen_window_) {
    frozen_window_->attach(ctx.state, need.frozen_window, plan.state.elem_bytes[size_t(Category::kFrozen)],
                           Category::kFrozen, need.frozen_window_bounce);
    frozen_window_->set_ready(INT32_MAX);  // nothing updates frozen values
    // Note [Frozen shards].
    frozen_sharded_ = plan.frozen_shards > 1;
    STRATA_CHECK(!frozen_sharded_ || (ctx.shards == plan.frozen_shards && !gather_once_),
                 "a frozen space sharded outside stage 3");
    for (const BlockLayout& bl : ctx.layout->blocks()) {
      largest_frozen_numel_ = std::max(largest_frozen_numel_, bl.frozen_padded_numel);
    }
    if (frozen_sharded_) {
      STRATA_CHECK(need.frozen_gather == 2 * per_use_ * largest_frozen_numel_ * ctx.compute_bytes,
                   "the frozen parts' ring is not the planned size");
      frozen_gather_mem_ = ctx.device->allocate(need.frozen_gather, "gathered frozen parts");
    }
  }
  train_schedule_ = plan_train_schedule(plan);
  eval_schedule_ = eval_schedule(blocks, plan.tied);
  train_ring_slot_ = ring_slots(train_schedule_);
  eval_ring_slot_ = ring_slots(eval_schedule_);
  if (need.gathered > 0) {
    log::info("parameter window: %d slot(s) of %s, %s of persistent blocks", need.window.slots,
              format_bytes(double(need.window.slot_numel * ctx.param_bytes)).c_str(),
              format_bytes(double(need.window.persistent_numel * ctx.param_bytes)).c_str());
  }
  if (need.gather > 0) gather_mem_ = ctx.device->allocate(need.gather, "gathered blocks");
  gathered_valid_.assign(size_t(blocks), 0);
  kept_at_.assign(size_t(blocks), -1);
  if (!gather_once_ && ctx.shards > 1) {
    int64_t at = 2 * per_use_ * largest_block_numel_ * ctx.param_bytes;  // after the ring
    for (size_t b = 0; b < plan.comm.keep_gathered.size(); ++b) {
      if (!plan.comm.keep_gathered[b]) continue;
      kept_at_[b] = at;
      at += ctx.layout->block(b).padded_numel * ctx.param_bytes;
    }
    STRATA_CHECK(at <= need.gather, "blocks kept gathered beyond the planned buffer");
    if (plan.comm.kept_gathered_numel > 0) {
      log::info("%s of gathered blocks kept for the step (comm.keep_gathered)",
                format_bytes(double(plan.comm.kept_gathered_numel * ctx.param_bytes)).c_str());
    }
  }
  secondary_valid_.assign(size_t(blocks), 0);
  secondary_at_.assign(size_t(blocks), -1);
  if (plan.comm.secondary_shard) {
    // Note [Secondary shard].
    STRATA_CHECK(!gather_once_ && ctx.shards > 1 && plan.nodes() > 1, "a secondary shard outside stage 3 on nodes");
    secondary_ = true;
    node_ranks_ = plan.ranks_per_node;
    local_rank_ = ctx.comm->rank() % node_ranks_;
    int64_t at = 0;
    for (size_t b = 0; b < size_t(blocks); ++b) {
      if (kept_at_[b] >= 0) continue;
      secondary_at_[b] = at;
      at += ctx.shard_numel(b) * plan.nodes() * ctx.param_bytes;
    }
    STRATA_CHECK(at == need.secondary, "the secondary shard is not the planned size");
    secondary_mem_ = ctx.device->allocate(need.secondary, "secondary shard");
    log::info("secondary shard of %s: a block's later gathers of a step stay inside the node of %d ranks "
              "(comm.secondary_shard)",
              format_bytes(double(need.secondary)).c_str(), node_ranks_);
  }
}

GatheredBlocks::~GatheredBlocks() = default;

bool GatheredBlocks::repeats(const std::vector<StepOp>& ops, size_t u) {
  return u > 0 && ops[u].count == ops[u - 1].count && ops[u].block[0] == ops[u - 1].block[0] &&
         ops[u].block[1] == ops[u - 1].block[1];
}

// The ring slot of each use: uses alternate between the two slots, except
// that a use repeating the one before it (same blocks) shares its slot and
// its gathered copy.
std::vector<int> GatheredBlocks::ring_slots(const std::vector<StepOp>& ops) {
  std::vector<int> slot(ops.size(), 0);
  for (size_t u = 1; u < ops.size(); ++u) slot[u] = repeats(ops, u) ? slot[u - 1] : 1 - slot[u - 1];
  return slot;
}

void GatheredBlocks::begin(bool train) {
  // A failed pass may have left gathers in flight: their buffers are reused.
  for (auto& slot : gather_done_) for (Completion& c : slot) c.wait();
  for (auto& slot : frozen_done_) for (Completion& c : slot) c.wait();
  // ...and secondary shards whose copy it never queued: gathered again.
  for (auto& slot : fill_) for (int64_t& b : slot) b = -1;
  uses_ = train ? &train_schedule_ : &eval_schedule_;
  ring_slot_ = train ? &train_ring_slot_ : &eval_ring_slot_;
  if (!train) window_->set_ready(INT32_MAX);
  else window_->set_ready(ready_blocks());
  window_->begin(uses_);
  if (frozen_window_) frozen_window_->begin(uses_);
  use_ = 0;
  use_issued_ = false;
}

void GatheredBlocks::invalidate() {
  window_->invalidate();
  std::fill(gathered_valid_.begin(), gathered_valid_.end(), 0);
  std::fill(secondary_valid_.begin(), secondary_valid_.end(), 0);
}

// Acquires use u's shards from the window and starts gathering them; a use
// of the blocks the use before it had (the layer schedule's next
// micro-batch) reads that use's gathered copy in the same ring slot.
void GatheredBlocks::issue_gather(size_t u) {
  const StepOp& use = (*uses_)[u];
  DevicePtr shard[2], frozen_shard[2];
  acquire(shard, size_t(use.block[0]), use.count > 1 ? size_t(use.block[1]) : SIZE_MAX);
  if (frozen_sharded_) frozen_window_->acquire(frozen_shard);
  const int slot = (*ring_slot_)[u];
  if (u > 0 && repeats(*uses_, u)) return;  // gathered_[slot] holds them: nothing to issue
  if (frozen_sharded_) issue_frozen_gather(use, slot, frozen_shard);
  const DType dt = ctx_.param_dtype == at::kFloat ? DType::kF32 : DType::kBF16;
  for (int i = 0; i < use.count; ++i) {
    const size_t b = size_t(use.block[i]);
    const int64_t n = ctx_.shard_numel(b);
    fill_[slot][i] = -1;
    if (n == 0) {  // a block with no trained part (a frozen embedding): nothing to gather
      gathered_[slot][i] = DevicePtr();
      continue;
    }
    const DevicePtr src =
        shard[i] ? shard[i] : ctx_.state->resident_on_device(Category::kParam16, ctx_.shard_offset[b], n);
    STRATA_CHECK(src, "a block neither fetched nor resident on the device");
    if (gather_once_ || kept_at_[b] >= 0) {
      // Gathered once per step (stages 1-2, or kept at stage 3) until invalidate().
      gathered_[slot][i] = gather_mem_.ptr() + (gather_once_ ? ctx_.layout->block(b).offset * ctx_.param_bytes
                                                             : kept_at_[b]);
      if (gathered_valid_[b]) continue;
    } else {
      // The ring: two uses of per_use_ blocks (StagingNeeds::gather).
      gathered_[slot][i] = gather_mem_.ptr() + int64_t(slot * per_use_ + i) * largest_block_numel_ * ctx_.param_bytes;
    }
    if (secondary_at_[b] >= 0 && secondary_valid_[b]) {
      // Note [Secondary shard]: inside the node.
      TraceSpan span(TraceTrack::kComm, "node all_gather");
      gather_done_[slot][i] = ctx_.collectives->node_all_gather(secondary_mem_.ptr() + secondary_at_[b],
                                                                gathered_[slot][i], n * (ctx_.shards / node_ranks_), dt);
      continue;
    }
    TraceSpan span(TraceTrack::kComm, "all_gather");
    gather_done_[slot][i] = ctx_.collectives->all_gather(src, gathered_[slot][i], n, dt);
    if (gather_once_ || kept_at_[b] >= 0) gathered_valid_[b] = 1;  // once issued
    if (secondary_at_[b] >= 0) fill_[slot][i] = int64_t(b);  // copied once it has landed (next())
  }
}

// Note [State kinds]: use u's frozen parts from their own window, in place
// (fetched or resident).
void GatheredBlocks::frozen_in_place(const StepOp& use, DevicePtr frozen[2]) {
  frozen_window_->acquire(frozen);
  for (int i = 0; i < use.count; ++i) {
    const size_t b = size_t(use.block[i]);
    const int64_t n = ctx_.layout->block(b).frozen_shard_numel();
    if (!frozen[i] && n > 0) frozen[i] = ctx_.state->resident_on_device(Category::kFrozen, ctx_.frozen_offset[b], n);
  }
}

// Note [Frozen shards]: the frozen parts' all-gathers into their ring slot.
void GatheredBlocks::issue_frozen_gather(const StepOp& use, int slot, const DevicePtr shard[2]) {
  const DType dt = ctx_.compute_dtype == at::kFloat ? DType::kF32 : DType::kBF16;  // (2 bytes moved as 2 bytes)
  for (int i = 0; i < use.count; ++i) {
    const size_t b = size_t(use.block[i]);
    const int64_t n = ctx_.layout->block(b).frozen_shard_numel();
    frozen_gathered_[slot][i] = DevicePtr();
    if (n == 0) continue;
    const DevicePtr src = shard[i] ? shard[i] : ctx_.state->resident_on_device(Category::kFrozen, ctx_.frozen_offset[b], n);
    STRATA_CHECK(src, "a frozen part neither fetched nor resident on the device");
    frozen_gathered_[slot][i] =
        frozen_gather_mem_.ptr() + int64_t(slot * per_use_ + i) * largest_frozen_numel_ * ctx_.compute_bytes;
    TraceSpan span(TraceTrack::kComm, "all_gather frozen");
    frozen_done_[slot][i] = ctx_.collectives->all_gather(src, frozen_gathered_[slot][i], n, dt);
  }
}

void GatheredBlocks::next(DevicePtr out[2], DevicePtr frozen[2]) {
  STRATA_CHECK(frozen != nullptr || !frozen_window_, "a use of a frozen space without its frozen parts");
  if (frozen != nullptr) frozen[0] = frozen[1] = DevicePtr();
  const StepOp& use = (*uses_)[use_];
  if (frozen_window_ && !frozen_sharded_) frozen_in_place(use, frozen);
  if (ctx_.shards == 1) {
    // One shard: the shard is the block, used in place (fetched or resident).
    acquire(out, size_t(use.block[0]), use.count > 1 ? size_t(use.block[1]) : SIZE_MAX);
    for (int i = 0; i < use.count; ++i) {
      const size_t b = size_t(use.block[i]);
      if (!out[i] && ctx_.shard_numel(b) > 0) {
        out[i] = ctx_.state->resident_on_device(Category::kParam16, ctx_.shard_offset[b], ctx_.shard_numel(b));
      }
    }
    return;
  }
  if (!use_issued_) issue_gather(use_);
  const int slot = (*ring_slot_)[use_];
  {
    // The compute stream after the gathers (Note [Device collectives]); the
    // window's next copy into the shards' slot is queued after that.
    TraceSpan span(TraceTrack::kComm, "wait all_gather");
    for (Completion& c : gather_done_[slot]) {
      ctx_.device->stream_wait(Stream::kCompute, c);
      c = Completion();
    }
    for (Completion& c : frozen_done_[slot]) {
      ctx_.device->stream_wait(Stream::kCompute, c);
      c = Completion();
    }
  }
  for (int i = 0; i < 2; ++i) {
    if (fill_[slot][i] < 0) continue;
    const size_t b = size_t(fill_[slot][i]);
    fill_secondary(b, gathered_[slot][i]);
    secondary_valid_[b] = 1;  // for the gathers issued after this copy
    fill_[slot][i] = -1;
  }
  window_->release();  // the shards are read by the gathers the compute stream waited for
  if (frozen_sharded_) frozen_window_->release();
  // The next use's gather runs while this one computes.
  use_issued_ = use_ + 1 < uses_->size();
  if (use_issued_) issue_gather(use_ + 1);
  out[0] = gathered_[slot][0];
  out[1] = gathered_[slot][1];
  if (frozen_sharded_) {
    frozen[0] = frozen_gathered_[slot][0];
    frozen[1] = frozen_gathered_[slot][1];
  }
}

void GatheredBlocks::end() {
  if (ctx_.shards == 1) window_->release();
  if (frozen_window_ && !frozen_sharded_) frozen_window_->release();
  ++use_;
}

void GatheredBlocks::fill_secondary(size_t b, DevicePtr gathered) {
  const int64_t m = ctx_.shard_numel(b) * (ctx_.shards / node_ranks_) * ctx_.param_bytes;
  ctx_.device->copy_on_device(secondary_mem_.ptr() + secondary_at_[b], gathered + int64_t(local_rank_) * m, m,
                              Stream::kCompute);
}

int32_t GatheredBlocks::ready_blocks() {
  const int64_t progress = optimizer_.progress();
  int32_t n = 0;
  while (size_t(n) < ctx_.block_end.size() && ctx_.block_end[size_t(n)] <= progress) ++n;
  return n;
}

void GatheredBlocks::acquire(DevicePtr out[2], size_t b0, size_t b1) {
  int64_t end = ctx_.block_end[b0];
  if (b1 != SIZE_MAX) end = std::max(end, ctx_.block_end[b1]);
  optimizer_.wait(end);
  window_->set_ready(ready_blocks());
  window_->acquire(out);
}

}  // namespace strata
