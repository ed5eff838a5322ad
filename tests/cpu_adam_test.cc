// Tests of cpu_adam: every kernel (forced) against a double-precision scalar
// reference of Note [AdamW numerics], the 16-bit conversions against
// independent oracles and edge cases, non-finite detection, threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_adam/adam.h"
#include "cpu_adam/grad_ops.h"
#include "cpu_adam_reference.h"

namespace strata::cpu_adam {
namespace {

constexpr Isa kAllIsas[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16};
// The largest size spans many tiles and both threads. Under AddressSanitizer (tools/test_sanitize.sh) it is
// 10x smaller, still 6 tiles: the double reference over 1 M elements x 100 steps takes 35 s a case there.
#if defined(__SANITIZE_ADDRESS__)
constexpr int64_t kSizes[] = {1, 7, 15, 16, 17, 4097, 100003};
#else
constexpr int64_t kSizes[] = {1, 7, 15, 16, 17, 4097, 1000003};
#endif
constexpr int kSteps = 100;
constexpr double kTolerance = 1e-6;            // max relative error per step, see Reference
constexpr double kTrajectoryTolerance = 1e-5;  // after 100 steps of fp32 storage, see Reference

#define SKIP_UNLESS_SUPPORTED(isa)                                                \
  do {                                                                            \
    if (!isa_supported(isa)) {                                                    \
      GTEST_SKIP() << "CPU lacks " << isa_name(isa);                              \
    }                                                                             \
  } while (0)

float bits_to_float(uint32_t b) { return std::bit_cast<float>(b); }
uint32_t float_to_bits(float f) { return std::bit_cast<uint32_t>(f); }

// ---- 16-bit conversions -----------------------------------------------------

// Independent oracle: the finite 16-bit values with bits lo and lo + 1 (same
// sign) bracket |x|; pick the nearer in exact double arithmetic, ties to the
// even bit pattern. `to_float` widens a 16-bit pattern; `inf_value` is where
// the all-ones exponent sits for rounding purposes (the next power of two).
template <class ToFloat>
uint16_t oracle_round(float x, ToFloat to_float, uint16_t inf_bits, double inf_value) {
  const uint16_t sign = (float_to_bits(x) >> 16) & 0x8000;
  const double a = std::fabs(static_cast<double>(x));
  auto value = [&](uint16_t b) { return b == inf_bits ? inf_value : double(to_float(b)); };
  // Largest non-negative pattern with value <= a (patterns are monotonic).
  uint16_t lo = 0, hi = inf_bits;
  while (lo < hi) {
    const uint16_t mid = static_cast<uint16_t>((lo + hi + 1) / 2);
    if (value(mid) <= a) lo = mid; else hi = static_cast<uint16_t>(mid - 1);
  }
  if (lo == inf_bits || value(lo) == a) return sign | lo;
  const double down = a - value(lo), up = value(lo + 1) - a;
  const uint16_t pick = (down < up || (down == up && (lo & 1) == 0)) ? lo : uint16_t(lo + 1);
  return sign | pick;
}

uint16_t oracle_bf16(float x) {
  if (std::isnan(x)) return 0x7FC0;
  if (std::isinf(x)) return (float_to_bits(x) >> 16) & 0xFF80;
  return oracle_round(x, bf16_to_float, 0x7F80, std::ldexp(1.0, 128));
}

uint16_t oracle_fp16(float x) {
  if (std::isnan(x)) return ((float_to_bits(x) >> 16) & 0x8000) | 0x7E00;
  if (std::isinf(x)) return ((float_to_bits(x) >> 16) & 0x8000) | 0x7C00;
  return oracle_round(x, fp16_to_float, 0x7C00, 65536.0);
}

// ---- gradient arithmetic (cpu_adam/grad_ops.h) ------------------------------------

// Note [Ordered norm] written out as its words say, element by element: the
// kernel's loops must add in exactly this order (bit for bit), and the sum is
// the squared norm (against a long double sum).
double ordered_norm_as_written(const std::vector<float>& x) {
  const int64_t n = int64_t(x.size());
  std::vector<double> partials;
  for (int64_t base = 0; base < n; base += kNormChunk) {
    std::vector<double> lanes(kNormLanes, 0.0);
    for (int64_t j = 0; j < kNormChunk / kNormLanes; ++j) {
      for (int l = 0; l < kNormLanes; ++l) {
        const int64_t i = base + j * kNormLanes + l;
        if (i < n) lanes[size_t(l)] += double(x[size_t(i)]) * double(x[size_t(i)]);
      }
    }
    for (int half = kNormLanes / 2; half > 0; half /= 2) {
      for (int l = 0; l < half; ++l) lanes[size_t(l)] += lanes[size_t(l + half)];
    }
    partials.push_back(lanes[0]);
  }
  std::vector<double> lanes(kNormLanes, 0.0);
  for (size_t c = 0; c < partials.size(); ++c) lanes[c % kNormLanes] += partials[c];
  for (int half = kNormLanes / 2; half > 0; half /= 2) {
    for (int l = 0; l < half; ++l) lanes[size_t(l)] += lanes[size_t(l + half)];
  }
  return lanes[0];
}

TEST(CpuAdamGradOps, OrderedNormFollowsItsNoteBitForBit) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t n : {0, 1, 7, 256, 4095, 4096, 4097, 3 * 4096 + 5, 300000, 1100000}) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& v : x) v = normal(rng) * std::ldexp(1.0f, int(rng() % 30) - 15);
    const double got = ordered_squared_norm(x.data(), n);
    EXPECT_EQ(std::bit_cast<uint64_t>(got), std::bit_cast<uint64_t>(ordered_norm_as_written(x))) << "n = " << n;
    long double exact = 0.0L;
    for (float v : x) exact += (long double)v * (long double)v;
    EXPECT_NEAR(got, double(exact), 1e-13 * double(exact)) << "n = " << n;
  }
  EXPECT_EQ(ordered_squared_norm(nullptr, 0), 0.0);
}

