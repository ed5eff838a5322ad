// The uses of a schedule and their gathered blocks (Note [Gathered blocks] in
// trainer.h): each use's blocks acquired from the parameter window once the
// optimizer has finished them, all-gathered when the block is sharded (the
// next use's gather issued before the current one computes), or used in
// place.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/optimizer_pass.h"
#include "engine/step_context.h"
#include "memory/buffer.h"
#include "memory/device.h"
#include "memory/param_window.h"
#include "memory/placement.h"

namespace strata {

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
  // use.block[1] (the embedding), as device pointers valid until end().
  void next(DevicePtr out[2]);
  void end();
  // The optimizer rewrote the working copy: nothing gathered or fetched
  // before is valid.
  void invalidate();

  ParamWindow& window() { return *window_; }
  const ParamWindow& window() const { return *window_; }
  int64_t device_bytes() const { return gather_mem_.bytes(); }

 private:
  void issue_gather(size_t u);
  // The window's next use (blocks `b0` and, for the tied head, `b1`), once
  // the optimizer has finished them.
  void acquire(DevicePtr out[2], size_t b0, size_t b1);
  int32_t ready_blocks();

  const StepContext& ctx_;
  OptimizerPass& optimizer_;
  bool gather_once_ = false;              // stages 1-2 with several shards
  int per_use_ = 1;                       // blocks per use: 2 with the tied head (head + embedding)
  int64_t largest_block_numel_ = 0;
  std::unique_ptr<ParamWindow> window_;
  std::vector<WindowUse> train_schedule_, eval_schedule_;
  DeviceBuffer gather_mem_;               // gathered blocks (ring, or the whole model)
  std::vector<char> gathered_valid_;      // gathered once per step: per block, gathered since the optimizer
  // Stage 3: per block kept gathered for the step (PlacementPlan::keep_gathered),
  // its bytes' offset in gather_mem_ after the ring; -1 for the others.
  std::vector<int64_t> kept_at_;
  const std::vector<WindowUse>* uses_ = nullptr;
  size_t use_ = 0;                        // the use next() hands out
  bool use_issued_ = false;               // its gather was issued
  Completion gather_done_[2][2];          // per ring slot, per block of the use
  DevicePtr gathered_[2][2];              // per ring slot, per block of the use
};

}  // namespace strata
