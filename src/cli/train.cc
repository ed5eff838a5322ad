#include "cli/train.h"

#include <ATen/Parallel.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>

#include <nlohmann/json.hpp>

#include "cli/plan.h"
#include "config/config.h"
#include "data/dataset.h"
#include "engine/trainer.h"
#include "model/model.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"
#include "util/progress.h"
#include "util/trace.h"

namespace strata {

namespace {

struct TrainOptions {
  std::string config_path;
  std::vector<std::string> overrides;
  int64_t steps = 0;        // 0 = from config
  std::string metrics;      // empty = from config
  std::string trace;        // Chrome trace file; empty = no trace
};

// The metrics file is opened only once start-up has succeeded, so that a run
// that fails at start-up leaves nothing behind.
class MetricsWriter {
 public:
  explicit MetricsWriter(const std::string& path) : path_(path) {
    if (path.empty()) return;
    make_dirs(parent_dir(path));
    out_.open(path, std::ios::out | std::ios::trunc);
    if (!out_) throw InputError(path, std::string("cannot open metrics file for writing: ") +
                                          std::strerror(errno));
  }
  void write(const nlohmann::json& j) {
    if (!out_.is_open()) return;
    out_ << j.dump() << '\n';
    out_.flush();
    if (!out_) throw IoError(path_, errno, "cannot write metrics");
  }

