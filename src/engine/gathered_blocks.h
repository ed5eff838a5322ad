// The uses of a schedule and their gathered blocks (Note [Gathered blocks] in
// trainer.h): each use's blocks acquired from the parameter window once the
// optimizer has finished them, all-gathered when the block is sharded (the
// next use's gather issued before the current one computes), or used in
// place.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/optimizer/optimizer_pass.h"
#include "engine/step_context.h"
#include "memory/buffer.h"
#include "memory/device.h"
#include "memory/param_window.h"
#include "memory/placement.h"

namespace strata {

// Note [Secondary shard]
// ZeRO++'s hpZ (comm.secondary_shard, CommPlan::secondary_shard): at
// stage 3 with ranks on several nodes, a block's first gather of a step
// spans the world (each rank gives its primary shard, 1/world of the block);
// when it has landed, each rank copies 1/L of the gathered block (L ranks per
// node; local rank j keeps elements [j x m, (j + 1) x m) of the block, m =
// block / L) into its secondary shard, on the compute stream. The step's later
// gathers of that block (the backward's, and the next micro-batches') gather
// the L secondary shards over the node's group instead, which puts the same
// block together in the same order: the network across nodes carries a
// block once per step, the node's own fabric the rest. The secondary shard
// is valid from its copy until the optimizer rewrites the working copy
// (invalidate()), like a kept block; a later gather issued after the copy was
// queued reads it, because every collective's input is what the compute
// stream queued before its issue (Note [Device collectives]).

// Note [Frozen shards]
// A frozen space (Note [State kinds] in memory/layout.h) is sharded across
// ranks at ZeRO stage 3 only (frozen_shard_count()): each rank places and
// fetches 1/world of every block's frozen part through the frozen window,
// and each use all-gathers the parts into a ring of its own (two uses of up
// to two blocks, StagingNeeds::frozen_gather) beside the trained parts'
// gather, with the same ring slot and the same waits. A frozen part is
// gathered at every use: neither comm.keep_gathered nor the secondary shard
// covers it (its bytes would stay on the device for the step, the base
// being most of the model). At stages 0-2, where every rank holds the whole
// model's values anyway, every rank holds the whole base on its tiers and
// its frozen window reads it in place as one rank does: nothing frozen
// crosses the network.

// Not thread-safe: the compute thread's.
class GatheredBlocks {
 public:
  // Builds the window and the schedules for `plan`, allocates the gathered
  // buffers (StagingNeeds::gather). `optimizer` must outlive it.
  GatheredBlocks(const StepContext& ctx, const PlacementPlan& plan, OptimizerPass& optimizer);
  ~GatheredBlocks();

  // Starts a pass over the training step's schedule or an evaluation batch's
  // (waiting for whatever a failed pass left in flight).
  void begin(bool train);
  // The next use's weights: blocks use.block[0] and, for the tied head,
  // use.block[1] (the embedding), as device pointers valid until end(); with
  // a frozen space (Note [State kinds]) the blocks' frozen parts in
  // `frozen` (null for a block of none), which must be given then.
  void next(DevicePtr out[2], DevicePtr frozen[2] = nullptr);
  void end();
  // The optimizer rewrote the working copy: nothing gathered or fetched
  // before is valid.
  void invalidate();

  // The training step's ops (memory/schedule.h): the order the trainer
  // executes and the window prefetches, one list.
  const std::vector<StepOp>& train_ops() const { return train_schedule_; }
  const std::vector<StepOp>& eval_ops() const { return eval_schedule_; }

  ParamWindow& window() { return *window_; }
  const ParamWindow& window() const { return *window_; }
  // Note [State kinds]: the frozen values' window (nullptr for a dense model).
  const ParamWindow* frozen_window() const { return frozen_window_.get(); }
  // Seconds uses waited for both windows' fetches since construction.
  double window_wait_seconds() const {
    return window_->wait_seconds() + (frozen_window_ ? frozen_window_->wait_seconds() : 0.0);
  }
  int64_t device_bytes() const { return gather_mem_.bytes() + secondary_mem_.bytes() + frozen_gather_mem_.bytes(); }

 private:
  void issue_gather(size_t u);
  // Note [Frozen shards]: use u's frozen parts into ring slot `slot`.
  void issue_frozen_gather(const StepOp& use, int slot, const DevicePtr shard[2]);
  // Use u's frozen parts read in place (one frozen shard).
  void frozen_in_place(const StepOp& use, DevicePtr frozen[2]);
  static bool repeats(const std::vector<StepOp>& ops, size_t u);  // use u has use u - 1's blocks
  static std::vector<int> ring_slots(const std::vector<StepOp>& ops);
  // The window's next use (blocks `b0` and, for the tied head, `b1`), once
  // the optimizer has finished them.
  void acquire(DevicePtr out[2], size_t b0, size_t b1);
  int32_t ready_blocks();
  // Note [Secondary shard]: the copy into block b's secondary shard from the
  // gathered block at `gathered`, queued on the compute stream.
  void fill_secondary(size_t b, DevicePtr gathered);

  const StepContext& ctx_;
  OptimizerPass& optimizer_;
  bool gather_once_ = false;              // stages 1-2 with several shards
  int per_use_ = 1;                       // blocks per use: 2 with the tied head (head + embedding)
  int64_t largest_block_numel_ = 0;
  std::unique_ptr<ParamWindow> window_;
  // Note [State kinds]: the frozen values' window over the same uses, never
  // invalidated (they never change); nullptr for a dense model.
  std::unique_ptr<ParamWindow> frozen_window_;
  std::vector<StepOp> train_schedule_, eval_schedule_;
  DeviceBuffer gather_mem_;               // gathered blocks (ring, or the whole model)
  std::vector<char> gathered_valid_;      // gathered once per step: per block, gathered since the optimizer
  // Stage 3: per block kept gathered for the step (CommPlan::keep_gathered),
  // its bytes' offset in gather_mem_ after the ring; -1 for the others.
  std::vector<int64_t> kept_at_;
  const std::vector<StepOp>* uses_ = nullptr;
  // Per use of each schedule: its ring slot (ring_slots); ring_slot_ the
  // current pass's.
  std::vector<int> train_ring_slot_, eval_ring_slot_;
  const std::vector<int>* ring_slot_ = nullptr;
  size_t use_ = 0;                        // the use next() hands out
  bool use_issued_ = false;               // its gather was issued
  // Note [Secondary shard]: per block, its offset in secondary_mem_ (-1:
  // none, a kept block), and whether it holds the block since the optimizer.
  bool secondary_ = false;
  int node_ranks_ = 1;
  int local_rank_ = 0;
  DeviceBuffer secondary_mem_;
  std::vector<int64_t> secondary_at_;
  std::vector<char> secondary_valid_;
  int64_t fill_[2][2] = {{-1, -1}, {-1, -1}};  // per ring slot, per block of the use: the block to copy, or -1
  Completion gather_done_[2][2];          // per ring slot, per block of the use
  DevicePtr gathered_[2][2];              // per ring slot, per block of the use
  // Note [Frozen shards]: the frozen parts' ring at stage 3 with ranks.
  bool frozen_sharded_ = false;
  int64_t largest_frozen_numel_ = 0;       // padded, the largest block's frozen part
  DeviceBuffer frozen_gather_mem_;
  Completion frozen_done_[2][2];
  DevicePtr frozen_gathered_[2][2];
};

}  // namespace strata
