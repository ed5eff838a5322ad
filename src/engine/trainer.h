// The training step: forward over blocks without autograd (keeping each
// block's input), loss with autograd over the head, backward over blocks in
// reverse by recomputing each block from its saved input with autograd over
// weight views, gradient accumulation, global-norm clipping, and the optimizer
// per sub-group where its state lives (see Note [Step order]). All state is
// held by a TieredState, placed by the config's placement plan.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "comm/communicator.h"
#include "config/config.h"
#include "cpu_adam/adam.h"
#include "engine/activation_checkpoints.h"
#include "engine/loss_scaler.h"
#include "engine/optimizer_staging.h"
#include "engine/optimizer_thread.h"
#include "memory/buffer.h"
#include "memory/device.h"
#include "memory/layout.h"
#include "memory/param_window.h"
#include "memory/placement.h"
#include "memory/tiered_state.h"
#include "model/model.h"

namespace strata {

// Checkpoints move state in chunks of at most this many elements (64 MiB of
// fp32): the staging a save or load needs, whatever the model size.
inline constexpr int64_t kCheckpointChunkElems = int64_t(1) << 24;

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
  int64_t net_bytes = 0;     // bytes this rank sent over the network in the step
  double comm_wait_s = 0.0;  // seconds compute waited for collectives
  bool stop = false;         // some rank asked to stop: every rank stops after this step
  double loss_scale = 0.0;   // fp16: the loss scale this step used (0 without one)
  bool skipped = false;      // fp16: the gradients overflowed and the optimizer step was skipped
};

// Bytes of each state category, for the start-up report.
struct StateBytes {
  int64_t param16 = 0;     // working copy in the compute dtype
  int64_t master = 0;      // fp32 parameters
  int64_t grad = 0;        // fp32 gradients
  int64_t optimizer = 0;   // exp_avg + exp_avg_sq
  int64_t total() const { return param16 + master + grad + optimizer; }
};

// Note [Recompute]
// run.recompute decides how backward gets a layer's autograd graph. always:
// the forward runs without autograd and keeps only each layer's input
// (activation checkpoints); backward recomputes the layer from it, a quarter
// of the step's FLOPs more, one layer's activations at a time. never: the
// forward builds every layer's graph over leaf views of the weights and a
// leaf input and keeps it; backward asks autograd through it. The graph
// refers to the weights by address, so never needs them in place for the
// whole step (the working copy resident on the device, or gathered once per
// step): the plan refuses it otherwise, and auto picks it only then and when
// every layer's activations fit (memory/placement.h, keep_graphs). The same
// operations run on the same values either way: losses and weights are
// bit-identical on CPU (tested). On a GPU, LibTorch may choose another
// attention kernel when autograd is on, so there they may differ by rounding.
//
// Note [Gathered blocks]
// State lives in the rank's shard space (memory/layout.h); compute sees
// gathered blocks, and the two meet only in the Communicator. Before a use,
// the block's param16 shard (in place when device-resident, else from the
// parameter window) is all-gathered into a gathered buffer; the next use's
// gather is issued before the current use computes, so it overlaps compute.
// Stage 3 gathers at every use into a ring of two uses' buffers; stages 1-2
// keep param16 replicated: a block is gathered into a whole-model buffer at
// its first use after each optimizer step and reused. After a block's
// backward its full fp32 gradient is reduce-scattered (stages 2-3) or
// all-reduced (stages 0-1) while the next block's backward runs, and the
// rank's shard is then added into its gradient home. With one shard (world
// size 1, or stage 0) the shard is the block: no gather buffer, used in place.
//
// Owns the model's state and the buffers of the step, all sized at
// construction: nothing on the step's path allocates except LibTorch's own
// activations and c10d's work handles. Not thread-safe.
class Trainer {
 public:
  // Plans the placement for this machine, allocates and initialises all state
  // from cfg.run.seed (the same values whatever the placement or world size).
  // `faults` (tests): injected below the NVMe engine (nvme/fault_backend.h).
  // `comm`: the ranks of the run (must outlive the trainer; world size
  // cfg.world_size); nullptr: world size 1. `device`: where the step computes
  // and the device tier lives (must outlive the trainer); nullptr: run.device's
  // (Note [The trainer's device]).
  Trainer(const Config& cfg, const Model& model, std::shared_ptr<nvme::FaultPlan> faults = nullptr,
          Communicator* comm = nullptr, int local_ranks = 1, Device* device = nullptr);
  ~Trainer();

