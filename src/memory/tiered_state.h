// The training state placed on tiers: every placement unit of every category
// (memory/placement.h) has one home, a range of the device arena, of one of
// the two host arenas (Note [Host arenas]), or a region of the NVMe swap
// store. Callers copy ranges in and out of homes, or use a home in place:
// host code where resident() gives it one (host tier, or the device tier of
// the CPU device), kernels where resident_on_device() does. No LibTorch here.
// With CPU compute the device arena is host memory with a budget (DESIGN.md,
// Devices), so every path runs without a GPU.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "memory/buffer.h"
#include "memory/completion.h"
#include "memory/device.h"
#include "memory/placement.h"
#include "nvme/engine.h"
#include "nvme/swap_store.h"

namespace strata {

// Bytes moved per link since construction.
struct LinkBytes {
  int64_t h2d = 0;         // host tier -> compute side
  int64_t d2h = 0;         // compute side -> host tier
  int64_t nvme_read = 0;
  int64_t nvme_write = 0;
  LinkBytes& operator+=(const LinkBytes& o) {
    h2d += o.h2d;
    d2h += o.d2h;
    nvme_read += o.nvme_read;
    nvme_write += o.nvme_write;
    return *this;
  }
};

// Note [Host arenas]
// The host tier is two arenas. Host-tier 16-bit parameters and gradients
// cross PCIe every step (fetched to the device for compute, written back from
// the backward), so they live in transfer memory registered with the device
// (pinned on CUDA): their copies are DMA, and the parameter window's fetches
// overlap compute. Master weights and moments stay in plain pageable memory:
// CPU Adam updates them in place and they never cross PCIe whole (only the
// 16-bit parameters Adam emits do), and pinning them is how DeepSpeed runs out
// of host memory (REFERENCE.md).
bool crosses_pcie(Category c);

struct TieredStateOptions {
  nvme::EngineOptions engine;     // from the aio section
  bool checksums = true;          // CRC-32C per swap block, verified on read
  bool keep_swap_files = false;
  // Bytes of transient device buffers the caller will allocate on top of the
  // resident units (gathered blocks, staging); counted against the budget.
  int64_t device_transient_bytes = 0;
  int64_t device_budget_bytes = -1;  // < 0: no budget
  // The device whose memory is the device tier (nullptr: the CPU device).
  // It must outlive the state.
  Device* device = nullptr;
};

// Swap I/O in flight for a group of asynchronous reads/writes: the storage
// behind their Completion. Reused from step to step (waiting keeps capacity):
// no allocation once grown. It must not move while a completion of it is
// pending (owners size their arrays of them at start-up).
class PendingIo final : public Waiter {
 public:
  bool empty() const { return handles_.empty() && device_.empty(); }
  // The threads that checksum this group's swap reads and writes (Note
  // [Parallel checksums] in nvme/swap_store.h); nullptr: the calling thread.
  // It must outlive the group's transfers.
  void set_checksum_threads(const nvme::ParallelFor* threads) { checksum_threads_ = threads; }
  // The completion of everything added since the group was last waited for.
  // A completion of an earlier round returns at once.
  Completion completion() { return empty() ? Completion() : Completion(this, round_); }
  // Waits for every transfer (all of them, even after one failed), empties
  // the group and rethrows the first error.
  void wait_ticket(uint64_t ticket) override;
  // True when every NVMe transfer added has finished and no device copy is
  // in the group (never blocks; wait() still verifies and reports them).
  bool done() const {
    if (!device_.empty()) return false;
    for (const nvme::SwapHandle& h : handles_) {
      if (!h.done()) return false;
    }
    return true;
  }

 private:
  friend class TieredState;
  std::vector<nvme::SwapHandle> handles_;
  std::vector<Completion> device_;  // device-tier copies (kStateH2D/kStateD2H)
  const nvme::ParallelFor* checksum_threads_ = nullptr;
  uint64_t round_ = 0;
};

// Thread-safety: read_async/write_async/wait/resident/links may be called
// from two threads at once for disjoint ranges and their own PendingIo (the
// trainer's optimizer thread and its compute thread); read()/write() and the
// rest from one thread only.
class TieredState {
 public:
  // Allocates the device and host arenas and, when the plan places anything
  // on NVMe, creates the swap store under plan.state.nvme_paths. Throws
  // OutOfMemoryError when the device units and transients exceed the
  // budget, IoError for swap directory problems.
  TieredState(const PlacementPlan& plan, const TieredStateOptions& options);
  ~TieredState();
  TieredState(const TieredState&) = delete;
  TieredState& operator=(const TieredState&) = delete;

  const PlacementPlan& plan() const { return plan_; }
  int elem_bytes(Category c) const { return plan_.state.elem_bytes[size_t(c)]; }
  Tier tier_of(Category c, int64_t offset) const;