 private:
  std::string path_;
  std::ofstream out_;
};

int run_train(const TrainOptions& opt) {
  std::vector<std::string> overrides = opt.overrides;
  if (opt.steps > 0) overrides.push_back("run.steps=" + std::to_string(opt.steps));
  if (!opt.metrics.empty()) overrides.push_back("run.metrics=" + nlohmann::json(opt.metrics).dump());
  Config cfg = load_config(opt.config_path, overrides);
  setup_logging(cfg.run.log_level, cfg.run.log_file);
  for (const std::string& key : cfg.ignored_keys) {
    log::warn("config key '%s' is a DeepSpeed key Strata does not act on; ignored", key.c_str());
  }
  if (cfg.run.device != "cpu") {
    throw ConfigError("run.device", "only \"cpu\" is supported by this build's trainer so far");
  }
  if (cfg.run.threads > 0) at::set_num_threads(int(cfg.run.threads));

  // Everything that can fail on bad input happens before the first byte of
  // output is written. First: does the placement fit this machine?
  check_plan_fits(cfg);
  TokenDataset data(cfg.data.paths, parse_token_format(cfg.data.format), cfg.model.vocab_size,
                    cfg.model.seq_len, cfg.data.val_fraction);
  Model model(cfg.model);
  // Events of about 400 steps of a small model; later ones are dropped (and
  // said so). Declared before the trainer, whose optimizer thread records
  // into it until the trainer is gone, also when a step throws.
  std::unique_ptr<Tracer> tracer;
  struct Uninstall {
    ~Uninstall() { Tracer::install(nullptr); }
  } uninstall;
  if (!opt.trace.empty()) {
    tracer = std::make_unique<Tracer>(size_t(1) << 18);
    Tracer::install(tracer.get());
  }
  Trainer trainer(cfg, model);
  MetricsWriter metrics(cfg.run.metrics);

  const StateBytes sb = trainer.state_bytes();
  const std::array<int64_t, kNumTiers> peak = trainer.peak_bytes();
  log::info("model: %lld layers, dim %lld, %lld heads (%lld kv), ffn %lld, seq %lld, vocab %lld: "
            "%.3fM parameters",
            (long long)cfg.model.n_layers, (long long)cfg.model.dim, (long long)cfg.model.n_heads,
            (long long)cfg.model.kv_heads(), (long long)cfg.model.ffn_dim(),
            (long long)cfg.model.seq_len, (long long)cfg.model.vocab_size,
            double(trainer.layout().parameter_count()) / 1e6);
  log::info("memory: parameters %s (fp32 master) + %s working copy (%s), gradients %s, "
            "optimizer state %s, total %s",
            format_bytes(double(sb.master)).c_str(), format_bytes(double(sb.param16)).c_str(),
            cfg.run.compute_dtype.c_str(),
            format_bytes(double(sb.grad)).c_str(), format_bytes(double(sb.optimizer)).c_str(),
            format_bytes(double(sb.total())).c_str());
  log::info("placement (%s): device %s, host %s, nvme %s (state + staging)",
            trainer.plan().source.c_str(), format_bytes(double(peak[0])).c_str(),
            format_bytes(double(peak[1])).c_str(), format_bytes(double(peak[2])).c_str());
  log::info("data: %lld tokens (%lld train, %lld held out); batch %lld = %lld micro x %lld "
            "accumulation; compute %s; %d threads",
            (long long)data.num_tokens(), (long long)data.train_tokens(),
            (long long)data.val_tokens(), (long long)cfg.train_batch_size,
            (long long)cfg.train_micro_batch_size_per_gpu,
            (long long)cfg.gradient_accumulation_steps, cfg.run.compute_dtype.c_str(),
            at::get_num_threads());

  const int64_t micro = cfg.train_micro_batch_size_per_gpu;
  const int64_t accum = cfg.gradient_accumulation_steps;
  const int64_t window = cfg.model.seq_len + 1;
  // Batch buffers sized once; sampling fills them in place every step.
  std::vector<int64_t> batch(size_t(accum * micro * window));
  const int64_t eval_batches = cfg.data.eval_batches;
  std::vector<int64_t> eval_batch(size_t(eval_batches * micro * window));
  const bool can_eval = data.val_tokens() > cfg.model.seq_len && cfg.data.eval_interval > 0;
  std::mt19937_64 rng(cfg.run.seed);

  ProgressBar bar("train", cfg.run.steps, cfg.steps_per_print);
  const auto start = std::chrono::steady_clock::now();
  double first_loss = NAN, last_loss = NAN;
  for (int64_t s = 1; s <= cfg.run.steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    data.sample_train(rng, accum * micro, batch.data());
    StepResult r = trainer.step(batch.data());
    const double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!std::isfinite(r.loss)) {
      throw Error("loss is " + std::to_string(r.loss) + " at step " + std::to_string(s) +
                  "; lower optimizer.params.lr or enable gradient_clipping");
    }
    if (s == 1) first_loss = r.loss;
    last_loss = r.loss;
    const double tokens_per_s = double(r.tokens) / step_s;
    nlohmann::json line = {
        {"step", s},
        {"loss", r.loss},
        {"lr", r.lr},
        {"grad_norm", r.grad_norm},
        {"tokens", r.tokens},
        {"tokens_per_s", tokens_per_s},
        {"flops_per_s", tokens_per_s * model.flops_per_token()},
        {"step_s", step_s},
        {"elapsed_s", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()},
        {"h2d_bytes", r.links.h2d},
        {"d2h_bytes", r.links.d2h},
        {"nvme_read_bytes", r.links.nvme_read},
        {"nvme_write_bytes", r.links.nvme_write},
        {"wait_s", r.wait_s},
        {"optimizer_s", r.optimizer_s},
        {"optimizer_wait_s", r.optimizer_wait_s},
        {"peak_device_bytes", peak[0]},
        {"peak_host_bytes", peak[1]},
        {"peak_nvme_bytes", peak[2]},
    };
    if (can_eval && (s % cfg.data.eval_interval == 0 || s == cfg.run.steps)) {
      // The same held-out windows at every eval, so eval losses compare.
      std::mt19937_64 eval_rng(cfg.run.seed ^ 0x5eedULL);
      data.sample_val(eval_rng, eval_batches * micro, eval_batch.data());
      line["eval_loss"] = trainer.eval_loss(eval_batch.data(), eval_batches);
      log::info("step %lld: eval loss %.4f", (long long)s, line["eval_loss"].get<double>());
    }
    metrics.write(line);
    char suffix[96];
    std::snprintf(suffix, sizeof(suffix), "loss %.4f | %.0f tok/s | lr %.2e", r.loss, tokens_per_s, r.lr);
    bar.update(s, suffix);
  }
  trainer.finish();  // the last optimizer step (run.overlap_optimizer)
  bar.finish();
  if (tracer) {
    Tracer::install(nullptr);
    tracer->write(opt.trace);
    log::info("trace: %zu events written to %s%s (open in https://ui.perfetto.dev)", tracer->size(),
              opt.trace.c_str(), tracer->dropped() ? strprintf(", %lld dropped", (long long)tracer->dropped()).c_str() : "");
  }
  const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log::info("done: %lld steps in %.1fs; loss %.4f -> %.4f", (long long)cfg.run.steps, total_s,
            first_loss, last_loss);
  return kExitOk;
}

}  // namespace

void register_train(CLI::App& app, int& result) {
  auto opt = std::make_shared<TrainOptions>();
  CLI::App* cmd = app.add_subcommand("train", "Train the model a config describes");
  cmd->add_option("config", opt->config_path, "JSON config file")->required();
  cmd->add_option("--set", opt->overrides, "Override a config key: --set optimizer.params.lr=3e-4")
      ->type_name("KEY=VALUE");
  cmd->add_option("--steps", opt->steps, "Number of optimizer steps (overrides run.steps)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--metrics", opt->metrics, "JSON-lines metrics file (overrides run.metrics)");
  cmd->add_option("--trace", opt->trace,
                  "Write a Chrome trace (compute, copies, NVMe I/O, CPU Adam tracks) to FILE at the end");
  cmd->callback([opt, &result]() { result = run_train(*opt); });
}

}  // namespace strata
