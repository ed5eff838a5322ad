// The activation checkpoints of a step: each layer's input per micro-batch,
// kept from its forward to its backward on the device, or with
// activation_checkpointing.cpu_checkpointing offloaded to host slots and
// brought back one backward op ahead (in the schedule's order) into two
// device slots.
#pragma once

#include <ATen/ATen.h>

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
  // `shape`: one layer's input [micro_batch, seq_len, dim] in `dtype`.
  // `schedule`: the training step's ops (memory/schedule.h), whose backward
  // order the restores follow (read here only).
  ActivationCheckpoints(const PlacementPlan& plan, size_t num_blocks, std::vector<int64_t> shape,
                        at::ScalarType dtype, TieredState* state, const std::vector<StepOp>& schedule);
  // Copies still in flight (a step that failed mid-way) finish before the
  // slots they use are freed.
  ~ActivationCheckpoints();
  ActivationCheckpoints(const ActivationCheckpoints&) = delete;
  ActivationCheckpoints& operator=(const ActivationCheckpoints&) = delete;

  // A step begins: nothing saved survives it (nor a failed one).
  void reset() {
    offloaded_.wait();
    offloading_ = at::Tensor();
    device_now_ = 0;
    restored_ = 0;
    for (at::Tensor& t : saved_) t = at::Tensor();
  }
  // Keeps x as block b's input for micro-batch m (on the device, or
  // offloaded to the host).
  void save(size_t b, int64_t m, const at::Tensor& x);
  // Block b's input of micro-batch m on the device for its backward, which
  // must be the schedule's next backward op; prefetches the one after it.
  at::Tensor restore(size_t b, int64_t m);

  // Peak bytes of saved inputs on the device (the layers' inputs, or the two
  // slots that bring them back).
  int64_t peak_device_bytes() const { return peak_device_; }
  int64_t device_slot_bytes() const { return device_.bytes(); }
  int64_t host_slot_bytes() const { return host_.bytes(); }

 private:
  size_t key(size_t b, int64_t m) const { return b * size_t(accum_) + size_t(m); }
  // cpu_checkpointing: layer b of micro-batch m in host slot
  // (b - 1) x held + m (m taken as 0 when one micro-batch is held).
  int64_t host_slot(size_t b, int64_t m) const { return int64_t(b - 1) * held_ + (held_ > 1 ? m : 0); }
  void bring(size_t k);  // the k-th restore's input into its device slot

  size_t head_;                       // the head's block index (layers are 1..head_-1)
  int64_t accum_ = 1;                 // micro-batches per step
  int64_t held_ = 1;                  // micro-batches whose inputs are held at once (StepShape::held_micro)
  std::vector<at::Tensor> saved_;     // per (block, micro-batch), when kept on the device
  // The restores of a step in the schedule's backward order (layers only:
  // the embedding's input is the tokens), as (block, micro-batch).
  std::vector<std::pair<size_t, int64_t>> restore_order_;
  std::vector<char> after_forward_;   // per restore: a forward ran since the one before (not prefetched)
  std::vector<int> slot_of_;          // per restore: its device slot, alternating from the first after a forward
  size_t restored_ = 0;               // restores made this step
  // cpu_checkpointing: the restores after a forward come back into device
  // slots 0, 1, 0, ... Copies on the D2H / H2D streams of the state's
  // device (Note [Buffer reuse across streams], memory/device.h).
  Device& dev_;
  PinnedHostBuffer host_;
  DeviceBuffer device_;
  at::Tensor offloading_;             // the input whose D2H copy is in flight
  Completion offloaded_;              // ... and its completion
  std::array<Completion, 2> slot_ready_;  // each device slot's H2D copy
  int64_t bytes_ = 0;                 // one layer's input; 0 without cpu_checkpointing
  std::vector<int64_t> shape_;
  at::ScalarType dtype_;
  TieredState* state_;
  int64_t device_now_ = 0, peak_device_ = 0;
};

}  // namespace strata
