// `strata export`: a checkpoint's weights as Hugging Face safetensors
// and a config.json, streamed through a buffer of --buffer-size (64 MiB:
// host memory stays that, whatever the size of the model or of its largest
// tensor). No LibTorch here.
#include "cli/export.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "checkpoint/safetensors.h"
#include "cpu_adam/convert.h"
#include "memory/buffer.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"
#include "util/progress.h"

namespace strata {

namespace {

using nlohmann::json;

struct ExportOptions {
  std::string checkpoint;
  std::string out;
  std::string dtype;  // bf16, or fp32 for a LoRA adapter (PEFT keeps adapters in fp32)
  bool merged = false;  // a LoRA checkpoint: the base with its adapters merged in (Note [Merged export])
  std::string max_shard_size = "5GB";
  std::string buffer_size = "64MiB";  // fp32 bytes read per chunk
  std::string expert_layout = "per_expert";  // Note [Expert tensors] in checkpoint/safetensors.h
};

// "5GB", "500MB", "2GiB", "1000000" -> bytes. Throws ConfigError naming the flag.
int64_t parse_size(const std::string& text, const char* flag) {
  size_t used = 0;
  double v = 0.0;
  try {
    v = std::stod(text, &used);
  } catch (...) {
    throw ConfigError(flag, "expected a size like 5GB or 500MB, got '" + text + "'");
  }
  std::string unit = text.substr(used);
  for (char& c : unit) c = char(std::toupper(static_cast<unsigned char>(c)));
  const std::map<std::string, double> units = {{"", 1.0},       {"B", 1.0},          {"KB", 1e3},
                                               {"MB", 1e6},     {"GB", 1e9},         {"TB", 1e12},
                                               {"KIB", 1024.0}, {"MIB", 1048576.0},  {"GIB", 1073741824.0}};
  auto it = units.find(unit);
  if (it == units.end() || !(v > 0.0)) {
    throw ConfigError(flag, "expected a positive size like 5GB or 500MB, got '" + text + "'");
  }
  return int64_t(v * it->second);
}

// The config.json that makes transformers build exactly this model: every
// field whose default would differ is set. `model` is a checkpoint's
// invariants.model (model_invariants: family, head_dim, rope_scaling and
// sliding_window only where they differ from Llama's defaults).
json hf_config(const json& model, const std::string& dtype) {
  const int64_t dim = model.at("dim"), heads = model.at("n_heads");
  const int64_t head_dim = model.value("head_dim", dim / heads);
  const double theta = model.at("rope_theta");
  const std::string family = model.value("family", std::string("llama"));
  const json r = model.value("rope_scaling", json{{"type", "none"}});
  json rope = {{"rope_type", "default"}, {"rope_theta", theta}};
  if (r.at("type") != "none") {
    rope = r;
    rope.erase("type");
    rope["rope_type"] = r.at("type");
    rope["rope_theta"] = theta;
  }
  static const std::map<std::string, std::string> arch = {{"llama", "LlamaForCausalLM"},
                                                          {"mistral", "MistralForCausalLM"},
                                                          {"qwen2", "Qwen2ForCausalLM"},
                                                          {"qwen3", "Qwen3ForCausalLM"},
                                                          {"mixtral", "MixtralForCausalLM"},
                                                          {"qwen2_moe", "Qwen2MoeForCausalLM"},
                                                          {"qwen3_moe", "Qwen3MoeForCausalLM"}};
  if (!arch.count(family)) throw InputError("manifest invariants.model.family", "unknown family '" + family + "'");
  json c = {{"architectures", {arch.at(family)}},
            {"model_type", family},
            {"hidden_size", dim},
            {"intermediate_size", model.at("ffn_hidden")},
            {"num_hidden_layers", model.at("n_layers")},
            {"num_attention_heads", heads},
            {"num_key_value_heads", model.at("n_kv_heads")},
            {"head_dim", head_dim},
            {"vocab_size", model.at("vocab_size")},
            {"max_position_embeddings", model.at("seq_len")},
            {"rms_norm_eps", model.at("norm_eps")},
            {"rope_theta", theta},
            {"rope_parameters", rope},
            {"tie_word_embeddings", model.at("tie_embeddings")},
            {"attention_dropout", 0.0},
            {"hidden_act", "silu"},
            {"use_cache", true},
            {"bos_token_id", nullptr},
            {"eos_token_id", nullptr},
            {"pad_token_id", nullptr},
            {"torch_dtype", dtype == "bf16" ? "bfloat16" : "float32"},
            {"dtype", dtype == "bf16" ? "bfloat16" : "float32"}};
  if (family == "llama") {
    c["attention_bias"] = false;
    c["mlp_bias"] = false;
    c["pretraining_tp"] = 1;
  }
  if (family == "qwen3") c["attention_bias"] = false;  // Qwen3's flag would add o_proj's too
  if (family == "mistral") {
    const int64_t w = model.value("sliding_window", int64_t{0});
    c["sliding_window"] = w > 0 ? json(w) : json(nullptr);
  }
  if (model.contains("moe")) {
    // Hugging Face's names (model_invariants writes them so); config.json's
    // intermediate_size is Mixtral's expert width, the Qwen families' dense
    // width (no layer of Strata's MoE models has a dense MLP: every layer
    // sparse, mlp_only_layers empty).
    const json& e = model.at("moe");
    for (const char* k : {"num_experts_per_tok", "router_aux_loss_coef", "output_router_logits"}) c[k] = e.at(k);
    if (family == "mixtral") {
      c["num_local_experts"] = e.at("num_experts");
      c["intermediate_size"] = e.at("moe_intermediate_size");
      c["router_jitter_noise"] = 0.0;
      const int64_t w = model.value("sliding_window", int64_t{0});
      c["sliding_window"] = w > 0 ? json(w) : json(nullptr);
    } else {
      c["num_experts"] = e.at("num_experts");
      c["moe_intermediate_size"] = e.at("moe_intermediate_size");
      c["norm_topk_prob"] = e.at("norm_topk_prob");
      c["decoder_sparse_step"] = 1;
      c["mlp_only_layers"] = json::array();
    }
    if (family == "qwen2_moe") {
      c["shared_expert_intermediate_size"] = e.at("shared_expert_intermediate_size");
      c["qkv_bias"] = true;
    }
    if (family == "qwen3_moe") c["attention_bias"] = false;
  }
  if (family == "qwen2" || family == "qwen3" || family == "qwen2_moe" || family == "qwen3_moe") {
    c["use_sliding_window"] = false;
    c["sliding_window"] = nullptr;
    c["max_window_layers"] = model.at("n_layers");
    c["layer_types"] = json::array();
    for (int64_t l = 0; l < model.at("n_layers").get<int64_t>(); ++l) c["layer_types"].push_back("full_attention");
  }
  return c;
}

void write_all(int fd, const void* p, size_t n, const std::string& path) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::write(fd, c, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) throw IoError(path, errno, "cannot write");
    c += w;
    n -= size_t(w);
  }
}

