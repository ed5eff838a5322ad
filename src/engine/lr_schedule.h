// Learning-rate schedules with DeepSpeed's names, parameters and step
// convention: the first optimizer step uses iteration 0 (DeepSpeed's
// scheduler steps once at construction), step k uses iteration k - 1.
#pragma once

#include <cstdint>

#include "config/config.h"

namespace strata {

// The learning rate of 1-based optimizer step `step`. With no scheduler it is
// optimizer.lr; WarmupLR/WarmupDecayLR go from warmup_min_lr to warmup_max_lr
// (the optimizer lr is not used, as in DeepSpeed); WarmupCosineLR scales
// optimizer.lr by a ratio that warms from warmup_min_ratio to 1, then follows a
// cosine down to cos_min_ratio at total_num_steps.
double learning_rate(const SchedulerConfig& s, double base_lr, int64_t step);

}  // namespace strata
