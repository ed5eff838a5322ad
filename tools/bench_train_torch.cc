// The reference of GPU benchmark (a) (BENCHMARKS.md, "GPU"): a plain LibTorch
// training loop of the model a Strata config describes, on one device, with
// everything resident — the 16-bit working weights as autograd leaves, fp32
// master weights and Adam moments updated by LibTorch's fused AdamW
// (at::_fused_adamw_) with global-norm clipping folded into its grad_scale —
// and the same blocks' forward (Strata's Model), dtype and recompute policy
// ("never": autograd keeps the whole graph; the policy the config must ask
// for). Also times a large bf16 GEMM, the roof MFU is reported against.
// Prints one JSON line: tokens_per_s, step_s (median), flops_per_token,
// gemm_tflops.
//
//   bench_train_torch --config CONFIG [--device cuda] [--steps 20] [--warmup 3]
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <CLI/CLI.hpp>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/config.h"
#include "memory/layout.h"
#include "model/model.h"
#include "util/errors.h"

namespace {

using strata::BlockKind;

void sync(const c10::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize(d.index());
}

double seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// TFLOP/s of an n x n x n bf16 matmul (or fp32 on a CPU), median of `reps`.
double gemm_tflops(const c10::Device& d, int64_t n, int reps) {
  const auto dt = d.is_cuda() ? at::kBFloat16 : at::kFloat;
  at::Tensor a = at::randn({n, n}, at::TensorOptions().dtype(dt).device(d));
  at::Tensor b = at::randn({n, n}, at::TensorOptions().dtype(dt).device(d));
  at::Tensor c = at::mm(a, b);
  sync(d);
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) at::mm_out(c, a, b);
    sync(d);
    t.push_back(seconds(t0) / 10);
  }
  std::sort(t.begin(), t.end());
  return 2.0 * double(n) * double(n) * double(n) / t[t.size() / 2] / 1e12;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Plain LibTorch training loop of a Strata config's model (GPU benchmark (a)'s reference)"};
  std::string config_path, device_name = "cuda";
  int steps = 20, warmup = 3;
  int64_t gemm_n = 8192;
  app.add_option("--config", config_path, "Strata JSON config")->required();
  app.add_option("--device", device_name, "cuda | cuda:N | cpu");
  app.add_option("--steps", steps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed steps first");
  app.add_option("--gemm-n", gemm_n, "size of the reference GEMM (0: none)");
  CLI11_PARSE(app, argc, argv);
  try {
    const strata::Config cfg = strata::load_config(config_path, {}, 1);
    const c10::Device dev(device_name);
    const strata::Model model(cfg.model);
    const strata::StateLayout layout(model.layout_specs(), 1);
    const auto dt = cfg.run.compute_dtype == "bf16" ? at::kBFloat16 : cfg.run.compute_dtype == "fp16" ? at::kHalf
                                                                                                      : at::kFloat;
    if (cfg.run.recompute == "always") {
      throw strata::ConfigError("run.recompute", "the reference keeps the whole graph: use \"never\" or \"auto\"");
    }
    // Weights: fp32 master per parameter (initialised as Strata does, seed
    // run.seed), a working copy in the compute dtype whose views are leaves.
    at::Generator gen = at::detail::createCPUGenerator(cfg.run.seed);
    std::vector<std::vector<at::Tensor>> master(layout.num_blocks()), work(layout.num_blocks());
    std::vector<at::Tensor> p_master, p_work, m1, m2, steps_t;
    for (size_t b = 0; b < layout.num_blocks(); ++b) {
      const strata::BlockLayout& bl = layout.block(b);
      at::Tensor flat = at::zeros({bl.padded_numel}, at::kFloat);
      strata::init_block(bl, flat, gen);
      for (const at::Tensor& v : strata::param_views(bl, flat)) {
        at::Tensor m = v.to(dev).contiguous();
        at::Tensor w = m.to(dt).detach().requires_grad_(true);
        master[b].push_back(m);
        work[b].push_back(w);
        p_master.push_back(m);
        p_work.push_back(w);
        m1.push_back(at::zeros_like(m));
        m2.push_back(at::zeros_like(m));
        steps_t.push_back(at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(dev)));
      }
    }
    const int64_t B = cfg.train_micro_batch_size_per_gpu, T = cfg.model.seq_len;
    const int64_t accum = cfg.gradient_accumulation_steps;
    at::Tensor tokens = at::randint(cfg.model.vocab_size, {accum, B, T + 1},
                                    at::TensorOptions().dtype(at::kLong).device(dev));
    const double max_norm = cfg.gradient_clipping;
    std::vector<double> step_s;
    for (int s = 0; s < warmup + steps; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<at::Tensor> grads32;
      for (int64_t m = 0; m < accum; ++m) {
        at::Tensor x = tokens[m].narrow(1, 0, T);
        at::Tensor y = tokens[m].narrow(1, 1, T);
        for (size_t b = 0; b < layout.num_blocks(); ++b) {
          const at::Tensor tied = model.blocks()[b].kind == BlockKind::kHead && cfg.model.tie_embeddings
                                      ? work[0][0]
                                      : at::Tensor();
          x = model.forward(b, work[b], x, tied);
        }
        at::Tensor loss = at::cross_entropy_loss(x.reshape({-1, x.size(-1)}).to(at::kFloat), y.reshape({-1}));
        std::vector<at::Tensor> g = torch::autograd::grad({loss / double(accum)}, p_work);
        if (m == 0) {
          for (at::Tensor& gi : g) grads32.push_back(gi.to(at::kFloat));
        } else {
          for (size_t i = 0; i < g.size(); ++i) grads32[i].add_(g[i]);
        }
      }
      // Clipping as torch.nn.utils.clip_grad_norm_, folded into AdamW's
      // grad_scale (grads are divided by it): no host sync.
      std::optional<at::Tensor> scale;
      if (max_norm > 0.0) {
        std::vector<at::Tensor> norms = at::_foreach_norm(grads32, 2.0);
        at::Tensor total = at::stack(norms).norm();
        scale = at::clamp_min((total + 1e-6) / max_norm, 1.0);  // 1 / min(1, max / (total + 1e-6))
      }
      at::_foreach_add_(steps_t, 1.0);
      at::_fused_adamw_(p_master, grads32, m1, m2, {}, steps_t, cfg.optimizer.lr, cfg.optimizer.beta1,
                        cfg.optimizer.beta2, cfg.optimizer.weight_decay, cfg.optimizer.eps, false, false, scale,
                        std::nullopt);
      {
        at::NoGradGuard no_grad;
        for (size_t i = 0; i < p_work.size(); ++i) p_work[i].copy_(p_master[i]);
      }
      sync(dev);
      if (s >= warmup) step_s.push_back(seconds(t0));
    }
    std::sort(step_s.begin(), step_s.end());
    const double med = step_s[step_s.size() / 2];
    const double tokens_per_s = double(accum * B * T) / med;
    nlohmann::json out = {{"device", device_name},
                          {"parameters", layout.parameter_count()},
                          {"compute_dtype", cfg.run.compute_dtype},
                          {"step_s", med},
                          {"tokens_per_s", tokens_per_s},
                          {"flops_per_token", model.flops_per_token()},
                          {"flops_per_s", tokens_per_s * model.flops_per_token()}};
    if (gemm_n > 0) out["gemm_tflops"] = gemm_tflops(dev, gemm_n, 5);
    std::printf("%s\n", out.dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_train_torch: error: %s\n", e.what());
    return 1;
  }
}
