#include "memory/placement.h"

#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>

#include "memory/bound.h"
#include "cpu_adam/grad_ops.h"
#include "memory/device.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"

namespace strata {

const char* tier_name(Tier t) {
  switch (t) {
    case Tier::kDevice: return "device";
    case Tier::kHost: return "host";
    case Tier::kNvme: return "nvme";
  }
  return "?";
}

const char* category_name(Category c) {
  switch (c) {
    case Category::kParam16: return "param16";
    case Category::kGrad: return "grad";
    case Category::kMaster: return "master";
    case Category::kExpAvg: return "exp_avg";
    case Category::kExpAvgSq: return "exp_avg_sq";
  }
  return "?";
}

int64_t device_of(const std::string& path) {
  std::string p = path;
  while (!path_exists(p) && p != "/" && p != ".") p = parent_dir(p);
  struct stat st;
  if (::stat(p.c_str(), &st) != 0) return -1;
  return int64_t(st.st_dev);
}

int64_t free_bytes_under(std::string path) {
  while (!path_exists(path) && path != "/" && path != ".") path = parent_dir(path);
  struct statvfs st;
  if (::statvfs(path.c_str(), &st) != 0) return -1;
  return int64_t(st.f_bavail) * int64_t(st.f_frsize);
}

namespace {

TierSplit on(Tier t) {
  TierSplit s{0.0, 0.0, 0.0};
  (t == Tier::kDevice ? s.device : t == Tier::kHost ? s.host : s.nvme) = 1.0;
  return s;
}

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

std::optional<Tier> range_tier(const PlacementPlan& plan, Category c, int64_t offset, int64_t numel) {
  std::optional<Tier> tier;
  for (const PlacementUnit& u : plan.units[size_t(c)]) {
    if (u.offset + u.numel <= offset || u.offset >= offset + numel) continue;
    if (tier.has_value() && *tier != u.tier) return std::nullopt;
    tier = u.tier;
  }
  return tier;
}

std::unique_ptr<ParamWindow> make_param_window(const PlacementPlan& plan) {
  const auto& units = plan.units[size_t(Category::kParam16)];
  std::vector<char> fetched(units.size());
  for (size_t b = 0; b < units.size(); ++b) fetched[b] = units[b].tier != Tier::kDevice;
  return std::make_unique<ParamWindow>(plan.block_numel, fetched, plan.window_knobs, plan.window_cap_bytes,
                                       plan.compute_bytes);
}

std::vector<StepOp> plan_train_schedule(const PlacementPlan& plan) {
  return train_schedule(plan.schedule, int(plan.block_numel.size()), plan.tied, plan.accum);
}

namespace {
WindowShape window_shape(const PlacementPlan& plan) {
  const int n = int(plan.block_numel.size());
  const std::vector<StepOp> train = plan_train_schedule(plan);
  const std::vector<StepOp> eval = eval_schedule(n, plan.tied);
  return make_param_window(plan)->plan({&train, &eval});
}
}  // namespace

int64_t pipeline_piece_numel(const PlacementPlan& plan) {
  return std::min({plan.sub_group_numel, plan.shard_space_numel, kPipelineChunkElems});
}

bool optimizer_overlaps(const Config& cfg, const PlacementPlan& plan) {
  switch (cfg.run.overlap_optimizer) {
    case OptimizerOverlap::kOn: return true;
    case OptimizerOverlap::kOff: return false;
    case OptimizerOverlap::kAuto: break;
  }
  if (!plan.device_addressable) return true;
  for (Category c : {Category::kMaster, Category::kExpAvg, Category::kExpAvgSq}) {
    for (const PlacementUnit& u : plan.units[size_t(c)]) {
      if (u.tier == Tier::kNvme && u.numel > 0) return false;
    }
  }
  return true;
}

std::vector<PlacementUnit> pipeline_pieces(const PlacementPlan& plan) {
  const int64_t chunk = pipeline_piece_numel(plan);
  std::vector<PlacementUnit> out;
  for (const PlacementUnit& g : plan.units[size_t(Category::kMaster)]) {
    for (int64_t o = 0; o < g.numel; o += chunk) out.push_back({g.offset + o, std::min(chunk, g.numel - o), g.tier});
  }
  return out;
}

StagingNeeds staging_needs(const PlacementPlan& plan) {
  StagingNeeds n;
  const int64_t largest = plan.largest_block_numel;
  auto off_device = [&](Category c) {
    for (const PlacementUnit& u : plan.units[size_t(c)]) if (u.tier != Tier::kDevice) return true;
    return false;
  };
  auto on_nvme = [&](Category c) {
    for (const PlacementUnit& u : plan.units[size_t(c)]) if (u.tier == Tier::kNvme) return true;
    return false;
  };
  // Device: the parameter window for blocks whose weights are not on the
  // device, sized by a dry run of the training and evaluation schedules; the
  // gradient path's buffers (Note [Gradient path] in engine/gradient_path.h).
  n.window = window_shape(plan);
  n.gathered = n.window.bytes(plan.compute_bytes);
  const bool grads_off_device = off_device(Category::kGrad);
  // Under the layer schedule at one rank, a block's micro-batches are summed
  // in one block-sized buffer and land once (Note [Gradient path]).
  if (plan.layer_major() && plan.world_size <= 1 && plan.accum > 1 && grads_off_device) n.grad_accum = largest * 4;
  // (The CPU device lays gradients out in the landing buffers themselves.)
  // With ranks: a stage per block's reduction, unless the step's sum is
  // reduced (PlacementPlan::reduce_per_step, the buffer grad_accum).
  n.grad_stage = plan.world_size > 1 ? (plan.reduce_per_step ? 0 : largest * 4)
                 : plan.tied || (grads_off_device && !plan.device_addressable && n.grad_accum == 0) ? largest * 4 : 0;
  const int64_t blocks = int64_t(plan.block_numel.size());
  n.grad_norms = blocks * 8;
  if (!plan.device_addressable) {
    n.grad_norms += (plan.largest_block_shard_numel + cpu_adam::kNormChunk - 1) / cpu_adam::kNormChunk * 8;
  }
  int64_t landing = 0;
  const std::vector<PlacementUnit>& grads = plan.units[size_t(Category::kGrad)];
  for (size_t b = 0; b < grads.size(); ++b) {
    if (grads[b].tier != Tier::kDevice) landing = std::max(landing, grads[b].numel * grad_wire_bytes(plan, b));
  }
  n.grad_host = 2 * landing;
  n.grad_rmw = on_nvme(Category::kGrad) ? plan.largest_block_shard_numel * 4 : 0;
  if (!plan.device_addressable && on_nvme(Category::kParam16)) {
    n.window_bounce = n.gathered;  // one bounce buffer per slot and for the persistent blocks
  }
  n.tokens = plan.token_bytes;
  bool saved_on_device = false;
  for (Category c : {Category::kMaster, Category::kExpAvg, Category::kExpAvgSq}) {
    saved_on_device |= plan.bytes[size_t(c)][size_t(Tier::kDevice)] > 0;
  }
  if (!plan.device_addressable && saved_on_device) n.save_bounce = kSaveBounceBytes;
  n.save_snapshot = plan.save_snapshot_bytes;
  if (plan.shards > 1 && plan.stage == 3) {
    n.gather = (2 * (plan.tied ? 2 : 1) * largest + plan.kept_gathered_numel) * plan.compute_bytes;
  } else if (plan.shards > 1) {
    n.gather = plan.gathered_numel * plan.compute_bytes;
  }
  if (plan.comm_staged) n.comm_host = 2 * int64_t(plan.world_size) * kStagedPieceBytes;
  if (plan.reduce_per_step) n.grad_accum = plan.gathered_numel * 4;
  if (plan.secondary_shard) {
    for (size_t b = 0; b < plan.block_numel.size(); ++b) {
      if (plan.keep_gathered.empty() || !plan.keep_gathered[b]) {
        n.secondary += plan.block_numel[b] * plan.nodes() * plan.compute_bytes;
      }
    }
  }
  if (plan.world_size > 1) {
    n.grad_sync = n.grad_stage + (plan.stage >= 2 ? 2 * plan.largest_block_shard_numel * 4 : 0);
    if (plan.comm_grad_bytes < 4) {
      n.grad_sync += 2 * (largest + (plan.stage >= 2 ? plan.largest_block_shard_numel : 0)) * plan.comm_grad_bytes;
    }
  }
  if (plan.cpu_checkpointing) {
    n.ckpt_device = std::min<int64_t>(2, plan.held_micro * plan.checkpoint_layers) * plan.checkpoint_bytes;
    n.ckpt_host = plan.held_micro * plan.checkpoint_layers * plan.checkpoint_bytes;
  }
  // Host: per sub-group, what is not resident in one piece is staged, a
  // pipeline piece at a time (Note [Pipeline pieces]); on a device host code
  // may not touch, device-tier parts of pieces CPU Adam updates too.
  const int64_t group = pipeline_piece_numel(plan);
  auto staged = [&](Category c, const PlacementUnit& g) {
    const std::optional<Tier> t = range_tier(plan, c, g.offset, g.numel);
    return !t.has_value() || *t == Tier::kNvme || (!plan.device_addressable && *t == Tier::kDevice);
  };
  bool grad_staged = false, emit_staged = false, state_staged = false;
  for (const PlacementUnit& g : plan.units[size_t(Category::kMaster)]) {
    if (device_adam_piece(plan, g)) continue;
    grad_staged |= staged(Category::kGrad, g);
    emit_staged |= staged(Category::kParam16, g);
    for (Category c : {Category::kMaster, Category::kExpAvg, Category::kExpAvgSq}) state_staged |= staged(c, g);
  }
  // Note [Optimizer pipeline]: with staging, `pipeline_depth` sets of it let
  // sub-group j+1 be read while j is updated and j-1 written back.
  n.opt_sets = grad_staged || state_staged || emit_staged ? plan.pipeline_depth : 0;
  n.opt_grad = grad_staged ? n.opt_sets * group * 4 : 0;
  const int64_t state_elem_bytes = plan.elem_bytes[size_t(Category::kMaster)] +
                                   plan.elem_bytes[size_t(Category::kExpAvg)] +
                                   plan.elem_bytes[size_t(Category::kExpAvgSq)];
  n.opt_state = state_staged ? n.opt_sets * group * state_elem_bytes : 0;
  n.opt_emit = emit_staged ? n.opt_sets * group * plan.compute_bytes : 0;
  return n;
}

int grad_wire_bytes(const PlacementPlan& plan, size_t b) {
  if (plan.world_size > 1 || plan.compute_bytes == 4 || (plan.tied && b == 0)) return 4;
  if (plan.layer_major() && plan.accum > 1) return 4;  // the micro-batches' fp32 sum lands
  return plan.compute_bytes;
}

bool device_adam_piece(const PlacementPlan& plan, const PlacementUnit& piece) {
  if (plan.device_addressable) return false;
  for (Category c : {Category::kParam16, Category::kGrad, Category::kMaster, Category::kExpAvg, Category::kExpAvgSq}) {
    const std::optional<Tier> t = range_tier(plan, c, piece.offset, piece.numel);
    if (!t.has_value() || *t != Tier::kDevice) return false;
  }
  return true;
}

int64_t shard_count(const Config& cfg) { return cfg.zero.stage == 0 ? 1 : cfg.world_size; }

MachineCapacity measure_capacity(const Config& cfg, const std::vector<std::string>& nvme_paths,
                                 int local_ranks, int gpu) {
  MachineCapacity m;
  local_ranks = std::max(1, local_ranks);
  m.ranks_per_node = local_ranks;
  m.device_is_host = cfg.run.device == DeviceKind::kCpu;
  const std::string device = device_kind_name(cfg.run.device);
  m.device_addressable = m.device_is_host;
  m.host_bytes = cpu_device().memory_info().free_bytes;  // MemAvailable
  if (m.host_bytes > 0) m.host_bytes /= local_ranks;
  if (cfg.run.device_memory_mb > 0) {
    m.device_bytes = cfg.run.device_memory_mb << 20;
    m.device_source = "run.device_memory_mb";
  } else if (m.device_is_host) {
    m.device_bytes = -1;  // no budget: the device tier is host memory
  }
  if (!m.device_is_host) {
    // Each local rank has a GPU of its own: no division; more local ranks
    // than GPUs (Gloo shares them round-robin, cli/train/session.cc: local rank r
    // takes GPU r mod gpus) divide a GPU's free memory among the ranks on it.
    DeviceMemoryInfo info;
    std::string name = device;
    int64_t sharing = 1;
    const int gpus = cuda_device_count();
    if (cfg.run.device == DeviceKind::kCuda && gpus > 0) {
      const int g = std::max(0, gpu) % gpus;
      name = "cuda:" + std::to_string(g);
      if (local_ranks > gpus) sharing = (local_ranks - g + gpus - 1) / gpus;
    }
    if (query_device_memory(name, &info)) {
      info.free_bytes /= sharing;
      const std::string measured = strprintf("%s: %s free of %s%s", name.c_str(),
                                             format_bytes(double(info.free_bytes)).c_str(),
                                             format_bytes(double(info.total_bytes)).c_str(),
                                             sharing > 1 ? strprintf(", shared by %lld ranks", (long long)sharing).c_str() : "");
      if (m.device_bytes < 0 || info.free_bytes < m.device_bytes) {
        m.device_source = m.device_bytes < 0 ? measured : measured + " (less than run.device_memory_mb)";
        m.device_bytes = info.free_bytes;
      } else {
        m.device_source = "run.device_memory_mb (" + measured + ")";
      }
    } else if (m.device_bytes < 0) {
      m.device_source = std::string("not measured: ") +
                        (built_with_cuda() ? "no " + device + " on this machine"
                                           : "this build has no CUDA path") +
                        " (set run.device_memory_mb to plan for one)";
    }
  }
  // Several swap directories on one file system share its free space.
  std::vector<int64_t> seen;
  for (const std::string& p : nvme_paths) {
    const int64_t dev = device_of(p);
    if (std::find(seen.begin(), seen.end(), dev) != seen.end()) continue;
    seen.push_back(dev);
    const int64_t free = free_bytes_under(p);
    if (free >= 0) m.nvme_bytes = std::max<int64_t>(m.nvme_bytes, 0) + free;
  }
  if (m.nvme_bytes > 0) m.nvme_bytes /= local_ranks;
  return m;
}

std::array<int64_t, kNumTiers> PlacementPlan::state_total() const {
  std::array<int64_t, kNumTiers> t{};
  for (int c = 0; c < kNumCategories; ++c)
    for (int k = 0; k < kNumTiers; ++k) t[size_t(k)] += bytes[size_t(c)][size_t(k)];
  return t;
}

std::array<int64_t, kNumTiers> PlacementPlan::total() const {
  std::array<int64_t, kNumTiers> t = state_total();
  t[size_t(Tier::kDevice)] += activation_bytes;
  t[size_t(Tier::kDevice)] += staging.device_bytes();
  t[size_t(Tier::kHost)] += staging.host_bytes();
  t[size_t(Tier::kNvme)] += nvme_spare_bytes;
  return t;
}

int64_t PlacementPlan::category_total(Category c) const {
  int64_t s = 0;
  for (int64_t b : bytes[size_t(c)]) s += b;
  return s;
}

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
    plan.largest_block_shard_numel = std::max(plan.largest_block_shard_numel, b.shard_numel());
  }
  plan.shard_space_numel = offset;
  plan.sub_group_numel = std::max<int64_t>(
      kShardAlignElems, (cfg.zero.sub_group_size + kShardAlignElems - 1) / kShardAlignElems * kShardAlignElems);
  std::vector<PlacementUnit> group_units;
  for (int64_t o = 0; o < plan.shard_space_numel; o += plan.sub_group_numel) {
    group_units.push_back({o, std::min(plan.sub_group_numel, plan.shard_space_numel - o), Tier::kDevice});
  }
  for (int c = 0; c < kNumCategories; ++c) units[size_t(c)] = c <= int(Category::kGrad) ? block_units : group_units;
}

