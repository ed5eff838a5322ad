// `strata bench-crc`: times each way this CPU has of checksumming swap blocks
// (CRC-32C per 4 KiB block, nvme/crc32c.h) against a memory read roof, on one
// thread, from memory and in cache, interleaved in one run (no LibTorch).
#pragma once

#include <CLI/CLI.hpp>

namespace strata {

// Adds the `bench-crc` subcommand to `app`.
void register_bench_crc(CLI::App& app);

}  // namespace strata
