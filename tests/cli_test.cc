// Tests of the strata executable as a user runs it: exit codes, one-line
// errors, and no metrics file left behind by a run that fails at start-up.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "memory/device.h"
#include "test_util.h"

namespace strata {
namespace {

using testing::TempDir;

using testing::Result;

Result run_strata(const std::string& args) {
  return testing::sh(std::string(STRATA_BINARY_DIR) + "/strata " + args);
}

bool exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

int count_lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

// Lines of the log's format ("[hh:mm:ss.mmm] [level] ...").
int count_log_lines(const std::string& s) {
  int n = 0;
  for (size_t at = 0; at < s.size();) {
    const size_t end = s.find('\n', at);
    if (s.compare(at, 1, "[") == 0 && s.find("] [", at) < end) ++n;
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return n;
}

nlohmann::json tiny_config(const std::string& data, const std::string& metrics) {
  return {
      {"train_micro_batch_size_per_gpu", 2},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
      {"model", {{"dim", 32}, {"n_layers", 1}, {"n_heads", 2}, {"seq_len", 16}}},
      {"data", {{"path", data}, {"val_fraction", 0.2}, {"eval_interval", 2}, {"eval_batches", 1}}},
      {"run", {{"steps", 3}, {"metrics", metrics}, {"log_level", "warn"}}},
  };
}

std::string write_config(const TempDir& dir, const nlohmann::json& j) {
  return dir.write("config.json", j.dump(2));
}

// DeepSpeed's monitors (docs/monitors.md): a config's tensorboard and
// csv_monitor blocks write TensorBoard event files and per-tag CSV files under
// output_path/job_name/, read back by TensorBoard's own reader and checked
// point by point against the metrics JSON lines (tests/monitors_check.py):
// DeepSpeed's tags at its x values (global samples), fp16's loss scale, the
// eval loss and Strata's figures. A monitor directory that cannot be made
// exits non-zero naming it, before any metrics file exists.
TEST(CliTest, DeepSpeedMonitorsWriteTensorBoardAndCsvFiles) {
  const std::string python = std::string(STRATA_SOURCE_DIR) + "/.venv/bin/python";
  if (testing::sh(python + " -c 'import tensorboard'").code != 0) {
    if (testing::under_ci()) FAIL() << "no tensorboard in .venv under CI";
    GTEST_SKIP() << "no tensorboard in .venv (tools/setup.sh installs it)";
  }
  TempDir dir;
  const std::string data = dir.write("data.txt", testing::sample_text(20000));
  nlohmann::json j = tiny_config(data, dir.file("m.jsonl"));
  j["run"]["steps"] = 4;
  j["fp16"] = {{"enabled", true}, {"initial_scale_power", 8}};
  j["tensorboard"] = {{"enabled", true}, {"output_path", dir.file("tb")}, {"job_name", "run1"}};
  j["csv_monitor"] = {{"enabled", true}, {"output_path", dir.file("csv") + "/"}, {"job_name", "run1"}};
  Result r = run_strata("train " + write_config(dir, j));
  ASSERT_EQ(r.code, 0) << r.output;
  Result check = testing::sh(python + " " + STRATA_SOURCE_DIR + "/tests/monitors_check.py " + dir.file("m.jsonl") +
                             " " + dir.file("tb/run1") + " " + dir.file("csv/run1") + " 2");
  EXPECT_EQ(check.code, 0) << check.output;
  EXPECT_TRUE(exists(dir.file("csv/run1/Train_Samples_loss_scale.csv"))) << "fp16's loss scale";
  EXPECT_TRUE(exists(dir.file("csv/run1/Train_Samples_eval_loss.csv")));
  // run.deterministic is named in the start line (docs/config.md).
  nlohmann::json d = tiny_config(data, dir.file("det.jsonl"));
  d["run"]["deterministic"] = true;
  d["run"]["log_level"] = "info";
  r = run_strata("train " + write_config(dir, d));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("run.deterministic: deterministic algorithms on (an op without one is an error), "
                          "CUBLAS_WORKSPACE_CONFIG=:4096:8"),
            std::string::npos)
      << r.output;
  // wandb and comet stay warnings that say what to use instead.
  j["wandb"] = {{"enabled", true}};
  j["run"]["log_level"] = "warn";
  j["run"]["metrics"] = dir.file("m2.jsonl");
  j["tensorboard"]["output_path"] = data + "/under-a-file";
  r = run_strata("train " + write_config(dir, j));
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("wandb"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\"tensorboard\" or \"csv_monitor\""), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(data + "/under-a-file"), std::string::npos) << r.output;
  EXPECT_FALSE(exists(dir.file("m2.jsonl"))) << "a metrics file from a run that failed to start";
}

// Every `strata plan` command README.md and docs/ show runs as written on
// this machine, which has no GPU (docs/planning.md): the commands are taken
// from the Markdown (code spans and fenced lines, continuation lines
// joined) wherever their config is a file of the repository (README's
// placeholders, CONFIG and job.json, and the fine-tune walk-through's
// finetune.json, which tokenize_test runs, are not), and run from the
// repository's root.
TEST(CliTest, PlanCommandsInTheDocsRunAsWritten) {
  const std::string root = STRATA_SOURCE_DIR;
  std::vector<std::string> docs = {root + "/README.md"};
  for (const char* d : {"config.md", "design.md", "planning.md", "monitors.md", "checkpoint.md", "nvme-format.md"}) {
    docs.push_back(root + "/docs/" + d);
  }
  std::vector<std::pair<std::string, std::string>> commands;  // (file, command)
  for (const std::string& path : docs) {
    std::ifstream in(path);
    ASSERT_TRUE(in.good()) << path;
    std::stringstream text;
    text << in.rdbuf();
    const std::string md = text.str();
    std::vector<std::string> found;
    // Code spans (which may span lines) and fenced lines (with "\" continuations).
    const std::regex span("`((?:build/)?strata plan [^`]+)`");
    for (auto it = std::sregex_iterator(md.begin(), md.end(), span); it != std::sregex_iterator(); ++it) {
      found.push_back((*it)[1]);
    }
    std::istringstream lines(md);
    std::string line;
    bool fenced = false;
    while (std::getline(lines, line)) {
      if (line.rfind("```", 0) == 0) {
        fenced = !fenced;
        continue;
      }
      if (!fenced || line.rfind("build/strata plan ", 0) != 0) continue;
      std::string cmd = line;
      while (!cmd.empty() && cmd.back() == '\\' && std::getline(lines, line)) cmd = cmd.substr(0, cmd.size() - 1) + line;
      found.push_back(cmd);
    }
    for (std::string cmd : found) {
      std::replace(cmd.begin(), cmd.end(), '\n', ' ');
      std::istringstream words(cmd);
      std::string strata, plan, config;
      words >> strata >> plan >> config;
      if (!exists(root + "/" + config)) continue;
      commands.emplace_back(path, cmd);
    }
  }
  ASSERT_GE(commands.size(), 3u) << "the docs' plan commands were not found";
  for (const auto& [file, cmd] : commands) {
    const std::string args = cmd.substr(cmd.find("plan "));
    Result r = testing::sh("cd " + root + " && " + std::string(STRATA_BINARY_DIR) + "/strata " + args);
    EXPECT_EQ(r.code, 0) << file << ": " << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find("verdict:"), std::string::npos) << file << ": " << cmd << "\n" << r.output;
  }
}

