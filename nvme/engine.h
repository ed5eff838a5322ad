// The asynchronous I/O engine: reads and writes of byte ranges of files,
// split into blocks and spread over one or more queues (io_uring rings, or a
// thread pool where io_uring is unavailable), each driven by its own worker
// thread. Callers get an IoHandle to poll or wait on.
//
// Note [I/O loop]
// Each worker owns one backend queue. It takes the ranges submitted to it
// in order, cuts them into block_size pieces, fills its queue to
// queue_depth and submits the whole batch with one system call (adjacent
// pieces of one batch reach the device merged), then waits for a batch of
// completions (Note [Batching]), reaps every completion available, and
// refills. A short transfer is advanced and requeued; EAGAIN and EINTR are
// requeued (a few hundred times at most); any other error fails the
// request, whose other pieces are then not started. A range is finished
// only when none of its pieces is in flight, so a failed request never has
// I/O still running into its buffer once its handle reports completion. At
// shutdown every queued request is still executed and everything in flight
// is drained.
//
// Note [Batching]
// The block layer merges adjacent requests that arrive in one submission (a
// plug) up to the device's largest request (max_sectors_kb, typically 4 MiB),
// and large requests are what a drive, and even more a virtual disk, serves
// fastest. DeepSpeed gets 4 MiB requests by submitting queue_depth blocks at
// once and waiting for all of them (overlap_events = false), at the cost of
// an empty queue at the end of every batch. Refilling after every completion
// keeps the queue full but submits blocks one or two at a time, which the
// device then sees as 1 MiB requests. The engine does both: it waits until
// submit_batch_bytes of the queue (at most half of it) has completed, then
// submits that many adjacent blocks with one system call, so the device sees
// merged requests while the rest of the queue stays busy.
//
// Note [Buffer reuse]
// The engine neither copies nor owns buffers: a buffer passed to submit()
// belongs to the kernel until the returned handle is done (wait() returned
// or threw, or done() returned true). Only then may it be reused or freed.
// IoHandle's destructor waits, so dropping a handle never frees a buffer
// under a running I/O.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "nvme/backend.h"
#include "nvme/fault_backend.h"
#include "nvme/file.h"

namespace strata::nvme {

// Options of an engine. The `aio` section of a Strata config maps onto the
// first five fields (intra_op_parallelism / thread_count -> rings).
struct EngineOptions {
  // Bytes per operation: requests are cut into pieces of this size. Larger
  // blocks mean fewer system calls; 1 MiB is enough to reach full bandwidth
  // on NVMe drives. REQUIRES: a multiple of 4096 in [4 KiB, 1 GiB].
  int64_t block_size_bytes = int64_t(1) << 20;
  // Operations in flight per ring. Deeper queues hide latency; beyond about
  // 32 blocks of 1 MiB a single NVMe drive gains nothing.
  int queue_depth = 32;
  // Rings, each with its own worker thread. More than one helps only when
  // one thread cannot keep the devices busy (several drives, small blocks).
  int rings = 1;
  // Submit each operation with its own system call instead of a batch per
  // refill. Costs system calls and merging; kept for DeepSpeed parity.
  bool single_submit = false;
  // Refill the queue as completions arrive (true), or only once the whole
  // batch in flight has completed (false).
  bool overlap_events = true;
  // With overlap_events: refill only once this many bytes of the queue have
  // completed (at most half the queue), so that each submission carries
  // adjacent blocks the kernel can merge into one device request. 4 MiB is
  // the largest request most NVMe drives and virtio disks take
  // (max_sectors_kb). 0: refill after every completion. See Note [Batching].
  int64_t submit_batch_bytes = int64_t(4) << 20;
  // io_uring (with the thread pool as the fallback), or force one of them.
  BackendKind backend = BackendKind::kAuto;
  // Register files with each ring (IOSQE_FIXED_FILE): saves a file lookup
  // per operation. At most max_files files may be attached at once.
  bool register_files = true;
  int max_files = 64;
  // Buffers registered with each ring from the start (Note [Registered
  // buffers]); typically the region of a BufferPool. Must outlive the
  // engine. More can be registered later (IoEngine::register_buffer).
  std::vector<std::pair<void*, int64_t>> fixed_buffers;
  // Tests: inject faults below the engine (fault_backend.h).
  std::shared_ptr<FaultPlan> faults;
};

// Throws strata::ConfigError naming the field when an option is out of range.
void validate(const EngineOptions& options);

// A file attached to an engine (IoEngine::attach). A plain index; valid until
// detached.
struct FileId {
  int slot = -1;
  bool valid() const { return slot >= 0; }
};

struct IoRequest {
  IoOp op = IoOp::kRead;
  FileId file;
  int64_t offset_bytes = 0;
  int64_t bytes = 0;
  // Read: destination; write: source. See Note [Buffer reuse].
  void* buffer = nullptr;
};

// Counters since the engine started. Thread-safety: a snapshot of atomics.
struct EngineStats {
  int64_t read_ops = 0;
  int64_t write_ops = 0;
  int64_t read_bytes = 0;
  int64_t write_bytes = 0;
  int64_t submits = 0;           // submit system calls (batches)
  int64_t short_transfers = 0;   // advanced and requeued
  int64_t retries = 0;           // EAGAIN/EINTR requeued
  int64_t fixed_buffer_ops = 0;  // of read_ops + write_ops: those whose buffer was registered
};

namespace detail {
struct RequestState;
struct Counters;
class Worker;
}  // namespace detail

class IoEngine;

// Note [Registered buffers]
// An operation whose buffer lies inside a buffer registered with its ring
// (io_uring's fixed buffers) skips pinning and unpinning its pages on every
// operation; `strata bench-io` measures with registered buffers, so the
// buffers training reads into and writes from are registered too. Each ring
// holds a table of kBufferTableSlots entries (at most 1 GiB each), created
// empty with the ring; entries are set and cleared on the ring's own worker
// thread (a ring of one issuer is registered by that issuer). Registration
// the system refuses (RLIMIT_MEMLOCK for an unprivileged user) is logged at
// debug level and the buffer is used unregistered; EngineStats counts the
// operations that were registered. Kernels before 5.19 have no such table:
// there the options' fixed_buffers are registered once and later
// registrations return false.
inline constexpr int kBufferTableSlots = 256;

// A buffer registered with an engine's rings for as long as this lives
// (IoEngine::register_buffer). Move-only; the empty value registers nothing.
class BufferRegistration {
 public:
  BufferRegistration() = default;
  ~BufferRegistration() { reset(); }
  BufferRegistration(BufferRegistration&& other) noexcept { *this = std::move(other); }
  BufferRegistration& operator=(BufferRegistration&& other) noexcept;
  BufferRegistration(const BufferRegistration&) = delete;
  BufferRegistration& operator=(const BufferRegistration&) = delete;

