// The activation checkpoints of a step: each layer's input, kept from its
// forward to its backward on the device, or with
// activation_checkpointing.cpu_checkpointing offloaded to host slots and
// brought back one layer ahead into two device slots.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <vector>

#include "memory/device.h"
#include "memory/placement.h"
#include "memory/tiered_state.h"

namespace strata {

// Blocks: 0 is the embedding (its "input" is the token ids), 1..layers are the
// layers, the head is not saved. Not thread-safe.
class ActivationCheckpoints {
 public:
  // Allocates the host and device slots the plan counted (staging.ckpt_*).
  // `shape`: one layer's input [micro_batch, seq_len, dim] in `dtype`.
  ActivationCheckpoints(const PlacementPlan& plan, size_t num_blocks, std::vector<int64_t> shape,
                        at::ScalarType dtype, TieredState* state);
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
  }
  // Keeps x as block b's input (on the device, or offloaded to the host).
  void save(size_t b, const at::Tensor& x);
  // Block b's input on the device for its backward; prefetches b - 1's.
  at::Tensor restore(size_t b);

  // Peak bytes of saved inputs on the device (the layers' inputs, or the two
  // slots that bring them back).
  int64_t peak_device_bytes() const { return peak_device_; }
  int64_t device_slot_bytes() const { return device_.bytes(); }
  int64_t host_slot_bytes() const { return host_.bytes(); }

 private:
  size_t head_;                       // the head's block index (layers are 1..head_-1)
  std::vector<at::Tensor> saved_;     // per block, when kept on the device
  // cpu_checkpointing: layer b in host slot b - 1, brought back into device
  // slot (head - 1 - b) % 2. Copies on the D2H / H2D streams of the state's
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
