// Helpers shared by the test suites: temporary directories and files.
#pragma once

#include <ftw.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

namespace strata::testing {

// A fresh directory under $TMPDIR, removed with its contents on destruction.
// POSIX calls rather than std::filesystem: see Note [No std::filesystem next to
// LibTorch] in src/util/fs.h.
class TempDir {
 public:
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/strata-test-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) std::abort();
    path_ = tmpl;
  }
  ~TempDir() {
    nftw(path_.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); },
         16, FTW_DEPTH | FTW_PHYS);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

  // Writes `bytes` to `name` inside the directory and returns its path.
  std::string write(const std::string& name, const std::string& bytes) const {
    std::ofstream f(file(name), std::ios::binary);
    f.write(bytes.data(), std::streamsize(bytes.size()));
    return file(name);
  }

 private:
  std::string path_;
};

// Some English text, long enough to train on for a few steps.
inline std::string sample_text(size_t min_bytes) {
  const std::string para =
      "The quick brown fox jumps over the lazy dog. A model whose training state does not fit in "
      "memory trains anyway, at nearly the speed it would have if it fitted, when every shard of "
      "state moves between tiers ahead of need. ";
  std::string out;
  while (out.size() < min_bytes) out += para;
  return out;
}

}  // namespace strata::testing
