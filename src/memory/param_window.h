// The parameter prefetch window: which blocks' 16-bit parameters are on the
// device, fetched ahead of need along the step's static block order, within
// the DeepSpeed ZeRO-3 limits. No LibTorch here. See Note [Prefetch window].
#pragma once

#include <cstdint>
#include <climits>
#include <vector>

#include "memory/buffer.h"
#include "memory/completion.h"
#include "memory/device.h"
#include "memory/schedule.h"
#include "nvme/engine.h"

namespace strata {

class TieredState;
class PendingIo;
enum class Category;  // memory/placement.h

// Note [Prefetch window]
// A step uses blocks in an order known before it starts: the ops of its
// schedule (memory/schedule.h, Note [Step schedules]), the same list the
// trainer executes. Blocks whose working copy lives on the device are used
// in place. Every other block is fetched into a slot of the window before it is
// used and its slot is freed once no claimed use remains. After each use the
// window claims the next schedule entries in order, fetching what is not
// already in a slot, while
//   - the elements fetched for entries after the current one stay within
//     `prefetch_numel` (stage3_prefetch_bucket_size; 0: no prefetch),
//   - the elements in slots stay within `max_live_numel`
//     (stage3_max_live_parameters), and
//   - a slot is free (the slot count is fixed at start-up).
// A block already in a slot is claimed again instead of fetched again (block
// H-1 from forward to backward, block 0 from one micro-batch's backward to the
// next one's forward; under the layer schedule each block across its A
// consecutive ops, so a windowed block is fetched at most twice a step, the
// tied embedding three times). The current entry is always admitted, whatever the
// limits. Blocks with fewer than `persistence_numel` elements
// (stage3_param_persistence_threshold) are persistent: fetched into their own
// area once per step (after the optimizer changed them) and kept; under a
// device cap only as many as fit beside two slots, smallest first. The same
// code sizes the window for `strata plan` (a dry run without I/O over the
// training and evaluation schedules) and runs it, so plan and run agree.
struct WindowKnobs {
  int64_t prefetch_numel = 50000000;     // stage3_prefetch_bucket_size
  int64_t max_live_numel = 1000000000;   // stage3_max_live_parameters
  int64_t persistence_numel = 100000;    // stage3_param_persistence_threshold
};

struct WindowShape {
  int64_t slot_numel = 0;          // padded elements of the largest windowed block
  int slots = 0;                   // slots allocated
  int64_t persistent_numel = 0;    // padded elements of all persistent blocks
  int64_t bytes(int elem_bytes) const { return (slots * slot_numel + persistent_numel) * elem_bytes; }
};

class ParamWindow {
 public:
  // `block_numel`: padded elements per block; `fetched`: 1 where the block's
  // working copy does not live on the device. `cap_bytes` caps the window's
  // memory (persistent blocks first, then slots; < 0: no cap) for elements of
  // `elem_bytes`; the current use's blocks are always given slots.
  ParamWindow(std::vector<int64_t> block_numel, std::vector<char> fetched, const WindowKnobs& knobs,
              int64_t cap_bytes, int elem_bytes);

  // The shape that running `schedules` needs (a dry run; no memory, no I/O).
  WindowShape plan(const std::vector<const std::vector<StepOp>*>& schedules);

  // Makes the window live: allocates `shape` in the memory of the state's
  // device and fetches through `state` (category `c`: param16, or the frozen
  // values of Note [State kinds]; elem_bytes bytes per element). On a device
  // host code may not touch, blocks whose copy is on NVMe come through
  // bounce buffers registered with the device, one per slot, `bounce_bytes`
  // in all (StagingNeeds::window_bounce, frozen_window_bounce): NVMe ->
  // bounce, then H2D.
  void attach(TieredState* state, const WindowShape& shape, int elem_bytes, Category c, int64_t bounce_bytes);

  // Starts a pass over `schedule` (which must outlive it); waits for and drops
  // whatever an earlier, possibly failed, pass left in flight.
  void begin(const std::vector<StepOp>* schedule);
  // The next use of the schedule: orders the device's compute stream after
  // its blocks' fetches (waiting on the host for NVMe reads, and for any
  // fetch on a device whose streams run inline), then prefetches ahead.
  // Returns their weights (a null DevicePtr for a resident block, which the
  // caller uses in place) in `out` (use.count entries). A slot is refilled
  // only after the compute queued before its release (the H2D stream waits
  // for it).
  void acquire(DevicePtr out[2]);
  // The current use is finished with its blocks.
  void release();
  // Blocks [0, blocks) hold their final values (Note [Optimizer overlap]);
  // prefetch does not touch the others. The caller makes sure the current
  // use's blocks are ready before acquire().
  void set_ready(int32_t blocks) { ready_ = blocks; }
  // The persistent copies are stale (the optimizer wrote the working copy).
  void invalidate() { std::fill(persistent_valid_.begin(), persistent_valid_.end(), 0); }

