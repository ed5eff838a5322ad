#include "util/errors.h"

#include <cstring>

namespace strata {

namespace {
std::string io_message(const std::string& path, int err, const std::string& what, int64_t offset,
                       int64_t bytes) {
  std::string msg = path + ": " + what;
  if (offset >= 0) msg += " at offset " + std::to_string(offset);
  if (bytes >= 0) msg += " (" + std::to_string(bytes) + " bytes)";
  if (err != 0) msg += ": " + std::string(std::strerror(err));
  return msg;
}
}  // namespace

IoError::IoError(std::string path, int err, const std::string& what, int64_t offset, int64_t bytes)
    : Error(io_message(path, err, what, offset, bytes)), path_(std::move(path)), err_(err),
      offset_(offset) {}

InternalError::InternalError(const char* file, int line, const std::string& what)
    : Error(std::string(file) + ":" + std::to_string(line) + ": internal error: " + what) {}

int exit_code_for(const std::exception& e) {
  if (dynamic_cast<const ConfigError*>(&e) || dynamic_cast<const InputError*>(&e)) {
    return kExitBadInput;
  }
  return kExitFailure;
}

}  // namespace strata
