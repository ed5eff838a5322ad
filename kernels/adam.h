// CUDA kernels of the optimizer step for state held in HBM, with host
// launchers: the fused AdamW of Note [AdamW numerics] (cpu_adam/types.h), the
// gradient's squared-norm partials, unscale with a non-finite check. Plain
// pointers (device memory) and sizes; no CUDA types here, so any file can
// include this header. Built only with the CUDA path (STRATA_WITH_CUDA).
// Every launcher fails fast with file:line on a CUDA error. `stream` is a
// cudaStream_t (nullptr = the legacy default stream); launches are
// asynchronous on it.
#pragma once

#include <cstdint>

#include "cpu_adam/kernels.h"
#include "cpu_adam/types.h"

namespace strata::kernels {

// One Adam step over `spans` (every pointer device memory), with the
// constants cpu_adam::detail::make_constants computed for it: the same
// operation sequence as the CPU kernels, every operation IEEE-rounded
// (compiled with -fmad=false; __fmaf_rn exactly where the Note fuses), so
// with finite gradients the results equal cpu_adam::CpuAdam's bit for bit,
// bf16 moments' stochastic rounding and the 16-bit copy included (Note [bf16
// state], Note [16-bit rounding]). Elements with a NaN or Inf gradient end up
// NaN on both, but the NaN's bits may differ (x86's default NaN has the sign
// set, CUDA's does not); the trainer never applies such a step. When any scaled gradient is not finite, *nonfinite (a device
// int; may be null) is set to 1; it is never cleared here. The step is
// applied regardless (Note [Non-finite gradients]).
void adam_step(const cpu_adam::detail::StepConstants& c, const cpu_adam::AdamSpans& spans, int* nonfinite,
               void* stream);

// Squared L2 norm partials of x[0, n): partials[k] for k < num_partials is
// the sum of x[i]^2 in double over the elements block k visits; their sum
// is the squared norm. REQUIRES: num_partials >= 1 (at most kMaxNormPartials
// are used; the rest are set to 0).
inline constexpr int kMaxNormPartials = 1024;
void squared_norm_partials(const float* x, int64_t n, double* partials, int num_partials, void* stream);

// Note [Ordered norm] in cpu_adam/grad_ops.h: *out (a device double) =
// the squared L2 norm of x[0, n) in the order cpu_adam::ordered_squared_norm
// sums it, bit for bit. `scratch` holds ordered_norm_scratch(n) doubles of
// device memory (the chunks' partials); launches on one stream may share it.
int64_t ordered_norm_scratch(int64_t n);
void ordered_squared_norm(const float* x, int64_t n, double* out, double* scratch, void* stream);

// x[i] *= scale in place (one IEEE multiply), setting *nonfinite = 1 (a
// device int) when any result is not finite.
void unscale_and_check(float* x, int64_t n, float scale, int* nonfinite, void* stream);

}  // namespace strata::kernels
