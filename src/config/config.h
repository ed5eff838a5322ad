// The training configuration: one JSON file with DeepSpeed-compatible keys plus
// Strata's own sections (model, data, run). Parsing validates every key; see
// docs/config.md for each key, its default and its effect.
#pragma once

#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "config/rates.h"

namespace strata {

// The decoder family: which Hugging Face class the layers are, and so which
// optional parameters a layer has (docs/config.md, model.family).
enum class ModelFamily {
  kLlama,    // LlamaForCausalLM
  kMistral,  // MistralForCausalLM: Llama's layers (plus a sliding window >= seq_len)
  kQwen2,    // Qwen2ForCausalLM: biases on the q, k and v projections
  kQwen3,    // Qwen3ForCausalLM: RMSNorm over each head of q and k, before rotary
  // Mixtures of experts (ModelConfig::moe; Note [Experts] in model/layer_ops.cc):
  kMixtral,   // MixtralForCausalLM: Llama's attention, experts renormalised over the top k
  kQwen2Moe,  // Qwen2MoeForCausalLM: Qwen2's attention, experts plus a sigmoid-gated shared expert
  kQwen3Moe,  // Qwen3MoeForCausalLM: Qwen3's attention, experts
};
// "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"
const char* model_family_name(ModelFamily f);

// model.rope_scaling: how rotary frequencies are rescaled for long contexts
// (Hugging Face's rope_parameters). kNone is plain RoPE.
enum class RopeType { kNone, kLinear, kLlama3 };
const char* rope_type_name(RopeType t);  // "none", "linear", "llama3"
struct RopeScaling {
  RopeType type = RopeType::kNone;
  double factor = 1.0;                              // linear, llama3
  double low_freq_factor = 1.0;                     // llama3
  double high_freq_factor = 4.0;                    // llama3
  int64_t original_max_position_embeddings = 8192;  // llama3
};

// lora: LoRA adapters over a frozen base, with PEFT's LoraConfig names and
// meanings (docs/config.md, "lora"; Note [State kinds] in memory/layout.h).
// The linears an adapter can target, in PEFT's names for these families.
enum class LoraModule : uint8_t { kQ, kK, kV, kO, kGate, kUp, kDown };
inline constexpr size_t kLoraModuleCount = 7;
const char* lora_module_name(LoraModule m);  // "q_proj", "k_proj", ..., "down_proj"
// lora.init_lora_weights: true (A kaiming-uniform with a = sqrt 5, B zeros)
// or "gaussian" (A normal with std 1 / r, B zeros).
enum class LoraInit { kKaimingUniform, kGaussian };
struct LoraConfig {
  bool enabled = false;            // a `lora` section is present: the base is frozen
  int64_t r = 8;                   // the adapters' rank
  double alpha = 8.0;              // lora_alpha
  double dropout = 0.0;            // lora_dropout, on each adapter's input, in [0, 1)
  std::array<bool, kLoraModuleCount> targets{};  // target_modules
  bool all_linear = false;         // target_modules was "all-linear" (every linear but the head)
  bool use_rslora = false;         // scaling alpha / sqrt(r) instead of alpha / r
  LoraInit init = LoraInit::kKaimingUniform;
  // A PEFT adapter directory (adapter_config.json, adapter_model.safetensors)
  // to start from; "" = A from run.seed, B zeros.
  std::string init_from;
  // adapter_config.json's base_model_name_or_path on export; "" = model.init_from.
  std::string base_model_name_or_path;

