// Mixture-of-experts models (families mixtral, qwen2_moe, qwen3_moe; Note
// [Experts] in src/model/experts.cc) against transformers 5.23 in .venv
// (tests/moe_ref.py): per family a tiny random model's logits and
// load-balancing loss from both checkpoint layouts, `strata export` in both
// layouts loaded back by transformers, and 10 clipped fp32 training steps
// with output_router_logits on against transformers + torch AdamW. Then
// through `strata train`: bit for bit across placements, schedules,
// speculation and recompute, 2 ranks at stages 0-3; the plan's expert rows
// and active FLOPs by hand; bad keys and weights one line naming them.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "data/dataset.h"
#include "engine/trainer.h"
#include "model/model.h"
#include "test_util.h"
#include "util/errors.h"
#include "util/fs.h"

namespace strata {
namespace {

using testing::Result;
using testing::sh;
using testing::TempDir;

const std::string kStrata = std::string(STRATA_BINARY_DIR) + "/strata";
const std::string kPython = std::string(STRATA_SOURCE_DIR) + "/.venv/bin/python";
const std::string kRef = std::string(STRATA_SOURCE_DIR) + "/tests/moe_ref.py";

bool have_transformers() { return sh(kPython + " -c 'import transformers, safetensors'").code == 0; }

// Per family: 4 experts of 48, top 2 (mixtral: 8 experts, top 2), qwen2_moe
// renormalising with a shared expert of 80, qwen3_moe not renormalising.
nlohmann::json family_spec(const std::string& family) {
  nlohmann::json s = {{"family", family}, {"tied", family == "qwen2_moe"}, {"experts", 4}, {"top_k", 2},
                      {"width", 48}, {"norm_topk_prob", family != "qwen3_moe"}, {"shared", 80}, {"coef", 0.02}};
  if (family == "mixtral") s["experts"] = 8;
  return s;
}

nlohmann::json train_config(const std::string& data, const nlohmann::json& model) {
  return {
      {"train_batch_size", 4},
      {"train_micro_batch_size_per_gpu", 2},
      {"gradient_clipping", 0.05},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.1}}}}},
      {"model", model},
      {"data", {{"path", data}, {"val_fraction", 0.0}}},
      {"run", {{"steps", 10}, {"seed", 3}, {"threads", 1}, {"log_level", "warn"}}},
  };
}

at::Tensor read_floats(const std::string& path, at::IntArrayRef shape) {
  const std::string b = file_contents(path);
  at::Tensor t = at::empty(shape, at::kFloat);
  EXPECT_EQ(size_t(t.numel() * 4), b.size()) << path;
  std::memcpy(t.data_ptr<float>(), b.data(), std::min(b.size(), size_t(t.numel() * 4)));
  return t;
}

// transformers' logits of `model_dir` on `tokens` [B, T]; *aux its aux_loss,
// *load (when given) per layer its busiest expert's tokens over the mean.
at::Tensor hf_logits(const TempDir& dir, const std::string& model_dir, const at::Tensor& tokens, double* aux,
                     const std::string& cls, std::vector<double>* load = nullptr) {
  const std::string tok = dir.file("tokens.bin"), out = dir.file("hf-logits.bin");
  std::ofstream(tok, std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data_ptr<int64_t>()), std::streamsize(tokens.numel() * 8));
  Result r = sh(kPython + " " + kRef + " logits " + model_dir + " " + tok + " " + std::to_string(tokens.size(0)) + " " +
                std::to_string(tokens.size(1)) + " " + out);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("class " + cls + "\n"), std::string::npos) << r.output;
  const size_t at = r.output.rfind("aux ");
  *aux = at == std::string::npos ? -1.0 : std::stod(r.output.substr(at + 4));
  if (load != nullptr) {
    const size_t l = r.output.rfind("load ");
    EXPECT_NE(l, std::string::npos) << r.output;
    if (l != std::string::npos) {
      std::istringstream in(r.output.substr(l + 5));
      for (double v; in >> v;) load->push_back(v);
    }
  }
  return read_floats(out, {tokens.size(0), tokens.size(1), 256});
}

