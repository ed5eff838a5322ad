// The optimizer pass: AdamW over this rank's shard space in pipeline pieces,
// each where its state lives (the device's Adam for pieces wholly in HBM,
// CPU Adam for the others with what is not resident staged), inline or on
// its own thread (Note [Optimizer overlap] in optimizer_thread.h), and the
// staging buffers it needs.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <atomic>
#include <functional>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cpu_adam/adam.h"
#include "engine/optimizer/optimizer_thread.h"
#include "engine/optimizer/save_gate.h"
#include "engine/step_context.h"
#include "memory/buffer.h"
#include "memory/placement.h"
#include "memory/tiered_state.h"

namespace strata {

// The optimizer's staging buffers (Note [Optimizer pipeline]): `sets` sets
// of one pipeline piece of each category that is not resident, allocated
// once as the plan counted them (StagingNeeds::opt_*), with the I/O in flight
// per set. On a device host code may not touch (a GPU) every slot, each of
// which may cross PCIe, is registered with the device; slots
// of a category with pieces on NVMe are registered with the I/O engine (Note
// [Registered buffers] in nvme/engine.h).
class OptimizerStaging {
 public:
  OptimizerStaging(const PlacementPlan& plan, TieredState& state);

  int sets() const { return sets_; }
  int64_t piece_numel() const { return piece_numel_; }
  // Set k's buffer for category c, nullptr when c is never staged; kParam16
  // is the new working copy the step emits.
  std::byte* slot(Category c, int k) const;
  // Reads and write-backs in flight per set, and their completions: a set is
  // reused only once the write-backs of its previous piece have completed.
  PendingIo& reads(int k) { return reads_[size_t(k)]; }
  PendingIo& writes(int k) { return writes_[size_t(k)]; }
  Completion& read_done(int k) { return read_done_[size_t(k)]; }
  Completion& write_done(int k) { return write_done_[size_t(k)]; }
  int64_t bytes() const;  // host

