#include "memory/param_window.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>

#include "memory/tiered_state.h"
#include "util/errors.h"
#include "util/trace.h"

namespace strata {

ParamWindow::ParamWindow(std::vector<int64_t> block_numel, std::vector<char> fetched,
                         const WindowKnobs& knobs, int64_t cap_bytes, int elem_bytes)
    : numel_(std::move(block_numel)), fetched_(std::move(fetched)), knobs_(knobs) {
  STRATA_CHECK(numel_.size() == fetched_.size(), "one fetched flag per block");
  persistent_.assign(numel_.size(), 0);
  persistent_at_.assign(numel_.size(), -1);
  persistent_valid_.assign(numel_.size(), 0);
  slot_of_.assign(numel_.size(), -1);
  // Persistent: fetched blocks under the threshold, smallest first, as far as
  // the cap allows after two slots of the largest fetched block.
  std::vector<size_t> small;
  int64_t largest = 0;
  for (size_t b = 0; b < numel_.size(); ++b) {
    if (!fetched_[b]) continue;
    largest = std::max(largest, numel_[b]);
    if (numel_[b] < knobs_.persistence_numel) small.push_back(b);
  }
  std::stable_sort(small.begin(), small.end(), [&](size_t a, size_t b) { return numel_[a] < numel_[b]; });
  int64_t room = cap_bytes < 0 ? INT64_MAX : cap_bytes / elem_bytes - 2 * largest;
  for (size_t b : small) {
    if (numel_[b] > room) break;
    room -= numel_[b];
    persistent_[b] = 1;
  }
  for (size_t b = 0; b < numel_.size(); ++b) {
    if (!fetched_[b]) continue;
    if (persistent_[b]) {
      persistent_at_[b] = shape_.persistent_numel;
      shape_.persistent_numel += numel_[b];
    } else {
      shape_.slot_numel = std::max(shape_.slot_numel, numel_[b]);
    }
  }
  if (cap_bytes >= 0 && shape_.slot_numel > 0) {
    const int64_t left = cap_bytes - shape_.persistent_numel * elem_bytes;
    max_slots_ = int(std::max<int64_t>(0, left / (shape_.slot_numel * elem_bytes)));
  }
}

ParamWindow::~ParamWindow() { drain(); }

WindowShape ParamWindow::plan(const std::vector<const std::vector<StepOp>*>& schedules) {
  STRATA_CHECK(state_ == nullptr, "plan() is a dry run, before attach()");
  for (const std::vector<StepOp>* s : schedules) {
    block_fetches_.assign(numel_.size(), 0);
    begin(s);
    DevicePtr out[2];
    for (size_t i = 0; i < s->size(); ++i) {
      acquire(out);
      release();
    }
    if (s == schedules.front()) planned_fetches_ = block_fetches_;
  }
  WindowShape shape = shape_;
  shape.slots = peak_slots_;
  invalidate();
  schedule_ = nullptr;
  slots_.clear();
  peak_slots_ = 0;
  peak_live_ = 0;
  peak_ahead_ = 0;
  fetches_ = 0;
  return shape;
}

void ParamWindow::attach(TieredState* state, const WindowShape& shape, int elem_bytes, Category c,
                         int64_t bounce_bytes) {
  STRATA_CHECK(shape.slot_numel == shape_.slot_numel && shape.persistent_numel == shape_.persistent_numel,
               "window shape planned for other blocks");
  state_ = state;
  elem_bytes_ = elem_bytes;
  category_ = c;
  shape_ = shape;
  max_slots_ = shape.slots;
  slots_.assign(size_t(shape.slots), Slot());
  pending_.resize(size_t(shape.slots) + 1);  // the last: persistent blocks' fetches
  done_.assign(size_t(shape.slots), Completion());
  bounced_.assign(size_t(shape.slots), 0);
  Device& dev = state->device();
  if (shape.slots > 0) {
    slots_mem_ = dev.allocate(shape.slots * shape.slot_numel * elem_bytes, "parameter window slots");
  }
  if (shape.persistent_numel > 0) {
    persistent_mem_ = dev.allocate(shape.persistent_numel * elem_bytes, "persistent parameters");
  }
  if (bounce_bytes > 0 && !dev.host_addressable()) {
    bounce_ = dev.allocate_pinned(bounce_bytes, "parameter window bounce buffers");
  }
  io_registered_.push_back(state->register_io_buffer(category_, bounce_.data(), bounce_.bytes()));
  io_registered_.push_back(state->register_io_buffer(category_, slots_mem_));
  io_registered_.push_back(state->register_io_buffer(category_, persistent_mem_));
}

DevicePtr ParamWindow::slot_ptr(int s) const {
  return slots_mem_.ptr() + int64_t(s) * shape_.slot_numel * elem_bytes_;
}

std::byte* ParamWindow::bounce_ptr(int s) const {
  return bounce_.data() + int64_t(s) * shape_.slot_numel * elem_bytes_;
}

void ParamWindow::drain() {
  for (Completion& c : done_) {
    try {
      c.wait();
    } catch (...) {
      // An earlier pass failed; its error was reported then.
    }
  }
  std::fill(bounced_.begin(), bounced_.end(), 0);
}

void ParamWindow::begin(const std::vector<StepOp>* schedule) {
  drain();
  for (Slot& s : slots_) s = Slot();
  std::fill(slot_of_.begin(), slot_of_.end(), -1);
  live_ = ahead_ = 0;
  in_use_ = 0;
  current_ = claimed_ = 0;
  acquired_ = false;
  schedule_ = schedule;
  advance();
}

void ParamWindow::fetch_persistent(int32_t b) {
  if (state_ != nullptr) {
    const auto t0 = std::chrono::steady_clock::now();
    Device& dev = state_->device();
    const DevicePtr dst = persistent_mem_.ptr() + persistent_at_[size_t(b)] * elem_bytes_;
    const int64_t offset = state_->plan().state.units[size_t(category_)][size_t(b)].offset;
    const int64_t n = numel_[size_t(b)];
    if (via_bounce(offset)) {
      std::byte* bounce = bounce_ptr(int(slots_.size())) + persistent_at_[size_t(b)] * elem_bytes_;
      state_->read(category_, offset, n, bounce);
      dev.stream_wait(Stream::kCompute, h2d_from_bounce(dst, bounce, n));  // after the last step's readers
    } else {
      dev.stream_wait(Stream::kCompute, state_->read_to_device(category_, offset, n, dst, pending_.back()));
    }
    wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  persistent_valid_[size_t(b)] = 1;
  ++fetches_;
  if (!block_fetches_.empty()) ++block_fetches_[size_t(b)];
}

// Starts fetching block b into slot s: straight to the device from host and
// device homes; from NVMe into the host-addressable slot itself, or into the
// slot's bounce buffer, copied to the device when the slot is acquired.
void ParamWindow::fetch_slot(int s, int32_t b) {
  const int64_t offset = state_->plan().state.units[size_t(category_)][size_t(b)].offset;
  PendingIo& io = pending_[size_t(s)];
  if (via_bounce(offset)) {
    // The slot's bounce buffer may still be the source of the H2D copy its
    // last block's acquire queued.
    done_[size_t(s)].wait();
    done_[size_t(s)] = state_->read_async(category_, offset, numel_[size_t(b)], bounce_ptr(s), io);
    bounced_[size_t(s)] = 1;
  } else {
    done_[size_t(s)] = state_->read_to_device(category_, offset, numel_[size_t(b)], slot_ptr(s), io);
  }
}

void ParamWindow::land(int s) {
  Device& dev = state_->device();
  Completion& fetched = done_[size_t(s)];
  if (!bounced_[size_t(s)] && !fetched.pending()) return;  // nothing to wait for or order
  const auto t0 = std::chrono::steady_clock::now();
  {
    TraceSpan span(TraceTrack::kCompute, "wait for parameters");
    if (bounced_[size_t(s)]) copy_bounced(s);
    if (fetched.pending()) dev.stream_wait(Stream::kCompute, fetched);
  }
  wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

bool ParamWindow::via_bounce(int64_t offset) const {
  return bounce_.bytes() > 0 && state_->tier_of(category_, offset) == Tier::kNvme;
}

Completion ParamWindow::h2d_from_bounce(DevicePtr dst, const std::byte* bounce, int64_t numel) {
  Device& dev = state_->device();
  // After the compute queued so far: the destination's previous readers.
  dev.stream_wait(Stream::kH2D, dev.record(Stream::kCompute));
  dev.copy_to_device(dst, bounce, numel * elem_bytes_, Stream::kH2D);
  state_->count_copy(/*to_device=*/true, numel * elem_bytes_);
  return dev.record(Stream::kH2D);
}

void ParamWindow::copy_bounced(int s) {
  Completion& fetched = done_[size_t(s)];
  fetched.wait();  // NVMe -> bounce
  bounced_[size_t(s)] = 0;
  fetched = h2d_from_bounce(slot_ptr(s), bounce_ptr(s), numel_[size_t(slots_[size_t(s)].block)]);
  ++bounce_copies_;
}

// Note [Bounce copies ahead]
// An NVMe block reaches a GPU in two hops: NVMe -> the slot's bounce buffer
// (started when the slot is claimed), then H2D. The second hop needs the
// first to have finished, which only the host can see; waiting for it at
// acquire would put the H2D copy in front of the block's compute. So after
// each acquire the window starts, in the order the blocks will be used, the
// H2D copies of the slots ahead whose NVMe reads have already finished
// (never waiting for one), and stops at the first that has not: the H2D
// stream then runs the copies in the order of need, behind the compute
// queued so far (the slots' previous readers), while the current block
// computes. A later block's failed read (an I/O or checksum error) is then
// thrown by the acquire that pumps it, one use early; begin() starts the
// next pass clean either way.
void ParamWindow::pump_bounced() {
  for (size_t i = current_ + 1; i < claimed_; ++i) {
    const StepOp& u = (*schedule_)[i];
    for (int k = 0; k < u.count; ++k) {
      const int32_t b = u.block[k];
      if (!windowed(b) || slot_of_[size_t(b)] < 0) continue;
      const int s = slot_of_[size_t(b)];
      if (!bounced_[size_t(s)]) continue;
      if (!pending_[size_t(s)].done()) return;
      copy_bounced(s);
      ++early_bounce_copies_;
    }
  }
}

// Claims use `i`: its windowed blocks not in a slot get one and are fetched.
// Unless `force`, only within the prefetch and live limits and the free slots.
bool ParamWindow::try_claim(size_t i, bool force) {
  const StepOp& u = (*schedule_)[i];
  int new_slots = 0;
  int64_t new_numel = 0;
  for (int k = 0; k < u.count; ++k) {
    const int32_t b = u.block[k];
    if (!force && fetched_[size_t(b)] && b >= ready_) return false;  // still being updated
    if (windowed(b) && slot_of_[size_t(b)] < 0) {
      ++new_slots;
      new_numel += numel_[size_t(b)];
    }
  }
  if (!force) {
    if (new_numel > 0 && (ahead_ + new_numel > knobs_.prefetch_numel || live_ + new_numel > knobs_.max_live_numel)) {
      return false;
    }
    // Live: the slots allocated; dry run: the cap, if any.
    const int64_t limit = state_ != nullptr ? int64_t(slots_.size()) : max_slots_ < 0 ? INT32_MAX : max_slots_;
    if (in_use_ + new_slots > limit) return false;
  }
  for (int k = 0; k < u.count; ++k) {
    const int32_t b = u.block[k];
    if (!fetched_[size_t(b)]) continue;
    if (persistent_[size_t(b)]) {
      if (!persistent_valid_[size_t(b)]) fetch_persistent(b);
      continue;
    }
    int s = slot_of_[size_t(b)];
    if (s >= 0) {
      ++slots_[size_t(s)].claims;
      continue;
    }
    for (s = 0; s < int(slots_.size()) && slots_[size_t(s)].block >= 0; ++s) {
    }
    if (s == int(slots_.size())) {
      STRATA_CHECK(state_ == nullptr, "parameter window: no free slot for the current block");
      slots_.emplace_back();
    }
    Slot& slot = slots_[size_t(s)];
    slot.block = b;
    slot.claims = 1;
    slot.ahead = !force;
    slot_of_[size_t(b)] = s;
    live_ += numel_[size_t(b)];
    if (slot.ahead) ahead_ += numel_[size_t(b)];
    ++in_use_;
    ++fetches_;
    if (!block_fetches_.empty()) ++block_fetches_[size_t(b)];
    if (state_ != nullptr) fetch_slot(s, b);
  }
  peak_slots_ = std::max(peak_slots_, in_use_);
  peak_live_ = std::max(peak_live_, live_);
  peak_ahead_ = std::max(peak_ahead_, ahead_);
  return true;
}

void ParamWindow::advance() {
  while (claimed_ < schedule_->size() && try_claim(claimed_, false)) ++claimed_;
}

void ParamWindow::acquire(DevicePtr out[2]) {
  STRATA_CHECK(schedule_ != nullptr && !acquired_ && current_ < schedule_->size(),
               "parameter window: acquire out of schedule");
  if (claimed_ == current_) {
    try_claim(current_, /*force=*/true);
    ++claimed_;
  }
  const StepOp& u = (*schedule_)[current_];
  for (int k = 0; k < u.count; ++k) {
    const int32_t b = u.block[k];
    out[k] = DevicePtr();
    if (!fetched_[size_t(b)]) continue;
    if (persistent_[size_t(b)]) {
      if (!persistent_valid_[size_t(b)]) fetch_persistent(b);
      if (state_ != nullptr) out[k] = persistent_mem_.ptr() + persistent_at_[size_t(b)] * elem_bytes_;
      continue;
    }
    const int s = slot_of_[size_t(b)];
    STRATA_CHECK(s >= 0, "parameter window: a claimed block has no slot");
    Slot& slot = slots_[size_t(s)];
    if (slot.ahead) {
      slot.ahead = false;
      ahead_ -= numel_[size_t(b)];
    }
    if (state_ != nullptr) {
      land(s);
      out[k] = slot_ptr(s);
    }
  }
  if (state_ != nullptr && bounce_.bytes() > 0) pump_bounced();  // Note [Bounce copies ahead]
  acquired_ = true;
  advance();
}

void ParamWindow::release() {
  STRATA_CHECK(acquired_, "parameter window: release without acquire");
  const StepOp& u = (*schedule_)[current_];
  for (int k = 0; k < u.count; ++k) {
    const int32_t b = u.block[k];
    if (!windowed(b)) continue;
    Slot& slot = slots_[size_t(slot_of_[size_t(b)])];
    if (--slot.claims == 0) {
      slot.block = -1;
      slot_of_[size_t(b)] = -1;
      live_ -= numel_[size_t(b)];
      --in_use_;
    }
  }
  acquired_ = false;
  ++current_;
  advance();
}

}  // namespace strata
