// `strata bench-adam`: times the CPU Adam step against a memory roof and the
// two-pass variant, interleaved, in one run (no LibTorch; LibTorch's own AdamW
// is timed by tools/bench_adam_torch).
#pragma once

#include <CLI/CLI.hpp>

namespace strata {

// Adds the `bench-adam` subcommand to `app`. Its errors are thrown from the
// callback (bad flags are CLI11 parse errors).
void register_bench_adam(CLI::App& app);

}  // namespace strata
