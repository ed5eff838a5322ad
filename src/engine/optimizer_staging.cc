#include "engine/optimizer_staging.h"

#include "util/errors.h"

namespace strata {

OptimizerStaging::OptimizerStaging(const PlacementPlan& plan, TieredState& state)
    : sets_(std::max(1, plan.staging.opt_sets)), piece_numel_(pipeline_piece_numel(plan)),
      elem_bytes_(plan.elem_bytes) {
  const StagingNeeds& need = plan.staging;
  Device& device = state.device();
  auto bytes_of = [&](Category c) { return size_t(sets_) * size_t(piece_numel_ * elem_bytes_[size_t(c)]); };
  auto crossing = [&](Category c, int64_t bytes, const char* what) {
    if (bytes <= 0) return;
    if (device.host_addressable()) {
      buf_[size_t(c)] = HostBuffer(size_t(bytes), what);
    } else {
      pinned_[size_t(c)] = device.allocate_pinned(bytes, what);
    }
  };
  crossing(Category::kGrad, need.opt_grad, "optimizer staging: grad");
  if (need.opt_state > 0) {
    // need.opt_state = sets pieces of each of the three, at their element sizes.
    STRATA_CHECK(int64_t(bytes_of(Category::kMaster) + bytes_of(Category::kExpAvg) + bytes_of(Category::kExpAvgSq)) ==
                     need.opt_state,
                 "optimizer staging does not add up to the plan's");
    buf_[size_t(Category::kMaster)] = HostBuffer(bytes_of(Category::kMaster), "optimizer staging: master");
    buf_[size_t(Category::kExpAvg)] = HostBuffer(bytes_of(Category::kExpAvg), "optimizer staging: exp_avg");
    buf_[size_t(Category::kExpAvgSq)] = HostBuffer(bytes_of(Category::kExpAvgSq), "optimizer staging: exp_avg_sq");
  }
  crossing(Category::kParam16, need.opt_emit, "optimizer staging: working copy");
  for (int c = 0; c < kNumCategories; ++c) {
    base_[size_t(c)] = pinned_[size_t(c)].data() != nullptr ? pinned_[size_t(c)].data() : buf_[size_t(c)].as<std::byte>();
    const int64_t bytes = pinned_[size_t(c)].bytes() + int64_t(buf_[size_t(c)].bytes());
    io_registered_.push_back(state.register_io_buffer(Category(c), base_[size_t(c)], bytes));
  }
  reads_.resize(size_t(sets_));
  writes_.resize(size_t(sets_));
  read_done_.resize(size_t(sets_));
  write_done_.resize(size_t(sets_));
}

std::byte* OptimizerStaging::slot(Category c, int k) const {
  std::byte* b = base_[size_t(c)];
  return b == nullptr ? nullptr : b + size_t(k) * size_t(piece_numel_ * elem_bytes_[size_t(c)]);
}

int64_t OptimizerStaging::bytes() const {
  int64_t n = 0;
  for (const HostBuffer& b : buf_) n += int64_t(b.bytes());
  for (const PinnedHostBuffer& b : pinned_) n += b.bytes();
  return n;
}

}  // namespace strata
