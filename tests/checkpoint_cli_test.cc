// Checkpoints through `strata train`: a run killed after a checkpoint resumes
// bit for bit (one rank and two), a stop signal saves and exits 0, a save
// killed at any point (a deterministic hook, and SIGKILLs at random times)
// leaves the previous checkpoint loadable and exact, a checkpoint reshards
// to other world sizes and stages, and a resume that changes what it may not
// is one clear line. Every rank runs one thread; one such test at a time.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace strata {
namespace {

using testing::read_bytes;
using testing::Result;
using testing::sh;
using testing::TempDir;

const std::string kStrata = std::string(STRATA_BINARY_DIR) + "/strata";

// step -> loss, from a metrics file.
std::map<int64_t, double> losses(const std::string& path) {
  std::map<int64_t, double> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded()) continue;  // a line cut by a kill
    out[j["step"].get<int64_t>()] = j["loss"].get<double>();
  }
  return out;
}

// Starts `args` in the background with stdout and stderr to `log`.
pid_t spawn(std::vector<std::string> args, const std::string& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

// A model whose blocks do not split evenly into 2, 3 or 4 shards.
nlohmann::json base_config(const std::string& data, const std::string& ck) {
  return {
      {"train_batch_size", 24},
      {"train_micro_batch_size_per_gpu", 2},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 2e-3}}}}},
      {"zero_optimization", {{"stage", 3}}},
      {"model", {{"dim", 48}, {"n_layers", 2}, {"n_heads", 4}, {"seq_len", 16}}},
      {"data", {{"path", data}, {"eval_interval", 0}}},
      {"run", {{"steps", 10}, {"threads", 1}, {"log_level", "warn"}, {"checkpoint", {{"dir", ck}, {"every", 5}}}}},
      {"comm", {{"timeout_s", 20}}},
  };
}

class CheckpointCliTest : public ::testing::Test {
 public:
  void SetUp() override { data_ = dir_.write("data.txt", testing::sample_text(60000)); }
  std::string config(const std::string& name, const nlohmann::json& j) const { return dir_.write(name, j.dump(2)); }
  // `strata train` on `ranks` ranks (strata launch when more than one).
  Result train(int ranks, const std::string& cfg, const std::string& args, const std::string& env = "") const {
    const std::string tail = " train " + cfg + " " + args;
    if (ranks == 1) return sh(env + " " + kStrata + tail);
    return sh(env + " " + kStrata + " launch --nproc " + std::to_string(ranks) + " -- strata" + tail);
  }
  TempDir dir_;
  std::string data_;
};

// 10 steps straight, against 5 steps + checkpoint + the process killed in
// its next save + a resume for the rest: every loss and the saved state bit
// for bit.
void expect_kill_and_resume_exact(CheckpointCliTest& t, const TempDir& dir, const std::string& data, int ranks,
                                  const std::vector<std::string>& sets, const std::string& what) {
  std::string set_args;
  for (const std::string& s : sets) set_args += " --set '" + s + "'";
  const std::string a = dir.file(what + "-a"), b = dir.file(what + "-b");
  const std::string cfg_a = t.config(what + "-a.json", base_config(data, a));
  const std::string cfg_b = t.config(what + "-b.json", base_config(data, b));
  Result straight = t.train(ranks, cfg_a, "--metrics " + a + ".jsonl" + set_args);
  ASSERT_EQ(straight.code, 0) << straight.output;
  // The second save (step 10) is killed at its 2nd write: latest stays at 5.
  Result killed = t.train(ranks, cfg_b, "--metrics " + b + "-1.jsonl" + set_args,
                          "STRATA_CHECKPOINT_KILL_AT=write:2:2");
  EXPECT_NE(killed.code, 0) << killed.output;
  EXPECT_EQ(read_bytes(b + "/latest"), "step-00000005\n") << what;
  Result resumed = t.train(ranks, cfg_b, "--resume --metrics " + b + "-2.jsonl" + set_args);
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  const std::map<int64_t, double> ref = losses(a + ".jsonl"), first = losses(b + "-1.jsonl"),
                                   rest = losses(b + "-2.jsonl");
  ASSERT_EQ(ref.size(), 10u) << what;
  ASSERT_EQ(rest.size(), 5u) << what;
  for (const auto& [step, loss] : rest) EXPECT_EQ(loss, ref.at(step)) << what << ": step " << step;
  for (const auto& [step, loss] : first) EXPECT_EQ(loss, ref.at(step)) << what << ": step " << step;
  // The final checkpoints hold the same bytes (same world size: same files).
  for (int r = 0; r < ranks; ++r) {
    const std::string f = "/step-00000010/rank-0000" + std::to_string(r) + ".bin";
    const std::string x = read_bytes(a + f), y = read_bytes(b + f);
    EXPECT_FALSE(x.empty()) << what << f;
    EXPECT_TRUE(x == y) << what << ": " << f << " differs";
  }
}

