// The optimizer's own thread and the protocol by which compute waits for it
// (Note [Optimizer overlap]). No LibTorch here.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "memory/tiered_state.h"

namespace strata {

// Note [Optimizer overlap]
// With run.overlap_optimizer, step() hands the optimizer to its own thread
// once backward and the gradient norm are done, and returns. The optimizer
// walks the sub-groups in shard-space order, which is the forward's block
// order, and publishes after each sub-group how far the update is final
// (for a working copy staged off the device: written). The next step's
// forward waits per block only until that block's range is final, and the
// parameter window prefetches only final blocks; by the head (the last
// block) every update is done, so the backward never waits, while the last
// NVMe write-backs finish during it. The next optimizer step, eval, checkpoint
// and the state accessors wait for the thread first (finish()). The same
// updates in the same order: arithmetic does not change.
//
// Thread-safety: start(), wait() and ready() are the compute thread's;
// publish() is the job's (it runs on the optimizer thread); wait_for_job()
// any thread's.
class OptimizerThread {
 public:
  struct Job {
    float grad_scale = 1.0f;
    double lr = 0.0;
    int64_t step = 0;
    Completion backward_done;  // the device's compute up to the step's last gradient
  };
  // What the last finished job took, reported once by take_report().
  struct Report {
    double seconds = 0.0;
    LinkBytes links;  // bytes it moved (its thread's transfers)
  };
  using Work = std::function<void(const Job&)>;

  // Starts the thread; `work` runs one job (and calls publish()).
  explicit OptimizerThread(Work work);
  // Waits for a running job; a failure nobody asked about is logged.
  ~OptimizerThread();
  OptimizerThread(const OptimizerThread&) = delete;
  OptimizerThread& operator=(const OptimizerThread&) = delete;

  // Hands over a job. REQUIRES: no job running (wait(INT64_MAX) returned).
  void start(const Job& job);
  // The job's progress: shard-space elements [0, offset) are final.
  void publish(int64_t offset);
  // Until [0, offset) is final, or the job has ended; rethrows the job's
  // failure (once). Adds the seconds it blocked to *waited.
  void wait(int64_t offset, double* waited);
  // Shard-space elements known final now (INT64_MAX when idle).
  int64_t progress();
  // Any thread (a checkpoint save reading what job `step` wrote): until
  // [0, offset) of the job with Job::step == step is final; at once when that
  // job has ended, a later one has started, or none has. False when that job
  // failed (its error stays for wait()).
  bool wait_for_job(int64_t step, int64_t offset);
  // The last finished job's time and bytes, then zeroes them.
  Report take_report();

 private:
  void loop();

  Work work_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  Job job_;                          // guarded by mu_, as are the rest
  bool ready_ = false, busy_ = false, quit_ = false;
  int64_t progress_ = INT64_MAX;     // set to INT64_MAX only when a job ends
  std::exception_ptr error_;
  int64_t ended_step_ = -1;  // Job::step of the last job that ended
  bool ended_failed_ = false;
  Report report_;
};

}  // namespace strata
