// The step's schedules (schedule.h, Note [Step schedules]).
#include "memory/schedule.h"

#include <algorithm>

#include "util/errors.h"

namespace strata {

namespace {

StepOp op(int32_t b, int64_t m, Pass pass) {
  StepOp o;
  o.block[0] = b;
  o.count = 1;
  o.micro = int32_t(m);
  o.pass = pass;
  return o;
}

StepOp head_op(int num_blocks, bool tied, int64_t m) {
  StepOp h = op(num_blocks - 1, m, Pass::kHead);
  if (tied) {
    h.block[1] = 0;
    h.count = 2;
  }
  return h;
}

}  // namespace

std::vector<StepOp> train_schedule(StepSchedule schedule, int num_blocks, bool tied, int64_t accum) {
  STRATA_CHECK(num_blocks >= 2, "a model has at least an embedding and a head");
  STRATA_CHECK(schedule != StepSchedule::kAuto, "a schedule must be resolved before it is made");
  const int32_t head = num_blocks - 1;
  const int64_t A = std::max<int64_t>(accum, 1);
  std::vector<StepOp> s;
  s.reserve(size_t(A * (2 * head + 1)));
  if (schedule == StepSchedule::kMicroBatch) {
    for (int64_t m = 0; m < A; ++m) {
      for (int32_t b = 0; b < head; ++b) s.push_back(op(b, m, Pass::kForward));
      s.push_back(head_op(num_blocks, tied, m));
      for (int32_t b = head; b-- > 0;) s.push_back(op(b, m, Pass::kBackward));
    }
    return s;
  }
  for (int32_t b = 0; b < head; ++b) {
    for (int64_t m = 0; m < A; ++m) s.push_back(op(b, m, Pass::kForward));
  }
  for (int64_t m = 0; m < A; ++m) s.push_back(head_op(num_blocks, tied, m));
  for (int32_t b = head; b-- > 0;) {
    for (int64_t m = 0; m < A; ++m) s.push_back(op(b, m, Pass::kBackward));
  }
  return s;
}

std::vector<StepOp> eval_schedule(int num_blocks, bool tied) {
  STRATA_CHECK(num_blocks >= 2, "a model has at least an embedding and a head");
  std::vector<StepOp> s;
  for (int32_t b = 0; b + 1 < num_blocks; ++b) s.push_back(op(b, 0, Pass::kForward));
  s.push_back(head_op(num_blocks, tied, 0));
  return s;
}

std::vector<int32_t> gradient_final_order(const std::vector<StepOp>& ops) {
  std::vector<int32_t> last_op;  // per block: index of its last op that finalises a gradient
  for (size_t i = 0; i < ops.size(); ++i) {
    const StepOp& o = ops[i];
    if (o.pass == Pass::kForward) continue;
    // A head op finalises the head's gradient (and adds the tied
    // embedding's share, final only at the embedding's own backward).
    const int32_t b = o.block[0];
    if (size_t(b) >= last_op.size()) last_op.resize(size_t(b) + 1, -1);
    last_op[size_t(b)] = int32_t(i);
  }
  std::vector<int32_t> order;
  for (size_t b = 0; b < last_op.size(); ++b) {
    if (last_op[b] >= 0) order.push_back(int32_t(b));
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return last_op[size_t(a)] < last_op[size_t(b)]; });
  return order;
}

}  // namespace strata