  bool targets_module(LoraModule m) const { return enabled && targets[size_t(m)]; }
  double scaling() const;  // PEFT's: alpha / r, or alpha / sqrt(r) with use_rslora
};

// The mixture-of-experts keys of the model section, by Hugging Face's names
// (docs/config.md, "Mixture of experts"): every layer's MLP is num_experts
// SwiGLU experts of moe_intermediate_size, each token routed to
// num_experts_per_tok of them.
struct MoeConfig {
  int64_t num_experts = 0;                      // Mixtral's num_local_experts
  int64_t num_experts_per_tok = 2;              // top k
  int64_t moe_intermediate_size = 0;            // an expert's width; 0 = ModelConfig::ffn_dim()
  bool norm_topk_prob = false;                  // top-k weights renormalised (Mixtral: always)
  int64_t shared_expert_intermediate_size = 0;  // qwen2_moe's shared expert (required there)
  double router_aux_loss_coef = 0.001;          // the load-balancing loss's weight
  bool output_router_logits = false;            // add it to the loss (transformers' switch)
  // run.expert_gemm resolved (parse_config): the experts' products as
  // LibTorch's grouped GEMM (at::_grouped_mm) rather than a loop of GEMMs
  // (Note [Experts] in model/experts.cc).
  bool grouped_gemm = false;
};

struct ModelConfig {
  int64_t vocab_size = 256;       // tokens; 256 for byte-level text
  int64_t dim = 128;              // model width
  int64_t n_layers = 4;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 0;         // 0 = n_heads (no grouping); must divide n_heads
  int64_t ffn_hidden = 0;         // 0 = SwiGLU default: 8/3 * dim rounded up to multiple_of
  int64_t multiple_of = 32;       // rounding of the default ffn_hidden
  int64_t seq_len = 128;          // tokens per sequence (training window)
  bool tie_embeddings = true;     // output head shares the token embedding
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  double init_std = 0.02;         // std of normal init for matrices and embedding
  ModelFamily family = ModelFamily::kLlama;
  int64_t explicit_head_dim = 0;  // "head_dim"; 0 = dim / n_heads
  RopeScaling rope_scaling;
  int64_t sliding_window = 0;     // mistral's window; 0 = none; else >= seq_len
  // Hugging Face safetensors (a directory with config.json, or one file)
  // whose weights initialise training; "" = random init from run.seed.
  std::string init_from;
  // The top-level `lora` section, kept with the model it reshapes: with it,
  // every layer's base weights are frozen and the targeted linears gain
  // adapters (model/model.h, model_blocks).
  LoraConfig lora;
  MoeConfig moe;  // the MoE families only

