// Host arithmetic on landed gradients: accumulate into fp32 homes and the
// ordered squared norm (Note [Ordered norm] in grad_ops.h).
#include "cpu_adam/grad_ops.h"

#include <cstring>

#include "cpu_adam/convert.h"

namespace strata::cpu_adam {

namespace {

template <typename Widen>
void accumulate(float* home, int64_t n, bool first, Widen widen) {
  if (first) {
    for (int64_t i = 0; i < n; ++i) home[i] = widen(i);
  } else {
    for (int64_t i = 0; i < n; ++i) home[i] = home[i] + widen(i);
  }
}

// The tree fold of Note [Ordered norm].
double fold(double* lanes) {
  for (int half = kNormLanes / 2; half > 0; half /= 2) {
    for (int l = 0; l < half; ++l) lanes[l] += lanes[l + half];
  }
  return lanes[0];
}

}  // namespace

void accumulate_grad(float* home, const void* src, GradType src_type, int64_t n, bool first) {
  switch (src_type) {
    case GradType::kF32: {
      const float* s = static_cast<const float*>(src);
      if (first) {
        std::memcpy(home, s, size_t(n) * sizeof(float));
      } else {
        accumulate(home, n, false, [s](int64_t i) { return s[i]; });
      }
      return;
    }
    case GradType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      accumulate(home, n, first, [s](int64_t i) {
        const uint32_t bits = uint32_t(s[i]) << 16;  // exact widening
        float f;
        std::memcpy(&f, &bits, sizeof f);
        return f;
      });
      return;
    }
    case GradType::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      accumulate(home, n, first, [s](int64_t i) { return fp16_to_float(s[i]); });
      return;
    }
  }
}

double ordered_squared_norm(const float* x, int64_t n) {
  double outer[kNormLanes] = {};  // per partial index modulo kNormLanes
  int64_t c = 0;
  for (int64_t base = 0; base < n; base += kNormChunk, ++c) {
    double lanes[kNormLanes] = {};
    const int64_t end = n - base < kNormChunk ? n - base : kNormChunk;
    const float* p = x + base;
    if (end == kNormChunk) {
      for (int64_t j = 0; j < kNormChunk; j += kNormLanes) {
        for (int l = 0; l < kNormLanes; ++l) {
          const double v = p[j + l];
          lanes[l] += v * v;  // exact product: one rounding, the addition's
        }
      }
    } else {
      for (int64_t i = 0; i < end; ++i) {
        const double v = p[i];
        lanes[i % kNormLanes] += v * v;
      }
    }
    outer[c % kNormLanes] += fold(lanes);
  }
  return fold(outer);
}

}  // namespace strata::cpu_adam
