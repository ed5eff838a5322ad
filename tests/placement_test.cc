// Tests of memory/placement: the plan from DeepSpeed keys, from a placement
// section and from "auto"; whole units; determinism; the verdict.
#include "memory/placement.h"

#include <gtest/gtest.h>

#include <map>

#include "plan/planner.h"
#include "memory/device.h"
#include "util/errors.h"

namespace strata {
namespace {

// 8 blocks of 64Ki elements each (padded to the 2048 quantum already).
StateLayout make_layout(int64_t world = 1) {
  std::vector<std::pair<std::string, std::vector<ParamSpec>>> blocks;
  for (int b = 0; b < 8; ++b) {
    blocks.push_back({"block." + std::to_string(b), {{"w", {256, 256}, Init::kNormal, 0.02}}});
  }
  return StateLayout(blocks, world);
}

Config config_with(const std::vector<std::string>& overrides) {
  nlohmann::json j = {{"data", {{"path", "unused.txt"}}},
                      {"zero_optimization", {{"sub_group_size", 65536}}}};
  return parse_config(j, overrides);
}

MachineCapacity unlimited() { return MachineCapacity{}; }

constexpr int64_t kTotal = 8 * 65536;

// A step's token windows (int64): in device memory and registered host memory.
int64_t token_bytes(const Config& c) {
  return c.gradient_accumulation_steps * c.train_micro_batch_size_per_gpu * (c.model.seq_len + 1) * 8;
}

TEST(PlacementTest, DefaultIsEverythingOnDevice) {
  StateLayout layout = make_layout();
  const Config cfg = config_with({});
  PlacementPlan p = make_plan(cfg, layout, 0, unlimited());
  EXPECT_EQ(p.state.source, "default");
  for (int c = 0; c <= int(Category::kExpAvgSq); ++c) {
    EXPECT_EQ(p.state.bytes[c][0], kTotal * p.state.elem_bytes[c]) << category_name(Category(c));
    EXPECT_EQ(p.state.bytes[c][1] + p.state.bytes[c][2], 0);
  }
  // A dense model has no frozen state (Note [State kinds] in memory/layout.h).
  EXPECT_EQ(p.state.category_total(Category::kFrozen), 0);
  EXPECT_TRUE(p.state.units[size_t(Category::kFrozen)].empty());
  // All resident: the fp32 stage of the tied embedding's gradient sum (the
  // largest block) and a norm slot per block (Note [Gradient path]).
  ASSERT_TRUE(p.tied);
  EXPECT_EQ(p.staging.device_bytes(), 65536 * 4 + int64_t(p.block_numel.size()) * 8 + token_bytes(cfg));
  EXPECT_EQ(p.staging.host_bytes(), token_bytes(cfg));
}

// run.checkpoint.snapshot_gb (Note [Save snapshots] in checkpoint/checkpoint.h):
// host memory the plan counts, 4 KiB pages, only with a checkpoint dir, and
// never more than this rank's saves hold (master fp32 + two moments: 12
// bytes a parameter, each of the 8 blocks' three ranges padded to 4 KiB).
TEST(PlacementTest, CheckpointSnapshotPoolIsCountedAndCapped) {
  StateLayout layout = make_layout();
  const PlacementPlan none = make_plan(config_with({}), layout, 0, unlimited());
  EXPECT_EQ(none.staging.save_snapshot, 0);
  const PlacementPlan no_dir = make_plan(config_with({"run.checkpoint.snapshot_gb=1"}), layout, 0, unlimited());
  EXPECT_EQ(no_dir.staging.save_snapshot, 0);
  // Without periodic saves (only the save at the end, which is waited for).
  const PlacementPlan not_periodic = make_plan(
      config_with({"run.checkpoint.dir=\"/tmp/unused-ck\"", "run.checkpoint.snapshot_gb=1"}), layout, 0, unlimited());
  EXPECT_EQ(not_periodic.staging.save_snapshot, 0);
  const std::string dir = "run.checkpoint={\"dir\":\"/tmp/unused-ck\",\"every\":10}";
  const PlacementPlan small = make_plan(config_with({dir, "run.checkpoint.snapshot_gb=0.00001"}), layout, 0,
                                        unlimited());
  EXPECT_EQ(small.staging.save_snapshot, 12288);  // 10,000 bytes in whole pages
  EXPECT_EQ(small.staging.host_bytes(), none.staging.host_bytes() + 12288);
  const PlacementPlan big = make_plan(config_with({dir, "run.checkpoint.snapshot_gb=1000"}), layout, 0, unlimited());
  const int64_t saved = kTotal * 12;
  EXPECT_GE(big.staging.save_snapshot, saved);
  EXPECT_LE(big.staging.save_snapshot, saved + 2 * 3 * 9 * 4096);
  EXPECT_EQ(big.staging.save_snapshot % 4096, 0);
  EXPECT_THROW(config_with({dir, "run.checkpoint.snapshot_gb=-1"}), ConfigError);
}

TEST(PlacementTest, DeepSpeedOptimizerOffloadToCpuAndNvmeWithRatio) {
  StateLayout layout = make_layout();
  PlacementPlan cpu = make_plan(config_with({"zero_optimization.offload_optimizer.device=cpu"}),
                                layout, 0, unlimited());
  EXPECT_EQ(cpu.state.source, "deepspeed");
  for (Category c : {Category::kMaster, Category::kExpAvg, Category::kExpAvgSq, Category::kGrad}) {
    EXPECT_EQ(cpu.state.bytes[int(c)][int(Tier::kHost)], kTotal * 4) << category_name(c);
  }
  EXPECT_EQ(cpu.state.bytes[int(Category::kParam16)][int(Tier::kDevice)], kTotal * 4);  // fp32 compute

  PlacementPlan nvme = make_plan(
      config_with({"zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"/tmp/x\",\"ratio\":0.25}"}),
      layout, 0, unlimited());
  // ratio 0.25: a quarter of the 8 sub-groups on NVMe, the rest on device.
  EXPECT_EQ(nvme.state.bytes[int(Category::kMaster)][int(Tier::kNvme)], 2 * 65536 * 4);
  EXPECT_EQ(nvme.state.bytes[int(Category::kMaster)][int(Tier::kDevice)], 6 * 65536 * 4);
  // DeepSpeed keeps the gradients of offloaded optimizer state in host memory.
  EXPECT_EQ(nvme.state.bytes[int(Category::kGrad)][int(Tier::kHost)], 2 * 65536 * 4);
  // One swapped sub-group of master/exp_avg/exp_avg_sq at a time; gradients
  // and working copy of a sub-group lie in one unit each, so are not staged.
  // buffer_count 4 -> a pipeline of 8 staging sets, the least above 1 (Note [Optimizer pipeline]).
  EXPECT_EQ(nvme.staging.opt_sets, 8);
  EXPECT_EQ(nvme.staging.opt_state, 8 * 65536 * 12);
  // More sets read further ahead, up to 128.
  for (auto [count, sets] : {std::pair<int, int>{40, 40}, {1000, 128}}) {
    PlacementPlan deep = make_plan(
        config_with({"zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"/tmp/x\","
                     "\"ratio\":0.25,\"buffer_count\":" + std::to_string(count) + "}"}),
        layout, 0, unlimited());
    EXPECT_EQ(deep.staging.opt_sets, sets) << count;
    EXPECT_EQ(deep.staging.opt_state, int64_t(sets) * 65536 * 12) << count;
  }
  EXPECT_EQ(nvme.staging.opt_grad + nvme.staging.opt_emit, 0);
  EXPECT_EQ(nvme.state.nvme_paths, std::vector<std::string>{"/tmp/x"});
  // Different directories for parameters and optimizer state: all of them are used.
  PlacementPlan both = make_plan(
      config_with({"zero_optimization.stage=3",
                   "zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":[\"/tmp/a\",\"/tmp/b\"]}",
                   "zero_optimization.offload_param={\"device\":\"nvme\",\"nvme_path\":[\"/tmp/b\",\"/tmp/c\"],\"max_in_cpu\":0}"}),
      layout, 0, unlimited());
  EXPECT_EQ(both.state.nvme_paths, (std::vector<std::string>{"/tmp/a", "/tmp/b", "/tmp/c"}));
}

TEST(PlacementTest, DeepSpeedParamOffloadToNvmeKeepsMaxInCpuOnHost) {
  StateLayout layout = make_layout();
  PlacementPlan p = make_plan(
      config_with({"zero_optimization.stage=3",
                   "zero_optimization.offload_param={\"device\":\"nvme\",\"nvme_path\":\"/tmp/x\",\"max_in_cpu\":131072,\"buffer_size\":70000,\"buffer_count\":3}"}),
      layout, 0, unlimited());
  EXPECT_EQ(p.state.bytes[int(Category::kParam16)][int(Tier::kHost)], 2 * 65536 * 4);
  EXPECT_EQ(p.state.bytes[int(Category::kParam16)][int(Tier::kNvme)], 6 * 65536 * 4);
  // DeepSpeed's default persistence threshold (1e5 elements) keeps these
  // 64Ki-element blocks persistent; without it the window holds the current
  // use (the head with the tied embedding: 2 blocks), one more per block of
  // prefetch bucket.
  EXPECT_EQ(p.staging.window.persistent_numel, 8 * 65536);
  EXPECT_EQ(p.staging.gathered, 8 * 65536 * 4);
  for (int64_t bucket : {0, 65536}) {
    PlacementPlan q = make_plan(
        config_with({"zero_optimization.stage=3", "zero_optimization.stage3_param_persistence_threshold=0",
                     "zero_optimization.stage3_prefetch_bucket_size=" + std::to_string(bucket),
                     "zero_optimization.offload_param={\"device\":\"nvme\",\"nvme_path\":\"/tmp/x\",\"max_in_cpu\":131072,\"buffer_size\":70000}"}),
        layout, 0, unlimited());
    const int slots = bucket == 0 ? 2 : 3;
    EXPECT_EQ(q.staging.window.slots, slots) << "bucket " << bucket;
    EXPECT_EQ(q.staging.gathered, slots * 65536 * 4) << "bucket " << bucket;
  }
  // A staging buffer that cannot hold the largest block shard is refused at
  // start, with the numbers, instead of failing deep in a step.
  try {
    make_plan(config_with({"zero_optimization.stage=3",
                           "zero_optimization.offload_param={\"device\":\"nvme\",\"nvme_path\":\"/tmp/x\",\"max_in_cpu\":0,\"buffer_size\":1000}"}),
              layout, 0, unlimited());
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), "zero_optimization.offload_param.buffer_size");
    EXPECT_NE(std::string(e.what()).find("65536"), std::string::npos) << e.what();
  }
}

TEST(PlacementTest, ThreeWaySplitPlacesWholeUnitsNearTheRequestedShares) {
  StateLayout layout = make_layout();
  Config cfg = config_with({"placement={\"param16\":{\"device\":0.2,\"host\":0.3,\"nvme\":0.5},"
                            "\"optimizer\":{\"device\":0.25,\"host\":0.25,\"nvme\":0.5},"
                            "\"nvme_path\":\"/tmp/x\"}"});
  PlacementPlan p = make_plan(cfg, layout, 0, unlimited());
  EXPECT_EQ(p.state.source, "placement");
  // 8 units with midpoints at 1/16, 3/16, 5/16, ...: device takes those below
  // 0.2 (2 units), host those below 0.5 (2 more), NVMe the other 4.
  const auto& pb = p.state.bytes[int(Category::kParam16)];
  EXPECT_EQ(pb[0], 2 * 65536 * 4);
  EXPECT_EQ(pb[1], 2 * 65536 * 4);
  EXPECT_EQ(pb[2], 4 * 65536 * 4);
  const auto& mb = p.state.bytes[int(Category::kMaster)];
  EXPECT_EQ(mb[0], 2 * 65536 * 4);
  EXPECT_EQ(mb[1], 2 * 65536 * 4);
  EXPECT_EQ(mb[2], 4 * 65536 * 4);
  // Every category accounts for every element exactly once.
  for (int c = 0; c <= int(Category::kExpAvgSq); ++c) {
    EXPECT_EQ(p.state.category_total(Category(c)), kTotal * p.state.elem_bytes[c]);
  }
  // Deterministic: the same config gives the same units.
  PlacementPlan q = make_plan(cfg, layout, 0, unlimited());
  for (int c = 0; c < kNumCategories; ++c) {
    ASSERT_EQ(p.state.units[c].size(), q.state.units[c].size());
    for (size_t i = 0; i < p.state.units[c].size(); ++i) EXPECT_EQ(p.state.units[c][i].tier, q.state.units[c][i].tier);
  }
}

TEST(PlacementTest, SubGroupsAreAlignedContiguousRanges) {
  StateLayout layout = make_layout();
  Config cfg = config_with({"zero_optimization.sub_group_size=100000"});
  PlacementPlan p = make_plan(cfg, layout, 0, unlimited());
  EXPECT_EQ(p.state.sub_group_numel % kShardAlignElems, 0);
  EXPECT_GE(p.state.sub_group_numel, 100000);
  int64_t next = 0;
  for (const PlacementUnit& u : p.state.units[int(Category::kMaster)]) {
    EXPECT_EQ(u.offset, next);
    next += u.numel;
  }
  EXPECT_EQ(next, kTotal);
}

// placement auto with no headroom on a one-layer model of 8 tokens, one
// staging set, and `more` overrides.
Config auto_config(std::vector<std::string> more = {}) {
  std::vector<std::string> o = {"placement={\"auto\":true,\"headroom\":0.0,\"nvme_path\":\"/tmp/x\"}",
                                "model.dim=8", "model.n_heads=2", "model.n_layers=1", "model.seq_len=8",
                                "train_micro_batch_size_per_gpu=1",
                                "zero_optimization.offload_optimizer.buffer_count=1"};
  o.insert(o.end(), more.begin(), more.end());
  return config_with(o);
}

// A GPU whose tiers hold, with auto's greedy fill of `cfg` (fp32, one
// micro-batch of 8 tokens, one staging set), exactly:
MachineCapacity gpu_capacity_for_auto(const Config& cfg, const StateLayout& layout) {
  const int64_t activations = make_plan(cfg, layout, 0, unlimited()).activations.bytes;
  const int64_t unit = 65536 * 4;  // every unit here: one block / one sub-group of fp32
  MachineCapacity cap;
  cap.device_is_host = false;
  cap.device_addressable = false;
  // Device: all of param16, half of grad, the activations, the fp32
  // gradient stage, and the gradient norms (a slot per block, and the norm
  // kernel's partials: one per 4096 elements of the largest block).
  cap.device_bytes = 8 * unit + 4 * unit + activations + 1 * unit + 8 * 8 + 65536 / 4096 * 8 + token_bytes(cfg);
  // Host: the other half of grad, all of master, half of exp_avg, and the
  // staging of one swapped sub-group (master, exp_avg, exp_avg_sq; buffer_count
  // 1 = one staging set); since host code may not touch a GPU's memory, CPU
  // Adam's staging of a device-tier gradient and working copy (one unit each),
  // and the two registered buffers gradient shards land in on their way to
  // host homes (one unit each).
  cap.host_bytes = 4 * unit + 8 * unit + 4 * unit + 3 * unit + 4 * unit + token_bytes(cfg);
  cap.nvme_bytes = int64_t(1) << 40;
  return cap;
}

TEST(PlacementTest, AutoFillsTheDeviceFirstWithParametersThenGradients) {
  StateLayout layout = make_layout();
  Config cfg = auto_config();
  const MachineCapacity cap = gpu_capacity_for_auto(cfg, layout);
  PlacementPlan p = make_plan(cfg, layout, 0, cap);
  EXPECT_EQ(p.state.source, "auto");
  EXPECT_NEAR(p.state.split[int(Category::kParam16)].device, 1.0, 1e-9);
  EXPECT_NEAR(p.state.split[int(Category::kGrad)].device, 0.5, 1e-9);
  EXPECT_NEAR(p.state.split[int(Category::kGrad)].host, 0.5, 1e-9);
  EXPECT_NEAR(p.state.split[int(Category::kMaster)].host, 1.0, 1e-9);
  EXPECT_NEAR(p.state.split[int(Category::kExpAvg)].host, 0.5, 1e-9);
  EXPECT_NEAR(p.state.split[int(Category::kExpAvg)].nvme, 0.5, 1e-9);
  EXPECT_NEAR(p.state.split[int(Category::kExpAvgSq)].nvme, 1.0, 1e-9);
  // What was placed, staging included, fits exactly what the tiers have.
  const auto total = p.total();
  EXPECT_LE(total[0], cap.device_bytes);
  EXPECT_LE(total[1], cap.host_bytes);
  EXPECT_TRUE(plan_shortfalls(p, cap).empty());
}

// Note [Auto's margin] (plan/planner.h): on the capacity above, auto's other
// candidate on a GPU, gradients before parameters, moves half of param16 to
// the host (fetched over H2D each step) where the greedy fill has half of
// the gradients there (landed over D2H and added by the host's lander
// thread). As that thread's rate is swept from fast to slow, the greedy
// fill's bound rises past the candidate's; choose_by_bound takes the
// candidate only once it is more than 10% lower, and says so either way.
TEST(PlacementTest, AutoByTheBoundLeavesTheGreedyFillOnlyForAClearlyLowerBound) {
  StateLayout layout = make_layout();
  Config cfg = auto_config({"run.swap_checksums=false"});
  const MachineCapacity cap = gpu_capacity_for_auto(cfg, layout);
  Config other = cfg;
  other.placement.auto_order = {1, 0, 2, 3, 4};  // gradients before parameters
  const PlacementPlan greedy = make_plan(cfg, layout, 0, cap);
  const PlacementPlan grads_first = make_plan(other, layout, 0, cap);
  ASSERT_TRUE(plan_shortfalls(grads_first, cap).empty());
  ASSERT_LT(grads_first.state.split[int(Category::kParam16)].device, 1.0);  // the two differ
  Rates r;
  r.device_flops = 1e12, r.adam = 1e9, r.h2d = r.d2h = 10e9, r.pcie_both = 20e9;
  r.nvme_read = r.nvme_write = r.nvme_both = 2e9;
  bool took_it = false, kept_greedy_though_lower = false;
  for (double adds = 10e9; adds > 0.01e9; adds /= 1.25) {
    r.grad_add = adds;
    auto seconds = [&](const Config& c, const PlacementPlan& p) {
      return step_bound(predicted_work(c, p, train_fetches(p), step_network_bytes(p)), r, false).seconds;
    };
    const double g = seconds(cfg, greedy), k = seconds(other, grads_first);
    const PlacementPlan chosen = choose_by_bound(cfg, layout, 0, cap, r);
    const bool is_other = chosen.state.split[int(Category::kParam16)].device < 1.0;
    EXPECT_EQ(is_other, k < g * 0.9) << "adds " << adds << "/s: greedy " << g << " s, other " << k << " s; "
                                     << chosen.state.auto_choice;
    if (is_other) {
      took_it = true;
      EXPECT_NE(chosen.state.auto_choice.find("gradients before parameters: bound"), std::string::npos) << chosen.state.auto_choice;
    } else if (k < g) {
      kept_greedy_though_lower = true;
      EXPECT_NE(chosen.state.auto_choice.find("not 10% lower"), std::string::npos) << chosen.state.auto_choice;
    }
  }
  EXPECT_TRUE(took_it);
  EXPECT_TRUE(kept_greedy_though_lower);
}

// run.overlap_optimizer "auto": on a GPU always; on the CPU device only when
// no optimizer state is on NVMe (one sub-group there is enough to turn it
// off); true and false as given.
TEST(PlacementTest, OptimizerOverlapsOnAGpuAndOnTheCpuUnlessItSwaps) {
  StateLayout layout = make_layout();
  const std::string swap = "zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"/tmp/x\",";
  MachineCapacity gpu;
  gpu.device_is_host = false;
  gpu.device_addressable = false;
  for (const char* overlap : {"\"auto\"", "true", "false"}) {
    const std::string o = std::string("run.overlap_optimizer=") + overlap;
    const bool forced = std::string(overlap) == "true", off = std::string(overlap) == "false";
    const Config in_ram = config_with({o});
    const Config one_group = config_with({o, swap + "\"ratio\":0.125}"});  // 1 of 8 sub-groups
    const Config all = config_with({o, swap + "\"ratio\":1.0}"});
    ASSERT_EQ(make_plan(one_group, layout, 0, unlimited()).state.bytes[int(Category::kExpAvg)][int(Tier::kNvme)],
              65536 * 4);
    EXPECT_EQ(optimizer_overlaps(in_ram, make_plan(in_ram, layout, 0, unlimited())), !off) << o;
    EXPECT_EQ(optimizer_overlaps(one_group, make_plan(one_group, layout, 0, unlimited())), forced) << o;
    EXPECT_EQ(optimizer_overlaps(all, make_plan(all, layout, 0, unlimited())), forced) << o;
    EXPECT_EQ(optimizer_overlaps(all, make_plan(all, layout, 0, gpu)), !off) << o << " on a GPU";
  }
}

// On a GPU, CPU Adam cannot use device memory in place: auto puts a
// sub-group's optimizer state on the device only whole and only beside its
// gradient and working copy (so the GPU's Adam updates it), never one
// category of it alone, though a lone master unit would fit.
TEST(PlacementTest, AutoOnAGpuPutsOptimizerStateOnTheDeviceOnlyWhole) {
  StateLayout layout = make_layout();
  Config cfg = config_with({"placement={\"auto\":true,\"headroom\":0.0,\"nvme_path\":\"/tmp/x\"}",
                            "model.dim=8", "model.n_heads=2", "model.n_layers=1", "model.seq_len=8",
                            "train_micro_batch_size_per_gpu=1"});
  const int64_t activations = make_plan(cfg, layout, 0, unlimited()).activations.bytes;
  const int64_t unit = 65536 * 4;
  MachineCapacity cap;
  cap.device_is_host = false;
  cap.device_addressable = false;
  cap.device_bytes = 8 * unit + 8 * unit + activations + 1 * unit + 5 * unit;  // param16, grad, stage, 5 more
  cap.host_bytes = int64_t(1) << 40;
  cap.nvme_bytes = int64_t(1) << 40;
  PlacementPlan p = make_plan(cfg, layout, 0, cap);
  ASSERT_FALSE(p.device_addressable);
  EXPECT_NEAR(p.state.split[int(Category::kParam16)].device, 1.0, 1e-9);
  EXPECT_NEAR(p.state.split[int(Category::kGrad)].device, 1.0, 1e-9);
  int device_groups = 0;
  for (size_t i = 0; i < p.state.units[size_t(Category::kMaster)].size(); ++i) {
    const PlacementUnit& m = p.state.units[size_t(Category::kMaster)][i];
    for (Category c : {Category::kExpAvg, Category::kExpAvgSq}) {
      EXPECT_EQ(p.state.units[size_t(c)][i].tier == Tier::kDevice, m.tier == Tier::kDevice) << "sub-group " << i;
    }
    EXPECT_EQ(device_adam_piece(p, m), m.tier == Tier::kDevice) << "sub-group " << i;
    device_groups += m.tier == Tier::kDevice;
  }
  EXPECT_EQ(device_groups, 1);  // 5 units left: one sub-group of 3, not a fourth and fifth alone
  EXPECT_EQ(p.staging.grad_host, 0);  // every gradient home is on the device

  // A first block of 11 units whose gradient does not fit (10 units left
  // after the working copy) while the 7 small blocks' do: its sub-groups
  // stay off the device, though the first would fit there (3 units left).
  std::vector<std::pair<std::string, std::vector<ParamSpec>>> blocks;
  blocks.push_back({"block.0", {{"w", {2816, 256}, Init::kNormal, 0.02}}});
  for (int b = 1; b < 8; ++b) blocks.push_back({"block." + std::to_string(b), {{"w", {256, 256}, Init::kNormal, 0.02}}});
  StateLayout uneven(blocks, 1);
  const int64_t act2 = make_plan(cfg, uneven, 0, unlimited()).activations.bytes;
  cap.device_bytes = act2 + 11 * unit /* gradient stage */ + 18 * unit /* param16 */ + 10 * unit;
  PlacementPlan q = make_plan(cfg, uneven, 0, cap);
  EXPECT_EQ(q.state.units[size_t(Category::kGrad)][0].tier, Tier::kHost);
  for (size_t b = 1; b < 8; ++b) EXPECT_EQ(q.state.units[size_t(Category::kGrad)][b].tier, Tier::kDevice) << b;
  device_groups = 0;
  for (const PlacementUnit& m : q.state.units[size_t(Category::kMaster)]) {
    EXPECT_EQ(device_adam_piece(q, m), m.tier == Tier::kDevice) << "sub-group at " << m.offset;
    device_groups += m.tier == Tier::kDevice;
  }
  EXPECT_EQ(device_groups, 1);
}

TEST(PlacementTest, AutoOnCpuSharesOneHostPoolAndSpillsToNvme) {
  StateLayout layout = make_layout();
  Config cfg = auto_config();
  MachineCapacity cap;  // CPU compute, no device budget: the device tier is host RAM
  cap.device_is_host = true;
  // Half of the 40 units of state, with room for staging (one set of the
  // sequential pipeline, buffer_count 1: master, exp_avg and exp_avg_sq of a
  // piece, 3 units; the two landing buffers of gradients homed off the
  // device among it).
  cap.host_bytes = 22 * 65536 * 4;
  cap.nvme_bytes = int64_t(1) << 40;
  PlacementPlan p = make_plan(cfg, layout, 0, cap);
  EXPECT_GT(p.state.bytes[int(Category::kExpAvgSq)][int(Tier::kNvme)], 0);  // spilled, not all "device"
  EXPECT_TRUE(plan_shortfalls(p, cap).empty()) << plan_shortfalls(p, cap)[0];
}

TEST(PlacementTest, ShortfallNamesTheTierAndTheNumbers) {
  StateLayout layout = make_layout();
  PlacementPlan p = make_plan(config_with({}), layout, 0, unlimited());
  MachineCapacity cap;
  cap.device_is_host = false;
  cap.device_addressable = false;
  cap.device_bytes = 1 << 20;
  cap.host_bytes = int64_t(1) << 34;
  auto s = plan_shortfalls(p, cap);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].rfind("device: short by", 0), 0u) << s[0];
  EXPECT_NE(s[0].find("has 1.0 MiB"), std::string::npos) << s[0];
  cap.device_bytes = -1;
  EXPECT_TRUE(plan_shortfalls(p, cap).empty());
}

