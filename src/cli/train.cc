// `strata train`: the training loop over a session (cli/train/session.h) —
// a step, its metrics line, evaluation and saves on their cadence, progress,
// and a stop signal honoured at a step boundary.
#include "cli/train.h"

#include <signal.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/train/metrics.h"
#include "cli/train/saves.h"
#include "cli/train/session.h"
#include "util/errors.h"
#include "util/logging.h"
#include "util/progress.h"
#include "util/trace.h"

namespace strata {

namespace {

// A stop requested by SIGINT/SIGTERM: the first one lets every rank finish
// the step it is in (the request is combined over the ranks at the step
// boundary); a second one exits at once.
std::atomic<int> g_stop_signals{0};

void on_stop_signal(int sig) {
  if (g_stop_signals.fetch_add(1) >= 1) {
    ::signal(sig, SIG_DFL);
    ::raise(sig);
  }
}

// Batch buffers sized once; sampling fills them in place every step. The
// global batch of a step is the same windows whatever the world size: every
// rank draws all of it from the same generator and trains on its slice.
struct Batches {
  explicit Batches(const TrainSession& s)
      : window(s.cfg.model.seq_len + 1),
        train(size_t(s.cfg.train_batch_size * window)),
        mine(train.data() + size_t(s.who.rank) * size_t(s.cfg.gradient_accumulation_steps *
                                                         s.cfg.train_micro_batch_size_per_gpu * window)),
        eval(size_t(s.cfg.data.eval_batches * s.cfg.train_micro_batch_size_per_gpu * window)),
        can_eval((s.cfg.data.sampling == DataSampling::kWindows ? s.data->val_tokens() > s.cfg.model.seq_len
                                                                 : s.data->val_examples() > 0) &&
                 s.cfg.data.eval_interval > 0) {}
  const int64_t window;
  std::vector<int64_t> train;
  const int64_t* mine;
  std::vector<int64_t> eval;
  const bool can_eval;
};

// At every data.eval_interval steps and the last: the loss over the same
// held-out windows each time, so eval losses compare.
void maybe_eval(TrainSession& s, Batches& b, int64_t step, nlohmann::json& line) {
  const Config& cfg = s.cfg;
  if (!b.can_eval || !(step % cfg.data.eval_interval == 0 || step == cfg.run.steps)) return;
  const int64_t rows = cfg.data.eval_batches * cfg.train_micro_batch_size_per_gpu;
  if (cfg.data.sampling == DataSampling::kWindows) {
    std::mt19937_64 eval_rng(cfg.run.seed ^ 0x5eedULL);
    s.data->sample_val(eval_rng, rows, b.eval.data());
  } else {
    s.data->val_example_batch(rows, b.eval.data());  // the first held-out examples, every time
  }
  line["eval_loss"] = s.trainer->eval_loss(b.eval.data(), cfg.data.eval_batches, s.data->masked());
  log::info("step %lld: eval loss %.4f", (long long)step, line["eval_loss"].get<double>());
}

// The trace, written at the end of the run.
void write_trace(TrainSession& s) {
  if (!s.tracer) return;
  Tracer::install(nullptr);
  s.tracer->write(s.trace_path);
  log::info("trace: %zu events written to %s%s (open in https://ui.perfetto.dev)", s.tracer->size(),
            s.trace_path.c_str(),
            s.tracer->dropped() ? strprintf(", %lld dropped", (long long)s.tracer->dropped()).c_str() : "");
}

int run_train(const TrainOptions& opt) {
  std::unique_ptr<TrainSession> session = open_session(opt);
  TrainSession& s = *session;
  const Config& cfg = s.cfg;
  Trainer& trainer = *s.trainer;
  Batches batches(s);
  Saves saves(s);
  if (s.first_step > cfg.run.steps) {
    log::warn("the checkpoint is at step %lld, run.steps is %lld: nothing to train (--steps is the total)",
              (long long)(s.first_step - 1), (long long)cfg.run.steps);
    s.comm->barrier();
    return kExitOk;
  }
  std::unique_ptr<ProgressBar> bar;  // from rank 0 only
  if (s.who.rank == 0) bar = std::make_unique<ProgressBar>("train", cfg.run.steps, cfg.steps_per_print);
  ::signal(SIGINT, on_stop_signal);
  ::signal(SIGTERM, on_stop_signal);
  StepTiming timing{.flops_per_token = s.model->flops_per_token(), .peak = s.peak, .world_size = s.who.world_size,
                    .loss_scaled = trainer.loss_scaler() != nullptr, .masked = s.data->masked()};
  const auto start = std::chrono::steady_clock::now();
  double first_loss = NAN, last_loss = NAN;
  int64_t steps_done = 0;
  for (int64_t step = s.first_step; step <= cfg.run.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    if (cfg.data.sampling == DataSampling::kWindows) {
      s.data->sample_train(s.rng, cfg.train_batch_size, batches.train.data());
    } else {
      timing.truncated = s.data->sample_examples(s.examples, cfg.run.seed, cfg.train_batch_size, batches.train.data());
    }
    // Note [Counted tokens]: every rank drew the global batch, so each counts its targets alike.
    const int64_t counted =
        s.data->masked() ? counted_targets(batches.train.data(), cfg.train_batch_size, cfg.model.seq_len) : -1;
    StepResult r = trainer.step(batches.mine, g_stop_signals.load() > 0, counted);
    steps_done = step;
    timing.step = step;
    timing.step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!std::isfinite(r.loss) && !r.skipped) {
      throw Error("loss is " + std::to_string(r.loss) + " at step " + std::to_string(step) +
                  "; lower optimizer.params.lr or enable gradient_clipping");
    }
    if (step == s.first_step) first_loss = r.loss;
    last_loss = r.loss;
    StepWork done = s.bound.work;  // the plan's work with this step's own byte counts
    done.links = r.links;
    if (done.checksum_bytes > 0) done.checksum_bytes = r.links.nvme_read + r.links.nvme_write;
    done.net_bytes = r.net_bytes;
    done.intra_node_bytes = r.intra_node_bytes;
    timing.bound_s = step_bound(done, s.bound.rates, s.bound.cpu_compute).seconds;
    timing.elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    nlohmann::json line = step_line(r, timing);
    if (timing.loss_scaled && r.skipped) {
      log::warn("step %lld: fp16 gradients overflowed at loss scale %g: step skipped, scale now %g", (long long)step,
                r.loss_scale, trainer.loss_scaler()->scale());
    }
    maybe_eval(s, batches, step, line);
    if (r.stop) {
      log::warn("stop requested (SIGINT/SIGTERM on some rank): every rank stops after step %lld%s", (long long)step,
                saves.on() ? " and saves a checkpoint" : "");
    }
    saves.after_step(step, r, line);
    s.metrics->write(line);
    if (s.monitors->any()) s.monitors->step(step, cfg.train_batch_size, numeric_fields(line));
    char suffix[128];
    std::snprintf(suffix, sizeof(suffix), "loss %.4f | %.0f tok/s | %.0f%% of bound | lr %.2e", r.loss,
                  double(r.tokens) / timing.step_s, 100.0 * timing.bound_s / timing.step_s, r.lr);
    if (bar) bar->update(step, suffix);
    if (r.stop) break;
  }
  saves.finish();
  trainer.finish();  // the last optimizer step (run.overlap_optimizer)
  s.comm->barrier();  // no rank leaves while another may still need it
  if (bar) bar->finish();
  write_trace(s);
  const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log::info("done: %lld steps in %.1fs; loss %.4f -> %.4f", (long long)steps_done, total_s, first_loss, last_loss);
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
  CLI::Option* resume =
      cmd->add_option("--resume", opt->resume_dir,
                      "Resume from the latest checkpoint in DIR (default: run.checkpoint.dir), or from DIR when it "
                      "is a checkpoint itself; --steps is then the total")
          ->expected(0, 1)
          ->type_name("[DIR]");
  cmd->add_option("--trace", opt->trace,
                  "Write a Chrome trace (compute, copies, NVMe I/O, CPU Adam tracks) to FILE at the end");
  cmd->add_flag("--reprobe", opt->reprobe,
                "Measure the step bound's rates again instead of taking those an earlier run on this machine kept");
  cmd->callback([opt, resume, &result]() {
    opt->resume = resume->count() > 0;
    result = run_train(*opt);
  });
}

}  // namespace strata