// One tensor of the export: its name in the files, shape, size, offset in
// its file's data section and file, and where its values come from: fill(at,
// n, out) writes elements [at, at + n) as fp32.
struct ExportItem {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel, begin;
  size_t shard;
  std::function<void(int64_t at, int64_t n, float* out)> fill;
};

// The export's files: tensors in model order, a new file when the next would
// pass the limit (a tensor larger than the limit gets a file of its own).
struct ExportLayout {
  std::vector<ExportItem> items;
  std::vector<int64_t> shard_bytes;
  int64_t largest = 0, total = 0;  // largest tensor's elements, all bytes
  bool lora = false;               // a PEFT adapter

  std::string file_name(size_t s) const {
    if (lora) return "adapter_model.safetensors";
    return shard_bytes.size() == 1 ? std::string("model.safetensors")
                                   : strprintf("model-%05zu-of-%05zu.safetensors", s + 1, shard_bytes.size());
  }
};

// Adds a tensor to `l`: a new file when it would pass the limit (a tensor
// larger than the limit gets a file of its own).
void add_item(ExportLayout& l, int eb, int64_t max_shard, std::string name, std::vector<int64_t> shape,
              std::function<void(int64_t, int64_t, float*)> fill) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const int64_t bytes = numel * eb;
  if (l.shard_bytes.empty() || (l.shard_bytes.back() > 0 && l.shard_bytes.back() + bytes > max_shard)) {
    l.shard_bytes.push_back(0);
  }
  l.items.push_back({std::move(name), std::move(shape), numel, l.shard_bytes.back(), l.shard_bytes.size() - 1,
                     std::move(fill)});
  l.shard_bytes.back() += bytes;
  l.largest = std::max(l.largest, numel);
  l.total += bytes;
}