TEST_F(CheckpointCliTest, KilledRunResumesBitExactOneRank) {
  expect_kill_and_resume_exact(*this, dir_, data_, 1, {}, "fp32");
  const std::string swap = dir_.file("swap");
  expect_kill_and_resume_exact(
      *this, dir_, data_, 1,
      {"bf16={\"enabled\":true}", "run.optimizer_state_dtype=\"bf16\"",
       "zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"" + swap + "\"}"},
      "bf16-nvme");
}

TEST_F(CheckpointCliTest, KilledRunResumesBitExactTwoRanks) {
  expect_kill_and_resume_exact(
      *this, dir_, data_, 2,
      {"zero_optimization.offload_optimizer={\"device\":\"nvme\",\"nvme_path\":\"" + dir_.file("swap2") + "\"}"},
      "ws2-nvme");
}

// The schedule is not arithmetic (Note [Step schedules] in
// src/memory/schedule.h): 5 steps under one schedule, saved, resumed under
// the other for the rest, give every loss and the final checkpoint's bytes
// of 10 steps straight under the first (12 micro-batches a step).
TEST_F(CheckpointCliTest, ACheckpointResumesUnderTheOtherSchedule) {
  for (const auto& [first, second] : {std::pair<std::string, std::string>{"micro_batch", "layer"}, {"layer", "micro_batch"}}) {
    const std::string what = first + "-then-" + second;
    const std::string a = dir_.file(what + "-a"), b = dir_.file(what + "-b");
    const std::string cfg_a = config(what + "-a.json", base_config(data_, a));
    const std::string cfg_b = config(what + "-b.json", base_config(data_, b));
    Result straight = train(1, cfg_a, "--metrics " + a + ".jsonl --set run.schedule=" + first);
    ASSERT_EQ(straight.code, 0) << straight.output;
    Result part = train(1, cfg_b, "--steps 5 --metrics " + b + "-1.jsonl --set run.schedule=" + first);
    ASSERT_EQ(part.code, 0) << part.output;
    Result resumed = train(1, cfg_b, "--resume --metrics " + b + "-2.jsonl --set run.schedule=" + second);
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    const std::map<int64_t, double> ref = losses(a + ".jsonl"), rest = losses(b + "-2.jsonl");
    ASSERT_EQ(ref.size(), 10u) << what;
    ASSERT_EQ(rest.size(), 5u) << what;
    for (const auto& [step, loss] : rest) EXPECT_EQ(loss, ref.at(step)) << what << ": step " << step;
    const std::string f = "/step-00000010/rank-00000.bin";
    const std::string x = read_bytes(a + f), y = read_bytes(b + f);
    EXPECT_FALSE(x.empty()) << what << f;
    EXPECT_TRUE(x == y) << what << ": " << f << " differs";
  }
}