// A gradient's widening and accumulation: home = widen(g) on the first
// micro-batch, home + widen(g) after, one fp32 addition per element.
TEST(CpuAdamGradOps, AccumulateWidensExactlyAndAddsOnce) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const int64_t n = 1000;
  std::vector<float> g(n), base(n);
  std::vector<uint16_t> g16(n), h16(n);
  for (int64_t i = 0; i < n; ++i) {
    g[size_t(i)] = normal(rng);
    base[size_t(i)] = normal(rng);
    g16[size_t(i)] = float_to_bf16(g[size_t(i)]);
    h16[size_t(i)] = float_to_fp16(g[size_t(i)]);
  }
  struct Case {
    GradType type;
    const void* src;
    float (*widen)(const void*, int64_t);
  };
  const Case cases[] = {
      {GradType::kF32, g.data(), [](const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }},
      {GradType::kBF16, g16.data(), [](const void* p, int64_t i) { return bf16_to_float(static_cast<const uint16_t*>(p)[i]); }},
      {GradType::kF16, h16.data(), [](const void* p, int64_t i) { return fp16_to_float(static_cast<const uint16_t*>(p)[i]); }},
  };
  for (const Case& c : cases) {
    std::vector<float> home = base;
    accumulate_grad(home.data(), c.src, c.type, n, /*first=*/true);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(home[size_t(i)], c.widen(c.src, i)) << grad_type_name(c.type) << " " << i;
    home = base;
    accumulate_grad(home.data(), c.src, c.type, n, /*first=*/false);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(home[size_t(i)], base[size_t(i)] + c.widen(c.src, i)) << grad_type_name(c.type) << " " << i;
    }
  }
}

TEST(CpuAdamConvert, Bf16EdgeCases) {
  struct Case { uint32_t in; uint16_t out; };
  const Case cases[] = {
      {0x00000000, 0x0000}, {0x80000000, 0x8000},  // +-0
      {0x3F800000, 0x3F80},                        // 1
      {0x3F808000, 0x3F80},                        // tie, even below
      {0x3F818000, 0x3F82},                        // tie, odd below: up
      {0x3F808001, 0x3F81},                        // just above a tie
      {0x3F807FFF, 0x3F80},                        // just below a tie
      {0xBF818000, 0xBF82},                        // negative tie
      {0x7F7FFFFF, 0x7F80},                        // largest float: rounds to Inf
      {0x7F7F7FFF, 0x7F7F},                        // largest that stays finite
      {0x7F800000, 0x7F80}, {0xFF800000, 0xFF80},  // +-Inf
      {0x7FC00000, 0x7FC0}, {0xFFC00001, 0x7FC0},  // NaNs -> c10's 0x7FC0
      {0x7F800001, 0x7FC0}, {0x7FFFFFFF, 0x7FC0},  // signalling / max payload
      {0x00000001, 0x0000},                        // smallest denormal
      {0x00008000, 0x0000},                        // denormal tie, even
      {0x00018000, 0x0002},                        // denormal tie, odd: up
      {0x007FFFFF, 0x0080},                        // largest denormal -> smallest normal
      {0x80010001, 0x8001},                        // negative denormal
  };
  for (const Case& c : cases) {
    EXPECT_EQ(float_to_bf16(bits_to_float(c.in)), c.out) << std::hex << c.in;
    EXPECT_EQ(oracle_bf16(bits_to_float(c.in)), c.out) << "oracle " << std::hex << c.in;
  }
}

TEST(CpuAdamConvert, Fp16EdgeCases) {
  struct Case { float in; uint16_t out; };
  const float inf = std::numeric_limits<float>::infinity();
  const Case cases[] = {
      {0.0f, 0x0000}, {-0.0f, 0x8000}, {1.0f, 0x3C00}, {-2.0f, 0xC000},
      {65504.0f, 0x7BFF},                      // largest fp16
      {65519.996f, 0x7BFF},                    // below the overflow tie
      {65520.0f, 0x7C00},                      // the tie goes to the even Inf
      {65536.0f, 0x7C00}, {-1e10f, 0xFC00},    // overflow
      {inf, 0x7C00}, {-inf, 0xFC00},
      {0x1p-14f, 0x0400},                      // smallest normal
      {0x1p-24f, 0x0001},                      // smallest denormal
      {0x1p-25f, 0x0000},                      // tie between 0 and 2^-24: even
      {0x1.000002p-25f, 0x0001},               // just above it
      {0x1.8p-24f, 0x0002},                    // tie between 1 and 2 units: even
      {0x1.4p-23f, 0x0002},                    // 2.5 units: tie, even
      {0x1.ffcp-15f, 0x0400},                  // largest denormal + half: rounds to normal
      {1.0f + 0x1p-11f, 0x3C00},               // tie, even below
      {1.0f + 0x3p-11f, 0x3C02},               // tie, odd below: up
      {-(1.0f + 0x3p-11f), 0xBC02},
      {0x1p-126f, 0x0000}, {0x1p-149f, 0x0000}, {-0x1p-149f, 0x8000},  // fp32 denormals
      {bits_to_float(0x7FC00000), 0x7E00}, {bits_to_float(0xFFC00000), 0xFE00},
      {bits_to_float(0x7F800001), 0x7E00}, {bits_to_float(0x7FBFFFFF), 0x7E00},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(float_to_fp16(c.in), c.out) << std::hexfloat << c.in;
    EXPECT_EQ(oracle_fp16(c.in), c.out) << "oracle " << std::hexfloat << c.in;
  }
}

TEST(CpuAdamConvert, WideningIsExactAndRoundTrips) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const uint16_t b = static_cast<uint16_t>(h);
    const float f16 = fp16_to_float(b);
    const float bf = bf16_to_float(b);
    EXPECT_EQ(float_to_bits(bf), h << 16);
    if (std::isnan(f16)) {
      EXPECT_TRUE((b & 0x7C00) == 0x7C00 && (b & 0x3FF) != 0) << h;
      EXPECT_EQ(float_to_fp16(f16), (b & 0x8000) | 0x7E00);
    } else {
      ASSERT_EQ(float_to_fp16(f16), b) << h;
    }
    if (!std::isnan(bf)) {
      ASSERT_EQ(float_to_bf16(bf), b) << h;
    }
  }
  EXPECT_EQ(fp16_to_float(0x0001), 0x1p-24f);
  EXPECT_EQ(fp16_to_float(0x03FF), 0x1.ff8p-15f);
  EXPECT_EQ(fp16_to_float(0x7BFF), 65504.0f);
  EXPECT_TRUE(std::isinf(fp16_to_float(0xFC00)) && fp16_to_float(0xFC00) < 0);
}

