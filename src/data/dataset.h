// Token sources: byte-level text (vocab 256) and flat little-endian uint16 /
// uint32 token files (nanoGPT-style .bin). A dataset is the concatenation of
// its files split into a training part and a held-out tail (a range, not a
// copy); batches are random windows drawn deterministically from a seed. The
// files are mapped read-only and read in their own width (Note [Mapped
// tokens]). No LibTorch here.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "config/config.h"

namespace strata {

// data.format's values (config/config.h): bytes of text, or .bin token files
// (docs/token-format.md).
using TokenFormat = DataFormat;

// Note [Mapped tokens]
// Token files are mapped read-only, never read into the process's own
// memory: a node's ranks share one page cache of the corpus, and a rank's
// anonymous memory does not grow with it (a 10B-token uint16 corpus would
// otherwise be 40 GB widened to uint32 per rank). Ids are validated at
// construction in one sequential pass over the mapping (bounded memory; the
// first bad id's file and byte offset), and a window is widened to int64 only
// when a batch is drawn.
class TokenDataset {
 public:
  // Maps and concatenates `paths` (Note [Mapped tokens]). Throws InputError naming the file (and the
  // byte offset) for a missing/unreadable file, a size that is not a multiple
  // of the token width, or a token >= vocab_size; throws InputError when the
  // training part or the held-out part is shorter than one sequence
  // (seq_len + 1 tokens, input plus shifted target).
  TokenDataset(const std::vector<std::string>& paths, TokenFormat format, int64_t vocab_size,
               int64_t seq_len, double val_fraction);
  ~TokenDataset();
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;

  int64_t num_tokens() const { return total_; }
  int64_t train_tokens() const { return train_end_; }
  int64_t val_tokens() const { return num_tokens() - train_end_; }
  // Token i of the concatenation. REQUIRES: 0 <= i < num_tokens().
  uint32_t token(int64_t i) const;
  int64_t seq_len() const { return seq_len_; }

  // Fills `out` (batch x (seq_len + 1) int64, row-major) with windows of the
  // training part, starting offsets drawn from `rng`.
  void sample_train(std::mt19937_64& rng, int64_t batch, int64_t* out) const;
  // Same over the held-out part.
  void sample_val(std::mt19937_64& rng, int64_t batch, int64_t* out) const;

 private:
  void sample(std::mt19937_64& rng, int64_t begin, int64_t end, int64_t batch, int64_t* out) const;
  // Tokens [start, start + n) into out, widened, across file boundaries.
  void copy_tokens(int64_t start, int64_t n, int64_t* out) const;

  // One mapped file: `count` tokens of `width_` bytes from `first` on.
  struct Mapped {
    const unsigned char* data = nullptr;
    size_t bytes = 0;
    int64_t first = 0;
    int64_t count = 0;
  };
  std::vector<Mapped> files_;
  int width_ = 1;
  int64_t total_ = 0;
  int64_t train_end_ = 0;
  int64_t seq_len_ = 0;
};

}  // namespace strata
