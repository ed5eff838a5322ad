#include "engine/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace strata {

namespace {

// Warm-up progress in [0, 1] at iteration `it` (< warmup steps).
double warmup_gamma(const SchedulerConfig& s, int64_t warmup, int64_t it) {
  if (s.warmup_type == WarmupType::kLog) return std::log(double(it + 1)) / std::log(double(warmup));
  return double(it) / double(warmup);
}

}  // namespace

double learning_rate(const SchedulerConfig& s, double base_lr, int64_t step) {
  const int64_t it = step - 1;
  if (s.type == SchedulerType::kConstant) return base_lr;
  if (s.type == SchedulerType::kWarmupLR || s.type == SchedulerType::kWarmupDecayLR) {
    // DeepSpeed clamps the warm-up to at least 2 steps (log(1) = 0).
    const int64_t warmup = std::max<int64_t>(2, s.warmup_num_steps);
    double gamma = 1.0;
    if (it < warmup) {
      gamma = warmup_gamma(s, warmup, it);
    } else if (s.type == SchedulerType::kWarmupDecayLR) {
      gamma = std::max(0.0, double(s.total_num_steps - it) /
                                std::max(1.0, double(s.total_num_steps - warmup)));
    }
    return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma;
  }
  // WarmupCosineLR
  const int64_t warmup = std::max<int64_t>(1, s.warmup_num_steps);
  if (it < s.warmup_num_steps) {
    const double ratio = s.warmup_type == WarmupType::kLog && warmup > 1 ? warmup_gamma(s, warmup, it)
                                                              : double(it) / double(warmup);
    return base_lr * (s.warmup_min_ratio + ratio * (1.0 - s.warmup_min_ratio));
  }
  const double done = double(it - s.warmup_num_steps + 1);
  const double total = double(std::max<int64_t>(1, s.total_num_steps - s.warmup_num_steps));
  const double cosine = (1.0 + std::cos(std::numbers::pi * std::min(1.0, done / total))) / 2.0;
  return base_lr * std::max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * cosine);
}

}  // namespace strata
