// The gradient path to homes off the device (Note [Gradient path] in
// gradient_path.h): landing buffers, the D2H, and the lander thread that adds
// each landed gradient into its home.
#include "engine/gradient_path.h"

#include <algorithm>

#include "cpu_adam/grad_ops.h"
#include "util/errors.h"
#include "util/trace.h"

namespace strata {

// ---- to the host ------------------------------------------------------------------

void GradientPath::stage_free() {
  if (stage_read_.pending()) ctx_.device->stream_wait(Stream::kCompute, stage_read_);
}

int GradientPath::claim_landing() {
  const int half = landing_turn_;
  landing_turn_ ^= 1;
  std::unique_lock<std::mutex> lock(mu_);
  if (busy_[half]) {
    TraceSpan span(TraceTrack::kCopy, "wait for a landing buffer");
    cv_.wait(lock, [&] { return !busy_[half]; });
  }
  if (error_) std::rethrow_exception(error_);  // the lander failed: stop queuing
  busy_[half] = true;
  return half;
}

void GradientPath::queue_landing(size_t b, int half, cpu_adam::GradType wire, const Completion& copied, bool last) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    STRATA_CHECK(queue_.size < 2, "more landings queued than landing halves");
    queue_.push_back(Landing{int(b), half, wire, copied, !written_[b], last});
  }
  cv_.notify_all();
  written_[b] = 1;
}

void GradientPath::land(size_t b, DevicePtr src, cpu_adam::GradType wire, bool last) {
  const int64_t bytes = ctx_.shard_numel(b) * bytes_of(wire);
  STRATA_CHECK(bytes <= landing_half_bytes_, "a gradient larger than its landing buffer");
  const int half = claim_landing();
  Device& dev = *ctx_.device;
  Completion copied;
  try {
    TraceSpan span(TraceTrack::kCopy, "gradient D2H");
    dev.stream_wait(Stream::kD2H, dev.record(Stream::kCompute));
    dev.copy_to_host(landing_.data() + half * landing_half_bytes_, src, bytes, Stream::kD2H);
    copied = dev.record(Stream::kD2H);
  } catch (...) {
    release_landing(half);
    throw;
  }
  stage_read_ = copied;  // the stage is rewritten only after this read
  ctx_.state->count_copy(/*to_device=*/false, bytes);
  queue_landing(b, half, wire, copied, last);
}

void GradientPath::wait_lander_idle() {
  std::unique_lock<std::mutex> lock(mu_);
  if (queue_.empty()) return;
  TraceSpan span(TraceTrack::kCopy, "wait for gradients to land");
  cv_.wait(lock, [&] { return queue_.empty(); });
}

void GradientPath::lander_loop() {
  LinkBytes mine;  // this thread's transfers (NVMe homes)
  TieredState::TallyScope tally(&mine);
  for (;;) {
    Landing l;
    bool skip = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return quit_ || !queue_.empty(); });
      if (queue_.empty()) return;
      l = queue_.front();
      skip = error_ != nullptr;
    }
    std::exception_ptr failed;
    try {
      if (skip) {
        l.copied.wait();  // the copy still ends before its buffer is reused
      } else {
        land_on_host(l);
      }
    } catch (...) {
      failed = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.pop_front();
      busy_[l.half] = false;
      if (failed && !error_) error_ = failed;
      links_ += mine;
      mine = LinkBytes();
    }
    cv_.notify_all();
  }
}

// The lander's work on one landed gradient: into its home (in place on the
// host; read, add, write on NVMe) and, on the last micro-batch, its norm.
void GradientPath::land_on_host(Landing& l) {
  {
    TraceSpan span(TraceTrack::kCopy, "wait gradient D2H");
    l.copied.wait();
  }
  TraceSpan span(TraceTrack::kCopy, "gradient into its home");
  const size_t b = size_t(l.block);
  const int64_t n = ctx_.shard_numel(b);
  const int64_t off = ctx_.shard_offset[b];
  TieredState& state = *ctx_.state;
  const std::byte* src = landing_.data() + l.half * landing_half_bytes_;
  float* values = reinterpret_cast<float*>(state.resident(Category::kGrad, off, n));
  if (values != nullptr) {
    cpu_adam::accumulate_grad(values, src, l.wire, n, l.first);
  } else {
    values = rmw_.as<float>();
    STRATA_CHECK(values != nullptr, "a gradient home on NVMe without a read-modify-write buffer");
    if (!l.first) state.read_async(Category::kGrad, off, n, values, lander_io_).wait();
    cpu_adam::accumulate_grad(values, src, l.wire, n, l.first);
    state.write_async(Category::kGrad, off, n, values, lander_io_).wait();
  }
  if (l.last) host_norms_[b] = cpu_adam::ordered_squared_norm(values + norm_lo_[b], norm_hi_[b] - norm_lo_[b]);
  std::lock_guard<std::mutex> lock(mu_);
  if (l.last) mark_final_locked(b, Completion());  // the loop notifies
  ++stats_.adds;
  if (std::this_thread::get_id() == compute_thread_) ++stats_.adds_on_compute_thread;
}

void GradientPath::release_landing(int half) {
  std::lock_guard<std::mutex> lock(mu_);
  busy_[half] = false;
}

}  // namespace strata
