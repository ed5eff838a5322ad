// Scalar fp32 <-> bf16/fp16 conversions, bit-exact with LibTorch's scalar
// conversions (c10::BFloat16 and c10::Half constructors from float); the SIMD
// kernels produce exactly these bits too.
#pragma once

#include <cstdint>

namespace strata::cpu_adam {

// The 16-bit copy of the parameters a step may write, or none.
enum class EmitType { kNone, kBF16, kF16 };
const char* emit_type_name(EmitType type);  // "none", "bf16", "fp16"

// Note [16-bit rounding]
// float -> bf16: round to nearest, ties to even, on the bit pattern (as
// c10::BFloat16's round_to_nearest_even): finite values that round past the
// largest bf16 become +-Inf; fp32 denormals round like any other value (no
// flush to zero); every NaN becomes 0x7FC0 (c10's canonical NaN).
// float -> fp16: IEEE 754 round to nearest, ties to even, as c10's
// fp16_ieee_from_fp32_value: overflow gives +-Inf, results below the smallest
// normal become fp16 denormals or +-0; every NaN becomes sign | 0x7E00.
// The AVX-512 BF16 instruction (vcvtneps2bf16) flushes denormals and keeps
// NaN payloads, so the kernels that use it patch those rare lanes (see
// kernel_avx512.cc) and the result is the same everywhere.
uint16_t float_to_bf16(float value);
uint16_t float_to_fp16(float value);

// Exact widenings (every bf16 and fp16 value is a float; NaN payloads kept).
float bf16_to_float(uint16_t bits);
float fp16_to_float(uint16_t bits);

}  // namespace strata::cpu_adam
