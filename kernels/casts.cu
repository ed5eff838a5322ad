#include "kernels/casts.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace strata::kernels {

namespace {

void check(cudaError_t err, const char* file, int line) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(file) + ":" + std::to_string(line) +
                             ": CUDA error: " + cudaGetErrorString(err));
  }
}
#define STRATA_CUDA_CHECK(expr) check((expr), __FILE__, __LINE__)

__global__ void cast_f32_to_bf16_kernel(const float* __restrict__ in, __nv_bfloat16* __restrict__ out,
                                        int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = __float2bfloat16_rn(in[i]);
  }
}

}  // namespace

void cast_f32_to_bf16(const float* in, uint16_t* out, int64_t n, void* stream) {
  if (n == 0) return;
  constexpr int kThreads = 256;  // per block
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  const int grid = int(blocks < 65535 * 8 ? blocks : 65535 * 8);
  cast_f32_to_bf16_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      in, reinterpret_cast<__nv_bfloat16*>(out), n);
  STRATA_CUDA_CHECK(cudaGetLastError());
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

}  // namespace strata::kernels