// The split each category asks for: DeepSpeed's offload keys, overridden per
// category by the placement section. Sets plan.source.
std::array<TierSplit, kNumCategories> requested_splits(const Config& cfg, PlacementPlan& plan) {
  const OffloadOptimizerConfig& oo = cfg.zero.offload_optimizer;
  const OffloadParamConfig& op = cfg.zero.offload_param;
  TierSplit optimizer = on(Tier::kDevice), grad = on(Tier::kDevice), param16 = on(Tier::kDevice);
  plan.source = "default";
  if (oo.device != "none") {
    plan.source = "deepspeed";
    const Tier t = oo.device == "cpu" ? Tier::kHost : Tier::kNvme;
    optimizer = TierSplit{1.0 - oo.ratio, t == Tier::kHost ? oo.ratio : 0.0, t == Tier::kNvme ? oo.ratio : 0.0};
    // DeepSpeed keeps the gradients of offloaded optimizer state in host memory
    // (they feed the CPU Adam), also when that state lives on NVMe.
    grad = TierSplit{1.0 - oo.ratio, oo.ratio, 0.0};
  }
  if (op.device == "cpu") {
    plan.source = "deepspeed";
    param16 = on(Tier::kHost);
  } else if (op.device == "nvme") {
    plan.source = "deepspeed";
    // max_in_cpu elements of parameters are kept in host memory, the rest on NVMe.
    const double in_cpu = std::min(1.0, double(op.max_in_cpu) / double(std::max<int64_t>(1, plan.shard_space_numel)));
    param16 = TierSplit{0.0, in_cpu, 1.0 - in_cpu};
  }
  std::array<TierSplit, kNumCategories> split = {param16, grad, optimizer, optimizer, optimizer};
  const PlacementConfig& pc = cfg.placement;
  if (pc.has_param16) split[0] = pc.param16;
  if (pc.has_grad) split[1] = pc.grad;
  if (pc.has_master) split[2] = pc.master;
  if (pc.has_exp_avg) split[3] = pc.exp_avg;
  if (pc.has_exp_avg_sq) split[4] = pc.exp_avg_sq;
  if (pc.has_param16 || pc.has_grad || pc.has_master || pc.has_exp_avg || pc.has_exp_avg_sq) {
    plan.source = "placement";
  }
  return split;
}

