// Parsing and validation of the training config. Every section is read by one
// function that first checks the keys it is given (unknown keys are errors,
// DeepSpeed keys Strata does not act on are recorded in Config::ignored_keys),
// then reads each value with its type and range. Cross-section rules and
// derived fields come last. See docs/config.md for every key.
#include "config/config.h"

#include <sys/stat.h>

#include <algorithm>
#include <functional>
#include <cctype>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <string_view>

#include "util/errors.h"
#include "util/fs.h"

namespace strata {

const char* device_kind_name(DeviceKind d) { return d == DeviceKind::kCuda ? "cuda" : "cpu"; }
const char* compute_dtype_name(ComputeDtype d) {
  switch (d) {
    case ComputeDtype::kBf16: return "bf16";
    case ComputeDtype::kFp16: return "fp16";
    case ComputeDtype::kFp32: break;
  }
  return "fp32";
}
const char* model_family_name(ModelFamily f) {
  switch (f) {
    case ModelFamily::kMistral: return "mistral";
    case ModelFamily::kQwen2: return "qwen2";
    case ModelFamily::kQwen3: return "qwen3";
    case ModelFamily::kLlama: break;
  }
  return "llama";
}
const char* rope_type_name(RopeType t) {
  switch (t) {
    case RopeType::kLinear: return "linear";
    case RopeType::kLlama3: return "llama3";
    case RopeType::kNone: break;
  }
  return "none";
}
const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::kAlways: return "always";
    case Recompute::kNever: return "never";
    case Recompute::kAuto: break;
  }
  return "auto";
}

const char* speculate_name(Speculate s) {
  switch (s) {
    case Speculate::kOn: return "on";
    case Speculate::kOff: return "off";
    case Speculate::kAuto: break;
  }
  return "auto";
}

const char* schedule_name(StepSchedule s) {
  switch (s) {
    case StepSchedule::kMicroBatch: return "micro_batch";
    case StepSchedule::kLayer: return "layer";
    case StepSchedule::kAuto: break;
  }
  return "auto";
}

int64_t ModelConfig::ffn_dim() const {
  if (ffn_hidden > 0) return ffn_hidden;
  const int64_t hidden = 8 * dim / 3;
  const int64_t m = multiple_of > 0 ? multiple_of : 1;
  return (hidden + m - 1) / m * m;
}

namespace {

using json = nlohmann::json;
using Keys = std::vector<std::string_view>;

// ---- messages ---------------------------------------------------------------

std::string join(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : path + "." + std::string(key);
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// A JSON value for a message: its type and, for scalars, its value.
std::string describe(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return std::string("boolean ") + (v.get<bool>() ? "true" : "false");
    case json::value_t::string: {
      std::string s = v.get<std::string>();
      if (s.size() > 60) s = s.substr(0, 57) + "...";
      return "string " + json(s).dump();
    }
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
    case json::value_t::number_float: return "number " + v.dump();
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    default: return "a value of unsupported type";
  }
}

std::string num(double v) { return json(v).dump(); }
std::string num(int64_t v) { return std::to_string(v); }

[[noreturn]] void fail(const std::string& key, const std::string& message) {
  throw ConfigError(key, message);
}

[[noreturn]] void wrong_type(const std::string& key, const char* expected, const json& v) {
  fail(key, std::string("expected ") + expected + ", got " + describe(v));
}

// ---- "did you mean" ---------------------------------------------------------

// Optimal string alignment distance (edits incl. adjacent transpositions).
size_t edit_distance(const std::string& a, const std::string& b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<size_t>> d(n + 1, std::vector<size_t>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (size_t i = 1; i <= n; ++i) {
    for (size_t j = 1; j <= m; ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[n][m];
}

size_t common_prefix(const std::string& a, const std::string& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return i;
}

// The closest candidate to `key`, or "" when none is close. Candidates within
// edit distance 3 come first (nearest wins); otherwise the longest shared
// prefix of at least 5 characters (or all of a key of 3+) wins.
std::string suggest(const std::string& key, const Keys& a, const Keys& b) {
  const std::string k = lower(key);
  std::string best;
  // Lower rank is better: (0, distance) for near typos, (1, -prefix) otherwise.
  std::pair<int, long> best_rank{2, 0};
  auto consider = [&](std::string_view cand_view) {
    const std::string cand = lower(cand_view);
    const size_t dist = edit_distance(k, cand);
    const size_t prefix = common_prefix(k, cand);
    std::pair<int, long> rank;
    if (dist <= 3) {
      rank = {0, static_cast<long>(dist)};
    } else if (prefix >= 5 || (prefix >= 3 && (prefix == k.size() || prefix == cand.size()))) {
      rank = {1, -static_cast<long>(prefix)};
    } else {
      return;
    }
    if (rank < best_rank) {
      best = std::string(cand_view);
      best_rank = rank;
    }
  };
  for (auto c : a) consider(c);
  for (auto c : b) consider(c);
  return best;
}

// Checks the keys of the object at `path`: each must be in `known` (read by the
// caller) or in `ignored` (accepted, recorded in `ignored_out`).
void check_keys(const json& obj, const std::string& path, const Keys& known, const Keys& ignored,
                std::vector<std::string>& ignored_out) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    const std::string& key = it.key();
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    if (std::find(ignored.begin(), ignored.end(), key) != ignored.end()) {
      ignored_out.push_back(join(path, key));
      continue;
    }
    std::string msg = "unknown key";
    const std::string close = suggest(key, known, ignored);
    if (!close.empty()) msg += ", did you mean '" + close + "'?";
    fail(join(path, key), msg);
  }
}

// ---- typed readers ----------------------------------------------------------
// Each reads obj[key] when present (leaving `out` at its default otherwise) and
// returns whether the key was present. `path` is the dotted path of `obj`.

const json* find(const json& obj, std::string_view key) {
  auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

// The object at obj[key], or an empty object when absent.
const json& section(const json& obj, const std::string& path, std::string_view key) {
  static const json empty = json::object();
  const json* v = find(obj, key);
  if (!v) return empty;
  if (!v->is_object()) wrong_type(join(path, key), "an object", *v);
  return *v;
}

bool read(const json& obj, const std::string& path, std::string_view key, bool& out) {
  const json* v = find(obj, key);
  if (!v) return false;
  if (!v->is_boolean()) wrong_type(join(path, key), "a boolean (true or false)", *v);
  out = v->get<bool>();
  return true;
}

// Integers: JSON integers, or floats with an integral value (DeepSpeed configs
// write 5e8).
int64_t to_int(const json& v, const std::string& key) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail(key, "integer " + v.dump() + " is out of range");
    }
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || d != std::floor(d)) {
      fail(key, "expected an integer, got " + v.dump());
    }
    if (d >= 9.2e18 || d <= -9.2e18) fail(key, "integer " + v.dump() + " is out of range");
    return static_cast<int64_t>(d);
  }
  wrong_type(key, "an integer", v);
}

bool read(const json& obj, const std::string& path, std::string_view key, int64_t& out) {
  const json* v = find(obj, key);
  if (!v) return false;
  out = to_int(*v, join(path, key));
  return true;
}

