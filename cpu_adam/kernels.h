// Internal: the per-ISA kernel entry points and the constants of one step.
// Each kernel_<isa>.cc is compiled with its own -m flags; this header must
// stay free of inline functions, which an ISA-flagged file could emit in a
// form the generic code would then link against.
#pragma once

#include <cstdint>

#include "cpu_adam/cross_entropy.h"
#include "cpu_adam/types.h"

namespace strata::cpu_adam::detail {

// How weight decay enters the step (Note [AdamW numerics]).
enum class DecayMode { kNone, kDecoupled, kL2 };

// The step's scalars, computed once per call in double and rounded to float.
struct StepConstants {
  float grad_scale;
  float decay;            // 1 - lr*wd; kDecoupled only
  float weight_decay;     // wd; kL2 only
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float inv_bias_correction2_sqrt;  // 1 / sqrt(1 - beta2^t)
  float neg_step_size;    // -lr / (1 - beta1^t)
  float eps;
  DecayMode decay_mode;
  // Note [bf16 state]: the hash key of element i is
  // uint32(rounding_offset + i) * kRoundingIndexMul + step_key.
  uint64_t rounding_offset;
  uint32_t step_key;
};

constexpr uint32_t kRoundingIndexMul = 0x9E3779B1u;  // odd: a bijection of the index
constexpr uint32_t kRoundingStepMul = 0x85EBCA77u;
// The mixer of the rounding hash (a 32-bit xorshift-multiply finaliser).
constexpr uint32_t kRoundingMix1 = 0x7FEB352Du;
constexpr uint32_t kRoundingMix2 = 0x846CA68Bu;

StepConstants make_constants(const AdamParams& params, const StepArgs& args);

// Updates elements [begin, end) of the spans. Returns true when every scaled
// gradient in the range was finite.
using StepKernel = bool (*)(const StepConstants& c, const AdamSpans& s, int64_t begin, int64_t end);
// Converts src[begin, end) into dst[begin, end) of a conversion of numel
// elements in all. REQUIRES: type != kNone.
using ConvertKernel = void (*)(const float* src, void* dst, EmitType type, int64_t numel,
                               int64_t begin, int64_t end);

// Rows [begin, end) of Note [Fused cross-entropy] (cpu_adam/cross_entropy.h).
using CrossEntropyKernel = void (*)(const CrossEntropyRows& a, int64_t begin, int64_t end);

struct Kernels {
  StepKernel step;
  ConvertKernel convert;
  CrossEntropyKernel cross_entropy;
};

Kernels scalar_kernels();
Kernels avx2_kernels();
Kernels avx512_kernels();
Kernels avx512_bf16_kernels();

// The kernels of `isa`. REQUIRES: isa_supported(isa).
Kernels kernels_for(Isa isa);

}  // namespace strata::cpu_adam::detail
