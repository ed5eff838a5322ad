// CpuAdam: CPUID dispatch, the step's constants, and the parallel split of a
// step into tiles on the object's oneTBB arena.
#include "cpu_adam/adam.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cpu_adam/kernels.h"

namespace strata::cpu_adam {

namespace {

// __builtin_cpu_supports also checks (through XGETBV) that the OS saves the
// AVX and AVX-512 registers.
Isa detect_isa() {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (!avx2) return Isa::kScalar;
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (!avx512) return Isa::kAvx2;
  return __builtin_cpu_supports("avx512bf16") ? Isa::kAvx512Bf16 : Isa::kAvx512;
}

void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("cpu_adam: ") + what);
}

int64_t tile_count(int64_t numel) {
  return (numel + CpuAdam::kTileNumel - 1) / CpuAdam::kTileNumel;
}

}  // namespace

Isa best_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

bool isa_supported(Isa isa) { return static_cast<int>(isa) <= static_cast<int>(best_isa()); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512_bf16";
  }
  return "?";
}

Isa parse_isa(std::string_view name) {
  if (name == "auto") return best_isa();
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (name == isa_name(isa)) return isa;
  }
  throw std::invalid_argument("cpu_adam: unknown instruction set '" + std::string(name) +
                              "' (expected auto, scalar, avx2, avx512 or avx512_bf16)");
}

const char* grad_type_name(GradType type) {
  switch (type) {
    case GradType::kF32: return "fp32";
    case GradType::kBF16: return "bf16";
    case GradType::kF16: return "fp16";
  }
  return "?";
}

const char* state_type_name(StateType type) {
  switch (type) {
    case StateType::kF32: return "fp32";
    case StateType::kBF16: return "bf16";
  }
  return "?";
}

namespace detail {

StepConstants make_constants(const AdamParams& p, const StepArgs& args) {
  // Note [AdamW numerics]: double first, one rounding to float.
  const double t = static_cast<double>(args.step);
  const double bias_correction1 = 1.0 - std::pow(p.beta1, t);
  const double bias_correction2 = 1.0 - std::pow(p.beta2, t);
  StepConstants c;
  c.grad_scale = args.grad_scale;
  c.decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  c.weight_decay = static_cast<float>(p.weight_decay);
  c.one_minus_beta1 = static_cast<float>(1.0 - p.beta1);
  c.beta2 = static_cast<float>(p.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - p.beta2);
  c.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(bias_correction2));
  c.neg_step_size = static_cast<float>(-(p.lr / bias_correction1));
  c.eps = static_cast<float>(p.eps);
  c.rounding_offset = args.rounding_offset;
  c.step_key = static_cast<uint32_t>(args.step) * kRoundingStepMul;
  c.decay_mode = p.weight_decay == 0.0 ? DecayMode::kNone
                 : p.adamw             ? DecayMode::kDecoupled
                                       : DecayMode::kL2;
  return c;
}

Kernels kernels_for(Isa isa) {
  require(isa_supported(isa), "instruction set not supported by this CPU");
  switch (isa) {
    case Isa::kScalar: return scalar_kernels();
    case Isa::kAvx2: return avx2_kernels();
    case Isa::kAvx512: return avx512_kernels();
    case Isa::kAvx512Bf16: return avx512_bf16_kernels();
  }
  return scalar_kernels();
}

}  // namespace detail

CpuAdam::CpuAdam(int threads, Isa isa)
    : threads_(threads > 0 ? threads : tbb::info::default_concurrency()),
      isa_(isa),
      arena_(threads_) {
  require(threads >= 0, "threads must be >= 0");
  require(isa_supported(isa), (std::string("instruction set ") + isa_name(isa) +
                               " is not supported by this CPU (best: " + isa_name(best_isa()) + ")")
                                  .c_str());
  arena_.initialize();  // start the arena now, not on the first step
  scratch_ = std::make_unique<float[]>(size_t(threads_) * 3 * size_t(kTileNumel));
}

bool CpuAdam::step(const AdamParams& params, const StepArgs& args, const AdamSpans& s) {
  require(args.step >= 1, "step must be >= 1 (the first step is 1)");
  require(s.numel >= 0, "numel must be >= 0");
  require((s.emit == nullptr) == (s.emit_type == EmitType::kNone),
          "emit must be non-null exactly when emit_type is not kNone");
  if (s.numel == 0) return true;
  require(s.param != nullptr && s.grad != nullptr && s.exp_avg != nullptr &&
              s.exp_avg_sq != nullptr,
          "null span");
  const detail::StepConstants c = detail::make_constants(params, args);
  const detail::StepKernel kernel = detail::kernels_for(isa_).step;
  const int64_t tiles = tile_count(s.numel);
  if (threads_ == 1 || tiles == 1) return kernel(c, s, 0, s.numel);

  // Contiguous runs of tiles per thread (static partition): each thread
  // streams one long range, which the hardware prefetchers follow best.
  std::atomic<bool> finite{true};
  arena_.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<int64_t>(0, tiles),
        [&](const tbb::blocked_range<int64_t>& r) {
          const int64_t begin = r.begin() * kTileNumel;
          const int64_t end = std::min(r.end() * kTileNumel, s.numel);
          if (!kernel(c, s, begin, end)) finite.store(false, std::memory_order_relaxed);
        },
        tbb::static_partitioner());
  });
  return finite.load(std::memory_order_relaxed);
}

