// Who this process is: the launcher's environment (strata launch / torchrun,
// or Slurm's srun), read in one place.
#include <cstdlib>
#include <string>

#include "comm/communicator.h"
#include "util/errors.h"

namespace strata {

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

int int_env(const char* name, int fallback, int min_value) {
  const char* v = env(name);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || n < min_value || n > (1 << 24)) {
    throw ConfigError(name, std::string("environment variable is not a valid number: '") + v + "'");
  }
  return int(n);
}

// "4(x2),3" -> 4: the tasks on the first node of SLURM_TASKS_PER_NODE.
int first_tasks_per_node(const char* v) {
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return end == v || n <= 0 ? -1 : int(n);
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // The first entry ends at a comma outside brackets.
  std::string first;
  int depth = 0;
  for (char c : nodelist) {
    if (c == ',' && depth == 0) break;
    if (c == '[') ++depth;
    if (c == ']') --depth;
    first += c;
  }
  // Every bracket group stands for its first member: prefix[003-005,7]-n[1-2] -> prefix003-n1.
  std::string host;
  for (size_t i = 0; i < first.size(); ++i) {
    if (first[i] != '[') {
      host += first[i];
      continue;
    }
    const size_t rb = first.find(']', i);
    std::string range = first.substr(i + 1, rb == std::string::npos ? std::string::npos : rb - i - 1);
    const size_t stop = range.find_first_of(",-");
    host += stop == std::string::npos ? range : range.substr(0, stop);
    if (rb == std::string::npos) break;
    i = rb;
  }
  return host;
}

RankInfo rank_info_from_environment() {
  RankInfo r;
  if (env("RANK") != nullptr || env("WORLD_SIZE") != nullptr) {
    r.source = "env";
    r.world_size = int_env("WORLD_SIZE", 1, 1);
    r.rank = int_env("RANK", 0, 0);
    r.local_rank = int_env("LOCAL_RANK", r.rank, 0);
    r.local_world_size = int_env("LOCAL_WORLD_SIZE", r.world_size, 1);
    if (const char* a = env("MASTER_ADDR")) r.master_addr = a;
    r.master_port = int_env("MASTER_PORT", 29500, 1);
    const char* agent = env("TORCHELASTIC_USE_AGENT_STORE");
    r.agent_store = agent != nullptr && std::string(agent) == "True";
  } else if (env("SLURM_PROCID") != nullptr && env("SLURM_NTASKS") != nullptr) {
    r.source = "slurm";
    r.world_size = int_env("SLURM_NTASKS", 1, 1);
    r.rank = int_env("SLURM_PROCID", 0, 0);
    r.local_rank = int_env("SLURM_LOCALID", 0, 0);
    r.local_world_size = int_env("SLURM_NTASKS_PER_NODE", -1, 1);
    if (r.local_world_size < 0) {
      const char* t = env("SLURM_TASKS_PER_NODE");
      r.local_world_size = t != nullptr ? first_tasks_per_node(t) : -1;
      if (r.local_world_size < 0) r.local_world_size = 1;
    }
    if (const char* a = env("MASTER_ADDR")) {
      r.master_addr = a;
    } else if (const char* nodes = env("SLURM_JOB_NODELIST")) {
      r.master_addr = first_slurm_host(nodes);
    }
    r.master_port = int_env("MASTER_PORT", 29500, 1);
  }
  if (r.rank >= r.world_size) {
    throw ConfigError(r.source == "slurm" ? "SLURM_PROCID" : "RANK",
                      "rank " + std::to_string(r.rank) + " is not below the world size " +
                          std::to_string(r.world_size));
  }
  if (r.local_rank >= r.local_world_size) {
    throw ConfigError(r.source == "slurm" ? "SLURM_LOCALID" : "LOCAL_RANK",
                      "local rank " + std::to_string(r.local_rank) + " is not below the local world size " +
                          std::to_string(r.local_world_size));
  }
  if (r.master_port > 65535) throw ConfigError("MASTER_PORT", "must be a TCP port (1..65535)");
  return r;
}

}  // namespace strata
