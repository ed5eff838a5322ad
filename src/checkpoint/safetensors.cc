#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <map>

#include <nlohmann/json.hpp>

#include "cpu_adam/convert.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"

namespace strata {

namespace {

void pread_all(const std::string& path, int64_t offset, int64_t bytes, void* out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw InputError(path, std::string("cannot open: ") + std::strerror(errno));
  char* p = static_cast<char*>(out);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, size_t(bytes), offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      throw InputError(path, strprintf("truncated: cannot read %lld bytes at offset %lld", (long long)bytes,
                                       (long long)offset));
    }
    p += n;
    offset += n;
    bytes -= n;
  }
  ::close(fd);
}

}  // namespace

std::string hf_tensor_name(const std::string& name) {
  static const std::map<std::string, std::string> layer = {
      {"attn_norm", "input_layernorm.weight"}, {"wq", "self_attn.q_proj.weight"},
      {"wk", "self_attn.k_proj.weight"},       {"wv", "self_attn.v_proj.weight"},
      {"wo", "self_attn.o_proj.weight"},       {"mlp_norm", "post_attention_layernorm.weight"},
      {"w1", "mlp.gate_proj.weight"},          {"w3", "mlp.up_proj.weight"},
      {"w2", "mlp.down_proj.weight"},          {"bq", "self_attn.q_proj.bias"},
      {"bk", "self_attn.k_proj.bias"},         {"bv", "self_attn.v_proj.bias"},
      {"q_norm", "self_attn.q_norm.weight"},   {"k_norm", "self_attn.k_norm.weight"}};
  if (name == "embedding.tok_embedding") return "model.embed_tokens.weight";
  if (name == "head.final_norm") return "model.norm.weight";
  if (name == "head.output") return "lm_head.weight";
  if (name.rfind("layer.", 0) == 0) {
    const size_t dot = name.find('.', 6);
    auto it = dot == std::string::npos ? layer.end() : layer.find(name.substr(dot + 1));
    if (it != layer.end()) return "model.layers." + name.substr(6, dot - 6) + "." + it->second;
  }
  throw Error("no Hugging Face name for parameter '" + name + "'");
}

const char* expert_layout_name(ExpertLayout l) { return l == ExpertLayout::kFused ? "fused" : "per_expert"; }

std::vector<HfPiece> hf_pieces(const std::string& name, const std::vector<int64_t>& shape, const std::string& family,
                               ExpertLayout layout) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const size_t dot = name.find('.', 6);
  const std::string param = name.rfind("layer.", 0) == 0 && dot != std::string::npos ? name.substr(dot + 1) : "";
  const std::string layer = param.empty() ? "" : "model.layers." + name.substr(6, dot - 6) + ".";
  static const std::map<std::string, std::string> shared = {{"shared.w1", "mlp.shared_expert.gate_proj.weight"},
                                                            {"shared.w3", "mlp.shared_expert.up_proj.weight"},
                                                            {"shared.w2", "mlp.shared_expert.down_proj.weight"},
                                                            {"shared.gate", "mlp.shared_expert_gate.weight"}};
  if (shared.count(param)) return {{layer + shared.at(param), shape, 0, numel}};
  const bool mixtral = family == "mixtral", fused = layout == ExpertLayout::kFused;
  if (param == "router") return {{layer + (mixtral && !fused ? "block_sparse_moe.gate.weight" : "mlp.gate.weight"), shape, 0, numel}};
  if (param != "experts.gate_up" && param != "experts.down") return {{hf_tensor_name(name), shape, 0, numel}};
  STRATA_CHECK(shape.size() == 3, "an experts parameter is [E, rows, cols]");
  const bool gate_up = param == "experts.gate_up";
  if (fused) return {{layer + (gate_up ? "mlp.experts.gate_up_proj" : "mlp.experts.down_proj"), shape, 0, numel}};
  // Per expert: gate_up's expert e is its gate [I, D] then its up [I, D].
  const int64_t experts = shape[0], per = numel / experts;
  const std::string prefix = layer + (mixtral ? "block_sparse_moe.experts." : "mlp.experts.");
  std::vector<HfPiece> out;
  for (int64_t e = 0; e < experts; ++e) {
    const std::string ex = prefix + std::to_string(e) + ".";
    if (gate_up) {
      const std::vector<int64_t> half = {shape[1] / 2, shape[2]};
      out.push_back({ex + (mixtral ? "w1.weight" : "gate_proj.weight"), half, e * per, per / 2});
      out.push_back({ex + (mixtral ? "w3.weight" : "up_proj.weight"), half, e * per + per / 2, per / 2});
    } else {
      out.push_back({ex + (mixtral ? "w2.weight" : "down_proj.weight"), {shape[1], shape[2]}, e * per, per});
    }
  }
  return out;
}

