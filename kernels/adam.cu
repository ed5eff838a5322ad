// Note [AdamW numerics] on the GPU. Compiled with -fmad=false (CMakeLists):
// nvcc would otherwise fuse a*b+c wherever it likes; here every operation
// is written with its rounding intrinsic, so the source says what runs.
#include "kernels/adam.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cpu_adam/grad_ops.h"
#include "kernels/check.h"

namespace strata::kernels {

namespace {

using cpu_adam::EmitType;
using cpu_adam::GradType;
using cpu_adam::StateType;
using cpu_adam::detail::DecayMode;
using cpu_adam::detail::StepConstants;

constexpr int kThreads = 256;

int grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return int(blocks < 65535 * 8 ? blocks : 65535 * 8);
}

template <GradType G>
__device__ float load_grad(const void* grad, int64_t i) {
  if constexpr (G == GradType::kF32) return static_cast<const float*>(grad)[i];
  if constexpr (G == GradType::kBF16) return __uint_as_float(uint32_t(static_cast<const uint16_t*>(grad)[i]) << 16);
  if constexpr (G == GradType::kF16) return __half2float(static_cast<const __half*>(grad)[i]);
}

template <StateType S>
__device__ float load_state(const void* state, int64_t i) {
  if constexpr (S == StateType::kF32) return static_cast<const float*>(state)[i];
  if constexpr (S == StateType::kBF16) return __uint_as_float(uint32_t(static_cast<const uint16_t*>(state)[i]) << 16);
}

// Note [bf16 state]: the 32 random bits of element `index`.
__device__ uint32_t rounding_bits(uint32_t step_key, uint64_t index) {
  uint32_t x = uint32_t(index) * cpu_adam::detail::kRoundingIndexMul + step_key;
  x ^= x >> 16;
  x *= cpu_adam::detail::kRoundingMix1;
  x ^= x >> 15;
  x *= cpu_adam::detail::kRoundingMix2;
  return x ^ (x >> 16);
}

__device__ uint16_t bf16_stochastic(float x, uint32_t r16) {
  if (isnan(x)) return 0x7FC0;
  return uint16_t((__float_as_uint(x) + r16) >> 16);
}

// Note [16-bit rounding]: the intrinsics round to nearest even (fp16 with
// IEEE denormals and overflow to Inf); NaN is made c10's.
__device__ uint16_t to_bf16(float x) {
  if (isnan(x)) return 0x7FC0;
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

__device__ uint16_t to_fp16(float x) {
  if (isnan(x)) return uint16_t((__float_as_uint(x) >> 16) & 0x8000u) | 0x7E00;
  return __half_as_ushort(__float2half_rn(x));
}

template <GradType G, EmitType E, DecayMode D, StateType S>
__global__ void adam_kernel(StepConstants c, float* __restrict__ param, const void* __restrict__ grad,
                            void* __restrict__ exp_avg, void* __restrict__ exp_avg_sq, void* __restrict__ emit,
                            int64_t n, int* nonfinite) {
  bool bad = false;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float g = __fmul_rn(load_grad<G>(grad, i), c.grad_scale);
    bad |= !isfinite(g);
    float p = param[i];
    if constexpr (D == DecayMode::kL2) g = __fmaf_rn(p, c.weight_decay, g);
    if constexpr (D == DecayMode::kDecoupled) p = __fmul_rn(p, c.decay);
    float m = load_state<S>(exp_avg, i);
    m = __fmaf_rn(c.one_minus_beta1, __fsub_rn(g, m), m);
    float v = load_state<S>(exp_avg_sq, i);
    v = __fmaf_rn(__fmul_rn(c.one_minus_beta2, g), g, __fmul_rn(v, c.beta2));
    const float denom = __fmaf_rn(__fsqrt_rn(v), c.inv_bias_correction2_sqrt, c.eps);
    p = __fadd_rn(p, __fdiv_rn(__fmul_rn(c.neg_step_size, m), denom));
    param[i] = p;
    if constexpr (S == StateType::kF32) {
      static_cast<float*>(exp_avg)[i] = m;
      static_cast<float*>(exp_avg_sq)[i] = v;
    } else {
      const uint32_t bits = rounding_bits(c.step_key, c.rounding_offset + uint64_t(i));
      static_cast<uint16_t*>(exp_avg)[i] = bf16_stochastic(m, bits & 0xFFFFu);
      static_cast<uint16_t*>(exp_avg_sq)[i] = bf16_stochastic(v, bits >> 16);
    }
    if constexpr (E == EmitType::kBF16) static_cast<uint16_t*>(emit)[i] = to_bf16(p);
    if constexpr (E == EmitType::kF16) static_cast<uint16_t*>(emit)[i] = to_fp16(p);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0 && nonfinite != nullptr) atomicOr(nonfinite, 1);
}

using Launch = void (*)(const StepConstants&, const cpu_adam::AdamSpans&, int*, cudaStream_t);

template <GradType G, EmitType E, DecayMode D, StateType S>
void launch(const StepConstants& c, const cpu_adam::AdamSpans& s, int* nonfinite, cudaStream_t stream) {
  adam_kernel<G, E, D, S><<<grid_for(s.numel), kThreads, 0, stream>>>(c, s.param, s.grad, s.exp_avg, s.exp_avg_sq,
                                                                       s.emit, s.numel, nonfinite);
}

template <GradType G, EmitType E, DecayMode D>
Launch pick_state(StateType st) {
  return st == StateType::kF32 ? &launch<G, E, D, StateType::kF32> : &launch<G, E, D, StateType::kBF16>;
}

template <GradType G, EmitType E>
Launch pick_decay(DecayMode d, StateType st) {
  switch (d) {
    case DecayMode::kNone: return pick_state<G, E, DecayMode::kNone>(st);
    case DecayMode::kDecoupled: return pick_state<G, E, DecayMode::kDecoupled>(st);
    case DecayMode::kL2: return pick_state<G, E, DecayMode::kL2>(st);
  }
  return nullptr;
}

template <GradType G>
Launch pick_emit(EmitType e, DecayMode d, StateType st) {
  switch (e) {
    case EmitType::kNone: return pick_decay<G, EmitType::kNone>(d, st);
    case EmitType::kBF16: return pick_decay<G, EmitType::kBF16>(d, st);
    case EmitType::kF16: return pick_decay<G, EmitType::kF16>(d, st);
  }
  return nullptr;
}

__global__ void squared_norm_kernel(const float* __restrict__ x, int64_t n, double* partials) {
  __shared__ double sums[kThreads];
  double acc = 0.0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double v = x[i];
    acc = __fma_rn(v, v, acc);
  }
  sums[threadIdx.x] = acc;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) sums[threadIdx.x] += sums[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = sums[0];
}

