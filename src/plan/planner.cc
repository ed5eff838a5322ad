// The planner (plan/planner.h): candidates, the choices by the bound, and
// the plan for the machine.
#include "plan/planner.h"

#include <optional>
#include <utility>

#include "util/errors.h"
#include "util/logging.h"

namespace strata {

PlacementPlan plan_for_machine(const Config& cfg, const StateLayout& layout, MachineCapacity* capacity,
                               int64_t rank, int local_ranks, const Device* device, const GivenCapacity& given,
                               const Rates* rates) {
  const int ranks = std::max(1, local_ranks);
  auto measure = [&](const std::vector<std::string>& paths) {
    MachineCapacity m =
        measure_capacity(cfg, paths, local_ranks, device != nullptr && device->is_cuda() ? device->ordinal() : -1);
    if (device != nullptr) m.device_addressable = device->host_addressable();
    if (given.host_bytes >= 0) m.host_bytes = given.host_bytes / ranks, m.host_source = "--host-memory-gb";
    if (given.nvme_bytes >= 0) m.nvme_bytes = given.nvme_bytes / ranks, m.nvme_source = "--nvme-gb";
    if (given.device_bytes >= 0) {
      m.device_bytes = given.device_bytes;
      m.device_source = given.device_source.empty() ? "--device-memory-gb" : given.device_source;
    }
    return m;
  };
  // The swap directories are known only from a first plan; capacity matters
  // only to auto, which the second call redoes with the directories measured.
  PlacementPlan first = make_plan(cfg, layout, rank, measure({}));
  MachineCapacity cap = measure(first.state.nvme_paths);
  if (capacity != nullptr) *capacity = cap;
  // With rates, optimizer.speculate auto takes NVMe state's alternate slots
  // only where the bound says they gain (Note [Speculating NVMe state]).
  auto judged = [&](PlacementPlan p) {
    if (rates != nullptr) judge_speculation_by_bound(cfg, *rates, cap.device_is_host, p);
    return p;
  };
  if (rates != nullptr && cfg.run.schedule == StepSchedule::kAuto && cfg.gradient_accumulation_steps > 1) {
    return judged(choose_schedule_by_bound(cfg, layout, rank, cap, *rates));
  }
  // Fixed placements too: optimizer.speculate's alternate swap slots need
  // the disk measured (resolve_speculation).
  if (rates != nullptr && cfg.placement.auto_place && cfg.placement.by_bound) {
    return judged(choose_by_bound(cfg, layout, rank, cap, *rates));
  }
  if (rates != nullptr) return judged(best_activations(cfg, layout, rank, cap, *rates));
  if (!cfg.placement.auto_place) return judged(first.state.nvme_paths.empty() ? first : make_plan(cfg, layout, rank, cap));
  return judged(make_plan(cfg, layout, rank, cap));
}

namespace {

// One of auto's fills (plan/planner.h, choose_by_bound): its name, the
// order categories fill in, the optimizer sub-groups it leaves in HBM and
// the frozen base's host bytes (-1: as many as fit).
struct Candidate {
  std::string name;
  std::vector<int> order;
  int64_t device_groups;
  int64_t frozen_host_bytes = -1;
};

// The greedy fill first, then the others worth trying beside `greedy`.
std::vector<Candidate> auto_candidates(const PlacementPlan& greedy, const MachineCapacity& capacity) {
  std::vector<Candidate> candidates = {{"greedy (param16, grad, optimizer state)", {}, -1}};
  // A frozen base (Note [State kinds] in memory/layout.h) in host RAM takes
  // the room host-kept activations would have: part of it on NVMe (read at
  // each use, never written) may buy more of the step than it costs. (Only
  // where the config names swap directories.)
  const int64_t frozen_host = greedy.state.bytes[size_t(Category::kFrozen)][size_t(Tier::kHost)];
  if (!capacity.device_is_host && frozen_host > 0 && !greedy.state.nvme_paths.empty()) {
    for (int quarters : {3, 2, 1, 0}) {
      const int64_t cap = frozen_host / 4 * quarters;
      candidates.push_back({strprintf("frozen base: at most %s in host RAM, the rest on NVMe",
                                      format_bytes(double(cap)).c_str()), {}, -1, cap});
    }
  }
  if (capacity.device_is_host) {
    candidates.push_back({"optimizer state before gradients", {0, 2, 3, 4, 1}, -1});
    candidates.push_back({"gradients before parameters", {1, 0, 2, 3, 4}, -1});
    candidates.push_back({"optimizer state first", {2, 3, 4, 0, 1}, -1});
  } else {
    int64_t groups = 0;
    for (const PlacementUnit& u : greedy.state.units[size_t(Category::kMaster)]) groups += u.tier == Tier::kDevice;
    if (groups > 0) {
      candidates.push_back({"no optimizer sub-group in HBM", {}, 0});
      if (groups > 1) candidates.push_back({strprintf("%lld of %lld sub-groups in HBM", (long long)(groups / 2),
                                                      (long long)groups), {}, groups / 2});
    }
    candidates.push_back({"gradients before parameters", {1, 0, 2, 3, 4}, -1});
  }
  return candidates;
}

}  // namespace

PlacementPlan choose_by_bound(const Config& cfg, const StateLayout& layout, int64_t rank,
                              const MachineCapacity& capacity, const Rates& rates) {
  PlacementPlan greedy = best_activations(cfg, layout, rank, capacity, rates);
  const std::vector<Candidate> candidates = auto_candidates(greedy, capacity);
  const bool cpu_compute = capacity.device_is_host;
  PlacementPlan best;
  double best_s = -1, runner_s = -1, greedy_s = -1;
  std::string best_name, runner_name, unjudged;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& k = candidates[i];
    Config c = cfg;
    c.placement.auto_order = k.order;
    c.placement.auto_device_groups = k.device_groups;
    c.placement.auto_frozen_host_bytes = k.frozen_host_bytes;
    PlacementPlan p = i == 0 ? greedy : best_activations(c, layout, rank, capacity, rates);
    if (i > 0 && !plan_shortfalls(p, capacity).empty()) continue;
    const StepWork w = predicted_work(c, p, train_fetches(p), step_network_bytes(p));
    if (!missing_rates(w, rates, cpu_compute).empty()) {
      if (i == 0) {  // nothing to compare with: the greedy fill, said why
        greedy.state.auto_choice = "greedy fill (not judged by the bound: no rate for " +
                             missing_rates(w, rates, cpu_compute).front() + ")";
        return greedy;
      }
      unjudged += (unjudged.empty() ? "" : ", ") + k.name;
      continue;
    }
    const double s = step_bound(w, rates, cpu_compute).seconds;
    if (i == 0) greedy_s = s;
    if (best_s < 0 || s < best_s * (1 - 1e-6)) {
      if (best_s >= 0) runner_s = best_s, runner_name = best_name;
      best_s = s, best_name = k.name, best = std::move(p);
    } else if (runner_s < 0 || s < runner_s) {
      runner_s = s, runner_name = k.name;
    }
  }
  // Note [Auto's margin]: another candidate replaces the greedy fill only
  // when its bound is lower by more than kAutoMargin.
  if (best_name != candidates[0].name && best_s > greedy_s * (1 - kAutoMargin)) {
    greedy.state.auto_choice = strprintf(
        "%s: bound %.3f s (%s: %.3f s, not %.0f%% lower: within what the bound leaves out)", candidates[0].name.c_str(),
        greedy_s, best_name.c_str(), best_s, kAutoMargin * 100);
    if (!unjudged.empty()) greedy.state.auto_choice += "; not judged (no rate): " + unjudged;
    return greedy;
  }
  best.state.auto_choice = strprintf("%s: bound %.3f s", best_name.c_str(), best_s);
  if (runner_s >= 0) best.state.auto_choice += strprintf("; runner-up %s: %.3f s", runner_name.c_str(), runner_s);
  if (best_name != candidates[0].name && runner_name != candidates[0].name) {
    best.state.auto_choice += strprintf("; greedy fill: %.3f s", greedy_s);
  }
  if (!unjudged.empty()) best.state.auto_choice += "; not judged (no rate): " + unjudged;
  return best;
}

