// Fine-tuning data through `strata train` (docs/token-format.md, "Examples
// and loss masks"): examples with loss masks, as tools/tokenize.py writes
// them, train bit for bit across placements, schedules, recompute modes and
// ZeRO stages, resume mid-epoch bit for bit, and train on 2 ranks as on one;
// bad files and keys are one line naming them, before anything is written.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace strata {
namespace {

using testing::Result;
using testing::sh;
using testing::TempDir;

const std::string kStrata = std::string(STRATA_BINARY_DIR) + "/strata";

std::string le(uint64_t v, int width) {
  std::string out;
  for (int b = 0; b < width; ++b) out.push_back(char((v >> (8 * b)) & 0xff));
  return out;
}

// `n` examples of 6 to 40 uint16 tokens (ids < 256), their first third not
// counted, written as tools/tokenize.py writes them: FILE, FILE.mask,
// FILE.idx and the version 2 sidecar.
std::string write_examples(const TempDir& dir, int n) {
  std::string ids, mask, index = le(0, 8);
  uint64_t tokens = 0, counted = 0;
  uint64_t x = 12345;
  for (int e = 0; e < n; ++e) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    const int len = 6 + int((x >> 33) % 35);
    // Learnable: each example counts up by 3 from a random id.
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    const uint64_t first = (x >> 40) % 250;
    for (int t = 0; t < len; ++t) {
      ids += le((first + 3 * uint64_t(t)) % 250 + 1, 2);
      mask.push_back(t < len / 3 ? 0 : 1);
      counted += t >= len / 3;
    }
    tokens += uint64_t(len);
    index += le(tokens, 8);
  }
  const std::string path = dir.write("ex.bin", ids);
  dir.write("ex.bin.mask", mask);
  dir.write("ex.bin.idx", index);
  const nlohmann::json side = {{"format", "strata-tokens"}, {"version", 2}, {"vocab_size", 256},
                               {"tokens", tokens}, {"dtype", "uint16"}, {"examples", n},
                               {"counted", counted}, {"mask", "ex.bin.mask"}, {"index", "ex.bin.idx"}};
  dir.write("ex.bin.json", side.dump());
  return path;
}

nlohmann::json base_config(const std::string& data, const std::string& sampling) {
  return {
      {"train_batch_size", 8},
      {"train_micro_batch_size_per_gpu", 2},
      {"gradient_clipping", 1.0},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}}}}},
      {"zero_optimization", {{"stage", 0}}},
      {"model", {{"vocab_size", 256}, {"dim", 48}, {"n_layers", 2}, {"n_heads", 4}, {"seq_len", 48}}},
      {"data", {{"path", data}, {"sampling", sampling}, {"val_fraction", 0.1}, {"eval_interval", 3},
                {"eval_batches", 2}}},
      {"run", {{"steps", 8}, {"threads", 1}, {"log_level", "warn"}, {"seed", 5}}},
      {"comm", {{"timeout_s", 20}}},
  };
}

