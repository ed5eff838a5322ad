#include "engine/optimizer_staging.h"

#include "util/errors.h"

namespace strata {

OptimizerStaging::OptimizerStaging(const PlacementPlan& plan)
    : sets_(std::max(1, plan.staging.opt_sets)), piece_numel_(pipeline_piece_numel(plan)),
      elem_bytes_(plan.elem_bytes) {
  const StagingNeeds& need = plan.staging;
  auto bytes_of = [&](Category c) { return size_t(sets_) * size_t(piece_numel_ * elem_bytes_[size_t(c)]); };
  if (need.opt_grad > 0) buf_[size_t(Category::kGrad)] = HostBuffer(size_t(need.opt_grad), "optimizer staging: grad");
  if (need.opt_state > 0) {
    // need.opt_state = sets pieces of each of the three, at their element sizes.
    STRATA_CHECK(int64_t(bytes_of(Category::kMaster) + bytes_of(Category::kExpAvg) + bytes_of(Category::kExpAvgSq)) ==
                     need.opt_state,
                 "optimizer staging does not add up to the plan's");
    buf_[size_t(Category::kMaster)] = HostBuffer(bytes_of(Category::kMaster), "optimizer staging: master");
    buf_[size_t(Category::kExpAvg)] = HostBuffer(bytes_of(Category::kExpAvg), "optimizer staging: exp_avg");
    buf_[size_t(Category::kExpAvgSq)] = HostBuffer(bytes_of(Category::kExpAvgSq), "optimizer staging: exp_avg_sq");
  }
  if (need.opt_emit > 0) {
    buf_[size_t(Category::kParam16)] = HostBuffer(size_t(need.opt_emit), "optimizer staging: working copy");
  }
  reads_.resize(size_t(sets_));
  writes_.resize(size_t(sets_));
  read_done_.resize(size_t(sets_));
  write_done_.resize(size_t(sets_));
}

std::byte* OptimizerStaging::slot(Category c, int k) const {
  const HostBuffer& b = buf_[size_t(c)];
  return b.data() == nullptr ? nullptr
                             : b.as<std::byte>() + size_t(k) * size_t(piece_numel_ * elem_bytes_[size_t(c)]);
}

int64_t OptimizerStaging::bytes() const {
  int64_t n = 0;
  for (const HostBuffer& b : buf_) n += int64_t(b.bytes());
  return n;
}

}  // namespace strata
