// Tests of memory/param_window (Note [Prefetch window]) as a policy, in dry
// runs: what is fetched when, and how the three stage3 knobs bound it.
#include "memory/param_window.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

namespace strata {
namespace {

// An embedding, `layers` equal layers and a small head (tied), all fetched.
struct Blocks {
  std::vector<int64_t> numel;
  std::vector<char> fetched;
};

Blocks model(int layers, int64_t layer_numel = 10000) {
  Blocks m;
  m.numel.push_back(8000);  // embedding
  for (int i = 0; i < layers; ++i) m.numel.push_back(layer_numel);
  m.numel.push_back(2048);  // head (a norm; the projection is tied)
  m.fetched.assign(m.numel.size(), 1);
  return m;
}

WindowKnobs knobs(int64_t prefetch, int64_t live = 1000000000, int64_t persist = 0) {
  WindowKnobs k;
  k.prefetch_numel = prefetch;
  k.max_live_numel = live;
  k.persistence_numel = persist;
  return k;
}

struct WindowRun {
  WindowShape shape;
  int64_t fetches = 0;
  int64_t peak_live = 0;
  int64_t peak_ahead = 0;
};

// Dry-runs one training step of `accum` micro-batches.
WindowRun run(const Blocks& m, const WindowKnobs& k, int64_t accum = 1, int64_t cap_bytes = -1,
              StepSchedule schedule = StepSchedule::kMicroBatch) {
  ParamWindow w(m.numel, m.fetched, k, cap_bytes, 2);
  const auto s = train_schedule(schedule, int(m.numel.size()), /*tied=*/true, accum);
  // plan() resets the counters: run the schedule again by hand to read them.
  WindowRun r;
  r.shape = w.plan({&s});
  w.begin(&s);
  DevicePtr out[2];
  for (size_t i = 0; i < s.size(); ++i) {
    w.acquire(out);
    w.release();
  }
  r.fetches = w.fetches();
  r.peak_live = w.peak_live_numel();
  r.peak_ahead = w.peak_ahead_numel();
  EXPECT_EQ(w.peak_slots(), r.shape.slots);
  return r;
}

TEST(ParamWindowTest, ScheduleIsForwardHeadWithTiedEmbeddingThenBackward) {
  const auto s = train_schedule(StepSchedule::kMicroBatch, 4, true, 2);
  std::vector<int> order, micro;
  for (const StepOp& u : s) order.push_back(u.block[0]), micro.push_back(u.micro);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 2, 1, 0, 0, 1, 2, 3, 2, 1, 0}));
  EXPECT_EQ(micro, (std::vector<int>{0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(s[3].count, 2);
  EXPECT_EQ(s[3].block[1], 0);
  EXPECT_EQ(s[3].pass, Pass::kHead);
  EXPECT_EQ(s[2].pass, Pass::kForward);
  EXPECT_EQ(s[4].pass, Pass::kBackward);
  EXPECT_EQ(train_schedule(StepSchedule::kMicroBatch, 4, false, 1)[3].count, 1);
  EXPECT_EQ(eval_schedule(4, true).size(), 4u);
}

// Note [Step schedules]: layer runs each block for every micro-batch before
// the next block, the head per micro-batch, then the blocks in reverse, each
// for every micro-batch in order.
TEST(ParamWindowTest, LayerScheduleRunsEachBlockForEveryMicroBatchInTurn) {
  const auto s = train_schedule(StepSchedule::kLayer, 4, true, 2);
  std::vector<int> order, micro, pass;
  for (const StepOp& u : s) order.push_back(u.block[0]), micro.push_back(u.micro), pass.push_back(int(u.pass));
  EXPECT_EQ(order, (std::vector<int>{0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 1, 1, 0, 0}));
  EXPECT_EQ(micro, (std::vector<int>{0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(pass, (std::vector<int>{0, 0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2}));
  EXPECT_EQ(s[6].count, 2);
  EXPECT_EQ(s[7].block[1], 0);
  // One micro-batch: both schedules are the same list.
  const auto a = train_schedule(StepSchedule::kLayer, 5, false, 1), b = train_schedule(StepSchedule::kMicroBatch, 5, false, 1);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].block[0], b[i].block[0]);
    EXPECT_EQ(a[i].pass, b[i].pass);
  }
}

// The step's shape answers what the engine asks of the order: the facts
// worked out by hand from Note [Step schedules] for both schedules.
TEST(ParamWindowTest, StepShapeGivesTheFactsOfEachSchedule) {
  StepShape mb, ly, one;
  mb.set(StepSchedule::kMicroBatch, 4);
  ly.set(StepSchedule::kLayer, 4);
  one.set(StepSchedule::kMicroBatch, 1);
  EXPECT_EQ(mb.held_micro, 1);
  EXPECT_EQ(ly.held_micro, 4);
  EXPECT_FALSE(mb.sums_each_block());
  EXPECT_TRUE(ly.sums_each_block());
  EXPECT_FALSE(one.sums_each_block());
  EXPECT_FALSE(mb.gradients_final_in_backward());
  EXPECT_TRUE(ly.gradients_final_in_backward());
  EXPECT_TRUE(one.gradients_final_in_backward());
  EXPECT_EQ(mb.hand_offs_per_step(false), 4);
  EXPECT_EQ(mb.hand_offs_per_step(true), 1);
  EXPECT_EQ(ly.hand_offs_per_step(false), 1);
  EXPECT_EQ(one.hand_offs_per_step(false), 1);
  EXPECT_EQ(ly.ops(4, true).size(), train_schedule(StepSchedule::kLayer, 4, true, 4).size());
}

// Gradients become final from the head down under both schedules; the
// order is read off the ops (a block is final at its last head or backward
// op), so a different list gives a different order.
TEST(ParamWindowTest, GradientFinalOrderIsReadOffTheOps) {
  for (StepSchedule s : {StepSchedule::kMicroBatch, StepSchedule::kLayer}) {
    EXPECT_EQ(gradient_final_order(train_schedule(s, 4, true, 2)), (std::vector<int32_t>{3, 2, 1, 0}));
  }
  auto bwd = [](int32_t b, int32_t m) {
    StepOp o;
    o.block[0] = b, o.count = 1, o.micro = m, o.pass = Pass::kBackward;
    return o;
  };
  StepOp fwd = bwd(0, 0);
  fwd.pass = Pass::kForward;
  EXPECT_EQ(gradient_final_order({fwd, bwd(2, 0), bwd(1, 0), bwd(2, 1)}), (std::vector<int32_t>{1, 2}));
}

// Under layer a windowed block is fetched at most twice a step (once for its
// forwards, once for its backwards), whatever the micro-batch count and even
// without prefetch; the tied embedding at most three times (its forwards, the
// head's, its backwards). micro_batch fetches a block up to 2A + 1 times.
TEST(ParamWindowTest, UnderLayerEachWindowedBlockIsFetchedAtMostTwiceAStep) {
  const Blocks m = model(4);  // 6 blocks, all fetched
  for (int64_t accum : {1, 3, 8}) {
    for (int64_t prefetch : {int64_t(0), int64_t(1000000)}) {
      ParamWindow w(m.numel, m.fetched, knobs(prefetch), -1, 2);
      const auto s = train_schedule(StepSchedule::kLayer, int(m.numel.size()), true, accum);
      w.plan({&s});
      const std::vector<int64_t>& f = w.planned_fetches();
      for (size_t b = 0; b < f.size(); ++b) {
        EXPECT_GE(f[b], 1) << "block " << b << ", A = " << accum;
        EXPECT_LE(f[b], b == 0 ? 3 : 2) << "block " << b << ", A = " << accum << ", prefetch " << prefetch;
      }
      // The head's uses are consecutive: once. With prefetch the last layer
      // is kept from its forwards to its backwards: once.
      EXPECT_EQ(f[5], 1);
      if (prefetch > 0) {
        EXPECT_EQ(f[4], 1);
      }
      const WindowRun mb = run(m, knobs(prefetch), accum, -1, StepSchedule::kMicroBatch);
      const WindowRun ly = run(m, knobs(prefetch), accum, -1, StepSchedule::kLayer);
      EXPECT_LE(ly.fetches, 2 * int64_t(m.numel.size()) + 1);
      if (accum > 1 && prefetch == 0) {
        EXPECT_GT(mb.fetches, ly.fetches) << "A = " << accum;
      }
    }
  }
}

TEST(ParamWindowTest, NoPrefetchHoldsOnlyTheCurrentUse) {
  const Blocks m = model(4);
  const WindowRun r = run(m, knobs(0));
  EXPECT_EQ(r.shape.slots, 2);  // the head with the tied embedding
  EXPECT_EQ(r.shape.slot_numel, 10000);
  EXPECT_EQ(r.peak_live, 8000 + 2048);
  // Every use fetches: 5 forward, head + embedding, 5 backward.
  EXPECT_EQ(r.fetches, 5 + 2 + 5);
}

TEST(ParamWindowTest, PrefetchBucketWidensTheWindowAndReusesBlocksInIt) {
  const Blocks m = model(4);
  const WindowRun none = run(m, knobs(0));
  const WindowRun one = run(m, knobs(20000));
  const WindowRun all = run(m, knobs(1000000));
  EXPECT_LT(none.shape.slots, one.shape.slots);
  EXPECT_LT(one.shape.slots, all.shape.slots);
  EXPECT_LT(none.peak_live, one.peak_live);
  EXPECT_LT(one.peak_live, all.peak_live);
  // With everything in the window, each block is fetched once per step.
  EXPECT_EQ(all.fetches, int64_t(m.numel.size()));
  EXPECT_EQ(all.peak_live, std::accumulate(m.numel.begin(), m.numel.end(), int64_t(0)));
  // The bucket bounds what is fetched ahead of its use.
  EXPECT_EQ(none.peak_ahead, 0);
  EXPECT_GT(one.peak_ahead, 0);
  EXPECT_LE(one.peak_ahead, 20000);
}

TEST(ParamWindowTest, MaxLiveParametersCapsWhatIsResidentAtOnce) {
  const Blocks m = model(6);
  const WindowRun free = run(m, knobs(1000000));
  const WindowRun capped = run(m, knobs(1000000, 30000));
  EXPECT_LE(capped.peak_live, 30000);
  EXPECT_LT(capped.shape.slots, free.shape.slots);
  EXPECT_GT(capped.fetches, free.fetches);
  // Below one use, the current use is still admitted.
  const WindowRun tiny = run(m, knobs(1000000, 1));
  EXPECT_EQ(tiny.shape.slots, 2);
  EXPECT_EQ(tiny.peak_live, 8000 + 2048);
}

TEST(ParamWindowTest, PersistentBlocksAreFetchedOncePerStepOutsideTheSlots) {
  const Blocks m = model(4);
  const WindowRun r = run(m, knobs(0, 1000000000, /*persist=*/9000), /*accum=*/3);
  // Embedding and head are persistent: 8000 + 2048 elements kept.
  EXPECT_EQ(r.shape.persistent_numel, 8000 + 2048);
  EXPECT_EQ(r.shape.slots, 1);
  // Layers: 4 forward + 3 backward fetches in the first micro-batch (the last
  // layer stays in its slot from forward to backward: the head use between
  // them needs no slot), 3 + 3 in the others (layer 1 also stays, from one
  // micro-batch's backward to the next one's forward, past the persistent
  // embedding); the two persistent blocks once in the step.
  EXPECT_EQ(r.fetches, (4 + 3) + 2 * (3 + 3) + 2);
  const WindowRun none = run(m, knobs(0), 3);
  EXPECT_GT(none.fetches, r.fetches);
}

TEST(ParamWindowTest, ResidentBlocksAreNeverFetched) {
  Blocks m = model(4);
  m.fetched = {0, 1, 0, 1, 0, 0};
  const WindowRun r = run(m, knobs(1000000));
  EXPECT_EQ(r.fetches, 2);
  EXPECT_EQ(r.peak_live, 20000);
  ParamWindow w(m.numel, m.fetched, knobs(0), -1, 2);
  const auto s = train_schedule(StepSchedule::kMicroBatch, int(m.numel.size()), true, 1);
  w.plan({&s});
  w.begin(&s);
  DevicePtr out[2];
  w.acquire(out);  // the embedding: resident, used in place
  EXPECT_FALSE(out[0]);
  w.release();
}

TEST(ParamWindowTest, DeviceCapLimitsSlotsButAdmitsTheCurrentUse) {
  const Blocks m = model(6);
  const int64_t slot_bytes = 10000 * 2;
  const WindowRun capped = run(m, knobs(1000000), 1, 3 * slot_bytes);
  EXPECT_EQ(capped.shape.slots, 3);
  const WindowRun zero = run(m, knobs(1000000), 1, 0);
  EXPECT_EQ(zero.shape.slots, 2);
}

TEST(ParamWindowTest, AccumulationReusesBlockZeroAcrossMicroBatches) {
  const Blocks m = model(2);
  // Bucket of one layer: after block 1's backward the next use is block 0's
  // backward then block 0's forward of the next micro-batch, both in the slot.
  const WindowRun r = run(m, knobs(10000), 2);
  const WindowRun r0 = run(m, knobs(0), 2);
  EXPECT_LT(r.fetches, r0.fetches);
}

}  // namespace
}  // namespace strata