std::string peft_tensor_name(const std::string& name) {
  const size_t dot = name.find('.', 6);
  const size_t kind = name.find("lora_");
  if (name.rfind("layer.", 0) != 0 || dot == std::string::npos || kind != dot + 1 || name.size() < kind + 8) {
    throw Error("no PEFT name for parameter '" + name + "'");
  }
  const std::string layer = name.substr(6, dot - 6), ab = name.substr(kind, 6), module = name.substr(kind + 7);
  const bool attention = module == "q_proj" || module == "k_proj" || module == "v_proj" || module == "o_proj";
  return "base_model.model.model.layers." + layer + (attention ? ".self_attn." : ".mlp.") + module + "." + ab +
         ".weight";
}

SafetensorsSet::SafetensorsSet(const std::string& path) {
  if (!is_directory(path)) {
    add_file(path);
    return;
  }
  const std::string index = path + "/model.safetensors.index.json";
  if (path_exists(index)) {
    const nlohmann::json j = nlohmann::json::parse(file_contents(index), nullptr, false);
    if (j.is_discarded() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
      throw InputError(index, "not a safetensors index (no weight_map)");
    }
    std::map<std::string, bool> files;
    for (const auto& [name, file] : j["weight_map"].items()) {
      const std::string f = file.get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos) throw InputError(index, "'" + f + "' is not a file name here");
      files[f] = true;
    }
    for (const auto& [f, unused] : files) {
      if (!path_exists(path + "/" + f)) throw InputError(index, "names shard '" + f + "', which is not in " + path);
      add_file(path + "/" + f);
    }
    return;
  }
  bool any = false;
  for (const std::string& n : list_dir(path)) {
    if (n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0) {
      add_file(path + "/" + n);
      any = true;
    }
  }
  if (!any) throw InputError(path, "no .safetensors files");
}

void SafetensorsSet::add_file(const std::string& path) {
  uint64_t n = 0;
  pread_all(path, 0, 8, &n);
  if (n == 0 || n > (uint64_t(100) << 20)) throw InputError(path, "not a safetensors file (header length)");
  std::string text(size_t(n), '\0');
  pread_all(path, 8, int64_t(n), text.data());
  const nlohmann::json h = nlohmann::json::parse(text, nullptr, false);
  if (h.is_discarded() || !h.is_object()) throw InputError(path, "not a safetensors file (header is not JSON)");
  for (const auto& [name, meta] : h.items()) {
    if (name == "__metadata__") continue;
    Entry e;
    e.file = path;
    try {
      e.dtype = meta.at("dtype").get<std::string>();
      e.shape = meta.at("shape").get<std::vector<int64_t>>();
      e.begin = 8 + int64_t(n) + meta.at("data_offsets").at(0).get<int64_t>();
      e.end = 8 + int64_t(n) + meta.at("data_offsets").at(1).get<int64_t>();
    } catch (const std::exception&) {
      throw InputError(path, "tensor '" + name + "': malformed header entry");
    }
    tensors_[name] = std::move(e);
  }
}

const std::vector<int64_t>& SafetensorsSet::shape(const std::string& name) const { return tensors_.at(name).shape; }
const std::string& SafetensorsSet::file(const std::string& name) const { return tensors_.at(name).file; }

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::vector<std::string> SafetensorsSet::names() const {
  std::vector<std::string> out;
  for (const auto& [n, e] : tensors_) out.push_back(n);
  return out;
}

void SafetensorsSet::read_f32(const std::string& name, int64_t first, int64_t count, float* out) const {
  const Entry& e = tensors_.at(name);
  int64_t numel = 1;
  for (int64_t d : e.shape) numel *= d;
  const int eb = e.dtype == "F32" ? 4 : (e.dtype == "BF16" || e.dtype == "F16") ? 2 : 0;
  if (eb == 0) throw InputError(e.file, "tensor '" + name + "' has dtype " + e.dtype + " (F32, BF16 or F16 expected)");
  if (e.end - e.begin != numel * eb) throw InputError(e.file, "tensor '" + name + "': data_offsets do not match its shape");
  STRATA_CHECK(first >= 0 && count >= 0 && first + count <= numel, "a range outside tensor " + name);
  if (eb == 4) return pread_all(e.file, e.begin + first * 4, count * 4, out);
  uint16_t* half = reinterpret_cast<uint16_t*>(out) + count;
  pread_all(e.file, e.begin + first * 2, count * 2, half);
  for (int64_t i = 0; i < count; ++i) {
    out[i] = e.dtype == "BF16" ? cpu_adam::bf16_to_float(half[i]) : cpu_adam::fp16_to_float(half[i]);
  }
}

void SafetensorsSet::read_f32(const std::string& name, float* out) const {
  int64_t numel = 1;
  for (int64_t d : tensors_.at(name).shape) numel *= d;
  read_f32(name, 0, numel, out);
}

}  // namespace strata
