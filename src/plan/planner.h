// The planner: the only code that both makes plans (memory/placement.h,
// make_plan) and evaluates them (plan/bound.h, step_bound). It builds the
// candidates that placement auto, run.schedule auto and optimizer.speculate
// auto choose among, judges them by the step's bound, and makes the plan
// for the machine the run is on (docs/design.md, "The step's bound").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "memory/device.h"
#include "memory/layout.h"
#include "memory/placement.h"
#include "plan/bound.h"
#include "plan/capacity.h"
#include "plan/choices.h"
#include "plan/make_plan.h"

namespace strata {

// measure_capacity + make_plan for `rank`, measuring NVMe space under the
// directories the plan itself names (what `strata plan` and `strata train`
// use), each of `local_ranks` ranks of the node taking its share. `device`:
// the device the run computes on when it is not run.device's (tests), whose
// addressability the plan takes.
// A machine described instead of measured (`strata plan --host-memory-gb`,
// `--nvme-gb`, `--device-memory-gb`: planning a node you are not on). Node
// figures are divided among the node's ranks like measured ones; < 0 = measure.
struct GivenCapacity {
  int64_t host_bytes = -1;    // RAM of the node
  int64_t nvme_bytes = -1;    // free bytes under the swap directories, per node
  int64_t device_bytes = -1;  // memory of each GPU (or the device budget)
  std::string device_source;  // where device_bytes came from ("" = --device-memory-gb)
};

// With `rates` and placement auto, the candidate placements auto can build
// are compared by the step's bound and the lowest chosen (choose_by_bound;
// the greedy fill unless another is more than 10% lower); with rates and
// run.schedule auto, the schedule too (choose_schedule_by_bound).
PlacementPlan plan_for_machine(const Config& cfg, const StateLayout& layout, MachineCapacity* capacity,
                               int64_t rank = 0, int local_ranks = 1, const Device* device = nullptr,
                               const GivenCapacity& given = {}, const Rates* rates = nullptr);

// placement auto judged by the bound: the candidates auto can build (the
// greedy fill; with CPU compute, other orders in which categories go down a
// tier; on a GPU, fewer optimizer sub-groups kept in HBM for its Adam, and
// gradients before parameters), each that fits costed with predicted_work
// and step_bound at `rates`, the lowest chosen where it beats the greedy
// fill's by more than kAutoMargin (Note [Auto's margin]), else the greedy fill.
// plan.state.auto_choice says which and the runner-up's bound. A candidate whose
// work needs a rate `rates` lacks is not judged.
//
// Note [Auto's margin]
// The bound is a lower bound, and what it leaves out differs between
// placements: on the dev VM a candidate 4% below the greedy fill by the
// bound (parameters and gradients on NVMe, their fetches and gradient
// writes partly on the compute's thread) ran 10-28% slower (BENCHMARKS.md,
// "The step's bound"). So another candidate wins only when its bound is
// lower than the greedy fill's by more than kAutoMargin; plan.state.auto_choice
// then names the candidate that was not taken.
inline constexpr double kAutoMargin = 0.10;
PlacementPlan choose_by_bound(const Config& cfg, const StateLayout& layout, int64_t rank,
                              const MachineCapacity& capacity, const Rates& rates);

// optimizer.speculate auto with rates, for a plan that speculates optimizer
// state on NVMe into alternate swap slots (Note [Speculating NVMe state]):
// keeps it where the step's bound with speculation is lower than without by
// more than kAutoMargin, else turns the plan's speculation off, its
// speculate_choice giving both bounds and a clipped step's. Leaves `on`,
// `off`, plans without slots and work lacking a rate as they are.
//
// Note [Speculating NVMe state]
// Alternate swap slots take a second copy of the NVMe optimizer state on
// disk (12 bytes per element with fp32 moments), and a clipped step pays the
// disk's pass twice. They hide CPU Adam behind the backward, not a disk that
// bounds the step: with the state wholly on one 2 GB/s drive the bound is
// 96.36 s a step with them against 99.40 s without, and 195.76 s when
// clipped (BENCHMARKS.md, "The optimizer behind the backward"). So auto
// takes the disk only where the bound says speculation gains more than what
// the bound leaves out (Note [Auto's margin]).
void judge_speculation_by_bound(const Config& cfg, const Rates& rates, bool cpu_compute, PlacementPlan& plan);

// run.recompute auto with rates on a GPU (Note [Activations by the
// bound]): make_plan's plan (its device-kept layers), or, where its bound is
// lower by more than kAutoMargin, the same plan with packs' entries in pinned
// host RAM (spread over the forwards: Note [Activation placement] in
// memory/placement.h), as many as make the bound lowest and host RAM holds.
// Other recompute settings, run.activations, the CPU device and work lacking
// a rate: make_plan's plan as it is.
//
// Note [Activations by the bound]
// A layer whose entries go to host RAM no longer runs its forward again in the
// backward (its FLOPs leave the bound's compute) but crosses PCIe twice (its
// entries' bytes join the bound's D2H and H2D), beside the state's own
// traffic. Which wins depends on the link and the compute: on an H200 with
// Llama-3-8B's shape the link has room to spare (BENCHMARKS.md, "Activations
// placed like state"); on a slow link or a model whose state already fills it,
// recompute is cheaper. So auto counts both in the bound, a layer's
// micro-batch at a time (Note [Activation placement] in memory/placement.h):
// where the link's time meets the compute's inside a layer, part of it goes.
PlacementPlan best_activations(const Config& cfg, const StateLayout& layout, int64_t rank,
                               const MachineCapacity& capacity, const Rates& rates);
// Whether best_activations weighs host RAM for `plan`'s recomputed packs
// (run.recompute auto, run.activations not given, some layer recomputed, a
// GPU run): then the plan is made again once rates are known, and the
// host-device copies are among the rates to measure.
bool weighs_host_activations(const Config& cfg, const PlacementPlan& plan);

// run.schedule auto with rates (Note [Step schedules] in memory/schedule.h):
// the plan under each schedule (placement auto by the bound within each), and
// the layer schedule when it fits and its bound is lower; with one
// micro-batch, or a rate missing, as make_plan decides without rates.
// plan.step.choice says which and why.
PlacementPlan choose_schedule_by_bound(const Config& cfg, const StateLayout& layout, int64_t rank,
                                       const MachineCapacity& capacity, const Rates& rates);

}  // namespace strata
