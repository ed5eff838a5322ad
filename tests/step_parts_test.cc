// The step's parts driven alone, on the test device (a GPU's separate
// memory, copies that run late):
// - the gradient path (Note [Gradient path] in src/engine/gradient_path.h):
//   two micro-batches of made-up gradients for every block land in homes on
//   the device, the host and NVMe; each home holds widen(g1) + widen(g2) bit
//   for bit, the step's squared norm is the blocks' ordered norms summed in
//   block order, and only the off-device blocks' gradients cross D2H, in the
//   compute dtype (the tied embedding's in fp32);
// - the optimizer pass (Note [Optimizer pipeline] in optimizer_pass.h):
//   state split over the three tiers (the device's Adam for pieces wholly on
//   the device, CPU Adam with staged device-tier parts for the others, NVMe
//   pipelined) updates every element as one CPU Adam call over the whole
//   shard space does, bit for bit.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <bit>
#include <cstring>

#include "comm/communicator.h"
#include "config/config.h"
#include "cpu_adam/adam.h"
#include "cpu_adam/grad_ops.h"
#include "deferred_device.h"
#include "engine/gradient_path.h"
#include "engine/optimizer/optimizer_pass.h"
#include "engine/probes.h"
#include "engine/step_context.h"
#include "memory/buffer.h"
#include "memory/placement.h"
#include "plan/planner.h"
#include "memory/tiered_state.h"
#include "model/model.h"
#include "test_util.h"
#include "util/errors.h"
#include "util/fs.h"

