// Page-locked host memory for I/O: one large contiguous region (huge pages
// where the system allows) and a pool of fixed-size slots carved from it.
//
// Note [Why one contiguous huge-page region]
// A direct I/O of N bytes becomes a device request with one scatter-gather
// segment per physically contiguous run of its buffer. With scattered 4 KiB
// pages a 1 MiB request needs 256 segments; a virtio disk that takes 254 per
// request (this project's development machines) splits it in two, and
// adjacent requests can no longer merge into the 4 MiB the device takes.
// From 2 MiB huge pages every 1 MiB block is one segment, so a batch of
// adjacent blocks reaches the device merged. The region is also registered
// with io_uring once (fixed buffers), which saves pinning pages per I/O, and
// locked so that it is never swapped out under a DMA.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

namespace strata::nvme {

inline constexpr int64_t kHugePageBytes = int64_t(2) << 20;

struct BufferOptions {
  bool lock = true;        // mlock; where RLIMIT_MEMLOCK refuses, warn once and stay pageable
  bool huge_pages = true;  // hugetlbfs pages if reserved, else transparent huge pages (madvise)
};

// A move-only owner of one anonymous mapping, zero-filled, aligned to 2 MiB
// (huge pages) or 4 KiB. Thread-safety: the object is immutable after
// construction; the bytes are the caller's to synchronize.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  // Throws strata::OutOfMemoryError with the sizes when the mapping fails.
  explicit PinnedBuffer(int64_t bytes, const BufferOptions& options = {});
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  std::byte* data() const { return data_; }
  int64_t bytes() const { return bytes_; }  // as asked for; the mapping may be larger
  bool locked() const { return locked_; }
  // "hugetlb", "thp" (madvise accepted; the kernel may still use small pages) or "none".
  const char* huge_page_kind() const { return huge_kind_; }

 private:
  void release() noexcept;
  std::byte* data_ = nullptr;
  int64_t bytes_ = 0;
  int64_t mapped_bytes_ = 0;
  bool locked_ = false;
  const char* huge_kind_ = "none";
};

// `slots` buffers of `slot_bytes` each in one PinnedBuffer. A slot is leased
// with acquire() and returns to the pool when its Lease is destroyed; the
// holder must have waited for every I/O on it before that (Note [Buffer
// reuse] in engine.h). Thread-safety: acquire/try_acquire and Lease
// destruction may run on any threads concurrently. The pool must outlive its
// leases.
class BufferPool {
 public:
  class Lease {
   public:
    Lease() = default;
    ~Lease() { reset(); }
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;

    std::byte* data() const { return data_; }
    int64_t bytes() const { return bytes_; }
    int slot() const { return slot_; }
    explicit operator bool() const { return pool_ != nullptr; }
    void reset();  // returns the slot now

   private:
    friend class BufferPool;
    Lease(BufferPool* pool, int slot, std::byte* data, int64_t bytes)
        : pool_(pool), slot_(slot), data_(data), bytes_(bytes) {}
    BufferPool* pool_ = nullptr;
    int slot_ = -1;
    std::byte* data_ = nullptr;
    int64_t bytes_ = 0;
  };

  // REQUIRES: slot_bytes > 0 and a multiple of 4096; slots > 0.
  BufferPool(int64_t slot_bytes, int slots, const BufferOptions& options = {});
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // Blocks until a slot is free.
  Lease acquire();
  std::optional<Lease> try_acquire();

  int64_t slot_bytes() const { return slot_bytes_; }
  int slots() const { return int(slot_count_); }
  // The whole region, e.g. to register with an IoEngine.
  const PinnedBuffer& region() const { return buffer_; }

 private:
  void release(int slot);
  int64_t slot_bytes_;
  int64_t slot_count_;
  PinnedBuffer buffer_;
  std::mutex mu_;
  std::condition_variable freed_;
  std::vector<int> free_;  // guarded by mu_
};

}  // namespace strata::nvme
