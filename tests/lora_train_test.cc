// LoRA training over a frozen base (docs/design.md, "State kinds"): 10
// clipped fp32 steps against transformers + PEFT + torch AdamW over the
// adapters on the same base, adapters and batches (tests/peft_train.py), per
// step loss and norm within 1e-5 relative; bit for bit across the frozen
// base's placements (device, host, NVMe, a three-way split, auto), the
// optimizer state's, both schedules, recompute modes and speculation; the base
// never written (its homes byte-identical after training, no NVMe writes or
// D2H where only it is off the device); no gradient or optimizer state for it
// (the plan's bytes by hand).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "config/config.h"
#include "data/dataset.h"
#include "engine/trainer.h"
#include "memory/layout.h"
#include "memory/placement.h"
#include "memory/tiered_state.h"
#include "model/model.h"
#include "plan/bound.h"
#include "test_util.h"
#include "training_session.h"
#include "plan/planner.h"
#include "util/counted_tokens.h"
#include "util/errors.h"
#include "util/fs.h"

namespace strata {
namespace {

using testing::Result;
using testing::sh;
using testing::TempDir;

const std::string kPython = std::string(STRATA_SOURCE_DIR) + "/.venv/bin/python";

nlohmann::json lora_config(const std::string& data) {
  return {
      {"train_micro_batch_size_per_gpu", 2},
      {"gradient_accumulation_steps", 2},
      {"gradient_clipping", 0.05},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.1}}}}},
      {"zero_optimization", {{"sub_group_size", 4096}}},
      {"model", {{"dim", 64}, {"n_layers", 2}, {"n_heads", 4}, {"n_kv_heads", 2}, {"ffn_hidden", 96},
                 {"seq_len", 32}}},
      {"lora", {{"r", 4}, {"lora_alpha", 8}, {"target_modules", "all-linear"}}},
      {"data", {{"path", data}, {"val_fraction", 0.0}}},
      {"run", {{"steps", 6}, {"seed", 11}}},
  };
}

struct LoraRun {
  std::vector<double> losses, norms;
  std::vector<at::Tensor> master;       // per block (adapters), after the last step
  std::vector<at::Tensor> frozen_before, frozen_after;  // per block, its frozen values as stored
  LinkBytes links;                      // over the steps
  std::vector<LinkBytes> step_links;    // as each StepResult reported them
  PlacementPlan plan;
};

// Block b's frozen values as stored (compute dtype), read from their home.
at::Tensor frozen_values(Trainer& t, size_t b) { return t.state_block(Category::kFrozen, b); }

LoraRun train(const nlohmann::json& j, const std::vector<std::string>& overrides, int steps = 6,
          const std::vector<int64_t>* tokens = nullptr, bool masked = false) {
  Config cfg = parse_config(j, overrides);
  Model model(cfg.model);
  Trainer trainer(cfg, model);
  TokenDataset data(cfg.data.paths, TokenFormat::kText, 256, cfg.model.seq_len, 0.0);
  const int64_t n = cfg.gradient_accumulation_steps * cfg.train_micro_batch_size_per_gpu;
  std::vector<int64_t> batch(size_t(n * (cfg.model.seq_len + 1)));
  std::mt19937_64 rng(5);
  LoraRun r;
  r.plan = trainer.plan();
  for (size_t b = 0; b < trainer.layout().num_blocks(); ++b) r.frozen_before.push_back(frozen_values(trainer, b));
  const LinkBytes links0 = trainer.state().links();
  for (int s = 0; s < steps; ++s) {
    if (tokens != nullptr) {
      std::copy(tokens->begin() + s * std::ptrdiff_t(batch.size()), tokens->begin() + (s + 1) * std::ptrdiff_t(batch.size()),
                batch.begin());
    } else {
      data.sample_train(rng, n, batch.data());
    }
    // Note [Counted tokens]: the global batch's counted targets (one rank: this batch).
    StepResult sr = trainer.step(batch.data(), false, masked ? counted_targets(batch.data(), n, cfg.model.seq_len) : -1);
    r.losses.push_back(sr.loss);
    r.norms.push_back(sr.grad_norm);
    r.step_links.push_back(sr.links);
  }
  trainer.finish();
  const LinkBytes links1 = trainer.state().links();
  r.links = {links1.h2d - links0.h2d, links1.d2h - links0.d2h, links1.nvme_read - links0.nvme_read,
             links1.nvme_write - links0.nvme_write};
  for (size_t b = 0; b < trainer.layout().num_blocks(); ++b) {
    r.master.push_back(trainer.master_block(b));
    r.frozen_after.push_back(frozen_values(trainer, b));
  }
  return r;
}

