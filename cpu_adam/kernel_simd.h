// Internal: the Adam step and the 16-bit conversion written once over a
// vector type V, included by the SIMD kernel files (kernel_avx2.cc,
// kernel_avx512.cc), each with its own V and its own -m flags.
//
// V provides: kWidth (floats per vector), F (vector of floats), H (kWidth
// 16-bit values), and static functions: load/store of fp32; load_bf16 and
// load_f16 (widen to F); to_bf16 and to_f16 (F -> H, Note [16-bit rounding]);
// store16 and stream16 (a non-temporal store, REQUIRES: sizeof(H)-aligned)
// of H, and fence() after streaming; set1, add, sub, mul, div, sqrt,
// fma(a, b, c) = a*b + c rounded once, and any_nan. For Note [bf16 state]:
// I (kWidth 32-bit integers), lanes() = {0, 1, ..., kWidth-1}, set1_u32,
// add_u32, mul_u32 (low 32 bits), xor_u32, and_u32, srl_u32<N>, and
// bf16_stochastic(x, r) = the high halves of bits(x) + r (r < 2^16) as H,
// 0x7FC0 for NaN. For Note [Fused cross-entropy]: max(a, b), round(a) (to
// the nearest integer, ties to even), scale2(a, n) = a x 2^n for an integral
// n in [-126, 0], rounded once.
//
// Everything here is in an anonymous namespace and templated on V (itself in
// an anonymous namespace of the including file), so no symbol compiled with
// one file's -m flags can be picked by the linker for another file.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_adam/kernels.h"