// fp16 with a dynamic loss scale: the checkpoint at step 5 follows a skipped
// (overflowing) step, so it holds 4 optimizer steps, a doubled-then-halved
// scale (2^20, not the config's initial 2^19) and the counters; the resumed
// run skips the same later steps with the same scales and losses.
// Note [Speculative optimizer]: a run killed while its optimizer speculates
// a step, commits one, or redoes a clipped one resumes from its last
// checkpoint bit for bit: the losses of 10 steps with the inline optimizer
// after a micro_batch step, against the optimizer behind the backward run
// for 5 steps (checkpointed at its end), resumed and killed in step 7's job
// of each kind (STRATA_OPTIMIZER_KILL_AT), and resumed again from step 5;
// the final checkpoints' bytes too; with the optimizer state in RAM and on
// NVMe (alternate swap slots).
TEST_F(CheckpointCliTest, KilledDuringSpeculationResumesBitExact) {
  // The optimizer state on NVMe: speculated into alternate swap slots
  // (Note [Alternate swap slots]), killed while writing the spare slots and
  // while flipping them.
  const std::string nvme = " --set zero_optimization.offload_optimizer='{\"device\":\"nvme\",\"nvme_path\":\"" +
                           dir_.path() + "\"}'";
  for (const auto& [kind, clip, where] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"speculate", "0", ""}, {"commit", "0", ""}, {"full", "0.0001", ""}, {"speculate", "0", nvme},
           {"commit", "0", nvme}}) {
    const std::string what = kind + (where.empty() ? "" : ", optimizer state on NVMe");
    const std::string name = kind + (where.empty() ? "" : "-nvme");
    const std::string a = dir_.file("spec-" + name + "-a"), b = dir_.file("spec-" + name + "-b");
    const std::string cfg_a = config("spec-" + name + "-a.json", base_config(data_, a));
    const std::string cfg_b = config("spec-" + name + "-b.json", base_config(data_, b));
    const std::string clipping = " --set gradient_clipping=" + clip + where;
    Result straight = train(1, cfg_a, "--metrics " + a + ".jsonl" + clipping +
                                          " --set run.schedule='\"micro_batch\"' --set run.overlap_optimizer=false"
                                          " --set optimizer.speculate='\"off\"'");
    ASSERT_EQ(straight.code, 0) << straight.output;
    const std::string spec = clipping + " --set run.schedule='\"layer\"' --set run.overlap_optimizer=true"
                                        " --set optimizer.speculate='\"on\"'";
    Result first =
        train(1, cfg_b, "--steps 5 --metrics " + b + "-1.jsonl" + spec + " --set run.log_level='\"info\"'");
    ASSERT_EQ(first.code, 0) << first.output;
    if (!where.empty()) {
      EXPECT_NE(first.output.find("in alternate swap slots"), std::string::npos) << what << ": " << first.output;
    }
    ASSERT_EQ(read_bytes(b + "/latest"), "step-00000005\n") << what;
    Result killed = train(1, cfg_b, "--resume --metrics " + b + "-2.jsonl" + spec,
                          "STRATA_OPTIMIZER_KILL_AT=" + kind + ":7");
    EXPECT_EQ(killed.code, 128 + SIGKILL) << what << ": " << killed.output;
    EXPECT_EQ(read_bytes(b + "/latest"), "step-00000005\n") << what;
    Result resumed = train(1, cfg_b, "--resume --metrics " + b + "-3.jsonl" + spec);
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    const std::map<int64_t, double> ref = losses(a + ".jsonl"), one = losses(b + "-1.jsonl"),
                                     two = losses(b + "-2.jsonl"), rest = losses(b + "-3.jsonl");
    ASSERT_EQ(ref.size(), 10u) << what;
    ASSERT_EQ(one.size(), 5u) << what;
    ASSERT_EQ(rest.size(), 5u) << what;
    for (const auto* part : {&one, &two, &rest}) {
      for (const auto& [step, loss] : *part) EXPECT_EQ(loss, ref.at(step)) << what << ": step " << step;
    }
    const std::string f = "/step-00000010/rank-00000.bin";
    const std::string x = read_bytes(a + f), y = read_bytes(b + f);
    EXPECT_FALSE(x.empty()) << what << f;
    EXPECT_TRUE(x == y) << what << ": " << f << " differs";
  }
}

