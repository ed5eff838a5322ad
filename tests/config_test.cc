// Tests of src/config: defaults, DeepSpeed-compatible keys, validation messages
// (each must name the key), overrides and file loading.
#include "config/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "util/errors.h"

namespace strata {
namespace {

using json = nlohmann::json;

// The smallest valid config: data.path is the only required key.
json minimal() { return json{{"data", {{"path", "corpus.txt"}}}}; }

// A config with one extra top-level section merged into minimal().
json with(const json& extra) {
  json j = minimal();
  j.update(extra, /*merge_objects=*/true);  // unlike merge_patch, keeps null values
  return j;
}

struct Failure {
  std::string key;
  std::string what;
};

// Parses and returns the ConfigError; fails the test when parsing succeeds.
Failure error_of(const json& j, const std::vector<std::string>& overrides = {}) {
  try {
    parse_config(j, overrides);
  } catch (const ConfigError& e) {
    return {e.key(), e.what()};
  }
  ADD_FAILURE() << "expected a ConfigError for " << j.dump();
  return {"<no error>", ""};
}

// Expects an error whose key is `key` and whose message contains `text`.
#define EXPECT_CONFIG_ERROR(j, key_, text)                          \
  do {                                                              \
    const Failure f_ = error_of(j);                                 \
    EXPECT_EQ(f_.key, key_) << f_.what;                             \
    EXPECT_NE(f_.what.find(text), std::string::npos) << f_.what;    \
  } while (0)

// ---- defaults ---------------------------------------------------------------

TEST(ConfigDefaults, MinimalConfigGivesDocumentedDefaults) {
  const Config c = parse_config(minimal());
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 8);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.train_batch_size, 8);
  EXPECT_EQ(c.world_size, 1);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.steps_per_print, 10);

  EXPECT_EQ(c.model.vocab_size, 256);
  EXPECT_EQ(c.model.dim, 128);
  EXPECT_EQ(c.model.n_layers, 4);
  EXPECT_EQ(c.model.n_heads, 4);
  EXPECT_EQ(c.model.kv_heads(), 4);
  EXPECT_EQ(c.model.seq_len, 128);
  EXPECT_TRUE(c.model.tie_embeddings);
  EXPECT_DOUBLE_EQ(c.model.rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.model.norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.model.init_std, 0.02);

  ASSERT_EQ(c.data.paths.size(), 1u);
  EXPECT_EQ(c.data.paths[0], "corpus.txt");
  EXPECT_STREQ(data_format_name(c.data.format), "text");
  EXPECT_DOUBLE_EQ(c.data.val_fraction, 0.1);
  EXPECT_EQ(c.data.eval_interval, 50);
  EXPECT_EQ(c.data.eval_batches, 4);

  EXPECT_EQ(c.run.steps, 200);
  EXPECT_EQ(c.run.seed, 1234u);
  EXPECT_EQ(c.run.log_level, "info");
  EXPECT_EQ(c.run.device, DeviceKind::kCpu);
  EXPECT_STREQ(moment_dtype_name(c.run.optimizer_state_dtype), "fp32");
  EXPECT_EQ(c.run.threads, 0);
  EXPECT_EQ(c.run.compute_dtype, ComputeDtype::kFp32);
  EXPECT_TRUE(c.run.metrics.empty());
  EXPECT_TRUE(c.run.log_file.empty());

  EXPECT_STREQ(optimizer_type_name(c.optimizer.type), "AdamW");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-3);
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.9);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.999);
  EXPECT_DOUBLE_EQ(c.optimizer.eps, 1e-8);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.01);
  EXPECT_TRUE(c.optimizer.adam_w_mode);
  EXPECT_STREQ(scheduler_type_name(c.scheduler.type), "");

  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_DOUBLE_EQ(c.fp16.loss_scale, 0.0);
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.fp16.loss_scale_window, 1000);
  EXPECT_EQ(c.fp16.hysteresis, 2);
  EXPECT_DOUBLE_EQ(c.fp16.min_loss_scale, 1.0);
  EXPECT_FALSE(c.bf16);

  EXPECT_EQ(c.zero.stage, 0);
  EXPECT_TRUE(c.zero.contiguous_gradients);
  EXPECT_FALSE(c.zero.overlap_comm);
  EXPECT_EQ(c.zero.reduce_bucket_size, 500000000);
  EXPECT_EQ(c.zero.allgather_bucket_size, 500000000);
  EXPECT_EQ(c.zero.sub_group_size, 1000000000);
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 50000000);
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, 100000);
  EXPECT_EQ(c.zero.stage3_max_live_parameters, 1000000000);
  EXPECT_EQ(c.zero.stage3_max_reuse_distance, 1000000000);
  EXPECT_FALSE(c.zero.stage3_gather_16bit_weights_on_model_save);
  EXPECT_STREQ(offload_device_name(c.zero.offload_param.device), "none");
  EXPECT_EQ(c.zero.offload_param.buffer_count, 5);
  EXPECT_EQ(c.zero.offload_param.buffer_size, 100000000);
  EXPECT_EQ(c.zero.offload_param.max_in_cpu, 1000000000);
  EXPECT_TRUE(c.zero.offload_param.pin_memory);
  EXPECT_STREQ(offload_device_name(c.zero.offload_optimizer.device), "none");
  EXPECT_EQ(c.zero.offload_optimizer.buffer_count, 4);
  EXPECT_DOUBLE_EQ(c.zero.offload_optimizer.ratio, 1.0);

  EXPECT_EQ(c.aio.block_size, 1048576);
  EXPECT_EQ(c.aio.queue_depth, 8);
  EXPECT_EQ(c.aio.intra_op_parallelism, 1);
  EXPECT_FALSE(c.aio.single_submit);
  EXPECT_TRUE(c.aio.overlap_events);
  EXPECT_FALSE(c.aio.use_gds);

  EXPECT_EQ(c.activation_checkpointing.number_checkpoints, 0);
  EXPECT_FALSE(c.activation_checkpointing.cpu_checkpointing);

  EXPECT_TRUE(c.ignored_keys.empty());
  EXPECT_EQ(c.raw, minimal());
}

TEST(ConfigDefaults, FfnDim) {
  ModelConfig m;
  EXPECT_EQ(m.ffn_dim(), 352);  // int(8 * 128 / 3) = 341, rounded up to 32
  m.dim = 4096;
  m.multiple_of = 256;
  EXPECT_EQ(m.ffn_dim(), 11008);  // LLaMA-7B
  m.ffn_hidden = 1000;
  EXPECT_EQ(m.ffn_dim(), 1000);
}

TEST(ConfigDefaults, OverlapCommDefaultsTrueForStage3) {
  EXPECT_TRUE(parse_config(with({{"zero_optimization", {{"stage", 3}}}})).zero.overlap_comm);
  EXPECT_FALSE(parse_config(with({{"zero_optimization", {{"stage", 2}}}})).zero.overlap_comm);
  EXPECT_FALSE(parse_config(with({{"zero_optimization", {{"stage", 3}, {"overlap_comm", false}}}}))
                   .zero.overlap_comm);
  EXPECT_TRUE(parse_config(with({{"zero_optimization", {{"stage", 1}, {"overlap_comm", true}}}}))
                  .zero.overlap_comm);
}