namespace strata::cpu_adam::detail {
namespace {

template <class V>
struct VectorConstants {
  typename V::F grad_scale, decay, weight_decay, one_minus_beta1, beta2, one_minus_beta2,
      inv_bias_correction2_sqrt, neg_step_size, eps, zero;
  typename V::I lane_keys, mix1, mix2, low16;  // Note [bf16 state]
  uint64_t rounding_offset;
  uint32_t step_key;
  explicit VectorConstants(const StepConstants& c)
      : grad_scale(V::set1(c.grad_scale)),
        decay(V::set1(c.decay)),
        weight_decay(V::set1(c.weight_decay)),
        one_minus_beta1(V::set1(c.one_minus_beta1)),
        beta2(V::set1(c.beta2)),
        one_minus_beta2(V::set1(c.one_minus_beta2)),
        inv_bias_correction2_sqrt(V::set1(c.inv_bias_correction2_sqrt)),
        neg_step_size(V::set1(c.neg_step_size)),
        eps(V::set1(c.eps)),
        zero(V::set1(0.0f)),
        lane_keys(V::mul_u32(V::lanes(), V::set1_u32(kRoundingIndexMul))),
        mix1(V::set1_u32(kRoundingMix1)),
        mix2(V::set1_u32(kRoundingMix2)),
        low16(V::set1_u32(0xFFFFu)),
        rounding_offset(c.rounding_offset),
        step_key(c.step_key) {}
};

// Note [bf16 state]: 32 random bits for each of the kWidth elements from
// `index` on (index = rounding_offset + position in the span).
template <class V>
inline typename V::I rounding_bits(const VectorConstants<V>& k, uint64_t index) {
  const uint32_t base = static_cast<uint32_t>(index) * kRoundingIndexMul + k.step_key;
  typename V::I x = V::add_u32(V::set1_u32(base), k.lane_keys);
  x = V::xor_u32(x, V::template srl_u32<16>(x));
  x = V::mul_u32(x, k.mix1);
  x = V::xor_u32(x, V::template srl_u32<15>(x));
  x = V::mul_u32(x, k.mix2);
  return V::xor_u32(x, V::template srl_u32<16>(x));
}

template <class V, StateType S>
inline typename V::F load_state(const void* state, int64_t i) {
  if constexpr (S == StateType::kF32) {
    return V::load(static_cast<const float*>(state) + i);
  } else {
    return V::load_bf16(static_cast<const uint16_t*>(state) + i);
  }
}

// r: the element's 16 random bits (bf16 state only).
template <class V, StateType S>
inline void store_state(void* state, int64_t i, typename V::F x, typename V::I r) {
  if constexpr (S == StateType::kF32) {
    V::store(static_cast<float*>(state) + i, x);
  } else {
    V::store16(static_cast<uint16_t*>(state) + i, V::bf16_stochastic(x, r));
  }
}

template <class V, GradType G>
inline typename V::F load_grad(const void* grad, int64_t i) {
  if constexpr (G == GradType::kF32) {
    return V::load(static_cast<const float*>(grad) + i);
  } else if constexpr (G == GradType::kBF16) {
    return V::load_bf16(static_cast<const uint16_t*>(grad) + i);
  } else {
    return V::load_f16(static_cast<const uint16_t*>(grad) + i);
  }
}

// Note [Streaming the 16-bit copy]
// The emitted 16-bit parameters are written and not read again by the CPU
// (they go to the GPU or to NVMe next), so when the destination is aligned
// they are written with non-temporal stores: these skip the read-for-ownership
// of each destination line, 2 of the ~32 bytes of DRAM traffic per element.
// The state arrays are read first, so their lines are in cache anyway and
// are stored normally. A range that streamed ends with a store fence, so the
// bytes are visible to whichever thread continues after the parallel loop.
// Small calls, whose arrays may all still be in the last-level cache (and be
// read from there next), store normally.
template <class V, EmitType E, bool kStream>
inline void store_emit(void* emit, int64_t i, typename V::F x) {
  if constexpr (E != EmitType::kNone) {
    const typename V::H h = E == EmitType::kBF16 ? V::to_bf16(x) : V::to_f16(x);
    uint16_t* out = static_cast<uint16_t*>(emit) + i;
    if constexpr (kStream) {
      V::stream16(out, h);
    } else {
      V::store16(out, h);
    }
  }
}

// Calls on fewer elements never stream: their ~30 bytes per element of
// traffic fit in a typical last-level cache.
constexpr int64_t kStreamMinNumel = int64_t{1} << 20;

// Whether emit[begin...] of a call on numel elements is streamed: vectors
// start at begin + k*kWidth, so an aligned begin makes every full vector
// aligned.
template <class V>
inline bool can_stream(const void* emit, int64_t numel, int64_t begin) {
  const auto address = reinterpret_cast<uintptr_t>(static_cast<const uint16_t*>(emit) + begin);
  return numel >= kStreamMinNumel && address % sizeof(typename V::H) == 0;
}

// One vector of Note [AdamW numerics], at element i of each span; `index` is
// the first element's index for the rounding hash (Note [bf16 state]).
// `nonfinite` accumulates g*0 + acc, which turns NaN as soon as any g is NaN
// or +-Inf.
template <class V, GradType G, EmitType E, DecayMode D, StateType S, bool kStream>
inline void step_vector(const VectorConstants<V>& k, float* param, const void* grad,
                        void* exp_avg, void* exp_avg_sq, void* emit, int64_t i, uint64_t index,
                        typename V::F& nonfinite) {
  using F = typename V::F;
  F g = V::mul(load_grad<V, G>(grad, i), k.grad_scale);
  nonfinite = V::fma(g, k.zero, nonfinite);
  F p = V::load(param + i);
  if constexpr (D == DecayMode::kL2) g = V::fma(p, k.weight_decay, g);
  if constexpr (D == DecayMode::kDecoupled) p = V::mul(p, k.decay);
  F m = load_state<V, S>(exp_avg, i);
  m = V::fma(k.one_minus_beta1, V::sub(g, m), m);
  F v = load_state<V, S>(exp_avg_sq, i);
  v = V::fma(V::mul(k.one_minus_beta2, g), g, V::mul(v, k.beta2));
  const F denom = V::fma(V::sqrt(v), k.inv_bias_correction2_sqrt, k.eps);
  p = V::add(p, V::div(V::mul(k.neg_step_size, m), denom));
  V::store(param + i, p);
  if constexpr (S == StateType::kF32) {
    store_state<V, S>(exp_avg, i, m, k.low16);
    store_state<V, S>(exp_avg_sq, i, v, k.low16);
  } else {
    const typename V::I bits = rounding_bits(k, index);
    store_state<V, S>(exp_avg, i, m, V::and_u32(bits, k.low16));
    store_state<V, S>(exp_avg_sq, i, v, V::template srl_u32<16>(bits));
  }
  store_emit<V, E, kStream>(emit, i, p);
}

inline int state_bytes(StateType type) { return type == StateType::kF32 ? 4 : 2; }

inline int grad_bytes(GradType type) { return type == GradType::kF32 ? 4 : 2; }

template <class V, GradType G, EmitType E, DecayMode D, StateType S>
bool step_range(const StepConstants& c, const AdamSpans& s, int64_t begin, int64_t end) {
  constexpr int W = V::kWidth;
  const VectorConstants<V> k(c);
  typename V::F nonfinite = k.zero;
  int64_t i = begin;
  if (E != EmitType::kNone && can_stream<V>(s.emit, s.numel, begin)) {  // Note [Streaming the 16-bit copy]
    for (; i + W <= end; i += W) {
      step_vector<V, G, E, D, S, true>(k, s.param, s.grad, s.exp_avg, s.exp_avg_sq, s.emit, i,
                                       k.rounding_offset + i, nonfinite);
    }
    V::fence();
  }
  for (; i + W <= end; i += W) {
    step_vector<V, G, E, D, S, false>(k, s.param, s.grad, s.exp_avg, s.exp_avg_sq, s.emit, i,
                                      k.rounding_offset + i, nonfinite);
  }
  if (i < end) {
    // The tail runs the same vector code on zero-padded copies, so every
    // element sees the same arithmetic (a zero gradient is finite) and draws
    // the same rounding bits.
    const int64_t n = end - i;
    const int gb = grad_bytes(G);
    const int sb = state_bytes(S);
    alignas(64) float p[W] = {};
    alignas(64) unsigned char m[W * 4] = {};
    alignas(64) unsigned char v[W * 4] = {};
    alignas(64) unsigned char g[W * 4] = {};
    alignas(64) uint16_t e[W] = {};
    std::memcpy(p, s.param + i, n * sizeof(float));
    std::memcpy(m, static_cast<const unsigned char*>(s.exp_avg) + i * sb, n * sb);
    std::memcpy(v, static_cast<const unsigned char*>(s.exp_avg_sq) + i * sb, n * sb);
    std::memcpy(g, static_cast<const unsigned char*>(s.grad) + i * gb, n * gb);
    step_vector<V, G, E, D, S, false>(k, p, g, m, v, e, 0, k.rounding_offset + i, nonfinite);
    std::memcpy(s.param + i, p, n * sizeof(float));
    std::memcpy(static_cast<unsigned char*>(s.exp_avg) + i * sb, m, n * sb);
    std::memcpy(static_cast<unsigned char*>(s.exp_avg_sq) + i * sb, v, n * sb);
    if constexpr (E != EmitType::kNone) {
      std::memcpy(static_cast<uint16_t*>(s.emit) + i, e, n * sizeof(uint16_t));
    }
  }
  return !V::any_nan(nonfinite);
}

template <class V, GradType G, EmitType E, DecayMode D>
StepKernel pick_state(StateType st) {
  return st == StateType::kF32 ? &step_range<V, G, E, D, StateType::kF32>
                               : &step_range<V, G, E, D, StateType::kBF16>;
}

template <class V, GradType G, EmitType E>
StepKernel pick_decay(DecayMode d, StateType st) {
  switch (d) {
    case DecayMode::kNone: return pick_state<V, G, E, DecayMode::kNone>(st);
    case DecayMode::kDecoupled: return pick_state<V, G, E, DecayMode::kDecoupled>(st);
    case DecayMode::kL2: return pick_state<V, G, E, DecayMode::kL2>(st);
  }
  return nullptr;
}

template <class V, GradType G>
StepKernel pick_emit(EmitType e, DecayMode d, StateType st) {
  switch (e) {
    case EmitType::kNone: return pick_decay<V, G, EmitType::kNone>(d, st);
    case EmitType::kBF16: return pick_decay<V, G, EmitType::kBF16>(d, st);
    case EmitType::kF16: return pick_decay<V, G, EmitType::kF16>(d, st);
  }
  return nullptr;
}

// The step entry point of a SIMD kernel file: picks the instantiation for
// this call's types and runs it.
template <class V>
bool simd_step(const StepConstants& c, const AdamSpans& s, int64_t begin, int64_t end) {
  StepKernel kernel = nullptr;
  const DecayMode d = c.decay_mode;
  const StateType st = s.state_type;
  switch (s.grad_type) {
    case GradType::kF32: kernel = pick_emit<V, GradType::kF32>(s.emit_type, d, st); break;
    case GradType::kBF16: kernel = pick_emit<V, GradType::kBF16>(s.emit_type, d, st); break;
    case GradType::kF16: kernel = pick_emit<V, GradType::kF16>(s.emit_type, d, st); break;
  }
  return kernel(c, s, begin, end);
}

template <class V, EmitType E>
void convert_range(const float* src, void* dst, int64_t numel, int64_t begin, int64_t end) {
  constexpr int W = V::kWidth;
  int64_t i = begin;
  if (can_stream<V>(dst, numel, begin)) {  // Note [Streaming the 16-bit copy]
    for (; i + W <= end; i += W) store_emit<V, E, true>(dst, i, V::load(src + i));
    V::fence();
  }
  for (; i + W <= end; i += W) store_emit<V, E, false>(dst, i, V::load(src + i));
  if (i < end) {
    const int64_t n = end - i;
    alignas(64) float x[W] = {};
    alignas(64) uint16_t y[W] = {};
    std::memcpy(x, src + i, n * sizeof(float));
    store_emit<V, E, false>(y, 0, V::load(x));
    std::memcpy(static_cast<uint16_t*>(dst) + i, y, n * sizeof(uint16_t));
  }
}

template <class V>
void simd_convert(const float* src, void* dst, EmitType type, int64_t numel, int64_t begin,
                  int64_t end) {
  if (type == EmitType::kBF16) convert_range<V, EmitType::kBF16>(src, dst, numel, begin, end);
  if (type == EmitType::kF16) convert_range<V, EmitType::kF16>(src, dst, numel, begin, end);
}

// ---- Note [Fused cross-entropy] (cpu_adam/cross_entropy.h) ----

// exp(d) for d <= 0 (d below -87 taken as -87), one sequence of IEEE
// operations: n = round(z / ln 2), r = z - n ln 2 in two fused steps (ln 2
// split so that n x kLn2Hi is exact), e^r by its Taylor polynomial of degree 7
// (|r| <= ln 2 / 2: truncation below 6e-9 relative) in Horner form, times 2^n.
constexpr float kExpFloor = -87.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpTaylor[8] = {1.0f,        1.0f,         0.5f,          1.0f / 6.0f,
                                 1.0f / 24.0f, 1.0f / 120.0f, 1.0f / 720.0f, 1.0f / 5040.0f};

template <class V>
inline typename V::F exp_nonpositive(typename V::F d) {
  using F = typename V::F;
  const F z = V::max(V::set1(kExpFloor), d);  // a NaN d stays NaN (max gives its second operand)
  const F n = V::round(V::mul(z, V::set1(kLog2e)));
  F r = V::fma(n, V::set1(-kLn2Hi), z);
  r = V::fma(n, V::set1(-kLn2Lo), r);
  F p = V::set1(kExpTaylor[7]);
  for (int k = 6; k >= 0; --k) p = V::fma(p, r, V::set1(kExpTaylor[k]));
  return V::scale2(p, n);
}

// One value of a row, widened exactly (out-of-line scalar conversions).
template <GradType T>
inline float widen_one(const void* row, int64_t i) {
  if constexpr (T == GradType::kF32) return static_cast<const float*>(row)[i];
  if constexpr (T == GradType::kBF16) return bf16_to_float(static_cast<const uint16_t*>(row)[i]);
  if constexpr (T == GradType::kF16) return fp16_to_float(static_cast<const uint16_t*>(row)[i]);
}

template <class V, GradType T>
inline void store_logit(void* row, int64_t i, typename V::F x) {
  if constexpr (T == GradType::kF32) {
    V::store(static_cast<float*>(row) + i, x);
  } else {
    V::store16(static_cast<uint16_t*>(row) + i, T == GradType::kBF16 ? V::to_bf16(x) : V::to_f16(x));
  }
}

// The kCrossEntropyLanes lanes of `parts` folded as Note [Fused
// cross-entropy]'s tree, by max or by sum.
template <class V, bool kMax>
inline float fold_lanes(const typename V::F* parts) {
  constexpr int W = V::kWidth;
  alignas(64) float l[kCrossEntropyLanes];
  for (int p = 0; p < kCrossEntropyLanes / W; ++p) V::store(l + p * W, parts[p]);
  for (int half = kCrossEntropyLanes / 2; half > 0; half /= 2) {
    for (int i = 0; i < half; ++i) l[i] = kMax ? (l[i + half] > l[i] ? l[i + half] : l[i]) : l[i] + l[i + half];
  }
  return l[0];
}

template <class V, GradType T>
void cross_entropy_range(const CrossEntropyRows& a, int64_t begin, int64_t end) {
  using F = typename V::F;
  constexpr int W = V::kWidth, P = kCrossEntropyLanes / W, L = kCrossEntropyLanes;
  const int eb = grad_bytes(T);
  const int64_t full = a.vocab / L * L, tail = a.vocab - full;
  for (int64_t row = begin; row < end; ++row) {
    unsigned char* x = static_cast<unsigned char*>(a.logits) + row * a.stride * eb;
    const int64_t t = a.targets[row];
    if (t == a.ignore_index) {
      a.row_loss[row] = 0.0f;
      if (a.write_grad) std::memset(x, 0, size_t(a.vocab) * size_t(eb));  // +0 in every type
      continue;
    }
    // The short last block, widened once; its padding never counts.
    alignas(64) float last[L];
    for (int i = 0; i < L; ++i) last[i] = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < tail; ++i) last[i] = widen_one<T>(x, full + i);
    F acc[P];
    for (F& v : acc) v = V::set1(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < full; i += L) {
      for (int p = 0; p < P; ++p) acc[p] = V::max(acc[p], load_grad<V, T>(x, i + p * W));
    }
    if (tail > 0) {
      for (int p = 0; p < P; ++p) acc[p] = V::max(acc[p], V::load(last + p * W));
    }
    const float m = fold_lanes<V, true>(acc);
    const F mv = V::set1(m);
    for (F& v : acc) v = V::set1(0.0f);
    for (int64_t i = 0; i < full; i += L) {
      for (int p = 0; p < P; ++p) {
        acc[p] = V::add(acc[p], exp_nonpositive<V>(V::sub(load_grad<V, T>(x, i + p * W), mv)));
      }
    }
    alignas(64) float e_last[L] = {};
    if (tail > 0) {
      for (int p = 0; p < P; ++p) V::store(e_last + p * W, exp_nonpositive<V>(V::sub(V::load(last + p * W), mv)));
      for (int i = int(tail); i < L; ++i) e_last[i] = 0.0f;
      for (int p = 0; p < P; ++p) acc[p] = V::add(acc[p], V::load(e_last + p * W));
    }
    const float s = fold_lanes<V, false>(acc);
    const float xt = widen_one<T>(x, t);
    a.row_loss[row] = std::log(s) - (xt - m);
    if (!a.write_grad) continue;
    const float c = a.grad_scale / s;
    const F cv = V::set1(c);
    for (int64_t i = 0; i < full; i += L) {
      for (int p = 0; p < P; ++p) {
        const F e = exp_nonpositive<V>(V::sub(load_grad<V, T>(x, i + p * W), mv));
        store_logit<V, T>(x, i + p * W, V::mul(e, cv));
      }
    }
    if (tail > 0) {
      alignas(64) unsigned char out[L * 4];
      for (int p = 0; p < P; ++p) store_logit<V, T>(out, p * W, V::mul(V::load(e_last + p * W), cv));
      std::memcpy(x + full * eb, out, size_t(tail) * size_t(eb));
    }
    // The target's own value: the same lane arithmetic on x_t, less grad_scale.
    alignas(64) unsigned char out_t[L * 4];
    const F gt = V::sub(V::mul(exp_nonpositive<V>(V::set1(xt - m)), cv), V::set1(a.grad_scale));
    store_logit<V, T>(out_t, 0, gt);
    std::memcpy(x + t * eb, out_t, size_t(eb));
  }
}

template <class V>
void simd_cross_entropy(const CrossEntropyRows& a, int64_t begin, int64_t end) {
  switch (a.type) {
    case GradType::kF32: cross_entropy_range<V, GradType::kF32>(a, begin, end); break;
    case GradType::kBF16: cross_entropy_range<V, GradType::kBF16>(a, begin, end); break;
    case GradType::kF16: cross_entropy_range<V, GradType::kF16>(a, begin, end); break;
  }
}

}  // namespace
}  // namespace strata::cpu_adam::detail
