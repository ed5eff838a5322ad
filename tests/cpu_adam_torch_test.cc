// cpu_adam against LibTorch: 100 steps equal torch::optim::AdamW / Adam (fp32,
// CPU) within 1e-6 relative, and the 16-bit conversions equal c10's.
// The only cpu_adam test that includes LibTorch.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cpu_adam/adam.h"
#include "cpu_adam_reference.h"

namespace strata::cpu_adam {
namespace {

constexpr double kTolerance = 1e-6;

struct Result {
  double p = 0, m = 0, v = 0;
};

// Runs the same 100 steps through CpuAdam(isa) and a LibTorch optimizer;
// returns the max relative difference of param, exp_avg and exp_avg_sq,
// measured as in cpu_adam_reference.h (against max(|torch|, magnitude)).
template <class TorchOptimizer, class TorchOptions, class TorchState>
Result compare_with_torch(Isa isa, const AdamParams& hp, int64_t n, int steps) {
  // One LibTorch thread: its OpenMP threads would otherwise spin after each
  // op and starve CpuAdam's oneTBB threads (a 20x slower test on 2 cores).
  torch::set_num_threads(1);
  std::mt19937_64 rng(123);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-3.0f, 1.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> param(n), scales(n), grad(n), m(n, 0.0f), v(n, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    param[i] = u(rng);
    scales[i] = std::pow(10.0f, exponent(rng));
  }
  torch::Tensor tp = torch::from_blob(param.data(), {n}, torch::kFloat32).clone();
  tp.set_requires_grad(true);
  TorchOptions options(hp.lr);
  options.betas({hp.beta1, hp.beta2}).eps(hp.eps).weight_decay(hp.weight_decay);
  TorchOptimizer torch_opt({tp}, options);
  Reference ref(param);  // for the magnitudes only

  CpuAdam adam(2, isa);
  AdamParams ours = hp;
  for (int t = 1; t <= steps; ++t) {
    for (int64_t i = 0; i < n; ++i) grad[i] = normal(rng) * scales[i] + 0.1f * scales[i];
    tp.mutable_grad() = torch::from_blob(grad.data(), {n}, torch::kFloat32).clone();
    torch_opt.step();
    AdamSpans s{.param = param.data(), .grad = grad.data(), .exp_avg = m.data(),
                .exp_avg_sq = v.data(), .numel = n};
    EXPECT_TRUE(adam.step(ours, {.step = t}, s));
    ref.step(hp, t, 1.0f, grad);
  }

  auto& state = static_cast<TorchState&>(*torch_opt.state().at(tp.unsafeGetTensorImpl()));
  EXPECT_EQ(state.step(), steps);
  const torch::Tensor tm = state.exp_avg().contiguous();
  const torch::Tensor tv = state.exp_avg_sq().contiguous();
  const torch::Tensor tpd = tp.detach().contiguous();
  const float* pp = tpd.data_ptr<float>();
  const float* pm = tm.data_ptr<float>();
  const float* pv = tv.data_ptr<float>();
  Result r;
  int64_t identical_p = 0;
  for (int64_t i = 0; i < n; ++i) {
    r.p = std::max(r.p, rel_error(param[i], pp[i], ref.mag_p[i]));
    r.m = std::max(r.m, rel_error(m[i], pm[i], ref.mag_m[i]));
    r.v = std::max(r.v, rel_error(v[i], pv[i], ref.mag_v[i]));
    identical_p += param[i] == pp[i];
  }
  std::printf("%s %s wd=%g: max rel diff p %.2e m %.2e v %.2e; params bit-identical %.1f%%\n",
              isa_name(isa), hp.adamw ? "AdamW" : "Adam", hp.weight_decay, r.p, r.m, r.v,
              100.0 * identical_p / n);
  return r;
}

class CpuAdamTorch : public ::testing::TestWithParam<Isa> {};

TEST_P(CpuAdamTorch, AdamW100Steps) {
  if (!isa_supported(GetParam())) GTEST_SKIP() << "CPU lacks " << isa_name(GetParam());
  for (double wd : {0.0, 0.01}) {
    const AdamParams hp{.lr = 1e-3, .weight_decay = wd, .adamw = true};
    const Result r = compare_with_torch<torch::optim::AdamW, torch::optim::AdamWOptions,
                                        torch::optim::AdamWParamState>(GetParam(), hp, 100003, 100);
    EXPECT_LE(r.p, kTolerance);
    EXPECT_LE(r.m, kTolerance);
    EXPECT_LE(r.v, kTolerance);
  }
}

TEST_P(CpuAdamTorch, Adam100Steps) {
  if (!isa_supported(GetParam())) GTEST_SKIP() << "CPU lacks " << isa_name(GetParam());
  const AdamParams hp{.lr = 1e-3, .weight_decay = 0.01, .adamw = false};
  const Result r = compare_with_torch<torch::optim::Adam, torch::optim::AdamOptions,
                                      torch::optim::AdamParamState>(GetParam(), hp, 100003, 100);
  EXPECT_LE(r.p, kTolerance);
  EXPECT_LE(r.m, kTolerance);
  EXPECT_LE(r.v, kTolerance);
}

INSTANTIATE_TEST_SUITE_P(AllIsas, CpuAdamTorch,
                         ::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16),
                         [](const auto& info) { return std::string(isa_name(info.param)); });

// Our conversions against c10's scalar constructors (bit for bit, NaN
// included) and LibTorch's vectorized tensor conversion (bit for bit; NaN
// only as NaN, since LibTorch's SIMD path encodes bf16 NaN as 0xFFFF).
TEST(CpuAdamTorchConvert, MatchesC10) {
  std::mt19937_64 rng(5);
  const int64_t n = 1 << 22;
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b = static_cast<uint32_t>(rng());
    if (i % 3 == 1) b = (b & 0xFFFF0000) | ((b & 1) ? 0x8000 : 0x7FFF);  // bf16 (near-)ties
    if (i % 3 == 2) b = (b & 0x807FE000) | 0x1000 | ((101u + (b >> 7) % 44) << 23);  // fp16 ties
    x[i] = std::bit_cast<float>(b);
  }
  const torch::Tensor t = torch::from_blob(x.data(), {n}, torch::kFloat32);
  const torch::Tensor tb = t.to(torch::kBFloat16).contiguous();
  const torch::Tensor th = t.to(torch::kHalf).contiguous();
  const auto* pb = reinterpret_cast<const uint16_t*>(tb.data_ptr());
  const auto* ph = reinterpret_cast<const uint16_t*>(th.data_ptr());
  std::vector<uint16_t> ours_b(n), ours_h(n);
  convert_f32_to_16(x.data(), ours_b.data(), EmitType::kBF16, n);
  convert_f32_to_16(x.data(), ours_h.data(), EmitType::kF16, n);
  int64_t nans = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float f = x[i];
    ASSERT_EQ(float_to_bf16(f), c10::BFloat16(f).x) << std::hex << std::bit_cast<uint32_t>(f);
    ASSERT_EQ(float_to_fp16(f), c10::Half(f).x) << std::hex << std::bit_cast<uint32_t>(f);
    ASSERT_EQ(ours_b[i], float_to_bf16(f));
    ASSERT_EQ(ours_h[i], float_to_fp16(f));
    if (std::isnan(f)) {
      ++nans;
      ASSERT_TRUE(std::isnan(bf16_to_float(pb[i])));
      ASSERT_TRUE(std::isnan(fp16_to_float(ph[i])));
    } else {
      ASSERT_EQ(ours_b[i], pb[i]) << std::hex << std::bit_cast<uint32_t>(f);
      ASSERT_EQ(ours_h[i], ph[i]) << std::hex << std::bit_cast<uint32_t>(f);
    }
  }
  EXPECT_GT(nans, 0);
}

}  // namespace
}  // namespace strata::cpu_adam
