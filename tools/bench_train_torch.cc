// The reference of GPU benchmark (a) (BENCHMARKS.md, "GPU"): a plain LibTorch
// training loop of the model a Strata config describes, on one device, with
// everything resident — the 16-bit working weights as autograd leaves, fp32
// master weights and Adam moments updated by LibTorch's fused AdamW
// (at::_fused_adamw_) with global-norm clipping folded into its grad_scale —
// and the same blocks' forward (Strata's Model), dtype and recompute policy:
// "never" keeps the whole graph; "always" runs the forward without autograd,
// keeping each layer's input, and recomputes each layer in the backward (as
// Strata does; `auto` is refused: say which in the config).
// With --compute-only (benchmark (b)'s reference) there are no master weights
// and no optimizer: the forward and backward of the working weights in HBM,
// gradients accumulated in fp32. Also times a large bf16 GEMM, the roof MFU is
// reported against. Prints one JSON line: tokens_per_s, step_s (median),
// flops_per_token, gemm_tflops.
//
//   bench_train_torch --config CONFIG [--device cuda] [--steps 20] [--warmup 3] [--compute-only]
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
  bool compute_only = false;
  app.add_flag("--compute-only", compute_only, "no master weights, no optimizer: forward and backward only");
  CLI11_PARSE(app, argc, argv);
  try {
    const strata::Config cfg = strata::load_config(config_path, {}, 1);
    const c10::Device dev(device_name);
    const strata::Model model(cfg.model);
    const strata::StateLayout layout(model.layout_specs(), 1);
    const auto dt = cfg.run.compute_dtype == strata::ComputeDtype::kBf16 ? at::kBFloat16 : cfg.run.compute_dtype == strata::ComputeDtype::kFp16 ? at::kHalf
                                                                                                      : at::kFloat;
    // The same step as Strata's or none: refuse what this loop does not do.
    if (cfg.run.recompute == strata::Recompute::kAuto) {
      throw strata::ConfigError("run.recompute", "say \"always\" or \"never\": the reference cannot guess the plan's choice");
    }
    if (cfg.run.optimizer_state_dtype != strata::MomentDtype::kFp32) {
      throw strata::ConfigError("run.optimizer_state_dtype", "the reference's fused AdamW keeps fp32 moments");
    }
    if (!cfg.optimizer.adam_w_mode) throw strata::ConfigError("optimizer.type", "the reference is AdamW");
    const bool recompute = cfg.run.recompute == strata::Recompute::kAlways;
    // Weights: fp32 master per parameter (initialised as Strata does, seed
    // run.seed), a working copy in the compute dtype whose views are leaves.
    std::vector<std::vector<at::Tensor>> work(layout.num_blocks());
    std::vector<at::Tensor> p_master, p_work, m1, m2, steps_t;
    for (size_t b = 0; b < layout.num_blocks(); ++b) {
      const strata::BlockLayout& bl = layout.block(b);
      at::Tensor flat = at::zeros({bl.padded_numel}, at::kFloat);
      strata::init_block(bl, flat, cfg.run.seed, b);
      for (const at::Tensor& v : strata::param_views(bl, flat)) {
        at::Tensor w = v.to(dev, dt).contiguous().detach().requires_grad_(true);
        work[b].push_back(w);
        p_work.push_back(w);
        if (compute_only) continue;
        at::Tensor m = v.to(dev).contiguous();
        p_master.push_back(m);
        m1.push_back(at::zeros_like(m));
        m2.push_back(at::zeros_like(m));
        steps_t.push_back(at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(dev)));
      }
    }
    const int64_t B = cfg.train_micro_batch_size_per_gpu, T = cfg.model.seq_len;
    const int64_t accum = cfg.gradient_accumulation_steps;
    at::Generator gen = at::detail::createCPUGenerator(cfg.run.seed);
    at::Tensor tokens = at::randint(cfg.model.vocab_size, {accum, B, T + 1}, gen, at::TensorOptions().dtype(at::kLong))
                            .to(dev);  // drawn from the seeded generator: two runs see the same tokens
    const double max_norm = cfg.gradient_clipping;
    std::vector<size_t> first_param;  // per block: its first index in p_work
    for (size_t b = 0, i = 0; b < layout.num_blocks(); i += work[b].size(), ++b) first_param.push_back(i);
    const size_t head = layout.num_blocks() - 1;
    const bool tied = cfg.model.tie_embeddings;
    // fp32 gradients, allocated once, zeroed per step; each micro-batch's
    // 16-bit gradients are added in per block (with recompute always as each
    // block's backward yields them, the tied head's share first at the
    // embedding, as Strata's staging does; with never after the one backward).
    std::vector<at::Tensor> grads32;
    for (const at::Tensor& w : p_work) grads32.push_back(at::zeros(w.sizes(), w.options().dtype(at::kFloat)));
    auto add_block = [&](size_t b, const std::vector<at::Tensor>& g, size_t first) {
      for (size_t i = 0; i < work[b].size(); ++i) grads32[first_param[b] + i].add_(g[first + i]);
    };
    auto micro_batch = [&](const at::Tensor& x0, const at::Tensor& y) -> at::Tensor {
      auto loss_of = [&](const at::Tensor& logits) {
        return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat), y.reshape({-1})) /
               double(accum);
      };
      if (!recompute) {
        at::Tensor x = x0;
        for (size_t b = 0; b < layout.num_blocks(); ++b) {
          x = model.forward(b, work[b], x, b == head && tied ? work[0][0] : at::Tensor());
        }
        const at::Tensor loss = loss_of(x);
        const std::vector<at::Tensor> g = torch::autograd::grad({loss}, p_work);
        for (size_t i = 0; i < g.size(); ++i) grads32[i].add_(g[i]);
        return loss.detach();
      }
      // Forward without autograd, keeping each block's input; the head with
      // autograd; then each block recomputed from its input, in reverse.
      std::vector<at::Tensor> inputs(head);
      at::Tensor x = x0;
      {
        at::NoGradGuard no_grad;
        for (size_t b = 0; b < head; ++b) {
          inputs[b] = x;
          x = model.forward(b, work[b], x);
        }
      }
      at::Tensor xin = x.detach().requires_grad_(true);
      std::vector<at::Tensor> wrt{xin};
      wrt.insert(wrt.end(), work[head].begin(), work[head].end());
      if (tied) wrt.push_back(work[0][0]);
      const at::Tensor loss = loss_of(model.forward(head, work[head], xin, tied ? work[0][0] : at::Tensor()));
      std::vector<at::Tensor> gh = torch::autograd::grad({loss}, wrt);
      add_block(head, gh, 1);
      at::Tensor tied_grad = tied ? gh.back() : at::Tensor();
      at::Tensor dx = gh[0];
      gh.clear();
      for (size_t b = head; b-- > 0;) {
        const bool emb = b == 0;
        at::Tensor in = emb ? inputs[b] : inputs[b].detach().requires_grad_(true);
        std::vector<at::Tensor> w{};
        if (!emb) w.push_back(in);
        w.insert(w.end(), work[b].begin(), work[b].end());
        std::vector<at::Tensor> gb = torch::autograd::grad({model.forward(b, work[b], in)}, w, {dx});
        if (emb && tied_grad.defined()) grads32[0].add_(tied_grad);
        add_block(b, gb, emb ? 0 : 1);
        if (!emb) dx = gb[0];
        inputs[b] = at::Tensor();
      }
      return loss.detach();
    };
    std::vector<double> step_s;
    at::Tensor last_loss;  // the mean loss of the last step (a check that two runs did the same)
    for (int s = 0; s < warmup + steps; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      for (at::Tensor& g : grads32) g.zero_();
      at::Tensor loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(dev));
      for (int64_t m = 0; m < accum; ++m) loss += micro_batch(tokens[m].narrow(1, 0, T), tokens[m].narrow(1, 1, T));
      last_loss = loss;
      if (compute_only) {
        sync(dev);
        if (s >= warmup) step_s.push_back(seconds(t0));
        continue;
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
                          {"compute_only", compute_only},
                          {"recompute", recompute ? "always" : "never"},
                          {"parameters", layout.parameter_count()},
                          {"compute_dtype", strata::compute_dtype_name(cfg.run.compute_dtype)},
                          {"step_s", med},
                          {"last_loss", last_loss.item<double>()},
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
