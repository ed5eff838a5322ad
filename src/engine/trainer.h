// The training step: forward over blocks without autograd (keeping each
// block's input), loss with autograd over the head, backward over blocks in
// reverse by recomputing each block from its saved input with autograd over
// weight views, gradient accumulation, global-norm clipping, and the optimizer
// per sub-group where its state lives (see Note [Step order]). All state is
// held by a TieredState, placed by the config's placement plan.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "comm/communicator.h"
#include "config/config.h"
#include "cpu_adam/types.h"
#include "engine/activation_checkpoints.h"
#include "engine/gathered_blocks.h"
#include "engine/gradient_path.h"
#include "engine/loss_scaler.h"
#include "engine/optimizer/optimizer_pass.h"
#include "engine/optimizer/speculation.h"
#include "engine/state_checkpoints.h"
#include "engine/step_context.h"
#include "memory/buffer.h"
#include "memory/device.h"
#include "memory/layout.h"
#include "memory/param_window.h"
#include "memory/placement.h"
#include "memory/tiered_state.h"
#include "model/model.h"
#include "model/saved_activations.h"

namespace strata {

class StepCounters;  // trainer.cc: what a step reports as differences

struct StepResult {
  double loss = 0.0;       // mean over the micro-batches of the step
  double grad_norm = 0.0;  // global L2 norm before clipping
  double lr = 0.0;
  int64_t tokens = 0;      // tokens trained on in this step
  int64_t counted_tokens = 0;  // of them, the targets counted toward the loss (all of them without masks)
  LinkBytes links;         // bytes moved by this step's compute and by the optimizer step
                           // reported in optimizer_s, per link
  double wait_s = 0.0;     // seconds compute waited for parameters / gradients to arrive
  double optimizer_s = 0.0;  // seconds in the optimizer (including its swapping); with
                             // run.overlap_optimizer: the last optimizer step that finished
  double optimizer_wait_s = 0.0;  // seconds this step's compute waited for the optimizer
  // Seconds the optimizer (its thread, or the launches of device pieces)
  // waited for a checkpoint save in flight since the last step's result
  // (Note [Save snapshots] in checkpoint/checkpoint.h).
  double checkpoint_wait_s = 0.0;
  int64_t net_bytes = 0;     // bytes this rank sent over the network in the step (the world's groups)
  int64_t intra_node_bytes = 0;  // besides those, bytes sent over its node's group (comm.secondary_shard)
  double comm_wait_s = 0.0;  // seconds compute waited for collectives
  bool stop = false;         // some rank asked to stop: every rank stops after this step
  double loss_scale = 0.0;   // fp16: the loss scale this step used (0 without one)
  bool skipped = false;      // fp16: the gradients overflowed and the optimizer step was skipped
  // Note [Speculative optimizer] (optimizer_pass.h): "" when the step did not
  // speculate, else "committed", "redone" (a clipped step) or "restored" (a
  // skipped one); the optimizer seconds that ran beside the backward
  // (speculative jobs finished since the last report); elements updated
  // again by a redo.
  std::string speculation;
  double optimizer_hidden_s = 0.0;
  int64_t redone_elements = 0;
  // Experts (Note [Load balancing] in model/experts.cc), empty for a dense
  // model: the load-balancing loss before its coefficient (the mean over the
  // micro-batches of the global batch), and per layer its busiest expert's
  // tokens over the mean tokens per expert, over the global batch.
  double aux_loss = 0.0;
  std::vector<double> expert_load;
};

// Bytes of each state category, for the start-up report.
struct StateBytes {
  int64_t param16 = 0;     // working copy in the compute dtype
  int64_t master = 0;      // fp32 parameters
  int64_t grad = 0;        // fp32 gradients
  int64_t optimizer = 0;   // exp_avg + exp_avg_sq
  int64_t total() const { return param16 + master + grad + optimizer; }
};

// run.deterministic (docs/config.md): LibTorch's deterministic algorithms
// (strict: an op without one fails the step naming itself) and
// CUBLAS_WORKSPACE_CONFIG=:4096:8, which they need on CUDA 10.2 and later
// (unless the environment sets it). Call before the first CUDA work of the
// process: cuBLAS reads the variable when it makes its handle. Off leaves
// LibTorch's defaults alone. Returns what it set, for the start line.
std::string apply_determinism(bool on);

// Note [Recompute]
// run.recompute decides which layers backward recomputes (Note [Activation
// placement] in memory/placement.h). always: each layer's forward keeps only
// its input and backward runs the layer's forward again from it (a quarter
// of the step's FLOPs more, one layer's activations at a time). never: each
// layer keeps its entries (the saved tensors that are not cheap to recompute,
// Note [Saved activations] in model/layer_ops.cc) and backward recomputes
// only the cheap ones. auto: the last layers keep their entries as far as the
// device has room and, on a GPU, others in host RAM where the step's
// bound gains (Note [Activations by the bound] in plan/planner.h), each a
// micro-batch at a time: a layer may keep its entries for some micro-batches
// and recompute for the others (keeps_entries_ is per block and
// micro-batch). Entries
// hold no weights, so every placement of the state
// allows every choice; every choice runs the same explicit forward and
// backward on the same values: losses and weights are bit-identical
// (tested).
//
// Note [Gathered blocks]
// State lives in the rank's shard space (memory/layout.h); compute sees
// gathered blocks, and the two meet only in the Communicator. Before a use,
// the block's param16 shard (in place when device-resident, else from the
// parameter window) is all-gathered into a gathered buffer; the next use's
// gather is issued before the current use computes, so it overlaps compute.
// Stage 3 gathers into a ring of two uses' buffers, at every use but one
// that follows a use of the same blocks, which reads that use's copy
// (GatheredBlocks::ring_slots: under the layer schedule a block is gathered
// twice a step, the tied embedding three times); stages 1-2
// keep param16 replicated: a block is gathered into a whole-model buffer at
// its first use after each optimizer step and reused. After a block's
// backward its full fp32 gradient is reduce-scattered (stages 2-3) or
// all-reduced (stages 0-1) while the next block's backward runs, and the
// rank's shard is then added into its gradient home. With one shard (world
// size 1, or stage 0) the shard is the block: no gather buffer, used in place.
// The uses are GatheredBlocks' (gathered_blocks.h), the reductions and homes
// GradientPath's (Note [Gradient path] in gradient_path.h).
//
// Owns the model's state and the parts of the step (gathered blocks, the
// gradient path, the optimizer pass, checkpoints), whose buffers are all
// sized at construction: nothing on the step's path allocates except
// LibTorch's own activations and c10d's work handles. Not thread-safe.
class Trainer {
 public:
  // Plans the placement for this machine, allocates and initialises all state
  // from cfg.run.seed (the same values whatever the placement or world size).
  // `faults` (tests): injected below the NVMe engine (nvme/fault_backend.h).
  // `comm`: the ranks of the run (must outlive the trainer; world size
  // cfg.world_size); nullptr: world size 1. `device`: where the step computes
  // and the device tier lives (must outlive the trainer); nullptr: run.device's
  // (Note [The trainer's device]). `stream` (tests): with several ranks on a
  // device host code may not touch, the collectives on its comm stream
  // (Note [Device collectives]) instead of the data group comm.backend names;
  // `node_stream` (tests) likewise over the node's group, which the plan's
  // secondary shard needs (Note [Secondary shard] in gathered_blocks.h).
  Trainer(const Config& cfg, const Model& model, std::shared_ptr<nvme::FaultPlan> faults = nullptr,
          Communicator* comm = nullptr, int local_ranks = 1, Device* device = nullptr,
          StreamCollectives* stream = nullptr, StreamCollectives* node_stream = nullptr);
  ~Trainer();

