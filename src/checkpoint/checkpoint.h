// Checkpoints: the training state saved independently of world size, stage,
// placement and padding, written atomically by every rank at once, and read
// back at any world size (docs/checkpoint.md has the format byte by byte).
// No LibTorch here: the trainer hands over its shard ranges and buffers.
//
// Note [Checkpoint protocol]
// A save of step S writes <dir>/step-<S, 8 digits>.tmp/: rank 0 creates it
// (removing a stale one a crashed save left), then every rank streams the
// ranges it holds from their tiers into its own rank-<r>.bin through the I/O
// engine, fsyncs it, and writes rank-<r>.json (its ranges and their
// CRC-32Cs). Once every rank has finished (an all-reduce of their status),
// rank 0 merges the parts into manifest.json (written under a temporary name,
// fsynced, renamed), fsyncs the directory, renames it to step-<S>, fsyncs
// <dir>, and only then points <dir>/latest at it (the same way) and prunes all
// but the newest `keep` complete checkpoints. A directory without the .tmp
// suffix is complete; one with it is ignored and removed by the next save.
// A failure on any rank (ENOSPC, EIO) fails the save on every rank with the
// first rank's message, removes the .tmp directory and leaves latest, the
// earlier checkpoints and the training state as they were.
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "memory/buffer.h"
#include "memory/placement.h"
#include "nvme/engine.h"

namespace strata {

class Communicator;

inline constexpr int kCheckpointVersion = 1;
inline constexpr int64_t kChecksumBytes = int64_t(1) << 20;  // one CRC-32C per MiB of a range
// The categories a checkpoint holds: param16 is the master weights in the
// compute dtype, and gradients are consumed within the step.
inline constexpr std::array<Category, 3> kSavedCategories = {Category::kMaster, Category::kExpAvg,
                                                             Category::kExpAvgSq};

// A piece of this rank's shard space and the parameters it holds: the tier
// reads or writes [shard_offset, shard_offset + shard_numel) (aligned for
// NVMe), whose first `numel` elements are the parameters with global
// unpadded indices [start, start + numel); the rest is padding.
struct ShardRange {
  Category category = Category::kMaster;
  int64_t shard_offset = 0;
  int64_t shard_numel = 0;
  int64_t start = 0;
  int64_t numel = 0;
};

// Where the saved elements [start, start + numel) of one category are.
struct SavedRange {
  Category category = Category::kMaster;
  int64_t start = 0;
  int64_t numel = 0;
  std::string file;            // a plain name inside the checkpoint directory
  int64_t offset = 0;          // bytes, a multiple of 4096
  std::vector<uint32_t> crc;   // CRC-32C of each MiB of its numel x elem_bytes bytes
};

struct TensorEntry {
  std::string name;             // "layer.3.wq"
  std::vector<int64_t> shape;
  int64_t start = 0;            // global unpadded index of its first element
};

struct Manifest {
  int64_t step = 0;
  int64_t saved_world_size = 1;   // of the run that saved it; informational
  int64_t parameters = 0;         // unpadded parameter count
  std::vector<TensorEntry> tensors;
  std::map<Category, int> elem_bytes;  // per saved category: 4 (fp32) or 2 (bf16)
  std::vector<SavedRange> ranges;      // sorted by category, then start
  std::map<std::string, int64_t> files;  // name -> bytes
  nlohmann::json trainer = nlohmann::json::object();   // step, scheduler, loss scale
  nlohmann::json data = nlohmann::json::object();      // the sampler's position
  nlohmann::json config = nlohmann::json::object();    // the effective config
  nlohmann::json invariants = nlohmann::json::object();  // what a resume must not change
};

nlohmann::json manifest_to_json(const Manifest& m);
// Parses and checks a manifest: types, version, plain file names inside the
// directory, ranges that tile every saved category exactly. Throws
// InputError naming `path` and the offending key.
Manifest manifest_from_json(const nlohmann::json& j, const std::string& path);

// Where the bytes of a rank's ranges come from (ShardRange i of the list).
struct RangeSource {
  // The range's shard_numel elements in host memory (its home), written to
  // the file in place; nullptr when they are not there (NVMe), and then
  // fill() copies them. May be empty (always fill).
  std::function<const std::byte*(size_t i)> resident;
  // Copies elements [at, at + numel) of range i (relative to its
  // shard_offset) into buf. `at` and `numel` are multiples of
  // kShardAlignElems, or numel reaches shard_numel.
  std::function<void(size_t i, int64_t at, int64_t numel, std::byte* buf)> fill;
  // Optional (Note [Save snapshots]): copies range i's shard_numel elements
  // into `dst` on the calling thread, ahead of the save, which then writes
  // them from there. Called by CheckpointSave::make_writable's caller's
  // thread, one call at a time; must not share I/O with fill(). Only for
  // the ranges `snapshot_ok` (asked once per range, when the save starts)
  // allows: those in memory, whose copy is not the disk's time.
  std::function<void(size_t i, std::byte* dst)> snapshot;
  std::function<bool(size_t i)> snapshot_ok;
};

// Writes one rank's ranges to <dir>/<file>, preallocated, through its own
// I/O engine. A range resident in host memory is written from its home
// (zero copy; only a last partial 4 KiB block goes through staging); others
// are filled piece by piece into kWriterSlots staging slots of
// kWriterSlotBytes (huge pages, registered with the engine), so that tier
// reads, checksums and the disk all overlap. Writes complete in the order
// of the ranges (waiting is FIFO).
class RankFileWriter {
 public:
  static constexpr int kWriterSlots = 8;
  static constexpr int64_t kWriterSlotBytes = int64_t(8) << 20;

