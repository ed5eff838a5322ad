// The NCCL process group (GPU ranks), on its own CUDA stream (c10d's). Built
// only with the CUDA path; it runs on a GPU host (one rank per GPU: NCCL
// refuses two ranks on one device).
#include "comm/c10d_backend.h"
#include "util/errors.h"

#ifdef STRATA_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace strata::detail {

at::Device nccl_device(const RankInfo& who) {
  return at::Device(at::kCUDA, at::DeviceIndex(who.local_rank));
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const RankInfo& who, const CommOptions& options) {
#ifdef STRATA_WITH_NCCL
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = std::chrono::milliseconds(int64_t(options.timeout_s * 1000.0));
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, who.rank, who.world_size, opts);
#else
  (void)store;
  (void)who;
  (void)options;
  throw CommError("comm.backend: this build of strata has no CUDA path, so no NCCL; use \"gloo\"");
#endif
}

}  // namespace strata::detail
