// Note [Fused cross-entropy]'s entry points: the kernel of this CPU's best
// instruction set, or of the one asked for.
#include "cpu_adam/cross_entropy.h"

#include "cpu_adam/kernels.h"

namespace strata::cpu_adam {

void cross_entropy_rows(Isa isa, const CrossEntropyRows& a, int64_t begin, int64_t end) {
  detail::kernels_for(isa).cross_entropy(a, begin, end);
}

void cross_entropy_rows(const CrossEntropyRows& a, int64_t begin, int64_t end) {
  static const detail::CrossEntropyKernel kernel = detail::kernels_for(best_isa()).cross_entropy;
  kernel(a, begin, end);
}

}  // namespace strata::cpu_adam