  // Measured: slots in use at once, elements in slots at once, and the
  // seconds acquire() waited for transfers, since construction.
  int peak_slots() const { return peak_slots_; }
  int64_t peak_live_numel() const { return peak_live_; }
  int64_t peak_ahead_numel() const { return peak_ahead_; }
  double wait_seconds() const { return wait_s_; }
  int64_t fetches() const { return fetches_; }
  // Per block, the fetches the first schedule of the last plan() needed
  // (for the training schedule: F of docs/design.md, "Bytes per link").
  const std::vector<int64_t>& planned_fetches() const { return planned_fetches_; }
  // Bounce-buffer H2D copies started before their block was acquired
  // (pump_bounced), and all of them.
  int64_t early_bounce_copies() const { return early_bounce_copies_; }
  int64_t bounce_copies() const { return bounce_copies_; }
  const WindowShape& shape() const { return shape_; }
  // Whether block b is persistent (after plan() or attach()).
  bool persistent(int32_t b) const { return persistent_[size_t(b)] != 0; }
  int64_t bounce_bytes() const { return bounce_.bytes(); }  // host
  ~ParamWindow();

 private:
  struct Slot {
    int32_t block = -1;
    int claims = 0;       // uses claimed and not yet released
    bool ahead = false;   // fetched for a use after the current one, not yet acquired
  };
  bool windowed(int32_t b) const { return fetched_[size_t(b)] && !persistent_[size_t(b)]; }
  bool try_claim(size_t use, bool force);
  void advance();
  void fetch_persistent(int32_t b);
  void fetch_slot(int s, int32_t b);
  void land(int s);  // slot s's fetch, ordered before the compute queued next
  void copy_bounced(int s);  // slot s's bounce buffer to the slot, on the H2D stream
  bool via_bounce(int64_t offset) const;  // a param16 home on NVMe, on a device with bounce buffers
  Completion h2d_from_bounce(DevicePtr dst, const std::byte* bounce, int64_t numel);
  void pump_bounced();
  DevicePtr slot_ptr(int s) const;
  std::byte* bounce_ptr(int s) const;  // persistent blocks: s = slots
  void drain();

  std::vector<int64_t> numel_;
  std::vector<char> fetched_, persistent_;
  WindowKnobs knobs_;
  int max_slots_ = -1;

  // Live mode.
  TieredState* state_ = nullptr;
  int elem_bytes_ = 0;
  Category category_{};
  WindowShape shape_;
  DeviceBuffer slots_mem_, persistent_mem_;
  PinnedHostBuffer bounce_;          // NVMe blocks on a device host code may not touch
  // Where NVMe reads land (the bounce buffer, or the slots and persistent
  // blocks of a host-addressable device), registered with the I/O engine.
  std::vector<nvme::BufferRegistration> io_registered_;
  std::vector<char> bounced_;        // per slot: its fetch is in the bounce buffer, not yet copied
  std::vector<int64_t> persistent_at_;   // element offset in persistent_mem_, per block
  std::vector<char> persistent_valid_;

  const std::vector<StepOp>* schedule_ = nullptr;
  std::vector<Slot> slots_;
  std::vector<PendingIo> pending_;   // per slot (live mode); sized once: done_ points into it
  std::vector<Completion> done_;     // per slot: its fetch
  std::vector<int> slot_of_;     // per block, -1 when not in a slot
  size_t current_ = 0;           // the use acquire() hands out next / release() finishes
  size_t claimed_ = 0;           // uses [0, claimed_) are claimed
  bool acquired_ = false;
  int32_t ready_ = INT32_MAX;
  int64_t live_ = 0, ahead_ = 0;
  int in_use_ = 0;

  int peak_slots_ = 0;
  int64_t peak_live_ = 0;
  int64_t peak_ahead_ = 0;
  double wait_s_ = 0.0;
  int64_t fetches_ = 0;
  std::vector<int64_t> block_fetches_;    // per block, since the last plan() pass began
  std::vector<int64_t> planned_fetches_;
  int64_t early_bounce_copies_ = 0, bounce_copies_ = 0;
};

}  // namespace strata
