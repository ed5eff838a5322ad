// The plain types of cpu_adam: instruction-set levels, gradient types,
// hyperparameters and the spans of one step. No oneTBB here, so the
// ISA-flagged kernel files can include it.
#pragma once

#include <cstdint>
#include <string_view>

#include "cpu_adam/convert.h"

namespace strata::cpu_adam {

// Note [AdamW numerics]
// One step t (1-based) on element i: PyTorch's AdamW/Adam (torch/optim/adamw.py,
// _single_tensor_adam; not amsgrad, not capturable), operation by operation
// except for the division noted below.
// The hyperparameters are doubles, and every constant is computed in double
// and then rounded to float once, as PyTorch does with Python floats:
//
//   decay      = float(1 - lr*wd)           AdamW with wd != 0, else unused
//   w1         = float(1 - beta1)
//   b2         = float(beta2),  w2 = float(1 - beta2)
//   inv_bc2    = float(1 / sqrt(1 - beta2^t))
//   neg_step   = float(-(lr / (1 - beta1^t)))
//
// then in fp32 (fma = fused multiply-add, one rounding):
//
//   g  = grad[i] * grad_scale                (16-bit grads widened exactly first)
//   g  = fma(param, float(wd), g)            Adam (L2) with wd != 0 only
//   p  = param * decay                       AdamW with wd != 0 only
//   m  = fma(w1, g - m, m)                   lerp(m, g, 1 - beta1)
//   v  = fma(w2 * g, g, v * b2)              v*beta2 + (1-beta2)*g*g
//   d  = fma(sqrt(v), inv_bc2, eps)          sqrt(v)/sqrt(bc2) + eps, see below
//   p  = p + (neg_step * m) / d              addcdiv(p, m, d, -step_size)
//   emit[i] = to_bf16(p) or to_fp16(p)       optional; see convert.h
//
// PyTorch divides sqrt(v) by float(sqrt(bc2)); multiplying by the reciprocal
// saves one of the two divisions per element, which with the square root are
// what limits a core's throughput here, and moves d by about an ulp.
//
// Each step is within 3e-7 relative of the same step computed exactly from
// the same fp32 state (tested: <= 1e-6 for every kernel). Every kernel
// (scalar with std::fma, AVX2, AVX-512, and the CUDA kernel of
// kernels/adam.h, compiled with -fmad=false and __fmaf_rn at these points)
// evaluates exactly this sequence with IEEE rounding of every operation, so
// they agree bit for bit (tested; for the CUDA kernel with finite gradients:
// the bits of a NaN produced from an Inf or NaN gradient are the hardware's).
// LibTorch's CPU kernels fuse some of these
// operations and not others, and torch::optim::AdamW (C++) updates m as
// m*beta1 + (1-beta1)*g, so results match LibTorch to rounding, not bit for
// bit (tested: 1e-6 relative after 100 steps).

// Note [Non-finite gradients]
// step() reports whether every scaled gradient g = grad*grad_scale was finite,
// found in the same pass (one fused multiply-add per vector), and applies the
// step regardless: elements with a NaN/Inf gradient end up NaN in param and
// state. Skipping a step on fp16 overflow has to be decided before any
// sub-group is stepped (the overflow may be on another sub-group or rank), so
// the caller decides it from the global gradient norm it already computes for
// clipping; this flag is the cheap per-call check that catches what slipped
// through.

// Instruction-set levels, lowest first. A level may be forced lower than the
// CPU supports (tests; CPUs that down-clock under AVX-512), never higher.
enum class Isa {
  kScalar,      // portable C++
  kAvx2,        // AVX2 + FMA + F16C
  kAvx512,      // AVX-512 F/BW/VL/DQ; bf16 rounding done with integer ops
  kAvx512Bf16,  // kAvx512 + AVX512-BF16 conversion instructions
};

// The highest level this CPU (and OS) supports, from CPUID.
Isa best_isa();
bool isa_supported(Isa isa);
const char* isa_name(Isa isa);  // "scalar", "avx2", "avx512", "avx512_bf16"
// Parses isa_name() spellings and "auto" (= best_isa()). Throws
// std::invalid_argument on anything else.
Isa parse_isa(std::string_view name);

enum class GradType { kF32, kBF16, kF16 };
const char* grad_type_name(GradType type);  // "fp32", "bf16", "fp16"

// Note [bf16 state]
// exp_avg and exp_avg_sq may be kept in bf16 (StateType::kBF16): 4 bytes of
// moments per parameter instead of 8, and 20 bytes of DRAM traffic per step
// instead of 28. A step widens them exactly, computes Note [AdamW numerics] in
// fp32 (the parameter update uses the unrounded new moments), and stores the
// new moments rounded to bf16 STOCHASTICALLY: 16 random bits are added to the
// fp32 bit pattern, which is then truncated, so the stored value is one of the
// two neighbouring bf16 values and its expectation is the fp32 value.
// Rounding to nearest would not do: with beta2 = 0.999, v moves by 0.1% a
// step when the gradient shrinks, less than half a bf16 ulp (0.2-0.4%), so v
// would never decay and the effective step size would only ever shrink.
// The random bits are a hash of (index, step), where index is the element's
// position in the span plus StepArgs::rounding_offset (a caller stepping one
// array in several spans passes each span's offset): the result does not
// depend on the thread count or the tiling, the SIMD kernels agree bit for
// bit, and rerunning a step from the same state gives the same bits. With
// i = uint32(index) (the index modulo 2^32: elements 2^32 apart draw the same
// bits, each still unbiased) and t = uint32(step), all arithmetic mod 2^32:
//   h = i * 0x9E3779B1 + t * 0x85EBCA77
//   h ^= h >> 16;  h *= 0x7FEB352D;  h ^= h >> 15;  h *= 0x846CA68B;  h ^= h >> 16
// m takes h & 0xFFFF, v takes h >> 16. NaN becomes 0x7FC0 (c10's canonical
// NaN, as in Note [16-bit rounding]; adding to a NaN's bits could carry into
// the sign); +-Inf stays +-Inf; a finite value above the largest bf16 may
// round to Inf.
enum class StateType { kF32, kBF16 };
const char* state_type_name(StateType type);  // "fp32", "bf16"

// Hyperparameters. Defaults are PyTorch's AdamW defaults.
struct AdamParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool adamw = true;  // true: decoupled weight decay (AdamW); false: L2 added to the gradient (Adam)
};

struct StepArgs {
  int64_t step = 1;         // 1-based: the first step is 1 (bias correction uses it)
  float grad_scale = 1.0f;  // multiplies every gradient first (1/loss_scale, clip coefficient)
  uint64_t rounding_offset = 0;  // bf16 state: index of the spans' element 0 in the whole array
};

// The spans of one step. Views: CpuAdam owns none of them.
struct AdamSpans {
  float* param = nullptr;       // (numel) fp32 master weights, updated in place
  const void* grad = nullptr;   // (numel) of grad_type
  GradType grad_type = GradType::kF32;
  void* exp_avg = nullptr;      // (numel) of state_type, zero before step 1
  void* exp_avg_sq = nullptr;   // (numel) of state_type, zero before step 1
  StateType state_type = StateType::kF32;
  void* emit = nullptr;         // (numel) of emit_type, or null with EmitType::kNone
  EmitType emit_type = EmitType::kNone;
  int64_t numel = 0;
};

}  // namespace strata::cpu_adam
