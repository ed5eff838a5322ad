// A one-line progress bar on stderr for long jobs. On a terminal it redraws in
// place; otherwise it prints a line every `plain_every` updates, so logs of
// non-interactive runs (CI) stay readable.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace strata {

class ProgressBar {
 public:
  ProgressBar(std::string label, int64_t total, int64_t plain_every = 0);
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // Sets the position (0..total) and a free-form suffix ("loss 2.31 | 41k tok/s").
  void update(int64_t done, const std::string& suffix);
  // Ends the line. Called by the destructor if not called before.
  void finish();

 private:
  std::string label_;
  int64_t total_;
  int64_t plain_every_;
  bool tty_;
  bool finished_ = false;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
};

}  // namespace strata
