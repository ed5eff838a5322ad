// The trainer's start-up (trainer.h): determinism, the context, the ranks'
// agreement on their collectives, the initial weights; and its end.
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "checkpoint/safetensors.h"
#include "engine/compute_stream.h"
#include "engine/trainer.h"
#include "plan/planner.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"
#include "util/progress.h"
#include "util/trace.h"

namespace strata {

namespace {

at::ScalarType dtype_of(ComputeDtype d) {
  switch (d) {
    case ComputeDtype::kBf16: return at::kBFloat16;
    case ComputeDtype::kFp16: return at::kHalf;
    case ComputeDtype::kFp32: break;
  }
  return at::kFloat;
}

nvme::EngineOptions engine_options(const AioConfig& aio) {
  nvme::EngineOptions o;
  o.block_size_bytes = aio.block_size;
  o.queue_depth = int(aio.queue_depth);
  o.rings = int(aio.intra_op_parallelism);
  o.single_submit = aio.single_submit;
  o.overlap_events = aio.overlap_events;
  return o;
}

}  // namespace

std::string apply_determinism(bool on) {
  if (!on) return "";
  ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
  // Not warn_only: LibTorch's attention backwards (cuDNN, flash, memory-
  // efficient) pick their deterministic algorithm only when a
  // non-deterministic op is an error (warn_only left them atomic:
  // BENCHMARKS.md, "GPU, round 2"); an op with no deterministic
  // implementation then stops the run naming itself.
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  at::globalContext().setDeterministicCuDNN(true);
  at::globalContext().setBenchmarkCuDNN(false);
  return std::string("deterministic algorithms on (an op without one is an error), CUBLAS_WORKSPACE_CONFIG=") +
         std::getenv("CUBLAS_WORKSPACE_CONFIG");
}

// The trace's span names, by pass, block and micro-batch (span_name), made once.
std::vector<std::string> Trainer::make_span_names(const StateLayout& layout, int64_t micro_batches) {
  std::vector<std::string> names;
  for (int pass = 0; pass < 3; ++pass) {
    static const char* const kPass[3] = {"forward", "head forward + backward", "backward"};
    for (const BlockLayout& bl : layout.blocks()) {
      for (int64_t m = 0; m < micro_batches; ++m) {
        names.push_back(strprintf("%s %s mb %lld", kPass[pass], bl.name.c_str(), (long long)m));
      }
    }
  }
  return names;
}

Trainer::Trainer(const Config& cfg, const Model& model, std::shared_ptr<nvme::FaultPlan> faults,
                 Communicator* comm, int local_ranks, Device* device, StreamCollectives* stream,
                 StreamCollectives* node_stream)
    : cfg_(cfg), model_(model), layout_(model.layout_specs(), shard_count(cfg), frozen_shard_count(cfg)) {
  apply_determinism(cfg.run.deterministic);  // strata train has, before its probes; a library user may not have
  make_context(comm, device, stream);
  const cpu_adam::Isa isa = cpu_adam::parse_isa(cfg.run.cpu_adam_isa);
  if (!cpu_adam::isa_supported(isa)) {
    throw ConfigError("run.cpu_adam_isa", std::string(cpu_adam::isa_name(isa)) +
                                              " is not supported by this CPU (best: " +
                                              cpu_adam::isa_name(cpu_adam::best_isa()) + ")");
  }
  MachineCapacity cap;
  // run.rates (filled by strata train's measurements): auto judges its
  // candidates by the step's bound (plan/bound.h).
  const Rates rates = rates_from_config(cfg.run.rates);
  const PlacementPlan plan =
      plan_for_machine(cfg, layout_, &cap, ctx_.comm->rank(), local_ranks, ctx_.device, GivenCapacity{}, &rates);
  agree_on_collectives(plan, node_stream);
  // Like DeepSpeed, create missing swap directories (private to the user).
  for (const std::string& dir : plan.state.nvme_paths) {
    if (!path_exists(dir)) {
      make_dirs(dir, 0700);
      log::info("created swap directory %s", dir.c_str());
    }
  }
  TieredStateOptions so;
  so.engine = engine_options(cfg.aio);
  so.engine.faults = std::move(faults);
  so.checksums = cfg.run.swap_checksums;
  so.device_transient_bytes = plan.staging.device_bytes();
  so.device_budget_bytes = cfg.run.device_memory_mb > 0 ? cfg.run.device_memory_mb << 20 : -1;
  so.device = ctx_.device;  // the compute device's memory is the device tier
  state_ = std::make_unique<TieredState>(plan, so);
  ctx_.state = state_.get();
  for (const PlacementUnit& u : plan.state.units[size_t(Category::kParam16)]) {
    ctx_.shard_offset.push_back(u.offset);
    ctx_.block_end.push_back(u.offset + u.numel);
  }
  for (const PlacementUnit& u : plan.state.units[size_t(Category::kFrozen)]) ctx_.frozen_offset.push_back(u.offset);
  int64_t global = 0;
  for (const BlockLayout& bl : layout_.blocks()) {
    ctx_.global_index.push_back(global);
    global += bl.numel;
  }
  const int64_t A = std::max<int64_t>(cfg.gradient_accumulation_steps, 1);
  span_names_ = make_span_names(layout_, A);

  optimizer_ = std::make_unique<OptimizerPass>(ctx_, plan, isa);
  speculation_ = SpeculationPolicy(optimizer_->speculates(), cfg_.optimizer.speculate);
  blocks_ = std::make_unique<GatheredBlocks>(ctx_, plan, *optimizer_);
  grads_ = std::make_unique<GradientPath>(ctx_, plan);
  optimizer_->set_gradients(grads_.get());
  checkpoints_ = std::make_unique<StateCheckpoints>(ctx_, *optimizer_);
  activations_ = std::make_unique<ActivationCheckpoints>(plan, layout_.num_blocks(), state_.get(), blocks_->train_ops());
  micro_loss_.resize(size_t(A));  // act_key's stride
  row_loss_.resize(size_t(cfg_.train_micro_batch_size_per_gpu * cfg_.model.seq_len));
  head_isa_ = isa;  // checked above
  keeps_entries_.assign(layout_.num_blocks() * size_t(A), 0);
  for (size_t b = 1; b + 1 < layout_.num_blocks(); ++b) {
    for (int64_t m = 0; m < A; ++m) keeps_entries_[act_key(b, m)] = plan.activations.keeps_entries(int64_t(b) - 1, m);
  }
  for (const SavedSpec& e : layer_saved_specs(cfg.model)) {
    if (!e.cheap) kept_ids_.push_back(e.id);
  }
  attn_rng_.resize(layout_.num_blocks() * size_t(A));
  flow_.resize(size_t(A));
  if (cfg.model.is_moe()) {  // Note [Load balancing] in model/experts.cc
    const int64_t E = cfg.model.moe.num_experts;
    const auto on_device = at::TensorOptions().dtype(at::kFloat).device(ctx_.torch_device);
    moe_tally_.resize(size_t(A));
    for (MoeTally& t : moe_tally_) {
      t.selected = at::zeros({E}, on_device);
      t.prob_sum = at::zeros({E}, on_device);
    }
    aux_loss_.resize(size_t(A));
    aux_grad_.resize(size_t(A));
    expert_load_ = at::zeros({cfg.model.n_layers, E}, on_device);
    expert_load_host_ = at::zeros({cfg.model.n_layers, E}, at::TensorOptions().dtype(at::kDouble));
  }
  tokens_host_ = ctx_.device->allocate_pinned(plan.staging.tokens, "token windows (host)");
  tokens_device_ = ctx_.device->allocate(plan.staging.tokens, "token windows");
  initialise_state(plan);
}

void Trainer::agree_on_collectives(const PlacementPlan& plan, StreamCollectives* node_stream) {
  Communicator& comm = *ctx_.comm;
  if (comm.world_size() <= 1) return;
  // FNV-1a over the choices that decide which collectives run, in 62 bits.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  for (char k : plan.comm.keep_gathered) mix(uint64_t(k));
  mix(plan.comm.reduce_per_step);
  mix(plan.comm.secondary_shard);
  mix(uint64_t(plan.ranks_per_node));
  mix(uint64_t(plan.step.schedule));  // the order of the reductions and gathers (Note [Step schedules])
  const int64_t mine = int64_t(h >> 2);
  int64_t v[2] = {mine, -mine};
  comm.all_reduce(v, 2, DType::kI64, ReduceOp::kMax).wait();
  if (v[0] != -v[1]) {
    throw ConfigError("comm.keep_gathered",
                      "the ranks planned different collectives from their own free memory (blocks kept gathered, "
                      "comm.gradient_reduction, comm.secondary_shard or run.schedule) or their nodes have different "
                      "numbers of ranks: set comm.keep_gathered to a number, and comm.gradient_reduction, "
                      "comm.secondary_shard and run.schedule to explicit values");
  }
  if (!plan.comm.secondary_shard) return;
  // Note [Secondary shard]: the node's group, in the data group's mode.
  const int per_node = plan.ranks_per_node;
  switch (collectives_->mode()) {
    case DeviceCommMode::kInPlace: {
      DataGroupOptions o;
      o.backend = "gloo";
      collectives_->attach_node_group(comm.open_node_group(o), nullptr, per_node);
      break;
    }
    case DeviceCommMode::kStaged:
      collectives_->attach_node_group(comm.open_node_group(data_options_), nullptr, per_node);
      break;
    case DeviceCommMode::kStream:
      if (node_stream == nullptr) {
        CollectiveGroup& node = *comm.open_node_group(data_options_);
        STRATA_CHECK(node.orders_streams(), "the node's group of a stream's collectives does not order streams");
        own_node_stream_ = stream_collectives_over(node);
        node_stream = own_node_stream_.get();
      }
      collectives_->attach_node_group(nullptr, node_stream, per_node);
      break;
  }
}

// The communicator, the device and what the parts share before the state.
void Trainer::make_context(Communicator* comm, Device* device, StreamCollectives* stream) {
  if (comm == nullptr) {
    own_comm_ = make_local_communicator();
    comm = own_comm_.get();
  }
  STRATA_CHECK(comm->world_size() == cfg_.world_size, "the communicator's world size is not the config's");
  if (device == nullptr) {
    if (cfg_.run.device == DeviceKind::kCpu) {
      device = &cpu_device();
    } else {
      own_device_ = make_device(device_kind_name(cfg_.run.device));
      device = own_device_.get();
    }
  }
  if (comm->world_size() > 1) {
    // Note [Device collectives]: in place, staged over Gloo, or on the comm stream.
    if (device->host_addressable()) {
      collectives_ = std::make_unique<DeviceCollectives>(*device, *comm);
    } else if (stream != nullptr) {
      collectives_ = std::make_unique<DeviceCollectives>(*device, *comm, *stream);
    } else {
      DataGroupOptions o;
      o.backend = comm_backend_name(comm_backend(cfg_));
      if (o.backend == "nccl" && !device->is_cuda()) {
        throw ConfigError("comm.backend", "\"nccl\" needs GPU memory, and " + device->name() +
                                              " is not a GPU; use \"gloo\"");
      }
      o.stream = device->native_stream(Stream::kComm);
      o.device_index = device->ordinal();
      data_options_ = o;
      CollectiveGroup& data = *comm->open_data_group(o);
      if (data.orders_streams()) {
        own_stream_ = stream_collectives_over(data);
        collectives_ = std::make_unique<DeviceCollectives>(*device, *comm, *own_stream_);
      } else {
        collectives_ = std::make_unique<DeviceCollectives>(*device, *comm, data);
      }
    }
    log::info("collectives on %s: %s, over %s", device->name().c_str(), device_comm_mode_name(collectives_->mode()),
              collectives_->mode() == DeviceCommMode::kInPlace ? comm->backend() : "the data group");
  }
  ctx_.collectives = collectives_.get();
  ctx_.cfg = &cfg_;
  ctx_.layout = &layout_;
  ctx_.device = device;
  ctx_.comm = comm;
  ctx_.torch_device = torch_device(*device);
  ctx_.compute_dtype = dtype_of(cfg_.run.compute_dtype);
  ctx_.compute_bytes = compute_dtype_bytes(cfg_.run.compute_dtype);
  ctx_.param_dtype = cfg_.model.lora.enabled ? at::kFloat : ctx_.compute_dtype;  // Note [LoRA layers]
  ctx_.param_bytes = cfg_.model.lora.enabled ? 4 : ctx_.compute_bytes;
  if (ctx_.compute_dtype == at::kHalf) scaler_ = std::make_unique<LossScaler>(cfg_.fp16);
  for (size_t b = 0; b < model_.num_blocks(); ++b) {
    if (model_.blocks()[b].kind == BlockKind::kEmbedding) ctx_.embedding_block = b;
    if (model_.blocks()[b].kind == BlockKind::kHead) ctx_.head_block = b;
  }
  STRATA_CHECK(ctx_.embedding_block == 0 && ctx_.head_block == model_.num_blocks() - 1,
               "the embedding must be the first block and the head the last");
  ctx_.shards = layout_.world_size();
  ctx_.shard_rank = ctx_.shards > 1 ? comm->rank() : 0;
}

// The optimizer thread and a save in flight go first (the parts' own
// destructors, in reverse order of declaration); device memory is freed
// after them, so nothing queued may still use it.
Trainer::~Trainer() {
  checkpoints_.reset();  // an unfinished save's thread first: it may wait for the optimizer
  optimizer_.reset();
  // Collectives a failed step left queued must not touch the parts' buffers
  // once those are freed (Note [Device collectives]).
  if (collectives_) collectives_->shutdown();
  try {
    for (int s = 0; s < kNumStreams; ++s) ctx_.device->synchronize(Stream(s));
  } catch (...) {
    // A failed device: its error was reported by the call that failed.
  }
}

// Every rank draws every block and keeps its shard; the draws depend on the
// seed and the model's shape alone (Note [Initial weights] in model/model.cc),
// so the same seed gives the same weights whatever the placement, threads or
// world size.
// With model.init_from, the weights come from Hugging Face safetensors
// instead, one block at a time.
constexpr int64_t kInitProgressNumel = int64_t(1) << 30;

namespace {

// Note [Expert tensors] (checkpoint/safetensors.h): an MoE layer's weights
// against the model's expert count and width, before any is read: a config
// (or config.json) that contradicts the files is named by its key, with both
// values.
void check_experts(const SafetensorsSet& hf, const ModelConfig& m, const std::string& param,
                   const std::vector<HfPiece>& pieces) {
  const int64_t E = m.moe.num_experts, I = m.expert_dim();
  const HfPiece& first = pieces.front();
  if (!hf.has(first.name)) return;  // read_hf names the missing tensor
  const std::vector<int64_t>& got = hf.shape(first.name);
  auto contradicts = [&](const char* key, int64_t mine, const std::string& theirs) {
    throw ConfigError(std::string("model.") + key, std::to_string(mine) + " (the config, or config.json), but " +
                                                       hf.file(first.name) + " has " + theirs);
  };
  if (param == "router") {
    if (got.size() == 2 && got[0] != E) {
      contradicts("num_experts", E, std::to_string(got[0]) + " experts (" + first.name + " " + shape_text(got) + ")");
    }
    return;
  }
  const bool gate_up = param == "experts.gate_up", fused = pieces.size() == 1;
  if (param != "experts.down" && !gate_up) return;
  if (fused && got.size() == 3) {
    if (got[0] != E) contradicts("num_experts", E, std::to_string(got[0]) + " experts (" + first.name + " " + shape_text(got) + ")");
    const int64_t width = gate_up ? got[1] / 2 : got[2];
    if (width != I) {
      contradicts("moe_intermediate_size", I, "experts of " + std::to_string(width) + " (" + first.name + " " + shape_text(got) + ")");
    }
    return;
  }
  if (!fused && got.size() == 2) {
    const int64_t width = gate_up ? got[0] : got[1];
    if (width != I) {
      contradicts("moe_intermediate_size", I, "experts of " + std::to_string(width) + " (" + first.name + " " + shape_text(got) + ")");
    }
    // One expert more than the config's, in the same naming.
    std::string extra = first.name;
    const std::string zero = ".experts.0.";
    extra.replace(extra.find(zero), zero.size(), ".experts." + std::to_string(E) + ".");
    if (hf.has(extra)) contradicts("num_experts", E, "more experts (" + extra + ")");
    for (const HfPiece& p : pieces) {
      if (!hf.has(p.name)) contradicts("num_experts", E, "fewer experts (no " + p.name + ")");
    }
  }
}

}  // namespace

// `params` of block `bl` from Hugging Face safetensors into `flat` (fp32);
// an MoE layer's experts in either layout (Note [Expert tensors]).
void Trainer::read_hf(SafetensorsSet& hf, const BlockLayout& bl, const std::vector<ParamLayout>& params,
                      const at::Tensor& flat) {
  const std::string family = model_family_name(cfg_.model.family);
  for (const ParamLayout& p : params) {
    const std::string strata = bl.name + "." + p.spec.name;
    std::vector<HfPiece> pieces = hf_pieces(strata, p.spec.shape, family, ExpertLayout::kPerExpert);
    if (!hf.has(pieces.front().name)) {
      std::vector<HfPiece> fused = hf_pieces(strata, p.spec.shape, family, ExpertLayout::kFused);
      if (hf.has(fused.front().name)) pieces = std::move(fused);
    }
    if (cfg_.model.is_moe()) check_experts(hf, cfg_.model, p.spec.name, pieces);
    for (const HfPiece& h : pieces) {
      if (!hf.has(h.name)) throw InputError(cfg_.model.init_from, "no tensor " + h.name + " (Strata's " + strata + ")");
      if (hf.shape(h.name) != h.shape) {
        throw InputError(hf.file(h.name), "tensor " + h.name + " has shape " + shape_text(hf.shape(h.name)) +
                                              ", but the model (config.json) needs " + shape_text(h.shape));
      }
      hf.read_f32(h.name, flat.data_ptr<float>() + p.offset + h.offset);
    }
  }
}

// lora.init_from's adapter_model.safetensors, checked whole before anything
// is read: every tensor must be one of this model's adapters (PEFT's names;
// a name that fits no adapter is refused, never left out), and every adapter
// must be there.
std::unique_ptr<SafetensorsSet> Trainer::open_adapters(const std::string& dir) {
  const std::string path = dir + "/adapter_model.safetensors";
  auto set = std::make_unique<SafetensorsSet>(path);
  std::map<std::string, const ParamSpec*> want;
  for (const BlockLayout& bl : layout_.blocks()) {
    for (const ParamLayout& p : bl.params) want[peft_tensor_name(bl.name + "." + p.spec.name)] = &p.spec;
  }
  for (const std::string& name : set->names()) {
    auto it = want.find(name);
    if (it == want.end()) {
      throw InputError(path, "tensor " + name + " is not an adapter of this model (lora.target_modules, "
                             "model.n_layers); its adapters are named like " + want.begin()->first);
    }
    if (set->shape(name) != it->second->shape) {
      throw InputError(path, "tensor " + name + " has shape " + shape_text(set->shape(name)) + ", but lora.r " +
                                 std::to_string(cfg_.model.lora.r) + " and the base need " + shape_text(it->second->shape));
    }
  }
  for (const auto& [name, spec] : want) {
    if (!set->has(name)) throw InputError(path, "no tensor " + name + " (lora.target_modules names its module)");
  }
  return set;
}

void Trainer::read_adapters(const SafetensorsSet& set, const BlockLayout& bl, const at::Tensor& flat) {
  for (const ParamLayout& p : bl.params) {
    set.read_f32(peft_tensor_name(bl.name + "." + p.spec.name), flat.data_ptr<float>() + p.offset);
  }
}

// Block b's frozen part (Note [State kinds]), from `hf` or drawn from
// run.seed, written to its home in the compute dtype; `mem` holds it in fp32
// and in the compute dtype.
void Trainer::write_frozen(size_t b, SafetensorsSet* hf, const PinnedHostBuffer& mem) {
  const BlockLayout& bl = layout_.block(b);
  const int64_t n = bl.frozen_shard_numel();
  at::Tensor values = at::from_blob(mem.data(), {bl.frozen_padded_numel}, at::TensorOptions().dtype(at::kFloat));
  values.zero_();
  if (hf) {
    read_hf(*hf, bl, bl.frozen, values);
  } else {
    init_frozen_block(bl, values, cfg_.run.seed, b);
  }
  std::byte* cast_mem = mem.data() + bl.frozen_padded_numel * 4;
  at::Tensor cast = at::from_blob(cast_mem, {bl.frozen_padded_numel}, at::TensorOptions().dtype(ctx_.compute_dtype));
  cast.copy_(values);
  // Note [Frozen shards]: this rank's shard of the frozen part, or all of it.
  const int64_t rank = bl.frozen_world_size > 1 ? ctx_.shard_rank : 0;
  state_->write(Category::kFrozen, ctx_.frozen_offset[b], n, cast_mem + rank * n * ctx_.compute_bytes);
}

void Trainer::initialise_state(const PlacementPlan& plan) {
  std::unique_ptr<SafetensorsSet> hf, adapters;
  if (!cfg_.model.init_from.empty()) hf = std::make_unique<SafetensorsSet>(cfg_.model.init_from);
  if (!cfg_.model.lora.init_from.empty()) adapters = open_adapters(cfg_.model.lora.init_from);
  // Start-up only: host memory for a block's fp32 weights and its working copy
  // (page-aligned for NVMe), registered with the device: copies into HBM from
  // pageable memory are staged by the driver (on the H200 host the weights'
  // writes took about 23 s of (b)'s 50 s start: BENCHMARKS.md, "GPU, round 2").
  const PinnedHostBuffer master_mem =
      ctx_.device->allocate_pinned(plan.largest_block_numel * 4, "initial weights");
  const PinnedHostBuffer working_mem =
      ctx_.device->allocate_pinned(plan.largest_block_numel * ctx_.param_bytes, "initial working copy");
  // Note [State kinds]: the frozen parts' values, drawn or read in fp32 and
  // written once in the compute dtype (never again).
  int64_t largest_frozen = 0;
  for (const BlockLayout& bl : layout_.blocks()) largest_frozen = std::max(largest_frozen, bl.frozen_padded_numel);
  const PinnedHostBuffer frozen_mem =
      ctx_.device->allocate_pinned(largest_frozen * (4 + ctx_.compute_bytes), "initial frozen weights");
  // A model of a billion elements or more takes seconds to tens of seconds here.
  std::unique_ptr<ProgressBar> bar;
  if (ctx_.shard_rank == 0 && layout_.total_numel() >= kInitProgressNumel) {
    bar = std::make_unique<ProgressBar>(hf ? "load weights" : "init weights", int64_t(layout_.num_blocks()));
  }
  double draw_s = 0.0;  // for the start line: drawing (or reading) against the rest
  const auto start = std::chrono::steady_clock::now();
  for (size_t b = 0; b < layout_.num_blocks(); ++b) {
    const BlockLayout& bl = layout_.block(b);
    const int64_t n = bl.shard_numel();
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor master = at::from_blob(master_mem.data(), {bl.padded_numel}, at::TensorOptions().dtype(at::kFloat));
    master.zero_();
    // A LoRA run's adapters start from lora.init_from or run.seed; its base
    // comes from model.init_from (write_frozen).
    if (hf && !cfg_.model.lora.enabled) {
      read_hf(*hf, bl, bl.params, master);
    } else if (adapters) {
      read_adapters(*adapters, bl, master);
    } else {
      init_block(bl, master, cfg_.run.seed, b);
    }
    draw_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state_->write(Category::kMaster, ctx_.shard_offset[b], n, master.data_ptr<float>() + ctx_.shard_rank * n);
    at::Tensor working =
        at::from_blob(working_mem.data(), {bl.padded_numel}, at::TensorOptions().dtype(ctx_.param_dtype));
    working.copy_(master);
    state_->write(Category::kParam16, ctx_.shard_offset[b], n,
                  working_mem.data() + ctx_.shard_rank * n * ctx_.param_bytes);
    if (bl.frozen_padded_numel > 0) {
      const auto t1 = std::chrono::steady_clock::now();
      write_frozen(b, hf.get(), frozen_mem);
      draw_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    }
    if (bar) bar->update(int64_t(b) + 1, bl.name);
  }
  bar.reset();
  const double rest_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() - draw_s;
  if (hf) {
    log::info("initial weights: read in %.1f s, written to their tiers in %.1f s", draw_s, rest_s);
  } else {
    log::info("initial weights: drawn in %.1f s on %d threads, written to their tiers in %.1f s", draw_s,
              at::get_num_threads(), rest_s);
  }
  // Adam moments start at zero; resident homes are zero already, swapped ones
  // are written once so that reading them is valid. The zeros come from the
  // optimizer's exp_avg staging (zero-initialised, `sets` pieces long): a
  // sub-group is written in runs of that size.
  const OptimizerStaging& staging = optimizer_->staging();
  std::byte* zeros = staging.slot(Category::kExpAvg, 0);
  if (zeros == nullptr) return;
  const int64_t run = int64_t(staging.sets()) * staging.piece_numel();
  STRATA_CHECK(run % kShardAlignElems == 0 || run == plan.state.shard_space_numel, "optimizer staging not aligned");
  for (Category c : {Category::kExpAvg, Category::kExpAvgSq}) {
    for (const PlacementUnit& g : plan.state.units[size_t(c)]) {
      if (g.tier != Tier::kNvme) continue;
      for (int64_t o = 0; o < g.numel; o += run) state_->write(c, g.offset + o, std::min(run, g.numel - o), zeros);
    }
  }
}

}  // namespace strata