TEST(ConfigDefaults, ComputeDtypeFollowsPrecisionSections) {
  EXPECT_EQ(parse_config(with({{"bf16", {{"enabled", true}}}})).run.compute_dtype, ComputeDtype::kBf16);
  EXPECT_TRUE(parse_config(with({{"bf16", {{"enabled", true}}}})).bf16);
  EXPECT_EQ(parse_config(with({{"fp16", {{"enabled", true}}}})).run.compute_dtype, ComputeDtype::kFp16);
  EXPECT_EQ(parse_config(with({{"bf16", {{"enabled", false}}}})).run.compute_dtype, ComputeDtype::kFp32);
  // DeepSpeed's older section name.
  EXPECT_EQ(parse_config(with({{"bfloat16", {{"enabled", true}}}})).run.compute_dtype, ComputeDtype::kBf16);
}

// ---- batch sizes --------------------------------------------------------------

TEST(ConfigBatch, InfersTheMissingOne) {
  Config c = parse_config(with({{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 4}}));
  EXPECT_EQ(c.gradient_accumulation_steps, 8);
  c = parse_config(with({{"train_batch_size", 32}, {"gradient_accumulation_steps", 2}}));
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 16);
  c = parse_config(with({{"train_micro_batch_size_per_gpu", 4}, {"gradient_accumulation_steps", 3}}));
  EXPECT_EQ(c.train_batch_size, 12);
  c = parse_config(with({{"train_batch_size", 24}}));
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 24);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  c = parse_config(with({{"train_micro_batch_size_per_gpu", 5}}));
  EXPECT_EQ(c.train_batch_size, 5);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  c = parse_config(with({{"gradient_accumulation_steps", 4}}));
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 8);
  EXPECT_EQ(c.train_batch_size, 32);
  c = parse_config(with({{"train_batch_size", 12},
                         {"train_micro_batch_size_per_gpu", 3},
                         {"gradient_accumulation_steps", 4}}));
  EXPECT_EQ(c.train_batch_size, 12);
}

TEST(ConfigBatch, InconsistentSizesNameTrainBatchSize) {
  EXPECT_CONFIG_ERROR(with({{"train_batch_size", 10},
                            {"train_micro_batch_size_per_gpu", 3},
                            {"gradient_accumulation_steps", 4}}),
                      "train_batch_size", "!= train_micro_batch_size_per_gpu 3");
}

TEST(ConfigBatch, NonDivisibleSizesNameTrainBatchSize) {
  EXPECT_CONFIG_ERROR(with({{"train_batch_size", 10}, {"train_micro_batch_size_per_gpu", 3}}),
                      "train_batch_size", "not divisible");
  EXPECT_CONFIG_ERROR(with({{"train_batch_size", 10}, {"gradient_accumulation_steps", 4}}),
                      "train_batch_size", "not divisible");
}

TEST(ConfigBatch, NonPositiveSizesNameTheirKey) {
  EXPECT_CONFIG_ERROR(with({{"train_micro_batch_size_per_gpu", 0}}),
                      "train_micro_batch_size_per_gpu", "must be > 0");
  EXPECT_CONFIG_ERROR(with({{"gradient_accumulation_steps", -2}}), "gradient_accumulation_steps",
                      "must be > 0, got -2");
}

// ---- unknown keys -------------------------------------------------------------

TEST(ConfigUnknownKeys, TopLevelTypoSuggestsTheKnownKey) {
  const Failure f = error_of(with({{"optimzer", {{"type", "AdamW"}}}}));
  EXPECT_EQ(f.key, "optimzer");
  EXPECT_EQ(f.what, "optimzer: unknown key, did you mean 'optimizer'?");
}

TEST(ConfigUnknownKeys, FarKeyHasNoSuggestion) {
  const Failure f = error_of(with({{"bananas_and_apples", 1}}));
  EXPECT_EQ(f.key, "bananas_and_apples");
  EXPECT_EQ(f.what, "bananas_and_apples: unknown key");
}

TEST(ConfigUnknownKeys, NestedKeyIsNamedWithItsFullPath) {
  EXPECT_CONFIG_ERROR(
      with({{"zero_optimization", {{"stage", 3}, {"offload_param", {{"devcie", "cpu"}}}}}}),
      "zero_optimization.offload_param.devcie", "did you mean 'device'?");
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"params", {{"learning_rate", 0.1}}}}}}),
                      "optimizer.params.learning_rate", "unknown key");
  EXPECT_CONFIG_ERROR(with({{"model", {{"n_layer", 2}}}}), "model.n_layer",
                      "did you mean 'n_layers'?");
  EXPECT_CONFIG_ERROR(with({{"data", {{"path", "x"}, {"fromat", "text"}}}}), "data.fromat",
                      "did you mean 'format'?");
}

TEST(ConfigUnknownKeys, CommonPrefixSuggests) {
  EXPECT_CONFIG_ERROR(with({{"zero_optimization", {{"stage3_prefetch", 5}}}}),
                      "zero_optimization.stage3_prefetch",
                      "did you mean 'stage3_prefetch_bucket_size'?");
}

TEST(ConfigUnknownKeys, IgnoredDeepSpeedKeysAreRecorded) {
  const Config c = parse_config(with({{"wall_clock_breakdown", false},
                                      {"flops_profiler", {{"enabled", false}}},
                                      {"wandb", {{"enabled", true}}},
                                      {"zero_allow_untested_optimizer", true},
                                      {"zero_optimization",
                                       {{"stage", 2},
                                        {"round_robin_gradients", true},
                                        {"cpu_offload", false},
                                        {"stage3_gather_fp16_weights_on_model_save", true}}}}));
  const std::vector<std::string> expected = {
      "flops_profiler",
      "wall_clock_breakdown",
      "wandb",
      "zero_allow_untested_optimizer",
      "zero_optimization.cpu_offload",
      "zero_optimization.round_robin_gradients",
      "zero_optimization.stage3_gather_fp16_weights_on_model_save",
  };
  std::vector<std::string> got = c.ignored_keys;
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, expected);
  EXPECT_EQ(c.zero.stage, 2);
}

TEST(ConfigUnknownKeys, AcceptedButInactiveParamsAreRecorded) {
  const Config c = parse_config(with({{"optimizer", {{"params", {{"torch_adam", true}}}}},
                                      {"fp16", {{"auto_cast", false}, {"consecutive_hysteresis", true}}},
                                      {"scheduler", {{"type", "WarmupLR"},
                                                     {"params", {{"last_batch_iteration", -1}}}}}}));
  std::vector<std::string> got = c.ignored_keys;
  std::sort(got.begin(), got.end());
  const std::vector<std::string> expected = {"fp16.auto_cast", "optimizer.params.torch_adam",
                                             "scheduler.params.last_batch_iteration"};
  EXPECT_EQ(got, expected);
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"params", {{"torch_adam", "yes"}}}}}}),
                      "optimizer.params.torch_adam", "expected a boolean");
  // consecutive_hysteresis is acted on (Note [Loss scaling]), not ignored.
  EXPECT_TRUE(c.fp16.consecutive_hysteresis);
}

// ---- types --------------------------------------------------------------------

