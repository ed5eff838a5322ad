// Deterministic kills for the crash tests (checkpoint_cli_test): an
// environment variable VAR=<event>:<n>[:<m>...] names the point at which a
// process SIGKILLs itself. Each hook parses its variable once (a static) and
// compares on its own path; this is the one parser of the format.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata {

struct KillAt {
  std::string event;             // empty: the variable is unset or has no ':'
  std::vector<int64_t> numbers;  // the colon-separated integers after the event
};

KillAt kill_at_from_env(const char* variable);

}  // namespace strata