  int64_t head_dim() const { return explicit_head_dim > 0 ? explicit_head_dim : dim / n_heads; }
  int64_t q_dim() const { return n_heads * head_dim(); }  // width of the attention's q and output
  bool qkv_bias() const { return family == ModelFamily::kQwen2 || family == ModelFamily::kQwen2Moe; }
  bool qk_norm() const { return family == ModelFamily::kQwen3 || family == ModelFamily::kQwen3Moe; }
  bool is_moe() const {
    return family == ModelFamily::kMixtral || family == ModelFamily::kQwen2Moe || family == ModelFamily::kQwen3Moe;
  }
  bool shared_expert() const { return family == ModelFamily::kQwen2Moe; }
  // The Qwen routers cast the top-k weights to the compute dtype; Mixtral's
  // keep them in fp32 (transformers 5.23's modeling files).
  bool routing_weights_cast() const { return family != ModelFamily::kMixtral; }
  int64_t expert_dim() const { return moe.moe_intermediate_size > 0 ? moe.moe_intermediate_size : ffn_dim(); }
  // A layer's MLP matrix parameters one token multiplies: SwiGLU's 3 x dim x
  // ffn_dim, or with experts the top k's, the router's and the shared
  // expert's (and its gate's); and of those, the down projections' (what a
  // recompute from the input skips: Note [Saved activations]).
  double mlp_active_params() const;
  double mlp_down_active_params() const;
  int64_t kv_heads() const { return n_kv_heads == 0 ? n_heads : n_kv_heads; }
  int64_t ffn_dim() const;
};

// The weight [out, in] of the linear LoRA module m adapts in a layer of `cfg`.
std::array<int64_t, 2> lora_module_shape(const ModelConfig& cfg, LoraModule m);
// A layer's adapter parameters (A and B of every targeted linear).
int64_t lora_layer_params(const ModelConfig& cfg);

// data.format: bytes of text (vocab 256), or tokenized .bin files
// (docs/token-format.md).
enum class DataFormat { kText, kUint16, kUint32 };
const char* data_format_name(DataFormat f);  // "text", "uint16", "uint32"

// data.sampling (docs/token-format.md, "Examples and loss masks"): random
// windows of the token stream, or examples (each sequence one example from
// its first token, padded), or whole examples packed into each sequence.
enum class DataSampling { kWindows, kExamples, kPacked };
const char* data_sampling_name(DataSampling s);  // "windows", "examples", "packed"

struct DataConfig {
  std::vector<std::string> paths;  // "path": a file or a list of files, concatenated
  DataFormat format = DataFormat::kText;
  double val_fraction = 0.1;       // tail of the tokens (examples: of the examples) held out for eval
  int64_t eval_interval = 50;      // steps between evals; 0 = never
  int64_t eval_batches = 4;        // micro-batches per eval
  DataSampling sampling = DataSampling::kWindows;
  bool truncate = false;           // an example longer than a sequence: cut (else refused)
  // Per file, from its sidecar (tools/tokenize.py's version 2): its loss mask
  // and its example index, "" where it has none.
  std::vector<std::string> mask_paths, index_paths;
  // Whether targets may be uncounted (a file's loss mask, or examples'
  // padding): then the loss is over counted tokens (Note [Counted tokens] in
  // util/counted_tokens.h).
  bool masked() const {
    for (const std::string& m : mask_paths) {
      if (!m.empty()) return true;
    }
    return sampling != DataSampling::kWindows;
  }
};

// run.checkpoint: where and how often the training state is saved
// (checkpoint/checkpoint.h). A dir enables saving at every `every` steps,
// at a stop signal and at the end of the run.
struct CheckpointConfig {
  std::string dir;                 // "" = no checkpoints
  int64_t every = 0;               // steps between saves; 0 = only on a stop and at the end
  int64_t keep = 2;                // complete checkpoints kept (the newest)
  // Host memory a save copies ranges into before training overwrites them
  // (Note [Save snapshots] in checkpoint/checkpoint.h); 0 = none: training
  // waits for the disk where it overtakes a save.
  double snapshot_gb = 0.0;
};

// Strings of the config parsed once, at its edge (config.cc); *_name gives
// the config's spelling back.
enum class DeviceKind { kCpu, kCuda };          // run.device
enum class ComputeDtype { kFp32, kBf16, kFp16 }; // derived from the bf16/fp16 sections
enum class Recompute { kAuto, kAlways, kNever }; // run.recompute
enum class OptimizerOverlap { kAuto, kOn, kOff };  // run.overlap_optimizer: "auto" | true | false
enum class StepSchedule { kAuto, kMicroBatch, kLayer };  // run.schedule
enum class ExpertGemm { kAuto, kLoop, kGrouped };       // run.expert_gemm
const char* device_kind_name(DeviceKind d);      // "cpu", "cuda"
const char* compute_dtype_name(ComputeDtype d);  // "fp32", "bf16", "fp16"
const char* recompute_name(Recompute r);         // "auto", "always", "never"
const char* schedule_name(StepSchedule s);       // "auto", "micro_batch", "layer"
const char* expert_gemm_name(ExpertGemm g);      // "auto", "loop", "grouped"
inline int compute_dtype_bytes(ComputeDtype d) { return d == ComputeDtype::kFp32 ? 4 : 2; }

// run.optimizer_state_dtype: the Adam moments' storage.
enum class MomentDtype { kFp32, kBf16 };
const char* moment_dtype_name(MomentDtype d);  // "fp32", "bf16"

struct RunConfig {
  int64_t steps = 200;
  uint64_t seed = 1234;
  std::string metrics;             // JSON-lines metrics file; empty = none
  std::string log_file;            // empty = stderr only
  std::string log_level = "info";
  DeviceKind device = DeviceKind::kCpu;  // cpu | cuda
  int64_t threads = 0;             // intra-op threads; 0 = all cores
  int64_t device_memory_mb = 0;    // device-tier budget in MiB; 0 = what the device has
  // Run the optimizer on its own thread, overlapped with the next step's
  // forward (each block waits only for its own sub-groups); see
  // Note [Optimizer overlap]. Arithmetic is the same either way. kAuto is
  // resolved with the plan (optimizer_overlaps in memory/placement.h).
  OptimizerOverlap overlap_optimizer = OptimizerOverlap::kAuto;
  // CRC-32C per 4 KiB swap block, computed on write and verified on read.
  bool swap_checksums = true;
  // run.deterministic: LibTorch's deterministic algorithms (strict: an op
  // that has none is an error) and cuBLAS's fixed workspace, so a GPU run
  // repeats itself bit for bit (apply_determinism in engine/trainer.h).
  bool deterministic = false;
  // auto | scalar | avx2 | avx512 | avx512_bf16 (force a lower one): checked
  // here, turned into cpu_adam's Isa by cpu_adam::parse_isa (config/ sits
  // below cpu_adam/ and does not include it).
  std::string cpu_adam_isa = "auto";
  // Storage of the Adam moments exp_avg and exp_avg_sq: fp32, or bf16 with
  // stochastic rounding (Note [bf16 state] in cpu_adam/types.h).
  MomentDtype optimizer_state_dtype = MomentDtype::kFp32;
  ComputeDtype compute_dtype = ComputeDtype::kFp32;  // derived: fp32 | bf16 | fp16 (from bf16/fp16 sections)
  // Backward recomputes each layer from its saved input (always), or every
  // layer keeps its saved tensors (never: a quarter fewer FLOPs, every
  // layer's entries held; in host RAM with cpu_checkpointing), or the plan
  // keeps as many layers' as the device has room for (auto). Note [Recompute].
  Recompute recompute = Recompute::kAuto;
  // An MoE layer's expert products: a loop of one GEMM per expert, or
  // LibTorch's grouped GEMM (one call, no wait for the per-expert counts);
  // auto: grouped on CUDA in bf16 (LibTorch 2.11 runs it on sm90+), the loop
  // elsewhere.
  ExpertGemm expert_gemm = ExpertGemm::kAuto;
  // run.activations: which layers keep their entries, fixed by hand (Note
  // [Activation placement] in memory/placement.h): the last
  // keep_device_layers on the device and keep_device_micro more micro-batches
  // of the layer before them; of the rest, keep_host_layers' worth of
  // micro-batches and keep_host_micro more in host RAM (spread); the others
  // recomputed. The micro-batch counts fewer than a step's. -1: not given
  // (run.recompute decides).
  int64_t keep_device_layers = -1;
  int64_t keep_host_layers = -1;
  int64_t keep_device_micro = 0;
  int64_t keep_host_micro = 0;
  // run.activations.in_gradient_homes: under the layer schedule, device
  // packs may live in gradient homes not yet written this step (Note [Packs
  // in gradient homes] in memory/placement.h).
  bool packs_in_grad_homes = true;
  // Set by the planner for its candidates (plan/planner.h, best_activations),
  // not a config key: under recompute auto, at most this many of the first
  // packs (a layer's for one micro-batch) keep their entries in host RAM
  // (-1: none).
  int64_t auto_host_packs = -1;
  // The order of the step's work (memory/schedule.h, Note [Step schedules]):
  // micro_batch (each micro-batch's forward and backward over every block in
  // turn), layer (each block for every micro-batch before the next block:
  // every block used twice a step, gradients landed and reduced once), or
  // auto (layer when it fits and the step's bound is lower). Arithmetic is
  // the same either way.
  StepSchedule schedule = StepSchedule::kAuto;
  CheckpointConfig checkpoint;
  // run.rates: the rates of the step's bound (plan/bound.h) given instead of
  // measured at start; 0 = measure. Units as the keys say (config/rates.h).
  RateOverrides rates;
};

// optimizer.type and scheduler.type (DeepSpeed's spellings); kConstant is no
// scheduler section (a constant learning rate).
enum class OptimizerType { kAdam, kAdamW };
enum class SchedulerType { kConstant, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR };
enum class WarmupType { kLog, kLinear };  // scheduler.params.warmup_type
const char* optimizer_type_name(OptimizerType t);  // "Adam", "AdamW"
const char* scheduler_type_name(SchedulerType t);  // "" (constant), "WarmupLR", ...
const char* warmup_type_name(WarmupType t);        // "log", "linear"

// optimizer.speculate (Note [Speculative optimizer] in engine/optimizer/optimizer_pass.h).
enum class Speculate { kAuto, kOn, kOff };
const char* speculate_name(Speculate s);  // "auto", "on", "off"

struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;
  Speculate speculate = Speculate::kAuto;
  // optimizer.speculate_slots: NVMe state speculates into alternate swap
  // slots where the disk has room (Note [Alternate swap slots] in
  // memory/tiered_state.h); false: by two passes, no extra disk.
  bool speculate_slots = true;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  bool adam_w_mode = true;         // derived: true for AdamW (decoupled decay)
};

