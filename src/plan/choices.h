// The plan's choices that spend the device memory the placement leaves
// (comm.secondary_shard, comm.keep_gathered, comm.gradient_reduction,
// optimizer.speculate), one function each, called by make_plan in that
// order; and run.schedule's candidates. Each takes `capacity` to know the
// room (placement.headroom of each budget kept free, as auto's fill does).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "config/config.h"
#include "memory/placement.h"
#include "plan/capacity.h"

namespace strata {

// Device (or, on the CPU device, host) bytes the plan may still add; -1
// where the device tier has no budget.
int64_t room_left(const Config& cfg, const MachineCapacity& capacity, const PlacementPlan& plan);
void choose_secondary_shard(const Config& cfg, const MachineCapacity& capacity, PlacementPlan& plan);
void choose_kept_gathered(const Config& cfg, const MachineCapacity& capacity, PlacementPlan& plan);
void choose_gradient_reduction(const Config& cfg, const MachineCapacity& capacity, PlacementPlan& plan);
// optimizer.speculate (Note [Speculative optimizer] in engine/optimizer/optimizer_pass.h).
void resolve_speculation(const Config& cfg, const MachineCapacity& cap, PlacementPlan& plan);

// run.schedule auto (Note [Step schedules] in memory/schedule.h): the plan
// `make` gives under micro_batch, returned, and under layer, in *layer when
// there is more than one micro-batch and its plan is made and fits
// `capacity` (else nullopt, and the returned plan's schedule_choice says why).
PlacementPlan schedule_candidates(const Config& cfg, const MachineCapacity& capacity,
                                  const std::function<PlacementPlan(const Config&)>& make,
                                  std::optional<PlacementPlan>* layer);

// What the layer schedule's plan `b` gives up against micro_batch's plan `a`
// of the same config: empty when it places every byte of state on the same
// tier and keeps every device-memory choice `a` made (kept graphs, blocks kept
// gathered, the secondary shard); else a phrase saying what.
std::string layer_gives_up(const PlacementPlan& a, const PlacementPlan& b);

}  // namespace strata
