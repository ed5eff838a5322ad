// Helpers shared by the test suites: temporary directories and files,
// shell commands, free ports.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
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

// A shell command's exit status (128 + the signal when one killed it) and
// its stdout and stderr together.
struct Result {
  int code = -1;
  std::string output;
};

// Under CI (CI=true, as tools/test.sh and .ci/run set it), where every
// Python package the tests use is installed: a missing one fails the test.
inline bool under_ci() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

inline Result sh(const std::string& cmd) {
  Result r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : -1;
  return r;
}

// The whole file ("" when it cannot be read).
inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// XORs the byte at each of `offsets` of `path` with `mask`, in place (a file
// changed behind its owner's back). False when the file cannot be changed.
template <typename Offsets>
bool flip_bytes(const std::string& path, const Offsets& offsets, unsigned char mask) {
  const int fd = ::open(path.c_str(), O_RDWR);
  if (fd < 0) return false;
  bool ok = true;
  for (const off_t at : offsets) {
    unsigned char byte;
    ok = ok && ::pread(fd, &byte, 1, at) == 1;
    byte = static_cast<unsigned char>(byte ^ mask);
    ok = ok && ::pwrite(fd, &byte, 1, at) == 1;
  }
  ::close(fd);
  return ok;
}

// A TCP port free right now on the loopback interface (from bind(0)).
inline int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

}  // namespace strata::testing