TEST(ConfigTypes, WrongTypeNamesKeyAndExpectedType) {
  const Failure f = error_of(with({{"optimizer", {{"params", {{"lr", "fast"}}}}}}));
  EXPECT_EQ(f.key, "optimizer.params.lr");
  EXPECT_EQ(f.what, "optimizer.params.lr: expected a number, got string \"fast\"");
  EXPECT_CONFIG_ERROR(with({{"fp16", {{"enabled", "yes"}}}}), "fp16.enabled",
                      "expected a boolean (true or false), got string \"yes\"");
  EXPECT_CONFIG_ERROR(with({{"zero_optimization", 3}}), "zero_optimization",
                      "expected an object, got number 3");
  EXPECT_CONFIG_ERROR(with({{"model", {{"dim", true}}}}), "model.dim",
                      "expected an integer, got boolean true");
  EXPECT_CONFIG_ERROR(with({{"run", {{"log_file", 3}}}}), "run.log_file", "expected a string");
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"params", {{"betas", 0.9}}}}}}),
                      "optimizer.params.betas", "expected a list of two numbers");
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"params", {{"betas", {0.9, 0.99, 0.999}}}}}}}),
                      "optimizer.params.betas", "expected a list of two numbers");
  EXPECT_CONFIG_ERROR(with({{"data", {{"path", {"a.txt", 7}}}}}), "data.path",
                      "element 1 is number 7");
}

TEST(ConfigTypes, IntegralFloatsAreIntegers) {
  const Config c = parse_config(with({{"zero_optimization",
                                       {{"stage", 3.0},
                                        {"reduce_bucket_size", 5e8},
                                        {"sub_group_size", 1e9},
                                        {"stage3_prefetch_bucket_size", 5e7}}},
                                      {"train_micro_batch_size_per_gpu", 2.0}}));
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.reduce_bucket_size, 500000000);
  EXPECT_EQ(c.zero.sub_group_size, 1000000000);
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size, 50000000);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 2);
}

TEST(ConfigTypes, FractionalFloatIsRejectedForIntegerKey) {
  const Failure f = error_of(with({{"zero_optimization", {{"reduce_bucket_size", 1.5}}}}));
  EXPECT_EQ(f.key, "zero_optimization.reduce_bucket_size");
  EXPECT_EQ(f.what, "zero_optimization.reduce_bucket_size: expected an integer, got 1.5");
  EXPECT_CONFIG_ERROR(with({{"train_batch_size", 1.5}}), "train_batch_size",
                      "expected an integer, got 1.5");
  EXPECT_CONFIG_ERROR(with({{"run", {{"seed", 1.5}}}}), "run.seed", "expected an integer");
  EXPECT_CONFIG_ERROR(with({{"zero_optimization", {{"sub_group_size", 1e30}}}}),
                      "zero_optimization.sub_group_size", "out of range");
}

TEST(ConfigTypes, TopLevelMustBeAnObject) {
  EXPECT_THROW(parse_config(json::array({1, 2})), ConfigError);
  try {
    parse_config(json::array());
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("must be a JSON object"), std::string::npos);
  }
}

// ---- ranges and enums -----------------------------------------------------------

TEST(ConfigRanges, OutOfRangeNamesKey) {
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"params", {{"betas", {0.9, 1.0}}}}}}}),
                      "optimizer.params.betas", "in [0, 1), got 1.0");
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"params", {{"eps", 0}}}}}}), "optimizer.params.eps",
                      "must be > 0");
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"params", {{"weight_decay", -0.1}}}}}}),
                      "optimizer.params.weight_decay", "must be >= 0, got -0.1");
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"params", {{"lr", -1}}}}}}), "optimizer.params.lr",
                      "must be >= 0");
  EXPECT_CONFIG_ERROR(with({{"gradient_clipping", -1.0}}), "gradient_clipping", "must be >= 0");
  EXPECT_CONFIG_ERROR(with({{"communication_data_type", "int8"}}), "communication_data_type",
                      "expected fp32, bf16 or fp16, got \"int8\"");
  EXPECT_STREQ(compute_dtype_name(parse_config(with({{"communication_data_type", "BF16"}})).comm.data_type), "bf16");
  EXPECT_CONFIG_ERROR(with({{"comm", {{"secondary_shard", "maybe"}}}}), "comm.secondary_shard",
                      "expected auto, on or off, got \"maybe\"");
  EXPECT_CONFIG_ERROR(with({{"zero_optimization", {{"zero_hpz_partition_size", 0}}}}),
                      "zero_optimization.zero_hpz_partition_size", "must be > 0");
  // DeepSpeed's hpZ key asks for the secondary shard; Strata's own key wins.
  EXPECT_STREQ(secondary_shard_name(parse_config(minimal()).comm.secondary_shard), "auto");
  EXPECT_STREQ(secondary_shard_name(
                parse_config(with({{"zero_optimization", {{"zero_hpz_partition_size", 8}}}})).comm.secondary_shard),
            "on");
  EXPECT_STREQ(secondary_shard_name(
                parse_config(with({{"zero_optimization", {{"zero_hpz_partition_size", 1}}}})).comm.secondary_shard),
            "auto");
  EXPECT_STREQ(secondary_shard_name(parse_config(with({{"zero_optimization", {{"zero_hpz_partition_size", 8}}},
                                                    {"comm", {{"secondary_shard", "off"}}}}))
                                     .comm.secondary_shard),
            "off");
  EXPECT_CONFIG_ERROR(with({{"zero_optimization", {{"stage", 4}}}}), "zero_optimization.stage",
                      "must be 0, 1, 2 or 3, got 4");
  EXPECT_CONFIG_ERROR(with({{"zero_optimization", {{"offload_optimizer", {{"ratio", 0}}}}}}),
                      "zero_optimization.offload_optimizer.ratio", "must be in (0, 1]");
  EXPECT_CONFIG_ERROR(with({{"zero_optimization", {{"offload_optimizer", {{"ratio", 1.5}}}}}}),
                      "zero_optimization.offload_optimizer.ratio", "must be in (0, 1]");
  EXPECT_CONFIG_ERROR(with({{"aio", {{"block_size", 1000}}}}), "aio.block_size",
                      "multiple of 4096");
  EXPECT_CONFIG_ERROR(with({{"aio", {{"block_size", 0}}}}), "aio.block_size", "must be > 0");
  EXPECT_CONFIG_ERROR(with({{"aio", {{"queue_depth", 0}}}}), "aio.queue_depth", "must be > 0");
  EXPECT_CONFIG_ERROR(with({{"aio", {{"intra_op_parallelism", 0}}}}), "aio.intra_op_parallelism",
                      "must be > 0");
  EXPECT_CONFIG_ERROR(with({{"data", {{"path", "x"}, {"val_fraction", 0.6}}}}),
                      "data.val_fraction", "must be in [0.0, 0.5]");
  EXPECT_CONFIG_ERROR(with({{"data", {{"path", "x"}, {"eval_batches", 0}}}}), "data.eval_batches",
                      "must be > 0");
  EXPECT_CONFIG_ERROR(with({{"data", {{"path", "x"}, {"eval_interval", -1}}}}),
                      "data.eval_interval", "must be >= 0");
  EXPECT_CONFIG_ERROR(with({{"run", {{"steps", 0}}}}), "run.steps", "must be > 0");
  EXPECT_CONFIG_ERROR(with({{"run", {{"threads", -1}}}}), "run.threads", "must be >= 0");
  EXPECT_CONFIG_ERROR(with({{"run", {{"seed", -1}}}}), "run.seed", "must be >= 0");
  EXPECT_CONFIG_ERROR(with({{"fp16", {{"loss_scale_window", 0}}}}), "fp16.loss_scale_window",
                      "must be > 0");
  EXPECT_CONFIG_ERROR(with({{"scheduler", {{"type", "WarmupCosineLR"},
                                           {"params", {{"total_num_steps", 10},
                                                       {"cos_min_ratio", 2}}}}}}),
                      "scheduler.params.cos_min_ratio", "must be in [0.0, 1.0]");
  EXPECT_CONFIG_ERROR(with({{"steps_per_print", 0}}), "steps_per_print", "must be > 0");
}

