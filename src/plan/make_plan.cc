// make_plan: the units of each category, the splits asked for or auto's fill,
// the activations and transients, then the choices (plan/choices.h).
#include "plan/make_plan.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "memory/device.h"
#include "config/saved_specs.h"
#include "plan/bound.h"
#include "plan/choices.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"

namespace strata {

namespace {

// Note [Placement units]: a unit goes to the tier whose share holds its midpoint.
void assign(std::vector<PlacementUnit>& units, const TierSplit& s, int64_t total) {
  const double dev_end = s.device * double(total);
  const double host_end = (s.device + s.host) * double(total);
  for (PlacementUnit& u : units) {
    const double mid = double(u.offset) + double(u.numel) / 2.0;
    u.tier = mid < dev_end ? Tier::kDevice : mid < host_end ? Tier::kHost : Tier::kNvme;
  }
}

int compute_bytes(const Config& cfg) { return compute_dtype_bytes(cfg.run.compute_dtype); }

}  // namespace

namespace {

// Note [Placement units]: param16 and grad per block shard, optimizer state
// per sub-group of the rank's shard space.
void cut_units(const Config& cfg, const StateLayout& layout, PlacementPlan& plan,
               std::array<std::vector<PlacementUnit>, kNumCategories>& units) {
  int64_t offset = 0;
  std::vector<PlacementUnit> block_units;
  for (const BlockLayout& b : layout.blocks()) {
    block_units.push_back({offset, b.shard_numel(), Tier::kDevice});
    offset += b.shard_numel();
    plan.state.largest_block_shard_numel = std::max(plan.state.largest_block_shard_numel, b.shard_numel());
  }
  plan.state.shard_space_numel = offset;
  plan.state.sub_group_numel = std::max<int64_t>(
      kShardAlignElems, (cfg.zero.sub_group_size + kShardAlignElems - 1) / kShardAlignElems * kShardAlignElems);
  std::vector<PlacementUnit> group_units;
  for (int64_t o = 0; o < plan.state.shard_space_numel; o += plan.state.sub_group_numel) {
    group_units.push_back({o, std::min(plan.state.sub_group_numel, plan.state.shard_space_numel - o), Tier::kDevice});
  }
  for (int c = 0; c <= int(Category::kExpAvgSq); ++c) {
    units[size_t(c)] = c <= int(Category::kGrad) ? block_units : group_units;
  }
  // Note [State kinds]: the frozen space, a unit per block shard like param16.
  units[size_t(Category::kFrozen)].clear();
  plan.state.frozen_space_numel = 0;
  if (!layout.has_frozen()) return;
  for (const BlockLayout& b : layout.blocks()) {
    units[size_t(Category::kFrozen)].push_back({plan.state.frozen_space_numel, b.frozen_shard_numel(), Tier::kDevice});
    plan.state.frozen_space_numel += b.frozen_shard_numel();
    plan.state.largest_frozen_shard_numel = std::max(plan.state.largest_frozen_shard_numel, b.frozen_shard_numel());
  }
}

// Each category's split as asked. Frozen values follow param16's split:
// offload_param places the frozen base (its max_in_cpu counts frozen
// elements), and so does a placement section's param16. The adapters'
// working copy, written every step and small, stays on the device unless
// placement.param16 says otherwise.
std::array<TierSplit, kNumCategories> requested_split(const Config& cfg, const StateLayout& layout,
                                                      const PlacementPlan& plan, const StateIntent& intent) {
  std::array<TierSplit, kNumCategories> split;
  for (size_t c = 0; c < intent.split.size(); ++c) split[c] = intent.split[c];
  if (layout.has_frozen()) {
    split[size_t(Category::kFrozen)] = state_intent(cfg, plan.state.frozen_space_numel).split[0];
    if (!cfg.placement.has_param16) split[size_t(Category::kParam16)] = TierSplit{1.0, 0.0, 0.0};
  }
  return split;
}

// The elements a category's units cover: the frozen space's for kFrozen,
// the shard space's for the others.
int64_t space_numel(const PlacementPlan& plan, int c) {
  return c == int(Category::kFrozen) ? plan.state.frozen_space_numel : plan.state.shard_space_numel;
}

// The activation rows from what each layer keeps (Note [Activation
// placement] in memory/placement.h): the token ids per micro-batch held and
// the packs held on the device; the held gradients; one block's work.
void activation_rows(PlacementPlan& plan) {
  ActivationPlan& a = plan.activations;
  a.checkpoint_activation_bytes = plan.step.held_micro * a.token_bytes + a.device_pack_bytes();
  a.bytes = a.checkpoint_activation_bytes + a.held_output_grad_bytes + a.held_tied_grad_bytes + a.work_bytes;
}

// Activations and the inputs of staging_needs (needed by auto, reported by all).
void estimate_transients(const Config& cfg, const StateLayout& layout, PlacementPlan& plan) {
  const ModelConfig& m = cfg.model;
  const int64_t tokens = cfg.train_micro_batch_size_per_gpu * m.seq_len;
  const int64_t cb = compute_bytes(cfg);
  // Saved block inputs (the embedding's are the int64 tokens) plus one
  // block's work: a layer's recomputed entries and its backward's
  // temporaries, about 10 x dim + 4 x ffn values per token, with attention
  // scores (heads x seq per token) as a kernel that materialises them would
  // hold (the flash kernels do not: an over-estimate kept from the autograd
  // path); or the fp32 logits with their gradient.
  plan.activations.checkpoint_bytes = tokens * m.dim * cb;
  plan.activations.checkpoint_layers = m.n_layers;
  plan.activations.cpu_checkpointing = cfg.activation_checkpointing.cpu_checkpointing;
  // Note [Step schedules]: the layer schedule holds A micro-batches' saved
  // inputs per layer, the A gradients of the current block's outputs between
  // blocks, and with a tied head the A head gradients of the embedding
  // until its backward; micro_batch one micro-batch's of each (the gradient
  // of the output and the head's share are then part of the op's own).
  const int64_t held = plan.step.held_micro;
  plan.activations.held_output_grad_bytes = held > 1 ? held * plan.activations.checkpoint_bytes : 0;
  // (A frozen embedding, LoRA's, takes no head gradient: Note [State kinds].)
  plan.activations.held_tied_grad_bytes =
      held > 1 && m.tie_embeddings && !m.lora.enabled ? held * m.vocab_size * m.dim * cb : 0;
  // Note [Saved activations] (model/layer_ops.cc): what a layer keeps when it
  // keeps its entries.
  plan.activations.entries_bytes = tokens * kept_entry_bytes_per_token(m, int(cb));
  plan.activations.token_bytes = tokens * 8;
  // A layer's forward or backward working set: with experts, the gathered
  // token copies, their gate/up and SwiGLU, the outputs and their re-sort (top
  // k of each a token: Note [Experts] in model/layer_ops.cc).
  // The backward holds the most: the copies, their output gradient and its
  // weighted form, and the gate/up gradients beside the saved gate/up.
  const int64_t mlp_work = m.is_moe() ? m.moe.num_experts_per_tok * (5 * m.dim + 8 * m.expert_dim()) +
                                            4 * m.moe.shared_expert_intermediate_size + m.moe.num_experts
                                      : 4 * m.ffn_dim();
  const int64_t layer = tokens * (6 * m.dim + 4 * m.q_dim() + mlp_work) * cb + 3 * tokens * m.n_heads * m.seq_len * 4;
  const int64_t head = 3 * tokens * m.vocab_size * 4;
  plan.activations.work_bytes = std::max(layer, head);
  plan.activations.layer_recompute_flops = step_flops(m, tokens, 1) - step_flops(m, tokens, 0);
  plan.activations.micro = std::max<int64_t>(plan.step.accum, 1);
  plan.activations.held = held;
  plan.activations.keep_device_packs = plan.activations.keep_host_packs = 0;
  activation_rows(plan);
  int64_t largest_block = 0;
  for (const BlockLayout& b : layout.blocks()) largest_block = std::max(largest_block, b.padded_numel);
  plan.largest_block_numel = largest_block;
  for (const BlockLayout& b : layout.blocks()) plan.block_numel.push_back(b.shard_numel());
  if (layout.has_frozen()) {
    for (const BlockLayout& b : layout.blocks()) plan.frozen_block_numel.push_back(b.frozen_shard_numel());
  }
  plan.step.token_bytes = std::max<int64_t>(plan.step.accum, 1) * cfg.train_micro_batch_size_per_gpu * (m.seq_len + 1) * 8;
  plan.window_knobs.prefetch_numel = cfg.zero.stage3_prefetch_bucket_size;
  plan.window_knobs.max_live_numel = cfg.zero.stage3_max_live_parameters;
  plan.window_knobs.persistence_numel = cfg.zero.stage3_param_persistence_threshold;
  plan.compute_bytes = int(cb);
  plan.tied = m.tie_embeddings;
}

// What is left of the device and host budgets while auto fills them, and the
// fill's rule for one unit: the device if it fits whole (and may go there),
// else the host likewise, else NVMe.
struct TierFill {
  int64_t dev_left = 0, host_left = 0;

