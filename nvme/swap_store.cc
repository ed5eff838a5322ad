#include "nvme/swap_store.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <dirent.h>
#include <ftw.h>
#include <sys/file.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "nvme/crc32c.h"
#include "nvme/io_error.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"

namespace strata::nvme {

namespace {

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

}  // namespace

// ---- SwapHandle -------------------------------------------------------------

void SwapHandle::wait() {
  if (store_ == nullptr) return io_.wait();
  if (finished_) {
    if (error_) std::rethrow_exception(error_);
    return;
  }
  finished_ = true;
  try {
    store_->finish(*this);
  } catch (...) {
    error_ = std::current_exception();
    throw;
  }
}

// ---- SwapStore --------------------------------------------------------------

SwapStore::SwapStore(IoEngine& engine, SwapOptions options)
    : SwapStore(engine, std::move(options), false) {}

SwapStore::SwapStore(IoEngine& engine, SwapOptions options, bool reopening)
    : engine_(engine), options_(std::move(options)) {
  const SwapOptions& o = options_;
  if (o.block_bytes <= 0 || o.block_bytes % kDirectAlignmentBytes != 0) {
    throw ConfigError("swap.block_bytes", strprintf("must be a positive multiple of 4096, got %lld",
                                                    (long long)o.block_bytes));
  }
  if (o.stripe_bytes <= 0 || o.stripe_bytes % o.block_bytes != 0) {
    throw ConfigError("swap.stripe_bytes",
                      strprintf("must be a positive multiple of block_bytes (%lld), got %lld",
                                (long long)o.block_bytes, (long long)o.stripe_bytes));
  }
  if (reopening) return;
  if (o.dirs.empty()) throw ConfigError("nvme_path", "no swap directory given");
  if (o.capacity_bytes <= 0) throw ConfigError("swap.capacity_bytes", "must be positive");
  const int64_t dirs = int64_t(o.dirs.size());
  capacity_bytes_ = round_up(o.capacity_bytes, o.stripe_bytes * dirs);
  file_bytes_ = capacity_bytes_ / dirs;
  create_files();
}

void SwapStore::create_files() {
  // Everything that can be checked is checked before anything is created.
  std::map<dev_t, std::pair<int64_t, std::string>> need;  // device -> bytes needed, a dir on it
  for (const std::string& dir : options_.dirs) {
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0) throw_io_error(dir, errno, "swap directory is not usable");
    if (!S_ISDIR(st.st_mode)) throw_io_error(dir, ENOTDIR, "swap directory is not a directory");
    auto& n = need[st.st_dev];
    n.first += file_bytes_;
    n.second = dir;
  }
  for (const auto& [dev, n] : need) {
    struct statvfs vfs;
    if (::statvfs(n.second.c_str(), &vfs) != 0)
      throw_io_error(n.second, errno, "cannot query free space");
    const int64_t avail = int64_t(vfs.f_bavail) * int64_t(vfs.f_frsize);
    if (avail < n.first) {
      throw_io_error(
          n.second, ENOSPC,
          strprintf("not enough free space for the swap store: it needs %s, %s are free",
                    format_bytes(double(n.first)).c_str(), format_bytes(double(avail)).c_str()));
    }
  }
  try {
    for (size_t d = 0; d < options_.dirs.size(); ++d) {
      std::string tmpl = options_.dirs[d] + "/strata-swap.XXXXXX";
      if (::mkdtemp(tmpl.data()) == nullptr) {  // mode 0700
        throw_io_error(options_.dirs[d], errno, "swap directory is not writable");
      }
      if (::chmod(tmpl.c_str(), 0700) != 0) throw_io_error(tmpl, errno, "cannot set permissions");
      if (options_.rank >= 0) {
        // Note [Swap directory layout]: lock first, then make it visible.
        top_dirs_.push_back(tmpl);
        const std::string pending = tmpl + "/lock.new";
        const int fd = ::open(pending.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0) throw_io_error(pending, errno, "cannot create the swap lock");
        lock_fds_.push_back(fd);
        if (::flock(fd, LOCK_EX | LOCK_NB) != 0) throw_io_error(pending, errno, "cannot lock the swap directory");
        if (::rename(pending.c_str(), (tmpl + "/lock").c_str()) != 0) {
          throw_io_error(pending, errno, "cannot rename the swap lock");
        }
        tmpl += "/rank" + std::to_string(options_.rank);
        if (::mkdir(tmpl.c_str(), 0700) != 0) throw_io_error(tmpl, errno, "cannot create the rank's swap directory");
      }
      store_dirs_.push_back(tmpl);
      const std::string path = tmpl + "/swap." + std::to_string(d);
      File f = File::open(path, OpenOptions{.write = true,
                                            .create = true,
                                            .exclusive = true,
                                            .mode = 0600,
                                            .direct = options_.direct});
      file_paths_.push_back(path);
      f.preallocate(file_bytes_);
      files_.push_back(engine_.attach(std::move(f)));
    }
  } catch (...) {
    remove_files();
    throw;
  }
  log::info("swap store: %s in %zu file(s) under %s%s",
            format_bytes(double(capacity_bytes_)).c_str(), file_paths_.size(),
            options_.dirs.front().c_str(), options_.dirs.size() > 1 ? " and others" : "");
}

