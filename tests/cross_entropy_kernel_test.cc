// Note [Fused cross-entropy] (cpu_adam/cross_entropy.h): every kernel this
// CPU has against a double-precision reference of the loss and the gradient
// (-log softmax and grad_scale x (softmax - one-hot), computed here with
// std::exp in double), the kernels against each other bit for bit, ignored
// rows, read-only calls and non-finite logits. No LibTorch (the head's use of
// it is tested against LibTorch's cross_entropy in layer_ops_test).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu_adam/adam.h"
#include "cpu_adam/cross_entropy.h"

namespace strata::cpu_adam {
namespace {

constexpr Isa kAllIsas[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16};
constexpr GradType kTypes[] = {GradType::kF32, GradType::kBF16, GradType::kF16};

int type_bytes(GradType t) { return t == GradType::kF32 ? 4 : 2; }

float widen(GradType t, const std::vector<unsigned char>& b, int64_t i) {
  if (t == GradType::kF32) {
    float f;
    std::memcpy(&f, b.data() + i * 4, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, b.data() + i * 2, 2);
  return t == GradType::kBF16 ? bf16_to_float(h) : fp16_to_float(h);
}

void put(GradType t, std::vector<unsigned char>* b, int64_t i, float v) {
  if (t == GradType::kF32) {
    std::memcpy(b->data() + i * 4, &v, 4);
  } else {
    const uint16_t h = t == GradType::kBF16 ? float_to_bf16(v) : float_to_fp16(v);
    std::memcpy(b->data() + i * 2, &h, 2);
  }
}

// Rows of random logits (spread `spread`) in `type`, row stride vocab + pad.
struct Rows {
  GradType type;
  int64_t rows, vocab, stride;
  std::vector<unsigned char> logits;
  std::vector<int64_t> targets;
  std::vector<float> loss;
  Rows(GradType t, int64_t n, int64_t v, int64_t pad, float spread, uint64_t seed)
      : type(t), rows(n), vocab(v), stride(v + pad), logits(size_t(n * (v + pad) * type_bytes(t))),
        targets(size_t(n)), loss(size_t(n), -1.0f) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, spread);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < stride; ++j) put(t, &logits, r * stride + j, normal(rng));
      targets[size_t(r)] = int64_t(rng() % uint64_t(v));
    }
  }
  CrossEntropyRows args(float grad_scale, bool write) {
    CrossEntropyRows a;
    a.logits = logits.data();
    a.type = type;
    a.rows = rows;
    a.vocab = vocab;
    a.stride = stride;
    a.targets = targets.data();
    a.grad_scale = grad_scale;
    a.write_grad = write;
    a.row_loss = loss.data();
    return a;
  }
};

struct Expected {
  std::vector<double> loss;  // per row
  std::vector<double> grad;  // rows x vocab
};

Expected reference(const Rows& in, double grad_scale) {
  Expected e{std::vector<double>(size_t(in.rows)), std::vector<double>(size_t(in.rows * in.vocab))};
  for (int64_t r = 0; r < in.rows; ++r) {
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < in.vocab; ++j) m = std::max(m, double(widen(in.type, in.logits, r * in.stride + j)));
    double s = 0.0;
    for (int64_t j = 0; j < in.vocab; ++j) s += std::exp(double(widen(in.type, in.logits, r * in.stride + j)) - m);
    const int64_t t = in.targets[size_t(r)];
    if (t == -100) continue;
    e.loss[size_t(r)] = std::log(s) - (double(widen(in.type, in.logits, r * in.stride + t)) - m);
    for (int64_t j = 0; j < in.vocab; ++j) {
      const double p = std::exp(double(widen(in.type, in.logits, r * in.stride + j)) - m) / s;
      e.grad[size_t(r * in.vocab + j)] = grad_scale * (p - (j == t ? 1.0 : 0.0));
    }
  }
  return e;
}

// The tolerance of one written gradient value: a few fp32 ulps of the
// softmax (the target's own value cancels against grad_scale: absolute), then
// the rounding to the row's type (half a 16-bit spacing, relative).
double grad_tolerance(GradType t, double ref, double grad_scale) {
  const double fp32 = 4e-7 * std::abs(ref) + 2e-7 * grad_scale;
  if (t == GradType::kF32) return fp32;
  const double spacing = t == GradType::kBF16 ? 0x1p-8 : 0x1p-11;  // half a spacing, relative
  const double tiny = t == GradType::kBF16 ? 0.0 : 0x1p-25;      // fp16's denormal step
  return fp32 + spacing * std::abs(ref) + tiny;
}

class CrossEntropyKernel : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!isa_supported(GetParam())) GTEST_SKIP() << "CPU lacks " << isa_name(GetParam());
  }
};

