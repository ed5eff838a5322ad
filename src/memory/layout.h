// The state layout: every block's parameters live in ONE flat buffer per state
// category, and a parameter is an offset and a shape into it (see
// Note [State layout]). Computed once from the block specs; no LibTorch here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata {

// How a parameter is initialised.
enum class Init { kNormal, kOnes, kZeros };

// One parameter of a block: what the model declares.
struct ParamSpec {
  std::string name;             // "wq", "attn_norm", ...
  std::vector<int64_t> shape;   // row-major, e.g. {n_heads*head_dim, dim}
  Init init = Init::kNormal;
  double std = 0.0;             // for kNormal

  int64_t numel() const;
};

// Where one parameter sits inside its block's flat range.
struct ParamLayout {
  ParamSpec spec;
  int64_t offset = 0;           // elements from the start of the block
};

// Note [State layout]
// A block's parameters are packed back to back in declaration order; the
// block's range is padded so that it splits into `world_size` equal shards,
// each a multiple of kShardAlignElems elements. With the same offsets used for
// every state category and every tier, a shard of any category is one
// contiguous range, and moving it between tiers is a single copy. Blocks'
// padded ranges concatenated in model order are the gathered space (what
// compute sees); rank r's shards of every block concatenated are its shard
// space (where its state lives: Note [Placement units], Note [Gathered
// blocks] in engine/trainer.h).
// Padding elements are zero in every category and stay zero (their gradient
// is zero, so Adam leaves them at zero).
inline constexpr int64_t kShardAlignElems = 2048;  // 4 KiB of 16-bit elements, 8 KiB of fp32

struct BlockLayout {
  std::string name;             // "embedding", "layer.3", "head"
  std::vector<ParamLayout> params;
  int64_t offset = 0;           // elements from the start of the gathered space
  int64_t numel = 0;            // sum of parameter numels (unpadded)
  int64_t padded_numel = 0;     // multiple of world_size * kShardAlignElems
  int64_t shard_numel() const { return padded_numel / world_size; }
  int64_t world_size = 1;
};

class StateLayout {
 public:
  // REQUIRES: world_size >= 1; every spec has a positive numel.
  StateLayout(const std::vector<std::pair<std::string, std::vector<ParamSpec>>>& blocks,
              int64_t world_size);

  const std::vector<BlockLayout>& blocks() const { return blocks_; }
  const BlockLayout& block(size_t i) const { return blocks_.at(i); }
  size_t num_blocks() const { return blocks_.size(); }
  int64_t total_numel() const { return total_numel_; }          // padded, all blocks
  int64_t parameter_count() const { return parameter_count_; }  // unpadded
  int64_t world_size() const { return world_size_; }

 private:
  std::vector<BlockLayout> blocks_;
  int64_t total_numel_ = 0;
  int64_t parameter_count_ = 0;
  int64_t world_size_ = 1;
};

}  // namespace strata