// strata plan --gpu NAME (docs/planning.md): the GPU's memory and rates
// from its preset, each named as the source; the host's RAM and disk
// this machine's unless given, and the output says which; an unknown
// name is one line listing the presets.
TEST(CliTest, PlanForAGpuThisMachineLacks) {
  TempDir dir;
  const std::string data = dir.write("data.txt", testing::sample_text(5000));
  nlohmann::json j = tiny_config(data, dir.file("m.jsonl"));
  j["bf16"] = {{"enabled", true}};
  const std::string cfg = write_config(dir, j);
  Result r = run_strata("plan --json --gpu a100-40g --probe-seconds 0.05 " + cfg);
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json p = nlohmann::json::parse(r.output);
  // The datasheet's 40960 MiB less the CUDA context's 512 (docs/planning.md).
  EXPECT_EQ(p["capacity_bytes"]["device"], int64_t(40960 - 512) << 20);
  EXPECT_EQ(p["device_memory_source"], "--gpu a100-40g preset (40960 MiB, less 512 MiB for the CUDA context)");
  EXPECT_EQ(p["host_memory_source"], "this machine's available RAM");
  const nlohmann::json& rates = p["bound"]["rates"];
  EXPECT_DOUBLE_EQ(rates["device_flops"].get<double>(), 312e12 * 0.55);
  EXPECT_NE(std::string(rates["device_flops_source"]).find("--gpu a100-40g preset"), std::string::npos) << rates;
  EXPECT_DOUBLE_EQ(rates["h2d_bytes_per_s"].get<double>(), 27.5e9);
  EXPECT_NE(std::string(rates["h2d_source"]).find("PCIe 4.0 x16"), std::string::npos) << rates;
  // A flag overrides the preset's figure; the host described by flags says so.
  r = run_strata("plan --gpu a100-40g --device-tflops 100 --host-memory-gb 64 --probe-seconds 0.05 " + cfg);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("device: --device-tflops"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(host memory: --host-memory-gb"), std::string::npos) << r.output;
  r = run_strata("plan --no-bound " + cfg);
  EXPECT_NE(r.output.find("(host memory: this machine's available RAM"), std::string::npos) << r.output;
  r = run_strata("plan --gpu b200 " + cfg);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
  EXPECT_NE(r.output.find("--gpu: no preset named 'b200'; presets: h100-sxm, h100-pcie, h200"), std::string::npos)
      << r.output;
}

// optimizer.speculate auto with the optimizer state on NVMe (Note
// [Speculating NVMe state] in plan/planner.h): `strata plan` decides again
// once it has the rates, as strata train does. A disk that bounds the step:
// no alternate slots (off, both bounds named, no spare disk in the total).
// CPU Adam as long as the compute beside a fast disk: the slots kept. Without
// rates: the slots, as before.
TEST(CliTest, PlanSpeculatesNvmeStateOnlyWhereTheBoundGains) {
  TempDir dir;
  const std::string data = dir.write("data.txt", testing::sample_text(5000));
  nlohmann::json j = tiny_config(data, dir.file("m.jsonl"));
  j["bf16"] = {{"enabled", true}};
  j["train_micro_batch_size_per_gpu"] = 16;
  j["gradient_accumulation_steps"] = 2;
  j["model"] = {{"dim", 128}, {"n_layers", 4}, {"n_heads", 4}, {"n_kv_heads", 2}, {"seq_len", 128}};
  j["run"]["device"] = "cuda";
  j["run"]["schedule"] = "layer";
  j["placement"] = {{"param16", {{"device", 1}}}, {"grad", {{"device", 1}}}, {"optimizer", {{"nvme", 1}}},
                    {"nvme_path", dir.file("swap")}};
  const std::string cfg = write_config(dir, j);
  const std::string rates = " --gpu h100-sxm --device-tflops 0.5 --checksum-gbps 100 --grad-add-gelems 10 ";
  Result r = run_strata("plan --json" + rates + "--nvme-gbps 0.001 --adam-gelems 1 " + cfg);
  ASSERT_EQ(r.code, 0) << r.output;
  nlohmann::json p = nlohmann::json::parse(r.output);
  EXPECT_EQ(p["speculate"]["on"], false) << p["speculate"];
  EXPECT_EQ(p["speculate"]["spare_nvme_bytes"], 0);
  EXPECT_NE(std::string(p["speculate"]["choice"]).find("not 10% lower"), std::string::npos) << p["speculate"];
  EXPECT_EQ(p["total_bytes"]["nvme"], p["state_total_bytes"]["nvme"]);
  r = run_strata("plan --json" + rates + "--nvme-gbps 100 --adam-gelems 0.02 " + cfg);
  ASSERT_EQ(r.code, 0) << r.output;
  p = nlohmann::json::parse(r.output);
  EXPECT_EQ(p["speculate"]["mechanism"], "alternate_slots") << p["speculate"];
  EXPECT_EQ(int64_t(p["speculate"]["spare_nvme_bytes"]), 12 * int64_t(p["speculate"]["elements"]));
  EXPECT_NE(std::string(p["speculate"]["choice"]).find("the bound:"), std::string::npos) << p["speculate"];
  r = run_strata("plan --json --no-bound --gpu h100-sxm " + cfg);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output)["speculate"]["mechanism"], "alternate_slots") << r.output;
}

