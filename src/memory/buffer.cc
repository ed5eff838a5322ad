#include "memory/buffer.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "util/errors.h"
#include "util/logging.h"

namespace strata {

HostBuffer::HostBuffer(size_t bytes, const std::string& what) : bytes_(bytes) {
  if (bytes == 0) return;
  // Note [Huge pages].
  const size_t align = bytes >= kHugePageBytes ? kHugePageBytes : kPageBytes;
  const size_t rounded = (bytes + align - 1) / align * align;
  data_ = std::aligned_alloc(align, rounded);
  if (data_ != nullptr && align == kHugePageBytes) ::madvise(data_, rounded, MADV_HUGEPAGE);  // a hint only
  if (data_ == nullptr) {
    throw OutOfMemoryError("cannot allocate " + format_bytes(double(rounded)) + " of host memory for " +
                           what);
  }
  std::memset(data_, 0, rounded);
  if (rounded >= (size_t(64) << 20)) {
    log::info("allocated %s for %s", format_bytes(double(rounded)).c_str(), what.c_str());
  } else {
    log::debug("allocated %s for %s", format_bytes(double(rounded)).c_str(), what.c_str());
  }
}

HostBuffer::~HostBuffer() { std::free(data_); }

HostBuffer::HostBuffer(HostBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}

HostBuffer& HostBuffer::operator=(HostBuffer&& o) noexcept {
  if (this != &o) {
    std::free(data_);
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

}  // namespace strata
