// What a step's layers keep for their backward (Note [Activation placement]
// in memory/placement.h): per layer and micro-batch a pack of tensors, its
// input alone (the activation checkpoint: backward recomputes the layer) or
// its entries (config/saved_specs.h), kept on the device (as the forward's
// tensors, or copied into gradient homes not yet written this step) or copied
// to host slots during the forward and brought back one host pack ahead (in
// the schedule's backward order) into two device slots.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "memory/device.h"
#include "memory/placement.h"
#include "memory/schedule.h"
#include "memory/tiered_state.h"

namespace strata {

// Blocks: 0 is the embedding (its "input" is the token ids), 1..layers are the
// layers, the head is not saved. Not thread-safe.
class ActivationCheckpoints {
 public:
  // Allocates the host and device slots the plan counted (staging.ckpt_*).
  // `schedule`: the training step's ops (memory/schedule.h), whose backward
  // order the restores follow (read here only).
  ActivationCheckpoints(const PlacementPlan& plan, size_t num_blocks, TieredState* state,
                        const std::vector<StepOp>& schedule);
  // Copies still in flight (a step that failed mid-way) finish before the
  // slots they use are freed.
  ~ActivationCheckpoints();
  ActivationCheckpoints(const ActivationCheckpoints&) = delete;
  ActivationCheckpoints& operator=(const ActivationCheckpoints&) = delete;

  // A step begins: nothing saved survives it (nor a failed one).
  void reset() {
    offloaded_.wait();
    offloading_.clear();
    device_now_ = 0;
    restored_ = 0;
    std::fill(brought_.begin(), brought_.end(), 0);
    for (std::vector<at::Tensor>& p : saved_) p.clear();
  }
  // Keeps `pack` for block b's backward of micro-batch m: the embedding's
  // token ids, a layer's input, or its entries (the plan's bytes: checked).
  // On the device, or copied to the host (the tensors must then be dense).
  void save(size_t b, int64_t m, std::vector<at::Tensor> pack);
  // Block b's pack of micro-batch m on the device for its backward, which
  // must be the schedule's next backward op; brings the next pack from the
  // host into the other slot.
  std::vector<at::Tensor> restore(size_t b, int64_t m);
  // Where a speculative step's commit must have reached (its low mark:
  // OptimizerPass::wait_committed) before block b's pack of micro-batch m
  // may overwrite the gradient homes it lives in: the lowest piece CPU Adam
  // updates among those the pack overlaps; -1 when it overlaps none or lives
  // elsewhere (Note [Packs in gradient homes] in memory/placement.h).
  int64_t commit_wait(size_t b, int64_t m) const { return commit_wait_[key(b, m)]; }

  // Peak bytes of saved packs on the device (those kept there, and the two
  // slots that bring back the others).
  int64_t peak_device_bytes() const { return peak_device_; }
  int64_t device_slot_bytes() const { return device_.bytes(); }
  int64_t host_slot_bytes() const { return host_.bytes(); }

 private:
  size_t key(size_t b, int64_t m) const { return b * size_t(accum_) + size_t(m); }
  bool on_host(size_t b, int64_t m) const { return b > 0 && b < head_ && host_offset_[key(b, m)] >= 0; }
  bool in_grad_home(size_t b, int64_t m) const { return b > 0 && b < head_ && lent_offset_[key(b, m)] >= 0; }
  void bring(size_t k);  // the k-th restore's pack into its device slot
  // Records the pack's shapes (checked against the plan's bytes) for its
  // rebuild from bytes; returns its bytes.
  int64_t record_shapes(size_t b, int64_t m, const std::vector<at::Tensor>& pack);
  // The pack's tensors over its bytes at `at` on the device, as the forward made them.
  std::vector<at::Tensor> rebuild(size_t b, int64_t m, std::byte* at) const;

  // A packed tensor as the forward made it (a host pack is rebuilt on the
  // device with the same sizes and strides).
  struct Packed {
    static constexpr size_t kMaxDims = 6;  // entries are at most 4-D (q, k, v, the attention output)
    std::array<int64_t, kMaxDims> sizes, strides;  // fixed: a save allocates nothing once warm
    size_t dims;
    at::ScalarType dtype;
    int64_t bytes;
  };

  size_t head_;                       // the head's block index (layers are 1..head_-1)
  int64_t accum_ = 1;                 // micro-batches per step
  int64_t held_ = 1;                  // micro-batches whose packs are held at once (StepShape::held_micro)
  std::vector<std::vector<at::Tensor>> saved_;  // per (block, micro-batch), when kept on the device
  // Per (block, micro-batch): its pack's host slot (-1 when kept on the
  // device; under micro_batch a layer's micro-batches share one), the plan's
  // bytes of its pack (ActivationPlan::saved_bytes), and on the host its
  // pack's tensors from its last save.
  std::vector<int64_t> host_offset_;
  // Per (block, micro-batch): its pack's offset from lent_ when it lives in
  // the gradient homes (Note [Packs in gradient homes] in
  // memory/placement.h), else -1.
  std::vector<int64_t> lent_offset_;
  DevicePtr lent_;
  std::vector<int64_t> commit_wait_;
  std::vector<int64_t> pack_bytes_;
  std::vector<std::vector<Packed>> packed_;
  // The restores of a step in the schedule's backward order (layers only:
  // the embedding's input is the tokens), as (block, micro-batch).
  std::vector<std::pair<size_t, int64_t>> restore_order_;
  std::vector<int> slot_of_;          // per restore from the host: its device slot (alternating from the first
                                      // after a forward); -1 for a pack kept on the device
  // Per restore: the next restore from the host with no forward between
  // (-1: none), which it brings into the other slot; and whether its own
  // pack has been brought this step.
  std::vector<int64_t> next_host_;
  std::vector<char> brought_;
  size_t restored_ = 0;               // restores made this step
  // The host packs come back into device slots 0, 1, 0, ... Copies on the
  // D2H / H2D streams of the state's device (Note [Buffer reuse across
  // streams], memory/device.h).
  Device& dev_;
  PinnedHostBuffer host_;
  DeviceBuffer device_;
  int64_t slot_bytes_ = 0;            // one device slot: the largest host pack (ActivationPlan::largest_host_pack)
  std::vector<at::Tensor> offloading_;  // the pack whose D2H copies are in flight
  Completion offloaded_;              // ... and their completion
  std::array<Completion, 2> slot_ready_;  // each device slot's H2D copy
  TieredState* state_;
  int64_t device_now_ = 0, peak_device_ = 0;
};

}  // namespace strata
