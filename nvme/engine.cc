#include "nvme/engine.h"

#include <errno.h>
#include <time.h>

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <future>
#include <latch>
#include <list>
#include <new>
#include <string_view>
#include <utility>

#include "nvme/io_error.h"
#include "util/errors.h"
#include "util/logging.h"

namespace strata::nvme {

namespace {
constexpr int kMaxRetries = 256;                           // EAGAIN/EINTR requeues of one operation
constexpr int64_t kMaxRegisteredBytes = int64_t(1) << 30;  // per registered buffer (kernel limit)
bool g_warned_uring = false;

// [p, p + bytes) as registrable pieces of at most kMaxRegisteredBytes.
void append_pieces(void* p, int64_t bytes, std::vector<std::pair<void*, int64_t>>& out) {
  for (int64_t off = 0; off < bytes; off += kMaxRegisteredBytes) {
    out.emplace_back(static_cast<std::byte*>(p) + off, std::min(kMaxRegisteredBytes, bytes - off));
  }
}
}  // namespace

void validate(const EngineOptions& o) {
  if (o.block_size_bytes < kDirectAlignmentBytes || o.block_size_bytes > (int64_t(1) << 30) ||
      o.block_size_bytes % kDirectAlignmentBytes != 0) {
    throw ConfigError("aio.block_size",
                      strprintf("must be a multiple of 4096 between 4 KiB and 1 GiB, got %lld",
                                (long long)o.block_size_bytes));
  }
  if (o.queue_depth < 1 || o.queue_depth > 4096) {
    throw ConfigError("aio.queue_depth", strprintf("must be in [1, 4096], got %d", o.queue_depth));
  }
  if (o.rings < 1 || o.rings > 64) {
    throw ConfigError("aio.intra_op_parallelism", strprintf("must be in [1, 64], got %d", o.rings));
  }
  if (o.submit_batch_bytes < 0) {
    throw ConfigError("aio.submit_batch_bytes", "must not be negative");
  }
  if (o.max_files < 0 || o.max_files > 65536) {
    throw ConfigError("aio.max_files", strprintf("must be in [0, 65536], got %d", o.max_files));
  }
}

struct IoEngine::FileEntry {
  File file;
  bool attached = false;
};

namespace detail {

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

// Note [No allocation per request]
// A step submits hundreds of requests; none of them allocates. A request's
// state (and its shared_ptr control block) comes from a free list of equal
// blocks, filled with kPooledStates at the first engine's start and grown
// only past that many states alive at once; a worker's ranges are list
// nodes it recycles (kSpareRanges made at its start; a finished range's node
// goes back to the worker's spare list before it next waits); the swap
// store collects a call's requests in a vector per thread that keeps its
// capacity. nvme_test's NoAllocationOnceWarm counts.
constexpr int kPooledStates = 256;
constexpr int kSpareRanges = 64;

class StatePool {
 public:
  void* get(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (bytes == block_ && head_ != nullptr) {
        Free* p = head_;
        head_ = p->next;
        --count_;
        return p;
      }
    }
    return ::operator new(bytes);
  }
  size_t free_blocks() {
    std::lock_guard<std::mutex> lock(mu_);
    return count_;
  }
  // Never allocates (a shared_ptr's release, noexcept, calls it): the free
  // list is threaded through the blocks themselves.
  void put(void* p, size_t bytes) noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    if (block_ == 0 && bytes >= sizeof(Free)) block_ = bytes;
    if (bytes != block_) {
      ::operator delete(p);
      return;
    }
    head_ = new (p) Free{head_};
    ++count_;
  }

 private:
  struct Free {
    Free* next;
  };
  std::mutex mu_;
  size_t block_ = 0;  // the one size it keeps (the control block with its state)
  Free* head_ = nullptr;
  size_t count_ = 0;
};

// Never destroyed: a handle may outlive every engine.
StatePool& state_pool() {
  static StatePool* pool = new StatePool;
  return *pool;
}

