#include "model/cross_entropy.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <string>

#include "cpu_adam/cross_entropy.h"
#include "util/errors.h"

namespace strata {

namespace {

// The row type of Note [Fused cross-entropy], or none for other dtypes.
std::optional<cpu_adam::GradType> row_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cpu_adam::GradType::kF32;
    case at::kBFloat16: return cpu_adam::GradType::kBF16;
    case at::kHalf: return cpu_adam::GradType::kF16;
    default: return std::nullopt;
  }
}

}  // namespace

bool fused_cross_entropy_applies(const at::Tensor& logits) {
  return logits.device().is_cpu() && logits.dim() >= 1 && logits.size(-1) > 0 && logits.stride(-1) == 1 &&
         row_type(logits.scalar_type()).has_value() && logits.is_contiguous();
}

double fused_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, std::optional<float> grad_scale,
                           std::span<float> row_loss, cpu_adam::Isa isa) {
  STRATA_CHECK(fused_cross_entropy_applies(logits), "fused cross-entropy over logits it does not apply to");
  const int64_t vocab = logits.size(-1), rows = logits.numel() / vocab;
  const at::Tensor t = targets.reshape({-1}).to(at::kLong).contiguous();
  STRATA_CHECK(t.numel() == rows, "fused cross-entropy: " + std::to_string(t.numel()) + " targets for " +
                                      std::to_string(rows) + " rows");
  STRATA_CHECK(int64_t(row_loss.size()) >= rows, "fused cross-entropy: room for " + std::to_string(row_loss.size()) +
                                                     " row losses, " + std::to_string(rows) + " rows");
  const int64_t* tp = t.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    STRATA_CHECK(tp[r] == -100 || (tp[r] >= 0 && tp[r] < vocab),
                 "target " + std::to_string(tp[r]) + " outside the vocabulary of " + std::to_string(vocab));
  }
  cpu_adam::CrossEntropyRows a;
  a.logits = logits.data_ptr();
  a.type = *row_type(logits.scalar_type());
  a.rows = rows;
  a.vocab = a.stride = vocab;
  a.targets = tp;
  a.grad_scale = grad_scale.value_or(0.0f);
  a.write_grad = grad_scale.has_value();
  a.row_loss = row_loss.data();
  at::parallel_for(0, rows, /*grain_size=*/8, [&](int64_t begin, int64_t end) {
    cpu_adam::cross_entropy_rows(isa, a, begin, end);
  });
  double sum = 0.0;
  for (int64_t r = 0; r < rows; ++r) sum += double(row_loss[r]);
  return sum;
}

}  // namespace strata