TEST_P(CrossEntropyKernel, MatchesDoubleReference) {
  for (GradType type : kTypes) {
    for (int64_t vocab : {1, 7, 16, 17, 33, 1000, 32003}) {
      for (float spread : {1.0f, 8.0f}) {
        Rows rows(type, 5, vocab, vocab % 3, spread, uint64_t(vocab) * 7 + uint64_t(spread));
        rows.targets[1] = vocab - 1;  // a target in the last (short) block
        const Expected want = reference(rows, 0.25);
        cross_entropy_rows(GetParam(), rows.args(0.25f, /*write=*/true), 0, rows.rows);
        for (int64_t r = 0; r < rows.rows; ++r) {
          const double ref = want.loss[size_t(r)];
          EXPECT_NEAR(rows.loss[size_t(r)], ref, 2e-6 * std::max(1.0, std::abs(ref)))
              << grad_type_name(type) << " vocab " << vocab << " row " << r;
          for (int64_t j = 0; j < vocab; ++j) {
            const double g = want.grad[size_t(r * vocab + j)];
            ASSERT_NEAR(widen(type, rows.logits, r * rows.stride + j), g, grad_tolerance(type, g, 0.25))
                << grad_type_name(type) << " vocab " << vocab << " row " << r << " column " << j
                << (j == rows.targets[size_t(r)] ? " (the target)" : "");
          }
        }
      }
    }
  }
}

TEST_P(CrossEntropyKernel, StableForLargeLogits) {
  // Logits in the thousands: exp of them would overflow without the max.
  Rows rows(GradType::kF32, 3, 500, 0, 1.0f, 5);
  for (int64_t i = 0; i < 3 * 500; ++i) put(GradType::kF32, &rows.logits, i, widen(GradType::kF32, rows.logits, i) * 50.0f + 3000.0f);
  const Expected want = reference(rows, 1.0);
  cross_entropy_rows(GetParam(), rows.args(1.0f, true), 0, 3);
  for (int64_t r = 0; r < 3; ++r) {
    EXPECT_TRUE(std::isfinite(rows.loss[size_t(r)]));
    EXPECT_NEAR(rows.loss[size_t(r)], want.loss[size_t(r)], 2e-6 * std::max(1.0, want.loss[size_t(r)]));
  }
}

TEST_P(CrossEntropyKernel, IgnoredRowsHaveNoLossAndAZeroGradient) {
  for (GradType type : kTypes) {
    Rows rows(type, 3, 40, 2, 1.0f, 9);
    rows.targets[1] = -100;
    const std::vector<unsigned char> before = rows.logits;
    cross_entropy_rows(GetParam(), rows.args(1.0f, true), 0, 3);
    EXPECT_EQ(rows.loss[1], 0.0f);
    for (int64_t j = 0; j < 40; ++j) EXPECT_EQ(widen(type, rows.logits, rows.stride + j), 0.0f) << j;
    // The padding between rows is never written.
    for (int64_t r = 0; r < 3; ++r) {
      for (int64_t j = 40; j < rows.stride; ++j) {
        EXPECT_EQ(widen(type, rows.logits, r * rows.stride + j), widen(type, before, r * rows.stride + j));
      }
    }
    EXPECT_GT(rows.loss[0], 0.0f);
  }
}

TEST_P(CrossEntropyKernel, ReadOnlyCallGivesTheSameLossAndWritesNothing) {
  for (GradType type : kTypes) {
    Rows a(type, 4, 100, 0, 2.0f, 11), b(type, 4, 100, 0, 2.0f, 11);
    cross_entropy_rows(GetParam(), a.args(1.0f, /*write=*/false), 0, 4);
    cross_entropy_rows(GetParam(), b.args(1.0f, /*write=*/true), 0, 4);
    const Rows fresh(type, 4, 100, 0, 2.0f, 11);
    EXPECT_EQ(a.logits, fresh.logits);
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_NE(b.logits, fresh.logits);
  }
}

TEST_P(CrossEntropyKernel, NonFiniteLogitsGiveANonFiniteLoss) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    for (int64_t at : {0, 17, 99}) {  // a full block, the middle, the short last block
      Rows rows(GradType::kF32, 1, 100, 0, 1.0f, 13);
      put(GradType::kF32, &rows.logits, at, bad);
      cross_entropy_rows(GetParam(), rows.args(1.0f, true), 0, 1);
      EXPECT_FALSE(std::isfinite(rows.loss[0])) << bad << " at " << at;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isas, CrossEntropyKernel, ::testing::ValuesIn(kAllIsas),
                         [](const ::testing::TestParamInfo<Isa>& i) { return isa_name(i.param); });

TEST(CrossEntropyKernelAgreement, KernelsAgreeBitForBit) {
  for (GradType type : kTypes) {
    for (int64_t vocab : {1, 15, 16, 31, 32000, 32003}) {
      Rows want(type, 6, vocab, 1, 3.0f, uint64_t(vocab));
      want.targets[2] = -100;
      cross_entropy_rows(Isa::kScalar, want.args(0.125f, true), 0, want.rows);
      for (Isa isa : kAllIsas) {
        if (!isa_supported(isa) || isa == Isa::kScalar) continue;
        Rows got(type, 6, vocab, 1, 3.0f, uint64_t(vocab));
        got.targets[2] = -100;
        // In two calls: the split between threads does not matter.
        cross_entropy_rows(isa, got.args(0.125f, true), 0, 2);
        cross_entropy_rows(isa, got.args(0.125f, true), 2, got.rows);
        EXPECT_EQ(got.logits, want.logits) << isa_name(isa) << " " << grad_type_name(type) << " vocab " << vocab;
        for (int64_t r = 0; r < want.rows; ++r) {
          EXPECT_EQ(std::bit_cast<uint32_t>(got.loss[size_t(r)]), std::bit_cast<uint32_t>(want.loss[size_t(r)]))
              << isa_name(isa) << " row " << r;
        }
      }
    }
  }
}

}  // namespace
}  // namespace strata::cpu_adam