void expect_identical(const LoraRun& a, const LoraRun& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(a.losses[i], b.losses[i]) << what << " step " << i + 1;
    EXPECT_EQ(a.norms[i], b.norms[i]) << what << " step " << i + 1;
  }
  ASSERT_EQ(a.master.size(), b.master.size());
  for (size_t i = 0; i < a.master.size(); ++i) {
    EXPECT_TRUE(at::equal(a.master[i], b.master[i])) << what << " block " << i;
  }
}

class LoraTrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    data_ = dir_.write("text.txt", testing::sample_text(20000));
    swap_ = dir_.file("swap");
    mkdir(swap_.c_str(), 0700);
    baseline_ = train(lora_config(data_), {});
  }
  TempDir dir_;
  std::string data_, swap_;
  LoraRun baseline_;
};

TEST_F(LoraTrainTest, AdaptersLearnAndTheBaseIsNeverWritten) {
  EXPECT_LT(baseline_.losses.back(), baseline_.losses.front() - 0.05);
  for (size_t b = 0; b < baseline_.frozen_before.size(); ++b) {
    EXPECT_GT(baseline_.frozen_before[b].abs().max().item<float>(), 0.0f) << "block " << b;
    EXPECT_TRUE(at::equal(baseline_.frozen_before[b], baseline_.frozen_after[b])) << "block " << b;
  }
  // The adapters moved: B started at zero.
  EXPECT_GT(baseline_.master[1].abs().max().item<float>(), 0.0f);
}

// By hand: 2 layers of dim 64, q 64x64, k and v 32x64, o 64x64, w1/w3 96x64,
// w2 64x96, r 4. A layer's adapters: q 4x(64+64), k 4x(64+32), v 4x(64+32),
// o 4x(64+64), gate 4x(64+96), up 4x(64+96), down 4x(96+64) = 512 + 384 + 384
// + 512 + 640 + 640 + 640 = 3,712, padded to 4,096. Its base: 4096 + 2 x 2048
// + 4096 + 3 x 6144 + 2 x 64 = 30,848, padded to 32,768; the embedding 256 x
// 64 = 16,384; the head's norm 64, padded to 2,048.
TEST_F(LoraTrainTest, OnlyTheAdaptersHaveGradientsAndOptimizerState) {
  const PlacementPlan& p = baseline_.plan;
  EXPECT_EQ(p.state.shard_space_numel, 2 * 4096);
  EXPECT_EQ(p.state.frozen_space_numel, 16384 + 2 * 32768 + 2048);
  for (Category c : {Category::kGrad, Category::kMaster, Category::kExpAvg, Category::kExpAvgSq}) {
    EXPECT_EQ(p.state.category_total(c), 2 * 4096 * 4) << category_name(c);
  }
  EXPECT_EQ(p.state.category_total(Category::kParam16), 2 * 4096 * 4);  // fp32 run: the adapters' working copy
  EXPECT_EQ(p.state.category_total(Category::kFrozen), (16384 + 2 * 32768 + 2048) * 4);
}

TEST_F(LoraTrainTest, FrozenBaseOnHostIsBitIdenticalAndOnlyRead) {
  const LoraRun r = train(lora_config(data_), {"zero_optimization.stage=3", "zero_optimization.offload_param.device=cpu"});
  expect_identical(baseline_, r, "base on host");
  EXPECT_EQ(r.plan.state.bytes[size_t(Category::kFrozen)][size_t(Tier::kHost)], (16384 + 2 * 32768 + 2048) * 4);
  EXPECT_GT(r.links.h2d, 0);
  EXPECT_EQ(r.links.nvme_read + r.links.nvme_write, 0);
  for (size_t b = 0; b < r.frozen_before.size(); ++b) {
    EXPECT_TRUE(at::equal(r.frozen_before[b], r.frozen_after[b])) << "block " << b;
    EXPECT_TRUE(at::equal(r.frozen_before[b], baseline_.frozen_before[b])) << "block " << b;
  }
}

