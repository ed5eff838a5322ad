// The step's numerics options.
// run.recompute (Note [Recompute] in src/engine/trainer.h): keeping the
// forward's graphs trains bit for bit as recomputing does; the plan refuses
// never where the weights move during the step, and auto picks it only where
// they stay and the activations fit.
// fp16 with loss scaling (Note [Loss scaling] in src/engine/loss_scaler.h):
// the scaler follows DeepSpeed's DynamicLossScaler step by step; the trainer
// skips an overflowing step leaving every byte of state as it was (and the
// optimizer step count and schedule where they were), unscales the gradient
// (its norm is fp32's), and stops once the scale is at its minimum. bf16 and
// fp32 still stop on a non-finite norm. Resume of the scaler's state:
// checkpoint_cli_test.
// The trainer's device (Note [The trainer's device]): on a device whose
// memory host code may not touch and whose copies run late unless waited for,
// every placement trains bit for bit as on the CPU device.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <bit>
#include <cmath>
#include <atomic>
#include <chrono>
#include <map>
#include <optional>
#include <thread>
#include <random>

#include "config/config.h"
#include "data/dataset.h"
#include "engine/loss_scaler.h"
#include "engine/lr_schedule.h"
#include "engine/trainer.h"
#include "memory/layout.h"
#include "memory/device.h"
#include "memory/placement.h"
#include "memory/tiered_state.h"
#include "plan/make_plan.h"
#include "model/model.h"
#include "deferred_device.h"
#include "test_util.h"
#include "training_session.h"
#include "util/errors.h"

namespace strata {
namespace {

using testing::TempDir;

// ---- the scaler ---------------------------------------------------------------

struct Expect {
  bool overflow;
  double scale;  // after the update
  int64_t hysteresis_left;
  int64_t since;
};

void run_schedule(LossScaler& s, const std::vector<Expect>& seq) {
  int64_t step = 0;
  for (const Expect& e : seq) {
    s.update(e.overflow, ++step);
    EXPECT_EQ(s.state().scale, e.scale) << "after update " << step;
    EXPECT_EQ(s.state().hysteresis_left, e.hysteresis_left) << "after update " << step;
    EXPECT_EQ(s.state().steps_since_overflow, e.since) << "after update " << step;
  }
}

// run.deterministic makes an op without a deterministic algorithm an error, not
// a warning: LibTorch's attention backwards on a GPU choose their deterministic
// kernels only then (BENCHMARKS.md, "GPU, round 2": with warn_only they did not).
TEST(DeterminismTest, OnMakesANonDeterministicOpAnErrorAndOffLeavesTheDefaults) {
  EXPECT_EQ(apply_determinism(false), "");
  EXPECT_FALSE(at::globalContext().deterministicAlgorithms());
  const std::string line = apply_determinism(true);
  // The environment's own setting wins (":4096:8" otherwise).
  const char* ws = std::getenv("CUBLAS_WORKSPACE_CONFIG");
  ASSERT_NE(ws, nullptr);
  EXPECT_NE(line.find(std::string("CUBLAS_WORKSPACE_CONFIG=") + ws), std::string::npos) << line;
  EXPECT_TRUE(at::globalContext().deterministicAlgorithms());
  EXPECT_FALSE(at::globalContext().deterministicAlgorithmsWarnOnly());
  EXPECT_THROW(at::globalContext().alertNotDeterministic("an op without a deterministic algorithm"), c10::Error);
  at::globalContext().setDeterministicAlgorithms(false, false);  // this process's other tests
}

// Worked by hand from DeepSpeed's DynamicLossScaler.update_scale
// (deepspeed/runtime/fp16/loss_scaler.py): halve when the hysteresis count
// is at 1, else count it down; double every `window` clean steps since the
// last overflow, restoring the count.
TEST(LossScalerTest, DynamicScaleFollowsDeepSpeed) {
  Fp16Config c;
  c.initial_scale_power = 10;
  c.loss_scale_window = 3;
  c.hysteresis = 2;
  c.min_loss_scale = 100;
  LossScaler s(c);
  EXPECT_TRUE(s.dynamic());
  EXPECT_EQ(s.scale(), 1024.0);
  run_schedule(s, {
                      {true, 1024, 1, 0},   // absorbed by the hysteresis
                      {true, 512, 1, 0},    // halves; the count stays at 1
                      {false, 512, 1, 1},
                      {false, 512, 1, 2},
                      {false, 1024, 2, 3},  // 3 clean steps: doubles, count restored
                      {false, 1024, 2, 4},
                      {true, 1024, 1, 0},
                      {false, 1024, 1, 1},  // a clean step does not restore the count
                      {true, 512, 1, 0},
                      {true, 256, 1, 0},
                      {true, 128, 1, 0},
                      {true, 100, 1, 0},    // clamped to min_loss_scale
                  });
  try {
    s.update(true, 13);
    FAIL() << "an overflow at the minimum scale must stop the run";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("step 13"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("fp16.min_loss_scale"), std::string::npos) << e.what();
  }
}

// DeepSpeed stops only at the minimum itself; a scale below it (a resume
// that raised fp16.min_loss_scale) is lifted to it by the next overflow.
TEST(LossScalerTest, ScaleBelowTheMinimumIsLiftedToIt) {
  Fp16Config c;
  c.initial_scale_power = 8;
  c.hysteresis = 1;
  c.min_loss_scale = 1000;
  LossScaler s(c);
  run_schedule(s, {{true, 1000, 1, 0}});
  EXPECT_THROW(s.update(true, 2), Error);
}

TEST(LossScalerTest, ConsecutiveHysteresisCountsOnlyOverflowsInARow) {
  Fp16Config c;
  c.initial_scale_power = 4;
  c.loss_scale_window = 1000;
  c.hysteresis = 2;
  c.consecutive_hysteresis = true;
  LossScaler s(c);
  run_schedule(s, {
                      {true, 16, 1, 0},
                      {false, 16, 2, 1},  // restored by a clean step
                      {true, 16, 1, 0},
                      {true, 8, 1, 0},
                  });
}

TEST(LossScalerTest, StaticScaleNeverMovesAndNeverStops) {
  Fp16Config c;
  c.loss_scale = 128;
  c.min_loss_scale = 128;
  LossScaler s(c);
  EXPECT_FALSE(s.dynamic());
  for (int i = 1; i <= 5; ++i) s.update(true, i);
  for (int i = 6; i <= 2005; ++i) s.update(false, i);
  EXPECT_EQ(s.scale(), 128.0);
}

TEST(LossScalerTest, StateRoundTripsThroughJsonAndBadStateIsRefused) {
  Fp16Config c;
  c.initial_scale_power = 12;
  c.hysteresis = 3;
  LossScaler a(c);
  a.update(true, 1);
  a.update(false, 2);
  LossScaler b(c);
  b.load_json(a.to_json(), "m.json");
  EXPECT_EQ(b.state(), a.state());
  EXPECT_EQ(b.state().hysteresis_left, 2);
  nlohmann::json bad = a.to_json();
  bad["scale"] = -1.0;
  try {
    b.load_json(bad, "ck/manifest.json");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()), "ck/manifest.json: manifest trainer.loss_scale.scale: must be a positive finite number");
  }
  bad = a.to_json();
  bad.erase("steps_since_overflow");
  EXPECT_THROW(b.load_json(bad, "m.json"), InputError);
  EXPECT_EQ(b.state(), a.state()) << "a refused state changes nothing";
}

// ---- the trainer ----------------------------------------------------------------

nlohmann::json base_config(const std::string& data) {
  return {
      {"train_micro_batch_size_per_gpu", 2},
      {"gradient_accumulation_steps", 2},
      {"gradient_clipping", 1.0},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.1}}}}},
      {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", 8}, {"warmup_max_lr", 3e-3},
                                                       {"warmup_type", "linear"}}}}},
      {"zero_optimization", {{"sub_group_size", 20000}}},
      {"model", {{"dim", 64}, {"n_layers", 2}, {"n_heads", 4}, {"n_kv_heads", 2}, {"ffn_hidden", 96},
                 {"seq_len", 32}}},
      {"data", {{"path", data}, {"val_fraction", 0.0}}},
      {"run", {{"steps", 10}, {"seed", 5}, {"threads", 1}}},
  };
}

using Training = testing::TrainingSession;

bool same_state(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!at::equal(a[i], b[i])) return false;
  }
  return true;
}

class StepTest : public ::testing::Test {
 protected:
  void SetUp() override { data_ = dir_.write("text.txt", testing::sample_text(20000)); }
  TempDir dir_;
  std::string data_;
};

