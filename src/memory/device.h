// The device layer (DESIGN.md, "The device layer"): the one place that knows
// where memory the compute device owns lives and how bytes reach it. No
// LibTorch here (engine/ makes tensors of device memory; kernels/ computes
// on it).
//
// - DevicePtr: a pointer into the device arena. Its type says which side it
//   is on; CPU code never dereferences one. Its bytes are reached through the
//   device's copies, kernels, and tensors made for the device.
// - DeviceBuffer: an owner of device memory (allocated once, at start-up).
// - PinnedHostBuffer: host memory for what crosses PCIe, registered with the
//   device (on CUDA cudaHostRegister, which page-locks it, so copies to and
//   from it are DMA without a bounce; on the CPU device plain memory); the
//   same memory can be registered with io_uring.
// - Streams: compute, H2D, D2H, communication, the state's own H2D/D2H, and
//   a checkpoint save's D2H. Work queued on one stream runs
//   in order; record() gives the Completion of everything queued on it so
//   far, stream_wait() orders a stream after a completion without blocking
//   the host.
//
// Two implementations: "cpu", where the device arena is host memory under a
// budget and a stream runs its work inline (a copy is a memcpy, done when the
// call returns), so every path runs and is tested without a GPU; and "cuda",
// with cudaMalloc'd HBM, four non-blocking CUDA streams and a pool of events
// sized at construction (nothing allocated per copy or per record).
//
// Note [Buffer reuse across streams]
// A buffer written by a copy on stream A and read by work on stream B needs
// stream_wait(B, record(A)) before B's work is queued; a buffer that goes back
// to a pool needs the completion of its last user to have fired (wait(), or a
// stream_wait of the next user's stream) before the next writer is queued.
// On CPU the completion has always fired when record() returns; on CUDA it
// fires when the GPU gets there, which is why the engine, not the device,
// keeps the completions next to the buffers they guard.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "memory/completion.h"
#include "nvme/buffer.h"

namespace strata {

// kH2D/kD2H carry the step's own copies (window fetches, landing
// gradients); kStateH2D/kStateD2H the tiered state's asynchronous transfers
// of device-tier homes (the optimizer's staging), so that those pipeline on
// their own instead of queuing behind the step's; kSaveD2H a checkpoint
// save's reads, which must not queue behind the next optimizer pass's reads
// (those wait for that step's backward).
enum class Stream : uint8_t {
  kCompute = 0, kH2D = 1, kD2H = 2, kComm = 3, kStateH2D = 4, kStateD2H = 5, kSaveD2H = 6
};
inline constexpr int kNumStreams = 7;
const char* stream_name(Stream s);

// A pointer into device memory. Arithmetic in bytes; raw() is for kernels,
// tensors made for the device, and the CPU implementation of the device.
class DevicePtr {
 public:
  DevicePtr() = default;
  explicit DevicePtr(std::byte* p) : p_(p) {}
  DevicePtr operator+(int64_t bytes) const { return DevicePtr(p_ + bytes); }
  std::byte* raw() const { return p_; }
  explicit operator bool() const { return p_ != nullptr; }
  bool operator==(const DevicePtr& o) const { return p_ == o.p_; }

 private:
  std::byte* p_ = nullptr;
};

class Device;

// Device memory, owned; freed (by the device that allocated it, which must
// outlive it) when destroyed. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  DevicePtr ptr() const { return DevicePtr(data_); }
  int64_t bytes() const { return bytes_; }

 private:
  friend class Device;
  DeviceBuffer(Device* owner, std::byte* data, int64_t bytes) : owner_(owner), data_(data), bytes_(bytes) {}
  void release() noexcept;
  Device* owner_ = nullptr;
  std::byte* data_ = nullptr;
  int64_t bytes_ = 0;
};

// Host memory for what crosses PCIe (2 MiB huge pages where the system gives
// them), zero-filled, registered with the device for its lifetime: on CUDA
// cudaHostRegister, which page-locks it; on the CPU device nothing (no DMA,
// so nothing to lock). The device must outlive it. Move-only.
class PinnedHostBuffer {
 public:
  PinnedHostBuffer() = default;
  ~PinnedHostBuffer();
  PinnedHostBuffer(PinnedHostBuffer&& o) noexcept;
  PinnedHostBuffer& operator=(PinnedHostBuffer&& o) noexcept;
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;

