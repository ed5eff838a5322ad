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
    case Category::kFrozen: return "frozen";
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

std::optional<Tier> range_tier(const PlacementPlan& plan, Category c, int64_t offset, int64_t numel) {
  std::optional<Tier> tier;
  for (const PlacementUnit& u : plan.state.units[size_t(c)]) {
    if (u.offset + u.numel <= offset || u.offset >= offset + numel) continue;
    if (tier.has_value() && *tier != u.tier) return std::nullopt;
    tier = u.tier;
  }
  return tier;
}

std::unique_ptr<ParamWindow> make_param_window(const PlacementPlan& plan) {
  const auto& units = plan.state.units[size_t(Category::kParam16)];
  std::vector<char> fetched(units.size());
  for (size_t b = 0; b < units.size(); ++b) fetched[b] = units[b].tier != Tier::kDevice && units[b].numel > 0;
  return std::make_unique<ParamWindow>(plan.block_numel, fetched, plan.window_knobs, plan.window_cap_bytes,
                                       plan.state.elem_bytes[size_t(Category::kParam16)]);
}

std::unique_ptr<ParamWindow> make_frozen_window(const PlacementPlan& plan) {
  const auto& units = plan.state.units[size_t(Category::kFrozen)];
  if (units.empty()) return nullptr;
  std::vector<char> fetched(units.size());
  for (size_t b = 0; b < units.size(); ++b) fetched[b] = units[b].tier != Tier::kDevice && units[b].numel > 0;
  // One share of the device for both windows: the frozen one gets what the
  // trained one leaves of plan.window_cap_bytes (the current block always
  // gets a slot).
  int64_t cap = plan.window_cap_bytes;
  if (cap >= 0) {
    const std::vector<StepOp> train = plan_train_schedule(plan);
    const std::vector<StepOp> eval = eval_schedule(int(plan.block_numel.size()), plan.tied);
    const WindowShape trained = make_param_window(plan)->plan({&train, &eval});
    cap = std::max<int64_t>(0, cap - trained.bytes(plan.state.elem_bytes[size_t(Category::kParam16)]));
  }
  return std::make_unique<ParamWindow>(plan.frozen_block_numel, fetched, plan.window_knobs, cap,
                                       plan.state.elem_bytes[size_t(Category::kFrozen)]);
}

std::vector<StepOp> plan_train_schedule(const PlacementPlan& plan) {
  return train_schedule(plan.step.schedule, int(plan.block_numel.size()), plan.tied, plan.step.accum);
}

int64_t pipeline_piece_numel(const PlacementPlan& plan) {
  return std::min({plan.state.sub_group_numel, plan.state.shard_space_numel, kPipelineChunkElems});
}

bool optimizer_overlaps(const Config& cfg, const PlacementPlan& plan) {
  switch (cfg.run.overlap_optimizer) {
    case OptimizerOverlap::kOn: return true;
    case OptimizerOverlap::kOff: return false;
    case OptimizerOverlap::kAuto: break;
  }
  if (!plan.device_addressable) return true;
  for (Category c : {Category::kMaster, Category::kExpAvg, Category::kExpAvgSq}) {
    for (const PlacementUnit& u : plan.state.units[size_t(c)]) {
      if (u.tier == Tier::kNvme && u.numel > 0) return false;
    }
  }
  return true;
}

std::vector<PlacementUnit> pipeline_pieces(const PlacementPlan& plan) {
  const int64_t chunk = pipeline_piece_numel(plan);
  std::vector<PlacementUnit> out;
  for (const PlacementUnit& g : plan.state.units[size_t(Category::kMaster)]) {
    for (int64_t o = 0; o < g.numel; o += chunk) out.push_back({g.offset + o, std::min(chunk, g.numel - o), g.tier});
  }
  return out;
}

