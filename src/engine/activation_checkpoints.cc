#include "engine/activation_checkpoints.h"

#include <cstring>

#include "util/errors.h"
#include "util/trace.h"

namespace strata {

ActivationCheckpoints::ActivationCheckpoints(const PlacementPlan& plan, size_t num_blocks,
                                             std::vector<int64_t> shape, at::ScalarType dtype, TieredState* state)
    : head_(num_blocks - 1), saved_(num_blocks), shape_(std::move(shape)), dtype_(dtype), state_(state) {
  const StagingNeeds& need = plan.staging;
  if (need.ckpt_host > 0) {
    bytes_ = plan.checkpoint_bytes;
    host_ = HostBuffer(size_t(need.ckpt_host), "offloaded activation checkpoints");
    device_ = HostBuffer(size_t(need.ckpt_device), "activation checkpoint slots (2)");
  }
}

// Layer inputs are saved on the device as LibTorch tensors, or with
// cpu_checkpointing copied to the host (D2H) during forward and brought back
// (H2D) during backward, one layer ahead: while layer b runs backward, layer
// b - 1's input is already in the other device slot. With CPU compute the
// copies are memcpy on the compute thread; a GPU build issues them on a copy
// stream.
void ActivationCheckpoints::save(size_t b, const at::Tensor& x) {
  if (b == 0) {
    saved_[b] = x;  // the token ids, kept with the batch
    return;
  }
  if (bytes_ == 0) {
    saved_[b] = x;
    device_now_ += int64_t(x.nbytes());
    peak_device_ = std::max(peak_device_, device_now_);
    return;
  }
  STRATA_CHECK(int64_t(x.nbytes()) == bytes_ && x.is_contiguous(), "unexpected activation shape");
  TraceSpan span(TraceTrack::kCopy, "offload checkpoint");
  std::memcpy(host_.as<std::byte>() + (b - 1) * size_t(bytes_), x.data_ptr(), size_t(bytes_));
  state_->count_copy(/*to_device=*/false, bytes_);
}

at::Tensor ActivationCheckpoints::restore(size_t b) {
  if (bytes_ == 0 || b == 0) {
    at::Tensor x = saved_[b];
    if (b != 0) device_now_ -= int64_t(x.nbytes());
    saved_[b] = at::Tensor();
    return x;
  }
  // Slots alternate from the first layer of the backward (the last layer).
  auto slot = [&](size_t layer) { return (head_ - 1 - layer) % 2; };
  auto bring = [&](size_t layer) {
    TraceSpan span(TraceTrack::kCopy, "fetch checkpoint");
    std::memcpy(device_.as<std::byte>() + slot(layer) * size_t(bytes_),
                host_.as<std::byte>() + (layer - 1) * size_t(bytes_), size_t(bytes_));
    state_->count_copy(/*to_device=*/true, bytes_);
  };
  if (b + 1 == head_) bring(b);  // the first layer of the backward: nothing prefetched it
  if (b - 1 != 0) bring(b - 1);  // prefetch into the other slot
  peak_device_ = int64_t(device_.bytes());
  return at::from_blob(device_.as<std::byte>() + slot(b) * size_t(bytes_), shape_, at::TensorOptions().dtype(dtype_));
}

}  // namespace strata