// Note [Ordered norm]: one block of kNormLanes threads per chunk; lane l sums
// its elements in order, then the tree fold (no contraction: -fmad=false,
// and the squares of floats are exact in double anyway).
constexpr int kLanes = cpu_adam::kNormLanes;
static_assert(kLanes == kThreads, "one lane per thread");

__device__ double fold_lanes(double* lanes) {
  for (int half = kLanes / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) lanes[threadIdx.x] = __dadd_rn(lanes[threadIdx.x], lanes[threadIdx.x + half]);
    __syncthreads();
  }
  return lanes[0];
}

__global__ void ordered_chunk_kernel(const float* __restrict__ x, int64_t n, double* partials) {
  __shared__ double lanes[kLanes];
  const int64_t base = int64_t(blockIdx.x) * cpu_adam::kNormChunk;
  double acc = 0.0;
  for (int64_t j = 0; j < cpu_adam::kNormChunk; j += kLanes) {
    const int64_t i = base + j + threadIdx.x;
    if (i < n) {
      const double v = x[i];
      acc = __dadd_rn(acc, __dmul_rn(v, v));
    }
  }
  lanes[threadIdx.x] = acc;
  __syncthreads();
  const double total = fold_lanes(lanes);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void ordered_partials_kernel(const double* __restrict__ partials, int64_t count, double* out) {
  __shared__ double lanes[kLanes];
  double acc = 0.0;
  for (int64_t c = threadIdx.x; c < count; c += kLanes) acc = __dadd_rn(acc, partials[c]);
  lanes[threadIdx.x] = acc;
  __syncthreads();
  const double total = fold_lanes(lanes);
  if (threadIdx.x == 0) *out = total;
}

__global__ void unscale_kernel(float* __restrict__ x, int64_t n, float scale, int* nonfinite) {
  bool bad = false;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = __fmul_rn(x[i], scale);
    x[i] = v;
    bad |= !isfinite(v);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(nonfinite, 1);
}

}  // namespace