// The checkpoint's own tensors: a model's in Hugging Face's names, or a LoRA
// run's adapters in PEFT's (one file, as PEFT reads it).
// An MoE model's experts in `experts` (Note [Expert tensors] in
// checkpoint/safetensors.h): per expert, each projection a tensor of its
// own, read from its range of the fused parameter.
ExportLayout plan_export(const Manifest& m, CheckpointReader& reader, int eb, int64_t max_shard, bool lora,
                         ExpertLayout experts) {
  ExportLayout l;
  if (lora) max_shard = INT64_MAX;
  const std::string family = m.invariants["model"].value("family", std::string("llama"));
  for (const TensorEntry& t : m.tensors) {
    if (lora) {
      add_item(l, eb, max_shard, peft_tensor_name(t.name), t.shape, [&reader, start = t.start](int64_t at, int64_t n, float* out) {
        reader.read(Category::kMaster, start + at, n, reinterpret_cast<std::byte*>(out));
      });
      continue;
    }
    for (const HfPiece& p : hf_pieces(t.name, t.shape, family, experts)) {
      add_item(l, eb, max_shard, p.name, p.shape, [&reader, start = t.start + p.offset](int64_t at, int64_t n, float* out) {
        reader.read(Category::kMaster, start + at, n, reinterpret_cast<std::byte*>(out));
      });
    }
  }
  return l;
}

// Note [Merged export]
// `strata export --merged` of a LoRA checkpoint: the full model, every tensor
// of the base (model.init_from's files) with each adapted linear's weight
// W + scaling x (B A), the product and the sum in fp32 and rounded once to
// the export dtype (PEFT's merge_and_unload computes the same delta, B A x
// scaling). The adapters (A [r, in], B [out, r]) are read whole from the
// checkpoint, once per tensor; the base streams through in chunks.
struct MergedAdapter {
  std::vector<float> a, b;  // A [r, in], B [out, r]
  int64_t r = 0, in = 0;
};

