// `strata plan --json`'s objects (docs/planning.md lists the fields): the
// plan, its activations and the step's bound with its rates. The text report
// is cli/plan.cc's.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "memory/placement.h"
#include "plan/bound.h"
#include "plan/capacity.h"

namespace strata {

// A plan computed for `strata plan`, with what its reports need.
struct Computed {
  PlacementPlan plan;
  MachineCapacity cap;
  std::vector<std::string> shortfalls;
  int ranks_per_node = 1;
  NetworkBytes net;  // sent by one rank per training step
  int64_t parameters = 0;  // the model's, unpadded
};

// The plan's object (everything but "bound", "experts" and the data rows).
nlohmann::json plan_json(const Computed& c);

// "bound": the step's bound, its work and rates (rates_json).
nlohmann::json bound_json(const StepWork& w, const StepBound& b, const Rates& r);

}  // namespace strata
