// Sequential write-then-read throughput of one file through an IoEngine: the
// measurement behind `strata bench-io` (src/cli/bench_io.cc). Page-cache
// effects are excluded: direct I/O, or, where the file system refuses it,
// write-back and eviction of the file's pages inside the timed region.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "nvme/buffer.h"
#include "nvme/engine.h"

namespace strata::nvme {

struct BenchOptions {
  std::string dir;   // where the temporary file goes (removed at the end)
  std::string file;  // or: this file, created if missing and kept (for repeated runs)
  int64_t bytes = int64_t(1) << 30;
  DirectIo direct = DirectIo::kAuto;
  BackendKind backend = BackendKind::kAuto;
  // Host buffer: min(bytes, this); requests beyond it reuse it cyclically.
  int64_t max_buffer_bytes = int64_t(1) << 30;
  // The write pass ends with fdatasync inside the timed region: the durable
  // rate, what a checkpoint (which must survive a power cut) can reach.
  bool fsync_writes = false;
  // Note [Laid-out bench files]: a file this bench creates or extends is
  // written once, untimed, before its first timed pass (as fio lays out its
  // files), so that timed writes overwrite written blocks as the swap store's
  // do. On ext4 a first write into preallocated extents also converts them:
  // on the dev VM 2.79 GB/s against 4.57-4.88 GB/s overwriting the same file
  // (BENCHMARKS.md, "The layer-major step"), which put the step's bound above
  // measured steps with the optimizer state on NVMe.
  bool lay_out = true;
};

struct BenchResult {
  IoOp op = IoOp::kWrite;
  int64_t block_size_bytes = 0;
  int queue_depth = 0;
  int rings = 0;
  int64_t bytes = 0;
  double seconds = 0;
  std::string backend;  // io_uring | threads
  bool direct = true;
  bool fixed_buffers = false;  // the buffer was registered with the rings
  bool fsync = false;          // a write pass timed to the end of fdatasync
  double gbps() const { return seconds > 0 ? double(bytes) / seconds / 1e9 : 0.0; }
};

// Owns the file and the pinned buffer. Not thread-safe.
class IoBench {
 public:
  // Checks the directory (InputError if missing), creates and preallocates
  // the file (IoError), allocates and fills the buffer.
  explicit IoBench(BenchOptions options);
  ~IoBench();  // removes a temporary file
  IoBench(const IoBench&) = delete;
  IoBench& operator=(const IoBench&) = delete;

  // Writes or reads the whole file once with a fresh engine of `engine`
  // (its backend and fixed_buffers are set here). `progress(done, total)`
  // is called as requests complete.
  BenchResult run(IoOp op, EngineOptions engine,
                  const std::function<void(int64_t, int64_t)>& progress = {});

  // Note [Laid-out bench files]: writes a file not yet laid out, untimed
  // (run() does it before its timed region; run_both for its writer).
  void lay_out(const EngineOptions& engine);

  // The file's name (a temporary one's, which no longer exists: Note
  // [Nameless bench files]).
  const std::string& path() const { return path_; }
  const PinnedBuffer& buffer() const { return buffer_; }

 private:
  // The requests of one whole pass over the file (kRequestBytes or the
  // engine's block size each, cycling through the buffer).
  std::vector<IoRequest> pass(IoOp op, FileId file, int64_t block_size_bytes) const;

  BenchOptions options_;
  std::string path_;
  // Note [Nameless bench files]: a temporary file is unlinked as soon as it
  // is created and reopened through /proc/self/fd/<held_fd_>.
  std::string open_path_;
  int held_fd_ = -1;
  bool temporary_ = false;
  bool unwritten_ = false;  // created or extended here and not yet laid out (options_.lay_out)
  PinnedBuffer buffer_;
};

// Reads `reader`'s file (written by an earlier pass) while `writer`'s file
// is written, each with a fresh engine of `engine`, on two threads: the
// disk's aggregate rate under a mix like the optimizer's swapping (the bytes
// of both passes over the time both took). op is kRead, bytes both passes'.
BenchResult run_both(IoBench& reader, IoBench& writer, const EngineOptions& engine);

}  // namespace strata::nvme
