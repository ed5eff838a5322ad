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

TokenDataset::TokenDataset(const std::vector<std::string>& paths, TokenFormat format,
                           int64_t vocab_size, int64_t seq_len, double val_fraction)
    : width_(width_of(format)), seq_len_(seq_len) {
  if (paths.empty()) throw ConfigError("data.path", "no data file given");
  try {
    for (const std::string& path : paths) {
      Mapped m;
      m.data = map_file(path, width_, &m.bytes);
      m.first = total_;
      m.count = int64_t(m.bytes) / width_;
      files_.push_back(m);
      validate(path, m.data, m.bytes, width_, vocab_size);
      total_ += m.count;
    }
  } catch (...) {
    for (const Mapped& m : files_) {
      if (m.data != nullptr) ::munmap(const_cast<unsigned char*>(m.data), m.bytes);
    }
    throw;
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

TokenDataset::~TokenDataset() {
  for (const Mapped& m : files_) {
    if (m.data != nullptr) ::munmap(const_cast<unsigned char*>(m.data), m.bytes);
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

}  // namespace strata