  // The bytes of [offset, offset + numel) of category `c` when they lie in
  // host units, or device units of a host-addressable device (the CPU
  // device), contiguous in one arena; nullptr otherwise (NVMe, device memory
  // of a GPU, or a range across tiers). Host code may use them in place.
  std::byte* resident(Category c, int64_t offset, int64_t numel) const;
  // The same range in device memory when it lies in contiguous device units
  // (on any device); a null DevicePtr otherwise. For kernels and tensors made
  // for the device.
  DevicePtr resident_on_device(Category c, int64_t offset, int64_t numel) const;
  Device& device() const { return *device_; }

  // Synchronous copies between homes and `buf`. For ranges touching NVMe,
  // offset and numel must be multiples of kShardAlignElems (or reach a unit's
  // end) and `buf` 4096-aligned: Note [Placement units] guarantees this for
  // whole units and sub-groups. Reading an NVMe unit never written throws.
  void read(Category c, int64_t offset, int64_t numel, void* buf);
  void write(Category c, int64_t offset, int64_t numel, const void* buf);
  // The same, returning before NVMe transfers and device-tier copies
  // complete: their handles and completions join the group `pending`, whose
  // completion is returned (already complete when everything was in host
  // memory: those pieces are copied at once). `buf` must stay untouched
  // (write) / unread (read) until the completion is waited. Device-tier
  // pieces are copied on the state's own streams (kStateD2H, kStateH2D)
  // after `device_after` when given (e.g. the backward that wrote the
  // gradient, or a fired Completion() for state no kernel touches), else
  // after all the compute queued so far.
  // `d2h`: the stream device-tier reads go on (a checkpoint save's own).
  [[nodiscard]] Completion read_async(Category c, int64_t offset, int64_t numel, void* buf,
                                      PendingIo& pending, const Completion* device_after = nullptr,
                                      Stream d2h = Stream::kStateD2H);
  [[nodiscard]] Completion write_async(Category c, int64_t offset, int64_t numel, const void* buf,
                                       PendingIo& pending, const Completion* device_after = nullptr);

  // Note [Alternate swap slots]
  // With OptimizerPlan::speculate_slots every NVMe unit of master weights
  // and moments whose three categories are all on NVMe
  // (optimizer_state_on_nvme) has two homes on disk, its slots, and per pipeline piece
  // (Note [Pipeline pieces] in placement.h) a flag saying which of them is
  // current. Reads, write_async and checkpoint saves see the current slot
  // only; the optimizer's speculation (Note [Speculative optimizer] in
  // engine/optimizer/optimizer_pass.h) writes a piece's new state into its spare slot
  // (write_spare_async) while the current one keeps the pre-step state, and
  // a commit makes the spare current by flipping the flag (commit_spare): no
  // second read, no second write. A redo or a skipped step leaves the flags
  // alone, so the pre-step state is current again at no cost. A spare slot
  // written and never committed is overwritten by the next speculation. The
  // disk pays for it: twice the NVMe bytes of master weights and moments.
  //
  // Whether [offset, offset + numel) of c lies in NVMe homes with two slots.
  bool has_spare(Category c, int64_t offset, int64_t numel) const;
  // write_async into the spare slots of [offset, offset + numel), which must
  // be whole pipeline pieces of homes with two slots.
  [[nodiscard]] Completion write_spare_async(Category c, int64_t offset, int64_t numel, const void* buf,
                                             PendingIo& pending);
  // Makes the spare slots of those pieces current. Any thread; REQUIRES:
  // their spare writes have completed, and no transfer of the range is in
  // flight.
  void commit_spare(Category c, int64_t offset, int64_t numel);

  // Starts copying [offset, offset + numel) of category c from host-tier or
  // device-tier homes into device memory at `dst`, on the H2D stream after
  // the compute queued so far (which may still read `dst`'s previous
  // contents); returns the copy's completion. NVMe pieces cannot go
  // straight to a GPU: read them into a bounce buffer registered with the
  // device (read_async), then copy. On a host-addressable device this is
  // read_async into dst's bytes.
  [[nodiscard]] Completion read_to_device(Category c, int64_t offset, int64_t numel, DevicePtr dst,
                                          PendingIo& pending);

  // A snapshot (the counters may move under another thread's transfers).
  LinkBytes links() const {
    return {links_[0].load(std::memory_order_relaxed), links_[1].load(std::memory_order_relaxed),
            links_[2].load(std::memory_order_relaxed), links_[3].load(std::memory_order_relaxed)};
  }
  // Counts a copy the caller made between the host tier and the compute side
  // outside the state (offloaded activation checkpoints).
  void count_copy(bool to_device, int64_t bytes) { count(to_device ? 0 : 1, bytes); }

  // While alive, this thread's transfers are also added to `*tally` (each
  // thread its own; scopes nest), so that a caller can attribute bytes to the
  // work of one thread exactly while another thread moves bytes too.
  class TallyScope {
   public:
    explicit TallyScope(LinkBytes* tally);
    ~TallyScope();
    TallyScope(const TallyScope&) = delete;
    TallyScope& operator=(const TallyScope&) = delete;