// A GPU's capacity is its free memory now, capped by run.device_memory_mb;
// where this machine has no such GPU, the budget alone, or unknown (said so).
TEST(PlacementTest, GpuCapacityIsMeasuredFreeMemoryOrTheBudget) {
  MachineCapacity c = measure_capacity(config_with({"run.device=\"cuda\""}), {});
  EXPECT_FALSE(c.device_is_host);
  DeviceMemoryInfo info;
  if (query_device_memory("cuda", &info)) {
    EXPECT_GT(c.device_bytes, 0);
    EXPECT_LE(c.device_bytes, info.total_bytes);
    EXPECT_EQ(c.device_source.rfind("cuda: ", 0), 0u) << c.device_source;
  } else {
    EXPECT_EQ(c.device_bytes, -1);
    EXPECT_NE(c.device_source.find("not measured"), std::string::npos) << c.device_source;
  }
  MachineCapacity b = measure_capacity(config_with({"run.device=\"cuda\"", "run.device_memory_mb=100"}), {});
  EXPECT_LE(b.device_bytes, int64_t(100) << 20);
  if (!query_device_memory("cuda", &info)) {
    EXPECT_EQ(b.device_bytes, int64_t(100) << 20);
    EXPECT_EQ(b.device_source, "run.device_memory_mb");
  }
  // CPU compute: the device tier is host memory, no GPU asked about.
  MachineCapacity h = measure_capacity(config_with({}), {});
  EXPECT_TRUE(h.device_is_host);
  EXPECT_EQ(h.device_bytes, -1);
  EXPECT_TRUE(h.device_source.empty());
}