TEST_F(LoraTrainTest, FrozenBaseOnNvmeIsBitIdenticalAndNeverWritten) {
  // No persistent blocks (they would be fetched once per run): every use reads.
  const std::vector<std::string> set = {"zero_optimization.stage=3", "zero_optimization.offload_param.device=nvme",
                                        "zero_optimization.offload_param.nvme_path=" + swap_,
                                        "zero_optimization.offload_param.max_in_cpu=0",
                                        "zero_optimization.stage3_param_persistence_threshold=0"};
  const LoraRun r = train(lora_config(data_), set);
  expect_identical(baseline_, r, "base on nvme");
  EXPECT_EQ(r.plan.state.bytes[size_t(Category::kFrozen)][size_t(Tier::kNvme)], (16384 + 2 * 32768 + 2048) * 4);
  EXPECT_GT(r.links.nvme_read, 0);
  // offload_param places the base; the adapters' working copy stays on the device.
  EXPECT_EQ(r.plan.state.bytes[size_t(Category::kParam16)][size_t(Tier::kDevice)], 2 * 4096 * 4);
  EXPECT_EQ(r.links.nvme_write, 0) << "nothing but the frozen base is on NVMe, and it is never written";
  EXPECT_EQ(r.links.d2h, 0);
  // Each step reads what the bound's byte count says.
  const Config cfg = parse_config(lora_config(data_), set);
  const StepWork w = predicted_work(cfg, r.plan, train_fetches(r.plan), NetworkBytes());
  EXPECT_GT(w.links.nvme_read, 0);
  for (size_t s = 0; s < r.step_links.size(); ++s) {
    EXPECT_EQ(r.step_links[s].nvme_read, w.links.nvme_read) << "step " << s + 1;
    EXPECT_EQ(r.step_links[s].h2d, w.links.h2d) << "step " << s + 1;
  }
  for (size_t b = 0; b < r.frozen_before.size(); ++b) {
    EXPECT_TRUE(at::equal(r.frozen_before[b], r.frozen_after[b])) << "block " << b;
    EXPECT_TRUE(at::equal(r.frozen_before[b], baseline_.frozen_before[b])) << "block " << b;
  }
}

TEST_F(LoraTrainTest, EveryPlacementScheduleAndRecomputeIsBitIdentical) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> variants = {
      {"three-way split",
       {"placement.nvme_path=" + swap_, "placement.param16={\"device\":0.3,\"host\":0.3,\"nvme\":0.4}",
        "placement.master={\"device\":0.2,\"host\":0.4,\"nvme\":0.4}"}},
      {"optimizer on nvme", {"zero_optimization.offload_optimizer.device=nvme",
                             "zero_optimization.offload_optimizer.nvme_path=" + swap_}},
      {"optimizer on host, speculating", {"zero_optimization.offload_optimizer.device=cpu", "optimizer.speculate=on"}},
      {"auto under a small device budget", {"placement.auto=true", "placement.nvme_path=" + swap_,
                                            "run.device_memory_mb=1"}},
      {"layer schedule", {"run.schedule=layer"}},
      {"micro_batch schedule", {"run.schedule=micro_batch"}},
      {"recompute always", {"run.recompute=always"}},
      {"recompute never", {"run.recompute=never"}},
  };
  for (const auto& [what, set] : variants) {
    SCOPED_TRACE(what);
    expect_identical(baseline_, train(lora_config(data_), set), what);
  }
}

TEST_F(LoraTrainTest, DropoutTrainsBitForBitAcrossRecomputeAndPlacement) {
  nlohmann::json j = lora_config(data_);
  j["lora"]["lora_dropout"] = 0.1;
  const LoraRun a = train(j, {"run.recompute=never"});
  const LoraRun b = train(j, {"run.recompute=always", "zero_optimization.stage=3", "zero_optimization.offload_param.device=cpu"});
  expect_identical(a, b, "dropout, recompute and placement");
  // Dropout changes the arithmetic.
  EXPECT_NE(a.losses[1], baseline_.losses[1]);
}

// bf16: a 16-bit base beside fp32 adapters (their working copy, gradients,
// master and moments); every placement of the base trains bit for bit as the
// base on the device, and the adapters' working copy is fp32.
TEST_F(LoraTrainTest, Bf16BaseTrainsBitForBitInEveryPlacement) {
  nlohmann::json j = lora_config(data_);
  j["bf16"] = {{"enabled", true}};
  const LoraRun base = train(j, {});
  EXPECT_EQ(base.plan.state.elem_bytes[size_t(Category::kParam16)], 4);
  EXPECT_EQ(base.plan.state.elem_bytes[size_t(Category::kFrozen)], 2);
  EXPECT_EQ(base.plan.state.category_total(Category::kFrozen), (16384 + 2 * 32768 + 2048) * 2);
  EXPECT_LT(base.losses.back(), base.losses.front() - 0.05);
  // Close to the fp32 run: the same adapters over a base rounded to bf16.
  EXPECT_LE(std::abs(base.losses[0] - baseline_.losses[0]), 2e-2 * baseline_.losses[0]);
  const std::vector<std::pair<std::string, std::vector<std::string>>> variants = {
      {"base on nvme", {"zero_optimization.stage=3", "zero_optimization.offload_param.device=nvme",
                        "zero_optimization.offload_param.nvme_path=" + swap_,
                        "zero_optimization.offload_param.max_in_cpu=0"}},
      {"base on host, optimizer on host, speculating",
       {"zero_optimization.stage=3", "zero_optimization.offload_param.device=cpu",
        "zero_optimization.offload_optimizer.device=cpu", "optimizer.speculate=on"}},
      {"recompute always, layer schedule", {"run.recompute=always", "run.schedule=layer"}},
  };
  for (const auto& [what, set] : variants) {
    SCOPED_TRACE(what);
    const LoraRun r = train(j, set);
    expect_identical(base, r, what);
    for (size_t b = 0; b < r.frozen_before.size(); ++b) {
      EXPECT_TRUE(at::equal(r.frozen_before[b], r.frozen_after[b])) << "block " << b;
    }
  }
}

