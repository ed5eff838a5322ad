// The thread-pool backend: pread/pwrite on a few threads per engine worker,
// for systems where io_uring is missing or forbidden (and to cross-check the
// io_uring backend in tests).
#include <errno.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "nvme/backend.h"

namespace strata::nvme {

namespace {

constexpr int kMaxThreadsPerQueue = 8;  // pread/pwrite calls in flight per engine worker

class ThreadBackend final : public Backend {
 public:
  explicit ThreadBackend(int queue_depth) {
    const int threads = std::clamp(queue_depth, 1, kMaxThreadsPerQueue);
    // At most queue_depth operations are outstanding: no allocation after this.
    prepared_.reserve(size_t(queue_depth));
    queue_.reserve(size_t(queue_depth));
    done_.reserve(size_t(queue_depth));
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
  }
  ~ThreadBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  const char* name() const override { return "threads"; }

  void prepare(const BackendOp& op) override { prepared_.push_back(op); }

  int submit_and_reap(int min_complete, std::span<Completion> out) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!prepared_.empty()) {
      queue_.erase(queue_.begin(), queue_.begin() + ptrdiff_t(head_));  // taken ones (no allocation)
      head_ = 0;
      queue_.insert(queue_.end(), prepared_.begin(), prepared_.end());
      const size_t n = prepared_.size();
      prepared_.clear();
      if (n == 1)
        work_cv_.notify_one();
      else
        work_cv_.notify_all();
    }
    done_cv_.wait(lock, [&] { return int(done_.size()) >= min_complete; });
    const size_t n = std::min(done_.size(), out.size());
    std::copy(done_.begin(), done_.begin() + ptrdiff_t(n), out.begin());
    done_.erase(done_.begin(), done_.begin() + ptrdiff_t(n));
    return int(n);
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      work_cv_.wait(lock, [&] { return stop_ || head_ < queue_.size(); });
      if (head_ == queue_.size()) return;  // stop_
      const BackendOp op = queue_[head_++];
      lock.unlock();
      ssize_t rc;
      do {
        rc = op.op == IoOp::kRead
                 ? ::pread(op.fd, op.buffer, size_t(op.bytes), off_t(op.offset_bytes))
                 : ::pwrite(op.fd, op.buffer, size_t(op.bytes), off_t(op.offset_bytes));
      } while (rc < 0 && errno == EINTR);
      const int64_t result = rc < 0 ? -int64_t(errno) : int64_t(rc);
      lock.lock();
      done_.push_back({op.tag, result});
      done_cv_.notify_one();
    }
  }

  std::vector<BackendOp> prepared_;  // owner thread only
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::vector<BackendOp> queue_;  // [head_, size) waiting; guarded by mu_
  size_t head_ = 0;               // guarded by mu_
  std::vector<Completion> done_;  // guarded by mu_
  bool stop_ = false;             // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace

std::unique_ptr<Backend> make_thread_backend(int queue_depth) {
  return std::make_unique<ThreadBackend>(queue_depth);
}

}  // namespace strata::nvme