// comm.secondary_shard: at stage 3 on 2 nodes of 2 ranks, auto keeps each
// node's share of every block not kept gathered (1/2 of its 16-bit
// parameters) when it fits on the device; not on one node, with one rank per
// node, below stage 3, when off, or when the device has no room left for it.
TEST(PlacementTest, SecondaryShardOnSeveralNodesWhenItFits) {
  const StateLayout layout = make_layout(4);
  auto cfg = [](std::vector<std::string> o) {
    o.insert(o.begin(), {"comm.keep_gathered=\"none\"", "run.device=\"cuda\""});
    nlohmann::json j = {{"data", {{"path", "unused.txt"}}}, {"train_batch_size", 4},
                        {"zero_optimization", {{"sub_group_size", 65536}, {"stage", 3}}}};
    return parse_config(j, o, 4);
  };
  auto capacity = [](int per_node, int64_t device_bytes) {
    MachineCapacity m;
    m.ranks_per_node = per_node;
    m.device_is_host = false;
    m.device_addressable = false;
    m.device_bytes = device_bytes;
    return m;
  };
  const Config on = cfg({});
  // The whole model's 16-bit (fp32 here) parameters over the node's 2 ranks.
  const int64_t secondary = kTotal / 2 * 4;
  PlacementPlan p = make_plan(on, layout, 0, capacity(2, -1));
  EXPECT_TRUE(p.comm.secondary_shard);
  EXPECT_EQ(p.staging.secondary, secondary);
  PlacementPlan without = make_plan(cfg({"comm.secondary_shard=\"off\""}), layout, 0, capacity(2, -1));
  EXPECT_FALSE(without.comm.secondary_shard);
  EXPECT_EQ(without.staging.secondary, 0);
  EXPECT_EQ(p.staging.device_bytes() - without.staging.device_bytes(), secondary);
  EXPECT_FALSE(make_plan(on, layout, 0, capacity(4, -1)).comm.secondary_shard);  // one node
  EXPECT_FALSE(make_plan(on, layout, 0, capacity(1, -1)).comm.secondary_shard);  // a rank per node
  EXPECT_FALSE(make_plan(cfg({"zero_optimization.stage=2"}), StateLayout(make_layout(4)), 0, capacity(2, -1))
                   .comm.secondary_shard);
  // A device with room for everything but the secondary shard: auto leaves
  // it out, on takes it (and the plan says it does not fit).
  const auto t = without.total();
  const int64_t tight = int64_t(double(t[0] + secondary / 2) / (1.0 - on.placement.headroom));
  EXPECT_FALSE(make_plan(on, layout, 0, capacity(2, tight)).comm.secondary_shard);
  EXPECT_TRUE(make_plan(on, layout, 0, capacity(2, tight * 2)).comm.secondary_shard);
  PlacementPlan forced = make_plan(cfg({"comm.secondary_shard=\"on\""}), layout, 0, capacity(2, tight));
  EXPECT_TRUE(forced.comm.secondary_shard);
  // Kept blocks need none: with all kept, no secondary shard.
  PlacementPlan kept = make_plan(cfg({"comm.keep_gathered=\"all\""}), layout, 0, capacity(2, -1));
  EXPECT_FALSE(kept.comm.secondary_shard);
  EXPECT_EQ(kept.staging.secondary, 0);
}

