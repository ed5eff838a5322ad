#include "engine/activation_checkpoints.h"

#include <cstring>

#include "engine/compute_stream.h"
#include "util/errors.h"
#include "util/trace.h"

namespace strata {

ActivationCheckpoints::ActivationCheckpoints(const PlacementPlan& plan, size_t num_blocks,
                                             std::vector<int64_t> shape, at::ScalarType dtype, TieredState* state,
                                             const std::vector<StepOp>& schedule)
    : head_(num_blocks - 1),
      accum_(std::max<int64_t>(plan.step.accum, 1)),
      held_(plan.step.held_micro),
      saved_(num_blocks * size_t(std::max<int64_t>(plan.step.accum, 1))),
      dev_(state->device()),
      shape_(std::move(shape)),
      dtype_(dtype),
      state_(state) {
  // A restore can be prefetched by the one before it unless a forward runs
  // between them (micro_batch: the next micro-batch's forward has not saved
  // its input yet, and its host slot is the same).
  bool forward_since = true;
  size_t run_start = 0;
  for (const StepOp& op : schedule) {
    if (op.pass == Pass::kForward) forward_since = true;
    if (op.pass != Pass::kBackward || op.block[0] == 0) continue;
    if (forward_since) run_start = restore_order_.size();
    slot_of_.push_back(int((restore_order_.size() - run_start) % 2));
    restore_order_.emplace_back(size_t(op.block[0]), op.micro);
    after_forward_.push_back(forward_since ? 1 : 0);
    forward_since = false;
  }
  const StagingNeeds& need = plan.staging;
  if (need.ckpt_host > 0) {
    bytes_ = plan.activations.checkpoint_bytes;
    host_ = dev_.allocate_pinned(need.ckpt_host, "offloaded activation checkpoints");
    device_ = dev_.allocate(need.ckpt_device, "activation checkpoint slots (2)");
  }
}

ActivationCheckpoints::~ActivationCheckpoints() {
  try {
    offloaded_.wait();
    dev_.synchronize(Stream::kD2H);
    dev_.synchronize(Stream::kH2D);
  } catch (...) {
    // A failed device: its error was reported by the step that failed.
  }
}

// Layer inputs are saved on the device as LibTorch tensors, or with
// cpu_checkpointing copied to the host (D2H) during forward and brought back
// (H2D) during backward, one restore ahead in the schedule's backward order:
// while one input's backward runs, the next one's is already in the other
// device slot. The copies go through the device layer: memcpy on the CPU
// device, the copy streams of a GPU, ordered after the compute that wrote
// (or last read) their source (or slot).
void ActivationCheckpoints::save(size_t b, int64_t m, const at::Tensor& x) {
  if (b == 0) {
    saved_[key(b, m)] = x;  // the token ids, kept with the batch
    return;
  }
  if (bytes_ == 0) {
    saved_[key(b, m)] = x;
    device_now_ += int64_t(x.nbytes());
    peak_device_ = std::max(peak_device_, device_now_);
    return;
  }
  STRATA_CHECK(int64_t(x.nbytes()) == bytes_ && x.is_contiguous(), "unexpected activation shape");
  TraceSpan span(TraceTrack::kCopy, "offload checkpoint");
  // The previous input's copy is done before its tensor may be freed.
  offloaded_.wait();
  offloading_ = x;
  dev_.stream_wait(Stream::kD2H, dev_.record(Stream::kCompute));
  dev_.copy_to_host(host_.data() + host_slot(b, m) * bytes_, DevicePtr(static_cast<std::byte*>(x.data_ptr())),
                    bytes_, Stream::kD2H);
  offloaded_ = dev_.record(Stream::kD2H);
  state_->count_copy(/*to_device=*/false, bytes_);
}

void ActivationCheckpoints::bring(size_t k) {
  TraceSpan span(TraceTrack::kCopy, "fetch checkpoint");
  const auto [b, m] = restore_order_[k];
  if (after_forward_[k]) {
    offloaded_.wait();  // the last offload of the forward has landed
    offloading_ = at::Tensor();
  }
  // The slot's previous input (two restores back) is done with it.
  dev_.stream_wait(Stream::kH2D, dev_.record(Stream::kCompute));
  const int slot = slot_of_[k];
  dev_.copy_to_device(device_.ptr() + int64_t(slot) * bytes_, host_.data() + host_slot(b, m) * bytes_, bytes_,
                      Stream::kH2D);
  slot_ready_[size_t(slot)] = dev_.record(Stream::kH2D);
  state_->count_copy(/*to_device=*/true, bytes_);
}

at::Tensor ActivationCheckpoints::restore(size_t b, int64_t m) {
  if (bytes_ == 0 || b == 0) {
    at::Tensor x = std::move(saved_[key(b, m)]);
    saved_[key(b, m)] = at::Tensor();
    if (b != 0) device_now_ -= int64_t(x.nbytes());
    return x;
  }
  const size_t k = restored_++;
  STRATA_CHECK(k < restore_order_.size() && restore_order_[k] == std::make_pair(b, m),
               "activation checkpoints restored out of the schedule's order");
  if (after_forward_[k]) bring(k);  // the first restore after a forward: nothing prefetched it
  if (k + 1 < restore_order_.size() && !after_forward_[k + 1]) bring(k + 1);  // prefetch into the other slot
  peak_device_ = device_.bytes();
  dev_.stream_wait(Stream::kCompute, slot_ready_[size_t(slot_of_[k])]);
  // A tensor of the device slot, on the compute device.
  return at::from_blob((device_.ptr() + int64_t(slot_of_[k]) * bytes_).raw(), shape_,
                       at::TensorOptions().dtype(dtype_).device(torch_device(dev_)));
}

}  // namespace strata
