#include "util/logging.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdarg>
#include <cstdio>
#include <vector>

namespace strata {

void setup_logging(const std::string& level, const std::string& log_file, int rank) {
  std::vector<spdlog::sink_ptr> sinks;
  sinks.push_back(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  if (!log_file.empty()) {
    sinks.push_back(std::make_shared<spdlog::sinks::basic_file_sink_mt>(log_file, /*truncate=*/true));
  }
  auto logger = std::make_shared<spdlog::logger>("strata", sinks.begin(), sinks.end());
  logger->set_pattern(rank < 0 ? std::string("[%H:%M:%S.%e] [%^%l%$] %v")
                               : "[%H:%M:%S.%e] [rank " + std::to_string(rank) + "] [%^%l%$] %v");
  logger->set_level(spdlog::level::from_str(level));
  spdlog::set_default_logger(logger);
}

namespace {
std::string vformat(const char* fmt, va_list args) {
  va_list copy;
  va_copy(copy, args);
  const int n = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  std::string out(n > 0 ? size_t(n) : 0, '\0');
  if (n > 0) std::vsnprintf(out.data(), size_t(n) + 1, fmt, args);
  return out;
}
}  // namespace

std::string strprintf(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::string s = vformat(fmt, args);
  va_end(args);
  return s;
}

#define STRATA_DEFINE_LOG(name, level)                       \
  void name(const char* fmt, ...) {                          \
    if (!spdlog::should_log(level)) return;                  \
    va_list args;                                            \
    va_start(args, fmt);                                     \
    std::string s = vformat(fmt, args);                      \
    va_end(args);                                            \
    spdlog::log(level, "{}", s);                             \
  }

namespace log {
STRATA_DEFINE_LOG(debug, spdlog::level::debug)
STRATA_DEFINE_LOG(info, spdlog::level::info)
STRATA_DEFINE_LOG(warn, spdlog::level::warn)
STRATA_DEFINE_LOG(error, spdlog::level::err)
}  // namespace log

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return buf;
}

}  // namespace strata
