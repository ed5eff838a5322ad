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
#endif

}  // namespace

void crc32c_blocks(const void* data, size_t bytes, size_t block_bytes, uint32_t* out) {
  const auto* p = static_cast<const unsigned char*>(data);
  const size_t full = bytes / block_bytes;
  size_t k = 0;
#if defined(__x86_64__)
  if (crc32c_hardware_available()) {
    for (; k + 3 <= full; k += 3) hw_blocks3(p + k * block_bytes, block_bytes, out + k);
  }
#endif
  for (; k < full; ++k) out[k] = crc32c(p + k * block_bytes, block_bytes);
  if (bytes % block_bytes != 0) out[full] = crc32c(p + full * block_bytes, bytes % block_bytes);
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
