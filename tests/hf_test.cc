// Hugging Face weights out: `strata export` writes safetensors that
// transformers' LlamaForCausalLM loads and that compute Strata's logits
// (fp32: within 1e-4 of the largest logit; bf16: Strata's error against HF
// fp32 at most 1.5x HF bf16's own), for tied, untied and grouped-query
// models; and the files read back with an independent safetensors reader.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

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
const std::string kLogits = std::string(STRATA_SOURCE_DIR) + "/tests/hf_logits.py";

bool have_transformers() { return sh(kPython + " -c 'import transformers, safetensors'").code == 0; }

nlohmann::json config(const std::string& data, const std::string& ck, const nlohmann::json& model) {
  return {
      {"train_micro_batch_size_per_gpu", 2},
      {"gradient_accumulation_steps", 1},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}}}}},
      {"model", model},
      {"data", {{"path", data}, {"val_fraction", 0.0}}},
      {"run", {{"steps", 3}, {"seed", 3}, {"checkpoint", {{"dir", ck}}}}},
  };
}

// Strata's forward over blocks, with the trainer's weights cast to `dtype`.
at::Tensor strata_logits(Trainer& trainer, const Model& model, const at::Tensor& tokens, at::ScalarType dtype) {
  std::vector<std::vector<at::Tensor>> w;
  for (size_t b = 0; b < model.num_blocks(); ++b) {
    std::vector<at::Tensor> wb = trainer.block_weights(b);
    for (at::Tensor& t : wb) t = t.to(dtype);
    w.push_back(std::move(wb));
  }
  at::Tensor x = model.forward(0, w[0], tokens);
  for (size_t b = 1; b + 1 < model.num_blocks(); ++b) x = model.forward(b, w[b], x);
  const at::Tensor tied = model.config().tie_embeddings ? w[0][0] : at::Tensor();
  return model.forward(model.num_blocks() - 1, w.back(), x, tied).to(at::kFloat);
}

at::Tensor read_floats(const std::string& path, at::IntArrayRef shape) {
  const std::string b = file_contents(path);
  at::Tensor t = at::empty(shape, at::kFloat);
  EXPECT_EQ(size_t(t.numel() * 4), b.size()) << path;
  std::memcpy(t.data_ptr<float>(), b.data(), std::min(b.size(), size_t(t.numel() * 4)));
  return t;
}

// `cls`, when given, is the class AutoModelForCausalLM must build from the
// export's config.json.
at::Tensor hf_logits(const TempDir& dir, const std::string& model_dir, const at::Tensor& tokens, const char* dtype,
                     int64_t vocab, const std::string& cls = "") {
  const std::string tok = dir.file("tokens.bin"), out = dir.file(std::string("hf-") + dtype + ".bin");
  std::ofstream(tok, std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data_ptr<int64_t>()), std::streamsize(tokens.numel() * 8));
  Result r = sh(kPython + " " + kLogits + " " + model_dir + " " + tok + " " + std::to_string(tokens.size(0)) + " " +
                std::to_string(tokens.size(1)) + " " + dtype + " " + out);
  EXPECT_EQ(r.code, 0) << r.output;
  if (!cls.empty()) {
    EXPECT_NE(r.output.find("class " + cls + "\n"), std::string::npos) << r.output;
  }
  return read_floats(out, {tokens.size(0), tokens.size(1), vocab});
}