struct SchedulerConfig {
  SchedulerType type = SchedulerType::kConstant;
  double warmup_min_lr = 0.0;      // WarmupLR, WarmupDecayLR
  double warmup_max_lr = 1e-3;     // WarmupLR, WarmupDecayLR
  int64_t warmup_num_steps = 1000;
  WarmupType warmup_type = WarmupType::kLog;
  int64_t total_num_steps = 0;     // WarmupDecayLR, WarmupCosineLR (required there)
  double warmup_min_ratio = 0.0;   // WarmupCosineLR
  double cos_min_ratio = 0.0001;   // WarmupCosineLR
};

struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;         // 0 = dynamic
  int64_t initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  double min_loss_scale = 1.0;
  bool consecutive_hysteresis = false;  // restore the hysteresis count at every clean step
};

// zero_optimization.offload_param.device and offload_optimizer.device.
enum class OffloadDevice { kNone, kCpu, kNvme };
const char* offload_device_name(OffloadDevice d);  // "none", "cpu", "nvme"

struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::vector<std::string> nvme_path;
  int64_t buffer_count = 5;
  int64_t buffer_size = 100000000; // elements
  int64_t max_in_cpu = 1000000000; // elements
  bool pin_memory = true;
};

struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::vector<std::string> nvme_path;
  int64_t buffer_count = 4;
  bool pin_memory = true;
  bool pipeline_read = false;
  bool pipeline_write = false;
  bool fast_init = false;
  double ratio = 1.0;              // fraction of optimizer state on CPU/NVMe
};

