// Strata's own sections of the config: model, data, run, placement, comm and
// the monitors (docs/config.md). Each function checks its section's keys
// against the table above it, then reads each value with its type and range.
#include <cmath>
#include <utility>

#include "config/sections.h"

namespace strata::config {

// ---- model ----------------------------------------------------------------------

const SectionKeys kModelKeys = {"model",
                                {"vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden",
                                 "multiple_of", "seq_len", "tie_embeddings", "rope_theta", "rope_scaling", "norm_eps",
                                 "init_std", "family", "sliding_window", "init_from", "num_experts",
                                 "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                                 "shared_expert_intermediate_size", "router_aux_loss_coef", "output_router_logits",
                                 "decoder_sparse_step", "mlp_only_layers", "router_jitter_noise"},
                                {}};
const SectionKeys kRopeScalingKeys = {
    "model.rope_scaling",
    {"type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    {}};

namespace {

void parse_rope_scaling(const json& r, Config& c) {
  Section s(r, kRopeScalingKeys, c.ignored_keys);
  RopeScaling& rs = c.model.rope_scaling;
  s.read_enum("type", rs.type, kRopeTypes);
  if (s.read("factor", rs.factor)) positive(s.key("factor"), rs.factor);
  if (s.read("low_freq_factor", rs.low_freq_factor)) positive(s.key("low_freq_factor"), rs.low_freq_factor);
  if (s.read("high_freq_factor", rs.high_freq_factor)) positive(s.key("high_freq_factor"), rs.high_freq_factor);
  if (s.read("original_max_position_embeddings", rs.original_max_position_embeddings)) {
    positive(s.key("original_max_position_embeddings"), rs.original_max_position_embeddings);
  }
  if (rs.type == RopeType::kLlama3 && !(rs.high_freq_factor > rs.low_freq_factor)) {
    fail(s.key("high_freq_factor"), "must be greater than low_freq_factor (" + num(rs.low_freq_factor) + ")");
  }
  s.done();
}

// The rules between the model's keys, once all are read.
void check_model(const ModelConfig& mc) {
  // Bound sizes so that derived products (8 * dim, vocab x dim) cannot overflow.
  constexpr int64_t kMaxDim = int64_t{1} << 32;
  for (auto [key, v] : {std::pair<const char*, int64_t>{"vocab_size", mc.vocab_size},
                        {"dim", mc.dim}, {"ffn_hidden", mc.ffn_hidden}, {"seq_len", mc.seq_len},
                        {"multiple_of", mc.multiple_of}, {"head_dim", mc.explicit_head_dim}}) {
    if (v > kMaxDim) fail(join("model", key), "must be <= 2^32, got " + num(v));
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
  if (mc.sliding_window > 0 && mc.family != ModelFamily::kMistral && mc.family != ModelFamily::kMixtral) {
    fail("model.sliding_window", "only model.family mistral and mixtral have a sliding window");
  }
  if (mc.sliding_window > 0 && mc.sliding_window < mc.seq_len) {
    fail("model.sliding_window", num(mc.sliding_window) + " is shorter than model.seq_len " + num(mc.seq_len) +
                                     ": sliding-window attention is not implemented (a window of at least "
                                     "seq_len changes nothing)");
  }
}

// The MoE keys (docs/config.md, "Mixture of experts"): read for the MoE
// families, refused by name elsewhere; what transformers can express but no
// released checkpoint of these families uses is refused by name too.
void parse_moe(Section& m, ModelConfig& mc) {
  static const char* const kMoeKeys[] = {"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                         "norm_topk_prob", "shared_expert_intermediate_size",
                                         "router_aux_loss_coef", "output_router_logits", "decoder_sparse_step",
                                         "mlp_only_layers", "router_jitter_noise"};
  if (!mc.is_moe()) {
    for (const char* k : kMoeKeys) {
      if (m.find(k) != nullptr && !m.find(k)->is_null()) {
        fail(m.key(k), std::string("model.family ") + model_family_name(mc.family) +
                           " has no experts (the MoE families are mixtral, qwen2_moe and qwen3_moe)");
      }
    }
    return;
  }
  MoeConfig& e = mc.moe;
  const std::string family = model_family_name(mc.family);
  if (!m.read("num_experts", e.num_experts)) fail(m.key("num_experts"), "required for model.family " + family);
  positive(m.key("num_experts"), e.num_experts);
  if (m.read("num_experts_per_tok", e.num_experts_per_tok)) positive(m.key("num_experts_per_tok"), e.num_experts_per_tok);
  if (e.num_experts_per_tok > e.num_experts) {
    fail(m.key("num_experts_per_tok"), num(e.num_experts_per_tok) + " is more than model.num_experts " +
                                           num(e.num_experts));
  }
  if (m.read("moe_intermediate_size", e.moe_intermediate_size)) {
    positive(m.key("moe_intermediate_size"), e.moe_intermediate_size);
  }
  if (mc.family == ModelFamily::kMixtral) {
    e.norm_topk_prob = true;  // Mixtral's router always renormalises
    bool given = true;
    if (m.read("norm_topk_prob", given) && !given) {
      fail(m.key("norm_topk_prob"), "mixtral always renormalises its top-k weights (false is qwen2_moe's and qwen3_moe's)");
    }
  } else {
    m.read("norm_topk_prob", e.norm_topk_prob);
  }
  const bool shared = m.read("shared_expert_intermediate_size", e.shared_expert_intermediate_size);
  if (mc.shared_expert()) {
    if (!shared) fail(m.key("shared_expert_intermediate_size"), "required for model.family " + family);
    positive(m.key("shared_expert_intermediate_size"), e.shared_expert_intermediate_size);
  } else if (shared && e.shared_expert_intermediate_size != 0) {
    fail(m.key("shared_expert_intermediate_size"), "only model.family qwen2_moe has a shared expert");
  }
  if (m.read("router_aux_loss_coef", e.router_aux_loss_coef)) {
    non_negative(m.key("router_aux_loss_coef"), e.router_aux_loss_coef);
  }
  m.read("output_router_logits", e.output_router_logits);
  int64_t step = 1;
  if (m.read("decoder_sparse_step", step) && step != 1) {
    fail(m.key("decoder_sparse_step"), num(step) + " is not supported: every layer has experts (1)");
  }
  if (const json* only = m.find("mlp_only_layers"); only != nullptr && !only->is_null()) {
    if (!only->is_array()) wrong_type(m.key("mlp_only_layers"), "a list of layer indexes", *only);
    if (!only->empty()) fail(m.key("mlp_only_layers"), only->dump() + " is not supported: every layer has experts ([])");
  }
  double jitter = 0.0;
  if (m.read("router_jitter_noise", jitter) && jitter != 0.0) {
    fail(m.key("router_jitter_noise"), num(jitter) + " is not supported (0: the router's input is not jittered)");
  }
}

}  // namespace

void parse_model(Section& top, Config& c) {
  // model.init_from's config.json fills the keys the section leaves out, so
  // the section's keys are checked before it is merged in.
  const json& given = top.object("model");
  check_keys(given, "model", kModelKeys.read, kModelKeys.ignored, c.ignored_keys);
  ModelConfig& mc = c.model;
  json merged = given;
  if (auto from = given.find("init_from"); from != given.end()) {
    if (!from->is_string()) wrong_type("model.init_from", "a string", *from);
    if (!from->get<std::string>().empty()) merged = model_with_hf_config(given, from->get<std::string>());
  }
  Section m(merged, kModelKeys, c.ignored_keys);
  m.read("init_from", mc.init_from);
  auto pos = [&](std::string_view key, int64_t& out) {
    if (m.read(key, out)) positive(m.key(key), out);
  };
  auto nonneg = [&](std::string_view key, int64_t& out) {
    if (m.read(key, out)) non_negative(m.key(key), out);
  };
  m.read_enum("family", mc.family, kModelFamilies);
  pos("vocab_size", mc.vocab_size);
  pos("dim", mc.dim);
  pos("n_layers", mc.n_layers);
  pos("n_heads", mc.n_heads);
  nonneg("n_kv_heads", mc.n_kv_heads);
  nonneg("head_dim", mc.explicit_head_dim);
  nonneg("ffn_hidden", mc.ffn_hidden);
  pos("multiple_of", mc.multiple_of);
  pos("seq_len", mc.seq_len);
  m.read("tie_embeddings", mc.tie_embeddings);
  if (m.read("rope_theta", mc.rope_theta)) positive("model.rope_theta", mc.rope_theta);
  if (m.read("norm_eps", mc.norm_eps)) positive("model.norm_eps", mc.norm_eps);
  if (m.read("init_std", mc.init_std)) positive("model.init_std", mc.init_std);
  nonneg("sliding_window", mc.sliding_window);
  if (const json* r = m.find("rope_scaling"); r != nullptr && !r->is_null()) {
    if (!r->is_object()) wrong_type("model.rope_scaling", "an object", *r);
    parse_rope_scaling(*r, c);
  }
  parse_moe(m, mc);
  m.done();
  check_model(mc);
}

// ---- data -------------------------------------------------------------------------

const SectionKeys kDataKeys = {
    "data", {"path", "format", "val_fraction", "eval_interval", "eval_batches", "sampling", "truncate"}, {}};

void parse_data(Section& top, Config& c) {
  Section d(top.object("data"), kDataKeys, c.ignored_keys);
  DataConfig& dc = c.data;
  if (!d.read_paths("path", dc.paths, false)) fail("data.path", "required: a token file or a list of files");
  if (dc.paths.empty()) fail("data.path", "the list of files is empty");
  const bool format_set = d.read_enum("format", dc.format, kDataFormats);
  apply_token_sidecars(c, format_set);
  if (d.read("val_fraction", dc.val_fraction)) in_closed("data.val_fraction", dc.val_fraction, 0.0, 0.5);
  if (d.read("eval_interval", dc.eval_interval)) non_negative("data.eval_interval", dc.eval_interval);
  if (d.read("eval_batches", dc.eval_batches)) positive("data.eval_batches", dc.eval_batches);
  d.read_enum("sampling", dc.sampling, kDataSamplings);
  d.read("truncate", dc.truncate);
  if (dc.sampling != DataSampling::kWindows) {
    // Examples come from the files' indexes (tools/tokenize.py writes them
    // for messages and prompt + completion rows).
    for (size_t i = 0; i < dc.paths.size(); ++i) {
      if (dc.index_paths[i].empty()) {
        fail("data.sampling", std::string(data_sampling_name(dc.sampling)) + " draws examples, and " + dc.paths[i] +
                                  " has no example index (its sidecar names none: tools/tokenize.py writes one for "
                                  "rows with messages or prompt + completion)");
      }
    }
  }
  d.done();
}

// ---- run --------------------------------------------------------------------------

const SectionKeys kRunKeys = {"run",
                              {"steps", "seed", "metrics", "log_file", "log_level", "device", "threads",
                               "device_memory_mb", "cpu_adam_isa", "overlap_optimizer", "swap_checksums",
                               "optimizer_state_dtype", "checkpoint", "recompute", "activations", "schedule",
                               "rates", "deterministic", "expert_gemm"},
                              {}};
// run.rates' keys are the rates table's (config/rates.h).
static Keys rate_keys() {
  Keys k;
  for (const RateSpec& r : kRateTable) k.push_back(r.key);
  return k;
}
const SectionKeys kRatesKeys = {"run.rates", rate_keys(), {}};
const SectionKeys kCheckpointKeys = {"run.checkpoint", {"dir", "every", "keep", "snapshot_gb"}, {}};
const SectionKeys kActivationsKeys = {
    "run.activations",
    {"keep_device_layers", "keep_host_layers", "keep_device_micro_batches", "keep_host_micro_batches",
     "in_gradient_homes"},
    {}};

namespace {

void parse_rates(const json& rates, Config& c) {
  Section s(rates, kRatesKeys, c.ignored_keys);
  for (const RateSpec& r : kRateTable) {
    double& v = c.run.rates[r.kind];
    if (s.read(r.key, v)) positive(s.key(r.key), v);
  }
  s.done();
}

void parse_checkpoint(Section& r, Config& c) {
  Section ck(r.object("checkpoint"), kCheckpointKeys, c.ignored_keys);
  CheckpointConfig& cc = c.run.checkpoint;
  ck.read("dir", cc.dir);
  if (ck.read("every", cc.every)) non_negative("run.checkpoint.every", cc.every);
  if (ck.read("keep", cc.keep)) positive("run.checkpoint.keep", cc.keep);
  if (ck.read("snapshot_gb", cc.snapshot_gb)) non_negative("run.checkpoint.snapshot_gb", cc.snapshot_gb);
  if (cc.every > 0 && cc.dir.empty()) fail("run.checkpoint.dir", "required when run.checkpoint.every is set");
  ck.done();
}

// run.activations: given, it fixes which layers keep their entries, so
// run.recompute must leave the choice open (auto).
void parse_activations(Section& r, Config& c) {
  Section a(r.object("activations"), kActivationsKeys, c.ignored_keys);
  RunConfig& rc = c.run;
  for (auto [key, v] : {std::pair{"keep_device_layers", &rc.keep_device_layers},
                        std::pair{"keep_host_layers", &rc.keep_host_layers}}) {
    if (!a.read(key, *v)) continue;
    non_negative(a.key(key), *v);
    if (*v > c.model.n_layers) {
      fail(a.key(key), "is " + std::to_string(*v) + ", more than the model's " + std::to_string(c.model.n_layers) +
                           " layers");
    }
  }
  // Part of one more layer, in micro-batches (the plan checks them against
  // the step's micro-batches and the layers left).
  bool micro_given = false;
  for (auto [key, v] : {std::pair{"keep_device_micro_batches", &rc.keep_device_micro},
                        std::pair{"keep_host_micro_batches", &rc.keep_host_micro}}) {
    if (!a.read(key, *v)) continue;
    non_negative(a.key(key), *v);
    micro_given = true;
  }
  a.read("in_gradient_homes", rc.packs_in_grad_homes);  // where device packs live, not which
  a.done();
  const bool given = rc.keep_device_layers >= 0 || rc.keep_host_layers >= 0 || micro_given;
  if (!given) return;
  rc.keep_device_layers = std::max<int64_t>(rc.keep_device_layers, 0);
  rc.keep_host_layers = std::max<int64_t>(rc.keep_host_layers, 0);
  if (rc.recompute != Recompute::kAuto) {
    fail("run.activations", std::string("fixes which layers recompute; run.recompute is ") +
                                recompute_name(rc.recompute) + ", which decides that too: leave it auto");
  }
  if (rc.keep_device_layers + rc.keep_host_layers > c.model.n_layers) {
    fail("run.activations", "keep_device_layers + keep_host_layers = " +
                                std::to_string(rc.keep_device_layers + rc.keep_host_layers) + ", more than the model's " +
                                std::to_string(c.model.n_layers) + " layers");
  }
}

}  // namespace

void parse_run(Section& top, Config& c) {
  Section r(top.object("run"), kRunKeys, c.ignored_keys);
  RunConfig& rc = c.run;
  if (r.read("steps", rc.steps)) positive("run.steps", rc.steps);
  if (const json* rates = r.find("rates"); rates != nullptr && !rates->is_null()) {
    if (!rates->is_object()) wrong_type("run.rates", "an object", *rates);
    parse_rates(*rates, c);
  }
  r.read("seed", rc.seed);
  r.read("metrics", rc.metrics);
  r.read("log_file", rc.log_file);
  r.read_choice("log_level", rc.log_level, {"trace", "debug", "info", "warn", "error", "off"});
  r.read_enum("device", rc.device, kDeviceKinds);
  if (r.read("threads", rc.threads)) non_negative("run.threads", rc.threads);
  if (r.read("device_memory_mb", rc.device_memory_mb)) non_negative("run.device_memory_mb", rc.device_memory_mb);
  r.read_choice("cpu_adam_isa", rc.cpu_adam_isa, {"auto", "scalar", "avx2", "avx512", "avx512_bf16"});
  if (const json* v = r.find("overlap_optimizer")) {
    if (v->is_boolean()) {
      rc.overlap_optimizer = v->get<bool>() ? OptimizerOverlap::kOn : OptimizerOverlap::kOff;
    } else if (v->is_string() && lower(v->get<std::string>()) == "auto") {
      rc.overlap_optimizer = OptimizerOverlap::kAuto;
    } else {
      wrong_type("run.overlap_optimizer", "true, false or \"auto\"", *v);
    }
  }
  r.read("swap_checksums", rc.swap_checksums);
  r.read("deterministic", rc.deterministic);
  r.read_enum("optimizer_state_dtype", rc.optimizer_state_dtype, kMomentDtypes);
  r.read_enum("recompute", rc.recompute, kRecomputes);
  parse_activations(r, c);
  r.read_enum("schedule", rc.schedule, kSchedules);
  r.read_enum("expert_gemm", rc.expert_gemm, kExpertGemms);
  parse_checkpoint(r, c);
  r.done();
}

// ---- placement ---------------------------------------------------------------------

const SectionKeys kPlacementKeys = {"placement",
                                    {"auto", "param16", "grad", "master", "exp_avg", "exp_avg_sq", "optimizer",
                                     "nvme_path", "headroom", "by_bound"},
                                    {}};
// One category's split (placement.<category>).
const SectionKeys kSplitKeys = {"placement.<category>", {"device", "host", "nvme"}, {}};

namespace {

// {"device": f, "host": f, "nvme": f}: absent tiers 0, each in [0, 1], summing to 1.
TierSplit read_split(const json& v, const std::string& key) {
  if (!v.is_object()) wrong_type(key, "an object like {\"device\": 0.2, \"host\": 0.3, \"nvme\": 0.5}", v);
  std::vector<std::string> unused;
  Section s(v, key, kSplitKeys, unused);
  TierSplit t{0.0, 0.0, 0.0};
  if (s.read("device", t.device)) in_closed(key + ".device", t.device, 0.0, 1.0);
  if (s.read("host", t.host)) in_closed(key + ".host", t.host, 0.0, 1.0);
  if (s.read("nvme", t.nvme)) in_closed(key + ".nvme", t.nvme, 0.0, 1.0);
  const double sum = t.device + t.host + t.nvme;
  if (std::abs(sum - 1.0) > 1e-6) fail(key, "fractions must sum to 1, got " + num(sum));
  s.done();
  return t;
}

}  // namespace

void parse_placement(Section& top, Config& c) {
  const json* v = top.find("placement");
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
  Section p(*v, kPlacementKeys, c.ignored_keys);
  p.read("auto", pc.auto_place);
  // "optimizer" is shorthand for master, exp_avg and exp_avg_sq; a category
  // named on its own wins over it.
  if (const json* o = p.find("optimizer")) {
    const TierSplit s = read_split(*o, p.key("optimizer"));
    pc.master = pc.exp_avg = pc.exp_avg_sq = s;
    pc.has_master = pc.has_exp_avg = pc.has_exp_avg_sq = true;
  }
  struct Cat { const char* name; TierSplit* split; bool* has; };
  for (const Cat& cat : {Cat{"param16", &pc.param16, &pc.has_param16},
                         Cat{"grad", &pc.grad, &pc.has_grad},
                         Cat{"master", &pc.master, &pc.has_master},
                         Cat{"exp_avg", &pc.exp_avg, &pc.has_exp_avg},
                         Cat{"exp_avg_sq", &pc.exp_avg_sq, &pc.has_exp_avg_sq}}) {
    if (const json* s = p.find(cat.name)) {
      *cat.split = read_split(*s, p.key(cat.name));
      *cat.has = true;
    }
  }
  p.read_paths("nvme_path", pc.nvme_path, true);
  if (pc.auto_place && (pc.has_param16 || pc.has_grad || pc.has_master || pc.has_exp_avg || pc.has_exp_avg_sq)) {
    fail("placement.auto", "true cannot be combined with per-category splits (auto chooses them)");
  }
  if (p.read("headroom", pc.headroom)) in_closed("placement.headroom", pc.headroom, 0.0, 0.9);
  p.read("by_bound", pc.by_bound);
  const bool any_nvme = pc.param16.nvme > 0 || pc.grad.nvme > 0 || pc.master.nvme > 0 || pc.exp_avg.nvme > 0 ||
                        pc.exp_avg_sq.nvme > 0;
  if (any_nvme && pc.nvme_path.empty() && c.zero.offload_optimizer.nvme_path.empty() &&
      c.zero.offload_param.nvme_path.empty()) {
    fail("placement.nvme_path", "required when a category is placed on nvme (or give "
                                "zero_optimization.offload_optimizer.nvme_path)");
  }
  p.done();
}

// ---- comm ------------------------------------------------------------------------

const SectionKeys kCommKeys = {
    "comm", {"backend", "timeout_s", "gradient_reduction", "keep_gathered", "secondary_shard"}, {}};

void parse_comm(Section& top, Config& c) {
  Section r(top.object("comm"), kCommKeys, c.ignored_keys);
  if (const json* k = r.find("keep_gathered"); k != nullptr && k->is_number()) {
    int64_t n = 0;
    r.read("keep_gathered", n);
    non_negative("comm.keep_gathered", n);
    c.comm.keep_gathered = {KeepGathered::Mode::kBlocks, n};
  } else {
    r.read_enum("keep_gathered", c.comm.keep_gathered.mode, kKeepGatheredModes);
  }
  r.read_enum("backend", c.comm.backend, kCommBackends);
  r.read_enum("gradient_reduction", c.comm.gradient_reduction, kGradientReductions);
  // DeepSpeed's zero_hpz_partition_size > 1 asks for the secondary shard
  // unless comm.secondary_shard says otherwise.
  if (!r.read_enum("secondary_shard", c.comm.secondary_shard, kSecondaryShards) && c.zero.hpz_partition_size > 1) {
    c.comm.secondary_shard = SecondaryShard::kOn;
  }
  if (r.read("timeout_s", c.comm.timeout_s)) positive("comm.timeout_s", c.comm.timeout_s);
  top.read_enum("communication_data_type", c.comm.data_type, kComputeDtypes);
  r.done();
}

// ---- tensorboard, csv_monitor (docs/monitors.md): DeepSpeed's keys and defaults -----

const SectionKeys kMonitorKeys = {"tensorboard", {"enabled", "output_path", "job_name"}, {}};

void parse_monitor(Section& top, Config& c, const char* key, MonitorConfig& m) {
  Section o(top.object(key), key, kMonitorKeys, c.ignored_keys);
  o.read("enabled", m.enabled);
  o.read("output_path", m.output_path);
  if (o.read("job_name", m.job_name) && m.job_name.empty()) {
    fail(o.key("job_name"), "must not be empty (it names the directory under output_path)");
  }
  o.done();
}

}  // namespace strata::config