template <class T>
struct StateAllocator {
  using value_type = T;
  StateAllocator() = default;
  template <class U>
  StateAllocator(const StateAllocator<U>&) {}  // NOLINT: rebinding
  T* allocate(size_t n) { return static_cast<T*>(state_pool().get(n * sizeof(T))); }
  void deallocate(T* p, size_t n) { state_pool().put(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const StateAllocator<U>&) const { return true; }
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

class Worker {
 public:
  Worker(IoEngine& engine, int index) : engine_(engine), index_(index) {
    const EngineOptions& o = engine.options_;
    spare_.resize(size_t(kSpareRanges));  // Note [No allocation per request]
    slots_.resize(size_t(o.queue_depth));
    for (int i = o.queue_depth - 1; i >= 0; --i) free_slots_.push_back(i);
    completions_.resize(size_t(o.queue_depth));
    // Note [Batching]: blocks per refill.
    const int64_t blocks = (o.submit_batch_bytes + o.block_size_bytes - 1) / o.block_size_bytes;
    batch_ = int(std::clamp<int64_t>(blocks, 1, std::max(1, o.queue_depth / 2)));
    std::promise<const char*> started;
    auto ready = started.get_future();
    thread_ = std::thread([this, p = std::move(started)]() mutable { run(std::move(p)); });
    try {
      backend_name_ = ready.get();
    } catch (...) {
      thread_.join();
      throw;
    }
  }
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }

  const char* backend_name() const { return backend_name_; }

  // Queues `r` in a recycled node (Note [No allocation per request]).
  void enqueue(Range&& r) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (spare_.empty()) {
        incoming_.push_back(std::move(r));
      } else {
        incoming_.splice(incoming_.end(), spare_, spare_.begin());
        incoming_.back() = std::move(r);
      }
    }
    cv_.notify_one();
  }
  void control(const Control& c) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      controls_.push_back(c);
    }
    cv_.notify_one();
  }

 private:
  void run(std::promise<const char*> started) {
    try {
      backend_ = make_backend();
    } catch (...) {
      started.set_exception(std::current_exception());
      return;
    }
    started.set_value(backend_->name());
    try {
      loop();
    } catch (const std::exception& e) {
      // The queue itself failed (not one operation): nothing can be trusted
      // about the operations in flight, and their buffers may still be
      // written. Fail fast (DESIGN.md, Errors).
      log::error("I/O engine worker %d: %s", index_, e.what());
      std::abort();
    }
    backend_.reset();
  }

  std::unique_ptr<Backend> make_backend() {
    const EngineOptions& o = engine_.options_;
    std::unique_ptr<Backend> b;
    if (o.backend != BackendKind::kThreadPool) {
      try {
        b = make_uring_backend(o.queue_depth, o.register_files ? o.max_files : 0);
      } catch (const IoError& e) {
        const bool unavailable = e.err() == ENOSYS || e.err() == EPERM || e.err() == EACCES;
        if (o.backend != BackendKind::kAuto || !unavailable) throw;
        warn_once(g_warned_uring,
                  std::string(e.what()) + "; using the thread-pool I/O backend (pread/pwrite)");
      }
    }
    if (!b) b = make_thread_backend(o.queue_depth);
    if (o.faults) b = make_fault_backend(std::move(b), o.faults);
    // Note [Registered buffers].
    const auto& initial = engine_.initial_buffers_;
    fixed_.assign(size_t(kBufferTableSlots), {nullptr, 0});
    buffer_table_ = b->create_buffer_table(kBufferTableSlots);
    // Without a table: the initial list registered at once, or not at all.
    const bool all = !buffer_table_ && !initial.empty() && b->register_buffers(initial);
    for (size_t i = 0; i < initial.size(); ++i) {
      if (all || (buffer_table_ && b->set_buffer(int(i), initial[i].first, initial[i].second))) {
        fixed_[i] = {static_cast<std::byte*>(initial[i].first), initial[i].second};
      }
    }
    fixed_end_ = initial.size();
    return b;
  }

  void apply(const Control& c) {
    if (!c.buffer) {
      backend_->register_file(c.slot, c.fd);
      return;
    }
    auto& entry = fixed_[size_t(c.slot)];
    if (c.p == nullptr) {  // clear
      if (entry.first != nullptr) {
        // A ring that registered a buffer must let it go: refusing would
        // leave its pages pinned under a buffer about to be freed.
        STRATA_CHECK(backend_->set_buffer(c.slot, nullptr, 0), "io_uring refused to unregister a buffer");
      }
      entry = {nullptr, 0};
      return;
    }
    if (buffer_table_ && backend_->set_buffer(c.slot, c.p, c.bytes)) {
      entry = {static_cast<std::byte*>(c.p), c.bytes};
      fixed_end_ = std::max(fixed_end_, size_t(c.slot) + 1);
    } else {
      c.refused->fetch_add(1, std::memory_order_relaxed);
    }
  }

  // The table entry whose buffer holds [p, p + bytes), or -1.
  int buffer_index(const std::byte* p, int64_t bytes) const {
    for (size_t i = 0; i < fixed_end_; ++i) {
      const auto& [start, n] = fixed_[i];
      if (start != nullptr && p >= start && p + bytes <= start + n) return int(i);
    }
    return -1;
  }

  // Note [I/O loop] in engine.h.
  void loop() {
    const bool overlap = engine_.options_.overlap_events;
    std::vector<Control> controls;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        spare_.splice(spare_.end(), done_);  // before waiting: the next submit reuses them
        if (idle()) {
          cv_.wait(lock, [&] { return stop_ || !incoming_.empty() || !controls_.empty(); });
          if (stop_ && incoming_.empty() && controls_.empty()) return;
        }
        if (!incoming_.empty()) {
          const auto first_new = incoming_.begin();
          const bool at_end = issue_ == ranges_.end();
          ranges_.splice(ranges_.end(), incoming_);
          if (at_end) issue_ = first_new;
        }
        controls.swap(controls_);
      }
      for (const Control& c : controls) {
        apply(c);
        c.latch->count_down();
      }
      controls.clear();
      if (overlap || submitted_ == 0) fill();
      if (submitted_ == 0) {
        pop_finished();
        continue;
      }
      const int min_complete = overlap ? std::min(batch_, submitted_) : submitted_;
      const int n = backend_->submit_and_reap(min_complete, completions_);
      engine_.counters_->submits.fetch_add(1, std::memory_order_relaxed);
      submitted_ -= n;
      for (int i = 0; i < n; ++i) complete(completions_[size_t(i)]);
      pop_finished();
    }
  }

  bool idle() const { return submitted_ == 0 && retry_.empty() && issue_ == ranges_.end(); }

  Range* next_range() {
    while (issue_ != ranges_.end()) {
      Range& r = *issue_;
      if (!r.stopped && r.issued_bytes < r.bytes) {
        if (!r.req->failed.load(std::memory_order_relaxed)) return &r;
        stop(r);  // another part of the request failed: do not start more
      }
      ++issue_;
    }
    return nullptr;
  }

  void fill() {
    std::vector<int>& retry = retry_scratch_;  // keeps its capacity
    retry.clear();
    retry.swap(retry_);
    for (int tag : retry) {
      Slot& s = slots_[size_t(tag)];
      if (s.range->req->failed.load(std::memory_order_relaxed)) {
        stop(*s.range);
        release(tag);
      } else {
        prepare(tag);
      }
    }
    const int64_t block = engine_.options_.block_size_bytes;
    while (!free_slots_.empty()) {
      Range* r = next_range();
      if (r == nullptr) break;
      const int tag = free_slots_.back();
      free_slots_.pop_back();
      Slot& s = slots_[size_t(tag)];
      s.range = r;
      s.buffer = r->buffer + r->issued_bytes;
      s.offset_bytes = r->offset_bytes + r->issued_bytes;
      s.bytes = std::min(block, r->bytes - r->issued_bytes);
      s.retries = 0;
      r->issued_bytes += s.bytes;
      ++r->inflight;
      prepare(tag);
    }
  }

  void prepare(int tag) {
    const Slot& s = slots_[size_t(tag)];
    BackendOp op;
    op.op = s.range->op;
    op.fd = s.range->fd;
    op.file_slot = s.range->file_slot;
    op.buffer_index = buffer_index(s.buffer, s.bytes);
    op.buffer = s.buffer;
    op.offset_bytes = s.offset_bytes;
    op.bytes = s.bytes;
    op.tag = uint64_t(tag);
    backend_->prepare(op);
    ++submitted_;
    slots_[size_t(tag)].fixed = op.buffer_index >= 0;
    if (engine_.options_.single_submit) {
      backend_->submit_and_reap(0, {});
      engine_.counters_->submits.fetch_add(1, std::memory_order_relaxed);
    }
  }

  void complete(const Completion& c) {
    const int tag = int(c.tag);
    Slot& s = slots_[size_t(tag)];
    Range& r = *s.range;
    Counters& counters = *engine_.counters_;
    if (c.result < 0) {
      const int err = int(-c.result);
      if ((err == EAGAIN || err == EINTR) && s.retries < kMaxRetries) {
        ++s.retries;
        counters.retries.fetch_add(1, std::memory_order_relaxed);
        if (s.retries > 8) {  // persistent EAGAIN: let the device drain a little
          const timespec pause{0, 100000L * std::min(s.retries, 10)};
          nanosleep(&pause, nullptr);
        }
        retry_.push_back(tag);
        return;
      }
      std::string what = std::string(io_op_name(r.op)) + " failed";
      if (err == EAGAIN || err == EINTR) what += strprintf(" after %d retries", s.retries);
      fail(s, err, what);
      release(tag);
      return;
    }
    if (c.result > 0) {
      if (r.op == IoOp::kRead) {
        counters.read_bytes.fetch_add(c.result, std::memory_order_relaxed);
      } else {
        counters.write_bytes.fetch_add(c.result, std::memory_order_relaxed);
      }
    }
    if (c.result >= s.bytes) {
      (r.op == IoOp::kRead ? counters.read_ops : counters.write_ops)
          .fetch_add(1, std::memory_order_relaxed);
      if (s.fixed) counters.fixed_buffer_ops.fetch_add(1, std::memory_order_relaxed);
      release(tag);
      return;
    }
    // A short transfer. Zero bytes read is the end of the file: the range
    // asked for bytes that were never written. An unaligned short direct
    // transfer ends at the end of the file too (the rest cannot be issued).
    if (c.result == 0 || (r.direct && c.result % kDirectAlignmentBytes != 0)) {
      if (r.op == IoOp::kRead) {
        fail(s, 0,
             strprintf("read past the end of the file (got %lld of %lld bytes)",
                       (long long)c.result, (long long)s.bytes));
      } else {
        fail(s, EIO,
             strprintf("write stopped short (%lld of %lld bytes)", (long long)c.result,
                       (long long)s.bytes));
      }
      release(tag);
      return;
    }
    counters.short_transfers.fetch_add(1, std::memory_order_relaxed);
    s.buffer += c.result;
    s.offset_bytes += c.result;
    s.bytes -= c.result;
    s.retries = 0;
    retry_.push_back(tag);
  }

  void fail(const Slot& s, int err, std::string what) {
    s.range->req->fail(err, *s.range->path, std::move(what), s.offset_bytes, s.bytes);
    s.range->stopped = true;
  }

  void release(int tag) {
    Range& r = *slots_[size_t(tag)].range;
    slots_[size_t(tag)].range = nullptr;
    free_slots_.push_back(tag);
    --r.inflight;
    maybe_finish(r);
  }

  void stop(Range& r) {
    r.stopped = true;
    maybe_finish(r);
  }

  void maybe_finish(Range& r) {
    if (r.finished || r.inflight > 0 || (!r.stopped && r.issued_bytes < r.bytes)) return;
    r.finished = true;
    r.req->finish_part();
    r.req.reset();
  }

  // Finished ranges from the front into done_, whose nodes go back to
  // spare_ at the next lock (references to the other ranges stay valid).
  void pop_finished() {
    while (!ranges_.empty() && ranges_.front().finished) {
      if (issue_ == ranges_.begin()) ++issue_;
      done_.splice(done_.end(), ranges_, ranges_.begin());
    }
  }

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

}  // namespace detail