  void place(const PlacementPlan& plan, int c, PlacementUnit& u, bool device_ok) {
    const int64_t bytes = u.numel * plan.state.elem_bytes[size_t(c)];
    if (device_ok && bytes <= dev_left) {
      u.tier = Tier::kDevice;
      dev_left -= bytes;
    } else if (bytes <= host_left) {
      u.tier = Tier::kHost;
      host_left -= bytes;
    } else {
      u.tier = Tier::kNvme;
    }
  }
};

// On a GPU, CPU Adam cannot update device memory in place: a sub-group's
// optimizer state goes to the device only whole (master and both moments)
// and only where its gradient and working copy are there too, so that the
// GPU's Adam updates it (device_adam_piece); otherwise a device-tier part
// would cross PCIe twice a step. The rest category by category, as on CPU.
void fill_optimizer_on_gpu(const PlacementConfig& pc, const PlacementPlan& plan, const std::vector<int>& order,
                           std::array<std::vector<PlacementUnit>, kNumCategories>& units, TierFill& fill) {
  const int first_optimizer = int(Category::kMaster);
  auto on_device = [&](Category c, int64_t lo, int64_t hi) {
    for (const PlacementUnit& u : units[size_t(c)]) {
      if (u.offset < hi && lo < u.offset + u.numel && u.tier != Tier::kDevice) return false;
    }
    return true;
  };
  std::vector<PlacementUnit>& master = units[size_t(Category::kMaster)];
  std::vector<char> device_group(master.size(), 0);
  for (size_t i = 0; i < master.size(); ++i) {
    int64_t bytes = 0;
    for (int c = first_optimizer; c <= int(Category::kExpAvgSq); ++c) {
      const PlacementUnit& u = units[size_t(c)].at(i);
      STRATA_CHECK(u.offset == master[i].offset && u.numel == master[i].numel,
                   "optimizer categories cut into different sub-groups");
      bytes += u.numel * plan.state.elem_bytes[size_t(c)];
    }
    const int64_t lo = master[i].offset, hi = lo + master[i].numel;
    device_group[i] = bytes <= fill.dev_left && on_device(Category::kParam16, lo, hi) && on_device(Category::kGrad, lo, hi);
    if (pc.auto_device_groups >= 0 && std::count(device_group.begin(), device_group.end(), 1) > pc.auto_device_groups) {
      device_group[i] = 0;
    }
    if (device_group[i]) fill.dev_left -= bytes;
  }
  for (int c : order) {
    if (c < first_optimizer || c > int(Category::kExpAvgSq)) continue;
    for (size_t i = 0; i < master.size(); ++i) {
      if (device_group[i]) {
        units[size_t(c)][i].tier = Tier::kDevice;
      } else {
        fill.place(plan, c, units[size_t(c)][i], false);
      }
    }
  }
}

// The split each category's units reached.
std::array<TierSplit, kNumCategories> reached_split(const PlacementPlan& plan,
                                                    const std::array<std::vector<PlacementUnit>, kNumCategories>& units) {
  std::array<TierSplit, kNumCategories> split;
  for (int c = 0; c < kNumCategories; ++c) {
    std::array<double, kNumTiers> b{};
    for (const PlacementUnit& u : units[size_t(c)]) b[size_t(u.tier)] += double(u.numel);
    const double total = double(std::max<int64_t>(1, space_numel(plan, c)));
    split[size_t(c)] = TierSplit{b[0] / total, b[1] / total, b[2] / total};
  }
  return split;
}

// "auto": fills the fastest tiers first; returns the split that was reached.
std::array<TierSplit, kNumCategories> fill_auto(const Config& cfg, const MachineCapacity& capacity,
                                                PlacementPlan& plan,
                                                std::array<std::vector<PlacementUnit>, kNumCategories>& units) {
  const PlacementConfig& pc = cfg.placement;
  // param16 (every forward and backward), then grad (every backward), then
  // optimizer state (once per step), whole units at a time: a unit goes to
  // the device if it fits whole in what is left of the device budget, else
  // to the host likewise, else to NVMe (on a GPU, optimizer state goes to the
  // device a whole sub-group at a time: fill_optimizer_on_gpu). With CPU
  // compute the device tier is host memory, so the two share one budget. The
  // staging buffers that what lands off the device needs are reserved and the
  // fill redone until the reserve stops changing.
  plan.state.source = "auto";
  const double keep = 1.0 - pc.headroom;
  const int64_t kUnlimited = std::numeric_limits<int64_t>::max() / 4;
  auto budget = [&](int64_t cap) { return cap < 0 ? kUnlimited : int64_t(double(cap) * keep); };
  int64_t reserve_device = 0, reserve_host = 0;
  plan.window_cap_bytes = 0;  // the window at its minimum while filling; widened below
  std::vector<int> order = pc.auto_order;
  if (order.empty()) order = {0, 1, 2, 3, 4};
  // Frozen values (Note [State kinds]) are read by every forward and
  // backward, as param16 is: right after it.
  if (std::find(order.begin(), order.end(), int(Category::kFrozen)) == order.end()) {
    order.insert(std::find(order.begin(), order.end(), int(Category::kParam16)) + 1, int(Category::kFrozen));
  }
  for (int pass = 0; pass < 4; ++pass) {
    TierFill fill;
    const int64_t act_dev = plan.activations.bytes;
    if (capacity.device_is_host) {
      // One pool of host RAM: the device budget (if one is set) is carved
      // from it, and everything else, staging included, comes out of it too.
      const int64_t pool = budget(capacity.host_bytes) - plan.activations.bytes - reserve_device - reserve_host;
      fill.dev_left = capacity.device_bytes >= 0
                          ? std::min(budget(capacity.device_bytes) - act_dev - reserve_device, pool)
                          : pool;
      fill.host_left = pool - fill.dev_left;
    } else {
      fill.dev_left = budget(capacity.device_bytes) - act_dev - reserve_device;
      fill.host_left = budget(capacity.host_bytes) - reserve_host;
    }
    for (int c : order) {
      if (!capacity.device_is_host && c >= int(Category::kMaster) && c <= int(Category::kExpAvgSq)) continue;
      // The planner's cap on the frozen base's host bytes (its candidates
      // trading host RAM between the base and activations).
      const bool capped = c == int(Category::kFrozen) && pc.auto_frozen_host_bytes >= 0;
      const int64_t host_before = fill.host_left;
      if (capped) fill.host_left = std::min(fill.host_left, pc.auto_frozen_host_bytes);
      const int64_t capped_left = fill.host_left;
      for (PlacementUnit& u : units[size_t(c)]) fill.place(plan, c, u, true);
      if (capped) fill.host_left = host_before - (capped_left - fill.host_left);
    }
    if (!capacity.device_is_host) fill_optimizer_on_gpu(pc, plan, order, units, fill);
    plan.state.units = units;
    const StagingNeeds need = staging_needs(plan);
    if (need.device_bytes() == reserve_device && need.host_bytes() == reserve_host) break;
    reserve_device = need.device_bytes();
    reserve_host = need.host_bytes();
  }
  return reached_split(plan, units);
}

// The parameter window's share of the device (plan.window_cap_bytes).
void cap_window(const Config& cfg, const MachineCapacity& capacity, PlacementPlan& plan) {
  const PlacementConfig& pc = cfg.placement;
  // With a device budget, the window (Note [Prefetch window]) gets what the
  // resident state, the other staging and the activations leave of it (under
  // auto, less the headroom); the current block always gets a slot.
  // Under auto on CPU without a device budget the device tier shares host
  // RAM, so the window gets what is left of that instead.
  // Under auto on CPU the device tier also shares host RAM, so the window
  // gets no more than what is left of that either.
  const double keep = pc.auto_place ? 1.0 - pc.headroom : 1.0;
  const StagingNeeds other = staging_needs(plan);
  auto left_of = [&](int64_t pool, bool shared) {
    int64_t left = int64_t(double(pool) * keep);
    for (int c = 0; c < kNumCategories; ++c) {
      left -= plan.state.bytes[size_t(c)][size_t(Tier::kDevice)];
      if (shared) left -= plan.state.bytes[size_t(c)][size_t(Tier::kHost)];
    }
    left -= plan.activations.bytes + other.grad_stage + other.grad_norms + other.ckpt_device + other.grad_accum +
            other.tokens + other.gather + other.frozen_gather + other.grad_sync + other.secondary;
    if (shared) left -= other.host_bytes();
    return std::max<int64_t>(0, left);
  };
  plan.window_cap_bytes = -1;
  if (capacity.device_bytes >= 0) plan.window_cap_bytes = left_of(capacity.device_bytes, false);
  if (pc.auto_place && capacity.device_is_host && capacity.host_bytes >= 0) {
    const int64_t shared = left_of(capacity.host_bytes, true);
    plan.window_cap_bytes = plan.window_cap_bytes < 0 ? shared : std::min(plan.window_cap_bytes, shared);
  }
}

// The swap directories, and what the NVMe placement requires of the config.
void choose_swap_paths(const Config& cfg, PlacementPlan& plan) {
  const OffloadParamConfig& op = cfg.zero.offload_param;
  const bool params_on_nvme = plan.state.bytes[0][2] > 0 || plan.state.bytes[1][2] > 0 || plan.state.bytes[5][2] > 0;
  const bool optimizer_on_nvme = plan.state.bytes[2][2] > 0 || plan.state.bytes[3][2] > 0 || plan.state.bytes[4][2] > 0;
  // The swap directories are the config's intent (state_intent).
  if ((params_on_nvme || optimizer_on_nvme) && plan.state.nvme_paths.empty()) {
    throw ConfigError("placement.nvme_path", "state is placed on nvme but no swap directory is given");
  }
  const int64_t largest_shard = std::max(plan.state.largest_block_shard_numel, plan.state.largest_frozen_shard_numel);
  if (params_on_nvme && op.device == OffloadDevice::kNvme && op.buffer_size < largest_shard) {
    // DeepSpeed asserts deep in a step when a parameter buffer cannot hold the
    // largest block; here it is refused before anything is allocated.
    throw ConfigError("zero_optimization.offload_param.buffer_size",
                      strprintf("%lld elements cannot hold the largest block shard (%lld elements); "
                                "raise it to at least %lld",
                                (long long)op.buffer_size, (long long)largest_shard, (long long)largest_shard));
  }
}

// Note [Packs in gradient homes] (memory/placement.h): how much of the
// device's gradient homes, from the first block's, each layer's packs may
// use under the layer schedule.
void lendable_homes(const Config& cfg, PlacementPlan& plan) {
  ActivationPlan& a = plan.activations;
  a.lend_limit.clear();
  a.lend_stride = 0;
  a.lent_packs = 0;
  if (!cfg.run.packs_in_grad_homes || a.held <= 1 || a.cpu_checkpointing || a.entries_bytes <= 0) return;
  const std::vector<PlacementUnit>& homes = plan.state.units[size_t(Category::kGrad)];
  const int64_t eb = plan.state.elem_bytes[size_t(Category::kGrad)];
  a.lend_stride = (a.entries_bytes + 511) / 512 * 512;  // each pack 512-byte aligned
  int64_t lendable = 0;  // bytes of the device homes from the first, so far
  bool open = true;
  // Layer l is block l + 1: its packs may use the homes of blocks 0..l.
  for (int64_t l = 0; l < a.checkpoint_layers && size_t(l) < homes.size(); ++l) {
    open = open && homes[size_t(l)].tier == Tier::kDevice;
    if (open) lendable += homes[size_t(l)].numel * eb;
    a.lend_limit.push_back(lendable);
  }
  if (lendable < a.lend_stride) a.lend_limit.clear();
}

// run.recompute auto: as many of the last packs (layer by layer, micro-batch
// by micro-batch) keep their entries on the device as fit in what the state,
// the staging and the other activations leave of it (of host RAM on CPU
// without a device budget), less the two device slots of host-kept entries
// when the planner asks for those. Under micro_batch a layer's packs are
// held one micro-batch at a time, so a part of a layer takes the memory of
// all of it: whole layers then. cpu_checkpointing asks for the device's
// memory back (DeepSpeed's meaning): none then.
int64_t device_packs_that_fit(const Config& cfg, const MachineCapacity& capacity, PlacementPlan& plan) {
  const ActivationPlan& a = plan.activations;
  if (a.cpu_checkpointing) return 0;
  const int64_t each = a.entries_bytes - a.checkpoint_bytes;  // one pack held, under either schedule
  plan.staging = staging_needs(plan);  // what the plan holds besides (made again once chosen)
  int64_t room = 0;
  if (plan.window_cap_bytes >= 0) {
    room = plan.window_cap_bytes - plan.staging.gathered - plan.staging.frozen_gathered;  // the windows' share stays
    if (cfg.run.auto_host_packs > 0 && !capacity.device_is_host) room -= 2 * a.entries_bytes;
  } else if (capacity.device_is_host && capacity.host_bytes >= 0) {
    const auto t = plan.total();
    const double keep = cfg.placement.auto_place ? 1.0 - cfg.placement.headroom : 1.0;
    room = int64_t(double(capacity.host_bytes) * keep) - t[size_t(Tier::kDevice)] - t[size_t(Tier::kHost)];
  } else {
    return a.packs();  // no limit known
  }
  if (each <= 0) return a.packs();
  // The last packs first into the gradient homes (Note [Packs in gradient
  // homes]), then into what is left.
  const int64_t lent = a.packs_that_lend(a.packs());
  if (room <= 0) return lent;
  const int64_t n = a.held > 1 ? room / each : room / each * a.micro;
  return std::min<int64_t>(a.packs(), lent + n);
}

// How many packs keep their entries in pinned host RAM under auto: at most
// run.auto_host_packs (the planner's, judged by the step's bound:
// plan/planner.h, best_activations), of the packs not kept on the device, as
// many as host RAM holds beside the state and the staging: the most whose
// host slots (ActivationPlan::host_pack_bytes: under micro_batch one per
// layer with a host pack) grow by no more than the room. None on the CPU
// device, whose device tier is that RAM already.
int64_t host_packs_that_fit(const Config& cfg, const MachineCapacity& capacity, PlacementPlan& plan) {
  const ActivationPlan& a = plan.activations;
  if (cfg.run.auto_host_packs <= 0 || capacity.device_is_host) return 0;
  int64_t n = std::min(cfg.run.auto_host_packs, a.packs() - a.keep_device_packs);
  if (capacity.host_bytes < 0 || n <= 0) return std::max<int64_t>(0, n);
  // Pinned RAM the OS cannot page: auto's headroom (placement.headroom) is
  // kept free whatever places the state.
  plan.staging = staging_needs(plan);
  const double keep = 1.0 - cfg.placement.headroom;
  const int64_t room = int64_t(double(capacity.host_bytes) * keep) - plan.total()[size_t(Tier::kHost)];  // staging in
  ActivationPlan t = a;
  t.keep_host_packs = 0;
  const int64_t base = t.host_pack_bytes();  // the inputs kept there with cpu_checkpointing
  auto grows = [&](int64_t h) {
    t.keep_host_packs = h;
    return t.host_pack_bytes() - base;
  };
  if (grows(n) <= room) return n;
  // The largest count that fits: the slots grow with the count
  // (ActivationPlan::host_keeps).
  int64_t lo = 0, hi = n;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    (grows(mid) <= room ? lo : hi) = mid;
  }
  return lo;
}

// Where the packs keep their entries, in words: "entries in host RAM for 3
// layers (spread), on the device for the last 1 layer, 4 layers recomputed".
std::string placement_in_words(const ActivationPlan& a) {
  std::string s;
  if (a.keep_host_packs > 0) s += "entries in host RAM for " + packs_in_words(a.keep_host_packs, a.micro) + " (spread)";
  if (a.keep_device_packs > 0) {
    s += s.empty() ? "entries on the device for the last " : ", on the device for the last ";
    s += packs_in_words(a.keep_device_packs, a.micro);
    if (a.lent_packs > 0) s += " (" + packs_in_words(a.lent_packs, a.micro) + " in gradient homes)";
  }
  if (s.empty()) return "every layer recomputed";
  if (a.recomputed_packs() == 0) return s + ", none recomputed";
  return s + ", " + packs_in_words(a.recomputed_packs(), a.micro) + " recomputed";
}

std::string auto_choice(const PlacementPlan& plan) {
  const ActivationPlan& a = plan.activations;
  if (a.keep_host_packs == 0) {
    if (a.cpu_checkpointing) return "auto: cpu_checkpointing offloads the layers' inputs; every layer recomputed";
    if (a.keep_device_packs == a.packs()) {
      if (a.lent_packs == 0) return "auto: every layer's entries fit on the device";
      return "auto: every layer's entries fit on the device (" + packs_in_words(a.lent_packs, a.micro) +
             " in gradient homes)";
    }
    if (a.keep_device_packs == 0) return "auto: no layer's entries fit on the device; every layer recomputed";
  }
  return "auto: " + placement_in_words(a);
}

// run.recompute (Note [Activation placement] in memory/placement.h): which
// layers keep their entries for the backward instead of their input alone.
// Entries hold no weights, so any placement of the state allows any choice.
void resolve_recompute(const Config& cfg, const MachineCapacity& capacity, PlacementPlan& plan) {
  ActivationPlan& a = plan.activations;
  const int64_t packs = a.packs();
  a.keep_device_packs = a.keep_host_packs = 0;
  lendable_homes(cfg, plan);
  if (cfg.run.keep_device_layers >= 0) {  // run.activations (checked against the layers by the config)
    for (auto [key, v] : {std::pair{"keep_device_micro_batches", cfg.run.keep_device_micro},
                          std::pair{"keep_host_micro_batches", cfg.run.keep_host_micro}}) {
      if (v >= a.micro) {
        throw ConfigError(std::string("run.activations.") + key,
                          strprintf("is %lld, not fewer than the step's %lld micro-batches: count whole layers in "
                                    "keep_%s_layers",
                                    (long long)v, (long long)a.micro, key[5] == 'd' ? "device" : "host"));
      }
    }
    a.keep_device_packs = cfg.run.keep_device_layers * a.micro + cfg.run.keep_device_micro;
    a.keep_host_packs = cfg.run.keep_host_layers * a.micro + cfg.run.keep_host_micro;
    if (a.keep_device_packs + a.keep_host_packs > packs) {
      throw ConfigError("run.activations", strprintf("keeps %lld layers' and micro-batches' entries, more than the "
                                                     "model's %lld layers of %lld micro-batches",
                                                     (long long)(a.keep_device_packs + a.keep_host_packs),
                                                     (long long)a.checkpoint_layers, (long long)a.micro));
    }
    a.lent_packs = a.packs_that_lend(a.keep_device_packs);
    a.recompute_choice = "run.activations: " + placement_in_words(a);
  } else switch (cfg.run.recompute) {
    case Recompute::kAlways:
      a.recompute_choice = "always: every layer recomputed from its input";
      break;
    case Recompute::kNever:
      if (a.cpu_checkpointing) {
        a.keep_host_packs = packs;
        a.recompute_choice = "never: every layer's entries in host RAM (cpu_checkpointing)";
      } else {
        a.keep_device_packs = packs;
        a.recompute_choice = "never: every layer's entries on the device";
      }
      break;
    case Recompute::kAuto:
      a.keep_device_packs = device_packs_that_fit(cfg, capacity, plan);
      a.keep_host_packs = host_packs_that_fit(cfg, capacity, plan);
      a.lent_packs = a.packs_that_lend(a.keep_device_packs);
      a.recompute_choice = auto_choice(plan);
      break;
  }
  a.lent_packs = a.packs_that_lend(a.keep_device_packs);
  activation_rows(plan);
  // Kept entries take the device from the window (host ones its two slots).
  if (a.keep_device_packs > 0 || a.keep_host_packs > 0) cap_window(cfg, capacity, plan);
}

}  // namespace