ExportLayout plan_merged_export(const Manifest& m, CheckpointReader& reader, const SafetensorsSet& base, int eb,
                                int64_t max_shard, std::vector<std::unique_ptr<MergedAdapter>>& adapters) {
  const json& lora = m.invariants["model"]["lora"];
  const double r = lora.at("r").get<double>(), alpha = lora.at("lora_alpha").get<double>();
  const double scaling = lora.at("use_rslora").get<bool>() ? alpha / std::sqrt(r) : alpha / r;
  // Each adapted weight's HF name -> its adapter.
  std::map<std::string, MergedAdapter*> by_weight;
  std::map<std::string, const TensorEntry*> entries;
  for (const TensorEntry& t : m.tensors) entries[t.name] = &t;
  for (const TensorEntry& t : m.tensors) {
    const size_t at = t.name.find(".lora_A.");
    if (at == std::string::npos) continue;
    const std::string module = t.name.substr(at + 8), layer = t.name.substr(0, at);
    const TensorEntry* b = entries.at(layer + ".lora_B." + module);
    auto ad = std::make_unique<MergedAdapter>();
    ad->r = t.shape.at(0);
    ad->in = t.shape.at(1);
    ad->a.resize(size_t(ad->r * ad->in));
    ad->b.resize(size_t(b->shape.at(0) * b->shape.at(1)));
    reader.read(Category::kMaster, t.start, int64_t(ad->a.size()), reinterpret_cast<std::byte*>(ad->a.data()));
    reader.read(Category::kMaster, b->start, int64_t(ad->b.size()), reinterpret_cast<std::byte*>(ad->b.data()));
    // "layer.L.lora_A.q_proj" -> PEFT's key -> the base's "model.layers.L.self_attn.q_proj.weight".
    std::string hf = peft_tensor_name(t.name);
    hf = hf.substr(std::string("base_model.model.").size());
    hf = hf.substr(0, hf.size() - std::string("lora_A.weight").size()) + "weight";
    if (!base.has(hf)) throw InputError(base.file(base.names().front()), "no tensor " + hf + " for adapter " + t.name);
    if (base.shape(hf) != std::vector<int64_t>{b->shape.at(0), ad->in}) {
      throw InputError(base.file(hf), "tensor " + hf + " has shape " + shape_text(base.shape(hf)) +
                                          ", but its adapter makes " + shape_text({b->shape.at(0), ad->in}));
    }
    by_weight[hf] = ad.get();
    adapters.push_back(std::move(ad));
  }
  ExportLayout l;
  for (const std::string& name : base.names()) {
    MergedAdapter* ad = by_weight.count(name) ? by_weight.at(name) : nullptr;
    add_item(l, eb, max_shard, name, base.shape(name), [&base, name, ad, scaling](int64_t at, int64_t n, float* out) {
      base.read_f32(name, at, n, out);
      if (ad == nullptr) return;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t o = (at + i) / ad->in, j = (at + i) % ad->in;
        float d = 0.0f;  // (B A)[o, j] in fp32
        for (int64_t k = 0; k < ad->r; ++k) d += ad->b[size_t(o * ad->r + k)] * ad->a[size_t(k * ad->in + j)];
        out[i] += float(double(d) * scaling);
      }
    });
  }
  return l;
}

// The chunks tensors stream through, and the progress over all files.
struct ExportStream {
  HostBuffer& f32;
  HostBuffer& out;
  int64_t chunk;
  ProgressBar& bar;
  size_t done = 0;
};

// Writes file s of `l` (atomically: a temporary file renamed into place)
// and its entries of `weight_map`.
void write_export_file(const ExportOptions& opt, const ExportLayout& l, size_t s, ExportStream& io, json& weight_map) {
  const int eb = opt.dtype == "bf16" ? 2 : 4;
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  for (const ExportItem& it : l.items) {
    if (it.shard != s) continue;
    header[it.name] = {{"dtype", opt.dtype == "bf16" ? "BF16" : "F32"},
                       {"shape", it.shape},
                       {"data_offsets", {it.begin, it.begin + it.numel * eb}}};
    weight_map[it.name] = l.file_name(s);
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8 != 0) h.push_back(' ');  // the data section starts 8-aligned
  const std::string path = opt.out + "/" + l.file_name(s);
  const std::string tmp = opt.out + "/." + l.file_name(s) + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw IoError(tmp, errno, "cannot create");
  try {
    const uint64_t hlen = h.size();
    write_all(fd, &hlen, 8, tmp);  // little-endian on every machine Strata runs on
    write_all(fd, h.data(), h.size(), tmp);
    for (const ExportItem& it : l.items) {
      if (it.shard != s) continue;
      for (int64_t o = 0; o < it.numel; o += io.chunk) {
        const int64_t n = std::min(io.chunk, it.numel - o);
        it.fill(o, n, io.f32.as<float>());
        const void* src = io.f32.data();
        if (eb == 2) {
          const float* x = io.f32.as<float>();
          uint16_t* y = io.out.as<uint16_t>();
          for (int64_t i = 0; i < n; ++i) y[i] = cpu_adam::float_to_bf16(x[i]);  // as torch converts
          src = io.out.data();
        }
        write_all(fd, src, size_t(n * eb), tmp);
      }
      io.bar.update(int64_t(++io.done), it.name);
    }
    if (::fsync(fd) != 0) throw IoError(tmp, errno, "cannot sync");
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) throw IoError(tmp, errno, "cannot close");
  rename_path(tmp, path);
}

