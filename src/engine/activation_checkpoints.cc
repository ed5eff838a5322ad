#include "engine/activation_checkpoints.h"

#include <cstring>

#include "engine/compute_stream.h"
#include "util/errors.h"
#include "util/trace.h"

namespace strata {

ActivationCheckpoints::ActivationCheckpoints(const PlacementPlan& plan, size_t num_blocks,
                                             std::vector<int64_t> shape, at::ScalarType dtype, TieredState* state)
    : head_(num_blocks - 1),
      saved_(num_blocks),
      dev_(state->device()),
      shape_(std::move(shape)),
      dtype_(dtype),
      state_(state) {
  const StagingNeeds& need = plan.staging;
  if (need.ckpt_host > 0) {
    bytes_ = plan.checkpoint_bytes;
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
// (H2D) during backward, one layer ahead: while layer b runs backward, layer
// b - 1's input is already in the other device slot. The copies go through
// the device layer: memcpy on the CPU device, the copy streams of a GPU,
// ordered after the compute that wrote (or last read) their source (or slot).
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
  // The previous input's copy is done before its tensor may be freed.
  offloaded_.wait();
  offloading_ = x;
  dev_.stream_wait(Stream::kD2H, dev_.record(Stream::kCompute));
  dev_.copy_to_host(host_.data() + (b - 1) * bytes_, DevicePtr(static_cast<std::byte*>(x.data_ptr())), bytes_,
                    Stream::kD2H);
  offloaded_ = dev_.record(Stream::kD2H);
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
    if (layer + 1 == head_) {
      offloaded_.wait();  // the last offload of the forward has landed
      offloading_ = at::Tensor();
    }
    // The slot's previous layer (two back in the backward) is done with it.
    dev_.stream_wait(Stream::kH2D, dev_.record(Stream::kCompute));
    dev_.copy_to_device(device_.ptr() + int64_t(slot(layer)) * bytes_, host_.data() + (layer - 1) * bytes_, bytes_,
                        Stream::kH2D);
    slot_ready_[slot(layer)] = dev_.record(Stream::kH2D);
    state_->count_copy(/*to_device=*/true, bytes_);
  };
  if (b + 1 == head_) bring(b);  // the first layer of the backward: nothing prefetched it
  if (b - 1 != 0) bring(b - 1);  // prefetch into the other slot
  peak_device_ = device_.bytes();
  dev_.stream_wait(Stream::kCompute, slot_ready_[slot(b)]);
  // A tensor of the device slot, on the compute device.
  return at::from_blob((device_.ptr() + int64_t(slot(b)) * bytes_).raw(), shape_,
                       at::TensorOptions().dtype(dtype_).device(torch_device(dev_)));
}

}  // namespace strata
