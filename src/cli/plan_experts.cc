#include "cli/plan_experts.h"

#include "plan/bound.h"
#include "util/logging.h"

namespace strata {

namespace {

struct ExpertFigures {
  int64_t expert_params = 0;  // every layer's experts (the router and a shared expert not counted)
  int64_t active_params = 0;  // what one token's forward multiplies or looks up: all but the experts it skips
  double tokens_per_expert = 0;  // a step's tokens x k / E: an expert's rows under even routing
  double active_flops_per_token = 0;  // forward and backward (bound.h, step_flops)
};

ExpertFigures figures(const ModelConfig& m, int64_t parameters, int64_t step_tokens) {
  ExpertFigures f;
  const int64_t E = m.moe.num_experts, k = m.moe.num_experts_per_tok, one = 3 * m.dim * m.expert_dim();
  f.expert_params = m.n_layers * E * one;
  f.active_params = parameters - m.n_layers * (E - k) * one;
  f.tokens_per_expert = double(step_tokens) * double(k) / double(E);
  f.active_flops_per_token = step_flops(m, 1, 0);
  return f;
}

}  // namespace

nlohmann::json experts_json(const ModelConfig& m, int64_t parameters, int64_t step_tokens) {
  if (!m.is_moe()) return nlohmann::json();
  const ExpertFigures f = figures(m, parameters, step_tokens);
  return {{"num_experts", m.moe.num_experts},
          {"num_experts_per_tok", m.moe.num_experts_per_tok},
          {"moe_intermediate_size", m.expert_dim()},
          {"shared_expert_intermediate_size", m.moe.shared_expert_intermediate_size},
          {"expert_parameters", f.expert_params},
          {"expert_share", double(f.expert_params) / double(parameters)},
          {"active_parameters", f.active_params},
          {"active_flops_per_token", f.active_flops_per_token},
          {"tokens_per_expert_per_step", f.tokens_per_expert}};
}

std::string experts_text(const ModelConfig& m, int64_t parameters, int64_t step_tokens) {
  if (!m.is_moe()) return "";
  const ExpertFigures f = figures(m, parameters, step_tokens);
  auto count = [](double n) { return n >= 1e9 ? strprintf("%.2f B", n / 1e9) : strprintf("%.2f M", n / 1e6); };
  return strprintf(
      "experts: %lld a layer of width %lld, top %lld%s: %s of %s parameters (%.1f%%) are experts; a token meets %s "
      "(%.3g GFLOP a token, forward and backward); a step's %lld tokens give an expert %.1f rows under even "
      "routing\n",
      (long long)m.moe.num_experts, (long long)m.expert_dim(), (long long)m.moe.num_experts_per_tok,
      m.shared_expert() ? strprintf(", a shared expert of %lld", (long long)m.moe.shared_expert_intermediate_size).c_str()
                        : "",
      count(double(f.expert_params)).c_str(), count(double(parameters)).c_str(),
      100.0 * double(f.expert_params) / double(parameters), count(double(f.active_params)).c_str(),
      f.active_flops_per_token / 1e9, (long long)step_tokens, f.tokens_per_expert);
}

}  // namespace strata