// Regular files under `dir`, recursively (what a run left behind).
std::vector<std::string> files_under(const std::string& dir) {
  Result r = testing::sh("find " + dir + " -type f");
  std::vector<std::string> out;
  std::istringstream in(r.output);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(line);
  }
  return out;
}

// A small file system (a tmpfs of `mib` MiB at `dir`, mounted for the
// test's life): a test that cannot mount one is skipped.
struct SmallDisk {
  std::string dir;
  bool mounted = false;
  SmallDisk(const std::string& d, int mib) : dir(d) {
    ::mkdir(d.c_str(), 0700);
    mounted = testing::sh("mount -t tmpfs -o size=" + std::to_string(mib) + "m tmpfs " + d).code == 0;
  }
  ~SmallDisk() {
    if (mounted) (void)testing::sh("umount " + dir);
  }
};

// A DeepSpeed user's small disk (issue: a DeepSpeed user's day): with the
// swap directory on a 24 MiB file system `strata plan` gives the plan's
// verdict ("nvme: short by") and probes nothing, `strata train` stops with
// the same verdict; on 80 MiB, room for the state (57 MiB) but not for the
// NVMe probe's two 476 MiB files, the probe measures over what fits and says
// so; a run.checkpoint.dir with room for less than its checkpoints is one
// line naming the key and both sizes, before any metrics file; and no probe
// or bench file outlives any of them, SIGKILL included.
TEST(CliTest, SmallDisksGetThePlansVerdictAndKeepNoFiles) {
  TempDir tmp;
  const std::string cfg = std::string(STRATA_SOURCE_DIR) + "/configs/cpu-nvme-offload.json";
  auto swap_on = [](const std::string& d) {
    return " --set zero_optimization.offload_param.nvme_path=" + d + "/swap" +
           " --set zero_optimization.offload_optimizer.nvme_path=" + d + "/swap";
  };
  {
    SmallDisk disk(tmp.file("d24"), 24);
    if (!disk.mounted) GTEST_SKIP() << "cannot mount a tmpfs here (not root)";
    Result r = run_strata("plan " + cfg + swap_on(disk.dir));
    EXPECT_NE(r.output.find("nvme: short by"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("step bound: not computed (the plan does not fit; nothing was probed)"),
              std::string::npos)
        << r.output;
    EXPECT_EQ(r.output.find("preallocate"), std::string::npos) << r.output;
    r = run_strata("train " + cfg + " --steps 1 --metrics " + tmp.file("m24.jsonl") + swap_on(disk.dir));
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find("nvme: short by"), std::string::npos) << r.output;
    EXPECT_EQ(files_under(disk.dir), std::vector<std::string>{});
    EXPECT_FALSE(exists(tmp.file("m24.jsonl")));
  }
  {
    SmallDisk disk(tmp.file("d80"), 80);
    ASSERT_TRUE(disk.mounted);
    Result r = run_strata("plan --json " + cfg + swap_on(disk.dir));
    ASSERT_EQ(r.code, 0) << r.output;
    const nlohmann::json p = nlohmann::json::parse(r.output);
    EXPECT_TRUE(p["fits"].get<bool>());
    const std::string src = p["bound"]["rates"]["nvme_read_source"];
    EXPECT_NE(src.find("a pass, less than the"), std::string::npos) << src;
    EXPECT_EQ(files_under(disk.dir), std::vector<std::string>{});
    // Two saves with run.checkpoint.keep 2: the first kept while the second
    // is written, 2 x 52.5 MiB on 80 MiB.
    const std::string ck = " --set run.checkpoint.dir=" + disk.dir + "/ck --set run.checkpoint.every=1";
    r = run_strata("train " + cfg + " --steps 2 --metrics " + tmp.file("m80.jsonl") + swap_on(tmp.file("swap")) + ck);
    EXPECT_EQ(r.code, 2) << r.output;
    // One line of error; before it only the start-up's log lines (the rates it measured first).
    EXPECT_EQ(count_lines(r.output) - count_log_lines(r.output), 1) << r.output;
    EXPECT_NE(r.output.find("run.checkpoint.dir: '" + disk.dir + "/ck' has "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("for 2 more checkpoint(s) of about"), std::string::npos) << r.output;
    EXPECT_FALSE(exists(tmp.file("m80.jsonl")));
    // One save fits, but not beside the run's 57 MiB of swap files on the same disk.
    r = run_strata("train " + cfg + " --steps 1 --metrics " + tmp.file("m80.jsonl") + swap_on(disk.dir) + ck);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find("of swap files on the same file system"), std::string::npos) << r.output;
    EXPECT_EQ(files_under(disk.dir), std::vector<std::string>{});
    r = run_strata("train " + cfg + " --steps 1 --metrics " + tmp.file("m80.jsonl") + swap_on(tmp.file("swap")) + ck);
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_TRUE(exists(disk.dir + "/ck/step-00000001/manifest.json")) << r.output;
  }
  {
    // SIGKILL in the middle of a benchmark: its files have no name to leave.
    SmallDisk disk(tmp.file("d300"), 300);
    ASSERT_TRUE(disk.mounted);
    Result r = testing::sh(std::string(STRATA_BINARY_DIR) + "/strata bench-io --dir " + disk.dir +
                           " --size-mb 128 --ops write,read,both --rounds 20 & p=$!; sleep 0.5; "
                           "ls " + disk.dir + "; kill -9 $p; wait $p; echo status $?");
    EXPECT_NE(r.output.find("status 137"), std::string::npos) << "the benchmark ended before the kill: " << r.output;
    EXPECT_EQ(r.output.find("strata-bench-io"), std::string::npos) << "a bench file had a name: " << r.output;
    EXPECT_EQ(files_under(disk.dir), std::vector<std::string>{});
  }
}

