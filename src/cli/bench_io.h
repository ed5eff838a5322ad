// `strata bench-io`: write-then-read throughput of the NVMe I/O engine on one
// directory, for one configuration or a sweep, as a table or JSON lines.
#pragma once

#include <CLI/CLI.hpp>

namespace strata {

// Adds the `bench-io` subcommand to `app`; `result` receives its exit code.
void register_bench_io(CLI::App& app, int& result);

}  // namespace strata
