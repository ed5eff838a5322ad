// Tests only: scalar stand-ins for exactly the AVX-512 intrinsics that
// cpu_adam/kernel_avx512.cc uses, so that its code runs (slowly) on CPUs
// without AVX-512, like the CI machines. Each follows the operation described
// in Intel's Intrinsics Guide, including what the kernel must correct:
// vcvtneps2bf16 flushes denormals to zero and keeps NaN payloads, vcvtps2ph
// keeps NaN payloads. Compiled in place of <immintrin.h> when
// STRATA_CPU_ADAM_EMULATE_AVX512 is defined (tests/cpu_adam.cmake).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_adam/convert.h"

typedef float __m512 __attribute__((__vector_size__(64), __may_alias__));
typedef long long __m512i __attribute__((__vector_size__(64), __may_alias__));
typedef long long __m256i __attribute__((__vector_size__(32), __may_alias__));
typedef short __m256bh __attribute__((__vector_size__(32), __may_alias__));
typedef uint16_t __mmask16;

#define _CMP_UNORD_Q 0x03
#define _MM_FROUND_TO_NEAREST_INT 0x00
#define _MM_FROUND_NO_EXC 0x08

namespace avx512_emulation {

struct F32x16 { float v[16]; };
struct U32x16 { uint32_t v[16]; };
struct U16x16 { uint16_t v[16]; };

template <class To, class From>
inline To as(const From& x) {
  static_assert(sizeof(To) == sizeof(From));
  To t;
  std::memcpy(&t, &x, sizeof(To));
  return t;
}

template <class Op>
inline __m512 map_ps(__m512 a, __m512 b, Op op) {
  F32x16 x = as<F32x16>(a), y = as<F32x16>(b);
  for (int i = 0; i < 16; ++i) x.v[i] = op(x.v[i], y.v[i]);
  return as<__m512>(x);
}

template <class Op>
inline __m512i map_epi32(__m512i a, __m512i b, Op op) {
  U32x16 x = as<U32x16>(a), y = as<U32x16>(b);
  for (int i = 0; i < 16; ++i) x.v[i] = op(x.v[i], y.v[i]);
  return as<__m512i>(x);
}

template <class Op>
inline __mmask16 cmp_epu32(__m512i a, __m512i b, Op op) {
  U32x16 x = as<U32x16>(a), y = as<U32x16>(b);
  __mmask16 k = 0;
  for (int i = 0; i < 16; ++i) k |= static_cast<__mmask16>(op(x.v[i], y.v[i]) ? 1u << i : 0u);
  return k;
}

// Intel's convert_fp32_to_bfloat16 for vcvtneps2bf16.
inline uint16_t bf16_instruction(float f) {
  const uint32_t b = std::bit_cast<uint32_t>(f);
  if ((b & 0x7F800000u) == 0) return static_cast<uint16_t>((b >> 16) & 0x8000u);  // zero/denormal
  if ((b & 0x7FFFFFFFu) == 0x7F800000u) return static_cast<uint16_t>(b >> 16);    // Inf
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);  // QNaN
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// vcvtps2ph: IEEE round to nearest even; a NaN is quieted, its payload truncated.
inline uint16_t fp16_instruction(float f) {
  const uint32_t b = std::bit_cast<uint32_t>(f);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) {
    return static_cast<uint16_t>(((b >> 16) & 0x8000u) | 0x7E00u | ((b >> 13) & 0x3FFu));
  }
  return strata::cpu_adam::float_to_fp16(f);
}

}  // namespace avx512_emulation

#define EMU_INLINE static inline
using avx512_emulation::as;

EMU_INLINE __m512 _mm512_loadu_ps(const float* p) { __m512 r; std::memcpy(&r, p, 64); return r; }
EMU_INLINE void _mm512_storeu_ps(float* p, __m512 x) { std::memcpy(p, &x, 64); }
EMU_INLINE __m256i _mm256_loadu_si256(const __m256i* p) { __m256i r; std::memcpy(&r, p, 32); return r; }
EMU_INLINE void _mm256_storeu_si256(__m256i* p, __m256i x) { std::memcpy(p, &x, 32); }
EMU_INLINE void _mm256_stream_si256(__m256i* p, __m256i x) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0) __builtin_trap();  // the instruction faults
  std::memcpy(p, &x, 32);
}
EMU_INLINE void _mm_sfence() {}