// Random bit patterns, weighted toward the interesting exponent ranges and
// the bits next to the rounding point. Runs of 64 elements of one kind (so
// that some vectors hold only denormals, only NaNs, ...: the SIMD kernels
// patch such lanes per vector) alternate with runs of mixed kinds.
std::vector<float> conversion_inputs(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b = static_cast<uint32_t>(rng());
    const int64_t run = i / 64;
    switch (run % 2 == 0 ? (run / 2) % 6 : i % 6) {
      case 0: break;                                                         // anything
      case 1: b = (b & 0x807FFFFF) | ((101u + (b >> 7) % 44) << 23); break;  // fp16 denormal..overflow
      case 2: b = (b & 0xFFFF0000) | ((b & 1) ? 0x8000 : 0x7FFF); break;     // bf16 ties and near-ties
      case 3: b = (b & 0xFFFFE000) | 0x1000; break;                          // fp16 normal ties
      case 4: b &= 0x807FFFFF; break;                                        // fp32 zero or denormal
      case 5: b |= 0x7F800000; break;                                        // NaN or Inf
    }
    x[i] = bits_to_float(b);
  }
  return x;
}

TEST(CpuAdamConvert, ScalarMatchesOracle) {
  const std::vector<float> x = conversion_inputs(1 << 20, 7);
  for (float f : x) {
    ASSERT_EQ(float_to_bf16(f), oracle_bf16(f)) << std::hex << float_to_bits(f);
    ASSERT_EQ(float_to_fp16(f), oracle_fp16(f)) << std::hex << float_to_bits(f);
  }
}

class CpuAdamConvertIsa : public ::testing::TestWithParam<Isa> {};

TEST_P(CpuAdamConvertIsa, KernelMatchesScalarBitForBit) {
  SKIP_UNLESS_SUPPORTED(GetParam());
  const int64_t n = (1 << 20) + 13;  // large enough to stream (kernel_simd.h)
  std::vector<float> x = conversion_inputs(n + 1, 11);
  std::vector<uint16_t> out(n + 1);
  CpuAdam adam(2, GetParam());
  for (EmitType type : {EmitType::kBF16, EmitType::kF16}) {
    auto ref = [&](float f) { return type == EmitType::kBF16 ? float_to_bf16(f) : float_to_fp16(f); };
    for (int offset : {0, 1}) {  // aligned and unaligned spans
      convert_f32_to_16(x.data() + offset, out.data() + offset, type, n, GetParam());
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(out[i + offset], ref(x[i + offset])) << emit_type_name(type) << " " << i;
      }
      std::fill(out.begin(), out.end(), 0);
      adam.convert(x.data() + offset, out.data() + offset, type, n);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(out[i + offset], ref(x[i + offset])) << emit_type_name(type) << " " << i;
      }
    }
  }
}

// A sweep over the whole float range (every 97th bit pattern): for fp16 the
// SIMD kernels use the hardware conversion (F16C, AVX-512), so this checks our
// scalar IEEE rounding against the CPU's own.
TEST_P(CpuAdamConvertIsa, SweepOfAllFloats) {
  SKIP_UNLESS_SUPPORTED(GetParam());
  constexpr int64_t kChunk = 1 << 20;
  constexpr uint64_t kStride = 97;
  std::vector<float> x(kChunk);
  std::vector<uint16_t> b16(kChunk), h16(kChunk);
  uint64_t bits = 0;
  while (bits <= 0xFFFFFFFFull) {
    int64_t n = 0;
    for (; n < kChunk && bits <= 0xFFFFFFFFull; ++n, bits += kStride) {
      x[n] = bits_to_float(static_cast<uint32_t>(bits));
    }
    convert_f32_to_16(x.data(), b16.data(), EmitType::kBF16, n, GetParam());
    convert_f32_to_16(x.data(), h16.data(), EmitType::kF16, n, GetParam());
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(b16[i], float_to_bf16(x[i])) << std::hex << float_to_bits(x[i]);
      ASSERT_EQ(h16[i], float_to_fp16(x[i])) << std::hex << float_to_bits(x[i]);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, CpuAdamConvertIsa, ::testing::ValuesIn(kAllIsas),
                         [](const auto& info) { return std::string(isa_name(info.param)); });

// ---- the step against a double-precision reference --------------------------

struct Errors {
  double p = 0, m = 0, v = 0;
};

// Storage for one problem: fp32 state and 16-bit/fp32 gradients, one
// element longer than needed so that the spans can start at offset 1.
struct Problem {
  int64_t n;
  int offset;
  GradType grad_type;
  EmitType emit_type;
  std::vector<float> param, exp_avg, exp_avg_sq, grad32, scales;
  std::vector<uint16_t> grad16, emit;
  std::mt19937_64 rng;

  Problem(int64_t n_, int offset_, GradType g, EmitType e, uint64_t seed)
      : n(n_), offset(offset_), grad_type(g), emit_type(e), param(n + 1), exp_avg(n + 1),
        exp_avg_sq(n + 1), grad32(n + 1), scales(n), grad16(n + 1), emit(n + 1), rng(seed) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::uniform_real_distribution<float> exponent(-3.0f, 1.0f);
    for (int64_t i = 0; i < n; ++i) {
      param[i + offset] = u(rng);
      scales[i] = std::pow(10.0f, exponent(rng));  // each element's gradient scale
    }
  }

  // New random gradients; returns their exact fp32 values (after rounding to
  // the 16-bit type, when there is one).
  std::vector<float> new_grads() {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> exact(n);
    for (int64_t i = 0; i < n; ++i) {
      const float g = normal(rng) * scales[i] + 0.1f * scales[i];  // a little drift
      float stored = g;
      if (grad_type == GradType::kBF16) {
        grad16[i + offset] = float_to_bf16(g);
        stored = bf16_to_float(grad16[i + offset]);
      } else if (grad_type == GradType::kF16) {
        grad16[i + offset] = float_to_fp16(g);
        stored = fp16_to_float(grad16[i + offset]);
      } else {
        grad32[i + offset] = g;
      }
      exact[i] = stored;
    }
    return exact;
  }

  void set_grad(int64_t i, float g) {  // element i of the span, raw (for non-finite tests)
    if (grad_type == GradType::kF32) grad32[i + offset] = g;
    if (grad_type == GradType::kBF16) grad16[i + offset] = float_to_bf16(g);
    if (grad_type == GradType::kF16) grad16[i + offset] = float_to_fp16(g);
  }

  AdamSpans spans() {
    AdamSpans s;
    s.param = param.data() + offset;
    s.grad = grad_type == GradType::kF32 ? static_cast<const void*>(grad32.data() + offset)
                                         : static_cast<const void*>(grad16.data() + offset);
    s.grad_type = grad_type;
    s.exp_avg = exp_avg.data() + offset;
    s.exp_avg_sq = exp_avg_sq.data() + offset;
    s.emit = emit_type == EmitType::kNone ? nullptr : emit.data() + offset;
    s.emit_type = emit_type;
    s.numel = n;
    return s;
  }

  std::vector<float> span_param() const {
    return std::vector<float>(param.begin() + offset, param.begin() + offset + n);
  }

  Errors errors(const Reference& ref) const {
    Errors e;
    for (int64_t i = 0; i < n; ++i) {
      e.p = std::max(e.p, rel_error(param[i + offset], ref.p[i], ref.mag_p[i]));
      e.m = std::max(e.m, rel_error(exp_avg[i + offset], ref.m[i], ref.mag_m[i]));
      e.v = std::max(e.v, rel_error(exp_avg_sq[i + offset], ref.v[i], ref.mag_v[i]));
    }
    return e;
  }

  // Emitted 16-bit values equal the conversion of the updated fp32 params.
  int64_t emit_mismatches() const {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float p = param[i + offset];
      const uint16_t want = emit_type == EmitType::kBF16 ? float_to_bf16(p) : float_to_fp16(p);
      bad += emit[i + offset] != want;
    }
    return bad;
  }
};