 private:
  int sets_ = 1;
  int64_t piece_numel_ = 0;
  std::array<int, kNumCategories> elem_bytes_{};
  std::array<HostBuffer, kNumCategories> buf_;  // per category, `sets_` pieces each
  std::array<PinnedHostBuffer, kNumCategories> pinned_;  // or registered with the device
  std::array<std::byte*, kNumCategories> base_{};
  std::vector<nvme::BufferRegistration> io_registered_;  // after the buffers: ends first
  std::vector<PendingIo> reads_, writes_;  // sized once: completions point into them
  std::vector<Completion> read_done_, write_done_;
};

// Note [Optimizer pipeline]
// The loop walks pipeline pieces (sub-groups cut to at most
// kPipelineChunkElems, Note [Pipeline pieces] in placement.h). Staging comes
// in `sets` sets (pipeline_depth in placement.h). With three or more, the
// reads of piece j + sets - 2 are issued before piece j is updated (with two,
// those of j + 1), and j's write-backs right after it, so NVMe transfers run
// on the I/O threads, sets - 2 pieces deep, while CPU Adam runs on its own. A
// set is reused for j + sets only once the write-backs of the piece that used
// it last have completed (the set of j - 2, whose write-backs had the update
// of j - 1 to run in). With one set the loop is sequential. Arithmetic does
// not depend on the depth.
//
// On a GPU (a device host code may not touch), a piece whose state, gradient
// and working copy all live in HBM is updated there by the fused kernel
// (kernels/adam.h, bit for bit CPU Adam's), queued on the compute stream, with
// nothing staged; every other piece is CPU Adam's as above, its device-tier
// parts staged through host memory like NVMe ones.
//
// Device-tier copies of staged pieces run on the state's own streams
// (kStateD2H, kStateH2D) and complete with their set's group like NVMe
// transfers, so they pipeline the same way instead of waiting per copy.
//
// Note [Speculative optimizer]
// With optimizer.speculate (OptimizerPlan::speculate) the update runs behind
// the backward, exact. Its inputs but two are known when the step begins:
// the learning rate, the Adam step, the loss scale; the two that are not are
// the clip coefficient (the global norm, after the whole backward and its
// all-reduce) and fp16's overflow verdict. The step speculates that the
// coefficient is 1 and nothing overflowed, i.e. the gradient scale is
// 1/loss_scale, which is the inline optimizer's float(coef / loss_scale)
// bit for bit when that holds.
// The mechanism, "two passes": the pre-step state is kept by not writing it.
//  1. speculate (kSpeculate, on the optimizer thread, beside the backward):
//     as each block's gradient becomes final (GradientSource::wait_final:
//     its last micro-batch's add and, with ranks, its reduction, landed),
//     from the highest piece down, CPU Adam computes the piece's step and
//     writes only the new working copy (CpuAdam::step_keeping_state, or the
//     step on staged copies of swapped state that are then dropped). The
//     master weights and moments are read, not written.
//  2. the verdict (compute thread, after the norm's all-reduce):
//     - coefficient 1, finite: commit. Pieces wholly in HBM (the device's
//       Adam; not speculated: it is fast) are launched on the compute
//       stream at once; a commit job (kCommit, from the highest piece down,
//       the next backward's order) computes the same step again and writes
//       master and moments (not the working copy, already final), during
//       the next step's forward. A block's gradient home is rewritten by the
//       next backward only once the commit is below it (wait_committed).
//     - clipped (coefficient < 1): redo. A full job with the true scale, as
//       without speculation: the state was never written, so this is the
//       inline optimizer's update; the next forward waits per block for it.
//     - skipped (fp16 overflow) or a non-finite norm: restore. The working
//       copy is the master weights rounded to the compute dtype (as start-up
//       and checkpoint loads make it), so kRestore rewrites the speculated
//       pieces' working copy from the unchanged master weights.
// Extra host memory traffic of a committed step: the commit pass re-reads
// the gradient, master and moments (16 bytes per element with fp32
// moments, 12 with bf16) beside the inline pass's reads and writes.
// The mechanism "alternate slots", for pieces whose master weights and
// moments all live on NVMe (OptimizerPlan::speculate_slots, where the disk
// has room for a second copy): the pre-step state is kept by writing the
// new one elsewhere. The speculation steps the staged copies in full and
// writes master and moments into the pieces' spare swap slots (Note
// [Alternate swap slots] in memory/tiered_state.h) beside the working
// copy; the commit job flips each piece's slots (after a save in flight
// has read it) and reads nothing; a redo reads the current, pre-step slots
// and writes them in place; a restore reads them. A committed step moves
// exactly the bytes of the inline optimizer (0 extra bytes moved per element,
// in memory and on disk; the slots take 12 bytes per element of disk with
// fp32 moments); a clipped one twice its NVMe bytes and Adam.
// A checkpoint holds committed state only: a save waits for the commit job
// of its step (wait_for_job), and a kill during speculation leaves master
// and moments at the last committed step (the working copy is rebuilt from
// the master weights on load).
//
// Thread-safety: step(), wait(), finish() and the accessors are the compute
// thread's; set_save() and wait_for_job() any thread's.
// CPU Adam's threads for `cfg` on `device` (0 = all cores).
int adam_threads(const Config& cfg, const Device& device);

// The part [start, start + numel) of a piece's spans (moments of
// `moment_bytes`, the emitted working copy of `working_bytes` per element):
// one CPU Adam call over a run inside a block shard (optimizer_pass.cc and
// optimizer_speculation.cc).
cpu_adam::AdamSpans run_part(const cpu_adam::AdamSpans& whole, int64_t start, int64_t numel, int64_t moment_bytes,
                             int64_t working_bytes);

class OptimizerPass {
 public:
  // Cuts the plan's pieces and their runs, allocates the staging, and with
  // run.overlap_optimizer starts the optimizer's thread.
  OptimizerPass(const StepContext& ctx, const PlacementPlan& plan, cpu_adam::Isa isa);
  // The thread first: its job uses the staging.
  ~OptimizerPass();

