#include "memory/buffer.h"

#include <sys/mman.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "util/errors.h"
#include "util/logging.h"
#include "util/zero_fill.h"

namespace strata {

namespace {
size_t host_alignment(size_t bytes) { return bytes >= kHugePageBytes ? kHugePageBytes : kPageBytes; }
size_t host_rounded(size_t bytes) {
  const size_t align = host_alignment(bytes);
  return (bytes + align - 1) / align * align;
}
}  // namespace

void* allocate_host_pages(size_t bytes) {
  // Note [Huge pages].
  const size_t align = host_alignment(bytes);
  const size_t rounded = host_rounded(bytes);
  void* p = std::aligned_alloc(align, rounded);
  if (p == nullptr) return nullptr;
  if (align == kHugePageBytes) ::madvise(p, rounded, MADV_HUGEPAGE);  // a hint only
  zero_fill(p, rounded);
  return p;
}

HostBuffer::HostBuffer(size_t bytes, const std::string& what) : bytes_(bytes) {
  if (bytes == 0) return;
  const size_t rounded = host_rounded(bytes);
  const auto start = std::chrono::steady_clock::now();
  data_ = allocate_host_pages(bytes);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (data_ == nullptr) {
    throw OutOfMemoryError("cannot allocate " + format_bytes(double(rounded)) + " of host memory for " +
                           what);
  }
  if (took >= 0.5) {  // the start-up's larger parts say what they cost
    log::info("allocated %s for %s (faulted in and zeroed in %.1f s)", format_bytes(double(rounded)).c_str(),
              what.c_str(), took);
  } else if (rounded >= (size_t(64) << 20)) {
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