TEST(ConfigRanges, LargeSeedIsAccepted) {
  const Config c = parse_config(with({{"run", {{"seed", 18446744073709551615ull}}}}));
  EXPECT_EQ(c.run.seed, 18446744073709551615ull);
}

TEST(ConfigEnums, BadEnumListsTheChoices) {
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"type", "SGD"}}}}), "optimizer.type",
                      "expected Adam or AdamW, got \"SGD\"");
  EXPECT_CONFIG_ERROR(with({{"scheduler", {{"type", "OneCycle"}}}}), "scheduler.type",
                      "expected WarmupLR, WarmupDecayLR or WarmupCosineLR");
  EXPECT_CONFIG_ERROR(
      with({{"zero_optimization", {{"offload_optimizer", {{"device", "disk"}}}}}}),
      "zero_optimization.offload_optimizer.device", "expected none, cpu or nvme, got \"disk\"");
  EXPECT_CONFIG_ERROR(with({{"scheduler", {{"type", "WarmupLR"},
                                           {"params", {{"warmup_type", "cubic"}}}}}}),
                      "scheduler.params.warmup_type", "expected log or linear");
  EXPECT_CONFIG_ERROR(with({{"run", {{"log_level", "loud"}}}}), "run.log_level",
                      "expected trace, debug, info, warn, error or off");
  EXPECT_CONFIG_ERROR(with({{"run", {{"device", "tpu"}}}}), "run.device", "expected cpu or cuda");
  EXPECT_CONFIG_ERROR(with({{"run", {{"optimizer_state_dtype", "fp8"}}}}), "run.optimizer_state_dtype",
                      "expected fp32 or bf16");
  EXPECT_CONFIG_ERROR(with({{"data", {{"path", "x"}, {"format", "int8"}}}}), "data.format",
                      "expected text, uint16 or uint32");
  EXPECT_CONFIG_ERROR(with({{"run", {{"overlap_optimizer", "sometimes"}}}}), "run.overlap_optimizer",
                      "expected true, false or \"auto\"");
  EXPECT_CONFIG_ERROR(with({{"run", {{"overlap_optimizer", 1}}}}), "run.overlap_optimizer",
                      "expected true, false or \"auto\"");
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"speculate", "maybe"}}}}), "optimizer.speculate",
                      "expected auto, on or off, got \"maybe\"");
  EXPECT_EQ(parse_config(with({{"optimizer", {{"speculate", "on"}}}})).optimizer.speculate, Speculate::kOn);
  EXPECT_EQ(parse_config(with(json::object())).optimizer.speculate, Speculate::kAuto);
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"speculate_slots", "yes"}}}}), "optimizer.speculate_slots", "a boolean");
  // DeepSpeed's monitors (docs/monitors.md): its keys and defaults.
  const Config d = parse_config(with(json::object()));
  EXPECT_FALSE(d.tensorboard.enabled);
  EXPECT_EQ(d.tensorboard.dir(), "DeepSpeedJobName");
  EXPECT_EQ(parse_config(with({{"csv_monitor", {{"enabled", true}, {"output_path", "runs"}, {"job_name", "j"}}}}))
                .csv_monitor.dir(),
            "runs/j");
  EXPECT_EQ(parse_config(with({{"tensorboard", {{"output_path", "runs/"}}}})).tensorboard.dir(), "runs/DeepSpeedJobName");
  EXPECT_CONFIG_ERROR(with({{"tensorboard", {{"job_name", ""}}}}), "tensorboard.job_name", "must not be empty");
  EXPECT_CONFIG_ERROR(with({{"csv_monitor", {{"enabled", "yes"}}}}), "csv_monitor.enabled", "a boolean");
  EXPECT_CONFIG_ERROR(with({{"tensorboard", {{"enable", true}}}}), "tensorboard.enable", "");
  EXPECT_TRUE(parse_config(with({{"tensorboard", {{"enabled", true}}}})).ignored_keys.empty());
  EXPECT_FALSE(parse_config(with(json::object())).run.deterministic);
  EXPECT_TRUE(parse_config(with({{"run", {{"deterministic", true}}}})).run.deterministic);
  EXPECT_CONFIG_ERROR(with({{"run", {{"deterministic", 1}}}}), "run.deterministic", "a boolean");
  EXPECT_TRUE(parse_config(with(json::object())).optimizer.speculate_slots);
  EXPECT_FALSE(parse_config(with({{"optimizer", {{"speculate_slots", false}}}})).optimizer.speculate_slots);
}

TEST(ConfigEnums, OverlapOptimizerIsABooleanOrAuto) {
  EXPECT_EQ(parse_config(with({{"run", {{"steps", 3}}}})).run.overlap_optimizer, OptimizerOverlap::kAuto);
  EXPECT_EQ(parse_config(with({{"run", {{"overlap_optimizer", true}}}})).run.overlap_optimizer, OptimizerOverlap::kOn);
  EXPECT_EQ(parse_config(with({{"run", {{"overlap_optimizer", false}}}})).run.overlap_optimizer,
            OptimizerOverlap::kOff);
  EXPECT_EQ(parse_config(with({{"run", {{"overlap_optimizer", "AUTO"}}}})).run.overlap_optimizer,
            OptimizerOverlap::kAuto);
}

TEST(ConfigEnums, CaseInsensitiveNamesAreCanonicalized) {
  Config c = parse_config(with({{"optimizer", {{"type", "adamw"}}}}));
  EXPECT_STREQ(optimizer_type_name(c.optimizer.type), "AdamW");
  c = parse_config(with({{"optimizer", {{"type", "adam"}}},
                         {"scheduler", {{"type", "warmuplr"}}},
                         {"zero_optimization", {{"offload_optimizer", {{"device", "CPU"}}}}}}));
  EXPECT_STREQ(optimizer_type_name(c.optimizer.type), "Adam");
  EXPECT_STREQ(scheduler_type_name(c.scheduler.type), "WarmupLR");
  EXPECT_STREQ(offload_device_name(c.zero.offload_optimizer.device), "cpu");
}

// ---- optimizer and scheduler ---------------------------------------------------