  RankFileWriter(const std::string& dir, const std::string& file, const std::vector<ShardRange>& ranges,
                 const std::map<Category, int>& elem_bytes, const nvme::EngineOptions& engine);
  ~RankFileWriter();
  RankFileWriter(const RankFileWriter&) = delete;
  RankFileWriter& operator=(const RankFileWriter&) = delete;

  // Checksums range i and starts writing it; waits only for staging slots.
  // Ranges are written in the order of the list: i is the next one. A
  // resident range's home must stay unchanged until wait_through(i).
  void write(size_t i, const RangeSource& source);
  // Waits until ranges 0..i are written (not yet synced).
  void wait_through(size_t i);
  // Without blocking: how many ranges, a prefix of the list, are written.
  size_t written_ranges();
  // Called with the ranges written before the one being written, before each
  // of its tier reads (fill), which may be slow: whoever waits for a range
  // learns it is written then, not after.
  void set_progress(std::function<void(size_t)> progress) { progress_ = std::move(progress); }
  // Waits for every write, fsyncs and closes the file; the ranges written.
  std::vector<SavedRange> finish();
  // Seconds spent in tier reads (fill), checksumming, waiting for writes
  // (slots and the end), and in fsync; bytes written from homes in place.
  double fill_s() const { return fill_s_; }
  double crc_s() const { return crc_s_; }
  double wait_s() const { return wait_s_; }
  double sync_s() const { return sync_s_; }
  int64_t in_place_bytes() const { return in_place_bytes_; }

 private:
  struct Pending {
    size_t range = 0;
    int slot = -1;  // -1: written from the range's home
    nvme::IoHandle handle;
  };
  std::byte* slot(int k) const { return slots_.as<std::byte>() + k * kWriterSlotBytes; }
  int acquire_slot();  // the next slot, round robin, once its write is done
  void submit(size_t range, int slot, int64_t offset, int64_t bytes, const std::byte* buf);
  void pop_front();

  std::string path_, file_;
  std::vector<ShardRange> ranges_;
  std::map<Category, int> elem_bytes_;
  HostBuffer slots_;
  std::unique_ptr<nvme::IoEngine> engine_;
  nvme::FileId id_;
  std::deque<Pending> pending_;  // in submission order
  std::array<bool, kWriterSlots> slot_busy_{};
  int next_slot_ = 0;
  size_t next_range_ = 0;
  std::vector<SavedRange> saved_;
  int64_t at_ = 0;  // bytes written so far (4 KiB multiples)
  double fill_s_ = 0.0, crc_s_ = 0.0, wait_s_ = 0.0, sync_s_ = 0.0;
  int64_t in_place_bytes_ = 0;
  std::function<void(size_t)> progress_;
};

// A complete checkpoint directory, opened for reading: the manifest checked,
// every file present and as long as the manifest says. Reads verify every
// MiB they touch against its CRC-32C.
class CheckpointReader {
 public:
  // Throws InputError naming the file for a missing or malformed manifest or
  // a missing or truncated data file.
  CheckpointReader(const std::string& dir, const nvme::EngineOptions& engine);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const std::string& dir() const { return dir_; }
  const Manifest& manifest() const { return manifest_; }
  static constexpr int kReaderSlots = 8;
  static constexpr int64_t kReaderSlotBytes = int64_t(8) << 20;

