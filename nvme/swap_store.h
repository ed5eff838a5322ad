// The swap store: named regions of bytes (key -> file, offset, bytes) in
// preallocated files, striped over one or more directories (one per drive),
// read and written through an IoEngine, with optional per-block CRC-32C
// checksums verified on every read. The on-disk layout is documented byte by
// byte in docs/nvme-format.md (Note [Swap file layout]).
//
// Note [Swap file layout]
// The store is one logical address space of `capacity_bytes`, cut into
// stripes of `stripe_bytes`; stripe s lives in the file of directory
// s % D at offset (s / D) * stripe_bytes, so a large region read or written
// at once keeps every drive busy. Regions are carved from the address space
// in order of creation, each starting on a `block_bytes` boundary; a block
// (the unit of checksums, 1 MiB by default) therefore never straddles two
// stripes or two files. Each directory gets a private subdirectory
// (mkdtemp: mode 0700) holding one file (mode 0600) preallocated to its
// share, because direct writes that grow or allocate a file are far slower.
// Checksums and the "written" mark of each block live in memory; a store
// kept at exit writes them to an index file beside the first file.
#pragma once

#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "nvme/engine.h"

namespace strata::nvme {

struct SwapOptions {
  // Directories to swap into (DeepSpeed's nvme_path), one per drive. Each
  // must exist and be writable.
  std::vector<std::string> dirs;
  // Bytes preallocated in all, split evenly over the directories (rounded up
  // to whole stripes). Free space is checked before anything is created.
  int64_t capacity_bytes = 0;
  // Consecutive stripes go to consecutive directories. REQUIRES: a multiple
  // of block_bytes.
  int64_t stripe_bytes = int64_t(16) << 20;
  // Alignment of regions and unit of checksums. REQUIRES: a multiple of 4096.
  int64_t block_bytes = int64_t(1) << 20;
  // CRC-32C per block, computed on write and verified on every read.
  bool checksums = true;
  // Keep the files (and write the index) at exit instead of removing them.
  bool keep_files = false;
  DirectIo direct = DirectIo::kAuto;
  // Note [Swap directory layout]: >= 0 puts the files under
  // <dir>/strata-swap.XXXXXX/rank<rank>/ with an flock held on
  // <dir>/strata-swap.XXXXXX/lock for the store's life; < 0 (tools, tests)
  // directly under <dir>/strata-swap.XXXXXX/ without a lock.
  int rank = -1;
};

// Note [Swap directory layout]
// A run swaps under <nvme_path>/strata-swap.XXXXXX/rank<r>/ and holds an
// exclusive flock on <nvme_path>/strata-swap.XXXXXX/lock while it lives (the
// lock file is created and locked under another name, then renamed, so it is
// never seen unlocked). The kernel drops the lock when the process dies, even
// by SIGKILL, so a swap directory whose lock nobody holds belongs to a run
// that is gone: the next run removes it (reclaim_abandoned_swap) instead of
// letting crashed runs' state (hundreds of GB for a real model) fill the disk.
// A directory without a lock file is never touched.
struct ReclaimedSwap {
  std::string path;
  int64_t bytes = 0;
};
// Removes every strata-swap.* directory under `dir` whose lock nobody holds.
// Errors removing one are logged, not thrown.
std::vector<ReclaimedSwap> reclaim_abandoned_swap(const std::string& dir);

struct RegionId {
  int index = -1;
  bool valid() const { return index >= 0; }
};

class SwapStore;

// Note [Parallel checksums]
// A write's CRC-32C and a read's verification run on the caller's thread, at
// about 8-20 GB/s (cold or cached data, one core). The optimizer's pipeline
// checksums every byte of optimizer state it swaps, twice per step (the read
// and the write-back): on one thread that caps it at a few G parameters a
// second whatever the disks, and it is serial with CPU Adam on the same
// thread. A caller that has threads to spare passes a ParallelFor: the blocks
// are then checksummed in chunks over those threads, and a mismatch is
// reported for the lowest bad block, as on one thread.
class ParallelFor {
 public:
  using Body = void (*)(void* context, int64_t begin, int64_t end);
  // Calls body(context, b, e) over disjoint [b, e) covering [0, n), possibly
  // concurrently, and returns once every call has returned. `body` does not
  // throw.
  virtual void run(int64_t n, Body body, void* context) const = 0;

 protected:
  ~ParallelFor() = default;
};

// Completion of one region read or write. Move-only. The bytes read are
// valid only once wait() has returned: it verifies the checksums. The
// destructor waits for the I/O (without verifying or throwing).
class SwapHandle {
 public:
  SwapHandle() = default;
  SwapHandle(SwapHandle&&) noexcept = default;
  SwapHandle& operator=(SwapHandle&&) noexcept = default;
  ~SwapHandle() = default;

  bool done() const { return io_.done(); }
  // Throws strata::IoError: the engine's error, or a checksum mismatch
  // naming the file, offset and region. Throws the same again if called again.
  void wait();

