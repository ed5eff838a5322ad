#include "util/zero_fill.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

namespace strata {

void zero_fill(void* p, size_t bytes) {
  constexpr size_t kRun = size_t(64) << 20;
  const size_t runs = (bytes + kRun - 1) / kRun;
  const size_t threads = std::min<size_t>(runs, std::max(1u, std::thread::hardware_concurrency()));
  if (runs < 4 || threads < 2) {
    std::memset(p, 0, bytes);
    return;
  }
  std::byte* base = static_cast<std::byte*>(p);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < runs;) {
      std::memset(base + i * kRun, 0, std::min(kRun, bytes - i * kRun));
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

}  // namespace strata