using detail::Range;
using detail::RequestState;

// ---- IoHandle -------------------------------------------------------------

IoHandle::~IoHandle() {
  if (state_) block();
}

IoHandle& IoHandle::operator=(IoHandle&& other) noexcept {
  if (this != &other) {
    if (state_) block();
    state_ = std::move(other.state_);
  }
  return *this;
}

bool IoHandle::done() const { return !state_ || state_->done.load(std::memory_order_acquire) != 0; }

void IoHandle::block() const {
  while (state_->done.load(std::memory_order_acquire) == 0) {
    state_->done.wait(0, std::memory_order_acquire);
  }
}

void IoHandle::wait() {
  if (!state_) return;
  block();
  if (state_->failed.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(state_->mu);
    throw_io_error(state_->path, state_->err, state_->what, state_->offset_bytes, state_->bytes);
  }
}

bool IoHandle::wait_ok() {
  if (!state_) return true;
  block();
  return !state_->failed.load(std::memory_order_acquire);
}

// ---- IoEngine -------------------------------------------------------------

IoEngine::IoEngine(EngineOptions options)
    : options_(std::move(options)), counters_(std::make_unique<detail::Counters>()) {
  validate(options_);
  for (const auto& [p, bytes] : options_.fixed_buffers) append_pieces(p, bytes, initial_buffers_);
  STRATA_CHECK(initial_buffers_.size() <= size_t(kBufferTableSlots), "too many fixed buffers");
  slot_used_.assign(size_t(kBufferTableSlots), false);
  for (size_t i = 0; i < initial_buffers_.size(); ++i) slot_used_[i] = true;
  files_.resize(size_t(std::max(options_.max_files, 1)));
  for (auto& f : files_) f = std::make_unique<FileEntry>();
  for (int i = 0; i < options_.rings; ++i) {
    workers_.push_back(std::make_unique<detail::Worker>(*this, i));
  }
  // Note [No allocation per request]: the request states' pool, filled once.
  if (detail::state_pool().free_blocks() < size_t(detail::kPooledStates)) {
    std::vector<std::shared_ptr<RequestState>> fill;
    for (int i = 0; i < detail::kPooledStates; ++i) {
      fill.push_back(std::allocate_shared<RequestState>(detail::StateAllocator<RequestState>{}));
    }
  }
  backend_name_ = workers_.front()->backend_name();
  log::debug("I/O engine: %s, %d ring(s) x queue depth %d, blocks of %s", backend_name_,
             options_.rings, options_.queue_depth,
             format_bytes(double(options_.block_size_bytes)).c_str());
}

