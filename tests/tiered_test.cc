// Tiered placement changes bytes, never arithmetic: the same model and data
// trained with its state on different tiers gives bit-identical losses and
// final parameters (fp32). Also: the device budget holds with parameters on
// NVMe, and per-link byte counts follow the placement.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "config/config.h"
#include "data/dataset.h"
#include "engine/trainer.h"
#include "model/model.h"
#include "plan/make_plan.h"
#include "test_util.h"
#include "nvme/fault_backend.h"
#include "util/errors.h"
#include "util/fs.h"

namespace strata {
namespace {

// Largest relative difference of a step's loss with bf16 moments against fp32
// moments over the 10 steps of base_config: measured 2.4e-5 (2026-11-23).
constexpr double kBf16MomentLossTolerance = 1e-3;

struct TrainRun {
  std::vector<double> losses;
  std::vector<at::Tensor> master;  // per block, after the last step
  std::array<int64_t, kNumTiers> peak{};
  LinkBytes links;                 // summed over steps
  StateBytes bytes;
  int window_slots_planned = 0, window_slots_used = 0;
  int64_t window_fetches = 0;
  int64_t checkpoint_device = 0;   // peak saved-input bytes on the device
  std::vector<LinkBytes> step_links;  // as each StepResult reported them
};

nlohmann::json base_config(const std::string& data) {
  return {
      {"train_micro_batch_size_per_gpu", 2},
      {"gradient_accumulation_steps", 2},
      {"gradient_clipping", 0.5},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.1}}}}},
      {"zero_optimization", {{"sub_group_size", 20000}}},
      {"model", {{"dim", 64}, {"n_layers", 2}, {"n_heads", 4}, {"n_kv_heads", 2}, {"ffn_hidden", 96},
                 {"seq_len", 32}}},
      {"data", {{"path", data}, {"val_fraction", 0.0}}},
      {"run", {{"steps", 10}, {"seed", 11}}},
  };
}

TrainRun train(const nlohmann::json& j, const std::vector<std::string>& overrides, int steps = 10) {
  Config cfg = parse_config(j, overrides);
  Model model(cfg.model);
  Trainer trainer(cfg, model);
  TokenDataset data(cfg.data.paths, TokenFormat::kText, 256, cfg.model.seq_len, 0.0);
  const int64_t n = cfg.gradient_accumulation_steps * cfg.train_micro_batch_size_per_gpu;
  std::vector<int64_t> batch(size_t(n * (cfg.model.seq_len + 1)));
  std::mt19937_64 rng(5);
  TrainRun r;
  const LinkBytes links0 = trainer.state().links();  // after initialisation
  for (int s = 0; s < steps; ++s) {
    data.sample_train(rng, n, batch.data());
    StepResult sr = trainer.step(batch.data());
    r.losses.push_back(sr.loss);
    r.step_links.push_back(sr.links);
  }
  // With the optimizer overlapped, the last step's swapping ends in finish().
  trainer.finish();
  const LinkBytes links1 = trainer.state().links();
  r.links = {links1.h2d - links0.h2d, links1.d2h - links0.d2h, links1.nvme_read - links0.nvme_read,
             links1.nvme_write - links0.nvme_write};
  for (size_t b = 0; b < trainer.layout().num_blocks(); ++b) r.master.push_back(trainer.master_block(b));
  r.peak = trainer.peak_bytes();
  r.bytes = trainer.state_bytes();
  r.window_slots_planned = trainer.plan().staging.window.slots;
  r.window_slots_used = trainer.window().peak_slots();
  r.window_fetches = trainer.window().fetches();
  r.checkpoint_device = trainer.peak_checkpoint_device_bytes();
  return r;
}

void expect_identical(const TrainRun& a, const TrainRun& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << what << " step " << i + 1;
  ASSERT_EQ(a.master.size(), b.master.size());
  for (size_t i = 0; i < a.master.size(); ++i) EXPECT_TRUE(at::equal(a.master[i], b.master[i])) << what << " block " << i;
}

class TieredTest : public ::testing::Test {
 protected:
  void SetUp() override {
    data_ = dir_.write("text.txt", testing::sample_text(20000));
    swap_ = dir_.file("swap");
    mkdir(swap_.c_str(), 0700);
    baseline_ = train(base_config(data_), {});
  }
  testing::TempDir dir_;
  std::string data_, swap_;
  TrainRun baseline_;
};

TEST_F(TieredTest, BaselineLearnsAndMovesNothing) {
  EXPECT_LT(baseline_.losses.back(), baseline_.losses.front() - 0.3);
  EXPECT_EQ(baseline_.links.h2d + baseline_.links.d2h + baseline_.links.nvme_read + baseline_.links.nvme_write, 0);
}

