// `strata export`: a checkpoint's weights as Hugging Face safetensors.
#pragma once

#include <CLI/CLI.hpp>

namespace strata {

// Adds the `export` subcommand to `app`; `result` receives its exit code.
void register_export(CLI::App& app, int& result);

}  // namespace strata
