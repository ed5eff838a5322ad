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
// With speculation (Note [Speculative optimizer] in optimizer_pass.h) a job
// has a kind. A speculative job runs during the backward and a commit job
// during the next forward; the working copy is final during both (the
// speculation rewrites only blocks whose backward is over, and the commit
// does not touch it), so progress() says so at once (kWorkingFinal), while
// a save waiting for a commit job's state waits for its end. A commit job
// walks the shard space downwards, in the next backward's order, and
// publishes how far down it has written (publish_low, wait_low): a block's
// gradient home is rewritten only above that. A job queued behind the
// running one (queue()) starts when it ends.
//
// Thread-safety: start(), queue(), wait(), wait_low() and progress() are the
// compute thread's; publish() and publish_low() are the job's (it runs on
// the optimizer thread); wait_for_job() any thread's.
// Where a speculative job learns that a block's gradient is final (the
// gradient path: engine/gradient_path.h).
class GradientSource {
 public:
  virtual ~GradientSource() = default;
  // Until block b's gradient of the running step is whole in its home;
  // *device: what a device-side read of it must be ordered after (fired for
  // homes off the device). False when the step was abandoned.
  virtual bool wait_final(size_t b, Completion* device) = 0;
  // Whether anyone will ask (the device events are recorded only then).
  virtual void track_finals(bool on) = 0;
};

class OptimizerThread {
 public:
  enum class Kind : uint8_t {
    kFull,       // the step's update, shard order, the working copy emitted
    kSpeculate,  // the working copy only, from the state, as gradients become final
    kCommit,     // the speculated step's state written, downwards, no working copy
    kRestore,    // the working copy rewritten from the (unchanged) master weights
  };
  // progress() while the working copy is final but the job runs.
  static constexpr int64_t kWorkingFinal = INT64_MAX - 1;
  struct Job {
    float grad_scale = 1.0f;
    double lr = 0.0;
    int64_t step = 0;
    Completion backward_done;  // the device's compute up to the step's last gradient
    Kind kind = Kind::kFull;
  };
  // What the jobs finished since the last take_report() took.
  struct Report {
    double seconds = 0.0;
    double speculated_s = 0.0;  // of which speculative jobs (beside the backward)
    LinkBytes links;  // bytes they moved (their thread's transfers)
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
  // Hands over a job that starts when the running one ends (at once when
  // none runs). REQUIRES: none queued already.
  void queue(const Job& job);
  // The job's progress: shard-space elements [0, offset) are final.
  void publish(int64_t offset);
  // A commit job's progress: [offset, end of the shard space) is written.
  void publish_low(int64_t offset);
  // Until no commit job runs or it has written [offset, end); rethrows a
  // failure of the jobs, as wait() does.
  void wait_low(int64_t offset, double* waited);
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
  void begin_locked(const Job& job);  // job_ becomes `job`, its progress reset

  Job job_;                          // guarded by mu_, as are the rest
  bool ready_ = false, busy_ = false, quit_ = false;
  Job next_;                         // queue()'s
  bool queued_ = false;
  int64_t progress_ = INT64_MAX;     // set to INT64_MAX only when the jobs end
  int64_t state_progress_ = INT64_MAX;  // what wait_for_job() reads: a commit's only at its end
  int64_t low_ = 0;                  // a commit job's publish_low(); 0 when none runs
  std::exception_ptr error_;
  int64_t ended_step_ = -1;  // Job::step of the last job that ended
  bool ended_failed_ = false;
  Report report_;
};

}  // namespace strata
