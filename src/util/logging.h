// Logging set-up: spdlog to stderr, optionally also to a file.
#pragma once

#include <string>

namespace strata {

// level: trace|debug|info|warn|error|off. log_file empty: stderr only.
// REQUIRES: called before any other thread logs.
void setup_logging(const std::string& level, const std::string& log_file);

// Formats a byte count as "12.3 MiB".
std::string format_bytes(double bytes);

}  // namespace strata
