#include "data/dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "util/errors.h"
#include "util/fs.h"

namespace strata {

namespace {

int width_of(TokenFormat format) {
  return format == TokenFormat::kText ? 1 : format == TokenFormat::kUint16 ? 2 : 4;
}

// Little-endian regardless of the host.
uint32_t load(const unsigned char* p, int width) {
  uint32_t t = 0;
  for (int b = 0; b < width; ++b) t |= uint32_t(p[b]) << (8 * b);
  return t;
}

// Maps `path` read-only (nothing for an empty file); checks its size against
// the token width.
const unsigned char* map_file(const std::string& path, int width, size_t* bytes) {
  if (is_directory(path)) throw InputError(path, "is a directory; data.path names a file or a list of files");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw InputError(path, std::string("cannot open data file: ") + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw InputError(path, std::string("cannot determine the size of the data file: ") + std::strerror(err));
  }
  *bytes = size_t(st.st_size);
  if (*bytes % size_t(width) != 0) {
    ::close(fd);
    throw InputError(path, "size " + std::to_string(*bytes) + " bytes is not a multiple of " + std::to_string(width) +
                               " (the token width of this format); trailing bytes at offset " +
                               std::to_string(*bytes / size_t(width) * size_t(width)));
  }
  void* p = nullptr;
  if (*bytes > 0) p = ::mmap(nullptr, *bytes, PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) throw InputError(path, std::string("cannot map the data file: ") + std::strerror(err));
  return static_cast<const unsigned char*>(p);
}

// Maps a loss mask or an example index beside a token file (the same
// errors as the token file's, naming it).
const unsigned char* map_side(const std::string& path, size_t* bytes) { return map_file(path, 1, bytes); }

// The loss mask: a byte a token, 0 or 1.
void validate_mask(const std::string& path, const unsigned char* mask, size_t bytes, int64_t tokens) {
  if (int64_t(bytes) != tokens) {
    throw InputError(path, "has " + std::to_string(bytes) + " bytes, but its token file has " + std::to_string(tokens) +
                               " tokens (a loss mask is one byte a token); the mask does not match its tokens from "
                               "offset " + std::to_string(std::min<int64_t>(int64_t(bytes), tokens)));
  }
  for (size_t i = 0; i < bytes; ++i) {
    if (mask[i] > 1) {
      throw InputError(path, "byte " + std::to_string(int(mask[i])) + " at offset " + std::to_string(i) +
                                 " is not 0 or 1 (a loss mask says whether each token counts)");
    }
  }
}

// The example index: little-endian uint64 offsets from 0 to the file's
// tokens, each example non-empty.
int64_t index_at(const unsigned char* p, size_t i) {
  uint64_t v = 0;
  for (int b = 0; b < 8; ++b) v |= uint64_t(p[i * 8 + size_t(b)]) << (8 * b);
  return int64_t(v);
}

void validate_index(const std::string& path, const unsigned char* index, size_t bytes, int64_t tokens) {
  if (bytes % 8 != 0 || bytes < 16) {
    throw InputError(path, "has " + std::to_string(bytes) + " bytes, not a list of at least two uint64 offsets "
                               "(an example index: examples + 1 of them)");
  }
  const size_t n = bytes / 8;
  if (index_at(index, 0) != 0) throw InputError(path, "the offset at byte 0 is " + std::to_string(index_at(index, 0)) + ", not 0");
  for (size_t i = 1; i < n; ++i) {
    const int64_t a = index_at(index, i - 1), b = index_at(index, i);
    if (b <= a || b > tokens) {
      throw InputError(path, "the offset at byte " + std::to_string(i * 8) + " is " + std::to_string(b) +
                                 ", after " + std::to_string(a) + ": offsets must rise, to at most the token file's " +
                                 std::to_string(tokens) + " tokens");
    }
  }
  if (index_at(index, n - 1) != tokens) {
    throw InputError(path, "the last offset (byte " + std::to_string((n - 1) * 8) + ") is " +
                               std::to_string(index_at(index, n - 1)) + ", not the token file's " +
                               std::to_string(tokens) + " tokens");
  }
}

// One sequential pass over a mapped file: the first id outside the vocabulary.
void validate(const std::string& path, const unsigned char* data, size_t bytes, int width, int64_t vocab_size) {
  if (bytes == 0) return;
  ::madvise(const_cast<unsigned char*>(data), bytes, MADV_SEQUENTIAL);
  const size_t n = bytes / size_t(width);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t t = load(data + i * size_t(width), width);
    if (int64_t(t) >= vocab_size) {
      throw InputError(path, "token " + std::to_string(t) + " at byte offset " + std::to_string(i * size_t(width)) +
                                 " is outside the vocabulary (model.vocab_size = " + std::to_string(vocab_size) + ")");
    }
  }
  ::madvise(const_cast<unsigned char*>(data), bytes, MADV_RANDOM);  // windows are drawn at random
}

}  // namespace

