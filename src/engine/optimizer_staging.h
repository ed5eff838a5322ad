// The optimizer's staging buffers (Note [Optimizer pipeline] in trainer.cc):
// `sets` sets of one pipeline piece of each category that is not resident,
// allocated once as the plan counted them (StagingNeeds::opt_*), with the
// I/O in flight per set. No LibTorch here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "memory/buffer.h"
#include "memory/device.h"
#include "memory/placement.h"
#include "memory/tiered_state.h"

namespace strata {

class OptimizerStaging {
 public:
  // On a device host code may not touch (a GPU) the gradient and working-copy
  // slots, which cross PCIe, are registered with `state`'s device.
  // Slots of a category with pieces on NVMe are registered with `state`'s
  // I/O engine (Note [Registered buffers] in nvme/engine.h).
  OptimizerStaging(const PlacementPlan& plan, TieredState& state);

  int sets() const { return sets_; }
  int64_t piece_numel() const { return piece_numel_; }
  // Set k's buffer for category c, nullptr when c is never staged; kParam16
  // is the new working copy the step emits.
  std::byte* slot(Category c, int k) const;
  // Reads and write-backs in flight per set, and their completions: a set is
  // reused only once the write-backs of its previous piece have completed.
  PendingIo& reads(int k) { return reads_[size_t(k)]; }
  PendingIo& writes(int k) { return writes_[size_t(k)]; }
  Completion& read_done(int k) { return read_done_[size_t(k)]; }
  Completion& write_done(int k) { return write_done_[size_t(k)]; }
  // Bytes allocated (host).
  int64_t bytes() const;

 private:
  int sets_ = 1;
  int64_t piece_numel_ = 0;
  std::array<int, kNumCategories> elem_bytes_{};
  std::array<HostBuffer, kNumCategories> buf_;  // per category, `sets_` pieces each
  std::array<PinnedHostBuffer, kNumCategories> pinned_;  // or registered with the device
  std::array<std::byte*, kNumCategories> base_{};
  std::vector<nvme::BufferRegistration> io_registered_;  // after the buffers: ends first
  std::vector<PendingIo> reads_, writes_;  // sized once: completions point into them
  std::vector<Completion> read_done_, write_done_;
};

}  // namespace strata