struct RunErrors {
  Errors per_step;    // max over all steps, reference restarted from the kernel's state
  Errors trajectory;  // after the last step, reference on its own double state
};

Errors max_errors(const Errors& a, const Errors& b) {
  return {std::max(a.p, b.p), std::max(a.m, b.m), std::max(a.v, b.v)};
}

// Runs `steps` steps with the kernel and both references.
RunErrors run_against_reference(CpuAdam& adam, Problem& prob, const AdamParams& hp, int steps,
                                float grad_scale) {
  Reference trajectory(prob.span_param());
  Reference one_step(prob.span_param());
  RunErrors errors;
  for (int t = 1; t <= steps; ++t) {
    const std::vector<float> g = prob.new_grads();
    const int o = prob.offset;
    one_step.load(prob.param.data() + o, prob.exp_avg.data() + o, prob.exp_avg_sq.data() + o);
    EXPECT_TRUE(adam.step(hp, {.step = t, .grad_scale = grad_scale}, prob.spans()));
    one_step.step(hp, t, grad_scale, g);
    trajectory.step(hp, t, grad_scale, g);
    errors.per_step = max_errors(errors.per_step, prob.errors(one_step));
    if (prob.emit_type != EmitType::kNone) {
      EXPECT_EQ(prob.emit_mismatches(), 0) << "step " << t;
    }
  }
  errors.trajectory = prob.errors(trajectory);
  return errors;
}

void expect_within_tolerance(const RunErrors& e, const std::string& what) {
  EXPECT_LE(e.per_step.p, kTolerance) << "param, per step, " << what;
  EXPECT_LE(e.per_step.m, kTolerance) << "exp_avg, per step, " << what;
  EXPECT_LE(e.per_step.v, kTolerance) << "exp_avg_sq, per step, " << what;
  EXPECT_LE(e.trajectory.p, kTrajectoryTolerance) << "param, trajectory, " << what;
  EXPECT_LE(e.trajectory.m, kTrajectoryTolerance) << "exp_avg, trajectory, " << what;
  EXPECT_LE(e.trajectory.v, kTrajectoryTolerance) << "exp_avg_sq, trajectory, " << what;
}

using KernelCase = std::tuple<Isa, GradType, EmitType>;

class CpuAdamKernel : public ::testing::TestWithParam<KernelCase> {};

