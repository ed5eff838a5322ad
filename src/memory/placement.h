// The placement plan: which tier (device, host, NVMe) holds each piece of each
// state category, decided before anything is allocated, deterministically from
// the config and the layout, so every rank can compute every rank's plan.
// No LibTorch here. See Note [Placement units].
#pragma once

#include <algorithm>
#include <array>
#include <optional>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "memory/layout.h"
#include "memory/param_window.h"
#include "memory/schedule.h"

namespace strata {

class Device;

enum class Tier { kDevice = 0, kHost = 1, kNvme = 2 };
inline constexpr int kNumTiers = 3;
const char* tier_name(Tier t);

// kFrozen: the values of frozen parameters (LoRA's base), in the compute
// dtype, over the frozen space (Note [State kinds] in memory/layout.h); the
// others cover the trained space. A dense model has no kFrozen units.
enum class Category { kParam16 = 0, kGrad = 1, kMaster = 2, kExpAvg = 3, kExpAvgSq = 4, kFrozen = 5 };
inline constexpr int kNumCategories = 6;
const char* category_name(Category c);

// Note [Placement units]
// Placement moves whole units, never parts of one. For param16 and grad a unit
// is one block's shard of this rank (what a forward or backward needs at
// once). For master, exp_avg and exp_avg_sq a unit is an optimizer sub-group:
// the rank's shard space (its shards of every block, concatenated) cut every
// sub_group_size elements, rounded up to kShardAlignElems, so that a
// sub-group is one contiguous range at the same offset in every category and
// tier (one NVMe read or write, one CPU Adam call). A unit goes to the tier in
// whose share of the split its midpoint falls: units are taken in model order,
// device share first, then host, then NVMe. The same config and layout
// always give the same plan.
// Frozen values (kFrozen) are cut like param16, one unit per block shard of
// the frozen space, and follow param16's split (offload_param); a unit of no
// elements (a block without a part of that kind) stays on the device.
struct PlacementUnit {
  int64_t offset = 0;  // elements from the start of the rank's shard space (kFrozen: its frozen space)
  int64_t numel = 0;
  Tier tier = Tier::kDevice;
};

// The transient and staging buffers the trainer allocates for a plan (bytes),
// computed here so that `strata plan` reports exactly what a run will use.
struct StagingNeeds {
  WindowShape window;      // the parameter window (Note [Prefetch window])
  int64_t gathered = 0;    // device: the window's slots and persistent blocks in the compute dtype
  // Note [State kinds]: the frozen values' own window over the same
  // schedule (never invalidated: they never change), its device bytes, and
  // its host bounce buffers on a device host code may not touch.
  WindowShape frozen_window;
  int64_t frozen_gathered = 0;
  int64_t frozen_window_bounce = 0;
  // Gradients (Note [Gradient path] in engine/gradient_path.h). Device: the
  // gradient stage, fp32 of the largest block, where some block's gradient
  // is staged (a home off the device, the tied embedding's sum, or ranks);
  // per block a norm slot (8 bytes) and, on a device host code may not
  // touch, the norm kernel's partials.
  int64_t grad_stage = 0;
  int64_t grad_norms = 0;
  // Host: two landing buffers registered with the device (one filled by the
  // D2H while the other is added into its home), each of the largest
  // gradient shard homed off the device at its wire size (grad_wire_bytes),
  // and a read-modify-write block (fp32 shard) when a home is on NVMe.
  int64_t grad_host = 0;
  int64_t grad_rmw = 0;
  int64_t opt_grad = 0;    // host: a sub-group's gradient, when not resident in one piece
  int64_t opt_state = 0;   // host: master + exp_avg + exp_avg_sq of a swapped sub-group, per set
  int64_t opt_emit = 0;    // host: a sub-group's new working copy, when not resident in one piece
  int opt_sets = 0;        // sets of the three above (the optimizer pipeline's depth)
  // activation_checkpointing.cpu_checkpointing: every layer's saved input in
  // host memory (per micro-batch held: A under the layer schedule), and two
  // device slots to bring them back for the backward.
  int64_t ckpt_device = 0;
  int64_t ckpt_host = 0;
  // Ranks (Note [Gathered blocks] in trainer.h): device buffers of gathered
  // blocks in the compute dtype (stage 3: two uses of up to two blocks; stages
  // 1-2: the whole replicated model), and the gradient's synchronisation (a
  // second fp32 gradient stage so that one block's reduction overlaps the next
  // block's backward, and at stages 2-3 two reduce-scattered shards; stage 3's
  // blocks kept gathered for the step (CommPlan::keep_gathered) in gather
  // after the ring; with a
  // 16-bit communication_data_type, the two stages and shards again in 16
  // bits, which the reductions carry).
  int64_t gather = 0;
  // Stage 3 with ranks and a frozen space: two uses of up to two blocks'
  // frozen parts, gathered, in the compute dtype (Note [Frozen shards] in
  // engine/gathered_blocks.h).
  int64_t frozen_gather = 0;
  int64_t grad_sync = 0;
  // A device host code may not touch, with param16 blocks on NVMe: host
  // bounce buffers registered with the device, one per window slot (and one
  // for the persistent blocks), that NVMe reads land in before the H2D copy.
  int64_t window_bounce = 0;
  // A step's token windows (int64), in device memory and in host memory
  // registered with the device (StepShape::token_bytes each).
  int64_t tokens = 0;
  // Host, on a device host code may not touch with saved state (master,
  // moments) on it: a checkpoint save's registered bounce buffer.
  int64_t save_bounce = 0;
  // Host, registered with the device: a save's snapshot pool
  // (PlacementPlan::save_snapshot_bytes).
  int64_t save_snapshot = 0;
  // Host, with CommPlan::staged: the staged collectives' input and
  // output buffers, registered with the device (2 x world size x
  // kStagedPieceBytes).
  int64_t comm_host = 0;
  // Device, with CommPlan::reduce_per_step: the whole model's gradient
  // in fp32 (padded), summed over the step's micro-batches. Under the layer
  // schedule at world size 1 with A > 1 and a gradient homed off the device:
  // one block's (the largest), where each block's gradient is summed over the
  // micro-batches before it lands once (Note [Gradient path]).
  int64_t grad_accum = 0;
  // Device, with CommPlan::secondary_shard: the node's secondary shard
  // of every block not kept gathered, in the compute dtype.
  int64_t secondary = 0;
  int64_t device_bytes() const {
    return gathered + frozen_gathered + grad_stage + grad_norms + ckpt_device + gather + frozen_gather + grad_sync +
           tokens + grad_accum + secondary;
  }
  int64_t host_bytes() const {
    return opt_grad + opt_state + opt_emit + ckpt_host + grad_host + grad_rmw + window_bounce + frozen_window_bounce +
           tokens + save_bounce + save_snapshot + comm_host;
  }
};

// A checkpoint save's bounce buffer for device-tier state (bytes): one
// writer slot's (checkpoint/checkpoint.h, RankFileWriter::kWriterSlotBytes).
inline constexpr int64_t kSaveBounceBytes = int64_t(8) << 20;

// Bytes per rank of one piece of a staged collective (Note [Device
// collectives] in comm/device_collectives.h).
inline constexpr int64_t kStagedPieceBytes = int64_t(4) << 20;

// Shards per block: the world size, except at ZeRO stage 0 where every rank
// keeps the whole state (DESIGN.md, "State, shards and gathered blocks").
int64_t shard_count(const Config& cfg);
// The frozen space's shards (Note [State kinds] in memory/layout.h): the
// world size at ZeRO stage 3, else 1 (Note [Frozen shards] in
// engine/gathered_blocks.h).
int64_t frozen_shard_count(const Config& cfg);

// Note [Plan parts]
// A PlacementPlan is what the plan is for (the ranks, the model's blocks in
// the plan's terms) and one part per decision, each made by its own function
// in plan/ and read by the code that carries it out:
//  - state: where each state category's units live (make_plan, auto's fill);
//  - step: the step's shape, its schedule and the facts of its order
//    (memory/schedule.h; plan/choices.h's schedule choice);
//  - comm: how ranks exchange blocks and gradients (plan/choices.h);
//  - optimizer: the optimizer pipeline and speculation (plan/choices.h);
//  - activations: what a step's activations hold and where (make_plan);
//  - staging: the transient and staging buffers all of the above need
//    (plan/staging.cc), exactly what the trainer allocates.

// Where each state category lives (Note [Placement units]).
struct StatePlacement {
  std::array<TierSplit, kNumCategories> split;                      // as requested
  std::array<std::vector<PlacementUnit>, kNumCategories> units;     // as placed
  std::array<std::array<int64_t, kNumTiers>, kNumCategories> bytes{};  // per category, tier
  std::array<int, kNumCategories> elem_bytes{};                     // bytes per element
  std::vector<std::string> nvme_paths;
  std::string source;            // "deepspeed", "placement", "auto", "default"
  // With auto and rates to judge by: which candidate was chosen and the
  // bound of each (plan/planner.h, choose_by_bound); empty otherwise.
  std::string auto_choice;
  int64_t sub_group_numel = 0;   // elements per optimizer sub-group (aligned)
  int64_t shard_space_numel = 0; // elements of this rank's shards, all blocks
  int64_t frozen_space_numel = 0; // the same of the frozen space (Note [State kinds]); 0 for a dense model
  int64_t largest_block_shard_numel = 0;   // of the trained space
  int64_t largest_frozen_shard_numel = 0;  // of the frozen space (Note [State kinds])

