#include "nvme/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace strata::nvme {

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

// Slicing-by-8 tables: table[k][b] is the CRC of byte b followed by k zero bytes.
struct Tables {
  uint32_t t[8][256];
  constexpr Tables() : t{} {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][b] = c;
    }
    for (int k = 1; k < 8; ++k) {
      for (uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
    }
  }
};
constexpr Tables kTables;

// GF(2) polynomial arithmetic modulo the (reflected) polynomial, for combine:
// crc(A||B) = crc(A) * x^(8*len(B)) + crc(B).
uint32_t mult_mod_p(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(2^k) mod p for k = 0..63.
struct PowerTable {
  std::array<uint32_t, 64> x2n{};
  PowerTable() {
    uint32_t p = 1u << 30;  // x^1
    for (auto& v : x2n) {
      v = p;
      p = mult_mod_p(p, p);
    }
  }
};

// x^(8 * bytes) mod p.
uint32_t x8n_mod_p(size_t bytes) {
  static const PowerTable table;
  uint32_t p = 1u << 31;  // x^0
  size_t n = bytes;
  unsigned k = 3;  // 8 = 2^3
  while (n != 0) {
    if (n & 1) p = mult_mod_p(table.x2n[k & 63], p);
    n >>= 1;
    ++k;
  }
  return p;
}

// x^n mod p, for the folding constants.
uint32_t xn_mod_p(uint64_t n) {
  uint32_t p = 1u << 31;   // x^0
  uint32_t sq = 1u << 30;  // x^(2^k), from x^1
  for (; n != 0; n >>= 1) {
    if (n & 1) p = mult_mod_p(sq, p);
    sq = mult_mod_p(sq, sq);
  }
  return p;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t hw_stream(uint32_t c, const unsigned char* p, size_t n) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = _mm_crc32_u64(c64, v);
    p += 8;
    n -= 8;
  }
  c = uint32_t(c64);
  while (n > 0) {
    c = _mm_crc32_u8(c, *p++);
    --n;
  }
  return c;
}

// Multiplication by one constant K modulo p, by table: the product is linear
// in the other factor, so it is the XOR of K x (each byte in its place),
// looked up. Built once for the lane length of a 4 KiB block (the swap store's
// checksum unit), where the bitwise combine would cost 8x the CRC itself.
struct ShiftTable {
  size_t lane = 0;
  uint32_t t[4][256];
  explicit ShiftTable(size_t lane_bytes) : lane(lane_bytes) {
    const uint32_t k = x8n_mod_p(lane_bytes);
    for (int i = 0; i < 4; ++i) {
      for (uint32_t b = 0; b < 256; ++b) t[i][b] = mult_mod_p(k, b << (8 * i));
    }
  }
  uint32_t times(uint32_t v) const {
    return t[0][v & 0xFF] ^ t[1][(v >> 8) & 0xFF] ^ t[2][(v >> 16) & 0xFF] ^ t[3][v >> 24];
  }
};

// Advances three CRC chains over [p0, p0 + n), [p1, ...), [p2, ...); n a
// multiple of 8. Independent chains hide the instruction's 3-cycle latency.
__attribute__((target("sse4.2"))) inline void three_chains(const unsigned char* p0, const unsigned char* p1,
                                                           const unsigned char* p2, size_t n, uint64_t& c0,
                                                           uint64_t& c1, uint64_t& c2) {
  for (size_t i = 0; i < n; i += 8) {
    uint64_t v0, v1, v2;
    std::memcpy(&v0, p0 + i, 8);
    std::memcpy(&v1, p1 + i, 8);
    std::memcpy(&v2, p2 + i, 8);
    c0 = _mm_crc32_u64(c0, v0);
    c1 = _mm_crc32_u64(c1, v1);
    c2 = _mm_crc32_u64(c2, v2);
  }
}

