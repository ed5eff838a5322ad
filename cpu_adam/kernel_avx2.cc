// AVX2 + FMA + F16C kernels: 8 floats per vector. Compiled with
// -mavx2 -mfma -mf16c; called only when best_isa() >= Isa::kAvx2.
#include <immintrin.h>

#include "cpu_adam/kernel_simd.h"

namespace strata::cpu_adam::detail {
namespace {

struct Avx2 {
  static constexpr int kWidth = 8;
  using F = __m256;

  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static F load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // Note [16-bit rounding]: round to nearest even on the bits, NaN -> 0x7FC0.
  using H = __m128i;  // 8 16-bit values
  static H to_bf16(F x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i biased = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
    __m256i r = _mm256_srli_epi32(biased, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // Values are 0..0xFFFF, so the signed-to-unsigned saturating pack keeps them.
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  // vcvtps2ph rounds to nearest even like c10; only NaN payloads differ, and
  // those rare lanes are replaced by c10's sign | 0x7E00.
  static H to_f16(F x) {
    __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    if (_mm256_movemask_ps(nan) != 0) {
      const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 16),
                                            _mm256_set1_epi32(0x8000));
      const __m256i canon = _mm256_or_si256(sign, _mm256_set1_epi32(0x7E00));
      const __m128i canon16 =
          _mm_packus_epi32(_mm256_castsi256_si128(canon), _mm256_extracti128_si256(canon, 1));
      const __m256i mask32 = _mm256_castps_si256(nan);
      const __m128i mask16 =
          _mm_packs_epi32(_mm256_castsi256_si128(mask32), _mm256_extracti128_si256(mask32, 1));
      h = _mm_blendv_epi8(h, canon16, mask16);
    }
    return h;
  }
  static void store16(uint16_t* p, H h) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h); }
  // REQUIRES: p 16-byte aligned.
  static void stream16(uint16_t* p, H h) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), h); }
  static void fence() { _mm_sfence(); }

  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static bool any_nan(F a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0; }
  // Note [Fused cross-entropy]. max: b where either is NaN (as vmaxps).
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F round(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F scale2(F a, F n) {  // n integral in [-126, 0]: 2^n is a normal float
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(a, _mm256_castsi256_ps(e));
  }

  // Note [bf16 state]
  using I = __m256i;
  static I lanes() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static I set1_u32(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static I add_u32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I mul_u32(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I xor_u32(I a, I b) { return _mm256_xor_si256(a, b); }
  static I and_u32(I a, I b) { return _mm256_and_si256(a, b); }
  template <int N>
  static I srl_u32(I a) { return _mm256_srli_epi32(a, N); }
  static H bf16_stochastic(F x, I r) {
    __m256i h = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7FC0), nan);
    // Values are 0..0xFFFF, so the signed-to-unsigned saturating pack keeps them.
    return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  }
};

}  // namespace

Kernels avx2_kernels() { return {&simd_step<Avx2>, &simd_convert<Avx2>, &simd_cross_entropy<Avx2>}; }

}  // namespace strata::cpu_adam::detail