  std::array<int64_t, kNumTiers> total() const;  // state bytes per tier
  int64_t category_total(Category c) const;
  // exp_avg and exp_avg_sq stored in bf16 (run.optimizer_state_dtype; Note
  // [bf16 state] in cpu_adam/types.h), read off their element size.
  bool bf16_moments() const { return elem_bytes[size_t(Category::kExpAvg)] == 2; }
  bool any_on_nvme(Category c) const { return bytes[size_t(c)][size_t(Tier::kNvme)] > 0; }
};

// How ranks exchange blocks and gradients.
struct CommPlan {
  // Several ranks on a device host code may not touch with the Gloo data
  // group: collectives staged through host buffers (StagingNeeds::comm_host;
  // Note [Device collectives] in comm/device_collectives.h).
  bool staged = false;
  // Bytes per element of the gradient reductions between ranks
  // (communication_data_type: 4 for fp32, 2 for bf16/fp16).
  int grad_bytes = 4;
  // With ranks and gradient accumulation: gradients summed on the rank over
  // the step's micro-batches and reduced once per step (comm.gradient_reduction;
  // StagingNeeds::grad_accum).
  bool reduce_per_step = false;
  // Stage 3 with ranks, per block: kept gathered for the whole step once
  // gathered (comm.keep_gathered), gathered once per step instead of per use.
  std::vector<char> keep_gathered;
  int64_t kept_gathered_numel = 0;  // their padded elements
  // Whether stage 3 keeps each node's secondary shard (comm.secondary_shard,
  // ZeRO++'s hpZ): a block's first gather of a step spans the world, its
  // later gathers the node, from 1/ranks_per_node of the block each rank kept
  // (StagingNeeds::secondary; Note [Secondary shard] in engine/gathered_blocks.h).
  bool secondary_shard = false;
};

// The optimizer's pipeline and speculation.
struct OptimizerPlan {
  int pipeline_depth = 8;  // staging sets: pipeline_depth(offload_optimizer.buffer_count)
  // optimizer.speculate resolved (Note [Speculative optimizer] in
  // engine/optimizer/optimizer_pass.h): CPU Adam's pieces are updated behind the
  // backward, speculatively; speculate_choice says why or why not.
  bool speculate = false;
  std::string speculate_choice;
  // With speculate, whether the pieces whose master weights and moments all
  // live on NVMe speculate into alternate swap slots committed by a flip
  // (Note [Alternate swap slots] in memory/tiered_state.h) rather than by two
  // passes, and the disk the slots take: a second home for every NVMe unit
  // of master weights and moments, counted in total()'s NVMe tier.
  bool speculate_slots = false;
  int64_t nvme_spare_bytes = 0;
};

// What a step's activations hold, and where.
struct ActivationPlan {
  // Device memory LibTorch allocates for activations (estimate): the saved
  // block inputs (or kept entries) on the device, one block's recompute.
  int64_t bytes = 0;
  // Its rows (Note [Step schedules] in memory/schedule.h): the saved block
  // inputs held (the token windows and, unless offloaded, every layer's input,
  // per micro-batch held: StepShape::held_micro), and under layer the A
  // gradients of the current block's outputs held between blocks and, with a
  // tied head, the A head gradients of the embedding held until its backward.
  int64_t checkpoint_activation_bytes = 0;
  int64_t held_output_grad_bytes = 0;
  int64_t held_tied_grad_bytes = 0;
  int64_t checkpoint_bytes = 0;      // one layer's saved input
  int64_t checkpoint_layers = 0;     // layers whose input is saved
  bool cpu_checkpointing = false;    // saved inputs offloaded to host (staging.ckpt_*)
  // Note [Activation placement] (engine/activation_checkpoints.h): what each
  // layer's forward keeps for its backward, and where, per micro-batch. A
  // layer keeps, for one micro-batch, one pack: either its input (backward
  // recomputes the layer from it) or its entries (its saved tensors that are
  // not cheap to recompute: model/saved_activations.h, input included;
  // backward recomputes only the cheap ones). Packs are numbered layer by
  // layer, u = l * micro + m: the last keep_device_packs keep their entries on
  // the device. Of the others, keep_host_packs keep theirs in pinned host RAM
  // (D2H during the forward, H2D ahead of the backward), spread evenly over
  // the order the forwards make them in (host_keeps: under layer over the
  // packs in u order, under micro_batch over each micro-batch's layers, the
  // same layers in each): a pack's D2H, one in flight, then runs beside the
  // forwards of the packs until the next host pack's, and its H2D beside
  // their backwards (Note [Activation copies] in plan/bound.h). The rest keep their input (on the
  // host with cpu_checkpointing). So a layer may be split by micro-batch:
  // auto fills memory a micro-batch at a time.
  // run.recompute resolved: always keeps no pack's entries, never every
  // pack's, auto as many as the plan finds room for (recompute_choice).
  int64_t micro = 1;                 // micro-batches a step (StepShape::accum, at least 1): packs per layer
  int64_t held = 1;                  // micro-batches held at once (StepShape::held_micro: 1 or micro)
  int64_t keep_device_packs = 0;
  int64_t keep_host_packs = 0;
  int64_t entries_bytes = 0;         // one layer's entries for one micro-batch
  int64_t token_bytes = 0;           // one micro-batch's token ids (the embedding's saved input)
  int64_t work_bytes = 0;            // one block's recompute and backward, or the head's (estimate)
  std::string recompute_choice;      // why (strata plan)
  int64_t packs() const { return checkpoint_layers * micro; }
  // Whether layer `l` (0-based) keeps its entries for micro-batch m: on the
  // device, in host RAM (on_host also for an input kept there).
  bool device_keeps(int64_t l, int64_t m) const { return l * micro + m >= packs() - keep_device_packs; }
  bool host_keeps(int64_t l, int64_t m) const;
  bool keeps_entries(int64_t l, int64_t m) const { return device_keeps(l, m) || host_keeps(l, m); }
  bool on_host(int64_t l, int64_t m) const { return host_keeps(l, m) || (cpu_checkpointing && !keeps_entries(l, m)); }
  // What layer l saves for micro-batch m.
  int64_t saved_bytes(int64_t l, int64_t m) const { return keeps_entries(l, m) ? entries_bytes : checkpoint_bytes; }
  int64_t recomputed_packs() const { return packs() - keep_device_packs - keep_host_packs; }
  // Bytes down (D2H) in a step's forwards, and up again (H2D) in its
  // backwards, of what the layers keep on the host.
  int64_t host_link_bytes() const;
  // What the layers' packs hold at once: under layer (held > 1) every pack
  // of the step; under micro_batch one micro-batch's, the largest. On the
  // device: the packs not on the host. In host RAM: the host slots, under
  // micro_batch one per layer of its largest host pack (host_slot_bytes).
  int64_t device_pack_bytes() const;
  int64_t host_pack_bytes() const;
  int64_t host_slot_bytes(int64_t l) const;
  int64_t largest_host_pack() const;
  // Host packs brought back in one run of backwards with no forward between
  // (all of the step's under layer, one micro-batch's under micro_batch).
  int64_t host_packs_per_run() const;
  double layer_recompute_flops = 0;  // recomputing one layer for one micro-batch (bound.h, step_flops)