// Writes Strata's initial adapters for `cfg` (by name and layer) and `spec`
// into `dir`, runs tests/peft_train.py there and returns its per-step
// reference (null, with a test failure, when it fails).
nlohmann::json peft_reference(const Config& cfg, nlohmann::json spec, const TempDir& dir) {
  {
    Model model(cfg.model);
    Trainer trainer(cfg, model);
    for (int64_t l = 0; l < cfg.model.n_layers; ++l) {
      const BlockLayout& bl = trainer.layout().block(size_t(l) + 1);
      const at::Tensor flat = trainer.master_block(size_t(l) + 1);
      for (const ParamLayout& p : bl.params) {
        spec["adapters"][p.spec.name] = p.spec.shape;
        const at::Tensor v = flat.narrow(0, p.offset, p.spec.numel()).contiguous();
        std::ofstream(dir.file(p.spec.name + "." + std::to_string(l) + ".bin"), std::ios::binary)
            .write(reinterpret_cast<const char*>(v.data_ptr<float>()), std::streamsize(v.numel() * 4));
      }
    }
  }
  std::ofstream(dir.file("spec.json")) << spec.dump();
  Result ref = sh(kPython + " " + std::string(STRATA_SOURCE_DIR) + "/tests/peft_train.py " + dir.path());
  EXPECT_EQ(ref.code, 0) << ref.output;
  if (ref.code != 0) return nullptr;
  return nlohmann::json::parse(file_contents(dir.file("reference.json")));
}

// 10 clipped fp32 steps against transformers + PEFT + torch AdamW on the same
// base (written by transformers, read through model.init_from), adapters
// (Strata's initial ones) and batches.
TEST(LoraPeftTrainTest, TenClippedStepsMatchPeftAndTorchAdamW) {
  if (sh(kPython + " -c 'import peft, transformers'").code != 0) {
    if (testing::under_ci()) FAIL() << "no peft in .venv under CI";
    GTEST_SKIP() << "no peft in .venv (tools/setup.sh installs it)";
  }
  TempDir dir;
  const std::string base = dir.file("base");
  Result made = sh(kPython + " -c \"import torch, transformers; torch.manual_seed(3); "
                   "c = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, "
                   "num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, "
                   "max_position_embeddings=32, tie_word_embeddings=False); "
                   "transformers.LlamaForCausalLM(c).save_pretrained('" + base + "')\"");
  ASSERT_EQ(made.code, 0) << made.output;
  const std::string data = dir.write("text.txt", testing::sample_text(20000));
  nlohmann::json j = lora_config(data);
  j["model"] = {{"init_from", base}, {"seq_len", 32}};
  j["lora"]["target_modules"] = {"q_proj", "v_proj", "o_proj", "down_proj"};
  j["lora"]["use_rslora"] = true;
  const int steps = 10;
  Config cfg = parse_config(j);
  // The batches, drawn once, fed to both.
  const int64_t seqs = cfg.train_batch_size, width = cfg.model.seq_len + 1;
  std::vector<int64_t> tokens(size_t(steps * seqs * width));
  {
    TokenDataset ds(cfg.data.paths, TokenFormat::kText, 256, cfg.model.seq_len, 0.0);
    std::mt19937_64 rng(9);
    for (int s = 0; s < steps; ++s) ds.sample_train(rng, seqs, tokens.data() + s * seqs * width);
  }
  std::ofstream(dir.file("tokens.bin"), std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(tokens.size() * 8));
  // Strata's initial adapters, by name and layer.
  nlohmann::json spec = {{"base", base}, {"r", 4}, {"lora_alpha", 8}, {"use_rslora", true},
                         {"target_modules", j["lora"]["target_modules"]}, {"lr", 1e-2}, {"beta1", 0.9},
                         {"beta2", 0.999}, {"eps", 1e-8}, {"weight_decay", 0.1}, {"clip", 0.05},
                         {"steps", steps}, {"sequences", seqs}, {"seq_len", cfg.model.seq_len},
                         {"micro_batch", cfg.train_micro_batch_size_per_gpu}, {"n_layers", cfg.model.n_layers}};
  const nlohmann::json expect = peft_reference(cfg, spec, dir);
  ASSERT_FALSE(expect.is_null());
  const LoraRun mine = train(j, {}, steps, &tokens);
  ASSERT_EQ(expect.size(), size_t(steps));
  int clipped = 0;
  for (int s = 0; s < steps; ++s) {
    const double loss = expect[size_t(s)]["loss"], norm = expect[size_t(s)]["grad_norm"];
    EXPECT_LE(std::abs(mine.losses[size_t(s)] - loss), 1e-5 * std::abs(loss)) << "step " << s + 1;
    // The norms to 2e-5: the head's fused cross-entropy (Note [Fused cross-entropy]) rounds its gradient
    // differently from LibTorch's log_softmax backward (an ulp or two), which lr 1e-2 carries to 1.0e-5 by step 9.
    EXPECT_LE(std::abs(mine.norms[size_t(s)] - norm), 2e-5 * std::abs(norm)) << "step " << s + 1;
    clipped += norm > 0.05;
  }
  EXPECT_GT(clipped, 0) << "the clip never acted: the test would not see a clipping difference";
  EXPECT_LT(mine.losses.back(), mine.losses.front());
}

