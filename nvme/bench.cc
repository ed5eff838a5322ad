#include "nvme/bench.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <random>
#include <thread>
#include <vector>

#include "nvme/io_error.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"

namespace strata::nvme {

namespace {
constexpr int64_t kRequestBytes = int64_t(64) << 20;  // one submit() per 64 MiB of the file
bool g_warned_buffered_bench = false;
// Numbers the temporary files of one process: `run_both` reads one bench's
// file while another bench writes its own, so two may exist at once.
std::atomic<int> g_bench_files{0};
}  // namespace

IoBench::IoBench(BenchOptions options) : options_(std::move(options)) {
  STRATA_CHECK(options_.bytes > 0 && options_.bytes % kDirectAlignmentBytes == 0,
               "benchmark size must be a positive multiple of 4096");
  STRATA_CHECK(
      options_.max_buffer_bytes > 0 && options_.max_buffer_bytes % kDirectAlignmentBytes == 0,
      "benchmark buffer must be a positive multiple of 4096");
  if (options_.file.empty()) {
    if (!is_directory(options_.dir)) throw InputError(options_.dir, "directory does not exist");
    path_ = strprintf("%s/strata-bench-io.%d.%d.dat", options_.dir.c_str(), int(::getpid()), g_bench_files++);
    temporary_ = true;
  } else {
    path_ = options_.file;
    if (!is_directory(parent_dir(path_)))
      throw InputError(parent_dir(path_), "directory does not exist");
  }
  open_path_ = path_;
  {
    File f = File::open(
        path_, OpenOptions{.write = true, .create = true, .mode = 0600, .direct = options_.direct});
    if (temporary_) {
      // Note [Nameless bench files]
      // A temporary bench file is unlinked at once and reopened by its
      // descriptor: no exit, a signal's or SIGKILL's included, can leave it
      // behind, and the kernel frees its blocks when the process ends.
      held_fd_ = ::fcntl(f.fd(), F_DUPFD_CLOEXEC, 0);
      const int err = errno;
      ::unlink(path_.c_str());
      if (held_fd_ < 0) throw IoError(path_, err, "cannot hold the benchmark file open");
      open_path_ = "/proc/self/fd/" + std::to_string(held_fd_);
    }
  }
  try {
    {
      File f = File::open(open_path_, OpenOptions{.write = true, .direct = options_.direct});
      if (f.size_bytes() < options_.bytes || temporary_) {
        f.preallocate(options_.bytes);
        unwritten_ = options_.lay_out;
      }
    }
    buffer_ = PinnedBuffer(std::min(options_.bytes, options_.max_buffer_bytes));
  } catch (...) {
    if (held_fd_ >= 0) ::close(held_fd_);  // the destructor will not run: the file's blocks go now
    throw;
  }
  // Incompressible contents, in case the device compresses or deduplicates.
  std::mt19937_64 rng(12345);
  for (int64_t i = 0; i + 8 <= buffer_.bytes(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(buffer_.data() + i, &v, 8);
  }
}

IoBench::~IoBench() {
  if (held_fd_ >= 0) ::close(held_fd_);
}

BenchResult IoBench::run(IoOp op, EngineOptions eo,
                         const std::function<void(int64_t, int64_t)>& progress) {
  eo.backend = options_.backend;
  eo.fixed_buffers = {{buffer_.data(), buffer_.bytes()}};
  IoEngine engine(eo);
  const FileId file =
      engine.attach(File::open(open_path_, OpenOptions{.write = true, .direct = options_.direct}));
  const File& f = engine.file(file);
  if (!f.direct()) {
    warn_once(g_warned_buffered_bench,
              path_ +
                  ": buffered I/O; the page cache is written back and evicted inside the timed "
                  "region, but a file system that keeps file data in memory (tmpfs) measures "
                  "memory, not a drive");
  }
  const int64_t total = options_.bytes;
  if (unwritten_) {
    // Note [Laid-out bench files]: untimed, with this pass's engine.
    std::vector<IoHandle> laid;
    for (const IoRequest& r : pass(IoOp::kWrite, file, eo.block_size_bytes)) laid.push_back(engine.submit(r));
    for (IoHandle& h : laid) h.wait();
    f.drop_cache();
    unwritten_ = false;
  }
  const std::vector<IoRequest> requests = pass(op, file, eo.block_size_bytes);
  if (op == IoOp::kRead) f.drop_cache();

  const auto t0 = std::chrono::steady_clock::now();
  std::vector<IoHandle> handles;
  handles.reserve(requests.size());
  for (const IoRequest& r : requests) handles.push_back(engine.submit(r));
  int64_t done = 0;
  for (size_t i = 0; i < handles.size(); ++i) {
    handles[i].wait();
    done += requests[i].bytes;
    if (progress) progress(done, total);
  }
  if (op == IoOp::kWrite) f.drop_cache();  // buffered: write back inside the timed region
  if (op == IoOp::kWrite && options_.fsync_writes) f.sync();
  const auto t1 = std::chrono::steady_clock::now();

  BenchResult r;
  r.op = op;
  r.block_size_bytes = eo.block_size_bytes;
  r.queue_depth = eo.queue_depth;
  r.rings = eo.rings;
  r.bytes = total;
  r.seconds = std::chrono::duration<double>(t1 - t0).count();
  r.backend = engine.backend_name();
  r.direct = f.direct();
  r.fixed_buffers = engine.stats().fixed_buffer_ops > 0;
  r.fsync = op == IoOp::kWrite && options_.fsync_writes;
  return r;
}

void IoBench::lay_out(const EngineOptions& engine) {
  if (!unwritten_) return;
  run(IoOp::kWrite, engine);  // lays the file out first, then a write pass: both untimed here
}

std::vector<IoRequest> IoBench::pass(IoOp op, FileId file, int64_t block_size_bytes) const {
  const int64_t total = options_.bytes;
  const int64_t request = std::min({total, std::max(kRequestBytes, block_size_bytes), buffer_.bytes()});
  const int64_t buffer_bytes = buffer_.bytes() / request * request;  // request i uses slot i mod n
  std::vector<IoRequest> requests;
  for (int64_t off = 0; off < total; off += request) {
    const int64_t n = std::min(request, total - off);
    requests.push_back({op, file, off, n, buffer_.data() + off % buffer_bytes});
  }
  return requests;
}

BenchResult run_both(IoBench& reader, IoBench& writer, const EngineOptions& engine) {
  writer.lay_out(engine);  // Note [Laid-out bench files]: before the timed region
  const auto t0 = std::chrono::steady_clock::now();
  BenchResult w;
  std::exception_ptr failed;
  std::thread t([&] {
    try {
      w = writer.run(IoOp::kWrite, engine);
    } catch (...) {
      failed = std::current_exception();
    }
  });
  BenchResult r;
  try {
    r = reader.run(IoOp::kRead, engine);
  } catch (...) {
    t.join();
    throw;
  }
  t.join();
  if (failed) std::rethrow_exception(failed);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.bytes += w.bytes;
  return r;
}

}  // namespace strata::nvme
