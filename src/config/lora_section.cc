// The `lora` section: LoRA adapters over a frozen base, with PEFT's LoraConfig
// names and meanings (docs/config.md, "lora"). lora.init_from's
// adapter_config.json fills the keys the section leaves out.
#include <cmath>
#include <fstream>
#include <set>

#include "config/sections.h"
#include "util/fs.h"

namespace strata {

const char* lora_module_name(LoraModule m) {
  static constexpr const char* kNames[kLoraModuleCount] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                          "gate_proj", "up_proj", "down_proj"};
  return kNames[size_t(m)];
}

std::array<int64_t, 2> lora_module_shape(const ModelConfig& cfg, LoraModule m) {
  const int64_t d = cfg.dim, q = cfg.q_dim(), kv = cfg.kv_heads() * cfg.head_dim(), f = cfg.ffn_dim();
  switch (m) {
    case LoraModule::kQ: return {q, d};
    case LoraModule::kK: return {kv, d};
    case LoraModule::kV: return {kv, d};
    case LoraModule::kO: return {d, q};
    case LoraModule::kGate: return {f, d};
    case LoraModule::kUp: return {f, d};
    case LoraModule::kDown: return {d, f};
  }
  return {0, 0};
}

int64_t lora_layer_params(const ModelConfig& cfg) {
  int64_t n = 0;
  for (size_t i = 0; i < kLoraModuleCount; ++i) {
    if (!cfg.lora.targets_module(LoraModule(i))) continue;
    const auto [out, in] = lora_module_shape(cfg, LoraModule(i));
    n += cfg.lora.r * (in + out);
  }
  return n;
}

double LoraConfig::scaling() const { return use_rslora ? alpha / std::sqrt(double(r)) : alpha / double(r); }

