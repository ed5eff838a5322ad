#include "nvme/buffer.h"

#include <errno.h>
#include <sys/mman.h>

#include <cstring>
#include <utility>

#include "nvme/file.h"
#include "nvme/io_error.h"
#include "util/errors.h"
#include "util/logging.h"
#include "util/zero_fill.h"

namespace strata::nvme {

namespace {
bool g_warned_mlock = false;

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// An anonymous mapping of `bytes` whose start is a multiple of `align`.
void* map_aligned(int64_t bytes, int64_t align) {
  const size_t total = size_t(bytes + align);
  void* raw = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t start = uintptr_t(raw);
  const uintptr_t aligned = (start + uintptr_t(align) - 1) / uintptr_t(align) * uintptr_t(align);
  if (aligned > start) ::munmap(raw, aligned - start);
  const uintptr_t end = aligned + uintptr_t(bytes);
  const uintptr_t raw_end = start + total;
  if (raw_end > end) ::munmap(reinterpret_cast<void*>(end), raw_end - end);
  return reinterpret_cast<void*>(aligned);
}
}  // namespace

PinnedBuffer::PinnedBuffer(int64_t bytes, const BufferOptions& options) : bytes_(bytes) {
  STRATA_CHECK(bytes > 0, "empty buffer");
  void* p = nullptr;
  if (options.huge_pages) {
    // Reserved hugetlbfs pages first: guaranteed 2 MiB contiguity. Most
    // systems reserve none, and the mapping fails at once.
    mapped_bytes_ = round_up(bytes, kHugePageBytes);
    p = ::mmap(nullptr, size_t(mapped_bytes_), PROT_READ | PROT_WRITE,
               MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | MAP_POPULATE, -1, 0);
    if (p != MAP_FAILED) {
      huge_kind_ = "hugetlb";
    } else {
      p = map_aligned(mapped_bytes_, kHugePageBytes);
      if (p != nullptr && ::madvise(p, size_t(mapped_bytes_), MADV_HUGEPAGE) == 0) {
        huge_kind_ = "thp";
      }
    }
  } else {
    mapped_bytes_ = round_up(bytes, kDirectAlignmentBytes);
    p = map_aligned(mapped_bytes_, kDirectAlignmentBytes);
  }
  if (p == nullptr || p == MAP_FAILED) {
    throw OutOfMemoryError(strprintf("cannot map a %s I/O buffer: %s",
                                     format_bytes(double(mapped_bytes_)).c_str(),
                                     std::strerror(errno)));
  }
  data_ = static_cast<std::byte*>(p);
  if (options.lock) {
    // mlock also faults every page in (as huge pages where madvise took).
    locked_ = ::mlock(p, size_t(mapped_bytes_)) == 0;
    if (!locked_) {
      warn_once(g_warned_mlock,
                strprintf("cannot lock a %s I/O buffer in memory (%s): raise `ulimit -l`; "
                          "continuing with pageable buffers",
                          format_bytes(double(mapped_bytes_)).c_str(), std::strerror(errno)));
    }
  }
  if (!locked_) zero_fill(p, size_t(mapped_bytes_));  // fault in now, not during I/O
  log::debug("I/O buffer: %s (%s, huge pages: %s)", format_bytes(double(mapped_bytes_)).c_str(),
             locked_ ? "locked" : "pageable", huge_kind_);
}

PinnedBuffer::~PinnedBuffer() { release(); }

void PinnedBuffer::release() noexcept {
  if (data_ != nullptr) ::munmap(data_, size_t(mapped_bytes_));  // also unlocks
  data_ = nullptr;
  bytes_ = mapped_bytes_ = 0;
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      mapped_bytes_(std::exchange(other.mapped_bytes_, 0)),
      locked_(other.locked_),
      huge_kind_(other.huge_kind_) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    mapped_bytes_ = std::exchange(other.mapped_bytes_, 0);
    locked_ = other.locked_;
    huge_kind_ = other.huge_kind_;
  }
  return *this;
}

// ---- BufferPool ---------------------------------------------------------------

BufferPool::BufferPool(int64_t slot_bytes, int slots, const BufferOptions& options)
    : slot_bytes_(slot_bytes), slot_count_(slots) {
  STRATA_CHECK(slot_bytes > 0 && slot_bytes % kDirectAlignmentBytes == 0,
               "slot_bytes must be a positive multiple of 4096");
  STRATA_CHECK(slots > 0, "a pool needs at least one slot");
  buffer_ = PinnedBuffer(slot_bytes * slots, options);
  free_.reserve(size_t(slots));
  for (int i = slots - 1; i >= 0; --i) free_.push_back(i);
}

BufferPool::Lease BufferPool::acquire() {
  std::unique_lock<std::mutex> lock(mu_);
  freed_.wait(lock, [&] { return !free_.empty(); });
  const int slot = free_.back();
  free_.pop_back();
  return Lease(this, slot, buffer_.data() + slot * slot_bytes_, slot_bytes_);
}

std::optional<BufferPool::Lease> BufferPool::try_acquire() {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty()) return std::nullopt;
  const int slot = free_.back();
  free_.pop_back();
  return Lease(this, slot, buffer_.data() + slot * slot_bytes_, slot_bytes_);
}

void BufferPool::release(int slot) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(slot);
  }
  freed_.notify_one();
}

BufferPool::Lease::Lease(Lease&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      slot_(other.slot_),
      data_(other.data_),
      bytes_(other.bytes_) {}

BufferPool::Lease& BufferPool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = std::exchange(other.pool_, nullptr);
    slot_ = other.slot_;
    data_ = other.data_;
    bytes_ = other.bytes_;
  }
  return *this;
}

void BufferPool::Lease::reset() {
  if (pool_ != nullptr) std::exchange(pool_, nullptr)->release(slot_);
}

}  // namespace strata::nvme
