// model.init_from: the Hugging Face config.json next to the weights fills the
// model keys the config leaves out and must agree with those it sets; families
// and features Strata's model lacks are refused by the config.json field that
// names them, never trained with wrong logits (docs/config.md, model.init_from).
#include <algorithm>
#include <fstream>
#include <utility>
#include <vector>

#include "config/sections.h"
#include "util/fs.h"
#include "util/logging.h"

namespace strata::config {
namespace {

// One Hugging Face config.json and where it came from, for messages.
struct HfConfig {
  json j;
  std::string path;   // DIR/config.json
  std::string where;  // "model.init_from (DIR/config.json)"

  std::string str(const char* key, const std::string& dflt) const {
    if (!j.contains(key) || j[key].is_null()) return dflt;
    if (!j[key].is_string()) fail(where, std::string(key) + " is not a string");
    return j[key].get<std::string>();
  }
  bool flag(const char* key) const { return j.contains(key) && j[key].is_boolean() && j[key].get<bool>(); }
};

// Rotary embeddings: transformers 5 writes rope_parameters (with rope_theta
// inside), older versions rope_scaling (null for plain RoPE) and rope_theta.
// Returns Strata's model.rope_scaling and sets `theta`.
json rope_scaling_of(const HfConfig& hf, json& theta) {
  const char* rope_key = "rope_scaling";
  json rope = json::object();
  if (hf.j.contains("rope_parameters") && hf.j["rope_parameters"].is_object()) {
    rope_key = "rope_parameters";
    rope = hf.j["rope_parameters"];
  } else if (hf.j.contains("rope_scaling") && hf.j["rope_scaling"].is_object()) {
    rope = hf.j["rope_scaling"];
  }
  const std::string rope_type = rope.value("rope_type", rope.value("type", std::string("default")));
  json scaling = {{"type", "none"}};
  auto rope_number = [&](const char* key) {
    if (!rope.contains(key) || !rope[key].is_number()) {
      fail(hf.where, std::string(rope_key) + "." + key + " is missing (rope_type '" + rope_type + "' needs it)");
    }
    return rope[key];
  };
  if (rope_type == "linear") {
    scaling = {{"type", "linear"}, {"factor", rope_number("factor")}};
  } else if (rope_type == "llama3") {
    scaling = {{"type", "llama3"},
               {"factor", rope_number("factor")},
               {"low_freq_factor", rope_number("low_freq_factor")},
               {"high_freq_factor", rope_number("high_freq_factor")},
               {"original_max_position_embeddings", rope_number("original_max_position_embeddings")}};
  } else if (rope_type != "default") {
    fail(hf.where, std::string(rope_key) + ".rope_type '" + rope_type +
                       "' is not supported (default, linear and llama3 are)");
  }
  for (const json* j : {static_cast<const json*>(&hf.j), static_cast<const json*>(&rope)}) {
    if (j->contains("partial_rotary_factor") && (*j)["partial_rotary_factor"].is_number() &&
        (*j)["partial_rotary_factor"].get<double>() != 1.0) {
      fail(hf.where, "partial_rotary_factor " + (*j)["partial_rotary_factor"].dump() + " is not supported (1.0 is)");
    }
  }
  theta = hf.j.contains("rope_theta") ? hf.j["rope_theta"] : json();
  if (rope.contains("rope_theta")) theta = rope["rope_theta"];
  return scaling;
}

// Biases, activation and attention windows Strata's layers lack are refused.
// Returns Mistral's sliding window (kept, and checked against seq_len by
// parse_model), else null.
json refuse_unsupported(const HfConfig& hf, const std::string& type) {
  // Qwen2's q/k/v biases are part of its family; anywhere else a bias flag
  // would also put one on o_proj or the MLP, which Strata lacks.
  if (type != "qwen2" && hf.flag("attention_bias")) {
    fail(hf.where, "attention_bias true is not supported for model_type '" + type +
                       "' (it adds an o_proj bias; only qwen2's q/k/v biases are)");
  }
  if (hf.flag("mlp_bias")) fail(hf.where, "mlp_bias true is not supported (Strata's MLP has no biases)");
  if (hf.str("hidden_act", "silu") != "silu") {
    fail(hf.where, "hidden_act '" + hf.j["hidden_act"].get<std::string>() + "' is not supported (SwiGLU uses silu)");
  }
  // Sliding-window attention: Mistral's window is kept; Qwen's per-layer windows are refused.
  json window;
  if (type == "mistral" || type == "mixtral") {
    window = hf.j.contains("sliding_window") && !hf.j["sliding_window"].is_null() ? hf.j["sliding_window"] : json(0);
  }
  if (hf.flag("use_sliding_window")) fail(hf.where, "use_sliding_window true is not supported (sliding-window attention)");
  if (hf.j.contains("layer_types") && hf.j["layer_types"].is_array()) {
    for (const json& t : hf.j["layer_types"]) {
      if (t != "full_attention") fail(hf.where, "layer_types entry " + t.dump() + " is not supported (full_attention is)");
    }
  }
  return window;
}

}  // namespace

json model_with_hf_config(const json& m, const std::string& from) {
  std::string dir = from;
  if (!is_directory(from)) {
    if (!path_exists(from)) fail("model.init_from", "'" + from + "' does not exist");
    dir = from.find('/') == std::string::npos ? "." : from.substr(0, from.find_last_of('/'));
  }
  HfConfig hf;
  hf.path = dir + "/config.json";
  if (!path_exists(hf.path)) {
    if (is_directory(from)) fail("model.init_from", "no config.json in " + from);
    return m;  // one file without a config: the model section says it all
  }
  std::ifstream in(hf.path);
  hf.j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (hf.j.is_discarded() || !hf.j.is_object()) fail("model.init_from", hf.path + " is not a JSON object");
  hf.where = "model.init_from (" + hf.path + ")";
  const std::string type = hf.str("model_type", "llama");
  const bool moe = type == "mixtral" || type == "qwen2_moe" || type == "qwen3_moe";
  if (type != "llama" && type != "mistral" && type != "qwen2" && type != "qwen3" && !moe) {
    fail(hf.where, "model_type '" + type +
                       "' is not supported (llama, mistral, qwen2, qwen3, mixtral, qwen2_moe or qwen3_moe)");
  }
  json theta;
  const json scaling = rope_scaling_of(hf, theta);
  const json window = refuse_unsupported(hf, type);

  const json& h = hf.j;
  // config.json's intermediate_size is Mixtral's expert width, and the Qwen
  // MoE families' dense MLP width (unused: every layer has experts).
  const json ffn = moe ? json() : h.value("intermediate_size", json());
  std::vector<std::pair<const char*, json>> fields = {
      {"family", json(type)},
      {"dim", h.value("hidden_size", json())},
      {"n_layers", h.value("num_hidden_layers", json())},
      {"n_heads", h.value("num_attention_heads", json())},
      {"n_kv_heads", h.value("num_key_value_heads", h.value("num_attention_heads", json()))},
      {"head_dim", h.value("head_dim", json())},
      {"ffn_hidden", ffn},
      {"vocab_size", h.value("vocab_size", json())},
      {"norm_eps", h.value("rms_norm_eps", json())},
      {"rope_theta", theta},
      {"rope_scaling", scaling},
      {"sliding_window", window},
      {"tie_embeddings", h.value("tie_word_embeddings", json(true))}};
  if (moe) {
    // Hugging Face's names; transformers 5 writes num_local_experts for every
    // MoE family, older files num_experts for the Qwen ones.
    const json experts = h.contains("num_experts") && !h["num_experts"].is_null() ? h["num_experts"]
                                                                                  : h.value("num_local_experts", json());
    const json width = type == "mixtral" ? h.value("intermediate_size", json()) : h.value("moe_intermediate_size", json());
    const std::vector<std::pair<const char*, json>> moe_fields = {
        {"num_experts", experts},
        {"num_experts_per_tok", h.value("num_experts_per_tok", json())},
        {"moe_intermediate_size", width},
        {"norm_topk_prob", type == "mixtral" ? json() : h.value("norm_topk_prob", json(false))},
        {"shared_expert_intermediate_size",
         type == "qwen2_moe" ? h.value("shared_expert_intermediate_size", json()) : json()},
        {"router_aux_loss_coef", h.value("router_aux_loss_coef", json())},
        {"output_router_logits", h.value("output_router_logits", json())},
        {"decoder_sparse_step", h.value("decoder_sparse_step", json())},
        {"mlp_only_layers", h.value("mlp_only_layers", json())},
        {"router_jitter_noise", h.value("router_jitter_noise", json())}};
    fields.insert(fields.end(), moe_fields.begin(), moe_fields.end());
  }
  json out = m;
  for (const auto& [key, v] : fields) {
    if (v.is_null()) continue;
    if (!m.contains(key)) {
      out[key] = v;
      continue;
    }
    // The training switches of the load-balancing loss are the run's to
    // choose (config.json's are the pretraining run's): the section wins.
    if (std::string(key) == "output_router_logits" || std::string(key) == "router_aux_loss_coef") continue;
    const bool same = v.is_number() && m[key].is_number() ? v.get<double>() == m[key].get<double>() : v == m[key];
    if (!same) fail(std::string("model.") + key, m[key].dump() + " here, but " + hf.path + " says " + v.dump());
  }
  return out;
}

// Note [Base identity]
// A LoRA checkpoint holds adapters trained over one base, which it does not
// store: a resume must find the same base. Its identity is, per safetensors
// file of model.init_from (sorted by name), the name and size, and one
// 64-bit FNV-1a hash over every file's header (each tensor's name, dtype,
// shape and offsets) and its data's first and last MiB: cheap for a base of
// hundreds of GB, and another base (another fine-tune of the same shape
// included) differs in it with near certainty.
json base_identity(const std::string& from) {
  std::vector<std::string> files;
  if (is_directory(from)) {
    for (const std::string& n : list_dir(from)) {
      if (n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0) files.push_back(n);
    }
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(from);
  }
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](const char* p, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ uint8_t(p[i])) * 1099511628211ull;
  };
  json list = json::array();
  std::vector<char> buf(size_t(1) << 20);
  for (const std::string& name : files) {
    const std::string path = is_directory(from) ? from + "/" + name : name;
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("model.init_from", "cannot read " + path);
    in.seekg(0, std::ios::end);
    const int64_t size = int64_t(in.tellg());
    list.push_back({{"name", name.substr(name.find_last_of('/') + 1)}, {"bytes", size}});
    uint64_t header = 0;
    in.seekg(0);
    in.read(reinterpret_cast<char*>(&header), 8);
    if (!in || size < 8 || header > uint64_t(size - 8)) fail("model.init_from", path + " is not a safetensors file");
    std::string text(size_t(header), '\0');
    in.read(text.data(), std::streamsize(header));
    mix(text.data(), text.size());
    const int64_t begin = 8 + int64_t(header), data = size - begin;
    const int64_t chunk = std::min<int64_t>(int64_t(buf.size()), data);
    for (int64_t at : {begin, std::max<int64_t>(begin, size - chunk)}) {
      in.clear();
      in.seekg(at);
      in.read(buf.data(), std::streamsize(chunk));
      mix(buf.data(), size_t(in.gcount()));
    }
  }
  return {{"files", list}, {"checksum", strprintf("fnv1a64:%016llx", (unsigned long long)h)}};
}

}  // namespace strata::config