namespace config {

namespace {

// PEFT's LoraConfig fields (peft 0.21) that Strata does not implement: each is
// accepted at PEFT's default (what adapter_config.json files carry) and
// refused, naming it, at any other value. An empty `value` means any value is
// accepted: the field describes the file or PEFT's runtime, not the
// arithmetic.
struct PeftField {
  const char* key;
  const char* value;  // PEFT's default as JSON; "" = any value
};
constexpr PeftField kPeftFields[] = {
    {"peft_type", "\"LORA\""},
    {"auto_mapping", ""},
    {"peft_version", ""},
    {"revision", ""},
    {"inference_mode", ""},
    {"runtime_config", ""},
    {"megatron_core", ""},
    {"qalora_group_size", ""},
    {"exclude_modules", "null"},
    {"fan_in_fan_out", "false"},
    {"bias", "\"none\""},
    {"modules_to_save", "null"},
    {"layers_to_transform", "null"},
    {"layers_pattern", "null"},
    {"rank_pattern", "{}"},
    {"alpha_pattern", "{}"},
    {"megatron_config", "null"},
    {"trainable_token_indices", "null"},
    {"loftq_config", "{}"},
    {"eva_config", "null"},
    {"corda_config", "null"},
    {"lora_ga_config", "null"},
    {"use_dora", "false"},
    {"velora_config", "null"},
    {"alora_invocation_tokens", "null"},
    {"use_qalora", "false"},
    {"monteclora_config", "null"},
    {"layer_replication", "null"},
    {"lora_bias", "false"},
    {"target_parameters", "null"},
    {"use_bdlora", "null"},
    {"arrow_config", "null"},
    {"kasa_config", "null"},
    {"ensure_weight_tying", "false"},
};

Keys lora_read_keys() {
  Keys k = {"r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "init_lora_weights", "init_from",
            "base_model_name_or_path", "task_type"};
  for (const PeftField& f : kPeftFields) k.push_back(f.key);
  return k;
}

// Whether `v` means what PEFT's default `def` means: equal, or an empty list,
// object or null where the default is null or empty.
bool at_default(const json& v, const json& def) {
  if (v == def) return true;
  const bool empty_v = v.is_null() || (v.is_array() && v.empty()) || (v.is_object() && v.empty());
  const bool empty_d = def.is_null() || (def.is_array() && def.empty()) || (def.is_object() && def.empty());
  return empty_v && empty_d;
}

// target_modules: a list of PEFT's module names, or "all-linear".
void read_targets(Section& s, LoraConfig& l) {
  const json* t = s.find("target_modules");
  if (t == nullptr || t->is_null()) {
    fail(s.key("target_modules"), "required: a list of module names (q_proj, k_proj, v_proj, o_proj, gate_proj, "
                                  "up_proj, down_proj) or \"all-linear\"");
  }
  auto known = [] {
    std::string all;
    for (size_t i = 0; i < kLoraModuleCount; ++i) all += std::string(i ? ", " : "") + lora_module_name(LoraModule(i));
    return all;
  };
  if (t->is_string()) {
    if (t->get<std::string>() != "all-linear") {
      fail(s.key("target_modules"), "'" + t->get<std::string>() +
                                        "' is a regular expression in PEFT, which Strata does not take: give a list "
                                        "of module names (" + known() + ") or \"all-linear\"");
    }
    l.all_linear = true;
    l.targets.fill(true);
    return;
  }
  if (!t->is_array()) wrong_type(s.key("target_modules"), "a list of module names or \"all-linear\"", *t);
  if (t->empty()) fail(s.key("target_modules"), "the list is empty: name at least one module (" + known() + ")");
  for (const json& e : *t) {
    if (!e.is_string()) wrong_type(s.key("target_modules"), "a list of strings", e);
    const std::string name = e.get<std::string>();
    size_t i = 0;
    while (i < kLoraModuleCount && name != lora_module_name(LoraModule(i))) ++i;
    if (i == kLoraModuleCount) {
      fail(s.key("target_modules"), "unknown module '" + name + "'; this model's linears are " + known());
    }
    l.targets[i] = true;
  }
}

// lora.init_from: the adapter directory's adapter_config.json, checked for
// presence; its keys fill those `given` leaves out, and a key both set must
// agree (target_modules as sets: PEFT writes a set in no fixed order).
json lora_with_adapter_config(const json& given, const std::string& dir) {
  const std::string key = "lora.init_from";
  if (!is_directory(dir)) fail(key, "'" + dir + "' is not a directory (a PEFT adapter: adapter_config.json and "
                                    "adapter_model.safetensors)");
  const std::string path = dir + "/adapter_config.json";
  if (!path_exists(path)) fail(key, "no adapter_config.json in " + dir);
  if (!path_exists(dir + "/adapter_model.safetensors")) fail(key, "no adapter_model.safetensors in " + dir);
  std::ifstream in(path);
  json a = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (a.is_discarded() || !a.is_object()) fail(key, path + " is not a JSON object");
  json merged = given;
  for (auto it = a.begin(); it != a.end(); ++it) {
    const json& theirs = it.value();
    auto mine = given.find(it.key());
    if (mine == given.end()) {
      merged[it.key()] = theirs;
      continue;
    }
    bool agree = *mine == theirs;
    if (it.key() == "target_modules") {
      // As sets; "all-linear" is the seven linears (PEFT writes the names it resolved).
      auto names = [](const json& v) {
        std::set<json> s;
        if (v == json("all-linear")) {
          for (size_t i = 0; i < kLoraModuleCount; ++i) s.insert(json(lora_module_name(LoraModule(i))));
        } else if (v.is_array()) {
          s.insert(v.begin(), v.end());
        }
        return s;
      };
      agree = agree || (!names(*mine).empty() && names(*mine) == names(theirs));
    }
    if (!agree && !(it.key() == "base_model_name_or_path" || it.key() == "inference_mode" ||
                    it.key() == "peft_version" || it.key() == "revision")) {
      fail("lora." + it.key(), mine->dump() + " in the config, " + theirs.dump() + " in " + path);
    }
  }
  return merged;
}

}  // namespace

const SectionKeys kLoraKeys = {"lora", lora_read_keys(), {}};

void parse_lora(Section& top, Config& c) {
  if (top.find("lora") == nullptr || top.find("lora")->is_null()) return;
  const json& given = top.object("lora");
  check_keys(given, "lora", kLoraKeys.read, kLoraKeys.ignored, c.ignored_keys);
  json merged = given;
  if (auto from = given.find("init_from"); from != given.end()) {
    if (!from->is_string()) wrong_type("lora.init_from", "a string", *from);
    if (!from->get<std::string>().empty()) merged = lora_with_adapter_config(given, from->get<std::string>());
  }
  Section s(merged, kLoraKeys, c.ignored_keys);
  LoraConfig& l = c.model.lora;
  l.enabled = true;
  s.read("init_from", l.init_from);
  if (s.read("r", l.r)) positive(s.key("r"), l.r);
  if (s.read("lora_alpha", l.alpha)) positive(s.key("lora_alpha"), l.alpha);
  if (s.read("lora_dropout", l.dropout) && !(l.dropout >= 0.0 && l.dropout < 1.0)) {
    fail(s.key("lora_dropout"), "must be in [0, 1), got " + num(l.dropout));
  }
  read_targets(s, l);
  if (c.model.is_moe()) {
    // An MoE layer's MLP is its experts and router, frozen with the base;
    // adapters go on the attention's linears only (docs/config.md, "lora").
    for (LoraModule m : {LoraModule::kGate, LoraModule::kUp, LoraModule::kDown}) {
      if (l.all_linear) {
        l.targets[size_t(m)] = false;
      } else if (l.targets[size_t(m)]) {
        fail(s.key("target_modules"), std::string("'") + lora_module_name(m) + "' is an expert's linear in model.family " +
                                          model_family_name(c.model.family) +
                                          ": adapters go on q_proj, k_proj, v_proj and o_proj (the experts stay frozen)");
      }
    }
  }
  s.read("use_rslora", l.use_rslora);
  if (const json* init = s.find("init_lora_weights")) {
    if (*init == json(true)) {
      l.init = LoraInit::kKaimingUniform;
    } else if (*init == json("gaussian")) {
      l.init = LoraInit::kGaussian;
    } else {
      fail(s.key("init_lora_weights"), "Strata implements true and \"gaussian\", got " + describe(*init));
    }
  }
  if (const json* b = s.find("base_model_name_or_path"); b != nullptr && !b->is_null()) {
    if (!b->is_string()) wrong_type(s.key("base_model_name_or_path"), "a string", *b);
    l.base_model_name_or_path = b->get<std::string>();
  }
  if (const json* t = s.find("task_type"); t != nullptr && !t->is_null() && *t != json("CAUSAL_LM")) {
    fail(s.key("task_type"), "Strata trains causal language models (\"CAUSAL_LM\"), got " + describe(*t));
  }
  for (const PeftField& f : kPeftFields) {
    const json* v = s.find(f.key);
    if (v == nullptr || *f.value == '\0') continue;
    const json def = json::parse(f.value);
    if (!at_default(*v, def)) {
      fail(s.key(f.key), describe(*v) + ": Strata does not implement this LoRA option (only PEFT's default, " +
                             def.dump() + ")");
    }
  }
  s.done();
}

}  // namespace config
}  // namespace strata
