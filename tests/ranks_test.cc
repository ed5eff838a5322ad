// Multi-process tests of ranks (CPU, Gloo): world sizes and ZeRO stages agree
// with one rank, NVMe equals RAM, bf16 moments do not depend on the world
// size, lost ranks are named, launchers work. Every rank runs one thread, a
// few steps of a tiny model; one such test at a time (CTest resource lock).
#include <gtest/gtest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace strata {
namespace {

using testing::free_port;
using testing::read_bytes;
using testing::Result;
using testing::sh;
using testing::TempDir;

const std::string kStrata = std::string(STRATA_BINARY_DIR) + "/strata";
const std::string kWorker = std::string(STRATA_BINARY_DIR) + "/tests/rank_worker";

// A model whose blocks do not split evenly into 2, 3 or 4 shards of whole
// 2048-element pieces: dim 48 gives layers of 27,744 elements.
nlohmann::json base_config(const std::string& data) {
  return {
      {"train_batch_size", 24},
      {"train_micro_batch_size_per_gpu", 2},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 2e-3}}}}},
      {"zero_optimization", {{"stage", 3}}},
      {"model", {{"dim", 48}, {"n_layers", 2}, {"n_heads", 4}, {"seq_len", 16}}},
      {"data", {{"path", data}, {"eval_interval", 0}}},
      {"run", {{"steps", 10}, {"threads", 1}, {"log_level", "warn"}, {"overlap_optimizer", true}}},
      {"comm", {{"timeout_s", 20}}},
  };
}

std::string write_config(const TempDir& dir, const std::string& name, const nlohmann::json& j) {
  return dir.write(name, j.dump(2));
}

std::vector<double> read_losses(const std::string& path) {
  std::vector<double> v;
  std::ifstream in(path);
  double x;
  while (in >> x) v.push_back(x);
  return v;
}

std::vector<float> read_floats(const std::string& path) {
  const std::string b = read_bytes(path);
  std::vector<float> v(b.size() / 4);
  std::memcpy(v.data(), b.data(), v.size() * 4);
  return v;
}

std::vector<int64_t> tensor_sizes(const std::string& path) {
  std::vector<int64_t> v;
  std::ifstream in(path);
  std::string block, name;
  int64_t n;
  while (in >> block >> name >> n) v.push_back(n);
  return v;
}

// Runs `ranks` rank_workers under strata launch; the outputs go to OUT.*.
Result run_workers(int ranks, const std::string& config, const std::string& out, const std::string& sets = "") {
  return sh(kStrata + " launch --nproc " + std::to_string(ranks) + " -- " + kWorker + " " + config + " " +
            out + " " + sets);
}

void expect_same_training(const std::string& ref, const std::string& got, const std::string& what) {
  const std::vector<double> a = read_losses(ref + ".losses"), b = read_losses(got + ".losses");
  ASSERT_EQ(a.size(), b.size()) << what;
  ASSERT_FALSE(a.empty()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_LE(std::abs(a[i] - b[i]), 1e-5 * std::abs(a[i])) << what << ": step " << i + 1 << " loss " << a[i]
                                                           << " vs " << b[i];
  }
  // The losses moved: the comparison is of training, not of initial values.
  EXPECT_LT(a.back(), a.front() - 0.05) << what;
  const std::vector<float> wa = read_floats(ref + ".master"), wb = read_floats(got + ".master");
  ASSERT_EQ(wa.size(), wb.size()) << what;
  size_t at = 0;
  for (int64_t n : tensor_sizes(ref + ".tensors")) {
    double max_w = 0.0, max_d = 0.0;
    for (int64_t i = 0; i < n; ++i, ++at) {
      max_w = std::max(max_w, double(std::abs(wa[at])));
      max_d = std::max(max_d, double(std::abs(wa[at] - wb[at])));
    }
    EXPECT_LE(max_d, 1e-4 * max_w) << what << ": a tensor of " << n << " elements differs";
  }
  EXPECT_EQ(at, wa.size());
}

// The losses of a metrics file, step by step.
std::vector<double> metric_losses(const std::string& path) {
  std::vector<double> v;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) v.push_back(nlohmann::json::parse(line)["loss"]);
  return v;
}

class RanksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    data_ = dir_.write("data.txt", testing::sample_text(60000));
  }
  TempDir dir_;
  std::string data_;
};

TEST_F(RanksTest, WorldSizes1To4AgreeAndShardTheirState) {
  const std::string cfg = write_config(dir_, "c.json", base_config(data_));
  for (int ws : {1, 2, 3, 4}) {
    const std::string out = dir_.file("ws" + std::to_string(ws));
    Result r = run_workers(ws, cfg, out);
    ASSERT_EQ(r.code, 0) << r.output;
    if (ws > 1) expect_same_training(dir_.file("ws1"), out, "world size " + std::to_string(ws));
    // Per-rank bytes of every sharded category: 1/ws of the whole plus padding.
    for (int rank = 0; rank < ws; ++rank) {
      const nlohmann::json j = nlohmann::json::parse(read_bytes(out + ".rank" + std::to_string(rank) + ".json"));
      const int64_t params = j["parameter_count"], blocks = j["num_blocks"];
      for (const char* c : {"param16", "grad", "master", "exp_avg", "exp_avg_sq"}) {
        const int64_t bytes = j["allocated"][c];
        const int64_t elem = 4;  // fp32 compute and moments
        EXPECT_GE(bytes * ws, params * elem) << c << " at world size " << ws;
        EXPECT_LE(bytes, (params + ws - 1) / ws * elem + blocks * 2048 * elem) << c << " at world size " << ws;
      }
    }
    if (ws == 3) {
      // The premise of "uneven": a block whose last rank holds both parameters
      // and padding (2 shards < numel < 3 shards).
      std::map<std::string, int64_t> numel;
      std::ifstream in(out + ".tensors");
      std::string block, name;
      int64_t n;
      while (in >> block >> name >> n) numel[block] += n;
      bool uneven = false;
      for (const auto& [b, k] : numel) {
        const int64_t shard = (k + 3 * 2048 - 1) / (3 * 2048) * 2048;
        uneven |= k > 2 * shard && k < 3 * shard;
      }
      EXPECT_TRUE(uneven) << "no block pads its last rank's shard";
    }
  }
}

TEST_F(RanksTest, StagesAgreeWithOneRank) {
  nlohmann::json c = base_config(data_);
  c["zero_optimization"]["stage"] = 0;
  const std::string cfg = write_config(dir_, "c.json", c);
  Result one = run_workers(1, cfg, dir_.file("ref"));
  ASSERT_EQ(one.code, 0) << one.output;
  for (int stage : {0, 1, 2, 3}) {
    const std::string out = dir_.file("s" + std::to_string(stage));
    Result r = run_workers(2, cfg, out, "zero_optimization.stage=" + std::to_string(stage));
    ASSERT_EQ(r.code, 0) << r.output;
    expect_same_training(dir_.file("ref"), out, "stage " + std::to_string(stage));
  }
}

