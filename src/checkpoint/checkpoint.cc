// The save in flight (CheckpointSave): every rank writes its ranges while
// training goes on, copying ranges the optimizer is about to overwrite into
// the snapshot pool; rank 0 publishes the checkpoint once all are written
// (publish.cc). docs/checkpoint.md has the format and the protocol.
#include "checkpoint/checkpoint.h"

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "checkpoint/internal.h"
#include "comm/communicator.h"
#include "util/errors.h"
#include "util/fs.h"

namespace strata {

using namespace ckpt;  // NOLINT: this module's own helpers (checkpoint/internal.h)

namespace {

constexpr int kSaveThreadNice = 10;

// What a rank reports of a phase of the save: empty when it succeeded.
struct PhaseStatus {
  std::string error;
};

// Agrees on whether a phase succeeded everywhere. Throws on every rank when
// one failed: the failing rank with its own message, the others naming the
// highest-numbered rank that failed.
void agree(Communicator& comm, const PhaseStatus& mine, const char* phase) {
  const int64_t failed = failed_rank(comm, !mine.error.empty());
  if (failed < 0) return;
  if (!mine.error.empty()) throw Error("checkpoint save failed (" + std::string(phase) + "): " + mine.error);
  throw Error(strprintf("checkpoint save failed (%s) on rank %lld; see its message", phase, (long long)failed));
}

std::string error_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace


CheckpointSave::CheckpointSave(const CheckpointOptions& options, Communicator& comm, Manifest header,
                               std::vector<ShardRange> ranges, RangeSource source, std::function<bool(size_t)> ready,
                               SnapshotPool pool)
    : options_(options), comm_(comm), header_(std::move(header)), ranges_(std::move(ranges)),
      source_(std::move(source)), ready_(std::move(ready)), pool_(source_.snapshot ? pool : SnapshotPool()),
      t0_(std::chrono::steady_clock::now()) {
  const int rank = comm.rank();
  STRATA_CHECK(reinterpret_cast<uintptr_t>(pool_.data) % kAlign == 0, "a snapshot pool not 4 KiB aligned");
  snap_state_.assign(ranges_.size(), Snap::kNone);
  snap_ok_.assign(ranges_.size(), 0);
  if (pool_.bytes > 0) {
    for (size_t i = 0; i < ranges_.size(); ++i) snap_ok_[i] = !source_.snapshot_ok || source_.snapshot_ok(i);
  }
  reserved_.reserve(ranges_.size());
  snap_.assign(ranges_.size(), nullptr);
  // A range taken into the pool is written from there: in place (the pool
  // is aligned), or its pieces copied.
  from_pool_.resident = [this](size_t i) -> const std::byte* { return snap_[i]; };
  from_pool_.fill = [this](size_t i, int64_t at, int64_t numel, std::byte* buf) {
    const int eb = header_.elem_bytes.at(ranges_[i].category);
    std::memcpy(buf, snap_[i] + at * eb, size_t(numel * eb));
  };
  step_ = header_.step;
  const std::string name = step_name(step_);
  tmp_ = options_.dir + "/" + name + ".tmp";
  final_dir_ = options_.dir + "/" + name;
  header_.saved_world_size = comm.world_size();
  for (const ShardRange& r : ranges_) bytes_ += r.numel * header_.elem_bytes.at(r.category);
  wait_for_checkpoint_pruning();  // the last save's pruning, off the disk before this one writes
  note_save_begun();
  PhaseStatus st;
  if (rank == 0) {
    try {
      make_dirs(options_.dir, 0700);
      remove_tree(tmp_);
      if (::mkdir(tmp_.c_str(), 0700) != 0) throw IoError(tmp_, errno, "cannot create checkpoint directory");
    } catch (...) {
      st.error = error_text(std::current_exception());
    }
  }
  agree(comm, st, "creating the directory");
  thread_ = std::thread([this] { run(); });
}

CheckpointSave::~CheckpointSave() {
  if (thread_.joinable()) thread_.join();
}

void CheckpointSave::run() {
  const int rank = comm_.rank();
  if (ready_) {
    // Saving while training: the checksums and the copies yield the CPU to
    // the step (a hint; Linux applies nice per thread).
    ::setpriority(PRIO_PROCESS, pid_t(::syscall(SYS_gettid)), kSaveThreadNice);
  }
  std::string error;
  try {
    const auto t0 = std::chrono::steady_clock::now();
    RankFileWriter w(tmp_, rank_file(rank, "bin"), ranges_, header_.elem_bytes, options_.engine);
    const double setup_s = seconds_since(t0);
    double ready_s = 0.0;
    auto publish = [&](size_t n) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (n <= written_) return;
        written_ = n;
      }
      cv_.notify_all();
    };
    w.set_progress(publish);
    for (size_t i = 0; i < ranges_.size(); ++i) {
      if (options_.test_delay_per_range_ms > 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(options_.test_delay_per_range_ms));
      }
      if (ready_) {
        const auto t1 = std::chrono::steady_clock::now();
        if (!ready_(i)) throw Error("the optimizer step being saved failed");
        ready_s += seconds_since(t1);
      }
      bool pooled;
      {
        // A snapshot being taken finishes first (Note [Save snapshots]);
        // once begun, the range is this thread's.
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return snap_state_[i] != Snap::kCopying; });
        begun_ = i + 1;
        pooled = snap_state_[i] == Snap::kTaken;
      }
      w.write(i, pooled ? from_pool_ : source_);
      publish(w.written_ranges());
    }
    for (size_t i = 0; i < ranges_.size(); ++i) {
      w.wait_through(i);
      publish(i + 1);
    }
    const std::vector<SavedRange> saved = w.finish();
    struct rusage cpu {};
    ::getrusage(RUSAGE_THREAD, &cpu);
    auto tv = [](const timeval& t) { return double(t.tv_sec) + 1e-6 * double(t.tv_usec); };
    log::debug("checkpoint: rank %d wrote %s in %.3f s: set-up %.3f s, waiting for the optimizer %.3f s, tier "
               "reads %.3f s, checksums %.3f s, waiting for writes %.3f s, fsync %.3f s (%s written in place, "
               "%s of it from the snapshot pool; the thread used %.3f s user, %.3f s system CPU)",
               rank, file_name_for_log(tmp_, rank).c_str(), seconds_since(t0), setup_s, ready_s, w.fill_s(),
               w.crc_s(), w.wait_s(), w.sync_s(), format_bytes(double(w.in_place_bytes())).c_str(),
               format_bytes(double(snapshot_bytes())).c_str(), tv(cpu.ru_utime), tv(cpu.ru_stime));
    json part = {{"bytes", int64_t(0)}, {"ranges", json::array()}};
    int64_t bytes = 0;
    for (const SavedRange& s : saved) {
      part["ranges"].push_back(range_to_json(s));
      bytes = std::max(bytes, s.offset + round_up(s.numel * header_.elem_bytes.at(s.category), kAlign));
    }
    part["bytes"] = bytes;
    checkpoint_fault_point("fsync");
    write_file_atomic(tmp_ + "/" + rank_file(rank, "json"), part.dump() + "\n");
  } catch (...) {
    error = error_text(std::current_exception());  // the writer has drained: no I/O from a home remains
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = std::move(error);
    written_ = ranges_.size();  // written, or abandoned: nothing waits on a failed save
    done_ = true;
    write_s_ = seconds_since(t0_);
  }
  cv_.notify_all();
}