TEST_P(CpuAdamKernel, MatchesDoubleReferenceOver100Steps) {
  const auto [isa, grad_type, emit_type] = GetParam();
  SKIP_UNLESS_SUPPORTED(isa);
  CpuAdam adam(2, isa);
  const AdamParams hp{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                      .weight_decay = 0.01, .adamw = true};
  for (int64_t n : kSizes) {
    const int offset = n % 2 == 1 ? 1 : 0;  // odd sizes run unaligned, even aligned
    Problem prob(n, offset, grad_type, emit_type, 1000 + n);
    const RunErrors e = run_against_reference(adam, prob, hp, kSteps, 0.75f);
    expect_within_tolerance(e, "n=" + std::to_string(n));
    if (n == kSizes[std::size(kSizes) - 1]) {
      std::printf("n=%lld max rel error per step: p %.2e m %.2e v %.2e; trajectory: p %.2e m %.2e v %.2e\n",
                  static_cast<long long>(n), e.per_step.p, e.per_step.m, e.per_step.v,
                  e.trajectory.p, e.trajectory.m, e.trajectory.v);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, CpuAdamKernel,
    ::testing::Combine(::testing::ValuesIn(kAllIsas),
                       ::testing::Values(GradType::kF32, GradType::kBF16, GradType::kF16),
                       ::testing::Values(EmitType::kNone, EmitType::kBF16, EmitType::kF16)),
    [](const ::testing::TestParamInfo<KernelCase>& info) {
      return std::string(isa_name(std::get<0>(info.param))) + "_grad_" +
             grad_type_name(std::get<1>(info.param)) + "_emit_" +
             emit_type_name(std::get<2>(info.param));
    });

class CpuAdamIsa : public ::testing::TestWithParam<Isa> {};

// Adam (L2) and AdamW, with and without weight decay, each against its own
// reference; with wd = 0 the two are the same algorithm, bit for bit; with
// wd > 0 they differ.
TEST_P(CpuAdamIsa, WeightDecayModes) {
  SKIP_UNLESS_SUPPORTED(GetParam());
  CpuAdam adam(2, GetParam());
  const int64_t n = 4097;
  std::vector<float> results[4];
  int k = 0;
  for (double wd : {0.0, 0.1}) {
    for (bool adamw : {false, true}) {
      const AdamParams hp{.lr = 1e-2, .weight_decay = wd, .adamw = adamw};
      Problem prob(n, 1, GradType::kF32, EmitType::kNone, 42);  // same data every time
      const RunErrors e = run_against_reference(adam, prob, hp, kSteps, 1.0f);
      expect_within_tolerance(e, "wd " + std::to_string(wd) + (adamw ? " adamw" : " adam"));
      results[k++] = prob.span_param();
    }
  }
  EXPECT_EQ(results[0], results[1]) << "wd = 0: Adam and AdamW must be identical";
  int64_t differ = 0;
  for (int64_t i = 0; i < n; ++i) differ += results[2][i] != results[3][i];
  EXPECT_GT(differ, n * 9 / 10) << "wd > 0: Adam and AdamW must differ";
  // AdamW decays every parameter toward 0 by lr*wd per step regardless of
  // the gradient scale; L2 decay is divided by sqrt(v) and is far weaker for
  // elements with large gradients.
}

// The first step of each mode, checked against hand-computed values.
TEST_P(CpuAdamIsa, FirstStepByHand) {
  SKIP_UNLESS_SUPPORTED(GetParam());
  CpuAdam adam(1, GetParam());
  for (bool adamw : {false, true}) {
    float p = 2.0f, g = 0.5f, m = 0.0f, v = 0.0f;
    const AdamParams hp{.lr = 0.1, .eps = 0.0, .weight_decay = 0.5, .adamw = adamw};
    AdamSpans s{.param = &p, .grad = &g, .exp_avg = &m, .exp_avg_sq = &v, .numel = 1};
    ASSERT_TRUE(adam.step(hp, {.step = 1}, s));
    // Step 1 with eps = 0: m_hat = g', v_hat = g'^2, so the update is -lr * sign(g').
    if (adamw) {
      EXPECT_FLOAT_EQ(p, 2.0f * (1 - 0.1f * 0.5f) - 0.1f);  // 1.8
    } else {
      EXPECT_FLOAT_EQ(p, 2.0f - 0.1f);  // g' = 0.5 + 0.5*2 = 1.5 > 0
      EXPECT_FLOAT_EQ(m, 0.1f * 1.5f);
      EXPECT_FLOAT_EQ(v, 0.001f * 1.5f * 1.5f);
    }
  }
}

TEST_P(CpuAdamIsa, NonFiniteGradientsAreReported) {
  SKIP_UNLESS_SUPPORTED(GetParam());
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int threads : {1, 2}) {
    CpuAdam adam(threads, GetParam());
    for (GradType gt : {GradType::kF32, GradType::kBF16, GradType::kF16}) {
      const int64_t n = 3 * CpuAdam::kTileNumel + 5;
      for (int64_t where : {int64_t{0}, int64_t{17}, CpuAdam::kTileNumel + 3, n - 1}) {
        for (float bad : {nan, inf, -inf}) {
          Problem prob(n, 1, gt, EmitType::kBF16, 5);
          prob.new_grads();
          EXPECT_TRUE(adam.step({}, {.step = 1}, prob.spans()));
          prob.new_grads();
          prob.set_grad(where, bad);
          EXPECT_FALSE(adam.step({}, {.step = 2}, prob.spans()))
              << grad_type_name(gt) << " at " << where << " value " << bad;
          EXPECT_TRUE(std::isnan(prob.param[where + 1]));
          EXPECT_EQ(prob.emit[where + 1], 0x7FC0);  // the canonical NaN is emitted
        }
      }
      // A finite gradient that overflows once scaled is reported too.
      Problem prob(100, 0, gt, EmitType::kNone, 6);
      prob.new_grads();
      prob.set_grad(50, 60000.0f);
      EXPECT_TRUE(adam.step({}, {.step = 1, .grad_scale = 1.0f}, prob.spans()));
      prob.set_grad(50, 60000.0f);
      EXPECT_FALSE(adam.step({}, {.step = 2, .grad_scale = 1e35f}, prob.spans()));
    }
  }
}

// Large calls write the 16-bit copy with streaming stores when it is aligned
// (Note [Streaming the 16-bit copy]); the bits are the same either way.
TEST_P(CpuAdamIsa, StreamedEmitEqualsPlainEmit) {
  SKIP_UNLESS_SUPPORTED(GetParam());
  const int64_t n = (1 << 20) + 37;
  struct Free { void operator()(void* p) const { std::free(p); } };
  for (EmitType et : {EmitType::kBF16, EmitType::kF16}) {
    std::vector<std::vector<uint16_t>> emitted;
    std::vector<std::vector<float>> params;
    for (int offset : {0, 1}) {  // 64-byte aligned (streams) and not
      // aligned_alloc wants a size that is a multiple of the alignment.
      const size_t bytes = (size_t(n + 64) * 2 + 63) / 64 * 64;
      std::unique_ptr<void, Free> buf(std::aligned_alloc(64, bytes));
      ASSERT_NE(buf.get(), nullptr);
      uint16_t* emit = static_cast<uint16_t*>(buf.get()) + offset;
      CpuAdam adam(2, GetParam());
      Problem prob(n, 0, GradType::kF32, EmitType::kNone, 21);
      for (int t = 1; t <= 2; ++t) {
        prob.new_grads();
        AdamSpans s = prob.spans();
        s.emit = emit;
        s.emit_type = et;
        ASSERT_TRUE(adam.step({}, {.step = t}, s));
      }
      emitted.emplace_back(emit, emit + n);
      params.push_back(prob.span_param());
      for (int64_t i = 0; i < n; ++i) {
        const float p = params.back()[i];
        ASSERT_EQ(emit[i], et == EmitType::kBF16 ? float_to_bf16(p) : float_to_fp16(p)) << i;
      }
    }
    EXPECT_EQ(params[0], params[1]);
    EXPECT_EQ(emitted[0], emitted[1]);
  }
}

// The parallel split never changes the arithmetic.
TEST_P(CpuAdamIsa, ThreadCountDoesNotChangeResults) {
  SKIP_UNLESS_SUPPORTED(GetParam());
  const int64_t n = 10 * CpuAdam::kTileNumel + 9;
  std::vector<std::vector<float>> params;
  for (int threads : {1, 2, 3}) {
    CpuAdam adam(threads, GetParam());
    Problem prob(n, 1, GradType::kBF16, EmitType::kBF16, 9);
    for (int t = 1; t <= 5; ++t) {
      prob.new_grads();
      adam.step({}, {.step = t}, prob.spans());
    }
    params.push_back(prob.span_param());
  }
  EXPECT_EQ(params[0], params[1]);
  EXPECT_EQ(params[0], params[2]);
}

// Note [A step that keeps its state]: the updated parameters (16-bit emit,
// or fp32 into param_out) are step()'s bit for bit, for fp32 and bf16
// moments (whose rounding is keyed by the element's index), on one thread
// and several, and param, exp_avg and exp_avg_sq are left as they were.
TEST_P(CpuAdamIsa, StepKeepingStateEmitsWhatStepWould) {
  SKIP_UNLESS_SUPPORTED(GetParam());
  const int64_t n = 3 * CpuAdam::kTileNumel + 77;
  for (StateType st : {StateType::kF32, StateType::kBF16}) {
    for (EmitType et : {EmitType::kNone, EmitType::kBF16, EmitType::kF16}) {
      for (int threads : {1, 3}) {
        CpuAdam adam(threads, GetParam());
        const size_t sb = st == StateType::kBF16 ? 2 : 4;
        std::mt19937_64 rng(77);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        const size_t un = static_cast<size_t>(n);
        std::vector<float> param(un), grad(un), out(un);
        for (float& x : param) x = normal(rng);
        std::vector<std::byte> m(un * sb), v(un * sb);
        std::vector<uint16_t> emit(un), emit_ref(un);
        for (int t = 1; t <= 3; ++t) {
          for (float& g : grad) g = normal(rng);
          AdamSpans s;
          s.param = param.data();
          s.grad = grad.data();
          s.exp_avg = m.data();
          s.exp_avg_sq = v.data();
          s.state_type = st;
          s.numel = n;
          if (et != EmitType::kNone) s.emit = emit.data(), s.emit_type = et;
          const AdamParams hp{.lr = 1e-2, .weight_decay = 0.1};
          const StepArgs args{.step = t, .grad_scale = 0.5f, .rounding_offset = 1000003};
          const std::vector<float> p0 = param;
          const std::vector<std::byte> m0 = m, v0 = v;
          ASSERT_TRUE(adam.step_keeping_state(hp, args, s, et == EmitType::kNone ? out.data() : nullptr));
          ASSERT_EQ(param, p0) << "param written";
          ASSERT_EQ(m, m0) << "exp_avg written";
          ASSERT_EQ(v, v0) << "exp_avg_sq written";
          const std::vector<uint16_t> kept_emit = emit;
          if (et != EmitType::kNone) {
            s.emit = emit_ref.data();
          }
          ASSERT_TRUE(adam.step(hp, args, s));
          if (et == EmitType::kNone) {
            ASSERT_EQ(out, param) << state_type_name(st) << " threads " << threads << " step " << t;
          } else {
            ASSERT_EQ(kept_emit, emit_ref) << state_type_name(st) << " " << emit_type_name(et) << " threads "
                                           << threads << " step " << t;
          }
          if (t > 1) {
            ASSERT_NE(m, m0) << "the reference step moved the moments";
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, CpuAdamIsa, ::testing::ValuesIn(kAllIsas),
                         [](const auto& info) { return std::string(isa_name(info.param)); });

// Every kernel this CPU can run, the scalar one first: they evaluate the same
// operation sequence (Note [AdamW numerics]). Needs two to compare.
std::vector<Isa> agreeing_isas() {
  std::vector<Isa> isas;
  for (Isa isa : kAllIsas) {
    if (isa_supported(isa)) isas.push_back(isa);
  }
  return isas;
}

// The scalar, AVX2 and AVX-512 kernels evaluate the same operation sequence:
// their results are identical, not just close.
TEST(CpuAdamIsaAgreement, KernelsAgreeBitForBit) {
  const std::vector<Isa> isas = agreeing_isas();
  if (isas.size() < 2) GTEST_SKIP() << "CPU lacks avx2: only the scalar kernel runs";
  std::vector<std::vector<float>> params;
  std::vector<std::vector<uint16_t>> emits;
  for (Isa isa : isas) {
    CpuAdam adam(2, isa);
    Problem prob(100003, 1, GradType::kF16, EmitType::kBF16, 3);
    for (int t = 1; t <= 10; ++t) {
      prob.new_grads();
      adam.step({.adamw = false}, {.step = t, .grad_scale = 0.3f}, prob.spans());
    }
    params.push_back(prob.span_param());
    emits.push_back(prob.emit);
  }
  for (size_t k = 1; k < params.size(); ++k) {
    EXPECT_EQ(params[0], params[k]) << isa_name(isas[k]);
    EXPECT_EQ(emits[0], emits[k]) << isa_name(isas[k]);
  }
}

// ---- bf16 state (Note [bf16 state]) -----------------------------------------

// A problem with exp_avg and exp_avg_sq stored in bf16, started from non-zero
// moments (as after some steps).
struct Bf16StateProblem {
  std::vector<float> param, grad;
  std::vector<uint16_t> m, v, emit;
  std::mt19937_64 rng;

  Bf16StateProblem(int64_t n, uint64_t seed) : param(n), grad(n), m(n), v(n), emit(n), rng(seed) {
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (int64_t i = 0; i < n; ++i) {
      param[i] = d(rng);
      m[i] = float_to_bf16(0.01f * d(rng));
      const float s = 0.01f * d(rng);
      v[i] = float_to_bf16(s * s);
    }
    new_grads();
  }
  void new_grads() {
    std::normal_distribution<float> d(0.0f, 0.01f);
    for (float& g : grad) g = d(rng);
  }
  AdamSpans spans(int64_t begin, int64_t end) {
    return AdamSpans{.param = param.data() + begin, .grad = grad.data() + begin,
                     .exp_avg = m.data() + begin, .exp_avg_sq = v.data() + begin,
                     .state_type = StateType::kBF16, .emit = emit.data() + begin,
                     .emit_type = EmitType::kBF16, .numel = end - begin};
  }
  AdamSpans spans() { return spans(0, int64_t(param.size())); }
  static std::vector<float> widen(const std::vector<uint16_t>& x) {
    std::vector<float> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = bf16_to_float(x[i]);
    return out;
  }
};

// The spacing of bf16 values at |x| (at least that of the smallest normal).
double bf16_ulp(double x) {
  const int e = std::max(std::ilogb(std::max(std::fabs(x), 1e-300)), -126);
  return std::ldexp(1.0, e - 7);
}

class CpuAdamBf16State : public ::testing::TestWithParam<Isa> {};

// Every step from the kernel's own state: the fp32 parameters within 1e-6 of
// the exact step (the update uses the unrounded moments), the stored moments
// within one bf16 spacing of the exact new moments (stochastic rounding picks
// one of the two neighbours).
TEST_P(CpuAdamBf16State, EachStepMatchesReferenceWithinOneBf16Spacing) {
  const Isa isa = GetParam();
  SKIP_UNLESS_SUPPORTED(isa);
  CpuAdam adam(2, isa);
  for (int64_t n : {int64_t{1}, int64_t{17}, int64_t{100003}}) {
    Bf16StateProblem prob(n, 11 + n);
    const AdamParams hp{.lr = 1e-2, .weight_decay = 0.1};
    double worst_p = 0, worst_m = 0, worst_v = 0;
    for (int t = 1; t <= 20; ++t) {
      prob.new_grads();
      Reference ref(prob.param);
      const std::vector<float> m0 = Bf16StateProblem::widen(prob.m), v0 = Bf16StateProblem::widen(prob.v);
      ref.load(prob.param.data(), m0.data(), v0.data());
      ref.step(hp, t, 1.0f, prob.grad);
      ASSERT_TRUE(adam.step(hp, {.step = t}, prob.spans()));
      for (int64_t i = 0; i < n; ++i) {
        worst_p = std::max(worst_p, rel_error(prob.param[i], ref.p[i], ref.mag_p[i]));
        const double m = bf16_to_float(prob.m[i]), v = bf16_to_float(prob.v[i]);
        worst_m = std::max(worst_m, std::fabs(m - ref.m[i]) /
                                        std::max(bf16_ulp(ref.m[i]), kTolerance * ref.mag_m[i]));
        worst_v = std::max(worst_v, std::fabs(v - ref.v[i]) /
                                        std::max(bf16_ulp(ref.v[i]), kTolerance * ref.mag_v[i]));
        ASSERT_EQ(prob.emit[i], float_to_bf16(prob.param[i])) << "emit, element " << i;
      }
    }
    EXPECT_LE(worst_p, kTolerance) << "n=" << n;
    EXPECT_LE(worst_m, 1.0) << "n=" << n << " (in bf16 spacings)";
    EXPECT_LE(worst_v, 1.0) << "n=" << n << " (in bf16 spacings)";
  }
}

// The reason for stochastic rounding: with beta2 = 0.999 and zero gradients,
// v must decay by 0.1% a step. Rounded to nearest it would never move; the
// stochastically rounded mean must follow 0.999^t.
TEST_P(CpuAdamBf16State, SecondMomentDecaysUnbiased) {
  const Isa isa = GetParam();
  SKIP_UNLESS_SUPPORTED(isa);
  ASSERT_EQ(float_to_bf16(0.999f), float_to_bf16(1.0f)) << "premise: nearest rounding would stall";
  const int64_t n = 1 << 16;
  std::vector<float> param(n, 0.0f), grad(n, 0.0f);
  std::vector<uint16_t> m(n, 0), v(n, float_to_bf16(1.0f));
  CpuAdam adam(2, isa);
  const AdamParams hp{.beta2 = 0.999, .weight_decay = 0.0};
  const int steps = 1000;
  for (int t = 1; t <= steps; ++t) {
    adam.step(hp, {.step = t},
              {.param = param.data(), .grad = grad.data(), .exp_avg = m.data(), .exp_avg_sq = v.data(),
               .state_type = StateType::kBF16, .numel = n});
  }
  double mean = 0;
  for (uint16_t x : v) mean += bf16_to_float(x);
  mean /= double(n);
  const double expected = std::pow(double(0.999f), steps);  // 0.368
  EXPECT_NEAR(mean, expected, 0.01 * expected);
  for (float p : param) ASSERT_EQ(p, 0.0f);  // m stayed 0, so no update
}

// The rounding bits depend on (index, step) only: the thread count and the
// split into spans (with rounding_offset) do not change a bit, and the
// offset does change the draws.
TEST_P(CpuAdamBf16State, RoundingDependsOnIndexNotOnSplitOrThreads) {
  const Isa isa = GetParam();
  SKIP_UNLESS_SUPPORTED(isa);
  const int64_t n = 3 * CpuAdam::kTileNumel + 101;
  const int64_t cut = CpuAdam::kTileNumel + 37;
  Bf16StateProblem whole(n, 5), split(n, 5), single(n, 5), shifted(n, 5);
  CpuAdam two(2, isa), one(1, isa);
  for (int t = 1; t <= 3; ++t) {
    for (Bf16StateProblem* p : {&whole, &split, &single, &shifted}) p->new_grads();
    two.step({}, {.step = t}, whole.spans());
    one.step({}, {.step = t}, single.spans());
    two.step({}, {.step = t}, split.spans(0, cut));
    two.step({}, {.step = t, .rounding_offset = uint64_t(cut)}, split.spans(cut, n));
    two.step({}, {.step = t, .rounding_offset = 12345}, shifted.spans());
  }
  EXPECT_EQ(whole.m, single.m);
  EXPECT_EQ(whole.v, single.v);
  EXPECT_EQ(whole.param, single.param);
  EXPECT_EQ(whole.m, split.m);
  EXPECT_EQ(whole.v, split.v);
  EXPECT_EQ(whole.param, split.param);
  int64_t differ = 0;
  for (int64_t i = 0; i < n; ++i) differ += whole.v[i] != shifted.v[i];
  EXPECT_GT(differ, n / 10) << "rounding_offset must change the draws";
}

TEST_P(CpuAdamBf16State, NonFiniteGradientsGiveNonFiniteState) {
  const Isa isa = GetParam();
  SKIP_UNLESS_SUPPORTED(isa);
  CpuAdam adam(1, isa);
  Bf16StateProblem prob(33, 9);
  prob.grad[3] = std::numeric_limits<float>::quiet_NaN();
  prob.grad[20] = std::numeric_limits<float>::infinity();
  // NaNs whose payload fills the low bits: adding the rounding bits would
  // carry into the sign (0x7FFFE000 is what fp16 0x7FFF widens to).
  prob.grad[5] = bits_to_float(0x7FFFE000u);
  prob.grad[6] = bits_to_float(0xFFFFFFFFu);
  EXPECT_FALSE(adam.step({}, {.step = 1}, prob.spans()));
  for (int64_t i : {3, 5, 6}) {
    EXPECT_EQ(prob.m[i], 0x7FC0) << "element " << i;
    EXPECT_EQ(prob.v[i], 0x7FC0) << "element " << i;
  }
  EXPECT_EQ(bf16_to_float(prob.v[20]), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(prob.param[20]));
  for (int64_t i : {0, 2, 4, 7, 19, 21, 32}) {
    EXPECT_TRUE(std::isfinite(bf16_to_float(prob.m[i])) && std::isfinite(bf16_to_float(prob.v[i])))
        << "element " << i;
  }
}

// The rounding bits as Note [bf16 state] writes them down, computed here: with
// zero gradients the new moments are exact functions of the old ones (for v
// the same in every kernel; for m with or without the SIMD kernels' fused
// multiply-add), so the stored bits are known exactly.
TEST_P(CpuAdamBf16State, RoundingBitsAreTheNotesHash) {
  const Isa isa = GetParam();
  SKIP_UNLESS_SUPPORTED(isa);
  const int64_t n = 100, t = 3;
  const uint64_t offset = (uint64_t{5} << 32) + 0xFFFFFFF0u;  // index mod 2^32 wraps inside the span
  std::mt19937_64 rng(4);
  std::uniform_real_distribution<float> u(0.5f, 2.0f);
  std::vector<float> param(n, 1.0f), grad(n, 0.0f), m_old(n), v_old(n);
  std::vector<uint16_t> m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    m[i] = float_to_bf16(u(rng));
    v[i] = float_to_bf16(u(rng));
    m_old[i] = bf16_to_float(m[i]);
    v_old[i] = bf16_to_float(v[i]);
  }
  const AdamParams hp{.beta1 = 0.9, .beta2 = 0.999, .weight_decay = 0.0};
  CpuAdam adam(1, isa);
  adam.step(hp, {.step = t, .rounding_offset = offset},
            {.param = param.data(), .grad = grad.data(), .exp_avg = m.data(), .exp_avg_sq = v.data(),
             .state_type = StateType::kBF16, .numel = n});
  const float w1 = static_cast<float>(1.0 - hp.beta1), b2 = static_cast<float>(hp.beta2);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t h = static_cast<uint32_t>(offset + uint64_t(i)) * 0x9E3779B1u + uint32_t(t) * 0x85EBCA77u;
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x846CA68Bu;
    h ^= h >> 16;
    const float new_m = isa == Isa::kScalar ? m_old[i] + w1 * (0.0f - m_old[i])
                                            : std::fma(w1, 0.0f - m_old[i], m_old[i]);
    const float new_v = v_old[i] * b2;
    ASSERT_EQ(m[i], uint16_t((float_to_bits(new_m) + (h & 0xFFFFu)) >> 16)) << "m, element " << i;
    ASSERT_EQ(v[i], uint16_t((float_to_bits(new_v) + (h >> 16)) >> 16)) << "v, element " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, CpuAdamBf16State, ::testing::ValuesIn(kAllIsas),
                         [](const auto& info) { return std::string(isa_name(info.param)); });

TEST(CpuAdamIsaAgreement, KernelsAgreeBitForBitWithBf16State) {
  const std::vector<Isa> isas = agreeing_isas();
  if (isas.size() < 2) GTEST_SKIP() << "CPU lacks avx2: only the scalar kernel runs";
  std::vector<Bf16StateProblem> probs;
  for (Isa isa : isas) {
    CpuAdam adam(2, isa);
    Bf16StateProblem& prob = probs.emplace_back(100003, 21);
    for (int t = 1; t <= 10; ++t) {
      prob.new_grads();
      adam.step({}, {.step = t, .grad_scale = 0.7f}, prob.spans());
    }
  }
  for (size_t k = 1; k < probs.size(); ++k) {
    EXPECT_EQ(probs[0].param, probs[k].param) << isa_name(isas[k]);
    EXPECT_EQ(probs[0].m, probs[k].m) << isa_name(isas[k]);
    EXPECT_EQ(probs[0].v, probs[k].v) << isa_name(isas[k]);
    EXPECT_EQ(probs[0].emit, probs[k].emit) << isa_name(isas[k]);
  }
}

// ---- API --------------------------------------------------------------------

TEST(CpuAdamApi, IsaNamesAndSupport) {
  for (Isa isa : kAllIsas) EXPECT_EQ(parse_isa(isa_name(isa)), isa);
  EXPECT_STREQ(state_type_name(StateType::kF32), "fp32");
  EXPECT_STREQ(state_type_name(StateType::kBF16), "bf16");
  EXPECT_EQ(parse_isa("auto"), best_isa());
  EXPECT_THROW(parse_isa("avx9000"), std::invalid_argument);
  EXPECT_TRUE(isa_supported(Isa::kScalar));
  EXPECT_TRUE(isa_supported(best_isa()));
  if (best_isa() != Isa::kAvx512Bf16) {
    EXPECT_THROW(CpuAdam(1, Isa::kAvx512Bf16), std::invalid_argument);
  }
  CpuAdam adam;
  EXPECT_GE(adam.threads(), 1);
  EXPECT_EQ(adam.isa(), best_isa());
}

TEST(CpuAdamApi, RejectsBadArguments) {
  CpuAdam adam(1);
  float p = 0, g = 0, m = 0, v = 0;
  uint16_t e = 0;
  AdamSpans s{.param = &p, .grad = &g, .exp_avg = &m, .exp_avg_sq = &v, .numel = 1};
  EXPECT_THROW(adam.step({}, {.step = 0}, s), std::invalid_argument);
  AdamSpans no_emit = s;
  no_emit.emit_type = EmitType::kBF16;
  EXPECT_THROW(adam.step({}, {.step = 1}, no_emit), std::invalid_argument);
  AdamSpans stray_emit = s;
  stray_emit.emit = &e;
  EXPECT_THROW(adam.step({}, {.step = 1}, stray_emit), std::invalid_argument);
  AdamSpans null_grad = s;
  null_grad.grad = nullptr;
  EXPECT_THROW(adam.step({}, {.step = 1}, null_grad), std::invalid_argument);
  AdamSpans empty{};
  EXPECT_TRUE(adam.step({}, {.step = 1}, empty));  // numel 0: nothing to do
  EXPECT_THROW(adam.convert(&p, &e, EmitType::kNone, 1), std::invalid_argument);
  EXPECT_THROW(CpuAdam(-1), std::invalid_argument);
}

}  // namespace
}  // namespace strata::cpu_adam
