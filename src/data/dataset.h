// Token sources: byte-level text (vocab 256) and flat little-endian uint16 /
// uint32 token files (nanoGPT-style .bin). A dataset is the concatenation of
// its files split into a training part and a held-out tail (a range, not a
// copy); batches are random windows drawn deterministically from a seed, or
// (data.sampling examples / packed) examples from the files' indexes in
// seeded epochs (Note [Example epochs]), with loss masks flagging the
// targets that do not count (Note [Counted tokens]). The
// files are mapped read-only and read in their own width (Note [Mapped
// tokens]). No LibTorch here.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "config/config.h"
#include "util/counted_tokens.h"

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
// Note [Example epochs]
// With data.sampling examples or packed, the training examples are drawn in
// epochs: epoch k's order is a Fisher-Yates shuffle of their indices by a
// std::mt19937_64 seeded with run.seed + 0x9E3779B97F4A7C15 x (k + 1), j
// drawn as rng() % (i + 1) (no std distribution: the same order with any
// standard library); a step takes the next sequences' worth of examples in
// that order, crossing into the next epoch where this one ends. Every rank
// draws the whole global batch, so the batches depend on (seed, step) alone,
// and a checkpoint resumes mid-epoch from (epoch, next).
struct ExampleCursor {
  int64_t epoch = 0;
  int64_t next = 0;                 // the next example's place in the epoch's order
  std::vector<int64_t> order;       // that order (made when the epoch starts)
  int64_t order_epoch = -1;         // the epoch `order` is for
};

class TokenDataset {
 public:
  // Maps and concatenates `paths` (Note [Mapped tokens]). Throws InputError naming the file (and the
  // byte offset) for a missing/unreadable file, a size that is not a multiple
  // of the token width, or a token >= vocab_size; throws InputError when the
  // training part or the held-out part is shorter than one sequence
  // (seq_len + 1 tokens, input plus shifted target).
  TokenDataset(const std::vector<std::string>& paths, TokenFormat format, int64_t vocab_size,
               int64_t seq_len, double val_fraction);
  // The data section's files with their loss masks and example indexes
  // (docs/token-format.md, "Examples and loss masks"), checked in the same
  // pass: a mask byte other than 0 or 1, an index that does not cut the file
  // into non-empty examples, or (data.truncate off, examples sampled) an
  // example longer than a sequence throws InputError naming the file and
  // the offset or the example.
  TokenDataset(const DataConfig& data, int64_t vocab_size, int64_t seq_len);
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

  // Note [Counted tokens]: whether windows carry kNotCounted flags.
  bool masked() const { return masked_; }
  DataSampling sampling() const { return sampling_; }
  int64_t num_examples() const { return int64_t(example_start_.size()) - 1; }
  int64_t train_examples() const { return train_examples_; }
  int64_t val_examples() const { return num_examples() - train_examples_; }
  // data.sampling examples / packed (Note [Example epochs]): `batch`
  // sequences of the training examples from `cur` on, padded with id 0 not
  // counted; advances `cur`. Returns how many examples were cut to a
  // sequence (data.truncate).
  int64_t sample_examples(ExampleCursor& cur, uint64_t seed, int64_t batch, int64_t* out) const;
  // The same over the held-out examples, in order from the first (the same
  // sequences at every eval).
  void val_example_batch(int64_t batch, int64_t* out) const;

 private:
  void sample(std::mt19937_64& rng, int64_t begin, int64_t end, int64_t batch, int64_t* out) const;
  // Tokens [start, start + n) into out, widened, across file boundaries.
  void copy_tokens(int64_t start, int64_t n, int64_t* out) const;

  void open_files(const std::vector<std::string>& paths, const std::vector<std::string>& masks,
                  const std::vector<std::string>& indexes, int64_t vocab_size);
  void split_windows(const std::string& name, double val_fraction);
  void split_examples(const std::string& name, double val_fraction, bool truncate);
  // Fills one sequence with examples from `cur` (one, or as many whole ones
  // as fit when packing); returns the examples cut.
  int64_t fill_sequence(const std::vector<int64_t>& order, int64_t& next, int64_t end, int64_t* out) const;
  void place_example(int64_t e, int64_t len, int64_t* out) const;

  // One mapped file: `count` tokens of `width_` bytes from `first` on, its
  // loss mask (a byte a token, or null) and its example index.
  struct Mapped {
    const unsigned char* data = nullptr;
    size_t bytes = 0;
    int64_t first = 0;
    int64_t count = 0;
    const unsigned char* mask = nullptr;
    size_t mask_bytes = 0;
    const unsigned char* index = nullptr;
    size_t index_bytes = 0;
  };
  std::vector<Mapped> files_;
  bool masked_ = false;
  DataSampling sampling_ = DataSampling::kWindows;
  bool truncate_ = false;
  std::vector<int64_t> example_start_;  // every example's first token, then the end (examples only)
  int64_t train_examples_ = 0;
  int width_ = 1;
  int64_t total_ = 0;
  int64_t train_end_ = 0;
  int64_t seq_len_ = 0;
};

}  // namespace strata
