// Private to comm/: the c10d process groups behind make_communicator, one .cc
// each, so that gloo's and NCCL's headers stay inside one file.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>

#include "comm/communicator.h"

namespace strata::detail {

// ProcessGroupGloo over `store` with options.timeout_s, options.threads and
// the interface of options.socket_ifname (else the master address when it is
// a loopback one, else the host name's).
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const RankInfo& who, const CommOptions& options);

// ProcessGroupNCCL on CUDA device `device_index`; throws CommError in a build
// without the CUDA path.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const RankInfo& who, const CommOptions& options,
                                                    int device_index);

// Runs `fn` with `stream` (a cudaStream_t of CUDA device `device_index`) as
// LibTorch's current stream, so that NCCL work issued in it is queued after
// that stream's work, and a Work::wait() in it makes that stream wait for the
// work (Note [Data group]). Without the CUDA path: throws CommError.
void on_stream(void* stream, int device_index, const std::function<void()>& fn);

}  // namespace strata::detail
