// The trainer's state from outside the step (trainer.h): checkpoints saved
// and loaded (engine/state_checkpoints.h), and the accessors of the state and
// its bytes.
#include "engine/trainer.h"
#include "util/errors.h"
#include "util/trace.h"

namespace strata {

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

// ---- state accessors --------------------------------------------------------------

StateBytes Trainer::state_bytes() const {
  const PlacementPlan& p = state_->plan();
  StateBytes s;
  s.param16 = p.state.category_total(Category::kParam16);
  s.master = p.state.category_total(Category::kMaster);
  s.grad = p.state.category_total(Category::kGrad);
  s.optimizer = p.state.category_total(Category::kExpAvg) + p.state.category_total(Category::kExpAvgSq);
  return s;
}

// Measured from what was allocated: the arenas, the swap store's regions and
// the step's buffers (all sized at start-up, so current = peak).
std::array<int64_t, kNumTiers> Trainer::peak_bytes() const {
  std::array<int64_t, kNumTiers> t{};
  t[0] = state_->device_arena_bytes() + blocks_->window().shape().bytes(ctx_.param_bytes) +
         blocks_->device_bytes() + grads_->device_bytes() + activations_->device_slot_bytes() + tokens_device_.bytes();
  t[1] = state_->host_arena_bytes() + optimizer_->staging().bytes() + activations_->host_slot_bytes() +
         grads_->host_bytes() + blocks_->window().bounce_bytes() + tokens_host_.bytes() + checkpoints_->host_bytes() +
         (collectives_ ? collectives_->host_bytes() : 0);
  if (const ParamWindow* fw = blocks_->frozen_window()) {  // Note [State kinds]: the frozen base's window
    t[0] += fw->shape().bytes(ctx_.compute_bytes);
    t[1] += fw->bounce_bytes();
  }
  t[2] = state_->swap() != nullptr ? state_->swap()->used_bytes() : 0;
  return t;
}

// Compute uses device-resident weights in place; the others come through the
// window (in place would hide the H2D copy a GPU must make).
// `p`: the block's gathered weights (Note [Gathered blocks]).
std::vector<at::Tensor> Trainer::weights(size_t b, DevicePtr p, DevicePtr frozen) {
  const BlockLayout& bl = layout_.block(b);
  STRATA_CHECK(p || bl.padded_numel == 0, "a block neither gathered nor resident on the device");
  STRATA_CHECK(frozen || bl.frozen_padded_numel == 0, "a block's frozen part neither fetched nor resident");
  at::Tensor flat, frozen_flat;
  if (bl.padded_numel > 0) flat = ctx_.device_tensor(p, bl.padded_numel, ctx_.param_dtype);
  if (bl.frozen_padded_numel > 0) frozen_flat = ctx_.device_tensor(frozen, bl.frozen_padded_numel, ctx_.compute_dtype);
  return param_views(bl, frozen_flat, flat);
}

// For tests and export, not the step: a copy through a temporary buffer.
std::vector<at::Tensor> Trainer::block_weights(size_t b) {
  const BlockLayout& bl = layout_.block(b);
  at::Tensor flat, frozen;
  if (bl.padded_numel > 0) flat = gathered_copy(Category::kParam16, b, ctx_.param_dtype);
  if (bl.frozen_padded_numel > 0) frozen = gathered_copy(Category::kFrozen, b, ctx_.compute_dtype);
  std::vector<at::Tensor> w = param_views(bl, frozen, flat);
  for (at::Tensor& t : w) t = t.clone();
  return w;
}

// A copy of block b's state of category c gathered from every rank (the
// shard staged through an aligned buffer: NVMe reads need 4 KiB alignment).
at::Tensor Trainer::gathered_copy(Category c, size_t b, at::ScalarType dtype) {
  finish();
  const BlockLayout& bl = layout_.block(b);
  // Note [State kinds]: the frozen values cover the block's frozen part.
  const bool frozen = c == Category::kFrozen;
  const int64_t n = frozen ? bl.frozen_shard_numel() : bl.shard_numel();
  const int eb = state_->elem_bytes(c);
  HostBuffer shard(size_t(n * eb), "shard copy");
  state_->read(c, frozen ? ctx_.frozen_offset[b] : ctx_.shard_offset[b], n, shard.data());
  at::Tensor out = at::empty({frozen ? bl.frozen_padded_numel : bl.padded_numel}, at::TensorOptions().dtype(dtype));
  STRATA_CHECK(int64_t(out.element_size()) == eb, "dtype does not match the category's element size");
  if (ctx_.shards == 1 || (frozen && bl.frozen_world_size == 1)) {  // (Note [Frozen shards] in engine/gathered_blocks.h)
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
  const bool values = c == Category::kParam16 || c == Category::kFrozen;  // in their own dtype
  const at::ScalarType t = eb == 4 ? at::kFloat : values ? ctx_.compute_dtype : at::kBFloat16;
  return gathered_copy(c, b, t);
}

}  // namespace strata