TEST(ConfigOptimizer, ParamsAreRead) {
  const Config c = parse_config(with(
      {{"optimizer",
        {{"type", "AdamW"},
         {"params", {{"lr", 3e-4}, {"betas", {0.8, 0.95}}, {"eps", 1e-6}, {"weight_decay", 0.1}}}}}}));
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.optimizer.eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.1);
}

TEST(ConfigOptimizer, AdamWModeIsDerived) {
  EXPECT_TRUE(parse_config(with({{"optimizer", {{"type", "AdamW"}}}})).optimizer.adam_w_mode);
  // DeepSpeed's Adam decouples weight decay unless adam_w_mode is false.
  EXPECT_TRUE(parse_config(with({{"optimizer", {{"type", "Adam"}}}})).optimizer.adam_w_mode);
  EXPECT_TRUE(parse_config(with({{"optimizer", {{"type", "Adam"},
                                                {"params", {{"adam_w_mode", true}}}}}}))
                  .optimizer.adam_w_mode);
  EXPECT_FALSE(parse_config(with({{"optimizer", {{"type", "Adam"},
                                                 {"params", {{"adam_w_mode", false}}}}}}))
                   .optimizer.adam_w_mode);
  EXPECT_CONFIG_ERROR(with({{"optimizer", {{"type", "AdamW"}, {"params", {{"adam_w_mode", false}}}}}}),
                      "optimizer.params.adam_w_mode", "contradicts");
}

TEST(ConfigScheduler, ParamsAreRead) {
  const Config c = parse_config(with({{"scheduler",
                                       {{"type", "WarmupDecayLR"},
                                        {"params",
                                         {{"warmup_min_lr", 0},
                                          {"warmup_max_lr", 3e-4},
                                          {"warmup_num_steps", 100},
                                          {"warmup_type", "linear"},
                                          {"total_num_steps", 1000}}}}}}));
  EXPECT_STREQ(scheduler_type_name(c.scheduler.type), "WarmupDecayLR");
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_max_lr, 3e-4);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 100);
  EXPECT_STREQ(warmup_type_name(c.scheduler.warmup_type), "linear");
  EXPECT_EQ(c.scheduler.total_num_steps, 1000);
  const Config w = parse_config(with({{"scheduler", {{"type", "WarmupLR"}}}}));
  EXPECT_EQ(w.scheduler.warmup_num_steps, 1000);
  EXPECT_STREQ(warmup_type_name(w.scheduler.warmup_type), "log");
}

TEST(ConfigScheduler, TotalStepsRequiredForDecayAndCosine) {
  EXPECT_CONFIG_ERROR(with({{"scheduler", {{"type", "WarmupDecayLR"}}}}),
                      "scheduler.params.total_num_steps", "required for WarmupDecayLR");
  EXPECT_CONFIG_ERROR(with({{"scheduler", {{"type", "WarmupCosineLR"},
                                           {"params", {{"total_num_steps", 0}}}}}}),
                      "scheduler.params.total_num_steps", "must be > 0");
  EXPECT_CONFIG_ERROR(with({{"scheduler", {{"params", {{"warmup_num_steps", 5}}}}}}),
                      "scheduler.type", "required");
}

// ---- precision ------------------------------------------------------------------

TEST(ConfigPrecision, Bf16AndFp16TogetherIsAnError) {
  EXPECT_CONFIG_ERROR(with({{"bf16", {{"enabled", true}}}, {"fp16", {{"enabled", true}}}}),
                      "bf16.enabled", "fp16");
  EXPECT_CONFIG_ERROR(with({{"bf16", {{"enabled", true}}}, {"bfloat16", {{"enabled", true}}}}),
                      "bfloat16", "bf16");
}

TEST(ConfigPrecision, Fp16ParamsAreRead) {
  const Config c = parse_config(with({{"fp16",
                                       {{"enabled", true},
                                        {"loss_scale", 0},
                                        {"initial_scale_power", 12},
                                        {"loss_scale_window", 500},
                                        {"hysteresis", 3},
                                        {"min_loss_scale", 0.5}}}}));
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.initial_scale_power, 12);
  EXPECT_EQ(c.fp16.loss_scale_window, 500);
  EXPECT_EQ(c.fp16.hysteresis, 3);
  EXPECT_DOUBLE_EQ(c.fp16.min_loss_scale, 0.5);
}

// ---- ZeRO, offload, aio ---------------------------------------------------------

TEST(ConfigZero, OffloadParamNeedsStage3) {
  EXPECT_CONFIG_ERROR(
      with({{"zero_optimization", {{"stage", 2}, {"offload_param", {{"device", "cpu"}}}}}}),
      "zero_optimization.offload_param.device", "stage 3");
  // device none is fine at any stage.
  EXPECT_NO_THROW(parse_config(
      with({{"zero_optimization", {{"stage", 1}, {"offload_param", {{"device", "none"}}}}}})));
}

TEST(ConfigZero, NvmeNeedsPath) {
  EXPECT_CONFIG_ERROR(
      with({{"zero_optimization", {{"stage", 3}, {"offload_param", {{"device", "nvme"}}}}}}),
      "zero_optimization.offload_param.nvme_path", "required when device is nvme");
  EXPECT_CONFIG_ERROR(
      with({{"zero_optimization",
             {{"offload_optimizer", {{"device", "nvme"}, {"nvme_path", json::array()}}}}}}),
      "zero_optimization.offload_optimizer.nvme_path", "required when device is nvme");
  EXPECT_CONFIG_ERROR(with({{"zero_optimization",
                             {{"offload_optimizer", {{"device", "nvme"}, {"nvme_path", ""}}}}}}),
                      "zero_optimization.offload_optimizer.nvme_path", "empty");
  const Config c = parse_config(
      with({{"zero_optimization",
             {{"offload_optimizer", {{"device", "nvme"}, {"nvme_path", {"/nvme0", "/nvme1"}}}}}}}));
  EXPECT_EQ(c.zero.offload_optimizer.nvme_path, (std::vector<std::string>{"/nvme0", "/nvme1"}));
}

TEST(ConfigAio, ThreadCountIsAnAlias) {
  EXPECT_EQ(parse_config(with({{"aio", {{"thread_count", 4}}}})).aio.intra_op_parallelism, 4);
  EXPECT_EQ(parse_config(with({{"aio", {{"thread_count", 4}, {"intra_op_parallelism", 4}}}}))
                .aio.intra_op_parallelism,
            4);
  EXPECT_CONFIG_ERROR(with({{"aio", {{"thread_count", 2}, {"intra_op_parallelism", 4}}}}),
                      "aio.thread_count", "differs from aio.intra_op_parallelism 4");
}

TEST(ConfigActivationCheckpointing, NumberCheckpointsIntOrNull) {
  EXPECT_EQ(parse_config(with({{"activation_checkpointing", {{"number_checkpoints", nullptr}}}}))
                .activation_checkpointing.number_checkpoints,
            0);
  EXPECT_EQ(parse_config(with({{"activation_checkpointing", {{"number_checkpoints", 4}}}}))
                .activation_checkpointing.number_checkpoints,
            4);
  EXPECT_CONFIG_ERROR(with({{"activation_checkpointing", {{"number_checkpoints", "all"}}}}),
                      "activation_checkpointing.number_checkpoints", "expected an integer or null");
  EXPECT_CONFIG_ERROR(with({{"activation_checkpointing", {{"number_checkpoints", 1.5}}}}),
                      "activation_checkpointing.number_checkpoints", "expected an integer");
}

