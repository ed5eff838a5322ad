// Scalar 16-bit conversions written from the IEEE 754 rules (Note [16-bit rounding]).
#include "cpu_adam/convert.h"

#include <bit>

namespace strata::cpu_adam {

const char* emit_type_name(EmitType type) {
  switch (type) {
    case EmitType::kNone: return "none";
    case EmitType::kBF16: return "bf16";
    case EmitType::kF16: return "fp16";
  }
  return "?";
}

uint16_t float_to_bf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN
  // Adding 0x7FFF rounds halfway cases down and 0x8000 rounds them up: pick by
  // the lowest kept bit so that ties go to even. A carry out of the mantissa
  // bumps the exponent, which is the correct result (up to Inf).
  const uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7FFFu + lsb) >> 16);
}

float bf16_to_float(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

namespace {

// Rounds x / 2^shift to nearest, ties to even. REQUIRES: 1 <= shift <= 31.
uint32_t shift_right_rne(uint32_t x, int shift) {
  const uint32_t kept = x >> shift;
  const uint32_t rest = x & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

}  // namespace

uint16_t float_to_fp16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return sign | 0x7E00;  // NaN
  // 65520 = 0x1.ffcp15 + half an fp16 ulp is the first value that rounds to
  // Inf (the tie goes to the even neighbour, 2^16 = Inf).
  if (abs >= 0x477FF000u) return sign | 0x7C00;
  if (abs >= 0x38800000u) {  // >= 2^-14: an fp16 normal
    // Rebias the exponent (127 -> 15) and round the 23-bit mantissa to 10
    // bits; a carry into the exponent is again the correct result.
    const uint32_t rebased = abs - ((127u - 15u) << 23);
    return sign | static_cast<uint16_t>(shift_right_rne(rebased, 13));
  }
  // fp16 denormal or zero: the result counts units of 2^-24. Anything up to
  // 2^-25 (half a unit; the tie goes to even, 0) is zero, fp32 denormals too.
  if (abs <= 0x33000000u) return sign;
  const uint32_t exponent = abs >> 23;                     // 102..112 here
  const uint32_t mantissa = (abs & 0x7FFFFFu) | 0x800000u;  // value = mantissa * 2^(exponent-150)
  return sign | static_cast<uint16_t>(shift_right_rne(mantissa, static_cast<int>(126 - exponent)));
}

float fp16_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1Fu;
  const uint32_t mantissa = bits & 0x3FFu;
  if (exponent == 0) {  // zero or denormal: mantissa * 2^-24, exact in fp32
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return std::bit_cast<float>(std::bit_cast<uint32_t>(magnitude) | sign);
  }
  if (exponent == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 127 - 15) << 23) | (mantissa << 13));
}

}  // namespace strata::cpu_adam