   private:
    LinkBytes* previous_;
  };
  // Bytes of the homes given to category c (arena ranges and swap regions),
  // summed over what was set up, whatever the tier.
  int64_t allocated_bytes(Category c) const;
  // Resident bytes per tier (state only; NVMe = bytes in the swap store).
  std::array<int64_t, kNumTiers> state_bytes() const { return plan_.state.total(); }
  int64_t device_arena_bytes() const { return device_arena_.bytes(); }
  // Both host arenas (Note [Host arenas]).
  int64_t host_arena_bytes() const { return int64_t(host_arena_.bytes()) + host_transfer_arena_.bytes(); }
  // The part registered with the device: host-tier 16-bit parameters and gradients.
  int64_t host_transfer_bytes() const { return host_transfer_arena_.bytes(); }
  const nvme::SwapStore* swap() const { return swap_.get(); }
  // Registers a host buffer that NVMe reads and writes of category c use
  // with the I/O engine's rings (Note [Registered buffers] in
  // nvme/engine.h), so that training moves bytes as `strata bench-io`
  // measures them. Empty where c has no NVMe homes or the buffer is empty.
  // The registration must end before the buffer is freed and before this
  // state: hold it beside the buffer, declared after it.
  nvme::BufferRegistration register_io_buffer(Category c, const void* p, int64_t bytes) {
    if (!engine_ || bytes <= 0 || !plan_.state.any_on_nvme(c)) return nvme::BufferRegistration();
    return engine_->register_buffer(const_cast<void*>(p), bytes);
  }
  // The same for device memory, which NVMe I/O reaches in place only on a
  // host-addressable device (the CPU device's); empty on others.
  nvme::BufferRegistration register_io_buffer(Category c, const DeviceBuffer& m) {
    if (!device_->host_addressable()) return nvme::BufferRegistration();
    return register_io_buffer(c, m.ptr().raw(), m.bytes());
  }
  // The NVMe I/O engine's counters (zero where nothing is on NVMe).
  nvme::EngineStats io_stats() const { return engine_ ? engine_->stats() : nvme::EngineStats(); }

 private:
  struct Home {
    int64_t offset = 0;      // elements, in the rank's shard space
    int64_t numel = 0;
    Tier tier = Tier::kDevice;
    std::byte* ptr = nullptr;  // device (a DevicePtr's raw bytes) / host
    nvme::RegionId region;     // NVMe
    // Note [Alternate swap slots]: the second slot, and the first of the
    // home's flags in slot_flags_ (one per slot_chunk_ elements; -1: none).
    nvme::RegionId spare;
    int64_t first_flag = -1;
  };
  template <typename Fn>
  void for_each_piece(Category c, int64_t offset, int64_t numel, Fn&& fn) const;
  // Note [Alternate swap slots]: whether unit u of c gets a second slot.
  bool has_slots(Category c, const PlacementUnit& u) const;

  // `compute_side`: `buf` is memory the compute device reads (a window slot
  // of the CPU device), so host-tier pieces count as H2D/D2H copies.
  // `spare`: an NVMe write goes to the spare slots (Note [Alternate swap slots]).
  void transfer(nvme::IoOp op, Category c, int64_t offset, int64_t numel, std::byte* buf,
                PendingIo& pending, const Completion* device_after = nullptr, bool compute_side = false,
                Stream d2h = Stream::kStateD2H, bool spare = false);
  // The NVMe I/O of [at, at + n) of home h (elements in the home) at
  // `mine`, split where the current slot changes.
  void swap_io(nvme::IoOp op, const Home& h, int64_t eb, int64_t at, int64_t n, std::byte* mine,
               PendingIo& pending, bool spare);
  void count(int link, int64_t bytes);  // 0 h2d, 1 d2h, 2 nvme_read, 3 nvme_write
  // The home range in one unit of a resident tier, or nullptr (resident()'s
  // search, any tier but NVMe).
  const std::byte* find_resident(Category c, int64_t offset, int64_t numel, Tier* tier) const;

  PlacementPlan plan_;
  PendingIo sync_;  // the synchronous read()/write()'s handles, reused
  std::array<std::vector<Home>, kNumCategories> homes_;
  Device* device_;
  DeviceBuffer device_arena_;
  PinnedHostBuffer host_transfer_arena_;
  HostBuffer host_arena_;
  std::unique_ptr<nvme::IoEngine> engine_;
  std::unique_ptr<nvme::SwapStore> swap_;
  std::array<std::atomic<int64_t>, 4> links_{};  // h2d, d2h, nvme_read, nvme_write
  // Note [Alternate swap slots]: per slot chunk (a pipeline piece), 1 when
  // the spare region is the current slot. Atomic: a save's thread reads
  // them while the optimizer's flips others.
  int64_t slot_chunk_ = 0;
  std::unique_ptr<std::atomic<uint8_t>[]> slot_flags_;
};

}  // namespace strata
