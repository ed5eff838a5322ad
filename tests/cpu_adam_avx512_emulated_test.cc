// The AVX-512 kernels run on any CPU: cpu_adam/kernel_avx512.cc compiled over
// scalar stand-ins for its intrinsics (avx512_emulation.h, which mimics the
// hardware's own NaN and denormal behaviour, so the kernel's corrections are
// exercised). Checked bit for bit against the AVX2 kernel (same operation
// sequence) and the scalar conversions. Where the CPU has AVX-512, the real
// kernels are checked by cpu_adam_test as well.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu_adam/adam.h"
#include "cpu_adam/kernels.h"
#include "cpu_adam_reference.h"

namespace strata::cpu_adam::detail {
Kernels emulated_avx512_kernels();
Kernels emulated_avx512_bf16_kernels();
}  // namespace strata::cpu_adam::detail

namespace strata::cpu_adam {
namespace {

using detail::Kernels;

struct Emulated {
  const char* name;
  Kernels kernels;
};

std::vector<Emulated> emulated() {
  return {{"avx512", detail::emulated_avx512_kernels()},
          {"avx512_bf16", detail::emulated_avx512_bf16_kernels()}};
}

// Every array 64-byte aligned plus `offset` elements, so both the streaming
// (aligned) and the plain store paths of the emit run.
template <class T>
struct Aligned {
  std::vector<T> storage;
  T* data;
  Aligned(int64_t n, int offset) : storage(n + 64) {
    auto address = reinterpret_cast<uintptr_t>(storage.data());
    const auto skip = static_cast<int64_t>((64 - address % 64) % 64 / sizeof(T));
    data = storage.data() + skip + offset;
  }
};

struct State {
  Aligned<float> p, m, v;
  Aligned<uint16_t> e;
  State(int64_t n, int offset) : p(n, offset), m(n, offset), v(n, offset), e(n, offset) {}
};

TEST(CpuAdamEmulatedAvx512, StepMatchesAvx2BitForBit) {
  if (!isa_supported(Isa::kAvx2)) GTEST_SKIP() << "CPU lacks avx2 (the comparison kernel)";
  const Kernels avx2 = detail::kernels_for(Isa::kAvx2);
  std::mt19937_64 rng(77);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const Emulated& emu : emulated()) {
    for (GradType gt : {GradType::kF32, GradType::kBF16, GradType::kF16}) {
      for (EmitType et : {EmitType::kNone, EmitType::kBF16, EmitType::kF16}) {
        for (bool adamw : {false, true}) {
          // The largest streams the 16-bit copy (kernel_simd.h): only for fp32 grads, to
          // keep the emulated run short.
          for (int64_t n : {1, 7, 15, 16, 17, 33, 4097, 20011, (1 << 20) + 7}) {
            if (n > 20011 && gt != GradType::kF32) continue;
            const int offset = static_cast<int>(n % 3);  // 0: aligned (streamed emit)
            State a(n, offset), b(n, offset);
            Aligned<float> g32(n, offset);
            Aligned<uint16_t> g16(n, offset);
            for (int64_t i = 0; i < n; ++i) {
              a.p.data[i] = b.p.data[i] = normal(rng);
              a.m.data[i] = b.m.data[i] = a.v.data[i] = b.v.data[i] = 0.0f;
            }
            const AdamParams hp{.lr = 1e-2, .weight_decay = 0.1, .adamw = adamw};
            for (int t = 1; t <= (n > 20011 ? 2 : 5); ++t) {
              for (int64_t i = 0; i < n; ++i) {
                const float g = normal(rng) * 0.1f;
                g32.data[i] = g;
                g16.data[i] = gt == GradType::kBF16 ? float_to_bf16(g) : float_to_fp16(g);
              }
              const detail::StepConstants c = detail::make_constants(hp, {.step = t, .grad_scale = 0.5f});
              auto spans = [&](State& s) {
                return AdamSpans{.param = s.p.data,
                                 .grad = gt == GradType::kF32 ? static_cast<const void*>(g32.data)
                                                              : static_cast<const void*>(g16.data),
                                 .grad_type = gt, .exp_avg = s.m.data, .exp_avg_sq = s.v.data,
                                 .emit = et == EmitType::kNone ? nullptr : s.e.data,
                                 .emit_type = et, .numel = n};
              };
              ASSERT_TRUE(avx2.step(c, spans(a), 0, n));
              // The emulated kernel in two ranges, as threads would split it.
              const int64_t mid = n > 32 ? 32 : n;
              ASSERT_TRUE(emu.kernels.step(c, spans(b), 0, mid));
              ASSERT_TRUE(emu.kernels.step(c, spans(b), mid, n));
            }
            const std::string what = std::string(emu.name) + " " + grad_type_name(gt) + " " +
                                     emit_type_name(et) + (adamw ? " adamw" : " adam") +
                                     " n=" + std::to_string(n);
            ASSERT_EQ(0, std::memcmp(a.p.data, b.p.data, n * 4)) << what;
            ASSERT_EQ(0, std::memcmp(a.m.data, b.m.data, n * 4)) << what;
            ASSERT_EQ(0, std::memcmp(a.v.data, b.v.data, n * 4)) << what;
            if (et != EmitType::kNone) {
              ASSERT_EQ(0, std::memcmp(a.e.data, b.e.data, n * 2)) << what;
            }
          }
        }
      }
    }
  }
}

// Note [bf16 state]: the emulated AVX-512 kernels draw the same rounding bits
// and store the same bf16 moments as the AVX2 kernel.
TEST(CpuAdamEmulatedAvx512, Bf16StateMatchesAvx2BitForBit) {
  if (!isa_supported(Isa::kAvx2)) GTEST_SKIP() << "CPU lacks avx2 (the comparison kernel)";
  const Kernels avx2 = detail::kernels_for(Isa::kAvx2);
  std::mt19937_64 rng(78);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const Emulated& emu : emulated()) {
    for (int64_t n : {1, 15, 16, 17, 4097, 20011}) {
      std::vector<float> pa(n), pb(n), g(n);
      std::vector<uint16_t> ma(n), mb(n), va(n), vb(n), ea(n), eb(n);
      for (int64_t i = 0; i < n; ++i) {
        pa[i] = pb[i] = normal(rng);
        ma[i] = mb[i] = float_to_bf16(0.01f * normal(rng));
        const float r = 0.01f * normal(rng);
        va[i] = vb[i] = float_to_bf16(r * r);
      }
      const AdamParams hp{.lr = 1e-2, .weight_decay = 0.1};
      for (int t = 1; t <= 5; ++t) {
        for (float& x : g) x = 0.01f * normal(rng);
        const detail::StepConstants c =
            detail::make_constants(hp, {.step = t, .grad_scale = 0.5f, .rounding_offset = 3});
        auto spans = [&](std::vector<float>& p, std::vector<uint16_t>& m, std::vector<uint16_t>& v,
                         std::vector<uint16_t>& e) {
          return AdamSpans{.param = p.data(), .grad = g.data(), .exp_avg = m.data(),
                           .exp_avg_sq = v.data(), .state_type = StateType::kBF16,
                           .emit = e.data(), .emit_type = EmitType::kBF16, .numel = n};
        };
        ASSERT_TRUE(avx2.step(c, spans(pa, ma, va, ea), 0, n));
        // Split part-way through a vector, as no thread would, to move the
        // lanes against the rounding index.
        const int64_t mid = n > 37 ? 37 : n;
        ASSERT_TRUE(emu.kernels.step(c, spans(pb, mb, vb, eb), 0, mid));
        ASSERT_TRUE(emu.kernels.step(c, spans(pb, mb, vb, eb), mid, n));
      }
      const std::string what = std::string(emu.name) + " n=" + std::to_string(n);
      ASSERT_EQ(pa, pb) << what;
      ASSERT_EQ(ma, mb) << what;
      ASSERT_EQ(va, vb) << what;
      ASSERT_EQ(ea, eb) << what;
    }
  }
}