// `strata bench-crc --json`: a roof and every implementation the CPU has,
// the one in use among them; a buffer not in whole blocks is one line, exit 2.
TEST(CliTest, BenchCrcTimesEachImplementationAgainstTheRoof) {
  Result r = run_strata("bench-crc --bytes 1048576 --cache-bytes 65536 --reps 1 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  std::vector<std::string> names;
  for (const auto& v : j.at("variants")) {
    names.push_back(v.at("name").get<std::string>());
    EXPECT_GT(v.at("memory_gbps").get<double>(), 0.0) << v.dump();
    EXPECT_GT(v.at("cache_gbps").get<double>(), 0.0) << v.dump();
  }
  ASSERT_GE(names.size(), 3u) << r.output;  // roof, a table, and the used one
  EXPECT_EQ(names.front(), "roof");
  EXPECT_EQ(names.back(), "software");
  EXPECT_NE(std::find(names.begin(), names.end(), j.at("used").get<std::string>()), names.end()) << r.output;
  // A cache buffer larger than the memory one (its CRCs outnumber the other's).
  r = run_strata("bench-crc --bytes 65536 --cache-bytes 262144 --reps 1");
  EXPECT_EQ(r.code, 0) << r.output;
  r = run_strata("bench-crc --bytes 10000 --reps 1");
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
  EXPECT_NE(r.output.find("--bytes"), std::string::npos) << r.output;
}

TEST(CliTest, MissingConfigFileExits2WithOneLine) {
  TempDir dir;
  Result r = run_strata("train " + dir.file("nope.json"));
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
  EXPECT_NE(r.output.find("nope.json"), std::string::npos) << r.output;
}

// Note [Kept rates] and Note [Probes sized to the work] (src/engine/probes.h):
// with state on NVMe, strata train's first line says what it measures (sized
// to this small model: 1 Mi elements, not the 4x-the-cache default) and where
// it keeps it; the next run takes the kept rates and measures nothing;
// --reprobe measures again.
TEST(CliTest, OffloadStartUpSaysWhatItMeasuresFirstAndKeepsItForTheNextRun) {
  TempDir dir;
  const std::string data = dir.write("d.txt", testing::sample_text(4000));
  nlohmann::json j = tiny_config(data, dir.file("m.jsonl"));
  j["run"]["log_level"] = "info";
  j["run"]["steps"] = 1;
  j["data"]["eval_interval"] = 0;
  j["zero_optimization"] = {{"offload_optimizer", {{"device", "nvme"}, {"nvme_path", dir.file("swap")}}}};
  const std::string cfg = write_config(dir, j);
  const std::string env = "STRATA_RATES_CACHE=" + dir.file("kept/rates.json") + " ";
  auto first_line = [](const std::string& out) { return out.substr(0, out.find('\n')); };
  Result r = testing::sh(env + std::string(STRATA_BINARY_DIR) + "/strata train " + cfg);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(first_line(r.output).find("measuring this machine's rates for the step's bound: "), std::string::npos)
      << r.output;
  EXPECT_NE(first_line(r.output).find("CPU Adam over 1 Mi elements"), std::string::npos) << r.output;
  EXPECT_NE(first_line(r.output).find("kept in " + dir.file("kept/rates.json")), std::string::npos) << r.output;
  EXPECT_TRUE(exists(dir.file("kept/rates.json")));
  r = testing::sh(env + std::string(STRATA_BINARY_DIR) + "/strata train " + cfg);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(first_line(r.output).find("rates for the step's bound kept from an earlier run"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("measuring"), std::string::npos) << r.output;
  r = testing::sh(env + std::string(STRATA_BINARY_DIR) + "/strata train --reprobe " + cfg);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(first_line(r.output).find("measuring this machine's rates"), std::string::npos) << r.output;
}

TEST(CliTest, BadKeyExits2NamingTheKeyAndLeavesNoMetrics) {
  TempDir dir;
  const std::string data = dir.write("d.txt", testing::sample_text(4000));
  nlohmann::json j = tiny_config(data, dir.file("m.jsonl"));
  j["optimizer"]["params"]["lrr"] = 0.1;
  Result r = run_strata("train " + write_config(dir, j));
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
  EXPECT_NE(r.output.find("optimizer.params.lrr"), std::string::npos) << r.output;
  EXPECT_FALSE(exists(dir.file("m.jsonl")));
}

TEST(CliTest, BadOverrideExits2NamingTheKey) {
  TempDir dir;
  const std::string data = dir.write("d.txt", testing::sample_text(4000));
  const std::string cfg = write_config(dir, tiny_config(data, dir.file("m.jsonl")));
  Result r = run_strata("train " + cfg + " --set model.n_heads=3");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("model."), std::string::npos) << r.output;
  EXPECT_FALSE(exists(dir.file("m.jsonl")));
}

TEST(CliTest, MissingDataFileExits2NamingTheFileAndLeavesNoMetrics) {
  TempDir dir;
  const std::string cfg = write_config(dir, tiny_config(dir.file("missing.txt"), dir.file("m.jsonl")));
  Result r = run_strata("train " + cfg);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
  EXPECT_NE(r.output.find("missing.txt"), std::string::npos) << r.output;
  EXPECT_FALSE(exists(dir.file("m.jsonl")));
}

// A run.checkpoint.dir that cannot be created (under a regular file) or
// written (a directory without write permission, when not root) is refused
// at start: exit 2, one line naming the key, no metrics file, no step trained.
TEST(CliTest, UnwritableCheckpointDirIsRefusedAtStart) {
  TempDir dir;
  const std::string data = dir.write("text.txt", std::string(4000, 'a'));
  const std::string blocker = dir.write("file", "x");
  std::vector<std::string> bad = {blocker + "/ckpt"};
  if (geteuid() != 0) {
    const std::string locked = dir.file("locked");
    ASSERT_EQ(mkdir(locked.c_str(), 0500), 0);
    bad.push_back(locked);
  }
  for (const std::string& ckpt : bad) {
    nlohmann::json j = tiny_config(data, dir.file("m.jsonl"));
    j["run"]["checkpoint"] = {{"dir", ckpt}, {"every", 1}};
    Result r = run_strata("train " + write_config(dir, j));
    EXPECT_EQ(r.code, 2) << ckpt << ": " << r.output;
    EXPECT_EQ(count_lines(r.output), 1) << r.output;
    EXPECT_NE(r.output.find("run.checkpoint.dir"), std::string::npos) << r.output;
    EXPECT_FALSE(exists(dir.file("m.jsonl"))) << ckpt;
  }
  // A directory that does not exist yet is created, private.
  nlohmann::json j = tiny_config(data, dir.file("m.jsonl"));
  j["run"]["checkpoint"] = {{"dir", dir.file("new/ckpt")}};
  j["run"]["steps"] = 1;
  Result r = run_strata("train " + write_config(dir, j));
  EXPECT_EQ(r.code, 0) << r.output;
  struct stat st;
  ASSERT_EQ(stat(dir.file("new/ckpt").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
}

// run.device "cuda": on a machine with a GPU, `strata train` trains there
// (a metrics line per step, finite losses); on one without, one line naming
// run.device, exit 2, and no metrics file.
TEST(CliTest, CudaTrainsOnAGpuAndIsOneLineNamingRunDeviceWithout) {
  TempDir dir;
  const std::string data = dir.write("d.txt", testing::sample_text(4000));
  nlohmann::json j = tiny_config(data, dir.file("m.jsonl"));
  j["run"]["device"] = "cuda";
  j["bf16"] = {{"enabled", true}};
  Result r = run_strata("train " + write_config(dir, j));
  if (cuda_device_count() == 0) {
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_EQ(count_lines(r.output), 1) << r.output;
    EXPECT_NE(r.output.find("run.device"), std::string::npos) << r.output;
    EXPECT_FALSE(exists(dir.file("m.jsonl")));
    return;
  }
  ASSERT_EQ(r.code, 0) << r.output;
  std::ifstream in(dir.file("m.jsonl"));
  int steps = 0;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json m = nlohmann::json::parse(line);
    if (!m.contains("tokens_per_s")) continue;
    ++steps;
    EXPECT_TRUE(std::isfinite(m["loss"].get<double>())) << line;
  }
  EXPECT_EQ(steps, 3);
}

TEST(CliTest, DataPathNamingADirectoryIsOneLine) {
  TempDir dir;
  const std::string cfg = write_config(dir, tiny_config(dir.path(), dir.file("m.jsonl")));
  Result r = run_strata("train " + cfg);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
  EXPECT_NE(r.output.find(dir.path() + ": is a directory"), std::string::npos) << r.output;
}

// The plan sizes a model from its specs with checked arithmetic and never
// builds it: far too large is the plan's verdict, absurd is a config error,
// never an allocator's stack trace.
TEST(CliTest, ModelFarTooLargeIsThePlansVerdict) {
  TempDir dir;
  const std::string data = dir.write("d.txt", testing::sample_text(4000));
  const std::string cfg = write_config(dir, tiny_config(data, dir.file("m.jsonl")));
  for (const char* cmd : {"train", "plan"}) {
    Result big = run_strata(std::string(cmd) + " " + cfg + " --set model.dim=262144 --set model.n_heads=1");
    EXPECT_EQ(big.code, 2) << big.output;
    EXPECT_NE(big.output.find("short by"), std::string::npos) << big.output;
    EXPECT_EQ(big.output.find("frame #"), std::string::npos) << big.output;
    Result absurd = run_strata(std::string(cmd) + " " + cfg + " --set model.dim=1000000000");
    EXPECT_EQ(absurd.code, 2) << absurd.output;
    EXPECT_EQ(count_lines(absurd.output), 1) << absurd.output;
    EXPECT_NE(absurd.output.find("model: parameter"), std::string::npos) << absurd.output;
  }
  EXPECT_FALSE(exists(dir.file("m.jsonl")));
}

// The plan counts what the data path uses: token files are mapped (page
// cache, not in the tiers' totals; files not on this machine listed), and
// each rank's own token batches are a row of the table.
TEST(CliTest, PlanCountsTheDataPath) {
  TempDir dir;
  const std::string data = dir.write("d.txt", testing::sample_text(5000));
  const int64_t size = int64_t(testing::sample_text(5000).size());
  nlohmann::json j = tiny_config(data, dir.file("m.jsonl"));
  j["gradient_accumulation_steps"] = 3;
  Result r = run_strata("plan --json " + write_config(dir, j));
  ASSERT_EQ(r.code, 0) << r.output;
  nlohmann::json p = nlohmann::json::parse(r.output);
  EXPECT_EQ(p["data"]["mapped_bytes"], size);
  EXPECT_EQ(p["data"]["token_batch_bytes"], 3 * 2 * (16 + 1) * 8);  // accumulation x micro-batch x window, int64
  EXPECT_TRUE(p["data"]["missing_files"].empty());
  // The schedule and its activation rows (Note [Step schedules]): layer holds
  // the 3 micro-batches' saved inputs (the tokens, 2 x 16 x 8 bytes, and the
  // layer's input, 2 x 16 x 32 x 4 bytes, per micro-batch) and 3 output
  // gradients of 4096 bytes.
  r = run_strata("plan --json --no-bound --set run.schedule=layer --set run.recompute=always " + write_config(dir, j));
  ASSERT_EQ(r.code, 0) << r.output;
  p = nlohmann::json::parse(r.output);
  EXPECT_EQ(p["schedule"], "layer");
  EXPECT_EQ(p["activations"]["micro_batches_held"], 3);
  EXPECT_EQ(p["activations"]["checkpoints"], 3 * (2 * 16 * 8 + 2 * 16 * 32 * 4));
  EXPECT_EQ(p["activations"]["output_gradients_held"], 3 * 2 * 16 * 32 * 4);
  // Recomputing the layer costs its forward again for each micro-batch but
  // for the down projection: per token q, k, v, o 32 x 32 and gate, up 32 x
  // 96 multiply-adds (10,240, twice in FLOPs) and the attention's 4 x 16 x
  // 32; 32 tokens, 3 micro-batches.
  EXPECT_EQ(p["recompute"], "always");
  EXPECT_EQ(p["activations"]["recomputed_flops_per_step"].get<double>(), 3.0 * 32 * (2 * 10240 + 4 * 16 * 32));
  // never (Note [Activation placement]): the layer keeps its entries instead
  // of its input, by hand per token x, q, o, mid, k, v of 32 values, gate
  // and up of 96 (ffn: 8/3 x 32 rounded up to 32), fp32; two rstd and a
  // log-sum-exp per head (2).
  r = run_strata("plan --json --no-bound --set run.schedule=layer --set run.recompute=never " + write_config(dir, j));
  ASSERT_EQ(r.code, 0) << r.output;
  p = nlohmann::json::parse(r.output);
  const int64_t entries = 2 * 16 * ((6 * 32 + 2 * 96) * 4 + (2 + 2) * 4);
  EXPECT_EQ(p["recompute"], "never");
  EXPECT_EQ(p["activations"]["entries_bytes_per_layer"], entries);
  EXPECT_EQ(p["activations"]["checkpoints"], 3 * (2 * 16 * 8 + entries));
  EXPECT_EQ(p["activations"]["recomputed_flops_per_step"].get<double>(), 0.0);
  // optimizer.speculate (Note [Speculative optimizer]): auto leaves it off
  // on the CPU device and says why; on takes every piece (all CPU Adam's).
  EXPECT_EQ(p["speculate"]["on"], false);
  EXPECT_NE(std::string(p["speculate"]["choice"]).find("CPU device"), std::string::npos) << p["speculate"];
  r = run_strata("plan --json --no-bound --set run.schedule=layer --set optimizer.speculate=on " + write_config(dir, j));
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json sp = nlohmann::json::parse(r.output)["speculate"];
  EXPECT_EQ(sp["on"], true);
  EXPECT_EQ(sp["mechanism"], "two_pass");
  EXPECT_GE(int64_t(sp["elements"]), int64_t(nlohmann::json::parse(r.output)["parameters"]));
  // The optimizer state on NVMe: alternate swap slots, a second copy of
  // master weights and moments on disk (12 bytes per element), in the
  // plan's NVMe total; with speculate_slots false, two passes.
  const std::string on_nvme = " --set run.schedule=layer --set optimizer.speculate=on --set run.overlap_optimizer=true --set "
                              "zero_optimization.offload_optimizer='{\"device\":\"nvme\",\"nvme_path\":\"" +
                              dir.path() + "\"}' ";
  r = run_strata("plan --json --no-bound" + on_nvme + write_config(dir, j));
  ASSERT_EQ(r.code, 0) << r.output;
  p = nlohmann::json::parse(r.output);
  EXPECT_EQ(p["speculate"]["mechanism"], "alternate_slots") << p["speculate"];
  EXPECT_EQ(p["speculate"]["alternate_slot_elements"], p["speculate"]["elements"]);
  const int64_t opt_nvme = int64_t(p["state_bytes"]["master"]["nvme"]) + int64_t(p["state_bytes"]["exp_avg"]["nvme"]) +
                           int64_t(p["state_bytes"]["exp_avg_sq"]["nvme"]);
  EXPECT_EQ(int64_t(p["speculate"]["spare_nvme_bytes"]), 12 * int64_t(p["speculate"]["elements"]));
  EXPECT_EQ(int64_t(p["total_bytes"]["nvme"]) - int64_t(p["state_total_bytes"]["nvme"]), opt_nvme);
  r = run_strata("plan --no-bound" + on_nvme + write_config(dir, j));
  EXPECT_NE(r.output.find("elements on NVMe (the new state written beside the backward, committed by a flip"),
            std::string::npos)
      << r.output;
  r = run_strata("plan --json --no-bound --set optimizer.speculate_slots=false" + on_nvme + write_config(dir, j));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output)["speculate"]["mechanism"], "two_pass");
  r = run_strata("plan --no-bound --set run.schedule=layer " + write_config(dir, j));
  EXPECT_NE(r.output.find("saved inputs (x3)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("schedule: layer"), std::string::npos) << r.output;
  j["data"]["path"] = {data, dir.file("elsewhere.txt")};
  r = run_strata("plan " + write_config(dir, j));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("data: 2 token file(s)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(1 not on this machine, not counted)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("token batches"), std::string::npos) << r.output;
}

// The plan's bound with every rate given (no probe runs): the tiny config's
// FLOPs by hand (dim 32, 1 layer, 2 heads, ffn 96, vocab 256, seq 16, 2
// windows, graphs kept): matrices 32x32 x 4 + 3 x 32 x 96 = 13312 per token;
// layer forward 2 x 13312 + 4 x 16 x 32 = 28672; forward + head 28672 + 2 x
// 256 x 32 = 45056; step 32 tokens x 3 x 45056 = 4325376 FLOPs. At 1 MFLOP/s
// that is 4.325376 s, and the cores bind. Bad rates and a machine described
// instead of measured.
TEST(CliTest, PlanBoundDividesHandCountedWorkByTheGivenRates) {
  TempDir dir;
  const std::string data = dir.write("d.txt", testing::sample_text(4000));
  const std::string cfg = write_config(dir, tiny_config(data, dir.file("m.jsonl")));
  const std::string rates = " --device-tflops 1e-6 --adam-gelems 1 --h2d-gbps 10 --d2h-gbps 10";
  Result r = run_strata("plan --json " + cfg + rates);
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json b = nlohmann::json::parse(r.output)["bound"];
  EXPECT_EQ(b["work"]["flops"], 4325376.0);
  EXPECT_EQ(b["binding"], "cpu (compute + Adam)");
  // + Adam: the model's padded elements at 1 G/s, well under a millisecond.
  EXPECT_GT(b["seconds"].get<double>(), 4.325376);
  EXPECT_LT(b["seconds"].get<double>(), 4.326376);
  EXPECT_EQ(b["rates"]["device_flops_source"], "--device-tflops");
  // run.overlap_optimizer "auto" on the CPU device: overlapped with the
  // optimizer state in RAM, in sequence once any of it is on NVMe.
  auto dependencies = [](const nlohmann::json& bound) {
    for (const auto& row : bound["resources"]) {
      if (row["resource"] == "dependencies") return row["work"].get<std::string>();
    }
    return std::string("(no dependencies row)");
  };
  EXPECT_EQ(b["overlap_optimizer"], true);
  EXPECT_EQ(dependencies(b), "max(first forward, optimizer) + rest of compute");
  nlohmann::json swapping = tiny_config(data, dir.file("m.jsonl"));
  swapping["zero_optimization"] = {{"offload_optimizer", {{"device", "nvme"}, {"nvme_path", dir.path()}}}};
  Result sw = run_strata("plan --json " + dir.write("swapping.json", swapping.dump(2)) + rates +
                         " --nvme-gbps 1 --checksum-gbps 10");
  ASSERT_EQ(sw.code, 0) << sw.output;
  const nlohmann::json sb = nlohmann::json::parse(sw.output)["bound"];
  EXPECT_EQ(sb["overlap_optimizer"], false);
  EXPECT_EQ(dependencies(sb), "compute, then the optimizer (not overlapped)");
  r = run_strata("plan " + cfg + rates);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("bound: 4.32"), std::string::npos) << r.output;
  for (const char* bad : {" --nvme-gbps -1", " --device-tflops nan", " --host-memory-gb -2"}) {
    Result e = run_strata("plan " + cfg + bad);
    EXPECT_EQ(e.code, 2) << bad << ": " << e.output;
    EXPECT_EQ(count_lines(e.output), 1) << e.output;
    EXPECT_NE(e.output.find(std::string(bad).substr(1, std::string(bad).find(' ', 1) - 1)), std::string::npos)
        << e.output;
  }
  // A node of 100 KiB of RAM: the verdict, with the figure given.
  Result small = run_strata("plan " + cfg + rates + " --host-memory-gb 0.00009536743");
  EXPECT_EQ(small.code, 2) << small.output;
  EXPECT_NE(small.output.find("host: short by"), std::string::npos) << small.output;
  EXPECT_NE(small.output.find("has 100.0 KiB"), std::string::npos) << small.output;
  // A cuda config on a machine without a GPU: the device's rate must be given.
  Result gpu = run_strata("plan " + cfg + " --set run.device='\"cuda\"' --device-memory-gb 80");
  DeviceMemoryInfo info;
  if (!query_device_memory("cuda", &info)) {
    EXPECT_EQ(gpu.code, 2) << gpu.output;
    EXPECT_NE(gpu.output.find("--device-tflops"), std::string::npos) << gpu.output;
  }
  Result given = run_strata("plan --json " + cfg + " --set run.device='\"cuda\"' --device-memory-gb 80" +
                            " --device-tflops 989 --adam-gelems 1 --h2d-gbps 50 --d2h-gbps 50 --pcie-both-gbps 80");
  ASSERT_EQ(given.code, 0) << given.output;
  const nlohmann::json g = nlohmann::json::parse(given.output);
  EXPECT_EQ(g["capacity_bytes"]["device"], int64_t(80) << 30);
  EXPECT_EQ(g["bound"]["resources"][0]["resource"], "device");
}

TEST(CliTest, TooShortDataFileExits2AndLeavesNoMetrics) {
  TempDir dir;
  const std::string data = dir.write("d.txt", "too short");
  const std::string cfg = write_config(dir, tiny_config(data, dir.file("m.jsonl")));
  Result r = run_strata("train " + cfg);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("d.txt"), std::string::npos) << r.output;
  EXPECT_FALSE(exists(dir.file("m.jsonl")));
}

TEST(CliTest, TrainWritesOneMetricsLinePerStepWithFlagsOverridingConfig) {
  TempDir dir;
  const std::string data = dir.write("d.txt", testing::sample_text(4000));
  const std::string cfg = write_config(dir, tiny_config(data, dir.file("ignored.jsonl")));
  Result r = run_strata("train " + cfg + " --steps 4 --metrics " + dir.file("m.jsonl") +
                     " --set optimizer.params.lr=2e-3");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_FALSE(exists(dir.file("ignored.jsonl")));
  std::ifstream f(dir.file("m.jsonl"));
  std::string line;
  int steps = 0, evals = 0;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    ++steps;
    EXPECT_EQ(j["step"].get<int>(), steps);
    for (const char* key : {"loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"}) {
      EXPECT_TRUE(j.contains(key)) << key << " missing in " << line;
    }
    EXPECT_DOUBLE_EQ(j["lr"].get<double>(), 2e-3);
    if (j.contains("eval_loss")) ++evals;
  }
  EXPECT_EQ(steps, 4);
  EXPECT_EQ(evals, 2);  // eval_interval 2: steps 2 and 4
}

