// The strata executable: one binary, subcommands per job. Every error is
// caught here, printed as one line, and mapped to an exit code (util/errors.h).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "cli/bench_adam.h"
#include "cli/bench_crc.h"
#include "cli/bench_io.h"
#include "cli/export.h"
#include "cli/launch.h"
#include "cli/plan.h"
#include "cli/train.h"
#include "util/errors.h"

#ifndef STRATA_VERSION
#define STRATA_VERSION "unknown"
#endif

int main(int argc, char** argv) {
  CLI::App app{"Strata: an out-of-core training engine"};
  app.set_version_flag("--version", std::string("strata ") + STRATA_VERSION);
  app.require_subcommand(1);
  int result = strata::kExitOk;
  app.add_subcommand("help", "Show the commands and their options")->callback([&app]() {
    // App::help() would describe the selected subcommand (this one); ask the
    // formatter for the top-level page instead.
    std::fputs(app.get_formatter()->make_help(&app, "strata", CLI::AppFormatMode::Normal).c_str(),
               stdout);
  });
  strata::register_train(app, result);
  strata::register_plan(app, result);
  strata::register_launch(app, result);
  strata::register_export(app, result);
  strata::register_bench_io(app, result);
  strata::register_bench_adam(app);
  strata::register_bench_crc(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11's own messages (--help, --version, bad flags); bad flags exit 2.
    const int code = app.exit(e);
    return code == 0 ? 0 : strata::kExitBadInput;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata: error: %s\n", e.what());
    return strata::exit_code_for(e);
  }
  return result;
}