namespace strata {
namespace {

struct Fixture {
  Fixture(const std::vector<std::string>& overrides, const std::string& swap,
          const nlohmann::json& placement = nullptr)
      : cfg(parse_config(nlohmann::json{{"train_micro_batch_size_per_gpu", 1},
                                        {"gradient_accumulation_steps", 2},
                                        {"bf16", {{"enabled", true}}},
                                        {"model", {{"dim", 64}, {"n_layers", 2}, {"n_heads", 4}, {"n_kv_heads", 2},
                                                   {"ffn_hidden", 96}, {"seq_len", 16}}},
                                        {"placement", placement.is_null()
                                                           ? nlohmann::json{{"grad", {{"device", 0.3}, {"host", 0.3},
                                                                                      {"nvme", 0.4}}},
                                                                            {"nvme_path", swap}}
                                                           : placement},
                                        {"data", {{"path", swap + "/unused.txt"}}}},
                         overrides)),
        model(cfg.model),
        layout(model.layout_specs(), 1),
        comm(make_local_communicator()) {
    MachineCapacity cap;
    plan = plan_for_machine(cfg, layout, &cap, 0, 1, &device);
    TieredStateOptions so;
    so.device = &device;
    so.device_transient_bytes = plan.staging.device_bytes();
    state = std::make_unique<TieredState>(plan, so);
    ctx.cfg = &cfg;
    ctx.layout = &layout;
    ctx.state = state.get();
    ctx.device = &device;
    ctx.comm = comm.get();
    ctx.compute_dtype = at::kBFloat16;
    ctx.compute_bytes = 2;
    ctx.param_dtype = at::kBFloat16;  // a dense model: the working copy in the compute dtype
    ctx.param_bytes = 2;
    ctx.head_block = layout.num_blocks() - 1;
    int64_t global = 0;
    for (const PlacementUnit& u : plan.state.units[size_t(Category::kGrad)]) {
      ctx.shard_offset.push_back(u.offset);
      ctx.block_end.push_back(u.offset + u.numel);
      ctx.global_index.push_back(global);
      global += u.numel;
    }
  }
  testing::DeferredDevice device;
  Config cfg;
  Model model;
  StateLayout layout;
  std::unique_ptr<Communicator> comm;
  PlacementPlan plan;
  std::unique_ptr<TieredState> state;
  StepContext ctx;
};

// Per block, its parameters' made-up gradients (bf16, like autograd's).
std::vector<std::vector<at::Tensor>> gradients(const StateLayout& layout, int seed) {
  at::Generator gen = at::detail::createCPUGenerator(uint64_t(seed));
  std::vector<std::vector<at::Tensor>> out;
  for (const BlockLayout& bl : layout.blocks()) {
    std::vector<at::Tensor> g;
    for (const ParamLayout& p : bl.params) {
      g.push_back(at::normal(0.0, 1.0, p.spec.shape, gen, at::kFloat).to(at::kBFloat16));
    }
    out.push_back(std::move(g));
  }
  return out;
}

// Both schedules (Note [Step schedules]): micro_batch adds each micro-batch's
// gradient of every block in turn, crossing in the wire dtype each time;
// layer adds a block's micro-batches in a row, summed on the device and
// landed once in fp32. The homes hold the same bits either way.
TEST(GradientPathTest, HomesOnEveryTierHoldTheSumAndOnlyOffDeviceBlocksCrossInTheirWireDtype) {
  for (const std::string schedule : {"micro_batch", "layer"})
  for (const bool tied : {false, true}) {
    testing::TempDir dir;
    ASSERT_EQ(mkdir((dir.path() + "/swap").c_str(), 0700), 0);
    Fixture f({std::string("model.tie_embeddings=") + (tied ? "true" : "false"), "run.schedule=\"" + schedule + "\""},
              dir.path() + "/swap");
    const bool layer = schedule == "layer";
    ASSERT_EQ(f.plan.step.schedule == StepSchedule::kLayer, layer);
    const std::string what = schedule + (tied ? ", tied" : ", untied");
    const size_t blocks = f.layout.num_blocks();
    std::array<bool, kNumTiers> seen{};
    for (const PlacementUnit& u : f.plan.state.units[size_t(Category::kGrad)]) seen[size_t(u.tier)] = true;
    ASSERT_TRUE(seen[0] && seen[1] && seen[2]) << "the split must give every tier a block";
    const auto micro = std::vector<std::vector<std::vector<at::Tensor>>>{gradients(f.layout, 1), gradients(f.layout, 2)};
    // The tied head's output-projection gradient (the embedding's shape).
    const auto head_share = std::vector<std::vector<std::vector<at::Tensor>>>{gradients(f.layout, 3), gradients(f.layout, 4)};
    GradientPath path(f.ctx, f.plan);
    LinkBytes moved;
    {
      TieredState::TallyScope tally(&moved);
      path.begin_step();
      if (layer) {
        if (tied) for (int m = 0; m < 2; ++m) path.set_tied(m, head_share[size_t(m)][0][0]);
        for (size_t b = blocks; b-- > 0;) {
          for (int m = 0; m < 2; ++m) path.add(b, micro[size_t(m)][b], 0, m);
        }
        path.end_micro();
      } else {
        for (int m = 0; m < 2; ++m) {
          for (size_t b = blocks; b-- > 0;) {
            if (tied && b == 0) path.set_tied(m, head_share[size_t(m)][0][0]);
            path.add(b, micro[size_t(m)][b], 0, m);
          }
          path.end_micro();
        }
      }
    }
    const double norm = path.finish_step(&moved);
    int64_t want_d2h = 0;
    double want_norm = 0.0;
    for (size_t b = 0; b < blocks; ++b) {
      const BlockLayout& bl = f.layout.block(b);
      at::Tensor want = at::zeros({bl.padded_numel}, at::kFloat);
      std::vector<at::Tensor> views = param_views(bl, want);
      for (int m = 0; m < 2; ++m) {
        for (size_t i = 0; i < views.size(); ++i) {
          at::Tensor g = micro[size_t(m)][b][i].to(at::kFloat);
          if (tied && b == 0) g = head_share[size_t(m)][0][0].to(at::kFloat).add(g);  // the fp32 sum
          if (m == 0) views[i].copy_(g);
          else views[i].add_(g);
        }
      }
      HostBuffer mem(size_t(bl.padded_numel * 4), "test: a block's gradient");  // aligned for NVMe
      f.state->read(Category::kGrad, f.ctx.shard_offset[b], bl.padded_numel, mem.data());
      const at::Tensor got = at::from_blob(mem.data(), {bl.padded_numel}, at::kFloat);
      EXPECT_TRUE(at::equal(got, want)) << "block " << b << ", " << what;
      want_norm += cpu_adam::ordered_squared_norm(want.data_ptr<float>(), bl.padded_numel);
      if (f.plan.state.units[size_t(Category::kGrad)][b].tier != Tier::kDevice) {
        // micro_batch: 2 micro-batches in bf16 (the tied embedding's fp32
        // sum in 4 bytes); layer: the fp32 sum once.
        want_d2h += layer ? 4 * bl.padded_numel : 2 * bl.padded_numel * (tied && b == 0 ? 2 : 1) * 2;
      }
    }
    EXPECT_EQ(std::bit_cast<uint64_t>(norm), std::bit_cast<uint64_t>(want_norm)) << what;
    EXPECT_EQ(moved.d2h, want_d2h) << what;
    EXPECT_EQ(moved.h2d, 0);
    const GradientPath::LanderStats st = path.lander_stats();
    EXPECT_GT(st.adds, 0);
    EXPECT_EQ(st.adds_on_compute_thread, 0);
  }
}

// Every category's whole shard space, read from its homes.
std::vector<std::byte> read_all(TieredState& state, Category c) {
  const int64_t n = state.plan().state.shard_space_numel;
  HostBuffer mem(size_t(n * state.elem_bytes(c)), "test: a category");
  state.read(c, 0, n, mem.data());
  return std::vector<std::byte>(mem.as<std::byte>(), mem.as<std::byte>() + n * state.elem_bytes(c));
}

TEST(OptimizerPassTest, StateOnEveryTierUpdatesAsOneCpuAdamCall) {
  testing::TempDir dir;
  ASSERT_EQ(mkdir((dir.path() + "/swap").c_str(), 0700), 0);
  const nlohmann::json split = {{"device", 0.3}, {"host", 0.3}, {"nvme", 0.4}};
  // Small sub-groups: several pieces per tier, some wholly on the device.
  Fixture f({"zero_optimization.sub_group_size=8192", "run.overlap_optimizer=false", "model.tie_embeddings=false"},
            dir.path() + "/swap",
            {{"param16", split}, {"grad", split}, {"optimizer", split}, {"nvme_path", dir.path() + "/swap"}});
  const int64_t n = f.plan.state.shard_space_numel;
  // Made-up state: master weights, gradients, moments (v >= 0).
  at::Generator gen = at::detail::createCPUGenerator(9);
  const at::Tensor master = at::normal(0.0, 1.0, {n}, gen, at::kFloat);
  const at::Tensor grad = at::normal(0.0, 1.0, {n}, gen, at::kFloat);
  const at::Tensor m = at::normal(0.0, 0.1, {n}, gen, at::kFloat);
  const at::Tensor v = at::normal(0.0, 0.1, {n}, gen, at::kFloat).square();
  for (auto [c, t] : {std::pair{Category::kMaster, master}, std::pair{Category::kGrad, grad},
                      std::pair{Category::kExpAvg, m}, std::pair{Category::kExpAvgSq, v}}) {
    HostBuffer mem(size_t(n * 4), "test: initial state");
    std::memcpy(mem.data(), t.data_ptr(), size_t(n * 4));
    f.state->write(c, 0, n, mem.data());
  }
  OptimizerPass pass(f.ctx, f.plan, cpu_adam::best_isa());
  int device_pieces = 0;
  for (const PlacementUnit& piece : pipeline_pieces(f.plan)) device_pieces += device_adam_piece(f.plan, piece);
  ASSERT_GT(device_pieces, 0);
  const OptimizerThread::Job job{0.5f, 1e-2, 3, Completion()};
  const OptimizerPass::Report r = pass.step(job);
  EXPECT_GT(r.links.nvme_read, 0);
  EXPECT_GT(r.links.d2h, 0);  // staged device-tier parts of pieces CPU Adam updates
  // The reference: one call over the whole shard space (fp32 moments: no
  // rounding key), emitting bf16.
  cpu_adam::AdamParams h;
  h.lr = 1e-2;
  h.weight_decay = f.cfg.optimizer.weight_decay;
  h.beta1 = f.cfg.optimizer.beta1;
  h.beta2 = f.cfg.optimizer.beta2;
  h.eps = f.cfg.optimizer.eps;
  h.adamw = f.cfg.optimizer.adam_w_mode;
  at::Tensor want_master = master.clone(), want_m = m.clone(), want_v = v.clone();
  at::Tensor want_p16 = at::empty({n}, at::kBFloat16);
  cpu_adam::AdamSpans s;
  s.param = want_master.data_ptr<float>();
  s.grad = grad.data_ptr<float>();
  s.exp_avg = want_m.data_ptr();
  s.exp_avg_sq = want_v.data_ptr();
  s.emit = want_p16.data_ptr();
  s.emit_type = cpu_adam::EmitType::kBF16;
  s.numel = n;
  cpu_adam::CpuAdam(1).step(h, cpu_adam::StepArgs{3, 0.5f, 0}, s);
  for (auto [c, t] : {std::pair{Category::kMaster, want_master}, std::pair{Category::kExpAvg, want_m},
                      std::pair{Category::kExpAvgSq, want_v}, std::pair{Category::kParam16, want_p16}}) {
    const std::vector<std::byte> got = read_all(*f.state, c);
    EXPECT_EQ(std::memcmp(got.data(), t.data_ptr(), got.size()), 0) << category_name(c);
  }
}

// The CPU probes' buffers are at least 4x the last-level caches (the H100 host's
// 300 MiB L3 held CPU Adam's old 8 Mi-element probe, which then ran 4x faster
// than the optimizer), never under their old sizes, and capped. Figures by hand.
TEST(ProbeTest, CpuProbeBuffersAreFourTimesTheLargestCache) {
  const int64_t mi = int64_t(1) << 20;
  EXPECT_EQ(adam_probe_numel(1.0, 0), 8 * mi);
  EXPECT_EQ(adam_probe_numel(0.25, 0), 4 * mi);
  EXPECT_EQ(adam_probe_numel(1.0, 32 * mi), 8 * mi);    // 4 x 32 MiB / 18 B = 7.1 Mi
  EXPECT_EQ(adam_probe_numel(0.25, 32 * mi), 8 * mi);   // rounded up to whole Mi
  EXPECT_EQ(adam_probe_numel(1.0, 300 * mi), 67 * mi);  // 4 x 300 MiB / 18 B = 66.7 Mi
  EXPECT_EQ(adam_probe_numel(1.0, 2048 * mi), 256 * mi);  // 455 Mi, capped
  EXPECT_EQ(checksum_probe_bytes(1.0, 0), 512 * mi);
  EXPECT_EQ(checksum_probe_bytes(0.25, 0), 128 * mi);
  EXPECT_EQ(checksum_probe_bytes(1.0, 300 * mi), 1200 * mi);
  EXPECT_EQ(checksum_probe_bytes(0.25, 64 * mi), 256 * mi);
  EXPECT_EQ(checksum_probe_bytes(1.0, 2048 * mi), 4096 * mi);
  // Gradient adds: a home of 4 bytes and a landed element of 2 (bf16) or 4.
  EXPECT_EQ(grad_add_probe_numel(1.0, 0, 2), 16 * mi);
  EXPECT_EQ(grad_add_probe_numel(0.25, 0, 4), 4 * mi);
  EXPECT_EQ(grad_add_probe_numel(0.25, 32 * mi, 4), 16 * mi);   // 4 x 32 MiB / 8 B
  EXPECT_EQ(grad_add_probe_numel(1.0, 300 * mi, 2), 200 * mi);  // 4 x 300 MiB / 6 B
  EXPECT_EQ(grad_add_probe_numel(1.0, 300 * mi, 4), 150 * mi);
  EXPECT_EQ(grad_add_probe_numel(1.0, 2048 * mi, 2), 256 * mi);  // capped
  // Note [Probes sized to the work]: never more than a step touches (the
  // rank's shard space: 0.8 M elements here, rounded up to 1 Mi), whatever
  // the caches; a larger state keeps the cache rule.
  EXPECT_EQ(adam_probe_numel(1.0, 300 * mi, 800'000), 1 * mi);
  EXPECT_EQ(adam_probe_numel(1.0, 300 * mi, 200 * mi), 67 * mi);
  EXPECT_EQ(adam_probe_numel(0.25, 0, 3 * mi + 1), 4 * mi);
  EXPECT_EQ(checksum_probe_bytes(1.0, 300 * mi, 800'000), 13 * mi);  // 16 B x 0.8 M = 12.2 MiB
  EXPECT_EQ(checksum_probe_bytes(1.0, 300 * mi, 100 * mi), 1200 * mi);
  EXPECT_EQ(grad_add_probe_numel(1.0, 300 * mi, 2, 3 * mi + 1), 4 * mi);
  EXPECT_EQ(grad_add_probe_numel(1.0, 300 * mi, 2, 0), 200 * mi);
  // The disk's: 0.2 s at 1 GB/s in whole 4 MiB steps (47), at least 128 MiB, at
  // most 16 B an element in 4 MiB steps, at least kMinProbeBytes.
  EXPECT_EQ(nvme_probe_bytes(0.2, 0), 188 * mi);
  EXPECT_EQ(nvme_probe_bytes(0.01, 0), 128 * mi);
  EXPECT_EQ(nvme_probe_bytes(0.2, 800'000), 16 * mi);
  EXPECT_EQ(nvme_probe_bytes(0.2, 1000), kMinProbeBytes);
  EXPECT_EQ(nvme_probe_bytes(0.2, 100 * mi), 188 * mi);
  EXPECT_EQ(parse_cache_size("32768K"), 32 * mi);
  EXPECT_EQ(parse_cache_size("300M"), 300 * mi);
  EXPECT_EQ(parse_cache_size("1G"), 1024 * mi);
  EXPECT_EQ(parse_cache_size("512"), 512);
  EXPECT_EQ(parse_cache_size("none"), 0);
}

// A plan that fills the disk leaves no room beside its state for the NVMe
// probe: a lone prober measures in the room the swap files will take (made
// after the probe), ranks probing together still stop with the flags to give.
TEST(ProbeTest, NvmeProbeOfAPlanThatFillsTheDiskMeasuresInTheStatesRoomWhenAlone) {
  testing::TempDir dir;
  const int64_t free = free_bytes_under(dir.path());
  ASSERT_GT(free, int64_t(1) << 30) << "the test needs 1 GiB free under " << dir.path();
  Config cfg;
  const int64_t reserve = free - (int64_t(16) << 20);  // the state's share: all but 16 MiB
  const IoRates lone = probe_nvme(cfg, dir.path(), 0.01, reserve, 1);
  EXPECT_TRUE(lone.in_state_room);
  EXPECT_GE(lone.bytes, kMinProbeBytes);
  EXPECT_GT(lone.read, 0.0);
  EXPECT_GT(lone.write, 0.0);
  EXPECT_GT(lone.both, 0.0);
  try {
    probe_nvme(cfg, dir.path(), 0.01, reserve, 2);
    ADD_FAILURE() << "two ranks probed beside a state that fills the disk";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("no room to measure the disk"), std::string::npos) << e.what();
  }
  const IoRates beside = probe_nvme(cfg, dir.path(), 0.01, 0, 1);
  EXPECT_FALSE(beside.in_state_room);
  EXPECT_EQ(beside.bytes, lone.bytes);  // the same 128 MiB pass either way: the disk has room for it
}

// Note [Kept rates]: a second measure takes what the first kept (the same
// figures, its source says so); a changed setting, --reprobe, an entry over a
// week old or a file that is not JSON measure again; "off" keeps nothing.
TEST(ProbeTest, RatesAreKeptPerSettingAndMeasuredAgainWhenAskedOrOld) {
  testing::TempDir dir;
  const std::string file = dir.path() + "/cache/rates.json";
  struct Reset {
    ~Reset() { set_rates_cache("off", false); }
  } reset;
  Config cfg;
  PlacementPlan plan;
  plan.state.shard_space_numel = int64_t(1) << 20;  // 1 Mi-element probes (Note [Probes sized to the work])
  StepWork work;
  work.adam_elems = 1;
  work.grad_add_elems = 1;
  auto measure = [&] {
    Rates r;
    measure_missing_rates(cfg, plan, &cpu_device(), work, r, 0.01);
    return r;
  };
  auto entries = [&] { return nlohmann::json::parse(file_contents(file)).size(); };
  set_rates_cache(file, false);
  const Rates first = measure();
  EXPECT_EQ(first.adam_source.rfind("measured: CPU Adam over 1 Mi elements", 0), 0u) << first.adam_source;
  EXPECT_EQ(first.grad_add_source.rfind("measured:", 0), 0u) << first.grad_add_source;
  ASSERT_EQ(entries(), 2u);
  const Rates second = measure();
  EXPECT_EQ(second.adam, first.adam);
  EXPECT_EQ(second.grad_add, first.grad_add);
  EXPECT_NE(second.adam_source.find("(kept from "), std::string::npos) << second.adam_source;
  EXPECT_NE(second.adam_source.find(file), std::string::npos) << second.adam_source;
  // Another instruction set is another CPU Adam: measured, kept beside.
  cfg.run.cpu_adam_isa = "scalar";
  EXPECT_EQ(measure().adam_source.find("kept"), std::string::npos);
  EXPECT_EQ(entries(), 3u);
  EXPECT_NE(measure().adam_source.find("kept"), std::string::npos);
  // A rank that is not the one keeping (ProbeRoom::keep false) measures and writes nothing; ranks
  // probing together (sharers) are another key.
  set_rates_cache(file, true);
  const std::string before = file_contents(file);
  Rates r2;
  measure_missing_rates(cfg, plan, &cpu_device(), work, r2, 0.01, ProbeRoom{true, 2, /*keep=*/false});
  EXPECT_EQ(r2.adam_source.find("kept"), std::string::npos);
  EXPECT_EQ(file_contents(file), before);
  // --reprobe: measured again and kept.
  EXPECT_EQ(measure().adam_source.find("kept"), std::string::npos);
  set_rates_cache(file, false);
  // Over a week old: measured again.
  nlohmann::json j = nlohmann::json::parse(file_contents(file));
  for (auto& [key, e] : j.items()) e["at"] = e["at"].get<double>() - kKeptRatesMaxAgeS - 60;
  write_file_atomic(file, j.dump());
  const Rates old = measure();
  EXPECT_EQ(old.adam_source.find("kept"), std::string::npos);
  EXPECT_EQ(old.grad_add_source.find("kept"), std::string::npos);
  EXPECT_NE(measure().grad_add_source.find("kept"), std::string::npos);
  // Not JSON: measured, the file rewritten.
  write_file_atomic(file, "not json");
  EXPECT_EQ(measure().adam_source.find("kept"), std::string::npos);
  EXPECT_EQ(entries(), 2u);
  // Off: nothing read or written.
  set_rates_cache("off", false);
  EXPECT_EQ(rates_cache_path(), "");
  remove_file(file);
  EXPECT_EQ(measure().adam_source.find("kept"), std::string::npos);
  EXPECT_FALSE(path_exists(file));
}

}  // namespace
}  // namespace strata