// Fine-tuning data (docs/token-format.md, "Examples and loss masks"): 10
// clipped fp32 steps on packed examples whose prompts are masked, against
// transformers + PEFT + torch AdamW with labels -100 there and each
// micro-batch's loss over the step's counted targets (num_items_in_batch, as
// transformers' Trainer); one micro-batch of step 3 counts nothing (a zero
// loss, no NaN). Per-step loss and norm within 1e-5.
TEST(LoraPeftTrainTest, MaskedExamplesMatchTransformersWithNumItemsInBatch) {
  if (sh(kPython + " -c 'import peft, transformers'").code != 0) {
    if (testing::under_ci()) FAIL() << "no peft in .venv under CI";
    GTEST_SKIP() << "no peft in .venv (tools/setup.sh installs it)";
  }
  TempDir dir;
  const std::string base = dir.file("base");
  Result made = sh(kPython + " -c \"import torch, transformers; torch.manual_seed(4); "
                   "c = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, "
                   "num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, "
                   "max_position_embeddings=32, tie_word_embeddings=False); "
                   "transformers.LlamaForCausalLM(c).save_pretrained('" + base + "')\"");
  ASSERT_EQ(made.code, 0) << made.output;
  // 60 examples of 5 to 24 byte tokens of text, the first half of each masked.
  const std::string text = testing::sample_text(4000);
  std::string ids, mask, index(8, '\0');
  int64_t at = 0, tokens_total = 0;
  for (int e = 0; e < 60; ++e) {
    const int len = 5 + (e * 7) % 20;
    for (int t = 0; t < len; ++t) {
      const unsigned char c = static_cast<unsigned char>(text[size_t(at++) % text.size()]);
      ids.push_back(char(c));
      ids.push_back('\0');
      mask.push_back(t < len / 2 ? 0 : 1);
    }
    tokens_total += len;
    for (int b = 0; b < 8; ++b) index.push_back(char((uint64_t(tokens_total) >> (8 * b)) & 0xff));
  }
  const std::string data = dir.write("ex.bin", ids);
  dir.write("ex.bin.mask", mask);
  dir.write("ex.bin.idx", index);
  dir.write("ex.bin.json", nlohmann::json({{"format", "strata-tokens"}, {"version", 2}, {"vocab_size", 256},
                                           {"tokens", tokens_total}, {"dtype", "uint16"}, {"examples", 60},
                                           {"mask", "ex.bin.mask"}, {"index", "ex.bin.idx"}})
                                .dump());
  nlohmann::json j = lora_config(data);
  j["model"] = {{"init_from", base}, {"seq_len", 32}};
  j["data"]["sampling"] = "packed";
  j["lora"]["target_modules"] = {"q_proj", "k_proj", "up_proj", "down_proj"};
  const int steps = 10;
  Config cfg = parse_config(j);
  const int64_t seqs = cfg.train_batch_size, width = cfg.model.seq_len + 1;
  std::vector<int64_t> tokens(size_t(steps * seqs * width));
  {
    TokenDataset ds(cfg.data, 256, cfg.model.seq_len);
    ExampleCursor cur;
    for (int s = 0; s < steps; ++s) ds.sample_examples(cur, 9, seqs, tokens.data() + s * seqs * width);
  }
  // Step 3's first micro-batch (2 sequences) counts nothing.
  for (int64_t i = 0; i < 2 * width; ++i) tokens[size_t(2 * seqs * width + i)] |= kNotCounted;
  std::ofstream(dir.file("tokens.bin"), std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(tokens.size() * 8));
  nlohmann::json spec = {{"base", base}, {"r", 4}, {"lora_alpha", 8}, {"use_rslora", false},
                         {"target_modules", j["lora"]["target_modules"]}, {"lr", 1e-2}, {"beta1", 0.9},
                         {"beta2", 0.999}, {"eps", 1e-8}, {"weight_decay", 0.1}, {"clip", 0.05},
                         {"steps", steps}, {"sequences", seqs}, {"seq_len", cfg.model.seq_len},
                         {"micro_batch", cfg.train_micro_batch_size_per_gpu}, {"n_layers", cfg.model.n_layers},
                         {"masked", true}};
  const nlohmann::json expect = peft_reference(cfg, spec, dir);
  ASSERT_FALSE(expect.is_null());
  const LoraRun mine = train(j, {}, steps, &tokens, /*masked=*/true);
  ASSERT_EQ(expect.size(), size_t(steps));
  int clipped = 0;
  for (int s = 0; s < steps; ++s) {
    const double loss = expect[size_t(s)]["loss"], norm = expect[size_t(s)]["grad_norm"];
    ASSERT_TRUE(std::isfinite(mine.losses[size_t(s)])) << "step " << s + 1;
    EXPECT_LE(std::abs(mine.losses[size_t(s)] - loss), 1e-5 * std::abs(loss)) << "step " << s + 1;
    // The norms to 2e-5: the head's fused cross-entropy (Note [Fused cross-entropy]) rounds its gradient
    // differently from LibTorch's log_softmax backward (an ulp or two), which lr 1e-2 carries to 1.0e-5 by step 9.
    EXPECT_LE(std::abs(mine.norms[size_t(s)] - norm), 2e-5 * std::abs(norm)) << "step " << s + 1;
    clipped += norm > 0.05;
  }
  EXPECT_GT(clipped, 0);
  EXPECT_LT(mine.losses.back(), mine.losses.front());
}