  // One optimizer step over this rank's `accum` micro-batches. `tokens` holds
  // accum x micro_batch windows of seq_len + 1 tokens (int64, row-major).
  // `stop_requested`: this rank wants to stop (a signal); combined over the
  // ranks into StepResult::stop. `counted`: -1, every target counts and the
  // loss is the global batch's mean; else the windows may carry kNotCounted
  // flags and `counted` is the global batch's counted targets, all ranks'
  // (Note [Counted tokens] in util/counted_tokens.h): the loss is the
  // counted targets' summed cross-entropy over it. Collective: every rank
  // calls it.
  StepResult step(const int64_t* tokens, bool stop_requested = false, int64_t counted = -1);

  // Waits for the last step's optimizer (Note [Optimizer overlap]) and
  // rethrows its failure; the state is then final. Call before the end.
  void finish();

  // Mean loss over `batches` windows of micro_batch x (seq_len + 1) tokens,
  // without gradients; with `masked` over their counted targets (Note
  // [Counted tokens]): their summed cross-entropy over their count (0 when
  // none counts).
  double eval_loss(const int64_t* tokens, int64_t batches, bool masked = false);

  const StateLayout& layout() const { return layout_; }
  const PlacementPlan& plan() const { return state_->plan(); }
  Device& device() const { return *ctx_.device; }
  const TieredState& state() const { return *state_; }
  StateBytes state_bytes() const;
  int64_t steps_done() const { return step_; }
  // Optimizer steps applied: steps_done() less those fp16 skipped on overflow
  // (Note [Loss scaling]). Adam's step count and the lr schedule follow it.
  // Tests (Note [Speculative optimizer]): called on the compute thread as
  // each block's backward for a micro-batch begins; the lowest block whose
  // speculated update has begun; the optimizer's published progress.
  void set_backward_hook(std::function<void(size_t block, int64_t micro)> hook) { backward_hook_ = std::move(hook); }
  int64_t speculation_reached_block() const { return optimizer_->speculation_reached_block(); }
  // Tests: OptimizerPass::set_piece_hook.
  void set_optimizer_piece_hook(std::function<void(int kind)> hook) { optimizer_->set_piece_hook(std::move(hook)); }
  int64_t optimizer_progress() { return optimizer_->progress(); }
  int64_t optimizer_steps() const { return applied_steps_; }
  // fp16 only (else nullptr): the loss scale and its counters.
  const LossScaler* loss_scaler() const { return scaler_.get(); }
  at::ScalarType compute_dtype() const { return ctx_.compute_dtype; }