// Special values through the conversion, where the hardware instructions
// (as emulated) differ from LibTorch and the kernel must correct them.
TEST(CpuAdamEmulatedAvx512, ConvertMatchesScalarOnSpecialValues) {
  std::mt19937_64 rng(3);
  const int64_t n = (1 << 20) + 3;  // large enough to stream when aligned
  Aligned<float> x(n + 1, 0);
  for (int64_t i = 0; i < n + 1; ++i) {
    uint32_t b = static_cast<uint32_t>(rng());
    // Runs of 64 elements of one kind (so some vectors hold only denormals,
    // only NaNs, ...), alternating with runs where the kinds are mixed.
    const int64_t run = i / 64;
    switch (run % 2 == 0 ? (run / 2) % 5 : i % 5) {
      case 0: b &= 0x807FFFFF; break;                                  // zero or denormal
      case 1: b |= 0x7F800000; break;                                  // NaN (or Inf)
      case 2: b = (b & 0xFFFF0000) | ((b & 1) ? 0x8000 : 0x7FFF); break;  // bf16 ties
      case 3: b = (b & 0x807FE000) | 0x1000 | ((101u + (b >> 7) % 44) << 23); break;  // fp16 ties
      case 4: break;
    }
    x.data[i] = std::bit_cast<float>(b);
  }
  for (const Emulated& emu : emulated()) {
    for (EmitType type : {EmitType::kBF16, EmitType::kF16}) {
      for (int offset : {0, 1}) {
        Aligned<uint16_t> out(n, offset);
        emu.kernels.convert(x.data + offset, out.data, type, n, 0, n);
        for (int64_t i = 0; i < n; ++i) {
          const float f = x.data[i + offset];
          const uint16_t want = type == EmitType::kBF16 ? float_to_bf16(f) : float_to_fp16(f);
          ASSERT_EQ(out.data[i], want) << emu.name << " " << emit_type_name(type) << " "
                                       << std::hex << std::bit_cast<uint32_t>(f);
        }
      }
    }
  }
}

