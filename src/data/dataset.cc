#include "data/dataset.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "util/errors.h"
#include "util/fs.h"

namespace strata {

TokenFormat parse_token_format(const std::string& s) {
  if (s == "text") return TokenFormat::kText;
  if (s == "uint16") return TokenFormat::kUint16;
  if (s == "uint32") return TokenFormat::kUint32;
  throw ConfigError("data.format", "expected text, uint16 or uint32, got \"" + s + "\"");
}

namespace {

std::vector<char> read_file(const std::string& path) {
  if (is_directory(path)) throw InputError(path, "is a directory; data.path names a file or a list of files");
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw InputError(path, std::string("cannot open data file: ") + std::strerror(errno));
  const std::streamsize size = f.tellg();
  if (size < 0) throw InputError(path, "cannot determine the size of the data file");
  std::vector<char> bytes(static_cast<size_t>(size));
  f.seekg(0);
  if (size > 0 && !f.read(bytes.data(), size)) {
    throw InputError(path, "short read of the data file");
  }
  return bytes;
}

void append_tokens(const std::string& path, const std::vector<char>& bytes, TokenFormat format,
                   int64_t vocab_size, std::vector<uint32_t>& out) {
  const size_t width = format == TokenFormat::kText ? 1 : format == TokenFormat::kUint16 ? 2 : 4;
  if (bytes.size() % width != 0) {
    throw InputError(path, "size " + std::to_string(bytes.size()) + " bytes is not a multiple of " +
                               std::to_string(width) + " (the token width of this format); " +
                               "trailing bytes at offset " +
                               std::to_string(bytes.size() / width * width));
  }
  const size_t n = bytes.size() / width;
  out.reserve(out.size() + n);
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  for (size_t i = 0; i < n; ++i) {
    uint32_t t = 0;
    // Little-endian regardless of the host.
    for (size_t b = 0; b < width; ++b) t |= uint32_t(p[i * width + b]) << (8 * b);
    if (int64_t(t) >= vocab_size) {
      throw InputError(path, "token " + std::to_string(t) + " at byte offset " +
                                 std::to_string(i * width) + " is outside the vocabulary (" +
                                 "model.vocab_size = " + std::to_string(vocab_size) + ")");
    }
    out.push_back(t);
  }
}

}  // namespace

TokenDataset::TokenDataset(const std::vector<std::string>& paths, TokenFormat format,
                           int64_t vocab_size, int64_t seq_len, double val_fraction)
    : seq_len_(seq_len) {
  if (paths.empty()) throw ConfigError("data.path", "no data file given");
  for (const std::string& path : paths) {
    append_tokens(path, read_file(path), format, vocab_size, tokens_);
  }
  const std::string name = paths.size() == 1 ? paths[0] : paths[0] + " (+" +
                                                              std::to_string(paths.size() - 1) +
                                                              " more)";
  const int64_t need = seq_len + 1;
  if (num_tokens() < need) {
    throw InputError(name, "has " + std::to_string(num_tokens()) +
                               " tokens, fewer than one sequence needs (model.seq_len + 1 = " +
                               std::to_string(need) + ")");
  }
  const int64_t val = int64_t(double(num_tokens()) * val_fraction);
  train_end_ = num_tokens() - val;
  if (train_end_ < need) {
    throw InputError(name, "the training part (" + std::to_string(train_end_) +
                               " tokens) is shorter than one sequence (" + std::to_string(need) +
                               " tokens); lower data.val_fraction or use more data");
  }
  if (val > 0 && val < need) {
    throw InputError(name, "the held-out part (" + std::to_string(val) +
                               " tokens, data.val_fraction) is shorter than one sequence (" +
                               std::to_string(need) + " tokens)");
  }
}

void TokenDataset::sample(std::mt19937_64& rng, int64_t begin, int64_t end, int64_t batch,
                          int64_t* out) const {
  const int64_t window = seq_len_ + 1;
  STRATA_CHECK(end - begin >= window, "split shorter than a window");
  // Draw offsets with our own arithmetic rather than a std distribution, whose
  // algorithm differs between standard libraries: same seed, same batches.
  const uint64_t choices = uint64_t(end - begin - window + 1);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t start = begin + int64_t(rng() % choices);
    for (int64_t t = 0; t < window; ++t) out[b * window + t] = int64_t(tokens_[size_t(start + t)]);
  }
}

void TokenDataset::sample_train(std::mt19937_64& rng, int64_t batch, int64_t* out) const {
  sample(rng, 0, train_end_, batch, out);
}

void TokenDataset::sample_val(std::mt19937_64& rng, int64_t batch, int64_t* out) const {
  STRATA_CHECK(val_tokens() > seq_len_, "no held-out part");
  sample(rng, train_end_, num_tokens(), batch, out);
}

}  // namespace strata