EMU_INLINE __m512 _mm512_set1_ps(float x) {
  avx512_emulation::F32x16 r;
  for (float& f : r.v) f = x;
  return as<__m512>(r);
}
EMU_INLINE __m512i _mm512_set1_epi32(int x) {
  avx512_emulation::U32x16 r;
  for (uint32_t& u : r.v) u = static_cast<uint32_t>(x);
  return as<__m512i>(r);
}
EMU_INLINE __m512 _mm512_castsi512_ps(__m512i x) { return as<__m512>(x); }
EMU_INLINE __m512i _mm512_castps_si512(__m512 x) { return as<__m512i>(x); }

EMU_INLINE __m512 _mm512_add_ps(__m512 a, __m512 b) { return avx512_emulation::map_ps(a, b, [](float x, float y) { return x + y; }); }
EMU_INLINE __m512 _mm512_sub_ps(__m512 a, __m512 b) { return avx512_emulation::map_ps(a, b, [](float x, float y) { return x - y; }); }
EMU_INLINE __m512 _mm512_mul_ps(__m512 a, __m512 b) { return avx512_emulation::map_ps(a, b, [](float x, float y) { return x * y; }); }
EMU_INLINE __m512 _mm512_div_ps(__m512 a, __m512 b) { return avx512_emulation::map_ps(a, b, [](float x, float y) { return x / y; }); }
EMU_INLINE __m512 _mm512_sqrt_ps(__m512 a) { return avx512_emulation::map_ps(a, a, [](float x, float) { return std::sqrt(x); }); }
EMU_INLINE __m512 _mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) {
  avx512_emulation::F32x16 x = as<avx512_emulation::F32x16>(a), y = as<avx512_emulation::F32x16>(b),
                           z = as<avx512_emulation::F32x16>(c);
  for (int i = 0; i < 16; ++i) x.v[i] = std::fma(x.v[i], y.v[i], z.v[i]);
  return as<__m512>(x);
}
// Note [Fused cross-entropy]'s: vmaxps gives the second operand where either is NaN.
EMU_INLINE __m512 _mm512_max_ps(__m512 a, __m512 b) { return avx512_emulation::map_ps(a, b, [](float x, float y) { return x > y ? x : y; }); }
EMU_INLINE __m512 _mm512_roundscale_ps(__m512 a, int imm) {
  if ((imm & ~_MM_FROUND_NO_EXC) != _MM_FROUND_TO_NEAREST_INT) __builtin_trap();  // the only one the kernel uses
  return avx512_emulation::map_ps(a, a, [](float x, float) { return std::nearbyint(x); });
}
EMU_INLINE __m512 _mm512_scalef_ps(__m512 a, __m512 b) {  // a x 2^floor(b), rounded once
  return avx512_emulation::map_ps(a, b, [](float x, float y) {
    return std::isnan(y) ? y : std::ldexp(x, static_cast<int>(std::floor(y)));  // no NaN to int conversion
  });
}
EMU_INLINE __mmask16 _mm512_cmp_ps_mask(__m512 a, __m512 b, int predicate) {
  if (predicate != _CMP_UNORD_Q) __builtin_trap();  // the only one the kernel uses
  avx512_emulation::F32x16 x = as<avx512_emulation::F32x16>(a), y = as<avx512_emulation::F32x16>(b);
  __mmask16 k = 0;
  for (int i = 0; i < 16; ++i) {
    if (std::isnan(x.v[i]) || std::isnan(y.v[i])) k |= static_cast<__mmask16>(1u << i);
  }
  return k;
}