namespace {

// The step's bound of `p` at `rates` (-1 where its work needs a rate they lack).
double bound_of(const Config& cfg, const PlacementPlan& p, const Rates& rates, bool cpu_compute) {
  const StepWork w = predicted_work(cfg, p, train_fetches(p), step_network_bytes(p));
  if (!missing_rates(w, rates, cpu_compute).empty()) return -1;
  return step_bound(w, rates, cpu_compute).seconds;
}

}  // namespace

PlacementPlan best_activations(const Config& cfg, const StateLayout& layout, int64_t rank,
                               const MachineCapacity& capacity, const Rates& rates) {
  PlacementPlan none = make_plan(cfg, layout, rank, capacity);
  if (cfg.run.recompute != Recompute::kAuto || cfg.run.keep_device_layers >= 0 || capacity.device_is_host ||
      none.activations.recomputed_packs() == 0) {
    return none;
  }
  const double none_s = bound_of(cfg, none, rates, false);
  if (none_s < 0) return none;
  Config c = cfg;
  auto with_host = [&](int64_t h) {
    c.run.auto_host_packs = h;
    return make_plan(c, layout, rank, capacity);
  };
  // Host keeps take two device slots, which may cost device-kept packs: up
  // to every pack may go to the host.
  PlacementPlan most = with_host(none.activations.packs());
  const int64_t fit = most.activations.keep_host_packs;
  if (fit == 0) {
    none.activations.recompute_choice += "; host RAM holds no layer's entries beside the state";
    return none;
  }
  // Compute falls and the link's bytes grow linearly with the packs on the
  // host, so the bound is convex in them: every count up to 16, a grid of 16
  // beyond, then the counts between the best and its grid neighbours.
  const int64_t stride = (fit + 15) / 16;
  std::vector<double> seconds(size_t(fit) + 1, -2);  // -2: not tried; -1: no bound or does not fit
  auto bound_at = [&](int64_t h, PlacementPlan* out) {
    if (seconds[size_t(h)] > -2 && out == nullptr) return seconds[size_t(h)];
    PlacementPlan p = h == fit ? most : with_host(h);
    const bool fits = plan_shortfalls(p, capacity).empty() && p.activations.keep_host_packs == h;
    seconds[size_t(h)] = fits ? bound_of(c, p, rates, false) : -1;
    if (out != nullptr) *out = std::move(p);
    return seconds[size_t(h)];
  };
  int64_t best_h = 0;
  double best_s = none_s;
  auto consider = [&](int64_t h) {
    const double s = bound_at(h, nullptr);
    if (s >= 0 && s < best_s * (1 - 1e-9)) best_s = s, best_h = h;
  };
  for (int64_t h = stride; h < fit; h += stride) consider(h);
  consider(fit);
  if (stride > 1 && best_h > 0) {
    for (int64_t h = std::max<int64_t>(1, best_h - stride + 1); h <= std::min(fit, best_h + stride - 1); ++h) consider(h);
  }
  // Note [Auto's margin]: what the bound leaves out (whether each host
  // pack's copies hide behind the packs between) is of that order.
  if (best_h == 0 || best_s > none_s * (1 - kAutoMargin)) {
    if (best_h > 0) {
      none.activations.recompute_choice +=
          strprintf("; entries in host RAM for %s: bound %.3f s against %.3f s, not %.0f%% lower",
                    packs_in_words(best_h, none.activations.micro).c_str(), best_s, none_s, kAutoMargin * 100);
    }
    return none;
  }
  PlacementPlan best;
  bound_at(best_h, &best);
  best.activations.recompute_choice +=
      strprintf(" (the bound: %.3f s a step, %.3f s recomputing them)", best_s, none_s);
  return best;
}

