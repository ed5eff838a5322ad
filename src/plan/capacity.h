// What the machine offers a plan, measured or given, and the plan's verdict
// on it (docs/design.md, "Placement").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "memory/placement.h"

namespace strata {

// What the machine offers, measured or given (bytes; < 0 = unknown/unlimited).
struct MachineCapacity {
  int64_t device_bytes = -1;    // device-tier budget
  int64_t host_bytes = -1;      // available RAM
  int64_t nvme_bytes = -1;      // free space under the swap directories (sum)
  bool device_is_host = true;   // CPU compute: the device tier lives in host RAM
  // Whether host code may use device memory in place (the CPU device); false
  // on a GPU, and on a test device that models one with host memory
  // (PlacementPlan::device_addressable).
  bool device_addressable = true;
  // GPU compute: where device_bytes came from ("cuda:0: 79.1 GiB free of
  // 79.6 GiB", "run.device_memory_mb", or why it could not be measured).
  std::string device_source;
  // Where host_bytes and nvme_bytes came from: this machine's MemAvailable
  // and free disk space, or the flags that described another.
  std::string host_source = "this machine's available RAM";
  std::string nvme_source = "this machine's free space under the swap directories";
  // Ranks on this node (the launcher's LOCAL_WORLD_SIZE): the world's ranks
  // are numbered node by node in groups of this many (PlacementPlan::ranks_per_node).
  int ranks_per_node = 1;
};

// Measures the capacity: device budget from run.device_memory_mb (CPU: else
// unlimited; a GPU: the free memory it reports now, and at most that with a
// budget; unknown where this machine has no such GPU), MemAvailable from /proc/meminfo, statvfs free space under each
// of `nvme_paths` (the nearest existing ancestor of each). With
// `local_ranks` > 1 ranks share the node: each gets its share of RAM and disk
// (the device budget is per rank already). `gpu`: the rank's GPU (its
// ordinal, whose free memory is measured, divided among the local ranks
// that share it when there are more than GPUs); -1: the first GPU
// (`strata plan`).
MachineCapacity measure_capacity(const Config& cfg, const std::vector<std::string>& nvme_paths,
                                 int local_ranks = 1, int gpu = -1);

// The verdict: empty when the plan fits `capacity`; otherwise one line per
// short tier ("host: short by 3.2 GiB (needs 35.2 GiB, has 32.0 GiB); move
// optimizer state to nvme ...").
std::vector<std::string> plan_shortfalls(const PlacementPlan& plan, const MachineCapacity& capacity);

}  // namespace strata
