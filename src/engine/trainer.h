// The training step: forward over blocks without autograd (keeping each
// block's input), loss with autograd over the head, backward over blocks in
// reverse by recomputing each block from its saved input with autograd over
// weight views, gradient accumulation, global-norm clipping, and the optimizer
// per sub-group where its state lives (see Note [Step order]). All state is
// held by a TieredState, placed by the config's placement plan.
#pragma once

#include <ATen/ATen.h>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <string>
#include <vector>

#include "config/config.h"
#include "cpu_adam/adam.h"
#include "memory/buffer.h"
#include "memory/layout.h"
#include "memory/param_window.h"
#include "memory/placement.h"
#include "memory/tiered_state.h"
#include "model/model.h"

namespace strata {

struct StepResult {
  double loss = 0.0;       // mean over the micro-batches of the step
  double grad_norm = 0.0;  // global L2 norm before clipping
  double lr = 0.0;
  int64_t tokens = 0;      // tokens trained on in this step
  LinkBytes links;         // bytes moved by this step's compute and by the optimizer step
                           // reported in optimizer_s, per link
  double wait_s = 0.0;     // seconds compute waited for parameters / gradients to arrive
  double optimizer_s = 0.0;  // seconds in the optimizer (including its swapping); with
                             // run.overlap_optimizer: the last optimizer step that finished
  double optimizer_wait_s = 0.0;  // seconds this step's compute waited for the optimizer
};

// Bytes of each state category, for the start-up report.
struct StateBytes {
  int64_t param16 = 0;     // working copy in the compute dtype
  int64_t master = 0;      // fp32 parameters
  int64_t grad = 0;        // fp32 gradients
  int64_t optimizer = 0;   // exp_avg + exp_avg_sq
  int64_t total() const { return param16 + master + grad + optimizer; }
};

// Owns the model's state and the buffers of the step, all sized at
// construction: nothing on the step's path allocates except LibTorch's own
// activations. Not thread-safe.
class Trainer {
 public:
  // Plans the placement for this machine, allocates and initialises all state
  // from cfg.run.seed (the same values whatever the placement).
  // `faults` (tests): injected below the NVMe engine (nvme/fault_backend.h).
  Trainer(const Config& cfg, const Model& model, std::shared_ptr<nvme::FaultPlan> faults = nullptr);
  ~Trainer();

  // One optimizer step over `accum` micro-batches. `tokens` holds
  // accum x micro_batch windows of seq_len + 1 tokens (int64, row-major).
  StepResult step(const int64_t* tokens);

  // Waits for the last step's optimizer (Note [Optimizer overlap]) and
  // rethrows its failure; the state is then final. Call before the end.
  void finish();

  // Mean loss over `batches` windows of micro_batch x (seq_len + 1) tokens,
  // without gradients.
  double eval_loss(const int64_t* tokens, int64_t batches);

  const StateLayout& layout() const { return layout_; }
  const PlacementPlan& plan() const { return state_->plan(); }
  const TieredState& state() const { return *state_; }
  StateBytes state_bytes() const;
  int64_t steps_done() const { return step_; }
  at::ScalarType compute_dtype() const { return compute_dtype_; }

  // Copies of block b's state (padded flat, for tests, export, checkpoints).
  at::Tensor master_block(size_t b);
  at::Tensor grad_block(size_t b);
  // Block b's weights as the forward uses them (compute dtype), as copies.
  std::vector<at::Tensor> block_weights(size_t b);

  // The parameter window (Note [Prefetch window]): measured peaks and fetches.
  const ParamWindow& window() const { return *window_; }

  // Peak bytes of saved block inputs (activation checkpoints) held on the
  // device: the layers' saved inputs, or with cpu_checkpointing the two slots
  // that bring them back.
  int64_t peak_checkpoint_device_bytes() const { return peak_ckpt_device_; }

  // Peak bytes per tier, measured from the allocations: resident state plus
  // the transient and staging buffers (device: gathered blocks, gradient
  // staging; host: optimizer staging); NVMe: swap regions in use. LibTorch's
  // activations are not included.
  std::array<int64_t, kNumTiers> peak_bytes() const;

