// The swap store's index (docs/nvme-format.md): what a store kept with
// keep_files writes beside its files, and what reopening it reads back.
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>

#include "nvme/crc32c.h"
#include "nvme/io_error.h"
#include "nvme/swap_store.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"

namespace strata::nvme {

namespace {

constexpr char kIndexMagic[8] = {'S', 'T', 'R', 'A', 'S', 'W', 'P', '1'};
constexpr uint32_t kIndexVersion = 1;
constexpr uint32_t kFlagChecksums = 1;

int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Little-endian serialization of the index (docs/nvme-format.md).
struct Writer {
  std::string out;
  void u8(uint8_t v) { out.push_back(char(v)); }
  void u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(char((v >> (8 * i)) & 0xFF));
  }
  void u64(uint64_t v) {
    for (int i = 0; i < 8; ++i) out.push_back(char((v >> (8 * i)) & 0xFF));
  }
  void str(const std::string& s) {
    u32(uint32_t(s.size()));
    out += s;
  }
};

struct Reader {
  const std::string& in;
  const std::string& path;
  size_t pos = 0;
  void need(size_t n) {
    if (in.size() - pos < n) {
      throw InputError(path, strprintf("swap index is truncated at byte %zu", pos));
    }
  }
  uint64_t uint(int bytes) {
    need(size_t(bytes));
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= uint64_t(uint8_t(in[pos + size_t(i)])) << (8 * i);
    pos += size_t(bytes);
    return v;
  }
  std::string str() {
    const size_t n = size_t(uint(4));
    need(n);
    std::string s = in.substr(pos, n);
    pos += n;
    return s;
  }
};

std::string read_whole_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw_io_error(path, errno, "cannot open swap index");
  std::string data;
  char buf[65536];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      throw_io_error(path, err, "cannot read swap index", int64_t(data.size()));
    }
    if (n == 0) break;
    data.append(buf, size_t(n));
  }
  ::close(fd);
  return data;
}

// Writes `data` to `path` atomically: temporary name, fsync, rename, fsync dir.
void write_file_atomically(const std::string& path, const std::string& data) {
  const std::string tmp = path + ".tmp";
  File f = File::open(
      tmp, OpenOptions{.write = true, .create = true, .mode = 0600, .direct = DirectIo::kOff});
  if (::ftruncate(f.fd(), 0) != 0) throw_io_error(tmp, errno, "cannot truncate");
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::pwrite(f.fd(), data.data() + done, data.size() - done, off_t(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      throw_io_error(tmp, errno, "cannot write", int64_t(done), int64_t(data.size() - done));
    done += size_t(n);
  }
  f.sync();
  f.close();
  if (::rename(tmp.c_str(), path.c_str()) != 0)
    throw_io_error(path, errno, "cannot rename " + tmp + " to");
  const int dir = ::open(parent_dir(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    (void)::fsync(dir);
    ::close(dir);
  }
}

}  // namespace

// ---- index (docs/nvme-format.md) -----------------------------------------------

void SwapStore::write_index() {
  Writer w;
  w.out.append(kIndexMagic, sizeof(kIndexMagic));
  w.u32(kIndexVersion);
  w.u32(options_.checksums ? kFlagChecksums : 0);
  w.u64(uint64_t(capacity_bytes_));
  w.u64(uint64_t(options_.stripe_bytes));
  w.u64(uint64_t(options_.block_bytes));
  w.u64(uint64_t(file_bytes_));
  std::lock_guard<std::mutex> lock(mu_);
  w.u64(uint64_t(next_free_bytes_));
  w.u32(uint32_t(file_paths_.size()));
  w.u32(uint32_t(regions_.size()));
  for (const std::string& p : file_paths_) w.str(p);
  for (const auto& r : regions_) {
    w.str(r->name);
    w.u64(uint64_t(r->start_bytes));
    w.u64(uint64_t(r->bytes));
    for (size_t k = 0; k < r->crc.size(); ++k) {
      w.u8(r->written[k]);
      w.u32(r->crc[k]);
    }
  }
  w.u32(crc32c(w.out.data(), w.out.size()));
  write_file_atomically(index_path(), w.out);
}

void SwapStore::read_index(const std::string& path) {
  const std::string data = read_whole_file(path);
  if (data.size() < sizeof(kIndexMagic) + 4 ||
      std::memcmp(data.data(), kIndexMagic, sizeof(kIndexMagic)) != 0) {
    throw InputError(path, "not a Strata swap index (bad magic)");
  }
  Reader rd{data, path};
  rd.pos = data.size() - 4;
  const uint32_t stored = uint32_t(rd.uint(4));
  if (crc32c(data.data(), data.size() - 4) != stored) {
    throw InputError(path, "swap index checksum mismatch: the index is corrupt");
  }
  rd.pos = sizeof(kIndexMagic);
  const uint32_t version = uint32_t(rd.uint(4));
  if (version != kIndexVersion) {
    throw InputError(
        path, strprintf("swap index version %u, this build reads %u", version, kIndexVersion));
  }
  options_.checksums = (rd.uint(4) & kFlagChecksums) != 0;
  capacity_bytes_ = int64_t(rd.uint(8));
  options_.stripe_bytes = int64_t(rd.uint(8));
  options_.block_bytes = int64_t(rd.uint(8));
  file_bytes_ = int64_t(rd.uint(8));
  next_free_bytes_ = int64_t(rd.uint(8));
  const uint32_t file_count = uint32_t(rd.uint(4));
  const uint32_t region_count = uint32_t(rd.uint(4));
  if (file_count == 0 || options_.block_bytes <= 0 || options_.stripe_bytes <= 0) {
    throw InputError(path, "swap index is inconsistent");
  }
  for (uint32_t i = 0; i < file_count; ++i) file_paths_.push_back(rd.str());
  for (uint32_t i = 0; i < region_count; ++i) {
    auto r = std::make_unique<Region>();
    r->name = rd.str();
    r->start_bytes = int64_t(rd.uint(8));
    r->bytes = int64_t(rd.uint(8));
    const int64_t blocks = (round_up(r->bytes, kDirectAlignmentBytes) + options_.block_bytes - 1) /
                           options_.block_bytes;
    for (int64_t k = 0; k < blocks; ++k) {
      r->written.push_back(uint8_t(rd.uint(1)));
      r->crc.push_back(uint32_t(rd.uint(4)));
    }
    by_name_[r->name] = int(regions_.size());
    regions_.push_back(std::move(r));
  }
  for (const std::string& p : file_paths_) {
    options_.dirs.push_back(parent_dir(parent_dir(p)));
    store_dirs_.push_back(parent_dir(p));
  }
  for (const std::string& p : file_paths_) {
    File f = File::open(p, OpenOptions{.write = true, .direct = options_.direct});
    const int64_t size = f.size_bytes();
    if (size < file_bytes_) {
      throw_io_error(p, 0,
                     strprintf("swap file is truncated: %lld bytes, the index says %lld",
                               (long long)size, (long long)file_bytes_));
    }
    files_.push_back(engine_.attach(std::move(f)));
  }
}

}  // namespace strata::nvme