TEST_F(CheckpointCliTest, Fp16KilledRunResumesWithItsLossScale) {
  const std::vector<std::string> sets = {
      "fp16={\"enabled\":true,\"initial_scale_power\":19,\"loss_scale_window\":2,\"hysteresis\":1}"};
  expect_kill_and_resume_exact(*this, dir_, data_, 1, sets, "fp16");
  // step -> (loss scale, skipped)
  auto scales = [](const std::string& path) {
    std::map<int64_t, std::pair<double, bool>> out;
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded()) out[j["step"].get<int64_t>()] = {j["loss_scale"].get<double>(), j["skipped"].get<bool>()};
    }
    return out;
  };
  const auto ref = scales(dir_.file("fp16-a.jsonl"));
  const auto rest = scales(dir_.file("fp16-b-2.jsonl"));
  ASSERT_EQ(ref.size(), 10u);
  ASSERT_EQ(rest.size(), 5u);
  // The schedule this test is about: a skip at the saved step and after it.
  ASSERT_TRUE(ref.at(5).second) << "step 5 no longer overflows; retune initial_scale_power";
  int later_skips = 0;
  for (const auto& [step, v] : rest) {
    EXPECT_EQ(v, ref.at(step)) << "step " << step;
    later_skips += v.second;
  }
  EXPECT_GE(later_skips, 1);
  const nlohmann::json m = nlohmann::json::parse(read_bytes(dir_.file("fp16-b") + "/step-00000005/manifest.json"));
  EXPECT_EQ(m["trainer"]["step"], 5);
  EXPECT_EQ(m["trainer"]["optimizer_step"], 4);
  EXPECT_EQ(m["trainer"]["loss_scale"]["scale"].get<double>(), ref.at(6).first);
}

// At two ranks an overflow anywhere skips the step on both: the norm is
// all-reduced, so their scales and skips agree step by step.
TEST_F(CheckpointCliTest, Fp16OverflowSkipsTheStepOnEveryRank) {
  const std::string m = dir_.file("ws2-{rank}.jsonl");
  nlohmann::json c = base_config(data_, "");
  c["run"].erase("checkpoint");
  Result r = train(2, config("ws2.json", c),
                   "--metrics '" + m + "' --set "
                   "'fp16={\"enabled\":true,\"initial_scale_power\":19,\"loss_scale_window\":2,\"hysteresis\":1}'");
  ASSERT_EQ(r.code, 0) << r.output;
  std::vector<nlohmann::json> rank[2];
  for (int k = 0; k < 2; ++k) {
    std::ifstream in(dir_.file("ws2-" + std::to_string(k) + ".jsonl"));
    std::string line;
    while (std::getline(in, line)) rank[k].push_back(nlohmann::json::parse(line));
  }
  ASSERT_EQ(rank[0].size(), 10u);
  ASSERT_EQ(rank[1].size(), 10u);
  int skips = 0;
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_EQ(rank[0][i]["skipped"], rank[1][i]["skipped"]) << "step " << i + 1;
    EXPECT_EQ(rank[0][i]["loss_scale"], rank[1][i]["loss_scale"]) << "step " << i + 1;
    skips += rank[0][i]["skipped"].get<bool>();
  }
  EXPECT_GE(skips, 1);
  EXPECT_LE(skips, 5);
}

// docs/metrics.md: a resume continues the metrics file from its checkpoint.
// The straight run wrote steps 1-10 (checkpoints at 5 and 10) and, as if
// killed mid-write, half a line; resumed from step 5 with the same file, it
// holds steps 1-10 once each, in order, the losses those of the straight run;
// the file as it was is FILE.prev.
TEST_F(CheckpointCliTest, AResumeContinuesTheMetricsFileFromItsCheckpoint) {
  const std::string a = dir_.file("a"), m = a + ".jsonl";
  const std::string cfg = config("a.json", base_config(data_, a));
  Result straight = train(1, cfg, "--metrics " + m);
  ASSERT_EQ(straight.code, 0) << straight.output;
  const std::map<int64_t, double> ref = losses(m);
  ASSERT_EQ(ref.size(), 10u);
  {
    std::ofstream cut(m, std::ios::app);
    cut << "{\"step\":11,\"lo";
  }
  Result resumed = train(1, cfg, "--resume " + a + "/step-00000005 --metrics " + m + " --set run.log_level=\"info\"");
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("metrics: 6 line(s) after step 5 dropped"), std::string::npos) << resumed.output;
  std::ifstream in(m);
  std::string line;
  int64_t expect = 1;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);  // every line whole
    EXPECT_EQ(j["step"].get<int64_t>(), expect) << line;
    EXPECT_EQ(j["loss"].get<double>(), ref.at(expect)) << "step " << expect;
    ++expect;
  }
  EXPECT_EQ(expect, 11);
  // The file as it was, kept beside it.
  const std::string prev = read_bytes(m + ".prev");
  EXPECT_EQ(losses(m + ".prev").size(), 10u);
  EXPECT_NE(prev.find("{\"step\":11,\"lo"), std::string::npos);
}

