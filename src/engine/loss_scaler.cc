#include "engine/loss_scaler.h"

#include <algorithm>
#include <cmath>

#include "util/errors.h"
#include "util/logging.h"

namespace strata {

LossScaler::LossScaler(const Fp16Config& cfg)
    : dynamic_(cfg.loss_scale == 0.0),
      min_scale_(cfg.min_loss_scale),
      window_(cfg.loss_scale_window),
      hysteresis_(cfg.hysteresis),
      consecutive_(cfg.consecutive_hysteresis) {
  state_.scale = dynamic_ ? std::ldexp(1.0, int(cfg.initial_scale_power)) : cfg.loss_scale;
  state_.hysteresis_left = hysteresis_;
}

// Note [Loss scaling]: DeepSpeed's DynamicLossScaler.update_scale.
void LossScaler::update(bool overflow, int64_t step) {
  if (!dynamic_) return;
  State& s = state_;
  if (overflow) {
    if (hysteresis_ == 1 || s.hysteresis_left == 1) {
      if (s.scale == min_scale_) {
        throw Error(strprintf("step %lld: the fp16 gradients overflow with the loss scale already at "
                              "fp16.min_loss_scale (%g): training cannot make progress; lower "
                              "optimizer.params.lr, enable gradient_clipping, or use bf16",
                              (long long)step, min_scale_));
      }
      s.scale = std::max(s.scale / 2.0, min_scale_);  // below the minimum (a resume that raised it): to it
    } else {
      --s.hysteresis_left;
    }
    s.steps_since_overflow = 0;
    return;
  }
  ++s.steps_since_overflow;
  if (consecutive_) s.hysteresis_left = hysteresis_;
  if (s.steps_since_overflow % window_ == 0) {
    if (!consecutive_) s.hysteresis_left = hysteresis_;
    s.scale *= 2.0;
  }
}

nlohmann::json LossScaler::to_json() const {
  return {{"dynamic", dynamic_},
          {"scale", state_.scale},
          {"hysteresis_left", state_.hysteresis_left},
          {"steps_since_overflow", state_.steps_since_overflow}};
}

void LossScaler::load_json(const nlohmann::json& j, const std::string& path) {
  auto bad = [&](const std::string& key, const std::string& what) {
    throw InputError(path, "manifest trainer.loss_scale." + key + ": " + what);
  };
  if (!j.is_object()) throw InputError(path, "manifest trainer.loss_scale: not an object");
  if (!j.contains("scale") || !j["scale"].is_number()) bad("scale", "missing or not a number");
  for (const char* key : {"hysteresis_left", "steps_since_overflow"}) {
    if (!j.contains(key) || !j[key].is_number_integer()) bad(key, "missing or not an integer");
  }
  State s;
  s.scale = j["scale"].get<double>();
  s.hysteresis_left = j["hysteresis_left"].get<int64_t>();
  s.steps_since_overflow = j["steps_since_overflow"].get<int64_t>();
  if (!(s.scale > 0.0) || !std::isfinite(s.scale)) bad("scale", "must be a positive finite number");
  if (s.hysteresis_left < 1) bad("hysteresis_left", "must be >= 1");
  if (s.steps_since_overflow < 0) bad("steps_since_overflow", "must be >= 0");
  // A static scale is the config's; a dynamic one continues where it was. A
  // resume may change fp16.hysteresis: the count never exceeds it.
  if (!dynamic_) return;
  s.hysteresis_left = std::min(s.hysteresis_left, hysteresis_);
  state_ = s;
}

}  // namespace strata
