#include "nvme/engine.h"

#include "nvme/worker.h"

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
constexpr int64_t kMaxRegisteredBytes = int64_t(1) << 30;  // per registered buffer (kernel limit)

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
