#include "engine/optimizer/optimizer_thread.h"

#include <chrono>
#include <climits>

#include "util/logging.h"
#include "util/trace.h"

namespace strata {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

OptimizerThread::OptimizerThread(Work work) : work_(std::move(work)) {
  thread_ = std::thread([this] { loop(); });
}

OptimizerThread::~OptimizerThread() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !busy_; });
    quit_ = true;
    if (error_) {
      try {
        std::rethrow_exception(error_);
      } catch (const std::exception& e) {
        log::warn("the last optimizer step failed and nobody asked: %s", e.what());
      } catch (...) {
        log::warn("the last optimizer step failed and nobody asked");
      }
    }
  }
  cv_.notify_all();
  thread_.join();
}

void OptimizerThread::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return ready_ || quit_; });
    if (quit_) return;
    ready_ = false;
    const Job job = job_;
    lock.unlock();
    std::exception_ptr error;
    const auto t0 = std::chrono::steady_clock::now();
    LinkBytes moved;
    try {
      TieredState::TallyScope tally(&moved);
      work_(job);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    const double took = seconds_since(t0);
    report_.seconds += took;
    if (job.kind == Kind::kSpeculate) report_.speculated_s += took;
    report_.links += moved;
    if (error && !error_) error_ = error;
    if (job.kind != Kind::kSpeculate) {  // a speculation's state is not its step's
      ended_step_ = job.step;
      ended_failed_ = error != nullptr;
    }
    low_ = 0;
    if (queued_ && !error_) {
      queued_ = false;
      begin_locked(next_);
    } else {
      queued_ = false;
      progress_ = state_progress_ = INT64_MAX;
      busy_ = false;
    }
    cv_.notify_all();
  }
}

void OptimizerThread::begin_locked(const Job& job) {
  job_ = job;
  ready_ = true;
  busy_ = true;
  const bool working_final = job.kind == Kind::kSpeculate || job.kind == Kind::kCommit;
  progress_ = working_final ? kWorkingFinal : 0;
  state_progress_ = 0;
  low_ = job.kind == Kind::kCommit ? INT64_MAX : 0;
}

void OptimizerThread::start(const Job& job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    begin_locked(job);
  }
  cv_.notify_all();
}

void OptimizerThread::queue(const Job& job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!busy_) {
      begin_locked(job);
    } else {
      next_ = job;
      queued_ = true;
    }
  }
  cv_.notify_all();
}

void OptimizerThread::publish(int64_t offset) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    progress_ = offset;
    state_progress_ = offset;
  }
  cv_.notify_all();
}

void OptimizerThread::publish_low(int64_t offset) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    low_ = offset;
  }
  cv_.notify_all();
}

void OptimizerThread::wait_low(int64_t offset, double* waited) {
  std::unique_lock<std::mutex> lock(mu_);
  if (low_ > offset) {
    TraceSpan span(TraceTrack::kCompute, "wait for the optimizer's commit");
    const auto t0 = std::chrono::steady_clock::now();
    cv_.wait(lock, [&] { return low_ <= offset; });
    *waited += seconds_since(t0);
  }
  if (!busy_ && error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void OptimizerThread::wait(int64_t offset, double* waited) {
  std::unique_lock<std::mutex> lock(mu_);
  if (busy_ && progress_ < offset) {
    TraceSpan span(TraceTrack::kCompute, "wait for optimizer");
    const auto t0 = std::chrono::steady_clock::now();
    cv_.wait(lock, [&] { return !busy_ || progress_ >= offset; });
    *waited += seconds_since(t0);
  }
  if (!busy_ && error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

bool OptimizerThread::wait_for_job(int64_t step, int64_t offset) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !busy_ || job_.step != step || state_progress_ >= offset; });
  if (busy_ && job_.step == step) return true;  // far enough
  return !(ended_step_ == step && ended_failed_);
}

int64_t OptimizerThread::progress() {
  std::lock_guard<std::mutex> lock(mu_);
  return progress_;
}

OptimizerThread::Report OptimizerThread::take_report() {
  std::lock_guard<std::mutex> lock(mu_);
  Report r = report_;
  report_ = Report();
  return r;
}

}  // namespace strata
