// The io_uring backend: one ring per engine worker, created on that worker's
// thread (IORING_SETUP_SINGLE_ISSUER), with registered files and buffers.
#include <errno.h>
#include <liburing.h>
#include <sys/uio.h>
#include <time.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "nvme/backend.h"
#include "nvme/io_error.h"
#include "util/errors.h"
#include "util/logging.h"

namespace strata::nvme {

const char* backend_kind_name(BackendKind kind) {
  switch (kind) {
    case BackendKind::kAuto:
      return "auto";
    case BackendKind::kIoUring:
      return "io_uring";
    case BackendKind::kThreadPool:
      return "threads";
  }
  return "?";
}

bool parse_backend_kind(const std::string& name, BackendKind* kind) {
  if (name == "auto")
    *kind = BackendKind::kAuto;
  else if (name == "io_uring" || name == "uring")
    *kind = BackendKind::kIoUring;
  else if (name == "threads" || name == "thread_pool")
    *kind = BackendKind::kThreadPool;
  else
    return false;
  return true;
}

namespace {

class UringBackend final : public Backend {
 public:
  UringBackend(int queue_depth, int max_files) : queue_depth_(queue_depth) {
    // Note [Ring setup flags]
    // SINGLE_ISSUER + DEFER_TASKRUN: only the owning worker submits, and
    // completions are processed when it asks for them (in submit_and_reap)
    // rather than by interrupting it. Kernels before 6.1 refuse the flags
    // (EINVAL); the ring then works without them.
    io_uring_params params;
    std::memset(&params, 0, sizeof(params));
    params.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
    int rc = io_uring_queue_init_params(unsigned(queue_depth), &ring_, &params);
    if (rc == -EINVAL) {
      std::memset(&params, 0, sizeof(params));
      rc = io_uring_queue_init_params(unsigned(queue_depth), &ring_, &params);
    }
    if (rc < 0) throw_io_error("io_uring", -rc, "cannot create a ring");
    (void)io_uring_register_ring_fd(&ring_);  // saves an fd lookup per enter; optional
    if (max_files > 0)
      files_registered_ = io_uring_register_files_sparse(&ring_, unsigned(max_files)) == 0;
  }
  ~UringBackend() override { io_uring_queue_exit(&ring_); }

  const char* name() const override { return "io_uring"; }

  void prepare(const BackendOp& op) override {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    STRATA_CHECK(sqe != nullptr, "io_uring submission queue full");
    const bool fixed_file = files_registered_ && op.file_slot >= 0 && slot_set(op.file_slot);
    const int fd = fixed_file ? op.file_slot : op.fd;
    const unsigned len = unsigned(op.bytes);
    const bool fixed_buf = buffers_registered_ && op.buffer_index >= 0;
    if (op.op == IoOp::kRead) {
      if (fixed_buf)
        io_uring_prep_read_fixed(sqe, fd, op.buffer, len, uint64_t(op.offset_bytes),
                                 op.buffer_index);
      else
        io_uring_prep_read(sqe, fd, op.buffer, len, uint64_t(op.offset_bytes));
    } else {
      if (fixed_buf)
        io_uring_prep_write_fixed(sqe, fd, op.buffer, len, uint64_t(op.offset_bytes),
                                  op.buffer_index);
      else
        io_uring_prep_write(sqe, fd, op.buffer, len, uint64_t(op.offset_bytes));
    }
    if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(sqe, op.tag);
  }

  int submit_and_reap(int min_complete, std::span<Completion> out) override {
    for (int attempt = 0;; ++attempt) {
      const int rc = io_uring_submit_and_wait(&ring_, unsigned(min_complete));
      if (rc >= 0 || rc == -EINTR) break;
      // -EAGAIN/-EBUSY/-ENOMEM: the kernel is short of resources for new
      // submissions; completions already posted free some. Reap those, or
      // back off and try again.
      if (rc == -EAGAIN || rc == -EBUSY || rc == -ENOMEM) {
        if (io_uring_cq_ready(&ring_) > 0) break;
        if (attempt < 1000) {
          const timespec pause{0, 1000000};  // 1 ms
          nanosleep(&pause, nullptr);
          continue;
        }
      }
      throw_io_error("io_uring", -rc, "cannot submit");
    }
    io_uring_cqe* cqes[256];
    int n = 0;
    while (size_t(n) < out.size()) {
      const unsigned want = unsigned(std::min<size_t>(out.size() - size_t(n), 256));
      const unsigned got = io_uring_peek_batch_cqe(&ring_, cqes, want);
      for (unsigned i = 0; i < got; ++i) {
        out[size_t(n++)] = {io_uring_cqe_get_data64(cqes[i]), int64_t(cqes[i]->res)};
      }
      io_uring_cq_advance(&ring_, got);
      if (got < want) break;
    }
    return n;
  }

  bool register_file(int slot, int fd) override {
    if (!files_registered_) return false;
    int value = fd;
    const int rc = io_uring_register_files_update(&ring_, unsigned(slot), &value, 1);
    if (slot >= int(slots_.size())) slots_.resize(size_t(slot) + 1, false);
    slots_[size_t(slot)] = rc == 1 && fd >= 0;
    return rc == 1;
  }

  bool create_buffer_table(int slots) override {
    const int rc = io_uring_register_buffers_sparse(&ring_, unsigned(slots));
    if (rc < 0) log::debug("io_uring: no sparse buffer table: %s", std::strerror(-rc));
    buffers_registered_ = rc == 0;
    return buffers_registered_;
  }

  bool set_buffer(int slot, void* p, int64_t bytes) override {
    if (!buffers_registered_) return false;
    iovec iov{p, p == nullptr ? 0 : size_t(bytes)};
    __u64 tag = 0;
    const int rc = io_uring_register_buffers_update_tag(&ring_, unsigned(slot), &iov, &tag, 1);
    if (rc < 0 && p != nullptr) {
      log::debug("io_uring: cannot register an I/O buffer of %lld bytes: %s", (long long)bytes,
                 std::strerror(-rc));
    }
    return rc == 1;
  }

  bool register_buffers(std::span<const std::pair<void*, int64_t>> regions) override {
    if (regions.empty()) return false;
    std::vector<iovec> iov;
    for (const auto& [p, bytes] : regions) iov.push_back({p, size_t(bytes)});
    const int rc = io_uring_register_buffers(&ring_, iov.data(), unsigned(iov.size()));
    if (rc < 0) {
      log::debug("io_uring: cannot register %zu I/O buffers: %s", iov.size(), std::strerror(-rc));
    }
    buffers_registered_ = rc == 0;
    return buffers_registered_;
  }

 private:
  bool slot_set(int slot) const { return slot < int(slots_.size()) && slots_[size_t(slot)]; }

  io_uring ring_;
  int queue_depth_;
  bool files_registered_ = false;
  bool buffers_registered_ = false;
  std::vector<bool> slots_;  // file slots registered in this ring
};

}  // namespace

std::unique_ptr<Backend> make_uring_backend(int queue_depth, int max_files) {
  return std::make_unique<UringBackend>(queue_depth, max_files);
}

}  // namespace strata::nvme