// A scale of 2^40 overflows fp16 at the logits' gradient: the first steps
// are skipped. Each leaves master weights, moments and the working copy bit
// for bit as they were, and neither Adam's step count nor the schedule moves;
// the scale follows hysteresis 2. The first clean step then trains with the
// schedule's first learning rate.
TEST_F(StepTest, OverflowingStepsAreSkippedWithoutTouchingState) {
  Training run(base_config(data_), {"fp16={\"enabled\":true,\"initial_scale_power\":40}"});
  ASSERT_NE(run.trainer().loss_scaler(), nullptr);
  const std::vector<at::Tensor> before = run.state();
  const double lr1 = learning_rate(run.cfg().scheduler, run.cfg().optimizer.lr, 1);
  double expected_scale = std::ldexp(1.0, 40);
  int skipped = 0;
  StepResult r;
  for (int s = 1; s <= 40; ++s) {
    r = run.step();
    EXPECT_EQ(r.loss_scale, expected_scale) << "step " << s;
    EXPECT_EQ(r.lr, lr1) << "step " << s;
    EXPECT_TRUE(std::isfinite(r.loss)) << "step " << s;
    EXPECT_EQ(run.trainer().steps_done(), s);
    if (!r.skipped) break;
    ++skipped;
    EXPECT_FALSE(std::isfinite(r.grad_norm));
    EXPECT_EQ(run.trainer().optimizer_steps(), 0) << "step " << s;
    EXPECT_TRUE(same_state(run.state(), before)) << "a skipped step " << s << " changed the state";
    if (s >= 2) expected_scale /= 2;  // hysteresis 2: the first overflow is absorbed
  }
  ASSERT_FALSE(r.skipped) << "the scale never came down far enough";
  EXPECT_GE(skipped, 10);  // 2^40 -> at most 2^31 for this model
  EXPECT_TRUE(std::isfinite(r.grad_norm));
  EXPECT_EQ(run.trainer().optimizer_steps(), 1);
  EXPECT_FALSE(same_state(run.state(), before)) << "the first clean step did not train";
  const StepResult r2 = run.step();
  if (!r2.skipped) {
    EXPECT_EQ(r2.lr, learning_rate(run.cfg().scheduler, run.cfg().optimizer.lr, 2));
    EXPECT_EQ(run.trainer().optimizer_steps(), 2);
  }
}

// The reported gradient norm is the unscaled one: fp16 with a static scale
// of 1024 gives fp32's norm and losses to within fp16's rounding, never
// 1024x off; no step overflows at that scale.
TEST_F(StepTest, GradientIsUnscaledAndTrainingFollowsFp32) {
  Training fp32(base_config(data_), {});
  Training fp16(base_config(data_), {"fp16={\"enabled\":true,\"loss_scale\":1024}"});
  for (int s = 1; s <= 6; ++s) {
    const StepResult a = fp32.step();
    const StepResult b = fp16.step();
    EXPECT_FALSE(b.skipped) << "step " << s;
    EXPECT_EQ(b.loss_scale, 1024.0);
    EXPECT_NEAR(b.grad_norm / a.grad_norm, 1.0, 0.02) << "step " << s;
    EXPECT_NEAR(b.loss / a.loss, 1.0, 0.01) << "step " << s;
  }
  EXPECT_EQ(fp16.trainer().optimizer_steps(), 6);
}

TEST_F(StepTest, OverflowAtTheMinimumScaleStopsTheRun) {
  Training run(base_config(data_),
          {"fp16={\"enabled\":true,\"initial_scale_power\":40,\"hysteresis\":1,\"min_loss_scale\":549755813888}"});
  const StepResult r = run.step();  // 2^40 overflows: halves to the minimum, 2^39
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(run.trainer().loss_scaler()->scale(), std::ldexp(1.0, 39));
  try {
    run.step();
    FAIL() << "an overflow at fp16.min_loss_scale must stop";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp16.min_loss_scale"), std::string::npos) << e.what();
  }
}

// bf16 and fp32 have no loss scale: a non-finite gradient norm stops the run
// with the state unchanged by that step.
TEST_F(StepTest, Bf16AndFp32StopOnANonFiniteNorm) {
  for (const std::vector<std::string>& sets :
       {std::vector<std::string>{"bf16={\"enabled\":true}"}, std::vector<std::string>{}}) {
    nlohmann::json j = base_config(data_);
    j.erase("scheduler");
    j["gradient_clipping"] = 0;
    j["optimizer"]["params"]["lr"] = 1e30;
    Training run(j, sets);
    EXPECT_EQ(run.trainer().loss_scaler(), nullptr);
    bool stopped = false;
    for (int s = 1; s <= 8 && !stopped; ++s) {
      try {
        run.step();
      } catch (const Error& e) {
        stopped = true;
        EXPECT_NE(std::string(e.what()).find("gradient norm is"), std::string::npos) << e.what();
      }
    }
    EXPECT_TRUE(stopped) << (sets.empty() ? "fp32" : "bf16") << " trained on through a non-finite norm";
  }
}

// ---- run.recompute ---------------------------------------------------------------

// Note [Activation placement]: every layer recomputed, every layer's entries
// kept on the device or in host RAM, a mix of the three, and the inputs
// offloaded: the same losses, norms and state bit for bit, in fp32, bf16
// (untied, layer schedule, A = 3) and fp16 (stage 3 with the parameters on
// the host, micro_batch, A = 2).
TEST_F(StepTest, EveryActivationPlacementTrainsBitForBitAsRecompute) {
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{},
        std::vector<std::string>{"bf16={\"enabled\":true}", "model.tie_embeddings=false", "run.schedule=\"layer\"",
                                 "gradient_accumulation_steps=3"},
        std::vector<std::string>{"fp16={\"enabled\":true,\"loss_scale\":1024}", "zero_optimization.stage=3",
                                 "zero_optimization.offload_param.device=cpu", "run.schedule=\"micro_batch\"",
                                 "zero_optimization.stage3_param_persistence_threshold=0"}}) {
    const std::string dtype = extra.empty() ? "fp32" : extra[0].substr(0, 4);
    struct Placement {
      std::vector<std::string> sets;
      // Keeping their entries there: whole layers, and micro-batches of
      // one more (Note [Activation placement]).
      int64_t device, host, device_micro = 0, host_micro = 0;
    };
    const std::vector<Placement> placements = {
        {{"run.recompute=\"always\""}, 0, 0},
        {{"run.recompute=\"never\""}, 2, 0},
        {{"run.recompute=\"never\"", "activation_checkpointing.cpu_checkpointing=true"}, 0, 2},
        {{"run.activations={\"keep_host_layers\":1,\"keep_device_layers\":1}"}, 1, 1},
        {{"run.activations={\"keep_host_layers\":1}", "activation_checkpointing.cpu_checkpointing=true"}, 0, 1},
        {{"run.recompute=\"always\"", "activation_checkpointing.cpu_checkpointing=true"}, 0, 0},
        // Layers split by micro-batch: one pack of layer 0 on the host, its
        // others recomputed, the last layer on the device; the last
        // micro-batch of the last layer on the device; one pack on the host
        // with the others' inputs there too (one host slot per layer under
        // micro_batch, taking both kinds of pack).
        {{"run.activations={\"keep_host_micro_batches\":1,\"keep_device_layers\":1}"}, 1, 0, 0, 1},
        {{"run.activations={\"keep_device_micro_batches\":1}"}, 0, 0, 1, 0},
        {{"run.activations={\"keep_host_micro_batches\":1}", "activation_checkpointing.cpu_checkpointing=true"},
         0, 0, 0, 1},
    };
    std::vector<std::string> ref_sets = extra;
    ref_sets.insert(ref_sets.end(), placements[0].sets.begin(), placements[0].sets.end());
    Training ref(base_config(data_), ref_sets);
    std::vector<StepResult> want;
    for (int s = 1; s <= 3; ++s) want.push_back(ref.step());
    for (size_t i = 1; i < placements.size(); ++i) {
      std::vector<std::string> sets = extra;
      sets.insert(sets.end(), placements[i].sets.begin(), placements[i].sets.end());
      const std::string what = dtype + " " + nlohmann::json(placements[i].sets).dump();
      Training run(base_config(data_), sets);
      const ActivationPlan& a = run.trainer().plan().activations;
      const int64_t A = run.trainer().plan().step.accum;
      ASSERT_EQ(a.keep_device_packs, placements[i].device * A + placements[i].device_micro) << what;
      ASSERT_EQ(a.keep_host_packs, placements[i].host * A + placements[i].host_micro) << what;
      for (int s = 1; s <= 3; ++s) {
        const StepResult r = run.step();
        EXPECT_EQ(r.loss, want[size_t(s - 1)].loss) << what << ", step " << s;
        EXPECT_EQ(r.grad_norm, want[size_t(s - 1)].grad_norm) << what << ", step " << s;
      }
      EXPECT_TRUE(same_state(ref.state(), run.state())) << what;
    }
  }
}