  // Saved elements [start, start + numel) of `category`, to be copied to out.
  struct Target {
    Category category = Category::kMaster;
    int64_t start = 0;
    int64_t numel = 0;
    std::byte* out = nullptr;
    // > 0: `out` is this target's own (not shared with another target) and
    // this many bytes may be written there (at least numel x elem_bytes):
    // pieces then go straight from the file into it where it is 4 KiB
    // aligned, ahead of done() and without a copy; the bytes past the
    // elements up to the next 4 KiB are the file's zero padding.
    int64_t own_bytes = 0;
  };
  // Fills each target's `out` with its saved elements (elem_bytes each), in
  // order, reading up to kReaderSlots pieces of kReaderSlotBytes ahead and
  // verifying every MiB as it arrives. done(k), on the calling thread, is
  // called once target k is complete and before any byte of a later target
  // is copied out: targets may share one `out` (unless own_bytes says
  // otherwise). Throws InputError naming the
  // file and offset on a checksum mismatch or a short read.
  void read_all(const std::vector<Target>& targets, const std::function<void(size_t)>& done = {});
  // One target.
  void read(Category c, int64_t start, int64_t numel, std::byte* out) { read_all({{c, start, numel, out}}); }
  int elem_bytes(Category c) const { return manifest_.elem_bytes.at(c); }

 private:
  nvme::FileId file(const std::string& name);

  std::string dir_;
  Manifest manifest_;
  HostBuffer scratch_;  // before the engine, which registers it
  std::unique_ptr<nvme::IoEngine> engine_;
  std::map<std::string, nvme::FileId> open_;
};

struct CheckpointOptions {
  std::string dir;          // run.checkpoint.dir
  int64_t keep = 2;         // complete checkpoints kept; older ones are pruned
  nvme::EngineOptions engine;
  // Tests: the save's thread sleeps this long before each range, so that
  // training overtakes a save in flight (Note [Saving while training]).
  int test_delay_per_range_ms = 0;
};

// Host memory a save may copy ranges into before training overwrites them
// (Note [Save snapshots]): 4 KiB aligned, owned by the caller, used by one
// save at a time. Empty: none.
struct SnapshotPool {
  std::byte* data = nullptr;
  int64_t bytes = 0;
};

// A save of one step in flight (Note [Checkpoint protocol]): this rank's
// ranges are written by a thread of its own while training goes on, and the
// save is published by a collective finish() at a later step boundary.
//
// Note [Saving while training]
// A periodic save does not stall the step. It starts at a step boundary; its
// thread writes each range as soon as `ready(i)` says the update being saved
// is final there (with run.overlap_optimizer the step's optimizer may still
// be running), from the range's home in place where it is resident, else
// through staging. Whatever would overwrite a range before it is written -
// the next optimizer pass - first calls make_writable() for the ranges it is
// about to change, so it waits per piece, and only when it overtakes the
// save (and, with a snapshot pool, only once the pool is full: Note [Save
// snapshots]). The fsync and the rank's part of the manifest follow on the
// same thread; finish() then agrees across ranks and publishes.
//
// Note [Save snapshots]
// A save longer than the forward and backward after it is overtaken by the
// next optimizer pass, which would wait for the disk range by range. With a
// snapshot pool (run.checkpoint.snapshot_gb), the pass instead copies each
// range it is about to overwrite, and the save has not begun, into the pool
// (RangeSource::snapshot: the same read the save would make, done earlier on
// the pass's thread), and goes on; the save writes that range from the pool.
// A range the save has begun is waited for, as is every range once the pool
// is full (it is not reused within a save: ranges are overtaken in the
// optimizer's order, which a speculating step's commit walks downwards,
// while the save writes upwards), and every range on NVMe (its copy would
// be the read the save makes, on the disk the save writes to: measured, that
// cost the step more than waiting; BENCHMARKS.md, "Checkpoints"). A pass
// walking upwards that catches up with the save would then follow it range
// by range (the save begins the next range before the pass gets there): so
// when it meets a begun range it first copies every later range the save
// has not begun, as far as the pool allows, in the save's order (the save
// writes each as soon as it is copied), and only then waits. The bytes read
// and written are the same either way; what the pool buys is that the
// disk's time stops being the step's: the copies run at memory or PCIe
// speed.
class CheckpointSave {
 public:
  // Collective: rank 0 creates the .tmp directory (every rank fails when it
  // cannot), then this rank's thread starts. `ready(i)` runs on that thread
  // before range i is read; false abandons the save (it then fails).
  // `pool` (with source.snapshot): Note [Save snapshots].
  CheckpointSave(const CheckpointOptions& options, Communicator& comm, Manifest header,
                 std::vector<ShardRange> ranges, RangeSource source, std::function<bool(size_t)> ready = {},
                 SnapshotPool pool = {});
  // Waits for the thread; an unfinished save leaves its .tmp directory,
  // which the next save removes.
  ~CheckpointSave();
  CheckpointSave(const CheckpointSave&) = delete;
  CheckpointSave& operator=(const CheckpointSave&) = delete;