  // One optimizer step over this rank's `accum` micro-batches. `tokens` holds
  // accum x micro_batch windows of seq_len + 1 tokens (int64, row-major).
  // `stop_requested`: this rank wants to stop (a signal); combined over the
  // ranks into StepResult::stop. Collective: every rank calls it.
  StepResult step(const int64_t* tokens, bool stop_requested = false);

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
  // Optimizer steps applied: steps_done() less those fp16 skipped on overflow
  // (Note [Loss scaling]). Adam's step count and the lr schedule follow it.
  int64_t optimizer_steps() const { return applied_steps_; }
  // fp16 only (else nullptr): the loss scale and its counters.
  const LossScaler* loss_scaler() const { return scaler_.get(); }
  at::ScalarType compute_dtype() const { return compute_dtype_; }

  // Copies of block b's state, gathered from every rank (padded flat, for
  // tests, export, checkpoints). Collective: every rank calls them.
  at::Tensor master_block(size_t b);
  at::Tensor grad_block(size_t b);
  at::Tensor state_block(Category c, size_t b);  // in the category's stored dtype
  // Block b's weights as the forward uses them (compute dtype), as copies.
  std::vector<at::Tensor> block_weights(size_t b);
  Communicator& comm() const { return *comm_; }

  // Checkpoints (checkpoint/checkpoint.h). The pieces of this rank's shard
  // space that hold parameters, per saved category, in chunks of at most
  // kCheckpointChunkElems: those it saves (with replicated state, every rank
  // a share), or all it holds (to load).
  std::vector<ShardRange> checkpoint_ranges(bool save) const;
  // Every parameter's name, shape and global unpadded index (for manifests).
  std::vector<TensorEntry> tensor_entries() const;
  // Saves the state after the optimizer of the last step has finished, as
  // step steps_done() (collective); sets the header's trainer.step,
  // trainer.optimizer_step and trainer.loss_scale. Returns the checkpoint
  // directory.
  std::string save_checkpoint(const CheckpointOptions& options, Manifest header);
  // The same save riding on training (Note [Saving while training] in
  // checkpoint.h): starts saving the state of steps_done() (collective) and
  // returns at once, even while that step's optimizer still runs; the next
  // optimizer passes wait per piece for what they would overwrite. At most
  // one in flight: poll it to the end first.
  void begin_checkpoint(const CheckpointOptions& options, Manifest header);
  bool checkpoint_in_flight() const { return save_ != nullptr; }
  struct FinishedSave {
    std::string dir;
    int64_t step = 0;
    double seconds = 0.0;        // from begin_checkpoint() to published
    double write_seconds = 0.0;  // from begin_checkpoint() to this rank's file synced
    int64_t bytes = 0;           // saved by this rank
  };
  // Collective. Finishes the save in flight once every rank has written its
  // part (wait: waits for that) and reports it; nullopt when none finished.
  // Throws Error on every rank when the save failed (training state untouched).
  std::optional<FinishedSave> poll_checkpoint(bool wait);
  // Loads master weights and Adam moments from `reader` (the working copy is
  // derived from the master weights) and continues from its step, optimizer
  // step and loss scale (manifest "trainer": step, optimizer_step,
  // loss_scale). Before
  // the first step only. Throws InputError naming the file when the
  // checkpoint does not fit this model or fails its checks.
  void load_checkpoint(CheckpointReader& reader);

  // The parameter window (Note [Prefetch window]): measured peaks and fetches.
  const ParamWindow& window() const { return *window_; }

  // Peak bytes of saved block inputs (activation checkpoints) held on the
  // device: the layers' saved inputs, or with cpu_checkpointing the two slots
  // that bring them back.
  int64_t peak_checkpoint_device_bytes() const { return checkpoints_->peak_device_bytes(); }

  // Peak bytes per tier, measured from the allocations: resident state plus
  // the transient and staging buffers (device: gathered blocks, gradient
  // staging; host: optimizer staging); NVMe: swap regions in use. LibTorch's
  // activations are not included.
  std::array<int64_t, kNumTiers> peak_bytes() const;