TEST_F(TieredTest, OptimizerOnHostIsBitIdentical) {
  TrainRun r = train(base_config(data_), {"zero_optimization.offload_optimizer.device=cpu"});
  expect_identical(baseline_, r, "optimizer on host");
  EXPECT_GT(r.links.d2h, 0);  // gradients flushed to the host tier
  EXPECT_EQ(r.links.nvme_read + r.links.nvme_write, 0);
}

TEST_F(TieredTest, OptimizerOnNvmeIsBitIdentical) {
  TrainRun r = train(base_config(data_), {"zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"" + swap_ + "\"}"});
  expect_identical(baseline_, r, "optimizer on nvme");
  // Every step reads and writes master, exp_avg and exp_avg_sq once.
  const int64_t state = r.bytes.master + r.bytes.optimizer;
  EXPECT_EQ(r.links.nvme_read, 10 * state);
  EXPECT_EQ(r.links.nvme_write, 10 * state);
}

TEST_F(TieredTest, ThreeWaySplitOfEveryCategoryIsBitIdentical) {
  const std::string split = "{\"device\":0.2,\"host\":0.3,\"nvme\":0.5}";
  TrainRun r = train(base_config(data_),
                {"placement={\"param16\":" + split + ",\"grad\":" + split + ",\"master\":" + split +
                 ",\"exp_avg\":" + split + ",\"exp_avg_sq\":" + split + ",\"nvme_path\":\"" + swap_ + "\"}"});
  expect_identical(baseline_, r, "20/30/50 split");
  EXPECT_GT(r.links.h2d, 0);
  EXPECT_GT(r.links.nvme_read, 0);
  EXPECT_GT(r.peak[int(Tier::kDevice)], 0);
  EXPECT_LT(r.peak[int(Tier::kDevice)], baseline_.peak[int(Tier::kDevice)]);
}

// The optimizer pipeline's depth (offload_optimizer.buffer_count, Note
// [Optimizer pipeline]) changes the staging memory, never the results.
TEST_F(TieredTest, OptimizerPipelineDepthChangesStagingNotResults) {
  const std::string nv = "{\"device\":\"nvme\",\"nvme_path\":\"" + swap_ + "\",\"buffer_count\":";
  TrainRun seq = train(base_config(data_), {"zero_optimization.offload_optimizer=" + nv + "1}"}, 4);
  // buffer_count 3 -> 8 sets (the least above 1), 10 -> 10: reads run 6 and 8 pieces ahead.
  TrainRun deep = train(base_config(data_), {"zero_optimization.offload_optimizer=" + nv + "3}"}, 4);
  TrainRun deeper = train(base_config(data_), {"zero_optimization.offload_optimizer=" + nv + "10}"}, 4);
  expect_identical(seq, deep, "pipeline depth 1 vs 8");
  expect_identical(seq, deeper, "pipeline depth 1 vs 10");
  for (size_t i = 0; i < seq.losses.size(); ++i) EXPECT_EQ(seq.losses[i], baseline_.losses[i]);
  const int64_t group = 20480 * 4 * 3;  // one staging set: master, exp_avg, exp_avg_sq of a sub-group
  EXPECT_EQ(deep.peak[int(Tier::kHost)] - seq.peak[int(Tier::kHost)], 7 * group);
  EXPECT_EQ(deeper.peak[int(Tier::kHost)] - seq.peak[int(Tier::kHost)], 9 * group);
}

// `strata plan`'s numbers (state + staging per tier; activations are an
// estimate of LibTorch's allocations and not measured) agree with what a run
// allocates within 10%.
TEST_F(TieredTest, PlanAgreesWithMeasuredAccounting) {
  const std::string split = "{\"device\":0.2,\"host\":0.3,\"nvme\":0.5}";
  for (const std::vector<std::string>& o : std::vector<std::vector<std::string>>{
           {},
           {"zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"" + swap_ + "\"}"},
           {"placement={\"param16\":" + split + ",\"grad\":" + split + ",\"optimizer\":" + split +
            ",\"nvme_path\":\"" + swap_ + "\"}", "bf16.enabled=true"},
           {"zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"" + swap_ + "\"}",
            "run.optimizer_state_dtype=\"bf16\""}}) {
    Config cfg = parse_config(base_config(data_), o);
    Model model(cfg.model);
    Trainer trainer(cfg, model);
    const PlacementPlan& plan = trainer.plan();
    auto planned = plan.total();
    planned[int(Tier::kDevice)] -= plan.activations.bytes;  // LibTorch's, not measured
    const auto measured = trainer.peak_bytes();
    for (int t = 0; t < kNumTiers; ++t) {
      EXPECT_NEAR(double(measured[t]), double(planned[t]), 0.1 * double(planned[t]))
          << tier_name(Tier(t)) << " with " << (o.empty() ? "defaults" : nlohmann::json(o).dump());
    }
  }
}