// Note [A step that keeps its state] in adam.h. Each tile's param and
// moments are copied into the slot's scratch and stepped there with the
// tile's own rounding offset (the bf16 moments' rounding is keyed by the
// element's index: Note [bf16 state] in types.h), so the arithmetic is
// step()'s element by element.
bool CpuAdam::keep_state_tiles(const void* constants, const AdamSpans& s, float* param_out, int64_t tile_begin,
                               int64_t tile_end, int slot) {
  const detail::StepConstants& c = *static_cast<const detail::StepConstants*>(constants);
  const detail::StepKernel kernel = detail::kernels_for(isa_).step;
  const size_t state_bytes = s.state_type == StateType::kBF16 ? 2 : 4;
  const size_t grad_bytes = s.grad_type == GradType::kF32 ? 4 : 2;
  const size_t emit_bytes = 2;
  float* p = scratch_.get() + size_t(slot) * 3 * size_t(kTileNumel);
  float* m = p + kTileNumel;
  float* v = m + kTileNumel;
  bool finite = true;
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    const int64_t at = t * kTileNumel, n = std::min(kTileNumel, s.numel - at);
    std::memcpy(p, s.param + at, size_t(n) * 4);
    std::memcpy(m, static_cast<const std::byte*>(s.exp_avg) + size_t(at) * state_bytes, size_t(n) * state_bytes);
    std::memcpy(v, static_cast<const std::byte*>(s.exp_avg_sq) + size_t(at) * state_bytes, size_t(n) * state_bytes);
    AdamSpans tile = s;
    tile.param = p;
    tile.exp_avg = m;
    tile.exp_avg_sq = v;
    tile.grad = static_cast<const std::byte*>(s.grad) + size_t(at) * grad_bytes;
    if (s.emit != nullptr) tile.emit = static_cast<std::byte*>(s.emit) + size_t(at) * emit_bytes;
    tile.numel = n;
    detail::StepConstants ct = c;
    ct.rounding_offset = c.rounding_offset + uint64_t(at);
    if (!kernel(ct, tile, 0, n)) finite = false;
    if (param_out != nullptr) std::memcpy(param_out + at, p, size_t(n) * 4);
  }
  return finite;
}

bool CpuAdam::step_keeping_state(const AdamParams& params, const StepArgs& args, const AdamSpans& s,
                                 float* param_out) {
  require(args.step >= 1, "step must be >= 1 (the first step is 1)");
  require(s.numel >= 0, "numel must be >= 0");
  require((s.emit == nullptr) == (s.emit_type == EmitType::kNone),
          "emit must be non-null exactly when emit_type is not kNone");
  require((param_out == nullptr) == (s.emit_type != EmitType::kNone),
          "param_out must be given exactly when there is no 16-bit copy to emit");
  if (s.numel == 0) return true;
  require(s.param != nullptr && s.grad != nullptr && s.exp_avg != nullptr && s.exp_avg_sq != nullptr, "null span");
  const detail::StepConstants c = detail::make_constants(params, args);
  const int64_t tiles = tile_count(s.numel);
  if (threads_ == 1 || tiles == 1) return keep_state_tiles(&c, s, param_out, 0, tiles, 0);
  std::atomic<bool> finite{true};
  arena_.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<int64_t>(0, tiles),
        [&](const tbb::blocked_range<int64_t>& r) {
          const int slot = tbb::this_task_arena::current_thread_index();
          require(slot >= 0 && slot < threads_, "an arena thread outside the scratch's slots");
          if (!keep_state_tiles(&c, s, param_out, r.begin(), r.end(), slot)) {
            finite.store(false, std::memory_order_relaxed);
          }
        },
        tbb::static_partitioner());
  });
  return finite.load(std::memory_order_relaxed);
}

void CpuAdam::convert(const float* src, void* dst, EmitType type, int64_t numel) {
  require(type != EmitType::kNone, "convert needs a 16-bit type");
  require(numel >= 0, "numel must be >= 0");
  if (numel == 0) return;
  require(src != nullptr && dst != nullptr, "null span");
  const detail::ConvertKernel kernel = detail::kernels_for(isa_).convert;
  const int64_t tiles = tile_count(numel);
  if (threads_ == 1 || tiles == 1) return kernel(src, dst, type, numel, 0, numel);
  arena_.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<int64_t>(0, tiles),
        [&](const tbb::blocked_range<int64_t>& r) {
          kernel(src, dst, type, numel, r.begin() * kTileNumel,
                 std::min(r.end() * kTileNumel, numel));
        },
        tbb::static_partitioner());
  });
}

void CpuAdam::parallel_for(int64_t n, void (*body)(void*, int64_t, int64_t), void* context) {
  require(n >= 0, "n must be >= 0");
  if (n == 0) return;
  if (threads_ == 1 || n == 1) return body(context, 0, n);
  // Dynamic partition: the chunks are small and even, and a thread the
  // compute preempts should not hold back the rest.
  arena_.execute([&] {
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 1),
                      [&](const tbb::blocked_range<int64_t>& r) { body(context, r.begin(), r.end()); });
  });
}

void convert_f32_to_16(const float* src, void* dst, EmitType type, int64_t numel, Isa isa) {
  require(type != EmitType::kNone, "convert needs a 16-bit type");
  require(numel >= 0, "numel must be >= 0");
  if (numel == 0) return;
  require(src != nullptr && dst != nullptr, "null span");
  detail::kernels_for(isa).convert(src, dst, type, numel, 0, numel);
}

}  // namespace strata::cpu_adam