TEST(PlacementTest, BadPlacementSectionsNameTheKey) {
  auto key_of = [](const std::vector<std::string>& o) {
    try {
      config_with(o);
    } catch (const ConfigError& e) {
      return e.key();
    }
    return std::string("no error");
  };
  EXPECT_EQ(key_of({"placement={\"grad\":{\"device\":0.5,\"host\":0.4}}"}), "placement.grad");
  EXPECT_EQ(key_of({"placement={\"grad\":{\"gpu\":1.0}}"}), "placement.grad.gpu");
  EXPECT_EQ(key_of({"placement={\"master\":{\"nvme\":1.0}}"}), "placement.nvme_path");
  EXPECT_EQ(key_of({"placement=\"manual\""}), "placement");
  EXPECT_EQ(key_of({"placement={\"param16\":{\"device\":1.5,\"host\":-0.5}}"}), "placement.param16.device");
  EXPECT_EQ(key_of({"run.device_memory_mb=-1"}), "run.device_memory_mb");
  EXPECT_EQ(key_of({"placement={\"auto\":true,\"grad\":{\"host\":1.0}}"}), "placement.auto");
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// Note [Step schedules]: the rows the schedule adds to the plan, by hand.
// Model dim 64, seq 32, vocab 256, micro-batch 2, A = 4, fp32, tied:
//   one layer's saved input: 2 x 32 tokens x 64 x 4 bytes = 16384;
//   saved inputs per micro-batch: the tokens (64 x 8 = 512) and 2 layers'
//   inputs (32768): 33280; layer holds 4 micro-batches' (133120), micro_batch one;
//   layer's 4 output gradients between blocks: 4 x 16384 = 65536;
//   layer's 4 head gradients of the tied embedding: 4 x 256 x 64 x 4 = 262144;
//   with gradients on the host, layer's block gradient sum: the largest
//   block (65536 elements) in fp32 = 262144 bytes;
//   with cpu_checkpointing, host slots for 4 micro-batches of 2 layers
//   (131072) and two device slots (32768).
TEST(PlacementTest, TheLayerSchedulesRowsAreTheActivationsItHolds) {
  const StateLayout layout = make_layout();
  const std::vector<std::string> base = {"model.dim=64", "model.n_heads=4", "model.n_layers=2", "model.seq_len=32",
                                         "model.vocab_size=256", "model.tie_embeddings=true",
                                         "train_micro_batch_size_per_gpu=2", "gradient_accumulation_steps=4",
                                         "run.recompute=\"always\"", "placement={\"grad\":{\"host\":1}}"};
  auto plan = [&](const std::string& schedule, std::vector<std::string> more = {}) {
    std::vector<std::string> o = base;
    o.push_back("run.schedule=\"" + schedule + "\"");
    o.insert(o.end(), more.begin(), more.end());
    return make_plan(config_with(o), layout, 0, unlimited());
  };
  const PlacementPlan mb = plan("micro_batch"), ly = plan("layer");
  ASSERT_FALSE(mb.step.schedule == StepSchedule::kLayer);
  ASSERT_TRUE(ly.step.schedule == StepSchedule::kLayer);
  EXPECT_EQ(mb.step.held_micro, 1);
  EXPECT_EQ(ly.step.held_micro, 4);
  EXPECT_EQ(mb.activations.checkpoint_activation_bytes, 33280);
  EXPECT_EQ(ly.activations.checkpoint_activation_bytes, 133120);
  EXPECT_EQ(mb.activations.held_output_grad_bytes, 0);
  EXPECT_EQ(ly.activations.held_output_grad_bytes, 65536);
  EXPECT_EQ(mb.activations.held_tied_grad_bytes, 0);
  EXPECT_EQ(ly.activations.held_tied_grad_bytes, 262144);
  EXPECT_EQ(ly.activations.bytes - mb.activations.bytes, (133120 - 33280) + 65536 + 262144);
  EXPECT_EQ(mb.staging.grad_accum, 0);
  EXPECT_EQ(ly.staging.grad_accum, 262144);
  // Gradients land once, in fp32: the landing buffers hold a block's fp32 shard either way here.
  EXPECT_EQ(ly.staging.grad_host, 2 * 65536 * 4);
  const PlacementPlan off = plan("layer", {"activation_checkpointing.cpu_checkpointing=true"});
  EXPECT_EQ(off.staging.ckpt_host, 131072);
  EXPECT_EQ(off.staging.ckpt_device, 32768);
  EXPECT_EQ(off.activations.checkpoint_activation_bytes, 4 * 512);
  EXPECT_EQ(plan("micro_batch", {"activation_checkpointing.cpu_checkpointing=true"}).staging.ckpt_host, 32768);
  // One micro-batch: layer holds nothing more.
  const PlacementPlan one = plan("layer", {"gradient_accumulation_steps=1"});
  EXPECT_EQ(one.activations.bytes, plan("micro_batch", {"gradient_accumulation_steps=1"}).activations.bytes);
  EXPECT_EQ(one.staging.grad_accum, 0);
  // A device too small for layer's activations: the verdict names the
  // schedule's rows and what to change.
  MachineCapacity cap;
  cap.device_bytes = mb.total()[0] + 1000;
  const std::vector<std::string> verdict = plan_shortfalls(ly, cap);
  ASSERT_EQ(verdict.size(), 1u);
  EXPECT_NE(verdict[0].find("the layer schedule holds the activations of 4 micro-batches"), std::string::npos)
      << verdict[0];
  EXPECT_NE(verdict[0].find("run.schedule \"micro_batch\""), std::string::npos) << verdict[0];
  EXPECT_NE(verdict[0].find("cpu_checkpointing"), std::string::npos) << verdict[0];
  EXPECT_TRUE(plan_shortfalls(mb, cap).empty());
  // auto without rates on that device: layer does not fit, so micro_batch.
  Config a = config_with(base);
  const PlacementPlan chosen = make_plan(a, layout, 0, cap);
  EXPECT_FALSE(chosen.step.schedule == StepSchedule::kLayer) << chosen.step.choice;
  EXPECT_NE(chosen.step.choice.find("does not fit"), std::string::npos) << chosen.step.choice;
  EXPECT_TRUE(make_plan(a, layout, 0, unlimited()).step.schedule == StepSchedule::kLayer);
  // The window gets what the rest leaves of a device budget: layer leaves it
  // less by its extra held activations and the block-sized fp32 sum of
  // its gradient (the layout's largest block, 65536 elements, in fp32).
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> o = base;
    o.insert(o.end(), more.begin(), more.end());
    return config_with(o);
  };
  MachineCapacity gpu;
  gpu.device_is_host = false;
  gpu.device_bytes = int64_t(64) << 20;
  const PlacementPlan mbw = make_plan(with({"run.schedule=\"micro_batch\""}), layout, 0, gpu);
  const PlacementPlan lyw = make_plan(with({"run.schedule=\"layer\""}), layout, 0, gpu);
  ASSERT_GT(lyw.window_cap_bytes, 0);
  EXPECT_EQ(mbw.window_cap_bytes - lyw.window_cap_bytes, (133120 - 33280) + 65536 + 262144 + 65536 * 4);
  // Auto without rates keeps micro_batch where layer's activations would
  // cost it kept entries (run.recompute auto): a device that holds more
  // layers' entries under micro_batch than under layer.
  auto with_recompute_auto = [&](const std::string& schedule) {
    return with({"run.recompute=\"auto\"", "run.schedule=\"" + schedule + "\""});
  };
  MachineCapacity tight = gpu;
  tight.device_bytes = lyw.total()[0] + 1024;
  const PlacementPlan mbk = make_plan(with_recompute_auto("micro_batch"), layout, 0, tight);
  const PlacementPlan lyk = make_plan(with_recompute_auto("layer"), layout, 0, tight);
  ASSERT_GT(mbk.activations.keep_device_packs, lyk.activations.keep_device_packs)
      << mbk.activations.recompute_choice << "; " << lyk.activations.recompute_choice;
  ASSERT_TRUE(plan_shortfalls(lyk, tight).empty());
  ASSERT_EQ(lyk.state.bytes, mbk.state.bytes);
  const PlacementPlan ak = make_plan(with_recompute_auto("auto"), layout, 0, tight);
  EXPECT_FALSE(ak.step.schedule == StepSchedule::kLayer) << ak.step.choice;
  EXPECT_NE(ak.step.choice.find("fewer layers' entries"), std::string::npos) << ak.step.choice;
  EXPECT_TRUE(make_plan(with_recompute_auto("auto"), layout, 0, unlimited()).step.schedule == StepSchedule::kLayer);
}

