// Tests of kernels/ against CPU references. They need a GPU: without one they
// are reported as skipped (never as passed).
#include "kernels/casts.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace strata::kernels {
namespace {

// Round-to-nearest-even fp32 -> bf16, NaN kept quiet, as c10::BFloat16 does.
uint16_t ref_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return uint16_t((u >> 16) | 0x40);
  const uint32_t lsb = (u >> 16) & 1;
  return uint16_t((u + 0x7fff + lsb) >> 16);
}

TEST(KernelsTest, CastF32ToBf16MatchesCpuReference) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 10.0f);
  std::vector<float> host(100003);
  for (float& x : host) x = dist(rng);
  host[0] = std::numeric_limits<float>::quiet_NaN();
  host[1] = std::numeric_limits<float>::infinity();
  host[2] = 1.0f + 1.0f / 256.0f;  // a tie: rounds to even
  float* d_in = nullptr;
  uint16_t* d_out = nullptr;
  ASSERT_EQ(cudaMalloc(&d_in, host.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_out, host.size() * 2), cudaSuccess);
  cudaMemcpy(d_in, host.data(), host.size() * 4, cudaMemcpyHostToDevice);
  cast_f32_to_bf16(d_in, d_out, int64_t(host.size()), nullptr);
  std::vector<uint16_t> out(host.size());
  cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost);
  cudaFree(d_in);
  cudaFree(d_out);
  EXPECT_TRUE(std::isnan([&] { uint32_t u = uint32_t(out[0]) << 16; float f; std::memcpy(&f, &u, 4); return f; }()));
  for (size_t i = 1; i < host.size(); ++i) ASSERT_EQ(out[i], ref_bf16(host[i])) << "at " << i;
}

}  // namespace
}  // namespace strata::kernels
