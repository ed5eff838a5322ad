// What the benchmark commands (bench-io, bench-adam, bench-crc) report of
// their repetitions.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace strata {

// The median of `xs` (the mean of the middle two for an even count; 0 when empty).
inline double median(std::vector<double> xs) {
  std::sort(xs.begin(), xs.end());
  const size_t n = xs.size();
  if (n == 0) return 0.0;
  return n % 2 == 1 ? xs[n / 2] : 0.5 * (xs[n / 2 - 1] + xs[n / 2]);
}

}  // namespace strata