// Activations and the inputs of staging_needs (needed by auto, reported by all).
void estimate_transients(const Config& cfg, const StateLayout& layout, PlacementPlan& plan) {
  const ModelConfig& m = cfg.model;
  const int64_t tokens = cfg.train_micro_batch_size_per_gpu * m.seq_len;
  const int64_t cb = compute_bytes(cfg);
  // Saved block inputs (the embedding's are the int64 tokens) plus the
  // autograd graph of one recomputed layer: about 10 x dim + 4 x ffn values per
  // token, and attention scores (heads x seq per token) when the attention
  // kernel materialises them; and the fp32 logits with their gradient.
  plan.checkpoint_bytes = tokens * m.dim * cb;
  plan.checkpoint_layers = m.n_layers;
  plan.cpu_checkpointing = cfg.activation_checkpointing.cpu_checkpointing;
  // Note [Step schedules]: the layer schedule holds A micro-batches' saved
  // inputs per layer, the A gradients of the current block's outputs between
  // blocks, and with a tied head the A head gradients of the embedding
  // until its backward; micro_batch one micro-batch's of each (the gradient
  // of the output and the head's share are then part of the op's own).
  plan.accum = cfg.gradient_accumulation_steps;
  const int64_t held = held_micro_batches(plan.schedule, plan.accum);
  plan.held_micro = held;
  plan.checkpoint_activation_bytes =
      held * (tokens * 8 + (plan.cpu_checkpointing ? 0 : plan.checkpoint_layers * plan.checkpoint_bytes));
  plan.held_output_grad_bytes = held > 1 ? held * plan.checkpoint_bytes : 0;
  plan.held_tied_grad_bytes = held > 1 && m.tie_embeddings ? held * m.vocab_size * m.dim * cb : 0;
  const int64_t layer = tokens * (6 * m.dim + 4 * m.q_dim() + 4 * m.ffn_dim()) * cb + 3 * tokens * m.n_heads * m.seq_len * 4;
  const int64_t head = 3 * tokens * m.vocab_size * 4;
  const int64_t held_grads = plan.held_output_grad_bytes + plan.held_tied_grad_bytes;
  plan.activation_bytes = plan.checkpoint_activation_bytes + held_grads + std::max(layer, head);
  // Keeping the forward's graphs (run.recompute never): every layer's graph
  // (which holds its input) and the head's, at once; for every micro-batch
  // held.
  plan.graph_extra_bytes =
      std::max<int64_t>(0, held * (tokens * 8 + m.n_layers * layer) + held_grads + head - plan.activation_bytes);
  int64_t largest_block = 0;
  for (const BlockLayout& b : layout.blocks()) largest_block = std::max(largest_block, b.padded_numel);
  plan.largest_block_numel = largest_block;
  for (const BlockLayout& b : layout.blocks()) plan.block_numel.push_back(b.shard_numel());
  plan.token_bytes = std::max<int64_t>(plan.accum, 1) * cfg.train_micro_batch_size_per_gpu * (m.seq_len + 1) * 8;
  plan.window_knobs.prefetch_numel = cfg.zero.stage3_prefetch_bucket_size;
  plan.window_knobs.max_live_numel = cfg.zero.stage3_max_live_parameters;
  plan.window_knobs.persistence_numel = cfg.zero.stage3_param_persistence_threshold;
  plan.compute_bytes = int(cb);
  plan.pipeline_depth = pipeline_depth(cfg.zero.offload_optimizer.buffer_count);
  plan.tied = m.tie_embeddings;
}

