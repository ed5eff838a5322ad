// The step's bound (plan/bound.h) against work computed by hand: model
// FLOPs of small configs, bytes per link of small placements (each figure
// written out below from docs/design.md's table), seconds from given rates.
#include "plan/planner.h"

#include <gtest/gtest.h>

#include "memory/layout.h"
#include "util/errors.h"
#include "util/logging.h"

namespace strata {
namespace {

// 8 blocks of 64 Ki elements (already multiples of the 2048 quantum).
StateLayout make_layout(int64_t shards = 1) {
  std::vector<std::pair<std::string, std::vector<ParamSpec>>> blocks;
  for (int b = 0; b < 8; ++b) blocks.push_back({"block." + std::to_string(b), {{"w", {256, 256}, Init::kNormal, 0.02}}});
  return StateLayout(blocks, shards);
}
constexpr int64_t kN = 8 * 65536;

// The micro_batch schedule unless an override says otherwise (the layer
// schedule's work: BoundTest.TheLayerScheduleLandsEachGradientOnce).
Config config_with(const std::vector<std::string>& overrides) {
  nlohmann::json j = {{"data", {{"path", "unused.txt"}}}, {"zero_optimization", {{"sub_group_size", 65536}}},
                      {"run", {{"schedule", "micro_batch"}}}, {"optimizer", {{"speculate", "off"}}}};
  return parse_config(j, overrides);
}

MachineCapacity gpu_like() {
  MachineCapacity m;
  m.device_is_host = false;
  m.device_addressable = false;
  return m;
}

// Param16 in host RAM, gradients and optimizer state on NVMe, two
// micro-batches of one (BytesPerLinkOfAnOffloadedPlacement counts its bytes),
// two threads of compute.
Config offloaded_config(bool checksums) {
  return config_with(
      {"gradient_accumulation_steps=2", "train_micro_batch_size_per_gpu=1", "run.overlap_optimizer=true",
       "run.threads=2",
       std::string("run.swap_checksums=") + (checksums ? "true" : "false"),
       "placement={\"param16\":{\"host\":1},\"grad\":{\"nvme\":1},\"optimizer\":{\"nvme\":1},\"nvme_path\":\"/tmp\"}"});
}

// Rates for `w` on the CPU device: 0.05 s of compute of which the first
// forward is an eighth (0.00625 s), Adam at 1 G elements/s, 2 GB/s H2D, 4
// GB/s D2H, gradient adds at 0.5 G elements/s, NVMe 1 GB/s read, 0.5 GB/s
// write, 1 GB/s both at once.
Rates cpu_rates(StepWork& w) {
  Rates r;
  r.device_flops = w.flops / 0.05;
  w.first_forward_flops = w.flops / 8;
  r.adam = 1e9;
  r.h2d = 2e9, r.d2h = 4e9, r.nvme_read = 1e9, r.nvme_write = 0.5e9, r.nvme_both = 1e9;
  r.grad_add = 0.5e9;
  return r;
}

// dim 64, 2 layers, 4 heads of 16 (2 kv heads), ffn 96, vocab 256, seq 32:
//   per layer, matrices: q 64x64 = 4096, k and v 64x32 = 2048 each, o 4096,
//   gate/up/down 3 x 64 x 96 = 18432: 30720 multiply-adds per token;
//   layer forward per token: 2 x 30720 + 4 x 32 (seq) x 64 (q width) = 69632;
//   forward per token: 2 x 69632 + the head's 2 x 256 x 64 = 172032;
//   a layer recomputed per token: 69632 less its down projection's
//   2 x 64 x 96 = 57344.
TEST(BoundTest, StepFlopsCountEveryMatrixTheHeadAndTheAttention) {
  ModelConfig m;
  m.dim = 64;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.ffn_hidden = 96;
  m.vocab_size = 256;
  m.seq_len = 32;
  EXPECT_DOUBLE_EQ(step_flops(m, 10, 0), 10.0 * 3 * 172032);            // forward + backward
  EXPECT_DOUBLE_EQ(step_flops(m, 10, 2), 10.0 * (3 * 172032 + 2 * 57344));  // + the layers again
  EXPECT_DOUBLE_EQ(step_flops(m, 10, 1), 10.0 * (3 * 172032 + 57344));      // + one layer again
  m.explicit_head_dim = 32;  // q 128 wide: q, o 64x128 = 8192 each, k, v 64x64 = 4096 each
  const double layer = 2 * (8192 + 2 * 4096 + 8192 + 18432) + 4 * 32 * 128;
  EXPECT_DOUBLE_EQ(step_flops(m, 1, 0), 3 * (2 * layer + 2 * 256 * 64));
}

// The same placement under the layer schedule (Note [Step schedules]): each
// block's two micro-batches summed on the device and landed once, in fp32,
// as the home's first write (no read-modify-write on NVMe):
//   h2d: param16 4n = 2097152 (as before: the blocks are persistent)
//   d2h: gradients 4n x 1 = 2097152
//   nvme read: optimizer state 12n + the optimizer's gradient 4n = 8388608
//   nvme write: gradients 4n + optimizer state 12n = 8388608
//   gradient adds: n = 524288 elements
// and the optimizer of the step before overlaps both micro-batches' forward.
TEST(BoundTest, TheLayerScheduleLandsEachGradientOnce) {
  Config cfg = offloaded_config(/*checksums=*/false);
  const PlacementPlan mb = make_plan(cfg, make_layout(), 0, MachineCapacity{});
  cfg.run.schedule = StepSchedule::kLayer;
  const PlacementPlan p = make_plan(cfg, make_layout(), 0, MachineCapacity{});
  ASSERT_TRUE(p.step.schedule == StepSchedule::kLayer);
  const std::vector<int64_t> f = train_fetches(p);
  EXPECT_EQ(f, std::vector<int64_t>(8, 1));
  const StepWork w = predicted_work(cfg, p, f, NetworkBytes{});
  EXPECT_EQ(w.links.h2d, 2097152);
  EXPECT_EQ(w.links.d2h, 2097152);
  EXPECT_EQ(w.links.nvme_read, 8388608);
  EXPECT_EQ(w.links.nvme_write, 8388608);
  EXPECT_EQ(w.grad_add_elems, 524288);
  EXPECT_EQ(w.adam_elems, kN);
  const StepWork wm = predicted_work(cfg, mb, train_fetches(mb), NetworkBytes{});
  EXPECT_EQ(w.flops, wm.flops);
  EXPECT_EQ(w.first_forward_flops, 2 * wm.first_forward_flops);
  // With ranks: one reduction per block per step, not one per micro-batch.
  Config two = cfg;
  two.world_size = 2;
  two.zero.stage = 2;
  two.run.schedule = StepSchedule::kMicroBatch;
  two.comm.gradient_reduction = GradientReduction::kPerMicroBatch;
  const StateLayout l2 = make_layout(2);
  const NetworkBytes per_micro = step_network_bytes(make_plan(two, l2, 0, MachineCapacity{}));
  two.run.schedule = StepSchedule::kLayer;
  const NetworkBytes per_step = step_network_bytes(make_plan(two, l2, 0, MachineCapacity{}));
  // reduce-scatter of every block: (ws - 1) / ws of its fp32 bytes per rank,
  // 8 blocks of 65536; stages 1-2 also gather the 16-bit (here fp32) weights
  // once, and the norm all-reduce sends 2 x (ws - 1) / ws of 24 bytes.
  const int64_t reduce = 8 * 65536 / 2 * 4;
  EXPECT_EQ(per_micro.world - per_step.world, reduce);
}

// CPU compute (host-addressable device): param16 in host RAM (fetched once,
// the blocks are persistent), gradients and optimizer state on NVMe, fp32,
// two micro-batches, n = 524288 elements:
//   h2d: param16 4n = 2097152
//   d2h: gradients 4n x 2 = 4194304
//   nvme read: gradient read-add-write 4n x 1 + optimizer state 12n + the optimizer's gradient 4n = 10485760
//   nvme write: gradients 4n x 2 + optimizer state 12n = 10485760
//   gradient adds (the lander, into homes off the device): n x 2 = 1048576 elements
// (without the swap checksums: BoundTest.SwapChecksumsShareTheCpu has them).
TEST(BoundTest, BytesPerLinkOfAnOffloadedPlacement) {
  const Config cfg = offloaded_config(/*checksums=*/false);
  const PlacementPlan p = make_plan(cfg, make_layout(), 0, MachineCapacity{});
  const std::vector<int64_t> f = train_fetches(p);
  EXPECT_EQ(f, std::vector<int64_t>(8, 1));
  StepWork w = predicted_work(cfg, p, f, NetworkBytes{});
  EXPECT_EQ(w.links.h2d, 2097152);
  EXPECT_EQ(w.links.d2h, 4194304);
  EXPECT_EQ(w.links.nvme_read, 10485760);
  EXPECT_EQ(w.links.nvme_write, 10485760);
  EXPECT_EQ(w.adam_elems, kN);
  EXPECT_EQ(w.grad_add_elems, 1048576);
  EXPECT_EQ(w.checksum_bytes, 0);
  // The optimizer's part: state 12n each way, its gradient read 4n.
  EXPECT_EQ(w.optimizer_links.nvme_read, 8388608);
  EXPECT_EQ(w.optimizer_links.nvme_write, 6291456);
  EXPECT_EQ(w.optimizer_links.h2d + w.optimizer_links.d2h, 0);  // in place on the CPU device
  // Rates: 1 GB/s read, 0.5 GB/s write, 1 GB/s both at once (the disk's
  // time is the longest of the three), 2 GB/s H2D, 4 GB/s D2H, 0.05 s of
  // compute of which the first forward is an eighth (0.00625 s).
  Rates r = cpu_rates(w);  // Adam: + 0.000524288 s on the same cores
  StepBound b = step_bound(w, r, /*cpu_compute=*/true);
  ASSERT_EQ(b.resources.size(), 3u);
  // The cores: 0.05 s of compute, 0.000524288 s of Adam, the copies on the
  // compute's thread, memcpy here: H2D 0.001048576 s and D2H 0.001048576 s,
  // and half (one thread of the two) of the gradient adds' 0.002097152 s.
  EXPECT_EQ(w.cpu_threads, 2);
  EXPECT_EQ(b.resources[0].resource, "cpu (compute + Adam + copies + gradient adds)");
  EXPECT_NEAR(b.resources[0].seconds, 0.05 + 0.000524288 + 0.002097152 + 0.002097152 / 2, 1e-12);
  // Reads 0.01048576 s, writes 0.02097152 s, both 20971520 B at 1 GB/s.
  EXPECT_EQ(b.resources[1].resource, "nvme (read + write)");
  EXPECT_NEAR(b.resources[1].seconds, 0.02097152, 1e-12);
  // The optimizer's I/O (reads 0.008388608 s, writes 0.012582912 s, both
  // 14680064 B: 0.014680064 s) outlasts the first forward with Adam
  // (0.00625 + 0.000524288 s); the rest of the compute (0.04375 s), the
  // copies (0.002097152 s) and the adds' share of the cores (0.001048576 s) follow.
  EXPECT_EQ(b.resources[2].resource, "dependencies");
  EXPECT_NEAR(b.resources[2].seconds, 0.014680064 + 0.04375 + 0.002097152 + 0.001048576, 1e-12);
  EXPECT_EQ(b.binding, "dependencies");
  EXPECT_NEAR(b.seconds, 0.061575792, 1e-12);
  // Without the overlap, compute, copies and adds, then the optimizer: 0.05 +
  // 0.002097152 + 0.001048576 + 0.014680064.
  w.overlap_optimizer = false;
  EXPECT_NEAR(step_bound(w, r, true).seconds, 0.067825792, 1e-12);
  w.overlap_optimizer = true;
  // Writes at 0.1 GB/s: the disk takes 0.1048576 s, the optimizer's writes
  // 0.06291456 s, and the dependencies 0.06291456 + 0.04375 + 0.003145728 s bind.
  r.nvme_write = 0.1e9;
  b = step_bound(w, r, true);
  EXPECT_NEAR(b.resources[1].seconds, 0.1048576, 1e-12);
  EXPECT_EQ(b.binding, "dependencies");
  EXPECT_NEAR(b.seconds, 0.109810288, 1e-12);
  // One thread of compute: the adds take their whole 0.002097152 s.
  w.cpu_threads = 1;
  EXPECT_NEAR(step_bound(w, r, true).resources[0].seconds, 0.05 + 0.000524288 + 0.004194304, 1e-12);
  w.cpu_threads = 2;
  // Without any compute to hide behind, the disk binds.
  w.flops = w.first_forward_flops = 0;
  w.adam_elems = 0;
  b = step_bound(w, r, true);
  EXPECT_EQ(b.binding, "nvme (read + write)");
  EXPECT_NEAR(b.seconds, 0.1048576, 1e-12);
}

// A GPU (not host-addressable), bf16, one micro-batch: weights and gradients
// on the device, optimizer state in host RAM: CPU Adam reads the fp32
// gradient over D2H (4n = 2097152) and sends the bf16 working copy back over
// H2D (2n = 1048576). On a GPU compute, CPU Adam and the PCIe directions are
// separate resources, and both directions at once have their own rate.
TEST(BoundTest, OnAGpuCpuAdamPcieAndComputeAreSeparateResources) {
  const Config cfg = config_with(
      {"bf16.enabled=true", "placement={\"param16\":{\"device\":1},\"grad\":{\"device\":1},\"optimizer\":{\"host\":1}}"});
  const PlacementPlan p = make_plan(cfg, make_layout(), 0, gpu_like());
  StepWork w = predicted_work(cfg, p, train_fetches(p), NetworkBytes{});
  EXPECT_EQ(w.links.h2d, 1048576);
  EXPECT_EQ(w.links.d2h, 2097152);
  EXPECT_EQ(w.links.nvme_read + w.links.nvme_write, 0);
  EXPECT_EQ(w.adam_elems, kN);
  EXPECT_EQ(w.optimizer_links.h2d, 1048576);
  EXPECT_EQ(w.optimizer_links.d2h, 2097152);
  Rates r;
  r.device_flops = w.flops / 0.01;  // 0.01 s, a quarter of it the first forward
  w.first_forward_flops = w.flops / 4;
  r.adam = double(kN) / 0.02;       // 0.02 s
  r.h2d = 1048576 / 0.001, r.d2h = 2097152 / 0.001, r.pcie_both = 3145728 / 0.0025;
  EXPECT_EQ(missing_rates(w, Rates{}, false),
            (std::vector<std::string>{"--device-tflops", "--adam-gelems", "--h2d-gbps", "--d2h-gbps", "--pcie-both-gbps"}));
  const StepBound b = step_bound(w, r, false);
  ASSERT_EQ(b.resources.size(), 6u);
  EXPECT_EQ(b.resources[0].resource, "device");
  EXPECT_NEAR(b.resources[0].seconds, 0.01, 1e-12);
  EXPECT_EQ(b.resources[1].resource, "cpu adam");
  EXPECT_NEAR(b.resources[1].seconds, 0.02, 1e-12);
  EXPECT_EQ(b.resources[4].resource, "pcie (h2d + d2h)");
  EXPECT_NEAR(b.resources[4].seconds, 0.0025, 1e-12);
  // The optimizer (CPU Adam's 0.02 s outlasts its PCIe 0.0025 s) runs beside
  // the first forward (0.0025 s); the rest of the compute (0.0075 s) after it.
  EXPECT_EQ(b.resources[5].resource, "dependencies");
  EXPECT_EQ(b.binding, "dependencies");
  EXPECT_NEAR(b.seconds, 0.02 + 0.0075, 1e-12);
  // Everything on the device: the device's own Adam, nothing crosses.
  const Config all = config_with({"bf16.enabled=true"});
  const PlacementPlan q = make_plan(all, make_layout(), 0, gpu_like());
  const StepWork v = predicted_work(all, q, train_fetches(q), NetworkBytes{});
  EXPECT_EQ(v.adam_elems, 0);
  EXPECT_EQ(v.links.h2d + v.links.d2h + v.links.nvme_read + v.links.nvme_write, 0);
  EXPECT_EQ(train_fetches(q), std::vector<int64_t>(8, 0));
}

// Note [Speculative optimizer]: the placement above with optimizer.speculate
// on. CPU Adam steps every element twice (the speculation and the commit),
// the gradient crosses D2H twice (4 bytes x 524288, twice), the working
// copy H2D once; a committed step waits after its backward only for block
// 0's speculation (an eighth of the elements, one of the two passes), a
// clipped one for the optimizer redone after the backward.
TEST(BoundTest, TheSpeculativeOptimizerHidesBehindTheBackwardUnlessClipped) {
  const Config cfg = config_with(
      {"bf16.enabled=true", "run.schedule=\"layer\"", "optimizer.speculate=\"on\"",
       "placement={\"param16\":{\"device\":1},\"grad\":{\"device\":1},\"optimizer\":{\"host\":1}}"});
  const PlacementPlan p = make_plan(cfg, make_layout(), 0, gpu_like());
  ASSERT_TRUE(p.optimizer.speculate) << p.optimizer.speculate_choice;
  EXPECT_EQ(speculated_numel(p), kN);
  StepWork w = predicted_work(cfg, p, train_fetches(p), NetworkBytes{});
  EXPECT_EQ(w.adam_elems, 2 * kN);
  EXPECT_EQ(w.speculated_elems, kN);
  EXPECT_EQ(w.speculation_tail_elems, 65536);
  EXPECT_EQ(w.optimizer_links.d2h, 2 * 2097152);
  EXPECT_EQ(w.optimizer_links.h2d, 1048576);
  Rates r;
  r.device_flops = w.flops / 0.01;  // 0.01 s, a quarter of it the first forward
  w.first_forward_flops = w.flops / 4;
  r.adam = double(kN) / 0.004;      // 0.004 s a pass
  r.h2d = 1048576 / 0.001, r.d2h = 2097152 / 0.001, r.pcie_both = 3145728 / 0.0025;
  const StepBound b = step_bound(w, r, false);
  EXPECT_EQ(b.binding, "dependencies");
  // max(CPU Adam 0.008 s, PCIe 5242880 bytes at 1.2582912 GB/s = 0.0041667 s) / 2 / 8 after the compute.
  EXPECT_NEAR(b.seconds, 0.01 + 0.008 / 16, 1e-12);
  w.clipped = true;
  const StepBound c = step_bound(w, r, false);
  // The redo (one pass, 0.004 s, under the PCIe's 0.0041667 s) beside the
  // first forward (0.0025 s), then the rest of the compute (0.0075 s).
  EXPECT_NEAR(c.seconds, 5242880 / (3145728 / 0.0025) + 0.0075, 1e-12);
  EXPECT_GT(c.seconds, b.seconds);
  // Without speculation: one pass, the optimizer beside the first forward.
  Config off = cfg;
  off.optimizer.speculate = Speculate::kOff;
  const PlacementPlan q = make_plan(off, make_layout(), 0, gpu_like());
  StepWork v = predicted_work(off, q, train_fetches(q), NetworkBytes{});
  EXPECT_EQ(v.adam_elems, kN);
  EXPECT_EQ(v.speculated_elems, 0);
}

// Note [Alternate swap slots]: the optimizer on NVMe speculating into spare
// slots. A committed step steps each element once (a commit flips), reads
// master and moments once (12 bytes x kN) and writes them once, into the
// spare slots; its step waits after the backward for block 0's share (an
// eighth) of the one pass. A clipped step pays the pass again: Adam twice,
// every optimizer byte twice (clipped_work).
TEST(BoundTest, AlternateSwapSlotsMakeACommittedStepOnePass) {
  const Config cfg = config_with(
      {"bf16.enabled=true", "run.schedule=\"layer\"", "optimizer.speculate=\"on\"", "run.swap_checksums=false",
       "placement={\"param16\":{\"device\":1},\"grad\":{\"device\":1},\"optimizer\":{\"nvme\":1},"
       "\"nvme_path\":\"/tmp/x\"}"});
  const PlacementPlan p = make_plan(cfg, make_layout(), 0, gpu_like());
  ASSERT_TRUE(p.optimizer.speculate_slots) << p.optimizer.speculate_choice;
  StepWork w = predicted_work(cfg, p, train_fetches(p), NetworkBytes{});
  EXPECT_EQ(w.adam_elems, kN);
  EXPECT_EQ(w.speculated_elems, kN);
  EXPECT_EQ(w.slot_elems, kN);
  EXPECT_EQ(w.optimizer_links.nvme_read, 12 * kN);
  EXPECT_EQ(w.optimizer_links.nvme_write, 12 * kN);
  EXPECT_EQ(w.optimizer_links.d2h, 4 * kN);  // the gradient, once
  EXPECT_EQ(w.optimizer_links.h2d, 2 * kN);  // the bf16 working copy
  const StepWork c = clipped_work(w);
  EXPECT_TRUE(c.clipped);
  EXPECT_EQ(c.adam_elems, 2 * kN);
  EXPECT_EQ(c.optimizer_links.nvme_read, 24 * kN);
  EXPECT_EQ(c.optimizer_links.nvme_write, 24 * kN);
  EXPECT_EQ(c.links.nvme_read - w.links.nvme_read, 12 * kN);
  EXPECT_EQ(c.optimizer_links.d2h, 8 * kN);
  Rates r;
  r.device_flops = w.flops / 0.01;  // 0.01 s, a quarter of it the first forward
  r.adam = double(kN) / 0.004;      // 0.004 s a pass
  r.nvme_read = double(12 * kN) / 0.002, r.nvme_write = double(12 * kN) / 0.002;
  r.nvme_both = double(24 * kN) / 0.002;
  r.h2d = double(2 * kN) / 0.001, r.d2h = double(4 * kN) / 0.001, r.pcie_both = double(6 * kN) / 0.0025;
  StepWork wf = w, cf = c;
  wf.first_forward_flops = cf.first_forward_flops = w.flops / 4;
  const StepBound b = step_bound(wf, r, false);
  EXPECT_EQ(b.binding, "dependencies");
  EXPECT_NEAR(b.seconds, 0.01 + 0.004 / 8, 1e-12);  // one pass, not half of two
  // Redone: one pass of Adam (0.004 s) under the optimizer's PCIe, now
  // 12 kN bytes at 6 kN / 0.0025 s = 0.005 s, beside the first forward, then
  // the rest of the compute (0.0075 s).
  const StepBound cb = step_bound(cf, r, false);
  EXPECT_NEAR(cb.seconds, 0.005 + 0.0075, 1e-12);
}

// Note [Speculating NVMe state]: optimizer.speculate auto keeps the
// alternate swap slots of NVMe state only where the bound with speculation
// is lower than without by more than kAutoMargin. CPU Adam the longest
// resource: the slots hide it behind the backward (kept). The disk far the
// longest: they hide only the compute beside it, a few percent (off, the
// spare disk given back). `on`, and a rate missing, leave the plan as it is.
TEST(BoundTest, AutoSpeculatesNvmeStateOnlyWhereTheBoundGains) {
  const std::string nvme =
      "placement={\"param16\":{\"device\":1},\"grad\":{\"device\":1},\"optimizer\":{\"nvme\":1},"
      "\"nvme_path\":\"/tmp/x\"}";
  const Config cfg = config_with({"bf16.enabled=true", "run.schedule=\"layer\"", "run.swap_checksums=false", nvme,
                                  "optimizer.speculate=\"auto\""});
  const PlacementPlan p = make_plan(cfg, make_layout(), 0, gpu_like());
  ASSERT_TRUE(p.optimizer.speculate_slots) << "auto without rates: " << p.optimizer.speculate_choice;
  ASSERT_EQ(p.optimizer.nvme_spare_bytes, 12 * kN);
  const StepWork w = predicted_work(cfg, p, train_fetches(p), NetworkBytes{});
  Rates adam_bound;
  adam_bound.device_flops = w.flops / 0.04;  // 0.04 s of compute
  adam_bound.adam = double(kN) / 0.03;       // 0.03 s a pass
  adam_bound.nvme_read = adam_bound.nvme_write = double(12 * kN) / 0.001;
  adam_bound.nvme_both = double(24 * kN) / 0.001;
  adam_bound.h2d = adam_bound.d2h = double(4 * kN) / 0.0001;
  adam_bound.pcie_both = double(8 * kN) / 0.0001;
  PlacementPlan kept = p;
  judge_speculation_by_bound(cfg, adam_bound, false, kept);
  EXPECT_TRUE(kept.optimizer.speculate_slots) << kept.optimizer.speculate_choice;
  EXPECT_EQ(kept.optimizer.nvme_spare_bytes, 12 * kN);
  EXPECT_NE(kept.optimizer.speculate_choice.find("the bound:"), std::string::npos) << kept.optimizer.speculate_choice;
  Rates disk_bound = adam_bound;
  disk_bound.adam = double(kN) / 0.001;
  disk_bound.nvme_read = disk_bound.nvme_write = double(12 * kN) / 1.0;  // 1 s each way: 25x the compute
  disk_bound.nvme_both = double(24 * kN) / 2.0;
  PlacementPlan off = p;
  judge_speculation_by_bound(cfg, disk_bound, false, off);
  EXPECT_FALSE(off.optimizer.speculate) << off.optimizer.speculate_choice;
  EXPECT_FALSE(off.optimizer.speculate_slots);
  EXPECT_EQ(off.optimizer.nvme_spare_bytes, 0);
  EXPECT_EQ(off.total()[size_t(Tier::kNvme)], p.total()[size_t(Tier::kNvme)] - 12 * kN);
  EXPECT_NE(off.optimizer.speculate_choice.find("not 10% lower"), std::string::npos) << off.optimizer.speculate_choice;
  // The choice is the bound's: speculation's bound on that disk is not 10% lower.
  const StepWork woff = predicted_work(cfg, off, train_fetches(off), NetworkBytes{});
  EXPECT_GE(step_bound(w, disk_bound, false).seconds, 0.9 * step_bound(woff, disk_bound, false).seconds);
  EXPECT_LT(step_bound(w, adam_bound, false).seconds, 0.9 * step_bound(woff, adam_bound, false).seconds);
  const Config on = config_with({"bf16.enabled=true", "run.schedule=\"layer\"", "run.swap_checksums=false", nvme,
                                 "optimizer.speculate=\"on\""});
  PlacementPlan forced = make_plan(on, make_layout(), 0, gpu_like());
  judge_speculation_by_bound(on, disk_bound, false, forced);
  EXPECT_TRUE(forced.optimizer.speculate_slots) << "on is the user's";
  Rates missing = disk_bound;
  missing.adam = 0;
  PlacementPlan unjudged = p;
  judge_speculation_by_bound(cfg, missing, false, unjudged);
  EXPECT_TRUE(unjudged.optimizer.speculate_slots) << "no CPU Adam rate: not judged";
}

// Note [Activations by the bound]: the same model on the same GPU, all state
// on it, the device holding the window and room for two of a layer's entries
// and a half (the 2 slots host-kept entries need). Without host keeps auto
// keeps the last d0 layers' entries on the device; host keeps give those
// slots up. A fast link makes keeping every layer's entries in host RAM the
// lower bound, a slow one recomputing; with cpu_checkpointing, a host RAM
// that holds two layers' entries keeps two.
TEST(BoundTest, AutoKeepsEntriesInHostRamOnlyWhereTheBoundGains) {
  const std::string on_device =
      "placement={\"param16\":{\"device\":1},\"grad\":{\"device\":1},\"optimizer\":{\"device\":1}}";
  const Config cfg = config_with({on_device, "train_micro_batch_size_per_gpu=1", "run.recompute=\"auto\""});
  const Config always = config_with({on_device, "train_micro_batch_size_per_gpu=1", "run.recompute=\"always\""});
  const int64_t L = cfg.model.n_layers;
  ASSERT_EQ(L, 4);
  MachineCapacity cap = gpu_like();
  cap.device_bytes = int64_t(1) << 40;
  const PlacementPlan rec = make_plan(always, make_layout(), 0, cap);
  // Entries for one micro-batch of 128 tokens at fp32: the kept tensors of
  // a layer (saved_specs.h) times the tokens; the input alone 128 x 128 x 4.
  const int64_t entries = rec.activations.entries_bytes, input = 128 * 128 * 4;
  ASSERT_EQ(rec.activations.checkpoint_bytes, input);
  ASSERT_GT(entries, 2 * input);
  const int64_t each = entries - input;  // one micro-batch held (micro_batch schedule)
  // What the window's share leaves besides: the device less the window cap.
  const int64_t fixed = cap.device_bytes - rec.window_cap_bytes;
  cap.device_bytes = fixed + rec.staging.gathered + 2 * entries + each / 2;
  const int64_t d0 = (2 * entries + each / 2) / each;
  ASSERT_GE(d0, 2);
  ASSERT_LT(d0, L);
  const PlacementPlan none = make_plan(cfg, make_layout(), 0, cap);
  ASSERT_EQ(none.activations.keep_device_packs, d0) << none.activations.recompute_choice;
  ASSERT_EQ(none.activations.keep_host_packs, 0);
  // Every layer on the host, fixed by hand (run.activations): the bound's
  // work of the two alternatives, the same rates for both.
  const Config by_hand = config_with({on_device, "train_micro_batch_size_per_gpu=1", "run.recompute=\"auto\"",
                                      "run.activations={\"keep_device_layers\":0,\"keep_host_layers\":4}"});
  const PlacementPlan host = make_plan(by_hand, make_layout(), 0, cap);
  ASSERT_TRUE(plan_shortfalls(host, cap).empty());
  const StepWork wn = predicted_work(cfg, none, train_fetches(none), NetworkBytes{});
  const StepWork wh = predicted_work(by_hand, host, train_fetches(host), NetworkBytes{});
  ASSERT_LT(wh.flops, wn.flops);  // L - d0 forwards fewer
  ASSERT_EQ(wh.links.d2h - wn.links.d2h, L * entries);
  ASSERT_EQ(wh.links.h2d - wn.links.h2d, L * entries);
  Rates fast;
  fast.device_flops = wn.flops / 1.0;  // 1 s of compute recomputing L - d0 layers
  fast.h2d = fast.d2h = double(L * entries) / 0.01;
  fast.pcie_both = 2 * fast.h2d;
  Rates slow = fast;
  slow.h2d = slow.d2h = double(L * entries) / 10.0;  // 10 s each way
  slow.pcie_both = 2 * slow.h2d;
  ASSERT_LT(step_bound(wh, fast, false).seconds, 0.9 * step_bound(wn, fast, false).seconds);
  ASSERT_GT(step_bound(wh, slow, false).seconds, step_bound(wn, slow, false).seconds);

  const PlacementPlan f = best_activations(cfg, make_layout(), 0, cap, fast);
  EXPECT_EQ(f.activations.keep_host_packs, L) << f.activations.recompute_choice;
  EXPECT_EQ(f.activations.keep_device_packs, 0);
  EXPECT_EQ(f.activations.recomputed_packs(), 0);
  EXPECT_EQ(f.staging.ckpt_host, L * entries);
  EXPECT_EQ(f.staging.ckpt_device, 2 * entries);
  EXPECT_NE(f.activations.recompute_choice.find("the bound:"), std::string::npos) << f.activations.recompute_choice;
  EXPECT_TRUE(plan_shortfalls(f, cap).empty());

  const PlacementPlan s = best_activations(cfg, make_layout(), 0, cap, slow);
  EXPECT_EQ(s.activations.keep_host_packs, 0) << s.activations.recompute_choice;
  EXPECT_EQ(s.activations.keep_device_packs, d0);
  EXPECT_EQ(s.staging.ckpt_host, 0);

  // cpu_checkpointing (the layers' inputs in host RAM, none kept on the
  // device) and host RAM for two more layers' entries (and half a third)
  // beside the staging: two layers swap their inputs there for their entries.
  const Config cc = config_with({on_device, "train_micro_batch_size_per_gpu=1", "run.recompute=\"auto\"",
                                 "activation_checkpointing.cpu_checkpointing=true"});
  const PlacementPlan cc_none = make_plan(cc, make_layout(), 0, cap);
  ASSERT_EQ(cc_none.activations.keep_device_packs, 0);
  ASSERT_EQ(cc_none.staging.ckpt_host, L * input);
  MachineCapacity small = cap;
  // (placement.headroom, 10% of host RAM, stays free of pinned entries.)
  small.host_bytes = int64_t(double(cc_none.staging.host_bytes() + 2 * each + each / 2) / 0.9) + 1;
  const PlacementPlan two = best_activations(cc, make_layout(), 0, small, fast);
  EXPECT_EQ(two.activations.keep_host_packs, 2) << two.activations.recompute_choice;
  EXPECT_EQ(two.activations.recomputed_packs(), 2);
  EXPECT_EQ(two.staging.ckpt_host, 2 * entries + 2 * input);
  EXPECT_TRUE(plan_shortfalls(two, small).empty());

  // always, run.activations and a missing rate: make_plan's plan as it is.
  EXPECT_EQ(best_activations(always, make_layout(), 0, cap, fast).activations.recomputed_packs(), L);
  EXPECT_EQ(best_activations(by_hand, make_layout(), 0, cap, slow).activations.keep_host_packs, L);
  Rates no_link = fast;
  no_link.h2d = 0;
  EXPECT_EQ(best_activations(cfg, make_layout(), 0, cap, no_link).activations.keep_host_packs, 0);
}

// Note [Activation placement]: under the layer schedule auto counts host
// keeps a micro-batch at a time. Four layers of four micro-batches (16
// packs) of 256 tokens (so that a recomputed pack's share of the step puts
// 11 host packs beyond auto's margin), the device with room for the two slots alone (or, without host
// keeps, for two packs), rates that make the packs' D2H take as long as the
// forwards at 11 packs on the host (two layers and three micro-batches;
// Note [Activation copies]): 10 packs leave more recompute in the
// backwards, 12 make the forwards wait for the link, and auto finds 11.
TEST(BoundTest, AutoKeepsPartOfALayerInHostRamWhereTheBoundIsLowest) {
  const std::string on_device =
      "placement={\"param16\":{\"device\":1},\"grad\":{\"device\":1},\"optimizer\":{\"device\":1}}";
  const std::vector<std::string> common = {on_device, "train_micro_batch_size_per_gpu=1", "gradient_accumulation_steps=4",
                                           "run.schedule=\"layer\"", "model.seq_len=256"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), common.begin(), common.end());
    return config_with(more);
  };
  const Config cfg = with({"run.recompute=\"auto\""});
  ASSERT_EQ(cfg.model.n_layers, 4);
  MachineCapacity cap = gpu_like();
  cap.device_bytes = int64_t(1) << 40;
  const PlacementPlan rec = make_plan(with({"run.recompute=\"always\""}), make_layout(), 0, cap);
  const int64_t entries = rec.activations.entries_bytes;
  cap.device_bytes = cap.device_bytes - rec.window_cap_bytes + rec.staging.gathered + 2 * entries;
  // By hand: h packs on the host, the rest recomputed (run.activations).
  auto by_hand = [&](int64_t h) {
    const Config c = with({strprintf("run.activations={\"keep_host_layers\":%lld,\"keep_host_micro_batches\":%lld}",
                                     (long long)(h / 4), (long long)(h % 4))});
    const PlacementPlan p = make_plan(c, make_layout(), 0, cap);
    EXPECT_EQ(p.activations.keep_host_packs, h);
    EXPECT_EQ(p.activations.keep_device_packs, 0);
    EXPECT_TRUE(plan_shortfalls(p, cap).empty()) << h;
    return predicted_work(c, p, train_fetches(p), NetworkBytes{});
  };
  const StepWork w10 = by_hand(10), w11 = by_hand(11), w12 = by_hand(12);
  ASSERT_EQ(w11.links.d2h - w10.links.d2h, entries);  // one pack more each way
  ASSERT_EQ(w12.links.h2d - w11.links.h2d, entries);
  ASSERT_LT(w11.flops, w10.flops);
  ASSERT_EQ(w11.activation_link_bytes, 11 * entries);
  Rates r;
  r.device_flops = w11.flops / 1.0;  // 1 s of compute at 11 packs
  const double forwards_s = w11.forward_flops / r.device_flops;
  ASSERT_GT(forwards_s, 0.2);
  ASSERT_LT(forwards_s, 0.4);  // about a third
  r.h2d = r.d2h = double(11 * entries) / forwards_s;  // the packs' D2H as long as the forwards
  r.pcie_both = 2 * r.h2d;
  const double s10 = step_bound(w10, r, false).seconds, s11 = step_bound(w11, r, false).seconds,
               s12 = step_bound(w12, r, false).seconds;
  ASSERT_LT(s11, s10);
  ASSERT_LT(s11, s12);
  // The copies' row: max(forwards, D2H) + max(backwards, H2D) = 1 s at 11
  // (the compute's, which binds first), more at 12 and binding.
  auto copies_row = [&](const StepWork& w) {
    for (const ResourceTime& t : step_bound(w, r, false).resources) {
      if (t.resource == "activation copies") return t.seconds;
    }
    return -1.0;
  };
  EXPECT_NEAR(copies_row(w11), 1.0, 1e-9);
  EXPECT_NEAR(s11, 1.0, 1e-9);
  EXPECT_EQ(step_bound(w12, r, false).binding, "activation copies");
  EXPECT_NEAR(s12, forwards_s * 12 / 11 + (w12.flops - w12.forward_flops) / r.device_flops, 1e-9);
  const PlacementPlan none = make_plan(cfg, make_layout(), 0, cap);
  ASSERT_EQ(none.activations.keep_host_packs, 0);
  ASSERT_EQ(none.activations.keep_device_packs, 2) << none.activations.recompute_choice;
  // Beyond auto's margin (Note [Auto's margin]).
  ASSERT_LT(s11, 0.88 * step_bound(predicted_work(cfg, none, train_fetches(none), NetworkBytes{}), r, false).seconds);

