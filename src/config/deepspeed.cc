// DeepSpeed's keys turned into Strata's intents (config.h, StateIntent): the
// only place a DeepSpeed offload section becomes a split of a state category
// or a swap directory. Reading and checking the keys is
// deepspeed_sections.cc's; the plan (plan/make_plan.cc) places units by the
// intent and never reads the offload sections for it.
#include <algorithm>

#include "config/config.h"

namespace strata {

namespace {

TierSplit all_on_device() { return TierSplit{1.0, 0.0, 0.0}; }

}  // namespace

StateIntent state_intent(const Config& cfg, int64_t shard_space_numel) {
  const OffloadOptimizerConfig& oo = cfg.zero.offload_optimizer;
  const OffloadParamConfig& op = cfg.zero.offload_param;
  StateIntent in;
  TierSplit optimizer = all_on_device(), grad = all_on_device(), param16 = all_on_device();
  in.source = "default";
  if (oo.device != OffloadDevice::kNone) {
    in.source = "deepspeed";
    const double r = oo.ratio;
    optimizer = oo.device == OffloadDevice::kCpu ? TierSplit{1.0 - r, r, 0.0} : TierSplit{1.0 - r, 0.0, r};
    // DeepSpeed keeps the gradients of offloaded optimizer state in host memory
    // (they feed the CPU Adam), also when that state lives on NVMe.
    grad = TierSplit{1.0 - r, r, 0.0};
  }
  if (op.device == OffloadDevice::kCpu) {
    in.source = "deepspeed";
    param16 = TierSplit{0.0, 1.0, 0.0};
  } else if (op.device == OffloadDevice::kNvme) {
    in.source = "deepspeed";
    // max_in_cpu elements of parameters are kept in host memory, the rest on NVMe.
    const double in_cpu = std::min(1.0, double(op.max_in_cpu) / double(std::max<int64_t>(1, shard_space_numel)));
    param16 = TierSplit{0.0, in_cpu, 1.0 - in_cpu};
  }
  in.split = {param16, grad, optimizer, optimizer, optimizer};
  const PlacementConfig& pc = cfg.placement;
  if (pc.has_param16) in.split[0] = pc.param16;
  if (pc.has_grad) in.split[1] = pc.grad;
  if (pc.has_master) in.split[2] = pc.master;
  if (pc.has_exp_avg) in.split[3] = pc.exp_avg;
  if (pc.has_exp_avg_sq) in.split[4] = pc.exp_avg_sq;
  if (pc.has_param16 || pc.has_grad || pc.has_master || pc.has_exp_avg || pc.has_exp_avg_sq) in.source = "placement";
  // Swap directories: the placement section's, else every directory the two
  // offload sections name (the store stripes all state over all of them).
  in.nvme_paths = pc.nvme_path;
  if (in.nvme_paths.empty()) {
    for (const auto* list : {&oo.nvme_path, &op.nvme_path}) {
      for (const std::string& d : *list) {
        if (std::find(in.nvme_paths.begin(), in.nvme_paths.end(), d) == in.nvme_paths.end()) in.nvme_paths.push_back(d);
      }
    }
  }
  in.optimizer_buffers = oo.buffer_count;
  return in;
}

}  // namespace strata