// "auto": fills the fastest tiers first; returns the split that was reached.
std::array<TierSplit, kNumCategories> fill_auto(const Config& cfg, const MachineCapacity& capacity,
                                                PlacementPlan& plan,
                                                std::array<std::vector<PlacementUnit>, kNumCategories>& units) {
  const PlacementConfig& pc = cfg.placement;
  std::array<TierSplit, kNumCategories> split;
  // param16 (every forward and backward), then grad (every backward), then
  // optimizer state (once per step), whole units at a time: a unit goes to
  // the device if it fits whole in what is left of the device budget, else
  // to the host likewise, else to NVMe (on a GPU, optimizer state goes to the
  // device a whole sub-group at a time, see below). With CPU compute the device tier is
  // host memory, so the two share one budget. The staging buffers that what
  // lands off the device needs are reserved and the fill redone until the
  // reserve stops changing.
  plan.source = "auto";
  const double keep = 1.0 - pc.headroom;
  const int64_t kUnlimited = std::numeric_limits<int64_t>::max() / 4;
  auto budget = [&](int64_t cap) { return cap < 0 ? kUnlimited : int64_t(double(cap) * keep); };
  int64_t reserve_device = 0, reserve_host = 0;
  plan.window_cap_bytes = 0;  // the window at its minimum while filling; widened below
  for (int pass = 0; pass < 4; ++pass) {
    int64_t dev_left, host_left;
    const int64_t act_dev = plan.activation_bytes;
    if (capacity.device_is_host) {
      // One pool of host RAM: the device budget (if one is set) is carved
      // from it, and everything else, staging included, comes out of it too.
      const int64_t pool = budget(capacity.host_bytes) - plan.activation_bytes - reserve_device - reserve_host;
      dev_left = capacity.device_bytes >= 0
                     ? std::min(budget(capacity.device_bytes) - act_dev - reserve_device, pool)
                     : pool;
      host_left = pool - dev_left;
    } else {
      dev_left = budget(capacity.device_bytes) - act_dev - reserve_device;
      host_left = budget(capacity.host_bytes) - reserve_host;
    }
    auto place = [&](int c, PlacementUnit& u, bool device_ok) {
      const int64_t bytes = u.numel * plan.elem_bytes[size_t(c)];
      if (device_ok && bytes <= dev_left) {
        u.tier = Tier::kDevice;
        dev_left -= bytes;
      } else if (bytes <= host_left) {
        u.tier = Tier::kHost;
        host_left -= bytes;
      } else {
        u.tier = Tier::kNvme;
      }
    };
    const int first_optimizer = int(Category::kMaster);
    std::vector<int> order = pc.auto_order;
    if (order.empty()) order = {0, 1, 2, 3, 4};
    for (int c : order) {
      if (!capacity.device_is_host && c >= first_optimizer) continue;
      for (PlacementUnit& u : units[size_t(c)]) place(c, u, true);
    }
    if (!capacity.device_is_host) {
      // On a GPU, CPU Adam cannot update device memory in place: a sub-group's
      // optimizer state goes to the device only whole (master and both
      // moments) and only where its gradient and working copy are there too,
      // so that the GPU's Adam updates it (device_adam_piece); otherwise a
      // device-tier part would cross PCIe twice a step.
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
        for (int c = first_optimizer; c < kNumCategories; ++c) {
          const PlacementUnit& u = units[size_t(c)].at(i);
          STRATA_CHECK(u.offset == master[i].offset && u.numel == master[i].numel,
                       "optimizer categories cut into different sub-groups");
          bytes += u.numel * plan.elem_bytes[size_t(c)];
        }
        const int64_t lo = master[i].offset, hi = lo + master[i].numel;
        device_group[i] = bytes <= dev_left && on_device(Category::kParam16, lo, hi) && on_device(Category::kGrad, lo, hi);
        if (pc.auto_device_groups >= 0 &&
            std::count(device_group.begin(), device_group.end(), 1) > pc.auto_device_groups) {
          device_group[i] = 0;
        }
        if (device_group[i]) dev_left -= bytes;
      }
      // The rest category by category, as on CPU.
      for (int c : order) {
        if (c < first_optimizer) continue;
        for (size_t i = 0; i < master.size(); ++i) {
          if (device_group[i]) {
            units[size_t(c)][i].tier = Tier::kDevice;
          } else {
            place(c, units[size_t(c)][i], false);
          }
        }
      }
    }
    plan.units = units;
    const StagingNeeds need = staging_needs(plan);
    if (need.device_bytes() == reserve_device && need.host_bytes() == reserve_host) break;
    reserve_device = need.device_bytes();
    reserve_host = need.host_bytes();
  }
  // Report the split that was reached.
  for (int c = 0; c < kNumCategories; ++c) {
    std::array<double, kNumTiers> b{};
    for (const PlacementUnit& u : units[size_t(c)]) b[size_t(u.tier)] += double(u.numel);
    const double total = double(plan.shard_space_numel);
    split[size_t(c)] = TierSplit{b[0] / total, b[1] / total, b[2] / total};
  }
  return split;
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
      left -= plan.bytes[size_t(c)][size_t(Tier::kDevice)];
      if (shared) left -= plan.bytes[size_t(c)][size_t(Tier::kHost)];
    }
    left -= plan.activation_bytes + other.grad_stage + other.grad_norms + other.ckpt_device + other.grad_accum +
            other.tokens;
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
  const OffloadOptimizerConfig& oo = cfg.zero.offload_optimizer;
  const OffloadParamConfig& op = cfg.zero.offload_param;
  const PlacementConfig& pc = cfg.placement;
  const bool params_on_nvme = plan.bytes[0][2] > 0 || plan.bytes[1][2] > 0;
  const bool optimizer_on_nvme = plan.bytes[2][2] > 0 || plan.bytes[3][2] > 0 || plan.bytes[4][2] > 0;
  // Swap directories: the placement section's, else every directory the two
  // offload sections name (the store stripes all state over all of them).
  plan.nvme_paths = pc.nvme_path;
  if (plan.nvme_paths.empty()) {
    for (const auto* list : {&oo.nvme_path, &op.nvme_path}) {
      for (const std::string& d : *list) {
        if (std::find(plan.nvme_paths.begin(), plan.nvme_paths.end(), d) == plan.nvme_paths.end()) {
          plan.nvme_paths.push_back(d);
        }
      }
    }
  }
  if ((params_on_nvme || optimizer_on_nvme) && plan.nvme_paths.empty()) {
    throw ConfigError("placement.nvme_path", "state is placed on nvme but no swap directory is given");
  }
  if (params_on_nvme && op.device == "nvme" && op.buffer_size < plan.largest_block_shard_numel) {
    // DeepSpeed asserts deep in a step when a parameter buffer cannot hold the
    // largest block; here it is refused before anything is allocated.
    throw ConfigError("zero_optimization.offload_param.buffer_size",
                      strprintf("%lld elements cannot hold the largest block shard (%lld elements); "
                                "raise it to at least %lld",
                                (long long)op.buffer_size, (long long)plan.largest_block_shard_numel,
                                (long long)plan.largest_block_shard_numel));
  }
}

