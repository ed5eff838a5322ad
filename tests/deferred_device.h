// A test device (device_test, step_test): host memory that host code may not
// touch in place, whose copy streams run their work only when a completion
// of the stream is waited for or the stream is synchronized — a GPU's
// asynchrony, without a GPU. A copy the engine forgets to order or wait for
// leaves stale bytes where it reads, and its memory starts as 0xFF bytes,
// never zero, as a GPU's may. Its compute stream runs work at once:
// the compute is LibTorch on the CPU, which does not wait either (its
// tensors are CPU tensors of the device's memory: torch_device() is kCPU).
// Thread-safe, as the Device contract asks (the trainer's optimizer thread).
#pragma once

#include <array>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "memory/device.h"

namespace strata::testing {

class DeferredDevice final : public Device {
 public:
  std::string name() const override { return "deferred"; }
  bool is_cuda() const override { return false; }
  bool host_addressable() const override { return false; }
  DeviceMemoryInfo memory_info() const override { return {int64_t(1) << 34, int64_t(1) << 33}; }
  void copy_to_device(DevicePtr dst, const void* src, int64_t bytes, Stream s) override {
    queue(s, [=] { if (bytes > 0) std::memcpy(dst.raw(), src, size_t(bytes)); });
  }
  void copy_to_host(void* dst, DevicePtr src, int64_t bytes, Stream s) override {
    queue(s, [=] { if (bytes > 0) std::memcpy(dst, src.raw(), size_t(bytes)); });
  }
  void copy_on_device(DevicePtr dst, DevicePtr src, int64_t bytes, Stream s) override {
    queue(s, [=] { if (bytes > 0) std::memmove(dst.raw(), src.raw(), size_t(bytes)); });
  }
  void fill_on_device(DevicePtr dst, uint8_t value, int64_t bytes, Stream s) override {
    queue(s, [=] { if (bytes > 0) std::memset(dst.raw(), value, size_t(bytes)); });
  }
  Completion record(Stream s) override {
    std::lock_guard<std::mutex> lock(mu_);
    marks_[++tickets_] = {int(s), ops_[size_t(s)].size()};
    return Completion(this, tickets_);
  }
  void stream_wait(Stream, Completion c) override { c.wait(); }  // a host wait: stricter than needed
  void synchronize(Stream s) override {
    std::lock_guard<std::mutex> lock(mu_);
    run(int(s), ops_[size_t(s)].size());
  }
  void* native_stream(Stream) const override { return nullptr; }
  void wait_ticket(uint64_t t) override {
    std::lock_guard<std::mutex> lock(mu_);
    const std::pair<int, size_t> m = marks_.at(t);  // kept: copies of a completion wait again
    run(m.first, m.second);
  }
  // Work of the test's own queued on `s` (not a copy): runs when the stream
  // is waited for, in order with its copies (tests/deferred_collectives.h).
  void enqueue(Stream s, std::function<void()> op) {
    std::lock_guard<std::mutex> lock(mu_);
    ops_[size_t(s)].push_back(std::move(op));
  }
  // Copies queued and not yet run.
  size_t queued() const {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = 0;
    for (int s = 0; s < kNumStreams; ++s) n += ops_[size_t(s)].size() - done_[size_t(s)];
    return n;
  }
  // Copies queued on the copy streams (H2D, D2H, comm) so far.
  size_t copies() const {
    std::lock_guard<std::mutex> lock(mu_);
    return copies_;
  }

 protected:
  // Filled with 0xFF (NaN as floats), as device memory is not zeroed: a read
  // of bytes nothing wrote shows.
  std::byte* raw_allocate(int64_t bytes) override {
    auto* p = static_cast<std::byte*>(std::malloc(size_t(bytes)));
    if (p != nullptr) std::memset(p, 0xFF, size_t(bytes));
    return p;
  }
  void raw_free(std::byte* p) noexcept override { std::free(p); }
  bool register_host(void*, int64_t) override { return true; }
  void unregister_host(void*) noexcept override {}

 private:
  void queue(Stream s, std::function<void()> op) {
    std::lock_guard<std::mutex> lock(mu_);
    if (s == Stream::kCompute) {
      op();  // in order with the compute, which runs at once
      return;
    }
    ++copies_;
    ops_[size_t(s)].push_back(std::move(op));
  }
  void run(int s, size_t through) {
    while (done_[size_t(s)] < through) ops_[size_t(s)][done_[size_t(s)]++]();
  }
  mutable std::mutex mu_;
  std::array<std::vector<std::function<void()>>, kNumStreams> ops_;
  std::array<size_t, kNumStreams> done_{};
  std::map<uint64_t, std::pair<int, size_t>> marks_;
  uint64_t tickets_ = 0;
  size_t copies_ = 0;
};

}  // namespace strata::testing