IoEngine::~IoEngine() {
  workers_.clear();  // each drains its queue, then joins
}

FileId IoEngine::attach(File file) {
  STRATA_CHECK(file.valid(), "attaching a closed file");
  std::lock_guard<std::mutex> lock(files_mu_);
  int slot = -1;
  for (size_t i = 0; i < files_.size(); ++i) {
    if (!files_[i]->attached) {
      slot = int(i);
      break;
    }
  }
  if (slot < 0) {
    throw_io_error(file.path(), EMFILE,
                   strprintf("cannot attach more than %zu files to the I/O engine", files_.size()));
  }
  FileEntry& e = *files_[size_t(slot)];
  e.file = std::move(file);
  e.attached = true;
  std::latch registered(ptrdiff_t(workers_.size()));
  for (auto& w : workers_) w->control({slot, e.file.fd(), &registered});
  registered.wait();
  return FileId{slot};
}

File IoEngine::detach(FileId id) {
  std::lock_guard<std::mutex> lock(files_mu_);
  STRATA_CHECK(id.slot >= 0 && size_t(id.slot) < files_.size() && files_[size_t(id.slot)]->attached,
               "detaching a file that is not attached");
  std::latch unregistered(ptrdiff_t(workers_.size()));
  for (auto& w : workers_) w->control({id.slot, -1, &unregistered});
  unregistered.wait();
  FileEntry& e = *files_[size_t(id.slot)];
  e.attached = false;
  return std::move(e.file);
}

