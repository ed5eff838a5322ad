// Host arithmetic on landed gradients (engine/gradient_path.h): adding a
// block's gradient, widened from the dtype it crossed PCIe in, into its fp32
// home, and the squared L2 norm in a fixed order that the device's kernel
// (kernels/adam.h, ordered_squared_norm) reproduces bit for bit. No LibTorch.
#pragma once

#include <cstdint>

#include "cpu_adam/types.h"

namespace strata::cpu_adam {

// home[i] = widen(src[i]) when `first`, else home[i] + widen(src[i]): one
// IEEE fp32 addition per element (the widening of bf16/fp16 is exact), which
// is what LibTorch's copy_/add_ compute on any device, so a gradient gets the
// same bits whichever tier holds it.
void accumulate_grad(float* home, const void* src, GradType src_type, int64_t n, bool first);

// Note [Ordered norm]
// The squared L2 norm of x[0, n) in double, summed in an order fixed by n
// alone, so that the CPU (here) and the GPU (kernels/adam.cu) give the same
// bits: every placement of a gradient then gives the same clip coefficient.
// Squares of floats are exact in double (24-bit mantissas, 53-bit result), so
// only the additions round, and they are done in this order:
//  - chunk c is x[c*kNormChunk, (c+1)*kNormChunk); lane l of kNormLanes sums
//    x[c*kNormChunk + j*kNormLanes + l]^2 for j = 0, 1, ... in order (elements
//    at or past n are skipped), then the lanes are folded as a tree: for
//    half = kNormLanes/2 .. 1, lane l < half adds lane l + half. Lane 0 is
//    chunk c's partial.
//  - the partials are summed the same way with one lane per partial index
//    modulo kNormLanes: lane l sums partial l, l + kNormLanes, ... in order,
//    then the same tree. Lane 0 is the result (0 for n == 0).
// The GPU runs one thread block of kNormLanes threads per chunk (coalesced
// reads), then one block for the partials.
inline constexpr int kNormLanes = 256;
inline constexpr int64_t kNormChunk = 4096;  // elements: 16 per lane
double ordered_squared_norm(const float* x, int64_t n);

}  // namespace strata::cpu_adam