  // True when every ring registered the whole buffer.
  bool registered() const { return registered_; }
  // Unregisters. REQUIRES: no I/O into the buffer in flight.
  void reset();

 private:
  friend class IoEngine;
  IoEngine* engine_ = nullptr;
  std::vector<int> slots_;
  bool registered_ = false;
};

// Completion of one submit() call (one or more requests). Move-only.
// Thread-safety: one handle may be used by one thread at a time; handles of
// the same engine may be used by different threads concurrently.
class IoHandle {
 public:
  IoHandle() = default;
  ~IoHandle();  // waits (without throwing) if not done: Note [Buffer reuse]
  IoHandle(IoHandle&&) noexcept = default;
  IoHandle& operator=(IoHandle&& other) noexcept;
  IoHandle(const IoHandle&) = delete;
  IoHandle& operator=(const IoHandle&) = delete;

  // True when every piece has completed or failed (never blocks).
  bool done() const;
  // Blocks until done; throws strata::IoError (path, offset, bytes, errno) of
  // the first piece that failed. Throws again if called again.
  void wait();
  // Like wait() but returns false instead of throwing.
  bool wait_ok();
  bool valid() const { return state_ != nullptr; }

 private:
  friend class IoEngine;
  explicit IoHandle(std::shared_ptr<detail::RequestState> state) : state_(std::move(state)) {}
  void block() const;
  std::shared_ptr<detail::RequestState> state_;
};

// Thread-safety: every method may be called from any thread concurrently,
// except that a file must not be detached while I/O on it is in flight.
class IoEngine {
 public:
  // Starts the workers and their backends. Throws ConfigError for bad
  // options, IoError where a forced backend cannot be created. With
  // BackendKind::kAuto, a missing or forbidden io_uring (ENOSYS, EPERM,
  // EACCES) falls back to the thread pool with one warning.
  explicit IoEngine(EngineOptions options);
  // Executes everything queued and drains everything in flight, then stops.
  ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // Takes ownership of `file` and registers it with every ring. Throws
  // IoError (EMFILE) when max_files files are attached.
  FileId attach(File file);
  // Unregisters and returns the file. REQUIRES: no I/O on it in flight.
  File detach(FileId id);
  const File& file(FileId id) const;

  // Queues requests; the handle completes when all of them have. For a
  // direct file, offset, bytes and buffer must be multiples of
  // kDirectAlignmentBytes (STRATA_CHECK). Zero-byte requests complete at once.
  IoHandle submit(std::span<const IoRequest> requests);
  IoHandle submit(const IoRequest& request) { return submit(std::span(&request, 1)); }
  // Synchronous helpers: submit and wait.
  void read(FileId file, int64_t offset_bytes, int64_t bytes, void* buffer);
  void write(FileId file, int64_t offset_bytes, int64_t bytes, const void* buffer);

  // Registers [p, p + bytes) with every ring (Note [Registered buffers]) until
  // the returned value is reset or destroyed, which must happen before the
  // engine's end and before the buffer is freed, with no I/O into it in
  // flight. Registration the system refuses is not an error: the buffer is
  // then used unregistered (registered() false).
  BufferRegistration register_buffer(void* p, int64_t bytes);

  const EngineOptions& options() const { return options_; }
  // The backend the workers use ("io_uring" or "threads").
  const char* backend_name() const { return backend_name_; }
  EngineStats stats() const;

 private:
  friend class detail::Worker;
  friend class BufferRegistration;
  struct FileEntry;
  // Sets table entries on every ring (p null: clears them); returns how many
  // ring entries refused.
  int set_buffers(std::span<const int> slots, std::span<const std::pair<void*, int64_t>> pieces);
  void unregister(std::span<const int> slots);

  EngineOptions options_;
  const char* backend_name_ = "?";
  std::mutex buffers_mu_;
  std::vector<bool> slot_used_;  // kBufferTableSlots entries; guarded by buffers_mu_
  std::vector<std::pair<void*, int64_t>> initial_buffers_;  // fixed_buffers cut to <= 1 GiB: slots 0..
  std::atomic<bool> told_refused_{false};                   // a refused registration was logged
  mutable std::mutex files_mu_;
  std::vector<std::unique_ptr<FileEntry>> files_;  // by slot; guarded by files_mu_
  std::unique_ptr<detail::Counters> counters_;
  std::vector<std::unique_ptr<detail::Worker>> workers_;
  std::atomic<uint32_t> next_worker_{0};
};

}  // namespace strata::nvme
