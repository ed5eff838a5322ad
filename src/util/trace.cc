#include "util/trace.h"

#include <errno.h>

#include <cstdio>
#include <cstring>

#include "util/errors.h"
#include "util/logging.h"

namespace strata {

Tracer* Tracer::current_ = nullptr;

Tracer::Tracer(size_t max_events) : max_events_(max_events), origin_(Clock::now()) {
  events_.reserve(max_events);
}

void Tracer::record(TraceTrack track, const char* name, Clock::time_point start, Clock::time_point end) {
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.size() >= max_events_) {
    ++dropped_;
    return;
  }
  Event e;
  std::strncpy(e.name, name, sizeof(e.name) - 1);
  e.name[sizeof(e.name) - 1] = '\0';
  e.track = int(track);
  e.start_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(start - origin_).count();
  e.dur_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count();
  events_.push_back(e);
}

void Tracer::write(const std::string& path) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) throw IoError(tmp, errno, "cannot create trace file");
  std::fputs("[\n", f);
  const char* tracks[] = {"", "compute", "copies (host <-> device)", "NVMe I/O", "CPU Adam", "collectives"};
  // One process per rank, so that traces of several ranks merge in Perfetto.
  const int pid = rank_ < 0 ? 1 : rank_ + 1;
  for (int t = 1; t <= 5; ++t) {
    std::fprintf(f,
                 "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%s\"}},\n"
                 "{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":%d,\"tid\":%d,\"args\":{\"sort_index\":%d}},\n",
                 pid, t, tracks[t], pid, t, t);
  }
  std::fprintf(f, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%d,\"args\":{\"name\":\"%s\"}}", pid,
               rank_ < 0 ? "strata" : strprintf("strata rank %d", rank_).c_str());
  for (const Event& e : events_) {
    // Names are Strata's own ("forward layer.3"): no characters that need escaping.
    std::fprintf(f, ",\n{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f}", e.name,
                 pid, e.track, double(e.start_ns) / 1e3, double(e.dur_ns) / 1e3);
  }
  std::fputs("\n]\n", f);
  const bool ok = std::fflush(f) == 0 && std::ferror(f) == 0;
  std::fclose(f);
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    throw IoError(path, err, "cannot write trace file");
  }
}

}  // namespace strata