TEST(CpuAdamEmulatedAvx512, MatchesDoubleReference) {
  const int64_t n = 4099;
  std::mt19937_64 rng(8);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const Emulated& emu : emulated()) {
    State s(n, 1);
    std::vector<float> p0(n), g(n);
    for (int64_t i = 0; i < n; ++i) {
      s.p.data[i] = p0[i] = normal(rng);
      s.m.data[i] = s.v.data[i] = 0.0f;
    }
    Reference ref(p0);
    const AdamParams hp{};
    double err = 0;
    for (int t = 1; t <= 20; ++t) {
      for (float& x : g) x = normal(rng) * 1e-2f;
      ref.load(s.p.data, s.m.data, s.v.data);
      const AdamSpans spans{.param = s.p.data, .grad = g.data(), .exp_avg = s.m.data,
                            .exp_avg_sq = s.v.data, .emit = s.e.data,
                            .emit_type = EmitType::kBF16, .numel = n};
      ASSERT_TRUE(emu.kernels.step(detail::make_constants(hp, {.step = t}), spans, 0, n));
      ref.step(hp, t, 1.0f, g);
      for (int64_t i = 0; i < n; ++i) {
        err = std::max(err, rel_error(s.p.data[i], ref.p[i], ref.mag_p[i]));
        err = std::max(err, rel_error(s.m.data[i], ref.m[i], ref.mag_m[i]));
        err = std::max(err, rel_error(s.v.data[i], ref.v[i], ref.mag_v[i]));
        ASSERT_EQ(s.e.data[i], float_to_bf16(s.p.data[i]));
      }
    }
    EXPECT_LE(err, 1e-6) << emu.name;
  }
}

TEST(CpuAdamEmulatedAvx512, NonFiniteGradientsAreReported) {
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t n = 100;
  for (const Emulated& emu : emulated()) {
    for (int64_t where : {0, 15, 16, 99}) {
      for (float bad : {std::numeric_limits<float>::quiet_NaN(), inf, -inf}) {
        State s(n, 0);
        std::vector<float> g(n, 0.25f);
        for (int64_t i = 0; i < n; ++i) s.p.data[i] = s.m.data[i] = s.v.data[i] = 0.5f;
        g[where] = bad;
        const AdamSpans spans{.param = s.p.data, .grad = g.data(), .exp_avg = s.m.data,
                              .exp_avg_sq = s.v.data, .emit = s.e.data,
                              .emit_type = EmitType::kF16, .numel = n};
        EXPECT_FALSE(emu.kernels.step(detail::make_constants({}, {.step = 3}), spans, 0, n))
            << emu.name << " at " << where;
        EXPECT_EQ(s.e.data[where] & 0x7FFF, 0x7E00);  // canonical fp16 NaN
      }
    }
  }
}

// Note [Fused cross-entropy]: the AVX-512 code (max, roundscale, scalef)
// gives the scalar kernel's bits, for every type, short last blocks and
// ignored rows included.
TEST(CpuAdamEmulatedAvx512, CrossEntropyMatchesScalarBitForBit) {
  const Kernels scalar = detail::kernels_for(Isa::kScalar);
  std::mt19937_64 rng(91);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  for (const Emulated& emu : emulated()) {
    for (GradType type : {GradType::kF32, GradType::kBF16, GradType::kF16}) {
      for (int64_t vocab : {1, 15, 16, 17, 1003}) {
        const int64_t rows = 4, eb = type == GradType::kF32 ? 4 : 2;
        std::vector<unsigned char> base(size_t(rows * vocab * eb));
        for (int64_t i = 0; i < rows * vocab; ++i) {
          const float v = normal(rng);
          if (type == GradType::kF32) {
            std::memcpy(base.data() + i * 4, &v, 4);
          } else {
            const uint16_t h = type == GradType::kBF16 ? float_to_bf16(v) : float_to_fp16(v);
            std::memcpy(base.data() + i * 2, &h, 2);
          }
        }
        std::vector<int64_t> targets = {0, vocab - 1, -100, vocab / 2};
        std::vector<unsigned char> a = base, b = base;
        std::vector<float> la(static_cast<size_t>(rows)), lb(static_cast<size_t>(rows));
        CrossEntropyRows args;
        args.type = type;
        args.rows = rows;
        args.vocab = args.stride = vocab;
        args.targets = targets.data();
        args.grad_scale = 0.5f;
        args.write_grad = true;
        args.logits = a.data();
        args.row_loss = la.data();
        scalar.cross_entropy(args, 0, rows);
        args.logits = b.data();
        args.row_loss = lb.data();
        emu.kernels.cross_entropy(args, 0, rows);
        EXPECT_EQ(a, b) << emu.name << " " << grad_type_name(type) << " vocab " << vocab;
        for (int64_t r = 0; r < rows; ++r) {
          EXPECT_EQ(std::bit_cast<uint32_t>(la[size_t(r)]), std::bit_cast<uint32_t>(lb[size_t(r)]))
              << emu.name << " row " << r;
        }
      }
    }
  }
}

}  // namespace
}  // namespace strata::cpu_adam
