// Tests of the device layer (memory/device.h), each on the CPU device and on
// CUDA device 0. The CUDA cases skip, naming why, in a build without the CUDA
// path or on a machine without a GPU; they never count as passed there.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "config/config.h"
#include "memory/device.h"
#include "memory/tiered_state.h"
#include "plan/make_plan.h"
#include "deferred_device.h"
#include "util/errors.h"

namespace strata {
namespace {

std::unique_ptr<Device> open_or_skip(const std::string& name, std::string* why) {
  if (name == "cpu") return make_device("cpu");
  if (!built_with_cuda()) {
    *why = "this build has no CUDA path";
    return nullptr;
  }
  if (cuda_device_count() == 0) {
    *why = "no CUDA device on this machine";
    return nullptr;
  }
  return make_device(name);
}

class DeviceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string why;
    device_ = open_or_skip(GetParam(), &why);
    if (!device_) GTEST_SKIP() << why;
  }
  std::unique_ptr<Device> device_;
};

// A byte pattern no copy of a different offset reproduces.
std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  uint32_t x = seed;
  for (auto& b : v) {
    x = x * 1664525u + 1013904223u;
    b = uint8_t(x >> 24);
  }
  return v;
}

TEST_P(DeviceTest, CopiesOnStreamsOrderedByCompletionsRoundTrip) {
  Device& d = *device_;
  const int64_t n = (int64_t(5) << 20) + 123;  // not a multiple of anything
  DeviceBuffer a = d.allocate(n, "test a");
  DeviceBuffer b = d.allocate(2 * n, "test b");
  ASSERT_EQ(a.bytes(), n);
  const std::vector<uint8_t> src = pattern(size_t(n), 7);
  PinnedHostBuffer staging = d.allocate_pinned(n, "test staging");
  std::memcpy(staging.data(), src.data(), size_t(n));

  // H2D into a; the compute stream copies a into the second half of b and
  // fills the first half; D2H copies b back. Each stream waits for the last.
  d.copy_to_device(a.ptr(), staging.data(), n, Stream::kH2D);
  d.stream_wait(Stream::kCompute, d.record(Stream::kH2D));
  d.fill_on_device(b.ptr(), 0xA5, n, Stream::kCompute);
  d.copy_on_device(b.ptr() + n, a.ptr(), n, Stream::kCompute);
  d.stream_wait(Stream::kD2H, d.record(Stream::kCompute));
  std::vector<uint8_t> out(size_t(2 * n), 0);
  d.copy_to_host(out.data(), b.ptr(), 2 * n, Stream::kD2H);
  Completion done = d.record(Stream::kD2H);
  done.wait();
  EXPECT_FALSE(done.pending());
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(out[size_t(i)], 0xA5) << "fill, byte " << i;
  }
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(out[size_t(n + i)], src[size_t(i)]) << "copy, byte " << i;
  }
}

TEST_P(DeviceTest, AllocationsAreZeroedOrEmptyAndOutOfMemoryNamesTheBuffer) {
  Device& d = *device_;
  DeviceBuffer empty = d.allocate(0, "nothing");
  EXPECT_FALSE(empty.ptr());
  EXPECT_EQ(empty.bytes(), 0);

  const DeviceMemoryInfo m = d.memory_info();
  EXPECT_GT(m.total_bytes, 0);
  EXPECT_GT(m.free_bytes, 0);
  EXPECT_LE(m.free_bytes, m.total_bytes);
#if defined(__SANITIZE_ADDRESS__)
  if (!d.is_cuda()) GTEST_SKIP() << "AddressSanitizer aborts on a 1 EiB malloc instead of returning null";
#endif
  try {
    // Far more than the machine (or the address space) has.
    DeviceBuffer huge = d.allocate(int64_t(1) << 60, "an impossible arena");
    FAIL() << "allocated 1 EiB";
  } catch (const OutOfMemoryError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("an impossible arena"), std::string::npos) << what;
    EXPECT_NE(what.find("in all"), std::string::npos) << what;
    EXPECT_NE(what.find("run.device_memory_mb"), std::string::npos) << what;
  }
  // The device still works after the refusal. The CPU device's memory is
  // zeroed (as HostBuffer's); cudaMalloc's is not, so on CUDA the check is a
  // fill and a read back.
  DeviceBuffer ok = d.allocate(4096, "after");
  if (d.is_cuda()) d.fill_on_device(ok.ptr(), 0, 4096, Stream::kD2H);
  std::vector<uint8_t> out(4096, 1);
  d.copy_to_host(out.data(), ok.ptr(), 4096, Stream::kD2H);
  d.record(Stream::kD2H).wait();
  EXPECT_EQ(std::count(out.begin(), out.end(), uint8_t(0)), 4096);
}