std::unique_ptr<SwapStore> SwapStore::reopen(IoEngine& engine, const std::string& index_path,
                                             DirectIo direct) {
  SwapOptions o;
  o.direct = direct;
  o.keep_files = true;
  std::unique_ptr<SwapStore> store(new SwapStore(engine, o, true));
  try {
    store->read_index(index_path);
  } catch (...) {
    // Leave the kept files and index exactly as they are.
    for (FileId id : store->files_) engine.detach(id);
    store->files_.clear();
    store->closed_ = true;
    throw;
  }
  return store;
}

SwapStore::~SwapStore() {
  try {
    close();
  } catch (const std::exception& e) {
    log::error("swap store: %s", e.what());
  }
}

void SwapStore::close() {
  if (closed_) return;
  closed_ = true;
  if (options_.keep_files) {
    flush();
    for (FileId id : files_) engine_.detach(id).close();
    files_.clear();
    log::info("swap store kept: %s", index_path().c_str());
  } else {
    remove_files();
  }
}

void SwapStore::remove_files() noexcept {
  for (FileId id : files_) engine_.detach(id);  // closes
  files_.clear();
  for (const std::string& p : file_paths_) {
    if (::unlink(p.c_str()) != 0 && errno != ENOENT) {
      log::warn("%s: cannot remove swap file: %s", p.c_str(), std::strerror(errno));
    }
  }
  for (const std::string& d : store_dirs_) {
    (void)::unlink((d + "/index").c_str());
    (void)::unlink((d + "/index.tmp").c_str());
    if (::rmdir(d.c_str()) != 0 && errno != ENOENT) {
      log::warn("%s: cannot remove swap directory: %s", d.c_str(), std::strerror(errno));
    }
  }
  // The lock goes last: until then no other run may reclaim the directory.
  for (const std::string& t : top_dirs_) {
    (void)::unlink((t + "/lock").c_str());
    (void)::unlink((t + "/lock.new").c_str());
    if (::rmdir(t.c_str()) != 0 && errno != ENOENT) {
      log::warn("%s: cannot remove swap directory: %s", t.c_str(), std::strerror(errno));
    }
  }
  for (int fd : lock_fds_) ::close(fd);
  lock_fds_.clear();
}

namespace {
int64_t g_tree_bytes = 0;
int add_size(const char*, const struct stat* st, int type, struct FTW*) {
  if (type == FTW_F) g_tree_bytes += int64_t(st->st_blocks) * 512;
  return 0;
}
int remove_entry(const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }
}  // namespace

