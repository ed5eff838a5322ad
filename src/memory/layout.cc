#include "memory/layout.h"

#include "util/errors.h"

namespace strata {

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

StateLayout::StateLayout(
    const std::vector<std::pair<std::string, std::vector<ParamSpec>>>& blocks, int64_t world_size)
    : world_size_(world_size) {
  STRATA_CHECK(world_size >= 1, "world_size must be positive");
  const int64_t quantum = world_size * kShardAlignElems;
  for (const auto& [name, specs] : blocks) {
    BlockLayout b;
    b.name = name;
    b.world_size = world_size;
    b.offset = total_numel_;
    for (const ParamSpec& s : specs) {
      STRATA_CHECK(s.numel() > 0, "parameter " + name + "." + s.name + " has no elements");
      b.params.push_back({s, b.numel});
      b.numel += s.numel();
    }
    b.padded_numel = (b.numel + quantum - 1) / quantum * quantum;
    total_numel_ += b.padded_numel;
    parameter_count_ += b.numel;
    blocks_.push_back(std::move(b));
  }
}

}  // namespace strata