// run.recompute (Note [Recompute] in engine/trainer.h). Kept graphs refer to
// the weights by address, so the weights must stay where they are for the
// whole step: the working copy resident on the device (no parameter window),
// or gathered once per step (stages 1-2 with several shards). Stage 3 with
// several shards gathers into a ring of two uses: never.
void resolve_recompute(const Config& cfg, const MachineCapacity& capacity, PlacementPlan& plan) {
  const Recompute mode = cfg.run.recompute;
  const auto& p16 = plan.bytes[size_t(Category::kParam16)];
  const bool gathered_once = plan.shards > 1 && plan.stage < 3;
  const bool stable = gathered_once || (plan.shards == 1 && p16[size_t(Tier::kHost)] == 0 &&
                                        p16[size_t(Tier::kNvme)] == 0);
  plan.keep_graphs = false;
  if (mode == Recompute::kAlways) return;
  if (mode == Recompute::kNever) {
    if (plan.cpu_checkpointing) {
      throw ConfigError("run.recompute", "never keeps every layer's activations on the device, which "
                                         "activation_checkpointing.cpu_checkpointing offloads; use one of the two");
    }
    if (!stable) {
      throw ConfigError("run.recompute",
                        "never keeps the forward's autograd graphs, whose weights must stay in place for the "
                        "whole step: it needs the working copy (param16) resident on the device, or ZeRO stage "
                        "1-2 with several ranks; use always or auto");
    }
    plan.keep_graphs = true;
  } else {
    // auto: when the activations of every layer fit in what the state, the
    // staging and the recompute's activations leave of the device.
    if (!stable || plan.cpu_checkpointing) return;
    if (plan.window_cap_bytes >= 0) {
      plan.keep_graphs = plan.window_cap_bytes >= plan.graph_extra_bytes;
    } else if (capacity.device_is_host && capacity.host_bytes >= 0) {
      // No device budget on CPU: the graphs come out of host RAM with the rest.
      const auto t = plan.total();
      const double keep = cfg.placement.auto_place ? 1.0 - cfg.placement.headroom : 1.0;
      plan.keep_graphs = t[size_t(Tier::kDevice)] + t[size_t(Tier::kHost)] + plan.graph_extra_bytes <=
                         int64_t(double(capacity.host_bytes) * keep);
    } else {
      plan.keep_graphs = true;
    }
  }
  if (plan.keep_graphs) {
    plan.activation_bytes += plan.graph_extra_bytes;
    cap_window(cfg, capacity, plan);
  }
}

}  // namespace

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
  const std::string& want = cfg.comm.secondary_shard;
  plan.secondary_shard = false;
  if (plan.stage != 3 || plan.shards <= 1 || plan.ranks_per_node <= 1 || plan.nodes() <= 1 || want == "off") return;
  take_if_fits(cfg, capacity, plan, plan.secondary_shard, want == "auto");
}