EMU_INLINE __m512i _mm512_and_si512(__m512i a, __m512i b) { return avx512_emulation::map_epi32(a, b, [](uint32_t x, uint32_t y) { return x & y; }); }
EMU_INLINE __m512i _mm512_or_si512(__m512i a, __m512i b) { return avx512_emulation::map_epi32(a, b, [](uint32_t x, uint32_t y) { return x | y; }); }
EMU_INLINE __m512i _mm512_add_epi32(__m512i a, __m512i b) { return avx512_emulation::map_epi32(a, b, [](uint32_t x, uint32_t y) { return x + y; }); }
EMU_INLINE __m512i _mm512_xor_si512(__m512i a, __m512i b) { return avx512_emulation::map_epi32(a, b, [](uint32_t x, uint32_t y) { return x ^ y; }); }
EMU_INLINE __m512i _mm512_mullo_epi32(__m512i a, __m512i b) { return avx512_emulation::map_epi32(a, b, [](uint32_t x, uint32_t y) { return x * y; }); }
EMU_INLINE __m512i _mm512_load_si512(const void* p) {  // REQUIRES: 64-byte aligned
  if (reinterpret_cast<uintptr_t>(p) % 64 != 0) __builtin_trap();
  __m512i r;
  std::memcpy(&r, p, 64);
  return r;
}
EMU_INLINE __m512i _mm512_sub_epi32(__m512i a, __m512i b) { return avx512_emulation::map_epi32(a, b, [](uint32_t x, uint32_t y) { return x - y; }); }
EMU_INLINE __m512i _mm512_slli_epi32(__m512i a, unsigned n) {
  return avx512_emulation::map_epi32(a, a, [n](uint32_t x, uint32_t) { return n > 31 ? 0u : x << n; });
}
EMU_INLINE __m512i _mm512_srli_epi32(__m512i a, unsigned n) {
  return avx512_emulation::map_epi32(a, a, [n](uint32_t x, uint32_t) { return n > 31 ? 0u : x >> n; });
}
EMU_INLINE __mmask16 _mm512_cmpgt_epu32_mask(__m512i a, __m512i b) {
  return avx512_emulation::cmp_epu32(a, b, [](uint32_t x, uint32_t y) { return x > y; });
}
EMU_INLINE __mmask16 _mm512_cmplt_epu32_mask(__m512i a, __m512i b) {
  return avx512_emulation::cmp_epu32(a, b, [](uint32_t x, uint32_t y) { return x < y; });
}
EMU_INLINE __m512i _mm512_mask_blend_epi32(__mmask16 k, __m512i a, __m512i b) {
  avx512_emulation::U32x16 x = as<avx512_emulation::U32x16>(a), y = as<avx512_emulation::U32x16>(b);
  for (int i = 0; i < 16; ++i) {
    if (k & (1u << i)) x.v[i] = y.v[i];
  }
  return as<__m512i>(x);
}
EMU_INLINE __m256i _mm256_mask_blend_epi16(__mmask16 k, __m256i a, __m256i b) {
  avx512_emulation::U16x16 x = as<avx512_emulation::U16x16>(a), y = as<avx512_emulation::U16x16>(b);
  for (int i = 0; i < 16; ++i) {
    if (k & (1u << i)) x.v[i] = y.v[i];
  }
  return as<__m256i>(x);
}
EMU_INLINE __m512i _mm512_cvtepu16_epi32(__m256i a) {  // zero-extend
  avx512_emulation::U16x16 x = as<avx512_emulation::U16x16>(a);
  avx512_emulation::U32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = x.v[i];
  return as<__m512i>(r);
}
EMU_INLINE __m256i _mm512_cvtepi32_epi16(__m512i a) {  // truncate
  avx512_emulation::U32x16 x = as<avx512_emulation::U32x16>(a);
  avx512_emulation::U16x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<uint16_t>(x.v[i]);
  return as<__m256i>(r);
}
EMU_INLINE __m512 _mm512_cvtph_ps(__m256i a) {  // exact
  avx512_emulation::U16x16 x = as<avx512_emulation::U16x16>(a);
  avx512_emulation::F32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = strata::cpu_adam::fp16_to_float(x.v[i]);
  return as<__m512>(r);
}
EMU_INLINE __m256i _mm512_cvtps_ph(__m512 a, int rounding) {
  if (rounding != _MM_FROUND_TO_NEAREST_INT) __builtin_trap();
  avx512_emulation::F32x16 x = as<avx512_emulation::F32x16>(a);
  avx512_emulation::U16x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = avx512_emulation::fp16_instruction(x.v[i]);
  return as<__m256i>(r);
}
EMU_INLINE __m256bh _mm512_cvtneps_pbh(__m512 a) {
  avx512_emulation::F32x16 x = as<avx512_emulation::F32x16>(a);
  avx512_emulation::U16x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = avx512_emulation::bf16_instruction(x.v[i]);
  return as<__m256bh>(r);
}
