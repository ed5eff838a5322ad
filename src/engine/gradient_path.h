// The gradient path (Note [Gradient path]): each block's weight gradients,
// as autograd gives them after the block's backward, into this rank's fp32
// gradient home on whichever tier holds it, reduced over the ranks on the
// way, with the squared norm of the final gradient per block.
#pragma once

#include <ATen/ATen.h>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "cpu_adam/types.h"
#include "engine/optimizer/optimizer_thread.h"
#include "engine/step_context.h"
#include "memory/buffer.h"
#include "memory/device.h"
#include "memory/placement.h"
#include "memory/tiered_state.h"

namespace strata {

// Note [Gradient path]
// Every byte that crosses a link is the least the placement needs, and the
// thread that queues compute only queues (docs/design.md, "Bytes per link").
// A block's micro-batch gradient G is autograd's gradient of each parameter,
// widened to fp32, except for the tied embedding, whose G is the fp32 sum of
// the head's gradient and the embedding's (in that order, as autograd would
// sum them). The home accumulates home = G on the block's first micro-batch
// of the step and home + G on the others: the same IEEE additions on every
// tier, so the placement never changes the bits.
//  - Home on the device, one rank: G is added (copied on the first
//    micro-batch) into the home straight from autograd's tensors, on the
//    compute stream; nothing is staged.
//  - Home on the host or NVMe, one rank: G is laid out in the gradient
//    stage (device memory) in the dtype it crosses PCIe in, the compute
//    dtype (fp32 for the tied embedding and for fp32 compute), copied D2H
//    into one of two landing buffers (host memory registered with the
//    device), and added into its home by the lander, a worker thread that
//    waits for the copy's completion (host homes in place; NVMe homes read,
//    added and written back through one read-modify-write buffer). The
//    compute thread waits only for a landing buffer to come free. On the
//    CPU device, whose memory is host memory, G is laid out in the landing
//    buffer itself (no copy; the D2H a GPU would make is still counted).
//  - Several ranks: G is staged in fp32 and reduced (reduce-scatter at
//    stages 2-3, all-reduce at 0-1) while the next block's backward runs;
//    the reduced shard is a real fp32 sum, and goes to its home as above
//    in fp32.
// Under the layer schedule (Note [Step schedules] in memory/schedule.h) a
// block's A micro-batches follow one another, so its gradient is summed
// before it moves: with a home off the device at one rank, G is added in
// fp32 into a block-sized device buffer (StagingNeeds::grad_accum; the
// same additions in the same order as above) and the sum lands once, in
// fp32, as the home's first write (NVMe: no read); with ranks it is summed
// in a gradient stage and reduced once. The tied head's shares are kept per
// micro-batch until the embedding's backward.
// On the last micro-batch the final gradient's squared norm over this rank's
// part is taken where the home is (the device's kernel, or the lander) in
// the order of Note [Ordered norm] (cpu_adam/grad_ops.h), and the step sums
// the blocks' norms in block order.
//
// Not thread-safe: the compute thread's (the lander is internal).
class GradientPath final : public GradientSource {
 public:
  // Allocates the buffers the plan counted (StagingNeeds::grad_*) and starts
  // the lander.
  GradientPath(const StepContext& ctx, const PlacementPlan& plan);
  // Lets landings in flight finish, then stops the lander.
  ~GradientPath();
  GradientPath(const GradientPath&) = delete;
  GradientPath& operator=(const GradientPath&) = delete;

  // A step begins (on the thread that queues compute): each block's first
  // add() writes its home. Drops what a failed step left in flight.
  void begin_step();
  // The head's gradient of the tied embedding for micro-batch `micro`,
  // added when the embedding's own for that micro-batch is (the embedding's
  // backward comes last; under the layer schedule after every head).
  void set_tied(int64_t micro, const at::Tensor& g);
  // Block b's weight gradients of micro-batch `micro`, grads[first..] (one
  // per parameter; undefined for a parameter without one): into the home,
  // or on their way there. A block's micro-batches come in order 0..A-1;
  // the last one's add takes its norm.
  void add(size_t b, const std::vector<at::Tensor>& grads, size_t first, int64_t micro);
  // A micro-batch's backward is queued: the last reductions are completed.
  void end_micro();
  // GradientSource (Note [Speculative optimizer] in optimizer_pass.h), any
  // thread: until block b's gradient of this step is whole in its home (its
  // last add on the device, or its last landing added by the lander).
  bool wait_final(size_t b, Completion* device) override;
  void track_finals(bool on) override { track_finals_ = on; }
  // The step failed: wait_final() returns false until the next begin_step().
  void cancel_waits();
  // Waits for every landing of the step and returns the squared norm of this
  // rank's part of the gradient, summed over blocks in block order. Adds the
  // lander's transfers (NVMe homes) to *moved.
  double finish_step(LinkBytes* moved);

