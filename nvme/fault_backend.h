// A Backend that injects faults into another one, for tests of everything
// above the backend: the k-th operation fails with EIO or ENOSPC, completes
// short, or reports EAGAIN/EINTR (which the engine must retry).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "nvme/backend.h"

namespace strata::nvme {

enum class FaultKind {
  kEio,     // completes with -EIO, transferring nothing
  kEnospc,  // completes with -ENOSPC, transferring nothing
  kShort,   // transfers the first half (4 KiB aligned) and reports that; ops < 8 KiB pass
  kEagain,  // completes with -EAGAIN, transferring nothing
  kEintr,   // completes with -EINTR, transferring nothing
};
const char* fault_kind_name(FaultKind kind);

// Which operations fail. Shared by the backends of all rings of an engine,
// so "the k-th operation" counts across rings (in the order they were
// prepared). Thread-safety: the counters are atomic.
struct FaultPlan {
  FaultKind kind = FaultKind::kEio;
  int64_t first_op = 1;          // 1-based index of the first faulty operation
  int64_t count = 1;             // consecutive faulty operations from there (< 0: all)
  int only_op = -1;              // -1: count reads and writes; else int(IoOp) to count only those
  std::atomic<int64_t> seen{0};  // operations counted so far
  std::atomic<int64_t> injected{0};  // faults injected so far
};

// Wraps `inner`; `plan` must outlive the backend.
std::unique_ptr<Backend> make_fault_backend(std::unique_ptr<Backend> inner,
                                            std::shared_ptr<FaultPlan> plan);

}  // namespace strata::nvme
