// The plan's choices that spend what room the placement leaves: the
// secondary shard, blocks kept gathered, the per-step gradient sum,
// speculation, and the schedule's candidates (plan/choices.h).
#include "plan/choices.h"

#include "plan/make_plan.h"

#include <algorithm>

#include "util/errors.h"
#include "util/logging.h"

namespace strata {

// Device (or, on the CPU device, host) bytes the plan may still add: -1
// where the device tier has no budget.
// Keeps placement.headroom of each budget free, as auto's fill does; on the
// CPU device both the host's memory and run.device_memory_mb bind.
int64_t room_left(const Config& cfg, const MachineCapacity& capacity, const PlacementPlan& plan) {
  const auto t = plan.total();
  const double keep = 1.0 - cfg.placement.headroom;
  int64_t room = -1;
  auto bound_by = [&](int64_t have, int64_t used) {
    if (have < 0) return;
    const int64_t r = std::max<int64_t>(0, int64_t(double(have) * keep) - used);
    room = room < 0 ? r : std::min(room, r);
  };
  if (capacity.device_is_host) {
    bound_by(capacity.host_bytes, t[0] + t[1]);
    bound_by(capacity.device_bytes, t[0]);
  } else {
    bound_by(capacity.device_bytes, t[0]);
  }
  return room;
}

// Turns on a choice of the plan (`choice`) whose buffers staging_needs
// sizes; with `only_if_fits` (auto) turns it off again when those buffers do
// not fit in room_left.
void take_if_fits(const Config& cfg, const MachineCapacity& capacity, PlacementPlan& plan, bool& choice,
                  bool only_if_fits) {
  choice = true;
  const StagingNeeds with = staging_needs(plan);
  if (only_if_fits) {
    const int64_t room = room_left(cfg, capacity, plan);
    if (room >= 0 && with.device_bytes() - plan.staging.device_bytes() > room) {
      choice = false;
      return;
    }
  }
  plan.staging = with;
}

// comm.secondary_shard: at stage 3 with ranks on several nodes of more than
// one rank, each rank keeps its node's secondary shard (auto: when it fits).
void choose_secondary_shard(const Config& cfg, const MachineCapacity& capacity, PlacementPlan& plan) {
  const SecondaryShard want = cfg.comm.secondary_shard;
  plan.comm.secondary_shard = false;
  if (plan.stage != 3 || plan.shards <= 1 || plan.ranks_per_node <= 1 || plan.nodes() <= 1 || want == SecondaryShard::kOff) return;
  take_if_fits(cfg, capacity, plan, plan.comm.secondary_shard, want == SecondaryShard::kAuto);
}

// comm.keep_gathered: at stage 3 with ranks, blocks kept gathered for the
// step, from the last one down (auto: while they fit; all; none). A kept
// block needs no secondary shard: it costs its gathered bytes less that.
void choose_kept_gathered(const Config& cfg, const MachineCapacity& capacity, PlacementPlan& plan) {
  const KeepGathered& want = cfg.comm.keep_gathered;
  const size_t blocks = plan.block_numel.size();
  plan.comm.keep_gathered.assign(blocks, 0);
  plan.comm.kept_gathered_numel = 0;
  if (plan.stage != 3 || plan.shards <= 1 || want.mode == KeepGathered::Mode::kNone) return;
  // A number keeps that many blocks, from the last one down, whatever fits.
  const bool counted = want.mode == KeepGathered::Mode::kBlocks;
  int64_t left = counted ? want.blocks : int64_t(blocks);
  int64_t room = want.mode == KeepGathered::Mode::kAll || counted ? -1 : room_left(cfg, capacity, plan);
  for (size_t i = blocks; i-- > 0 && left > 0;) {
    const int64_t padded = plan.block_numel[i] * plan.shards;
    const int64_t bytes = (padded - (plan.comm.secondary_shard ? plan.block_numel[i] * plan.nodes() : 0)) * plan.param_bytes();
    if (room >= 0 && bytes > room) continue;
    if (room >= 0) room -= bytes;
    plan.comm.keep_gathered[i] = 1;
    plan.comm.kept_gathered_numel += padded;
    --left;
  }
  // Every block kept: no later gather, no secondary shard.
  if (plan.comm.kept_gathered_numel == plan.gathered_numel) plan.comm.secondary_shard = false;
  plan.staging = staging_needs(plan);
}

// comm.gradient_reduction: per_step needs a whole-model fp32 gradient on the
// device; auto takes it when the plan still fits with it (always where the
// device tier has no budget), only with ranks and accumulation.
void choose_gradient_reduction(const Config& cfg, const MachineCapacity& capacity, PlacementPlan& plan) {
  const GradientReduction want = cfg.comm.gradient_reduction;
  // The layer schedule reduces each block once per step anyway, from a block-sized sum.
  if (plan.world_size <= 1 || plan.step.accum <= 1 || want == GradientReduction::kPerMicroBatch || plan.step.gradients_final_in_backward()) return;
  take_if_fits(cfg, capacity, plan, plan.comm.reduce_per_step, want == GradientReduction::kAuto);
}

PlacementPlan schedule_candidates(const Config& cfg, const MachineCapacity& capacity,
                                  const std::function<PlacementPlan(const Config&)>& make,
                                  std::optional<PlacementPlan>* layer) {
  Config mb = cfg, ly = cfg;
  mb.run.schedule = StepSchedule::kMicroBatch;
  ly.run.schedule = StepSchedule::kLayer;
  // micro_batch cannot speculate with several micro-batches (Note
  // [Speculative optimizer]): its candidate does not insist.
  if (cfg.gradient_accumulation_steps > 1 && mb.optimizer.speculate == Speculate::kOn) {
    mb.optimizer.speculate = Speculate::kAuto;
  }
  PlacementPlan a = make(mb);
  layer->reset();
  if (cfg.gradient_accumulation_steps <= 1) {
    a.step.choice = "micro_batch (one micro-batch: the two schedules are one order)";
    return a;
  }
  try {
    *layer = make(ly);
  } catch (const ConfigError& e) {
    a.step.choice = std::string("micro_batch (layer refused: ") + e.what() + ")";
    return a;
  }
  if (!plan_shortfalls(**layer, capacity).empty()) {
    layer->reset();
    a.step.choice = "micro_batch (layer does not fit: it holds the activations of every micro-batch)";
  }
  return a;
}

// What the layer schedule's plan b gives up against micro_batch's plan a:
// empty when it places every byte of state on the same tier and keeps every
// device-memory choice micro_batch's plan made (layers' kept entries, blocks kept
// gathered, the secondary shard); else why not.
std::string layer_gives_up(const PlacementPlan& a, const PlacementPlan& b) {
  if (b.state.bytes != a.state.bytes) return "layer's held activations would move state to a slower tier";
  auto kept_packs = [](const PlacementPlan& p) { return p.activations.keep_device_packs + p.activations.keep_host_packs; };
  if (kept_packs(b) < kept_packs(a)) return "layer's held activations leave room to keep fewer layers' entries";
  if (a.comm.secondary_shard && !b.comm.secondary_shard) return "layer's held activations leave no room for the secondary shard";
  auto kept = [](const PlacementPlan& p) { return std::count(p.comm.keep_gathered.begin(), p.comm.keep_gathered.end(), 1); };
  if (kept(b) < kept(a)) return "layer's held activations leave room to keep fewer blocks gathered";
  return "";
}

// optimizer.speculate (Note [Speculative optimizer] in
// engine/optimizer/optimizer_pass.h). It needs the layer schedule (or one
// micro-batch), the optimizer's thread and a piece CPU Adam updates. Pieces
// whose master weights and moments are all on NVMe speculate into alternate
// swap slots where the disk has room for a second copy of them (`cap`;
// unknown counts as room); otherwise by two passes, which read their state
// twice. auto leaves it off where it costs more than it hides: on the CPU
// device (Adam and the compute share the cores, and the commit pass adds
// memory traffic) and with optimizer state on NVMe that has no room for its
// slots (the commit would read it a second time).
void resolve_speculation(const Config& cfg, const MachineCapacity& cap, PlacementPlan& plan) {
  const Speculate want = cfg.optimizer.speculate;
  plan.optimizer.speculate = false;
  plan.optimizer.speculate_slots = false;
  plan.optimizer.nvme_spare_bytes = 0;
  if (want == Speculate::kOff) {
    plan.optimizer.speculate_choice = "off";
    return;
  }
  if (!plan.step.gradients_final_in_backward()) {
    // A block's gradient is final only in the last micro-batch's backward:
    // the speculation would have an A-th of the backward to hide in.
    if (want == Speculate::kOn && cfg.run.schedule == StepSchedule::kMicroBatch) {
      throw ConfigError("optimizer.speculate", "on needs run.schedule \"layer\" (or auto) with several "
                                               "micro-batches: under micro_batch a block's gradient is final only "
                                               "in the last micro-batch's backward");
    }
    plan.optimizer.speculate_choice = "off (micro_batch with several micro-batches: gradients are final only at the last)";
    return;
  }
  if (!optimizer_overlaps(cfg, plan)) {
    if (want == Speculate::kOn) {
      throw ConfigError("optimizer.speculate", "on needs the optimizer on its own thread, which "
                                               "run.overlap_optimizer turns off here; set it true");
    }
    plan.optimizer.speculate_choice = "off (the optimizer runs inline: run.overlap_optimizer)";
    return;
  }
  bool cpu_piece = false;
  for (const PlacementUnit& piece : pipeline_pieces(plan)) cpu_piece |= !device_adam_piece(plan, piece);
  if (!cpu_piece) {
    plan.optimizer.speculate_choice = "off (every piece is updated by the device's Adam after the verdict)";
    return;
  }
  // Note [Alternate swap slots]: a second home on disk for every NVMe unit
  // of master weights and moments.
  int64_t spare = 0;  // the sub-groups whose master weights and moments are all on NVMe
  const int64_t state_bytes = plan.state.elem_bytes[size_t(Category::kMaster)] +
                              plan.state.elem_bytes[size_t(Category::kExpAvg)] + plan.state.elem_bytes[size_t(Category::kExpAvgSq)];
  for (const PlacementUnit& u : plan.state.units[size_t(Category::kMaster)]) {
    if (optimizer_state_on_nvme(plan, u.offset, u.numel)) spare += u.numel * state_bytes;
  }
  const int64_t nvme_need = plan.total()[size_t(Tier::kNvme)] + spare;
  const bool room = spare > 0 && cfg.optimizer.speculate_slots && (cap.nvme_bytes < 0 || nvme_need <= cap.nvme_bytes);
  // Why NVMe state would be read twice, where it would.
  const std::string no_slots =
      !cfg.optimizer.speculate_slots
          ? std::string("optimizer.speculate_slots is false")
          : strprintf("no room for its alternate slots: needs %s of disk, has %s", format_bytes(double(nvme_need)).c_str(),
                      format_bytes(double(cap.nvme_bytes)).c_str());
  if (want == Speculate::kAuto) {
    if (plan.device_addressable) {
      plan.optimizer.speculate_choice = "off (the CPU device: Adam shares the cores with the compute; \"on\" to force)";
      return;
    }
    if (spare > 0 && !room) {
      plan.optimizer.speculate_choice =
          "off (optimizer state on NVMe, " + no_slots + ": the commit would read it twice; \"on\" to force)";
      return;
    }
  }
  plan.optimizer.speculate = true;
  plan.optimizer.speculate_choice = want == Speculate::kOn ? "on" : "on (auto)";
  if (room) {
    plan.optimizer.speculate_slots = true;
    plan.optimizer.nvme_spare_bytes = spare;
  } else if (spare > 0) {
    plan.optimizer.speculate_choice += " (NVMe state by two passes, read twice: " + no_slots + ")";
  }
}

}  // namespace strata