  // Copies of block b's state, gathered from every rank (padded flat, for
  // tests, export, checkpoints). Collective: every rank calls them.
  at::Tensor master_block(size_t b);
  at::Tensor grad_block(size_t b);
  at::Tensor state_block(Category c, size_t b);  // in the category's stored dtype
  // Block b's weights as the forward uses them (compute dtype), as copies.
  std::vector<at::Tensor> block_weights(size_t b);
  Communicator& comm() const { return *ctx_.comm; }

  // Checkpoints (engine/state_checkpoints.h). Saves the state after the optimizer of the last step has finished, as
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
  bool checkpoint_in_flight() const { return checkpoints_->in_flight(); }
  using FinishedSave = strata::FinishedSave;
  // Collective. Finishes the save in flight once every rank has written its
  // part (wait: waits for that) and reports it; nullopt when none finished.
  // Throws Error on every rank when the save failed (training state untouched).
  std::optional<FinishedSave> poll_checkpoint(bool wait) { return checkpoints_->poll(wait); }
  // Loads master weights and Adam moments from `reader` (the working copy is
  // derived from the master weights) and continues from its step, optimizer
  // step and loss scale (manifest "trainer": step, optimizer_step,
  // loss_scale). Before the first step only. Throws InputError naming the
  // file when the checkpoint does not fit this model or fails its checks.
  void load_checkpoint(CheckpointReader& reader);

  // The parameter window (Note [Prefetch window]): measured peaks and fetches.
  const ParamWindow& window() const { return blocks_->window(); }
  // The gradient path's lander: where host arithmetic on landed gradients ran.
  GradientPath::LanderStats lander_stats() { return grads_->lander_stats(); }

  // Peak bytes of saved block inputs (activation checkpoints) held on the
  // device: the layers' saved inputs, or with cpu_checkpointing the two slots
  // that bring them back.
  int64_t peak_checkpoint_device_bytes() const { return activations_->peak_device_bytes(); }

  // Peak bytes per tier, measured from the allocations: resident state plus
  // every part's buffers (window, gathered blocks, gradient stages, landing
  // and norm buffers, optimizer staging, activation slots, token windows, the
  // save's bounce); NVMe: swap regions in use. LibTorch's activations are not
  // included.
  std::array<int64_t, kNumTiers> peak_bytes() const;

