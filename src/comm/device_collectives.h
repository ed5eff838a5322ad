// Collectives on device memory (Note [Device collectives]): the gathers of
// parameter blocks and the reductions of gradients between the ranks, in
// whichever way the device and the backend allow. No LibTorch here.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "comm/communicator.h"
#include "memory/device.h"
#include "memory/placement.h"  // kStagedPieceBytes: the plan sizes the staging buffers from it

namespace strata {

// Note [Device collectives]
// The step's collectives read and write device memory; how they reach it
// depends on the device and the data group (Note [Data group] in
// comm/communicator.h):
// - in place: a device host code may touch (the CPU device). The host group
//   reads and writes device memory directly; its completions are host waits.
// - staged: a device host code may not touch, with the Gloo data group
//   (comm.backend "gloo": several processes sharing one GPU, clusters without
//   NCCL). A worker thread takes each collective in issue order: it waits for
//   the compute queued before the collective was issued (the input's
//   writer), copies the input D2H into registered host buffers on the comm
//   stream, runs the Gloo collective there, and copies the result H2D, in
//   pieces of kStagedPieceBytes per rank so that the host buffers stay
//   small (2 x world size x kStagedPieceBytes, StagingNeeds::comm_host). Its
//   completions are host waits for the worker.
// - stream: a StreamCollectives, NCCL's model: the comm stream is ordered
//   after the compute queued so far, the collective is queued on it, and the
//   completion is an event recorded there after it. Whoever reads the result
//   orders its stream after that event (Device::stream_wait: no host wait on
//   a GPU). Tests put the test device's comm stream behind the same seam
//   (tests/deferred_collectives.h), so this ordering is exercised in CI.
// In every mode the caller keeps the buffers untouched until the completion
// fired (for a stream completion: until its stream waited for it), and
// issues collectives from one thread, in the same order on every rank.

// What NCCL is to a stream: collectives queued on the device's
// communication stream (Stream::kComm), in order with the other work queued
// there, done when the stream gets past them. Nothing here blocks the host.
class StreamCollectives {
 public:
  virtual ~StreamCollectives() = default;
  virtual void all_gather(DevicePtr in, DevicePtr out, int64_t count, DType t) = 0;
  virtual void reduce_scatter(DevicePtr in, DevicePtr out, int64_t count, DType t) = 0;
  virtual void all_reduce(DevicePtr buf, int64_t count, DType t) = 0;  // sum
};

// A data group whose completions order its stream (NCCL, opened on the
// device's comm stream) as a StreamCollectives: each collective issued, and
// its completion's wait() (which orders that stream) called at once.
std::unique_ptr<StreamCollectives> stream_collectives_over(CollectiveGroup& group);

enum class DeviceCommMode { kInPlace, kStaged, kStream };
const char* device_comm_mode_name(DeviceCommMode m);

// The registered host memory the staged mode holds at `world_size`: an
// input and an output buffer of kStagedPieceBytes (memory/placement.h) per
// rank (StagingNeeds::comm_host).
inline int64_t staged_host_bytes(int world_size) { return 2 * int64_t(world_size) * kStagedPieceBytes; }

// Thread-safety: the collectives are issued from one thread (the step's);
// completions may be waited for from any thread.
class DeviceCollectives final : public Waiter {
 public:
  // In place over `comm` (device->host_addressable()).
  DeviceCollectives(Device& device, Communicator& comm);
  // Staged through host buffers over the Gloo data group `data`.
  DeviceCollectives(Device& device, Communicator& comm, CollectiveGroup& data);
  // On the comm stream through `stream`.
  DeviceCollectives(Device& device, Communicator& comm, StreamCollectives& stream);
  ~DeviceCollectives() override;
  DeviceCollectives(const DeviceCollectives&) = delete;
  DeviceCollectives& operator=(const DeviceCollectives&) = delete;

  DeviceCommMode mode() const { return mode_; }

  // Before the buffers the collectives use are freed (the trainer's
  // destructor, perhaps after a failed step): staged collectives not yet
  // started are dropped, never run (their peers may never match them), the
  // one running ends, and the worker stops. Stream collectives end with their
  // stream (the caller synchronizes it).
  void shutdown();
  // Registered host memory this holds (the staged mode's buffers).
  int64_t host_bytes() const { return stage_in_.bytes() + stage_out_.bytes(); }

  // The node's group for the secondary shard's gathers (comm.secondary_shard),
  // in this object's mode: in place and staged, `group` (a Gloo group of the
  // node's `size` ranks); on the stream, `stream` over it. Once, before the
  // first node_all_gather; the staged mode's buffers (sized by the world)
  // serve it too, and its collectives take their turn in the one worker's
  // issue order.
  void attach_node_group(CollectiveGroup* group, StreamCollectives* stream, int size);
  // all_gather over the node's group.
  Completion node_all_gather(DevicePtr in, DevicePtr out, int64_t count, DType t);

  // As CollectiveGroup's, on device memory. The input was written by work
  // queued on the compute stream before the call (or is already complete);
  // a reader of the output orders its stream after the completion
  // (Device::stream_wait) or waits for it.
  Completion all_gather(DevicePtr in, DevicePtr out, int64_t count, DType t);
  Completion reduce_scatter(DevicePtr in, DevicePtr out, int64_t count, DType t);
  Completion all_reduce(DevicePtr buf, int64_t count, DType t);  // sum

  // Network bytes of the data group's collectives (the host group's are
  // Communicator::bytes_sent()), and the bytes the staged mode copied
  // device -> host and host -> device.
  int64_t bytes_sent() const;
  // Bytes sent over the node's group.
  int64_t node_bytes_sent() const { return node_sent_; }
  // Seconds callers spent blocked waiting for staged collectives.
  double wait_seconds() const;

  void wait_ticket(uint64_t ticket) override;

 private:
  enum class Op : uint8_t { kAllGather, kReduceScatter, kAllReduce };
  struct Job {
    Op op = Op::kAllGather;
    CollectiveGroup* group = nullptr;  // the data group or the node's
    int size = 1;                      // its ranks
    DevicePtr in, out;
    int64_t count = 0;
    DType t = DType::kF32;
    Completion produced;  // the compute queued before the issue
  };
  static constexpr uint64_t kJobs = 64;  // staged collectives in flight, at most

  Completion issue(Op op, DevicePtr in, DevicePtr out, int64_t count, DType t, bool node = false);
  void worker_loop();
  void run_staged(const Job& job);

  Device& device_;
  Communicator& comm_;
  DeviceCommMode mode_;
  CollectiveGroup* data_ = nullptr;
  StreamCollectives* stream_ = nullptr;
  int world_size_ = 1;
  int64_t sent_ = 0;  // the issuing thread's
  CollectiveGroup* node_ = nullptr;         // attach_node_group's
  StreamCollectives* node_stream_ = nullptr;
  int node_size_ = 1;
  int64_t node_sent_ = 0;  // the issuing thread's

  // Staged mode.
  PinnedHostBuffer stage_in_, stage_out_;
  std::thread worker_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::array<Job, kJobs> jobs_;  // ring: job t at t % kJobs
  uint64_t issued_ = 0;          // guarded by mu_, as are the next four
  uint64_t done_ = 0;
  bool quit_ = false;
  bool dropping_ = false;        // shutdown(): jobs not yet started are dropped
  std::exception_ptr error_;
  double wait_s_ = 0.0;
};

}  // namespace strata
