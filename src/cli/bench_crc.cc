// `strata bench-crc`: the swap store hashes every block it writes and verifies
// every block it reads (run.swap_checksums, docs/config.md), on CPU Adam's
// threads, so the checksum's rate per thread is part of every NVMe step's CPU
// time (docs/design.md, "The step's bound"). On the same buffers, rep by rep
// interleaved (memory bandwidth on shared machines swings minute to minute,
// so only same-run ratios mean anything), on one thread:
//   roof          a pass summing the buffer's 64-bit words: the read a
//                 checksum cannot avoid;
//   <impl>        crc32c_blocks_with(impl) for each implementation the CPU
//                 has (Note [Folding CRC] in nvme/crc32c.cc), the fastest
//                 being the one the swap store uses;
// each over a buffer past the caches ("memory") and over one that stays in
// cache, repeated to the same bytes ("cache"). Reports medians in GB/s.
#include "cli/bench_crc.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/bench_stats.h"
#include "nvme/crc32c.h"
#include "util/errors.h"
#include "util/logging.h"

namespace strata {
namespace {

using nvme::BlockCrc;

struct BenchCrcOptions {
  int64_t bytes = int64_t(1) << 30;  // the buffer past the caches
  int64_t cache_bytes = 256 << 10;   // the one in cache
  int64_t block = 4096;
  int reps = 9;
  bool json = false;
};

// Defeats dead-code elimination of the roof's sum and the CRCs.
volatile uint64_t g_sink = 0;

uint64_t sum_words(const unsigned char* p, int64_t bytes) {
  const auto* w = reinterpret_cast<const uint64_t*>(p);
  uint64_t a = 0, b = 0, c = 0, d = 0;
  const int64_t n = bytes / 8;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a += w[i];
    b += w[i + 1];
    c += w[i + 2];
    d += w[i + 3];
  }
  for (; i < n; ++i) a += w[i];
  return a + b + c + d;
}

void run_bench_crc(const BenchCrcOptions& o) {
  if (o.bytes % o.block != 0 || o.cache_bytes % o.block != 0) {
    throw ConfigError("--bytes", "bench-crc: --bytes and --cache-bytes must be multiples of --block (" +
                                     std::to_string(o.block) + ")");
  }
  auto alloc = [](int64_t bytes) {
    void* p = std::aligned_alloc(4096, size_t((bytes + 4095) / 4096 * 4096));
    if (p == nullptr) {
      throw OutOfMemoryError("bench-crc: cannot allocate " + format_bytes(double(bytes)) + "; try a smaller --bytes");
    }
    return std::unique_ptr<unsigned char, decltype(&std::free)>(static_cast<unsigned char*>(p), &std::free);
  };
  auto big = alloc(o.bytes), small = alloc(o.cache_bytes);
  uint64_t x = 0x9E3779B97F4A7C15ull;  // any bytes; not zeros, which a CPU may treat specially
  auto fill = [&x](unsigned char* p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>((x = x * 6364136223846793005ull + 1) >> 56);
  };
  fill(big.get(), o.bytes);
  fill(small.get(), o.cache_bytes);
  std::vector<uint32_t> out(size_t(std::max(o.bytes, o.cache_bytes) / o.block + 1));

  std::vector<BlockCrc> impls;
  for (BlockCrc i : {BlockCrc::kFold512, BlockCrc::kFold256, BlockCrc::kThreeChains, BlockCrc::kSoftware}) {
    if (nvme::block_crc_available(i)) impls.push_back(i);
  }
  struct Variant {
    std::string name;
    std::vector<double> memory, cache;  // GB/s per rep
  };
  std::vector<Variant> v;
  v.push_back({"roof", {}, {}});
  for (BlockCrc i : impls) v.push_back({nvme::block_crc_name(i), {}, {}});
  auto timed = [](auto fn) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  const int64_t cache_reps = std::max<int64_t>(1, o.bytes / o.cache_bytes);
  auto run = [&](size_t k, const unsigned char* p, int64_t bytes) {
    if (k == 0) {
      g_sink = g_sink + sum_words(p, bytes);
    } else {
      nvme::crc32c_blocks_with(impls[k - 1], p, size_t(bytes), size_t(o.block), out.data());
      g_sink = g_sink + out[0];
    }
  };
  for (int r = -1; r < o.reps; ++r) {  // rep -1 warms up (page faults, frequency)
    for (size_t k = 0; k < v.size(); ++k) {
      const double sm = timed([&] { run(k, big.get(), o.bytes); });
      const double sc = timed([&] {
        for (int64_t c = 0; c < cache_reps; ++c) run(k, small.get(), o.cache_bytes);
      });
      if (r < 0) continue;
      v[k].memory.push_back(double(o.bytes) / sm / 1e9);
      v[k].cache.push_back(double(cache_reps * o.cache_bytes) / sc / 1e9);
    }
  }
  const BlockCrc best = nvme::block_crc_best();
  const double roof_m = median(v[0].memory), roof_c = median(v[0].cache);
  if (o.json) {
    nlohmann::json j;
    j["bytes"] = o.bytes;
    j["cache_bytes"] = o.cache_bytes;
    j["block"] = o.block;
    j["reps"] = o.reps;
    j["used"] = nvme::block_crc_name(best);
    for (const auto& x : v) {
      j["variants"].push_back({{"name", x.name},
                               {"memory_gbps", median(x.memory)},
                               {"cache_gbps", median(x.cache)},
                               {"memory_vs_roof", median(x.memory) / roof_m},
                               {"cache_vs_roof", median(x.cache) / roof_c}});
    }
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("bench-crc: CRC-32C per %lld-byte block, one thread, %s from memory, %s in cache; medians of %d "
              "reps; the swap store uses %s\n",
              static_cast<long long>(o.block), format_bytes(double(o.bytes)).c_str(),
              format_bytes(double(o.cache_bytes)).c_str(), o.reps, nvme::block_crc_name(best));
  std::printf("%-14s %12s %9s %12s %9s\n", "variant", "memory GB/s", "/ roof", "cache GB/s", "/ roof");
  for (const auto& x : v) {
    std::printf("%-14s %12.2f %9.2f %12.2f %9.2f\n", x.name.c_str(), median(x.memory), median(x.memory) / roof_m,
                median(x.cache), median(x.cache) / roof_c);
  }
}

}  // namespace

void register_bench_crc(CLI::App& app) {
  auto opts = std::make_shared<BenchCrcOptions>();
  CLI::App* sub = app.add_subcommand(
      "bench-crc", "Time each CRC-32C implementation of the swap checksums against a memory read roof (one thread)");
  sub->add_option("--bytes", opts->bytes, "Buffer past the caches, bytes")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{4096}, int64_t{1} << 40));
  sub->add_option("--cache-bytes", opts->cache_bytes, "Buffer that stays in cache, bytes")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{4096}, int64_t{1} << 30));
  sub->add_option("--block", opts->block, "Checksum block, bytes (the swap store's: 4096)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{64}, int64_t{1} << 24));
  sub->add_option("--reps", opts->reps, "Timed repetitions of each variant (medians)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  sub->add_flag("--json", opts->json, "Print one JSON object instead of the table");
  sub->callback([opts] { run_bench_crc(*opts); });
}

}  // namespace strata