// The base LoRA trains over, written by transformers.
std::string make_base(const TempDir& dir, bool tied, int seed = 3) {
  const std::string base = dir.file((tied ? "base-tied-" : "base-") + std::to_string(seed));
  Result made = sh(kPython + " -c \"import torch, transformers; torch.manual_seed(" + std::to_string(seed) + "); "
                   "c = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, "
                   "num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, "
                   "max_position_embeddings=32, tie_word_embeddings=" + std::string(tied ? "True" : "False") + "); "
                   "transformers.LlamaForCausalLM(c).save_pretrained('" + base + "')\"");
  EXPECT_EQ(made.code, 0) << made.output;
  return base;
}

// strata export of a LoRA checkpoint: PEFT loads it with every adapter key
// and no other, and computes Strata's evaluation loss; that adapter then
// starts a run (lora.init_from) whose first evaluation is the same.
TEST(LoraExportTest, PeftLoadsTheExportAndItStartsTraining) {
  if (sh(kPython + " -c 'import peft, transformers'").code != 0) {
    if (testing::under_ci()) FAIL() << "no peft in .venv under CI";
    GTEST_SKIP() << "no peft in .venv (tools/setup.sh installs it)";
  }
  TempDir dir;
  const std::string base = make_base(dir, true);
  const std::string data = dir.write("text.txt", testing::sample_text(20000));
  nlohmann::json j = lora_config(data);
  j["model"] = {{"init_from", base}, {"seq_len", 32}};
  j["lora"]["target_modules"] = {"q_proj", "k_proj", "gate_proj", "down_proj"};
  const std::string ck = dir.file("ck");
  // Eval tokens: two sequences.
  Config cfg = parse_config(j);
  std::vector<int64_t> eval(size_t(2 * (cfg.model.seq_len + 1)));
  {
    TokenDataset ds(cfg.data.paths, TokenFormat::kText, 256, cfg.model.seq_len, 0.0);
    std::mt19937_64 rng(17);
    ds.sample_train(rng, 2, eval.data());
  }
  std::ofstream(dir.file("eval.bin"), std::ios::binary)
      .write(reinterpret_cast<const char*>(eval.data()), std::streamsize(eval.size() * 8));
  double strata_loss = 0.0;
  {
    testing::TrainingSession s(j, {});
    s.train(3);
    s.save(ck);
    strata_loss = s.trainer().eval_loss(eval.data(), 1);
  }
  const std::string out = dir.file("adapter");
  Result e = sh(std::string(STRATA_BINARY_DIR) + "/strata export " + ck + " --out " + out);
  ASSERT_EQ(e.code, 0) << e.output;
  const nlohmann::json ac = nlohmann::json::parse(file_contents(out + "/adapter_config.json"));
  EXPECT_EQ(ac["peft_type"], "LORA");
  EXPECT_EQ(ac["task_type"], "CAUSAL_LM");
  EXPECT_EQ(ac["r"], 4);
  EXPECT_EQ(ac["base_model_name_or_path"], base);
  EXPECT_EQ(ac["target_modules"], nlohmann::json({"q_proj", "k_proj", "gate_proj", "down_proj"}));
  Result r = sh(kPython + " " + std::string(STRATA_SOURCE_DIR) + "/tests/peft_eval.py " + base + " " + out + " " +
                dir.file("eval.bin") + " 2 " + std::to_string(cfg.model.seq_len + 1));
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json got = nlohmann::json::parse(r.output.substr(r.output.rfind('{')));
  EXPECT_EQ(got["adapter_tensors"], 2 * 4 * 2);  // 2 layers x 4 modules x (A, B)
  EXPECT_TRUE(got["missing"].empty()) << got.dump();
  EXPECT_TRUE(got["unexpected"].empty()) << got.dump();
  const double peft_loss = got["loss"];
  EXPECT_LE(std::abs(strata_loss - peft_loss), 1e-5 * std::abs(peft_loss)) << strata_loss << " vs " << peft_loss;

  // --merged: the full model, base + scaling B A, that transformers loads
  // alone, with the same loss (fp32: the merge's only rounding is fp32's).
  const std::string merged = dir.file("merged");
  Result mg = sh(std::string(STRATA_BINARY_DIR) + "/strata export " + ck + " --out " + merged + " --merged --dtype fp32");
  ASSERT_EQ(mg.code, 0) << mg.output;
  Result rm = sh(kPython + " " + std::string(STRATA_SOURCE_DIR) + "/tests/peft_eval.py " + merged + " none " +
                 dir.file("eval.bin") + " 2 " + std::to_string(cfg.model.seq_len + 1));
  ASSERT_EQ(rm.code, 0) << rm.output;
  const double merged_loss = nlohmann::json::parse(rm.output.substr(rm.output.rfind('{')))["loss"];
  EXPECT_LE(std::abs(strata_loss - merged_loss), 1e-5 * std::abs(merged_loss)) << strata_loss << " vs " << merged_loss;
  // Merging needs a checkpoint of a LoRA run.
  Result bad = sh(std::string(STRATA_BINARY_DIR) + "/strata export " + ck + " --out " + dir.file("m2") +
                  " --merged --dtype int8 2>&1");
  EXPECT_EQ(bad.code, 2) << bad.output;

  // The exported adapter (as PEFT would have made it) starts a run.
  nlohmann::json again = j;
  again["lora"] = {{"init_from", out}};
  testing::TrainingSession s2(again, {});
  EXPECT_EQ(s2.cfg().model.lora.r, 4);
  EXPECT_LE(std::abs(s2.trainer().eval_loss(eval.data(), 1) - strata_loss), 1e-6 * std::abs(strata_loss));
  EXPECT_TRUE(std::isfinite(s2.step().loss));
  // An adapter for another rank is refused naming the file and both shapes.
  nlohmann::json wrong = again;
  wrong["lora"]["r"] = 8;
  try {
    testing::TrainingSession s3(wrong, {});
    FAIL() << "an adapter of rank 4 loaded into r 8";
  } catch (const Error& err) {
    const std::string msg = err.what();
    EXPECT_NE(msg.find("lora.r"), std::string::npos) << msg;
  }
  // Note [Base identity]: a base replaced under the same path is not merged into.
  const std::string other = make_base(dir, true, 5);
  ASSERT_EQ(sh("cp " + other + "/model.safetensors " + base + "/model.safetensors").code, 0);
  Result moved = sh(std::string(STRATA_BINARY_DIR) + "/strata export " + ck + " --out " + dir.file("m3") + " --merged 2>&1");
  EXPECT_EQ(moved.code, 2) << moved.output;
  EXPECT_NE(moved.output.find("lora_base"), std::string::npos) << moved.output;
}