const File& IoEngine::file(FileId id) const {
  std::lock_guard<std::mutex> lock(files_mu_);
  STRATA_CHECK(id.slot >= 0 && size_t(id.slot) < files_.size() && files_[size_t(id.slot)]->attached,
               "file not attached");
  return files_[size_t(id.slot)]->file;
}

BufferRegistration IoEngine::register_buffer(void* p, int64_t bytes) {
  BufferRegistration r;
  if (p == nullptr || bytes <= 0) return r;
  std::vector<std::pair<void*, int64_t>> pieces;
  append_pieces(p, bytes, pieces);
  {
    std::lock_guard<std::mutex> lock(buffers_mu_);
    for (size_t i = 0; i < slot_used_.size() && r.slots_.size() < pieces.size(); ++i) {
      if (!slot_used_[i]) r.slots_.push_back(int(i));
    }
    if (r.slots_.size() < pieces.size()) {
      log::debug("I/O engine: buffer table full; a buffer of %s stays unregistered",
                 format_bytes(double(bytes)).c_str());
      r.slots_.clear();
      return r;
    }
    for (int slot : r.slots_) slot_used_[size_t(slot)] = true;
  }
  r.engine_ = this;
  r.registered_ = set_buffers(r.slots_, pieces) == 0;
  if (!r.registered_ && std::string_view(backend_name_) == "io_uring" && !told_refused_.exchange(true)) {
    log::info("io_uring refused to register %s of I/O buffers (RLIMIT_MEMLOCK: raise `ulimit -l` or run with "
              "CAP_IPC_LOCK); their transfers pin pages per operation, slower than `strata bench-io` measures",
              format_bytes(double(bytes)).c_str());
  }
  return r;
}

