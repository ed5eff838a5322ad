// Test helper shared by cpu_adam_test and cpu_adam_torch_test: the
// double-precision reference of Note [AdamW numerics].
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_adam/adam.h"

namespace strata::cpu_adam {

// Note [AdamW numerics] in double, from the same float-rounded constants the
// kernels use (they are part of the definition, as in PyTorch).
//
// Two ways to compare:
// - step by step: every step, the reference starts from the kernel's own fp32
//   state and computes the step exactly; the kernel must match it to 1e-6.
//   This is the kernel's accuracy, and any error in the formula shows up here.
// - trajectory: the reference keeps its own state in double for all 100 steps.
//   Storing state in fp32 rounds p, m and v once per step, and these roundings
//   add up (for a steady update they are correlated, so they grow with the
//   step count): any fp32 implementation, LibTorch's included, drifts from
//   the exact trajectory by a few 1e-6 over 100 steps. That drift is bounded
//   by kTrajectoryTolerance.
//
// m and p are sums of terms of both signs and can cancel to ~0, where an fp32
// result is only accurate relative to the terms; so each value carries the
// magnitude it is a sum of (the same sum over absolute values) and the error
// of x against reference r is |x - r| / max(|r|, magnitude). v has no
// cancellation of its own, but with L2 weight decay g = grad + wd*p can
// cancel, so v is measured against the same sum over magnitude(g)^2.
struct Reference {
  std::vector<double> p, m, v, mag_p, mag_m, mag_v;

  explicit Reference(const std::vector<float>& param)
      : p(param.begin(), param.end()), m(param.size()), v(param.size()), mag_p(param.size()),
        mag_m(param.size()), mag_v(param.size()) {
    for (size_t i = 0; i < p.size(); ++i) mag_p[i] = std::fabs(p[i]);
  }

  // Starts from fp32 state (the step-by-step comparison).
  void load(const float* param, const float* exp_avg, const float* exp_avg_sq) {
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] = param[i];
      m[i] = exp_avg[i];
      v[i] = exp_avg_sq[i];
      mag_p[i] = std::fabs(p[i]);
      mag_m[i] = std::fabs(m[i]);
      mag_v[i] = v[i];
    }
  }

  void step(const AdamParams& hp, int64_t t, float grad_scale, const std::vector<float>& grad) {
    const bool decoupled = hp.adamw && hp.weight_decay != 0;
    const bool l2 = !hp.adamw && hp.weight_decay != 0;
    const double decay = static_cast<float>(1.0 - hp.lr * hp.weight_decay);
    const double wd = static_cast<float>(hp.weight_decay);
    const double w1 = static_cast<float>(1.0 - hp.beta1);
    const double b2 = static_cast<float>(hp.beta2);
    const double w2 = static_cast<float>(1.0 - hp.beta2);
    const double inv_bc2_sqrt =
        static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(hp.beta2, double(t))));
    const double neg_step = static_cast<float>(-(hp.lr / (1.0 - std::pow(hp.beta1, double(t)))));
    const double eps = static_cast<float>(hp.eps);
    for (size_t i = 0; i < p.size(); ++i) {
      double g = double(grad[i]) * grad_scale;
      double mag_g = std::fabs(g);
      if (l2) {
        g += wd * p[i];
        mag_g += wd * mag_p[i];
      }
      if (decoupled) {
        p[i] *= decay;
        mag_p[i] *= decay;
      }
      m[i] += w1 * (g - m[i]);
      mag_m[i] += w1 * (mag_g - mag_m[i]);
      v[i] = v[i] * b2 + w2 * g * g;
      mag_v[i] = mag_v[i] * b2 + w2 * mag_g * mag_g;
      const double denom = std::sqrt(v[i]) * inv_bc2_sqrt + eps;
      p[i] += neg_step * m[i] / denom;
      mag_p[i] += std::fabs(neg_step) * mag_m[i] / denom;
    }
  }
};

inline double rel_error(double x, double ref, double magnitude) {
  const double scale = std::max({std::fabs(ref), magnitude, 1e-30});
  return std::fabs(x - ref) / scale;
}

}  // namespace strata::cpu_adam