  // Gradients the lander added into homes, and how many of those adds ran
  // on the thread that calls add() (tests: it must be none).
  struct LanderStats {
    int64_t adds = 0;
    int64_t adds_on_compute_thread = 0;
  };
  LanderStats lander_stats();
  int64_t device_bytes() const;  // the stages, shards and norm slots
  int64_t host_bytes() const;    // landing and read-modify-write buffers

 private:
  // Bytes per element of a gradient on the wire.
  static int64_t bytes_of(cpu_adam::GradType t) { return t == cpu_adam::GradType::kF32 ? 4 : 2; }
  struct Landing {
    int block = -1;
    int half = 0;
    cpu_adam::GradType wire = cpu_adam::GradType::kF32;
    Completion copied;  // the D2H into the landing half
    bool first = false;
    bool last = false;
  };
  void make_device_buffers(const PlacementPlan& plan);  // construction, in this order
  void make_views();
  void add_summed(size_t b, const std::vector<at::Tensor>& grads, size_t first);
  void write_or_add(const std::vector<at::Tensor>& dst, size_t b, const std::vector<at::Tensor>& grads, size_t first,
                    bool write);
  void add_on_device(size_t b, const std::vector<at::Tensor>& grads, size_t first);
  void add_through_host(size_t b, const std::vector<at::Tensor>& grads, size_t first);
  void lay_out(size_t b, const std::vector<at::Tensor>& grads, size_t first, int half);
  void add_to_reduce(size_t b, const std::vector<at::Tensor>& grads, size_t first);
  void sum_into(const std::vector<at::Tensor>& dst, size_t b, const std::vector<at::Tensor>& grads, size_t first);
  void reduce(int k, size_t b, const at::Tensor& stage);
  void complete_reduction(int k);
  // Adds a reduced fp32 shard at `src` into block b's home.
  // `last`: the block's last micro-batch (its norm is taken).
  void deliver(size_t b, DevicePtr src, bool last);
  // D2H of block b's shard at `src` (in `wire`) and its landing job.
  void land(size_t b, DevicePtr src, cpu_adam::GradType wire, bool last);
  // A landing half no job uses any more (waits for the lander), now taken.
  int claim_landing();
  void release_landing(int half);      // a claimed half on which nothing was queued
  void queue_landing(size_t b, int half, cpu_adam::GradType wire, const Completion& copied, bool last);
  // The device's norm of b's final gradient at `home` (device memory).
  void device_norm(size_t b, DevicePtr home);
  // The compute stream waits for the last D2H that read the stages.
  void stage_free();
  void lander_loop();
  void land_on_host(Landing& l);
  void wait_lander_idle();
  void mark_final(size_t b, const Completion& device);  // takes mu_
  void mark_final_locked(size_t b, const Completion& device);

  const StepContext& ctx_;
  const size_t blocks_;
  bool ranks_ = false;                 // world size > 1: reduced over the ranks
  bool reduce_scatter_ = false;        // stages 2-3 with ranks
  std::vector<char> home_on_device_;   // per block: its grad home is on the device tier
  std::vector<cpu_adam::GradType> wire_;  // per block: the dtype its shard crosses PCIe in
  std::vector<int64_t> norm_lo_, norm_hi_;  // per block: this rank's norm range within its shard
  std::vector<char> written_;          // per block: its home was written this step
  // Blocks 0..lent_blocks_ - 1 lend their device homes to activation packs
  // until their backward (Note [Packs in gradient homes] in
  // memory/placement.h): zeroed before their first add of a step.
  size_t lent_blocks_ = 0;
  int64_t accum_ = 1;                  // micro-batches per step
  bool sums_each_block_ = false;       // StepShape::sums_each_block (Note [Step schedules])
  bool last_micro_ = false;            // the current add's micro-batch is the block's last
  bool first_micro_ = false;           // ... its first
  at::Tensor tied_;                    // the current add's share of the tied head
  std::vector<at::Tensor> tied_held_;  // per micro-batch: the head's share, until the embedding's add
  int sum_turn_ = 0;                   // ranks under layer: the stage the current block is summed in