// Trains 3 steps, saves, exports in fp32 and bf16, and compares logits.
void expect_hf_agrees(const TempDir& dir, const std::string& data, const nlohmann::json& model_cfg,
                      const std::string& what) {
  const std::string ck = dir.file(what + "-ck");
  Config cfg = parse_config(config(data, ck, model_cfg));
  Model model(cfg.model);
  Trainer trainer(cfg, model);
  TokenDataset ds(cfg.data.paths, TokenFormat::kText, 256, cfg.model.seq_len, 0.0);
  std::mt19937_64 rng(1);
  std::vector<int64_t> batch(size_t(2 * (cfg.model.seq_len + 1)));
  for (int s = 0; s < 3; ++s) {
    ds.sample_train(rng, 2, batch.data());
    trainer.step(batch.data());
  }
  CheckpointOptions o;
  o.dir = ck;
  Manifest h;
  h.invariants = resume_invariants(cfg);
  trainer.save_checkpoint(o, h);
  const std::string fp32 = dir.file(what + "-fp32"), bf16 = dir.file(what + "-bf16");
  Result e1 = sh(kStrata + " export " + ck + " --out " + fp32 + " --dtype fp32");
  ASSERT_EQ(e1.code, 0) << e1.output;
  Result e2 = sh(kStrata + " export " + ck + " --out " + bf16 + " --dtype bf16 --max-shard-size 40KB --buffer-size 12KB");
  ASSERT_EQ(e2.code, 0) << e2.output;
  EXPECT_TRUE(path_exists(bf16 + "/model.safetensors.index.json")) << "the 40 KB limit shards the bf16 export";

  ds.sample_train(rng, 2, batch.data());
  const int64_t t = cfg.model.seq_len;
  at::Tensor tokens = at::from_blob(batch.data(), {2, t + 1}, at::kLong).narrow(1, 0, t).contiguous();
  const int64_t v = cfg.model.vocab_size;
  const at::Tensor mine32 = strata_logits(trainer, model, tokens, at::kFloat);
  const at::Tensor hf32 = hf_logits(dir, fp32, tokens, "fp32", v);
  const double scale = mine32.abs().max().item<double>();
  const double diff = (mine32 - hf32).abs().max().item<double>();
  EXPECT_LE(diff, 1e-4 * scale) << what << ": fp32 max|diff| " << diff << " vs max|logit| " << scale;
  const at::Tensor mine16 = strata_logits(trainer, model, tokens, at::kBFloat16);
  const at::Tensor hf16 = hf_logits(dir, bf16, tokens, "bf16", v);
  const double err_mine = (mine16 - hf32).abs().max().item<double>();
  const double err_hf = (hf16 - hf32).abs().max().item<double>();
  EXPECT_GT(err_hf, 0.0);
  EXPECT_LE(err_mine, 1.5 * err_hf) << what << ": Strata bf16 error " << err_mine << ", HF bf16 error " << err_hf;
}

class HfTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_transformers()) {
      // Under CI (tools/test.sh installs them) a missing package is a failure, not a skip.
      if (testing::under_ci()) FAIL() << "no transformers in .venv under CI";
      GTEST_SKIP() << "no transformers in .venv (tools/setup.sh installs it)";
    }
    data_ = dir_.write("data.txt", testing::sample_text(30000));
  }
  TempDir dir_;
  std::string data_;
};

TEST_F(HfTest, ExportedTiedModelComputesStratasLogits) {
  expect_hf_agrees(dir_, data_, {{"dim", 64}, {"n_layers", 2}, {"n_heads", 4}, {"seq_len", 64}}, "tied");
}

TEST_F(HfTest, ExportedUntiedGroupedQueryModelComputesStratasLogits) {
  expect_hf_agrees(dir_, data_,
                   {{"dim", 64}, {"n_layers", 2}, {"n_heads", 4}, {"n_kv_heads", 2}, {"seq_len", 64},
                    {"tie_embeddings", false}, {"rope_theta", 500000.0}, {"norm_eps", 1e-6}},
                   "untied-gqa");
}