// comm.keep_gathered: at stage 3 with ranks, blocks kept gathered for the
// step, from the last one down (auto: while they fit; all; none). A kept
// block needs no secondary shard: it costs its gathered bytes less that.
void choose_kept_gathered(const Config& cfg, const MachineCapacity& capacity, PlacementPlan& plan) {
  const std::string& want = cfg.comm.keep_gathered;
  const size_t blocks = plan.block_numel.size();
  plan.keep_gathered.assign(blocks, 0);
  plan.kept_gathered_numel = 0;
  if (plan.stage != 3 || plan.shards <= 1 || want == "none") return;
  // A number keeps that many blocks, from the last one down, whatever fits.
  const bool counted = !want.empty() && want.find_first_not_of("0123456789") == std::string::npos;
  int64_t left = counted ? std::stoll(want) : int64_t(blocks);
  int64_t room = want == "all" || counted ? -1 : room_left(cfg, capacity, plan);
  for (size_t i = blocks; i-- > 0 && left > 0;) {
    const int64_t padded = plan.block_numel[i] * plan.shards;
    const int64_t bytes = (padded - (plan.secondary_shard ? plan.block_numel[i] * plan.nodes() : 0)) * plan.compute_bytes;
    if (room >= 0 && bytes > room) continue;
    if (room >= 0) room -= bytes;
    plan.keep_gathered[i] = 1;
    plan.kept_gathered_numel += padded;
    --left;
  }
  // Every block kept: no later gather, no secondary shard.
  if (plan.kept_gathered_numel == plan.gathered_numel) plan.secondary_shard = false;
  plan.staging = staging_needs(plan);
}

// comm.gradient_reduction: per_step needs a whole-model fp32 gradient on the
// device; auto takes it when the plan still fits with it (always where the
// device tier has no budget), only with ranks and accumulation.
void choose_gradient_reduction(const Config& cfg, const MachineCapacity& capacity, PlacementPlan& plan) {
  const std::string& want = cfg.comm.gradient_reduction;
  // The layer schedule reduces each block once per step anyway, from a block-sized sum.
  if (plan.world_size <= 1 || plan.accum <= 1 || want == "per_micro_batch" || plan.layer_major()) return;
  take_if_fits(cfg, capacity, plan, plan.reduce_per_step, want == "auto");
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
    a.schedule_choice = "micro_batch (one micro-batch: the two schedules are one order)";
    return a;
  }
  try {
    *layer = make(ly);
  } catch (const ConfigError& e) {
    a.schedule_choice = std::string("micro_batch (layer refused: ") + e.what() + ")";
    return a;
  }
  if (!plan_shortfalls(**layer, capacity).empty()) {
    layer->reset();
    a.schedule_choice = "micro_batch (layer does not fit: it holds the activations of every micro-batch)";
  }
  return a;
}