// Strata's forward over blocks in fp32.
at::Tensor strata_logits(Trainer& trainer, const Model& model, const at::Tensor& tokens) {
  std::vector<std::vector<at::Tensor>> w;
  for (size_t b = 0; b < model.num_blocks(); ++b) w.push_back(trainer.block_weights(b));
  at::Tensor x = model.forward(0, w[0], tokens);
  for (size_t b = 1; b + 1 < model.num_blocks(); ++b) x = model.forward(b, w[b], x);
  const at::Tensor tied = model.config().tie_embeddings ? w[0][0] : at::Tensor();
  return model.forward(model.num_blocks() - 1, w.back(), x, tied);
}

double max_rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

const char* class_of(const std::string& family) {
  return family == "mixtral" ? "MixtralForCausalLM" : family == "qwen2_moe" ? "Qwen2MoeForCausalLM" : "Qwen3MoeForCausalLM";
}

class MoeHfTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!have_transformers()) {
      if (testing::under_ci()) FAIL() << "no transformers in .venv under CI";
      GTEST_SKIP() << "no transformers in .venv (tools/setup.sh installs it)";
    }
    data_ = dir_.write("data.txt", testing::sample_text(30000));
    Result r = sh(kPython + " " + kRef + " make " + dir_.file("hf") + " '" + family_spec(GetParam()).dump() + "'");
    ASSERT_EQ(r.code, 0) << r.output;
  }
  TempDir dir_;
  std::string data_;
};

// From either layout, model.init_from's config.json fills the MoE keys;
// Strata's logits are transformers' (fp32, 1e-5 of the largest), the first
// step's loss and aux_loss are transformers' on the same windows (1e-5,
// 1e-6); after 3 steps the export in each layout loads in transformers as
// the family's class and computes Strata's logits.
TEST_P(MoeHfTest, LogitsAndAuxMatchTransformersFromBothLayoutsAndExportRoundTrips) {
  const std::string family = GetParam();
  const nlohmann::json spec = family_spec(family);
  const int64_t T = 32;
  std::vector<int64_t> batch(size_t(2 * (T + 1)));
  TokenDataset ds({data_}, TokenFormat::kText, 256, T, 0.0);
  std::mt19937_64 rng(9);
  ds.sample_train(rng, 2, batch.data());
  const at::Tensor tokens = at::from_blob(batch.data(), {2, T + 1}, at::kLong).narrow(1, 0, T).contiguous();
  for (const std::string layout : {"per_expert", "fused"}) {
    SCOPED_TRACE(family + " " + layout);
    double hf_aux = 0.0;
    std::vector<double> hf_load;
    const at::Tensor theirs = hf_logits(dir_, dir_.file("hf/" + layout), tokens, &hf_aux, class_of(family), &hf_load);
    nlohmann::json j = train_config(data_, {{"seq_len", T}, {"init_from", dir_.file("hf/" + layout)}});
    j["train_batch_size"] = 2;
    Config cfg = parse_config(j);
    EXPECT_EQ(model_family_name(cfg.model.family), family);
    EXPECT_EQ(cfg.model.moe.num_experts, spec["experts"].get<int64_t>());  // filled from config.json
    EXPECT_EQ(cfg.model.expert_dim(), 48);
    EXPECT_EQ(cfg.model.moe.norm_topk_prob, spec["norm_topk_prob"].get<bool>());
    EXPECT_DOUBLE_EQ(cfg.model.moe.router_aux_loss_coef, 0.02);
    Model model(cfg.model);
    Trainer trainer(cfg, model);
    const at::Tensor mine = strata_logits(trainer, model, tokens);
    EXPECT_LE(max_rel(mine, theirs), 1e-5);
    // The step's statistics are the initial weights' on the same windows.
    const StepResult r = trainer.step(batch.data());
    const at::Tensor flat = theirs.reshape({-1, 256});
    const double hf_loss =
        at::cross_entropy_loss(flat, at::from_blob(batch.data(), {2, T + 1}, at::kLong).narrow(1, 1, T).reshape({-1}))
            .item<double>();
    EXPECT_LE(std::abs(r.loss - hf_loss), 1e-5 * hf_loss) << r.loss << " vs " << hf_loss;
    EXPECT_LE(std::abs(r.aux_loss - hf_aux), 1e-6 * hf_aux) << r.aux_loss << " vs " << hf_aux;
    EXPECT_GT(r.aux_loss, 0.0);
    // The expert load: transformers' routing counted per layer, the same.
    ASSERT_EQ(r.expert_load.size(), 2u);
    ASSERT_EQ(hf_load.size(), 2u);
    for (size_t l = 0; l < 2; ++l) EXPECT_NEAR(r.expert_load[l], hf_load[l], 1e-9) << "layer " << l;
    if (layout == std::string("fused")) continue;
    std::vector<int64_t> more(batch.size());
    for (int s = 0; s < 2; ++s) {
      ds.sample_train(rng, 2, more.data());
      trainer.step(more.data());
    }
    const std::string ck = dir_.file("ck-" + family);
    CheckpointOptions o;
    o.dir = ck;
    Manifest h;
    h.invariants = resume_invariants(cfg);
    trainer.save_checkpoint(o, h);
    const at::Tensor after = strata_logits(trainer, model, tokens);
    for (const std::string out_layout : {"per_expert", "fused"}) {
      const std::string out = dir_.file("export-" + out_layout);
      Result e = sh(kStrata + " export " + ck + " --out " + out + " --dtype fp32 --expert-layout " + out_layout +
                    " --max-shard-size 200KB");
      ASSERT_EQ(e.code, 0) << e.output;
      const bool fused = path_exists(out + "/model.safetensors.index.json") &&
                         file_contents(out + "/model.safetensors.index.json").find("gate_up_proj") != std::string::npos;
      EXPECT_EQ(fused, out_layout == std::string("fused")) << "the index names the fused tensors in the fused layout";
      double aux = 0.0;
      const at::Tensor back = hf_logits(dir_, out, tokens, &aux, class_of(family));
      EXPECT_LE(max_rel(after, back), 1e-5) << out_layout;
    }
  }
}

