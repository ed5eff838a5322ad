// The NCCL process group (the data group of GPU ranks, Note [Data group]),
// its work queued on the device's communication stream. Built only with the
// CUDA path; it runs on a GPU host (one rank per GPU: NCCL refuses two ranks
// on one device).
#include "comm/c10d_backend.h"
#include "util/errors.h"

#ifdef STRATA_WITH_NCCL
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace strata::detail {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const RankInfo& who, const CommOptions& options,
                                                    int device_index) {
#ifdef STRATA_WITH_NCCL
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = std::chrono::milliseconds(int64_t(options.timeout_s * 1000.0));
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, who.rank, who.world_size, opts);
  // Binds the group to this rank's GPU (one rank per GPU), so NCCL does not
  // guess it from the rank.
  pg->setBoundDeviceId(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index)));
  return pg;
#else
  (void)store;
  (void)who;
  (void)options;
  (void)device_index;
  throw CommError("comm.backend: this build of strata has no CUDA path, so no NCCL; use \"gloo\"");
#endif
}

void on_stream(void* stream, int device_index, const std::function<void()>& fn) {
#ifdef STRATA_WITH_NCCL
  const auto index = static_cast<c10::DeviceIndex>(device_index);
  c10::cuda::CUDAStreamGuard guard(
      c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), index));
  fn();
#else
  (void)stream;
  (void)device_index;
  (void)fn;
  throw CommError("collectives on a CUDA stream need the CUDA path, which this build of strata lacks");
#endif
}

}  // namespace strata::detail