std::vector<ReclaimedSwap> reclaim_abandoned_swap(const std::string& dir) {
  std::vector<ReclaimedSwap> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  std::vector<std::string> candidates;
  while (const dirent* e = ::readdir(d)) {
    if (std::strncmp(e->d_name, "strata-swap.", 12) == 0) candidates.push_back(dir + "/" + e->d_name);
  }
  ::closedir(d);
  std::sort(candidates.begin(), candidates.end());
  for (const std::string& top : candidates) {
    const std::string lock = top + "/lock";
    const int fd = ::open(lock.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;  // no lock file: not ours to judge
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      ::close(fd);  // held by a live run
      continue;
    }
    g_tree_bytes = 0;
    ::nftw(top.c_str(), add_size, 16, FTW_PHYS);
    const int64_t bytes = g_tree_bytes;
    const int rc = ::nftw(top.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    ::close(fd);
    if (rc != 0) {
      log::warn("%s: cannot remove an abandoned swap directory: %s", top.c_str(), std::strerror(errno));
      continue;
    }
    out.push_back({top, bytes});
  }
  return out;
}

void SwapStore::flush() {
  for (FileId id : files_) engine_.file(id).sync();
  if (options_.keep_files) write_index();
}

RegionId SwapStore::add_region(const std::string& name, int64_t bytes) {
  STRATA_CHECK(bytes > 0, "region '" + name + "' is empty");
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_CHECK(by_name_.count(name) == 0, "region '" + name + "' exists");
  const int64_t start = round_up(next_free_bytes_, options_.block_bytes);
  const int64_t padded = round_up(bytes, kDirectAlignmentBytes);
  if (start + padded > capacity_bytes_) {
    throw_io_error(store_dirs_.front(), ENOSPC,
                   strprintf("swap store full: region '%s' needs %s, %s of %s are free",
                             name.c_str(), format_bytes(double(padded)).c_str(),
                             format_bytes(double(capacity_bytes_ - start)).c_str(),
                             format_bytes(double(capacity_bytes_)).c_str()));
  }
  auto r = std::make_unique<Region>();
  r->name = name;
  r->start_bytes = start;
  r->bytes = bytes;
  const int64_t blocks = (padded + options_.block_bytes - 1) / options_.block_bytes;
  r->crc.assign(size_t(blocks), 0);
  r->written.assign(size_t(blocks), 0);
  next_free_bytes_ = start + padded;
  regions_.push_back(std::move(r));
  by_name_[name] = int(regions_.size()) - 1;
  return RegionId{int(regions_.size()) - 1};
}

RegionId SwapStore::find(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? RegionId{} : RegionId{it->second};
}

SwapStore::Region& SwapStore::region(RegionId id) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_CHECK(id.index >= 0 && size_t(id.index) < regions_.size(), "no such region");
  return *regions_[size_t(id.index)];
}
const SwapStore::Region& SwapStore::region(RegionId id) const {
  return const_cast<SwapStore*>(this)->region(id);
}

int64_t SwapStore::region_bytes(RegionId id) const { return region(id).bytes; }
const std::string& SwapStore::region_name(RegionId id) const { return region(id).name; }

int64_t SwapStore::used_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_free_bytes_;
}

std::vector<std::string> SwapStore::file_paths() const { return file_paths_; }

std::vector<SwapStore::Piece> SwapStore::map(int64_t logical, int64_t bytes) const {
  std::vector<Piece> pieces;
  map_into(logical, bytes, pieces);
  return pieces;
}

void SwapStore::map_into(int64_t logical, int64_t bytes, std::vector<Piece>& pieces) const {
  pieces.clear();
  const int64_t stripe = options_.stripe_bytes;
  const int64_t dirs = int64_t(files_.size());
  while (bytes > 0) {
    const int64_t s = logical / stripe;
    const int64_t within = logical % stripe;
    const int64_t n = std::min(bytes, stripe - within);
    const int file = int(s % dirs);
    const int64_t offset = (s / dirs) * stripe + within;
    if (!pieces.empty() && pieces.back().file == file &&
        pieces.back().file_offset_bytes + pieces.back().bytes == offset) {
      pieces.back().bytes += n;  // one directory: stripes are contiguous
    } else {
      pieces.push_back({file, offset, n});
    }
    logical += n;
    bytes -= n;
  }
}

IoHandle SwapStore::submit_pieces(IoOp op, const Region& r, int64_t offset, int64_t xfer, std::byte* p) {
  thread_local std::vector<Piece> pieces;
  thread_local std::vector<IoRequest> requests;
  map_into(r.start_bytes + offset, xfer, pieces);
  requests.clear();
  int64_t done = 0;
  for (const Piece& piece : pieces) {
    requests.push_back({op, files_[size_t(piece.file)], piece.file_offset_bytes, piece.bytes, p + done});
    done += piece.bytes;
  }
  return engine_.submit(requests);
}

