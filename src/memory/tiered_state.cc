#include "memory/tiered_state.h"

#include <algorithm>
#include <cstring>

#include "util/errors.h"
#include "util/logging.h"
#include "util/trace.h"

namespace strata {

namespace {
constexpr int64_t kSwapBlockBytes = 4096;  // swap checksum/alignment unit: one page
int64_t round_up(int64_t v, int64_t q) { return (v + q - 1) / q * q; }
}  // namespace

bool crosses_pcie(Category c) {
  return c == Category::kParam16 || c == Category::kGrad || c == Category::kFrozen;
}

namespace {
// Note [Alternate swap slots]: the categories whose NVMe homes have two.
bool slotted(Category c) { return c == Category::kMaster || c == Category::kExpAvg || c == Category::kExpAvgSq; }

// The arenas' sizes: every resident unit, each rounded to a page; the host
// units of the categories that cross PCIe apart; NVMe's in swap blocks (two
// homes where a unit has alternate slots).
struct ArenaSizes {
  std::array<int64_t, kNumTiers> tier{};
  int64_t transfer = 0;
  int64_t nvme = 0;
};

ArenaSizes arena_sizes(const PlacementPlan& plan) {
  ArenaSizes a;
  for (int c = 0; c < kNumCategories; ++c) {
    for (const PlacementUnit& u : plan.state.units[size_t(c)]) {
      const int64_t bytes = round_up(u.numel * plan.state.elem_bytes[size_t(c)], kPageBytes);
      a.tier[size_t(u.tier)] += bytes;
      const bool slots = plan.optimizer.speculate_slots && slotted(Category(c)) && optimizer_state_on_nvme(plan, u.offset, u.numel);
      if (u.tier == Tier::kNvme) a.nvme += round_up(bytes, kSwapBlockBytes) * (slots ? 2 : 1);
      if (u.tier == Tier::kHost && crosses_pcie(Category(c))) a.transfer += bytes;
    }
  }
  return a;
}

// The swap store of `nvme_bytes` under the plan's directories, after
// removing what killed runs left there (Note [Swap directory layout]).
std::unique_ptr<nvme::SwapStore> open_swap(const PlacementPlan& plan, const TieredStateOptions& options,
                                           nvme::IoEngine& engine, int64_t nvme_bytes) {
  for (const std::string& dir : plan.state.nvme_paths) {
    for (const nvme::ReclaimedSwap& r : nvme::reclaim_abandoned_swap(dir)) {
      log::warn("removed %s (%s), the swap directory of a run that is gone", r.path.c_str(),
                format_bytes(double(r.bytes)).c_str());
    }
  }
  nvme::SwapOptions so;
  so.rank = plan.rank;
  so.dirs = plan.state.nvme_paths;
  so.capacity_bytes = nvme_bytes;
  so.block_bytes = kSwapBlockBytes;
  so.stripe_bytes = std::max<int64_t>(kSwapBlockBytes, int64_t(16) << 20);
  so.checksums = options.checksums;
  so.keep_files = options.keep_swap_files;
  return std::make_unique<nvme::SwapStore>(engine, so);
}

}  // namespace

bool TieredState::has_slots(Category c, const PlacementUnit& u) const {
  return plan_.optimizer.speculate_slots && slotted(c) && optimizer_state_on_nvme(plan_, u.offset, u.numel);
}

TieredState::TieredState(const PlacementPlan& plan, const TieredStateOptions& options)
    : plan_(plan), device_(options.device != nullptr ? options.device : &cpu_device()) {
  const ArenaSizes sizes = arena_sizes(plan_);
  const std::array<int64_t, kNumTiers>& need = sizes.tier;
  const int64_t transfer_bytes = sizes.transfer;
  if (options.device_budget_bytes >= 0 &&
      need[0] + options.device_transient_bytes > options.device_budget_bytes) {
    throw OutOfMemoryError(strprintf(
        "device tier: %s of resident state + %s of transient buffers exceeds the budget of %s "
        "(run.device_memory_mb); move state off the device in the placement",
        format_bytes(double(need[0])).c_str(), format_bytes(double(options.device_transient_bytes)).c_str(),
        format_bytes(double(options.device_budget_bytes)).c_str()));
  }
  device_arena_ = device_->allocate(need[0], "device tier (resident state)");
  // Device memory comes uninitialised (a GPU's): resident moments must start
  // at zero and padding must read as zero. The CPU device's is zeroed already.
  if (!device_->host_addressable()) {
    device_->fill_on_device(device_arena_.ptr(), 0, device_arena_.bytes(), Stream::kCompute);
    device_->synchronize(Stream::kCompute);
  }
  // Note [Host arenas].
  host_transfer_arena_ = device_->allocate_pinned(transfer_bytes, "host tier: 16-bit parameters and gradients");
  host_arena_ = HostBuffer(size_t(need[1] - transfer_bytes), "host tier: optimizer state");
  if (sizes.nvme > 0) {
    engine_ = std::make_unique<nvme::IoEngine>(options.engine);
    swap_ = open_swap(plan_, options, *engine_, sizes.nvme);
  }
  std::array<int64_t, kNumTiers> used{};
  int64_t transfer_used = 0;
  int64_t flags = 0;
  slot_chunk_ = pipeline_piece_numel(plan_);
  for (int c = 0; c < kNumCategories; ++c) {
    for (size_t i = 0; i < plan_.state.units[size_t(c)].size(); ++i) {
      const PlacementUnit& u = plan_.state.units[size_t(c)][i];
      Home h;
      h.offset = u.offset;
      h.numel = u.numel;
      h.tier = u.tier;
      const int64_t bytes = u.numel * plan_.state.elem_bytes[size_t(c)];
      if (u.tier == Tier::kNvme) {
        h.region = swap_->add_region(strprintf("%s.%zu", category_name(Category(c)), i), bytes);
        if (has_slots(Category(c), u)) {  // Note [Alternate swap slots]
          h.spare = swap_->add_region(strprintf("%s.%zu.spare", category_name(Category(c)), i), bytes);
          h.first_flag = flags;
          flags += (u.numel + slot_chunk_ - 1) / slot_chunk_;
        }
      } else {
        if (u.tier == Tier::kHost && crosses_pcie(Category(c))) {
          h.ptr = host_transfer_arena_.data() + transfer_used;
          transfer_used += round_up(bytes, kPageBytes);
        } else {
          std::byte* arena = u.tier == Tier::kDevice ? device_arena_.ptr().raw() : host_arena_.as<std::byte>();
          h.ptr = arena + used[size_t(u.tier)];
          used[size_t(u.tier)] += round_up(bytes, kPageBytes);
        }
      }
      homes_[size_t(c)].push_back(h);
    }
  }
  if (flags > 0) {
    slot_flags_ = std::make_unique<std::atomic<uint8_t>[]>(size_t(flags));
    for (int64_t i = 0; i < flags; ++i) slot_flags_[size_t(i)].store(0, std::memory_order_relaxed);
  }
}

int64_t TieredState::allocated_bytes(Category c) const {
  int64_t bytes = 0;
  for (const Home& h : homes_[size_t(c)]) {
    bytes += h.tier == Tier::kNvme ? swap_->region_bytes(h.region) : h.numel * elem_bytes(c);
  }
  return bytes;
}

TieredState::~TieredState() = default;

Tier TieredState::tier_of(Category c, int64_t offset) const {
  const auto& homes = homes_[size_t(c)];
  auto it = std::upper_bound(homes.begin(), homes.end(), offset,
                             [](int64_t o, const Home& h) { return o < h.offset; });
  STRATA_CHECK(it != homes.begin(), "offset before the first unit");
  return std::prev(it)->tier;
}

const std::byte* TieredState::find_resident(Category c, int64_t offset, int64_t numel, Tier* tier) const {
  const auto& homes = homes_[size_t(c)];
  auto it = std::upper_bound(homes.begin(), homes.end(), offset,
                             [](int64_t o, const Home& h) { return o < h.offset; });
  if (it == homes.begin()) return nullptr;
  --it;
  const Home& first = *it;
  if (first.tier == Tier::kNvme) return nullptr;
  // A range may span consecutive units of one tier: a category's units are
  // carved from an arena in order, each a whole number of pages (Note
  // [Placement units]: multiples of 2048 elements), so they are contiguous.
  const int64_t eb = plan_.state.elem_bytes[size_t(c)];
  for (const Home* h = &*it; h->offset + h->numel < offset + numel;) {
    ++it;
    if (it == homes.end() || it->tier != first.tier || it->ptr != h->ptr + h->numel * eb) return nullptr;
    h = &*it;
  }
  *tier = first.tier;
  return first.ptr + (offset - first.offset) * eb;
}

std::byte* TieredState::resident(Category c, int64_t offset, int64_t numel) const {
  Tier tier = Tier::kNvme;
  const std::byte* p = find_resident(c, offset, numel, &tier);
  if (p == nullptr || (tier == Tier::kDevice && !device_->host_addressable())) return nullptr;
  return const_cast<std::byte*>(p);
}

DevicePtr TieredState::resident_on_device(Category c, int64_t offset, int64_t numel) const {
  Tier tier = Tier::kNvme;
  const std::byte* p = find_resident(c, offset, numel, &tier);
  if (p == nullptr || tier != Tier::kDevice) return DevicePtr();
  return DevicePtr(const_cast<std::byte*>(p));
}

// Calls fn(home, first element in home, numel of the piece, byte offset in the caller's buffer).
template <typename Fn>
void TieredState::for_each_piece(Category c, int64_t offset, int64_t numel, Fn&& fn) const {
  const auto& homes = homes_[size_t(c)];
  auto it = std::upper_bound(homes.begin(), homes.end(), offset,
                             [](int64_t o, const Home& h) { return o < h.offset; });
  STRATA_CHECK(it != homes.begin(), "range before the first unit");
  --it;
  const int64_t eb = plan_.state.elem_bytes[size_t(c)];
  int64_t pos = offset;
  const int64_t end = offset + numel;
  for (; pos < end; ++it) {
    STRATA_CHECK(it != homes.end(), "range past the last unit");
    const Home& h = *it;
    const int64_t n = std::min(end, h.offset + h.numel) - pos;
    fn(h, pos - h.offset, n, (pos - offset) * eb);
    pos += n;
  }
}

namespace {
thread_local LinkBytes* t_tally = nullptr;
}  // namespace

TieredState::TallyScope::TallyScope(LinkBytes* tally) : previous_(t_tally) { t_tally = tally; }
TieredState::TallyScope::~TallyScope() { t_tally = previous_; }

void TieredState::count(int link, int64_t bytes) {
  links_[size_t(link)] += bytes;
  if (t_tally != nullptr) {
    int64_t* f[4] = {&t_tally->h2d, &t_tally->d2h, &t_tally->nvme_read, &t_tally->nvme_write};
    *f[link] += bytes;
  }
}

namespace {
const char* kReadNames[kNumCategories] = {"read param16", "read grad", "read master", "read exp_avg",
                                          "read exp_avg_sq", "read frozen"};
const char* kWriteNames[kNumCategories] = {"write param16", "write grad", "write master",
                                           "write exp_avg", "write exp_avg_sq", "write frozen"};

// Waits for every one (swap handles, device completions), even after one
// failed, so that the store finishes each I/O (a failed write clears its
// blocks' written marks); empties `pending` and keeps the first error.
template <typename T>
void wait_each(std::vector<T>& pending, std::exception_ptr& first) {
  for (auto& p : pending) {
    try {
      p.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  pending.clear();
}

void wait_all_handles(std::vector<nvme::SwapHandle>& pending) {
  std::exception_ptr first;
  wait_each(pending, first);
  if (first) std::rethrow_exception(first);
}

}  // namespace

// Copies between homes and `buf` in direction `op`: resident pieces at once,
// NVMe pieces submitted with their handles appended to `pending`.
// Note [Alternate swap slots]: each run of chunks whose flags agree goes to
// one slot.
void TieredState::swap_io(nvme::IoOp op, const Home& h, int64_t eb, int64_t at, int64_t n, std::byte* mine,
                          PendingIo& pending, bool spare) {
  const bool reading = op == nvme::IoOp::kRead;
  auto submit = [&](nvme::RegionId region, int64_t from, int64_t count) {
    std::byte* p = mine + (from - at) * eb;
    pending.handles_.push_back(reading ? swap_->read(region, from * eb, count * eb, p, pending.checksum_threads_)
                                       : swap_->write(region, from * eb, count * eb, p, pending.checksum_threads_));
  };
  if (h.first_flag < 0) {
    STRATA_CHECK(!spare, "a spare-slot write to a home without one");
    submit(h.region, at, n);
    return;
  }
  auto slot_of = [&](int64_t chunk) {
    const bool other = slot_flags_[size_t(h.first_flag + chunk)].load(std::memory_order_acquire) != 0;
    return other != spare ? h.spare : h.region;
  };
  int64_t pos = at;
  const int64_t end = at + n;
  while (pos < end) {
    const int64_t chunk = pos / slot_chunk_;
    const nvme::RegionId region = slot_of(chunk);
    int64_t stop = std::min(end, (chunk + 1) * slot_chunk_);
    while (stop < end && slot_of(stop / slot_chunk_).index == region.index) stop = std::min(end, stop + slot_chunk_);
    submit(region, pos, stop - pos);
    pos = stop;
  }
}

bool TieredState::has_spare(Category c, int64_t offset, int64_t numel) const {
  if (!slot_flags_) return false;
  bool all = numel > 0;
  for_each_piece(c, offset, numel, [&](const Home& h, int64_t, int64_t, int64_t) {
    all &= h.tier == Tier::kNvme && h.first_flag >= 0;
  });
  return all;
}

Completion TieredState::write_spare_async(Category c, int64_t offset, int64_t numel, const void* buf,
                                          PendingIo& pending) {
  STRATA_CHECK(has_spare(c, offset, numel), "a spare-slot write outside the homes with two slots");
  transfer(nvme::IoOp::kWrite, c, offset, numel, static_cast<std::byte*>(const_cast<void*>(buf)), pending,
           nullptr, false, Stream::kStateD2H, /*spare=*/true);
  return pending.completion();
}

void TieredState::commit_spare(Category c, int64_t offset, int64_t numel) {
  STRATA_CHECK(has_spare(c, offset, numel), "a commit of spare slots outside the homes with two slots");
  for_each_piece(c, offset, numel, [&](const Home& h, int64_t at, int64_t n, int64_t) {
    STRATA_CHECK(at % slot_chunk_ == 0 && (n % slot_chunk_ == 0 || at + n == h.numel),
                 "a commit of spare slots that is not whole pipeline pieces");
    for (int64_t k = at / slot_chunk_; k * slot_chunk_ < at + n; ++k) {
      slot_flags_[size_t(h.first_flag + k)].fetch_xor(1, std::memory_order_acq_rel);
    }
  });
}

void TieredState::transfer(nvme::IoOp op, Category c, int64_t offset, int64_t numel, std::byte* buf,
                           PendingIo& pending, const Completion* device_after, bool compute_side, Stream d2h,
                           bool spare) {
  const bool reading = op == nvme::IoOp::kRead;
  TraceSpan span(tier_of(c, offset) == Tier::kNvme ? TraceTrack::kNvme : TraceTrack::kCopy,
                 reading ? kReadNames[int(c)] : kWriteNames[int(c)]);
  const int64_t eb = plan_.state.elem_bytes[size_t(c)];
  const size_t before = pending.handles_.size();
  const Stream copies = reading ? d2h : Stream::kStateH2D;
  bool device_copies = false;
  try {
    for_each_piece(c, offset, numel, [&](const Home& h, int64_t at, int64_t n, int64_t buf_off) {
      std::byte* mine = buf + buf_off;
      const int64_t bytes = n * eb;
      if (h.tier == Tier::kNvme) {
        swap_io(op, h, eb, at, n, mine, pending, spare);
        count(reading ? 2 : 3, bytes);
        if (compute_side && reading) count(0, bytes);  // and the H2D a GPU would make from its bounce buffer
      } else if (h.tier == Tier::kDevice) {
        // Through the device layer: a memcpy on the CPU device, a copy on
        // the D2H / H2D stream of a GPU, after the compute queued so far
        // (which may write the home a read takes, or read the home a write
        // replaces).
        if (!device_copies) {
          device_->stream_wait(copies, device_after != nullptr ? *device_after : device_->record(Stream::kCompute));
        }
        const DevicePtr home(h.ptr + at * eb);
        if (reading) {
          device_->copy_to_host(mine, home, bytes, copies);
        } else {
          device_->copy_to_device(home, mine, bytes, copies);
        }
        count(reading ? 1 : 0, bytes);  // crossed PCIe (docs/design.md, "Bytes per link")
        device_copies = true;
      } else {
        std::byte* home = h.ptr + at * eb;
        std::memcpy(reading ? mine : home, reading ? home : mine, size_t(bytes));
        // Host memory to host memory crosses no link, unless `buf` is the
        // compute side's (the CPU device's: what a GPU would copy H2D/D2H).
        if (compute_side) count(reading ? 0 : 1, bytes);
      }
    });
    // Device pieces complete with the group, like NVMe ones (on the CPU
    // device they already have).
    if (device_copies) {
      const Completion copied = device_->record(copies);
      if (copied.pending()) pending.device_.push_back(copied);
    }
  } catch (...) {
    // A submission refused mid-way: finish what this call submitted, report the refusal.
    std::vector<nvme::SwapHandle> submitted(
        std::make_move_iterator(pending.handles_.begin() + long(before)),
        std::make_move_iterator(pending.handles_.end()));
    pending.handles_.resize(before);
    try {
      wait_all_handles(submitted);
      if (device_copies) device_->synchronize(copies);
    } catch (...) {
    }
    throw;
  }
}

Completion TieredState::read_async(Category c, int64_t offset, int64_t numel, void* buf,
                                   PendingIo& pending, const Completion* device_after, Stream d2h) {
  transfer(nvme::IoOp::kRead, c, offset, numel, static_cast<std::byte*>(buf), pending, device_after, false, d2h);
  return pending.completion();
}

Completion TieredState::write_async(Category c, int64_t offset, int64_t numel, const void* buf,
                                    PendingIo& pending, const Completion* device_after) {
  // The swap store only reads `buf` for a write.
  transfer(nvme::IoOp::kWrite, c, offset, numel, static_cast<std::byte*>(const_cast<void*>(buf)), pending,
           device_after);
  return pending.completion();
}

Completion TieredState::read_to_device(Category c, int64_t offset, int64_t numel, DevicePtr dst,
                                      PendingIo& pending) {
  if (device_->host_addressable()) {
    transfer(nvme::IoOp::kRead, c, offset, numel, dst.raw(), pending, nullptr, /*compute_side=*/true);
    return pending.completion();
  }
  TraceSpan span(TraceTrack::kCopy, kReadNames[int(c)]);
  const int64_t eb = plan_.state.elem_bytes[size_t(c)];
  device_->stream_wait(Stream::kH2D, device_->record(Stream::kCompute));
  for_each_piece(c, offset, numel, [&](const Home& h, int64_t at, int64_t n, int64_t buf_off) {
    STRATA_CHECK(h.tier != Tier::kNvme, "read_to_device: an NVMe home needs a bounce buffer");
    const DevicePtr to = dst + buf_off;  // buf_off is in bytes
    if (h.tier == Tier::kDevice) {
      device_->copy_on_device(to, DevicePtr(h.ptr + at * eb), n * eb, Stream::kH2D);
    } else {
      device_->copy_to_device(to, h.ptr + at * eb, n * eb, Stream::kH2D);
      count(0, n * eb);
    }
  });
  return device_->record(Stream::kH2D);
}

void TieredState::read(Category c, int64_t offset, int64_t numel, void* buf) {
  read_async(c, offset, numel, buf, sync_).wait();
}

void TieredState::write(Category c, int64_t offset, int64_t numel, const void* buf) {
  write_async(c, offset, numel, buf, sync_).wait();
}

void PendingIo::wait_ticket(uint64_t ticket) {
  if (ticket != round_) return;  // an earlier round, waited for then
  ++round_;
  std::exception_ptr first;
  wait_each(device_, first);
  wait_each(handles_, first);
  if (first) std::rethrow_exception(first);
}

}  // namespace strata
