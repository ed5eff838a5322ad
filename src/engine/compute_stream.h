// Where LibTorch computes for the engine: the torch device of a Device, and
// the scope that makes the device's compute stream LibTorch's current stream
// (so that LibTorch's kernels, the device's copies and kernels/ launches on
// the compute stream run in the order the engine queues them).
#pragma once

#include <c10/core/Device.h>

#include <memory>

#include "memory/device.h"

namespace strata {

// kCUDA with the device's ordinal for a CUDA device; kCPU for any other (the
// CPU device, and test devices whose memory is host memory).
c10::Device torch_device(const Device& device);

// While alive, LibTorch's current stream on a CUDA device is the device's
// compute stream; on any other device it does nothing. One per thread that
// runs LibTorch ops on the device's memory.
class ComputeStreamScope {
 public:
  explicit ComputeStreamScope(Device& device);
  ~ComputeStreamScope();
  ComputeStreamScope(const ComputeStreamScope&) = delete;
  ComputeStreamScope& operator=(const ComputeStreamScope&) = delete;

 private:
  struct Guard;
  std::unique_ptr<Guard> guard_;
};

}  // namespace strata