  // Note [Packs in gradient homes]
  // Under the layer schedule a block's gradient home is first written by its
  // backward (home = G on its first micro-batch: Note [Gradient path] in
  // engine/gradient_path.h), and layer l's packs are all restored by then
  // for every block b <= l (layer l is block l + 1, whose backward comes
  // first). So from the step's start the device homes of blocks 0..l hold
  // nothing this step reads before layer l's packs are done with: the last
  // device packs may live there instead of in memory of their own. What
  // still reads the previous step's gradients is over before a pack is
  // copied in: the inline optimizer within its step; on its own thread
  // (Note [Optimizer overlap]) a full update publishes a block only once its
  // gradient is read, and the forward of layer l waits for block l + 1's;
  // a speculative step's commit (Note [Speculative optimizer]), which reads
  // CPU Adam's pieces' gradients during the next forward from the top down,
  // is waited for (wait_committed) down to the lowest such piece the pack
  // overlaps before the copy (the device's Adam's pieces were updated before
  // the step returned). The bound leaves that wait out (it shows in the
  // metrics' optimizer_wait_s): the packs lie from the homes' start, where
  // the greedy fill puts the device's Adam's pieces, so only the last packs
  // of the forward reach CPU Adam's, and the commit, one pass of CPU Adam
  // over them, started at the step before's verdict (on (b), BENCHMARKS.md:
  // the last 15 of 256 packs, saved after ~0.92 s of forwards; the commit
  // ~0.63 s). lend_limit[l]: the bytes of the device's homes, from the
  // first block's, that layer l's packs may use (empty: none); the last
  // lent_packs device packs lie there lend_stride apart, the first of them
  // at the homes' start. A lent block's home is zeroed before its first
  // write (the norm and the optimizer read its padding). A pack there is
  // copied in after its forward (on the compute stream) and read in place.
  std::vector<int64_t> lend_limit;
  int64_t lend_stride = 0;
  int64_t lent_packs = 0;
  bool lent(int64_t l, int64_t m) const { return l * micro + m >= packs() - lent_packs; }
  int64_t lent_offset(int64_t l, int64_t m) const { return (l * micro + m - (packs() - lent_packs)) * lend_stride; }
  // How many of the last `device_packs` packs the lendable homes hold.
  int64_t packs_that_lend(int64_t device_packs) const;
  // The blocks whose homes hold a lent pack (0..lent_blocks - 1): zeroed
  // before their first write of a step. `block_bytes`: each block's home.
  size_t lent_blocks(const std::vector<int64_t>& block_bytes) const;
};

// A count of packs (Note [Activation placement]) of `micro` a layer in
// words: "3 layers", "1 layer and 3 micro-batches", "1 micro-batch of a layer".
std::string packs_in_words(int64_t packs, int64_t micro);

struct PlacementPlan {
  // What the plan is for.
  int world_size = 1;            // ranks
  int stage = 0;                 // zero_optimization.stage
  int64_t shards = 1;            // shard_count(): 1 at stage 0
  int64_t frozen_shards = 1;     // frozen_shard_count(): the world size at stage 3 only
  int rank = 0;                  // the rank this plan is for
  // Ranks per node (MachineCapacity::ranks_per_node).
  int ranks_per_node = 1;
  int nodes() const { return ranks_per_node > 0 && world_size % ranks_per_node == 0 ? world_size / ranks_per_node : 1; }
  int64_t gathered_numel = 0;        // padded elements of all blocks (gathered space)
  std::vector<int64_t> block_numel;  // padded elements per block
  // Note [State kinds]: each block's frozen shard (empty for a dense model).
  std::vector<int64_t> frozen_block_numel;
  int64_t largest_block_numel = 0;   // padded, the largest gathered block
  int compute_bytes = 4;             // bytes per element of the compute dtype (activations, frozen values)
  // The step's all-reduces of doubles after the backward (trainer.cc,
  // forward_backward): norm, loss and stop (and an MoE model's aux loss),
  // and an MoE model's expert load (layers x experts; 0 for a dense model).
  int64_t step_sums = 3, expert_load_sums = 0;
  // Bytes per element of the working copy (param16): compute_bytes, or 4
  // for LoRA's fp32 adapters (Note [State kinds] in memory/layout.h).
  int param_bytes() const { return state.elem_bytes[0]; }
  bool tied = false;
  // Whether host code may use device-tier homes in place (the CPU device,
  // whose device tier is host memory). False on a GPU: there an optimizer
  // piece whose state, gradient and working copy all live on the device is
  // updated there (device_adam_piece); any other piece is updated by CPU Adam
  // with its device-tier parts staged through host memory (Note [Optimizer
  // pipeline] in engine/optimizer/optimizer_pass.h).
  bool device_addressable = true;