  using Report = OptimizerThread::Report;  // seconds and bytes of one job
  // Applies `job`: inline (returns its time and bytes), or handed to the
  // thread after the previous job finished (returns that one's).
  Report step(const OptimizerThread::Job& job);
  // Note [Speculative optimizer]. Whether some piece speculates.
  bool speculates() const { return speculates_; }
  // Where speculation learns that gradients are final. REQUIRES: set before
  // the first speculate().
  void set_gradients(GradientSource* source) {
    gradients_ = source;
    if (source != nullptr) source->track_finals(speculates_);
  }
  // Queues the step's speculation (job.kind kSpeculate) behind the previous
  // step's commit.
  void speculate(const OptimizerThread::Job& job);
  enum class Verdict { kCommit, kRedo, kRestore };
  // After the speculation ended: commits it, redoes the step with `job`'s
  // true scale (kRedo), or restores the working copy (kRestore). Returns the
  // report of the jobs finished since the last step()/settle().
  Report settle(Verdict verdict, const OptimizerThread::Job& job);
  // A step failed before its verdict: the speculation stops (the gradient
  // source's waits return false) and the working copy is restored.
  void abandon_speculation(const OptimizerThread::Job& job);
  // Until the commit job has written [offset, end of the shard space).
  void wait_committed(int64_t offset);
  int64_t speculated_numel() const { return speculated_numel_; }  // elements of the pieces that speculate
  // Tests: called on the optimizer's thread before each piece a job works
  // on, with the job's kind (OptimizerThread::Kind). Set only while the
  // thread is idle (before a step, or after finish()): it is read unlocked.
  void set_piece_hook(std::function<void(int kind)> hook) { piece_hook_ = std::move(hook); }
  // Any thread (tests): the lowest block whose speculated update has begun
  // in the running or last speculation (INT64_MAX: none yet).
  int64_t speculation_reached_block() const { return reached_block_.load(std::memory_order_acquire); }
  // Until the running job has made [0, offset) final (no-op without the
  // thread); rethrows its failure, after which broken() is true.
  void wait(int64_t offset);
  void finish() { wait(INT64_MAX); }
  // Shard-space elements final now (INT64_MAX when no job runs).
  int64_t progress();
  // An optimizer step failed part-way: the state is inconsistent.
  bool broken() const { return broken_; }
  double wait_seconds() const { return wait_s_; }  // compute waited for the thread
  bool threaded() const { return thread_ != nullptr; }
  // Any thread: Note [Optimizer overlap]'s wait for job `step`'s progress.
  bool wait_for_job(int64_t step, int64_t offset);
  // A save in flight (nullptr: none); passes of steps after its applied()
  // wait for it per piece.
  void set_save(std::shared_ptr<SaveGate> save);
  // Seconds passes waited for a save in flight (SaveGate::make_writable) since
  // the last call, on any thread.
  double take_checkpoint_wait();
  const OptimizerStaging& staging() const { return *staging_; }
  // Orders stream `s` after the device-side updates of [offset, offset +
  // numel) of optimizer state by the last job that reached it (the device's
  // Adam on the compute stream, write-backs on kStateH2D), without host
  // waits and without waiting for compute queued since: what a save reading
  // that job's device-tier state needs. REQUIRES: that job has published the
  // range (wait_for_job), and no later job has updated it.
  void order_after_updates(Stream s, int64_t offset, int64_t numel) const;

 private:
  struct Abandoned {};  // a speculation's gradients will not come (abandon_speculation)
  void run(const OptimizerThread::Job& job);
  void walk(const OptimizerThread::Job& job, const std::vector<size_t>& order, size_t ahead,
            const std::shared_ptr<SaveGate>& save, const cpu_adam::AdamParams& h);
  void stage_piece(size_t j, const OptimizerThread::Job& job);
  void update_piece(size_t j, const OptimizerThread::Job& job, const cpu_adam::AdamParams& h);
  void speculate_piece(size_t j, const OptimizerThread::Job& job, const cpu_adam::AdamParams& h);
  void restore_piece(size_t j);
  void write_back_piece(size_t j, bool state, bool working, bool spare = false);
  void launch_device_pieces(const OptimizerThread::Job& job);
  cpu_adam::AdamParams adam_params(const OptimizerThread::Job& job) const;
  std::shared_ptr<SaveGate> save_for(const OptimizerThread::Job& job);
  void cut_runs();
  struct DeviceRun;
  void launch_device_run(const cpu_adam::AdamParams& h, const OptimizerThread::Job& job, const DeviceRun& r);
  void device_adam(const cpu_adam::AdamParams& h, const cpu_adam::StepArgs& args, const cpu_adam::AdamSpans& spans);