bool CheckpointSave::reserve_locked(size_t i, std::vector<std::pair<size_t, std::byte*>>& out) {
  const int64_t bytes = round_up(ranges_[i].shard_numel * header_.elem_bytes.at(ranges_[i].category), kAlign);
  if (!snap_ok_[i] || i < begun_ || done_ || snap_state_[i] != Snap::kNone || pool_used_ + bytes > pool_.bytes) {
    return false;
  }
  out.push_back({i, pool_.data + pool_used_});
  pool_used_ += bytes;
  snap_state_[i] = Snap::kCopying;  // the save's thread waits for it
  return true;
}

void CheckpointSave::copy_reserved(std::unique_lock<std::mutex>& lock,
                                   const std::vector<std::pair<size_t, std::byte*>>& reserved) {
  lock.unlock();
  size_t k = 0;
  try {
    for (; k < reserved.size(); ++k) {
      {
        std::lock_guard<std::mutex> state(mu_);
        if (done_) break;  // failed: nothing waits for these (and the pool may soon be the next save's)
      }
      source_.snapshot(reserved[k].first, reserved[k].second);
      {
        std::lock_guard<std::mutex> state(mu_);
        const size_t i = reserved[k].first;
        snap_[i] = reserved[k].second;
        snap_state_[i] = Snap::kTaken;
        snapshot_bytes_ += ranges_[i].numel * header_.elem_bytes.at(ranges_[i].category);
      }
      cv_.notify_all();  // in order: the save's thread goes on with each
    }
  } catch (...) {
    lock.lock();
    // Homes not yet overwritten: the save reads those ranges there.
    for (; k < reserved.size(); ++k) snap_state_[reserved[k].first] = Snap::kNone;
    cv_.notify_all();
    throw;
  }
  lock.lock();
  for (; k < reserved.size(); ++k) snap_state_[reserved[k].first] = Snap::kNone;  // after a failed save
  cv_.notify_all();
}

