// Private to comm/: the c10d process groups behind make_communicator, one .cc
// each, so that gloo's and NCCL's headers stay inside one file.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/communicator.h"

namespace strata::detail {

// ProcessGroupGloo over `store` with options.timeout_s, options.threads and
// the interface of options.socket_ifname (else the master address when it is
// a loopback one, else the host name's).
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const RankInfo& who, const CommOptions& options);

// ProcessGroupNCCL on CUDA device who.local_rank; throws CommError in a build
// without the CUDA path.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const RankInfo& who, const CommOptions& options);

// The device the backend's buffers live on (CPU for Gloo, cuda:local_rank for NCCL).
at::Device nccl_device(const RankInfo& who);

}  // namespace strata::detail