// A DeepSpeed ZeRO-Infinity config as users write it: stage 3, parameters and
// optimizer state on NVMe, an aio section, fp16/bf16, plus DeepSpeed-only keys.
TEST(ConfigZero, ZeroInfinityConfigParses) {
  const json j = json::parse(R"({
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "wall_clock_breakdown": false,
    "zero_allow_untested_optimizer": true,
    "optimizer": {
      "type": "AdamW",
      "params": {"lr": 1.5e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    },
    "scheduler": {
      "type": "WarmupCosineLR",
      "params": {"total_num_steps": 10000, "warmup_num_steps": 500, "warmup_min_ratio": 0.01,
                 "cos_min_ratio": 0.1}
    },
    "bf16": {"enabled": true},
    "zero_optimization": {
      "stage": 3,
      "contiguous_gradients": true,
      "overlap_comm": true,
      "reduce_bucket_size": 5e8,
      "sub_group_size": 1e9,
      "stage3_prefetch_bucket_size": 5e7,
      "stage3_param_persistence_threshold": 1e5,
      "stage3_max_live_parameters": 1e9,
      "stage3_max_reuse_distance": 1e9,
      "stage3_gather_16bit_weights_on_model_save": true,
      "offload_param": {
        "device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
        "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9
      },
      "offload_optimizer": {
        "device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
        "buffer_count": 4, "fast_init": false, "pipeline_read": true, "pipeline_write": true,
        "ratio": 0.3
      }
    },
    "aio": {
      "block_size": 1048576, "queue_depth": 16, "thread_count": 2,
      "single_submit": false, "overlap_events": true
    },
    "activation_checkpointing": {
      "partition_activations": true, "cpu_checkpointing": true,
      "contiguous_memory_optimization": false, "number_checkpoints": null,
      "synchronize_checkpoint_boundary": false, "profile": false
    },
    "model": {"vocab_size": 32000, "dim": 4096, "n_layers": 32, "n_heads": 32,
              "n_kv_heads": 8, "multiple_of": 256, "seq_len": 2048, "tie_embeddings": false},
    "data": {"path": ["shard0.bin", "shard1.bin"], "format": "uint16"},
    "run": {"steps": 10000, "device": "cuda", "seed": 42}
  })");
  const Config c = parse_config(j);
  EXPECT_EQ(c.train_batch_size, 64);
  EXPECT_EQ(c.gradient_accumulation_steps, 16);
  EXPECT_EQ(c.steps_per_print, 100);
  EXPECT_STREQ(optimizer_type_name(c.optimizer.type), "AdamW");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1.5e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.95);
  EXPECT_STREQ(scheduler_type_name(c.scheduler.type), "WarmupCosineLR");
  EXPECT_EQ(c.scheduler.total_num_steps, 10000);
  EXPECT_DOUBLE_EQ(c.scheduler.cos_min_ratio, 0.1);
  EXPECT_TRUE(c.bf16);
  EXPECT_EQ(c.run.compute_dtype, ComputeDtype::kBf16);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_TRUE(c.zero.overlap_comm);
  EXPECT_EQ(c.zero.reduce_bucket_size, 500000000);
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold, 100000);
  EXPECT_TRUE(c.zero.stage3_gather_16bit_weights_on_model_save);
  EXPECT_STREQ(offload_device_name(c.zero.offload_param.device), "nvme");
  EXPECT_EQ(c.zero.offload_param.nvme_path, std::vector<std::string>{"/local_nvme"});
  EXPECT_EQ(c.zero.offload_param.buffer_size, 100000000);
  EXPECT_EQ(c.zero.offload_param.max_in_cpu, 1000000000);
  EXPECT_STREQ(offload_device_name(c.zero.offload_optimizer.device), "nvme");
  EXPECT_TRUE(c.zero.offload_optimizer.pipeline_read);
  EXPECT_TRUE(c.zero.offload_optimizer.pipeline_write);
  EXPECT_DOUBLE_EQ(c.zero.offload_optimizer.ratio, 0.3);
  EXPECT_EQ(c.aio.queue_depth, 16);
  EXPECT_EQ(c.aio.intra_op_parallelism, 2);
  EXPECT_TRUE(c.activation_checkpointing.cpu_checkpointing);
  EXPECT_EQ(c.activation_checkpointing.number_checkpoints, 0);
  EXPECT_EQ(c.model.kv_heads(), 8);
  EXPECT_EQ(c.model.head_dim(), 128);
  EXPECT_EQ(c.model.ffn_dim(), 11008);
  EXPECT_EQ(c.data.paths.size(), 2u);
  EXPECT_STREQ(data_format_name(c.data.format), "uint16");
  EXPECT_EQ(c.run.device, DeviceKind::kCuda);
  EXPECT_EQ(c.run.seed, 42u);
  std::vector<std::string> ignored = c.ignored_keys;
  std::sort(ignored.begin(), ignored.end());
  EXPECT_EQ(ignored, (std::vector<std::string>{"wall_clock_breakdown",
                                               "zero_allow_untested_optimizer"}));
  EXPECT_EQ(c.raw, j);
}

// ---- Strata sections ------------------------------------------------------------

TEST(ConfigModel, ShapeRulesNameTheKey) {
  EXPECT_CONFIG_ERROR(with({{"model", {{"dim", 130}, {"n_heads", 4}}}}), "model.dim",
                      "not divisible by model.n_heads 4");
  EXPECT_CONFIG_ERROR(with({{"model", {{"dim", 12}, {"n_heads", 4}}}}), "model.dim",
                      "must be even");
  EXPECT_CONFIG_ERROR(with({{"model", {{"n_heads", 4}, {"n_kv_heads", 3}}}}), "model.n_kv_heads",
                      "does not divide model.n_heads 4");
  EXPECT_CONFIG_ERROR(with({{"model", {{"n_layers", 0}}}}), "model.n_layers", "must be > 0");
  EXPECT_CONFIG_ERROR(with({{"model", {{"n_kv_heads", -1}}}}), "model.n_kv_heads", "must be >= 0");
  EXPECT_CONFIG_ERROR(with({{"model", {{"norm_eps", 0}}}}), "model.norm_eps", "must be > 0");
  EXPECT_CONFIG_ERROR(with({{"model", {{"dim", 1e12}}}}), "model.dim", "must be <= 2^32");
  const Config c = parse_config(with({{"model", {{"n_kv_heads", 2}, {"ffn_hidden", 0}}}}));
  EXPECT_EQ(c.model.kv_heads(), 2);
}