TEST(CliTest, LossesAreWrittenWithFullPrecision) {
  TempDir dir;
  const std::string data = dir.write("d.txt", testing::sample_text(4000));
  const std::string cfg = write_config(dir, tiny_config(data, dir.file("m.jsonl")));
  ASSERT_EQ(run_strata("train " + cfg).code, 0);
  std::ifstream f(dir.file("m.jsonl"));
  std::string line;
  std::getline(f, line);
  // A double printed round-trip exactly has about 17 significant digits.
  const auto pos = line.find("\"loss\":");
  ASSERT_NE(pos, std::string::npos);
  const std::string num = line.substr(pos + 7, line.find_first_of(",}", pos) - pos - 7);
  EXPECT_GE(num.size(), 12u) << num;
}

TEST(CliTest, TraceIsChromeTraceJsonWithComputeNvmeAndAdamTracks) {
  TempDir dir;
  const std::string data = dir.write("d.txt", testing::sample_text(4000));
  nlohmann::json j = tiny_config(data, dir.file("m.jsonl"));
  j["zero_optimization"] = {{"offload_optimizer", {{"device", "nvme"}, {"nvme_path", dir.file("swap")}}}};
  const std::string cfg = write_config(dir, j);
  Result r = run_strata("train " + cfg + " --steps 2 --trace " + dir.file("trace.json"));
  ASSERT_EQ(r.code, 0) << r.output;
  std::ifstream f(dir.file("trace.json"));
  nlohmann::json t = nlohmann::json::parse(f);  // throws (test fails) on malformed JSON
  ASSERT_TRUE(t.is_array());
  std::map<int, int> spans;  // track -> complete events
  std::map<std::string, int> adam;  // the CPU Adam track's, by name
  for (const auto& e : t) {
    if (e["ph"] == "X") {
      ++spans[e["tid"].get<int>()];
      if (e["tid"] == 4) ++adam[e["name"].get<std::string>()];
      EXPECT_GE(e["dur"].get<double>(), 0.0);
    }
  }
  EXPECT_GT(spans[1], 0);  // compute
  EXPECT_GT(spans[3], 0);  // NVMe I/O (optimizer state)
  // One CPU Adam call per step (one sub-group), after waiting for its reads.
  EXPECT_EQ(adam["adam sub-group"], 2);
  EXPECT_EQ(adam["wait for the piece's reads (and verify them)"], 2);
  EXPECT_FALSE(exists(dir.file("trace.json.tmp")));
}

TEST(CliTest, VersionAndHelp) {
  Result v = run_strata("--version");
  EXPECT_EQ(v.code, 0);
  EXPECT_EQ(v.output.rfind("strata ", 0), 0u) << v.output;
  Result h = run_strata("help");
  EXPECT_EQ(h.code, 0);
  EXPECT_NE(h.output.find("train"), std::string::npos);
  Result bad = run_strata("train");
  EXPECT_EQ(bad.code, 2);
}

}  // namespace
}  // namespace strata