// 10 clipped fp32 steps (2 micro-batches a step, output_router_logits on,
// weight decay) against transformers + torch AdamW on the same weights and
// windows: per-step loss and aux loss within 1e-5, the norm 1e-4.
TEST_P(MoeHfTest, TenClippedStepsMatchTransformersAndTorchAdamW) {
  const std::string family = GetParam();
  const int steps = 10;
  nlohmann::json j = train_config(data_, {{"seq_len", 32}, {"init_from", dir_.file("hf/fused")},
                                          {"output_router_logits", true}});
  Config cfg = parse_config(j);
  ASSERT_TRUE(cfg.model.moe.output_router_logits);
  const int64_t seqs = cfg.train_batch_size, width = cfg.model.seq_len + 1;
  std::vector<int64_t> tokens(size_t(steps * seqs * width));
  TokenDataset ds(cfg.data.paths, TokenFormat::kText, 256, cfg.model.seq_len, 0.0);
  std::mt19937_64 rng(9);
  for (int s = 0; s < steps; ++s) ds.sample_train(rng, seqs, tokens.data() + s * seqs * width);
  std::ofstream(dir_.file("steps.bin"), std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(tokens.size() * 8));
  const std::string ref = dir_.file("ref");
  make_dirs(ref);
  rename_path(dir_.file("steps.bin"), ref + "/tokens.bin");
  const nlohmann::json spec = {{"model", dir_.file("hf/per_expert")}, {"steps", steps}, {"sequences", seqs},
                               {"seq_len", cfg.model.seq_len}, {"micro_batch", 2}, {"lr", 1e-2}, {"beta1", 0.9},
                               {"beta2", 0.999}, {"eps", 1e-8}, {"weight_decay", 0.1}, {"clip", 0.05}};
  std::ofstream(ref + "/spec.json") << spec.dump();
  Result r = sh(kPython + " " + kRef + " train " + ref);
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json expect = nlohmann::json::parse(file_contents(ref + "/reference.json"));
  ASSERT_EQ(expect.size(), size_t(steps));
  Model model(cfg.model);
  Trainer trainer(cfg, model);
  int clipped = 0;
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    const StepResult got = trainer.step(tokens.data() + s * seqs * width);
    const double loss = expect[size_t(s)]["loss"], aux = expect[size_t(s)]["aux_loss"];
    const double norm = expect[size_t(s)]["grad_norm"];
    EXPECT_LE(std::abs(got.loss - loss), 1e-5 * loss) << "step " << s + 1;
    EXPECT_LE(std::abs(got.aux_loss - aux), 1e-5 * aux) << "step " << s + 1;
    // The norm: 1e-4. Routing is discrete: where a token's k-th and (k+1)-th
    // probabilities differ by rounding, the two sides may choose different
    // experts for it, which moves the norm (a sum over the chosen experts'
    // gradients) more than the loss (measured: mixtral's 8 experts, step 10,
    // loss 1.4e-6, norm 2.2e-5, every earlier step within 2e-6).
    EXPECT_LE(std::abs(got.grad_norm - norm), 1e-4 * norm) << "step " << s + 1;
    clipped += norm > 0.05;
    losses.push_back(got.loss);
  }
  EXPECT_GT(clipped, 0) << "the clip never acted";
  EXPECT_LT(losses.back(), losses.front());
}

