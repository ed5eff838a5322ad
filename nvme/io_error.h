// The one place where an errno becomes an exception in nvme/: every failed
// system call and every failed asynchronous operation goes through here, so
// each IoError names the path, the offset, the byte count and the errno text.
#pragma once

#include <cstdint>
#include <string>

namespace strata::nvme {

// Throws strata::IoError(path, err, what, offset, bytes). `err` is a positive
// errno value (0 where no system call failed, e.g. a checksum mismatch).
[[noreturn]] void throw_io_error(const std::string& path, int err, const std::string& what,
                                 int64_t offset_bytes = -1, int64_t bytes = -1);

// Logs `message` as a warning the first time it is called with the same
// `once_flag` in this process, and never again. For fallbacks that would
// otherwise warn on every file or every operation.
void warn_once(bool& once_flag, const std::string& message);

}  // namespace strata::nvme
