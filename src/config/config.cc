// The training config: parse_config reads the sections in order (each in
// deepspeed_sections.cc or strata_sections.cc, with its key table beside it),
// then the rules across sections. Names of the config's enums, the
// invariants that ranks and resumes compare, and the table of every key
// (config_key_table) live here. See docs/config.md for every key.
#include "config/config.h"

#include <algorithm>
#include <fstream>
#include <functional>
#include <sstream>

#include "config/sections.h"
#include "util/fs.h"

namespace strata {

using config::name_of;
using json = nlohmann::json;

const char* device_kind_name(DeviceKind d) { return name_of(config::kDeviceKinds, d); }
const char* compute_dtype_name(ComputeDtype d) { return name_of(config::kComputeDtypes, d); }
const char* model_family_name(ModelFamily f) { return name_of(config::kModelFamilies, f); }
const char* rope_type_name(RopeType t) { return name_of(config::kRopeTypes, t); }
const char* recompute_name(Recompute r) { return name_of(config::kRecomputes, r); }
const char* speculate_name(Speculate s) { return name_of(config::kSpeculates, s); }
const char* schedule_name(StepSchedule s) { return name_of(config::kSchedules, s); }
const char* expert_gemm_name(ExpertGemm g) { return name_of(config::kExpertGemms, g); }
const char* data_format_name(DataFormat f) { return name_of(config::kDataFormats, f); }
const char* data_sampling_name(DataSampling s) { return name_of(config::kDataSamplings, s); }
const char* moment_dtype_name(MomentDtype d) { return name_of(config::kMomentDtypes, d); }
const char* optimizer_type_name(OptimizerType t) { return name_of(config::kOptimizerTypes, t); }
const char* scheduler_type_name(SchedulerType t) {
  return t == SchedulerType::kConstant ? "" : name_of(config::kSchedulerTypes, t);
}
const char* warmup_type_name(WarmupType t) { return name_of(config::kWarmupTypes, t); }
const char* offload_device_name(OffloadDevice d) { return name_of(config::kOffloadDevices, d); }
const char* comm_backend_name(CommBackend b) { return name_of(config::kCommBackends, b); }
const char* secondary_shard_name(SecondaryShard s) { return name_of(config::kSecondaryShards, s); }
CommBackend comm_backend(const Config& c) {
  if (c.comm.backend != CommBackend::kAuto) return c.comm.backend;
  return c.run.device == DeviceKind::kCuda ? CommBackend::kNccl : CommBackend::kGloo;
}


int64_t ModelConfig::ffn_dim() const {
  if (ffn_hidden > 0) return ffn_hidden;
  const int64_t hidden = 8 * dim / 3;
  const int64_t m = multiple_of > 0 ? multiple_of : 1;
  return (hidden + m - 1) / m * m;
}

double ModelConfig::mlp_active_params() const {
  const double d = double(dim);
  if (!is_moe()) return 3.0 * d * double(ffn_dim());
  const double shared = 3.0 * d * double(moe.shared_expert_intermediate_size) + (shared_expert() ? d : 0.0);
  return double(moe.num_experts_per_tok) * 3.0 * d * double(expert_dim()) + d * double(moe.num_experts) + shared;
}

double ModelConfig::mlp_down_active_params() const {
  const double d = double(dim);
  if (!is_moe()) return d * double(ffn_dim());
  return d * (double(moe.num_experts_per_tok) * double(expert_dim()) + double(moe.shared_expert_intermediate_size));
}

std::vector<ConfigKey> config_key_table() {
  using config::SectionKeys;
  std::vector<std::pair<std::string, const SectionKeys*>> tables = {
      {"", &config::kTopKeys},
      {"optimizer", &config::kOptimizerKeys},
      {"optimizer.params", &config::kOptimizerParamsKeys},
      {"scheduler", &config::kSchedulerKeys},
      {"scheduler.params", &config::kSchedulerParamsKeys},
      {"fp16", &config::kFp16Keys},
      {"bf16", &config::kBf16Keys},
      {"zero_optimization", &config::kZeroKeys},
      {"lora", &config::kLoraKeys},
      {"zero_optimization.offload_param", &config::kOffloadParamKeys},
      {"zero_optimization.offload_optimizer", &config::kOffloadOptimizerKeys},
      {"aio", &config::kAioKeys},
      {"activation_checkpointing", &config::kActivationCheckpointingKeys},
      {"model", &config::kModelKeys},
      {"model.rope_scaling", &config::kRopeScalingKeys},
      {"data", &config::kDataKeys},
      {"run", &config::kRunKeys},
      {"run.rates", &config::kRatesKeys},
      {"run.checkpoint", &config::kCheckpointKeys},
      {"run.activations", &config::kActivationsKeys},
      {"placement", &config::kPlacementKeys},
      {"comm", &config::kCommKeys},
      {"tensorboard", &config::kMonitorKeys},
      {"csv_monitor", &config::kMonitorKeys}};
  for (const char* category : {"param16", "grad", "master", "exp_avg", "exp_avg_sq", "optimizer"}) {
    tables.emplace_back(std::string("placement.") + category, &config::kSplitKeys);
  }
  std::vector<ConfigKey> out;
  for (const auto& [path, keys] : tables) {
    for (auto k : keys->read) out.push_back({config::join(path, k), false});
    for (auto k : keys->ignored) out.push_back({config::join(path, k), true});
  }
  return out;
}

namespace {

using config::fail;
using config::join;
using config::describe;

// Sets obj at the dotted path of `override_text` ("a.b.c=value").
void apply_override(json& root, const std::string& override_text) {
  const size_t eq = override_text.find('=');
  if (eq == std::string::npos) {
    fail(override_text, "malformed override: expected KEY=VALUE, e.g. optimizer.params.lr=3e-4");
  }
  const std::string key = override_text.substr(0, eq);
  const std::string value_text = override_text.substr(eq + 1);
  if (key.empty()) fail(override_text, "malformed override: empty key before '='");
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t dot = key.find('.', start);
    parts.push_back(key.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  for (const auto& p : parts) {
    if (p.empty()) fail(override_text, "malformed override: empty component in key '" + key + "'");
  }
  json value = json::parse(value_text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) value = value_text;

  json* node = &root;
  std::string path;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    path = join(path, parts[i]);
    json& child = (*node)[parts[i]];
    if (child.is_null()) child = json::object();
    if (!child.is_object()) {
      fail(path, "cannot apply override '" + override_text + "': expected an object here, got " +
                     describe(child));
    }
    node = &child;
  }
  (*node)[parts.back()] = std::move(value);
}

}  // namespace

Config parse_config(nlohmann::json j, const std::vector<std::string>& overrides, int64_t world_size) {
  if (!j.is_object()) fail("", "the config must be a JSON object, got " + describe(j));
  for (const auto& o : overrides) apply_override(j, o);

  Config c;
  c.world_size = world_size;
  config::Section top(j, config::kTopKeys, c.ignored_keys);
  config::parse_batch(top, c);
  if (top.read("gradient_clipping", c.gradient_clipping)) {
    config::non_negative("gradient_clipping", c.gradient_clipping);
  }
  if (top.read("steps_per_print", c.steps_per_print)) config::positive("steps_per_print", c.steps_per_print);
  config::parse_optimizer(top, c);
  config::parse_scheduler(top, c);
  config::parse_precision(top, c);
  config::parse_zero(top, c);
  config::parse_aio(top, c);
  config::parse_activation_checkpointing(top, c);
  config::parse_model(top, c);
  config::parse_lora(top, c);
  config::parse_data(top, c);
  config::parse_run(top, c);
  config::parse_placement(top, c);
  config::parse_comm(top, c);
  config::parse_monitor(top, c, "tensorboard", c.tensorboard);
  config::parse_monitor(top, c, "csv_monitor", c.csv_monitor);
  top.done();

  if (c.data.format == DataFormat::kText && c.model.vocab_size != 256) {
    fail("model.vocab_size", "must be 256 for data.format text (bytes), got " + config::num(c.model.vocab_size));
  }
  c.run.compute_dtype = c.bf16 ? ComputeDtype::kBf16 : c.fp16.enabled ? ComputeDtype::kFp16 : ComputeDtype::kFp32;
  c.model.moe.grouped_gemm =
      c.run.expert_gemm == ExpertGemm::kGrouped ||
      (c.run.expert_gemm == ExpertGemm::kAuto && c.run.device == DeviceKind::kCuda && c.run.compute_dtype == ComputeDtype::kBf16);
  c.raw = std::move(j);
  return c;
}

std::string MonitorConfig::dir() const {
  if (output_path.empty()) return job_name;
  return output_path.back() == '/' ? output_path + job_name : output_path + "/" + job_name;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides, int64_t world_size) {
  // POSIX, not std::filesystem: Note [No std::filesystem next to LibTorch] (util/fs.h).
  if (is_directory(path)) fail(path, "cannot read config file (it is a directory)");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "cannot read config file");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail(path, "cannot read config file");