// The plan's activation rows (Note [Activation placement]): one layer's
// entries worked out by hand for base_config's model (dim 64, 4 heads of 16,
// 2 k/v heads, ffn 96, micro-batch 2 x seq 32): x, q, attention output, mid
// 64 values each, k and v 32 each, gate and up 96 each, in the compute dtype;
// two rstd and 4 heads' log-sum-exp in fp32.
TEST_F(StepTest, PlanKeepsWhatFitsAndCountsTheEntriesItKeeps) {
  auto plan = [&](std::vector<std::string> sets, const MachineCapacity& cap) {
    sets.insert(sets.begin(), "run.schedule=\"micro_batch\"");
    const Config cfg = parse_config(base_config(data_), sets);
    const Model model(cfg.model);
    const StateLayout layout(model.layout_specs(), shard_count(cfg));
    return make_plan(cfg, layout, 0, cap);
  };
  const MachineCapacity unlimited;
  const int64_t tokens = 2 * 32;
  const PlacementPlan always = plan({"run.recompute=\"always\""}, unlimited);
  ASSERT_EQ(always.activations.checkpoint_layers, 2);
  EXPECT_EQ(always.activations.recomputed_packs(), 2 * 2);  // 2 layers, 2 micro-batches
  EXPECT_EQ(always.activations.entries_bytes, tokens * ((4 * 64 + 2 * 32 + 2 * 96) * 4 + (2 + 4) * 4));
  const PlacementPlan bf16 = plan({"bf16.enabled=true"}, unlimited);
  EXPECT_EQ(bf16.activations.entries_bytes, tokens * ((4 * 64 + 2 * 32 + 2 * 96) * 2 + (2 + 4) * 4));
  // auto without a budget: every layer keeps its entries; the rows grow by
  // what that adds over the inputs.
  const PlacementPlan kept = plan({}, unlimited);
  EXPECT_EQ(kept.activations.keep_device_packs, 2 * 2);
  EXPECT_EQ(kept.activations.recomputed_packs(), 0);
  const int64_t each = kept.activations.entries_bytes - kept.activations.checkpoint_bytes;
  EXPECT_EQ(kept.activations.bytes, always.activations.bytes + 2 * each);
  // Entries hold no weights: the parameters offloaded change nothing.
  const std::string stage3 = "zero_optimization.stage=3";
  const std::string offload = "zero_optimization.offload_param={\"device\":\"cpu\"}";
  EXPECT_EQ(plan({stage3, offload}, unlimited).activations.keep_device_packs, 2 * 2);
  // auto under a device budget: as many of the last layers as fit (whole
  // layers under micro_batch: a layer's micro-batches are held in turn, so
  // part of one takes the memory of all of it).
  MachineCapacity tight;
  tight.device_is_host = false;
  tight.device_bytes = always.total()[size_t(Tier::kDevice)] + each + each / 2;
  const PlacementPlan one = plan({}, tight);
  EXPECT_EQ(one.activations.keep_device_packs, 2) << one.activations.recompute_choice;
  EXPECT_TRUE(one.activations.keeps_entries(1, 0) && one.activations.keeps_entries(1, 1));
  EXPECT_FALSE(one.activations.keeps_entries(0, 0) || one.activations.keeps_entries(0, 1));
  EXPECT_EQ(one.activations.bytes, always.activations.bytes + each);
  tight.device_bytes = always.total()[size_t(Tier::kDevice)] + each / 2;
  EXPECT_EQ(plan({}, tight).activations.keep_device_packs, 0);
  // Under layer, where every micro-batch's packs are held at once, a
  // micro-batch at a time: room for three packs keeps layer 1's two and
  // layer 0's last micro-batch; the rows grow by three packs.
  const PlacementPlan always_layer = plan({"run.schedule=\"layer\"", "run.recompute=\"always\""}, unlimited);
  tight.device_bytes = always_layer.total()[size_t(Tier::kDevice)] + 3 * each + each / 2;
  const std::string no_homes = "run.activations={\"in_gradient_homes\":false}";
  const PlacementPlan three = plan({"run.schedule=\"layer\"", no_homes}, tight);
  EXPECT_EQ(three.activations.keep_device_packs, 3) << three.activations.recompute_choice;
  EXPECT_TRUE(three.activations.keeps_entries(0, 1) && three.activations.keeps_entries(1, 0));
  EXPECT_FALSE(three.activations.keeps_entries(0, 0));
  EXPECT_EQ(three.activations.lent_packs, 0);
  EXPECT_EQ(three.activations.bytes, always_layer.activations.bytes + 3 * each);
  // Note [Packs in gradient homes]: the same room keeps the fourth pack too,
  // the last, in the gradient homes of the blocks before its layer. By hand,
  // fp32 homes: the embedding's 256 x 64 elements (65,536 bytes), layer 0's
  // 2 x 64 (norms) + 2 x 4096 (q, o) + 2 x 2048 (k, v) + 3 x 6144 (gate,
  // up, down) = 30,848 elements padded to 32,768 (131,072 bytes); a pack
  // (132,608 bytes: a multiple of 512) fits only in layer 1's 196,608.
  const PlacementPlan lent = plan({"run.schedule=\"layer\""}, tight);
  EXPECT_EQ(lent.activations.entries_bytes, 132608);
  EXPECT_EQ(lent.activations.lend_limit, (std::vector<int64_t>{65536, 65536 + 131072}));
  EXPECT_EQ(lent.activations.lent_packs, 1);
  EXPECT_TRUE(lent.activations.lent(1, 1));
  EXPECT_FALSE(lent.activations.lent(1, 0));
  EXPECT_EQ(lent.activations.keep_device_packs, 4) << lent.activations.recompute_choice;
  // The rows hold three packs' entries; the lent one's input is not held apart.
  EXPECT_EQ(lent.activations.bytes, always_layer.activations.bytes + 3 * each - lent.activations.checkpoint_bytes);
  EXPECT_NE(lent.activations.recompute_choice.find("(1 micro-batch of a layer in gradient homes)"), std::string::npos)
      << lent.activations.recompute_choice;
  // Under micro_batch a home is written in the first micro-batch's backward,
  // before the next micro-batch's forward: none lent.
  EXPECT_EQ(plan({}, unlimited).activations.lent_packs, 0);
  // auto on CPU without a device budget: the entries must fit in host RAM.
  MachineCapacity ram;
  ram.host_bytes = always.total()[size_t(Tier::kDevice)] + always.total()[size_t(Tier::kHost)] + each / 2;
  EXPECT_EQ(plan({}, ram).activations.keep_device_packs, 0);
  ram.host_bytes += 2 * each;
  EXPECT_EQ(plan({}, ram).activations.keep_device_packs, 2 * 2);
  // Host: the entries in the host slots, the largest layer's twice on the
  // device; the bound's compute without the recomputed forwards.
  const PlacementPlan host = plan({"run.activations={\"keep_host_layers\":2}"}, unlimited);
  EXPECT_EQ(host.staging.ckpt_host, 2 * host.activations.entries_bytes);
  EXPECT_EQ(host.staging.ckpt_device, 2 * host.activations.entries_bytes);
  EXPECT_EQ(host.activations.host_link_bytes(), 2 * 2 * host.activations.entries_bytes);
  // A micro-batch of a layer on the host: under micro_batch its layer's
  // slot (one pack) and one device slot; under layer three packs of four
  // (spread: all but layer 1's last) and two device slots.
  const int64_t E = host.activations.entries_bytes;
  const PlacementPlan part = plan({"run.activations={\"keep_host_micro_batches\":1}"}, unlimited);
  EXPECT_EQ(part.staging.ckpt_host, E);
  EXPECT_EQ(part.staging.ckpt_device, E);
  EXPECT_EQ(part.activations.host_link_bytes(), E);
  const PlacementPlan part_layer =
      plan({"run.schedule=\"layer\"", "run.activations={\"keep_host_layers\":1,\"keep_host_micro_batches\":1}"},
           unlimited);
  EXPECT_EQ(part_layer.staging.ckpt_host, 3 * E);
  EXPECT_EQ(part_layer.staging.ckpt_device, 2 * E);
  EXPECT_EQ(part_layer.activations.host_link_bytes(), 3 * E);
  EXPECT_EQ(part_layer.activations.recomputed_packs(), 1);
  // A layer's worth of packs on the host, spread over the forwards' order
  // (Note [Activation placement]): under micro_batch (micro-batch by
  // micro-batch) layer 0 of each micro-batch, one host slot; under layer
  // (layer by layer) the first micro-batch of each layer, two slots.
  const std::string one_layer = "run.activations={\"keep_host_layers\":1}";
  const PlacementPlan spread_mb = plan({one_layer}, unlimited);
  EXPECT_TRUE(spread_mb.activations.on_host(0, 0) && spread_mb.activations.on_host(0, 1));
  EXPECT_FALSE(spread_mb.activations.keeps_entries(1, 0) || spread_mb.activations.keeps_entries(1, 1));
  EXPECT_EQ(spread_mb.staging.ckpt_host, E);
  const PlacementPlan spread_layer = plan({"run.schedule=\"layer\"", one_layer}, unlimited);
  EXPECT_TRUE(spread_layer.activations.on_host(0, 0) && spread_layer.activations.on_host(1, 0));
  EXPECT_FALSE(spread_layer.activations.keeps_entries(0, 1) || spread_layer.activations.keeps_entries(1, 1));
  EXPECT_EQ(spread_layer.staging.ckpt_host, 2 * E);
  // Bad run.activations: one line naming the key.
  for (const std::vector<std::string>& sets :
       {std::vector<std::string>{"run.activations={\"keep_host_layers\":3}"},
        std::vector<std::string>{"run.activations={\"keep_host_layers\":1,\"keep_device_layers\":2}"},
        std::vector<std::string>{"run.activations={\"keep_device_layers\":-1}"},
        std::vector<std::string>{"run.activations={\"keep_host_micro_batches\":2}"},  // the step's 2: a layer
        std::vector<std::string>{"run.activations={\"keep_host_layers\":1,\"keep_device_layers\":1,"
                                 "\"keep_device_micro_batches\":1}"},  // 5 of 4 packs
        // Given, even as 0, it fixes the choice: run.recompute must be auto.
        std::vector<std::string>{"run.activations={\"keep_host_micro_batches\":0}", "run.recompute=\"never\""},
        std::vector<std::string>{"run.activations={\"keep_device_layers\":1}", "run.recompute=\"never\""}}) {
    try {
      plan(sets, unlimited);
      FAIL() << sets[0];
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.key().rfind("run.activations", 0), 0u) << e.what();
    }
  }
  EXPECT_THROW(parse_config(base_config(data_), {"run.recompute=\"sometimes\""}), ConfigError);
}

// ---- the trainer's device ------------------------------------------------------