 private:
  // The step (trainer.cc, in this order): its forward and backward, the
  // schedule's ops, one op, the optimizer; then (block_ops.cc) the three kinds of op (Note [Step schedules] in
  // memory/schedule.h): a block's forward, the head's forward and backward
  // (returning the micro-batch's loss, a 0-dim tensor on the device), a
  // block's backward (returning the gradient of its input).
  void begin_step();
  void skip_on_overflow(StepResult& r, double loss_scale);  // fp16: r.skipped on a non-finite norm
  void forward_backward(const int64_t* tokens, double loss_scale, bool stop_requested, StepResult& r,
                        LinkBytes& moved, const StepCounters& counters, double& param_wait);
  double run_schedule(const int64_t* tokens, double loss_scale);
  void run_op(const StepOp& op, const at::Tensor& tokens, double loss_scale);
  void apply_optimizer(StepResult& r, double loss_scale);
  // Note [Speculative optimizer]: a failed step's speculation abandoned, and
  // the verdict on a finished one (speculation_ decides whether a step
  // speculates and hears each verdict).
  void abandon_speculation(const OptimizerThread::Job& speculated);
  double clip_coefficient(double norm) const;
  void settle_speculation(StepResult& r, const OptimizerThread::Job& speculated);
  at::Tensor forward_block(size_t b, int64_t m, const at::Tensor& x, bool train);
  at::Tensor head_forward_backward(const at::Tensor& x, const at::Tensor& targets, double loss_scale, int64_t m,
                                   at::Tensor* dx);
  at::Tensor block_backward(size_t b, int64_t m, const at::Tensor& dx);
  // A layer's saved tensors as its pack (its input, or its kept entries) and
  // back (activations_ moves packs).
  std::vector<at::Tensor> pack_of(size_t b, int64_t m, LayerSaved* s);
  void unpack(size_t b, int64_t m, std::vector<at::Tensor> pack, LayerSaved* s);
  // The eval head's loss: the mean, or (masked) the counted targets' sum and count.
  std::pair<double, int64_t> eval_head(const at::Tensor& x, const at::Tensor& targets, bool masked);
  // The mean cross-entropy, or with a step's counted targets (counted_ >= 0)
  // the counted ones' sum over their global count.
  at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& targets) const;
  // Note [Counted tokens]: a window's inputs (flags dropped) and targets
  // (-100 where not counted), in masked steps; the windows themselves else.
  at::Tensor inputs_of(const at::Tensor& window) const;
  at::Tensor targets_of(const at::Tensor& window, bool masked) const;
  // `rows` windows of seq_len + 1 tokens from host memory to the device,
  // through registered memory, ordered before the compute queued next.
  at::Tensor stage_tokens(const int64_t* tokens, int64_t rows);
  [[noreturn]] void out_of_memory(const c10::OutOfMemoryError& e) const;

  // Start-up (trainer_setup.cc).
  void make_context(Communicator* comm, Device* device, StreamCollectives* stream);
  // Every rank planned the same collectives (the plan's choices by memory
  // could differ between ranks with different free memory): else a
  // ConfigError on every rank. Then the node's group when the plan keeps a
  // secondary shard.
  void agree_on_collectives(const PlacementPlan& plan, StreamCollectives* node_stream);
  void initialise_state(const PlacementPlan& plan);
  void read_hf(SafetensorsSet& hf, const BlockLayout& bl, const std::vector<ParamLayout>& params,
               const at::Tensor& flat);
  void write_frozen(size_t b, SafetensorsSet* hf, const PinnedHostBuffer& mem);
  std::unique_ptr<SafetensorsSet> open_adapters(const std::string& dir);
  void read_adapters(const SafetensorsSet& set, const BlockLayout& bl, const at::Tensor& flat);

  // Views of block b's weights at `p`, its gathered copy (compute dtype), and
  // `frozen`, its frozen part's (Note [State kinds] in memory/layout.h), in
  // declaration order: the frozen ones first.
  std::vector<at::Tensor> weights(size_t b, DevicePtr p, DevicePtr frozen = DevicePtr());
  // The key of LoRA's dropout masks for block b (a layer) and micro-batch m
  // of the step under way (Note [LoRA layers] in model/layer_ops.cc); m
  // counted in the global batch (rank r trains micro-batches r x A .. r x A +
  // A - 1 of it), so that the masks do not depend on the world size.
  uint64_t dropout_key(size_t b, int64_t m) const {
    const int64_t global = int64_t(ctx_.comm->rank()) * cfg_.gradient_accumulation_steps + m;
    return lora_dropout_key(cfg_.run.seed, step_ + 1, global, int64_t(b) - 1);
  }
  at::Tensor gathered_copy(Category c, size_t b, at::ScalarType dtype);