struct ZeroConfig {
  int64_t stage = 0;
  bool contiguous_gradients = true;
  bool overlap_comm = false;       // default true for stage 3
  int64_t reduce_bucket_size = 500000000;
  int64_t allgather_bucket_size = 500000000;
  bool reduce_scatter = true;
  bool allgather_partitions = true;
  int64_t sub_group_size = 1000000000;
  int64_t stage3_prefetch_bucket_size = 50000000;
  int64_t stage3_param_persistence_threshold = 100000;
  int64_t stage3_max_live_parameters = 1000000000;
  int64_t stage3_max_reuse_distance = 1000000000;
  // zero_hpz_partition_size (ZeRO++'s hpZ): 1 = no secondary shard; more =
  // comm.secondary_shard "on", the secondary shard spanning that many ranks,
  // which must be the ranks of a node (checked at start).
  int64_t hpz_partition_size = 1;
  bool stage3_gather_16bit_weights_on_model_save = false;
  OffloadParamConfig offload_param;
  OffloadOptimizerConfig offload_optimizer;
};

struct AioConfig {
  int64_t block_size = 1048576;    // bytes
  int64_t queue_depth = 8;
  int64_t intra_op_parallelism = 1;  // also accepted as thread_count
  bool single_submit = false;
  bool overlap_events = true;
  bool use_gds = false;
};

struct ActivationCheckpointingConfig {
  bool partition_activations = false;
  bool cpu_checkpointing = false;
  bool contiguous_memory_optimization = false;
  int64_t number_checkpoints = 0;  // 0 = None
  bool synchronize_checkpoint_boundary = false;
  bool profile = false;
};

// A split of one state category over the three tiers; fractions sum to 1.
struct TierSplit {
  double device = 1.0;
  double host = 0.0;
  double nvme = 0.0;
};