// One buffer as three lanes, combined.
__attribute__((target("sse4.2"))) uint32_t hw_3way(uint32_t c, const unsigned char* p, size_t n) {
  constexpr size_t kMinBytes = 3 * 1024;
  if (n < kMinBytes) return hw_stream(c, p, n);
  const size_t lane = n / 3 / 8 * 8;
  const unsigned char* p1 = p + lane;
  const unsigned char* p2 = p + 2 * lane;
  uint64_t c0 = c, c1 = 0xFFFFFFFFu, c2 = 0xFFFFFFFFu;  // c1, c2: fresh CRCs (pre-inverted)
  three_chains(p, p1, p2, lane, c0, c1, c2);
  // Finalized CRCs of the lanes, combined: crc(A||B) = crc(A) x^8|B| + crc(B).
  uint32_t crc = ~uint32_t(c0);
  static const ShiftTable k4096(4096 / 3 / 8 * 8);
  if (lane == k4096.lane) {
    crc = k4096.times(crc) ^ ~uint32_t(c1);
    crc = k4096.times(crc) ^ ~uint32_t(c2);
  } else {
    const uint32_t k = x8n_mod_p(lane);
    crc = mult_mod_p(k, crc) ^ ~uint32_t(c1);
    crc = mult_mod_p(k, crc) ^ ~uint32_t(c2);
  }
  return hw_stream(~crc, p + 3 * lane, n - 3 * lane);
}
// Three whole blocks side by side: independent CRCs, so no combine, and
// three sequential streams the hardware prefetcher follows.
__attribute__((target("sse4.2"))) void hw_blocks3(const unsigned char* p, size_t blk, uint32_t* out) {
  const unsigned char* p1 = p + blk;
  const unsigned char* p2 = p + 2 * blk;
  uint64_t c0 = 0xFFFFFFFFu, c1 = 0xFFFFFFFFu, c2 = 0xFFFFFFFFu;
  const size_t i = blk / 8 * 8;
  three_chains(p, p1, p2, i, c0, c1, c2);
  out[0] = ~hw_stream(uint32_t(c0), p + i, blk - i);
  out[1] = ~hw_stream(uint32_t(c1), p1 + i, blk - i);
  out[2] = ~hw_stream(uint32_t(c2), p2 + i, blk - i);
}

// Note [Folding CRC]
// A block's CRC by carry-less multiplication (VPCLMULQDQ), its bytes taken
// as a polynomial over GF(2) as the CRC takes them: the CRC is the block's
// polynomial D times x^32 mod P, and only D mod P matters. In a 128-bit lane
// loaded from memory the CRC's bit order is reflected: bit i is the
// coefficient of x^(127 - i). Splitting a lane into H (its low quadword,
// the high-degree half) and L, H x^64 + L moved d bits further on is
//   H x^(d + 64) + L x^d  =  H (x^(d + 63) mod P) x + L (x^(d - 1) mod P) x (mod P)
// and the carry-less product of two reflected quadwords is their product
// times x, so each lane folds over the next data lane d bits on with two
// multiplications by 32-bit constants (placed in the quadword's high half,
// their reflected degree 0 at bit 63) and an XOR, staying within 96 bits.
// Several accumulators (vectors of lanes) fold by their combined width d, so
// the multiplications of one do not wait for another's; at the end they fold
// into one vector F by its width, and as D mod P = F mod P, the CRC of the
// block is the crc32 instruction's CRC of F's bytes (from 0), with the CRC's
// initial ~0 XORed into the block's first four bytes beforehand (what
// starting the register at ~0 does) and the final inversion after. Reading
// the block front to back as one stream keeps the hardware prefetcher ahead:
// with 512-bit vectors, at the memory read roof on the dev VM, twice the
// three crc32 chains over three blocks, and 1.9x them in cache
// (BENCHMARKS.md, "Swap checksums"; `strata bench-crc`). Crc32cTest in
// tests/nvme_test.cc checks every implementation against the table.