// Note [The trainer's device]: every copy between the device and host code
// goes through the device, ordered and waited for. The deferred device runs
// a copy only when its completion is waited for: a missing wait or ordering
// leaves stale bytes where the step reads (a stale window slot, gradient or
// working copy), and the losses or the state then differ from the CPU
// device's. Placements that take every device path: all on the device (the
// device's Adam), parameters and gradients on the host (H2D window fetches,
// D2H gradients), everything on NVMe with persistent blocks (bounce buffers),
// and three-way splits (pieces on the device beside pieces CPU Adam updates
// with device-tier parts staged); with offloaded activations, in bf16 and
// fp16, and with bf16 moments (whose rounding is keyed by element).
TEST_F(StepTest, ADeviceHostCodeMayNotTouchTrainsBitForBitAsTheCpuDevice) {
  const std::string swap = dir_.path() + "/swap";
  const std::string split = "{\"device\":0.3,\"host\":0.3,\"nvme\":0.4}";
  const std::string nvme = "{\"device\":\"nvme\",\"nvme_path\":\"" + swap + "\"";
  const std::vector<std::vector<std::string>> cases = {
      {},
      {"zero_optimization.stage=3", "zero_optimization.offload_param.device=cpu",
       "zero_optimization.offload_optimizer.device=cpu",
       "zero_optimization.stage3_param_persistence_threshold=0", "activation_checkpointing.cpu_checkpointing=true"},
      {"zero_optimization.stage=3", "zero_optimization.offload_param=" + nvme + ",\"max_in_cpu\":0}", "zero_optimization.offload_optimizer=" + nvme + "}",
       "zero_optimization.stage3_param_persistence_threshold=5000", "bf16.enabled=true"},
      {"placement={\"param16\":" + split + ",\"grad\":" + split + ",\"optimizer\":" + split + ",\"nvme_path\":\"" +
       swap + "\"}", "zero_optimization.stage3_param_persistence_threshold=0"},
      {"placement={\"param16\":{\"device\":0.5,\"host\":0.5},\"grad\":{\"device\":0.7,\"nvme\":0.3},"
       "\"optimizer\":{\"device\":0.6,\"host\":0.4},\"nvme_path\":\"" + swap + "\"}",
       "fp16={\"enabled\":true,\"loss_scale\":1024}", "run.overlap_optimizer=false"},
      // bf16 moments on the device: the device's Adam runs over stretches
      // merged across pieces, keyed as CPU Adam's per-piece runs are.
      {"bf16.enabled=true", "run.optimizer_state_dtype=\"bf16\"", "zero_optimization.sub_group_size=4096"},
  };
  for (const std::vector<std::string>& o : cases) {
    const std::string what = o.empty() ? "all on the device" : nlohmann::json(o).dump();
    Training cpu(base_config(data_), o);
    testing::DeferredDevice dev;
    Training deferred(base_config(data_), o, nullptr, &dev);
    ASSERT_FALSE(deferred.trainer().plan().device_addressable) << what;
    for (int s = 1; s <= 3; ++s) {
      const StepResult a = cpu.step(), b = deferred.step();
      EXPECT_EQ(a.loss, b.loss) << what << ", step " << s;
      EXPECT_EQ(a.grad_norm, b.grad_norm) << what << ", step " << s;
    }
    EXPECT_TRUE(same_state(cpu.state(), deferred.state())) << what;
    EXPECT_GT(dev.copies(), 0u) << what;
  }
}

// ---- run.schedule (Note [Step schedules] in src/memory/schedule.h) --------------

// Every state category, the gradients included, as their bits (a skipped
// fp16 step leaves non-finite gradients, and NaN equals nothing).
std::vector<at::Tensor> all_state(Training& run) {
  std::vector<at::Tensor> out = run.state();
  for (size_t b = 0; b < run.trainer().layout().num_blocks(); ++b) out.push_back(run.trainer().grad_block(b));
  for (at::Tensor& t : out) t = t.view(t.element_size() == 4 ? at::kInt : at::kShort);
  return out;
}

// Note [Packs in gradient homes]: four layers of two micro-batches under
// the layer schedule, every layer's entries kept: the last three packs live
// in the gradient homes of the embedding and layers 0-2 (fp32, 132,608
// bytes each from the homes' start: the embedding's 65,536 bytes, then
// 131,072 per layer, paddings included, layer 2 partly), as the plan says by
// hand; the losses, norms, state and gradients bit for bit as recomputing
// every layer and as keeping the entries apart, on the CPU device and on the
// test device (copies deferred, memory not zeroed), with the optimizer on its
// own thread and inline.
TEST_F(StepTest, PacksInGradientHomesTrainBitForBit) {
  const std::vector<std::string> base = {"model.n_layers=4", "run.schedule=\"layer\""};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), base.begin(), base.end());
    return more;
  };
  Training ref(base_config(data_), with({"run.recompute=\"always\""}));
  std::vector<StepResult> want;
  for (int s = 1; s <= 3; ++s) want.push_back(ref.step());
  const std::vector<at::Tensor> want_state = all_state(ref);
  for (const char* overlap : {"run.overlap_optimizer=true", "run.overlap_optimizer=false"}) {
    for (bool homes : {true, false}) {
      for (bool deferred : {false, true}) {
        std::vector<std::string> sets = with({"run.recompute=\"never\"", overlap});
        if (!homes) sets.push_back("run.activations={\"in_gradient_homes\":false}");
        const std::string what = nlohmann::json(sets).dump() + (deferred ? " on the test device" : "");
        testing::DeferredDevice dev;
        Training run(base_config(data_), sets, nullptr, deferred ? &dev : nullptr);
        const ActivationPlan& a = run.trainer().plan().activations;
        ASSERT_EQ(a.keep_device_packs, 8) << what;
        if (homes) {
          EXPECT_EQ(a.lend_limit, (std::vector<int64_t>{65536, 196608, 327680, 458752})) << what;
          EXPECT_EQ(a.lend_stride, 132608) << what;
          ASSERT_EQ(a.lent_packs, 3) << what;  // 3 x 132,608 = 397,824 <= 458,752; 4 would pass layer 2's
          EXPECT_TRUE(a.lent(2, 1) && a.lent(3, 0) && a.lent(3, 1) && !a.lent(2, 0)) << what;
        } else {
          ASSERT_EQ(a.lent_packs, 0) << what;
        }
        for (int s = 1; s <= 3; ++s) {
          const StepResult r = run.step();
          EXPECT_EQ(r.loss, want[size_t(s - 1)].loss) << what << ", step " << s;
          EXPECT_EQ(r.grad_norm, want[size_t(s - 1)].grad_norm) << what << ", step " << s;
        }
        EXPECT_TRUE(same_state(want_state, all_state(run))) << what;
      }
    }
  }
  // The optimizer behind the backward (Note [Speculative optimizer]): each
  // committed step's commit reads CPU Adam's gradients during the next
  // forward, held back here 30 ms a piece, so the forward reaches the lent
  // packs' saves long before it is done; they wait for it and nothing read
  // is overwritten: the same bits as the inline optimizer.
  Training inline_ref(base_config(data_), with({"run.recompute=\"always\"", "gradient_clipping=0",
                                                "run.overlap_optimizer=false", "optimizer.speculate=\"off\""}));
  Training spec(base_config(data_), with({"run.recompute=\"never\"", "gradient_clipping=0",
                                          "run.overlap_optimizer=true", "optimizer.speculate=\"on\""}));
  ASSERT_TRUE(spec.trainer().plan().optimizer.speculate) << spec.trainer().plan().optimizer.speculate_choice;
  ASSERT_EQ(spec.trainer().plan().activations.lent_packs, 3);
  std::atomic<int> held{0};
  spec.trainer().set_optimizer_piece_hook([&](int kind) {
    if (kind != int(OptimizerThread::Kind::kCommit)) return;
    ++held;
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  });
  std::vector<StepResult> inline_steps;
  for (int s = 1; s <= 3; ++s) inline_steps.push_back(inline_ref.step());
  for (int s = 1; s <= 3; ++s) {
    const StepResult& a = inline_steps[size_t(s - 1)];
    const StepResult b = spec.step_leaving_optimizer();
    EXPECT_EQ(b.speculation, "committed") << "step " << s;
    EXPECT_EQ(a.loss, b.loss) << "step " << s;
    EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << s;
  }
  spec.trainer().finish();
  EXPECT_GT(held.load(), 0);
  EXPECT_TRUE(same_state(all_state(inline_ref), all_state(spec)));
}

// The placements both schedule tests train under (`swap`: the swap
// directory): all on the device; untied bf16 A=3; host offload with
// cpu_checkpointing; NVMe with persistent blocks; a 3-way split untied; a
// mixed split in fp16 with the optimizer inline; fp16 whose first steps
// overflow, gradients on the host, A=4; bf16 moments; every layer's entries
// kept, A=3; a layer's entries in host RAM and the other's on the device, the
// parameters windowed from the host, bf16, A=3.
std::vector<std::vector<std::string>> schedule_matrix(const std::string& swap) {
  const std::string split = "{\"device\":0.3,\"host\":0.3,\"nvme\":0.4}";
  const std::string nvme = "{\"device\":\"nvme\",\"nvme_path\":\"" + swap + "\"";
  return {
      {},
      {"model.tie_embeddings=false", "bf16.enabled=true", "gradient_accumulation_steps=3"},
      {"zero_optimization.stage=3", "zero_optimization.offload_param.device=cpu",
       "zero_optimization.offload_optimizer.device=cpu",
       "zero_optimization.stage3_param_persistence_threshold=0", "activation_checkpointing.cpu_checkpointing=true"},
      {"zero_optimization.stage=3", "zero_optimization.offload_param=" + nvme + ",\"max_in_cpu\":0}",
       "zero_optimization.offload_optimizer=" + nvme + "}", "zero_optimization.stage3_param_persistence_threshold=5000",
       "bf16.enabled=true"},
      {"placement={\"param16\":" + split + ",\"grad\":" + split + ",\"optimizer\":" + split + ",\"nvme_path\":\"" +
       swap + "\"}", "zero_optimization.stage3_param_persistence_threshold=0", "model.tie_embeddings=false"},
      {"placement={\"param16\":{\"device\":0.5,\"host\":0.5},\"grad\":{\"device\":0.7,\"nvme\":0.3},"
       "\"optimizer\":{\"device\":0.6,\"host\":0.4},\"nvme_path\":\"" + swap + "\"}",
       "fp16={\"enabled\":true,\"loss_scale\":1024}", "run.overlap_optimizer=false"},
      {"fp16={\"enabled\":true,\"initial_scale_power\":24}", "gradient_accumulation_steps=4",
       "placement={\"param16\":{\"device\":1},\"grad\":{\"host\":1},\"optimizer\":{\"host\":1}}"},
      {"bf16.enabled=true", "run.optimizer_state_dtype=\"bf16\"", "zero_optimization.sub_group_size=4096"},
      {"run.recompute=\"never\"", "gradient_accumulation_steps=3"},
      // Of the six packs (3 micro-batches), layer 1's last on the device,
      // four of the other five on the host (spread), one recomputed.
      {"run.activations={\"keep_host_layers\":1,\"keep_host_micro_batches\":1,\"keep_device_micro_batches\":1}",
       "gradient_accumulation_steps=3",
       "bf16.enabled=true", "zero_optimization.stage=3", "zero_optimization.offload_param.device=cpu",
       "zero_optimization.stage3_param_persistence_threshold=0"},
  };
}

