// The one error style of Strata: typed exceptions, caught once in cli/, which
// prints one line and exits non-zero. Library code never calls exit().
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace strata {

// Base of every error Strata throws on purpose.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A bad configuration: the message names the full key path ("optimizer.params.lr").
class ConfigError : public Error {
 public:
  ConfigError(std::string key, const std::string& message)
      : Error(key.empty() ? message : key + ": " + message), key_(std::move(key)) {}
  const std::string& key() const { return key_; }

 private:
  std::string key_;
};

// Bad input that is not the config: a data file, a checkpoint. Names the file
// (and the offset where one applies).
class InputError : public Error {
 public:
  InputError(std::string path, const std::string& message)
      : Error(path + ": " + message), path_(std::move(path)) {}
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A failed system call on a file: path, offset, bytes and errno text.
class IoError : public Error {
 public:
  IoError(std::string path, int err, const std::string& what, int64_t offset = -1,
          int64_t bytes = -1);
  const std::string& path() const { return path_; }
  int err() const { return err_; }
  int64_t offset() const { return offset_; }

 private:
  std::string path_;
  int err_;
  int64_t offset_;
};

// A memory budget that cannot be met; the message carries the numbers.
class OutOfMemoryError : public Error {
 public:
  explicit OutOfMemoryError(const std::string& what) : Error(what) {}
};

// Communication between ranks failed: a peer lost (the message names it), a
// collective or store wait that timed out, a port already in use.
class CommError : public Error {
 public:
  explicit CommError(const std::string& what) : Error(what) {}
};

// A broken invariant: a bug in Strata, reported with file:line.
class InternalError : public Error {
 public:
  InternalError(const char* file, int line, const std::string& what);
};

// A CUDA (or NCCL) call that failed: file:line of the call and the driver's
// text. Not a bug in Strata's logic, not the user's input: the device failed.
class DeviceError : public Error {
 public:
  DeviceError(const char* file, int line, const std::string& what)
      : Error(std::string(file) + ":" + std::to_string(line) + ": " + what) {}
};

// Exit codes of the strata executable.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;    // runtime failure (I/O, internal, out of memory)
inline constexpr int kExitBadInput = 2;   // bad config, flags, data or checkpoint

// Maps an exception to the exit code cli/ returns.
int exit_code_for(const std::exception& e);

}  // namespace strata

// Fails fast on a broken invariant with file:line. Use for bugs, not for user input.
#define STRATA_CHECK(cond, msg)                                              \
  do {                                                                       \
    if (!(cond)) {                                                           \
      throw ::strata::InternalError(__FILE__, __LINE__,                     \
                                    std::string("check failed: " #cond ": ") + (msg)); \
    }                                                                        \
  } while (0)
