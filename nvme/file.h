// An owned file descriptor for the I/O engine: opened with O_DIRECT where the
// file system allows it, preallocated, and closed exactly once.
#pragma once

#include <cstdint>
#include <string>

namespace strata::nvme {

// Offsets, lengths and buffer addresses of direct I/O are multiples of this.
// 4 KiB covers every logical block size in use (512 B and 4 KiB sectors) and
// the page size, which registered io_uring buffers need.
inline constexpr int64_t kDirectAlignmentBytes = 4096;

// Whether a file is opened for direct I/O (bypassing the page cache).
enum class DirectIo {
  kAuto,     // O_DIRECT; buffered with one warning where the file system refuses it (EINVAL)
  kRequire,  // O_DIRECT or an IoError
  kOff,      // buffered
};
const char* direct_io_name(DirectIo mode);

struct OpenOptions {
  bool write = false;      // O_RDWR, else O_RDONLY
  bool create = false;     // O_CREAT with `mode`
  bool exclusive = false;  // with create: O_EXCL (fail if it exists)
  unsigned mode = 0600;    // permission bits of a file created here (exactly: umask ignored)
  DirectIo direct = DirectIo::kAuto;
};

// A move-only owner of one open file descriptor and the path it was opened
// from (for error messages). Thread-safety: const methods may be called from
// several threads; open/close/move need external synchronization.
class File {
 public:
  File() = default;
  ~File();  // closes, logging (not throwing) a failure
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  // Opens `path`; see DirectIo for the fallback. Throws IoError naming the path.
  static File open(const std::string& path, const OpenOptions& options);

  bool valid() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  // True when the descriptor has O_DIRECT: offsets, lengths and buffers of
  // every I/O must then be multiples of kDirectAlignmentBytes.
  bool direct() const { return direct_; }

  int64_t size_bytes() const;
  // Allocates blocks for [0, bytes) (fallocate), so that later direct writes
  // neither grow the file nor allocate. Throws IoError (ENOSPC when the file
  // system is full). Where fallocate is unsupported, extends with ftruncate
  // and warns once.
  void preallocate(int64_t bytes);
  void truncate(int64_t bytes);
  // fdatasync.
  void sync() const;
  // Writes back and evicts the page-cache pages of [offset, offset + bytes)
  // (bytes <= 0: to the end of the file), so that the next read comes from
  // the device. A no-op for direct files.
  void drop_cache(int64_t offset_bytes = 0, int64_t bytes = 0) const;
  // Closes now, throwing IoError if close(2) fails (the destructor only logs).
  void close();

 private:
  File(int fd, std::string path, bool direct) : fd_(fd), path_(std::move(path)), direct_(direct) {}
  int fd_ = -1;
  std::string path_;
  bool direct_ = false;
};

namespace testing {
// Fault injection: while set, opening with O_DIRECT fails with EINVAL as on a
// file system without direct I/O, so tests can reach the buffered fallback.
void set_refuse_direct_open(bool refuse);
}  // namespace testing

}  // namespace strata::nvme
