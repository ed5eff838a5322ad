// The state layout: every block's parameters live in ONE flat buffer per state
// category, and a parameter is an offset and a shape into it (see
// Note [State layout]). Computed once from the block specs; no LibTorch here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata {

// How a parameter is initialised: kNormal N(0, std); kUniform U(-std, std)
// (`std` the bound: LoRA's A under kaiming_uniform_(a = sqrt 5) is
// U(-1/sqrt(in), 1/sqrt(in))).
enum class Init { kNormal, kOnes, kZeros, kUniform };

// One parameter of a block: what the model declares.
struct ParamSpec {
  std::string name;             // "wq", "attn_norm", ...
  std::vector<int64_t> shape;   // row-major, e.g. {n_heads*head_dim, dim}
  Init init = Init::kNormal;
  double std = 0.0;             // for kNormal; the bound for kUniform
  // Note [State kinds]: a frozen parameter has values only (in the compute
  // dtype), never a gradient, master weight or moment.
  bool frozen = false;

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

// Note [State kinds]
// State comes in two kinds, and a state category covers the parameters of
// one kind only:
//
//   kind     parameters                    categories                          dtype
//   trained  every one of a dense model;   param16 (working copy), grad,       as the run's
//            LoRA's adapters               master, exp_avg, exp_avg_sq         (adapters: fp32)
//   frozen   LoRA's base                   frozen (values only)                compute dtype
//
// So each block has two parts, each packed and padded as Note [State layout]
// says: its trained parameters (`params`, the block's range as before) and
// its frozen ones (`frozen`, a range of the frozen space, which is made of
// the blocks' frozen parts as the gathered space is of their trained parts).
// A dense model has no frozen part and its layout is what it always was. A
// frozen parameter has no gradient home, master or moment, is never written
// and never leaves the tier it was placed on except to be read. A block
// declares its frozen parameters before its trained ones, so that its
// weights in declaration order are the frozen part's views, then the trained
// part's (param_views in model/model.h).
struct BlockLayout {
  std::string name;             // "embedding", "layer.3", "head"
  std::vector<ParamLayout> params;  // trained; offsets in the block's trained range
  int64_t offset = 0;           // elements from the start of the gathered space
  int64_t numel = 0;            // sum of trained parameter numels (unpadded)
  int64_t padded_numel = 0;     // multiple of world_size * kShardAlignElems (0 when none)
  int64_t shard_numel() const { return padded_numel / world_size; }
  int64_t world_size = 1;
  // Note [State kinds]: the frozen part, laid out the same way in the frozen space.
  std::vector<ParamLayout> frozen;  // offsets in the block's frozen range
  int64_t frozen_offset = 0;    // elements from the start of the frozen space
  int64_t frozen_numel = 0;     // unpadded
  int64_t frozen_padded_numel = 0;  // multiple of frozen_world_size * kShardAlignElems
  int64_t frozen_shard_numel() const { return frozen_padded_numel / frozen_world_size; }
  // The frozen space's shards: ZeRO stage 3's ranks, else 1 (each rank holds
  // the whole base, as it holds the whole model's values at stages 0-2:
  // Note [Frozen shards] in engine/gathered_blocks.h).
  int64_t frozen_world_size = 1;
};

class StateLayout {
 public:
  // REQUIRES: world_size >= 1; every spec has a positive numel; in each
  // block the frozen specs come before the trained ones. The frozen space
  // splits into `frozen_world_size` shards (frozen_shard_count(): the world
  // size at ZeRO stage 3 only).
  StateLayout(const std::vector<std::pair<std::string, std::vector<ParamSpec>>>& blocks,
              int64_t world_size, int64_t frozen_world_size = 1);

  const std::vector<BlockLayout>& blocks() const { return blocks_; }
  const BlockLayout& block(size_t i) const { return blocks_.at(i); }
  size_t num_blocks() const { return blocks_.size(); }
  int64_t total_numel() const { return total_numel_; }          // padded, all blocks (trained)
  int64_t parameter_count() const { return parameter_count_; }  // unpadded (trained)
  // Note [State kinds]: the frozen space.
  int64_t frozen_total_numel() const { return frozen_total_numel_; }          // padded
  int64_t frozen_parameter_count() const { return frozen_parameter_count_; }  // unpadded
  bool has_frozen() const { return frozen_total_numel_ > 0; }
  int64_t world_size() const { return world_size_; }
  int64_t frozen_world_size() const { return frozen_world_size_; }

 private:
  std::vector<BlockLayout> blocks_;
  int64_t total_numel_ = 0;
  int64_t parameter_count_ = 0;
  int64_t frozen_total_numel_ = 0;
  int64_t frozen_parameter_count_ = 0;
  int64_t world_size_ = 1;
  int64_t frozen_world_size_ = 1;
};

}  // namespace strata