// adapter_config.json for a LoRA checkpoint: PEFT's LoraConfig fields that
// say what the adapters are (model.lora of the invariants, the run's config).
json adapter_config(const Manifest& m) {
  const json& l = m.invariants["model"]["lora"];
  std::string base;
  if (m.config.contains("lora") && m.config["lora"].is_object()) {
    base = m.config["lora"].value("base_model_name_or_path", std::string());
  }
  if (base.empty() && m.config.contains("model") && m.config["model"].is_object()) {
    base = m.config["model"].value("init_from", std::string());
  }
  double dropout = 0.0;
  if (m.config.contains("lora") && m.config["lora"].is_object()) dropout = m.config["lora"].value("lora_dropout", 0.0);
  return {{"peft_type", "LORA"},
          {"task_type", "CAUSAL_LM"},
          {"base_model_name_or_path", base.empty() ? json(nullptr) : json(base)},
          {"r", l.at("r")},
          {"lora_alpha", l.at("lora_alpha")},
          {"lora_dropout", dropout},
          {"target_modules", l.at("target_modules")},
          {"use_rslora", l.at("use_rslora")},
          {"init_lora_weights", true},
          {"bias", "none"},
          {"fan_in_fan_out", false},
          {"modules_to_save", nullptr},
          {"inference_mode", true}};
}

