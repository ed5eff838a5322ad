// The trainer's buffers for a plan (staging_needs): what `strata plan`
// reports and what a run allocates, from the same construction.
#include <algorithm>
#include <optional>

#include "cpu_adam/grad_ops.h"
#include "plan/make_plan.h"

namespace strata {

namespace {
WindowShape window_shape(const PlacementPlan& plan, bool frozen) {
  const int n = int(plan.block_numel.size());
  const std::vector<StepOp> train = plan_train_schedule(plan);
  const std::vector<StepOp> eval = eval_schedule(n, plan.tied);
  if (frozen) {
    std::unique_ptr<ParamWindow> w = make_frozen_window(plan);
    return w ? w->plan({&train, &eval}) : WindowShape();
  }
  return make_param_window(plan)->plan({&train, &eval});
}
}  // namespace

namespace {

bool off_device(const PlacementPlan& plan, Category c) {
  for (const PlacementUnit& u : plan.state.units[size_t(c)]) {
    if (u.tier != Tier::kDevice) return true;
  }
  return false;
}

bool on_nvme(const PlacementPlan& plan, Category c) {
  for (const PlacementUnit& u : plan.state.units[size_t(c)]) {
    if (u.tier == Tier::kNvme) return true;
  }
  return false;
}

// The gradient path's buffers (Note [Gradient path] in engine/gradient_path.h).
void gradient_staging(const PlacementPlan& plan, StagingNeeds& n) {
  const int64_t largest = plan.largest_block_numel;
  const bool grads_off_device = off_device(plan, Category::kGrad);
  // Under the layer schedule at one rank, a block's micro-batches are summed
  // in one block-sized buffer and land once (Note [Gradient path]).
  if (plan.step.sums_each_block() && plan.world_size <= 1 && grads_off_device) n.grad_accum = largest * 4;
  // (The CPU device lays gradients out in the landing buffers themselves.)
  // With ranks: a stage per block's reduction, unless the step's sum is
  // reduced (CommPlan::reduce_per_step, the buffer grad_accum).
  n.grad_stage = plan.world_size > 1 ? (plan.comm.reduce_per_step ? 0 : largest * 4)
                 : plan.tied || (grads_off_device && !plan.device_addressable && n.grad_accum == 0) ? largest * 4 : 0;
  const int64_t blocks = int64_t(plan.block_numel.size());
  n.grad_norms = blocks * 8;
  if (!plan.device_addressable) {
    n.grad_norms += (plan.state.largest_block_shard_numel + cpu_adam::kNormChunk - 1) / cpu_adam::kNormChunk * 8;
  }
  int64_t landing = 0;
  const std::vector<PlacementUnit>& grads = plan.state.units[size_t(Category::kGrad)];
  for (size_t b = 0; b < grads.size(); ++b) {
    if (grads[b].tier != Tier::kDevice) landing = std::max(landing, grads[b].numel * grad_wire_bytes(plan, b));
  }
  n.grad_host = 2 * landing;
  n.grad_rmw = on_nvme(plan, Category::kGrad) ? plan.state.largest_block_shard_numel * 4 : 0;
}

// The buffers of the collectives between ranks.
void comm_staging(const PlacementPlan& plan, StagingNeeds& n) {
  const int64_t largest = plan.largest_block_numel;
  if (plan.shards > 1 && plan.stage == 3) {
    n.gather = (2 * (plan.tied ? 2 : 1) * largest + plan.comm.kept_gathered_numel) * plan.param_bytes();
  } else if (plan.shards > 1) {
    n.gather = plan.gathered_numel * plan.param_bytes();
  }
  if (plan.frozen_shards > 1) {
    // Note [Frozen shards]: a ring of two uses, like stage 3's blocks.
    int64_t largest_frozen = 0;
    for (int64_t shard : plan.frozen_block_numel) largest_frozen = std::max(largest_frozen, shard * plan.frozen_shards);
    n.frozen_gather = 2 * (plan.tied ? 2 : 1) * largest_frozen * plan.compute_bytes;
  }
  if (plan.comm.staged) n.comm_host = 2 * int64_t(plan.world_size) * kStagedPieceBytes;
  if (plan.comm.reduce_per_step) n.grad_accum = plan.gathered_numel * 4;
  if (plan.comm.secondary_shard) {
    for (size_t b = 0; b < plan.block_numel.size(); ++b) {
      if (plan.comm.keep_gathered.empty() || !plan.comm.keep_gathered[b]) {
        n.secondary += plan.block_numel[b] * plan.nodes() * plan.param_bytes();
      }
    }
  }
  if (plan.world_size > 1) {
    n.grad_sync = n.grad_stage + (plan.stage >= 2 ? 2 * plan.state.largest_block_shard_numel * 4 : 0);
    if (plan.comm.grad_bytes < 4) {
      n.grad_sync += 2 * (largest + (plan.stage >= 2 ? plan.state.largest_block_shard_numel : 0)) * plan.comm.grad_bytes;
    }
  }
}

// The optimizer's staging in host memory.
void optimizer_staging(const PlacementPlan& plan, StagingNeeds& n) {
  // Host: per sub-group, what is not resident in one piece is staged, a
  // pipeline piece at a time (Note [Pipeline pieces]); on a device host code
  // may not touch, device-tier parts of pieces CPU Adam updates too.
  const int64_t group = pipeline_piece_numel(plan);
  auto staged = [&](Category c, const PlacementUnit& g) {
    const std::optional<Tier> t = range_tier(plan, c, g.offset, g.numel);
    return !t.has_value() || *t == Tier::kNvme || (!plan.device_addressable && *t == Tier::kDevice);
  };
  bool grad_staged = false, emit_staged = false, state_staged = false;
  for (const PlacementUnit& g : plan.state.units[size_t(Category::kMaster)]) {
    if (device_adam_piece(plan, g)) continue;
    grad_staged |= staged(Category::kGrad, g);
    emit_staged |= staged(Category::kParam16, g);
    for (Category c : {Category::kMaster, Category::kExpAvg, Category::kExpAvgSq}) state_staged |= staged(c, g);
  }
  // Note [Optimizer pipeline]: with staging, `pipeline_depth` sets of it let
  // sub-group j+1 be read while j is updated and j-1 written back.
  n.opt_sets = grad_staged || state_staged || emit_staged ? plan.optimizer.pipeline_depth : 0;
  n.opt_grad = grad_staged ? n.opt_sets * group * 4 : 0;
  const int64_t state_elem_bytes = plan.state.elem_bytes[size_t(Category::kMaster)] +
                                   plan.state.elem_bytes[size_t(Category::kExpAvg)] +
                                   plan.state.elem_bytes[size_t(Category::kExpAvgSq)];
  n.opt_state = state_staged ? n.opt_sets * group * state_elem_bytes : 0;
  n.opt_emit = emit_staged ? n.opt_sets * group * plan.param_bytes() : 0;
}

}  // namespace

StagingNeeds staging_needs(const PlacementPlan& plan) {
  StagingNeeds n;
  // Device: the parameter window for blocks whose weights are not on the
  // device, sized by a dry run of the training and evaluation schedules; the
  // gradient path's buffers (Note [Gradient path] in engine/gradient_path.h).
  n.window = window_shape(plan, false);
  n.gathered = n.window.bytes(plan.state.elem_bytes[size_t(Category::kParam16)]);
  gradient_staging(plan, n);
  if (!plan.device_addressable && on_nvme(plan, Category::kParam16)) {
    n.window_bounce = n.gathered;  // one bounce buffer per slot and for the persistent blocks
  }
  // Note [State kinds]: the frozen values' window, the same way.
  n.frozen_window = window_shape(plan, true);
  n.frozen_gathered = n.frozen_window.bytes(plan.state.elem_bytes[size_t(Category::kFrozen)]);
  if (!plan.device_addressable && on_nvme(plan, Category::kFrozen)) n.frozen_window_bounce = n.frozen_gathered;
  n.tokens = plan.step.token_bytes;
  bool saved_on_device = false;
  for (Category c : {Category::kMaster, Category::kExpAvg, Category::kExpAvgSq}) {
    saved_on_device |= plan.state.bytes[size_t(c)][size_t(Tier::kDevice)] > 0;
  }
  if (!plan.device_addressable && saved_on_device) n.save_bounce = kSaveBounceBytes;
  n.save_snapshot = plan.save_snapshot_bytes;
  comm_staging(plan, n);
  // What the layers keep in host RAM (Note [Activation placement] in
  // memory/placement.h), the packs held at once, and the device slots they
  // come back into: two (one where a run of backwards brings back only one),
  // each of the largest pack.
  const ActivationPlan& a = plan.activations;
  n.ckpt_host = a.host_pack_bytes();
  n.ckpt_device = std::min<int64_t>(2, a.host_packs_per_run()) * a.largest_host_pack();
  optimizer_staging(plan, n);
  return n;
}

}  // namespace strata
