#include "util/fs.h"

#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>

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

}  // namespace strata
