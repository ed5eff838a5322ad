// The config's sections (config/ only): one function per section that reads
// it from the top-level object into Config, each with its key table beside it
// (config/reader.h). DeepSpeed's sections are in deepspeed_sections.cc,
// Strata's own in strata_sections.cc; parse_config (config.cc) calls them in
// the order below.
#pragma once

#include "config/config.h"
#include "config/reader.h"

namespace strata::config {

// Each section's key table, beside the function that reads the section.
extern const SectionKeys kTopKeys, kOptimizerKeys, kOptimizerParamsKeys, kSchedulerKeys, kSchedulerParamsKeys,
    kFp16Keys, kBf16Keys, kZeroKeys, kOffloadParamKeys, kOffloadOptimizerKeys, kAioKeys,
    kActivationCheckpointingKeys;  // deepspeed_sections.cc
extern const SectionKeys kModelKeys, kRopeScalingKeys, kDataKeys, kRunKeys, kRatesKeys, kCheckpointKeys, kActivationsKeys,
    kPlacementKeys, kSplitKeys, kCommKeys, kMonitorKeys;  // strata_sections.cc
extern const SectionKeys kLoraKeys;                   // lora_section.cc

// Enum tables (name <-> value), in the order their messages list them.
inline constexpr EnumName<DeviceKind> kDeviceKinds[] = {{DeviceKind::kCpu, "cpu"}, {DeviceKind::kCuda, "cuda"}};
inline constexpr EnumName<ComputeDtype> kComputeDtypes[] = {
    {ComputeDtype::kFp32, "fp32"}, {ComputeDtype::kBf16, "bf16"}, {ComputeDtype::kFp16, "fp16"}};
inline constexpr EnumName<ModelFamily> kModelFamilies[] = {{ModelFamily::kLlama, "llama"},
                                                           {ModelFamily::kMistral, "mistral"},
                                                           {ModelFamily::kQwen2, "qwen2"},
                                                           {ModelFamily::kQwen3, "qwen3"},
                                                           {ModelFamily::kMixtral, "mixtral"},
                                                           {ModelFamily::kQwen2Moe, "qwen2_moe"},
                                                           {ModelFamily::kQwen3Moe, "qwen3_moe"}};
inline constexpr EnumName<RopeType> kRopeTypes[] = {
    {RopeType::kNone, "none"}, {RopeType::kLinear, "linear"}, {RopeType::kLlama3, "llama3"}};
inline constexpr EnumName<Recompute> kRecomputes[] = {
    {Recompute::kAuto, "auto"}, {Recompute::kAlways, "always"}, {Recompute::kNever, "never"}};
inline constexpr EnumName<Speculate> kSpeculates[] = {
    {Speculate::kAuto, "auto"}, {Speculate::kOn, "on"}, {Speculate::kOff, "off"}};
inline constexpr EnumName<ExpertGemm> kExpertGemms[] = {
    {ExpertGemm::kAuto, "auto"}, {ExpertGemm::kLoop, "loop"}, {ExpertGemm::kGrouped, "grouped"}};
inline constexpr EnumName<StepSchedule> kSchedules[] = {
    {StepSchedule::kAuto, "auto"}, {StepSchedule::kMicroBatch, "micro_batch"}, {StepSchedule::kLayer, "layer"}};
inline constexpr EnumName<DataFormat> kDataFormats[] = {
    {DataFormat::kText, "text"}, {DataFormat::kUint16, "uint16"}, {DataFormat::kUint32, "uint32"}};
inline constexpr EnumName<DataSampling> kDataSamplings[] = {
    {DataSampling::kWindows, "windows"}, {DataSampling::kExamples, "examples"}, {DataSampling::kPacked, "packed"}};
inline constexpr EnumName<MomentDtype> kMomentDtypes[] = {{MomentDtype::kFp32, "fp32"}, {MomentDtype::kBf16, "bf16"}};
inline constexpr EnumName<OptimizerType> kOptimizerTypes[] = {{OptimizerType::kAdam, "Adam"},
                                                              {OptimizerType::kAdamW, "AdamW"}};
// kConstant has no spelling: it is the absence of a scheduler section.
inline constexpr EnumName<SchedulerType> kSchedulerTypes[] = {{SchedulerType::kWarmupLR, "WarmupLR"},
                                                              {SchedulerType::kWarmupDecayLR, "WarmupDecayLR"},
                                                              {SchedulerType::kWarmupCosineLR, "WarmupCosineLR"}};
inline constexpr EnumName<WarmupType> kWarmupTypes[] = {{WarmupType::kLog, "log"}, {WarmupType::kLinear, "linear"}};
inline constexpr EnumName<OffloadDevice> kOffloadDevices[] = {
    {OffloadDevice::kNone, "none"}, {OffloadDevice::kCpu, "cpu"}, {OffloadDevice::kNvme, "nvme"}};
inline constexpr EnumName<CommBackend> kCommBackends[] = {
    {CommBackend::kAuto, "auto"}, {CommBackend::kGloo, "gloo"}, {CommBackend::kNccl, "nccl"}};
inline constexpr EnumName<GradientReduction> kGradientReductions[] = {{GradientReduction::kAuto, "auto"},
                                                                      {GradientReduction::kPerStep, "per_step"},
                                                                      {GradientReduction::kPerMicroBatch, "per_micro_batch"}};
inline constexpr EnumName<SecondaryShard> kSecondaryShards[] = {
    {SecondaryShard::kAuto, "auto"}, {SecondaryShard::kOn, "on"}, {SecondaryShard::kOff, "off"}};
inline constexpr EnumName<KeepGathered::Mode> kKeepGatheredModes[] = {
    {KeepGathered::Mode::kAuto, "auto"}, {KeepGathered::Mode::kAll, "all"}, {KeepGathered::Mode::kNone, "none"}};

// DeepSpeed's sections (deepspeed_sections.cc).
void parse_batch(Section& top, Config& c);  // train_batch_size and its two factors
void parse_optimizer(Section& top, Config& c);
void parse_scheduler(Section& top, Config& c);
void parse_precision(Section& top, Config& c);  // fp16, bf16 (or bfloat16)
void parse_zero(Section& top, Config& c);       // zero_optimization and its offload sections
void parse_aio(Section& top, Config& c);
void parse_activation_checkpointing(Section& top, Config& c);

// Strata's sections (strata_sections.cc).
void parse_model(Section& top, Config& c);
void parse_data(Section& top, Config& c);
void parse_run(Section& top, Config& c);
void parse_placement(Section& top, Config& c);
void parse_lora(Section& top, Config& c);  // lora (lora_section.cc)
void parse_comm(Section& top, Config& c);  // comm and the top-level communication_data_type
void parse_monitor(Section& top, Config& c, const char* key, MonitorConfig& m);  // tensorboard, csv_monitor

// model.init_from's Hugging Face config.json merged into the model section
// (hf_config.cc).
json model_with_hf_config(const json& m, const std::string& from);
// A LoRA base's identity (Note [Base identity] in hf_config.cc): its
// safetensors files' names and sizes and a hash of their headers and ends.
json base_identity(const std::string& from);

// The token files' sidecars (FILE.json) checked against, and filling, the
// data and model sections (token_sidecars.cc).
void apply_token_sidecars(Config& c, bool format_set);

}  // namespace strata::config
