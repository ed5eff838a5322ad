// Owning, page-aligned host buffers. Every large allocation is logged in MiB so
// that the memory story of a run can be read from its log.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace strata {

inline constexpr size_t kPageBytes = 4096;

// A zero-initialised host allocation aligned to kPageBytes (what O_DIRECT and
// registered io_uring buffers need). Move-only.
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