int run_export(ExportOptions opt) {
  const int64_t max_shard = parse_size(opt.max_shard_size, "--max-shard-size");
  const int64_t buffer_elems = std::max<int64_t>(1, parse_size(opt.buffer_size, "--buffer-size") / 4);
  nvme::EngineOptions engine;
  engine.block_size_bytes = int64_t(4) << 20;
  CheckpointReader reader(resolve_checkpoint(opt.checkpoint), engine);
  const Manifest& m = reader.manifest();
  const std::string mpath = reader.dir() + "/manifest.json";
  if (!m.invariants.contains("model")) throw InputError(mpath, "manifest invariants.model: missing");
  const json& model = m.invariants["model"];
  const bool lora = model.contains("lora");
  if (opt.merged && !lora) throw ConfigError("--merged", "the checkpoint " + reader.dir() + " is not of a LoRA run");
  std::unique_ptr<SafetensorsSet> base;
  if (opt.merged) {
    // The base is model.init_from's files (Note [Base identity]: the ones the adapters were trained over).
    std::string from;
    if (m.config.contains("model") && m.config["model"].is_object()) from = m.config["model"].value("init_from", "");
    if (from.empty()) {
      throw ConfigError("--merged", "the run of " + reader.dir() + " drew its base from run.seed (no "
                                    "model.init_from): there are no base files to merge the adapters into");
    }
    if (!path_exists(from)) throw InputError(from, "the base (model.init_from) is not there to merge into");
    // Note [Base identity]: the files must still be the base the adapters were trained over.
    if (m.invariants.contains("lora_base") && base_identity(from) != m.invariants["lora_base"]) {
      throw InputError(from, "is not the base the adapters of " + reader.dir() + " were trained over (its "
                             "files differ from the checkpoint's lora_base): nothing was merged");
    }
    base = std::make_unique<SafetensorsSet>(from);
  }
  if (opt.dtype.empty()) opt.dtype = lora && !opt.merged ? "fp32" : "bf16";
  if (opt.dtype != "bf16" && opt.dtype != "fp32") {
    throw ConfigError("--dtype", "expected bf16 or fp32, got '" + opt.dtype + "'");
  }
  if (opt.expert_layout != "per_expert" && opt.expert_layout != "fused") {
    throw ConfigError("--expert-layout", "expected per_expert or fused, got '" + opt.expert_layout + "'");
  }
  const ExpertLayout experts = opt.expert_layout == "fused" ? ExpertLayout::kFused : ExpertLayout::kPerExpert;
  if (is_directory(opt.out) && !list_dir(opt.out).empty()) {
    throw InputError(opt.out, "exists and is not empty; export writes into a new or empty directory");
  }
  make_dirs(opt.out, 0755);

  const int eb = opt.dtype == "bf16" ? 2 : 4;
  std::vector<std::unique_ptr<MergedAdapter>> adapters;
  ExportLayout l = opt.merged ? plan_merged_export(m, reader, *base, eb, max_shard, adapters)
                              : plan_export(m, reader, eb, max_shard, lora, experts);
  l.lora = lora && !opt.merged;
  const size_t shards = l.shard_bytes.size();
  // Tensors stream through in chunks: host memory is one chunk, whatever the
  // size of the largest tensor (Llama-3's 128256 x 4096 embedding is 2 GiB in fp32).
  const int64_t chunk = std::min<int64_t>(l.largest, buffer_elems);
  HostBuffer f32(size_t(chunk * 4), "export: one chunk (fp32)");
  HostBuffer out(size_t(chunk * eb), "export: one chunk (output dtype)");
  ProgressBar bar("export", int64_t(l.items.size()));
  ExportStream io{f32, out, chunk, bar};
  json weight_map = json::object();
  for (size_t s = 0; s < shards; ++s) write_export_file(opt, l, s, io, weight_map);
  bar.finish();
  if (shards > 1) {
    write_file_atomic(opt.out + "/model.safetensors.index.json",
                      json({{"metadata", {{"total_size", l.total}}}, {"weight_map", weight_map}}).dump(2) + "\n");
  }
  if (lora && !opt.merged) {
    write_file_atomic(opt.out + "/adapter_config.json", adapter_config(m).dump(2) + "\n");
  } else {
    write_file_atomic(opt.out + "/config.json", hf_config(model, opt.dtype).dump(2) + "\n");
  }
  log::info("exported step %lld of %s: %zu tensors, %s in %zu file(s) to %s", (long long)m.step,
            reader.dir().c_str(), l.items.size(), format_bytes(double(l.total)).c_str(), shards, opt.out.c_str());
  return kExitOk;
}

}  // namespace

void register_export(CLI::App& app, int& result) {
  auto opt = std::make_shared<ExportOptions>();
  CLI::App* cmd = app.add_subcommand(
      "export", "Write a checkpoint's weights as Hugging Face safetensors (Llama, Mistral, Qwen2, Qwen3, Mixtral, "
                "Qwen2-MoE or Qwen3-MoE)");
  cmd->add_option("checkpoint", opt->checkpoint, "Checkpoint directory (or a directory of them with 'latest')")
      ->required();
  cmd->add_option("--out", opt->out, "Output directory (new or empty)")->required();
  cmd->add_option("--dtype", opt->dtype, "bf16 | fp32 (default: bf16; fp32 for a LoRA adapter)");
  cmd->add_flag("--merged", opt->merged,
                "A LoRA checkpoint: the full model, its base (model.init_from) with the adapters merged in");
  cmd->add_option("--max-shard-size", opt->max_shard_size, "Largest safetensors file: 5GB, 500MB, ...")
      ->capture_default_str();
  cmd->add_option("--buffer-size", opt->buffer_size, "Host memory tensors stream through (fp32 bytes)")
      ->capture_default_str();
  cmd->add_option("--expert-layout", opt->expert_layout,
                  "An MoE model's experts: per_expert (a tensor per expert and projection, transformers' "
                  "save_pretrained default) or fused (experts.gate_up_proj and experts.down_proj)")
      ->capture_default_str();
  cmd->callback([opt, &result]() { result = run_export(*opt); });
}

}  // namespace strata
