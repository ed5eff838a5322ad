// Making a plan: the placement of every unit of state (the splits asked for,
// or auto's fill), the activations, the staging buffers, and the choices
// that spend what room is left (plan/choices.h). Deterministic from the
// config, the layout and the capacity, so every rank computes every rank's
// plan. The planner (plan/planner.h) makes several and judges them by the
// step's bound.
#pragma once

#include <cstdint>

#include "config/config.h"
#include "memory/layout.h"
#include "memory/placement.h"
#include "plan/capacity.h"

namespace strata {

// The trainer's buffers for `plan` (uses units, block_numel, window_knobs,
// window_cap_bytes, tied, accum, compute_bytes, sub_group_numel).
StagingNeeds staging_needs(const PlacementPlan& plan);

// Computes the plan for `rank` (0 .. world_size-1). Throws ConfigError when
// the config asks for something the layout cannot give (e.g. NVMe with no
// path). `capacity` is used only by "auto".
PlacementPlan make_plan(const Config& cfg, const StateLayout& layout, int64_t rank,
                        const MachineCapacity& capacity);

}  // namespace strata
