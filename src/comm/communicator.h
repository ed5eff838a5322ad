// The Communicator: collectives over flat buffers between the ranks of a run,
// each returning a Completion that the engine waits on only when it needs the
// result. Backends: local (world size 1, no sockets), Gloo (CPU ranks) and
// NCCL (GPU ranks), the last two through LibTorch's c10d. The rendezvous, the
// per-rank heartbeats and the small values ranks exchange at start go through
// c10d's TCPStore. This header is free of LibTorch; see Note [Lost ranks].
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "memory/completion.h"

namespace strata {

// Who this process is, read from the launcher's environment.
struct RankInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  bool agent_store = false;  // torchrun's agent serves the store: every rank is a client
  std::string source = "none";  // "env" (RANK/WORLD_SIZE...), "slurm", or "none" (one rank)
};

// RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
// when those are absent SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
// SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE and the first host of
// SLURM_JOB_NODELIST (MASTER_PORT, else 29500); when neither, one rank.
// TORCHELASTIC_USE_AGENT_STORE=True makes every rank a client of the store.
// Throws ConfigError naming the variable that is malformed or inconsistent.
RankInfo rank_info_from_environment();

// The first host of a Slurm node list: "node[003-005,7],gpu1" -> "node003".
std::string first_slurm_host(const std::string& nodelist);

enum class DType { kF32, kF64, kBF16, kF16, kI64 };
int dtype_bytes(DType t);
enum class ReduceOp { kSum, kMax };

struct CommOptions {
  // The host group is always Gloo; this names the data group's backend
  // (Note [Data group]): gloo | nccl (world size 1 always uses the local
  // communicator).
  std::string backend = "gloo";
  double timeout_s = 300.0;      // every collective and store wait; a lost rank is named within it
  double heartbeat_s = 1.0;      // interval of each rank's heartbeat through the store
  int threads = 1;               // Gloo's worker threads
  std::string socket_ifname;     // GLOO_SOCKET_IFNAME: the interface Gloo binds to
  // Build the backend's process group even at world size 1 (tests of a
  // backend on one GPU); otherwise world size 1 is the local communicator.
  bool process_group_at_one = false;
};

// Collectives over the ranks of one process group, on flat buffers. Each is
// issued from one thread at a time and in the same order on every rank (a
// group's collectives are matched by their order).
class CollectiveGroup : public Waiter {
 public:
  ~CollectiveGroup() override = default;
  virtual const char* backend() const = 0;

  // out[r * count .. (r + 1) * count) = rank r's in[0 .. count). `in` may not
  // overlap `out`. Buffers stay untouched until the completion fired.
  virtual Completion all_gather(const void* in, void* out, int64_t count, DType t) = 0;
  // out[0 .. count) = sum over ranks of their in[rank * count .. (rank + 1) * count).
  virtual Completion reduce_scatter(const void* in, void* out, int64_t count, DType t) = 0;
  virtual Completion all_reduce(void* buf, int64_t count, DType t, ReduceOp op) = 0;

  // Note [Data group]: true for NCCL, whose work runs on a device stream and
  // whose completions' wait() makes that stream wait for the work without
  // blocking the host. False where wait() blocks the host until the work is
  // done (Gloo, local).
  virtual bool orders_streams() const { return false; }

  // Bytes this rank has sent over the network since construction (ring
  // algorithms: (n-1)/n of the buffer per pass), and seconds callers spent
  // blocked in wait() on collectives.
  virtual int64_t bytes_sent() const = 0;
  virtual double wait_seconds() const = 0;
};

// Note [Data group]
// Host values (losses, the squared norm, failed-rank and stop votes, config
// checks, checkpoint handshakes) always go over the communicator's own group,
// Gloo on host memory. Collectives on device memory go over a second group of
// the same ranks, the data group, opened once the device exists: NCCL on
// GPUs (comm.backend "nccl"), whose work is queued on the device's
// communication stream, or a second Gloo group (comm.backend "gloo") that
// engine/ feeds through registered host buffers (comm/device_collectives.h).
// Two groups, because a group's collectives are matched by their order: the
// data group is driven by the thread that moves device data, the host group
// by the step's thread, and neither can delay or reorder the other's. NCCL
// cannot carry host values anyway, and c10d's NCCL Work::wait() only orders
// the current stream: a host wait on it would return before the work is done.
struct DataGroupOptions {
  std::string backend = "gloo";  // gloo | nccl
  void* stream = nullptr;        // nccl: the cudaStream_t its work is queued on
  int device_index = -1;         // nccl: the CUDA device of that stream and of the buffers
};

