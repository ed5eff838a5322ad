// Reading Hugging Face safetensors: one file, or a directory of shards with
// model.safetensors.index.json (or of *.safetensors files without one).
// Tensors are read one at a time and converted to fp32. No LibTorch here.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace strata {

// Hugging Face's name for a Strata parameter ("layer.3.wq" ->
// "model.layers.3.self_attn.q_proj.weight"), the same in every family Strata
// reads (Llama, Mistral, Qwen2, Qwen3). Throws Error for a name without one.
std::string hf_tensor_name(const std::string& strata_name);

// Note [Expert tensors]
// An MoE layer's router and experts have two Hugging Face layouts:
// per_expert, one tensor per expert and projection, as transformers 5.23's
// save_pretrained writes by default (Mixtral: block_sparse_moe.gate and
// block_sparse_moe.experts.E.w1/w3/w2; the Qwen families: mlp.gate and
// mlp.experts.E.gate_proj/up_proj/down_proj), and fused, as its
// save_original_format=False and newer Hub checkpoints write (every family:
// mlp.gate, mlp.experts.gate_up_proj [E, 2I, D] with the gate rows first and
// mlp.experts.down_proj [E, D, I]), which is Strata's own (model/experts.cc).
enum class ExpertLayout { kPerExpert, kFused };
const char* expert_layout_name(ExpertLayout l);  // "per_expert", "fused"
// One Hugging Face tensor of a Strata parameter: its name and shape, and the
// parameter's elements [offset, offset + numel) it holds (row-major).
struct HfPiece {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0, numel = 0;
};
// The Hugging Face tensors of Strata parameter `strata_name` of `shape` in
// model family `family` ("mixtral", ...): the one hf_tensor_name gives, or an
// MoE parameter's in `layout`. Throws Error for a name without one.
std::vector<HfPiece> hf_pieces(const std::string& strata_name, const std::vector<int64_t>& shape,
                               const std::string& family, ExpertLayout layout);

// PEFT's key of a LoRA adapter ("layer.3.lora_A.q_proj" ->
// "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"; the
// adapter's name left out, as PEFT saves it). Throws Error for a name
// without one.
std::string peft_tensor_name(const std::string& strata_name);

// "[4096, 128]"
std::string shape_text(const std::vector<int64_t>& shape);

class SafetensorsSet {
 public:
  // Parses every file's header. Throws InputError naming the file.
  explicit SafetensorsSet(const std::string& path);

  bool has(const std::string& name) const { return tensors_.count(name) > 0; }
  const std::vector<int64_t>& shape(const std::string& name) const;
  const std::string& file(const std::string& name) const;  // the file that holds it
  // Reads tensor `name` (F32, BF16 or F16) into out[0..numel) as fp32.
  // Throws InputError naming the file for a short read or another dtype.
  void read_f32(const std::string& name, float* out) const;
  // Elements [first, first + count) of tensor `name` (row-major) into out[0..count) as fp32.
  void read_f32(const std::string& name, int64_t first, int64_t count, float* out) const;
  std::vector<std::string> names() const;

 private:
  struct Entry {
    std::string file, dtype;
    std::vector<int64_t> shape;
    int64_t begin = 0, end = 0;  // absolute byte offsets in the file
  };
  void add_file(const std::string& path);
  std::map<std::string, Entry> tensors_;
};

}  // namespace strata