// A save killed at each kind of event (the k-th data write, fsync, rename,
// latest update): the previous checkpoint loads and resumes bit for bit.
TEST_F(CheckpointCliTest, SaveKilledAtAnyEventLeavesThePreviousCheckpointExact) {
  const std::string a = dir_.file("a");
  Result straight = train(1, config("a.json", base_config(data_, a)), "--metrics " + a + ".jsonl");
  ASSERT_EQ(straight.code, 0) << straight.output;
  const std::map<int64_t, double> ref = losses(a + ".jsonl");
  int n = 0;
  for (const std::string event : {"write:1", "write:4", "fsync:1", "fsync:3", "fsync:5", "rename:1", "latest:1"}) {
    const std::string b = dir_.file("b" + std::to_string(++n));
    const std::string cfg = config("b" + std::to_string(n) + ".json", base_config(data_, b));
    Result killed = train(1, cfg, "", "STRATA_CHECKPOINT_KILL_AT=" + event + ":2");
    EXPECT_EQ(killed.code, 128 + SIGKILL) << event << ": " << killed.output;
    EXPECT_EQ(read_bytes(b + "/latest"), "step-00000005\n") << event;
    Result resumed = train(1, cfg, "--resume --metrics " + b + ".jsonl");
    ASSERT_EQ(resumed.code, 0) << event << ": " << resumed.output;
    const std::map<int64_t, double> rest = losses(b + ".jsonl");
    ASSERT_EQ(rest.size(), 5u) << event;
    for (const auto& [step, loss] : rest) EXPECT_EQ(loss, ref.at(step)) << event << ": step " << step;
    EXPECT_EQ(read_bytes(b + "/latest"), "step-00000010\n") << event;
  }
}

// SIGKILLs at random times while a run saves after every step: whatever
// latest names loads, and the run it resumes matches the straight run.
TEST_F(CheckpointCliTest, RandomKillsDuringSavesNeverLoseTheLatestCheckpoint) {
  nlohmann::json c = base_config(data_, dir_.file("ref"));
  c["run"]["steps"] = 200;
  c["run"]["checkpoint"]["every"] = 50;
  const std::string ref_metrics = dir_.file("ref.jsonl");
  Result straight = train(1, config("ref.json", c), "--metrics " + ref_metrics);
  ASSERT_EQ(straight.code, 0) << straight.output;
  const std::map<int64_t, double> ref = losses(ref_metrics);
  const std::string ck = dir_.file("ck");
  c["run"]["checkpoint"] = {{"dir", ck}, {"every", 1}, {"keep", 2}};
  const std::string cfg = config("c.json", c);
  std::mt19937 rng(7);
  int kills = 0, resumed_steps = 0;
  for (int i = 0; i < 22 && kills < 20; ++i) {
    const std::string m = dir_.file("m" + std::to_string(i) + ".jsonl");
    const bool resume = access((ck + "/latest").c_str(), F_OK) == 0;
    std::vector<std::string> args = {kStrata, "train", cfg, "--metrics", m};
    if (resume) args.push_back("--resume");
    const pid_t pid = spawn(args, dir_.file("log" + std::to_string(i)));
    // Kill it somewhere in a step and its save, at any machine's speed: wait for
    // two saves this run commits (latest changes twice) and draw the kill from
    // the time between them. (A fixed window after the first metrics line
    // missed every save in a slower build: nothing was ever resumed.)
    const auto t0 = std::chrono::steady_clock::now();
    std::string seen = read_bytes(ck + "/latest");
    std::vector<std::chrono::steady_clock::time_point> commits;
    int st = 0;
    bool exited = false;
    while (commits.size() < 2 && !exited) {
      exited = waitpid(pid, &st, WNOHANG) == pid;
      ASSERT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 120.0)
          << read_bytes(dir_.file("log" + std::to_string(i)));
      const std::string now = read_bytes(ck + "/latest");
      if (!now.empty() && now != seen) {
        seen = now;
        commits.push_back(std::chrono::steady_clock::now());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!exited) {
      const double period = std::chrono::duration<double>(commits[1] - commits[0]).count();
      std::this_thread::sleep_for(
          std::chrono::duration<double>(std::uniform_real_distribution<double>(0.0, period)(rng)));
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      ++kills;
    }
    // Every step this run reported equals the straight run's.
    for (const auto& [step, loss] : losses(m)) {
      EXPECT_EQ(loss, ref.at(step)) << "run " << i << " step " << step << "\n" << read_bytes(dir_.file("log" + std::to_string(i)));
      resumed_steps += resume;
    }
    if (exited) break;
  }
  EXPECT_GE(kills, 20);
  EXPECT_GT(resumed_steps, 0);
  // The last latest resumes too.
  Result last = train(1, cfg, "--resume --steps 200 --metrics " + dir_.file("last.jsonl"));
  ASSERT_EQ(last.code, 0) << last.output;
  for (const auto& [step, loss] : losses(dir_.file("last.jsonl"))) EXPECT_EQ(loss, ref.at(step)) << "step " << step;
}