int IoEngine::set_buffers(std::span<const int> slots, std::span<const std::pair<void*, int64_t>> pieces) {
  std::atomic<int> refused{0};
  std::latch done(ptrdiff_t(workers_.size() * slots.size()));
  for (size_t i = 0; i < slots.size(); ++i) {
    detail::Control c;
    c.slot = slots[i];
    c.latch = &done;
    c.buffer = true;
    c.p = pieces.empty() ? nullptr : pieces[i].first;
    c.bytes = pieces.empty() ? 0 : pieces[i].second;
    c.refused = &refused;
    for (auto& w : workers_) w->control(c);
  }
  done.wait();
  return refused.load();
}

void IoEngine::unregister(std::span<const int> slots) {
  set_buffers(slots, {});
  std::lock_guard<std::mutex> lock(buffers_mu_);
  for (int slot : slots) slot_used_[size_t(slot)] = false;
}

BufferRegistration& BufferRegistration::operator=(BufferRegistration&& other) noexcept {
  if (this != &other) {
    reset();
    engine_ = std::exchange(other.engine_, nullptr);
    slots_ = std::move(other.slots_);
    other.slots_.clear();
    registered_ = std::exchange(other.registered_, false);
  }
  return *this;
}

void BufferRegistration::reset() {
  if (engine_ != nullptr) engine_->unregister(slots_);
  engine_ = nullptr;
  slots_.clear();
  registered_ = false;
}