// optimizer.speculate (Note [Speculative optimizer] in
// engine/optimizer/optimizer_pass.h): auto speculates on a GPU with CPU Adam's pieces
// and no optimizer state on NVMe; not on the CPU device, not where every
// piece is the device's Adam, not with the optimizer inline; on forces it
// where the optimizer has its thread and refuses, naming the key, where not.
TEST(PlacementTest, SpeculationIsResolvedWhereItHides) {
  const StateLayout layout = make_layout();
  MachineCapacity gpu;
  gpu.device_is_host = false;
  gpu.device_addressable = false;
  auto plan = [&](std::vector<std::string> o, const MachineCapacity& cap) {
    o.insert(o.begin(), {"run.schedule=\"layer\"", "gradient_accumulation_steps=2"});
    return make_plan(config_with(o), layout, 0, cap);
  };
  const std::string host = "placement={\"optimizer\":{\"host\":1}}";
  const std::string nvme = "placement={\"optimizer\":{\"nvme\":1},\"nvme_path\":\"/tmp/x\"}";
  EXPECT_TRUE(plan({host}, gpu).optimizer.speculate) << plan({host}, gpu).optimizer.speculate_choice;
  EXPECT_EQ(speculated_numel(plan({host}, gpu)), kTotal);
  EXPECT_FALSE(plan({}, gpu).optimizer.speculate) << "every piece in HBM";
  EXPECT_NE(plan({}, gpu).optimizer.speculate_choice.find("device's Adam"), std::string::npos);
  // Optimizer state on NVMe: alternate swap slots where the disk has room
  // for a second copy of master weights and moments (unknown counts as
  // room), else auto is off and on reads the state twice (two passes).
  EXPECT_TRUE(plan({nvme}, gpu).optimizer.speculate) << plan({nvme}, gpu).optimizer.speculate_choice;
  EXPECT_TRUE(plan({nvme}, gpu).optimizer.speculate_slots);
  EXPECT_EQ(plan({nvme}, gpu).optimizer.nvme_spare_bytes, 12 * kTotal);
  MachineCapacity small_disk = gpu;
  small_disk.nvme_bytes = plan({nvme, "optimizer.speculate=\"off\""}, gpu).total()[size_t(Tier::kNvme)];
  EXPECT_FALSE(plan({nvme}, small_disk).optimizer.speculate);
  EXPECT_NE(plan({nvme}, small_disk).optimizer.speculate_choice.find("no room for its alternate slots"), std::string::npos)
      << plan({nvme}, small_disk).optimizer.speculate_choice;
  MachineCapacity room = small_disk;
  room.nvme_bytes += 12 * kTotal;
  EXPECT_TRUE(plan({nvme}, room).optimizer.speculate_slots) << "exactly room for the slots";
  const PlacementPlan forced = plan({nvme, "optimizer.speculate=\"on\""}, small_disk);
  EXPECT_TRUE(forced.optimizer.speculate);
  EXPECT_FALSE(forced.optimizer.speculate_slots);
  EXPECT_EQ(forced.optimizer.nvme_spare_bytes, 0);
  EXPECT_NE(forced.optimizer.speculate_choice.find("two passes"), std::string::npos) << forced.optimizer.speculate_choice;
  EXPECT_FALSE(plan({nvme, "optimizer.speculate_slots=false"}, gpu).optimizer.speculate);
  EXPECT_NE(plan({nvme, "optimizer.speculate_slots=false"}, gpu).optimizer.speculate_choice.find("speculate_slots is false"),
            std::string::npos);
  EXPECT_FALSE(plan({host}, gpu).optimizer.speculate_slots) << "no state on NVMe, no slots";
  EXPECT_TRUE(plan({nvme, "optimizer.speculate=\"on\""}, gpu).optimizer.speculate);
  EXPECT_FALSE(plan({host}, unlimited()).optimizer.speculate) << "the CPU device";
  EXPECT_TRUE(plan({host, "optimizer.speculate=\"on\""}, unlimited()).optimizer.speculate);
  EXPECT_FALSE(plan({host, "optimizer.speculate=\"off\""}, gpu).optimizer.speculate);
  EXPECT_FALSE(plan({host, "run.overlap_optimizer=false"}, gpu).optimizer.speculate);
  // micro_batch with several micro-batches: a gradient is final only in the
  // last one's backward.
  EXPECT_FALSE(plan({host, "run.schedule=\"micro_batch\""}, gpu).optimizer.speculate);
  EXPECT_THROW(plan({host, "run.schedule=\"micro_batch\"", "optimizer.speculate=\"on\""}, gpu), ConfigError);
  EXPECT_TRUE(plan({host, "run.schedule=\"micro_batch\"", "gradient_accumulation_steps=1"}, gpu).optimizer.speculate);
  // run.schedule auto with one micro-batch (micro_batch's order): on holds.
  EXPECT_TRUE(make_plan(config_with({host, "gradient_accumulation_steps=1", "optimizer.speculate=\"on\""}), layout, 0,
                        unlimited())
                  .optimizer.speculate);
  try {
    plan({host, "run.overlap_optimizer=false", "optimizer.speculate=\"on\""}, gpu);
    ADD_FAILURE() << "on without the optimizer's thread was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer.speculate"), std::string::npos) << e.what();
  }
}