  json j;
  try {
    j = json::parse(text.str(), nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    // nlohmann's message: "[json.exception.parse_error.101] parse error at line L, column C: ...".
    const std::string what = e.what();
    const size_t at = what.find("at line ");
    std::string detail = at == std::string::npos ? "at byte " + std::to_string(e.byte) + ": " + what
                                                 : what.substr(at);
    std::replace(detail.begin(), detail.end(), '\n', ' ');
    fail(path, "invalid JSON " + detail);
  }
  if (!j.is_object()) fail(path, "the config must be a JSON object, got " + describe(j));
  return parse_config(std::move(j), overrides, world_size);
}

nlohmann::json rank_invariant_config(const Config& c) {
  json j = c.raw;
  auto drop = [&](std::initializer_list<const char*> path) {
    json* node = &j;
    std::vector<const char*> parts(path);
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      if (!node->is_object() || !node->contains(parts[i])) return;
      node = &(*node)[parts[i]];
    }
    if (node->is_object()) node->erase(parts.back());
  };
  drop({"run", "metrics"});
  drop({"run", "log_file"});
  drop({"run", "threads"});
  drop({"placement", "nvme_path"});
  drop({"zero_optimization", "offload_param", "nvme_path"});
  drop({"zero_optimization", "offload_optimizer", "nvme_path"});
  // A section left empty says nothing (and may be absent on another rank).
  std::function<void(json&)> prune = [&](json& node) {
    if (!node.is_object()) return;
    for (auto it = node.begin(); it != node.end();) {
      prune(*it);
      if (it->is_object() && it->empty()) {
        it = node.erase(it);
      } else {
        ++it;
      }
    }
  };
  prune(j);
  return j;
}

