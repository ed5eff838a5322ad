// The language-model head's softmax cross-entropy over rows of logits, fused
// with its gradient, for the CPU (model/cross_entropy.h runs it over a
// head's logits). No LibTorch.
#pragma once

#include <cstdint>

#include "cpu_adam/types.h"

namespace strata::cpu_adam {

// Note [Fused cross-entropy]
// Per row x (vocab values, widened exactly from bf16/fp16 to fp32) with
// target t, in fp32:
//   m    = max_j x_j
//   s    = sum_j e_j,  e_j = exp(x_j - m)
//   loss = log(s) - (x_t - m)                  (= -log_softmax(x)_t)
//   grad_j = e_j * c - (j == t ? grad_scale : 0),  c = grad_scale / s
// and the gradient, rounded to the logits' own type (Note [16-bit
// rounding]), is written over the row. A row whose target is ignore_index
// has loss 0 and a zero gradient. This is what LibTorch's log_softmax,
// nll_loss and their backward compute through an fp32 copy of the logits,
// to a few fp32 ulps, in three passes over each row while it is in cache (the
// max, the sum, the gradient: one read and one write from memory) instead of
// a widening copy, a log_softmax, an fp32 gradient, its fill and its
// narrowing: on a 2-core CPU the head of a 32,000-token vocabulary spent 40%
// of its time there (docs/design.md, "The head's loss").
// The order is fixed so every kernel gives the same bits: the row is read in
// blocks of kCrossEntropyLanes values, lane l accumulating values l, l + 16,
// ... (a short last block padded: -inf for the max, 0 for the sum), then the
// 16 lanes are folded as a tree (half = 8, 4, 2, 1: lane l < half adds lane
// l + half). exp is evaluated by one sequence of IEEE operations (see
// kernel_simd.h, exp_nonpositive): round z/ln 2 to an integer n, reduce r = z
// - n ln 2 in two fused steps, a degree-7 polynomial in r, times 2^n; within
// 2 ulp of exp, and arguments below -87 are taken as -87 (exp(-87) = 1.6e-38,
// where LibTorch gives smaller values or 0: no visible difference in a sum of
// at least 1; a -inf logit's gradient is then 1.6e-38 x c, not 0).
inline constexpr int kCrossEntropyLanes = 16;

struct CrossEntropyRows {
  void* logits = nullptr;      // rows x vocab values of `type`, row r at logits + r * stride
  GradType type = GradType::kF32;
  int64_t rows = 0, vocab = 0, stride = 0;
  const int64_t* targets = nullptr;  // one per row: in [0, vocab), or ignore_index
  int64_t ignore_index = -100;
  float grad_scale = 1.0f;     // the gradient written is grad_scale x (softmax - one-hot)
  bool write_grad = false;     // false: the logits are only read
  float* row_loss = nullptr;   // out: one per row
};

// Rows [begin, end) of `a` on the calling thread, with the best kernel this
// CPU has (the caller splits rows between threads: each row is computed the
// same on any thread). REQUIRES: every target in [0, vocab) or ignore_index.
void cross_entropy_rows(const CrossEntropyRows& a, int64_t begin, int64_t end);

// The same with the kernel of `isa` (tests). REQUIRES: isa_supported(isa).
void cross_entropy_rows(Isa isa, const CrossEntropyRows& a, int64_t begin, int64_t end);

}  // namespace strata::cpu_adam
