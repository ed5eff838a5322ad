// The CUDA implementation of the device layer (device.h): HBM from
// cudaMalloc, four non-blocking streams, and the completions of record() as a
// ring of events created at construction. Compiled only with the CUDA path.
//
// Note [Event ring]
// record() takes the next of kEvents events (ticket t uses slot t % kEvents).
// Before a slot is recorded again the event it held is synchronized: in a
// pipeline of a few dozen copies in flight that wait is long over, and it is
// what lets a completion that outlived its slot return at once (its work was
// done when the slot was taken) instead of waiting on someone else's work.
// The wait happens outside the device's lock (other threads record and wait
// meanwhile); while it lasts the slot still answers for its old ticket, so a
// waiter on that ticket may wait for the new work too: longer, never shorter.
#include <cuda_runtime.h>

#include <array>
#include <mutex>
#include <thread>
#include <vector>

#include "memory/device.h"
#include "util/errors.h"
#include "util/logging.h"

namespace strata {

namespace {

void check_cuda(cudaError_t err, const char* file, int line, const char* what) {
  if (err != cudaSuccess) {
    throw DeviceError(file, line, std::string(what) + ": CUDA error: " + cudaGetErrorString(err));
  }
}
#define STRATA_CUDA_CALL(expr) check_cuda((expr), __FILE__, __LINE__, #expr)

constexpr int kEvents = 4096;

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int ordinal) : ordinal_(ordinal) {
    STRATA_CUDA_CALL(cudaSetDevice(ordinal_));
    cudaDeviceProp prop{};
    STRATA_CUDA_CALL(cudaGetDeviceProperties(&prop, ordinal_));
    name_ = "cuda:" + std::to_string(ordinal_) + " (" + prop.name + ")";
    for (auto& s : streams_) STRATA_CUDA_CALL(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    events_.resize(kEvents);
    slot_ticket_.assign(kEvents, 0);
    slot_busy_.assign(kEvents, 0);
    for (cudaEvent_t& e : events_) STRATA_CUDA_CALL(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  ~CudaDevice() override {
    cudaSetDevice(ordinal_);
    for (cudaStream_t s : streams_) cudaStreamSynchronize(s);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    for (cudaStream_t s : streams_) cudaStreamDestroy(s);
  }

  std::string name() const override { return name_; }
  bool is_cuda() const override { return true; }
  int ordinal() const override { return ordinal_; }
  DeviceMemoryInfo memory_info() const override {
    select();
    size_t free = 0, total = 0;
    STRATA_CUDA_CALL(cudaMemGetInfo(&free, &total));
    return {int64_t(total), int64_t(free)};
  }

  void copy_to_device(DevicePtr dst, const void* src, int64_t bytes, Stream s) override {
    copy(dst.raw(), src, bytes, s);
  }
  void copy_to_host(void* dst, DevicePtr src, int64_t bytes, Stream s) override { copy(dst, src.raw(), bytes, s); }
  void copy_on_device(DevicePtr dst, DevicePtr src, int64_t bytes, Stream s) override {
    copy(dst.raw(), src.raw(), bytes, s);
  }
  void fill_on_device(DevicePtr dst, uint8_t value, int64_t bytes, Stream s) override {
    if (bytes <= 0) return;
    select();
    STRATA_CUDA_CALL(cudaMemsetAsync(dst.raw(), value, size_t(bytes), stream(s)));
  }

  Completion record(Stream s) override {
    select();
    cudaEvent_t e;
    uint64_t t = 0, previous = 0;
    size_t slot = 0;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        slot = size_t(next_ticket_ % kEvents);
        if (!slot_busy_[slot]) {
          t = next_ticket_++;
          previous = slot_ticket_[slot];
          slot_busy_[slot] = 1;
          e = events_[slot];
          break;
        }
      }
      std::this_thread::yield();  // kEvents records while this slot's last was being reused: practically never
    }
    // Note [Event ring]: the slot's previous work first, outside the lock.
    try {
      if (previous != 0) STRATA_CUDA_CALL(cudaEventSynchronize(e));
      STRATA_CUDA_CALL(cudaEventRecord(e, stream(s)));
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      slot_busy_[slot] = 0;
      throw;
    }
    std::lock_guard<std::mutex> lock(mu_);
    slot_ticket_[slot] = t;
    slot_busy_[slot] = 0;
    return Completion(this, t);
  }
  void stream_wait(Stream s, Completion c) override {
    if (!c.pending()) return;
    if (c.waiter() != this) {
      c.wait();  // an NVMe transfer, a collective: the host waits
      return;
    }
    cudaEvent_t e;
    if (!live_event(c.ticket(), &e)) return;
    select();
    STRATA_CUDA_CALL(cudaStreamWaitEvent(stream(s), e, 0));
  }
  void synchronize(Stream s) override {
    select();
    STRATA_CUDA_CALL(cudaStreamSynchronize(stream(s)));
  }
  void* native_stream(Stream s) const override { return streams_[size_t(s)]; }
  void make_current() const override { select(); }
  void wait_ticket(uint64_t ticket) override {
    cudaEvent_t e;
    if (!live_event(ticket, &e)) return;
    STRATA_CUDA_CALL(cudaEventSynchronize(e));
  }

 protected:
  std::byte* raw_allocate(int64_t bytes) override {
    select();
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, size_t(bytes));
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // not sticky: clear it, the caller reports the sizes
      return nullptr;
    }
    STRATA_CUDA_CALL(err);
    return static_cast<std::byte*>(p);
  }
  void raw_free(std::byte* p) noexcept override {
    cudaSetDevice(ordinal_);
    cudaFree(p);
  }
  bool register_host(void* p, int64_t bytes) override {
    select();
    if (cudaHostRegister(p, size_t(bytes), cudaHostRegisterDefault) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return true;
  }
  void unregister_host(void* p) noexcept override {
    cudaSetDevice(ordinal_);
    cudaHostUnregister(p);
  }

 private:
  void select() const { STRATA_CUDA_CALL(cudaSetDevice(ordinal_)); }
  cudaStream_t stream(Stream s) const { return streams_[size_t(s)]; }
  void copy(void* dst, const void* src, int64_t bytes, Stream s) {
    if (bytes <= 0) return;
    select();
    STRATA_CUDA_CALL(cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDefault, stream(s)));
  }
  // The event of `ticket` if its slot still holds it; false when the slot was
  // taken since (Note [Event ring]: its work is done).
  bool live_event(uint64_t ticket, cudaEvent_t* e) {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t slot = size_t(ticket % kEvents);
    if (slot_ticket_[slot] != ticket) return false;
    *e = events_[slot];
    return true;
  }

  int ordinal_;
  std::string name_;
  std::array<cudaStream_t, kNumStreams> streams_{};
  std::mutex mu_;
  std::vector<cudaEvent_t> events_;
  std::vector<uint64_t> slot_ticket_;
  std::vector<char> slot_busy_;  // per slot: a record() is reusing it (guarded by mu_)
  uint64_t next_ticket_ = 1;
};

}  // namespace

int cuda_device_count_impl() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

bool cuda_memory_info_impl(int ordinal, DeviceMemoryInfo* out) {
  size_t free = 0, total = 0;
  if (cudaSetDevice(ordinal) != cudaSuccess || cudaMemGetInfo(&free, &total) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  *out = {int64_t(total), int64_t(free)};
  return true;
}

std::unique_ptr<Device> make_cuda_device(int ordinal) { return std::make_unique<CudaDevice>(ordinal); }

}  // namespace strata
