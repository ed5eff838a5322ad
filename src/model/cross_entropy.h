// The head's loss on the CPU: Note [Fused cross-entropy]
// (cpu_adam/cross_entropy.h) over a LibTorch tensor of logits, its rows split
// between LibTorch's intra-op threads.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <span>

#include "cpu_adam/types.h"

namespace strata {

// Whether `logits` can take the fused path: a CPU tensor of fp32, bf16 or
// fp16 with contiguous rows (the last dimension).
bool fused_cross_entropy_applies(const at::Tensor& logits);

// The sum over rows of -log softmax(logits)[target], an ignored target
// (-100) adding 0, summed in row order in double. With `grad_scale` given,
// the logits are overwritten by grad_scale x (softmax - one-hot) (an ignored
// row by zeros): the gradient of grad_scale x that sum. logits [..., V],
// targets int64 of the leading shape, every one in [0, V) or -100 (checked);
// row_loss: room for one float a row (checked). `isa`: the kernel's
// (run.cpu_adam_isa; every one gives the same bits). Each row is computed on
// one thread, so the bits do not depend on the thread count either.
double fused_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, std::optional<float> grad_scale,
                           std::span<float> row_loss, cpu_adam::Isa isa = cpu_adam::best_isa());

}  // namespace strata
