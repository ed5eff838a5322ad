// Linked into every test binary (tests/CMakeLists.txt, strata_test): the
// environment each test and the processes it starts run in.
#include <cstdlib>

namespace {
// No rates kept between runs (Note [Kept rates] in src/engine/probes.h): a
// test's probes measure, whatever earlier tests or runs on the machine left;
// tests of the kept rates name their own file.
const int kNoKeptRates = ::setenv("STRATA_RATES_CACHE", "off", /*overwrite=*/1);
}  // namespace