TEST_F(TieredTest, ParametersOnNvmeWithDeviceBudgetSmallerThanTheModel) {
  const std::vector<std::string> o = {
      "zero_optimization.stage=3",
      "zero_optimization.offload_param={\"device\":\"nvme\",\"nvme_path\":\"" + swap_ + "\",\"max_in_cpu\":0}",
      "zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"" + swap_ + "\"}",
      "run.device_memory_mb=1"};
  TrainRun r = train(base_config(data_), o);
  expect_identical(baseline_, r, "parameters on nvme");
  const int64_t model_state = r.bytes.total();
  EXPECT_GT(model_state, int64_t(1) << 20);                 // the model does not fit the budget...
  EXPECT_LE(r.peak[int(Tier::kDevice)], int64_t(1) << 20);  // ...and the device stays within it
  EXPECT_GT(r.links.nvme_read, 10 * r.bytes.param16);       // parameters streamed every pass
}

// run.optimizer_state_dtype = bf16 (Note [bf16 state]): the moments take half
// the bytes wherever they live or move; their rounding is keyed by the
// model-wide element index, so placement changes nothing; training stays
// close to fp32 moments without being equal to it.
TEST_F(TieredTest, Bf16MomentsHalveTheirBytesAndDoNotDependOnPlacement) {
  const std::string bf = "run.optimizer_state_dtype=\"bf16\"";
  const std::string split = "{\"device\":0.2,\"host\":0.3,\"nvme\":0.5}";
  TrainRun dev = train(base_config(data_), {bf});
  TrainRun nv = train(base_config(data_), {bf, "zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"" +
                                                   swap_ + "\",\"buffer_count\":1}"});
  TrainRun sp = train(base_config(data_), {bf, "placement={\"master\":" + split + ",\"exp_avg\":" + split +
                                                   ",\"exp_avg_sq\":" + split + ",\"nvme_path\":\"" + swap_ + "\"}"});
  expect_identical(dev, nv, "bf16 moments on nvme");
  expect_identical(dev, sp, "bf16 moments split");
  EXPECT_EQ(2 * dev.bytes.optimizer, baseline_.bytes.optimizer);
  EXPECT_EQ(dev.bytes.master, baseline_.bytes.master);
  // Every step reads and writes master (4 bytes) and both moments (2 + 2) once.
  EXPECT_EQ(nv.links.nvme_read, 10 * (nv.bytes.master + nv.bytes.optimizer));
  EXPECT_EQ(nv.links.nvme_write, 10 * (nv.bytes.master + nv.bytes.optimizer));
  EXPECT_EQ(nv.bytes.optimizer, nv.bytes.master);  // 2 + 2 bytes per element against 4
  bool master_differs = false;
  for (size_t b = 0; b < dev.master.size(); ++b) master_differs |= !at::equal(dev.master[b], baseline_.master[b]);
  EXPECT_TRUE(master_differs) << "the setting must be in effect";
  double worst = 0;
  for (size_t i = 0; i < dev.losses.size(); ++i) {
    worst = std::max(worst, std::fabs(dev.losses[i] - baseline_.losses[i]) / baseline_.losses[i]);
  }
  EXPECT_LT(worst, kBf16MomentLossTolerance) << "largest relative loss difference to fp32 moments";
}

TEST_F(TieredTest, Bf16WithOptimizerOnNvmeMatchesBf16OnDevice) {
  TrainRun dev = train(base_config(data_), {"bf16.enabled=true"}, 5);
  TrainRun nv = train(base_config(data_), {"bf16.enabled=true",
                                      "zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"" + swap_ + "\"}"}, 5);
  expect_identical(dev, nv, "bf16 optimizer on nvme");
}

TEST_F(TieredTest, DeviceBudgetTooSmallForResidentStateIsRejectedWithNumbers) {
  try {
    train(base_config(data_), {"run.device_memory_mb=1"}, 1);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("exceeds the budget of 1.0 MiB"), std::string::npos) << e.what();
  }
}

