// `strata plan --json`'s objects (cli/plan_json.h).
#include "cli/plan_json.h"

#include "config/rates.h"

namespace strata {

namespace {

// run.recompute as resolved: always, never, or partial (some layers keep
// their entries, some recompute: Note [Activation placement]).
const char* recompute_json(const ActivationPlan& act) {
  if (act.recomputed_packs() == act.packs()) return "always";
  return act.recomputed_packs() == 0 ? "never" : "partial";
}

// The activations' rows (Note [Step schedules] in memory/schedule.h) and
// what each layer keeps (Note [Activation placement] in memory/placement.h).
nlohmann::json activations_json(const PlacementPlan& p) {
  const ActivationPlan& act = p.activations;
  return {{"micro_batches_held", p.step.held_micro},
          {"checkpoints", act.checkpoint_activation_bytes},
          {"output_gradients_held", act.held_output_grad_bytes},
          {"tied_head_gradients_held", act.held_tied_grad_bytes},
          // As run.activations spells a placement: whole layers, then the
          // micro-batches of one more layer.
          {"micro_batches", act.micro},
          {"keep_device_layers", act.keep_device_packs / act.micro},
          {"keep_device_micro_batches", act.keep_device_packs % act.micro},
          {"keep_host_layers", act.keep_host_packs / act.micro},
          {"keep_host_micro_batches", act.keep_host_packs % act.micro},
          {"recomputed_layers", double(act.recomputed_packs()) / double(act.micro)},
          {"entries_bytes_per_layer", act.entries_bytes},
          // Note [Packs in gradient homes]: of the device's, these live in
          // gradient homes (not in the device rows).
          {"device_micro_batches_in_gradient_homes", act.lent_packs},
          {"gradient_home_bytes_lent", act.lent_packs * act.lend_stride},
          {"host_bytes", p.staging.ckpt_host},
          {"d2h_bytes_per_step", act.host_link_bytes()},
          {"h2d_bytes_per_step", act.host_link_bytes()},
          {"recomputed_flops_per_step", double(act.recomputed_packs()) * act.layer_recompute_flops},
          {"choice", act.recompute_choice}};
}

}  // namespace

nlohmann::json plan_json(const Computed& c) {
  nlohmann::json j;
  const PlacementPlan& p = c.plan;
  j["source"] = p.state.source;
  j["parameters"] = c.parameters;
  for (int cat = 0; cat < kNumCategories; ++cat) {
    if (Category(cat) == Category::kFrozen && p.state.frozen_space_numel == 0) continue;  // a dense model
    nlohmann::json row;
    for (int t = 0; t < kNumTiers; ++t) row[tier_name(Tier(t))] = p.state.bytes[size_t(cat)][size_t(t)];
    j["state_bytes"][category_name(Category(cat))] = row;
  }
  const auto st = p.state.total();
  const auto tot = p.total();
  for (int t = 0; t < kNumTiers; ++t) {
    j["state_total_bytes"][tier_name(Tier(t))] = st[size_t(t)];
    j["total_bytes"][tier_name(Tier(t))] = tot[size_t(t)];
  }
  j["activation_bytes"] = p.activations.bytes;
  j["cpu_checkpointing"] = p.activations.cpu_checkpointing;
  j["recompute"] = recompute_json(p.activations);
  j["schedule"] = schedule_name(p.step.schedule);
  if (!p.step.choice.empty()) j["schedule_choice"] = p.step.choice;
  // Note [Speculative optimizer] in engine/optimizer/optimizer_pass.h.
  const int64_t speculated = speculated_numel(p), in_slots = speculated_slot_numel(p);
  j["speculate"] = {{"on", p.optimizer.speculate},
                    {"mechanism", !p.optimizer.speculate                ? "none"
                                  : in_slots == 0             ? "two_pass"
                                  : in_slots == speculated    ? "alternate_slots"
                                                              : "two_pass+alternate_slots"},
                    {"elements", speculated},
                    {"alternate_slot_elements", in_slots},
                    {"spare_nvme_bytes", p.optimizer.nvme_spare_bytes},
                    {"choice", p.optimizer.speculate_choice}};
  j["activations"] = activations_json(p);
  if (p.state.frozen_space_numel > 0) {  // Note [State kinds]
    j["frozen_window"] = {{"slots", p.staging.frozen_window.slots},
                          {"slot_elements", p.staging.frozen_window.slot_numel},
                          {"persistent_elements", p.staging.frozen_window.persistent_numel},
                          {"device_bytes", p.staging.frozen_gathered},
                          {"bounce_bytes", p.staging.frozen_window_bounce}};
  }
  j["parameter_window"] = {{"slots", p.staging.window.slots},
                           {"slot_elements", p.staging.window.slot_numel},
                           {"persistent_elements", p.staging.window.persistent_numel}};
  j["staging_bytes"] = {{"gathered", p.staging.gathered}, {"grad_stage", p.staging.grad_stage},
                        {"checkpoint_device", p.staging.ckpt_device}, {"checkpoint_host", p.staging.ckpt_host},
                        {"grad_rmw", p.staging.grad_rmw}, {"grad_norms", p.staging.grad_norms}, {"opt_grad", p.staging.opt_grad},
                        {"opt_state", p.staging.opt_state}, {"opt_emit", p.staging.opt_emit},
                        {"grad_host", p.staging.grad_host}, {"window_bounce", p.staging.window_bounce},
                        {"tokens", p.staging.tokens}, {"save_bounce", p.staging.save_bounce},
                        {"save_snapshot", p.staging.save_snapshot},
                        {"comm_host", p.staging.comm_host}, {"grad_accum", p.staging.grad_accum},
                        {"secondary", p.staging.secondary}, {"gather", p.staging.gather},
                        {"frozen_gather", p.staging.frozen_gather}};
  int64_t kept = 0;
  for (char k : p.comm.keep_gathered) kept += k;
  j["kept_gathered_blocks"] = kept;
  j["secondary_shard"] = p.comm.secondary_shard;
  j["gradient_reduction"] = p.world_size <= 1                        ? "none"
                            : p.comm.reduce_per_step || p.step.sums_each_block() ? "per_step"
                                                                                    : "per_micro_batch";
  j["device_transient_bytes"] = p.staging.device_bytes();
  j["host_staging_bytes"] = p.staging.host_bytes();
  j["sub_group_numel"] = p.state.sub_group_numel;
  j["optimizer_state_dtype"] = p.state.bf16_moments() ? "bf16" : "fp32";
  j["nvme_paths"] = p.state.nvme_paths;
  j["capacity_bytes"] = {{"device", c.cap.device_bytes}, {"host", c.cap.host_bytes}, {"nvme", c.cap.nvme_bytes}};
  if (!c.cap.device_source.empty()) j["device_memory_source"] = c.cap.device_source;
  j["host_memory_source"] = c.cap.host_source;
  j["nvme_source"] = c.cap.nvme_source;
  j["world_size"] = p.world_size;
  j["stage"] = p.stage;
  j["ranks_per_node"] = c.ranks_per_node;
  for (int t = 0; t < kNumTiers; ++t) j["node_total_bytes"][tier_name(Tier(t))] = tot[size_t(t)] * c.ranks_per_node;
  j["network"] = {{"bytes_per_step_per_rank", c.net.world}, {"intra_node_bytes_per_step_per_rank", c.net.node}};
  j["fits"] = c.shortfalls.empty();
  j["shortfalls"] = c.shortfalls;
  return j;
}

namespace {

// bound.rates in strata plan --json: each row of the rates table (config/rates.h)
// in the bound's units with its source, and `run_rates`: the same as run.rates
// keys in their units (what tools/plan_rates.py hands to training runs).
nlohmann::json rates_json(const Rates& r) {
  nlohmann::json j = nlohmann::json::object(), keys = nlohmann::json::object();
  for (const RateSpec& s : kRateTable) {
    j[s.value] = r.value(s.kind);
    j[s.source] = r.source(s.kind);
    if (r.value(s.kind) > 0) keys[s.key] = r.value(s.kind) / s.scale;
  }
  j["run_rates"] = keys;
  return j;
}

}  // namespace

nlohmann::json bound_json(const StepWork& w, const StepBound& b, const Rates& r) {
  nlohmann::json res = nlohmann::json::array();
  for (const ResourceTime& t : b.resources) {
    res.push_back({{"resource", t.resource}, {"work", t.work}, {"rate", t.rate}, {"seconds", t.seconds}});
  }
  return {{"seconds", b.seconds},
          {"binding", b.binding},
          {"overlap_optimizer", w.overlap_optimizer},
          {"resources", res},
          {"work", {{"flops", w.flops}, {"h2d_bytes", w.links.h2d}, {"d2h_bytes", w.links.d2h},
                    {"nvme_read_bytes", w.links.nvme_read}, {"nvme_write_bytes", w.links.nvme_write},
                    {"adam_elements", w.adam_elems}, {"grad_add_elements", w.grad_add_elems},
                    {"checksum_bytes", w.checksum_bytes},
                    {"optimizer_checksum_bytes", w.optimizer_checksum_bytes}, {"net_bytes", w.net_bytes},
                    {"intra_node_bytes", w.intra_node_bytes}}},
          {"rates", rates_json(r)}};
}

}  // namespace strata