// Note [Base identity]: a checkpoint's adapters resume over the base they
// were trained on, and a resume over another base of the same shape is one
// line naming lora_base (exit 2), before anything is allocated.
TEST(LoraResumeTest, AResumeOverAnotherBaseIsRefused) {
  if (sh(kPython + " -c 'import transformers'").code != 0) {
    if (testing::under_ci()) FAIL() << "no transformers in .venv under CI";
    GTEST_SKIP() << "no transformers in .venv (tools/setup.sh installs it)";
  }
  TempDir dir;
  const std::string a = make_base(dir, true, 3), b = make_base(dir, true, 4);
  const std::string data = dir.write("text.txt", testing::sample_text(20000));
  auto write_config = [&](const std::string& base, const std::string& name) {
    nlohmann::json j = lora_config(data);
    j["model"] = {{"init_from", base}, {"seq_len", 32}};
    j["run"]["checkpoint"] = {{"dir", dir.file("ck")}};
    j["run"]["steps"] = 2;
    std::ofstream(dir.file(name)) << j.dump();
    return dir.file(name);
  };
  const std::string strata = std::string(STRATA_BINARY_DIR) + "/strata";
  Result first = sh(strata + " train " + write_config(a, "a.json") + " 2>&1");
  ASSERT_EQ(first.code, 0) << first.output;
  Result other = sh(strata + " train " + write_config(b, "b.json") + " --resume --steps 3 2>&1");
  EXPECT_EQ(other.code, 2) << other.output;
  EXPECT_NE(other.output.find("lora_base"), std::string::npos) << other.output;
  Result same = sh(strata + " train " + dir.file("a.json") + " --resume --steps 3 2>&1");
  EXPECT_EQ(same.code, 0) << same.output;
}