INSTANTIATE_TEST_SUITE_P(Families, MoeHfTest, ::testing::Values("mixtral", "qwen2_moe", "qwen3_moe"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// ---- through `strata train` and `strata plan` --------------------------------

// A tiny qwen2_moe (8 experts of 32, top 2, renormalised, a shared expert of
// 40, the load-balancing loss in the loss) from run.seed.
nlohmann::json cli_config(const std::string& data) {
  return {
      {"train_batch_size", 8},
      {"train_micro_batch_size_per_gpu", 2},
      {"gradient_clipping", 1.0},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}}}}},
      {"zero_optimization", {{"stage", 0}}},
      {"model", {{"family", "qwen2_moe"}, {"vocab_size", 256}, {"dim", 48}, {"n_layers", 2}, {"n_heads", 4},
                 {"seq_len", 48}, {"num_experts", 8}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 32},
                 {"shared_expert_intermediate_size", 40}, {"norm_topk_prob", true}, {"output_router_logits", true}}},
      {"data", {{"path", data}, {"val_fraction", 0.1}, {"eval_interval", 3}, {"eval_batches", 2}}},
      {"run", {{"steps", 6}, {"threads", 1}, {"log_level", "warn"}, {"seed", 5}}},
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

// The fields two runs of the same steps agree on bit for bit.
std::vector<std::string> training_fields(const std::vector<nlohmann::json>& m) {
  std::vector<std::string> out;
  for (const nlohmann::json& j : m) {
    out.push_back(j["loss"].dump() + " " + j["grad_norm"].dump() + " " + j["aux_loss"].dump() + " " +
                  j["expert_load"].dump() + " " + j.value("eval_loss", nlohmann::json()).dump());
  }
  return out;
}

class MoeTrainTest : public ::testing::Test {
 protected:
  void SetUp() override { data_ = dir_.write("data.txt", testing::sample_text(40000)); }
  Result train(const nlohmann::json& c, const std::string& name, const std::string& extra = "") {
    const std::string cfg = dir_.write(name + ".json", c.dump());
    return sh(kStrata + " train " + cfg + " --metrics " + dir_.file(name + ".jsonl") + " " + extra);
  }
  TempDir dir_;
  std::string data_;
};

