// What the machine offers (measure_capacity) and whether a plan fits it
// (plan_shortfalls).
#include "plan/capacity.h"

#include <algorithm>

#include "memory/device.h"
#include "util/logging.h"

namespace strata {

MachineCapacity measure_capacity(const Config& cfg, const std::vector<std::string>& nvme_paths,
                                 int local_ranks, int gpu) {
  MachineCapacity m;
  local_ranks = std::max(1, local_ranks);
  m.ranks_per_node = local_ranks;
  m.device_is_host = cfg.run.device == DeviceKind::kCpu;
  const std::string device = device_kind_name(cfg.run.device);
  m.device_addressable = m.device_is_host;
  m.host_bytes = cpu_device().memory_info().free_bytes;  // MemAvailable
  if (m.host_bytes > 0) m.host_bytes /= local_ranks;
  if (cfg.run.device_memory_mb > 0) {
    m.device_bytes = cfg.run.device_memory_mb << 20;
    m.device_source = "run.device_memory_mb";
  } else if (m.device_is_host) {
    m.device_bytes = -1;  // no budget: the device tier is host memory
  }
  if (!m.device_is_host) {
    // Each local rank has a GPU of its own: no division; more local ranks
    // than GPUs (Gloo shares them round-robin, cli/train/session.cc: local rank r
    // takes GPU r mod gpus) divide a GPU's free memory among the ranks on it.
    DeviceMemoryInfo info;
    std::string name = device;
    int64_t sharing = 1;
    const int gpus = cuda_device_count();
    if (cfg.run.device == DeviceKind::kCuda && gpus > 0) {
      const int g = std::max(0, gpu) % gpus;
      name = "cuda:" + std::to_string(g);
      if (local_ranks > gpus) sharing = (local_ranks - g + gpus - 1) / gpus;
    }
    if (query_device_memory(name, &info)) {
      info.free_bytes /= sharing;
      const std::string measured = strprintf("%s: %s free of %s%s", name.c_str(),
                                             format_bytes(double(info.free_bytes)).c_str(),
                                             format_bytes(double(info.total_bytes)).c_str(),
                                             sharing > 1 ? strprintf(", shared by %lld ranks", (long long)sharing).c_str() : "");
      if (m.device_bytes < 0 || info.free_bytes < m.device_bytes) {
        m.device_source = m.device_bytes < 0 ? measured : measured + " (less than run.device_memory_mb)";
        m.device_bytes = info.free_bytes;
      } else {
        m.device_source = "run.device_memory_mb (" + measured + ")";
      }
    } else if (m.device_bytes < 0) {
      m.device_source = std::string("not measured: ") +
                        (built_with_cuda() ? "no " + device + " on this machine"
                                           : "this build has no CUDA path") +
                        " (set run.device_memory_mb to plan for one)";
    }
  }
  // Several swap directories on one file system share its free space.
  std::vector<int64_t> seen;
  for (const std::string& p : nvme_paths) {
    const int64_t dev = device_of(p);
    if (std::find(seen.begin(), seen.end(), dev) != seen.end()) continue;
    seen.push_back(dev);
    const int64_t free = free_bytes_under(p);
    if (free >= 0) m.nvme_bytes = std::max<int64_t>(m.nvme_bytes, 0) + free;
  }
  if (m.nvme_bytes > 0) m.nvme_bytes /= local_ranks;
  return m;
}

std::vector<std::string> plan_shortfalls(const PlacementPlan& plan, const MachineCapacity& cap) {
  std::vector<std::string> out;
  const auto t = plan.total();
  auto check = [&](Tier tier, int64_t need, int64_t have, const std::string& advice) {
    if (have >= 0 && need > have) {
      out.push_back(strprintf("%s: short by %s (needs %s, has %s); %s", tier_name(tier),
                              format_bytes(double(need - have)).c_str(), format_bytes(double(need)).c_str(),
                              format_bytes(double(have)).c_str(), advice.c_str()));
    }
  };
  // Note [Step schedules]: what the layer schedule's held activations add.
  std::string layer;
  if (plan.step.held_micro > 1) {
    layer = strprintf("; the layer schedule holds the activations of %lld micro-batches (saved inputs %s, "
                      "output gradients %s, tied head gradients %s): set "
                      "activation_checkpointing.cpu_checkpointing, lower train_micro_batch_size_per_gpu, or set "
                      "run.schedule \"micro_batch\"",
                      (long long)plan.step.held_micro, format_bytes(double(plan.activations.checkpoint_activation_bytes)).c_str(),
                      format_bytes(double(plan.activations.held_output_grad_bytes)).c_str(),
                      format_bytes(double(plan.activations.held_tied_grad_bytes)).c_str());
  }
  check(Tier::kDevice, t[0], cap.device_bytes,
        "move state off the device (zero_optimization.offload_optimizer / offload_param, or a placement "
        "split with less on device), lower train_micro_batch_size_per_gpu, or raise run.device_memory_mb" + layer);
  int64_t host_need = t[1];
  if (cap.device_is_host && cap.device_bytes >= 0) host_need += std::min<int64_t>(t[0], cap.device_bytes);
  else if (cap.device_is_host) host_need += t[0];
  check(Tier::kHost, host_need, cap.host_bytes,
        "move state to nvme (offload_optimizer.device \"nvme\" or a placement split), or lower "
        "zero_optimization.sub_group_size to shrink the optimizer staging buffers" +
            (cap.device_is_host || plan.activations.cpu_checkpointing ? layer : std::string()));
  check(Tier::kNvme, t[2], cap.nvme_bytes, "free disk space under the nvme_path directories or add more");
  return out;
}

}  // namespace strata
