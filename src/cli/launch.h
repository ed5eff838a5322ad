// `strata launch --nproc N [--master-port P] -- strata train CONFIG ...`:
// starts N local ranks with the standard variables (RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), prefixes every
// output line with its rank, forwards SIGINT/SIGTERM, and when one rank fails
// stops the others and exits with that rank's status.
#pragma once

#include <CLI/CLI.hpp>

namespace strata {

void register_launch(CLI::App& app, int& result);

}  // namespace strata