TEST(ConfigModel, FamilyKeysNameTheirKey) {
  EXPECT_CONFIG_ERROR(with({{"model", {{"family", "gemma"}}}}), "model.family",
                      "expected llama, mistral, qwen2, qwen3, mixtral, qwen2_moe or qwen3_moe");
  EXPECT_CONFIG_ERROR(with({{"model", {{"rope_scaling", {{"type", "yarn"}}}}}}), "model.rope_scaling.type",
                      "expected none, linear or llama3");
  EXPECT_CONFIG_ERROR(with({{"model", {{"rope_scaling", {{"type", "linear"}, {"factor", 0}}}}}}),
                      "model.rope_scaling.factor", "must be > 0");
  EXPECT_CONFIG_ERROR(with({{"model", {{"rope_scaling", {{"type", "llama3"}, {"low_freq_factor", 4.0}}}}}}),
                      "model.rope_scaling.high_freq_factor", "must be greater than low_freq_factor");
  EXPECT_CONFIG_ERROR(with({{"model", {{"rope_scaling", {{"type", "linear"}, {"scale", 2}}}}}}),
                      "model.rope_scaling.scale", "");
  EXPECT_CONFIG_ERROR(with({{"model", {{"sliding_window", 4096}}}}), "model.sliding_window",
                      "only model.family mistral");
  EXPECT_CONFIG_ERROR(with({{"model", {{"family", "mistral"}, {"sliding_window", 64}, {"seq_len", 128}}}}),
                      "model.sliding_window", "64 is shorter than model.seq_len 128");
  EXPECT_CONFIG_ERROR(with({{"model", {{"head_dim", 15}}}}), "model.head_dim", "head dim 15 must be even");
  // An explicit head_dim frees dim from n_heads (Qwen3: 4 heads of 32 on a 64-wide model).
  const Config c = parse_config(
      with({{"model", {{"family", "qwen3"}, {"dim", 64}, {"n_heads", 4}, {"head_dim", 32}, {"n_kv_heads", 2}}}}));
  EXPECT_EQ(c.model.head_dim(), 32);
  EXPECT_EQ(c.model.q_dim(), 128);
  EXPECT_TRUE(c.model.qk_norm());
  EXPECT_FALSE(c.model.qkv_bias());
  const Config m = parse_config(with({{"model", {{"family", "mistral"}, {"sliding_window", 4096}}}}));
  EXPECT_EQ(m.model.sliding_window, 4096);
}

// A Llama model's invariants carry none of the family keys, so checkpoints
// saved before those keys existed still resume and export; any other family
// or feature is recorded, so `strata export` writes the right config.json.
TEST(ConfigModel, InvariantsRecordOnlyWhatDiffersFromLlama) {
  const nlohmann::json llama = resume_invariants(parse_config(with({{"model", {{"head_dim", 32}}}})))["model"];
  for (const char* k : {"family", "head_dim", "rope_scaling", "sliding_window"}) EXPECT_FALSE(llama.contains(k)) << k;
  const nlohmann::json q = resume_invariants(parse_config(with(
      {{"model", {{"family", "qwen2"}, {"head_dim", 64}, {"rope_scaling", {{"type", "linear"}, {"factor", 2.0}}}}}})))["model"];
  EXPECT_EQ(q["family"], "qwen2");
  EXPECT_EQ(q["head_dim"], 64);
  EXPECT_EQ(q["rope_scaling"], (nlohmann::json{{"type", "linear"}, {"factor", 2.0}}));
}

TEST(ConfigModel, TextFormatNeedsVocab256) {
  EXPECT_CONFIG_ERROR(with({{"model", {{"vocab_size", 1000}}}}), "model.vocab_size",
                      "must be 256 for data.format text");
  EXPECT_NO_THROW(parse_config(
      with({{"model", {{"vocab_size", 1000}}}, {"data", {{"path", "t.bin"}, {"format", "uint32"}}}})));
}

TEST(ConfigData, PathIsRequired) {
  EXPECT_CONFIG_ERROR(json::object(), "data.path", "required");
  EXPECT_CONFIG_ERROR(json({{"data", {{"format", "text"}}}}), "data.path", "required");
  EXPECT_CONFIG_ERROR(json({{"data", {{"path", json::array()}}}}), "data.path", "empty");
  EXPECT_CONFIG_ERROR(json({{"data", {{"path", ""}}}}), "data.path", "empty");
  const Config c = parse_config(json({{"data", {{"path", {"rel/a.txt", "/abs/b.txt"}}}}}));
  EXPECT_EQ(c.data.paths, (std::vector<std::string>{"rel/a.txt", "/abs/b.txt"}));
}

// ---- overrides ----------------------------------------------------------------

TEST(ConfigOverrides, SetExistingAndNewKeys) {
  const Config c = parse_config(
      with({{"optimizer", {{"params", {{"lr", 1e-3}}}}}}),
      {"optimizer.params.lr=3e-4", "zero_optimization.offload_optimizer.device=cpu",
       "run.steps=7", "bf16.enabled=true", "run.metrics=out/metrics.jsonl",
       "optimizer.params.betas=[0.5,0.6]"});
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-4);
  EXPECT_STREQ(offload_device_name(c.zero.offload_optimizer.device), "cpu");
  EXPECT_EQ(c.run.steps, 7);
  EXPECT_TRUE(c.bf16);
  EXPECT_EQ(c.run.metrics, "out/metrics.jsonl");
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.5);
  EXPECT_EQ(c.raw["zero_optimization"]["offload_optimizer"]["device"], "cpu");
  EXPECT_EQ(c.raw["optimizer"]["params"]["lr"], 3e-4);
}

TEST(ConfigOverrides, LaterOverrideWins) {
  const Config c = parse_config(minimal(), {"run.steps=5", "run.steps=9"});
  EXPECT_EQ(c.run.steps, 9);
}

TEST(ConfigOverrides, OverridesAreValidated) {
  Failure f = error_of(minimal(), {"optimizer.params.lr=fast"});
  EXPECT_EQ(f.key, "optimizer.params.lr");
  EXPECT_NE(f.what.find("expected a number, got string \"fast\""), std::string::npos) << f.what;
  f = error_of(minimal(), {"zero_optimization.stgae=3"});
  EXPECT_EQ(f.key, "zero_optimization.stgae");
  EXPECT_NE(f.what.find("did you mean 'stage'?"), std::string::npos) << f.what;
  f = error_of(minimal(), {"optimzer.type=Adam"});
  EXPECT_EQ(f.key, "optimzer");
}

TEST(ConfigOverrides, MalformedOverrideNamesIt) {
  Failure f = error_of(minimal(), {"run.steps"});
  EXPECT_EQ(f.key, "run.steps");
  EXPECT_NE(f.what.find("malformed override"), std::string::npos) << f.what;
  f = error_of(minimal(), {"=5"});
  EXPECT_EQ(f.key, "=5");
  EXPECT_NE(f.what.find("empty key"), std::string::npos) << f.what;
  f = error_of(minimal(), {"run..steps=5"});
  EXPECT_EQ(f.key, "run..steps=5");
  EXPECT_NE(f.what.find("malformed override"), std::string::npos) << f.what;
  f = error_of(minimal(), {"data.path.x=1"});
  EXPECT_EQ(f.key, "data.path");
  EXPECT_NE(f.what.find("expected an object"), std::string::npos) << f.what;
}

// ---- load_config ----------------------------------------------------------------

class ConfigFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("strata_config_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    const auto p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  }
  std::filesystem::path dir_;
};

