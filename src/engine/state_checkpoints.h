// The training state's checkpoints (checkpoint/checkpoint.h): which ranges of
// this rank's shard space hold parameters, saves that ride on training (Note
// [Saving while training]) and loads that validate before writing.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "engine/loss_scaler.h"
#include "engine/optimizer/optimizer_pass.h"
#include "engine/step_context.h"

namespace strata {

// Checkpoints move state in chunks of at most this many elements (64 MiB of
// fp32): the staging a save or load needs, whatever the model size.
inline constexpr int64_t kCheckpointChunkElems = int64_t(1) << 24;

struct FinishedSave {
  std::string dir;
  int64_t step = 0;
  double seconds = 0.0;        // from begin to published
  double write_seconds = 0.0;  // from begin to this rank's file synced
  int64_t bytes = 0;           // saved by this rank
  int64_t snapshot_bytes = 0;  // of which written from the snapshot pool (Note [Save snapshots])
};

// The step counters a checkpoint carries (manifest "trainer").
struct TrainerCounters {
  int64_t step = 0;            // steps done
  int64_t optimizer_step = 0;  // optimizer steps applied (fp16 skips some)
};

// Not thread-safe: the compute thread's (a save's own thread is internal).
class StateCheckpoints {
 public:
  // `optimizer` must outlive it.
  StateCheckpoints(const StepContext& ctx, OptimizerPass& optimizer);
  ~StateCheckpoints();

  // The pieces of this rank's shard space that hold parameters, per saved
  // category, in chunks of at most kCheckpointChunkElems: those it saves
  // (with replicated state, every rank a share), or all it holds (to load).
  std::vector<ShardRange> ranges(bool save) const;
  // Every parameter's name, shape and global unpadded index (for manifests).
  std::vector<TensorEntry> tensor_entries() const;

  // Starts saving the state of `counters` (collective): header.step and
  // header.trainer's step, optimizer_step and loss_scale (`scaler`, or null)
  // are filled here. REQUIRES: none in flight.
  void begin(const CheckpointOptions& options, Manifest header, const TrainerCounters& counters,
             const LossScaler* scaler);
  bool in_flight() const { return save_ != nullptr; }
  // The save's registered bounce and snapshot pool.
  int64_t host_bytes() const { return res_->bounce.bytes() + res_->snapshot_pool.bytes(); }
  // Collective: finishes the save in flight once every rank has written its
  // part (wait: waits for that); nullopt when none finished. Throws Error on
  // every rank when the save failed (training state untouched).
  std::optional<FinishedSave> poll(bool wait);

  // Loads master weights and moments from `reader` (the working copy derived
  // from the master weights) and returns its counters; `scaler` (fp16, else
  // null) takes its loss scale. Every check runs before anything is written;
  // throws InputError naming the file when the checkpoint does not fit.
  TrainerCounters load(CheckpointReader& reader, LossScaler* scaler);

 private:
  class InFlight;
  void fill_header(Manifest& header, const TrainerCounters& counters, const LossScaler* scaler) const;
  static RangeSource range_source(const StepContext* ctx, OptimizerPass* opt, InFlight* raw);
  void check_shape(const Manifest& m, const std::string& mpath) const;

  const StepContext& ctx_;
  OptimizerPass& optimizer_;
  std::shared_ptr<InFlight> save_;
  // What a save's thread and the passes that overtake it use, allocated at
  // start-up and shared with the save in flight: an optimizer pass may hold
  // that save (and its thread run) after this object is gone.
  struct Resources {
    PendingIo save_io;  // the save's thread reads homes and NVMe through it
    // A GPU's device-tier state comes D2H into this registered buffer (one
    // writer slot's bytes), then into the writer's staging.
    PinnedHostBuffer bounce;
    // Note [Save snapshots] (checkpoint/checkpoint.h): run.checkpoint.snapshot_gb
    // of host memory registered with the device, and the I/O its copies use.
    PinnedHostBuffer snapshot_pool;
    PendingIo snapshot_io;
  };
  std::shared_ptr<Resources> res_;
};

}  // namespace strata