// SIGTERM (through strata launch, to both ranks): every rank stops after the
// same step, a checkpoint of it is saved, the exit status is 0; the resume
// continues exactly.
TEST_F(CheckpointCliTest, StopSignalSavesAndExitsZero) {
  const std::string a = dir_.file("a"), b = dir_.file("b");
  nlohmann::json c = base_config(data_, a);
  c["run"]["steps"] = 30;
  c["run"]["checkpoint"]["every"] = 0;
  Result straight = train(2, config("a.json", c), "--metrics " + a + ".jsonl");
  ASSERT_EQ(straight.code, 0) << straight.output;
  const std::map<int64_t, double> ref = losses(a + ".jsonl");
  c["run"]["checkpoint"]["dir"] = b;
  const std::string cfg = config("b.json", c);
  const std::string log = dir_.file("launch.log");
  const pid_t pid =
      spawn({kStrata, "launch", "--nproc", "2", "--", "strata", "train", cfg, "--metrics", b + "-1.jsonl"}, log);
  const auto t0 = std::chrono::steady_clock::now();
  while (read_bytes(b + "-1.jsonl").find("\"step\":3,") == std::string::npos) {
    ASSERT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 60.0) << read_bytes(log);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(pid, SIGTERM);
  int st = 0;
  waitpid(pid, &st, 0);
  ASSERT_TRUE(WIFEXITED(st)) << read_bytes(log);
  EXPECT_EQ(WEXITSTATUS(st), 0) << read_bytes(log);
  const std::map<int64_t, double> first = losses(b + "-1.jsonl");
  ASSERT_FALSE(first.empty());
  const int64_t stopped = first.rbegin()->first;
  EXPECT_LT(stopped, 30);
  char name[32];
  std::snprintf(name, sizeof(name), "step-%08lld\n", (long long)stopped);
  EXPECT_EQ(read_bytes(b + "/latest"), name) << read_bytes(log);
  Result resumed = train(2, cfg, "--resume --metrics " + b + "-2.jsonl");
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  const std::map<int64_t, double> rest = losses(b + "-2.jsonl");
  EXPECT_EQ(int64_t(rest.size()), 30 - stopped);
  EXPECT_EQ(rest.begin()->first, stopped + 1);
  for (const auto& [step, loss] : rest) EXPECT_EQ(loss, ref.at(step)) << "step " << step;
}

