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
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
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

// Writes one rank's ranges to <dir>/<file>, preallocated, through its own
// I/O engine: two staging buffers, so that the tier read of one range
// overlaps the write of the previous one.
class RankFileWriter {
 public:
  RankFileWriter(const std::string& dir, const std::string& file, const std::vector<ShardRange>& ranges,
                 const std::map<Category, int>& elem_bytes, const nvme::EngineOptions& engine);
  ~RankFileWriter();
  RankFileWriter(const RankFileWriter&) = delete;
  RankFileWriter& operator=(const RankFileWriter&) = delete;

  // A free staging buffer for range `i` of the constructor's list (4 KiB
  // aligned, its shard_numel elements long); waits for the write that used
  // it before.
  std::byte* buffer(size_t i);
  // Checksums and starts writing range `i` from the buffer buffer(i) gave.
  void write(size_t i);
  // Waits for every write, fsyncs and closes the file; the ranges written.
  std::vector<SavedRange> finish();
  // Seconds spent checksumming, waiting for writes, and in fsync.
  double crc_s() const { return crc_s_; }
  double wait_s() const { return wait_s_; }
  double sync_s() const { return sync_s_; }

 private:
  std::string path_, file_;
  std::vector<ShardRange> ranges_;
  std::map<Category, int> elem_bytes_;
  std::unique_ptr<nvme::IoEngine> engine_;
  nvme::FileId id_;
  HostBuffer buf_[2];
  nvme::IoHandle pending_[2];
  std::vector<SavedRange> saved_;
  int64_t at_ = 0;  // bytes written so far (4 KiB multiples)
  double crc_s_ = 0.0, wait_s_ = 0.0, sync_s_ = 0.0;
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
  // Fills `out` with the saved elements [start, start + numel) of category c
  // (elem_bytes(c) each). Throws InputError naming the file and offset on a
  // checksum mismatch or a short read.
  void read(Category c, int64_t start, int64_t numel, std::byte* out);
  int elem_bytes(Category c) const { return manifest_.elem_bytes.at(c); }

 private:
  nvme::FileId file(const std::string& name);

  std::string dir_;
  Manifest manifest_;
  std::unique_ptr<nvme::IoEngine> engine_;
  std::map<std::string, nvme::FileId> open_;
  HostBuffer scratch_;
};

struct CheckpointOptions {
  std::string dir;          // run.checkpoint.dir
  int64_t keep = 2;         // complete checkpoints kept; older ones are pruned
  nvme::EngineOptions engine;
};

// Saves step `header.step` (Note [Checkpoint protocol]). Collective: every
// rank calls it with the ranges it writes; `fill(i, buf)` reads range i from
// its tier into buf. Returns the checkpoint's directory. Throws Error (every
// rank, with the first failing rank's message) when the save failed.
std::string save_checkpoint(const CheckpointOptions& options, Communicator& comm, Manifest header,
                            const std::vector<ShardRange>& ranges,
                            const std::function<void(size_t, std::byte*)>& fill);

// The checkpoint `dir` names: a complete checkpoint directory itself, or a
// directory of them with a `latest`. Throws InputError naming the path.
std::string resolve_checkpoint(const std::string& dir);

// Tests: a deterministic kill hook. STRATA_CHECKPOINT_KILL_AT=<event>:<k>[:<n>]
// SIGKILLs the process just before the k-th event (1-based) of kind
// write | fsync | rename | latest in the n-th save of the process (default 1).
void checkpoint_fault_point(const char* event);

}  // namespace strata
