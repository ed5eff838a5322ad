#include "util/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

namespace strata {

ProgressBar::ProgressBar(std::string label, int64_t total, int64_t plain_every)
    : label_(std::move(label)), total_(std::max<int64_t>(total, 1)), plain_every_(plain_every),
      tty_(isatty(STDERR_FILENO) != 0), start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {
  if (plain_every_ <= 0) plain_every_ = std::max<int64_t>(total_ / 10, 1);
}

ProgressBar::~ProgressBar() { finish(); }

void ProgressBar::update(int64_t done, const std::string& suffix) {
  const auto now = std::chrono::steady_clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double frac = std::clamp(double(done) / double(total_), 0.0, 1.0);
  const double eta = done > 0 ? elapsed * (double(total_ - done) / double(done)) : 0.0;
  if (tty_) {
    // Redraw at most 10 times a second, and always at the end.
    if (done < total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    constexpr int kWidth = 28;  // characters of bar
    const int filled = int(frac * kWidth);
    std::string bar(filled, '#');
    bar.resize(kWidth, '.');
    std::fprintf(stderr, "\r\033[K%s [%s] %lld/%lld %3.0f%% %.0fs<%.0fs %s", label_.c_str(),
                 bar.c_str(), (long long)done, (long long)total_, frac * 100.0, elapsed, eta,
                 suffix.c_str());
    std::fflush(stderr);
  } else if (done == total_ || done % plain_every_ == 0) {
    std::fprintf(stderr, "%s %lld/%lld (%.0f%%) %.0fs %s\n", label_.c_str(), (long long)done,
                 (long long)total_, frac * 100.0, elapsed, suffix.c_str());
  }
}

void ProgressBar::finish() {
  if (finished_) return;
  finished_ = true;
  if (tty_) std::fprintf(stderr, "\n");
}

}  // namespace strata