// Saved at world size W, loaded at W' and another stage: the losses go on as
// the run that was never resharded, within rounding.
TEST_F(CheckpointCliTest, CheckpointsReshardToOtherWorldSizesAndStages) {
  const std::string a = dir_.file("a");
  nlohmann::json c = base_config(data_, a);
  c["run"]["steps"] = 8;
  c["run"]["checkpoint"]["every"] = 4;
  Result straight = train(1, config("a.json", c), "--metrics " + a + ".jsonl");
  ASSERT_EQ(straight.code, 0) << straight.output;
  const std::map<int64_t, double> ref = losses(a + ".jsonl");
  struct Case { int from, to, stage_to; };
  int n = 0;
  for (const Case k : {Case{2, 3, 3}, Case{3, 4, 1}, Case{4, 1, 3}, Case{1, 2, 2}}) {
    const std::string b = dir_.file("b" + std::to_string(++n));
    nlohmann::json cb = base_config(data_, b);
    cb["run"]["steps"] = 4;
    const std::string cfg = config("b" + std::to_string(n) + ".json", cb);
    Result saved = train(k.from, cfg, "");
    ASSERT_EQ(saved.code, 0) << saved.output;
    Result resumed = train(k.to, cfg, "--resume --steps 8 --set zero_optimization.stage=" + std::to_string(k.stage_to) +
                                          " --metrics " + b + ".jsonl");
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    const std::map<int64_t, double> rest = losses(b + ".jsonl");
    ASSERT_EQ(rest.size(), 4u) << k.from << " -> " << k.to;
    for (const auto& [step, loss] : rest) {
      EXPECT_LE(std::abs(loss - ref.at(step)), 1e-5 * std::abs(ref.at(step)))
          << k.from << " ranks -> " << k.to << " ranks, stage " << k.stage_to << ": step " << step << " loss " << loss
          << " vs " << ref.at(step);
    }
  }
}

// What a resume may not change is one line naming the key; a damaged
// checkpoint is one line naming the file; neither starts the run.
TEST_F(CheckpointCliTest, ResumeRefusesChangedInvariantsAndDamageInOneLine) {
  const std::string b = dir_.file("b");
  nlohmann::json c = base_config(data_, b);
  c["run"]["steps"] = 2;
  const std::string cfg = config("c.json", c);
  ASSERT_EQ(train(1, cfg, "").code, 0);
  const std::string m = dir_.file("m.jsonl");
  struct Case { std::string set, expect; };
  for (const Case& k : {Case{"optimizer.params.lr=0.5", "strata: error: optimizer.params.lr: the checkpoint " + b +
                                                            "/step-00000002 was saved with 0.002, this run has 0.5"},
                        Case{"model.dim=64", "strata: error: model.dim: the checkpoint"},
                        Case{"run.seed=5", "strata: error: run.seed: the checkpoint"},
                        Case{"train_batch_size=48", "strata: error: train_batch_size: the checkpoint"}}) {
    Result r = train(1, cfg, "--resume --steps 4 --metrics " + m + " --set " + k.set);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(k.expect), std::string::npos) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
    EXPECT_NE(access(m.c_str(), F_OK), 0) << "a metrics file was started";
  }
  // What may change: world size, stage, placement, paths, steps.
  Result ok = train(2, cfg, "--resume --steps 3 --set zero_optimization.stage=1 --set run.threads=1");
  EXPECT_EQ(ok.code, 0) << ok.output;
  // Damage: a flipped byte in the newest checkpoint's data.
  const std::string bin = b + "/step-00000003/rank-00000.bin";
  {
    std::fstream f(bin, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x7f');
  }
  Result bad = train(2, cfg, "--resume --steps 5 --metrics " + m);
  EXPECT_NE(bad.code, 0) << bad.output;
  EXPECT_NE(bad.output.find("strata: error: " + bin + ": checksum mismatch"), std::string::npos) << bad.output;
  EXPECT_NE(access(m.c_str(), F_OK), 0) << "a metrics file was started";
  Result none = train(1, cfg, "--resume " + dir_.file("nothing-here"));
  EXPECT_EQ(none.code, 2) << none.output;
  EXPECT_NE(none.output.find("no such checkpoint directory"), std::string::npos) << none.output;
}

}  // namespace
}  // namespace strata
