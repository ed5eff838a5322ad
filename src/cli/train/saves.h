// Checkpoints on the run's cadence (Note [Checkpoint protocol] in
// checkpoint/checkpoint.h): every run.checkpoint.every steps a save that
// rides on training (Note [Saving while training]), at the last step and on a
// stop signal one that is waited for; each finished save goes into its step's
// metrics line and the log.
#pragma once

#include <cstdint>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "cli/train/session.h"

namespace strata {

class Saves {
 public:
  explicit Saves(TrainSession& session);
  // Whether the run saves at all (run.checkpoint.dir).
  bool on() const { return !opts_.dir.empty(); }
  // After step `step` (its result `r`, its line so far): publishes a save in
  // flight whose parts every rank has written, begins the one due now.
  void after_step(int64_t step, const StepResult& r, nlohmann::json& line);
  // At the end of the run: waits for a save still in flight.
  void finish();

 private:
  // The manifest's header for a save after step `step` (lr: the step's).
  Manifest header(int64_t step, double lr) const;
  void report(const Trainer::FinishedSave& f, nlohmann::json& line, bool in_background) const;

  TrainSession& s_;
  CheckpointOptions opts_;
};

}  // namespace strata
