// The edge of the world for the I/O engine: a Backend executes single reads
// and writes asynchronously. The engine (engine.h) does everything above it
// (splitting, queueing, short-transfer and EAGAIN handling, errors), so a
// fake backend that injects faults (fault_backend.h) tests all of that.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace strata::nvme {

enum class IoOp : uint8_t { kRead, kWrite };
inline const char* io_op_name(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

// Which implementation executes I/O.
enum class BackendKind {
  kAuto,        // io_uring; the thread pool with one warning where io_uring is unavailable
  kIoUring,     // io_uring or an error
  kThreadPool,  // pread/pwrite on worker threads
};
const char* backend_kind_name(BackendKind kind);
// Parses "auto" | "io_uring" | "threads"; returns false on anything else.
bool parse_backend_kind(const std::string& name, BackendKind* kind);

// One operation as the backend sees it. `file_slot` and `buffer_index` are
// the engine's registration indices (-1: not registered); a backend that
// does not register uses `fd` and `buffer`.
struct BackendOp {
  IoOp op = IoOp::kRead;
  int fd = -1;
  int file_slot = -1;
  int buffer_index = -1;
  void* buffer = nullptr;
  int64_t offset_bytes = 0;
  int64_t bytes = 0;
  uint64_t tag = 0;  // returned in the completion
};

struct Completion {
  uint64_t tag = 0;
  int64_t result = 0;  // bytes transferred (may be short), or -errno
};

// One queue of asynchronous operations. Not thread-safe: each engine worker
// owns one backend and is the only thread that calls it.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  // Queues `op` for the next submit. REQUIRES: fewer than `queue_depth`
  // operations prepared or in flight.
  virtual void prepare(const BackendOp& op) = 0;
  // Submits everything prepared, then waits until at least `min_complete`
  // completions are available (0: do not wait) and moves up to out.size()
  // of them into `out`. Returns how many. Retries EINTR itself; throws
  // strata::IoError for a failure of the queue itself (not of an operation).
  virtual int submit_and_reap(int min_complete, std::span<Completion> out) = 0;

  // Registration (optional; return false where unsupported or refused).
  // register_file: slot -> fd (fd -1 clears the slot). Called by the owning
  // worker between operations; no operation on the slot is in flight.
  virtual bool register_file(int slot, int fd) { return false; }
  // Registered buffers, in one of two ways. Preferred: a table of `slots`
  // empty entries created once, right after construction, whose entries are
  // then set and cleared one at a time (set_buffer, by the owning worker, no
  // operation on the entry in flight; p null clears it). Where the table
  // cannot be created (kernels before 5.19), register_buffers registers a
  // fixed list once instead. Each returns false where unsupported or refused
  // (RLIMIT_MEMLOCK); the buffers are then used unregistered.
  virtual bool create_buffer_table(int slots) { return false; }
  virtual bool set_buffer(int slot, void* p, int64_t bytes) { return false; }
  virtual bool register_buffers(std::span<const std::pair<void*, int64_t>> regions) {
    return false;
  }
};

// Creates a backend of `kind` (kAuto resolved by the caller) for `queue_depth`
// operations in flight with room for `max_files` registered files. Throws
// strata::IoError with the errno where the kind cannot be created (ENOSYS or
// EPERM for io_uring that is missing or forbidden).
std::unique_ptr<Backend> make_uring_backend(int queue_depth, int max_files);
std::unique_ptr<Backend> make_thread_backend(int queue_depth);

}  // namespace strata::nvme
