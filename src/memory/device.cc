// The device layer's common part and its CPU implementation (device.h).
#include "memory/device.h"

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <utility>

#include "memory/buffer.h"
#include "util/errors.h"
#include "util/logging.h"

namespace strata {

#ifdef STRATA_WITH_CUDA
// device_cuda.cc
std::unique_ptr<Device> make_cuda_device(int ordinal);
int cuda_device_count_impl();
bool cuda_memory_info_impl(int ordinal, DeviceMemoryInfo* out);
#endif

const char* stream_name(Stream s) {
  switch (s) {
    case Stream::kCompute: return "compute";
    case Stream::kH2D: return "h2d";
    case Stream::kD2H: return "d2h";
    case Stream::kComm: return "comm";
    case Stream::kStateH2D: return "state h2d";
    case Stream::kStateD2H: return "state d2h";
    case Stream::kSaveD2H: return "save d2h";
  }
  return "?";
}

// ---- owners ------------------------------------------------------------------------

DeviceBuffer::~DeviceBuffer() { release(); }

void DeviceBuffer::release() noexcept {
  if (data_ != nullptr) owner_->raw_free(data_);
  owner_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : owner_(std::exchange(o.owner_, nullptr)),
      data_(std::exchange(o.data_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    release();
    owner_ = std::exchange(o.owner_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

PinnedHostBuffer::~PinnedHostBuffer() { release(); }

void PinnedHostBuffer::release() noexcept {
  if (registered_) owner_->unregister_host(mem_.data());
  registered_ = false;
  owner_ = nullptr;
  mem_ = nvme::PinnedBuffer();
}

PinnedHostBuffer::PinnedHostBuffer(PinnedHostBuffer&& o) noexcept
    : owner_(std::exchange(o.owner_, nullptr)),
      mem_(std::move(o.mem_)),
      registered_(std::exchange(o.registered_, false)) {}

PinnedHostBuffer& PinnedHostBuffer::operator=(PinnedHostBuffer&& o) noexcept {
  if (this != &o) {
    release();
    owner_ = std::exchange(o.owner_, nullptr);
    mem_ = std::move(o.mem_);
    registered_ = std::exchange(o.registered_, false);
  }
  return *this;
}

DeviceBuffer Device::allocate(int64_t bytes, const std::string& what) {
  STRATA_CHECK(bytes >= 0, "a negative device allocation");
  if (bytes == 0) return DeviceBuffer();
  std::byte* p = raw_allocate(bytes);
  if (p == nullptr) {
    const DeviceMemoryInfo m = memory_info();
    throw OutOfMemoryError(strprintf(
        "%s: cannot allocate %s of device memory for %s (the device has %s in all, %s free); lower "
        "run.device_memory_mb or move state off the device in the placement (strata plan shows the split)",
        name().c_str(), format_bytes(double(bytes)).c_str(), what.c_str(), format_bytes(double(m.total_bytes)).c_str(),
        format_bytes(double(m.free_bytes)).c_str()));
  }
  if (bytes >= (int64_t(64) << 20)) {
    log::info("allocated %s of device memory (%s) for %s", format_bytes(double(bytes)).c_str(), name().c_str(),
              what.c_str());
  }
  return DeviceBuffer(this, p, bytes);
}

PinnedHostBuffer Device::allocate_pinned(int64_t bytes, const std::string& what) {
  STRATA_CHECK(bytes >= 0, "a negative pinned allocation");
  PinnedHostBuffer b;
  if (bytes == 0) return b;
  try {
    nvme::BufferOptions o;
    o.lock = false;  // registration locks what needs locking (CUDA)
    b.mem_ = nvme::PinnedBuffer(bytes, o);
  } catch (const OutOfMemoryError& e) {
    throw OutOfMemoryError("pinned host memory for " + what + ": " + e.what());
  }
  b.owner_ = this;
  b.registered_ = register_host(b.mem_.data(), b.mem_.bytes());
  if (!b.registered_) {
    log::warn("%s refused to register %s of pinned host memory for %s: its copies are staged by the driver",
              name().c_str(), format_bytes(double(bytes)).c_str(), what.c_str());
  }
  if (bytes >= (int64_t(64) << 20)) {
    log::info("allocated %s of %s host memory for %s", format_bytes(double(bytes)).c_str(),
              is_cuda() ? "pinned" : "transfer", what.c_str());
  }
  return b;
}

// ---- the CPU device --------------------------------------------------------------

namespace {

int64_t meminfo_bytes(const char* field) {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (f >> key >> kib >> unit) {
    if (key == field) return kib * 1024;
  }
  return -1;
}

// The device arena is host memory (budgeted by the tiered state); every
// stream runs its work inline, so a copy is done when the call returns and
// every completion has fired when it is recorded.
class CpuDevice final : public Device {
 public:
  std::string name() const override { return "cpu"; }
  bool is_cuda() const override { return false; }
  DeviceMemoryInfo memory_info() const override {
    return {meminfo_bytes("MemTotal:"), meminfo_bytes("MemAvailable:")};
  }
  void copy_to_device(DevicePtr dst, const void* src, int64_t bytes, Stream) override {
    if (bytes > 0) std::memcpy(dst.raw(), src, size_t(bytes));
  }
  void copy_to_host(void* dst, DevicePtr src, int64_t bytes, Stream) override {
    if (bytes > 0) std::memcpy(dst, src.raw(), size_t(bytes));
  }
  void copy_on_device(DevicePtr dst, DevicePtr src, int64_t bytes, Stream) override {
    if (bytes > 0) std::memmove(dst.raw(), src.raw(), size_t(bytes));
  }
  void fill_on_device(DevicePtr dst, uint8_t value, int64_t bytes, Stream) override {
    if (bytes > 0) std::memset(dst.raw(), value, size_t(bytes));
  }
  Completion record(Stream) override { return Completion(); }
  void stream_wait(Stream, Completion c) override { c.wait(); }
  void synchronize(Stream) override {}
  void* native_stream(Stream) const override { return nullptr; }
  void wait_ticket(uint64_t) override {}

 protected:
  std::byte* raw_allocate(int64_t bytes) override {
    return static_cast<std::byte*>(allocate_host_pages(size_t(bytes)));  // as HostBuffer's
  }
  void raw_free(std::byte* p) noexcept override { std::free(p); }
  bool register_host(void*, int64_t) override { return true; }
  void unregister_host(void*) noexcept override {}
};

}  // namespace

Device& cpu_device() {
  static CpuDevice device;
  return device;
}

bool built_with_cuda() {
#ifdef STRATA_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
#ifdef STRATA_WITH_CUDA
  return cuda_device_count_impl();
#else
  return 0;
#endif
}

namespace {

// The ordinal `name` names ("cuda": LOCAL_RANK's, or 0); -1 for "cpu"; throws
// ConfigError for anything else.
int cuda_ordinal(const std::string& name) {
  if (name == "cpu") return -1;
  int ordinal = -1;
  if (name == "cuda") {
    const char* local = std::getenv("LOCAL_RANK");
    const std::string v = local != nullptr ? local : "0";
    if (v.empty() || v.size() > 6 || v.find_first_not_of("0123456789") != std::string::npos) {
      throw ConfigError("run.device", "\"cuda\" takes the GPU of LOCAL_RANK, which is '" + v +
                                          "', not a number >= 0 (or name one: cuda:N)");
    }
    ordinal = std::atoi(v.c_str());
  } else if (name.rfind("cuda:", 0) == 0 && name.size() > 5 &&
             name.find_first_not_of("0123456789", 5) == std::string::npos) {
    ordinal = std::atoi(name.c_str() + 5);
  } else {
    throw ConfigError("run.device", "'" + name + "' is not a device (cpu, cuda or cuda:N)");
  }
  return ordinal;
}

}  // namespace

bool query_device_memory(const std::string& name, DeviceMemoryInfo* out) {
  int ordinal = -1;
  try {
    ordinal = cuda_ordinal(name);
  } catch (const ConfigError&) {
    return false;
  }
  if (ordinal < 0) {
    *out = cpu_device().memory_info();
    return out->total_bytes > 0;
  }
#ifdef STRATA_WITH_CUDA
  return ordinal < cuda_device_count_impl() && cuda_memory_info_impl(ordinal, out);
#else
  return false;
#endif
}

std::unique_ptr<Device> make_device(const std::string& name) {
  const int ordinal = cuda_ordinal(name);
  if (ordinal < 0) return std::make_unique<CpuDevice>();
#ifdef STRATA_WITH_CUDA
  const int n = cuda_device_count_impl();
  if (ordinal >= n) {
    throw ConfigError("run.device", strprintf("'%s': this machine has %d CUDA device(s)%s", name.c_str(), n,
                                              n == 0 ? " (or no driver)" : ""));
  }
  return make_cuda_device(ordinal);
#else
  throw ConfigError("run.device", "'" + name + "': this build of Strata has no CUDA path (configure with "
                                                "-DSTRATA_CUDA=ON on a machine with nvcc)");
#endif
}

}  // namespace strata