// run.schedule auto with rates chooses the schedule with the lower bound,
// on two configurations that go opposite ways: gradients homed on the host
// of a GPU (layer lands each once: fewer D2H bytes and gradient adds), and
// auto placement on a GPU whose memory holds micro_batch's activations beside
// all the state but not layer's, so layer moves parameters off the device
// and fetches them over a slow H2D link.
TEST(PlacementTest, AutoScheduleFollowsTheBoundBothWays) {
  const StateLayout layout = make_layout();
  Rates r;
  r.device_flops = 1e12, r.adam = 1e9, r.h2d = 0.5e9, r.d2h = 0.5e9, r.pcie_both = 1e9;
  r.nvme_read = r.nvme_write = r.nvme_both = 2e9, r.grad_add = 0.2e9, r.checksum = 10e9;
  auto bound_of = [&](const Config& c, const PlacementPlan& p) {
    return step_bound(predicted_work(c, p, train_fetches(p), step_network_bytes(p)), r, false).seconds;
  };
  std::map<bool, int> chosen_layer;
  for (int k = 0; k < 2; ++k) {
    std::vector<std::string> o = {"model.dim=64", "model.n_heads=4", "model.n_layers=2", "model.seq_len=64",
                                  "model.vocab_size=256", "train_micro_batch_size_per_gpu=4",
                                  "gradient_accumulation_steps=8", "run.swap_checksums=false",
                                  "run.recompute=\"always\""};
    MachineCapacity cap;
    cap.device_is_host = false;
    cap.device_addressable = false;
    if (k == 0) {
      o.push_back("placement={\"grad\":{\"host\":1},\"optimizer\":{\"host\":1}}");
    } else {
      o.push_back("placement={\"auto\":true,\"headroom\":0.0,\"nvme_path\":\"/tmp/x\"}");
    }
    Config cfg = config_with(o), mbc = cfg, lyc = cfg;
    mbc.run.schedule = StepSchedule::kMicroBatch;
    lyc.run.schedule = StepSchedule::kLayer;
    if (k == 1) {
      // Everything on the device under micro_batch, with 1 KiB to spare.
      cap.device_bytes = make_plan(mbc, layout, 0, unlimited()).total()[0] + 1024;
      cap.host_bytes = int64_t(1) << 40;
    }
    const PlacementPlan mb = make_plan(mbc, layout, 0, cap), ly = make_plan(lyc, layout, 0, cap);
    ASSERT_TRUE(plan_shortfalls(ly, cap).empty()) << k;
    const double smb = bound_of(mbc, mb), sly = bound_of(lyc, ly);
    const PlacementPlan chosen = choose_schedule_by_bound(cfg, layout, 0, cap, r);
    // Without rates: layer where it gives nothing up (k = 0), else
    // micro_batch; the bound overrides that only when lower by more than
    // kAutoMargin.
    const bool layer_default = layer_gives_up(mb, ly).empty();
    EXPECT_EQ(layer_default, k == 0) << layer_gives_up(mb, ly);
    const bool expect_layer = layer_default ? !(smb < sly * (1 - kAutoMargin)) : sly < smb * (1 - kAutoMargin);
    EXPECT_EQ(chosen.step.schedule == StepSchedule::kLayer, expect_layer) << k << ": micro_batch " << smb << " s, layer " << sly << " s; "
                                                  << chosen.step.choice;
    EXPECT_EQ(chosen.step.schedule == StepSchedule::kLayer, sly < smb) << "the lower bound did not win by the margin here";
    EXPECT_NE(chosen.step.choice.find("bound"), std::string::npos) << chosen.step.choice;
    ++chosen_layer[(chosen.step.schedule == StepSchedule::kLayer)];
    if (k == 1) {
      EXPECT_EQ(mb.state.split[int(Category::kParam16)].device, 1.0);
      EXPECT_LT(ly.state.split[int(Category::kParam16)].device + ly.state.split[int(Category::kMaster)].device, 2.0)
          << "layer's activations moved no state";
    }
  }
  EXPECT_EQ(chosen_layer[true], 1) << "the two configurations did not go opposite ways";
  EXPECT_EQ(chosen_layer[false], 1);
}

}  // namespace
}  // namespace strata
