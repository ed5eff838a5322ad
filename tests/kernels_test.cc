// Tests of kernels/ against CPU references. They need a GPU: without one they
// are reported as skipped (never as passed).
// - AdamW: bit for bit against cpu_adam's scalar kernel (and so every CPU
//   kernel: cpu_adam_test), every gradient, state, emit and decay variant,
//   with bf16 moments' stochastic rounding and the non-finite flag.
// - casts: bit for bit against cpu_adam/convert.h, special values included.
// - squared-norm partials: against a double sum, relative 1e-12 (the
//   summation order differs).
// - unscale: bit for bit (one IEEE multiply), and the non-finite flag.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu_adam/adam.h"
#include "cpu_adam/convert.h"
#include "cpu_adam/grad_ops.h"
#include "cpu_adam/kernels.h"
#include "kernels/adam.h"
#include "kernels/casts.h"

namespace strata::kernels {
namespace {

using cpu_adam::AdamParams;
using cpu_adam::AdamSpans;
using cpu_adam::EmitType;
using cpu_adam::GradType;
using cpu_adam::StateType;
using cpu_adam::StepArgs;

#define SKIP_WITHOUT_GPU()          \
  if (cuda_device_count() == 0) {   \
    GTEST_SKIP() << "no CUDA device"; \
  }

// A device copy of a host vector, freed with the object.
template <class T>
class DeviceVector {
 public:
  explicit DeviceVector(const std::vector<T>& host) : n_(host.size()) {
    EXPECT_EQ(cudaMalloc(&p_, std::max<size_t>(n_, 1) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceVector() { cudaFree(p_); }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;
  T* get() const { return p_; }
  std::vector<T> host() const {
    std::vector<T> out(n_);
    EXPECT_EQ(cudaMemcpy(out.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

std::vector<float> special_floats(size_t n, uint64_t seed) {
  std::mt19937 rng{uint32_t(seed)};
  std::normal_distribution<float> dist(0.0f, 10.0f);
  std::uniform_real_distribution<float> expo(-40.0f, 40.0f);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = (i % 3 == 0) ? dist(rng) * std::exp2(expo(rng)) : dist(rng);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            1.0f + 1.0f / 256.0f,  // a bf16 tie
                            65504.0f, 65519.0f, 65520.0f, -65520.0f,  // fp16 max and the rounding edge
                            5.96e-8f, 2.98e-8f, 2.99e-8f, 1e-45f, -0.0f, 3.4e38f, 6.1e-5f};
  for (size_t i = 0; i < sizeof(specials) / sizeof(specials[0]) && i < n; ++i) v[i] = specials[i];
  return v;
}

TEST(KernelsTest, CastsMatchCpuConversionsBitForBit) {
  SKIP_WITHOUT_GPU();
  const std::vector<float> x = special_floats(100003, 3);
  DeviceVector<float> d_in(x);
  DeviceVector<uint16_t> d_bf16(std::vector<uint16_t>(x.size())), d_fp16(std::vector<uint16_t>(x.size()));
  cast_f32_to_bf16(d_in.get(), d_bf16.get(), int64_t(x.size()), nullptr);
  cast_f32_to_fp16(d_in.get(), d_fp16.get(), int64_t(x.size()), nullptr);
  const std::vector<uint16_t> bf16 = d_bf16.host(), fp16 = d_fp16.host();
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(bf16[i], cpu_adam::float_to_bf16(x[i])) << "bf16 of " << x[i] << " at " << i;
    ASSERT_EQ(fp16[i], cpu_adam::float_to_fp16(x[i])) << "fp16 of " << x[i] << " at " << i;
  }
  // Widening back is exact: every 16-bit pattern.
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = uint16_t(i);
  DeviceVector<uint16_t> d_all(all);
  DeviceVector<float> d_wide(std::vector<float>(all.size()));
  for (int kind = 0; kind < 2; ++kind) {
    if (kind == 0) cast_bf16_to_f32(d_all.get(), d_wide.get(), int64_t(all.size()), nullptr);
    if (kind == 1) cast_fp16_to_f32(d_all.get(), d_wide.get(), int64_t(all.size()), nullptr);
    const std::vector<float> wide = d_wide.host();
    for (size_t i = 0; i < all.size(); ++i) {
      const float ref = kind == 0 ? cpu_adam::bf16_to_float(all[i]) : cpu_adam::fp16_to_float(all[i]);
      uint32_t a, b;
      std::memcpy(&a, &wide[i], 4);
      std::memcpy(&b, &ref, 4);
      if (std::isnan(ref)) {
        ASSERT_TRUE(std::isnan(wide[i])) << (kind ? "fp16 " : "bf16 ") << i;
      } else {
        ASSERT_EQ(a, b) << (kind ? "fp16 " : "bf16 ") << i;
      }
    }
  }
}

// One Adam problem in host memory, stepped on the CPU (scalar kernel) and on
// the GPU from the same bytes.
struct Problem {
  int64_t n;
  GradType gt;
  StateType st;
  EmitType et;
  std::vector<float> param;
  std::vector<uint8_t> grad, m, v;
  std::vector<uint16_t> emit;

  Problem(int64_t numel, GradType g, StateType s, EmitType e, uint64_t seed)
      : n(numel), gt(g), st(s), et(e), param(size_t(numel)), emit(size_t(numel)) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> d(0.0f, 1.0f);
    const int sb = s == StateType::kF32 ? 4 : 2;
    m.resize(size_t(numel * sb));
    v.resize(size_t(numel * sb));
    for (int64_t i = 0; i < numel; ++i) {
      param[size_t(i)] = d(rng);
      // A second moment is a running mean of squares: never negative (a
      // negative one gives a NaN whose bits differ between CPU and GPU).
      const float mi = 0.01f * d(rng), r = d(rng), vi = 1e-4f * r * r;
      if (s == StateType::kF32) {
        std::memcpy(&m[size_t(i * 4)], &mi, 4);
        std::memcpy(&v[size_t(i * 4)], &vi, 4);
      } else {
        const uint16_t mb = cpu_adam::float_to_bf16(mi), vb = cpu_adam::float_to_bf16(vi);
        std::memcpy(&m[size_t(i * 2)], &mb, 2);
        std::memcpy(&v[size_t(i * 2)], &vb, 2);
      }
    }
    new_grads(rng());
  }
  void new_grads(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> d(0.0f, 0.05f);
    const int gb = gt == GradType::kF32 ? 4 : 2;
    grad.resize(size_t(n * gb));
    for (int64_t i = 0; i < n; ++i) {
      const float g = d(rng);
      if (gt == GradType::kF32) std::memcpy(&grad[size_t(i * 4)], &g, 4);
      if (gt == GradType::kBF16) {
        const uint16_t b = cpu_adam::float_to_bf16(g);
        std::memcpy(&grad[size_t(i * 2)], &b, 2);
      }
      if (gt == GradType::kF16) {
        const uint16_t b = cpu_adam::float_to_fp16(g);
        std::memcpy(&grad[size_t(i * 2)], &b, 2);
      }
    }
  }
  AdamSpans spans(float* p, const void* g, void* mm, void* vv, void* e) const {
    AdamSpans s;
    s.param = p;
    s.grad = g;
    s.grad_type = gt;
    s.exp_avg = mm;
    s.exp_avg_sq = vv;
    s.state_type = st;
    s.emit = et == EmitType::kNone ? nullptr : e;
    s.emit_type = et;
    s.numel = n;
    return s;
  }
};

TEST(KernelsTest, AdamMatchesScalarCpuAdamBitForBit) {
  SKIP_WITHOUT_GPU();
  cpu_adam::CpuAdam cpu(1, cpu_adam::Isa::kScalar);
  int cases = 0;
  for (GradType gt : {GradType::kF32, GradType::kBF16, GradType::kF16}) {
    for (StateType st : {StateType::kF32, StateType::kBF16}) {
      for (EmitType et : {EmitType::kNone, EmitType::kBF16, EmitType::kF16}) {
        for (int decay = 0; decay < 3; ++decay) {
          const std::string what = std::string(cpu_adam::grad_type_name(gt)) + " grads, " +
                                   cpu_adam::state_type_name(st) + " state, emit " + cpu_adam::emit_type_name(et) +
                                   ", decay mode " + std::to_string(decay);
          AdamParams h;
          h.lr = 1e-3;
          h.weight_decay = decay == 0 ? 0.0 : 0.05;
          h.adamw = decay != 2;
          Problem cpu_p(20011, gt, st, et, uint64_t(++cases));
          DeviceVector<float> p(cpu_p.param);
          DeviceVector<uint8_t> m(cpu_p.m), v(cpu_p.v);
          DeviceVector<uint16_t> e(cpu_p.emit);
          DeviceVector<int> flag(std::vector<int>{0});
          for (int t = 1; t <= 3; ++t) {
            cpu_p.new_grads(uint64_t(1000 * cases + t));
            DeviceVector<uint8_t> g(cpu_p.grad);
            const StepArgs args{t, 0.75f, uint64_t(123456789) * uint64_t(t)};
            const bool finite = cpu.step(h, args, cpu_p.spans(cpu_p.param.data(), cpu_p.grad.data(), cpu_p.m.data(),
                                                              cpu_p.v.data(), cpu_p.emit.data()));
            EXPECT_TRUE(finite);
            adam_step(cpu_adam::detail::make_constants(h, args), cpu_p.spans(p.get(), g.get(), m.get(), v.get(), e.get()),
                      flag.get(), nullptr);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          }
          EXPECT_EQ(flag.host()[0], 0) << what;
          for (float x : cpu_p.param) ASSERT_FALSE(std::isnan(x)) << what << ": the CPU reference made a NaN";
          const std::vector<float> gp = p.host();
          ASSERT_EQ(std::memcmp(gp.data(), cpu_p.param.data(), gp.size() * 4), 0) << what << ": param";
          EXPECT_TRUE(m.host() == cpu_p.m) << what << ": exp_avg";
          EXPECT_TRUE(v.host() == cpu_p.v) << what << ": exp_avg_sq";
          if (et != EmitType::kNone) {
            EXPECT_TRUE(e.host() == cpu_p.emit) << what << ": 16-bit copy";
          }
        }
      }
    }
  }
}

TEST(KernelsTest, AdamFlagsNonFiniteGradients) {
  SKIP_WITHOUT_GPU();
  Problem prob(5000, GradType::kF32, StateType::kF32, EmitType::kNone, 9);
  const float inf = std::numeric_limits<float>::infinity();
  std::memcpy(&prob.grad[4 * 4321], &inf, 4);
  DeviceVector<float> p(prob.param);
  DeviceVector<uint8_t> g(prob.grad), m(prob.m), v(prob.v);
  DeviceVector<int> flag(std::vector<int>{0});
  adam_step(cpu_adam::detail::make_constants(AdamParams{}, StepArgs{}),
            prob.spans(p.get(), g.get(), m.get(), v.get(), nullptr), flag.get(), nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(flag.host()[0], 1);
  EXPECT_TRUE(std::isnan(p.host()[4321]));
  EXPECT_TRUE(std::isfinite(p.host()[4320]));
}

TEST(KernelsTest, SquaredNormPartialsSumToTheSquaredNorm) {
  SKIP_WITHOUT_GPU();
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(1000), int64_t(3000017)}) {
    std::vector<float> x(static_cast<size_t>(n));
    std::mt19937 rng{uint32_t(n)};
    std::normal_distribution<float> d(0.0f, 3.0f);
    double ref = 0.0;
    for (float& xi : x) {
      xi = d(rng);
      ref += double(xi) * double(xi);
    }
    DeviceVector<float> dx(x);
    DeviceVector<double> parts(std::vector<double>(kMaxNormPartials + 5, -1.0));
    squared_norm_partials(dx.get(), n, parts.get(), kMaxNormPartials + 5, nullptr);
    double sum = 0.0;
    for (double p : parts.host()) sum += p;
    EXPECT_NEAR(sum, ref, 1e-12 * std::max(ref, 1.0)) << "n = " << n;
  }
}

// Note [Ordered norm]: the device's squared norm is the CPU reference's bit
// for bit, whatever the length (partial chunks, one chunk, many).
TEST(KernelsTest, OrderedNormIsTheCpuReferenceBitForBit) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(255), int64_t(4096), int64_t(4097), int64_t(1) << 20,
                    (int64_t(1) << 22) + 333}) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& v : x) v = normal(rng) * std::ldexp(1.0f, int(rng() % 40) - 20);
    DeviceVector<float> dx(x);
    DeviceVector<double> out(std::vector<double>{-1.0});
    DeviceVector<double> scratch(std::vector<double>(size_t(std::max<int64_t>(ordered_norm_scratch(n), 1)), -1.0));
    ordered_squared_norm(dx.get(), n, out.get(), scratch.get(), nullptr);
    const double want = cpu_adam::ordered_squared_norm(x.data(), n);
    EXPECT_EQ(std::bit_cast<uint64_t>(out.host()[0]), std::bit_cast<uint64_t>(want)) << "n = " << n;
  }
}

TEST(KernelsTest, UnscaleIsOneMultiplyAndFlagsNonFinite) {
  SKIP_WITHOUT_GPU();
  // Denormals, fp16 edges and wide exponents, without NaN or Inf at first.
  std::vector<float> finite_x = special_floats(70001, 5);
  for (float& f : finite_x) {
    if (!std::isfinite(f)) f = 1.0f;
  }
  DeviceVector<float> d(finite_x);
  DeviceVector<int> flag(std::vector<int>{0});
  unscale_and_check(d.get(), int64_t(finite_x.size()), 1.0f / 1024.0f, flag.get(), nullptr);
  const std::vector<float> got = d.host();
  EXPECT_EQ(flag.host()[0], 0);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], finite_x[i] * (1.0f / 1024.0f)) << i;
  finite_x[777] = std::numeric_limits<float>::quiet_NaN();
  DeviceVector<float> d2(finite_x);
  unscale_and_check(d2.get(), int64_t(finite_x.size()), 0.5f, flag.get(), nullptr);
  EXPECT_EQ(flag.host()[0], 1);
}

}  // namespace
}  // namespace strata::kernels
