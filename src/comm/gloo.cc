// The Gloo process group (CPU ranks). The only file that includes gloo's
// headers (ProcessGroupGloo.hpp inlines code against them; REFERENCE.md).
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <chrono>

#include "comm/c10d_backend.h"
#include "util/logging.h"

namespace strata::detail {

namespace {
bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}
}  // namespace

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const RankInfo& who, const CommOptions& options) {
  auto opts = c10d::ProcessGroupGloo::Options::create(
      std::chrono::milliseconds(int64_t(options.timeout_s * 1000.0)));
  // c10d's C++ API does not read GLOO_SOCKET_IFNAME (its Python wrapper does).
  if (!options.socket_ifname.empty()) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(options.socket_ifname));
  } else if (is_loopback(who.master_addr)) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  opts->threads = std::max(1, options.threads);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, who.rank, who.world_size, opts);
}

}  // namespace strata::detail
