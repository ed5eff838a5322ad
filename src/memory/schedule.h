// The step as a schedule: the ordered list of (blocks, micro-batch, pass)
// that one training step runs, made by one function per schedule and read
// by the trainer's executor and the parameter window's prefetch alike (one
// order, in one place). No LibTorch here. See Note [Step schedules].
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
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

// The step's shape: its schedule and every fact of its order that the rest
// of the engine needs (the planner's rows, the gradient path, the
// optimizer's order, the bound), answered here from the schedule so that no
// other code reasons about which schedule runs (Note [Step schedules]).
struct StepShape {
  // run.schedule resolved: kMicroBatch or kLayer, never kAuto.
  StepSchedule schedule = StepSchedule::kMicroBatch;
  int64_t accum = 1;        // micro-batches per step (A)
  int64_t held_micro = 1;   // micro-batches whose activations are held at once (A under layer)
  std::string choice;       // run.schedule auto: what was chosen and why
  int64_t token_bytes = 0;  // a step's token windows: A x micro x (seq_len + 1) x 8

  void set(StepSchedule s, int64_t a) {
    schedule = s;
    accum = a;
    held_micro = held_micro_batches(s, a);
  }
  // Whether each block's A backward ops run back to back, so that its
  // gradient is summed over the step's micro-batches on the device and is
  // final at the A-th (the layer schedule with A > 1). Under micro_batch a
  // block's gradient is final only in the last micro-batch's backward.
  bool sums_each_block() const { return schedule == StepSchedule::kLayer && accum > 1; }
  // Whether a block's gradient is final at most one backward op after its
  // previous op of the step: every gradient becomes final while the backward
  // still has blocks to run (what the speculative optimizer hides in).
  bool gradients_final_in_backward() const { return schedule == StepSchedule::kLayer || accum <= 1; }
  // Times per step each block's gradient is handed on (lands in its home,
  // or is reduced between ranks): once when summed over the step first
  // (`whole_model_sum`: comm.gradient_reduction per_step) or by the schedule,
  // else once per micro-batch.
  int64_t hand_offs_per_step(bool whole_model_sum) const {
    return whole_model_sum || gradients_final_in_backward() ? 1 : std::max<int64_t>(accum, 1);
  }
  // The ops of one training step for `num_blocks` blocks.
  std::vector<StepOp> ops(int num_blocks, bool tied) const { return train_schedule(schedule, num_blocks, tied, accum); }
};

// The blocks in the order their gradients become final in `ops` (a block's
// last backward op; the head's at its last head op, the tied embedding's at
// its own last backward): what the speculative optimizer walks.
std::vector<int32_t> gradient_final_order(const std::vector<StepOp>& ops);

}  // namespace strata