std::vector<nlohmann::json> metrics(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

// The fields that must agree bit for bit between two runs of the same steps.
std::vector<std::string> training_fields(const std::vector<nlohmann::json>& m) {
  std::vector<std::string> out;
  for (const nlohmann::json& j : m) {
    out.push_back(j["loss"].dump() + " " + j["grad_norm"].dump() + " " + j["counted_tokens"].dump() + " " +
                  j.value("eval_loss", nlohmann::json()).dump());
  }
  return out;
}

class FinetuneDataTest : public ::testing::Test {
 protected:
  Result train(const nlohmann::json& c, const std::string& name, const std::string& extra = "") {
    const std::string cfg = dir_.write(name + ".json", c.dump());
    return sh(kStrata + " train " + cfg + " --metrics " + dir_.file(name + ".jsonl") + " " + extra);
  }
  TempDir dir_;
};

// Masked, packed examples: every placement of the state, both schedules,
// recompute always and never train bit for bit; the loss moves; counted
// tokens are the targets the masks count (fewer than the targets); eval runs.
TEST_F(FinetuneDataTest, MaskedExamplesTrainBitForBitAcrossPlacementsSchedulesAndRecompute) {
  const std::string data = write_examples(dir_, 120);
  const std::string swap = dir_.file("swap");
  ASSERT_EQ(sh("mkdir -p " + swap).code, 0);
  const nlohmann::json c = base_config(data, "packed");
  ASSERT_EQ(train(c, "ref").code, 0) << train(c, "ref").output;
  const std::vector<nlohmann::json> ref = metrics(dir_.file("ref.jsonl"));
  ASSERT_EQ(ref.size(), 8u);
  EXPECT_LT(ref.back()["loss"].get<double>(), ref.front()["loss"].get<double>());
  for (const nlohmann::json& j : ref) {
    EXPECT_GT(j["counted_tokens"].get<int64_t>(), 0);
    EXPECT_LT(j["counted_tokens"].get<int64_t>(), j["tokens"].get<int64_t>());
  }
  EXPECT_TRUE(ref[2].contains("eval_loss"));
  std::vector<std::pair<std::string, nlohmann::json>> variants;
  nlohmann::json v = c;
  v["zero_optimization"] = {{"stage", 3}, {"offload_param", {{"device", "cpu"}}}, {"offload_optimizer", {{"device", "cpu"}}}};
  variants.push_back({"host", v});
  v["zero_optimization"] = {{"stage", 3},
                            {"sub_group_size", 8192},
                            {"offload_param", {{"device", "nvme"}, {"nvme_path", swap}, {"max_in_cpu", 0}}},
                            {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", swap}}}};
  variants.push_back({"nvme", v});
  v = c;
  v["run"]["schedule"] = "micro_batch";
  variants.push_back({"micro_batch", v});
  v["run"]["schedule"] = "layer";
  variants.push_back({"layer", v});
  v = c;
  v["run"]["recompute"] = "always";
  variants.push_back({"recompute always", v});
  v["run"]["recompute"] = "never";
  variants.push_back({"recompute never", v});
  for (const auto& [name, cfg] : variants) {
    const std::string file = "v" + std::to_string(&name - &variants[0].first);
    Result r = train(cfg, file);
    ASSERT_EQ(r.code, 0) << name << "\n" << r.output;
    EXPECT_EQ(training_fields(metrics(dir_.file(file + ".jsonl"))), training_fields(ref)) << name;
  }
}

// A checkpoint mid-epoch (54 training examples, ~12 a step packed: the
// epoch ends near step 5) resumes to the same losses, counted tokens and
// evals as the uninterrupted run, across the epoch's end.
TEST_F(FinetuneDataTest, ResumesMidEpochBitForBit) {
  const std::string data = write_examples(dir_, 60);
  nlohmann::json c = base_config(data, "packed");
  c["run"]["checkpoint"] = {{"dir", dir_.file("ckpt")}, {"every", 3}, {"keep", 5}};
  Result full = train(c, "full");
  ASSERT_EQ(full.code, 0) << full.output;
  nlohmann::json s = c;
  s["run"]["checkpoint"]["dir"] = dir_.file("ckpt2");
  s["run"]["steps"] = 3;
  Result first = train(s, "part");
  ASSERT_EQ(first.code, 0) << first.output;
  s["run"]["steps"] = 8;
  Result rest = train(s, "part", "--resume");
  ASSERT_EQ(rest.code, 0) << rest.output;
  const std::vector<std::string> a = training_fields(metrics(dir_.file("full.jsonl")));
  const std::vector<std::string> b = training_fields(metrics(dir_.file("part.jsonl")));
  EXPECT_EQ(a, b);
  std::string latest = testing::read_bytes(dir_.file("ckpt2") + "/latest");
  latest.erase(latest.find_last_not_of('\n') + 1);
  const nlohmann::json manifest =
      nlohmann::json::parse(testing::read_bytes(dir_.file("ckpt2") + "/" + latest + "/manifest.json"));
  // (The last save, at step 8: past the first epoch's end.)
  EXPECT_EQ(manifest["data"]["epoch"].get<int64_t>(), 1) << manifest["data"]["epoch"];
  EXPECT_GT(manifest["data"]["example"].get<int64_t>(), 0);
}

// 2 ranks train as one rank does (to rounding), at stage 0 and stage 3
// alike (bit for bit between them); the counted tokens are the global
// batch's.
TEST_F(FinetuneDataTest, TwoRanksTrainAsOne) {
  const std::string data = write_examples(dir_, 120);
  const nlohmann::json c = base_config(data, "examples");
  ASSERT_EQ(train(c, "one").code, 0);
  const std::vector<nlohmann::json> one = metrics(dir_.file("one.jsonl"));
  std::vector<std::string> stage0;
  for (int stage : {0, 3}) {
    const std::string m = dir_.file("two" + std::to_string(stage) + ".jsonl");
    nlohmann::json s = c;
    s["zero_optimization"]["stage"] = stage;
    const std::string cfg = dir_.write("two" + std::to_string(stage) + ".json", s.dump());
    Result r = sh(kStrata + " launch --nproc 2 -- strata train " + cfg + " --metrics " + m);
    ASSERT_EQ(r.code, 0) << r.output;
    const std::vector<nlohmann::json> two = metrics(m);
    ASSERT_EQ(two.size(), one.size());
    for (size_t i = 0; i < one.size(); ++i) {
      const double a = one[i]["loss"], b = two[i]["loss"];
      EXPECT_LE(std::abs(a - b), 1e-5 * std::abs(a)) << "stage " << stage << " step " << i + 1;
      EXPECT_EQ(one[i]["counted_tokens"], two[i]["counted_tokens"]);
    }
    if (stage == 0) stage0 = training_fields(two);
    else EXPECT_EQ(training_fields(two), stage0);
  }
}

// Bad input: one line naming the key or the file, exit 2, no metrics file.
TEST_F(FinetuneDataTest, BadKeysAndFilesAreOneLine) {
  const std::string data = write_examples(dir_, 40);
  auto fails = [&](const nlohmann::json& c, const std::string& name, const std::string& words) {
    Result r = train(c, name);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(words), std::string::npos) << r.output;
    EXPECT_NE(access(dir_.file(name + ".jsonl").c_str(), F_OK), 0) << name;
  };
  nlohmann::json c = base_config(data, "sometimes");
  fails(c, "enum", "data.sampling");
  // Examples without an index: a plain token file.
  const std::string plain = dir_.write("plain.bin", std::string(4000, '\1'));
  c = base_config(plain, "examples");
  fails(c, "noindex", "data.sampling");
  // Longer than a sequence without data.truncate: the example named.
  c = base_config(data, "examples");
  c["model"]["seq_len"] = 16;
  fails(c, "long", "example ");
  // A mask that does not match its tokens.
  std::ofstream(dir_.file("ex.bin.mask"), std::ios::app) << "\x01\x01";
  c = base_config(data, "packed");
  fails(c, "mask", "ex.bin.mask");
}

}  // namespace
}  // namespace strata