  Config cfg_;
  const Model& model_;
  StateLayout layout_;
  // Note [The trainer's device]
  // The compute device: the device tier's memory, the step's buffers
  // (gathered blocks, window slots, gradient stages) and LibTorch's tensors
  // of them (ctx_.torch_device, on the device's compute stream) are its. Host
  // code reaches them only through the device's copies, except on a
  // host-addressable device (the CPU device), where the same code uses them
  // in place. run.device "cpu" is the process's CPU device; "cuda[:N]" a GPU
  // the trainer owns; tests pass devices of their own.
  std::unique_ptr<Device> own_device_;
  std::unique_ptr<Communicator> own_comm_;  // world size 1 without a caller's
  // With several ranks: the collectives on device memory (Note [Device
  // collectives]), over NCCL's data group as a stream's when that is theirs.
  std::unique_ptr<StreamCollectives> own_stream_, own_node_stream_;
  DataGroupOptions data_options_;  // the data group's, for the node's group
  std::unique_ptr<DeviceCollectives> collectives_;
  std::unique_ptr<TieredState> state_;
  StepContext ctx_;                       // what the parts share; refers to the above
  int64_t step_ = 0;
  int64_t applied_steps_ = 0;             // optimizer steps applied (fp16 skips some)
  std::function<void(size_t, int64_t)> backward_hook_;
  SpeculationPolicy speculation_;         // whether a step speculates (step_ numbering)
  std::unique_ptr<LossScaler> scaler_;    // fp16 only

  // The parts of the step; the optimizer first, which the others use (and
  // which is destroyed last of them, its thread after a save's).
  std::unique_ptr<OptimizerPass> optimizer_;
  std::unique_ptr<GatheredBlocks> blocks_;
  std::unique_ptr<GradientPath> grads_;
  std::unique_ptr<StateCheckpoints> checkpoints_;

  // Activations: what each layer keeps for its backward, its input or its
  // entries (Note [Activation placement] in memory/placement.h).
  std::unique_ptr<ActivationCheckpoints> activations_;
  std::vector<char> keeps_entries_;       // per (block, micro-batch), act_key: a layer that keeps its entries
  std::vector<Saved> kept_ids_;           // the entries such a layer keeps, in its pack's order
  // Per (block, micro-batch): the attention kernel's random state of a layer
  // that keeps its entries (tiny, on the device; LayerSaved::attn_seed).
  std::vector<std::pair<at::Tensor, at::Tensor>> attn_rng_;
  size_t act_key(size_t b, int64_t m) const { return b * micro_loss_.size() + size_t(m); }
  std::vector<at::Tensor> micro_loss_;    // per micro-batch of the step: its loss, read at the end
  std::vector<float> row_loss_;           // a micro-batch's per-token losses (model/cross_entropy.h), sized at start-up
  cpu_adam::Isa head_isa_ = cpu_adam::Isa::kScalar;  // the head's fused cross-entropy's kernel (run.cpu_adam_isa)
  int64_t counted_ = -1;                  // the step's global counted targets (step()'s `counted`)
  // Experts (Note [Load balancing] in model/experts.cc), sized at start-up:
  // per micro-batch its routing statistics, its load-balancing loss (0-dim,
  // on the device, read at the end) and that loss's gradient for the
  // backward; the step's tokens per expert per layer [L, E] on the device and
  // in host memory; the loss's scale (coefficient x loss scale / micro-
  // batches of the global batch), 0 without output_router_logits.
  std::vector<MoeTally> moe_tally_;
  std::vector<at::Tensor> aux_loss_, aux_grad_;
  at::Tensor expert_load_, expert_load_host_;
  double aux_scale_ = 0.0;
  void finish_aux(int64_t m);  // micro-batch m's forward is done: its loss and gradient
  // Per micro-batch, between ops: the input of its next forward, then the
  // gradient of the output of its next backward (the layer schedule holds
  // all A at once: the plan's activation rows).
  std::vector<at::Tensor> flow_;

  // Tokens: registered host memory and device memory for a step's windows
  // (Note [The trainer's device]); the H2D copy's completion guards the host side.
  PinnedHostBuffer tokens_host_;
  DeviceBuffer tokens_device_;
  Completion tokens_copied_;

  // Trace span names by pass, block and micro-batch (util/trace.h keeps the pointers).
  std::vector<std::string> span_names_;
  static std::vector<std::string> make_span_names(const StateLayout& layout, int64_t micro_batches);
  const char* span_name(Pass pass, size_t b, int64_t m) const {
    return span_names_[(size_t(pass) * layout_.num_blocks() + b) * micro_loss_.size() + size_t(m)].c_str();
  }
};

}  // namespace strata