int grad_wire_bytes(const PlacementPlan& plan, size_t b) {
  if (plan.world_size > 1 || plan.param_bytes() == 4 || (plan.tied && b == 0)) return 4;
  if (plan.step.sums_each_block()) return 4;  // the micro-batches' fp32 sum lands
  return plan.param_bytes();
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
int64_t frozen_shard_count(const Config& cfg) { return cfg.zero.stage == 3 ? cfg.world_size : 1; }

std::array<int64_t, kNumTiers> StatePlacement::total() const {
  std::array<int64_t, kNumTiers> t{};
  for (int c = 0; c < kNumCategories; ++c)
    for (int k = 0; k < kNumTiers; ++k) t[size_t(k)] += bytes[size_t(c)][size_t(k)];
  return t;
}

std::array<int64_t, kNumTiers> PlacementPlan::total() const {
  std::array<int64_t, kNumTiers> t = state.total();
  t[size_t(Tier::kDevice)] += activations.bytes;
  t[size_t(Tier::kDevice)] += staging.device_bytes();
  t[size_t(Tier::kHost)] += staging.host_bytes();
  t[size_t(Tier::kNvme)] += optimizer.nvme_spare_bytes;
  return t;
}

int64_t StatePlacement::category_total(Category c) const {
  int64_t s = 0;
  for (int64_t b : bytes[size_t(c)]) s += b;
  return s;
}

int64_t speculated_numel(const PlacementPlan& plan) {
  if (!plan.optimizer.speculate) return 0;
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
  if (!plan.optimizer.speculate || !plan.optimizer.speculate_slots || device_adam_piece(plan, piece)) return false;
  return optimizer_state_on_nvme(plan, piece.offset, piece.numel);
}

int64_t speculated_slot_numel(const PlacementPlan& plan) {
  int64_t n = 0;
  for (const PlacementUnit& piece : pipeline_pieces(plan)) {
    if (speculates_in_slots(plan, piece)) n += piece.numel;
  }
  return n;
}

// Note [Activation placement] (placement.h): the host packs spread over the
// packs not kept on the device (R of them), in the forwards' order. Under
// layer that order is the packs' (u): the u-th is host-kept when
// ceil((u + 1) H / R) > ceil(u H / R), H of them, the first among them,
// never two apart by more than ceil(R / H). Under micro_batch each
// micro-batch's forward runs every layer: the host packs are the same k =
// ceil(H / micro) layers of every micro-batch, spread over the q = R / micro
// layers no micro-batch keeps on the device (floor(i q / k), i < k), the
// last of them host-kept only by the first H % micro micro-batches (all when
// 0); past q layers' worth, the first micro-batches of layer q. A layer's
// host slot serves its micro-batches in turn, so the slots are k: host RAM
// grows with H.
bool ActivationPlan::host_keeps(int64_t l, int64_t m) const {
  if (keep_host_packs <= 0 || device_keeps(l, m)) return false;
  const int64_t R = packs() - keep_device_packs, H = std::min(keep_host_packs, R);
  if (held > 1 || micro == 1) {
    const int64_t u = l * micro + m;
    auto before = [&](int64_t k) { return (k * H + R - 1) / R; };  // host packs among the first k
    return before(u + 1) > before(u);
  }
  const int64_t q = R / micro, k = (H + micro - 1) / micro, e = H % micro;
  if (k > q) return l < q || (l == q && m < H - q * micro);
  // l is in {floor(i q / k)} when i = ceil(l k / q) maps back to it.
  const int64_t i = (l * k + q - 1) / q;
  if (i >= k || i * q / k != l) return false;
  return e == 0 || m < e || i < k - 1;
}

// The packs' bytes. The link
// carries every host pack of the step; what is held at once is, under
// micro_batch (held == 1), the largest micro-batch's packs (its backward
// frees them before the next forward), under layer every micro-batch's.
int64_t ActivationPlan::host_link_bytes() const {
  int64_t n = 0;
  for (int64_t l = 0; l < checkpoint_layers; ++l) {
    for (int64_t m = 0; m < micro; ++m) n += on_host(l, m) ? saved_bytes(l, m) : 0;
  }
  return n;
}

int64_t ActivationPlan::device_pack_bytes() const {
  int64_t all = 0, largest = 0;
  for (int64_t m = 0; m < micro; ++m) {
    int64_t n = 0;
    for (int64_t l = 0; l < checkpoint_layers; ++l) n += on_host(l, m) || lent(l, m) ? 0 : saved_bytes(l, m);
    all += n;
    largest = std::max(largest, n);
  }
  return held > 1 ? all : largest;
}

int64_t ActivationPlan::host_slot_bytes(int64_t l) const {
  int64_t n = 0;
  for (int64_t m = 0; m < micro; ++m) n = std::max(n, on_host(l, m) ? saved_bytes(l, m) : 0);
  return n;
}

int64_t ActivationPlan::host_pack_bytes() const {
  if (held > 1) return host_link_bytes();
  int64_t n = 0;
  for (int64_t l = 0; l < checkpoint_layers; ++l) n += host_slot_bytes(l);
  return n;
}

int64_t ActivationPlan::largest_host_pack() const {
  int64_t n = 0;
  for (int64_t l = 0; l < checkpoint_layers; ++l) n = std::max(n, host_slot_bytes(l));
  return n;
}

int64_t ActivationPlan::host_packs_per_run() const {
  int64_t all = 0, largest = 0;
  for (int64_t m = 0; m < micro; ++m) {
    int64_t n = 0;
    for (int64_t l = 0; l < checkpoint_layers; ++l) n += on_host(l, m) ? 1 : 0;
    all += n;
    largest = std::max(largest, n);
  }
  return held > 1 ? all : largest;
}

int64_t ActivationPlan::packs_that_lend(int64_t device_packs) const {
  // The last k packs, the first of them at offset 0: pack u = P - k + j
  // ends at (j + 1) x stride, within its layer's limit. If k fit, k - 1 do
  // (each pack then lies a stride lower): the largest k by bisection.
  const int64_t P = packs();
  auto fits = [&](int64_t k) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t l = (P - k + j) / micro;
      if (size_t(l) >= lend_limit.size() || (j + 1) * lend_stride > lend_limit[size_t(l)]) return false;
    }
    return true;
  };
  if (lend_stride <= 0 || lend_limit.empty()) return 0;
  int64_t lo = 0, hi = std::min(device_packs, P);
  if (fits(hi)) return hi;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

size_t ActivationPlan::lent_blocks(const std::vector<int64_t>& block_bytes) const {
  const int64_t end = lent_packs * lend_stride;
  size_t b = 0;
  for (int64_t at = 0; at < end && b < block_bytes.size(); ++b) at += block_bytes[b];
  return b;
}

// A count of packs in words: "3 layers", "1 layer and 3 micro-batches", "1 micro-batch of a layer".
std::string packs_in_words(int64_t packs, int64_t micro) {
  const int64_t layers = packs / micro, rest = packs % micro;
  const std::string l = strprintf("%lld layer%s", (long long)layers, layers == 1 ? "" : "s");
  const std::string m = strprintf("%lld micro-batch%s", (long long)rest, rest == 1 ? "" : "es");
  if (rest == 0) return l;
  return layers == 0 ? m + " of a layer" : l + " and " + m;
}

}  // namespace strata