// The safetensors files parsed here from the format's definition (8-byte
// header length, JSON header, raw little-endian data): every tensor holds the
// checkpoint's master weights, named as Hugging Face names them.
TEST_F(HfTest, ExportedFilesReadBackWithAnIndependentReader) {
  const std::string ck = dir_.file("ck");
  Config cfg = parse_config(config(data_, ck, {{"dim", 64}, {"n_layers", 2}, {"n_heads", 4}, {"seq_len", 32},
                                               {"tie_embeddings", false}}));
  Model model(cfg.model);
  Trainer trainer(cfg, model);
  CheckpointOptions o;
  o.dir = ck;
  Manifest h;
  h.invariants = resume_invariants(cfg);
  TokenDataset ds(cfg.data.paths, TokenFormat::kText, 256, cfg.model.seq_len, 0.0);
  std::mt19937_64 rng(1);
  std::vector<int64_t> batch(size_t(2 * (cfg.model.seq_len + 1)));
  ds.sample_train(rng, 2, batch.data());
  trainer.step(batch.data());
  trainer.save_checkpoint(o, h);
  const std::string out = dir_.file("out");
  Result e = sh(kStrata + " export " + ck + " --out " + out + " --dtype fp32 --max-shard-size 100KB");
  ASSERT_EQ(e.code, 0) << e.output;
  const nlohmann::json index = nlohmann::json::parse(file_contents(out + "/model.safetensors.index.json"));
  std::map<std::string, at::Tensor> got;
  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items()) files.insert(file.get<std::string>());
  int64_t total = 0;
  for (const std::string& f : files) {
    const std::string bytes = file_contents(out + "/" + f);
    ASSERT_GE(bytes.size(), 8u);
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n));
    const size_t data0 = 8 + n;
    for (const auto& [name, meta] : header.items()) {
      if (name == "__metadata__") continue;
      EXPECT_EQ(meta["dtype"], "F32");
      std::vector<int64_t> shape = meta["shape"].get<std::vector<int64_t>>();
      const int64_t b0 = meta["data_offsets"][0], b1 = meta["data_offsets"][1];
      at::Tensor t = at::empty(shape, at::kFloat);
      ASSERT_EQ(b1 - b0, t.numel() * 4) << name;
      ASSERT_LE(data0 + size_t(b1), bytes.size()) << name;
      std::memcpy(t.data_ptr<float>(), bytes.data() + data0 + b0, size_t(b1 - b0));
      got[name] = t;
      total += b1 - b0;
      EXPECT_EQ(index["weight_map"][name], f);
    }
  }
  EXPECT_EQ(index["metadata"]["total_size"], total);
  EXPECT_GT(files.size(), 1u);
  // Block by block, parameter by parameter, against the trainer's master weights.
  const std::vector<std::pair<std::string, std::string>> layer_names = {
      {"attn_norm", "input_layernorm"}, {"wq", "self_attn.q_proj"}, {"wk", "self_attn.k_proj"},
      {"wv", "self_attn.v_proj"},       {"wo", "self_attn.o_proj"}, {"mlp_norm", "post_attention_layernorm"},
      {"w1", "mlp.gate_proj"},          {"w3", "mlp.up_proj"},      {"w2", "mlp.down_proj"}};
  size_t checked = 0;
  for (size_t b = 0; b < trainer.layout().num_blocks(); ++b) {
    const BlockLayout& bl = trainer.layout().block(b);
    const std::vector<at::Tensor> w = param_views(bl, trainer.master_block(b));
    for (size_t p = 0; p < bl.params.size(); ++p) {
      const std::string& n = bl.params[p].spec.name;
      std::string hf;
      if (n == "tok_embedding") hf = "model.embed_tokens.weight";
      if (n == "final_norm") hf = "model.norm.weight";
      if (n == "output") hf = "lm_head.weight";
      for (const auto& [s, h] : layer_names) {
        if (n == s) hf = "model.layers." + bl.name.substr(6) + "." + h + ".weight";
      }
      ASSERT_TRUE(got.count(hf)) << bl.name << "." << n << " as " << hf;
      EXPECT_TRUE(at::equal(got[hf], w[p])) << hf;
      ++checked;
    }
  }
  EXPECT_EQ(checked, got.size());
  const nlohmann::json c = nlohmann::json::parse(file_contents(out + "/config.json"));
  EXPECT_EQ(c["tie_word_embeddings"], false);
  EXPECT_EQ(c["num_key_value_heads"], 4);
  EXPECT_EQ(c["attention_bias"], false);
}

