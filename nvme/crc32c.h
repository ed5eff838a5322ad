// CRC-32C (Castagnoli), the checksum of swap-store blocks: the SSE4.2 crc32
// instruction where the CPU has it (three interleaved streams, about 3x one
// stream), a table-driven software version otherwise. Both give identical
// results; crc32c("123456789") == 0xE3069283.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::nvme {

// The CRC-32C of `bytes` bytes at `data`, continuing from `crc` (the value
// returned for the preceding bytes; 0 to start). Thread-safe.
uint32_t crc32c(const void* data, size_t bytes, uint32_t crc = 0);

// The CRC-32C of each `block_bytes` block of `bytes` bytes at `data` into
// out[0..], the last block possibly shorter: what crc32c() gives per block,
// a block at a time by carry-less folding where the CPU has VPCLMULQDQ (with
// AVX-512: 2x the crc32 instruction's three chains from memory, 1.9x in cache), else
// three blocks at a time (three crc32 chains, no combine). Thread-safe.
void crc32c_blocks(const void* data, size_t bytes, size_t block_bytes, uint32_t* out);

// How crc32c_blocks hashes a whole block (Note [Folding CRC] in crc32c.cc):
// by carry-less multiplication, 512-bit or 256-bit vectors (blocks whose size
// is a multiple of 128 bytes), by three crc32 chains, or by table.
enum class BlockCrc { kFold512, kFold256, kThreeChains, kSoftware };
// The fastest this CPU has; crc32c_blocks uses it.
BlockCrc block_crc_best();
bool block_crc_available(BlockCrc impl);
const char* block_crc_name(BlockCrc impl);
// crc32c_blocks with `impl` for the whole blocks it can take (the rest as
// crc32c_blocks does). REQUIRES: block_crc_available(impl).
void crc32c_blocks_with(BlockCrc impl, const void* data, size_t bytes, size_t block_bytes, uint32_t* out);

// The individual implementations, for tests and benchmarks.
uint32_t crc32c_software(const void* data, size_t bytes, uint32_t crc = 0);
// REQUIRES: crc32c_hardware_available().
uint32_t crc32c_hardware(const void* data, size_t bytes, uint32_t crc = 0);
bool crc32c_hardware_available();

// The CRC of A||B from crc(A), crc(B) and the length of B.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, size_t bytes_b);

}  // namespace strata::nvme