 private:
  friend class SwapStore;
  IoHandle io_;
  SwapStore* store_ = nullptr;
  IoOp op_ = IoOp::kRead;
  int region_ = -1;
  int64_t offset_bytes_ = 0;  // in the region
  int64_t bytes_ = 0;         // transferred (padded to 4 KiB)
  const std::byte* buffer_ = nullptr;
  const ParallelFor* parallel_ = nullptr;  // verifies a read (Note [Parallel checksums])
  bool finished_ = false;
  std::exception_ptr error_;  // what the first wait() threw
};

// Thread-safety: all methods may be called concurrently, provided no two
// I/Os in flight touch the same block with one of them a write.
// The engine must outlive the store.
class SwapStore {
 public:
  // Creates the private directories and preallocated files. Throws IoError:
  // a directory that does not exist (ENOENT) or is not writable, too little
  // free space (ENOSPC, with the numbers), a failed preallocation. ConfigError
  // for inconsistent options. Nothing is left behind when it throws.
  SwapStore(IoEngine& engine, SwapOptions options);
  // Reopens a store kept with keep_files from its index file (index_path()).
  // Verifies the index checksum and that no file is shorter than the index
  // says (a truncated file). The reopened store keeps its files.
  static std::unique_ptr<SwapStore> reopen(IoEngine& engine, const std::string& index_path,
                                           DirectIo direct = DirectIo::kAuto);
  // close(), logging instead of throwing. REQUIRES: no I/O in flight.
  ~SwapStore();
  SwapStore(const SwapStore&) = delete;
  SwapStore& operator=(const SwapStore&) = delete;

  // Reserves `bytes` under `name`. Throws IoError (ENOSPC) when the capacity
  // is exhausted, InternalError for a duplicate name.
  RegionId add_region(const std::string& name, int64_t bytes);
  // Invalid id when there is no such region.
  RegionId find(const std::string& name) const;
  int64_t region_bytes(RegionId id) const;
  const std::string& region_name(RegionId id) const;

  // Region I/O of [offset, offset + bytes). REQUIRES: offset a multiple of
  // block_bytes; bytes a multiple of block_bytes or reaching the end of the
  // region; buffer 4096-aligned and holding bytes rounded up to 4096 (the
  // padding is transferred too). Reading a block never written throws
  // IoError (ENODATA) before any I/O. See Note [Buffer reuse] in engine.h.
  // With `parallel`, the write's checksums, or the read's verification in
  // its handle's wait(), run over its threads (Note [Parallel checksums]); it
  // must outlive the handle.
  SwapHandle write(RegionId id, int64_t offset_bytes, int64_t bytes, const void* buffer,
                   const ParallelFor* parallel = nullptr);
  SwapHandle read(RegionId id, int64_t offset_bytes, int64_t bytes, void* buffer,
                  const ParallelFor* parallel = nullptr);
  SwapHandle write(RegionId id, const void* buffer) {
    return write(id, 0, region_bytes(id), buffer);
  }
  SwapHandle read(RegionId id, void* buffer) { return read(id, 0, region_bytes(id), buffer); }

  // fdatasync every file, and write the index when keeping files.
  void flush();
  // Clean exit: removes the files and private directories, or (keep_files)
  // flushes and keeps them. Throws IoError. REQUIRES: no I/O in flight.
  void close();

  int64_t capacity_bytes() const { return capacity_bytes_; }
  int64_t used_bytes() const;
  const SwapOptions& options() const { return options_; }
  // The private directory per swap directory, and the file in each.
  const std::vector<std::string>& store_dirs() const { return store_dirs_; }
  std::vector<std::string> file_paths() const;
  std::string index_path() const { return store_dirs_.front() + "/index"; }

 private:
  friend class SwapHandle;
  struct Region {
    std::string name;
    int64_t start_bytes = 0;  // in the logical address space
    int64_t bytes = 0;
    std::vector<uint32_t> crc;     // per block
    std::vector<uint8_t> written;  // per block: 1 once written
  };
  struct Piece {
    int file;
    int64_t file_offset_bytes;
    int64_t bytes;
  };

  SwapStore(IoEngine& engine, SwapOptions options, bool reopening);
  void create_files();
  void remove_files() noexcept;
  void write_index();
  void read_index(const std::string& path);
  // Logical range -> per-file pieces (split at stripe boundaries).
  std::vector<Piece> map(int64_t logical_offset_bytes, int64_t bytes) const;
  // The same pieces into `out` (cleared first; its capacity is kept).
  void map_into(int64_t logical_offset_bytes, int64_t bytes, std::vector<Piece>& out) const;
  // `op` on [offset, offset + xfer) of `r` from/into `p`: one request per
  // piece, collected without allocating (Note [No allocation per request]
  // in nvme/engine.cc).
  IoHandle submit_pieces(IoOp op, const Region& r, int64_t offset, int64_t xfer, std::byte* p);
  Region& region(RegionId id);
  const Region& region(RegionId id) const;
  int64_t block_len(const Region& r, int64_t block) const;
  void check_range(const Region& r, int64_t offset_bytes, int64_t bytes, const void* buffer) const;
  void finish(SwapHandle& h);  // verify a read, or undo the marks of a failed write

  IoEngine& engine_;
  SwapOptions options_;
  int64_t capacity_bytes_ = 0;
  int64_t file_bytes_ = 0;  // per file
  std::vector<std::string> store_dirs_;
  std::vector<std::string> top_dirs_;  // strata-swap.XXXXXX (Note [Swap directory layout])
  std::vector<int> lock_fds_;          // its lock, held while the store lives
  std::vector<std::string> file_paths_;
  std::vector<FileId> files_;
  bool closed_ = false;
  mutable std::mutex mu_;  // guards regions_ (the vector and the map, not block entries)
  std::vector<std::unique_ptr<Region>> regions_;
  std::map<std::string, int> by_name_;
  int64_t next_free_bytes_ = 0;
};

}  // namespace strata::nvme