void TokenDataset::open_files(const std::vector<std::string>& paths, const std::vector<std::string>& masks,
                              const std::vector<std::string>& indexes, int64_t vocab_size) {
  if (paths.empty()) throw ConfigError("data.path", "no data file given");
  try {
    for (size_t f = 0; f < paths.size(); ++f) {
      const std::string& path = paths[f];
      Mapped m;
      m.data = map_file(path, width_, &m.bytes);
      m.first = total_;
      m.count = int64_t(m.bytes) / width_;
      files_.push_back(m);
      validate(path, m.data, m.bytes, width_, vocab_size);
      if (f < masks.size() && !masks[f].empty()) {
        files_.back().mask = map_side(masks[f], &files_.back().mask_bytes);
        validate_mask(masks[f], files_.back().mask, files_.back().mask_bytes, m.count);
        masked_ = true;
      }
      if (f < indexes.size() && !indexes[f].empty()) {
        files_.back().index = map_side(indexes[f], &files_.back().index_bytes);
        validate_index(indexes[f], files_.back().index, files_.back().index_bytes, m.count);
      }
      total_ += m.count;
    }
  } catch (...) {
    for (const Mapped& m : files_) {
      if (m.data != nullptr) ::munmap(const_cast<unsigned char*>(m.data), m.bytes);
      if (m.mask != nullptr) ::munmap(const_cast<unsigned char*>(m.mask), m.mask_bytes);
      if (m.index != nullptr) ::munmap(const_cast<unsigned char*>(m.index), m.index_bytes);
    }
    files_.clear();
    throw;
  }
}

namespace {

std::string data_name(const std::vector<std::string>& paths) {
  return paths.size() == 1 ? paths[0] : paths[0] + " (+" + std::to_string(paths.size() - 1) + " more)";
}

}  // namespace

TokenDataset::TokenDataset(const std::vector<std::string>& paths, TokenFormat format,
                           int64_t vocab_size, int64_t seq_len, double val_fraction)
    : width_(width_of(format)), seq_len_(seq_len) {
  open_files(paths, {}, {}, vocab_size);
  split_windows(data_name(paths), val_fraction);
}

TokenDataset::TokenDataset(const DataConfig& data, int64_t vocab_size, int64_t seq_len)
    : sampling_(data.sampling), truncate_(data.truncate), width_(width_of(data.format)), seq_len_(seq_len) {
  open_files(data.paths, data.mask_paths, data.index_paths, vocab_size);
  if (sampling_ == DataSampling::kWindows) {
    split_windows(data_name(data.paths), data.val_fraction);
  } else {
    masked_ = true;  // padding is never counted
    split_examples(data_name(data.paths), data.val_fraction, data.truncate);
  }
}