int64_t SwapStore::block_len(const Region& r, int64_t block) const {
  const int64_t padded = round_up(r.bytes, kDirectAlignmentBytes);
  return std::min(options_.block_bytes, padded - block * options_.block_bytes);
}

void SwapStore::check_range(const Region& r, int64_t offset, int64_t bytes,
                            const void* buffer) const {
  STRATA_CHECK(!closed_, "swap store is closed");
  STRATA_CHECK(offset >= 0 && bytes > 0 && offset + bytes <= r.bytes,
               strprintf("region '%s': range [%lld, %lld) outside its %lld bytes", r.name.c_str(),
                         (long long)offset, (long long)(offset + bytes), (long long)r.bytes));
  STRATA_CHECK(offset % options_.block_bytes == 0 &&
                   (bytes % options_.block_bytes == 0 || offset + bytes == r.bytes),
               strprintf("region '%s': range [%lld, %lld) is not made of whole %lld-byte blocks",
                         r.name.c_str(), (long long)offset, (long long)(offset + bytes),
                         (long long)options_.block_bytes));
  STRATA_CHECK(uintptr_t(buffer) % uintptr_t(kDirectAlignmentBytes) == 0,
               "region '" + r.name + "': buffer is not 4096-aligned");
}

namespace {

// Blocks per checksum chunk: what one thread checksums at a time (192 KiB of
// 4 KiB blocks; crc32c_blocks, Note [Folding CRC] in crc32c.cc).
constexpr int64_t kChecksumChunkBlocks = 48;

// The CRC-32C of blocks [0, blocks) of `data` (the last one `last_len`
// bytes) into crc[0..], chunk by chunk, on `parallel`'s threads or this one.
struct ChecksumJob {
  const std::byte* data;
  int64_t blocks, block_bytes, last_len;
  uint32_t* crc;
  static void chunk(void* self, int64_t begin, int64_t end) {
    const auto& j = *static_cast<const ChecksumJob*>(self);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t k = c * kChecksumChunkBlocks, n = std::min(kChecksumChunkBlocks, j.blocks - k);
      const int64_t bytes = (n - 1) * j.block_bytes + (k + n == j.blocks ? j.last_len : j.block_bytes);
      crc32c_blocks(j.data + k * j.block_bytes, size_t(bytes), size_t(j.block_bytes), j.crc + k);
    }
  }
};

// Verifies blocks [0, blocks) of `data` against want[0..]: the lowest
// mismatching block in `bad` (blocks when none), each chunk checked whole.
struct VerifyJob {
  const std::byte* data;
  int64_t blocks, block_bytes, last_len;
  const uint32_t* want;
  std::atomic<int64_t> bad;
  static void chunk(void* self, int64_t begin, int64_t end) {
    auto& j = *static_cast<VerifyJob*>(self);
    uint32_t got[kChecksumChunkBlocks];
    for (int64_t c = begin; c < end; ++c) {
      const int64_t k = c * kChecksumChunkBlocks, n = std::min(kChecksumChunkBlocks, j.blocks - k);
      const int64_t bytes = (n - 1) * j.block_bytes + (k + n == j.blocks ? j.last_len : j.block_bytes);
      crc32c_blocks(j.data + k * j.block_bytes, size_t(bytes), size_t(j.block_bytes), got);
      for (int64_t i = 0; i < n; ++i) {
        if (got[i] == j.want[k + i]) continue;
        int64_t seen = j.bad.load();
        while (k + i < seen && !j.bad.compare_exchange_weak(seen, k + i)) {
        }
        break;
      }
    }
  }
};

void run_chunks(const ParallelFor* parallel, int64_t blocks, ParallelFor::Body body, void* job) {
  const int64_t chunks = (blocks + kChecksumChunkBlocks - 1) / kChecksumChunkBlocks;
  if (parallel != nullptr && chunks > 1) {
    parallel->run(chunks, body, job);
  } else {
    body(job, 0, chunks);
  }
}

}  // namespace