  int64_t step() const { return step_; }
  // Any thread: until the homes of ranges [lo, hi) may change: each is
  // written, or copied into the snapshot pool by this call (Note [Save
  // snapshots]), or the save has failed. Returns the seconds it waited for
  // the save (not those it spent copying).
  double make_writable(size_t lo, size_t hi);
  // Bytes of ranges copied into the pool so far (the save writes them from there).
  int64_t snapshot_bytes() const;
  // Collective, cheap (one all-reduce): whether every rank's thread is done.
  bool done_everywhere();
  // Collective: waits for this rank's thread, agrees, and rank 0 publishes.
  // Returns the checkpoint's directory; throws Error on every rank, with the
  // first failing rank's message, when the save failed (the .tmp directory
  // removed, latest and the earlier checkpoints untouched).
  std::string finish();
  // Seconds from the start to this rank's file synced (valid once done), and
  // the bytes this rank saved.
  double write_seconds() const { return write_s_; }
  int64_t bytes() const { return bytes_; }

 private:
  void run();

  CheckpointOptions options_;
  Communicator& comm_;
  Manifest header_;
  std::vector<ShardRange> ranges_;
  RangeSource source_;
  std::function<bool(size_t)> ready_;
  SnapshotPool pool_;
  RangeSource from_pool_;  // range i's bytes from snap_[i]
  std::string tmp_, final_dir_;
  int64_t step_ = 0;
  int64_t bytes_ = 0;
  double write_s_ = 0.0;
  std::chrono::steady_clock::time_point t0_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  size_t written_ = 0;  // guarded by mu_, as are the rest up to error_
  size_t begun_ = 0;    // ranges the thread has begun (read from their homes or the pool)
  enum class Snap : uint8_t { kNone, kCopying, kTaken };
  std::vector<Snap> snap_state_;   // per range
  std::vector<char> snap_ok_;      // per range: RangeSource::snapshot_ok
  std::vector<std::byte*> snap_;   // per range: its copy in the pool (set once kTaken)
  int64_t pool_used_ = 0;
  int64_t snapshot_bytes_ = 0;
  // make_writable's callers one at a time (source_.snapshot's I/O is one), before mu_.
  std::mutex callers_mu_;
  // Note [Save snapshots]: takes range i's place in the pool (false: begun,
  // not kNone, or no room); copies what was reserved, in order.
  bool reserve_locked(size_t i, std::vector<std::pair<size_t, std::byte*>>& out);
  void copy_reserved(std::unique_lock<std::mutex>& lock, const std::vector<std::pair<size_t, std::byte*>>& reserved);
  std::vector<std::pair<size_t, std::byte*>> reserved_;  // make_writable's (callers_mu_), sized once
  bool done_ = false;
  std::string error_;
  bool finished_ = false;
  std::thread thread_;
};

// Saves step `header.step` (Note [Checkpoint protocol]) and waits: a
// CheckpointSave finished at once. Collective: every
// rank calls it with the ranges it writes and where their bytes are.
// Returns the checkpoint's directory. Throws Error (every rank, with the
// first failing rank's message) when the save failed.
std::string save_checkpoint(const CheckpointOptions& options, Communicator& comm, Manifest header,
                            const std::vector<ShardRange>& ranges, const RangeSource& source);

// Checkpoints pruned by a save are renamed to <name>.pruned.tmp at once and
// removed on a background thread, which the next save and the process's exit
// wait for. This waits for it now.
void wait_for_checkpoint_pruning();

// The checkpoint `dir` names: a complete checkpoint directory itself, or a
// directory of them with a `latest`. Throws InputError naming the path.
std::string resolve_checkpoint(const std::string& dir);

// Tests: a deterministic kill hook. STRATA_CHECKPOINT_KILL_AT=<event>:<k>[:<n>]
// SIGKILLs the process just before the k-th event (1-based) of kind
// write | fsync | rename | latest in the n-th save of the process (default 1).
void checkpoint_fault_point(const char* event);

}  // namespace strata