void adam_step(const StepConstants& c, const cpu_adam::AdamSpans& s, int* nonfinite, void* stream) {
  STRATA_KERNEL_REQUIRE(s.numel >= 0, "numel must be >= 0");
  STRATA_KERNEL_REQUIRE((s.emit == nullptr) == (s.emit_type == EmitType::kNone),
                        "emit must be non-null exactly when emit_type is not kNone");
  if (s.numel == 0) return;
  STRATA_KERNEL_REQUIRE(s.param != nullptr && s.grad != nullptr && s.exp_avg != nullptr && s.exp_avg_sq != nullptr,
                        "null span");
  Launch l = nullptr;
  switch (s.grad_type) {
    case GradType::kF32: l = pick_emit<GradType::kF32>(s.emit_type, c.decay_mode, s.state_type); break;
    case GradType::kBF16: l = pick_emit<GradType::kBF16>(s.emit_type, c.decay_mode, s.state_type); break;
    case GradType::kF16: l = pick_emit<GradType::kF16>(s.emit_type, c.decay_mode, s.state_type); break;
  }
  l(c, s, nonfinite, static_cast<cudaStream_t>(stream));
  STRATA_CUDA_CHECK(cudaGetLastError());
}

void squared_norm_partials(const float* x, int64_t n, double* partials, int num_partials, void* stream) {
  STRATA_KERNEL_REQUIRE(num_partials >= 1 && n >= 0, "squared_norm_partials: bad sizes");
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int used = num_partials < kMaxNormPartials ? num_partials : kMaxNormPartials;
  STRATA_CUDA_CHECK(cudaMemsetAsync(partials, 0, size_t(num_partials) * sizeof(double), st));
  if (n == 0) return;
  const int grid = grid_for(n) < used ? grid_for(n) : used;
  squared_norm_kernel<<<grid, kThreads, 0, st>>>(x, n, partials);
  STRATA_CUDA_CHECK(cudaGetLastError());
}

int64_t ordered_norm_scratch(int64_t n) { return (n + cpu_adam::kNormChunk - 1) / cpu_adam::kNormChunk; }

void ordered_squared_norm(const float* x, int64_t n, double* out, double* scratch, void* stream) {
  STRATA_KERNEL_REQUIRE(n >= 0 && out != nullptr, "ordered_squared_norm: bad arguments");
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t chunks = ordered_norm_scratch(n);
  if (chunks > 0) {
    STRATA_KERNEL_REQUIRE(scratch != nullptr && chunks < (int64_t(1) << 31), "ordered_squared_norm: scratch");
    ordered_chunk_kernel<<<unsigned(chunks), kLanes, 0, st>>>(x, n, scratch);
    STRATA_CUDA_CHECK(cudaGetLastError());
  }
  ordered_partials_kernel<<<1, kLanes, 0, st>>>(scratch, chunks, out);
  STRATA_CUDA_CHECK(cudaGetLastError());
}

void unscale_and_check(float* x, int64_t n, float scale, int* nonfinite, void* stream) {
  STRATA_KERNEL_REQUIRE(n >= 0 && nonfinite != nullptr, "unscale_and_check: bad arguments");
  if (n == 0) return;
  unscale_kernel<<<grid_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, n, scale, nonfinite);
  STRATA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace strata::kernels