TEST_P(DeviceTest, PinnedHostMemoryIsRegisteredZeroedAndMovable) {
  Device& d = *device_;
  PinnedHostBuffer p = d.allocate_pinned((int64_t(3) << 20) + 5, "test pinned");
  ASSERT_NE(p.data(), nullptr);
  EXPECT_TRUE(p.registered());
  for (int64_t i = 0; i < p.bytes(); i += 4093) ASSERT_EQ(p.data()[i], std::byte{0});
  std::byte* raw = p.data();
  PinnedHostBuffer q = std::move(p);
  EXPECT_EQ(q.data(), raw);
  EXPECT_EQ(p.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
  q = PinnedHostBuffer();
  EXPECT_EQ(q.data(), nullptr);
}

// A stream ordered after a completion that is not the device's (an NVMe
// transfer, a collective) waits for it on the host.
class CountingWaiter final : public Waiter {
 public:
  void wait_ticket(uint64_t ticket) override { waited.push_back(ticket); }
  std::vector<uint64_t> waited;
};

TEST_P(DeviceTest, StreamWaitOnAnotherOwnersCompletionWaitsForIt) {
  Device& d = *device_;
  CountingWaiter io;
  d.stream_wait(Stream::kH2D, Completion(&io, 42));
  ASSERT_EQ(io.waited.size(), 1u);
  EXPECT_EQ(io.waited[0], 42u);
  d.stream_wait(Stream::kH2D, Completion());  // a fired one: nothing
  EXPECT_EQ(io.waited.size(), 1u);
}

// More records than the event ring has slots: a completion whose slot was
// taken since returns at once (its work was done), and the newest still
// orders the host after its copy.
TEST_P(DeviceTest, OldCompletionsOutliveTheEventRing) {
  Device& d = *device_;
  const int64_t n = 1 << 20;
  DeviceBuffer a = d.allocate(n, "ring a");
  const std::vector<uint8_t> src = pattern(size_t(n), 3);
  Completion first = d.record(Stream::kH2D);
  Completion last;
  for (int i = 0; i < 10000; ++i) {
    d.copy_to_device(a.ptr(), src.data(), n / 16, Stream::kH2D);
    last = d.record(Stream::kH2D);
  }
  first.wait();
  d.copy_to_device(a.ptr(), src.data(), n, Stream::kH2D);
  d.stream_wait(Stream::kD2H, d.record(Stream::kH2D));
  std::vector<uint8_t> out(static_cast<size_t>(n), 0);
  d.copy_to_host(out.data(), a.ptr(), n, Stream::kD2H);
  last.wait();
  d.synchronize(Stream::kD2H);
  EXPECT_EQ(out, src);
}

INSTANTIATE_TEST_SUITE_P(Devices, DeviceTest, ::testing::Values(std::string("cpu"), std::string("cuda:0")),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           return i.param == "cpu" ? std::string("cpu") : std::string("cuda");
                         });