// Experts live in their layer's block: every placement of the state, both
// schedules, the speculative optimizer and recompute always and never train
// bit for bit (loss, norm, aux loss, expert load, eval); the loss moves and
// the metrics line carries aux_loss and a load per layer.
TEST_F(MoeTrainTest, BitForBitAcrossPlacementsSchedulesSpeculationAndRecompute) {
  const std::string swap = dir_.file("swap");
  make_dirs(swap);
  const nlohmann::json c = cli_config(data_);
  Result r = train(c, "ref");
  ASSERT_EQ(r.code, 0) << r.output;
  const std::vector<nlohmann::json> ref = metrics(dir_.file("ref.jsonl"));
  ASSERT_EQ(ref.size(), 6u);
  EXPECT_LT(ref.back()["loss"].get<double>(), ref.front()["loss"].get<double>());
  for (const nlohmann::json& j : ref) {
    // Uniform routing gives aux = k = 2; a load of 1 is perfectly even, 4 is every token's k on 2 experts.
    EXPECT_GT(j["aux_loss"].get<double>(), 1.5);
    EXPECT_LT(j["aux_loss"].get<double>(), 8.0);
    ASSERT_EQ(j["expert_load"].size(), 2u);
    for (const nlohmann::json& l : j["expert_load"]) {
      EXPECT_GE(l.get<double>(), 1.0);
      EXPECT_LE(l.get<double>(), 4.0);
    }
  }
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
  v["optimizer"]["speculate"] = "on";
  v["run"]["overlap_optimizer"] = true;
  variants.push_back({"speculate", v});
  v = c;
  v["run"]["recompute"] = "always";
  variants.push_back({"recompute always", v});
  v["run"]["recompute"] = "never";
  variants.push_back({"recompute never", v});
  for (size_t i = 0; i < variants.size(); ++i) {
    const std::string file = "v" + std::to_string(i);
    Result t = train(variants[i].second, file);
    ASSERT_EQ(t.code, 0) << variants[i].first << "\n" << t.output;
    EXPECT_EQ(training_fields(metrics(dir_.file(file + ".jsonl"))), training_fields(ref)) << variants[i].first;
  }
}

// 2 ranks train as one rank (to rounding: the gradients are reduced in
// another order) at every ZeRO stage, the stages bit for bit with each
// other; the aux loss and expert load are the global batch's.
TEST_F(MoeTrainTest, TwoRanksTrainAsOneAtEveryStage) {
  nlohmann::json c = cli_config(data_);
  c["run"]["steps"] = 3;
  c["data"]["eval_interval"] = 0;
  ASSERT_EQ(train(c, "one").code, 0);
  const std::vector<nlohmann::json> one = metrics(dir_.file("one.jsonl"));
  ASSERT_EQ(one.size(), 3u);
  std::vector<std::string> stage0;
  for (int stage : {0, 1, 2, 3}) {
    const std::string m = dir_.file("two" + std::to_string(stage) + ".jsonl");
    nlohmann::json s = c;
    s["zero_optimization"]["stage"] = stage;
    const std::string cfg = dir_.write("two" + std::to_string(stage) + ".json", s.dump());
    Result r = sh(kStrata + " launch --nproc 2 -- strata train " + cfg + " --metrics " + m);
    ASSERT_EQ(r.code, 0) << r.output;
    const std::vector<nlohmann::json> two = metrics(m);
    ASSERT_EQ(two.size(), one.size());
    for (size_t i = 0; i < one.size(); ++i) {
      for (const char* k : {"loss", "aux_loss", "grad_norm"}) {
        const double a = one[i][k], b = two[i][k];
        EXPECT_LE(std::abs(a - b), 1e-5 * std::abs(a)) << k << " stage " << stage << " step " << i + 1;
      }
      EXPECT_EQ(one[i]["expert_load"], two[i]["expert_load"]) << "stage " << stage;
    }
    // Each rank's network bytes are the plan's prediction (the aux loss and
    // the expert load's all-reduces included).
    Result plan = sh(kStrata + " plan " + cfg + " --world-size 2 --json --no-bound 2>/dev/null");
    ASSERT_EQ(plan.code, 0) << plan.output;
    const int64_t predicted = nlohmann::json::parse(plan.output)["network"]["bytes_per_step_per_rank"];
    for (const nlohmann::json& line : two) EXPECT_EQ(line["net_bytes"].get<int64_t>(), predicted) << "stage " << stage;
    if (stage == 0) {
      stage0 = training_fields(two);
    } else {
      EXPECT_EQ(training_fields(two), stage0) << "stage " << stage;
    }
  }
}

