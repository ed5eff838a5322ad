// DeepSpeed's sections of the config: the batch, optimizer, scheduler, fp16 and
// bf16, zero_optimization, aio and activation_checkpointing (docs/config.md).
// Each function checks its section's keys against the table above it, then
// reads each value with its type and range.
#include <cmath>

#include "config/sections.h"

namespace strata::config {

const SectionKeys kTopKeys = {
    "",
    {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
     "steps_per_print", "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "zero_optimization", "aio",
     "activation_checkpointing", "model", "lora", "data", "run", "placement", "comm", "communication_data_type",
     "tensorboard", "csv_monitor"},
    {"wall_clock_breakdown", "prescale_gradients", "gradient_predivide_factor", "zero_allow_untested_optimizer",
     "flops_profiler", "wandb", "comet", "comms_logger", "checkpoint", "data_types", "amp", "dump_state",
     "sparse_gradients", "memory_breakdown", "elasticity", "zero_force_ds_cpu_optimizer",
     "seq_parallel_communication_data_type", "compression_training", "autotuning", "quantize_training",
     "disable_allgather", "progressive_layer_drop", "curriculum_learning", "data_efficiency", "eigenvalue",
     "sparse_attention", "pipeline", "hybrid_engine", "weight_quantization", "compile", "timers",
     "dataloader_drop_last", "torch_autocast", "graph_harvesting", "use_data_before_expert_parallelism",
     "tensor_parallel", "nebula"}};

// ---- batch ------------------------------------------------------------------

void parse_batch(Section& top, Config& c) {
  int64_t train = 0, micro = 0, accum = 0;
  const bool has_train = top.read("train_batch_size", train);
  const bool has_micro = top.read("train_micro_batch_size_per_gpu", micro);
  const bool has_accum = top.read("gradient_accumulation_steps", accum);
  if (has_train) positive("train_batch_size", train);
  if (has_micro) positive("train_micro_batch_size_per_gpu", micro);
  if (has_accum) positive("gradient_accumulation_steps", accum);
  const int64_t ws = c.world_size;

  if (has_train && has_micro && has_accum) {
    if (train != micro * accum * ws) {
      fail("train_batch_size",
           num(train) + " != train_micro_batch_size_per_gpu " + num(micro) + " x gradient_accumulation_steps " +
               num(accum) + " x world_size " + num(ws) + " = " + num(micro * accum * ws));
    }
  } else if (has_train && has_micro) {
    if (train % (micro * ws) != 0) {
      fail("train_batch_size", num(train) + " is not divisible by train_micro_batch_size_per_gpu " + num(micro) +
                                   " x world_size " + num(ws));
    }
    accum = train / (micro * ws);
  } else if (has_train && has_accum) {
    if (train % (accum * ws) != 0) {
      fail("train_batch_size", num(train) + " is not divisible by gradient_accumulation_steps " + num(accum) +
                                   " x world_size " + num(ws));
    }
    micro = train / (accum * ws);
  } else if (has_train) {
    if (train % ws != 0) fail("train_batch_size", num(train) + " is not divisible by world_size " + num(ws));
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

// ---- optimizer ----------------------------------------------------------------

const SectionKeys kOptimizerKeys = {"optimizer", {"type", "params", "speculate", "speculate_slots"}, {}};
const SectionKeys kOptimizerParamsKeys = {
    "optimizer.params", {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam"}, {}};

void parse_optimizer(Section& top, Config& c) {
  Section o(top.object("optimizer"), kOptimizerKeys, c.ignored_keys);
  OptimizerConfig& opt = c.optimizer;
  o.read_enum("type", opt.type, kOptimizerTypes);
  o.read_enum("speculate", opt.speculate, kSpeculates);
  o.read("speculate_slots", opt.speculate_slots);

  Section p(o.object("params"), kOptimizerParamsKeys, c.ignored_keys);
  if (p.read("lr", opt.lr)) non_negative(p.key("lr"), opt.lr);
  if (const json* b = p.find("betas")) {
    const std::string k = p.key("betas");
    if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number() || !(*b)[1].is_number()) {
      wrong_type(k, "a list of two numbers [beta1, beta2]", *b);
    }
    opt.beta1 = (*b)[0].get<double>();
    opt.beta2 = (*b)[1].get<double>();
    for (double beta : {opt.beta1, opt.beta2}) {
      if (!(beta >= 0.0 && beta < 1.0)) fail(k, "each beta must be in [0, 1), got " + num(beta));
    }
  }
  if (p.read("eps", opt.eps)) positive(p.key("eps"), opt.eps);
  if (p.read("weight_decay", opt.weight_decay)) non_negative(p.key("weight_decay"), opt.weight_decay);
  bool torch_adam = false;
  if (p.read("torch_adam", torch_adam)) c.ignored_keys.push_back(p.key("torch_adam"));

  // AdamW always decouples weight decay; Adam does when params.adam_w_mode is true.
  bool w_mode = false;
  const bool has_w_mode = p.read("adam_w_mode", w_mode);
  if (opt.type == OptimizerType::kAdamW) {
    if (has_w_mode && !w_mode) {
      fail(p.key("adam_w_mode"), "false contradicts optimizer.type AdamW (use type Adam for L2 decay)");
    }
    opt.adam_w_mode = true;
  } else {
    // DeepSpeed's default (ADAM_W_MODE_DEFAULT = True): its "Adam" decouples weight
    // decay unless adam_w_mode is false, and a pasted config must train the same.
    opt.adam_w_mode = !has_w_mode || w_mode;
  }
  o.done();
  p.done();
}

// ---- scheduler ----------------------------------------------------------------

const SectionKeys kSchedulerKeys = {"scheduler", {"type", "params"}, {}};
const SectionKeys kSchedulerParamsKeys = {"scheduler.params",
                                          {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                                           "total_num_steps", "warmup_min_ratio", "cos_min_ratio"},
                                          {"last_batch_iteration"}};

void parse_scheduler(Section& top, Config& c) {
  if (!top.find("scheduler")) return;
  Section s(top.object("scheduler"), kSchedulerKeys, c.ignored_keys);
  SchedulerConfig& sc = c.scheduler;
  if (!s.read_enum("type", sc.type, kSchedulerTypes)) {
    fail("scheduler.type", "required when a scheduler is given (WarmupLR, WarmupDecayLR or WarmupCosineLR)");
  }
  Section p(s.object("params"), kSchedulerParamsKeys, c.ignored_keys);
  if (p.read("warmup_min_lr", sc.warmup_min_lr)) non_negative(p.key("warmup_min_lr"), sc.warmup_min_lr);
  if (p.read("warmup_max_lr", sc.warmup_max_lr)) non_negative(p.key("warmup_max_lr"), sc.warmup_max_lr);
  if (p.read("warmup_num_steps", sc.warmup_num_steps)) {
    non_negative(p.key("warmup_num_steps"), sc.warmup_num_steps);
  }
  p.read_enum("warmup_type", sc.warmup_type, kWarmupTypes);
  const bool has_total = p.read("total_num_steps", sc.total_num_steps);
  if (p.read("warmup_min_ratio", sc.warmup_min_ratio)) {
    in_closed(p.key("warmup_min_ratio"), sc.warmup_min_ratio, 0.0, 1.0);
  }
  if (p.read("cos_min_ratio", sc.cos_min_ratio)) in_closed(p.key("cos_min_ratio"), sc.cos_min_ratio, 0.0, 1.0);
  if (sc.type == SchedulerType::kWarmupDecayLR || sc.type == SchedulerType::kWarmupCosineLR) {
    if (!has_total) fail(p.key("total_num_steps"), std::string("required for ") + scheduler_type_name(sc.type));
    positive(p.key("total_num_steps"), sc.total_num_steps);
  } else if (has_total) {
    non_negative(p.key("total_num_steps"), sc.total_num_steps);
  }
  s.done();
  p.done();
}

// ---- fp16, bf16 -----------------------------------------------------------------

const SectionKeys kFp16Keys = {"fp16",
                               {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                                "min_loss_scale", "auto_cast", "consecutive_hysteresis"},
                               {"fp16_master_weights_and_grads"}};
const SectionKeys kBf16Keys = {"bf16",
                               {"enabled"},
                               {"immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                                "bf16_optimizer_states"}};

void parse_precision(Section& top, Config& c) {
  Section f(top.object("fp16"), kFp16Keys, c.ignored_keys);
  Fp16Config& h = c.fp16;
  f.read("enabled", h.enabled);
  if (f.read("loss_scale", h.loss_scale)) non_negative("fp16.loss_scale", h.loss_scale);
  if (f.read("initial_scale_power", h.initial_scale_power)) {
    if (h.initial_scale_power < 0 || h.initial_scale_power > 63) {
      fail("fp16.initial_scale_power", "must be in [0, 63], got " + num(h.initial_scale_power));
    }
  }
  if (f.read("loss_scale_window", h.loss_scale_window)) positive("fp16.loss_scale_window", h.loss_scale_window);
  if (f.read("hysteresis", h.hysteresis)) positive("fp16.hysteresis", h.hysteresis);
  if (f.read("min_loss_scale", h.min_loss_scale)) positive("fp16.min_loss_scale", h.min_loss_scale);
  bool flag = false;
  if (f.read("auto_cast", flag)) c.ignored_keys.push_back("fp16.auto_cast");
  f.read("consecutive_hysteresis", h.consecutive_hysteresis);
  f.done();

  // bf16, also under DeepSpeed's older name bfloat16.
  const bool has_bf16 = top.find("bf16") != nullptr;
  const bool has_bfloat16 = top.find("bfloat16") != nullptr;
  if (has_bf16 && has_bfloat16) fail("bfloat16", "given together with bf16; keep only bf16");
  const std::string bpath = has_bfloat16 ? "bfloat16" : "bf16";
  Section b(top.object(bpath), bpath, kBf16Keys, c.ignored_keys);
  b.read("enabled", c.bf16);
  b.done();

  if (c.bf16 && h.enabled) fail(bpath + ".enabled", "bf16 and fp16 cannot both be enabled (fp16.enabled is true)");
}

// ---- zero_optimization ------------------------------------------------------------

const SectionKeys kZeroKeys = {
    "zero_optimization",
    {"stage", "contiguous_gradients", "overlap_comm", "reduce_bucket_size", "allgather_bucket_size",
     "reduce_scatter", "allgather_partitions", "sub_group_size", "stage3_prefetch_bucket_size",
     "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
     "stage3_gather_16bit_weights_on_model_save", "offload_param", "offload_optimizer", "zero_hpz_partition_size"},
    {"round_robin_gradients", "elastic_checkpoint", "ignore_unused_parameters", "load_from_fp32_weights",
     "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
     "zeropp_loco_param", "mics_shard_size", "mics_hierarchical_params_gather",
     "stage3_gather_fp16_weights_on_model_save", "memory_efficient_linear", "cpu_offload", "cpu_offload_param",
     "cpu_offload_params", "cpu_offload_use_pin_memory", "stage3_model_persistence_threshold",
     "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
     "stage3_allgather_sequential", "use_multi_rank_bucket_allreduce", "legacy_stage1",
     "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks"}};
const SectionKeys kOffloadParamKeys = {
    "zero_optimization.offload_param",
    {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"},
    {}};
const SectionKeys kOffloadOptimizerKeys = {
    "zero_optimization.offload_optimizer",
    {"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write", "fast_init", "ratio"},
    {"super_offload", "convert_grad_on_cpu", "cpuadam_cores_perc"}};

namespace {

void parse_offload_param(Section& z, Config& c) {
  Section o(z.object("offload_param"), kOffloadParamKeys, c.ignored_keys);
  OffloadParamConfig& op = c.zero.offload_param;
  o.read_enum("device", op.device, kOffloadDevices);
  o.read_paths("nvme_path", op.nvme_path, true);
  if (o.read("buffer_count", op.buffer_count)) positive(o.key("buffer_count"), op.buffer_count);
  if (o.read("buffer_size", op.buffer_size)) positive(o.key("buffer_size"), op.buffer_size);
  if (o.read("max_in_cpu", op.max_in_cpu)) non_negative(o.key("max_in_cpu"), op.max_in_cpu);
  o.read("pin_memory", op.pin_memory);
  if (op.device == OffloadDevice::kNvme && op.nvme_path.empty()) fail(o.key("nvme_path"), "required when device is nvme");
  o.done();
}

void parse_offload_optimizer(Section& z, Config& c) {
  Section o(z.object("offload_optimizer"), kOffloadOptimizerKeys, c.ignored_keys);
  OffloadOptimizerConfig& oo = c.zero.offload_optimizer;
  o.read_enum("device", oo.device, kOffloadDevices);
  o.read_paths("nvme_path", oo.nvme_path, true);
  if (o.read("buffer_count", oo.buffer_count)) positive(o.key("buffer_count"), oo.buffer_count);
  o.read("pin_memory", oo.pin_memory);
  o.read("pipeline_read", oo.pipeline_read);
  o.read("pipeline_write", oo.pipeline_write);
  o.read("fast_init", oo.fast_init);
  if (o.read("ratio", oo.ratio)) {
    if (!(oo.ratio > 0.0 && oo.ratio <= 1.0)) fail(o.key("ratio"), "must be in (0, 1], got " + num(oo.ratio));
  }
  if (oo.device == OffloadDevice::kNvme && oo.nvme_path.empty()) fail(o.key("nvme_path"), "required when device is nvme");
  o.done();
}

}  // namespace

void parse_zero(Section& top, Config& c) {
  Section z(top.object("zero_optimization"), kZeroKeys, c.ignored_keys);
  ZeroConfig& zc = c.zero;
  if (z.read("stage", zc.stage)) {
    if (zc.stage < 0 || zc.stage > 3) fail(z.key("stage"), "must be 0, 1, 2 or 3, got " + num(zc.stage));
  }
  z.read("contiguous_gradients", zc.contiguous_gradients);
  if (!z.read("overlap_comm", zc.overlap_comm)) zc.overlap_comm = zc.stage == 3;
  auto pos = [&](std::string_view key, int64_t& out) {
    if (z.read(key, out)) positive(z.key(key), out);
  };
  auto nonneg = [&](std::string_view key, int64_t& out) {
    if (z.read(key, out)) non_negative(z.key(key), out);
  };
  pos("reduce_bucket_size", zc.reduce_bucket_size);
  pos("allgather_bucket_size", zc.allgather_bucket_size);
  z.read("reduce_scatter", zc.reduce_scatter);
  z.read("allgather_partitions", zc.allgather_partitions);
  pos("sub_group_size", zc.sub_group_size);
  nonneg("stage3_prefetch_bucket_size", zc.stage3_prefetch_bucket_size);
  nonneg("stage3_param_persistence_threshold", zc.stage3_param_persistence_threshold);
  nonneg("stage3_max_live_parameters", zc.stage3_max_live_parameters);
  nonneg("stage3_max_reuse_distance", zc.stage3_max_reuse_distance);
  pos("zero_hpz_partition_size", zc.hpz_partition_size);
  z.read("stage3_gather_16bit_weights_on_model_save", zc.stage3_gather_16bit_weights_on_model_save);
  parse_offload_param(z, c);
  parse_offload_optimizer(z, c);
  if (zc.stage < 3 && zc.offload_param.device != OffloadDevice::kNone) {
    fail(z.key("offload_param.device"),
         "offloading parameters needs zero_optimization.stage 3, got stage " + num(zc.stage));
  }
  z.done();
}

// ---- aio ----------------------------------------------------------------------

const SectionKeys kAioKeys = {"aio",
                              {"block_size", "queue_depth", "intra_op_parallelism", "thread_count", "single_submit",
                               "overlap_events", "use_gds"},
                              {}};

void parse_aio(Section& top, Config& c) {
  Section a(top.object("aio"), kAioKeys, c.ignored_keys);
  AioConfig& ac = c.aio;
  if (a.read("block_size", ac.block_size)) {
    positive("aio.block_size", ac.block_size);
    if (ac.block_size % 4096 != 0) fail("aio.block_size", "must be a multiple of 4096, got " + num(ac.block_size));
  }
  if (a.read("queue_depth", ac.queue_depth)) positive("aio.queue_depth", ac.queue_depth);
  int64_t intra = 0, threads = 0;
  const bool has_intra = a.read("intra_op_parallelism", intra);
  const bool has_threads = a.read("thread_count", threads);
  if (has_intra) positive("aio.intra_op_parallelism", intra);
  if (has_threads) positive("aio.thread_count", threads);
  if (has_intra && has_threads && intra != threads) {
    fail("aio.thread_count", num(threads) + " differs from aio.intra_op_parallelism " + num(intra) +
                                 " (thread_count is its older name; give one)");
  }
  if (has_intra) {
    ac.intra_op_parallelism = intra;
  } else if (has_threads) {
    ac.intra_op_parallelism = threads;
  }
  a.read("single_submit", ac.single_submit);
  a.read("overlap_events", ac.overlap_events);
  a.read("use_gds", ac.use_gds);
  a.done();
}

// ---- activation_checkpointing ---------------------------------------------------

const SectionKeys kActivationCheckpointingKeys = {
    "activation_checkpointing",
    {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization", "number_checkpoints",
     "synchronize_checkpoint_boundary", "profile"},
    {}};

void parse_activation_checkpointing(Section& top, Config& c) {
  Section a(top.object("activation_checkpointing"), kActivationCheckpointingKeys, c.ignored_keys);
  ActivationCheckpointingConfig& ac = c.activation_checkpointing;
  a.read("partition_activations", ac.partition_activations);
  a.read("cpu_checkpointing", ac.cpu_checkpointing);
  a.read("contiguous_memory_optimization", ac.contiguous_memory_optimization);
  if (const json* n = a.find("number_checkpoints")) {
    // null (DeepSpeed's None), and false as some configs write it, mean none.
    const std::string k = a.key("number_checkpoints");
    if (n->is_null() || (n->is_boolean() && !n->get<bool>())) {
      ac.number_checkpoints = 0;
    } else if (n->is_number()) {
      ac.number_checkpoints = to_int(*n, k);
      non_negative(k, ac.number_checkpoints);
    } else {
      wrong_type(k, "an integer or null", *n);
    }
  }
  a.read("synchronize_checkpoint_boundary", ac.synchronize_checkpoint_boundary);
  a.read("profile", ac.profile);
  a.done();
}

}  // namespace strata::config