bool weighs_host_activations(const Config& cfg, const PlacementPlan& plan) {
  return cfg.run.recompute == Recompute::kAuto && cfg.run.keep_device_layers < 0 && cfg.run.device != DeviceKind::kCpu &&
         plan.activations.recomputed_packs() > 0;
}

void judge_speculation_by_bound(const Config& cfg, const Rates& rates, bool cpu_compute, PlacementPlan& plan) {
  if (cfg.optimizer.speculate != Speculate::kAuto || !plan.optimizer.speculate || !plan.optimizer.speculate_slots) return;
  PlacementPlan off = plan;
  off.optimizer.speculate = false;
  off.optimizer.speculate_slots = false;
  off.optimizer.nvme_spare_bytes = 0;
  const StepWork won = predicted_work(cfg, plan, train_fetches(plan), step_network_bytes(plan));
  const StepWork woff = predicted_work(cfg, off, train_fetches(off), step_network_bytes(off));
  if (!missing_rates(won, rates, cpu_compute).empty() || !missing_rates(woff, rates, cpu_compute).empty()) return;
  const double on_s = step_bound(won, rates, cpu_compute).seconds;
  const double off_s = step_bound(woff, rates, cpu_compute).seconds;
  const double clipped_s = step_bound(clipped_work(won), rates, cpu_compute).seconds;
  if (on_s < off_s * (1 - kAutoMargin)) {
    plan.optimizer.speculate_choice +=
        strprintf(" (the bound: %.3f s a step, %.3f s without; a clipped step %.3f s)", on_s, off_s, clipped_s);
    return;
  }
  off.optimizer.speculate_choice = strprintf(
      "off (optimizer state on NVMe: its alternate slots would take %s more disk for a bound of %.3f s a step "
      "against %.3f s without, not %.0f%% lower, and a clipped step %.3f s; \"on\" to force)",
      format_bytes(double(plan.optimizer.nvme_spare_bytes)).c_str(), on_s, off_s, kAutoMargin * 100, clipped_s);
  plan = std::move(off);
}

