// Whether a step speculates (Note [Speculative optimizer] in
// engine/optimizer/optimizer_pass.h): the policy's state across steps. The
// pass runs a speculation and carries out its verdict (kCommit, kRedo,
// kRestore, abandon: optimizer_speculation.cc); the trainer asks this policy
// before a step and tells it each verdict.
#pragma once

#include <cstdint>

#include "config/config.h"

namespace strata {

// optimizer.speculate auto: after this many redone (clipped) steps in a row,
// the next kSpeculationPauseSteps steps run the optimizer after the backward.
inline constexpr int64_t kSpeculationRedosToPause = 3;
inline constexpr int64_t kSpeculationPauseSteps = 20;

class SpeculationPolicy {
 public:
  // `available`: the plan speculates (OptimizerPlan::speculate, some piece on
  // CPU Adam); `setting`: optimizer.speculate (only auto pauses).
  SpeculationPolicy() = default;
  SpeculationPolicy(bool available, Speculate setting) : available_(available), pauses_(setting == Speculate::kAuto) {}

  // Whether step `step` (0-based) speculates.
  bool speculates(int64_t step) const { return available_ && step >= paused_until_; }
  // The verdict on step `step`'s speculation.
  void committed() { redos_in_a_row_ = 0; }
  void redone(int64_t step) {
    if (++redos_in_a_row_ >= kSpeculationRedosToPause && pauses_) {
      paused_until_ = step + 1 + kSpeculationPauseSteps;
      redos_in_a_row_ = 0;
    }
  }

 private:
  bool available_ = false;
  bool pauses_ = false;
  int64_t redos_in_a_row_ = 0;  // speculated steps redone in a row
  int64_t paused_until_ = 0;    // no speculation before this step
};

}  // namespace strata