// Hugging Face weights in and out, per family: a random model built and
// saved by transformers (norms and biases random too) initialises Strata
// through model.init_from (its config.json filling the model section); the
// first step's loss equals transformers' on the same windows; after 5 steps
// the export (fp32, sharded, so loaded through its index) is loaded by
// AutoModelForCausalLM as the family's own class and computes Strata's logits.
void expect_round_trip(const TempDir& dir, const std::string& data, const std::string& what, const std::string& cls,
                       const nlohmann::json& spec) {
  const std::string model_dir = dir.file("hf-" + what), ck = dir.file("ck-" + what);
  const int64_t window = 33;
  std::vector<int64_t> batch(size_t(2 * window));
  TokenDataset ds({data}, TokenFormat::kText, 256, window - 1, 0.0);
  std::mt19937_64 rng(9);
  ds.sample_train(rng, 2, batch.data());
  const std::string tok = dir.file("windows-" + what + ".bin");
  std::ofstream(tok, std::ios::binary).write(reinterpret_cast<const char*>(batch.data()), std::streamsize(batch.size() * 8));
  Result r = sh(kPython + " " + std::string(STRATA_SOURCE_DIR) + "/tests/hf_make.py " + model_dir + " " + tok +
                " 2 " + std::to_string(window) + " '" + spec.dump() + "'");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("class " + cls + "\n"), std::string::npos) << r.output;
  const size_t at = r.output.rfind("loss ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const double hf_loss = std::stod(r.output.substr(at + 5));

  Config cfg = parse_config(config(data, ck, {{"seq_len", window - 1}, {"init_from", model_dir}}));
  EXPECT_EQ(cfg.model.dim, 64);  // filled from config.json
  EXPECT_EQ(cfg.model.kv_heads(), spec["kv"].get<int64_t>());
  EXPECT_EQ(cfg.model.tie_embeddings, spec["tied"].get<bool>());
  EXPECT_EQ(model_family_name(cfg.model.family), spec["family"].get<std::string>());
  Model model(cfg.model);
  Trainer trainer(cfg, model);
  const double loss = trainer.step(batch.data()).loss;
  EXPECT_LE(std::abs(loss - hf_loss), 1e-5 * hf_loss) << what << ": Strata " << loss << ", transformers " << hf_loss;
  for (int s = 1; s < 5; ++s) {
    ds.sample_train(rng, 2, batch.data());
    trainer.step(batch.data());
  }
  CheckpointOptions o;
  o.dir = ck;
  Manifest h;
  h.invariants = resume_invariants(cfg);
  trainer.save_checkpoint(o, h);
  const std::string out = dir.file("export-" + what);
  // A 16 KB buffer: the 64 KB tensors stream through in chunks.
  Result e = sh(kStrata + " export " + ck + " --out " + out + " --dtype fp32 --max-shard-size 40KB --buffer-size 16KB");
  ASSERT_EQ(e.code, 0) << e.output;
  EXPECT_TRUE(path_exists(out + "/model.safetensors.index.json")) << "the 40 KB limit shards the export";

  ds.sample_train(rng, 2, batch.data());
  const int64_t t = cfg.model.seq_len;
  at::Tensor tokens = at::from_blob(batch.data(), {2, t + 1}, at::kLong).narrow(1, 0, t).contiguous();
  const at::Tensor mine = strata_logits(trainer, model, tokens, at::kFloat);
  const at::Tensor theirs = hf_logits(dir, out, tokens, "fp32", cfg.model.vocab_size, cls);
  const double scale = mine.abs().max().item<double>();
  const double diff = (mine - theirs).abs().max().item<double>();
  EXPECT_LE(diff, 1e-4 * scale) << what << ": fp32 max|diff| " << diff << " vs max|logit| " << scale;
}

TEST_F(HfTest, LlamaRoundTripsTiedAndUntied) {
  expect_round_trip(dir_, data_, "llama-tied", "LlamaForCausalLM", {{"family", "llama"}, {"tied", true}, {"kv", 4}});
  expect_round_trip(dir_, data_, "llama-untied-gqa", "LlamaForCausalLM",
                    {{"family", "llama"}, {"tied", false}, {"kv", 2}});
}

// Llama 3.1's rope scaling with an original context of 16 positions, so that
// the 32-token windows see stretched, kept and interpolated frequencies.
TEST_F(HfTest, Llama31RopeScalingRoundTrips) {
  expect_round_trip(dir_, data_, "llama31", "LlamaForCausalLM",
                    {{"family", "llama"}, {"tied", false}, {"kv", 2},
                     {"rope", {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                               {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 16}}}});
  expect_round_trip(dir_, data_, "llama-linear", "LlamaForCausalLM",
                    {{"family", "llama"}, {"tied", true}, {"kv", 4}, {"rope", {{"rope_type", "linear"}, {"factor", 4.0}}}});
}

TEST_F(HfTest, MistralRoundTrips) {
  expect_round_trip(dir_, data_, "mistral", "MistralForCausalLM",
                    {{"family", "mistral"}, {"tied", false}, {"kv", 2}, {"config", {{"sliding_window", 32}}}});
  expect_round_trip(dir_, data_, "mistral-tied", "MistralForCausalLM",
                    {{"family", "mistral"}, {"tied", true}, {"kv", 4}, {"config", {{"sliding_window", nullptr}}}});
}

TEST_F(HfTest, Qwen2RoundTripsWithItsBiases) {
  expect_round_trip(dir_, data_, "qwen2-tied", "Qwen2ForCausalLM", {{"family", "qwen2"}, {"tied", true}, {"kv", 2}});
  expect_round_trip(dir_, data_, "qwen2-untied", "Qwen2ForCausalLM", {{"family", "qwen2"}, {"tied", false}, {"kv", 4}});
}

// Qwen3 with head_dim 32 over 4 heads: q is 128 wide on a 64-wide model.
TEST_F(HfTest, Qwen3RoundTripsWithItsQkNorms) {
  expect_round_trip(dir_, data_, "qwen3-untied", "Qwen3ForCausalLM",
                    {{"family", "qwen3"}, {"tied", false}, {"kv", 2}, {"head_dim", 32}});
  expect_round_trip(dir_, data_, "qwen3-tied", "Qwen3ForCausalLM",
                    {{"family", "qwen3"}, {"tied", true}, {"kv", 2}, {"head_dim", 16}});
}