// The Strata `placement` section: either "auto" or a split per category.
// Categories it does not name are placed from the DeepSpeed offload keys.
struct PlacementConfig {
  bool auto_place = false;           // "placement": "auto" or {"auto": true, ...}
  bool has_param16 = false, has_grad = false, has_master = false, has_exp_avg = false,
       has_exp_avg_sq = false;
  TierSplit param16, grad, master, exp_avg, exp_avg_sq;
  std::vector<std::string> nvme_path;  // swap directories; default: the offload sections' nvme_path
  double headroom = 0.1;               // fraction of each tier kept free by "auto"
  bool by_bound = true;                // auto compares its candidates by the step's bound (false: greedy fill)
  // Set by the planner for its candidates (plan/bound.h), not config keys:
  // the order auto fills categories in (empty: param16, grad, master,
  // exp_avg, exp_avg_sq) and, on a GPU, how many optimizer sub-groups may
  // stay on the device for its Adam (-1: as many as fit), and the host bytes
  // the frozen base may take (-1: as many as fit; the rest goes to NVMe, so
  // that host RAM is left to activations: plan/planner.cc, choose_by_bound).
  std::vector<int> auto_order;
  int64_t auto_device_groups = -1;
  int64_t auto_frozen_host_bytes = -1;
};

// What the config asks of the state's placement in Strata's terms
// (config/deepspeed.cc, the only place DeepSpeed's offload sections become
// it): a split per category in the order param16, grad, master, exp_avg,
// exp_avg_sq (memory/placement.h's Category), the placement section's own
// splits over the offload sections'; which of them decided ("default",
// "deepspeed", "placement"); the swap directories; the optimizer pipeline's
// buffers (offload_optimizer.buffer_count).
struct Config;
struct StateIntent {
  std::array<TierSplit, 5> split;
  std::string source;
  std::vector<std::string> nvme_paths;
  int64_t optimizer_buffers = 4;
};
// `shard_space_numel`: the elements of a rank's shards (offload_param.max_in_cpu
// is a count of them).
StateIntent state_intent(const Config& cfg, int64_t shard_space_numel);

// comm.backend: auto (gloo for run.device cpu, nccl for cuda), gloo, nccl.
enum class CommBackend { kAuto, kGloo, kNccl };
// comm.gradient_reduction, comm.secondary_shard.
enum class GradientReduction { kAuto, kPerStep, kPerMicroBatch };
enum class SecondaryShard { kAuto, kOn, kOff };
const char* comm_backend_name(CommBackend b);              // "auto", "gloo", "nccl"
const char* secondary_shard_name(SecondaryShard s);        // "auto", "on", "off"
// comm.keep_gathered: auto, all, none, or a number of blocks.
struct KeepGathered {
  enum class Mode { kAuto, kAll, kNone, kBlocks };
  Mode mode = Mode::kAuto;
  int64_t blocks = 0;  // with kBlocks
};

// comm.backend resolved: kGloo or kNccl (auto: nccl on run.device cuda).
struct Config;
CommBackend comm_backend(const Config& c);

// Communication between ranks (src/comm/); ignored at world size 1.
struct CommConfig {
  CommBackend backend = CommBackend::kAuto;
  double timeout_s = 300.0;        // every collective and rendezvous wait; a lost rank is named within it
  // communication_data_type (top level, DeepSpeed's): the dtype gradients are
  // reduced in between ranks. fp32 (default): the same sums whatever the
  // world size, to rounding; bf16 | fp16: half the network bytes of the
  // reductions, the reduced gradient rounded to 16 bits (docs/config.md).
  ComputeDtype data_type = ComputeDtype::kFp32;
  // When gradients are reduced between ranks with gradient accumulation:
  // per_micro_batch (each micro-batch's, while the next block's backward
  // runs), per_step (summed on the rank over the step's micro-batches in a
  // whole-model fp32 buffer, then reduced once: DDP's no_sync; A times fewer
  // reduction bytes), or auto (per_step when that buffer fits).
  GradientReduction gradient_reduction = GradientReduction::kAuto;
  // Stage 3 with ranks: blocks whose 16-bit parameters stay gathered from
  // their first use in a step to the optimizer (FSDP's
  // reshard_after_forward=False): one gather per step instead of one per use.
  // auto (as many as fit, from the last layer down), all, none, or a number
  // of blocks, from the last one down.
  KeepGathered keep_gathered;
  // Stage 3 with ranks on several nodes: after a block's first gather of a
  // step each rank keeps 1/(ranks per node) of it, its node's secondary shard
  // (ZeRO++'s hpZ), so the step's later gathers of that block run inside the
  // node. auto (when it fits), on, off.
  SecondaryShard secondary_shard = SecondaryShard::kAuto;
};