IoHandle IoEngine::submit(std::span<const IoRequest> requests) {
  // Note [No allocation per request].
  auto state = std::allocate_shared<RequestState>(detail::StateAllocator<RequestState>{});
  const int rings = options_.rings;
  const int64_t block = options_.block_size_bytes;
  bool queuing = false;
  try {
    std::lock_guard<std::mutex> lock(files_mu_);
    // Every request is checked before any is queued.
    for (const IoRequest& q : requests) {
      STRATA_CHECK(q.file.slot >= 0 && size_t(q.file.slot) < files_.size() &&
                       files_[size_t(q.file.slot)]->attached,
                   "I/O on a file that is not attached");
      const File& f = files_[size_t(q.file.slot)]->file;
      STRATA_CHECK(q.offset_bytes >= 0 && q.bytes >= 0, f.path() + ": negative offset or size");
      if (q.bytes == 0) continue;
      STRATA_CHECK(q.buffer != nullptr, f.path() + ": null buffer");
      if (f.direct()) {
        const bool aligned = q.offset_bytes % kDirectAlignmentBytes == 0 &&
                             q.bytes % kDirectAlignmentBytes == 0 &&
                             uintptr_t(q.buffer) % uintptr_t(kDirectAlignmentBytes) == 0;
        STRATA_CHECK(aligned, strprintf("%s: direct I/O needs 4096-aligned offset (%lld), size "
                                        "(%lld) and buffer (%p)",
                                        f.path().c_str(), (long long)q.offset_bytes,
                                        (long long)q.bytes, q.buffer));
      }
    }
    // One part stands for the submit itself until every range is queued, so
    // that a worker finishing the first range cannot complete the handle.
    state->parts_left.store(1, std::memory_order_relaxed);
    queuing = true;
    for (const IoRequest& q : requests) {
      if (q.bytes == 0) continue;
      const File& f = files_[size_t(q.file.slot)]->file;
      // Contiguous shares of whole blocks, one per ring, so that each ring's
      // batches are adjacent on disk (mergeable) and the rings run in parallel.
      const int64_t pieces = (q.bytes + block - 1) / block;
      const int64_t shares = std::min<int64_t>(rings, pieces);
      const int64_t per_share = (pieces + shares - 1) / shares;
      const uint32_t first = next_worker_.fetch_add(1, std::memory_order_relaxed);
      for (int64_t k = 0; k < shares; ++k) {
        const int64_t begin = std::min(q.bytes, k * per_share * block);
        const int64_t end = std::min(q.bytes, (k + 1) * per_share * block);
        if (begin >= end) break;
        Range r;
        r.req = state;
        r.path = &f.path();
        r.fd = f.fd();
        r.file_slot = q.file.slot;
        r.direct = f.direct();
        r.op = q.op;
        r.buffer = static_cast<std::byte*>(q.buffer) + begin;
        r.offset_bytes = q.offset_bytes + begin;
        r.bytes = end - begin;
        state->parts_left.fetch_add(1, std::memory_order_relaxed);
        workers_[(first + uint32_t(k)) % uint32_t(rings)]->enqueue(std::move(r));
      }
    }
  } catch (...) {
    if (queuing) {
      // A range could not be queued (no memory for its node): stop the
      // queued ones and let them end before the caller's buffers may be reused.
      state->fail(ENOMEM, "", "an I/O request could not be queued", -1, -1);
      state->finish_part();
      while (state->done.load(std::memory_order_acquire) == 0) state->done.wait(0, std::memory_order_acquire);
    }
    throw;
  }
  state->finish_part();  // the submit's own part
  return IoHandle(std::move(state));
}

void IoEngine::read(FileId file, int64_t offset_bytes, int64_t bytes, void* buffer) {
  submit(IoRequest{IoOp::kRead, file, offset_bytes, bytes, buffer}).wait();
}

void IoEngine::write(FileId file, int64_t offset_bytes, int64_t bytes, const void* buffer) {
  submit(IoRequest{IoOp::kWrite, file, offset_bytes, bytes, const_cast<void*>(buffer)}).wait();
}

EngineStats IoEngine::stats() const {
  const detail::Counters& c = *counters_;
  EngineStats s;
  s.read_ops = c.read_ops.load();
  s.write_ops = c.write_ops.load();
  s.read_bytes = c.read_bytes.load();
  s.write_bytes = c.write_bytes.load();
  s.submits = c.submits.load();
  s.short_transfers = c.short_transfers.load();
  s.retries = c.retries.load();
  s.fixed_buffer_ops = c.fixed_buffer_ops.load();
  return s;
}

}  // namespace strata::nvme
