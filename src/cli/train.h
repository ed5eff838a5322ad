// `strata train`: runs the training job a config describes.
#pragma once

#include <CLI/CLI.hpp>

namespace strata {

// Adds the `train` subcommand to `app`; `result` receives its exit code.
void register_train(CLI::App& app, int& result);

}  // namespace strata
