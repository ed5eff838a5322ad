// The I/O engine's worker (nvme/ only; engine.h is the interface): one
// ring (io_uring, or the thread pool's) driven by a thread of its own, and
// the request and range records it executes (Note [I/O loop] in engine.h).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <future>
#include <latch>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "nvme/backend.h"
#include "nvme/engine.h"

namespace strata::nvme::detail {

struct RequestState {
  std::atomic<int64_t> parts_left{0};
  std::atomic<uint32_t> done{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  // The first failure; guarded by mu, read after done.
  int err = 0;
  std::string path;
  std::string what;
  int64_t offset_bytes = -1;
  int64_t bytes = -1;

  void fail(int e, const std::string& p, std::string w, int64_t off, int64_t n) {
    std::lock_guard<std::mutex> lock(mu);
    if (failed.load(std::memory_order_relaxed)) return;
    err = e;
    path = p;
    what = std::move(w);
    offset_bytes = off;
    bytes = n;
    failed.store(true, std::memory_order_release);
  }
  void finish_part() {
    if (parts_left.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      done.store(1, std::memory_order_release);
      done.notify_all();
    }
  }
};

struct Counters {
  std::atomic<int64_t> read_ops{0}, write_ops{0}, read_bytes{0}, write_bytes{0}, submits{0},
      short_transfers{0}, retries{0}, fixed_buffer_ops{0};
};

// The part of one request that one worker executes: a contiguous range.
struct Range {
  std::shared_ptr<RequestState> req;
  const std::string* path = nullptr;  // the attached file's; stable while attached
  int fd = -1;
  int file_slot = -1;
  bool direct = false;
  IoOp op = IoOp::kRead;
  std::byte* buffer = nullptr;
  int64_t offset_bytes = 0;
  int64_t bytes = 0;
  int64_t issued_bytes = 0;  // cut into pieces so far
  int inflight = 0;          // pieces in flight or waiting for a retry
  bool stopped = false;      // no more pieces after a failure
  bool finished = false;
};

// One operation in flight: a piece of a range (advanced after a short transfer).
struct Slot {
  Range* range = nullptr;
  std::byte* buffer = nullptr;
  int64_t offset_bytes = 0;
  int64_t bytes = 0;
  int retries = 0;
  bool fixed = false;  // its last preparation used a registered buffer
};

// Work for a worker's own thread between operations: a file slot to set
// (buffer false; fd -1 clears it) or a buffer table entry (buffer true; p
// null clears it). Refusals are counted in `refused`.
struct Control {
  int slot = -1;
  int fd = -1;
  std::latch* latch = nullptr;
  bool buffer = false;
  void* p = nullptr;
  int64_t bytes = 0;
  std::atomic<int>* refused = nullptr;
};

// Range nodes a worker makes at its start (Note [No allocation per request]
// in engine.cc).
constexpr int kSpareRanges = 64;

class Worker {
 public:
  Worker(IoEngine& engine, int index);
  ~Worker();

  const char* backend_name() const { return backend_name_; }

  // Queues `r` in a recycled node (Note [No allocation per request]).
  void enqueue(Range&& r);
  void control(const Control& c);

 private:
  void run(std::promise<const char*> started);
  std::unique_ptr<Backend> make_backend();
  void apply(const Control& c);

  // The table entry whose buffer holds [p, p + bytes), or -1.
  int buffer_index(const std::byte* p, int64_t bytes) const;

  // Note [I/O loop] in engine.h.
  void loop();
  bool idle() const { return submitted_ == 0 && retry_.empty() && issue_ == ranges_.end(); }

  Range* next_range();
  void fill();
  void prepare(int tag);
  void complete(const Completion& c);
  void fail(const Slot& s, int err, std::string what);
  void release(int tag);
  void stop(Range& r);
  void maybe_finish(Range& r);

  // Finished ranges from the front into done_, whose nodes go back to
  // spare_ at the next lock (references to the other ranges stay valid).
  void pop_finished();

  IoEngine& engine_;
  const int index_;
  std::thread thread_;
  const char* backend_name_ = "?";
  std::unique_ptr<Backend> backend_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::list<Range> incoming_;      // guarded by mu_
  std::list<Range> spare_;         // recycled nodes; guarded by mu_
  std::vector<Control> controls_;  // guarded by mu_
  bool stop_ = false;              // guarded by mu_

  // Owned by the worker thread.
  std::list<Range> ranges_;  // in submission order; finished ones moved from the front to done_
  std::list<Range> done_;    // finished, for spare_
  std::list<Range>::iterator issue_ = ranges_.end();  // the first range with pieces to issue
  std::vector<Slot> slots_;   // queue_depth entries; the tag of an operation is its index
  std::vector<int> free_slots_;
  std::vector<int> retry_;  // slots to prepare again (short transfer, EAGAIN)
  std::vector<int> retry_scratch_;
  int submitted_ = 0;       // prepared or submitted, completion not yet reaped
  int batch_ = 1;           // completions to wait for before refilling
  std::vector<Completion> completions_;
  // Note [Registered buffers]: this ring's table, by entry.
  bool buffer_table_ = false;
  std::vector<std::pair<std::byte*, int64_t>> fixed_;
  size_t fixed_end_ = 0;  // entries at and after this one have never been set
};

}  // namespace strata::nvme::detail