 private:
  // The step (trainer.cc, in this order): forward and backward of one
  // micro-batch; the uses of a schedule with their gathered blocks (Note
  // [Gathered blocks]); the gradient's reduction into its homes; the
  // optimizer (Note [Optimizer pipeline]).
  // Returns the micro-batch's loss (a 0-dim tensor on the device).
  at::Tensor forward_backward(const at::Tensor& tokens, double loss_scale);
  // Forward over the blocks before the head (saving inputs when training);
  // shared by training and evaluation.
  at::Tensor forward_layers(at::Tensor x, bool train);
  at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& targets) const;
  void begin_uses(const std::vector<WindowUse>* schedule);
  void next_use(DevicePtr out[2]);
  void end_use();
  void issue_gather(size_t u);
  // The window's next use (blocks `b0` and, for the tied head, `b1`), once
  // the optimizer has finished them.
  void acquire(DevicePtr out[2], size_t b0, size_t b1);
  // Waits until the optimizer has finished [0, offset) of shard space.
  void wait_optimizer(int64_t offset);
  int32_t ready_blocks();
  // Stages `grads[first..]` (one per parameter of block b) as b's full fp32
  // gradient and starts its reduction (Note [Gathered blocks]).
  void accumulate_grad(size_t b, const std::vector<at::Tensor>& grads, size_t first);
  // Waits for the reduction of stage k and adds its shard into the home.
  void complete_grad_sync(int k);
  void flush_grad(size_t b, DevicePtr shard);
  void finish_landing();
  void optimizer_step(const OptimizerThread::Job& job);
  // One Adam call on device memory (a piece device_adam_piece() gives the
  // device): kernels::adam_step on the compute stream of a GPU.
  void device_adam(const cpu_adam::AdamParams& h, const cpu_adam::StepArgs& args, const cpu_adam::AdamSpans& spans);

  // Start-up (trainer.cc, at the end).
  void allocate_step_buffers(const PlacementPlan& plan);
  void initialise_state(const PlacementPlan& plan);

  // Block b's padded range of device memory at `p` as a flat tensor of
  // `dtype` on the compute device (no copy).
  at::Tensor block_flat(size_t b, DevicePtr p, at::ScalarType dtype);
  // `numel` elements of device memory as a flat tensor on the compute device.
  at::Tensor device_tensor(DevicePtr p, int64_t numel, at::ScalarType dtype) const;
  at::Tensor gathered_copy(Category c, size_t b, at::ScalarType dtype);
  // The range when it is resident on the device tier, else null.
  DevicePtr device_resident(Category c, int64_t offset, int64_t numel) const;
  // Views of block b's weights (compute dtype) at `p`, its gathered copy.
  std::vector<at::Tensor> weights(size_t b, DevicePtr p);

  Config cfg_;
  const Model& model_;
  StateLayout layout_;
  at::ScalarType compute_dtype_;
  int compute_bytes_;
  size_t embedding_block_ = 0;
  size_t head_block_ = 0;
  // Note [The trainer's device]
  // The compute device: the device tier's memory, the step's buffers
  // (gathered blocks, window slots, gradient stages) and LibTorch's tensors
  // of them (torch_device_, on the device's compute stream) are its. Host
  // code reaches them only through the device's copies, except on a
  // host-addressable device (the CPU device), where the same code uses them
  // in place. run.device "cpu" is the process's CPU device; "cuda[:N]" a GPU
  // the trainer owns; tests pass devices of their own.
  std::unique_ptr<Device> own_device_;
  Device* device_ = nullptr;
  c10::Device torch_device_{c10::DeviceType::CPU};
  std::unique_ptr<TieredState> state_;
  std::unique_ptr<cpu_adam::CpuAdam> adam_;
  int64_t step_ = 0;
  int64_t applied_steps_ = 0;             // optimizer steps applied (fp16 skips some)
  std::unique_ptr<LossScaler> scaler_;    // fp16 only
  bool broken_ = false;                   // an optimizer step failed part-way

  // Ranks (Note [Gathered blocks]).
  std::unique_ptr<Communicator> own_comm_;  // world size 1 without a caller's
  Communicator* comm_ = nullptr;
  int64_t shards_ = 1;                    // shards per block
  int64_t shard_rank_ = 0;                // this rank's shard (0 with one shard)
  bool gather_each_use_ = false;          // stage 3 with several shards
  bool gather_once_ = false;              // stages 1-2 with several shards
  std::vector<int64_t> shard_offset_;     // per block: its shard's offset in shard space
  std::vector<int64_t> block_end_;        // per block: end of its shard in shard space
  std::vector<int64_t> global_index_;     // per block: global unpadded index of its element 0

  // Parameters: the window (blocks not resident on the device) and the
  // gathered blocks.
  std::unique_ptr<ParamWindow> window_;
  std::vector<WindowUse> train_schedule_, eval_schedule_;
  DeviceBuffer gather_mem_;               // gathered blocks (ring, or the whole model)
  std::vector<char> gathered_valid_;      // gather_once_: per block, gathered since the optimizer
  const std::vector<WindowUse>* uses_ = nullptr;
  size_t use_ = 0;                        // the use next_use() hands out
  bool use_issued_ = false;               // its gather was issued
  Completion gather_done_[2][2];          // per ring slot, per block of the use
  DevicePtr gathered_[2][2];              // per ring slot, per block of the use

  // Gradients: two fp32 stages of a whole block (one reduced while the next
  // block's backward fills the other; one without ranks), a read-modify-write
  // buffer for homes off the device (host memory registered with the device
  // on a GPU, where the shard lands first: StagingNeeds::grad_host), and at
  // stages 2-3 two reduced shards.
  DeviceBuffer grad_stage_, grad_stage2_, grad_shards_;
  HostBuffer grad_rmw_;
  PinnedHostBuffer grad_host_;
  std::vector<nvme::BufferRegistration> grad_io_;  // the buffers above NVMe I/O uses; ends first
  std::vector<at::Tensor> grad_stage_flat_[2];               // per stage, per block: its range
  std::vector<std::vector<at::Tensor>> grad_stage_views_[2]; // per stage, per block: parameter views
  struct GradSync {
    int block = -1;
    Completion done;
    DevicePtr shard;
  } grad_sync_[2];
  int grad_turn_ = 0;                     // the stage the next block fills
  uint64_t grad_seq_[2] = {0, 0};         // issue order of the two syncs
  uint64_t grad_issued_ = 0;
  std::vector<char> grad_written_;        // per block: written since the step began
  at::Tensor tied_grad_;                  // head's gradient for the tied embedding, until flushed
  bool last_micro_ = false;               // the micro-batch whose flush takes the norm
  std::vector<at::Tensor> micro_loss_;    // per micro-batch of the step: its loss, read at the end
  // A GPU's gradients for homes off the device (flush_grad): the block whose
  // D2H into a landing half of grad_host_ is in flight, added into its home
  // while the next block's backward runs (its D2H reads the gradient stage,
  // which is zeroed for the next block only after).
  struct Landing {
    int block = -1;
    Completion copied;
    std::byte* landed = nullptr;
    bool first = false;  // the block's first flush of the step: a write, not an add
  } landing_;            // finished within its micro-batch (last_micro_ says whether to take the norm)
  int landing_turn_ = 0;
  std::vector<at::Tensor> block_norm_;    // per block: L2 norm of this rank's range (0-dim, on the device)
  std::vector<int64_t> norm_lo_, norm_hi_;  // per block: this rank's norm range within its shard

  // Activations: the layers' saved inputs, or (Note [Recompute]) the
  // graphs the forward kept, per block.
  std::unique_ptr<ActivationCheckpoints> checkpoints_;
  bool keep_graphs_ = false;
  struct KeptGraph {
    at::Tensor xin;              // the block's input (a leaf, except the embedding's tokens)
    std::vector<at::Tensor> w;   // leaf views of its weights
    at::Tensor y;                // its output, the graph's root
  };
  std::vector<KeptGraph> graphs_;

  // The optimizer: pipeline pieces in shard order, their runs inside one
  // block shard (with the global unpadded index of their first element: the
  // key of bf16 moments' rounding), staging, and its thread.
  std::vector<PlacementUnit> pieces_;
  struct AdamRun {
    int64_t start = 0;   // elements from the piece's start
    int64_t numel = 0;
    uint64_t key = 0;
    int32_t block = 0;
  };
  std::vector<std::vector<AdamRun>> piece_runs_;
  std::vector<char> piece_on_device_;     // per piece: device_adam_piece()
  // Device pieces' runs merged across pieces (one launch per stretch of a
  // block shard, not one per 2^20-element piece), launched at the piece where
  // each starts; empty for the pieces a merged run covers.
  struct DeviceRun {
    int64_t offset = 0;  // shard space
    int64_t numel = 0;
    uint64_t key = 0;
  };
  std::vector<std::vector<DeviceRun>> device_launch_;
  void launch_device_run(const cpu_adam::AdamParams& h, const OptimizerThread::Job& job, const DeviceRun& r);
  std::unique_ptr<OptimizerStaging> staging_;
  struct OptSet {
    cpu_adam::AdamSpans adam;
    std::byte* working = nullptr;
    bool working_resident = false;
  };
  std::vector<OptSet> opt_spans_;         // per staging set
  PendingIo opt_param_write_;             // a staged working copy's write, waited at once
  std::unique_ptr<OptimizerThread> opt_thread_;  // run.overlap_optimizer
  double opt_wait_s_ = 0.0;               // seconds compute waited for the optimizer

  // A save in flight (begin_checkpoint). The optimizer thread takes its own
  // reference under save_mu_; the save's thread reads homes and NVMe (save_io_).
  struct InFlightSave {
    std::unique_ptr<CheckpointSave> save;
    std::vector<ShardRange> ranges;  // in shard-space order, as the optimizer walks it
    std::vector<int64_t> offsets;    // their shard offsets
    int64_t applied = 0;             // the optimizer step saved
    std::chrono::steady_clock::time_point t0;
  };
  std::vector<ShardRange> save_ranges() const;
  std::shared_ptr<InFlightSave> save_;
  std::mutex save_mu_;
  PendingIo save_io_;

  std::vector<std::string> forward_names_, backward_names_;  // trace span names per block
};

}  // namespace strata
