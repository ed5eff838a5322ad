// What the parts of the step share (engine/gathered_blocks.h,
// gradient_path.h, optimizer_pass.h, state_checkpoints.h): the config, the
// layout with this rank's shard geometry, the state, the compute device and
// the ranks. The Trainer owns it and outlives the parts.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "config/config.h"
#include "comm/device_collectives.h"
#include "memory/device.h"
#include "memory/layout.h"
#include "memory/tiered_state.h"

namespace strata {

struct StepContext {
  const Config* cfg = nullptr;
  const StateLayout* layout = nullptr;
  TieredState* state = nullptr;
  Device* device = nullptr;
  Communicator* comm = nullptr;         // the ranks; host values over its host group
  DeviceCollectives* collectives = nullptr;  // with several ranks: gathers and reductions of device memory
  c10::Device torch_device{c10::DeviceType::CPU};  // LibTorch's name for *device
  at::ScalarType compute_dtype = at::kFloat;
  int compute_bytes = 4;                 // bytes per element of compute_dtype
  // The working copy's (param16's) dtype: the compute dtype, or fp32 for
  // LoRA's adapters beside a 16-bit base (Note [State kinds] in
  // memory/layout.h); frozen values and activations are in compute_dtype.
  at::ScalarType param_dtype = at::kFloat;
  int param_bytes = 4;
  size_t embedding_block = 0;            // block 0
  size_t head_block = 0;                 // the last block
  int64_t shards = 1;                    // shards per block (1 at stage 0)
  int64_t shard_rank = 0;                // this rank's shard (0 with one shard)
  // Per block (Note [Gathered blocks] in trainer.h): its shard's offset in
  // shard space, the end of that shard, and the global unpadded index of its
  // element 0.
  std::vector<int64_t> shard_offset, block_end, global_index;
  // Note [State kinds] in memory/layout.h: per block, its frozen shard's
  // offset in the frozen space (empty for a dense model).
  std::vector<int64_t> frozen_offset;

  int64_t shard_numel(size_t b) const { return layout->block(b).shard_numel(); }
  // `numel` elements of device memory as a flat tensor on the compute device
  // (no copy).
  at::Tensor device_tensor(DevicePtr p, int64_t numel, at::ScalarType dtype) const {
    return at::from_blob(p.raw(), {numel}, at::TensorOptions().dtype(dtype).device(torch_device));
  }
};

}  // namespace strata