 private:
  // Block b's padded range of `buf` as a flat tensor of `dtype` (no copy).
  at::Tensor block_flat(size_t b, void* buf, at::ScalarType dtype);
  at::Tensor fp32_block_copy(Category c, size_t b);
  // The range when it is resident on the device tier, else nullptr.
  std::byte* device_resident(Category c, int64_t offset, int64_t numel) const;
  // Views of block b's weights in the compute dtype: at `fetched` (from the
  // window), or in place when the block is device-resident (fetched nullptr).
  std::vector<at::Tensor> weights(size_t b, std::byte* fetched);
  // Adds `grads[first..]` (one per parameter of block b) into b's gradient home.
  void accumulate_grad(size_t b, const std::vector<at::Tensor>& grads, size_t first);
  void flush_grad(size_t b);
  double forward_backward(const at::Tensor& tokens, double loss_scale);
  double global_grad_norm();
  void optimizer_step(float grad_scale, double lr, int64_t step);
  // Note [Optimizer overlap]: the optimizer thread and how compute waits for it.
  void optimizer_thread();
  void publish_progress(int64_t offset);
  void wait_progress(int64_t offset);   // until [0, offset) of shard space is final
  int32_t ready_blocks();
  // The window's next use (blocks `b0` and, for the tied head, `b1`), once
  // the optimizer has finished them.
  void acquire(std::byte* out[2], size_t b0, size_t b1);
  at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& targets) const;
  // Keeps x as layer b's saved input (on the device, or offloaded).
  void save_input(size_t b, const at::Tensor& x);
  // Layer b's saved input on the device for its backward; prefetches b - 1's.
  at::Tensor restore_input(size_t b);

  Config cfg_;
  const Model& model_;
  StateLayout layout_;
  at::ScalarType compute_dtype_;
  int compute_bytes_;
  size_t embedding_block_ = 0;
  size_t head_block_ = 0;
  std::unique_ptr<TieredState> state_;
  std::unique_ptr<cpu_adam::CpuAdam> adam_;

  // Transient device buffers: the parameter window (blocks not resident on
  // the device) and fp32 gradient staging (2: accumulate, and
  // read-modify-write of a non-resident gradient).
  std::unique_ptr<ParamWindow> window_;
  std::vector<WindowUse> train_schedule_, eval_schedule_;
  HostBuffer grad_stage_;
  HostBuffer grad_rmw_;
  // Optimizer staging, allocated only for what is not resident: grad and
  // master (fp32), exp_avg and exp_avg_sq (the plan's element size: fp32 or
  // bf16) and the emitted working copy.
  int64_t group_numel_ = 0;               // elements of a pipeline piece
  std::vector<PlacementUnit> pieces_;     // the optimizer's pipeline pieces, in shard order
  HostBuffer opt_grad_, opt_master_, opt_avg_, opt_avg_sq_, opt_emit_;  // opt_sets sets each
  std::vector<PendingIo> opt_reads_, opt_writes_;  // per staging set
  struct OptSet {
    cpu_adam::AdamSpans adam;
    std::byte* working = nullptr;
    bool working_resident = false;
  };
  std::vector<OptSet> opt_spans_;

  std::vector<std::string> forward_names_, backward_names_;  // trace span names per block
  std::vector<at::Tensor> grad_stage_flat_;                  // per block: its range of grad_stage_
  std::vector<std::vector<at::Tensor>> grad_stage_views_;    // per block: parameter views of it
  std::vector<char> grad_written_;        // per block: written since the step began
  std::vector<at::Tensor> saved_inputs_;  // per block, the activation checkpoint
  // cpu_checkpointing: layer b's saved input in host slot b, brought back
  // into device slot b % 2 for its backward (the next one prefetched).
  HostBuffer ckpt_host_, ckpt_device_;
  int64_t ckpt_bytes_ = 0;
  std::vector<int64_t> ckpt_shape_;
  int64_t ckpt_device_now_ = 0, peak_ckpt_device_ = 0;
  at::Tensor tied_grad_;                  // head's gradient for the tied embedding, until flushed
  int64_t step_ = 0;
  bool broken_ = false;                   // an optimizer step failed part-way

  // The optimizer thread (run.overlap_optimizer).
  bool overlap_ = false;
  std::vector<int64_t> block_end_;        // per block: end of its range in shard space
  std::thread opt_thread_;
  std::mutex opt_mu_;
  std::condition_variable opt_cv_;
  struct OptJob {
    float grad_scale = 1.0f;
    double lr = 0.0;
    int64_t step = 0;
  } opt_job_;                             // guarded by opt_mu_, as are the next five
  bool opt_job_ready_ = false, opt_busy_ = false, opt_quit_ = false;
  int64_t opt_progress_ = INT64_MAX;      // shard-space elements whose update is final
  std::exception_ptr opt_error_;
  double opt_seconds_ = 0.0;              // duration of the last finished optimizer step
  LinkBytes opt_links_;                   // its bytes moved, until reported by a step
  double opt_wait_s_ = 0.0;               // compute thread: seconds waited for the optimizer
  PendingIo opt_param_write_;             // a staged working copy's write, waited at once
};

}  // namespace strata
