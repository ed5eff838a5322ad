// Portable scalar kernels: Note [AdamW numerics] one element at a time, the
// same operation sequence as the SIMD kernels, so all agree bit for bit.
// Generic x86-64 has no FMA instruction: std::fma is a library call (glibc
// picks the FMA instruction where the CPU has one, else computes it exactly
// in software), slow but exact; this kernel is the fallback for CPUs without
// AVX2 and the reference the CUDA kernel is tested against.
#include <cmath>
#include <cstring>

#include "cpu_adam/kernel_simd.h"
#include "cpu_adam/kernels.h"

namespace strata::cpu_adam::detail {
namespace {

template <GradType G>
float load_grad(const void* grad, int64_t i) {
  if constexpr (G == GradType::kF32) return static_cast<const float*>(grad)[i];
  if constexpr (G == GradType::kBF16) return bf16_to_float(static_cast<const uint16_t*>(grad)[i]);
  if constexpr (G == GradType::kF16) return fp16_to_float(static_cast<const uint16_t*>(grad)[i]);
}

// Note [bf16 state]: the 32 random bits of element `index`.
uint32_t rounding_bits(const StepConstants& c, uint64_t index) {
  uint32_t x = static_cast<uint32_t>(index) * kRoundingIndexMul + c.step_key;
  x ^= x >> 16;
  x *= kRoundingMix1;
  x ^= x >> 15;
  x *= kRoundingMix2;
  return x ^ (x >> 16);
}

uint16_t bf16_stochastic(float x, uint32_t r16) {
  if (std::isnan(x)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return static_cast<uint16_t>((bits + r16) >> 16);
}

template <StateType S>
float load_state(const void* state, int64_t i) {
  if constexpr (S == StateType::kF32) return static_cast<const float*>(state)[i];
  if constexpr (S == StateType::kBF16) return bf16_to_float(static_cast<const uint16_t*>(state)[i]);
}

template <GradType G, EmitType E, DecayMode D, StateType S>
bool step_range(const StepConstants& c, const AdamSpans& s, int64_t begin, int64_t end) {
  float nonfinite = 0.0f;
  for (int64_t i = begin; i < end; ++i) {
    float g = load_grad<G>(s.grad, i) * c.grad_scale;
    nonfinite += g * 0.0f;  // NaN once any g is NaN or +-Inf
    float p = s.param[i];
    if constexpr (D == DecayMode::kL2) g = std::fma(p, c.weight_decay, g);
    if constexpr (D == DecayMode::kDecoupled) p = p * c.decay;
    float m = load_state<S>(s.exp_avg, i);
    m = std::fma(c.one_minus_beta1, g - m, m);
    float v = load_state<S>(s.exp_avg_sq, i);
    v = std::fma(c.one_minus_beta2 * g, g, v * c.beta2);
    const float denom = std::fma(std::sqrt(v), c.inv_bias_correction2_sqrt, c.eps);
    p = p + (c.neg_step_size * m) / denom;
    s.param[i] = p;
    if constexpr (S == StateType::kF32) {
      static_cast<float*>(s.exp_avg)[i] = m;
      static_cast<float*>(s.exp_avg_sq)[i] = v;
    } else {
      const uint32_t bits = rounding_bits(c, c.rounding_offset + i);
      static_cast<uint16_t*>(s.exp_avg)[i] = bf16_stochastic(m, bits & 0xFFFFu);
      static_cast<uint16_t*>(s.exp_avg_sq)[i] = bf16_stochastic(v, bits >> 16);
    }
    if constexpr (E == EmitType::kBF16) static_cast<uint16_t*>(s.emit)[i] = float_to_bf16(p);
    if constexpr (E == EmitType::kF16) static_cast<uint16_t*>(s.emit)[i] = float_to_fp16(p);
  }
  return !std::isnan(nonfinite);
}

template <GradType G, EmitType E, DecayMode D>
StepKernel pick_state(StateType st) {
  return st == StateType::kF32 ? &step_range<G, E, D, StateType::kF32>
                               : &step_range<G, E, D, StateType::kBF16>;
}

template <GradType G, EmitType E>
StepKernel pick_decay(DecayMode d, StateType st) {
  switch (d) {
    case DecayMode::kNone: return pick_state<G, E, DecayMode::kNone>(st);
    case DecayMode::kDecoupled: return pick_state<G, E, DecayMode::kDecoupled>(st);
    case DecayMode::kL2: return pick_state<G, E, DecayMode::kL2>(st);
  }
  return nullptr;
}

template <GradType G>
StepKernel pick_emit(EmitType e, DecayMode d, StateType st) {
  switch (e) {
    case EmitType::kNone: return pick_decay<G, EmitType::kNone>(d, st);
    case EmitType::kBF16: return pick_decay<G, EmitType::kBF16>(d, st);
    case EmitType::kF16: return pick_decay<G, EmitType::kF16>(d, st);
  }
  return nullptr;
}

bool scalar_step(const StepConstants& c, const AdamSpans& s, int64_t begin, int64_t end) {
  StepKernel kernel = nullptr;
  const DecayMode d = c.decay_mode;
  const StateType st = s.state_type;
  switch (s.grad_type) {
    case GradType::kF32: kernel = pick_emit<GradType::kF32>(s.emit_type, d, st); break;
    case GradType::kBF16: kernel = pick_emit<GradType::kBF16>(s.emit_type, d, st); break;
    case GradType::kF16: kernel = pick_emit<GradType::kF16>(s.emit_type, d, st); break;
  }
  return kernel(c, s, begin, end);
}

void scalar_convert(const float* src, void* dst, EmitType type, int64_t /*numel*/, int64_t begin,
                    int64_t end) {
  uint16_t* out = static_cast<uint16_t*>(dst);
  if (type == EmitType::kBF16) {
    for (int64_t i = begin; i < end; ++i) out[i] = float_to_bf16(src[i]);
  } else if (type == EmitType::kF16) {
    for (int64_t i = begin; i < end; ++i) out[i] = float_to_fp16(src[i]);
  }
}

// Note [Fused cross-entropy] over kernel_simd.h's code with one-float
// "vectors": the same operations in the same order as the SIMD kernels.
struct Scalar {
  static constexpr int kWidth = 1;
  using F = float;
  using H = uint16_t;
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static F load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  static F load_f16(const uint16_t* p) { return fp16_to_float(*p); }
  static H to_bf16(F x) { return float_to_bf16(x); }
  static H to_f16(F x) { return float_to_fp16(x); }
  static void store16(uint16_t* p, H h) { *p = h; }
  static F set1(float x) { return x; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F fma(F a, F b, F c) { return std::fma(a, b, c); }
  static F max(F a, F b) { return a > b ? a : b; }  // b where either is NaN, as vmaxps
  static F round(F a) { return std::nearbyint(a); }  // the default rounding: to nearest even
  // A NaN n (from a NaN argument, whose a is NaN too) is not converted to int (undefined).
  static F scale2(F a, F n) { return n != n ? a : std::ldexp(a, static_cast<int>(n)); }
};

}  // namespace

Kernels scalar_kernels() { return {&scalar_step, &scalar_convert, &simd_cross_entropy<Scalar>}; }

}  // namespace strata::cpu_adam::detail