  const PlacementPlan best = best_activations(cfg, make_layout(), 0, cap, r);
  EXPECT_EQ(best.activations.keep_host_packs, 11) << best.activations.recompute_choice;
  // Spread over the forwards (Note [Activation placement]): 11 of 16, the
  // first of them; never two recomputed packs in a row.
  int64_t on_host = 0, run = 0, longest = 0;
  for (int64_t u = 0; u < 16; ++u) {
    const bool h = best.activations.on_host(u / 4, u % 4);
    on_host += h ? 1 : 0;
    run = h ? 0 : run + 1;
    longest = std::max(longest, run);
  }
  EXPECT_EQ(on_host, 11);
  EXPECT_TRUE(best.activations.on_host(0, 0));
  EXPECT_EQ(longest, 1);
  EXPECT_EQ(best.staging.ckpt_host, 11 * entries);
  EXPECT_NE(best.activations.recompute_choice.find("2 layers and 3 micro-batches"), std::string::npos)
      << best.activations.recompute_choice;
}

// The same placement as BytesPerLinkOfAnOffloadedPlacement with the swap
// checksums (run.swap_checksums, the default): every NVMe byte is
// checksummed, 10485760 read + 10485760 written = 20971520; the optimizer's
// 8388608 + 6291456 = 14680064. At 1.048576 GB/s of CRC-32C that is 0.02 s,
// 0.014 s of it on the optimizer's thread, in sequence with its Adam.
TEST(BoundTest, SwapChecksumsShareTheCpu) {
  const Config cfg = offloaded_config(/*checksums=*/true);
  const PlacementPlan p = make_plan(cfg, make_layout(), 0, MachineCapacity{});
  StepWork w = predicted_work(cfg, p, train_fetches(p), NetworkBytes{});
  EXPECT_EQ(w.checksum_bytes, 20971520);
  EXPECT_EQ(w.optimizer_checksum_bytes, 14680064);
  Rates r = cpu_rates(w);
  EXPECT_EQ(missing_rates(w, r, true), std::vector<std::string>{"--checksum-gbps"});
  r.checksum = 1.048576e9;
  const StepBound b = step_bound(w, r, /*cpu_compute=*/true);
  ASSERT_EQ(b.resources.size(), 3u);
  // The cores: 0.05 s of compute + 0.000524288 s of Adam + 0.002097152 s of
  // copies + half of the 0.002097152 s of gradient adds + 0.02 s of
  // checksums (on Adam's threads, all of them).
  EXPECT_EQ(b.resources[0].resource, "cpu (compute + Adam + copies + gradient adds + checksums)");
  EXPECT_NEAR(b.resources[0].seconds, 0.073670016, 1e-12);
  // The optimizer: the first forward, its Adam and its checksums (0.00625 +
  // 0.000524288 + 0.014 s) now outlast its I/O (0.014680064 s).
  EXPECT_EQ(b.resources[2].resource, "dependencies");
  EXPECT_NEAR(b.resources[2].seconds, 0.020774288 + 0.04375 + 0.002097152 + 0.001048576, 1e-12);
  EXPECT_EQ(b.binding, "cpu (compute + Adam + copies + gradient adds + checksums)");
  EXPECT_NEAR(b.seconds, 0.073670016, 1e-12);

  // On a GPU, bf16, weights and gradients in HBM, the optimizer state on
  // NVMe: 12n read and 12n written, all of it the optimizer's (12582912
  // bytes checksummed). CPU Adam 0.02 s and the checksums 0.01 s share the
  // host's cores, in sequence on the optimizer's thread: 0.03 s, beside the
  // first forward (0.0025 s of the device's 0.01 s).
  const Config gcfg = config_with(
      {"bf16.enabled=true",
       "placement={\"param16\":{\"device\":1},\"grad\":{\"device\":1},\"optimizer\":{\"nvme\":1},\"nvme_path\":\"/tmp\"}"});
  const PlacementPlan q = make_plan(gcfg, make_layout(), 0, gpu_like());
  StepWork v = predicted_work(gcfg, q, train_fetches(q), NetworkBytes{});
  EXPECT_EQ(v.links.nvme_read, 6291456);
  EXPECT_EQ(v.links.nvme_write, 6291456);
  EXPECT_EQ(v.checksum_bytes, 12582912);
  EXPECT_EQ(v.optimizer_checksum_bytes, 12582912);
  Rates g;
  g.device_flops = v.flops / 0.01;
  v.first_forward_flops = v.flops / 4;
  g.adam = double(kN) / 0.02;
  g.checksum = 12582912 / 0.01;
  g.h2d = g.d2h = g.pcie_both = g.nvme_read = g.nvme_write = g.nvme_both = 1e12;
  const StepBound c = step_bound(v, g, /*cpu_compute=*/false);
  EXPECT_EQ(c.resources[1].resource, "cpu (Adam + checksums)");
  EXPECT_NEAR(c.resources[1].seconds, 0.03, 1e-12);
  EXPECT_EQ(c.binding, "dependencies");
  EXPECT_NEAR(c.seconds, 0.03 + 0.0075, 1e-12);
}