// run.schedule auto without rates (Note [Step schedules] in
// memory/schedule.h): the layer schedule when there is more than one
// micro-batch, its plan fits the machine, and the activations it holds gave
// up nothing of micro_batch's plan (layer_gives_up: then it moves no more
// bytes on any link, and fewer where blocks are fetched or gradients land off
// the device). With rates, plan_for_machine chooses by the step's bound
// instead (plan/planner.h, choose_schedule_by_bound).
static PlacementPlan resolve_schedule(const Config& cfg, const StateLayout& layout, int64_t rank,
                                      const MachineCapacity& capacity) {
  std::optional<PlacementPlan> b;
  PlacementPlan a = schedule_candidates(
      cfg, capacity, [&](const Config& c) { return make_plan(c, layout, rank, capacity); }, &b);
  if (!b) return a;
  const std::string why = layer_gives_up(a, *b);
  if (!why.empty()) {
    a.step.choice = "micro_batch (" + why + ")";
    return a;
  }
  b->step.choice = "layer (fits with the same placement)";
  return *b;
}

PlacementPlan make_plan(const Config& cfg, const StateLayout& layout, int64_t rank,
                        const MachineCapacity& capacity) {
  if (cfg.run.schedule == StepSchedule::kAuto) return resolve_schedule(cfg, layout, rank, capacity);
  STRATA_CHECK(layout.world_size() == shard_count(cfg) &&
                   (!layout.has_frozen() || layout.frozen_world_size() == frozen_shard_count(cfg)),
               "the layout's shards are not the config's");
  STRATA_CHECK(rank >= 0 && rank < std::max<int64_t>(1, cfg.world_size), "rank out of range");
  PlacementPlan plan;
  plan.world_size = int(cfg.world_size);
  plan.stage = int(cfg.zero.stage);
  if (cfg.model.is_moe()) {  // Note [Load balancing] in model/experts.cc
    plan.step_sums = 4;
    plan.expert_load_sums = cfg.model.n_layers * cfg.model.moe.num_experts;
  }
  plan.shards = layout.world_size();
  plan.frozen_shards = layout.has_frozen() ? layout.frozen_world_size() : 1;
  plan.rank = int(rank);
  plan.ranks_per_node = std::max(1, capacity.ranks_per_node);
  plan.device_addressable = capacity.device_addressable;
  plan.step.set(cfg.run.schedule, cfg.gradient_accumulation_steps);
  const bool gloo = comm_backend(cfg) == CommBackend::kGloo;
  plan.comm.staged = plan.world_size > 1 && !plan.device_addressable && gloo;
  plan.comm.grad_bytes = compute_dtype_bytes(cfg.comm.data_type);
  plan.gathered_numel = layout.total_numel();
  // The working copy: fp32 or 16-bit; LoRA's adapters always fp32 (Note [LoRA
  // layers] in model/layer_ops.cc), beside frozen values in the compute dtype.
  const int compute = compute_bytes(cfg);
  const int int16_bytes = layout.has_frozen() ? 4 : compute;
  const int moment_bytes = cfg.run.optimizer_state_dtype == MomentDtype::kBf16 ? 2 : 4;  // Note [bf16 state]
  plan.state.elem_bytes = {int16_bytes, 4, 4, moment_bytes, moment_bytes, compute};
  // Every rank owns equally sized shards (shard r of every block), so the
  // plans of all ranks are the same.
  std::array<std::vector<PlacementUnit>, kNumCategories> units;
  cut_units(cfg, layout, plan, units);
  if (!cfg.run.checkpoint.dir.empty() && cfg.run.checkpoint.every > 0 && cfg.run.checkpoint.snapshot_gb > 0) {
    // Only periodic saves ride on training. No more than this rank's saves
    // hold: its saved categories' elements (replicated state: its share of
    // the chunks, a world-th, rounded up by one chunk of each category),
    // each range (a block's chunk of at most 2^24 elements) 4 KiB aligned.
    const int64_t chunk = int64_t(1) << 24;
    const int64_t ranges = 3 * (int64_t(layout.num_blocks()) + plan.state.shard_space_numel / chunk + 1);
    const int64_t world = plan.shards == 1 ? std::max<int64_t>(1, cfg.world_size) : 1;
    const double elems = std::min(double(plan.state.shard_space_numel),
                                  double(plan.state.shard_space_numel) / double(world) + double(chunk));
    const double most = elems * (4 + 2 * moment_bytes) + double(ranges) * 4096;
    const double want = std::min(cfg.run.checkpoint.snapshot_gb * 1e9, most);
    plan.save_snapshot_bytes = (int64_t(want) + 4095) / 4096 * 4096;
  }
  const StateIntent intent = state_intent(cfg, plan.state.shard_space_numel);
  plan.state.source = intent.source;
  plan.state.nvme_paths = intent.nvme_paths;
  plan.optimizer.pipeline_depth = pipeline_depth(intent.optimizer_buffers);
  std::array<TierSplit, kNumCategories> split = requested_split(cfg, layout, plan, intent);
  estimate_transients(cfg, layout, plan);
  if (!cfg.placement.auto_place) {
    for (int c = 0; c < kNumCategories; ++c) assign(units[size_t(c)], split[size_t(c)], space_numel(plan, c));
  } else {
    split = fill_auto(cfg, capacity, plan, units);
  }
  // A unit of no elements (a block without a part of that kind) has no
  // home to move: it stays on the device.
  for (auto& us : units) {
    for (PlacementUnit& u : us) {
      if (u.numel == 0) u.tier = Tier::kDevice;
    }
  }
  plan.state.split = split;
  plan.state.units = std::move(units);
  for (int c = 0; c < kNumCategories; ++c) {
    for (const PlacementUnit& u : plan.state.units[size_t(c)]) {
      plan.state.bytes[size_t(c)][size_t(u.tier)] += u.numel * plan.state.elem_bytes[size_t(c)];
    }
  }
  cap_window(cfg, capacity, plan);
  resolve_recompute(cfg, capacity, plan);
  choose_swap_paths(cfg, plan);
  plan.staging = staging_needs(plan);
  choose_secondary_shard(cfg, capacity, plan);
  choose_kept_gathered(cfg, capacity, plan);
  choose_gradient_reduction(cfg, capacity, plan);
  resolve_speculation(cfg, capacity, plan);
  return plan;
}

}  // namespace strata