// Windows: the last val_fraction of the tokens held out; each part at least
// a window (or the held-out part empty).
void TokenDataset::split_windows(const std::string& name, double val_fraction) {
  const int64_t need = seq_len_ + 1;
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

// Examples (Note [Example epochs]): every file's index joined, the last
// val_fraction of them held out; an example longer than a sequence refused
// unless data.truncate.
void TokenDataset::split_examples(const std::string& name, double val_fraction, bool truncate) {
  for (size_t f = 0; f < files_.size(); ++f) {
    const Mapped& m = files_[f];
    STRATA_CHECK(m.index != nullptr, "examples without an index (the config checks data.sampling)");
    const size_t n = m.index_bytes / 8;
    for (size_t i = 0; i + 1 < n; ++i) example_start_.push_back(m.first + index_at(m.index, i));
  }
  example_start_.push_back(total_);
  const int64_t window = seq_len_ + 1;
  if (!truncate) {
    for (int64_t e = 0; e < num_examples(); ++e) {
      const int64_t len = example_start_[size_t(e) + 1] - example_start_[size_t(e)];
      if (len <= window) continue;
      throw InputError(name, "example " + std::to_string(e) + " (tokens " + std::to_string(example_start_[size_t(e)]) +
                                 " to " + std::to_string(example_start_[size_t(e) + 1]) + ") has " + std::to_string(len) +
                                 " tokens, more than a sequence holds (model.seq_len + 1 = " + std::to_string(window) +
                                 "); data.truncate: true cuts such examples");
    }
  }
  const int64_t val = int64_t(double(num_examples()) * val_fraction);
  train_examples_ = num_examples() - val;
  if (train_examples_ < 1) {
    throw InputError(name, "no training example is left after data.val_fraction holds out " + std::to_string(val) +
                               " of " + std::to_string(num_examples()));
  }
  train_end_ = example_start_[size_t(train_examples_)];
}

TokenDataset::~TokenDataset() {
  for (const Mapped& m : files_) {
    if (m.data != nullptr) ::munmap(const_cast<unsigned char*>(m.data), m.bytes);
    if (m.mask != nullptr) ::munmap(const_cast<unsigned char*>(m.mask), m.mask_bytes);
    if (m.index != nullptr) ::munmap(const_cast<unsigned char*>(m.index), m.index_bytes);
  }
}

uint32_t TokenDataset::token(int64_t i) const {
  int64_t v = 0;
  copy_tokens(i, 1, &v);
  return uint32_t(v);
}

void TokenDataset::copy_tokens(int64_t start, int64_t n, int64_t* out) const {
  STRATA_CHECK(start >= 0 && start + n <= total_, "tokens outside the dataset");
  // The file holding `start`: the last one whose first token is <= start.
  auto it = std::upper_bound(files_.begin(), files_.end(), start,
                             [](int64_t s, const Mapped& m) { return s < m.first; });
  size_t f = size_t(it - files_.begin()) - 1;
  for (int64_t done = 0; done < n; ++f) {
    const Mapped& m = files_[f];
    const int64_t at = start + done - m.first;
    const int64_t take = std::min(n - done, m.count - at);
    for (int64_t t = 0; t < take; ++t) out[done + t] = int64_t(load(m.data + (at + t) * width_, width_));
    if (m.mask != nullptr) {  // Note [Counted tokens]
      for (int64_t t = 0; t < take; ++t) out[done + t] |= m.mask[at + t] ? 0 : kNotCounted;
    }
    done += take;
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
    copy_tokens(start, window, out + b * window);
  }
}

void TokenDataset::sample_train(std::mt19937_64& rng, int64_t batch, int64_t* out) const {
  sample(rng, 0, train_end_, batch, out);
}

void TokenDataset::sample_val(std::mt19937_64& rng, int64_t batch, int64_t* out) const {
  STRATA_CHECK(val_tokens() > seq_len_, "no held-out part");
  sample(rng, train_end_, num_tokens(), batch, out);
}

// Example e's first `len` tokens at `out`; its first token is never a
// target (nothing before it in the example predicts it).
void TokenDataset::place_example(int64_t e, int64_t len, int64_t* out) const {
  copy_tokens(example_start_[size_t(e)], len, out);
  out[0] |= kNotCounted;
}

int64_t TokenDataset::fill_sequence(const std::vector<int64_t>& order, int64_t& next, int64_t end,
                                    int64_t* out) const {
  const int64_t window = seq_len_ + 1;
  int64_t at = 0, cut = 0;
  while (next < end) {
    const int64_t e = order.empty() ? next : order[size_t(next)];
    int64_t len = example_start_[size_t(e) + 1] - example_start_[size_t(e)];
    if (at > 0 && at + len > window) break;  // packed: the next sequence starts with it
    if (len > window) {
      STRATA_CHECK(truncate_, "an example longer than a sequence (checked at start)");
      len = window;
      ++cut;
    }
    place_example(e, len, out + at);
    at += len;
    ++next;
    if (sampling_ == DataSampling::kExamples) break;
  }
  for (int64_t t = at; t < window; ++t) out[t] = kNotCounted;  // padding: id 0, never counted
  return cut;
}

int64_t TokenDataset::sample_examples(ExampleCursor& cur, uint64_t seed, int64_t batch, int64_t* out) const {
  STRATA_CHECK(sampling_ != DataSampling::kWindows, "examples drawn from windows");
  const int64_t n = train_examples_, window = seq_len_ + 1;
  int64_t cut = 0;
  for (int64_t b = 0; b < batch; ++b) {
    if (cur.next >= n) {
      ++cur.epoch;
      cur.next = 0;
    }
    if (cur.order_epoch != cur.epoch) {
      // Note [Example epochs]: the epoch's order.
      cur.order.resize(size_t(n));
      for (int64_t i = 0; i < n; ++i) cur.order[size_t(i)] = i;
      std::mt19937_64 rng(seed + 0x9E3779B97F4A7C15ULL * uint64_t(cur.epoch + 1));
      for (int64_t i = n - 1; i > 0; --i) std::swap(cur.order[size_t(i)], cur.order[size_t(rng() % uint64_t(i + 1))]);
      cur.order_epoch = cur.epoch;
    }
    cut += fill_sequence(cur.order, cur.next, n, out + b * window);
  }
  return cut;
}

void TokenDataset::val_example_batch(int64_t batch, int64_t* out) const {
  STRATA_CHECK(val_examples() > 0, "no held-out examples");
  const int64_t window = seq_len_ + 1;
  int64_t next = train_examples_;
  for (int64_t b = 0; b < batch; ++b) {
    if (next >= num_examples()) next = train_examples_;  // fewer held-out examples than sequences: again
    fill_sequence({}, next, num_examples(), out + b * window);
  }
}

}  // namespace strata