// Ranks on the test device (tests/deferred_device.h: memory host code may
// not touch, copies that run only when waited for), with the collectives
// staged through host buffers over Gloo (--device=deferred) or queued on the
// device's comm stream as NCCL's are (--device=deferred-stream, Note [Device
// collectives]): world sizes, stages and placements train as one rank on
// the CPU device does.
const char* kStaged = "--device=deferred";
const char* kOnStream = "--device=deferred-stream";

// Placement p of the test device's cases: 0 everything on the device, 1 on
// the host, 2 on NVMe, 3 every category split three ways.
const char* kPlacementNames[] = {"device", "host", "nvme", "split"};
nlohmann::json with_placement(nlohmann::json c, int p, const std::string& swap) {
  const nlohmann::json nvme = {{"device", "nvme"}, {"nvme_path", swap}};
  const nlohmann::json split = {{"device", 0.3}, {"host", 0.3}, {"nvme", 0.4}};
  if (p == 1) {
    c["zero_optimization"]["offload_param"] = {{"device", "cpu"}};
    c["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
  } else if (p == 2) {
    c["zero_optimization"]["offload_param"] = nvme;
    c["zero_optimization"]["offload_param"]["max_in_cpu"] = 0;
    c["zero_optimization"]["offload_optimizer"] = nvme;
    c["zero_optimization"]["sub_group_size"] = 8192;
  } else if (p == 3) {
    c["placement"] = {{"param16", split}, {"grad", split}, {"optimizer", split}, {"nvme_path", swap}};
    c["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
  }
  return c;
}

TEST_F(RanksTest, OnTheTestDeviceWorldSizesAndPlacementsAgreeWithOneRank) {
  const std::string swap = dir_.file("swap");
  ASSERT_EQ(mkdir(swap.c_str(), 0700), 0);
  Result one = run_workers(1, write_config(dir_, "c.json", base_config(data_)), dir_.file("ref"));
  ASSERT_EQ(one.code, 0) << one.output;
  for (const char* mode : {kStaged, kOnStream}) {
    for (int p = 0; p < 4; ++p) {
      const std::string cfg = write_config(dir_, "p" + std::to_string(p) + ".json",
                                           with_placement(base_config(data_), p, swap));
      for (int ws : {2, 4}) {
        if (ws == 4 && p != 3) continue;  // four ranks: the split placement only (time)
        const std::string what = std::string(mode) + " " + kPlacementNames[p] + " at world size " + std::to_string(ws);
        const std::string out = dir_.file(std::string(mode + 9) + kPlacementNames[p] + std::to_string(ws));
        Result r = run_workers(ws, cfg, out, mode);
        ASSERT_EQ(r.code, 0) << what << "\n" << r.output;
        expect_same_training(dir_.file("ref"), out, what);
      }
    }
  }
  EXPECT_EQ(sh("ls -A " + swap).output, "");
}

TEST_F(RanksTest, OnTheTestDeviceStagesAgreeWithOneRank) {
  nlohmann::json c = base_config(data_);
  c["zero_optimization"]["stage"] = 0;
  const std::string cfg = write_config(dir_, "c.json", c);
  Result one = run_workers(1, cfg, dir_.file("ref"));
  ASSERT_EQ(one.code, 0) << one.output;
  for (const char* mode : {kStaged, kOnStream}) {
    for (int stage : {0, 1, 2}) {
      const std::string what = std::string(mode) + " stage " + std::to_string(stage);
      const std::string out = dir_.file(std::string(mode + 9) + "s" + std::to_string(stage));
      Result r = run_workers(2, cfg, out, std::string(mode) + " zero_optimization.stage=" + std::to_string(stage) +
                                              " zero_optimization.offload_optimizer.device=cpu");
      ASSERT_EQ(r.code, 0) << what << "\n" << r.output;
      expect_same_training(dir_.file("ref"), out, what);
    }
  }
}

// Stage 3, every category on the host, no overlap of the optimizer (whose
// late updates would refetch a block): per rank and step, every parameter
// shard is fetched once (persistent blocks), and every gradient shard lands
// (fp32) once per micro-batch (comm.gradient_reduction per_micro_batch) or
// once per step (per_step: summed on the rank, reduced once). With 12 / ws
// micro-batches the D2H bytes shrink as 1 / ws^2 or 1 / ws, the H2D bytes as
// 1 / ws; the network bytes are what `strata plan --world-size` predicts,
// per_step's a fraction of per_micro_batch's.
TEST_F(RanksTest, OnTheTestDevicePerRankBytesShrinkWithTheWorldSize) {
  nlohmann::json c = base_config(data_);
  c["run"]["steps"] = 2;
  c["run"]["overlap_optimizer"] = false;
  c["zero_optimization"]["offload_param"] = {{"device", "cpu"}};
  c["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
  int64_t total_shard_space = 0;
  std::map<std::string, std::map<int, int64_t>> net_of;  // reduction -> world size -> planned bytes
  // micro_batch with each reduction, and the layer schedule (Note [Step
  // schedules]), whose blocks land and are reduced once per step whatever
  // comm.gradient_reduction says.
  for (const char* reduction : {"per_micro_batch", "per_step", "layer"}) {
    const bool layer = std::string(reduction) == "layer";
    c["comm"]["gradient_reduction"] = layer ? "per_micro_batch" : reduction;
    c["run"]["schedule"] = layer ? "layer" : "micro_batch";
    const std::string cfg = write_config(dir_, std::string(reduction) + ".json", c);
    for (int ws : {1, 2, 4}) {
      Result p = sh(kStrata + " plan --json --world-size " + std::to_string(ws) + " " + cfg);
      ASSERT_EQ(p.code, 0) << p.output;
      const int64_t planned_net = nlohmann::json::parse(p.output)["network"]["bytes_per_step_per_rank"];
      const int64_t accum = 12 / ws, landings = layer || (std::string(reduction) == "per_step" && ws > 1) ? 1 : accum;
      for (const char* mode : {kStaged, kOnStream}) {
        if (ws == 1 && mode == kOnStream) continue;  // one rank: no collectives
        const std::string what = std::string(reduction) + " " + mode + " at world size " + std::to_string(ws);
        const std::string out = dir_.file(std::string(reduction) + (mode + 9) + std::to_string(ws));
        Result r = run_workers(ws, cfg, out, mode);
        ASSERT_EQ(r.code, 0) << what << "\n" << r.output;
        for (int rank = 0; rank < ws; ++rank) {
          const nlohmann::json j = nlohmann::json::parse(read_bytes(out + ".rank" + std::to_string(rank) + ".json"));
          const int64_t shard_space = j["shard_space_numel"];
          if (ws == 1) total_shard_space = shard_space;
          EXPECT_LE(shard_space * ws, total_shard_space + int64_t(j["num_blocks"]) * ws * 2048) << what;
          ASSERT_EQ(j["steps"].size(), 2u) << what;
          for (const nlohmann::json& s : j["steps"]) {
            EXPECT_EQ(int64_t(s["d2h"]), landings * shard_space * 4) << what << ", rank " << rank;
            EXPECT_EQ(int64_t(s["h2d"]), shard_space * 4) << what << ", rank " << rank;
            EXPECT_EQ(int64_t(s["net"]), planned_net) << what << ", rank " << rank;
          }
        }
      }
      net_of[reduction][ws] = planned_net;
    }
  }
  for (int ws : {2, 4}) {
    EXPECT_GT(net_of["per_step"][ws], 0);
    EXPECT_LT(net_of["per_step"][ws], net_of["per_micro_batch"][ws]) << "world size " << ws;
    EXPECT_EQ(net_of["layer"][ws], net_of["per_step"][ws]) << "world size " << ws;
  }
}

// The same bytes of two runs' files (losses, master weights, moments,
// gradients): bit for bit.
void expect_identical_files(const std::string& a, const std::string& b, const std::string& what) {
  for (const char* f : {".losses", ".master", ".exp_avg", ".exp_avg_sq", ".grad"}) {
    const std::string x = read_bytes(a + f), y = read_bytes(b + f);
    EXPECT_FALSE(x.empty()) << what << f;
    EXPECT_TRUE(x == y) << what << ": " << f << " differs";
  }
}

// Note [Step schedules]: with ranks the layer schedule trains bit for bit as
// micro_batch with comm.gradient_reduction per_step (each block's
// micro-batches summed in fp32 in order, reduced once): stages 0-3 at two
// ranks over Gloo, the staged and stream collectives of the test device at
// two ranks, four ranks at stage 3; the tied embedding's sum included.
TEST_F(RanksTest, LayerScheduleTrainsBitForBitAsPerStepReductions) {
  nlohmann::json c = base_config(data_);
  c["run"]["steps"] = 3;
  c["comm"]["gradient_reduction"] = "per_step";
  c["model"]["tie_embeddings"] = true;
  const std::string cfg = write_config(dir_, "c.json", c);
  struct Case {
    int ws;
    std::string args;
  };
  const std::vector<Case> cases = {
      {2, "zero_optimization.stage=0"}, {2, "zero_optimization.stage=1"}, {2, "zero_optimization.stage=2"},
      {2, "zero_optimization.stage=3"}, {4, "zero_optimization.stage=3"},
      {2, std::string(kStaged) + " zero_optimization.stage=3 zero_optimization.offload_param.device=cpu "
              "zero_optimization.offload_optimizer.device=cpu"},
      {2, std::string(kOnStream) + " zero_optimization.stage=2 zero_optimization.offload_optimizer.device=cpu"},
      {2, std::string(kOnStream) + " zero_optimization.stage=3"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string what = cases[i].args + " at world size " + std::to_string(cases[i].ws);
    const std::string a = dir_.file("mb" + std::to_string(i)), b = dir_.file("ly" + std::to_string(i));
    Result ra = run_workers(cases[i].ws, cfg, a, cases[i].args + " run.schedule=\"micro_batch\"");
    ASSERT_EQ(ra.code, 0) << what << "\n" << ra.output;
    Result rb = run_workers(cases[i].ws, cfg, b, cases[i].args + " run.schedule=\"layer\"");
    ASSERT_EQ(rb.code, 0) << what << "\n" << rb.output;
    expect_identical_files(a, b, what);
  }
}

// Note [Activation placement]: with ranks (six micro-batches each), every layer
// recomputed (always), every layer's entries kept (never), and the first
// layer split by micro-batch (its first micro-batch's entries in host RAM,
// its other five recomputed) with the last layer's entries on the device
// (run.activations) train bit for bit the same: stages 0-3 at two ranks over
// Gloo under both schedules, bf16 at stage 3, and the staged collectives of
// the test device at stage 3.
TEST_F(RanksTest, ActivationPlacementsTrainBitForBitWithRanks) {
  nlohmann::json c = base_config(data_);
  c["run"]["steps"] = 3;
  c["run"]["recompute"] = "always";
  const std::string always = write_config(dir_, "always.json", c);
  c["run"]["recompute"] = "never";
  const std::string never = write_config(dir_, "never.json", c);
  c["run"]["recompute"] = "auto";
  c["run"]["activations"] = {{"keep_host_micro_batches", 1}, {"keep_device_layers", 1}};
  const std::string split = write_config(dir_, "split.json", c);
  const std::vector<std::string> cases = {
      "zero_optimization.stage=0",
      "zero_optimization.stage=1",
      "zero_optimization.stage=2",
      "zero_optimization.stage=3",
      "zero_optimization.stage=1 run.schedule=\"layer\"",
      "zero_optimization.stage=3 run.schedule=\"layer\"",
      "zero_optimization.stage=3 bf16.enabled=true",
      std::string(kStaged) + " zero_optimization.stage=3 zero_optimization.offload_param.device=cpu",
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string ref = dir_.file("r" + std::to_string(i));
    Result r = run_workers(2, always, ref, cases[i]);
    ASSERT_EQ(r.code, 0) << cases[i] << "\n" << r.output;
    const std::vector<double> losses = read_losses(ref + ".losses");
    ASSERT_EQ(losses.size(), 3u) << cases[i];
    EXPECT_NE(losses.front(), losses.back()) << cases[i] << ": the losses moved";
    for (const auto& [name, cfg] : {std::pair<const char*, std::string>{"never", never}, {"split by micro-batch", split}}) {
      const std::string what = std::string(name) + " against always, " + cases[i];
      const std::string out = dir_.file(std::string(name).substr(0, 1) + std::to_string(i));
      Result rr = run_workers(2, cfg, out, cases[i]);
      ASSERT_EQ(rr.code, 0) << what << "\n" << rr.output;
      expect_identical_files(ref, out, what);
      // The host-kept pack's entries went down and came back (counted as
      // d2h/h2d: the CPU device's copies too); always moved none of them.
      const auto d2h = [](const std::string& o) {
        return nlohmann::json::parse(read_bytes(o + ".rank0.json"))["steps"][0]["d2h"].get<int64_t>();
      };
      if (cfg == split) {
        EXPECT_GT(d2h(out), d2h(ref)) << what;
      }
    }
  }
}

// Note [Speculative optimizer]: the optimizer behind the backward under the
// layer schedule (each block's gradient final after its reduction) trains
// bit for bit like the inline optimizer after a micro_batch step, at stages
// 0-3 with two ranks over Gloo and on the test device's staged and stream
// collectives; half the cases clip every step (the speculation redone),
// half never clip (committed), and every rank reports which.
TEST_F(RanksTest, SpeculativeOptimizerTrainsBitForBitWithRanks) {
  nlohmann::json c = base_config(data_);
  c["run"]["steps"] = 3;
  c["model"]["tie_embeddings"] = true;
  c["comm"]["gradient_reduction"] = "per_step";  // micro_batch's reductions as layer's (bit for bit)
  const std::string cfg = write_config(dir_, "c.json", c);
  struct Case {
    std::string args;
    bool clip;
  };
  const std::vector<Case> cases = {
      {"zero_optimization.stage=0", false},
      {"zero_optimization.stage=1", true},
      {"zero_optimization.stage=2", false},
      {"zero_optimization.stage=3", true},
      {std::string(kStaged) + " zero_optimization.stage=3 zero_optimization.offload_param.device=cpu "
                              "zero_optimization.offload_optimizer.device=cpu", false},
      {std::string(kOnStream) + " zero_optimization.stage=2 zero_optimization.offload_optimizer.device=cpu", true},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string what = cases[i].args + (cases[i].clip ? ", clipped" : "");
    const std::string clip = cases[i].clip ? " gradient_clipping=0.0001" : " gradient_clipping=0";
    const std::string a = dir_.file("inline" + std::to_string(i)), b = dir_.file("spec" + std::to_string(i));
    Result ra = run_workers(2, cfg, a, cases[i].args + clip +
                                           " run.schedule=\"micro_batch\" run.overlap_optimizer=false"
                                           " optimizer.speculate=\"off\"");
    ASSERT_EQ(ra.code, 0) << what << "\n" << ra.output;
    Result rb = run_workers(2, cfg, b, cases[i].args + clip +
                                           " run.schedule=\"layer\" run.overlap_optimizer=true"
                                           " optimizer.speculate=\"on\"");
    ASSERT_EQ(rb.code, 0) << what << "\n" << rb.output;
    expect_identical_files(a, b, what);
    for (int rank = 0; rank < 2; ++rank) {
      const nlohmann::json j = nlohmann::json::parse(read_bytes(b + ".rank" + std::to_string(rank) + ".json"));
      ASSERT_EQ(j["steps"].size(), 3u) << what;
      for (const nlohmann::json& s : j["steps"]) {
        EXPECT_EQ(std::string(s["speculation"]), cases[i].clip ? "redone" : "committed") << what << ", rank " << rank;
      }
    }
  }
}

// comm.keep_gathered at stage 3: blocks kept gathered for the step are
// gathered once instead of at every use, so each rank sends what the plan
// counts (less than with none kept), and training is bit for bit the same
// (a gather is a copy). On the test device with NCCL's seam, whose late
// collectives would show a kept block read before its gather landed.
TEST_F(RanksTest, KeptGatheredBlocksSendFewerBytesAndTrainTheSame) {
  nlohmann::json c = base_config(data_);
  c["run"]["steps"] = 4;
  c["comm"]["gradient_reduction"] = "per_micro_batch";
  std::map<std::string, int64_t> planned;
  for (const char* keep : {"none", "all", "auto"}) {
    c["comm"]["keep_gathered"] = keep;
    const std::string cfg = write_config(dir_, std::string(keep) + ".json", c);
    Result p = sh(kStrata + " plan --json --world-size 2 " + cfg);
    ASSERT_EQ(p.code, 0) << p.output;
    const nlohmann::json pj = nlohmann::json::parse(p.output);
    planned[keep] = pj["network"]["bytes_per_step_per_rank"];
    EXPECT_EQ(int64_t(pj["kept_gathered_blocks"]), std::string(keep) == "none" ? 0 : 4) << keep;
    const std::string out = dir_.file(keep);
    Result r = run_workers(2, cfg, out, kOnStream);
    ASSERT_EQ(r.code, 0) << keep << "\n" << r.output;
    for (int rank = 0; rank < 2; ++rank) {
      const nlohmann::json j = nlohmann::json::parse(read_bytes(out + ".rank" + std::to_string(rank) + ".json"));
      for (const nlohmann::json& s : j["steps"]) EXPECT_EQ(int64_t(s["net"]), planned[keep]) << keep;
    }
  }
  EXPECT_LT(planned["all"], planned["none"]);
  EXPECT_EQ(read_bytes(dir_.file("none.losses")), read_bytes(dir_.file("all.losses")));
  EXPECT_EQ(read_bytes(dir_.file("none.master")), read_bytes(dir_.file("all.master")));
  // Untied, two of four blocks kept: the ring of one block per use and the
  // kept blocks after it share the buffer without overlapping.
  c["model"]["tie_embeddings"] = false;
  for (const nlohmann::json& keep : {nlohmann::json("none"), nlohmann::json(2)}) {
    c["comm"]["keep_gathered"] = keep;
    const std::string name = std::string("untied-") + (keep.is_number() ? "2" : "none");
    const std::string cfg = write_config(dir_, name + ".json", c);
    Result p = sh(kStrata + " plan --json --world-size 2 " + cfg);
    ASSERT_EQ(p.code, 0) << p.output;
    EXPECT_EQ(int64_t(nlohmann::json::parse(p.output)["kept_gathered_blocks"]), keep.is_number() ? 2 : 0);
    Result r = run_workers(2, cfg, dir_.file(name), kOnStream);
    ASSERT_EQ(r.code, 0) << name << "\n" << r.output;
  }
  EXPECT_EQ(read_bytes(dir_.file("untied-none.losses")), read_bytes(dir_.file("untied-2.losses")));
  EXPECT_EQ(read_bytes(dir_.file("untied-none.master")), read_bytes(dir_.file("untied-2.master")));
}

// Ranks as `nodes` nodes of `per_node` each, one strata launch per node (as
// on a cluster), all on this machine; the outputs go to OUT.*.
Result run_on_nodes(int nodes, int per_node, const std::string& config, const std::string& out,
                    const std::string& sets) {
  const std::string port = std::to_string(free_port());
  std::string cmd = "pids=; ";
  for (int n = nodes - 1; n >= 0; --n) {
    const std::string launch = kStrata + " launch --nproc " + std::to_string(per_node) + " --nnodes " +
                               std::to_string(nodes) + " --node-rank " + std::to_string(n) + " --master-addr 127.0.0.1 --master-port " +
                               port + " -- " + kWorker + " " + config + " " + out + " " + sets;
    if (n > 0) {
      cmd += launch + " > " + out + ".node" + std::to_string(n) + ".log 2>&1 & pids=\"$pids $!\"; ";
    } else {
      cmd += launch + "; rc=$?; for p in $pids; do wait $p || rc=1; done; cat " + out + ".node*.log; exit $rc";
    }
  }
  return sh("bash -c '" + cmd + "'");
}

// comm.secondary_shard at stage 3 on 2 nodes of 2 ranks: each block's first
// gather of a step spans the 4 ranks, its later ones the node's 2 from the
// secondary shard, so each rank sends what the plan counts on each group
// (fewer bytes across nodes than without it) and training is bit for bit
// the same (a gather is a copy), in place (CPU), staged, and on the test
// device's comm stream, whose late collectives would show a secondary shard
// read before its copy was queued.
TEST_F(RanksTest, SecondaryShardKeepsLaterGathersInTheNodeAndTrainsTheSame) {
  nlohmann::json c = base_config(data_);
  c["run"]["steps"] = 3;
  c["comm"]["keep_gathered"] = "none";
  c["comm"]["gradient_reduction"] = "per_micro_batch";
  std::map<std::string, nlohmann::json> planned;
  for (const char* sec : {"off", "on"}) {
    c["comm"]["secondary_shard"] = sec;
    const std::string cfg = write_config(dir_, std::string(sec) + ".json", c);
    Result p = sh(kStrata + " plan --json --world-size 4 --nodes 2 " + cfg);
    ASSERT_EQ(p.code, 0) << p.output;
    planned[sec] = nlohmann::json::parse(p.output);
    EXPECT_EQ(bool(planned[sec]["secondary_shard"]), std::string(sec) == "on");
    for (const char* mode : {"", kStaged, kOnStream}) {
      const std::string what = std::string(sec) + " " + (*mode ? mode + 9 : "cpu");
      const std::string out = dir_.file(std::string(sec) + "-" + (*mode ? mode + 9 : "cpu"));
      Result r = run_on_nodes(2, 2, cfg, out, mode);
      ASSERT_EQ(r.code, 0) << what << "\n" << r.output;
      for (int rank = 0; rank < 4; ++rank) {
        const nlohmann::json j = nlohmann::json::parse(read_bytes(out + ".rank" + std::to_string(rank) + ".json"));
        ASSERT_EQ(j["steps"].size(), 3u) << what;
        for (const nlohmann::json& s : j["steps"]) {
          EXPECT_EQ(int64_t(s["net"]), int64_t(planned[sec]["network"]["bytes_per_step_per_rank"]))
              << what << ", rank " << rank;
          EXPECT_EQ(int64_t(s["intra_node"]), int64_t(planned[sec]["network"]["intra_node_bytes_per_step_per_rank"]))
              << what << ", rank " << rank;
        }
      }
      EXPECT_EQ(read_bytes(dir_.file("off-cpu.losses")), read_bytes(out + ".losses")) << what;
      EXPECT_TRUE(read_bytes(dir_.file("off-cpu.master")) == read_bytes(out + ".master"))
          << what << ": the master weights differ";
    }
  }
  EXPECT_EQ(int64_t(planned["off"]["network"]["intra_node_bytes_per_step_per_rank"]), 0);
  EXPECT_GT(int64_t(planned["on"]["network"]["intra_node_bytes_per_step_per_rank"]), 0);
  EXPECT_LT(int64_t(planned["on"]["network"]["bytes_per_step_per_rank"]),
            int64_t(planned["off"]["network"]["bytes_per_step_per_rank"]));
  EXPECT_GT(int64_t(planned["on"]["staging_bytes"]["secondary"]), 0);
}

// communication_data_type bf16: the gradient reductions carry 16 bits, so
// each rank sends what the plan counts for them (less than with fp32), and
// training follows world size 1 to 16-bit rounding, not to fp32's.
TEST_F(RanksTest, Bf16CommunicationHalvesTheReductionBytes) {
  nlohmann::json c = base_config(data_);
  c["run"]["steps"] = 6;
  const std::string cfg = write_config(dir_, "c.json", c);
  c["communication_data_type"] = "bf16";
  const std::string cfg16 = write_config(dir_, "c16.json", c);
  Result one = run_workers(1, cfg, dir_.file("ref"));
  ASSERT_EQ(one.code, 0) << one.output;
  const std::vector<double> ref = read_losses(dir_.file("ref.losses"));
  for (int stage : {0, 2}) {
    const std::string set = " --set zero_optimization.stage=" + std::to_string(stage);
    auto planned = [&](const std::string& config) {
      Result p = sh(kStrata + " plan --json --world-size 2 " + config + set);
      EXPECT_EQ(p.code, 0) << p.output;
      return int64_t(nlohmann::json::parse(p.output)["network"]["bytes_per_step_per_rank"]);
    };
    const int64_t net32 = planned(cfg), net16 = planned(cfg16);
    EXPECT_LT(net16, net32) << "stage " << stage;
    for (const char* mode : {kOnStream, ""}) {
      const std::string what = "stage " + std::to_string(stage) + " " + mode;
      const std::string out = dir_.file("b" + std::to_string(stage) + (*mode ? "d" : "c"));
      Result r = run_workers(2, cfg16, out, std::string(mode) + " zero_optimization.stage=" + std::to_string(stage));
      ASSERT_EQ(r.code, 0) << what << "\n" << r.output;
      const nlohmann::json j = nlohmann::json::parse(read_bytes(out + ".rank1.json"));
      for (const nlohmann::json& s : j["steps"]) EXPECT_EQ(int64_t(s["net"]), net16) << what;
      const std::vector<double> got = read_losses(out + ".losses");
      ASSERT_EQ(got.size(), ref.size()) << what;
      for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-2 * ref[i]) << what << ", step " << i + 1;
      EXPECT_NE(got.back(), ref.back()) << what << ": 16-bit reductions changed nothing";
    }
  }
}

// LoRA over a frozen base (docs/design.md, "State kinds", "Frozen shards")
// with ranks: at stages 0-2 each rank holds the whole base, at stage 3 a
// shard of it, gathered per use. 2 ranks train as one rank (to rounding) at
// every stage, with dropout, and every stage as stage 0 does bit for bit;
// at stage 3 the base is the same bit for bit whether on the device, in host
// RAM or on NVMe, or on the test device with its collectives on a stream;
// each rank holds half the base at stage 3 and all of it below; the base
// reads back unchanged; the network bytes are what the plan predicts.
TEST_F(RanksTest, LoraTrainsAsOneRankAtEveryStage) {
  nlohmann::json c = base_config(data_);
  c["zero_optimization"]["stage"] = 0;
  // (At 2e-2 the runs part after 6 steps with or without ranks' rounding:
  // Adam's first steps on B, which starts at zero, are as large as the rate.)
  c["optimizer"]["params"]["lr"] = 5e-3;
  c["lora"] = {{"r", 4}, {"lora_alpha", 8}, {"lora_dropout", 0.1}, {"target_modules", "all-linear"}};
  const std::string cfg = write_config(dir_, "lora.json", c);
  Result one = run_workers(1, cfg, dir_.file("lora1"));
  ASSERT_EQ(one.code, 0) << one.output;
  const std::string base = read_bytes(dir_.file("lora1.frozen"));
  ASSERT_GT(base.size(), 0u);
  int64_t whole_base = 0;
  for (int stage : {0, 1, 2, 3}) {
    const std::string what = "LoRA, 2 ranks at stage " + std::to_string(stage);
    const std::string out = dir_.file("lora-s" + std::to_string(stage));
    Result r = run_workers(2, cfg, out, "zero_optimization.stage=" + std::to_string(stage));
    ASSERT_EQ(r.code, 0) << what << "\n" << r.output;
    expect_same_training(dir_.file("lora1"), out, what);
    EXPECT_EQ(read_bytes(out + ".frozen"), base) << what << ": the base changed";
    if (stage > 0) {
      EXPECT_EQ(read_bytes(dir_.file("lora-s0.losses")), read_bytes(out + ".losses")) << what;
      EXPECT_EQ(read_bytes(dir_.file("lora-s0.master")), read_bytes(out + ".master")) << what;
    }
    for (int rank = 0; rank < 2; ++rank) {
      const nlohmann::json j = nlohmann::json::parse(read_bytes(out + ".rank" + std::to_string(rank) + ".json"));
      const int64_t frozen = j["allocated"]["frozen"];
      if (stage == 0) whole_base = frozen;
      // fp32 base: 4 bytes an element, at most a 2048-element pad per block and rank.
      const int64_t held = stage == 3 ? whole_base / 2 : whole_base;
      EXPECT_GE(frozen, int64_t(base.size()) / (stage == 3 ? 2 : 1)) << what << " rank " << rank;
      EXPECT_LE(std::abs(frozen - held), 4 * 2048 * 4) << what << " rank " << rank;
    }
  }
  // Stage 3: the base's shards in host RAM and on NVMe.
  const std::string swap = dir_.file("swap");
  ASSERT_EQ(mkdir(swap.c_str(), 0700), 0);
  const std::string s3 = " zero_optimization.stage=3";
  const std::pair<std::string, std::string> tiers[] = {
      {"host", s3 + " zero_optimization.offload_param.device=cpu"},
      {"nvme", s3 + " zero_optimization.offload_param.device=nvme zero_optimization.offload_param.nvme_path=\"" +
                   swap + "\" zero_optimization.offload_param.max_in_cpu=0"},
      {"stream", s3 + " zero_optimization.offload_param.device=cpu " + kOnStream}};
  for (const auto& [name, sets] : tiers) {
    const std::string out = dir_.file("lora-" + name);
    Result r = run_workers(2, cfg, out, sets);
    ASSERT_EQ(r.code, 0) << name << "\n" << r.output;
    EXPECT_EQ(read_bytes(dir_.file("lora-s3.losses")), read_bytes(out + ".losses")) << "the base on " << name;
    EXPECT_EQ(read_bytes(dir_.file("lora-s3.master")), read_bytes(out + ".master")) << "the base on " << name;
    EXPECT_EQ(read_bytes(out + ".frozen"), base) << "the base on " << name;
  }
  // The network: stage 3 gathers the base's shards at every use.
  for (int stage : {2, 3}) {
    Result p = sh(kStrata + " plan --json --world-size 2 " + cfg + " --set zero_optimization.stage=" +
                  std::to_string(stage));
    ASSERT_EQ(p.code, 0) << p.output;
    const int64_t planned = nlohmann::json::parse(p.output)["network"]["bytes_per_step_per_rank"];
    const nlohmann::json j =
        nlohmann::json::parse(read_bytes(dir_.file("lora-s" + std::to_string(stage) + ".rank0.json")));
    for (const nlohmann::json& step : j["steps"]) EXPECT_EQ(int64_t(step["net"]), planned) << "stage " << stage;
  }
}

TEST_F(RanksTest, NvmeEqualsRamBitForBitAtWorldSize2) {
  nlohmann::json c = base_config(data_);
  c["run"]["steps"] = 4;
  const std::string ram = write_config(dir_, "ram.json", c);
  const std::string swap = dir_.file("swap");
  ASSERT_EQ(mkdir(swap.c_str(), 0700), 0);
  c["zero_optimization"]["offload_optimizer"] = {{"device", "nvme"}, {"nvme_path", swap}};
  c["zero_optimization"]["offload_param"] = {{"device", "nvme"}, {"nvme_path", swap}};
  c["zero_optimization"]["sub_group_size"] = 8192;
  const std::string nvme = write_config(dir_, "nvme.json", c);
  Result a = run_workers(2, ram, dir_.file("ram"));
  ASSERT_EQ(a.code, 0) << a.output;
  Result b = run_workers(2, nvme, dir_.file("nvme"));
  ASSERT_EQ(b.code, 0) << b.output;
  EXPECT_EQ(read_bytes(dir_.file("ram.losses")), read_bytes(dir_.file("nvme.losses")));
  EXPECT_EQ(read_bytes(dir_.file("ram.master")), read_bytes(dir_.file("nvme.master")));
  EXPECT_EQ(read_bytes(dir_.file("ram.exp_avg_sq")), read_bytes(dir_.file("nvme.exp_avg_sq")));
  // Both ranks swapped: the NVMe state really lived on NVMe.
  for (int rank = 0; rank < 2; ++rank) {
    const nlohmann::json j =
        nlohmann::json::parse(read_bytes(dir_.file("nvme.rank" + std::to_string(rank) + ".json")));
    EXPECT_GT(int64_t(j["allocated"]["master"]), 0);
  }
  // Every swap directory was removed at exit.
  EXPECT_EQ(sh("ls -A " + swap).output, "");
}

// One step from the same state and the same gradients at world sizes 1 and
// 2 (two micro-batches summed once in either case, no clipping): the bf16
// moments, rounded stochastically by the global parameter index, are the
// same bits although the shards and their padding differ.
TEST_F(RanksTest, Bf16MomentsDoNotDependOnWorldSize) {
  nlohmann::json c = base_config(data_);
  c["train_batch_size"] = 4;
  c["gradient_clipping"] = 0.0;
  c["run"]["steps"] = 1;
  c["run"]["optimizer_state_dtype"] = "bf16";
  const std::string cfg = write_config(dir_, "c.json", c);
  Result a = run_workers(1, cfg, dir_.file("one"));
  ASSERT_EQ(a.code, 0) << a.output;
  Result b = run_workers(2, cfg, dir_.file("two"));
  ASSERT_EQ(b.code, 0) << b.output;
  const std::string m1 = read_bytes(dir_.file("one.exp_avg_sq")), m2 = read_bytes(dir_.file("two.exp_avg_sq"));
  ASSERT_FALSE(m1.empty());
  EXPECT_EQ(m1.size(), m2.size());
  EXPECT_TRUE(m1 == m2) << "gathered bf16 exp_avg_sq differs between world sizes 1 and 2";
  EXPECT_TRUE(read_bytes(dir_.file("one.exp_avg")) == read_bytes(dir_.file("two.exp_avg")));
  EXPECT_TRUE(read_bytes(dir_.file("one.master")) == read_bytes(dir_.file("two.master")));
}

TEST_F(RanksTest, LaunchReturnsTheFailingRanksStatus) {
  Result r = sh(kStrata + " launch --nproc 2 --grace 2 -- sh -c 'if [ $RANK = 1 ]; then exit 3; fi; sleep 30'");
  EXPECT_EQ(r.code, 3) << r.output;
  EXPECT_NE(r.output.find("rank 1 exited with status 3"), std::string::npos) << r.output;
  Result ok = sh(kStrata + " launch --nproc 3 -- sh -c 'echo hello from $RANK of $WORLD_SIZE'");
  EXPECT_EQ(ok.code, 0);
  EXPECT_NE(ok.output.find("[rank 2] hello from 2 of 3"), std::string::npos) << ok.output;
}

// Starts `n` ranks of `strata train` directly (no launcher that would stop
// the others), each with its output in a file.
struct Ranks {
  std::vector<pid_t> pids;
  std::vector<std::string> logs;
};

Ranks start_ranks(int n, const TempDir& dir, const std::vector<std::vector<std::string>>& args, int port) {
  Ranks rs;
  for (int r = 0; r < n; ++r) {
    const std::string log = dir.file("rank" + std::to_string(r) + ".log");
    const pid_t pid = fork();
    if (pid == 0) {
      const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      dup2(fd, 1);
      dup2(fd, 2);
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      std::vector<std::string> a = args[size_t(r)];
      std::vector<char*> argv;
      for (std::string& s : a) argv.push_back(s.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    rs.pids.push_back(pid);
    rs.logs.push_back(log);
  }
  return rs;
}

// Waits for pid up to `seconds`; returns its exit code, or -1 (killed then).
int wait_for(pid_t pid, double seconds) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > seconds) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

bool wait_for_text(const std::string& path, const std::string& text, double seconds) {
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds) {
    if (read_bytes(path).find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// A rank killed mid-run (SIGKILL) or stopped (SIGSTOP): every other rank
// exits non-zero with one line naming it, within comm.timeout_s + 10 s.
// `device_mode`: empty, `strata train` on the CPU device; else rank_worker
// on the test device with that --device mode.
void lost_rank_case(const TempDir& dir, const std::string& data, int sig, const std::string& device_mode = "") {
  nlohmann::json c = base_config(data);
  const double timeout = 6.0;
  c["comm"]["timeout_s"] = timeout;
  c["run"]["steps"] = 100000;
  c["run"]["log_level"] = "info";
  const std::string cfg = write_config(dir, "c.json", c);
  std::vector<std::vector<std::string>> args(3, {kStrata, "train", cfg, "--metrics", dir.file("m{rank}.jsonl")});
  std::string progress = dir.file("m1.jsonl"), step3 = "\"step\":3,", error = "strata: error: lost rank 1";
  if (!device_mode.empty()) {
    args.assign(3, {kWorker, cfg, dir.file("w"), device_mode});
    progress = dir.file("w.rank1.steps");
    step3 = "step 3";
    error = "rank_worker: error: lost rank 1";
  }
  Ranks rs = start_ranks(3, dir, args, free_port());
  ASSERT_TRUE(wait_for_text(progress, step3, 60)) << read_bytes(rs.logs[1]);
  kill(rs.pids[1], sig);
  const auto t0 = std::chrono::steady_clock::now();
  for (int r : {0, 2}) {
    const int code = wait_for(rs.pids[size_t(r)], timeout + 10.0);
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string log = read_bytes(rs.logs[size_t(r)]);
    EXPECT_NE(code, 0) << log;
    EXPECT_NE(code, -1) << "rank " << r << " still running after " << took << " s";
    EXPECT_LE(took, timeout + 10.0);
    EXPECT_NE(log.find(error), std::string::npos) << log;
    EXPECT_EQ(log.find("frame #"), std::string::npos) << "a stack trace: " << log;
  }
  kill(rs.pids[1], SIGKILL);
  wait_for(rs.pids[1], 10);
}

TEST_F(RanksTest, KilledRankIsNamedByTheOthers) { lost_rank_case(dir_, data_, SIGKILL); }
TEST_F(RanksTest, HungRankIsNamedByTheOthersWithinTheTimeout) { lost_rank_case(dir_, data_, SIGSTOP); }
TEST_F(RanksTest, OnTheTestDeviceAKilledRankIsNamedByTheOthers) {
  lost_rank_case(dir_, data_, SIGKILL, kStaged);
}
TEST_F(RanksTest, OnTheTestDeviceAHungRankIsNamedByTheOthers) {
  lost_rank_case(dir_, data_, SIGSTOP, kOnStream);
}

// SIGTERM to one rank: the request is combined at the step boundary, so
// every rank stops after the same step and exits 0.
TEST_F(RanksTest, StopRequestedOnOneRankStopsAllAfterTheSameStep) {
  nlohmann::json c = base_config(data_);
  c["run"]["steps"] = 100000;
  const std::string cfg = write_config(dir_, "c.json", c);
  std::vector<std::vector<std::string>> args(2, {kStrata, "train", cfg, "--metrics", dir_.file("m{rank}.jsonl")});
  Ranks rs = start_ranks(2, dir_, args, free_port());
  ASSERT_TRUE(wait_for_text(dir_.file("m1.jsonl"), "\"step\":3,", 60)) << read_bytes(rs.logs[1]);
  kill(rs.pids[1], SIGTERM);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(wait_for(rs.pids[size_t(r)], 60), 0) << read_bytes(rs.logs[size_t(r)]);
  const std::string m0 = read_bytes(dir_.file("m0.jsonl")), m1 = read_bytes(dir_.file("m1.jsonl"));
  const auto lines = [](const std::string& t) { return std::count(t.begin(), t.end(), '\n'); };
  EXPECT_GE(lines(m0), 3);
  EXPECT_EQ(lines(m0), lines(m1));
  EXPECT_NE(read_bytes(rs.logs[0]).find("stop requested (SIGINT/SIGTERM on some rank): every rank stops after step"), std::string::npos);
}

TEST_F(RanksTest, MismatchedConfigsStopEveryRankNamingTheKey) {
  const std::string cfg = write_config(dir_, "c.json", base_config(data_));
  std::vector<std::vector<std::string>> args = {
      {kStrata, "train", cfg},
      {kStrata, "train", cfg, "--set", "optimizer.params.lr=0.5", "--set", "run.threads=2"}};
  Ranks rs = start_ranks(2, dir_, args, free_port());
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(wait_for(rs.pids[size_t(r)], 60), 2);
    const std::string log = read_bytes(rs.logs[size_t(r)]);
    // run.threads may differ; the learning rate may not.
    EXPECT_NE(log.find("strata: error: optimizer.params.lr: rank 1's config differs from rank 0's"),
              std::string::npos)
        << log;
  }
}

TEST_F(RanksTest, WorldSizeThatDoesNotDivideTheBatchIsRefused) {
  nlohmann::json c = base_config(data_);
  c["train_batch_size"] = 6;  // 2 micro x 2 ranks does not divide it
  const std::string cfg = write_config(dir_, "c.json", c);
  Result r = sh(kStrata + " launch --nproc 2 -- strata train " + cfg);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("train_batch_size: 6 is not divisible by train_micro_batch_size_per_gpu 2 x world_size 2"),
            std::string::npos)
      << r.output;
}

TEST_F(RanksTest, MasterPortInUseIsOneClearLine) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(a);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  const std::string cfg = write_config(dir_, "c.json", base_config(data_));
  Result r = sh(kStrata + " launch --nproc 2 --grace 2 --master-port " + std::to_string(port) +
                " -- strata train " + cfg);
  close(fd);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("[rank 0] strata: error: rank 0 cannot serve the rendezvous store on port " +
                          std::to_string(port) + " (MASTER_PORT)"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("frame #"), std::string::npos) << r.output;
}

TEST_F(RanksTest, TorchrunRunsTwoRanksOfStrata) {
  const std::string torchrun = std::string(STRATA_SOURCE_DIR) + "/.venv/bin/torchrun";
  if (access(torchrun.c_str(), X_OK) != 0) GTEST_SKIP() << "no torchrun in .venv";
  nlohmann::json c = base_config(data_);
  c["run"]["steps"] = 3;
  const std::string cfg = write_config(dir_, "c.json", c);
  Result t = sh("OMP_NUM_THREADS=1 " + torchrun + " --no-python --nproc-per-node 2 --master-port " +
                std::to_string(free_port()) + " " + kStrata + " train " + cfg + " --metrics " + dir_.file("t.jsonl"));
  ASSERT_EQ(t.code, 0) << t.output;
  Result l = sh(kStrata + " launch --nproc 2 -- strata train " + cfg + " --metrics " + dir_.file("l.jsonl"));
  ASSERT_EQ(l.code, 0) << l.output;
  const std::vector<double> a = metric_losses(dir_.file("t.jsonl")), b = metric_losses(dir_.file("l.jsonl"));
  EXPECT_EQ(a.size(), 3u);
  EXPECT_EQ(a, b);
  const nlohmann::json last = nlohmann::json::parse(read_bytes(dir_.file("t.jsonl")).substr(
      read_bytes(dir_.file("t.jsonl")).rfind('{')));
  EXPECT_EQ(last["world_size"], 2);
  EXPECT_GT(int64_t(last["net_bytes"]), 0);
}

// What srun gives each task: Slurm's variables and none of torchrun's. Two
// tasks so started train exactly as `strata launch` does.
TEST_F(RanksTest, SlurmEnvironmentRunsTwoRanksOfStrata) {
  nlohmann::json c = base_config(data_);
  c["run"]["steps"] = 3;
  c["run"]["log_level"] = "info";
  const std::string cfg = write_config(dir_, "c.json", c);
  const std::string port = std::to_string(free_port());
  std::string cmd;
  for (const std::string r : {"0", "1"}) {
    cmd += "env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MASTER_ADDR "
           "-u TORCHELASTIC_USE_AGENT_STORE SLURM_PROCID=" + r + " SLURM_NTASKS=2 SLURM_LOCALID=" + r +
           " SLURM_NTASKS_PER_NODE=2 SLURM_JOB_NODELIST=localhost MASTER_PORT=" + port +
           " OMP_NUM_THREADS=1 " + kStrata + " train " + cfg + " --metrics " + dir_.file("s.jsonl") + " > " +
           dir_.file("slurm" + r + ".log") + " 2>&1 & p" + r + "=$!; ";
  }
  cmd += "wait $p0; a=$?; wait $p1; b=$?; exit $((a | b))";
  Result s = sh(cmd);
  const std::string log0 = read_bytes(dir_.file("slurm0.log")), log1 = read_bytes(dir_.file("slurm1.log"));
  ASSERT_EQ(s.code, 0) << s.output << log0 << log1;
  EXPECT_NE(log0.find("rank 0 of 2 (local 0 of 2) via slurm"), std::string::npos) << log0;
  EXPECT_NE(log1.find("rank 1 of 2 (local 1 of 2) via slurm"), std::string::npos) << log1;
  Result l = sh(kStrata + " launch --nproc 2 -- strata train " + cfg + " --metrics " + dir_.file("l.jsonl"));
  ASSERT_EQ(l.code, 0) << l.output;
  const std::vector<double> a = metric_losses(dir_.file("s.jsonl")), b = metric_losses(dir_.file("l.jsonl"));
  EXPECT_EQ(a.size(), 3u);
  EXPECT_EQ(a, b);
}

// `strata plan --world-size` predicts what each rank sends per step from the
// schedule; the run counts what its collectives sent.
TEST_F(RanksTest, PlanPredictsTheNetworkBytesOfEachStage) {
  nlohmann::json c = base_config(data_);
  c["run"]["steps"] = 2;
  const std::string cfg = write_config(dir_, "c.json", c);
  for (int stage : {0, 1, 2, 3}) {
    const std::string set = " --set zero_optimization.stage=" + std::to_string(stage);
    Result p = sh(kStrata + " plan --json --world-size 3 " + cfg + set);
    ASSERT_EQ(p.code, 0) << p.output;
    const int64_t planned = nlohmann::json::parse(p.output)["network"]["bytes_per_step_per_rank"];
    const std::string m = dir_.file("m" + std::to_string(stage) + ".jsonl");
    Result r = sh(kStrata + " launch --nproc 3 -- strata train " + cfg + set + " --metrics " + m);
    ASSERT_EQ(r.code, 0) << r.output;
    std::ifstream in(m);
    std::string line;
    int steps = 0;
    while (std::getline(in, line)) {
      ++steps;
      EXPECT_EQ(int64_t(nlohmann::json::parse(line)["net_bytes"]), planned) << "stage " << stage;
    }
    EXPECT_EQ(steps, 2);
    EXPECT_GT(planned, 0);
  }
}

// A run killed with SIGKILL leaves its swap directory behind; the next run
// removes it and says so, and leaves alone one whose lock a live run holds.
TEST_F(RanksTest, SwapDirectoryOfAKilledRunIsReclaimed) {
  const std::string swap = dir_.file("swap");
  ASSERT_EQ(mkdir(swap.c_str(), 0700), 0);
  nlohmann::json c = base_config(data_);
  c["zero_optimization"]["offload_optimizer"] = {{"device", "nvme"}, {"nvme_path", swap}};
  c["run"]["steps"] = 100000;
  const std::string cfg = write_config(dir_, "c.json", c);
  Ranks rs = start_ranks(1, dir_, {{kStrata, "train", cfg, "--metrics", dir_.file("m.jsonl")}}, free_port());
  ASSERT_TRUE(wait_for_text(dir_.file("m.jsonl"), "\"step\":2,", 60)) << read_bytes(rs.logs[0]);
  kill(rs.pids[0], SIGKILL);
  wait_for(rs.pids[0], 10);
  const std::string left = sh("ls " + swap).output;
  ASSERT_NE(left.find("strata-swap."), std::string::npos) << "the killed run left nothing to reclaim";
  const std::string killed_dir = swap + "/" + left.substr(0, left.find('\n'));
  // A directory a live run holds (its lock taken by this test process).
  const std::string live = swap + "/strata-swap.live01";
  ASSERT_EQ(mkdir(live.c_str(), 0700), 0);
  const int lock = open((live + "/lock").c_str(), O_CREAT | O_WRONLY, 0600);
  ASSERT_EQ(flock(lock, LOCK_EX), 0);
  c["run"]["steps"] = 1;
  const std::string cfg2 = write_config(dir_, "c2.json", c);
  Result r = sh(kStrata + " train " + cfg2);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("removed " + killed_dir), std::string::npos) << r.output;
  struct stat st;
  EXPECT_NE(stat(killed_dir.c_str(), &st), 0) << killed_dir << " is still there";
  EXPECT_EQ(stat(live.c_str(), &st), 0) << "a live run's swap directory was removed";
  close(lock);
}

}  // namespace
}  // namespace strata
