// Owning, page-aligned host buffers. Every large allocation is logged in MiB so
// that the memory story of a run can be read from its log.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace strata {

inline constexpr size_t kPageBytes = 4096;

inline constexpr size_t kHugePageBytes = size_t(2) << 20;

// A zero-initialised host allocation aligned to kPageBytes (what O_DIRECT and
// registered io_uring buffers need). Move-only.
//
// Note [Huge pages]
// One of kHugePageBytes or more is aligned to, and rounded up to, 2 MiB and
// asks for transparent huge pages (madvise; not pinned, not locked). Besides
// fewer TLB misses, an O_DIRECT transfer from 4 KiB pages is a scatter list
// of 1024 pieces per 4 MiB, which the block layer splits at the device's
// max_segments into requests of about 1 MiB; from huge pages it is a few
// pieces and reaches the device as the 4 MiB request that Note [Batching]
// (nvme/engine.h) counts on. On the development VM's virtual disk this is
// the difference between 0.5 and 2.5 GB/s for checkpoint and swap writes.
// The allocation behind a HostBuffer (Note [Huge pages]): zero-filled,
// aligned and rounded as the Note says; nullptr when the system refuses.
// Freed with std::free. Also the CPU device's device memory.
void* allocate_host_pages(size_t bytes);

class HostBuffer {
 public:
  HostBuffer() = default;
  // `what` names the buffer in the log line and in an out-of-memory error.
  HostBuffer(size_t bytes, const std::string& what);
  ~HostBuffer();
  HostBuffer(HostBuffer&& o) noexcept;
  HostBuffer& operator=(HostBuffer&& o) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace strata