  // The decisions (Note [Plan parts]).
  StatePlacement state;
  StepShape step;
  CommPlan comm;
  OptimizerPlan optimizer;
  ActivationPlan activations;

  // What sizes the staging: the window's knobs (the stage3_* keys) and the
  // device memory it may use (< 0: no limit); run.checkpoint.snapshot_gb
  // with a run.checkpoint.dir, at most what this rank's saves hold (Note
  // [Save snapshots] in checkpoint/checkpoint.h).
  WindowKnobs window_knobs;
  int64_t window_cap_bytes = -1;
  int64_t save_snapshot_bytes = 0;
  StagingNeeds staging;              // exactly what the trainer allocates

  // State + activations + transient + staging (+ speculation's spare swap
  // slots) per tier.
  std::array<int64_t, kNumTiers> total() const;
};

// The one tier holding all of [offset, offset + numel) of category c, or
// nullopt when the range spans units on different tiers.
std::optional<Tier> range_tier(const PlacementPlan& plan, Category c, int64_t offset, int64_t numel);

// Note [Pipeline pieces]
// The optimizer's pipeline (Note [Optimizer pipeline] in engine/optimizer/optimizer_pass.h) walks
// sub-groups in pieces of at most kPipelineChunkElems elements: a piece's
// master, exp_avg and exp_avg_sq (12 MiB of fp32) stay in the last-level
// cache between CPU Adam and the checksum of their write-back, and between the
// checksum of their read and CPU Adam; the staging buffers are sized by a
// piece, not by sub_group_size (DeepSpeed's default of 1e9 would otherwise
// mean 36 GB of staging). Placement still moves whole sub-groups; Adam is
// elementwise, so the arithmetic does not change.
inline constexpr int64_t kPipelineChunkElems = int64_t(1) << 20;
// The optimizer pipeline's sets of piece staging for
// offload_optimizer.buffer_count (Note [Optimizer pipeline] in
// engine/optimizer/optimizer_pass.h): 1 = sequential; otherwise at least 8, at most 16.
// The pipeline reads sets - 2 pieces ahead, and an NVMe device needs tens of
// MB in flight: on the dev VM's disk the optimizer at 100% NVMe took 2.6-2.9x
// longer with 3 sets than with 8 (BENCHMARKS.md, "Tiered placement").
inline int pipeline_depth(int64_t buffer_count) {
  return buffer_count <= 1 ? 1 : int(std::clamp<int64_t>(buffer_count, 8, 128));
}
int64_t pipeline_piece_numel(const PlacementPlan& plan);
std::vector<PlacementUnit> pipeline_pieces(const PlacementPlan& plan);

// The file system (st_dev) holding `path`, or its nearest existing
// ancestor; -1 when none can be read.
int64_t device_of(const std::string& path);

// Free bytes (for an unprivileged writer) on the file system holding `path`,
// or its nearest existing ancestor; -1 when none can be read.
int64_t free_bytes_under(std::string path);

// Whether the optimizer runs on its own thread, overlapped with the next
// step's forward (run.overlap_optimizer; Note [Optimizer overlap] in
// engine/optimizer/optimizer_thread.h). "auto": yes on a device host code may not touch
// (a GPU, whose compute leaves the cores to CPU Adam); on the CPU device only
// when no optimizer state is on NVMe. There the forward's threads and the
// optimizer's share the cores, and a swapping optimizer slowed by them keeps
// its disk waiting: on the dev VM, steps with 25-100% of the optimizer state
// on NVMe ran 6-16% slower overlapped (medians; rounds 0-26%), with none 5%
// faster (BENCHMARKS.md, "The step's bound"). Ranks decide alone: only the
// timing differs (the optimizer's thread runs no collectives).
bool optimizer_overlaps(const Config& cfg, const PlacementPlan& plan);

// Whether the optimizer updates `piece` on the device: a device host code may
// not touch (!plan.device_addressable) with the piece's master weights,
// moments, gradient and working copy all on the device tier.
bool device_adam_piece(const PlacementPlan& plan, const PlacementUnit& piece);

// Elements whose update speculates (OptimizerPlan::speculate: CPU Adam's
// pieces), 0 without speculation.
int64_t speculated_numel(const PlacementPlan& plan);
// Whether pipeline piece `piece` speculates into alternate swap slots
// (OptimizerPlan::speculate_slots; its master weights and moments all on
// NVMe), and the elements of the pieces that do.
bool speculates_in_slots(const PlacementPlan& plan, const PlacementUnit& piece);
// Whether master weights and moments of [offset, offset + numel) all live
// on NVMe: the ranges that get alternate swap slots with
// OptimizerPlan::speculate_slots (and only those).
bool optimizer_state_on_nvme(const PlacementPlan& plan, int64_t offset, int64_t numel);
int64_t speculated_slot_numel(const PlacementPlan& plan);

// The ops of one training step under the plan's schedule (memory/schedule.h).
std::vector<StepOp> plan_train_schedule(const PlacementPlan& plan);

// The parameter window for `plan`'s blocks (fetched: those whose working
// copy is off the device), not yet attached; the trainer runs it and
// staging_needs sizes it with the same construction.
std::unique_ptr<ParamWindow> make_param_window(const PlacementPlan& plan);
// The same for the frozen values (Note [State kinds]); nullptr for a dense model.
std::unique_ptr<ParamWindow> make_frozen_window(const PlacementPlan& plan);

// The bytes per element in which block b's gradient shard crosses PCIe to a
// home off the device (Note [Gradient path]): the compute dtype's, or 4 where
// the step has a real fp32 sum (several ranks' reduction, the tied
// embedding) or computes in fp32.
int grad_wire_bytes(const PlacementPlan& plan, size_t b);

}  // namespace strata