TEST_F(ConfigFile, LoadsAndAppliesOverrides) {
  const std::string path = write("ok.json", R"({
    // comments are allowed
    "data": {"path": "corpus.txt"},
    "run": {"steps": 3}
  })");
  const Config c = load_config(path, {"run.steps=4"});
  EXPECT_EQ(c.run.steps, 4);
  EXPECT_EQ(c.data.paths[0], "corpus.txt");
}

TEST_F(ConfigFile, MissingFileNamesThePath) {
  const std::string path = (dir_ / "nope.json").string();
  try {
    load_config(path);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), path);
    EXPECT_EQ(std::string(e.what()), path + ": cannot read config file");
  }
  try {
    load_config(dir_.string());
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), dir_.string());
    EXPECT_NE(std::string(e.what()).find("cannot read config file"), std::string::npos);
  }
}

TEST_F(ConfigFile, BadJsonNamesFileLineAndColumn) {
  const std::string path = write("bad.json", "{\n  \"data\": {\"path\": \"x\"},\n  \"run\": {steps: 3}\n}\n");
  try {
    load_config(path);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.key(), path);
    EXPECT_NE(what.find("invalid JSON at line 3, column"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

TEST_F(ConfigFile, TopLevelMustBeAnObject) {
  const std::string path = write("list.json", "[1, 2]");
  try {
    load_config(path);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), path);
    EXPECT_NE(std::string(e.what()).find("must be a JSON object, got an array"), std::string::npos);
  }
}

TEST_F(ConfigFile, ValidationErrorsNameTheKey) {
  const std::string path = write("typo.json", R"({"data": {"path": "x"}, "optimzer": {}})");
  try {
    load_config(path);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), "optimzer");
  }
}


// ---- docs/config.md against the parser's key tables ----------------------------

// What docs/config.md says about keys: the keys its tables' first cells name
// (resolved against the section heading above them), each table row's text
// with the keys and section it belongs to, the headings' paths, and the keys
// of its "accepted with a warning" table.
struct ConfigDocs {
  struct Row {
    std::string section;              // the heading's path ("" for none)
    std::vector<std::string> names;   // full keys its first cell names
    std::string text;
  };
  std::vector<Row> rows;
  std::set<std::string> named, headings, ignored;
};

std::vector<std::string> backticked(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = s.find('`'); i != std::string::npos; i = s.find('`', i + 1)) {
    const size_t j = s.find('`', i + 1);
    if (j == std::string::npos) break;
    out.push_back(s.substr(i + 1, j - i - 1));
    i = j;
  }
  return out;
}

bool plain_name(const std::string& s) {
  return !s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_.") == std::string::npos;
}

ConfigDocs read_config_docs(const std::set<std::string>& sections, const std::set<std::string>& top_level) {
  std::ifstream in(std::string(STRATA_SOURCE_DIR) + "/docs/config.md");
  EXPECT_TRUE(in.good()) << "docs/config.md";
  ConfigDocs docs;
  std::string line, section;
  bool ignored_table = false;
  while (std::getline(in, line)) {
    if (line.rfind("#", 0) == 0) {
      std::istringstream words(line.substr(line.find_first_not_of("# ")));
      std::string first;
      words >> first;
      while (!first.empty() && (first.back() == ',' || first.back() == ':')) first.pop_back();
      section = sections.count(first) ? first : "";
      if (!section.empty()) docs.headings.insert(section);
      ignored_table = line.find("accepted with a warning") != std::string::npos;
      continue;
    }
    if (line.rfind("|", 0) != 0) continue;
    const size_t end = line.find('|', 1);
    const std::string first = line.substr(1, end == std::string::npos ? std::string::npos : end - 1);
    if (ignored_table) {  // | where | keys |
      const std::vector<std::string> where = backticked(first);
      if (first.find("top level") == std::string::npos && where.size() != 1) continue;
      const std::string prefix = where.empty() ? "" : where[0];
      for (const std::string& k : backticked(line.substr(end + 1))) {
        if (plain_name(k)) docs.ignored.insert(prefix.empty() ? k : prefix + "." + k);
      }
      continue;
    }
    ConfigDocs::Row row{section, {}, line};
    std::string previous;
    for (const std::string& n : backticked(first)) {
      std::string full;
      if (!n.empty() && n[0] == '.' && plain_name(n.substr(1)) && !previous.empty()) {
        full = previous.substr(0, previous.rfind('.')) + n;  // `csv_monitor.enabled`, `.output_path`
      } else if (plain_name(n)) {
        const std::string head = n.substr(0, n.find('.'));
        full = section.empty() || top_level.count(head) ? n : section + "." + n;
      } else {
        continue;
      }
      row.names.push_back(full);
      docs.named.insert(full);
      previous = full;
    }
    docs.rows.push_back(row);
  }
  return docs;
}

// A key is documented when a table row names it or a key inside it, a heading is it, or a row
// of one of its enclosing keys (or under its enclosing section's heading)
// names its last part in backticks or quotes (run.rates' rates, a
// placement category's tiers).
bool documented(const ConfigDocs& docs, const std::string& key) {
  if (docs.named.count(key) || docs.headings.count(key)) return true;
  for (const std::string& n : docs.named) {
    if (n.rfind(key + ".", 0) == 0) return true;  // a section whose keys are documented
  }
  const std::string leaf = key.substr(key.rfind('.') + 1);
  for (size_t dot = key.rfind('.'); dot != std::string::npos && dot > 0; dot = key.rfind('.', dot - 1)) {
    const std::string outer = key.substr(0, dot);
    for (const ConfigDocs::Row& row : docs.rows) {
      const bool of_outer = row.section == outer ||
                            std::find(row.names.begin(), row.names.end(), outer) != row.names.end();
      if (of_outer && (row.text.find("`" + leaf + "`") != std::string::npos ||
                       row.text.find("\"" + leaf + "\"") != std::string::npos)) {
        return true;
      }
    }
    if (dot == 0) break;
  }
  return false;
}

TEST(ConfigTest, DocsListEveryKeyTheParserReads) {
  std::set<std::string> read, ignored, sections, top_level;
  for (const ConfigKey& k : config_key_table()) {
    (k.ignored ? ignored : read).insert(k.key);
    for (size_t dot = k.key.find('.'); dot != std::string::npos; dot = k.key.find('.', dot + 1)) {
      sections.insert(k.key.substr(0, dot));
    }
    if (k.key.find('.') == std::string::npos) top_level.insert(k.key);
  }
  ASSERT_GT(read.size(), 100u);
  const ConfigDocs docs = read_config_docs(sections, top_level);
  ASSERT_GT(docs.named.size(), 100u);
  for (const std::string& k : read) {
    EXPECT_TRUE(documented(docs, k)) << k << " is read by the parser but not documented in docs/config.md";
  }
  for (const std::string& k : docs.named) {
    EXPECT_TRUE(read.count(k) || ignored.count(k)) << k << " is documented in docs/config.md but not read";
  }
  for (const std::string& k : ignored) {
    EXPECT_TRUE(docs.ignored.count(k))
        << k << " is accepted with a warning but missing from docs/config.md's table of such keys";
  }
  for (const std::string& k : docs.ignored) {
    EXPECT_TRUE(ignored.count(k) || read.count(k)) << k << " is in docs/config.md's accepted keys but not known";
  }
}

}  // namespace
}  // namespace strata
