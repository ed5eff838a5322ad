#include "nvme/fault_backend.h"

#include <errno.h>

#include <vector>

#include "nvme/file.h"

namespace strata::nvme {

const char* fault_kind_name(FaultKind kind) {
  switch (kind) {
    case FaultKind::kEio:
      return "EIO";
    case FaultKind::kEnospc:
      return "ENOSPC";
    case FaultKind::kShort:
      return "short";
    case FaultKind::kEagain:
      return "EAGAIN";
    case FaultKind::kEintr:
      return "EINTR";
  }
  return "?";
}

namespace {

class FaultBackend final : public Backend {
 public:
  FaultBackend(std::unique_ptr<Backend> inner, std::shared_ptr<FaultPlan> plan)
      : inner_(std::move(inner)), plan_(std::move(plan)) {}

  const char* name() const override { return inner_->name(); }

  void prepare(const BackendOp& op) override {
    if (!is_faulty(op)) return inner_->prepare(op);
    switch (plan_->kind) {
      case FaultKind::kEio:
        return fail(op, EIO);
      case FaultKind::kEnospc:
        return fail(op, ENOSPC);
      case FaultKind::kEagain:
        return fail(op, EAGAIN);
      case FaultKind::kEintr:
        return fail(op, EINTR);
      case FaultKind::kShort: {
        // Aligned, as short direct transfers are (is_faulty skips ops < 8 KiB).
        BackendOp half = op;
        half.bytes = op.bytes / 2 / kDirectAlignmentBytes * kDirectAlignmentBytes;
        return inner_->prepare(half);
      }
    }
  }

  int submit_and_reap(int min_complete, std::span<Completion> out) override {
    int n = 0;
    while (!injected_.empty() && size_t(n) < out.size()) {
      out[size_t(n++)] = injected_.back();
      injected_.pop_back();
    }
    return n + inner_->submit_and_reap(std::max(0, min_complete - n), out.subspan(size_t(n)));
  }

  bool register_file(int slot, int fd) override { return inner_->register_file(slot, fd); }
  bool create_buffer_table(int slots) override { return inner_->create_buffer_table(slots); }
  bool set_buffer(int slot, void* p, int64_t bytes) override { return inner_->set_buffer(slot, p, bytes); }
  bool register_buffers(std::span<const std::pair<void*, int64_t>> regions) override {
    return inner_->register_buffers(regions);
  }

 private:
  bool is_faulty(const BackendOp& op) {
    if (plan_->only_op >= 0 && plan_->only_op != int(op.op)) return false;
    if (plan_->kind == FaultKind::kShort && op.bytes < 2 * kDirectAlignmentBytes) return false;
    const int64_t k = plan_->seen.fetch_add(1) + 1;
    const bool faulty =
        k >= plan_->first_op && (plan_->count < 0 || k < plan_->first_op + plan_->count);
    if (faulty) plan_->injected.fetch_add(1);
    return faulty;
  }
  void fail(const BackendOp& op, int err) { injected_.push_back({op.tag, -int64_t(err)}); }

  std::unique_ptr<Backend> inner_;
  std::shared_ptr<FaultPlan> plan_;
  std::vector<Completion> injected_;  // completions of faulty ops, delivered at the next reap
};

}  // namespace

std::unique_ptr<Backend> make_fault_backend(std::unique_ptr<Backend> inner,
                                            std::shared_ptr<FaultPlan> plan) {
  return std::make_unique<FaultBackend>(std::move(inner), std::move(plan));
}

}  // namespace strata::nvme