struct FoldConstants {
  uint64_t by256[2], by512[2], by1024[2];  // {H's, L's} constants for d bits
  FoldConstants() {
    auto make = [](uint64_t d, uint64_t* k) {
      k[0] = uint64_t(xn_mod_p(d + 63)) << 32;
      k[1] = uint64_t(xn_mod_p(d - 1)) << 32;
    };
    make(256, by256);
    make(512, by512);
    make(1024, by1024);
  }
};
const FoldConstants& fold_constants() {
  static const FoldConstants k;
  return k;
}

// One block, 512-bit vectors: two accumulators 128 bytes apart.
// REQUIRES: blk a multiple of 128, blk > 0.
__attribute__((target("avx512f,avx512bw,avx512vl,vpclmulqdq,sse4.2"))) uint32_t fold512_block(
    const unsigned char* p, size_t blk) {
  const FoldConstants& c = fold_constants();
  auto lanes = [](const uint64_t* k) {  // {H's, L's} in every lane
    const auto h = static_cast<long long>(k[0]), l = static_cast<long long>(k[1]);
    return std::array<long long, 2>{h, l};
  };
  const auto d2 = lanes(c.by1024), d1 = lanes(c.by512);
  const __m512i k2 = _mm512_set_epi64(d2[1], d2[0], d2[1], d2[0], d2[1], d2[0], d2[1], d2[0]);
  const __m512i k1 = _mm512_set_epi64(d1[1], d1[0], d1[1], d1[0], d1[1], d1[0], d1[1], d1[0]);
  __m512i a0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, 0xFFFFFFFFu));
  __m512i a1 = _mm512_loadu_si512(p + 64);
  for (size_t off = 128; off < blk; off += 128) {
    a0 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a0, k2, 0x00), _mm512_clmulepi64_epi128(a0, k2, 0x11),
                                   _mm512_loadu_si512(p + off), 0x96);  // XOR of the three
    a1 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a1, k2, 0x00), _mm512_clmulepi64_epi128(a1, k2, 0x11),
                                   _mm512_loadu_si512(p + off + 64), 0x96);
  }
  const __m512i f = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a0, k1, 0x00),
                                              _mm512_clmulepi64_epi128(a0, k1, 0x11), a1, 0x96);
  alignas(64) uint64_t w[8];
  _mm512_store_si512(reinterpret_cast<__m512i*>(w), f);
  uint64_t crc = 0;
  for (uint64_t v : w) crc = _mm_crc32_u64(crc, v);
  return ~uint32_t(crc);
}

#define STRATA_FOLD256 __attribute__((target("avx2,vpclmulqdq,sse4.2")))
STRATA_FOLD256 inline __m256i load256(const unsigned char* q) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
}
// a's lanes folded d bits on (k: the constants for d) onto `next`.
STRATA_FOLD256 inline __m256i fold256(__m256i a, __m256i k, __m256i next) {
  return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(a, k, 0x00), _mm256_clmulepi64_epi128(a, k, 0x11)),
                          next);
}

// One block, 256-bit vectors (AVX2 CPUs with VPCLMULQDQ): four accumulators
// 128 bytes apart. REQUIRES: blk a multiple of 128, blk > 0.
STRATA_FOLD256 uint32_t fold256_block(const unsigned char* p, size_t blk) {
  const FoldConstants& c = fold_constants();
  const __m256i k4 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c.by1024)));
  const __m256i k1 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c.by256)));
  __m256i a[4];
  for (int i = 0; i < 4; ++i) a[i] = load256(p + 32 * i);
  a[0] = _mm256_xor_si256(a[0], _mm256_set_epi64x(0, 0, 0, 0xFFFFFFFFu));
  for (size_t off = 128; off < blk; off += 128) {
    for (int i = 0; i < 4; ++i) a[i] = fold256(a[i], k4, load256(p + off + 32 * i));
  }
  __m256i f = a[0];
  for (int i = 1; i < 4; ++i) f = fold256(f, k1, a[i]);
  alignas(32) uint64_t w[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(w), f);
  uint64_t crc = 0;
  for (uint64_t v : w) crc = _mm_crc32_u64(crc, v);
  return ~uint32_t(crc);
}
#undef STRATA_FOLD256
#endif

}  // namespace

