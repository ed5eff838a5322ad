// CUDA kernels for dtype casts, with host launchers. Plain pointers and sizes;
// no CUDA types in this header, so any file can include it. Built only when
// the CUDA path is on (STRATA_WITH_CUDA); see kernels/CMakeLists.txt.
#pragma once

#include <cstdint>

namespace strata::kernels {

// Converts n fp32 values at `in` (device memory) to bf16 bits at `out`
// (device memory), rounding to nearest even as LibTorch does; NaN stays NaN.
// `stream` is a cudaStream_t (nullptr = the legacy default stream).
// Fails fast with file:line on a CUDA error.
void cast_f32_to_bf16(const float* in, uint16_t* out, int64_t n, void* stream);

// Number of CUDA devices visible to this process (0 when none or no driver).
int cuda_device_count();

}  // namespace strata::kernels
