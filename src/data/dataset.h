// Token sources: byte-level text (vocab 256) and flat little-endian uint16 /
// uint32 token files (nanoGPT-style .bin). A dataset is one token array split
// into a training part and a held-out tail; batches are random windows drawn
// deterministically from a seed. No LibTorch here.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace strata {

enum class TokenFormat { kText, kUint16, kUint32 };

// Parses "text" | "uint16" | "uint32". Throws ConfigError naming data.format.
TokenFormat parse_token_format(const std::string& s);

class TokenDataset {
 public:
  // Reads and concatenates `paths`. Throws InputError naming the file (and the
  // byte offset) for a missing/unreadable file, a size that is not a multiple
  // of the token width, or a token >= vocab_size; throws InputError when the
  // training part or the held-out part is shorter than one sequence
  // (seq_len + 1 tokens, input plus shifted target).
  TokenDataset(const std::vector<std::string>& paths, TokenFormat format, int64_t vocab_size,
               int64_t seq_len, double val_fraction);

  int64_t num_tokens() const { return int64_t(tokens_.size()); }
  int64_t train_tokens() const { return train_end_; }
  int64_t val_tokens() const { return num_tokens() - train_end_; }
  const std::vector<uint32_t>& tokens() const { return tokens_; }
  int64_t seq_len() const { return seq_len_; }

  // Fills `out` (batch x (seq_len + 1) int64, row-major) with windows of the
  // training part, starting offsets drawn from `rng`.
  void sample_train(std::mt19937_64& rng, int64_t batch, int64_t* out) const;
  // Same over the held-out part.
  void sample_val(std::mt19937_64& rng, int64_t batch, int64_t* out) const;

 private:
  void sample(std::mt19937_64& rng, int64_t begin, int64_t end, int64_t batch, int64_t* out) const;

  std::vector<uint32_t> tokens_;
  int64_t train_end_ = 0;
  int64_t seq_len_ = 0;
};

}  // namespace strata