// Note [Lost ranks]
// A ring collective cannot tell which peer failed: a peer that exits makes
// the others' pending Gloo work throw at once (connection reset), a peer that
// hangs is seen only by the collective's timeout. So every rank keeps a
// heartbeat in the store (a counter it bumps every heartbeat_s from its own
// thread and its own store connection), and a rank whose collective failed
// asks lost_rank() which peer stopped beating: the first whose counter has
// not moved for three intervals, or, when nothing is seen within the
// timeout, "unknown". A rank that exits on purpose first writes why
// ("exit/<r>"), so the others do not blame it, and report the rank it blamed.
// When the store itself is gone (it lives in rank 0, or in torchrun's agent)
// the answer is "rank 0 (store host)" unless a peer already named the lost
// rank; so a failed rank 0 that serves the store stays a few heartbeats,
// until every rank still beating has said why it leaves. Destroying a c10d process group after
// a failed collective can block joining its threads, so a failed
// communicator is leaked, never destroyed.
class Communicator : public CollectiveGroup {
 public:
  ~Communicator() override = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // The collectives of CollectiveGroup are the host group's (Gloo, or local).
  virtual Completion broadcast(void* buf, int64_t count, DType t, int root) = 0;
  virtual void barrier() = 0;

  // Small values through the store (start-up, not the hot path). get waits up
  // to the timeout for the key to appear and throws CommError when it does not.
  virtual void store_set(const std::string& key, const std::string& value) = 0;
  virtual std::string store_get(const std::string& key) = 0;

  // Note [Lost ranks]: who is lost, waiting up to `max_wait_s` for a stale
  // heartbeat; "" when every peer still beats.
  virtual std::string lost_rank(double max_wait_s) = 0;
  // Records that this rank is leaving on purpose (`why`), before it exits.
  virtual void mark_exit(const std::string& why) = 0;

  // Note [Data group]: opens the group for collectives on device memory.
  // Every rank calls it once, at the same point of the start-up; the
  // communicator owns the group. Throws CommError when the backend cannot be
  // built (no NCCL in this build). The local communicator is its own data
  // group (copies).
  virtual CollectiveGroup* open_data_group(const DataGroupOptions& options) = 0;
  // The data group's counterpart over the ranks of this rank's node: ranks
  // k x L .. k x L + L - 1 of node k = rank / L, where L is the launcher's
  // LOCAL_WORLD_SIZE, as local ranks 0 .. L - 1. It carries the secondary
  // shard's gathers (comm.secondary_shard). Every rank calls it once, at the
  // same point of the start-up; the communicator owns the group. Throws
  // CommError when the ranks are not numbered node by node (RANK = node x
  // LOCAL_WORLD_SIZE + LOCAL_RANK, as torchrun, strata launch and Slurm's
  // block distribution number them). The local communicator is its own.
  virtual CollectiveGroup* open_node_group(const DataGroupOptions& options) = 0;
};

// World size 1: copies and no-ops, no sockets.
std::unique_ptr<Communicator> make_local_communicator();

// Collective: every rank says whether its part of some work failed. Returns
// -1 when no rank failed, else the highest rank that did, so that all ranks
// stop together rather than one going on to a collective the other never
// reaches.
inline int64_t failed_rank(Communicator& comm, bool failed) {
  int64_t v = failed ? int64_t(comm.rank()) : -1;
  if (comm.world_size() > 1) comm.all_reduce(&v, 1, DType::kI64, ReduceOp::kMax).wait();
  return v;
}
// Connects to the store (serving it from rank 0 unless torchrun's agent does)
// and builds the backend's process group. Throws CommError on failure (the
// message names the address, e.g. MASTER_PORT already in use).
std::unique_ptr<Communicator> make_communicator(const RankInfo& who, const CommOptions& options);

// Bytes a ring all_gather/reduce_scatter of `count` per rank sends from one
// rank, and a ring all_reduce of `count` (what bytes_sent() adds up and
// `strata plan --world-size` predicts).
int64_t ring_gather_bytes(int world_size, int64_t count, DType t);
int64_t ring_all_reduce_bytes(int world_size, int64_t count, DType t);

}  // namespace strata
