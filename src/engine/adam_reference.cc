#include "engine/adam_reference.h"

#include <cmath>

namespace strata {

void adam_reference_step(const AdamHyper& h, int64_t step, float grad_scale, float* param,
                         const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n) {
  // Scalars are computed in double and rounded once, as PyTorch does for the
  // Python floats of its single-tensor AdamW.
  const double bc1 = 1.0 - std::pow(h.beta1, double(step));
  const double bc2 = 1.0 - std::pow(h.beta2, double(step));
  const float step_size = float(h.lr / bc1);
  const float bc2_sqrt = float(std::sqrt(bc2));
  const float one_minus_b1 = float(1.0 - h.beta1);
  const float b2 = float(h.beta2);
  const float one_minus_b2 = float(1.0 - h.beta2);
  const float eps = float(h.eps);
  const float decay = float(1.0 - h.lr * h.weight_decay);
  const float wd = float(h.weight_decay);
  for (int64_t i = 0; i < n; ++i) {
    float g = grad[i] * grad_scale;
    float p = param[i];
    if (h.adamw) {
      p = p * decay;
    } else if (wd != 0.0f) {
      g = g + wd * p;
    }
    const float m = exp_avg[i] + one_minus_b1 * (g - exp_avg[i]);
    const float v = exp_avg_sq[i] * b2 + one_minus_b2 * g * g;
    const float denom = std::sqrt(v) / bc2_sqrt + eps;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = p - step_size * (m / denom);
  }
}

}  // namespace strata
