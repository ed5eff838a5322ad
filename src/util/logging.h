// Logging: one line per event to stderr (and optionally a file), through
// spdlog underneath. This header deliberately exposes printf-style functions
// instead of spdlog: LibTorch ships its own, newer {fmt} headers, which clash
// with the {fmt} Debian's spdlog is built against, so no file that sees
// LibTorch's include path may include spdlog. Only util/logging.cc does.
#pragma once

#include <string>

namespace strata {

// level: trace|debug|info|warn|error|off. log_file empty: stderr only.
// REQUIRES: called before any other thread logs.
// rank >= 0 (a multi-rank run): every line carries "[rank r]".
void setup_logging(const std::string& level, const std::string& log_file, int rank = -1);

namespace log {
void debug(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void info(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void warn(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void error(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
}  // namespace log

// printf into a std::string.
std::string strprintf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Formats a byte count as "12.3 MiB".
std::string format_bytes(double bytes);

}  // namespace strata