// DeepSpeed's `tensorboard` and `csv_monitor` blocks (docs/monitors.md):
// rank 0 writes TensorBoard event files / one CSV file per tag under
// output_path/job_name/ (relative paths from the working directory).
struct MonitorConfig {
  bool enabled = false;
  std::string output_path;                  // "" = the working directory, as DeepSpeed
  std::string job_name = "DeepSpeedJobName";  // DeepSpeed's default
  std::string dir() const;                  // output_path/job_name
};

struct Config {
  // Batch sizes: train_batch_size = micro_batch x grad_accum x world_size.
  int64_t train_batch_size = 0;
  int64_t train_micro_batch_size_per_gpu = 0;
  int64_t gradient_accumulation_steps = 0;
  int64_t world_size = 1;          // ranks (from the launcher's environment, not a key)
  double gradient_clipping = 1.0;  // 0 = off
  int64_t steps_per_print = 10;

  ModelConfig model;
  DataConfig data;
  RunConfig run;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  Fp16Config fp16;
  bool bf16 = false;
  ZeroConfig zero;
  AioConfig aio;
  ActivationCheckpointingConfig activation_checkpointing;
  PlacementConfig placement;
  CommConfig comm;
  MonitorConfig tensorboard;
  MonitorConfig csv_monitor;

  // The JSON after defaults and overrides, as loaded (for logs and checkpoints).
  nlohmann::json raw;
  // DeepSpeed keys that were accepted but that Strata does not act on.
  std::vector<std::string> ignored_keys;
};

// Parses and validates `j`. `source` names the file in messages. `overrides`
// are "a.b.c=value" strings applied before validation (value parsed as JSON,
// else taken as a string). Throws ConfigError naming the key.
// `world_size` (ranks of the run) enters the batch arithmetic.
Config parse_config(nlohmann::json j, const std::vector<std::string>& overrides = {},
                    int64_t world_size = 1);

// Reads the JSON file at `path` and parses it. Throws ConfigError (path in the
// key) for a missing/unreadable file or bad JSON (with line/column).
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {},
                   int64_t world_size = 1);

// The effective config less the keys that may differ between ranks (metrics,
// log and trace paths, nvme_path lists, run.threads): what ranks compare at
// start. And the first key (dotted path) where two such configs differ, ""
// when equal.
nlohmann::json rank_invariant_config(const Config& c);
// What a resumed run may not change from the run that saved the checkpoint
// (model, optimizer, schedule, global batch, seed, data, dtypes), as
// effective values; compared with first_difference().
// The model section as checkpoints record it (invariants.model, which
// `strata export` reads): keys at their Llama defaults are left out.
nlohmann::json model_invariants(const ModelConfig& m);
nlohmann::json resume_invariants(const Config& c);
// A LoRA base's identity, as resume_invariants records it under
// "lora_base" (Note [Base identity] in config/hf_config.cc), of the
// safetensors at `from` (model.init_from).
nlohmann::json base_identity(const std::string& from);
std::string first_difference(const nlohmann::json& a, const nlohmann::json& b, const std::string& path = "");

// Every key the parser knows, as a full dotted path ("zero_optimization.stage";
// a placement category's split under each category's name): those it reads,
// and DeepSpeed's that it accepts with a warning (`ignored`). Read from the
// same key tables that check each section's keys (config/reader.h); a test
// holds docs/config.md to it.
struct ConfigKey {
  std::string key;
  bool ignored = false;
};
std::vector<ConfigKey> config_key_table();

}  // namespace strata