bool read(const json& obj, const std::string& path, std::string_view key, uint64_t& out) {
  const json* v = find(obj, key);
  if (!v) return false;
  const std::string k = join(path, key);
  if (v->is_number_unsigned()) {
    out = v->get<uint64_t>();
  } else if (v->is_number_integer()) {
    const int64_t i = v->get<int64_t>();
    if (i < 0) fail(k, "must be >= 0, got " + v->dump());
    out = static_cast<uint64_t>(i);
  } else if (v->is_number_float()) {
    const double d = v->get<double>();
    if (!std::isfinite(d) || d != std::floor(d)) fail(k, "expected an integer, got " + v->dump());
    if (d < 0) fail(k, "must be >= 0, got " + v->dump());
    if (d >= 1.8e19) fail(k, "integer " + v->dump() + " is out of range");
    out = static_cast<uint64_t>(d);
  } else {
    wrong_type(k, "a non-negative integer", *v);
  }
  return true;
}

bool read(const json& obj, const std::string& path, std::string_view key, double& out) {
  const json* v = find(obj, key);
  if (!v) return false;
  if (!v->is_number()) wrong_type(join(path, key), "a number", *v);
  out = v->get<double>();
  return true;
}

bool read(const json& obj, const std::string& path, std::string_view key, std::string& out) {
  const json* v = find(obj, key);
  if (!v) return false;
  if (!v->is_string()) wrong_type(join(path, key), "a string", *v);
  out = v->get<std::string>();
  return true;
}

// A string from a fixed set, matched case-insensitively; `out` gets the
// canonical spelling.
bool read_enum(const json& obj, const std::string& path, std::string_view key, std::string& out,
               const Keys& allowed) {
  std::string s;
  if (!read(obj, path, key, s)) return false;
  for (auto a : allowed) {
    if (lower(a) == lower(s)) {
      out = std::string(a);
      return true;
    }
  }
  std::string list;
  for (size_t i = 0; i < allowed.size(); ++i) {
    if (i > 0) list += i + 1 == allowed.size() ? " or " : ", ";
    list += std::string(allowed[i]);
  }
  fail(join(path, key), "expected " + list + ", got " + json(s).dump());
}

// A string or a list of strings, none empty. null = no paths.
bool read_paths(const json& obj, const std::string& path, std::string_view key,
                std::vector<std::string>& out, bool allow_null) {
  const json* v = find(obj, key);
  if (!v) return false;
  const std::string k = join(path, key);
  out.clear();
  if (v->is_null() && allow_null) return true;
  if (v->is_string()) {
    out.push_back(v->get<std::string>());
  } else if (v->is_array()) {
    for (size_t i = 0; i < v->size(); ++i) {
      const json& e = (*v)[i];
      if (!e.is_string()) {
        fail(k, "expected a string or a list of strings, element " + std::to_string(i) + " is " +
                    describe(e));
      }
      out.push_back(e.get<std::string>());
    }
  } else {
    wrong_type(k, "a string or a list of strings", *v);
  }
  for (const auto& p : out) {
    if (p.empty()) fail(k, "paths must not be empty strings");
  }
  return true;
}

// ---- range checks -----------------------------------------------------------

void positive(const std::string& key, int64_t v) {
  if (v <= 0) fail(key, "must be > 0, got " + num(v));
}
void non_negative(const std::string& key, int64_t v) {
  if (v < 0) fail(key, "must be >= 0, got " + num(v));
}
void positive(const std::string& key, double v) {
  if (!(v > 0)) fail(key, "must be > 0, got " + num(v));
}
void non_negative(const std::string& key, double v) {
  if (!(v >= 0)) fail(key, "must be >= 0, got " + num(v));
}
void in_closed(const std::string& key, double v, double lo, double hi) {
  if (!(v >= lo && v <= hi)) {
    fail(key, "must be in [" + num(lo) + ", " + num(hi) + "], got " + num(v));
  }
}

// ---- known and ignored keys -------------------------------------------------

const Keys kTopKnown = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "gradient_clipping", "steps_per_print", "optimizer", "scheduler", "fp16", "bf16", "bfloat16",
    "zero_optimization", "aio", "activation_checkpointing", "model", "data", "run", "placement",
    "comm", "communication_data_type", "tensorboard", "csv_monitor"};

// DeepSpeed keys that Strata accepts but does not act on.
const Keys kTopIgnored = {
    "wall_clock_breakdown", "prescale_gradients", "gradient_predivide_factor",
    "zero_allow_untested_optimizer", "flops_profiler",
    "wandb", "comet", "comms_logger", "checkpoint", "data_types", "amp",
    "dump_state", "sparse_gradients", "memory_breakdown", "elasticity",
    "zero_force_ds_cpu_optimizer", "seq_parallel_communication_data_type",
    "compression_training", "autotuning", "quantize_training", "disable_allgather",
    "progressive_layer_drop", "curriculum_learning", "data_efficiency", "eigenvalue",
    "sparse_attention", "pipeline", "hybrid_engine", "weight_quantization", "compile", "timers",
    "dataloader_drop_last", "torch_autocast", "graph_harvesting",
    "use_data_before_expert_parallelism", "tensor_parallel", "nebula"};

const Keys kNone = {};

const Keys kZeroKnown = {
    "stage", "contiguous_gradients", "overlap_comm", "reduce_bucket_size", "allgather_bucket_size",
    "reduce_scatter", "allgather_partitions", "sub_group_size", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_max_live_parameters",
    "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save", "offload_param",
    "offload_optimizer", "zero_hpz_partition_size"};

const Keys kZeroIgnored = {
    "round_robin_gradients", "elastic_checkpoint", "ignore_unused_parameters",
    "load_from_fp32_weights", "zero_quantized_weights",
    "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zeropp_loco_param",
    "mics_shard_size", "mics_hierarchical_params_gather", "stage3_gather_fp16_weights_on_model_save",
    "memory_efficient_linear", "cpu_offload", "cpu_offload_param", "cpu_offload_params",
    "cpu_offload_use_pin_memory", "stage3_model_persistence_threshold",
    "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential", "use_multi_rank_bucket_allreduce", "legacy_stage1",
    "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
    "enable_sanity_checks"};

// ---- sections ---------------------------------------------------------------

void parse_batch(const json& root, Config& c) {
  int64_t train = 0, micro = 0, accum = 0;
  const bool has_train = read(root, "", "train_batch_size", train);
  const bool has_micro = read(root, "", "train_micro_batch_size_per_gpu", micro);
  const bool has_accum = read(root, "", "gradient_accumulation_steps", accum);
  if (has_train) positive("train_batch_size", train);
  if (has_micro) positive("train_micro_batch_size_per_gpu", micro);
  if (has_accum) positive("gradient_accumulation_steps", accum);
  const int64_t ws = c.world_size;

  if (has_train && has_micro && has_accum) {
    if (train != micro * accum * ws) {
      fail("train_batch_size",
           num(train) + " != train_micro_batch_size_per_gpu " + num(micro) +
               " x gradient_accumulation_steps " + num(accum) + " x world_size " + num(ws) +
               " = " + num(micro * accum * ws));
    }
  } else if (has_train && has_micro) {
    if (train % (micro * ws) != 0) {
      fail("train_batch_size", num(train) + " is not divisible by train_micro_batch_size_per_gpu " +
                                   num(micro) + " x world_size " + num(ws));
    }
    accum = train / (micro * ws);
  } else if (has_train && has_accum) {
    if (train % (accum * ws) != 0) {
      fail("train_batch_size", num(train) + " is not divisible by gradient_accumulation_steps " +
                                   num(accum) + " x world_size " + num(ws));
    }
    micro = train / (accum * ws);
  } else if (has_train) {
    if (train % ws != 0) {
      fail("train_batch_size", num(train) + " is not divisible by world_size " + num(ws));
    }
    accum = 1;
    micro = train / ws;
  } else {
    if (!has_micro) micro = 8;
    if (!has_accum) accum = 1;
    train = micro * accum * ws;
  }
  c.train_batch_size = train;
  c.train_micro_batch_size_per_gpu = micro;
  c.gradient_accumulation_steps = accum;
}

