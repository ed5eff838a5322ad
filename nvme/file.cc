#include "nvme/file.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <utility>

#include "nvme/io_error.h"
#include "util/logging.h"

namespace strata::nvme {

namespace {
std::atomic<bool> g_refuse_direct{false};
bool g_warned_buffered = false;
bool g_warned_fallocate = false;

int open_fd(const std::string& path, int flags, unsigned mode) {
  if ((flags & O_DIRECT) && g_refuse_direct.load()) {
    errno = EINVAL;
    return -1;
  }
  int fd;
  do {
    fd = ::open(path.c_str(), flags, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}
}  // namespace

namespace testing {
void set_refuse_direct_open(bool refuse) { g_refuse_direct.store(refuse); }
}  // namespace testing

const char* direct_io_name(DirectIo mode) {
  switch (mode) {
    case DirectIo::kAuto:
      return "auto";
    case DirectIo::kRequire:
      return "require";
    case DirectIo::kOff:
      return "off";
  }
  return "?";
}

File::~File() {
  if (fd_ >= 0 && ::close(fd_) != 0) {
    log::warn("%s: close failed: %s", path_.c_str(), std::strerror(errno));
  }
}

File::File(File&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)), direct_(other.direct_) {}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    direct_ = other.direct_;
  }
  return *this;
}

File File::open(const std::string& path, const OpenOptions& options) {
  int flags = O_CLOEXEC | (options.write ? O_RDWR : O_RDONLY);
  bool created = false;
  if (options.create) {
    // Create exclusively first, so that only a file made here gets `mode`
    // (an existing file keeps its permissions).
    const int fd = open_fd(path, flags | O_CREAT | O_EXCL, options.mode);
    if (fd >= 0) {
      ::close(fd);
      created = true;
    } else if (errno != EEXIST || options.exclusive) {
      throw_io_error(path, errno, "cannot create");
    }
  }
  // A file created here is removed again if it cannot be opened as asked.
  try {
    int fd = -1;
    bool direct = false;
    if (options.direct != DirectIo::kOff) {
      fd = open_fd(path, flags | O_DIRECT, options.mode);
      direct = fd >= 0;
      if (fd < 0 && errno == EINVAL && options.direct == DirectIo::kAuto) {
        warn_once(g_warned_buffered,
                  path +
                      ": the file system refuses O_DIRECT; using buffered I/O (page cache) "
                      "for files there");
      } else if (fd < 0) {
        throw_io_error(
            path, errno,
            options.direct == DirectIo::kRequire ? "cannot open for direct I/O" : "cannot open");
      }
    }
    if (fd < 0) {
      fd = open_fd(path, flags, options.mode);
      if (fd < 0) throw_io_error(path, errno, "cannot open");
    }
    File file(fd, path, direct);
    // A created file gets exactly `mode`, whatever the umask.
    if (created && ::fchmod(fd, options.mode) != 0) {
      throw_io_error(path, errno, "cannot set permissions");
    }
    return file;
  } catch (...) {
    if (created) ::unlink(path.c_str());
    throw;
  }
}

int64_t File::size_bytes() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) throw_io_error(path_, errno, "cannot stat");
  return int64_t(st.st_size);
}

void File::preallocate(int64_t bytes) {
  if (bytes <= 0) return;
  int rc;
  do {
    rc = ::fallocate(fd_, 0, 0, off_t(bytes));
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return;
  if (errno == EOPNOTSUPP || errno == ENOSYS) {
    warn_once(g_warned_fallocate,
              path_ +
                  ": the file system does not support fallocate; swap files are sparse, "
                  "and direct writes into them may be slow");
    if (size_bytes() < bytes) truncate(bytes);
    return;
  }
  throw_io_error(path_, errno, "cannot preallocate", 0, bytes);
}

void File::truncate(int64_t bytes) {
  if (::ftruncate(fd_, off_t(bytes)) != 0) throw_io_error(path_, errno, "cannot truncate", bytes);
}

void File::sync() const {
  if (::fdatasync(fd_) != 0) throw_io_error(path_, errno, "cannot sync");
}

void File::drop_cache(int64_t offset_bytes, int64_t bytes) const {
  if (direct_) return;
  const off_t len = bytes > 0 ? off_t(bytes) : 0;
  if (::sync_file_range(
          fd_, off_t(offset_bytes), len,
          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER) != 0) {
    throw_io_error(path_, errno, "cannot write back cached pages", offset_bytes, bytes);
  }
  // Advisory: a file system may keep the pages (tmpfs, where they are the file).
  (void)::posix_fadvise(fd_, off_t(offset_bytes), len, POSIX_FADV_DONTNEED);
}

void File::close() {
  if (fd_ < 0) return;
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) throw_io_error(path_, errno, "cannot close");
}

}  // namespace strata::nvme
