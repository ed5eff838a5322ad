// The I/O engine's worker (nvme/worker.h): its thread, its ring and the loop
// that fills, submits and reaps it (Note [I/O loop] in engine.h).
#include "nvme/worker.h"

#include <errno.h>
#include <time.h>

#include <algorithm>
#include <exception>

#include "nvme/fault_backend.h"
#include "nvme/io_error.h"
#include "util/errors.h"
#include "util/logging.h"

namespace strata::nvme::detail {

namespace {
constexpr int kMaxRetries = 256;  // EAGAIN/EINTR requeues of one operation
bool g_warned_uring = false;
}  // namespace

Worker::Worker(IoEngine& engine, int index) : engine_(engine), index_(index) {
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

Worker::~Worker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

void Worker::enqueue(Range&& r) {
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

void Worker::control(const Control& c) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    controls_.push_back(c);
  }
  cv_.notify_one();
}

void Worker::run(std::promise<const char*> started) {
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

std::unique_ptr<Backend> Worker::make_backend() {
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

void Worker::apply(const Control& c) {
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

int Worker::buffer_index(const std::byte* p, int64_t bytes) const {
  for (size_t i = 0; i < fixed_end_; ++i) {
    const auto& [start, n] = fixed_[i];
    if (start != nullptr && p >= start && p + bytes <= start + n) return int(i);
  }
  return -1;
}

void Worker::loop() {
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

Range* Worker::next_range() {
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

void Worker::fill() {
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

void Worker::prepare(int tag) {
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

void Worker::complete(const Completion& c) {
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

void Worker::fail(const Slot& s, int err, std::string what) {
  s.range->req->fail(err, *s.range->path, std::move(what), s.offset_bytes, s.bytes);
  s.range->stopped = true;
}

void Worker::release(int tag) {
  Range& r = *slots_[size_t(tag)].range;
  slots_[size_t(tag)].range = nullptr;
  free_slots_.push_back(tag);
  --r.inflight;
  maybe_finish(r);
}

void Worker::stop(Range& r) {
  r.stopped = true;
  maybe_finish(r);
}

void Worker::maybe_finish(Range& r) {
  if (r.finished || r.inflight > 0 || (!r.stopped && r.issued_bytes < r.bytes)) return;
  r.finished = true;
  r.req->finish_part();
  r.req.reset();
}

void Worker::pop_finished() {
  while (!ranges_.empty() && ranges_.front().finished) {
    if (issue_ == ranges_.begin()) ++issue_;
    done_.splice(done_.end(), ranges_, ranges_.begin());
  }
}

}  // namespace strata::nvme::detail