// Step s of run a (the reference) against b and c (c on the test device):
// the same loss, norm bits and skipped flag.
void expect_same_steps(const StepResult& ra, const StepResult& rb, const StepResult& rc, const std::string& what,
                       int s) {
  EXPECT_EQ(ra.loss, rb.loss) << what << ", step " << s;
  EXPECT_EQ(ra.loss, rc.loss) << what << ", step " << s << " (test device)";
  EXPECT_EQ(std::bit_cast<uint64_t>(ra.grad_norm), std::bit_cast<uint64_t>(rb.grad_norm)) << what << ", step " << s;
  EXPECT_EQ(std::bit_cast<uint64_t>(ra.grad_norm), std::bit_cast<uint64_t>(rc.grad_norm))
      << what << ", step " << s << " (test device)";
  EXPECT_EQ(ra.skipped, rb.skipped) << what << ", step " << s;
  EXPECT_EQ(ra.skipped, rc.skipped) << what << ", step " << s;
}

// The layer schedule trains bit for bit like micro_batch (world size 1):
// losses, norms and every state category, on every placement of
// schedule_matrix, tied and untied, fp32, bf16 and fp16 (with skipped steps), with
// offloaded activations and kept graphs, on the CPU device and on the test
// device (a missing wait or ordering in the new order leaves stale bytes).
TEST_F(StepTest, LayerScheduleTrainsBitForBitAsMicroBatch) {
  const std::vector<std::vector<std::string>> cases = schedule_matrix(dir_.path() + "/swap");
  int skipped = 0;
  for (const std::vector<std::string>& o : cases) {
    const std::string what = o.empty() ? "all on the device" : nlohmann::json(o).dump();
    std::vector<std::string> mb = o, ly = o;
    mb.push_back("run.schedule=\"micro_batch\"");
    ly.push_back("run.schedule=\"layer\"");
    Training a(base_config(data_), mb);
    Training b(base_config(data_), ly);
    testing::DeferredDevice dev;
    Training c(base_config(data_), ly, nullptr, &dev);
    ASSERT_FALSE(a.trainer().plan().step.schedule == StepSchedule::kLayer) << what;
    ASSERT_TRUE(b.trainer().plan().step.schedule == StepSchedule::kLayer) << what;
    ASSERT_TRUE(c.trainer().plan().step.schedule == StepSchedule::kLayer) << what;
    for (int s = 1; s <= 3; ++s) {
      const StepResult ra = a.step(), rb = b.step(), rc = c.step();
      expect_same_steps(ra, rb, rc, what, s);
      skipped += ra.skipped;
    }
    const std::vector<at::Tensor> sa = all_state(a);
    EXPECT_TRUE(same_state(sa, all_state(b))) << what;
    EXPECT_TRUE(same_state(sa, all_state(c))) << what << " (test device)";
  }
  EXPECT_GT(skipped, 0) << "no case skipped a step: the fp16 case no longer overflows";
}

// Note [Speculative optimizer]: the optimizer behind the backward (layer
// schedule, optimizer.speculate on) trains bit for bit like the inline
// optimizer after a micro_batch step: losses, norms, skipped steps and every
// state category, on every placement of the matrix, with gradient clipping
// at a threshold between the steps' norms (so some steps commit their
// speculation and some redo it), without clipping, and with fp16 steps that
// overflow (restored); on the CPU device and on the test device; where
// optimizer state is on NVMe, by both mechanisms (alternate swap slots, and
// two passes with optimizer.speculate_slots false).
TEST_F(StepTest, SpeculativeOptimizerTrainsBitForBitAsTheInlineOptimizer) {
  // The schedule tests' matrix; the speculated runs turn run.overlap_optimizer on.
  const std::vector<std::vector<std::string>> cases = schedule_matrix(dir_.path() + "/swap");
  constexpr int kSteps = 8;  // the fp16 case overflows its first steps
  std::map<std::string, int> outcomes;
  int slot_cases = 0, lent_cases = 0;
  for (const std::vector<std::string>& o : cases) {
    for (bool clip : {true, false}) {
      std::string what = (o.empty() ? "all on the device" : nlohmann::json(o).dump()) + (clip ? ", clipped" : "");
      std::vector<std::string> inline_opt = o;
      inline_opt.insert(inline_opt.end(), {"run.schedule=\"micro_batch\"", "run.overlap_optimizer=false",
                                           "optimizer.speculate=\"off\""});
      std::vector<std::string> spec = o;
      spec.insert(spec.end(), {"run.schedule=\"layer\"", "run.overlap_optimizer=true", "optimizer.speculate=\"on\""});
      double threshold = 0.0;
      if (clip) {
        // Between the smallest and the largest finite norm of an unclipped run.
        Training cal(base_config(data_), inline_opt);
        double lo = INFINITY, hi = 0.0;
        for (int s = 1; s <= kSteps; ++s) {
          const double n = cal.step().grad_norm;
          if (std::isfinite(n)) lo = std::min(lo, n), hi = std::max(hi, n);
        }
        ASSERT_LT(lo, hi) << what;
        threshold = (lo + hi) / 2;
      }
      const std::string clipping = "gradient_clipping=" + std::to_string(threshold);
      inline_opt.push_back(clipping);
      spec.push_back(clipping);
      Training a(base_config(data_), inline_opt);
      Training b(base_config(data_), spec);
      testing::DeferredDevice dev;
      Training c(base_config(data_), spec, nullptr, &dev);
      ASSERT_FALSE(a.trainer().plan().optimizer.speculate) << what;
      ASSERT_TRUE(b.trainer().plan().optimizer.speculate) << what << ": " << b.trainer().plan().optimizer.speculate_choice;
      // Packs in gradient homes the commit reads during the next forward
      // (Note [Packs in gradient homes]).
      if (b.trainer().plan().activations.lent_packs > 0) ++lent_cases;
      // On the test device a piece wholly on the device is the device's
      // Adam's, which waits for the verdict: nothing to speculate when all are.
      const bool c_speculates = c.trainer().plan().optimizer.speculate;
      if (!c_speculates) {
        ASSERT_NE(c.trainer().plan().optimizer.speculate_choice.find("device's Adam"), std::string::npos) << what;
      }
      // Optimizer state on NVMe speculates into alternate swap slots (Note
      // [Alternate swap slots]); d runs the same by two passes.
      std::optional<Training> d;
      if (b.trainer().plan().optimizer.speculate_slots) {
        ++slot_cases;
        EXPECT_GT(speculated_slot_numel(b.trainer().plan()), 0) << what;
        std::vector<std::string> two_pass = spec;
        two_pass.push_back("optimizer.speculate_slots=false");
        d.emplace(base_config(data_), two_pass);
        ASSERT_TRUE(d->trainer().plan().optimizer.speculate && !d->trainer().plan().optimizer.speculate_slots) << what;
      }
      for (int s = 1; s <= kSteps; ++s) {
        const StepResult ra = a.step(), rb = b.step(), rc = c.step();
        expect_same_steps(ra, rb, rc, what, s);
        if (d) {
          const StepResult rd = d->step();
          expect_same_steps(ra, rd, rc, what + ", two passes", s);
          EXPECT_EQ(rd.speculation, rb.speculation) << what << ", step " << s;
        }
        EXPECT_EQ(ra.speculation, "") << what;
        if (c_speculates) {
          EXPECT_EQ(rb.speculation, rc.speculation) << what << ", step " << s;
        }
        const bool clipped = clip && std::isfinite(ra.grad_norm) && ra.grad_norm + 1e-6 > threshold;
        if (ra.skipped) {
          EXPECT_EQ(rb.speculation, "restored") << what << ", step " << s;
        } else if (!clipped) {
          EXPECT_EQ(rb.speculation, "committed") << what << ", step " << s;
        }
        ++outcomes[rb.speculation];
      }
      const std::vector<at::Tensor> sa = all_state(a);
      EXPECT_TRUE(same_state(sa, all_state(b))) << what;
      EXPECT_TRUE(same_state(sa, all_state(c))) << what << " (test device)";
      if (d) {
        EXPECT_TRUE(same_state(sa, all_state(*d))) << what << ", two passes";
      }
    }
  }
  EXPECT_GT(slot_cases, 0) << "no case speculated into alternate swap slots";
  EXPECT_GT(lent_cases, 0) << "no case kept packs in gradient homes";
  EXPECT_GT(outcomes["committed"], 0);
  EXPECT_GT(outcomes["redone"], 0) << "no step was clipped";
  EXPECT_GT(outcomes["restored"], 0) << "no fp16 step overflowed";
}

