#include "engine/compute_stream.h"

#include "util/errors.h"

#ifdef STRATA_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#endif

namespace strata {

c10::Device torch_device(const Device& device) {
  if (device.is_cuda()) return c10::Device(c10::DeviceType::CUDA, c10::DeviceIndex(device.ordinal()));
  return c10::Device(c10::DeviceType::CPU);
}

#ifdef STRATA_WITH_CUDA
struct ComputeStreamScope::Guard {
  explicit Guard(c10::cuda::CUDAStream s) : stream(s) {}
  c10::cuda::CUDAStreamGuard stream;
};

ComputeStreamScope::ComputeStreamScope(Device& device) {
  if (!device.is_cuda()) return;
  auto* s = static_cast<cudaStream_t>(device.native_stream(Stream::kCompute));
  guard_ = std::make_unique<Guard>(c10::cuda::getStreamFromExternal(s, c10::DeviceIndex(device.ordinal())));
}
#else
struct ComputeStreamScope::Guard {};

ComputeStreamScope::ComputeStreamScope(Device& device) {
  STRATA_CHECK(!device.is_cuda(), "a CUDA device in a build without the CUDA path");
}
#endif

ComputeStreamScope::~ComputeStreamScope() = default;

}  // namespace strata
