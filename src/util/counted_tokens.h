// Note [Counted tokens]
// Fine-tuning data says which targets count toward the loss (loss masks,
// padding: docs/token-format.md, "Examples and loss masks"). A batch stays
// one int64 array of windows of seq_len + 1 ids (input: the first seq_len,
// targets: the last seq_len), and a token that is not counted as a target
// carries kNotCounted above its id: the input side reads the id
// (token & kTokenIdMask), the target side reads -100, the ignored label of
// transformers' loss, where the flag is set. So the windows travel through
// the token buffers, the ranks' slices and the tests unchanged, and a run
// without masks has no flag anywhere. A window's first token is input only:
// its flag means nothing.
#pragma once

#include <cstdint>

namespace strata {

inline constexpr int64_t kNotCounted = int64_t(1) << 40;
inline constexpr int64_t kTokenIdMask = (int64_t(1) << 32) - 1;

// The counted targets of `sequences` windows of seq_len + 1 tokens.
inline int64_t counted_targets(const int64_t* tokens, int64_t sequences, int64_t seq_len) {
  int64_t n = 0;
  for (int64_t s = 0; s < sequences; ++s) {
    const int64_t* w = tokens + s * (seq_len + 1);
    for (int64_t t = 1; t <= seq_len; ++t) n += (w[t] & kNotCounted) == 0;
  }
  return n;
}

}  // namespace strata
