// AVX-512 kernels: 16 floats per vector. Compiled with -mavx512f -mavx512bw
// -mavx512vl -mavx512dq -mavx512bf16 -mfma -mf16c. Only the kBf16Insn = true
// instantiation contains AVX512-BF16 instructions (GCC emits them only for
// the intrinsics), and it runs only when best_isa() == Isa::kAvx512Bf16.
#ifdef STRATA_CPU_ADAM_EMULATE_AVX512
// Tests only: the same code over scalar stand-ins for the intrinsics, so that
// it can be checked on CPUs without AVX-512 (tests/avx512_emulation.h).
#include "avx512_emulation.h"
#define avx512_kernels emulated_avx512_kernels
#define avx512_bf16_kernels emulated_avx512_bf16_kernels
#else
#include <immintrin.h>
#endif

// GCC 12 warns about the _mm512_undefined_*() operands inside its own AVX-512
// intrinsics once they are inlined (GCC bug 105593, fixed in 12.3/13).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "cpu_adam/kernel_simd.h"

namespace strata::cpu_adam::detail {
namespace {

template <bool kBf16Insn>
struct Avx512 {
  static constexpr int kWidth = 16;
  using F = __m512;

  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static F load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }

  // Note [16-bit rounding] with integer operations: round to nearest even on
  // the bits, NaN -> 0x7FC0.
  using H = __m256i;  // 16 16-bit values
  static H bf16_exact(F x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i biased = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
    __m512i r = _mm512_srli_epi32(biased, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }
  // vcvtneps2bf16 rounds normal values and infinities exactly like the
  // integer path but flushes fp32 denormals to zero and keeps NaN payloads;
  // a vector holding either (essentially never, in training) takes the
  // integer path instead, so the bits never depend on the instruction set.
  static H to_bf16(F x) {
    H h;
    if constexpr (kBf16Insn) {
      h = (__m256i)_mm512_cvtneps_pbh(x);  // same 32 bytes, new type
      const __m512i abs = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
      const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7F800000));
      const __mmask16 denormal = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(abs, _mm512_set1_epi32(1)),
                                                         _mm512_set1_epi32(0x007FFFFF));
      if ((nan | denormal) != 0) h = bf16_exact(x);
    } else {
      h = bf16_exact(x);
    }
    return h;
  }
  // vcvtps2ph rounds to nearest even like c10; only NaN payloads differ, and
  // those rare lanes are replaced by c10's sign | 0x7E00.
  static H to_f16(F x) {
    H h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    if (nan != 0) {
      const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 16),
                                            _mm512_set1_epi32(0x8000));
      const __m256i canon = _mm512_cvtepi32_epi16(_mm512_or_si512(sign, _mm512_set1_epi32(0x7E00)));
      h = _mm256_mask_blend_epi16(nan, h, canon);
    }
    return h;
  }
  static void store16(uint16_t* p, H h) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h); }
  // REQUIRES: p 32-byte aligned.
  static void stream16(uint16_t* p, H h) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h); }
  static void fence() { _mm_sfence(); }

  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static bool any_nan(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0; }
  // Note [Fused cross-entropy]. max: b where either is NaN (as vmaxps).
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F round(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F scale2(F a, F n) { return _mm512_scalef_ps(a, n); }  // a x 2^floor(n), rounded once

  // Note [bf16 state]
  using I = __m512i;
  static I lanes() {
    alignas(64) static constexpr uint32_t kLanes[16] = {0, 1, 2,  3,  4,  5,  6,  7,
                                                        8, 9, 10, 11, 12, 13, 14, 15};
    return _mm512_load_si512(kLanes);
  }
  static I set1_u32(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static I add_u32(I a, I b) { return _mm512_add_epi32(a, b); }
  static I mul_u32(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I xor_u32(I a, I b) { return _mm512_xor_si512(a, b); }
  static I and_u32(I a, I b) { return _mm512_and_si512(a, b); }
  template <int N>
  static I srl_u32(I a) { return _mm512_srli_epi32(a, N); }
  static H bf16_stochastic(F x, I r) {
    __m512i h = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    h = _mm512_mask_blend_epi32(nan, h, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(h);
  }
};

}  // namespace

Kernels avx512_kernels() {
  return {&simd_step<Avx512<false>>, &simd_convert<Avx512<false>>, &simd_cross_entropy<Avx512<false>>};
}

Kernels avx512_bf16_kernels() {
  return {&simd_step<Avx512<true>>, &simd_convert<Avx512<true>>, &simd_cross_entropy<Avx512<true>>};
}

}  // namespace strata::cpu_adam::detail
