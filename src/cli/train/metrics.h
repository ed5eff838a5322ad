// The metrics line `strata train` writes after every step (docs/metrics.md):
// its fields from the step's result, and the file it goes to. The monitors
// (docs/monitors.md) take the line's numeric fields by name.
#pragma once

#include <array>
#include <cstdint>
#include <fstream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "engine/trainer.h"
#include "memory/placement.h"

namespace strata {

// The metrics file is opened only once start-up has succeeded, so that a run
// that fails at start-up leaves nothing behind.
class MetricsWriter {
 public:
  // `append`: a resumed run adds to the file of the run it continues, whose
  // lines of steps after `resumed_step` (the checkpoint's: this run computes
  // them again) and any line cut short are dropped first (docs/metrics.md).
  MetricsWriter(const std::string& path, bool append, int64_t resumed_step = -1);
  void write(const nlohmann::json& j);

 private:
  std::string path_;
  std::ofstream out_;
};

// The figures of a step that its result does not carry.
struct StepTiming {
  int64_t step = 0;
  double step_s = 0.0;     // the step's wall time
  double bound_s = 0.0;    // its bound (docs/design.md, "The step's bound")
  double elapsed_s = 0.0;  // since the first step began
  double flops_per_token = 0.0;
  std::array<int64_t, kNumTiers> peak{};
  int world_size = 1;
  bool loss_scaled = false;  // fp16: loss_scale and skipped are written
  // Counted targets (Note [Counted tokens] in util/counted_tokens.h):
  // counted_tokens is written; with examples sampled, the step's examples cut
  // to a sequence (data.truncate), else -1.
  bool masked = false;
  int64_t truncated = -1;
};

// The step's line: every field docs/metrics.md lists but those added later
// (eval_loss, checkpoint_*).
nlohmann::json step_line(const StepResult& r, const StepTiming& t);

// The numeric fields of a line, for the monitors; those the line writes as
// null (NaN, infinities) are left out.
std::map<std::string, double> numeric_fields(const nlohmann::json& line);

}  // namespace strata