void parse_optimizer(const json& root, Config& c) {
  const std::string path = "optimizer";
  const json& o = section(root, "", path);
  check_keys(o, path, {"type", "params", "speculate", "speculate_slots"}, kNone, c.ignored_keys);
  OptimizerConfig& opt = c.optimizer;
  read_enum(o, path, "type", opt.type, {"Adam", "AdamW"});
  std::string speculate = speculate_name(opt.speculate);
  read_enum(o, path, "speculate", speculate, {"auto", "on", "off"});
  opt.speculate = speculate == "on" ? Speculate::kOn : speculate == "off" ? Speculate::kOff : Speculate::kAuto;
  read(o, path, "speculate_slots", opt.speculate_slots);

  const std::string pp = "optimizer.params";
  const json& p = section(o, path, "params");
  check_keys(p, pp, {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam"}, kNone,
             c.ignored_keys);
  if (read(p, pp, "lr", opt.lr)) non_negative(pp + ".lr", opt.lr);
  if (const json* b = find(p, "betas")) {
    const std::string k = pp + ".betas";
    if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number() || !(*b)[1].is_number()) {
      wrong_type(k, "a list of two numbers [beta1, beta2]", *b);
    }
    opt.beta1 = (*b)[0].get<double>();
    opt.beta2 = (*b)[1].get<double>();
    for (double beta : {opt.beta1, opt.beta2}) {
      if (!(beta >= 0.0 && beta < 1.0)) fail(k, "each beta must be in [0, 1), got " + num(beta));
    }
  }
  if (read(p, pp, "eps", opt.eps)) positive(pp + ".eps", opt.eps);
  if (read(p, pp, "weight_decay", opt.weight_decay)) {
    non_negative(pp + ".weight_decay", opt.weight_decay);
  }
  bool torch_adam = false;
  if (read(p, pp, "torch_adam", torch_adam)) c.ignored_keys.push_back(pp + ".torch_adam");

  // AdamW always decouples weight decay; Adam does when params.adam_w_mode is true.
  bool w_mode = false;
  const bool has_w_mode = read(p, pp, "adam_w_mode", w_mode);
  if (opt.type == "AdamW") {
    if (has_w_mode && !w_mode) {
      fail(pp + ".adam_w_mode", "false contradicts optimizer.type AdamW (use type Adam for L2 decay)");
    }
    opt.adam_w_mode = true;
  } else {
    // DeepSpeed's default (ADAM_W_MODE_DEFAULT = True): its "Adam" decouples weight
    // decay unless adam_w_mode is false, and a pasted config must train the same.
    opt.adam_w_mode = !has_w_mode || w_mode;
  }
}

