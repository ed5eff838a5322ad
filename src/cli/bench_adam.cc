// `strata bench-adam`: on the same buffers, in the same run, interleaved rep
// by rep (memory bandwidth on shared machines swings from minute to minute,
// so only same-run ratios mean anything), times
//   roof      one pass reading four fp32 arrays and writing three: the DRAM
//             traffic an fp32 Adam step cannot avoid, on the same threads;
//   step      CpuAdam::step without the 16-bit emit;
//   fused     CpuAdam::step with the 16-bit emit (when --emit is not none);
//   two-pass  step, then CpuAdam::convert over the updated params;
// and reports medians: ms per step, parameters/s, GB/s, and the ratios.
#include "cli/bench_adam.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/bench_stats.h"
#include "cpu_adam/adam.h"
#include "util/errors.h"
#include "util/logging.h"

namespace strata {
namespace {

using cpu_adam::CpuAdam;
using cpu_adam::EmitType;
using cpu_adam::GradType;
using cpu_adam::StateType;

struct BenchAdamOptions {
  int64_t numel = 25'000'000;
  int threads = 0;  // 0: all cores
  std::string grad_dtype = "fp32";
  std::string emit = "bf16";
  std::string state = "fp32";  // exp_avg / exp_avg_sq storage
  std::string isa = "auto";
  int reps = 9;
  bool json = false;
};

GradType parse_grad_type(const std::string& s) {
  if (s == "bf16") return GradType::kBF16;
  if (s == "fp16") return GradType::kF16;
  return GradType::kF32;
}

EmitType parse_emit_type(const std::string& s) {
  if (s == "bf16") return EmitType::kBF16;
  if (s == "fp16") return EmitType::kF16;
  return EmitType::kNone;
}

// A page-aligned heap buffer (owning; freed on destruction), aligned like the
// engine's shards (4 KiB, what O_DIRECT needs).
struct Buffer {
  std::unique_ptr<void, decltype(&std::free)> ptr{nullptr, &std::free};
  explicit Buffer(int64_t bytes) {
    constexpr size_t kAlign = 4096;  // bytes
    const size_t rounded = (static_cast<size_t>(bytes) + kAlign - 1) / kAlign * kAlign;
    ptr.reset(std::aligned_alloc(kAlign, rounded));
    if (!ptr) {
      throw OutOfMemoryError("bench-adam: cannot allocate " + format_bytes(double(bytes)) +
                             "; try a smaller --numel");
    }
  }
  template <class T>
  T* as() const { return static_cast<T*>(ptr.get()); }
};

// Splits [0, numel) into tiles the way CpuAdam does and runs fn(begin, end)
// on the arena's threads.
template <class Fn>
void parallel_tiles(tbb::task_arena& arena, int64_t numel, Fn fn) {
  const int64_t tiles = (numel + CpuAdam::kTileNumel - 1) / CpuAdam::kTileNumel;
  arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<int64_t>(0, tiles),
        [&](const tbb::blocked_range<int64_t>& r) {
          fn(r.begin() * CpuAdam::kTileNumel, std::min(r.end() * CpuAdam::kTileNumel, numel));
        },
        tbb::static_partitioner());
  });
}

// The roof: read p, g, m, v; write p, m, v, with the widest loads and stores
// this file may use without the kernels' dispatch: AVX2 where the CPU has it
// (a target attribute, so the rest of the file stays generic), SSE2 otherwise.
// Either is far from compute-bound for arrays that do not fit in cache.
__attribute__((target("avx2"))) void roof_range_avx2(float* p, const float* g, float* m,
                                                     float* v, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_loadu_ps(p + i), x));
    _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_loadu_ps(m + i), x));
    _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), x));
  }
  for (; i < end; ++i) {
    p[i] += g[i];
    m[i] += g[i];
    v[i] += g[i];
  }
}

void roof_range_sse2(float* p, const float* g, float* m, float* v, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + 4 <= end; i += 4) {
    const __m128 x = _mm_loadu_ps(g + i);
    _mm_storeu_ps(p + i, _mm_add_ps(_mm_loadu_ps(p + i), x));
    _mm_storeu_ps(m + i, _mm_add_ps(_mm_loadu_ps(m + i), x));
    _mm_storeu_ps(v + i, _mm_add_ps(_mm_loadu_ps(v + i), x));
  }
  for (; i < end; ++i) {
    p[i] += g[i];
    m[i] += g[i];
    v[i] += g[i];
  }
}

template <class Fn>
double time_ms(Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}

