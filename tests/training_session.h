// Test helper shared by the in-process trainer suites (checkpoint_test,
// step_test): training as `strata train` does it at one rank — one generator
// draws every batch, and a checkpoint carries its state.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "data/dataset.h"
#include "engine/trainer.h"
#include "model/model.h"
#include "nvme/fault_backend.h"

namespace strata::testing {

class TrainingSession {
 public:
  // `device`: where the trainer computes (nullptr: run.device's).
  TrainingSession(const nlohmann::json& j, const std::vector<std::string>& overrides,
                  std::shared_ptr<nvme::FaultPlan> faults = nullptr, Device* device = nullptr)
      : cfg_(parse_config(j, overrides)),
        model_(cfg_.model),
        trainer_(cfg_, model_, std::move(faults), nullptr, 1, device),
        data_(cfg_.data.paths, TokenFormat::kText, 256, cfg_.model.seq_len, 0.0),
        rng_(cfg_.run.seed),
        batch_(size_t(cfg_.train_batch_size * (cfg_.model.seq_len + 1))) {}

  // One step on the next batch; its optimizer has finished when it returns.
  StepResult step() {
    StepResult r = step_leaving_optimizer();
    trainer_.finish();
    return r;
  }
  // A step that returns with the optimizer's thread still at work (as
  // strata train runs them): its commit or update overlaps the next step.
  StepResult step_leaving_optimizer() {
    data_.sample_train(rng_, cfg_.train_batch_size, batch_.data());
    return trainer_.step(batch_.data());
  }
  std::vector<double> train(int steps) {
    std::vector<double> losses;
    for (int s = 0; s < steps; ++s) losses.push_back(step().loss);
    return losses;
  }
  std::string save(const std::string& dir, std::shared_ptr<nvme::FaultPlan> faults = nullptr, int64_t keep = 2) {
    CheckpointOptions o;
    o.dir = dir;
    o.keep = keep;
    o.engine.faults = std::move(faults);
    return trainer_.save_checkpoint(o, header());
  }
  // A save riding on training (Trainer::begin_checkpoint); each range waits
  // `delay_ms` first.
  void begin_save(const std::string& dir, int delay_ms) {
    CheckpointOptions o;
    o.dir = dir;
    o.test_delay_per_range_ms = delay_ms;
    trainer_.begin_checkpoint(o, header());
  }
  Manifest header() {
    Manifest h;
    std::ostringstream state;
    state << rng_;
    h.data = {{"rng", state.str()}, {"tokens", data_.num_tokens()}};
    h.invariants = resume_invariants(cfg_);
    h.config = rank_invariant_config(cfg_);  // as strata train's saves (cli/train/saves.cc)
    return h;
  }
  void load(const std::string& dir) {
    CheckpointReader r(resolve_checkpoint(dir), nvme::EngineOptions());
    trainer_.load_checkpoint(r);
    std::istringstream state(r.manifest().data["rng"].get<std::string>());
    state >> rng_;
  }
  // Every saved category's blocks, gathered, then the working copy's.
  std::vector<at::Tensor> state() {
    std::vector<at::Tensor> out;
    for (Category c : {Category::kMaster, Category::kExpAvg, Category::kExpAvgSq, Category::kParam16}) {
      for (size_t b = 0; b < trainer_.layout().num_blocks(); ++b) out.push_back(trainer_.state_block(c, b));
    }
    return out;
  }
  const Config& cfg() const { return cfg_; }
  Trainer& trainer() { return trainer_; }

 private:
  Config cfg_;
  Model model_;
  Trainer trainer_;
  TokenDataset data_;
  std::mt19937_64 rng_;
  std::vector<int64_t> batch_;
};

}  // namespace strata::testing
