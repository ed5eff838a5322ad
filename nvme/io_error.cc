#include "nvme/io_error.h"

#include <mutex>

#include "util/errors.h"
#include "util/logging.h"

namespace strata::nvme {

void throw_io_error(const std::string& path, int err, const std::string& what, int64_t offset_bytes,
                    int64_t bytes) {
  throw IoError(path, err, what, offset_bytes, bytes);
}

void warn_once(bool& once_flag, const std::string& message) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (once_flag) return;
  once_flag = true;
  log::warn("%s", message.c_str());
}

}  // namespace strata::nvme