  std::byte* data() const { return mem_.data(); }
  int64_t bytes() const { return mem_.bytes(); }
  // Whether the device registered it (always on CPU; on CUDA unless the
  // driver refused, which is logged).
  bool registered() const { return registered_; }

 private:
  friend class Device;
  void release() noexcept;
  Device* owner_ = nullptr;
  nvme::PinnedBuffer mem_;
  bool registered_ = false;
};

struct DeviceMemoryInfo {
  int64_t total_bytes = 0;
  int64_t free_bytes = 0;
};

// Thread-safety: every member may be called from any thread. Copies queued
// on one stream from two threads run in the order they were queued; a
// record() covers everything queued on its stream so far, other threads'
// copies included (it may wait for more than its caller queued, never less).
class Device : public Waiter {
 public:
  ~Device() override = default;

  virtual std::string name() const = 0;  // "cpu", "cuda:0 (NVIDIA H100 80GB HBM3)"
  virtual bool is_cuda() const = 0;
  // Whether host code may read and write device memory (the CPU device,
  // whose arena is host memory): what lets CPU Adam, checkpoints and
  // activation copies use a device-tier home in place.
  virtual bool host_addressable() const { return !is_cuda(); }
  virtual int ordinal() const { return -1; }
  // What the device has now (CPU: the machine's RAM, MemAvailable).
  virtual DeviceMemoryInfo memory_info() const = 0;

  // Device memory of `bytes` (0 gives an empty buffer), NOT zero-filled.
  // `what` names it in the log and in the OutOfMemoryError (total, free,
  // asked) when it fails.
  DeviceBuffer allocate(int64_t bytes, const std::string& what);
  // Page-locked host memory registered with this device.
  PinnedHostBuffer allocate_pinned(int64_t bytes, const std::string& what);

  // Copies queued on `s`, in order with its other work. Both ends must stay
  // valid and untouched by others until the completion of a later record(s)
  // has fired. Host ends may be any host memory; pinned ones (or registered
  // ones) are copied without a bounce.
  virtual void copy_to_device(DevicePtr dst, const void* src, int64_t bytes, Stream s) = 0;
  virtual void copy_to_host(void* dst, DevicePtr src, int64_t bytes, Stream s) = 0;
  virtual void copy_on_device(DevicePtr dst, DevicePtr src, int64_t bytes, Stream s) = 0;
  virtual void fill_on_device(DevicePtr dst, uint8_t value, int64_t bytes, Stream s) = 0;

  // The completion of everything queued on `s` so far.
  virtual Completion record(Stream s) = 0;
  // Work queued on `s` after this call starts after `c` has fired. A
  // completion of this device does not block the host; any other (an NVMe
  // transfer, a collective) is waited for here.
  virtual void stream_wait(Stream s, Completion c) = 0;
  // Blocks until everything queued on `s` is done.
  virtual void synchronize(Stream s) = 0;
  // The stream's native handle (cudaStream_t on CUDA, for LibTorch and
  // kernels); nullptr on CPU.
  virtual void* native_stream(Stream s) const = 0;
  // Makes this device the calling thread's current one (cudaSetDevice), for
  // launches that do not go through the device (kernels/); nothing on CPU.
  virtual void make_current() const {}

 protected:
  virtual std::byte* raw_allocate(int64_t bytes) = 0;  // nullptr when out of memory
  virtual void raw_free(std::byte* p) noexcept = 0;
  virtual bool register_host(void* p, int64_t bytes) = 0;  // false when the driver refuses
  virtual void unregister_host(void* p) noexcept = 0;

 private:
  friend class DeviceBuffer;
  friend class PinnedHostBuffer;
};

// "cpu", "cuda" (device 0, or LOCAL_RANK's under a launcher; a LOCAL_RANK
// that is not a number >= 0 is a ConfigError) or "cuda:N".
// Throws ConfigError naming run.device for a name it does not know, or for a
// CUDA device this build or this machine does not have.
std::unique_ptr<Device> make_device(const std::string& name);

// What device `name` (as make_device takes it) has now, without creating the
// device (no streams, no events): for the plan. False when it cannot be
// measured here (no CUDA path in this build, no such GPU, an unknown name).
bool query_device_memory(const std::string& name, DeviceMemoryInfo* out);

// The CPU device every process can use (the default of code not given one).
Device& cpu_device();

// How many CUDA devices this process sees (0 in a build without CUDA, or
// where the driver has none); never throws.
int cuda_device_count();
bool built_with_cuda();

}  // namespace strata
