// A Chrome-trace recorder (the JSON "trace event" format Perfetto and
// chrome://tracing open): complete events on a few named tracks. The event
// buffer is allocated once; recording copies a name into it and allocates
// nothing, and when no tracer is installed a span costs one branch.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace strata {

// One track per kind of work (Chrome trace "tid").
enum class TraceTrack : int { kCompute = 1, kCopy = 2, kNvme = 3, kAdam = 4, kComm = 5 };

class Tracer {
 public:
  // Keeps at most `max_events` events; later ones are counted and dropped.
  explicit Tracer(size_t max_events);
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  using Clock = std::chrono::steady_clock;
  void record(TraceTrack track, const char* name, Clock::time_point start, Clock::time_point end);
  size_t size() const { return events_.size(); }
  int64_t dropped() const { return dropped_; }

  // The process this trace shows (one per rank: pid rank + 1, "strata rank r").
  void set_rank(int rank) { rank_ = rank; }

  // Writes the JSON array (atomically: temporary name, then rename). Throws IoError.
  void write(const std::string& path) const;

  // The process-wide tracer spans report to; nullptr = tracing off.
  static Tracer* current() { return current_; }
  static void install(Tracer* t) { current_ = t; }

 private:
  struct Event {
    char name[48];
    int track;
    int64_t start_ns;
    int64_t dur_ns;
  };
  std::vector<Event> events_;
  size_t max_events_;
  int64_t dropped_ = 0;
  Clock::time_point origin_;
  int rank_ = -1;  // -1: a single-process run
  mutable std::mutex mu_;
  static Tracer* current_;
};

// Records [construction, destruction) on `track` when a tracer is installed.
// `name` is copied (truncated to 47 characters).
class TraceSpan {
 public:
  TraceSpan(TraceTrack track, const char* name)
      : tracer_(Tracer::current()), track_(track), name_(name) {
    if (tracer_ != nullptr) start_ = Tracer::Clock::now();
  }
  ~TraceSpan() {
    if (tracer_ != nullptr) tracer_->record(track_, name_, start_, Tracer::Clock::now());
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  Tracer* tracer_;
  TraceTrack track_;
  const char* name_;
  Tracer::Clock::time_point start_;
};

}  // namespace strata