// A fault in the middle of an optimizer swap stops training with a clear error
// (path, errno), and no swap file survives the trainer.
void expect_swap_fault_is_reported(const std::string& data, const std::string& swap, nvme::FaultKind kind,
                                   const std::string& errno_text, bool overlap) {
  Config cfg = parse_config(base_config(data), {"zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"" + swap + "\"}",
                                                std::string("run.overlap_optimizer=") + (overlap ? "true" : "false")});
  Model model(cfg.model);
  auto faults = std::make_shared<nvme::FaultPlan>();
  faults->kind = kind;
  faults->only_op = int(nvme::IoOp::kWrite);
  faults->first_op = int64_t(1) << 60;  // none while the state is initialised
  {
    Trainer trainer(cfg, model, faults);
    // The first optimizer step writes master, exp_avg, exp_avg_sq per
    // sub-group: fail the second of those writes.
    faults->first_op = faults->seen.load() + 2;
    TokenDataset ds(cfg.data.paths, TokenFormat::kText, 256, cfg.model.seq_len, 0.0);
    std::vector<int64_t> batch(size_t(4 * (cfg.model.seq_len + 1)));
    std::mt19937_64 rng(1);
    ds.sample_train(rng, 4, batch.data());
    try {
      trainer.step(batch.data());
      trainer.finish();  // with the optimizer overlapped, its failure surfaces here
      FAIL() << "expected IoError";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find(swap), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(errno_text), std::string::npos) << e.what();
    }
    EXPECT_EQ(faults->injected.load(), 1);
    // The state is half-updated: no further step.
    EXPECT_THROW(trainer.step(batch.data()), Error);
  }
  // The store removed its files and private directory.
  DIR* d = opendir(swap.c_str());
  ASSERT_NE(d, nullptr);
  int entries = 0;
  while (dirent* e = readdir(d)) entries += std::string(e->d_name) != "." && std::string(e->d_name) != "..";
  closedir(d);
  EXPECT_EQ(entries, 0);
}

TEST_F(TieredTest, EioInTheMiddleOfAnOptimizerSwapStopsWithAClearError) {
  expect_swap_fault_is_reported(data_, swap_, nvme::FaultKind::kEio, "Input/output error", true);
  expect_swap_fault_is_reported(data_, swap_, nvme::FaultKind::kEio, "Input/output error", false);
}

TEST_F(TieredTest, EnospcInTheMiddleOfAnOptimizerSwapStopsWithAClearError) {
  expect_swap_fault_is_reported(data_, swap_, nvme::FaultKind::kEnospc, "No space left on device", true);
  expect_swap_fault_is_reported(data_, swap_, nvme::FaultKind::kEnospc, "No space left on device", false);
}

