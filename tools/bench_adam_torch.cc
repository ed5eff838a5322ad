// bench_adam_torch: LibTorch's own CPU AdamW (torch::optim::AdamW) against
// Strata's CpuAdam on the same sizes and threads, interleaved rep by rep,
// medians. Kept out of `strata bench-adam` so that cpu_adam and the CLI's
// benchmark stay free of LibTorch.
//   bench_adam_torch [--numel N] [--threads T] [--reps R] [--json]
// Times: torch AdamW step; Strata step (fp32 grads, no emit); and, for the
// 16-bit copy the GPU needs, LibTorch's bf16 copy_ of the params after its
// step (what a separate conversion pass costs with LibTorch) against
// Strata's step with the bf16 emit fused in.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "cpu_adam/adam.h"

namespace {

double median(std::vector<double> xs) {
  std::sort(xs.begin(), xs.end());
  const size_t n = xs.size();
  return n % 2 == 1 ? xs[n / 2] : 0.5 * (xs[n / 2 - 1] + xs[n / 2]);
}

double time_ms(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  // LibTorch's OpenMP threads spin after every parallel region by default,
  // taking the cores from oneTBB's threads in the next timed call (and the
  // other way round). Passive waiting costs LibTorch one wake-up per op,
  // nothing next to ops over millions of elements. Must precede OpenMP's start.
  setenv("OMP_WAIT_POLICY", "passive", 0);

  CLI::App app{"LibTorch's CPU AdamW against Strata's CpuAdam"};
  int64_t numel = 25'000'000;
  int threads = 0;
  int reps = 5;
  bool json = false;
  app.add_option("--numel", numel, "Parameters per step")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "Threads for both (0: all cores)")->capture_default_str();
  app.add_option("--reps", reps, "Timed repetitions (medians)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_flag("--json", json, "Print one JSON object");
  CLI11_PARSE(app, argc, argv);

  strata::cpu_adam::CpuAdam adam(threads);
  torch::set_num_threads(adam.threads());
  const int64_t n = numel;

  // LibTorch: a parameter with a gradient and its optimizer (state created
  // on the first step, which is the warm-up).
  torch::Tensor tp = torch::rand({n}, torch::kFloat32).sub_(0.5).set_requires_grad(true);
  tp.mutable_grad() = torch::rand({n}, torch::kFloat32).mul_(1e-3);
  torch::optim::AdamW torch_opt({tp}, torch::optim::AdamWOptions(1e-3));
  torch::Tensor tp16 = torch::empty({n}, torch::kBFloat16);

  // Strata: its own buffers with the same values.
  torch::Tensor sp = tp.detach().clone(), sg = tp.grad().clone();
  torch::Tensor sm = torch::zeros({n}), sv = torch::zeros({n});
  torch::Tensor s16 = torch::empty({n}, torch::kBFloat16);
  strata::cpu_adam::AdamSpans spans{.param = sp.data_ptr<float>(), .grad = sg.data_ptr<float>(),
                                    .exp_avg = sm.data_ptr<float>(),
                                    .exp_avg_sq = sv.data_ptr<float>(), .numel = n};
  strata::cpu_adam::AdamSpans fused = spans;
  fused.emit = s16.data_ptr();
  fused.emit_type = strata::cpu_adam::EmitType::kBF16;
  const strata::cpu_adam::AdamParams hp;  // the same defaults as AdamWOptions
  int64_t t = 0;

  struct Variant {
    const char* name;
    std::function<void()> run;
    std::vector<double> ms;
  };
  std::vector<Variant> variants = {
      {"torch", [&] { torch_opt.step(); }, {}},
      {"torch_step_and_bf16_copy", [&] { torch_opt.step(); tp16.copy_(tp.detach()); }, {}},
      {"strata", [&] { adam.step(hp, {.step = ++t}, spans); }, {}},
      {"strata_fused_bf16", [&] { adam.step(hp, {.step = ++t}, fused); }, {}},
  };
  std::fprintf(stderr, "bench_adam_torch: %lld params, %d threads, %d reps...\n",
               static_cast<long long>(n), adam.threads(), reps);
  for (Variant& v : variants) v.run();  // warm-up (LibTorch allocates its state here)
  for (int r = 0; r < reps; ++r) {
    for (size_t k = 0; k < variants.size(); ++k) {
      Variant& v = variants[(k + r) % variants.size()];
      v.ms.push_back(time_ms(v.run));
    }
  }
  const double torch_ms = median(variants[0].ms), torch_copy_ms = median(variants[1].ms);
  const double strata_ms = median(variants[2].ms), fused_ms = median(variants[3].ms);
  if (json) {
    std::printf(
        "{\"numel\":%lld,\"threads\":%d,\"isa\":\"%s\",\"reps\":%d,\"torch_ms\":%.3f,"
        "\"torch_step_and_bf16_copy_ms\":%.3f,\"strata_ms\":%.3f,\"strata_fused_bf16_ms\":%.3f,"
        "\"torch_vs_strata\":%.3f,\"torch_two_pass_vs_strata_fused\":%.3f}\n",
        static_cast<long long>(n), adam.threads(), strata::cpu_adam::isa_name(adam.isa()), reps,
        torch_ms, torch_copy_ms, strata_ms, fused_ms, torch_ms / strata_ms, torch_copy_ms / fused_ms);
    return 0;
  }
  std::printf("bench_adam_torch: %lld params, %d threads, isa %s; medians of %d reps\n",
              static_cast<long long>(n), adam.threads(), strata::cpu_adam::isa_name(adam.isa()), reps);
  auto line = [&](const char* what, double ms) {
    std::printf("  %-44s %9.2f ms  %7.3f Gparam/s\n", what, ms, n / ms * 1e-6);
  };
  line("torch::optim::AdamW step", torch_ms);
  line("torch AdamW step + bf16 copy_ of the params", torch_copy_ms);
  line("Strata step (fp32 grads, no emit)", strata_ms);
  line("Strata step + fused bf16 emit", fused_ms);
  std::printf("  torch / Strata step time: %.2f (target >= 10)\n", torch_ms / strata_ms);
  std::printf("  torch step + copy / Strata fused time: %.2f\n", torch_copy_ms / fused_ms);
  return 0;
}