// LoRA (docs/design.md, "State kinds"): on a GPU, auto's candidates put part
// of a frozen base that greedy keeps in host RAM on NVMe instead, leaving
// that RAM to host-kept activations. configs/lora-70b-h100.json's shape with
// 4 micro-batches a step on one H100 with 150 GB of host RAM under the layer
// schedule (the base fills that RAM; the layers' entries that could take it
// are recomputed): with a disk fast enough that reading the base twice a
// step hides under the compute, auto takes the candidate with no base in
// host RAM (more packs kept, a bound lower by more than 10%); with a slow one
// the greedy fill stays. A candidate's cap holds: the base's host bytes stay
// under it, the rest on NVMe.
TEST(LoraPlanTest, AutoTradesAFrozenBaseInHostRamForKeptActivations) {
  Config cfg = load_config(std::string(STRATA_SOURCE_DIR) + "/configs/lora-70b-h100.json",
                           {"run.schedule=layer", "placement.headroom=0.03", "gradient_accumulation_steps=4"}, 1);
  const StateLayout layout(model_layout_specs(cfg.model), shard_count(cfg), frozen_shard_count(cfg));
  MachineCapacity cap;
  cap.device_is_host = false;
  cap.device_addressable = false;
  cap.device_bytes = (81559LL - 512) << 20;
  cap.host_bytes = 150'000'000'000LL;
  cap.nvme_bytes = 2'000'000'000'000LL;
  Rates r;
  r.device_flops = 544e12, r.h2d = r.d2h = 55e9, r.pcie_both = 64e9, r.adam = 2e9, r.grad_add = 2e9, r.checksum = 100e9;
  const auto frozen = [](const PlacementPlan& p, Tier t) { return p.state.bytes[size_t(Category::kFrozen)][size_t(t)]; };
  r.nvme_read = r.nvme_write = r.nvme_both = 40e9;
  const PlacementPlan fast = choose_by_bound(cfg, layout, 0, cap, r);
  const PlacementPlan greedy = best_activations(cfg, layout, 0, cap, r);
  ASSERT_GT(frozen(greedy, Tier::kHost), 0);
  EXPECT_EQ(frozen(fast, Tier::kHost), 0) << fast.state.auto_choice;
  EXPECT_GT(frozen(fast, Tier::kNvme), 0);
  EXPECT_GT(fast.activations.keep_host_packs, greedy.activations.keep_host_packs);
  EXPECT_NE(fast.state.auto_choice.find("frozen base: at most 0 B in host RAM"), std::string::npos)
      << fast.state.auto_choice;
  r.nvme_read = r.nvme_write = r.nvme_both = 2e9;
  const PlacementPlan slow = choose_by_bound(cfg, layout, 0, cap, r);
  EXPECT_EQ(frozen(slow, Tier::kHost), frozen(greedy, Tier::kHost)) << slow.state.auto_choice;
  EXPECT_EQ(frozen(slow, Tier::kNvme), 0);
  Config capped = cfg;
  capped.placement.auto_frozen_host_bytes = frozen(greedy, Tier::kHost) / 3;
  const PlacementPlan third = make_plan(capped, layout, 0, cap);
  EXPECT_LE(frozen(third, Tier::kHost), capped.placement.auto_frozen_host_bytes);
  EXPECT_GT(frozen(third, Tier::kHost), 0);
  EXPECT_EQ(frozen(third, Tier::kDevice) + frozen(third, Tier::kHost) + frozen(third, Tier::kNvme),
            frozen(greedy, Tier::kDevice) + frozen(greedy, Tier::kHost));
}

}  // namespace
}  // namespace strata
