// The reference Adam/AdamW step over flat fp32 spans: a plain scalar loop,
// written to match torch.optim.AdamW's arithmetic. The SIMD cpu_adam library
// replaces it behind the same call; this one stays as the oracle.
#pragma once

#include <cstdint>

namespace strata {

struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adamw = true;  // decoupled weight decay; false = L2 added to the gradient
};

// One step (1-based `step`) over n elements. The gradient is multiplied by
// `grad_scale` first (clipping and loss-scale unscaling fold in here).
void adam_reference_step(const AdamHyper& h, int64_t step, float grad_scale, float* param,
                         const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n);

}  // namespace strata