json model_invariants(const ModelConfig& m) {
  json j = {{"vocab_size", m.vocab_size}, {"dim", m.dim}, {"n_layers", m.n_layers}, {"n_heads", m.n_heads},
            {"n_kv_heads", m.kv_heads()}, {"ffn_hidden", m.ffn_dim()}, {"seq_len", m.seq_len},
            {"tie_embeddings", m.tie_embeddings}, {"rope_theta", m.rope_theta}, {"norm_eps", m.norm_eps}};
  // What a plain Llama model leaves at its default is not written, so that a
  // checkpoint saved before these keys existed resumes and exports as it did.
  if (m.family != ModelFamily::kLlama) j["family"] = model_family_name(m.family);
  if (m.dim % m.n_heads != 0 || m.head_dim() != m.dim / m.n_heads) j["head_dim"] = m.head_dim();
  if (m.rope_scaling.type != RopeType::kNone) {
    const RopeScaling& r = m.rope_scaling;
    j["rope_scaling"] = {{"type", rope_type_name(r.type)}, {"factor", r.factor}};
    if (r.type == RopeType::kLlama3) {
      j["rope_scaling"]["low_freq_factor"] = r.low_freq_factor;
      j["rope_scaling"]["high_freq_factor"] = r.high_freq_factor;
      j["rope_scaling"]["original_max_position_embeddings"] = r.original_max_position_embeddings;
    }
  }
  if (m.sliding_window > 0) j["sliding_window"] = m.sliding_window;
  if (m.is_moe()) {  // Hugging Face's names (config.json's, as export writes them)
    const MoeConfig& e = m.moe;
    j["moe"] = {{"num_experts", e.num_experts},
                {"num_experts_per_tok", e.num_experts_per_tok},
                {"moe_intermediate_size", m.expert_dim()},
                {"norm_topk_prob", e.norm_topk_prob},
                {"shared_expert_intermediate_size", e.shared_expert_intermediate_size},
                {"router_aux_loss_coef", e.router_aux_loss_coef},
                {"output_router_logits", e.output_router_logits}};
  }
  if (m.lora.enabled) {
    // The adapters' shapes and arithmetic (their dropout may change on resume).
    json targets = json::array();
    for (size_t i = 0; i < kLoraModuleCount; ++i) {
      if (m.lora.targets[i]) targets.push_back(lora_module_name(LoraModule(i)));
    }
    j["lora"] = {{"r", m.lora.r}, {"lora_alpha", m.lora.alpha}, {"use_rslora", m.lora.use_rslora},
                 {"target_modules", targets}};
  }
  return j;
}