SwapHandle SwapStore::write(RegionId id, int64_t offset, int64_t bytes, const void* buffer,
                            const ParallelFor* parallel) {
  Region& r = region(id);
  check_range(r, offset, bytes, buffer);
  const int64_t xfer = round_up(offset + bytes, kDirectAlignmentBytes) - offset;
  const auto* p = static_cast<const std::byte*>(buffer);
  const int64_t first = offset / options_.block_bytes;
  const int64_t blocks = (xfer + options_.block_bytes - 1) / options_.block_bytes;
  if (options_.checksums && blocks > 0) {
    ChecksumJob job{p, blocks, options_.block_bytes, block_len(r, first + blocks - 1), &r.crc[size_t(first)]};
    run_chunks(parallel, blocks, &ChecksumJob::chunk, &job);
  }
  for (int64_t k = 0; k < blocks; ++k) r.written[size_t(first + k)] = 1;
  SwapHandle h;
  h.io_ = submit_pieces(IoOp::kWrite, r, offset, xfer, const_cast<std::byte*>(p));
  h.store_ = this;
  h.op_ = IoOp::kWrite;
  h.region_ = id.index;
  h.offset_bytes_ = offset;
  h.bytes_ = xfer;
  h.buffer_ = p;
  return h;
}

SwapHandle SwapStore::read(RegionId id, int64_t offset, int64_t bytes, void* buffer,
                           const ParallelFor* parallel) {
  Region& r = region(id);
  check_range(r, offset, bytes, buffer);
  const int64_t xfer = round_up(offset + bytes, kDirectAlignmentBytes) - offset;
  const int64_t first = offset / options_.block_bytes;
  const int64_t blocks = (xfer + options_.block_bytes - 1) / options_.block_bytes;
  for (int64_t k = 0; k < blocks; ++k) {
    if (!r.written[size_t(first + k)]) {
      const int64_t at = (first + k) * options_.block_bytes;
      const Piece piece = map(r.start_bytes + at, block_len(r, first + k)).front();
      throw_io_error(
          file_paths_[size_t(piece.file)], ENODATA,
          strprintf("region '%s': read of bytes [%lld, %lld) that were never written",
                    r.name.c_str(), (long long)at, (long long)(at + block_len(r, first + k))),
          piece.file_offset_bytes, block_len(r, first + k));
    }
  }
  auto* p = static_cast<std::byte*>(buffer);
  SwapHandle h;
  h.io_ = submit_pieces(IoOp::kRead, r, offset, xfer, p);
  h.store_ = this;
  h.op_ = IoOp::kRead;
  h.region_ = id.index;
  h.offset_bytes_ = offset;
  h.bytes_ = xfer;
  h.buffer_ = p;
  h.parallel_ = parallel;
  return h;
}

void SwapStore::finish(SwapHandle& h) {
  Region& r = region(RegionId{h.region_});
  const int64_t first = h.offset_bytes_ / options_.block_bytes;
  const int64_t blocks = (h.bytes_ + options_.block_bytes - 1) / options_.block_bytes;
  if (!h.io_.wait_ok()) {
    // A failed write leaves the blocks with unknown contents: forget them, so
    // that a later read fails (ENODATA) instead of returning stale bytes.
    if (h.op_ == IoOp::kWrite) {
      for (int64_t k = 0; k < blocks; ++k) r.written[size_t(first + k)] = 0;
    }
    h.io_.wait();  // throws the engine's error
  }
  if (h.op_ != IoOp::kRead || !options_.checksums || blocks == 0) return;
  VerifyJob job{h.buffer_, blocks, options_.block_bytes, block_len(r, first + blocks - 1), &r.crc[size_t(first)],
                {blocks}};
  run_chunks(h.parallel_, blocks, &VerifyJob::chunk, &job);
  const int64_t k = job.bad.load();
  if (k == blocks) return;
  const int64_t len = block_len(r, first + k);
  const uint32_t got = crc32c(h.buffer_ + k * options_.block_bytes, size_t(len));
  const int64_t at = (first + k) * options_.block_bytes;
  const Piece piece = map(r.start_bytes + at, len).front();
  throw_io_error(file_paths_[size_t(piece.file)], 0,
                 strprintf("checksum mismatch in swap region '%s' at region offset %lld "
                           "(crc32c 0x%08x, expected 0x%08x): the file was modified or the "
                           "device returned corrupt data",
                           r.name.c_str(), (long long)at, got, r.crc[size_t(first + k)]),
                 piece.file_offset_bytes, len);
}

}  // namespace strata::nvme
