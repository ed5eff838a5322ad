// The NCCL seam on the test device (Note [Device collectives] in
// comm/device_collectives.h): each collective queued on the deferred
// device's comm stream and run, over a Gloo group on the device's memory in
// place, only when that stream is waited for or synchronized — as NCCL's
// kernels run when the GPU gets there. A reader that forgets to order itself
// after the collective's completion reads what the buffer held before.
#pragma once

#include "deferred_device.h"
#include "comm/device_collectives.h"

namespace strata::testing {

class DeferredStreamCollectives final : public StreamCollectives {
 public:
  DeferredStreamCollectives(DeferredDevice& device, CollectiveGroup& group) : device_(device), group_(group) {}
  void all_gather(DevicePtr in, DevicePtr out, int64_t count, DType t) override {
    queue([=](CollectiveGroup& g) { g.all_gather(in.raw(), out.raw(), count, t).wait(); });
  }
  void reduce_scatter(DevicePtr in, DevicePtr out, int64_t count, DType t) override {
    queue([=](CollectiveGroup& g) { g.reduce_scatter(in.raw(), out.raw(), count, t).wait(); });
  }
  void all_reduce(DevicePtr buf, int64_t count, DType t) override {
    queue([=](CollectiveGroup& g) { g.all_reduce(buf.raw(), count, t, ReduceOp::kSum).wait(); });
  }

 private:
  // After a failed collective the rest are dropped, as a failed NCCL
  // communicator's are: the group is not used again.
  template <typename Fn>
  void queue(Fn fn) {
    CollectiveGroup* g = &group_;
    bool* failed = &failed_;
    device_.enqueue(Stream::kComm, [g, failed, fn] {
      if (*failed) return;
      try {
        fn(*g);
      } catch (...) {
        *failed = true;
        throw;
      }
    });
  }
  bool failed_ = false;  // touched by the thread running the stream's work, under the device's lock
  DeferredDevice& device_;
  CollectiveGroup& group_;
};

}  // namespace strata::testing