// Each family and feature Strata's model lacks is refused by the config.json
// field that names it (never trained with wrong logits).
TEST_F(HfTest, InitFromRefusesWhatStratasModelLacks) {
  const std::string d = dir_.file("hf-refused");
  make_dirs(d);
  const std::string base = R"("hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "intermediate_size": 96, "vocab_size": 256)";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"("model_type": "gemma")", "model_type 'gemma' is not supported"},
      {R"("model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})",
       "rope_parameters.rope_type 'yarn' is not supported"},
      {R"("model_type": "llama", "rope_scaling": {"type": "dynamic", "factor": 2.0})",
       "rope_scaling.rope_type 'dynamic' is not supported"},
      {R"("model_type": "llama", "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4})",
       "rope_parameters.low_freq_factor is missing"},
      {R"("model_type": "llama", "attention_bias": true)", "attention_bias true is not supported for model_type 'llama'"},
      {R"("model_type": "qwen3", "attention_bias": true)", "attention_bias true is not supported for model_type 'qwen3'"},
      {R"("model_type": "llama", "mlp_bias": true)", "mlp_bias true is not supported"},
      {R"("model_type": "llama", "hidden_act": "gelu")", "hidden_act 'gelu' is not supported"},
      {R"("model_type": "qwen2", "use_sliding_window": true, "sliding_window": 16)", "use_sliding_window true"},
      {R"("model_type": "qwen2", "layer_types": ["full_attention", "sliding_attention"])",
       "layer_types entry \"sliding_attention\""},
      {R"("model_type": "llama", "partial_rotary_factor": 0.5)", "partial_rotary_factor 0.5 is not supported"},
      // A window shorter than the training window would change attention.
      {R"("model_type": "mistral", "sliding_window": 16)", "model.sliding_window: 16 is shorter than model.seq_len 32"},
  };
  for (const auto& [fields, message] : cases) {
    std::ofstream(d + "/config.json") << "{" << fields << ", " << base << "}";
    try {
      parse_config(config(data_, "", {{"init_from", d}, {"seq_len", 32}}));
      ADD_FAILURE() << "accepted: " << fields;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
  std::ofstream(d + "/config.json") << R"({"model_type": "llama", )" << base << "}";
  try {
    parse_config(config(data_, "", {{"init_from", d}, {"dim", 128}}));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("model.dim: 128 here, but " + d + "/config.json says 64"), std::string::npos)
        << e.what();
  }
  std::ofstream(d + "/config.json") << R"({"model_type": "qwen2", )" << base << "}";
  try {
    parse_config(config(data_, "", {{"init_from", d}, {"family", "llama"}}));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("model.family: \"llama\" here, but " + d + "/config.json says \"qwen2\""),
              std::string::npos)
        << e.what();
  }
}

// One safetensors file holding `tensors` (name -> shape, F32 zeros).
void write_safetensors(const std::string& path, const std::map<std::string, std::vector<int64_t>>& tensors) {
  nlohmann::json h = nlohmann::json::object();
  int64_t at = 0;
  for (const auto& [name, shape] : tensors) {
    int64_t n = 4;
    for (int64_t d : shape) n *= d;
    h[name] = {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {at, at + n}}};
    at += n;
  }
  const std::string text = h.dump();
  const uint64_t len = text.size();
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(&len), 8);
  f.write(text.data(), std::streamsize(text.size()));
  f << std::string(size_t(at), '\0');
}

// Weights that disagree with their config.json, and an index naming a shard
// that is not there: one error naming the file and what is wrong.
TEST_F(HfTest, InitFromBadWeightsNameTheFile) {
  const std::string d = dir_.file("hf-bad");
  make_dirs(d);
  std::ofstream(d + "/config.json") << R"({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
      "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 256})";
  write_safetensors(d + "/model.safetensors", {{"model.embed_tokens.weight", {256, 32}}});
  Config cfg = parse_config(config(data_, "", {{"init_from", d}}));
  Model model(cfg.model);
  try {
    Trainer trainer(cfg, model);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(d + "/model.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("model.embed_tokens.weight has shape [256, 32], but the model (config.json) "
                                         "needs [256, 64]"),
              std::string::npos)
        << e.what();
  }
  std::ofstream(d + "/model.safetensors.index.json")
      << R"({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}})";
  write_safetensors(d + "/model-00001-of-00002.safetensors", {{"model.embed_tokens.weight", {256, 64}}});
  try {
    Trainer trainer(cfg, model);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("model.safetensors.index.json"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("names shard 'model-00002-of-00002.safetensors', which is not in"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace strata