// `strata plan`'s expert rows and active FLOPs against the arithmetic done
// by hand for cli_config's model: dim 48, 2 layers, 4 heads of 12, vocab 256
// tied, 8 experts of 32, top 2, a shared expert of 40, seq 48.
TEST_F(MoeTrainTest, PlanShowsExpertsAndActiveFlopsWorkedOutByHand) {
  const std::string cfg = dir_.write("plan.json", cli_config(data_).dump());
  Result r = sh(kStrata + " plan " + cfg + " --json --no-bound 2>/dev/null");
  ASSERT_EQ(r.code, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output);
  const nlohmann::json& e = j["experts"];
  // A layer: norms 2 x 48, q/k/v/o 4 x 48 x 48 = 9216, biases 3 x 48, router
  // 8 x 48 = 384, experts 8 x (2 x 32 x 48 + 48 x 32) = 36864, shared 3 x 40
  // x 48 = 5760 and its gate 48: 52512. Two layers, the embedding 256 x 48
  // = 12288 and the final norm 48: 117360.
  EXPECT_EQ(j["parameters"].get<int64_t>(), 117360);
  EXPECT_EQ(e["expert_parameters"].get<int64_t>(), 73728);  // 2 x 36864
  EXPECT_NEAR(e["expert_share"].get<double>(), 73728.0 / 117360.0, 1e-12);
  EXPECT_EQ(e["active_parameters"].get<int64_t>(), 117360 - 2 * 6 * 4608);  // 6 experts of 4608 skipped a layer
  // A token's forward per layer: 2 x (attention's 9216 + experts' 2 x 4608 +
  // router 384 + shared 5760 + its gate 48) + 4 x 48 x 48 for the scores =
  // 58464; the head 2 x 256 x 48; forward and backward 3x:
  // 3 x (2 x 58464 + 24576) = 424512.
  EXPECT_DOUBLE_EQ(e["active_flops_per_token"].get<double>(), 424512.0);
  // A step: 4 micro-batches of 2 x 48 tokens, k = 2 of 8 experts: 96 rows an expert.
  EXPECT_DOUBLE_EQ(e["tokens_per_expert_per_step"].get<double>(), 96.0);
  Result text = sh(kStrata + " plan " + cfg + " --no-bound 2>&1");
  EXPECT_NE(text.output.find("experts: 8 a layer of width 32, top 2, a shared expert of 40"), std::string::npos)
      << text.output;
}

// LoRA on an MoE model: the experts and router are frozen with the base;
// "all-linear" puts adapters on the attention's four linears only, and the
// exported adapter holds exactly those.
TEST_F(MoeTrainTest, LoraAdaptsTheAttentionOfAnMoeModel) {
  nlohmann::json c = cli_config(data_);
  c["lora"] = {{"r", 4}, {"lora_alpha", 8}, {"target_modules", "all-linear"}};
  c["optimizer"]["params"]["lr"] = 1e-2;
  c["run"]["checkpoint"] = {{"dir", dir_.file("ck")}};
  Result r = train(c, "lora");
  ASSERT_EQ(r.code, 0) << r.output;
  const std::vector<nlohmann::json> m = metrics(dir_.file("lora.jsonl"));
  ASSERT_EQ(m.size(), 6u);
  EXPECT_LT(m.back()["loss"].get<double>(), m.front()["loss"].get<double>());
  EXPECT_GT(m.back()["aux_loss"].get<double>(), 0.0);
  Result e = sh(kStrata + " export " + dir_.file("ck") + " --out " + dir_.file("adapter"));
  ASSERT_EQ(e.code, 0) << e.output;
  const std::string bytes = file_contents(dir_.file("adapter/adapter_model.safetensors"));
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n));
  int adapters = 0;
  for (const auto& [name, meta] : header.items()) {
    if (name == "__metadata__") continue;
    ++adapters;
    EXPECT_NE(name.find(".self_attn."), std::string::npos) << name;
  }
  EXPECT_EQ(adapters, 2 * 4 * 2);  // 2 layers x q, k, v, o x (A, B)
}