void run_bench_adam(const BenchAdamOptions& o) {
  const GradType grad_type = parse_grad_type(o.grad_dtype);
  const EmitType emit_type = parse_emit_type(o.emit);
  const bool has_emit = emit_type != EmitType::kNone;
  CpuAdam adam(o.threads, cpu_adam::parse_isa(o.isa));
  tbb::task_arena arena(adam.threads());
  const int64_t n = o.numel;
  const int64_t grad_bytes = grad_type == GradType::kF32 ? 4 : 2;
  const StateType state_type = o.state == "bf16" ? StateType::kBF16 : StateType::kF32;
  const int64_t state_bytes = state_type == StateType::kF32 ? 4 : 2;

  Buffer param(n * 4), exp_avg(n * 4), exp_avg_sq(n * 4), grad(n * grad_bytes), grad32(n * 4),
      emit(n * 2);
  // The step's moments: the roof's fp32 arrays, or bf16 arrays of their own
  // (Note [bf16 state]; the roof stays what an fp32 step must move).
  Buffer exp_avg16(state_type == StateType::kBF16 ? n * 2 : 1),
      exp_avg_sq16(state_type == StateType::kBF16 ? n * 2 : 1);
  void* step_m = state_type == StateType::kBF16 ? exp_avg16.as<void>() : exp_avg.as<void>();
  void* step_v = state_type == StateType::kBF16 ? exp_avg_sq16.as<void>() : exp_avg_sq.as<void>();
  // First touch on the benchmark's threads, with values a step can chew on.
  parallel_tiles(arena, n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float x = static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
      param.as<float>()[i] = x;
      exp_avg.as<float>()[i] = 0.0f;
      exp_avg_sq.as<float>()[i] = 0.0f;
      grad32.as<float>()[i] = 1e-3f * x;
      emit.as<uint16_t>()[i] = 0;
      if (state_type == StateType::kBF16) {
        exp_avg16.as<uint16_t>()[i] = 0;
        exp_avg_sq16.as<uint16_t>()[i] = 0;
      }
    }
  });
  if (grad_type == GradType::kF32) {
    parallel_tiles(arena, n, [&](int64_t b, int64_t e) {
      std::copy(grad32.as<float>() + b, grad32.as<float>() + e, grad.as<float>() + b);
    });
  } else {
    adam.convert(grad32.as<float>(), grad.as<void>(),
                 grad_type == GradType::kBF16 ? EmitType::kBF16 : EmitType::kF16, n);
  }

  cpu_adam::AdamSpans spans{.param = param.as<float>(), .grad = grad.as<void>(),
                            .grad_type = grad_type, .exp_avg = step_m, .exp_avg_sq = step_v,
                            .state_type = state_type, .numel = n};
  cpu_adam::AdamSpans fused_spans = spans;
  fused_spans.emit = emit.as<void>();
  fused_spans.emit_type = emit_type;
  const cpu_adam::AdamParams hp;  // PyTorch's AdamW defaults
  int64_t t = 0;

  const bool avx2 = cpu_adam::isa_supported(cpu_adam::Isa::kAvx2);
  auto roof = [&] {
    parallel_tiles(arena, n, [&](int64_t b, int64_t e) {
      float* p = param.as<float>();
      float* m = exp_avg.as<float>();
      float* v = exp_avg_sq.as<float>();
      // The step's own gradient buffer when it is fp32: the very same arrays.
      const float* g = grad_type == GradType::kF32 ? grad.as<float>() : grad32.as<float>();
      avx2 ? roof_range_avx2(p, g, m, v, b, e) : roof_range_sse2(p, g, m, v, b, e);
    });
  };
  auto step = [&] { adam.step(hp, {.step = ++t}, spans); };
  auto fused = [&] { adam.step(hp, {.step = ++t}, fused_spans); };
  double convert_part = 0;
  auto two_pass = [&] {
    adam.step(hp, {.step = ++t}, spans);
    convert_part += time_ms([&] { adam.convert(param.as<float>(), emit.as<void>(), emit_type, n); });
  };

  struct Variant {
    const char* name;
    std::function<void()> run;
    std::vector<double> ms;
  };
  std::vector<Variant> variants = {{"roof", roof, {}}, {"step", step, {}}};
  if (has_emit) {
    variants.push_back({"fused", fused, {}});
    variants.push_back({"two_pass", two_pass, {}});
  }
  std::fprintf(stderr, "bench-adam: %lld params, %d threads, %s, %d reps of %zu variants...\n",
               static_cast<long long>(n), adam.threads(), cpu_adam::isa_name(adam.isa()), o.reps,
               variants.size());
  for (Variant& v : variants) v.run();  // warm-up
  convert_part = 0;
  std::vector<double> convert_ms;
  for (int r = 0; r < o.reps; ++r) {
    // Rotate the order every rep so no variant always follows the same one.
    for (size_t k = 0; k < variants.size(); ++k) {
      Variant& v = variants[(k + r) % variants.size()];
      const double before = convert_part;
      v.ms.push_back(time_ms(v.run));
      if (convert_part != before) convert_ms.push_back(convert_part - before);
    }
  }

  // Bytes each variant must move through DRAM (stores of lines already read
  // cost no extra read; the 16-bit emit is written without being read first
  // only with streaming stores, which these kernels do not use).
  const double step_bytes = double(n) * (4 + grad_bytes + 4 * state_bytes + 4);
  const double emit_bytes = double(n) * 2;
  auto result = [&](const char* name) {
    for (const Variant& v : variants) {
      if (std::string(v.name) == name) return median(v.ms);
    }
    return -1.0;
  };
  const double roof_ms = result("roof"), step_ms = result("step");
  const double fused_ms = has_emit ? result("fused") : step_ms;
  const double two_pass_ms = has_emit ? result("two_pass") : -1.0;
  const double conv_ms = has_emit ? median(convert_ms) : -1.0;

  if (o.json) {
    nlohmann::json j = {{"numel", n},
                        {"threads", adam.threads()},
                        {"isa", cpu_adam::isa_name(adam.isa())},
                        {"grad_dtype", cpu_adam::grad_type_name(grad_type)},
                        {"emit", cpu_adam::emit_type_name(emit_type)},
                        {"state", cpu_adam::state_type_name(state_type)},
                        {"reps", o.reps},
                        {"roof_ms", roof_ms},
                        {"step_ms", step_ms},
                        {"strata_ms", fused_ms},
                        {"roof_gbps", 28.0 * n / roof_ms * 1e-6},
                        {"step_gbps", step_bytes / step_ms * 1e-6},
                        {"step_vs_roof", roof_ms / step_ms}};
    if (has_emit) {
      j["two_pass_ms"] = two_pass_ms;
      j["convert_ms"] = conv_ms;
      j["two_pass_vs_fused"] = two_pass_ms / fused_ms;
    } else {
      j["two_pass_ms"] = nullptr;
    }
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf(
      "bench-adam: %lld params, %d threads, isa %s, grad %s, emit %s, state %s; medians of %d reps\n",
      static_cast<long long>(n), adam.threads(), cpu_adam::isa_name(adam.isa()),
      cpu_adam::grad_type_name(grad_type), cpu_adam::emit_type_name(emit_type),
      cpu_adam::state_type_name(state_type), o.reps);
  auto line = [&](const char* what, double ms, double bytes) {
    std::printf("  %-34s %9.2f ms  %7.3f Gparam/s  %6.1f GB/s\n", what, ms, n / ms * 1e-6,
                bytes / ms * 1e-6);
  };
  line("roof (read 4 fp32, write 3 fp32)", roof_ms, 28.0 * n);
  line("step (no emit)", step_ms, step_bytes);
  if (has_emit) {
    const std::string e = cpu_adam::emit_type_name(emit_type);
    line(("step + " + e + " emit (fused)").c_str(), fused_ms, step_bytes + emit_bytes);
    line(("two-pass: step, then " + e + " pass").c_str(), two_pass_ms,
         step_bytes + double(n) * 4 + emit_bytes);
    line(("  of which the " + e + " pass").c_str(), conv_ms, double(n) * 4 + emit_bytes);
  }
  std::printf("  step speed / roof speed: %.3f (target >= 0.95)\n", roof_ms / step_ms);
  if (has_emit) {
    std::printf("  two-pass time / fused time: %.3f (target >= 1.3)\n", two_pass_ms / fused_ms);
  }
}

}  // namespace

void register_bench_adam(CLI::App& app) {
  auto opts = std::make_shared<BenchAdamOptions>();
  CLI::App* sub = app.add_subcommand(
      "bench-adam",
      "Time the CPU Adam step against a memory roof and a two-pass 16-bit variant");
  sub->add_option("--numel", opts->numel, "Parameters per step")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  sub->add_option("--threads", opts->threads, "Threads (0: all cores)")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  sub->add_option("--grad-dtype", opts->grad_dtype, "Gradient type")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  sub->add_option("--emit", opts->emit, "16-bit copy of the params written by the step")
      ->capture_default_str()
      ->check(CLI::IsMember({"bf16", "fp16", "none"}));
  sub->add_option("--state", opts->state, "Storage of exp_avg and exp_avg_sq (bf16: stochastic rounding)")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "bf16"}));
  sub->add_option("--isa", opts->isa, "Kernel instruction set (forces a lower one)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "scalar", "avx2", "avx512", "avx512_bf16"}));
  sub->add_option("--reps", opts->reps, "Timed repetitions of each variant (medians)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  sub->add_flag("--json", opts->json, "Print one JSON object instead of the table");
  sub->callback([opts] { run_bench_adam(*opts); });
}

}  // namespace strata