PlacementPlan choose_schedule_by_bound(const Config& cfg, const StateLayout& layout, int64_t rank,
                                       const MachineCapacity& capacity, const Rates& rates) {
  std::optional<PlacementPlan> b;
  PlacementPlan a = schedule_candidates(
      cfg, capacity,
      [&](const Config& c) {
        return c.placement.auto_place && c.placement.by_bound ? choose_by_bound(c, layout, rank, capacity, rates)
                                                              : best_activations(c, layout, rank, capacity, rates);
      },
      &b);
  if (!b) return a;
  Config mb = cfg, ly = cfg;
  mb.run.schedule = StepSchedule::kMicroBatch;
  ly.run.schedule = StepSchedule::kLayer;
  const bool cpu_compute = capacity.device_is_host;
  const StepWork wa = predicted_work(mb, a, train_fetches(a), step_network_bytes(a));
  const StepWork wb = predicted_work(ly, *b, train_fetches(*b), step_network_bytes(*b));
  if (!missing_rates(wa, rates, cpu_compute).empty() || !missing_rates(wb, rates, cpu_compute).empty()) {
    return make_plan(cfg, layout, rank, capacity);  // without the bound
  }
  const double sa = step_bound(wa, rates, cpu_compute).seconds, sb = step_bound(wb, rates, cpu_compute).seconds;
  // The bound overrides the choice made without rates (resolve_schedule in
  // plan/make_plan.cc) only when it is lower by more than kAutoMargin (Note
  // [Auto's margin]): what the bound leaves out is of that order.
  const std::string gives_up = layer_gives_up(a, *b);
  const bool layer_default = gives_up.empty();
  const double def_s = layer_default ? sb : sa, other_s = layer_default ? sa : sb;
  const bool take_layer = other_s < def_s * (1 - kAutoMargin) ? !layer_default : layer_default;
  std::string note;
  if (other_s < def_s && take_layer == layer_default) {
    note = strprintf("; %s is lower by less than %.0f%%, the choice without rates stands: %s",
                     layer_default ? "micro_batch" : "layer", kAutoMargin * 100,
                     layer_default ? "layer fits with the same placement" : gives_up.c_str());
  }
  if (take_layer) {
    b->step.choice = strprintf("layer: bound %.3f s (micro_batch: %.3f s%s)", sb, sa, note.c_str());
    return *b;
  }
  a.step.choice = strprintf("micro_batch: bound %.3f s (layer: %.3f s%s)", sa, sb, note.c_str());
  return a;
}

}  // namespace strata
