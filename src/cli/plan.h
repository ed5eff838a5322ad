// `strata plan CONFIG [--json]`: the placement plan and whether it fits this
// machine, before anything is allocated.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "config/config.h"
#include "plan/bound.h"
#include "memory/placement.h"
#include "plan/capacity.h"

namespace strata {

void register_plan(CLI::App& app, int& result);

// The plan report as text (what `strata plan` prints).
std::string format_plan(const PlacementPlan& plan, const MachineCapacity& cap,
                        const std::vector<std::string>& shortfalls);

// Computes the plan for `rank` of `cfg` on this machine (one of `local_ranks`
// ranks sharing it); throws ConfigError with the shortfall lines when it does
// not fit (what `strata train` runs first).
// `device`: the rank's (its GPU's free memory is the budget; nullptr: the first GPU's).
// Returns the plan (for the disk checks that follow: its swap directories
// and NVMe bytes).
PlacementPlan check_plan_fits(const Config& cfg, int rank = 0, int local_ranks = 1, const Device* device = nullptr);


}  // namespace strata