  // Device: the gradient stage(s) (fp32 of the largest block; two with ranks)
  // and, at stages 2-3, two reduced shards. Views per block, built once.
  DeviceBuffer stage_[2], shards_mem_;
  std::vector<at::Tensor> stage_flat_[2];              // per block: fp32 flat view
  std::vector<std::vector<at::Tensor>> stage_views_[2];  // per block: fp32 parameter views
  // Per landing half (or only [0]: the stage on a GPU), per block: the
  // buffer a home-off-device gradient is laid out in, in its wire dtype.
  std::vector<at::Tensor> wire_flat_[2];
  std::vector<at::Tensor> wire_padding_[2];            // per block: the padding after its parameters
  std::vector<std::vector<at::Tensor>> wire_views_[2];
  // A host-addressable device (the CPU device): the gradient is laid out in
  // a landing half directly; nothing to copy (d2h_bytes still counts what a
  // GPU would move).
  bool lay_out_in_landing_ = false;
  std::vector<std::vector<at::Tensor>> home_views_;    // per block with a device home: fp32 views
  Completion stage_read_;                              // the last D2H that read a stage or shard
  // communication_data_type bf16/fp16: the stage cast to 16 bits before its
  // reduction, and (stages 2-3) the reduced 16-bit shards, widened into the
  // fp32 shard when the reduction completes. Per stage, built once.
  DeviceBuffer comm16_;
  // CommPlan::reduce_per_step: every block's fp32 gradient summed over
  // the step's micro-batches; or (sum_on_device_: the layer schedule at one
  // rank with homes off the device) one block's at a time (flat, parameter
  // and padding views per block).
  DeviceBuffer sum_mem_;
  bool sum_on_device_ = false;
  std::vector<at::Tensor> accum_flat_;
  std::vector<std::vector<at::Tensor>> accum_views_;
  std::vector<at::Tensor> accum_padding_;
  at::ScalarType comm_type_ = at::kFloat;
  std::vector<at::Tensor> comm_flat_[2];               // per block: 16-bit flat view of the stage's copy
  DevicePtr comm_shard_[2];
  struct Reduction {
    int block = -1;
    Completion done;
    DevicePtr shard;   // fp32: what is delivered
    DevicePtr wire;    // 16-bit communication: the reduced shard, widened into `shard`
    bool last = false;  // the block's last micro-batch: its delivery takes the norm
  } reduction_[2];
  int64_t largest_shard_numel_ = 0;
  int turn_ = 0;                       // the stage the next block fills
  uint64_t seq_[2] = {0, 0};           // issue order of the two reductions
  uint64_t issued_ = 0;

  // Norms: per block, in device memory (device homes; copied to host at the
  // step's end) or host memory (the lander's).
  DeviceBuffer device_norms_, norm_scratch_;
  std::vector<double> host_norms_;     // written by the lander, read after it is idle
  std::vector<double> device_norms_host_;  // the device's, copied at the step's end
  bool any_device_home_ = false;       // some block's norm is the device's

  // Host: two landing halves and the read-modify-write block of NVMe homes.
  PinnedHostBuffer landing_;
  int64_t landing_half_bytes_ = 0;
  int landing_turn_ = 0;
  HostBuffer rmw_;
  std::vector<nvme::BufferRegistration> io_registered_;  // after the buffers: ends first

  // The lander. Guarded by mu_: queue_, busy_, error_, stats_, links_.
  std::mutex mu_;
  std::condition_variable cv_;
  // Landings queued, oldest first: at most one per landing half, so a ring
  // of two (nothing allocated per landing).
  struct Queue {
    Landing at[2];
    int head = 0, size = 0;
    bool empty() const { return size == 0; }
    Landing& front() { return at[head]; }
    void push_back(const Landing& l) { at[(head + size++) % 2] = l; }
    void pop_front() { head = (head + 1) % 2, --size; }
  } queue_;
  bool busy_[2] = {false, false};      // per landing half: queued or being added
  bool quit_ = false;
  std::exception_ptr error_;
  LanderStats stats_;
  LinkBytes links_;                    // the lander's transfers this step
  // wait_final(): per block, the step (generation) whose gradient is final
  // in its home, and what a device-side read waits for; also guarded by mu_.
  uint64_t generation_ = 1;            // final_generation_ starts below it: nothing final
  bool cancelled_ = false;
  bool track_finals_ = false;          // track_finals(): a speculating optimizer asks
  std::vector<uint64_t> final_generation_;
  std::vector<Completion> final_device_;
  std::thread::id compute_thread_;
  PendingIo lander_io_;                // the lander's NVMe reads and writes
  std::thread lander_;
};

}  // namespace strata
