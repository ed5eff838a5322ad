#include "memory/layout.h"

#include "util/errors.h"

namespace strata {

namespace {
// Sizes come from the config and can be absurd (model.dim = 1e9): every
// product and sum is checked, and the whole stays below kMaxModelElems so
// that bytes of every category, tier and staging buffer fit int64 too.
constexpr int64_t kMaxModelElems = int64_t(1) << 56;

[[noreturn]] void too_large(const std::string& what) {
  throw ConfigError("model", what + " has more elements than Strata can address (2^56); "
                                    "check model.dim, model.n_layers and model.vocab_size");
}
}  // namespace

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n) || n > kMaxModelElems) too_large("parameter " + name);
  }
  return n;
}

StateLayout::StateLayout(
    const std::vector<std::pair<std::string, std::vector<ParamSpec>>>& blocks, int64_t world_size,
    int64_t frozen_world_size)
    : world_size_(world_size), frozen_world_size_(frozen_world_size) {
  STRATA_CHECK(world_size >= 1 && frozen_world_size_ >= 1, "world_size must be positive");
  auto pad_to = [](int64_t n, int64_t shards) {
    const int64_t quantum = shards * kShardAlignElems;
    return (n + quantum - 1) / quantum * quantum;
  };
  auto pad = [&](int64_t n) { return pad_to(n, world_size); };
  auto add = [&](int64_t& total, int64_t n, const std::string& what) {
    if (__builtin_add_overflow(total, n, &total) || total > kMaxModelElems) too_large(what);
  };
  for (const auto& [name, specs] : blocks) {
    BlockLayout b;
    b.name = name;
    b.world_size = world_size;
    b.frozen_world_size = frozen_world_size_;
    b.offset = total_numel_;
    b.frozen_offset = frozen_total_numel_;
    // Note [State kinds]: each part packed back to back, frozen first.
    for (const ParamSpec& s : specs) {
      const int64_t n = s.numel();
      STRATA_CHECK(n > 0, "parameter " + name + "." + s.name + " has no elements");
      STRATA_CHECK(!s.frozen || b.params.empty(), "block " + name + " declares frozen " + s.name + " after a trained one");
      if (s.frozen) {
        b.frozen.push_back({s, b.frozen_numel});
        add(b.frozen_numel, n, "block " + name);
      } else {
        b.params.push_back({s, b.numel});
        add(b.numel, n, "block " + name);
      }
    }
    b.padded_numel = pad(b.numel);
    b.frozen_padded_numel = pad_to(b.frozen_numel, frozen_world_size_);
    add(total_numel_, b.padded_numel, "the model");
    add(frozen_total_numel_, b.frozen_padded_numel, "the model");
    if (total_numel_ + frozen_total_numel_ > kMaxModelElems) too_large("the model");
    parameter_count_ += b.numel;
    frozen_parameter_count_ += b.frozen_numel;
    blocks_.push_back(std::move(b));
  }
}

}  // namespace strata