  const StepContext& ctx_;
  std::unique_ptr<cpu_adam::CpuAdam> adam_;
  // Adam's threads checksum the staged pieces' swap reads and writes (Note
  // [Parallel checksums] in nvme/swap_store.h): between the pieces' updates,
  // on the same thread that calls step(), so never beside it.
  struct AdamThreads final : nvme::ParallelFor {
    cpu_adam::CpuAdam* adam = nullptr;
    void run(int64_t n, Body body, void* context) const override { adam->parallel_for(n, body, context); }
  };
  AdamThreads checksum_threads_;
  // Pipeline pieces in shard order (Note [Pipeline pieces] in placement.h),
  // their runs inside one block shard (with the global unpadded index of
  // their first element: the key of bf16 moments' rounding).
  std::vector<PlacementUnit> pieces_;
  struct AdamRun {
    int64_t start = 0;   // elements from the piece's start
    int64_t numel = 0;
    uint64_t key = 0;
    int32_t block = 0;
  };
  std::vector<std::vector<AdamRun>> piece_runs_;
  std::vector<std::string> speculate_names_, commit_names_;  // per piece: trace spans
  std::vector<char> piece_on_device_;     // per piece: device_adam_piece()
  // Note [Speculative optimizer]: per piece, whether it speculates (CPU
  // Adam's pieces, with OptimizerPlan::speculate); the pieces in shard
  // order, and those that speculate from the highest down.
  std::vector<char> piece_speculates_;
  std::vector<char> piece_slots_;  // and whether into alternate swap slots (speculates_in_slots)
  bool speculates_ = false;
  int64_t speculated_numel_ = 0;
  std::atomic<int64_t> reached_block_{INT64_MAX};
  std::function<void(int)> piece_hook_;
  std::vector<size_t> speculation_order(const PlacementPlan& plan) const;
  // The pieces in shard order, and the speculating ones in the order their
  // gradients become final (speculation_order).
  std::vector<size_t> ascending_, descending_;
  std::vector<int> set_of_;               // per piece: its staging set in the running job
  GradientSource* gradients_ = nullptr;
  PendingIo grad_read_;                   // a speculated piece's gradient, read once final
  double speculation_waited_s_ = 0.0;     // the speculation's waits for gradients (its thread's; read after finish())
  // Device pieces' runs merged across pieces (one launch per stretch of a
  // block shard, not one per 2^20-element piece), launched at the piece where
  // each starts; empty for the pieces a merged run covers.
  struct DeviceRun {
    int64_t offset = 0;  // shard space
    int64_t numel = 0;
    uint64_t key = 0;
  };
  std::vector<std::vector<DeviceRun>> device_launch_;
  // Per piece: its optimizer state has device-tier parts (a GPU), and the
  // completion of the last job's device-side update of it (fired: none).
  std::vector<char> piece_device_state_;
  std::vector<Completion> device_done_;
  Completion last_launch_;                // the last device launch's (the optimizer thread's)
  std::unique_ptr<OptimizerStaging> staging_;
  struct OptSet {
    cpu_adam::AdamSpans adam;
    std::byte* working = nullptr;
    bool working_resident = false;
    bool keeps_state = false;  // some of master and moments is resident (updated in place)
  };
  std::vector<OptSet> sets_;              // per staging set
  PendingIo param_write_;                 // a staged working copy's write, waited at once
  std::unique_ptr<OptimizerThread> thread_;  // run.overlap_optimizer
  double wait_s_ = 0.0;
  bool broken_ = false;
  void add_checkpoint_wait(double seconds);
  std::atomic<int64_t> checkpoint_wait_ns_{0};
  std::mutex save_mu_;
  std::shared_ptr<SaveGate> save_;        // guarded by save_mu_
};

}  // namespace strata