BlockCrc block_crc_best() {
  for (BlockCrc impl : {BlockCrc::kFold512, BlockCrc::kFold256, BlockCrc::kThreeChains}) {
    if (block_crc_available(impl)) return impl;
  }
  return BlockCrc::kSoftware;
}

bool block_crc_available(BlockCrc impl) {
#if defined(__x86_64__)
  // __builtin_cpu_supports also checks that the OS saves the vector state.
  static const bool clmul = __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("sse4.2");
  static const bool avx512 = clmul && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl");
  static const bool avx2 = clmul && __builtin_cpu_supports("avx2");
  switch (impl) {
    case BlockCrc::kFold512: return avx512;
    case BlockCrc::kFold256: return avx2;
    case BlockCrc::kThreeChains: return crc32c_hardware_available();
    case BlockCrc::kSoftware: return true;
  }
  return false;
#else
  return impl == BlockCrc::kSoftware;
#endif
}

const char* block_crc_name(BlockCrc impl) {
  switch (impl) {
    case BlockCrc::kFold512: return "fold512";
    case BlockCrc::kFold256: return "fold256";
    case BlockCrc::kThreeChains: return "three-chains";
    case BlockCrc::kSoftware: return "software";
  }
  return "?";
}

void crc32c_blocks_with(BlockCrc impl, const void* data, size_t bytes, size_t block_bytes, uint32_t* out) {
  const auto* p = static_cast<const unsigned char*>(data);
  const size_t full = bytes / block_bytes;
  size_t k = 0;
#if defined(__x86_64__)
  const bool folds = block_bytes % 128 == 0;
  if (impl == BlockCrc::kFold512 && folds) {
    for (; k < full; ++k) out[k] = fold512_block(p + k * block_bytes, block_bytes);
  } else if (impl == BlockCrc::kFold256 && folds) {
    for (; k < full; ++k) out[k] = fold256_block(p + k * block_bytes, block_bytes);
  } else if (impl != BlockCrc::kSoftware && crc32c_hardware_available()) {
    for (; k + 3 <= full; k += 3) hw_blocks3(p + k * block_bytes, block_bytes, out + k);
  }
#endif
  auto one = [impl](const unsigned char* q, size_t n) {
    return impl == BlockCrc::kSoftware ? crc32c_software(q, n) : crc32c(q, n);
  };
  for (; k < full; ++k) out[k] = one(p + k * block_bytes, block_bytes);
  if (bytes % block_bytes != 0) out[full] = one(p + full * block_bytes, bytes % block_bytes);
}

void crc32c_blocks(const void* data, size_t bytes, size_t block_bytes, uint32_t* out) {
  static const BlockCrc best = block_crc_best();
  crc32c_blocks_with(best, data, bytes, block_bytes, out);
}

uint32_t crc32c_software(const void* data, size_t bytes, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  const auto& t = kTables.t;
  while (bytes >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;  // little-endian (x86, aarch64)
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    bytes -= 8;
  }
  while (bytes > 0) {
    c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
    --bytes;
  }
  return ~c;
}

bool crc32c_hardware_available() {
#if defined(__x86_64__)
  static const bool available = __builtin_cpu_supports("sse4.2");
  return available;
#else
  return false;
#endif
}

uint32_t crc32c_hardware(const void* data, size_t bytes, uint32_t crc) {
#if defined(__x86_64__)
  return ~hw_3way(~crc, static_cast<const unsigned char*>(data), bytes);
#else
  return crc32c_software(data, bytes, crc);
#endif
}

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc) {
  return crc32c_hardware_available() ? crc32c_hardware(data, bytes, crc)
                                     : crc32c_software(data, bytes, crc);
}

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, size_t bytes_b) {
  return mult_mod_p(x8n_mod_p(bytes_b), crc_a) ^ crc_b;
}

}  // namespace strata::nvme
