// The rank environment of each launcher, the Slurm host list, the byte
// counts of ring collectives, the local communicator, the NCCL backend on one
// GPU (skipped, with the reason, without one), and the config comparison of
// ranks. Multi-process behaviour: ranks_test.cc.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "config/config.h"
#include "memory/device.h"
#include "test_util.h"
#include "util/errors.h"

namespace strata {
namespace {

// Sets the given variables (and clears every other launcher variable) for
// the scope of one test.
class Env {
 public:
  explicit Env(const std::vector<std::pair<std::string, std::string>>& vars) {
    clear();
    for (const auto& [k, v] : vars) setenv(k.c_str(), v.c_str(), 1);
  }
  ~Env() { clear(); }

 private:
  static void clear() {
    for (const char* k : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                          "TORCHELASTIC_USE_AGENT_STORE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                          "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_JOB_NODELIST"}) {
      unsetenv(k);
    }
  }
};

TEST(RankInfoTest, NoLauncherIsOneRank) {
  Env e({});
  const RankInfo r = rank_info_from_environment();
  EXPECT_EQ(r.world_size, 1);
  EXPECT_EQ(r.rank, 0);
  EXPECT_EQ(r.source, "none");
}

TEST(RankInfoTest, TorchrunVariables) {
  Env e({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
         {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29400"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  const RankInfo r = rank_info_from_environment();
  EXPECT_EQ(r.rank, 5);
  EXPECT_EQ(r.world_size, 8);
  EXPECT_EQ(r.local_rank, 1);
  EXPECT_EQ(r.local_world_size, 4);
  EXPECT_EQ(r.master_addr, "node0");
  EXPECT_EQ(r.master_port, 29400);
  EXPECT_TRUE(r.agent_store);
  EXPECT_EQ(r.source, "env");
}

TEST(RankInfoTest, SlurmVariablesWhenTheStandardOnesAreAbsent) {
  Env e({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"}, {"SLURM_TASKS_PER_NODE", "2(x2)"},
         {"SLURM_JOB_NODELIST", "gpu[007-008],cpu1"}});
  const RankInfo r = rank_info_from_environment();
  EXPECT_EQ(r.rank, 3);
  EXPECT_EQ(r.world_size, 4);
  EXPECT_EQ(r.local_rank, 1);
  EXPECT_EQ(r.local_world_size, 2);
  EXPECT_EQ(r.master_addr, "gpu007");
  EXPECT_EQ(r.master_port, 29500);
  EXPECT_EQ(r.source, "slurm");
}

TEST(RankInfoTest, BadValuesNameTheVariable) {
  {
    Env e({{"RANK", "two"}, {"WORLD_SIZE", "4"}});
    try {
      rank_info_from_environment();
      FAIL() << "no error";
    } catch (const ConfigError& x) {
      EXPECT_EQ(x.key(), "RANK");
    }
  }
  {
    Env e({{"RANK", "4"}, {"WORLD_SIZE", "4"}});
    EXPECT_THROW(rank_info_from_environment(), ConfigError);
  }
}

TEST(SlurmHostTest, FirstHostOfANodeList) {
  EXPECT_EQ(first_slurm_host("node1"), "node1");
  EXPECT_EQ(first_slurm_host("node1,node2"), "node1");
  EXPECT_EQ(first_slurm_host("node[003-005,7],gpu1"), "node003");
  EXPECT_EQ(first_slurm_host("rack[2,4]-n[01-02]"), "rack2-n01");
}

TEST(RingBytesTest, WhatOneRankSends) {
  EXPECT_EQ(ring_gather_bytes(1, 1000, DType::kF32), 0);
  EXPECT_EQ(ring_gather_bytes(4, 1000, DType::kF32), 3 * 1000 * 4);
  EXPECT_EQ(ring_gather_bytes(3, 1000, DType::kBF16), 2 * 1000 * 2);
  EXPECT_EQ(ring_all_reduce_bytes(4, 1000, DType::kF32), 2 * 3 * 1000 * 4 / 4);
  EXPECT_EQ(ring_all_reduce_bytes(1, 1000, DType::kF32), 0);
}

TEST(LocalCommunicatorTest, CopiesAndNoOps) {
  std::unique_ptr<Communicator> c = make_local_communicator();
  EXPECT_EQ(c->world_size(), 1);
  std::vector<float> in{1, 2, 3}, out(3, 0.0f);
  Completion done = c->all_gather(in.data(), out.data(), 3, DType::kF32);
  done.wait();
  EXPECT_EQ(out, in);
  std::vector<float> rs(3, 0.0f);
  c->reduce_scatter(in.data(), rs.data(), 3, DType::kF32).wait();
  EXPECT_EQ(rs, in);
  double x[2] = {1.5, 2.5};
  c->all_reduce(x, 2, DType::kF64, ReduceOp::kSum).wait();
  EXPECT_EQ(x[1], 2.5);
  c->store_set("k", "v");
  EXPECT_EQ(c->store_get("k"), "v");
  EXPECT_EQ(c->bytes_sent(), 0);
}

// The NCCL data group at world size 1, on device memory (Note [Data group]):
// each collective lands what it should once the device's comm stream, which
// its completion orders, is synchronized; the host group stays Gloo.
TEST(NcclTest, CollectivesOnGpuMemoryAtWorldSizeOne) {
  if (!built_with_cuda()) GTEST_SKIP() << "this build has no CUDA path";
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  std::unique_ptr<Device> dev = make_device("cuda:0");
  RankInfo who;
  who.master_port = testing::free_port();
  CommOptions o;
  o.backend = "nccl";
  o.timeout_s = 60;
  o.process_group_at_one = true;
  std::unique_ptr<Communicator> c = make_communicator(who, o);
  DataGroupOptions d;
  d.backend = "nccl";
  d.stream = dev->native_stream(Stream::kComm);
  d.device_index = 0;
  CollectiveGroup* g = c->open_data_group(d);
  EXPECT_STREQ(g->backend(), "nccl");
  EXPECT_STREQ(c->backend(), "nccl");
  EXPECT_TRUE(g->orders_streams());
  const int64_t n = 1 << 20;
  std::vector<float> in(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) in[size_t(i)] = float(i % 1000) * 0.5f - 7.0f;
  DeviceBuffer a = dev->allocate(n * 4, "nccl in"), b = dev->allocate(n * 4, "nccl out");
  auto check = [&](const char* what) {
    dev->synchronize(Stream::kComm);  // the completion ordered this stream, not the host
    std::vector<float> out(static_cast<size_t>(n), 0.0f);
    dev->copy_to_host(out.data(), b.ptr(), n * 4, Stream::kD2H);
    dev->synchronize(Stream::kD2H);
    EXPECT_EQ(out, in) << what;
  };
  dev->copy_to_device(a.ptr(), in.data(), n * 4, Stream::kH2D);
  dev->synchronize(Stream::kH2D);
  dev->fill_on_device(b.ptr(), 0xFF, n * 4, Stream::kH2D);
  dev->synchronize(Stream::kH2D);
  g->all_gather(a.ptr().raw(), b.ptr().raw(), n, DType::kF32).wait();
  check("all_gather");
  dev->fill_on_device(b.ptr(), 0xFF, n * 4, Stream::kH2D);
  dev->synchronize(Stream::kH2D);
  g->reduce_scatter(a.ptr().raw(), b.ptr().raw(), n, DType::kF32).wait();
  check("reduce_scatter");
  dev->copy_on_device(b.ptr(), a.ptr(), n * 4, Stream::kH2D);
  dev->synchronize(Stream::kH2D);
  g->all_reduce(b.ptr().raw(), n, DType::kF32, ReduceOp::kSum).wait();
  check("all_reduce");
  // Host values still go over the host group, on host memory.
  double x[2] = {1.5, 2.5};
  c->all_reduce(x, 2, DType::kF64, ReduceOp::kSum).wait();
  EXPECT_EQ(x[1], 2.5);
}

TEST(ConfigAgreementTest, PerRankKeysMayDifferOthersAreNamed) {
  const nlohmann::json base = {{"model", {{"dim", 64}}},
                               {"data", {{"path", "d.txt"}}},
                               {"run", {{"threads", 1}, {"metrics", "a.jsonl"}}}};
  nlohmann::json other = base;
  other["run"]["threads"] = 2;
  other["run"]["metrics"] = "b.jsonl";
  other["zero_optimization"]["offload_optimizer"]["nvme_path"] = "/mnt/b";
  const Config a = parse_config(base), b = parse_config(other);
  EXPECT_EQ(first_difference(rank_invariant_config(a), rank_invariant_config(b)), "");
  other["model"]["dim"] = 128;
  const Config c = parse_config(other);
  EXPECT_EQ(first_difference(rank_invariant_config(a), rank_invariant_config(c)), "model.dim");
  nlohmann::json extra = base;
  extra["gradient_clipping"] = 0.5;
  EXPECT_EQ(first_difference(rank_invariant_config(a), rank_invariant_config(parse_config(extra))),
            "gradient_clipping");
}

}  // namespace
}  // namespace strata