// A GPU, bf16, two micro-batches, gradients homed in host RAM: each
// micro-batch's bf16 gradient (2n bytes, n = 524288; block 0, the tied
// embedding, in fp32: 2 x 65536 more) lands over D2H and the
// lander thread adds it into its fp32 home, 2n = 1048576 elements a step.
// Those adds are one host thread's work beside the backward: a resource of
// their own, apart from CPU Adam's cores, and no step of the dependencies.
TEST(BoundTest, OnAGpuTheGradientAddsAreOneHostThread) {
  const Config cfg = config_with(
      {"bf16.enabled=true", "gradient_accumulation_steps=2", "train_micro_batch_size_per_gpu=1",
       "placement={\"param16\":{\"device\":1},\"grad\":{\"host\":1},\"optimizer\":{\"host\":1}}"});
  const PlacementPlan p = make_plan(cfg, make_layout(), 0, gpu_like());
  StepWork w = predicted_work(cfg, p, train_fetches(p), NetworkBytes{});
  EXPECT_EQ(w.grad_add_elems, 1048576);
  EXPECT_EQ(w.links.d2h, 2359296);  // (2n + 131072) x 2 micro-batches; the optimizer finds them on the host
  Rates r;
  r.device_flops = w.flops / 0.01;  // 0.01 s, a quarter of it the first forward
  w.first_forward_flops = w.flops / 4;
  r.adam = double(kN) / 0.02;  // 0.02 s
  r.h2d = r.d2h = r.pcie_both = 1e12;
  EXPECT_EQ(missing_rates(w, r, false), std::vector<std::string>{"--grad-add-gelems"});
  r.grad_add = 1048576 / 0.04;  // 0.04 s
  StepBound b = step_bound(w, r, false);
  EXPECT_EQ(b.resources[1].resource, "cpu adam");
  EXPECT_NEAR(b.resources[1].seconds, 0.02, 1e-12);
  EXPECT_EQ(b.resources[2].resource, "host gradient adds");
  EXPECT_NEAR(b.resources[2].seconds, 0.04, 1e-12);
  EXPECT_EQ(b.binding, "host gradient adds");
  EXPECT_NEAR(b.seconds, 0.04, 1e-12);
  // At 0.01 s the dependencies bind again (the optimizer's 0.02 s beside the
  // first forward, then the rest of the compute, 0.0075 s): the adds are not in them.
  r.grad_add = 1048576 / 0.01;
  b = step_bound(w, r, false);
  EXPECT_EQ(b.binding, "dependencies");
  EXPECT_NEAR(b.seconds, 0.0275, 1e-12);
}

