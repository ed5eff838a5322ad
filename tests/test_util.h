// Helpers shared by the test suites: temporary directories and files.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>

namespace strata::testing {

// A fresh directory under $TMPDIR, removed with its contents on destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "strata-test-XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) std::abort();
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

  // Writes `bytes` to `name` inside the directory and returns its path.
  std::string write(const std::string& name, const std::string& bytes) const {
    std::ofstream f(file(name), std::ios::binary);
    f.write(bytes.data(), std::streamsize(bytes.size()));
    return file(name);
  }

 private:
  std::filesystem::path path_;
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