json resume_invariants(const Config& c) {
  const ModelConfig& m = c.model;
  const SchedulerConfig& s = c.scheduler;
  const OptimizerConfig& o = c.optimizer;
  json j = {
      {"model", model_invariants(m)},
      {"optimizer", {{"type", optimizer_type_name(o.type)}, {"params", {{"lr", o.lr}, {"betas", {o.beta1, o.beta2}}, {"eps", o.eps},
                                                   {"weight_decay", o.weight_decay}}}}},
      {"scheduler", {{"type", scheduler_type_name(s.type)}, {"params", {{"warmup_min_lr", s.warmup_min_lr}, {"warmup_max_lr", s.warmup_max_lr},
                                                   {"warmup_num_steps", s.warmup_num_steps},
                                                   {"warmup_type", warmup_type_name(s.warmup_type)},
                                                   {"total_num_steps", s.total_num_steps},
                                                   {"warmup_min_ratio", s.warmup_min_ratio},
                                                   {"cos_min_ratio", s.cos_min_ratio}}}}},
      {"gradient_clipping", c.gradient_clipping},
      {"train_batch_size", c.train_batch_size},
      {"run", {{"seed", c.run.seed}, {"compute_dtype", compute_dtype_name(c.run.compute_dtype)},
               {"optimizer_state_dtype", moment_dtype_name(c.run.optimizer_state_dtype)}}},
      {"data", {{"format", data_format_name(c.data.format)}, {"val_fraction", c.data.val_fraction}}},
  };
  // LoRA's adapters are trained over one base, which the checkpoint does not
  // hold: a resume over another is refused (Note [Base identity] in
  // hf_config.cc). A base drawn from run.seed is the seed's.
  if (m.lora.enabled && !m.init_from.empty()) j["lora_base"] = config::base_identity(m.init_from);
  // Examples are drawn in epochs (docs/token-format.md): another sampling
  // would not continue the same order. (Windows, the default, is left out:
  // checkpoints from before data.sampling resume.)
  if (c.data.sampling != DataSampling::kWindows) j["data"]["sampling"] = data_sampling_name(c.data.sampling);
  return j;
}

json base_identity(const std::string& from) { return config::base_identity(from); }

std::string first_difference(const json& a, const json& b, const std::string& path) {
  if (a.is_object() && b.is_object()) {
    std::vector<std::string> keys;
    for (auto it = a.begin(); it != a.end(); ++it) keys.push_back(it.key());
    for (auto it = b.begin(); it != b.end(); ++it) {
      if (!a.contains(it.key())) keys.push_back(it.key());
    }
    std::sort(keys.begin(), keys.end());
    for (const std::string& k : keys) {
      const std::string sub = path.empty() ? k : path + "." + k;
      if (!a.contains(k) || !b.contains(k)) return sub;
      const std::string d = first_difference(a[k], b[k], sub);
      if (!d.empty()) return d;
    }
    return "";
  }
  return a == b ? "" : (path.empty() ? "(the whole config)" : path);
}

}  // namespace strata
