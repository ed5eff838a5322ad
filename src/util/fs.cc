#include "util/fs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>

#include "util/errors.h"

namespace strata {

bool path_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string parent_dir(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

void make_dirs(const std::string& path, unsigned mode) {
  if (path.empty() || is_directory(path)) return;
  make_dirs(parent_dir(path), mode);
  if (::mkdir(path.c_str(), mode) != 0 && errno != EEXIST) {
    throw IoError(path, errno, "cannot create directory");
  }
}

void remove_file(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    throw IoError(path, errno, "cannot remove file");
  }
}

namespace {
int remove_entry(const char* path, const struct stat*, int type, struct FTW*) {
  const int rc = type == FTW_DP ? ::rmdir(path) : ::unlink(path);
  return rc != 0 && errno != ENOENT ? errno : 0;
}
}  // namespace

void remove_tree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    throw IoError(path, errno, "cannot remove");
  }
  if (!S_ISDIR(st.st_mode)) return remove_file(path);
  const int rc = ::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
  if (rc != 0) throw IoError(path, rc > 0 ? rc : errno, "cannot remove directory tree");
}

std::vector<std::string> list_dir(const std::string& path) {
  DIR* d = ::opendir(path.c_str());
  if (d == nullptr) throw IoError(path, errno, "cannot list directory");
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

void rename_path(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) throw IoError(from, errno, "cannot rename to " + to);
}

void sync_dir(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw IoError(path, errno, "cannot open directory to sync it");
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw IoError(path, err, "cannot sync directory");
}

std::string file_contents(const std::string& path) {
  if (is_directory(path)) throw InputError(path, "is a directory, expected a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path, std::string("cannot read: ") + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw InputError(path, "cannot read");
  return text.str();
}

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) throw IoError(tmp, errno, "cannot create");
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw IoError(tmp, err, "cannot write");
    }
    done += size_t(n);
  }
  const bool synced = ::fsync(fd) == 0;
  int err = errno;
  const bool closed = ::close(fd) == 0;
  if (synced && !closed) err = errno;
  if (!synced || !closed) {
    ::unlink(tmp.c_str());
    throw IoError(tmp, err, "cannot sync");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw IoError(tmp, err, "cannot rename to " + path);
  }
  sync_dir(parent_dir(path));
}

}  // namespace strata