// The tiered state on a device host code may not touch: device-tier homes
// are not handed to host code, only to kernels (resident_on_device), and
// reads and writes go through the device's copies and are done when they
// return, though the device defers them.
TEST(TieredStateOnADevice, DeviceTierGoesThroughTheDevicesCopiesAndIsDoneOnReturn) {
  std::vector<std::pair<std::string, std::vector<ParamSpec>>> blocks;
  for (int b = 0; b < 4; ++b) blocks.push_back({"block." + std::to_string(b), {{"w", {128, 128}, Init::kNormal, 0.02}}});
  StateLayout layout(blocks, 1);
  nlohmann::json j = {{"data", {{"path", "unused.txt"}}}, {"zero_optimization", {{"sub_group_size", 16384}}}};
  const Config cfg = parse_config(j, {});
  const PlacementPlan plan = make_plan(cfg, layout, 0, MachineCapacity{});
  testing::DeferredDevice dev;
  TieredStateOptions so;
  so.device = &dev;
  TieredState st(plan, so);
  EXPECT_EQ(&st.device(), &dev);
  const PlacementUnit& u = plan.state.units[size_t(Category::kMaster)][1];
  ASSERT_EQ(u.tier, Tier::kDevice);
  EXPECT_EQ(st.resident(Category::kMaster, u.offset, u.numel), nullptr);
  const DevicePtr home = st.resident_on_device(Category::kMaster, u.offset, u.numel);
  ASSERT_TRUE(home);

  std::vector<float> in(size_t(u.numel)), out(size_t(u.numel), -1.0f);
  for (size_t i = 0; i < in.size(); ++i) in[i] = float(i) * 0.25f + 1.0f;
  st.write(Category::kMaster, u.offset, u.numel, in.data());
  EXPECT_EQ(dev.queued(), 0u) << "write returned with copies not done";
  // The bytes are in device memory, at the home kernels get.
  std::vector<float> direct(size_t(u.numel), 0.0f);
  dev.copy_to_host(direct.data(), home, u.numel * 4, Stream::kD2H);
  dev.record(Stream::kD2H).wait();
  EXPECT_EQ(direct, in);
  st.read(Category::kMaster, u.offset, u.numel, out.data());
  EXPECT_EQ(dev.queued(), 0u) << "read returned with copies not done";
  EXPECT_EQ(out, in);
}

TEST(DeviceNames, UnknownOrAbsentDevicesAreConfigErrorsNamingRunDevice) {
  for (const char* bad : {"gpu", "cuda:", "cuda:x", "cuda:-1", "CPU"}) {
    try {
      make_device(bad);
      FAIL() << bad << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.key(), "run.device") << bad;
    }
  }
  // A CUDA device past the last one (or any, without the CUDA path or a GPU).
  const std::string past = "cuda:" + std::to_string(cuda_device_count());
  try {
    make_device(past);
    FAIL() << past << " was accepted";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key(), "run.device");
    EXPECT_NE(std::string(e.what()).find(past), std::string::npos) << e.what();
  }
  // "cuda" takes LOCAL_RANK's GPU: a LOCAL_RANK that is not a number is named.
  const char* saved = std::getenv("LOCAL_RANK");
  const std::string keep = saved != nullptr ? saved : "";
  for (const char* bad : {"-1", "x", ""}) {
    ::setenv("LOCAL_RANK", bad, 1);
    try {
      make_device("cuda");
      FAIL() << "LOCAL_RANK=" << bad << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("LOCAL_RANK"), std::string::npos) << e.what();
    }
  }
  if (saved != nullptr) {
    ::setenv("LOCAL_RANK", keep.c_str(), 1);
  } else {
    ::unsetenv("LOCAL_RANK");
  }
  EXPECT_EQ(make_device("cpu")->name(), "cpu");
  EXPECT_EQ(&cpu_device(), &cpu_device());
  EXPECT_EQ(cpu_device().native_stream(Stream::kCompute), nullptr);
  EXPECT_STREQ(stream_name(Stream::kComm), "comm");
}

}  // namespace
}  // namespace strata