// What the layer schedule's plan b gives up against micro_batch's plan a:
// empty when it places every byte of state on the same tier and keeps every
// device-memory choice micro_batch's plan made (kept graphs, blocks kept
// gathered, the secondary shard); else why not.
std::string layer_gives_up(const PlacementPlan& a, const PlacementPlan& b) {
  if (b.bytes != a.bytes) return "layer's held activations would move state to a slower tier";
  if (a.keep_graphs && !b.keep_graphs) return "layer's held activations leave no room to keep the graphs";
  if (a.secondary_shard && !b.secondary_shard) return "layer's held activations leave no room for the secondary shard";
  auto kept = [](const PlacementPlan& p) { return std::count(p.keep_gathered.begin(), p.keep_gathered.end(), 1); };
  if (kept(b) < kept(a)) return "layer's held activations leave room to keep fewer blocks gathered";
  return "";
}

// optimizer.speculate (Note [Speculative optimizer] in
// engine/optimizer_pass.h). It needs the layer schedule (or one
// micro-batch), the optimizer's thread and a piece CPU Adam updates. Pieces
// whose master weights and moments are all on NVMe speculate into alternate
// swap slots where the disk has room for a second copy of them (`cap`;
// unknown counts as room); otherwise by two passes, which read their state
// twice. auto leaves it off where it costs more than it hides: on the CPU
// device (Adam and the compute share the cores, and the commit pass adds
// memory traffic) and with optimizer state on NVMe that has no room for its
// slots (the commit would read it a second time).
static void resolve_speculation(const Config& cfg, const MachineCapacity& cap, PlacementPlan& plan) {
  const Speculate want = cfg.optimizer.speculate;
  plan.speculate = false;
  plan.speculate_slots = false;
  plan.nvme_spare_bytes = 0;
  if (want == Speculate::kOff) {
    plan.speculate_choice = "off";
    return;
  }
  if (!plan.layer_major() && plan.accum > 1) {
    // A block's gradient is final only in the last micro-batch's backward:
    // the speculation would have an A-th of the backward to hide in.
    if (want == Speculate::kOn && cfg.run.schedule == StepSchedule::kMicroBatch) {
      throw ConfigError("optimizer.speculate", "on needs run.schedule \"layer\" (or auto) with several "
                                               "micro-batches: under micro_batch a block's gradient is final only "
                                               "in the last micro-batch's backward");
    }
    plan.speculate_choice = "off (micro_batch with several micro-batches: gradients are final only at the last)";
    return;
  }
  if (!optimizer_overlaps(cfg, plan)) {
    if (want == Speculate::kOn) {
      throw ConfigError("optimizer.speculate", "on needs the optimizer on its own thread, which "
                                               "run.overlap_optimizer turns off here; set it true");
    }
    plan.speculate_choice = "off (the optimizer runs inline: run.overlap_optimizer)";
    return;
  }
  bool cpu_piece = false;
  for (const PlacementUnit& piece : pipeline_pieces(plan)) cpu_piece |= !device_adam_piece(plan, piece);
  if (!cpu_piece) {
    plan.speculate_choice = "off (every piece is updated by the device's Adam after the verdict)";
    return;
  }
  // Note [Alternate swap slots]: a second home on disk for every NVMe unit
  // of master weights and moments.
  int64_t spare = 0;  // the sub-groups whose master weights and moments are all on NVMe
  const int64_t state_bytes = plan.elem_bytes[size_t(Category::kMaster)] +
                              plan.elem_bytes[size_t(Category::kExpAvg)] + plan.elem_bytes[size_t(Category::kExpAvgSq)];
  for (const PlacementUnit& u : plan.units[size_t(Category::kMaster)]) {
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
      plan.speculate_choice = "off (the CPU device: Adam shares the cores with the compute; \"on\" to force)";
      return;
    }
    if (spare > 0 && !room) {
      plan.speculate_choice =
          "off (optimizer state on NVMe, " + no_slots + ": the commit would read it twice; \"on\" to force)";
      return;
    }
  }
  plan.speculate = true;
  plan.speculate_choice = want == Speculate::kOn ? "on" : "on (auto)";
  if (room) {
    plan.speculate_slots = true;
    plan.nvme_spare_bytes = spare;
  } else if (spare > 0) {
    plan.speculate_choice += " (NVMe state by two passes, read twice: " + no_slots + ")";
  }
}

int64_t speculated_numel(const PlacementPlan& plan) {
  if (!plan.speculate) return 0;
  int64_t n = 0;
  for (const PlacementUnit& piece : pipeline_pieces(plan)) {
    if (!device_adam_piece(plan, piece)) n += piece.numel;
  }
  return n;
}

bool optimizer_state_on_nvme(const PlacementPlan& plan, int64_t offset, int64_t numel) {
  for (Category c : {Category::kMaster, Category::kExpAvg, Category::kExpAvgSq}) {
    if (range_tier(plan, c, offset, numel) != Tier::kNvme) return false;
  }
  return true;
}

bool speculates_in_slots(const PlacementPlan& plan, const PlacementUnit& piece) {
  if (!plan.speculate || !plan.speculate_slots || device_adam_piece(plan, piece)) return false;
  return optimizer_state_on_nvme(plan, piece.offset, piece.numel);
}

int64_t speculated_slot_numel(const PlacementPlan& plan) {
  int64_t n = 0;
  for (const PlacementUnit& piece : pipeline_pieces(plan)) {
    if (speculates_in_slots(plan, piece)) n += piece.numel;
  }
  return n;
}

// run.schedule auto without rates (Note [Step schedules] in
// memory/schedule.h): the layer schedule when there is more than one
// micro-batch, its plan fits the machine, and the activations it holds gave
// up nothing of micro_batch's plan (layer_gives_up: then it moves no more
// bytes on any link, and fewer where blocks are fetched or gradients land off
// the device). With rates, plan_for_machine chooses by the step's bound
// instead (memory/bound.h, choose_schedule_by_bound).
static PlacementPlan resolve_schedule(const Config& cfg, const StateLayout& layout, int64_t rank,
                                      const MachineCapacity& capacity) {
  std::optional<PlacementPlan> b;
  PlacementPlan a = schedule_candidates(
      cfg, capacity, [&](const Config& c) { return make_plan(c, layout, rank, capacity); }, &b);
  if (!b) return a;
  const std::string why = layer_gives_up(a, *b);
  if (!why.empty()) {
    a.schedule_choice = "micro_batch (" + why + ")";
    return a;
  }
  b->schedule_choice = "layer (fits with the same placement)";
  return *b;
}

