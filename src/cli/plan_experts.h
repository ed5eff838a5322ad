// `strata plan`'s rows for a mixture-of-experts model (docs/design.md,
// "Experts"): the experts' share of the parameters, what one token meets,
// and the tokens an expert sees in a step. From the config alone.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "config/config.h"

namespace strata {

// `parameters`: the model's (unpadded); `step_tokens`: one rank's tokens a
// step. Empty for a dense model.
nlohmann::json experts_json(const ModelConfig& m, int64_t parameters, int64_t step_tokens);
std::string experts_text(const ModelConfig& m, int64_t parameters, int64_t step_tokens);

}  // namespace strata