TEST(BoundTest, RatesFromTheConfigAreConvertedAndNamed) {
  const Config cfg = config_with(
      {"run.rates={\"device_tflops\":2,\"nvme_read_gbps\":3.5,\"checksum_gbps\":12,\"grad_add_gelems\":1.5,"
       "\"net_gbps\":100}"});
  const Rates r = rates_from_config(cfg.run.rates);
  EXPECT_DOUBLE_EQ(r.device_flops, 2e12);
  EXPECT_DOUBLE_EQ(r.nvme_read, 3.5e9);
  EXPECT_DOUBLE_EQ(r.net, 12.5e9);  // 100 Gbit/s
  EXPECT_EQ(r.nvme_read_source, "run.rates.nvme_read_gbps");
  EXPECT_DOUBLE_EQ(r.checksum, 12e9);
  EXPECT_EQ(r.checksum_source, "run.rates.checksum_gbps");
  EXPECT_DOUBLE_EQ(r.grad_add, 1.5e9);
  EXPECT_EQ(r.grad_add_source, "run.rates.grad_add_gelems");
  EXPECT_EQ(r.h2d, 0.0);
  try {
    config_with({"run.rates={\"nvme_gbps\":3}"});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("run.rates.nvme_gbps"), std::string::npos) << e.what();
  }
  try {
    config_with({"run.rates={\"h2d_gbps\":-1}"});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("run.rates.h2d_gbps"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace strata