PlacementPlan make_plan(const Config& cfg, const StateLayout& layout, int64_t rank,
                        const MachineCapacity& capacity) {
  if (cfg.run.schedule == StepSchedule::kAuto) return resolve_schedule(cfg, layout, rank, capacity);
  STRATA_CHECK(layout.world_size() == shard_count(cfg), "the layout's shards are not the config's");
  STRATA_CHECK(rank >= 0 && rank < std::max<int64_t>(1, cfg.world_size), "rank out of range");
  PlacementPlan plan;
  plan.world_size = int(cfg.world_size);
  plan.stage = int(cfg.zero.stage);
  plan.shards = layout.world_size();
  plan.rank = int(rank);
  plan.ranks_per_node = std::max(1, capacity.ranks_per_node);
  plan.device_addressable = capacity.device_addressable;
  plan.schedule = cfg.run.schedule;
  const bool gloo = cfg.comm.backend == "gloo" || (cfg.comm.backend == "auto" && cfg.run.device != DeviceKind::kCuda);
  plan.comm_staged = plan.world_size > 1 && !plan.device_addressable && gloo;
  plan.comm_grad_bytes = cfg.comm.data_type == "fp32" ? 4 : 2;
  plan.gathered_numel = layout.total_numel();
  const int int16_bytes = compute_bytes(cfg);  // the working copy: fp32 or 16-bit
  const int moment_bytes = cfg.run.optimizer_state_dtype == "bf16" ? 2 : 4;  // Note [bf16 state]
  plan.elem_bytes = {int16_bytes, 4, 4, moment_bytes, moment_bytes};
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
    const int64_t ranges = 3 * (int64_t(layout.num_blocks()) + plan.shard_space_numel / chunk + 1);
    const int64_t world = plan.shards == 1 ? std::max<int64_t>(1, cfg.world_size) : 1;
    const double elems = std::min(double(plan.shard_space_numel),
                                  double(plan.shard_space_numel) / double(world) + double(chunk));
    const double most = elems * (4 + 2 * moment_bytes) + double(ranges) * 4096;
    const double want = std::min(cfg.run.checkpoint.snapshot_gb * 1e9, most);
    plan.save_snapshot_bytes = (int64_t(want) + 4095) / 4096 * 4096;
  }
  std::array<TierSplit, kNumCategories> split = requested_splits(cfg, plan);
  estimate_transients(cfg, layout, plan);
  if (!cfg.placement.auto_place) {
    for (int c = 0; c < kNumCategories; ++c) assign(units[size_t(c)], split[size_t(c)], plan.shard_space_numel);
  } else {
    split = fill_auto(cfg, capacity, plan, units);
  }
  plan.split = split;
  plan.units = std::move(units);
  for (int c = 0; c < kNumCategories; ++c) {
    for (const PlacementUnit& u : plan.units[size_t(c)]) {
      plan.bytes[size_t(c)][size_t(u.tier)] += u.numel * plan.elem_bytes[size_t(c)];
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
  MachineCapacity cap = measure(first.nvme_paths);
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
  if (!cfg.placement.auto_place) return judged(first.nvme_paths.empty() ? first : make_plan(cfg, layout, rank, cap));
  if (rates != nullptr && cfg.placement.by_bound) return judged(choose_by_bound(cfg, layout, rank, cap, *rates));
  return judged(make_plan(cfg, layout, rank, cap));
}

std::vector<std::string> plan_shortfalls(const PlacementPlan& plan, const MachineCapacity& cap) {
  std::vector<std::string> out;
  const auto t = plan.total();
  auto check = [&](Tier tier, int64_t need, int64_t have, const std::string& advice) {
    if (have >= 0 && need > have) {
      out.push_back(strprintf("%s: short by %s (needs %s, has %s); %s", tier_name(tier),
                              format_bytes(double(need - have)).c_str(), format_bytes(double(need)).c_str(),
                              format_bytes(double(have)).c_str(), advice.c_str()));
    }
  };
  // Note [Step schedules]: what the layer schedule's held activations add.
  std::string layer;
  if (plan.layer_major() && plan.held_micro > 1) {
    layer = strprintf("; the layer schedule holds the activations of %lld micro-batches (saved inputs %s, "
                      "output gradients %s, tied head gradients %s): set "
                      "activation_checkpointing.cpu_checkpointing, lower train_micro_batch_size_per_gpu, or set "
                      "run.schedule \"micro_batch\"",
                      (long long)plan.held_micro, format_bytes(double(plan.checkpoint_activation_bytes)).c_str(),
                      format_bytes(double(plan.held_output_grad_bytes)).c_str(),
                      format_bytes(double(plan.held_tied_grad_bytes)).c_str());
  }
  check(Tier::kDevice, t[0], cap.device_bytes,
        "move state off the device (zero_optimization.offload_optimizer / offload_param, or a placement "
        "split with less on device), lower train_micro_batch_size_per_gpu, or raise run.device_memory_mb" + layer);
  int64_t host_need = t[1];
  if (cap.device_is_host && cap.device_bytes >= 0) host_need += std::min<int64_t>(t[0], cap.device_bytes);
  else if (cap.device_is_host) host_need += t[0];
  check(Tier::kHost, host_need, cap.host_bytes,
        "move state to nvme (offload_optimizer.device \"nvme\" or a placement split), or lower "
        "zero_optimization.sub_group_size to shrink the optimizer staging buffers" +
            (cap.device_is_host || plan.cpu_checkpointing ? layer : std::string()));
  check(Tier::kNvme, t[2], cap.nvme_bytes, "free disk space under the nvme_path directories or add more");
  return out;
}

}  // namespace strata