void parse_scheduler(const json& root, Config& c) {
  const std::string path = "scheduler";
  if (!find(root, path)) return;
  const json& s = section(root, "", path);
  check_keys(s, path, {"type", "params"}, kNone, c.ignored_keys);
  SchedulerConfig& sc = c.scheduler;
  if (!read_enum(s, path, "type", sc.type, {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"})) {
    fail("scheduler.type", "required when a scheduler is given (WarmupLR, WarmupDecayLR or WarmupCosineLR)");
  }
  const std::string pp = "scheduler.params";
  const json& p = section(s, path, "params");
  check_keys(p, pp,
             {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
              "total_num_steps", "warmup_min_ratio", "cos_min_ratio"},
             {"last_batch_iteration"}, c.ignored_keys);
  if (read(p, pp, "warmup_min_lr", sc.warmup_min_lr)) {
    non_negative(pp + ".warmup_min_lr", sc.warmup_min_lr);
  }
  if (read(p, pp, "warmup_max_lr", sc.warmup_max_lr)) {
    non_negative(pp + ".warmup_max_lr", sc.warmup_max_lr);
  }
  if (read(p, pp, "warmup_num_steps", sc.warmup_num_steps)) {
    non_negative(pp + ".warmup_num_steps", sc.warmup_num_steps);
  }
  read_enum(p, pp, "warmup_type", sc.warmup_type, {"log", "linear"});
  const bool has_total = read(p, pp, "total_num_steps", sc.total_num_steps);
  if (read(p, pp, "warmup_min_ratio", sc.warmup_min_ratio)) {
    in_closed(pp + ".warmup_min_ratio", sc.warmup_min_ratio, 0.0, 1.0);
  }
  if (read(p, pp, "cos_min_ratio", sc.cos_min_ratio)) {
    in_closed(pp + ".cos_min_ratio", sc.cos_min_ratio, 0.0, 1.0);
  }
  if (sc.type == "WarmupDecayLR" || sc.type == "WarmupCosineLR") {
    if (!has_total) fail(pp + ".total_num_steps", "required for " + sc.type);
    positive(pp + ".total_num_steps", sc.total_num_steps);
  } else if (has_total) {
    non_negative(pp + ".total_num_steps", sc.total_num_steps);
  }
}

void parse_precision(const json& root, Config& c) {
  const std::string path = "fp16";
  const json& f = section(root, "", path);
  check_keys(f, path,
             {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "min_loss_scale", "auto_cast", "consecutive_hysteresis"},
             {"fp16_master_weights_and_grads"}, c.ignored_keys);
  Fp16Config& h = c.fp16;
  read(f, path, "enabled", h.enabled);
  if (read(f, path, "loss_scale", h.loss_scale)) non_negative("fp16.loss_scale", h.loss_scale);
  if (read(f, path, "initial_scale_power", h.initial_scale_power)) {
    if (h.initial_scale_power < 0 || h.initial_scale_power > 63) {
      fail("fp16.initial_scale_power", "must be in [0, 63], got " + num(h.initial_scale_power));
    }
  }
  if (read(f, path, "loss_scale_window", h.loss_scale_window)) {
    positive("fp16.loss_scale_window", h.loss_scale_window);
  }
  if (read(f, path, "hysteresis", h.hysteresis)) positive("fp16.hysteresis", h.hysteresis);
  if (read(f, path, "min_loss_scale", h.min_loss_scale)) {
    positive("fp16.min_loss_scale", h.min_loss_scale);
  }
  bool flag = false;
  if (read(f, path, "auto_cast", flag)) c.ignored_keys.push_back("fp16.auto_cast");
  read(f, path, "consecutive_hysteresis", h.consecutive_hysteresis);

  // bf16, also under DeepSpeed's older name bfloat16.
  const bool has_bf16 = find(root, "bf16") != nullptr;
  const bool has_bfloat16 = find(root, "bfloat16") != nullptr;
  if (has_bf16 && has_bfloat16) fail("bfloat16", "given together with bf16; keep only bf16");
  const std::string bpath = has_bfloat16 ? "bfloat16" : "bf16";
  const json& b = section(root, "", bpath);
  check_keys(b, bpath, {"enabled"},
             {"immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
              "bf16_optimizer_states"},
             c.ignored_keys);
  read(b, bpath, "enabled", c.bf16);

  if (c.bf16 && h.enabled) {
    fail(bpath + ".enabled", "bf16 and fp16 cannot both be enabled (fp16.enabled is true)");
  }
}

void parse_offload_param(const json& z, Config& c) {
  const std::string path = "zero_optimization.offload_param";
  const json& o = section(z, "zero_optimization", "offload_param");
  check_keys(o, path,
             {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"},
             kNone, c.ignored_keys);
  OffloadParamConfig& op = c.zero.offload_param;
  read_enum(o, path, "device", op.device, {"none", "cpu", "nvme"});
  read_paths(o, path, "nvme_path", op.nvme_path, true);
  if (read(o, path, "buffer_count", op.buffer_count)) positive(path + ".buffer_count", op.buffer_count);
  if (read(o, path, "buffer_size", op.buffer_size)) positive(path + ".buffer_size", op.buffer_size);
  if (read(o, path, "max_in_cpu", op.max_in_cpu)) non_negative(path + ".max_in_cpu", op.max_in_cpu);
  read(o, path, "pin_memory", op.pin_memory);
  if (op.device == "nvme" && op.nvme_path.empty()) {
    fail(path + ".nvme_path", "required when device is nvme");
  }
}

void parse_offload_optimizer(const json& z, Config& c) {
  const std::string path = "zero_optimization.offload_optimizer";
  const json& o = section(z, "zero_optimization", "offload_optimizer");
  check_keys(o, path,
             {"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read",
              "pipeline_write", "fast_init", "ratio"},
             {"super_offload", "convert_grad_on_cpu", "cpuadam_cores_perc"}, c.ignored_keys);
  OffloadOptimizerConfig& oo = c.zero.offload_optimizer;
  read_enum(o, path, "device", oo.device, {"none", "cpu", "nvme"});
  read_paths(o, path, "nvme_path", oo.nvme_path, true);
  if (read(o, path, "buffer_count", oo.buffer_count)) positive(path + ".buffer_count", oo.buffer_count);
  read(o, path, "pin_memory", oo.pin_memory);
  read(o, path, "pipeline_read", oo.pipeline_read);
  read(o, path, "pipeline_write", oo.pipeline_write);
  read(o, path, "fast_init", oo.fast_init);
  if (read(o, path, "ratio", oo.ratio)) {
    if (!(oo.ratio > 0.0 && oo.ratio <= 1.0)) {
      fail(path + ".ratio", "must be in (0, 1], got " + num(oo.ratio));
    }
  }
  if (oo.device == "nvme" && oo.nvme_path.empty()) {
    fail(path + ".nvme_path", "required when device is nvme");
  }
}

void parse_zero(const json& root, Config& c) {
  const std::string path = "zero_optimization";
  const json& z = section(root, "", path);
  check_keys(z, path, kZeroKnown, kZeroIgnored, c.ignored_keys);
  ZeroConfig& zc = c.zero;
  if (read(z, path, "stage", zc.stage)) {
    if (zc.stage < 0 || zc.stage > 3) fail(path + ".stage", "must be 0, 1, 2 or 3, got " + num(zc.stage));
  }
  read(z, path, "contiguous_gradients", zc.contiguous_gradients);
  if (!read(z, path, "overlap_comm", zc.overlap_comm)) zc.overlap_comm = zc.stage == 3;
  auto pos = [&](std::string_view key, int64_t& out) {
    if (read(z, path, key, out)) positive(join(path, key), out);
  };
  auto nonneg = [&](std::string_view key, int64_t& out) {
    if (read(z, path, key, out)) non_negative(join(path, key), out);
  };
  pos("reduce_bucket_size", zc.reduce_bucket_size);
  pos("allgather_bucket_size", zc.allgather_bucket_size);
  read(z, path, "reduce_scatter", zc.reduce_scatter);
  read(z, path, "allgather_partitions", zc.allgather_partitions);
  pos("sub_group_size", zc.sub_group_size);
  nonneg("stage3_prefetch_bucket_size", zc.stage3_prefetch_bucket_size);
  nonneg("stage3_param_persistence_threshold", zc.stage3_param_persistence_threshold);
  nonneg("stage3_max_live_parameters", zc.stage3_max_live_parameters);
  nonneg("stage3_max_reuse_distance", zc.stage3_max_reuse_distance);
  pos("zero_hpz_partition_size", zc.hpz_partition_size);
  read(z, path, "stage3_gather_16bit_weights_on_model_save",
       zc.stage3_gather_16bit_weights_on_model_save);
  parse_offload_param(z, c);
  parse_offload_optimizer(z, c);
  if (zc.stage < 3 && zc.offload_param.device != "none") {
    fail(path + ".offload_param.device",
         "offloading parameters needs zero_optimization.stage 3, got stage " + num(zc.stage));
  }
}

void parse_aio(const json& root, Config& c) {
  const std::string path = "aio";
  const json& a = section(root, "", path);
  check_keys(a, path,
             {"block_size", "queue_depth", "intra_op_parallelism", "thread_count", "single_submit",
              "overlap_events", "use_gds"},
             kNone, c.ignored_keys);
  AioConfig& ac = c.aio;
  if (read(a, path, "block_size", ac.block_size)) {
    positive("aio.block_size", ac.block_size);
    if (ac.block_size % 4096 != 0) {
      fail("aio.block_size", "must be a multiple of 4096, got " + num(ac.block_size));
    }
  }
  if (read(a, path, "queue_depth", ac.queue_depth)) positive("aio.queue_depth", ac.queue_depth);
  int64_t intra = 0, threads = 0;
  const bool has_intra = read(a, path, "intra_op_parallelism", intra);
  const bool has_threads = read(a, path, "thread_count", threads);
  if (has_intra) positive("aio.intra_op_parallelism", intra);
  if (has_threads) positive("aio.thread_count", threads);
  if (has_intra && has_threads && intra != threads) {
    fail("aio.thread_count", num(threads) + " differs from aio.intra_op_parallelism " + num(intra) +
                                 " (thread_count is its older name; give one)");
  }
  if (has_intra) ac.intra_op_parallelism = intra;
  else if (has_threads) ac.intra_op_parallelism = threads;
  read(a, path, "single_submit", ac.single_submit);
  read(a, path, "overlap_events", ac.overlap_events);
  read(a, path, "use_gds", ac.use_gds);
}

void parse_activation_checkpointing(const json& root, Config& c) {
  const std::string path = "activation_checkpointing";
  const json& a = section(root, "", path);
  check_keys(a, path,
             {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
              "number_checkpoints", "synchronize_checkpoint_boundary", "profile"},
             kNone, c.ignored_keys);
  ActivationCheckpointingConfig& ac = c.activation_checkpointing;
  read(a, path, "partition_activations", ac.partition_activations);
  read(a, path, "cpu_checkpointing", ac.cpu_checkpointing);
  read(a, path, "contiguous_memory_optimization", ac.contiguous_memory_optimization);
  if (const json* n = find(a, "number_checkpoints")) {
    // null (DeepSpeed's None), and false as some configs write it, mean none.
    if (n->is_null() || (n->is_boolean() && !n->get<bool>())) {
      ac.number_checkpoints = 0;
    } else if (n->is_number()) {
      ac.number_checkpoints = to_int(*n, path + ".number_checkpoints");
      non_negative(path + ".number_checkpoints", ac.number_checkpoints);
    } else {
      wrong_type(path + ".number_checkpoints", "an integer or null", *n);
    }
  }
  read(a, path, "synchronize_checkpoint_boundary", ac.synchronize_checkpoint_boundary);
  read(a, path, "profile", ac.profile);
}

// model.init_from: the Hugging Face config.json next to the weights fills
// the model keys the config leaves out and must agree with those it sets;
// families and features Strata's model lacks are refused by the config.json
// field that names them, never trained with wrong logits.
json model_with_hf_config(const json& m, const std::string& from) {
  std::string dir = from;
  if (!is_directory(from)) {
    if (!path_exists(from)) fail("model.init_from", "'" + from + "' does not exist");
    dir = from.find('/') == std::string::npos ? "." : from.substr(0, from.find_last_of('/'));
  }
  const std::string cpath = dir + "/config.json";
  if (!path_exists(cpath)) {
    if (is_directory(from)) fail("model.init_from", "no config.json in " + from);
    return m;  // one file without a config: the model section says it all
  }
  std::ifstream in(cpath);
  json hf = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (hf.is_discarded() || !hf.is_object()) fail("model.init_from", cpath + " is not a JSON object");
  const std::string where = "model.init_from (" + cpath + ")";
  auto str = [&](const char* key, const std::string& dflt) {
    if (!hf.contains(key) || hf[key].is_null()) return dflt;
    if (!hf[key].is_string()) fail(where, std::string(key) + " is not a string");
    return hf[key].get<std::string>();
  };
  auto flag = [&](const char* key) { return hf.contains(key) && hf[key].is_boolean() && hf[key].get<bool>(); };
  const std::string type = str("model_type", "llama");
  if (type != "llama" && type != "mistral" && type != "qwen2" && type != "qwen3") {
    fail(where, "model_type '" + type + "' is not supported (llama, mistral, qwen2 or qwen3)");
  }

  // Rotary embeddings: transformers 5 writes rope_parameters (with rope_theta
  // inside), older versions rope_scaling (null for plain RoPE) and rope_theta.
  const char* rope_key = "rope_scaling";
  json rope = json::object();
  if (hf.contains("rope_parameters") && hf["rope_parameters"].is_object()) {
    rope_key = "rope_parameters";
    rope = hf["rope_parameters"];
  } else if (hf.contains("rope_scaling") && hf["rope_scaling"].is_object()) {
    rope = hf["rope_scaling"];
  }
  const std::string rope_type = rope.value("rope_type", rope.value("type", std::string("default")));
  json scaling = {{"type", "none"}};
  auto rope_number = [&](const char* key) {
    if (!rope.contains(key) || !rope[key].is_number()) {
      fail(where, std::string(rope_key) + "." + key + " is missing (rope_type '" + rope_type + "' needs it)");
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
    fail(where, std::string(rope_key) + ".rope_type '" + rope_type +
                    "' is not supported (default, linear and llama3 are)");
  }
  for (const json* j : {&hf, &rope}) {
    if (j->contains("partial_rotary_factor") && (*j)["partial_rotary_factor"].is_number() &&
        (*j)["partial_rotary_factor"].get<double>() != 1.0) {
      fail(where, "partial_rotary_factor " + (*j)["partial_rotary_factor"].dump() + " is not supported (1.0 is)");
    }
  }
  json theta = hf.contains("rope_theta") ? hf["rope_theta"] : json();
  if (rope.contains("rope_theta")) theta = rope["rope_theta"];

  // Biases: Qwen2's q/k/v biases are part of its family; anywhere else a
  // bias flag would also put one on o_proj or the MLP, which Strata lacks.
  if (type != "qwen2" && flag("attention_bias")) {
    fail(where, "attention_bias true is not supported for model_type '" + type +
                    "' (it adds an o_proj bias; only qwen2's q/k/v biases are)");
  }
  if (flag("mlp_bias")) fail(where, "mlp_bias true is not supported (Strata's MLP has no biases)");
  if (str("hidden_act", "silu") != "silu") {
    fail(where, "hidden_act '" + hf["hidden_act"].get<std::string>() + "' is not supported (SwiGLU uses silu)");
  }
  // Sliding-window attention: Mistral's window is kept (and checked against
  // seq_len by parse_model); Qwen's per-layer windows are refused.
  json window;
  if (type == "mistral") window = hf.contains("sliding_window") && !hf["sliding_window"].is_null() ? hf["sliding_window"] : json(0);
  if (flag("use_sliding_window")) fail(where, "use_sliding_window true is not supported (sliding-window attention)");
  if (hf.contains("layer_types") && hf["layer_types"].is_array()) {
    for (const json& t : hf["layer_types"]) {
      if (t != "full_attention") fail(where, "layer_types entry " + t.dump() + " is not supported (full_attention is)");
    }
  }

  const std::vector<std::pair<const char*, json>> fields = {
      {"family", json(type)},
      {"dim", hf.value("hidden_size", json())},
      {"n_layers", hf.value("num_hidden_layers", json())},
      {"n_heads", hf.value("num_attention_heads", json())},
      {"n_kv_heads", hf.value("num_key_value_heads", hf.value("num_attention_heads", json()))},
      {"head_dim", hf.value("head_dim", json())},
      {"ffn_hidden", hf.value("intermediate_size", json())},
      {"vocab_size", hf.value("vocab_size", json())},
      {"norm_eps", hf.value("rms_norm_eps", json())},
      {"rope_theta", theta},
      {"rope_scaling", scaling},
      {"sliding_window", window},
      {"tie_embeddings", hf.value("tie_word_embeddings", json(true))}};
  json out = m;
  for (const auto& [key, v] : fields) {
    if (v.is_null()) continue;
    if (!m.contains(key)) {
      out[key] = v;
      continue;
    }
    const bool same = v.is_number() && m[key].is_number() ? v.get<double>() == m[key].get<double>() : v == m[key];
    if (!same) {
      fail(std::string("model.") + key, m[key].dump() + " here, but " + cpath + " says " + v.dump());
    }
  }
  return out;
}

void parse_model(const json& root, Config& c) {
  const std::string path = "model";
  json merged = section(root, "", path);
  check_keys(merged, path,
             {"vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden", "multiple_of",
              "seq_len", "tie_embeddings", "rope_theta", "rope_scaling", "norm_eps", "init_std", "family",
              "sliding_window", "init_from"},
             kNone, c.ignored_keys);
  ModelConfig& mc = c.model;
  if (read(merged, path, "init_from", mc.init_from) && !mc.init_from.empty()) {
    merged = model_with_hf_config(merged, mc.init_from);
  }
  const json& m = merged;
  auto pos = [&](std::string_view key, int64_t& out) {
    if (read(m, path, key, out)) positive(join(path, key), out);
  };
  std::string family = "llama";
  read_enum(m, path, "family", family, {"llama", "mistral", "qwen2", "qwen3"});
  mc.family = family == "mistral" ? ModelFamily::kMistral
              : family == "qwen2" ? ModelFamily::kQwen2
              : family == "qwen3" ? ModelFamily::kQwen3
                                  : ModelFamily::kLlama;
  pos("vocab_size", mc.vocab_size);
  pos("dim", mc.dim);
  pos("n_layers", mc.n_layers);
  pos("n_heads", mc.n_heads);
  if (read(m, path, "n_kv_heads", mc.n_kv_heads)) non_negative("model.n_kv_heads", mc.n_kv_heads);
  if (read(m, path, "head_dim", mc.explicit_head_dim)) non_negative("model.head_dim", mc.explicit_head_dim);
  if (read(m, path, "ffn_hidden", mc.ffn_hidden)) non_negative("model.ffn_hidden", mc.ffn_hidden);
  pos("multiple_of", mc.multiple_of);
  pos("seq_len", mc.seq_len);
  read(m, path, "tie_embeddings", mc.tie_embeddings);
  if (read(m, path, "rope_theta", mc.rope_theta)) positive("model.rope_theta", mc.rope_theta);
  if (read(m, path, "norm_eps", mc.norm_eps)) positive("model.norm_eps", mc.norm_eps);
  if (read(m, path, "init_std", mc.init_std)) positive("model.init_std", mc.init_std);
  if (read(m, path, "sliding_window", mc.sliding_window)) non_negative("model.sliding_window", mc.sliding_window);
  if (const json* r = find(m, "rope_scaling"); r != nullptr && !r->is_null()) {
    const std::string rp = "model.rope_scaling";
    if (!r->is_object()) wrong_type(rp, "an object", *r);
    check_keys(*r, rp, {"type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
               kNone, c.ignored_keys);
    RopeScaling& rs = mc.rope_scaling;
    std::string type = "none";
    read_enum(*r, rp, "type", type, {"none", "linear", "llama3"});
    rs.type = type == "linear" ? RopeType::kLinear : type == "llama3" ? RopeType::kLlama3 : RopeType::kNone;
    if (read(*r, rp, "factor", rs.factor)) positive(rp + ".factor", rs.factor);
    if (read(*r, rp, "low_freq_factor", rs.low_freq_factor)) positive(rp + ".low_freq_factor", rs.low_freq_factor);
    if (read(*r, rp, "high_freq_factor", rs.high_freq_factor)) positive(rp + ".high_freq_factor", rs.high_freq_factor);
    if (read(*r, rp, "original_max_position_embeddings", rs.original_max_position_embeddings)) {
      positive(rp + ".original_max_position_embeddings", rs.original_max_position_embeddings);
    }
    if (rs.type == RopeType::kLlama3 && !(rs.high_freq_factor > rs.low_freq_factor)) {
      fail(rp + ".high_freq_factor", "must be greater than low_freq_factor (" + num(rs.low_freq_factor) + ")");
    }
  }
  // Bound sizes so that derived products (8 * dim, vocab x dim) cannot overflow.
  constexpr int64_t kMaxDim = int64_t{1} << 32;
  for (auto [key, v] : {std::pair<const char*, int64_t>{"vocab_size", mc.vocab_size},
                        {"dim", mc.dim}, {"ffn_hidden", mc.ffn_hidden}, {"seq_len", mc.seq_len},
                        {"multiple_of", mc.multiple_of}, {"head_dim", mc.explicit_head_dim}}) {
    if (v > kMaxDim) fail(join(path, key), "must be <= 2^32, got " + num(v));
  }

  if (mc.explicit_head_dim == 0 && mc.dim % mc.n_heads != 0) {
    fail("model.dim", num(mc.dim) + " is not divisible by model.n_heads " + num(mc.n_heads) +
                          " (or set model.head_dim)");
  }
  if (mc.head_dim() % 2 != 0) {
    fail(mc.explicit_head_dim > 0 ? "model.head_dim" : "model.dim",
         "head dim " + num(mc.head_dim()) + " must be even for rotary embeddings");
  }
  if (mc.n_heads % mc.kv_heads() != 0) {
    fail("model.n_kv_heads", num(mc.kv_heads()) + " does not divide model.n_heads " + num(mc.n_heads));
  }
  if (mc.sliding_window > 0 && mc.family != ModelFamily::kMistral) {
    fail("model.sliding_window", "only model.family mistral has a sliding window");
  }
  if (mc.sliding_window > 0 && mc.sliding_window < mc.seq_len) {
    fail("model.sliding_window", num(mc.sliding_window) + " is shorter than model.seq_len " + num(mc.seq_len) +
                                     ": sliding-window attention is not implemented (a window of at least "
                                     "seq_len changes nothing)");
  }
}

// A token file written by tools/tokenize.py has a sidecar, FILE.json: its
// dtype is data.format unless the config sets one (then they must agree), its
// tokenizer's vocabulary must fit model.vocab_size, and its token count must
// match the file's size. Files without a sidecar are taken as the config says.
void apply_token_sidecars(Config& c, bool format_set) {
  std::string from;  // the sidecar data.format came from
  for (const std::string& file : c.data.paths) {
    const std::string side = file + ".json";
    if (!path_exists(side) || is_directory(side)) continue;
    const json j = json::parse(file_contents(side), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || j.value("format", std::string()) != "strata-tokens") {
      fail(side, "not a token file sidecar (tools/tokenize.py writes {\"format\": \"strata-tokens\", ...})");
    }
    for (const char* k : {"dtype", "vocab_size", "tokens"}) {
      if (!j.contains(k)) fail(side, std::string("no \"") + k + "\" field");
    }
    if (!j["dtype"].is_string() || (j["dtype"] != "uint16" && j["dtype"] != "uint32")) {
      fail(side, "dtype " + j["dtype"].dump() + " is not uint16 or uint32");
    }
    if (!j["vocab_size"].is_number_integer() || !j["tokens"].is_number_integer() || j["tokens"].get<int64_t>() < 0) {
      fail(side, "vocab_size and tokens must be non-negative integers");
    }
    const std::string dtype = j["dtype"].get<std::string>();
    if (format_set && c.data.format != dtype) {
      fail("data.format", json(c.data.format).dump() + " here, but " + side + " says the file is " + dtype);
    }
    if (!format_set) {
      if (!from.empty() && c.data.format != dtype) {
        fail(side, "dtype " + dtype + " differs from " + c.data.format + " in " + from + " (one data.format for all files)");
      }
      c.data.format = dtype;
      from = side;
    }
    const int64_t vocab = j["vocab_size"].get<int64_t>();
    if (vocab > c.model.vocab_size) {
      fail("model.vocab_size", num(c.model.vocab_size) + " is smaller than the vocabulary of the tokenizer that wrote " +
                                   file + " (" + num(vocab) + ", in " + side + ")");
    }
    struct stat st;
    if (::stat(file.c_str(), &st) == 0) {
      const int64_t tokens = j["tokens"].get<int64_t>(), width = dtype == "uint16" ? 2 : 4;
      if (int64_t(st.st_size) != tokens * width) {
        fail(side, "says " + num(tokens) + " " + dtype + " tokens (" + num(tokens * width) + " bytes), but " + file +
                       " has " + num(int64_t(st.st_size)) + " bytes");
      }
    }
  }
}

// tensorboard / csv_monitor (docs/monitors.md): DeepSpeed's keys and defaults.
void parse_monitor(const json& root, Config& c, const char* key, MonitorConfig& m) {
  const json& o = section(root, "", key);
  check_keys(o, key, {"enabled", "output_path", "job_name"}, kNone, c.ignored_keys);
  read(o, key, "enabled", m.enabled);
  read(o, key, "output_path", m.output_path);
  if (read(o, key, "job_name", m.job_name) && m.job_name.empty()) {
    fail(std::string(key) + ".job_name", "must not be empty (it names the directory under output_path)");
  }
}

void parse_data(const json& root, Config& c) {
  const std::string path = "data";
  const json& d = section(root, "", path);
  check_keys(d, path, {"path", "format", "val_fraction", "eval_interval", "eval_batches"}, kNone,
             c.ignored_keys);
  DataConfig& dc = c.data;
  if (!read_paths(d, path, "path", dc.paths, false)) {
    fail("data.path", "required: a token file or a list of files");
  }
  if (dc.paths.empty()) fail("data.path", "the list of files is empty");
  const bool format_set = read_enum(d, path, "format", dc.format, {"text", "uint16", "uint32"});
  apply_token_sidecars(c, format_set);
  if (read(d, path, "val_fraction", dc.val_fraction)) {
    in_closed("data.val_fraction", dc.val_fraction, 0.0, 0.5);
  }
  if (read(d, path, "eval_interval", dc.eval_interval)) {
    non_negative("data.eval_interval", dc.eval_interval);
  }
  if (read(d, path, "eval_batches", dc.eval_batches)) positive("data.eval_batches", dc.eval_batches);
}

void parse_run(const json& root, Config& c) {
  const std::string path = "run";
  const json& r = section(root, "", path);
  check_keys(r, path,
             {"steps", "seed", "metrics", "log_file", "log_level", "device", "threads",
              "device_memory_mb", "cpu_adam_isa", "overlap_optimizer",
              "swap_checksums", "optimizer_state_dtype", "checkpoint", "recompute", "schedule", "rates",
              "deterministic"},
             kNone, c.ignored_keys);
  RunConfig& rc = c.run;
  if (read(r, path, "steps", rc.steps)) positive("run.steps", rc.steps);
  if (const json* rates = find(r, "rates"); rates != nullptr && !rates->is_null()) {
    const std::string rp = "run.rates";
    if (!rates->is_object()) wrong_type(rp, "an object", *rates);
    check_keys(*rates, rp,
               {"device_tflops", "h2d_gbps", "d2h_gbps", "pcie_both_gbps", "nvme_read_gbps", "nvme_write_gbps",
                "nvme_both_gbps", "adam_gelems", "checksum_gbps", "grad_add_gelems", "net_gbps", "intra_node_gbps"},
               kNone, c.ignored_keys);
    RateOverrides& o = rc.rates;
    for (auto [key, out] : {std::pair<const char*, double*>{"device_tflops", &o.device_tflops},
                            {"h2d_gbps", &o.h2d_gbps}, {"d2h_gbps", &o.d2h_gbps},
                            {"pcie_both_gbps", &o.pcie_both_gbps}, {"nvme_read_gbps", &o.nvme_read_gbps},
                            {"nvme_write_gbps", &o.nvme_write_gbps}, {"nvme_both_gbps", &o.nvme_both_gbps},
                            {"adam_gelems", &o.adam_gelems}, {"checksum_gbps", &o.checksum_gbps},
                            {"grad_add_gelems", &o.grad_add_gelems},
                            {"net_gbps", &o.net_gbps}, {"intra_node_gbps", &o.intra_node_gbps}}) {
      if (read(*rates, rp, key, *out)) positive(join(rp, key), *out);
    }
  }
  read(r, path, "seed", rc.seed);
  read(r, path, "metrics", rc.metrics);
  read(r, path, "log_file", rc.log_file);
  read_enum(r, path, "log_level", rc.log_level, {"trace", "debug", "info", "warn", "error", "off"});
  std::string device = device_kind_name(rc.device);
  read_enum(r, path, "device", device, {"cpu", "cuda"});
  rc.device = device == "cuda" ? DeviceKind::kCuda : DeviceKind::kCpu;
  if (read(r, path, "threads", rc.threads)) non_negative("run.threads", rc.threads);
  if (read(r, path, "device_memory_mb", rc.device_memory_mb)) {
    non_negative("run.device_memory_mb", rc.device_memory_mb);
  }
  read_enum(r, path, "cpu_adam_isa", rc.cpu_adam_isa,
            {"auto", "scalar", "avx2", "avx512", "avx512_bf16"});
  if (const json* v = find(r, "overlap_optimizer")) {
    if (v->is_boolean()) {
      rc.overlap_optimizer = v->get<bool>() ? OptimizerOverlap::kOn : OptimizerOverlap::kOff;
    } else if (v->is_string() && lower(v->get<std::string>()) == "auto") {
      rc.overlap_optimizer = OptimizerOverlap::kAuto;
    } else {
      wrong_type(join(path, "overlap_optimizer"), "true, false or \"auto\"", *v);
    }
  }
  read(r, path, "swap_checksums", rc.swap_checksums);
  read(r, path, "deterministic", rc.deterministic);
  read_enum(r, path, "optimizer_state_dtype", rc.optimizer_state_dtype, {"fp32", "bf16"});
  std::string recompute = recompute_name(rc.recompute);
  read_enum(r, path, "recompute", recompute, {"auto", "always", "never"});
  rc.recompute = recompute == "always" ? Recompute::kAlways : recompute == "never" ? Recompute::kNever : Recompute::kAuto;
  std::string schedule = schedule_name(rc.schedule);
  read_enum(r, path, "schedule", schedule, {"auto", "micro_batch", "layer"});
  rc.schedule = schedule == "micro_batch" ? StepSchedule::kMicroBatch
                : schedule == "layer"     ? StepSchedule::kLayer
                                          : StepSchedule::kAuto;
  const json& ck = section(r, path, "checkpoint");
  check_keys(ck, "run.checkpoint", {"dir", "every", "keep", "snapshot_gb"}, kNone, c.ignored_keys);
  read(ck, "run.checkpoint", "dir", rc.checkpoint.dir);
  if (read(ck, "run.checkpoint", "every", rc.checkpoint.every)) non_negative("run.checkpoint.every", rc.checkpoint.every);
  if (read(ck, "run.checkpoint", "keep", rc.checkpoint.keep)) positive("run.checkpoint.keep", rc.checkpoint.keep);
  if (read(ck, "run.checkpoint", "snapshot_gb", rc.checkpoint.snapshot_gb)) {
    non_negative("run.checkpoint.snapshot_gb", rc.checkpoint.snapshot_gb);
  }
  if (rc.checkpoint.every > 0 && rc.checkpoint.dir.empty()) {
    fail("run.checkpoint.dir", "required when run.checkpoint.every is set");
  }
}

void parse_comm(const json& root, Config& c) {
  const std::string path = "comm";
  const json& r = section(root, "", path);
  check_keys(r, path, {"backend", "timeout_s", "gradient_reduction", "keep_gathered", "secondary_shard"}, kNone,
             c.ignored_keys);
  if (r.contains("keep_gathered") && r["keep_gathered"].is_number()) {
    int64_t n = 0;
    read(r, path, "keep_gathered", n);
    non_negative("comm.keep_gathered", n);
    c.comm.keep_gathered = std::to_string(n);
  } else {
    read_enum(r, path, "keep_gathered", c.comm.keep_gathered, {"auto", "all", "none"});
  }
  read_enum(r, path, "backend", c.comm.backend, {"auto", "gloo", "nccl"});
  read_enum(r, path, "gradient_reduction", c.comm.gradient_reduction, {"auto", "per_step", "per_micro_batch"});
  // DeepSpeed's zero_hpz_partition_size > 1 asks for the secondary shard
  // unless comm.secondary_shard says otherwise.
  if (!read_enum(r, path, "secondary_shard", c.comm.secondary_shard, {"auto", "on", "off"}) &&
      c.zero.hpz_partition_size > 1) {
    c.comm.secondary_shard = "on";
  }
  if (read(r, path, "timeout_s", c.comm.timeout_s)) positive("comm.timeout_s", c.comm.timeout_s);
  read_enum(root, "", "communication_data_type", c.comm.data_type, {"fp32", "bf16", "fp16"});
}

// One category's split: {"device": f, "host": f, "nvme": f}, absent tiers 0,
// each in [0, 1], summing to 1.
TierSplit read_split(const json& v, const std::string& key) {
  if (!v.is_object()) wrong_type(key, "an object like {\"device\": 0.2, \"host\": 0.3, \"nvme\": 0.5}", v);
  std::vector<std::string> unused;
  check_keys(v, key, {"device", "host", "nvme"}, kNone, unused);
  TierSplit s{0.0, 0.0, 0.0};
  if (read(v, key, "device", s.device)) in_closed(key + ".device", s.device, 0.0, 1.0);
  if (read(v, key, "host", s.host)) in_closed(key + ".host", s.host, 0.0, 1.0);
  if (read(v, key, "nvme", s.nvme)) in_closed(key + ".nvme", s.nvme, 0.0, 1.0);
  const double sum = s.device + s.host + s.nvme;
  if (std::abs(sum - 1.0) > 1e-6) {
    fail(key, "fractions must sum to 1, got " + num(sum));
  }
  return s;
}

void parse_placement(const json& root, Config& c) {
  const json* v = find(root, "placement");
  if (v == nullptr || v->is_null()) return;
  PlacementConfig& pc = c.placement;
  if (v->is_string()) {
    if (lower(v->get<std::string>()) != "auto") {
      fail("placement", "expected \"auto\" or an object of per-category splits, got " + v->dump());
    }
    pc.auto_place = true;
    return;
  }
  if (!v->is_object()) wrong_type("placement", "\"auto\" or an object", *v);
  const std::string path = "placement";
  check_keys(*v, path,
             {"auto", "param16", "grad", "master", "exp_avg", "exp_avg_sq", "optimizer", "nvme_path",
              "headroom", "by_bound"},
             kNone, c.ignored_keys);
  read(*v, path, "auto", pc.auto_place);
  // "optimizer" is shorthand for master, exp_avg and exp_avg_sq; a category
  // named on its own wins over it.
  if (const json* o = find(*v, "optimizer")) {
    const TierSplit s = read_split(*o, path + ".optimizer");
    pc.master = pc.exp_avg = pc.exp_avg_sq = s;
    pc.has_master = pc.has_exp_avg = pc.has_exp_avg_sq = true;
  }
  struct Cat { const char* name; TierSplit* split; bool* has; };
  for (const Cat& cat : {Cat{"param16", &pc.param16, &pc.has_param16},
                         Cat{"grad", &pc.grad, &pc.has_grad},
                         Cat{"master", &pc.master, &pc.has_master},
                         Cat{"exp_avg", &pc.exp_avg, &pc.has_exp_avg},
                         Cat{"exp_avg_sq", &pc.exp_avg_sq, &pc.has_exp_avg_sq}}) {
    if (const json* s = find(*v, cat.name)) {
      *cat.split = read_split(*s, path + "." + cat.name);
      *cat.has = true;
    }
  }
  read_paths(*v, path, "nvme_path", pc.nvme_path, true);
  if (pc.auto_place && (pc.has_param16 || pc.has_grad || pc.has_master || pc.has_exp_avg ||
                        pc.has_exp_avg_sq)) {
    fail("placement.auto", "true cannot be combined with per-category splits (auto chooses them)");
  }
  if (read(*v, path, "headroom", pc.headroom)) in_closed("placement.headroom", pc.headroom, 0.0, 0.9);
  read(*v, path, "by_bound", pc.by_bound);
  const bool any_nvme = pc.param16.nvme > 0 || pc.grad.nvme > 0 || pc.master.nvme > 0 ||
                        pc.exp_avg.nvme > 0 || pc.exp_avg_sq.nvme > 0;
  if (any_nvme && pc.nvme_path.empty() && c.zero.offload_optimizer.nvme_path.empty() &&
      c.zero.offload_param.nvme_path.empty()) {
    fail("placement.nvme_path", "required when a category is placed on nvme (or give "
                                "zero_optimization.offload_optimizer.nvme_path)");
  }
}

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
  check_keys(j, "", kTopKnown, kTopIgnored, c.ignored_keys);

  parse_batch(j, c);
  if (read(j, "", "gradient_clipping", c.gradient_clipping)) {
    non_negative("gradient_clipping", c.gradient_clipping);
  }
  if (read(j, "", "steps_per_print", c.steps_per_print)) {
    positive("steps_per_print", c.steps_per_print);
  }
  parse_optimizer(j, c);
  parse_scheduler(j, c);
  parse_precision(j, c);
  parse_zero(j, c);
  parse_aio(j, c);
  parse_activation_checkpointing(j, c);
  parse_model(j, c);
  parse_data(j, c);
  parse_run(j, c);
  parse_placement(j, c);
  parse_comm(j, c);
  parse_monitor(j, c, "tensorboard", c.tensorboard);
  parse_monitor(j, c, "csv_monitor", c.csv_monitor);

  if (c.data.format == "text" && c.model.vocab_size != 256) {
    fail("model.vocab_size", "must be 256 for data.format text (bytes), got " +
                                 num(c.model.vocab_size));
  }
  c.run.compute_dtype = c.bf16 ? ComputeDtype::kBf16 : c.fp16.enabled ? ComputeDtype::kFp16 : ComputeDtype::kFp32;
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
  return j;
}

json resume_invariants(const Config& c) {
  const ModelConfig& m = c.model;
  const SchedulerConfig& s = c.scheduler;
  const OptimizerConfig& o = c.optimizer;
  return {
      {"model", model_invariants(m)},
      {"optimizer", {{"type", o.type}, {"params", {{"lr", o.lr}, {"betas", {o.beta1, o.beta2}}, {"eps", o.eps},
                                                   {"weight_decay", o.weight_decay}}}}},
      {"scheduler", {{"type", s.type}, {"params", {{"warmup_min_lr", s.warmup_min_lr}, {"warmup_max_lr", s.warmup_max_lr},
                                                   {"warmup_num_steps", s.warmup_num_steps},
                                                   {"warmup_type", s.warmup_type},
                                                   {"total_num_steps", s.total_num_steps},
                                                   {"warmup_min_ratio", s.warmup_min_ratio},
                                                   {"cos_min_ratio", s.cos_min_ratio}}}}},
      {"gradient_clipping", c.gradient_clipping},
      {"train_batch_size", c.train_batch_size},
      {"run", {{"seed", c.run.seed}, {"compute_dtype", compute_dtype_name(c.run.compute_dtype)},
               {"optimizer_state_dtype", c.run.optimizer_state_dtype}}},
      {"data", {{"format", c.data.format}, {"val_fraction", c.data.val_fraction}}},
  };
}

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
