// The step as a schedule: the ordered list of (blocks, micro-batch, pass)
// that one training step runs, made by one function per schedule and read
// by the trainer's executor and the parameter window's prefetch alike (one
// order, in one place). No LibTorch here. See Note [Step schedules].
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "config/config.h"

namespace strata {

// Note [Step schedules]
// A step of A micro-batches over blocks 0 (embedding) .. H (head) is a list
// of ops; each uses one block (the head: with the tied embedding, two) for
// one micro-batch in one pass:
//  - forward: the block's forward for micro-batch m, keeping its input (the
//    activation checkpoint) or its graph (Note [Recompute] in
//    engine/trainer.h);
//  - head: the head's forward, the loss and the head's backward for m (the
//    gradient of its input, and for a tied head the embedding's share);
//  - backward: the block's recompute and backward for m, given the gradient
//    of its output; its weight gradients go to the gradient path.
// micro_batch: for m = 0..A-1: forward 0..H-1, head, backward H-1..0. A block
// whose working copy is not kept on the device is fetched up to 2A + 1 times,
// and an off-device gradient lands A times (docs/design.md, "Bytes per link").
// layer (GreedySnake's "vertical" order): forward block b for m = 0..A-1,
// then b + 1; the head for m = 0..A-1; backward block b for m = 0..A-1, from
// H-1 down. Every block is fetched at most twice a step whatever A is (the
// tied embedding three times: the head uses it between its forward and its
// backward), as the window keeps a block across its A consecutive ops, and a block's gradient is final when
// its A-th backward ends: summed on the device in the order 0..A-1 and handed
// on once (one landing, one reduction). It holds A checkpoints per block and
// A output gradients between blocks. Both run the same operations on the
// same values in each block and micro-batch, and the gradient sums in the
// same order, so they train bit for bit alike (step_test, ranks_test).
enum class Pass : uint8_t { kForward, kHead, kBackward };

struct StepOp {
  int32_t block[2] = {-1, -1};  // block[1]: the tied embedding beside the head
  int count = 0;                // blocks used: 1, or 2 for a tied head
  int32_t micro = 0;            // micro-batch 0 .. A-1
  Pass pass = Pass::kForward;
};

// The ops of one training step under `schedule` (kMicroBatch or kLayer) for
// `num_blocks` blocks (block 0 the embedding, the last the head) and `accum`
// micro-batches; and of one evaluation batch (forward and the head's forward).
std::vector<StepOp> train_schedule(StepSchedule schedule, int num_blocks, bool tied, int64_t accum);
std::vector<StepOp> eval_schedule(int num_blocks, bool tied);

// Micro-batches whose activations a schedule holds at once: A under layer,
// 1 under micro_batch.
inline int64_t held_micro_batches(StepSchedule schedule, int64_t accum) {
  return schedule == StepSchedule::kLayer ? std::max<int64_t>(accum, 1) : 1;
}

}  // namespace strata
