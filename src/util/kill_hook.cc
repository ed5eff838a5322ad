#include "util/kill_hook.h"

#include <cstdlib>

namespace strata {

KillAt kill_at_from_env(const char* variable) {
  KillAt k;
  const char* v = std::getenv(variable);
  if (v == nullptr) return k;
  const std::string t = v;
  size_t at = t.find(':');
  if (at == std::string::npos) return k;
  k.event = t.substr(0, at);
  while (at != std::string::npos) {
    k.numbers.push_back(std::atoll(t.c_str() + at + 1));
    at = t.find(':', at + 1);
  }
  return k;
}

}  // namespace strata