double CheckpointSave::make_writable(size_t lo, size_t hi) {
  hi = std::min(hi, ranges_.size());
  double waited = 0.0;
  std::lock_guard<std::mutex> one_caller(callers_mu_);
  std::vector<std::pair<size_t, std::byte*>>& reserved = reserved_;
  std::unique_lock<std::mutex> lock(mu_);
  for (size_t i = lo; i < hi; ++i) {
    if (i < written_ || done_ || snap_state_[i] == Snap::kTaken) continue;
    reserved.clear();
    if (reserve_locked(i, reserved)) {
      copy_reserved(lock, reserved);  // Note [Save snapshots]: ours to copy
      continue;
    }
    if (snap_state_[i] == Snap::kNone && i < begun_) {
      // The save is at this range: this pass has caught up with it. Rather
      // than follow it at the disk's pace range by range, take every later
      // range it has not begun (the rest of this piece's too), while the
      // pool has room, in its order (it writes each as soon as it is
      // copied), then wait for the ones it has.
      for (size_t k = std::max(i + 1, begun_); k < ranges_.size() && pool_used_ < pool_.bytes; ++k) {
        reserve_locked(k, reserved);  // not those taken, on NVMe, or too large for what is left
      }
      if (!reserved.empty()) copy_reserved(lock, reserved);
    }
    // Begun by the save, being copied by another thread, or no room left.
    const auto t0 = std::chrono::steady_clock::now();
    cv_.wait(lock, [&] { return written_ > i || done_ || snap_state_[i] == Snap::kTaken; });
    waited += seconds_since(t0);
  }
  return waited;
}

int64_t CheckpointSave::snapshot_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return snapshot_bytes_;
}

bool CheckpointSave::done_everywhere() {
  bool done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done = done_;
  }
  return failed_rank(comm_, !done) < 0;
}

std::string CheckpointSave::finish() {
  STRATA_CHECK(!finished_, "a checkpoint save is finished once");
  finished_ = true;
  thread_.join();
  const int rank = comm_.rank();
  PhaseStatus st;
  st.error = error_;
  try {
    agree(comm_, st, "writing the state");
  } catch (...) {
    if (rank == 0) {
      try {
        remove_tree(tmp_);
      } catch (...) {
      }
    }
    throw;
  }
  if (rank == 0) {
    try {
      publish(options_, std::move(header_), comm_.world_size(), tmp_, final_dir_);
    } catch (...) {
      st.error = error_text(std::current_exception());
      try {
        remove_tree(tmp_);
      } catch (...) {
      }
    }
  }
  agree(comm_, st, "publishing");
  return final_dir_;
}

std::string save_checkpoint(const CheckpointOptions& options, Communicator& comm, Manifest header,
                            const std::vector<ShardRange>& ranges, const RangeSource& source) {
  CheckpointSave save(options, comm, std::move(header), ranges, source);
  return save.finish();
}

}  // namespace strata
