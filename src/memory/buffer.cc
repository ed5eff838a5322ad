#include "memory/buffer.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstddef>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "util/errors.h"
#include "util/logging.h"

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
  // Zeroing faults every page in. One thread did it at about 5 GB/s on the
  // H200 host (110 GiB of host tier: 22 s of start-up, BENCHMARKS.md "GPU,
  // round 2"); large buffers are zeroed on every core, in runs of whole huge pages.
  constexpr size_t kRun = size_t(64) << 20;
  if (rounded < 4 * kRun) {
    std::memset(p, 0, rounded);
  } else {
    std::byte* base = static_cast<std::byte*>(p);
    tbb::parallel_for(tbb::blocked_range<size_t>(0, (rounded + kRun - 1) / kRun, 1),
                      [&](const tbb::blocked_range<size_t>& r) {
                        for (size_t i = r.begin(); i < r.end(); ++i) {
                          std::memset(base + i * kRun, 0, std::min(kRun, rounded - i * kRun));
                        }
                      });
  }
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