// A swap file changed behind the store's back: the next optimizer step's
// read of that state stops with the region, file and offset (the pieces are
// checksummed on CPU Adam's threads: Note [Parallel checksums] in
// nvme/swap_store.h), with the optimizer overlapped and inline.
TEST_F(TieredTest, SwapFileChangedBetweenStepsIsCaughtByTheOptimizer) {
  for (const bool overlap : {true, false}) {
    Config cfg = parse_config(base_config(data_),
                              {"zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"" + swap_ + "\"}",
                               "zero_optimization.sub_group_size=1000000",
                               std::string("run.overlap_optimizer=") + (overlap ? "true" : "false")});
    Model model(cfg.model);
    Trainer trainer(cfg, model);
    TokenDataset ds(cfg.data.paths, TokenFormat::kText, 256, cfg.model.seq_len, 0.0);
    std::vector<int64_t> batch(size_t(4 * (cfg.model.seq_len + 1)));
    std::mt19937_64 rng(1);
    ds.sample_train(rng, 4, batch.data());
    trainer.step(batch.data());
    trainer.finish();
    // One byte of every 4 KiB of the store's file flipped.
    std::vector<std::string> files;
    for (const std::string& top : list_dir(swap_)) {
      for (const std::string& rank : list_dir(swap_ + "/" + top)) {
        const std::string dir = swap_ + "/" + top + "/" + rank;
        if (!is_directory(dir)) continue;
        for (const std::string& f : list_dir(dir)) files.push_back(dir + "/" + f);
      }
    }
    ASSERT_EQ(files.size(), 1u);
    struct stat st;
    ASSERT_EQ(::stat(files[0].c_str(), &st), 0);
    std::vector<off_t> every_page;
    for (off_t at = 100; at < st.st_size; at += 4096) every_page.push_back(at);
    ASSERT_TRUE(testing::flip_bytes(files[0], every_page, 0x40));
    try {
      trainer.step(batch.data());
      trainer.finish();
      ADD_FAILURE() << "a changed swap file was read back (overlap " << overlap << ")";
    } catch (const IoError& e) {
      EXPECT_EQ(e.path(), files[0]);
      EXPECT_NE(std::string(e.what()).find("checksum mismatch in swap region"), std::string::npos) << e.what();
    }
    EXPECT_THROW(trainer.step(batch.data()), Error);  // half-updated: no further step
  }
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// Note [Prefetch window]: the three stage3 knobs change device bytes and
// traffic, never results. Parameters on the host tier, so every block goes
// through the window (blocks: embedding 16Ki, 2 layers of 32Ki, head 2Ki
// elements).
TEST_F(TieredTest, PrefetchKnobsMoveDevicePeakNotResults) {
  auto run = [&](int64_t bucket, int64_t live, int64_t persist) {
    return train(base_config(data_),
                 {"zero_optimization.stage=3", "zero_optimization.offload_param.device=cpu",
                  "zero_optimization.stage3_prefetch_bucket_size=" + std::to_string(bucket),
                  "zero_optimization.stage3_max_live_parameters=" + std::to_string(live),
                  "zero_optimization.stage3_param_persistence_threshold=" + std::to_string(persist)},
                 4);
  };
  const int64_t kBig = 1000000000;
  const TrainRun none = run(0, kBig, 0);
  const TrainRun wide = run(kBig, kBig, 0);
  const TrainRun capped = run(kBig, 40000, 0);
  const TrainRun persistent = run(0, kBig, kBig);
  for (const TrainRun* r : {&none, &wide, &capped, &persistent}) {
    ASSERT_EQ(r->losses.size(), 4u);
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(r->losses[i], baseline_.losses[i]) << "step " << i + 1;
    // The dry run of the plan and the real run agree.
    EXPECT_EQ(r->window_slots_used, r->window_slots_planned);
  }
  const int dev = int(Tier::kDevice);
  EXPECT_LT(none.peak[dev], wide.peak[dev]);      // prefetch bucket: more in flight
  EXPECT_LT(capped.peak[dev], wide.peak[dev]);    // max live parameters: fewer at once
  EXPECT_LT(capped.window_slots_used, wide.window_slots_used);
  EXPECT_NE(persistent.peak[dev], none.peak[dev]);  // persistence: all blocks kept...
  EXPECT_EQ(persistent.window_slots_used, 0);
  // ...and fetched once per step (4 blocks, 4 steps) instead of at every use.
  EXPECT_EQ(persistent.window_fetches, 4 * 4);
  EXPECT_GT(none.window_fetches, 4 * 4);
  EXPECT_LT(persistent.links.h2d, none.links.h2d);
  EXPECT_LT(wide.links.h2d, none.links.h2d);  // blocks reused inside the window
}

TEST_F(TieredTest, DeviceBudgetBoundsTheParameterWindow) {
  auto run = [&](int mb) {
    return train(base_config(data_),
                 {"zero_optimization.stage=3",
                  "zero_optimization.offload_param={\"device\":\"nvme\",\"nvme_path\":\"" + swap_ +
                      "\",\"max_in_cpu\":0}",
                  "zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"" + swap_ + "\"}",
                  "zero_optimization.stage3_param_persistence_threshold=0", "run.device_memory_mb=" + std::to_string(mb)},
                 3);
  };
  const TrainRun one = run(1), four = run(4);
  EXPECT_LE(one.peak[int(Tier::kDevice)], int64_t(1) << 20);
  EXPECT_LE(four.peak[int(Tier::kDevice)], int64_t(4) << 20);
  EXPECT_LT(one.window_slots_used, four.window_slots_used);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(one.losses[i], four.losses[i]);
}

TEST_F(TieredTest, CpuCheckpointingOffloadsSavedInputsBitIdentically) {
  // Saved inputs exist when backward recomputes (Note [Recompute]).
  // Both schedules (Note [Step schedules]): micro_batch holds one
  // micro-batch's inputs of every layer on the device, layer both
  // micro-batches'; offloaded, each brings them back through two slots.
  const int64_t ckpt = 2 * 32 * 64 * 4;  // micro x seq x dim x fp32: one layer's input
  TrainRun first;
  for (const std::string schedule : {"micro_batch", "layer"}) {
    const std::vector<std::string> four_layers = {"model.n_layers=4", "run.recompute=\"always\"",
                                                  "run.schedule=\"" + schedule + "\""};
    std::vector<std::string> offload = four_layers;
    offload.push_back("activation_checkpointing.cpu_checkpointing=true");
    const TrainRun kept = train(base_config(data_), four_layers, 3);
    const TrainRun off = train(base_config(data_), offload, 3);
    expect_identical(kept, off, "cpu_checkpointing, " + schedule);
    if (schedule == "micro_batch") first = kept;
    expect_identical(first, off, "cpu_checkpointing, " + schedule + " against micro_batch");
    EXPECT_EQ(kept.checkpoint_device, (schedule == "layer" ? 2 : 1) * 4 * ckpt) << schedule;
    EXPECT_EQ(off.checkpoint_device, 2 * ckpt) << schedule;
    // Each step: 2 micro-batches x 4 layers out and back in.
    EXPECT_EQ(off.links.d2h - kept.links.d2h, 3 * 2 * 4 * ckpt) << schedule;
    EXPECT_EQ(off.links.h2d - kept.links.h2d, 3 * 2 * 4 * ckpt) << schedule;
  }
  // One layer (a single device slot) and an odd count.
  // Under layer one layer's two micro-batches take both slots.
  for (int layers : {1, 3}) {
    for (const std::string schedule : {"micro_batch", "layer"}) {
      const std::string n = "model.n_layers=" + std::to_string(layers), sch = "run.schedule=\"" + schedule + "\"";
      const TrainRun k = train(base_config(data_), {n, sch, "run.recompute=\"always\""}, 2);
      const TrainRun o = train(base_config(data_), {n, sch, "activation_checkpointing.cpu_checkpointing=true"}, 2);
      expect_identical(k, o, "cpu_checkpointing with " + n + ", " + schedule);
      const int slots = schedule == "layer" ? 2 : std::min(layers, 2);  // two slots, or one for one layer
      EXPECT_EQ(o.checkpoint_device, slots * ckpt) << n << ", " << schedule;
    }
  }
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// Note [Optimizer overlap]: the optimizer on its own thread, overlapped with
// the next forward, gives the same numbers as stepping in line, wherever the
// state lives (the parameters' working copy on NVMe too, which the next
// forward reads while the optimizer writes it).
TEST_F(TieredTest, OverlappedOptimizerIsBitIdenticalToInline) {
  const std::string split = "{\"device\":0.2,\"host\":0.3,\"nvme\":0.5}";
  const std::string placement = "placement={\"param16\":" + split + ",\"grad\":" + split + ",\"optimizer\":" +
                                split + ",\"nvme_path\":\"" + swap_ + "\"}";
  for (const char* overlap : {"true", "false"}) {
    TrainRun r = train(base_config(data_), {placement, std::string("run.overlap_optimizer=") + overlap,
                                            "zero_optimization.stage3_param_persistence_threshold=0"});
    expect_identical(baseline_, r, std::string("overlap ") + overlap);
  }
  TrainRun unchecked = train(base_config(data_), {placement, "run.swap_checksums=false"});
  expect_identical(baseline_, unchecked, "swap checksums off");
  TrainRun inline_default = train(base_config(data_), {"run.overlap_optimizer=false"});
  expect_identical(baseline_, inline_default, "inline, all on device");
}

// Each optimizer step's swapping is reported once, with the step that
// reports its optimizer_s: its own step inline, the next one overlapped.
TEST_F(TieredTest, StepMetricsCountEachOptimizerStepsBytesOnce) {
  const std::string nvme = "zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"" + swap_ + "\"}";
  const TrainRun inl = train(base_config(data_), {nvme, "run.overlap_optimizer=false"}, 4);
  const TrainRun ovl = train(base_config(data_), {nvme, "run.overlap_optimizer=true"}, 4);
  const int64_t state = inl.bytes.master + inl.bytes.optimizer;
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(inl.step_links[i].nvme_read, state) << "inline step " << i + 1;
    EXPECT_EQ(inl.step_links[i].nvme_write, state) << "inline step " << i + 1;
    EXPECT_EQ(ovl.step_links[i].nvme_read, i == 0 ? 0 : state) << "overlapped step " << i + 1;
    EXPECT_EQ(ovl.step_links[i].nvme_write, i == 0 ? 0 : state) << "overlapped step " << i + 1;
    // Gradients go to the host tier (D2H) in the step that computes them.
    EXPECT_EQ(ovl.step_links[i].d2h, inl.step_links[i].d2h) << "step " << i + 1;
    EXPECT_GT(ovl.step_links[i].d2h, 0);
  }
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// Note [Pipeline pieces]: sub-groups larger than a pipeline piece are swapped
// and updated piece by piece, with staging for one piece per set.
TEST_F(TieredTest, SubGroupsLargerThanAPipelinePieceAreBitIdentical) {
  const std::vector<std::string> big = {"model.dim=256", "model.n_heads=4", "model.ffn_hidden=512",
                                        "zero_optimization.sub_group_size=1000000000"};
  std::vector<std::string> nvme = big;
  nvme.push_back("zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"" + swap_ + "\"}");
  const TrainRun dev = train(base_config(data_), big, 3);
  const TrainRun nv = train(base_config(data_), nvme, 3);
  expect_identical(dev, nv, "one sub-group, several pieces, on nvme");
  // One staging set: the sub-group is larger than all the staging there is.
  std::vector<std::string> one_set = nvme;
  one_set.push_back("zero_optimization.offload_optimizer.buffer_count=1");
  expect_identical(dev, train(base_config(data_), one_set, 3), "pieces with one staging set");
  // More than one piece, and the staging is a piece per set, not a sub-group.
  Config cfg = parse_config(base_config(data_), nvme);
  Model model(cfg.model);
  const PlacementPlan plan = make_plan(cfg, StateLayout(model.layout_specs(), 1), 0, MachineCapacity{});
  ASSERT_EQ(plan.state.units[int(Category::kMaster)].size(), 1u);
  EXPECT_GT(plan.state.shard_space_numel, kPipelineChunkElems);
  const std::vector<PlacementUnit> pieces = pipeline_pieces(plan);
  EXPECT_EQ(int64_t(pieces.size()), (plan.state.shard_space_numel + kPipelineChunkElems - 1) / kPipelineChunkElems);
  EXPECT_EQ(plan.staging.opt_state, plan.staging.opt_sets * 3 * kPipelineChunkElems * 4);
  EXPECT_EQ(nv.step_links.back().nvme_read, nv.bytes.master + nv.bytes.optimizer);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// The engine waits on one type for NVMe transfers and collectives alike
// (memory/completion.h): a swap read/write returns a Completion that is
// pending until its I/O is waited, an already-waited one returns at once,
// and a failed transfer rethrows from wait() and leaves its group reusable.
TEST_F(TieredTest, SwapTransfersCompleteThroughTheEnginesCompletion) {
  Config cfg = parse_config(base_config(data_), {"zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"" + swap_ + "\"}"});
  Model model(cfg.model);
  Trainer trainer(cfg, model);  // only for its plan
  const PlacementPlan& plan = trainer.plan();
  const PlacementUnit& u = plan.state.units[size_t(Category::kMaster)][0];
  ASSERT_EQ(plan.state.units[size_t(Category::kMaster)][0].tier, Tier::kNvme);
  auto faults = std::make_shared<nvme::FaultPlan>();
  faults->only_op = int(nvme::IoOp::kRead);
  faults->first_op = int64_t(1) << 60;
  TieredStateOptions so;
  so.engine.faults = faults;
  TieredState st(plan, so);

  HostBuffer out(size_t(u.numel * 4), "test out"), in(size_t(u.numel * 4), "test in");
  for (int64_t i = 0; i < u.numel; ++i) out.as<float>()[i] = float(i) * 0.5f;
  PendingIo group;
  Completion written = st.write_async(Category::kMaster, u.offset, u.numel, out.data(), group);
  EXPECT_TRUE(written.pending());
  Completion copy = written;  // a copy names the same work
  written.wait();
  EXPECT_FALSE(written.pending());
  copy.wait();  // that round was waited: returns at once

  Completion read = st.read_async(Category::kMaster, u.offset, u.numel, in.data(), group);
  EXPECT_TRUE(read.pending());
  read.wait();
  EXPECT_EQ(std::memcmp(in.data(), out.data(), size_t(u.numel * 4)), 0);

  // Resident work is done when the call returns.
  const PlacementUnit& p = plan.state.units[size_t(Category::kParam16)][0];
  ASSERT_NE(p.tier, Tier::kNvme);
  PendingIo other;
  EXPECT_FALSE(st.read_async(Category::kParam16, p.offset, p.numel, in.data(), other).pending());

  // A failed read rethrows from wait(); the group then serves the next round.
  faults->first_op = faults->seen.load() + 1;
  Completion failed = st.read_async(Category::kMaster, u.offset, u.numel, in.data(), group);
  EXPECT_THROW(failed.wait(), IoError);
  EXPECT_EQ(faults->injected.load(), 1);
  std::memset(in.data(), 0, size_t(u.numel * 4));
  st.read_async(Category::kMaster, u.offset, u.numel, in.data(), group).wait();
  EXPECT_EQ(std::memcmp(in.data(), out.data(), size_t(u.numel * 4)), 0);
}

// Note [Alternate swap slots]: with optimizer.speculate's slots every NVMe
// unit of master weights and moments has a second home on disk (the plan
// counts it: 12 bytes per element with fp32 moments). A spare write is not
// seen until its piece is committed; a commit flips that piece only, so one
// read across pieces returns each from its own current slot; a write after
// a commit goes to the new current slot, and the next spare write to the
// old one. A commit of part of a piece is refused.
TEST_F(TieredTest, AlternateSwapSlotsCommitPieceByPieceByAFlip) {
  const std::vector<std::string> o = {
      "model.dim=256", "model.n_heads=4", "model.ffn_hidden=512", "model.n_layers=4",
      "zero_optimization.sub_group_size=1000000000",
      "zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"" + swap_ + "\"}",
      "run.schedule=\"layer\"", "optimizer.speculate=\"on\"", "run.overlap_optimizer=true"};
  Config cfg = parse_config(base_config(data_), o);
  Model model(cfg.model);
  const PlacementPlan plan = make_plan(cfg, StateLayout(model.layout_specs(), 1), 0, MachineCapacity{});
  ASSERT_TRUE(plan.optimizer.speculate_slots) << plan.optimizer.speculate_choice;
  const int64_t n = plan.state.shard_space_numel;
  EXPECT_EQ(plan.optimizer.nvme_spare_bytes, 12 * n);
  EXPECT_EQ(plan.total()[size_t(Tier::kNvme)] - plan.state.total()[size_t(Tier::kNvme)], 12 * n);
  EXPECT_EQ(speculated_slot_numel(plan), n);
  cfg.optimizer.speculate_slots = false;
  const PlacementPlan two_pass = make_plan(cfg, StateLayout(model.layout_specs(), 1), 0, MachineCapacity{});
  EXPECT_TRUE(two_pass.optimizer.speculate);
  EXPECT_FALSE(two_pass.optimizer.speculate_slots);
  EXPECT_EQ(two_pass.optimizer.nvme_spare_bytes, 0);
  EXPECT_EQ(speculated_slot_numel(two_pass), 0);

  const std::vector<PlacementUnit> pieces = pipeline_pieces(plan);
  ASSERT_GE(pieces.size(), 3u);
  TieredState st(plan, TieredStateOptions{});
  EXPECT_TRUE(st.has_spare(Category::kMaster, 0, n));
  EXPECT_TRUE(st.has_spare(Category::kExpAvgSq, pieces[1].offset, pieces[1].numel));
  EXPECT_FALSE(st.has_spare(Category::kParam16, 0, n));
  EXPECT_GE(st.swap()->used_bytes(), plan.total()[size_t(Tier::kNvme)]);
  auto filled = [&](float scale) {
    HostBuffer b(size_t(n * 4), "test");
    for (int64_t i = 0; i < n; ++i) b.as<float>()[i] = float(i) * scale;
    return b;
  };
  HostBuffer a = filled(1.0f), spare = filled(-1.0f), later = filled(0.25f), in(size_t(n * 4), "test in");
  auto read_all = [&] {
    std::memset(in.data(), 0, size_t(n * 4));
    st.read(Category::kMaster, 0, n, in.data());
  };
  // Element i as read, against the buffer it should come from.
  auto same = [&](int64_t from, int64_t count, const HostBuffer& want) {
    return std::memcmp(in.as<float>() + from, want.as<float>() + from, size_t(count * 4)) == 0;
  };
  const PlacementUnit& p1 = pieces[1];
  st.write(Category::kMaster, 0, n, a.data());
  PendingIo io;
  st.write_spare_async(Category::kMaster, p1.offset, p1.numel, spare.as<float>() + p1.offset, io).wait();
  read_all();
  EXPECT_TRUE(same(0, n, a)) << "a spare write was seen before its commit";
  st.commit_spare(Category::kMaster, p1.offset, p1.numel);
  read_all();
  EXPECT_TRUE(same(0, p1.offset, a));
  EXPECT_TRUE(same(p1.offset, p1.numel, spare)) << "the committed piece reads its old slot";
  EXPECT_TRUE(same(p1.offset + p1.numel, n - p1.offset - p1.numel, a)) << "the commit flipped more than its piece";
  // In place, then into the other slot again.
  st.write(Category::kMaster, p1.offset, p1.numel, later.as<float>() + p1.offset);
  read_all();
  EXPECT_TRUE(same(p1.offset, p1.numel, later));
  st.write_spare_async(Category::kMaster, p1.offset, p1.numel, a.as<float>() + p1.offset, io).wait();
  read_all();
  EXPECT_TRUE(same(p1.offset, p1.numel, later));
  st.commit_spare(Category::kMaster, p1.offset, p1.numel);
  read_all();
  EXPECT_TRUE(same(0, n, a));
  EXPECT_THROW(st.commit_spare(Category::kMaster, p1.offset, p1.numel / 2), InternalError);
  EXPECT_THROW((void)st.write_spare_async(Category::kParam16, 0, 2048, a.data(), io), InternalError);
}

// Note [Host arenas]: host-tier 16-bit parameters and gradients live in
// memory registered with the device, the optimizer state in plain memory;
// training is bit-identical to everything on the device either way.
TEST_F(TieredTest, HostTierParametersAndGradientsLiveInRegisteredTransferMemory) {
  const std::vector<std::string> o = {
      "placement={\"param16\":{\"host\":1.0},\"grad\":{\"host\":1.0},\"optimizer\":{\"host\":1.0}}"};
  Config cfg = parse_config(base_config(data_), o);
  Model model(cfg.model);
  Trainer trainer(cfg, model);
  const TieredState& st = trainer.state();
  // fp32 compute: 4-byte working copy and gradients over the padded layout
  // (blocks are padded to 2048 elements, so no unit rounds up to a page).
  const int64_t n = trainer.layout().total_numel();
  EXPECT_EQ(st.host_transfer_bytes(), n * (4 + 4));
  EXPECT_EQ(st.host_arena_bytes() - st.host_transfer_bytes(), n * (4 + 4 + 4));  // master, two moments
  EXPECT_EQ(st.device_arena_bytes(), 0);
  // Optimizer state alone on the host: nothing crosses PCIe from there.
  Config opt_only = parse_config(base_config(data_), {"placement={\"optimizer\":{\"host\":1.0}}"});
  Trainer t2(opt_only, model);
  EXPECT_EQ(t2.state().host_transfer_bytes(), 0);
  EXPECT_EQ(t2.state().host_arena_bytes(), n * 12);
  expect_identical(train(base_config(data_), o), baseline_, "everything on the host");
}

}  // namespace
}  // namespace strata