// Note [Speculative optimizer], the order: on the test device, block b + 1's
// update begins before block b's backward ends (the compute thread, at the
// start of b's first backward, holds until the optimizer's speculation has
// reached b + 1: were the optimizer after the backward, it never would, and
// the hold gives up after 30 s), and after a committed step the working copy
// is final at once (the next forward waits for nothing; only the last
// block's speculation was left at the verdict).
TEST_F(StepTest, EachBlocksUpdateBeginsBeforeTheNextBlocksBackwardEnds) {
  testing::DeferredDevice dev;
  Training t(base_config(data_),
             {"model.n_layers=4", "model.tie_embeddings=false", "zero_optimization.sub_group_size=4096",
              "gradient_accumulation_steps=2",
              "placement={\"param16\":{\"device\":1},\"grad\":{\"host\":1},\"optimizer\":{\"host\":1}}",
              "run.schedule=\"layer\"", "optimizer.speculate=\"on\"", "gradient_clipping=0"},
             nullptr, &dev);
  ASSERT_TRUE(t.trainer().plan().optimizer.speculate) << t.trainer().plan().optimizer.speculate_choice;
  const int64_t blocks = int64_t(t.trainer().layout().num_blocks());
  int held = 0, gave_up = 0;
  t.trainer().set_backward_hook([&](size_t b, int64_t m) {
    if (m != 0 || int64_t(b) + 1 >= blocks) return;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (t.trainer().speculation_reached_block() > int64_t(b) + 1) {
      if (std::chrono::steady_clock::now() > deadline) {
        ++gave_up;
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    ++held;
  });
  for (int s = 1; s <= 2; ++s) {
    const StepResult r = t.step();
    EXPECT_EQ(r.speculation, "committed") << "step " << s;
    EXPECT_GE(t.trainer().optimizer_progress(), t.trainer().plan().state.shard_space_numel)
        << "the working copy is not final after a committed step";
  }
  EXPECT_EQ(gave_up, 0) << "a block's update waited for a later block's backward";
  EXPECT_EQ(held, 2 * (blocks - 1));
}

// optimizer.speculate auto: after kSpeculationRedosToPause redone (clipped)
// steps in a row the next kSpeculationPauseSteps steps run the optimizer
// after the backward, then it speculates again; on stays on. On the test
// device, where auto speculates (a device host code may not touch).
TEST_F(StepTest, AutoSpeculationPausesAfterClippedStepsInARow) {
  for (const char* mode : {"auto", "on"}) {
    testing::DeferredDevice dev;
    Training t(base_config(data_),
               {"gradient_accumulation_steps=2", "run.schedule=\"layer\"", "gradient_clipping=0.0001",
                std::string("optimizer.speculate=\"") + mode + "\"",
                "placement={\"param16\":{\"device\":1},\"grad\":{\"host\":1},\"optimizer\":{\"host\":1}}"},
               nullptr, &dev);
    ASSERT_TRUE(t.trainer().plan().optimizer.speculate) << mode << ": " << t.trainer().plan().optimizer.speculate_choice;
    const int64_t steps = kSpeculationRedosToPause + kSpeculationPauseSteps + 1;
    for (int64_t s = 1; s <= steps; ++s) {
      const std::string got = t.step().speculation;
      const bool paused = std::string(mode) == "auto" && s > kSpeculationRedosToPause &&
                          s <= kSpeculationRedosToPause + kSpeculationPauseSteps;
      EXPECT_EQ(got, paused ? "" : "redone") << mode << ", step " << s;
    }
  }
}

// ---- bytes per link (docs/design.md, "Bytes per link") ----------------------------

// The table of docs/design.md, written out for world size 1 with every
// block fetched once per step (persistent, or kept by the window from its
// first use to its last) and the optimizer inline: what each link must carry in one
// step, from the placement alone. c: bytes of the compute dtype; w_b: the
// bytes a block's gradient crosses PCIe in (4 for fp32 compute and for the
// tied embedding, whose gradient is a real fp32 sum, else c); m: bytes of a
// moment; A: micro-batches.
// Under the layer schedule (Note [Step schedules]) with A > 1 a block's
// gradient lands once per step, its micro-batches' fp32 sum: 4 bytes per
// element, one write of an NVMe home and no read before it.
LinkBytes table_bytes(const PlacementPlan& p, int64_t accum, const ModelConfig& model) {
  LinkBytes e;
  const bool once = (p.step.schedule == StepSchedule::kLayer) && accum > 1;
  const int64_t landings = once ? 1 : accum;
  const int64_t c = p.compute_bytes;
  const int64_t m = p.state.elem_bytes[size_t(Category::kExpAvg)];
  const std::vector<PlacementUnit>& p16 = p.state.units[size_t(Category::kParam16)];
  const std::vector<PlacementUnit>& grad = p.state.units[size_t(Category::kGrad)];
  for (size_t b = 0; b < p16.size(); ++b) {
    const int64_t n = p16[b].numel;
    // The forward's fetch of the working copy (once: persistent).
    if (p16[b].tier == Tier::kHost) e.h2d += c * n;
    if (p16[b].tier == Tier::kNvme) e.nvme_read += c * n, e.h2d += c * n;
    // The backward's gradient, every micro-batch.
    const int64_t w = c == 4 || (p.tied && b == 0) || once ? 4 : c;
    if (grad[b].tier != Tier::kDevice) e.d2h += w * n * landings;
    if (grad[b].tier == Tier::kNvme) e.nvme_write += 4 * n * landings, e.nvme_read += 4 * n * (landings - 1);
  }
  // Activations in host RAM: D2H after the layer's forward and H2D before
  // its backward, per micro-batch; keep_host_packs of them their
  // entries (by hand: x, q, attention output and mid of q_dim = dim values,
  // k and v of kv_heads x head_dim, gate and up of ffn, in the compute dtype;
  // two rstd and a log-sum-exp per head in fp32, per token), the recomputed
  // ones their input with cpu_checkpointing.
  const ModelConfig& mc = model;
  const int64_t tokens = p.activations.checkpoint_bytes / (int64_t(mc.dim) * p.compute_bytes);
  const int64_t entries =
      tokens * ((2 * mc.dim + 2 * mc.q_dim() + 2 * mc.kv_heads() * mc.head_dim() + 2 * mc.ffn_dim()) * p.compute_bytes +
                (2 + mc.n_heads) * 4);
  const int64_t recomputed = p.activations.checkpoint_layers * accum - p.activations.keep_device_packs -
                             p.activations.keep_host_packs;
  const int64_t down = p.activations.keep_host_packs * entries +
                       (p.activations.cpu_checkpointing ? recomputed * p.activations.checkpoint_bytes : 0);
  e.d2h += down;
  e.h2d += down;
  // The optimizer, per pipeline piece: nothing crosses for a piece wholly on
  // the device (the device's Adam); CPU Adam reads what is not in host
  // memory and writes it back.
  auto overlap = [](const PlacementUnit& u, const PlacementUnit& piece) {
    return std::max<int64_t>(0, std::min(u.offset + u.numel, piece.offset + piece.numel) -
                                    std::max(u.offset, piece.offset));
  };
  for (const PlacementUnit& piece : pipeline_pieces(p)) {
    bool all_device = piece.tier == Tier::kDevice;
    for (size_t b = 0; b < p16.size(); ++b) {
      if (overlap(p16[b], piece) > 0 && p16[b].tier != Tier::kDevice) all_device = false;
      if (overlap(grad[b], piece) > 0 && grad[b].tier != Tier::kDevice) all_device = false;
    }
    if (all_device) continue;
    const int64_t state = (4 + 2 * m) * piece.numel;  // master, exp_avg, exp_avg_sq
    if (piece.tier == Tier::kDevice) e.d2h += state, e.h2d += state;
    if (piece.tier == Tier::kNvme) e.nvme_read += state, e.nvme_write += state;
    for (size_t b = 0; b < p16.size(); ++b) {
      const int64_t g = overlap(grad[b], piece), w = overlap(p16[b], piece);
      if (grad[b].tier == Tier::kDevice) e.d2h += 4 * g;
      if (grad[b].tier == Tier::kNvme) e.nvme_read += 4 * g;
      if (p16[b].tier == Tier::kDevice) e.h2d += c * w;
      if (p16[b].tier == Tier::kNvme) e.nvme_write += c * w;
    }
  }
  return e;
}

// Note [Gradient path]: on the test device (a GPU's separate memory) every
// placement of the step test's matrix moves exactly the bytes of the table
// on each link in each step: a byte too many (a gradient crossing in fp32, a
// read-modify-write counted as a copy, a fetch twice) fails.
TEST_F(StepTest, EveryLinkCarriesExactlyTheBytesOfThePlacement) {
  const std::string swap = dir_.path() + "/swap";
  const std::string split = "{\"device\":0.3,\"host\":0.3,\"nvme\":0.4}";
  const std::string nvme = "{\"device\":\"nvme\",\"nvme_path\":\"" + swap + "\"";
  const std::vector<std::string> common = {"run.overlap_optimizer=false"};
  const std::string persistent = "zero_optimization.stage3_param_persistence_threshold=100000000";
  const std::vector<std::vector<std::string>> cases = {
      {"bf16.enabled=true"},
      {"zero_optimization.stage=3", "zero_optimization.offload_param.device=cpu",
       "zero_optimization.offload_optimizer.device=cpu", "bf16.enabled=true", persistent},
      // Windowed blocks, offloaded activations: the window keeps each block
      // from its first use to its last (no limit binds), so each is fetched
      // once a step here too.
      {"zero_optimization.stage=3", "zero_optimization.offload_param.device=cpu",
       "zero_optimization.offload_optimizer.device=cpu", "zero_optimization.stage3_param_persistence_threshold=0",
       "activation_checkpointing.cpu_checkpointing=true"},
      {"zero_optimization.stage=3", "zero_optimization.offload_param=" + nvme + ",\"max_in_cpu\":0}",
       "zero_optimization.offload_optimizer=" + nvme + "}", "bf16.enabled=true", "run.optimizer_state_dtype=\"bf16\"",
       persistent},
      {"placement={\"param16\":" + split + ",\"grad\":" + split + ",\"optimizer\":" + split + ",\"nvme_path\":\"" +
       swap + "\"}", persistent},
      {"placement={\"param16\":{\"device\":0.5,\"host\":0.5},\"grad\":{\"device\":0.7,\"nvme\":0.3},"
       "\"optimizer\":{\"device\":0.6,\"host\":0.4},\"nvme_path\":\"" + swap + "\"}",
       "fp16={\"enabled\":true,\"loss_scale\":1024}", persistent},
      {"placement={\"param16\":{\"device\":1},\"grad\":{\"host\":1},\"optimizer\":{\"host\":1}}", "bf16.enabled=true",
       "model.tie_embeddings=false", "gradient_accumulation_steps=3"},
      // The bit-for-bit test's windows: NVMe with some blocks persistent,
      // the 3-way split with none.
      {"zero_optimization.stage=3", "zero_optimization.offload_param=" + nvme + ",\"max_in_cpu\":0}",
       "zero_optimization.offload_optimizer=" + nvme + "}", "zero_optimization.stage3_param_persistence_threshold=5000",
       "bf16.enabled=true"},
      {"placement={\"param16\":" + split + ",\"grad\":" + split + ",\"optimizer\":" + split + ",\"nvme_path\":\"" +
       swap + "\"}", "zero_optimization.stage3_param_persistence_threshold=0"},
      {"bf16.enabled=true", "run.optimizer_state_dtype=\"bf16\"", "zero_optimization.sub_group_size=4096"},
      // Activations in host RAM (Note [Activation placement]): a layer's
      // entries and the other's input; every layer's entries.
      {"run.activations={\"keep_host_layers\":1}", "activation_checkpointing.cpu_checkpointing=true",
       "bf16.enabled=true"},
      // One pack's entries, the other packs' inputs.
      {"run.activations={\"keep_host_micro_batches\":1}", "activation_checkpointing.cpu_checkpointing=true"},
      {"run.recompute=\"never\"", "activation_checkpointing.cpu_checkpointing=true", "zero_optimization.stage=3",
       "zero_optimization.offload_param.device=cpu", persistent},
  };
  // Every case under both schedules at the config's 2 micro-batches; the
  // cases that home param16 and gradients on every tier (the 3-way split,
  // and gradients on the host beside the device) also at A = 1, 3 and 8.
  struct Run {
    std::vector<std::string> o;
    std::string schedule;
    int64_t accum;
  };
  std::vector<Run> runs;
  for (const std::string schedule : {"micro_batch", "layer"}) {
    for (const std::vector<std::string>& o : cases) runs.push_back({o, schedule, 2});
    for (int64_t a : {1, 3, 8}) {
      runs.push_back({cases[4], schedule, a});
      runs.push_back({cases[6], schedule, a});
    }
  }
  for (Run& k : runs) {
    std::vector<std::string> o = k.o;
    const std::string what = nlohmann::json(o).dump() + ", " + k.schedule + ", A = " + std::to_string(k.accum);
    o.insert(o.end(), common.begin(), common.end());
    o.push_back("run.schedule=\"" + k.schedule + "\"");
    o.push_back("gradient_accumulation_steps=" + std::to_string(k.accum));
    testing::DeferredDevice dev;
    Training run(base_config(data_), o, nullptr, &dev);
    const PlacementPlan& plan = run.trainer().plan();
    ASSERT_EQ(plan.step.schedule == StepSchedule::kLayer, k.schedule == "layer") << what;
    const LinkBytes want = table_bytes(plan, plan.step.accum, run.cfg().model);
    for (int s = 1; s <= 2; ++s) {
      const StepResult r = run.step();
      ASSERT_FALSE(r.skipped) << what;
      EXPECT_EQ(r.links.h2d, want.h2d) << what << ", step " << s;
      EXPECT_EQ(r.links.d2h, want.d2h) << what << ", step " << s;
      EXPECT_EQ(r.links.nvme_read, want.nvme_read) << what << ", step " << s;
      EXPECT_EQ(r.links.nvme_write, want.nvme_write) << what << ", step " << s;
    }
  }
}

// On the CPU device the metrics count what a GPU would move: gradients on
// the host in bf16 cross in 2 bytes per element per micro-batch, the tied
// embedding's (a real fp32 sum) in 4.
// Under the layer schedule each block's three micro-batches are summed on
// the device and cross once, in fp32.
TEST_F(StepTest, OnTheCpuDeviceHostGradientsCrossInTheComputeDtype) {
  for (const std::string schedule : {"micro_batch", "layer"}) {
    Training run(base_config(data_), {"bf16.enabled=true", "gradient_accumulation_steps=3",
                                      "run.schedule=\"" + schedule + "\"",
                                      "placement={\"param16\":{\"device\":1},\"grad\":{\"host\":1},\"optimizer\":{\"host\":1}}"});
    const PlacementPlan& plan = run.trainer().plan();
    ASSERT_TRUE(plan.tied);
    int64_t want = 0;
    for (size_t b = 0; b < plan.state.units[size_t(Category::kGrad)].size(); ++b) {
      const int64_t n = plan.state.units[size_t(Category::kGrad)][b].numel;
      want += schedule == "layer" ? 4 * n : (b == 0 ? 4 : 2) * n * 3;
    }
    for (int s = 1; s <= 2; ++s) EXPECT_EQ(run.step().links.d2h, want) << schedule << ", step " << s;
  }
}

// Note [Gradient path]: adds of landed gradients into host and NVMe homes
// (and their norms) run on the lander, never on the thread that queues the
// compute.
TEST_F(StepTest, HostArithmeticOnLandedGradientsRunsOffTheComputeThread) {
  const std::string swap = dir_.path() + "/swap";
  for (const std::string schedule : {"micro_batch", "layer"}) {
    testing::DeferredDevice dev;
    Training run(base_config(data_),
                 {"bf16.enabled=true", "run.schedule=\"" + schedule + "\"",
                  "placement={\"param16\":{\"device\":1},\"grad\":{\"host\":0.5,\"nvme\":0.5},"
                  "\"optimizer\":{\"host\":1},\"nvme_path\":\"" + swap + "\"}"},
                 nullptr, &dev);
    for (int s = 1; s <= 2; ++s) run.step();
    const GradientPath::LanderStats st = run.trainer().lander_stats();
    // steps x landings per step (micro_batch: one per micro-batch; layer: one) x blocks
    EXPECT_EQ(st.adds, 2 * (schedule == "layer" ? 1 : 2) * int64_t(run.trainer().layout().num_blocks())) << schedule;
    EXPECT_EQ(st.adds_on_compute_thread, 0) << schedule;
  }
}

// Placement independence on a device with memory of its own: with clipping
// active (the coefficient below 1 on some steps), every placement trains bit
// for bit as all state on the device does, on the test device as on the CPU
// device; the norm is summed in one order wherever the gradient lives (Note
// [Ordered norm] in cpu_adam/grad_ops.h).
TEST_F(StepTest, WithClippingThePlacementChangesNothingOnADeviceOfItsOwn) {
  const std::string swap = dir_.path() + "/swap";
  const std::string split = "{\"device\":0.3,\"host\":0.3,\"nvme\":0.4}";
  const std::vector<std::string> dtype = {"bf16.enabled=true", "gradient_clipping=0.5"};
  const std::vector<std::vector<std::string>> placements = {
      {"zero_optimization.stage=3", "zero_optimization.offload_param.device=cpu",
       "zero_optimization.offload_optimizer.device=cpu", "zero_optimization.stage3_param_persistence_threshold=0"},
      {"placement={\"param16\":" + split + ",\"grad\":" + split + ",\"optimizer\":" + split + ",\"nvme_path\":\"" +
       swap + "\"}"},
      {"placement={\"param16\":{\"device\":1},\"grad\":{\"device\":0.5,\"host\":0.5},\"optimizer\":{\"device\":1}}"},
  };
  testing::DeferredDevice ref_dev;
  Training ref(base_config(data_), dtype, nullptr, &ref_dev);
  std::vector<StepResult> want;
  bool clipped = false;
  for (int s = 1; s <= 3; ++s) {
    want.push_back(ref.step());
    clipped |= want.back().grad_norm > 0.5;
  }
  ASSERT_TRUE(clipped) << "no step had its gradient clipped";
  const std::vector<at::Tensor> want_state = ref.state();
  for (std::vector<std::string> o : placements) {
    const std::string what = nlohmann::json(o).dump();
    o.insert(o.end(), dtype.begin(), dtype.end());
    testing::DeferredDevice dev;
    Training run(base_config(data_), o, nullptr, &dev);
    for (int s = 1; s <= 3; ++s) {
      const StepResult r = run.step();
      EXPECT_EQ(r.loss, want[size_t(s - 1)].loss) << what << ", step " << s;
      EXPECT_EQ(r.grad_norm, want[size_t(s - 1)].grad_norm) << what << ", step " << s;
    }
    EXPECT_TRUE(same_state(run.state(), want_state)) << what;
  }
}

// Note [Registered buffers] in nvme/engine.h: every NVMe read and write of a
// training step goes through a buffer registered with the I/O engine (as
// `strata bench-io` measures), on the CPU device and on one host code may
// not touch (where NVMe blocks go through bounce and landing buffers).
TEST_F(StepTest, NvmeTrafficOfAStepUsesRegisteredBuffers) {
  {
    nvme::IoEngine probe{nvme::EngineOptions()};
    if (std::string(probe.backend_name()) != "io_uring" || geteuid() != 0) {
      GTEST_SKIP() << "needs io_uring and root (RLIMIT_MEMLOCK limits registration otherwise)";
    }
  }
  const std::string swap = dir_.path() + "/swap";
  const std::string split = "{\"device\":0.3,\"host\":0.3,\"nvme\":0.4}";
  const std::string nvme = "{\"device\":\"nvme\",\"nvme_path\":\"" + swap + "\"";
  const std::vector<std::vector<std::string>> cases = {
      {"zero_optimization.stage=3", "zero_optimization.offload_param=" + nvme + ",\"max_in_cpu\":0}",
       "zero_optimization.offload_optimizer=" + nvme + "}", "zero_optimization.stage3_param_persistence_threshold=5000",
       "bf16.enabled=true"},
      {"placement={\"param16\":" + split + ",\"grad\":" + split + ",\"optimizer\":" + split + ",\"nvme_path\":\"" +
       swap + "\"}", "zero_optimization.stage3_param_persistence_threshold=0"},
  };
  for (const std::vector<std::string>& o : cases) {
    for (const bool deferred : {false, true}) {
      const std::string what = nlohmann::json(o).dump() + (deferred ? " on the test device" : " on the CPU");
      testing::DeferredDevice dev;
      Training run(base_config(data_), o, nullptr, deferred ? &dev : nullptr);
      const nvme::EngineStats before = run.trainer().state().io_stats();
      for (int s = 1; s <= 2; ++s) run.step();
      const nvme::EngineStats after = run.trainer().state().io_stats();
      const int64_t ops = after.read_ops + after.write_ops - before.read_ops - before.write_ops;
      EXPECT_GT(after.read_ops - before.read_ops, 0) << what;
      EXPECT_GT(after.write_ops - before.write_ops, 0) << what;
      EXPECT_EQ(after.fixed_buffer_ops - before.fixed_buffer_ops, ops) << what;
    }
  }
}

// Note [Bounce copies ahead] in param_window.cc: on a device host code may
// not touch, the H2D copies of NVMe blocks whose reads have finished start at
// an earlier block's acquire, not at their own (the bit-for-bit test above
// shows they are ordered right).
TEST_F(StepTest, BounceCopiesOfNvmeBlocksStartBeforeTheirAcquire) {
  const std::string nvme = "{\"device\":\"nvme\",\"nvme_path\":\"" + dir_.path() + "/swap\"";
  testing::DeferredDevice dev;
  Training run(base_config(data_),
               {"zero_optimization.stage=3", "zero_optimization.offload_param=" + nvme + ",\"max_in_cpu\":0}",
                "zero_optimization.stage3_param_persistence_threshold=0"},
               nullptr, &dev);
  for (int s = 1; s <= 2; ++s) run.step();
  const ParamWindow& w = run.trainer().window();
  EXPECT_GT(w.bounce_copies(), 0);
  EXPECT_GT(w.early_bounce_copies(), 0);
  EXPECT_LE(w.early_bounce_copies(), w.bounce_copies());
}

// On a GPU (skipped, with the reason, without one): the same placements
// train as on the CPU device, within the rounding of LibTorch's CUDA kernels
// (its reductions and matmuls sum in another order than the CPU's; the HBM
// pieces' Adam is the CPU's bit for bit, kernels_test).
TEST_F(StepTest, OnAGpuEveryPlacementTrainsAsOnTheCpuWithinRounding) {
  if (!built_with_cuda()) GTEST_SKIP() << "this build has no CUDA path";
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  const std::string swap = dir_.path() + "/swap";
  const std::string split = "{\"device\":0.3,\"host\":0.3,\"nvme\":0.4}";
  const std::string nvme = "{\"device\":\"nvme\",\"nvme_path\":\"" + swap + "\"";
  const std::vector<std::pair<std::vector<std::string>, double>> cases = {
      {{}, 1e-4},
      {{"zero_optimization.stage=3", "zero_optimization.offload_param.device=cpu",
        "zero_optimization.offload_optimizer.device=cpu", "activation_checkpointing.cpu_checkpointing=true"},
       1e-4},
      {{"zero_optimization.stage=3", "zero_optimization.offload_param=" + nvme + ",\"max_in_cpu\":0}",
        "zero_optimization.offload_optimizer=" + nvme + "}", "zero_optimization.stage3_param_persistence_threshold=5000",
        "bf16.enabled=true"},
       2e-2},
      {{"placement={\"param16\":" + split + ",\"grad\":" + split + ",\"optimizer\":" + split + ",\"nvme_path\":\"" +
        swap + "\"}", "zero_optimization.stage3_param_persistence_threshold=0"},
       1e-4},
      // Every layer's entries kept (run.recompute never), the working copy on
      // the device.
      {{"run.recompute=\"never\"", "placement={\"param16\":{\"device\":1},\"grad\":" + split +
        ",\"optimizer\":" + split + ",\"nvme_path\":\"" + swap + "\"}"},
       1e-4},
      {{"fp16={\"enabled\":true,\"loss_scale\":1024}"}, 2e-2},
  };
  for (const auto& [o, tol] : cases) {
    const std::string what = o.empty() ? "all on the device" : nlohmann::json(o).dump();
    Training cpu(base_config(data_), o);
    std::vector<std::string> on_gpu = o;
    on_gpu.push_back("run.device=\"cuda\"");
    Training gpu(base_config(data_), on_gpu);
    EXPECT_FALSE(gpu.trainer().plan().device_addressable) << what;
    for (int s = 1; s <= 3; ++s) {
      const StepResult a = cpu.step(), b = gpu.step();
      EXPECT_NEAR(b.loss / a.loss, 1.0, tol) << what << ", step " << s;
      EXPECT_NEAR(b.grad_norm / a.grad_norm, 1.0, 10 * tol) << what << ", step " << s;
    }
  }
}

// The optimizer behind the backward on a GPU (Note [Speculative optimizer]),
// with run.deterministic: the layer schedule with optimizer.speculate on
// trains bit for bit as the inline optimizer after a micro_batch step on
// the same GPU (losses, norms, every state category), CPU Adam's pieces in
// RAM and on NVMe (alternate swap slots), clipping at a threshold between
// the steps' norms so that some speculations are committed and some redone.
// A missing wait between the GPU's streams and the optimizer's thread shows
// as a difference; the test device cannot show what the GPU's own streams do.
TEST_F(StepTest, OnAGpuTheOptimizerBehindTheBackwardTrainsAsTheInlineOptimizer) {
  if (!built_with_cuda()) GTEST_SKIP() << "this build has no CUDA path";
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  const std::string swap = dir_.path() + "/swap";
  const std::string split = "{\"device\":0.3,\"host\":0.3,\"nvme\":0.4}";
  const std::vector<std::vector<std::string>> cases = {
      {"placement={\"param16\":{\"device\":1},\"grad\":{\"device\":1},\"optimizer\":{\"host\":1}}"},
      {"placement={\"param16\":{\"device\":1},\"grad\":{\"host\":1},\"optimizer\":{\"nvme\":1},\"nvme_path\":\"" +
       swap + "\"}"},
      {"bf16.enabled=true", "zero_optimization.stage3_param_persistence_threshold=0",
       "placement={\"param16\":" + split + ",\"grad\":" + split + ",\"optimizer\":" + split + ",\"nvme_path\":\"" +
           swap + "\"}"},
  };
  constexpr int kSteps = 6;
  std::map<std::string, int> outcomes;
  for (const std::vector<std::string>& o : cases) {
    const std::string what = nlohmann::json(o).dump();
    std::vector<std::string> inline_opt = o, spec = o;
    for (auto* v : {&inline_opt, &spec}) v->insert(v->end(), {"run.device=\"cuda\"", "run.deterministic=true"});
    inline_opt.insert(inline_opt.end(), {"run.schedule=\"micro_batch\"", "run.overlap_optimizer=false",
                                         "optimizer.speculate=\"off\""});
    spec.insert(spec.end(), {"run.schedule=\"layer\"", "run.overlap_optimizer=true", "optimizer.speculate=\"on\""});
    double lo = INFINITY, hi = 0.0;
    {
      Training cal(base_config(data_), inline_opt);
      for (int s = 1; s <= kSteps; ++s) {
        const double n = cal.step().grad_norm;
        lo = std::min(lo, n), hi = std::max(hi, n);
      }
    }
    ASSERT_LT(lo, hi) << what;
    const double threshold = (lo + hi) / 2;
    inline_opt.push_back("gradient_clipping=" + std::to_string(threshold));
    spec.push_back("gradient_clipping=" + std::to_string(threshold));
    Training a(base_config(data_), inline_opt);
    Training b(base_config(data_), spec);
    ASSERT_TRUE(b.trainer().plan().optimizer.speculate) << what << ": " << b.trainer().plan().optimizer.speculate_choice;
    for (int s = 1; s <= kSteps; ++s) {
      const StepResult ra = a.step(), rb = b.step();
      EXPECT_EQ(ra.loss, rb.loss) << what << ", step " << s;
      EXPECT_EQ(std::bit_cast<uint64_t>(ra.grad_norm), std::bit_cast<uint64_t>(rb.grad_norm)) << what << ", step " << s;
      ++outcomes[rb.speculation];
    }
    EXPECT_TRUE(same_state(all_state(a), all_state(b))) << what;
  }
  EXPECT_GT(outcomes["committed"], 0);
  EXPECT_GT(outcomes["redone"], 0) << "no step was clipped";
}

}  // namespace
}  // namespace strata