// Bad keys: one line naming the key, exit 2, nothing written.
TEST_F(MoeTrainTest, BadKeysAreOneLineNamingThem) {
  auto fails = [&](const nlohmann::json& c, const std::string& name, const std::string& words) {
    Result r = train(c, name);
    EXPECT_EQ(r.code, 2) << name << ": " << r.output;
    EXPECT_NE(r.output.find(words), std::string::npos) << name << ": " << r.output;
    EXPECT_NE(access(dir_.file(name + ".jsonl").c_str(), F_OK), 0) << name;
  };
  nlohmann::json c = cli_config(data_);
  c["model"]["num_experts_per_tok"] = 9;
  fails(c, "topk", "model.num_experts_per_tok: 9 is more than model.num_experts 8");
  c = cli_config(data_);
  c["model"]["decoder_sparse_step"] = 2;
  fails(c, "sparse", "model.decoder_sparse_step");
  c = cli_config(data_);
  c["model"]["mlp_only_layers"] = {1};
  fails(c, "mlponly", "model.mlp_only_layers");
  c = cli_config(data_);
  c["model"]["router_jitter_noise"] = 0.01;
  fails(c, "jitter", "model.router_jitter_noise");
  c = cli_config(data_);
  c["model"].erase("num_experts");
  fails(c, "noexperts", "model.num_experts: required");
  c = cli_config(data_);
  c["model"].erase("shared_expert_intermediate_size");
  fails(c, "noshared", "model.shared_expert_intermediate_size: required");
  c = cli_config(data_);
  c["model"]["family"] = "llama";
  fails(c, "dense", "model.num_experts: model.family llama has no experts");
  c = cli_config(data_);
  c["model"]["family"] = "mixtral";
  c["model"].erase("shared_expert_intermediate_size");
  c["model"]["norm_topk_prob"] = false;
  fails(c, "mixnorm", "model.norm_topk_prob");
  c = cli_config(data_);
  c["lora"] = {{"r", 4}, {"target_modules", {"q_proj", "down_proj"}}};
  fails(c, "loraexperts", "lora.target_modules");
  // Mixtral keeps its attention window (transformers applies it): one
  // shorter than a sequence is refused, as for mistral; qwen's is not kept.
  c = cli_config(data_);
  c["model"]["family"] = "mixtral";
  c["model"].erase("shared_expert_intermediate_size");
  c["model"]["sliding_window"] = 16;
  fails(c, "mixwindow", "model.sliding_window: 16 is shorter than model.seq_len 48");
  c["model"]["family"] = "qwen3_moe";
  fails(c, "qwenwindow", "model.sliding_window: only model.family mistral and mixtral");
}

// Weights that contradict the config: the key named with both values.
TEST(MoeWeightsTest, ExpertCountAndWidthAgainstTheWeightsNameTheKey) {
  if (!have_transformers()) {
    if (testing::under_ci()) FAIL() << "no transformers in .venv under CI";
    GTEST_SKIP() << "no transformers in .venv (tools/setup.sh installs it)";
  }
  TempDir dir;
  const std::string data = dir.write("data.txt", testing::sample_text(20000));
  Result made = sh(kPython + " " + kRef + " make " + dir.file("hf") + " '" + family_spec("qwen3_moe").dump() + "'");
  ASSERT_EQ(made.code, 0) << made.output;
  for (const std::string layout : {"per_expert", "fused"}) {
    const std::string from = dir.file("hf/" + layout);
    nlohmann::json hf = nlohmann::json::parse(file_contents(from + "/config.json"));
    // The config against config.json: the model section's value and the file's.
    nlohmann::json j = train_config(data, {{"seq_len", 32}, {"init_from", from}, {"num_experts", 6}});
    try {
      parse_config(j);
      ADD_FAILURE() << "no error";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("model.num_experts: 6 here, but"), std::string::npos) << e.what();
    }
    // config.json against the weights (a file edited by hand).
    for (const auto& [key, value, words] :
         std::vector<std::tuple<std::string, int, std::string>>{{"num_local_experts", 3, "model.num_experts: 3"},
                                                                {"num_local_experts", 5, "model.num_experts: 5"},
                                                                {"moe_intermediate_size", 40, "model.moe_intermediate_size: 40"}}) {
      nlohmann::json edited = hf;
      if (key == "num_local_experts") edited.erase("num_experts");
      edited[key] = value;
      std::ofstream(from + "/config.json") << edited.dump();
      Config cfg = parse_config(train_config(data, {{"seq_len", 32}, {"init_from", from}}));
      Model model(cfg.model);
      try {
        Trainer trainer(cfg, model);
        ADD_FAILURE() << layout << " " << key << " " << value << ": no error";
      } catch (const ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << layout << ": " << e.what();
        EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
      }
    }
    std::ofstream(from + "/config.json") << hf.dump();
  }
}

}  // namespace
}  // namespace strata
