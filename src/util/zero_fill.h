// Zeroing a fresh host buffer faults every page in. One thread does that at
// about 5 GB/s (110 GiB of host tier took 22 s of start-up on the H200 host,
// BENCHMARKS.md "GPU, round 2"); a large buffer is zeroed by one thread per
// core, each over whole 64 MiB runs (whole huge pages).
#pragma once

#include <cstddef>

namespace strata {

// Sets `bytes` bytes at `p` to zero; in parallel from 256 MiB up.
void zero_fill(void* p, size_t bytes);

}  // namespace strata
