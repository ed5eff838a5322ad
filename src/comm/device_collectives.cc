// Collectives on device memory (Note [Device collectives] in
// device_collectives.h).
#include "comm/device_collectives.h"

#include <algorithm>
#include <chrono>

#include "util/errors.h"
#include "util/trace.h"

namespace strata {

namespace {

class GroupOnStream final : public StreamCollectives {
 public:
  explicit GroupOnStream(CollectiveGroup& g) : g_(g) {}
  void all_gather(DevicePtr in, DevicePtr out, int64_t count, DType t) override {
    g_.all_gather(in.raw(), out.raw(), count, t).wait();
  }
  void reduce_scatter(DevicePtr in, DevicePtr out, int64_t count, DType t) override {
    g_.reduce_scatter(in.raw(), out.raw(), count, t).wait();
  }
  void all_reduce(DevicePtr buf, int64_t count, DType t) override {
    g_.all_reduce(buf.raw(), count, t, ReduceOp::kSum).wait();
  }

 private:
  CollectiveGroup& g_;
};

}  // namespace

std::unique_ptr<StreamCollectives> stream_collectives_over(CollectiveGroup& group) {
  STRATA_CHECK(group.orders_streams(), "a data group whose completions block the host is not a stream's");
  return std::make_unique<GroupOnStream>(group);
}

const char* device_comm_mode_name(DeviceCommMode m) {
  switch (m) {
    case DeviceCommMode::kInPlace: return "in place";
    case DeviceCommMode::kStaged: return "staged through host buffers";
    case DeviceCommMode::kStream: return "on the comm stream";
  }
  return "?";
}

DeviceCollectives::DeviceCollectives(Device& device, Communicator& comm)
    : device_(device), comm_(comm), mode_(DeviceCommMode::kInPlace), world_size_(comm.world_size()) {
  STRATA_CHECK(device.host_addressable(), "collectives in place on a device host code may not touch");
}

DeviceCollectives::DeviceCollectives(Device& device, Communicator& comm, CollectiveGroup& data)
    : device_(device), comm_(comm), mode_(DeviceCommMode::kStaged), data_(&data), world_size_(comm.world_size()) {
  const int64_t bytes = staged_host_bytes(world_size_) / 2;
  stage_in_ = device.allocate_pinned(bytes, "staged collectives (in)");
  stage_out_ = device.allocate_pinned(bytes, "staged collectives (out)");
  worker_ = std::thread([this] { worker_loop(); });
}

DeviceCollectives::DeviceCollectives(Device& device, Communicator& comm, StreamCollectives& stream)
    : device_(device), comm_(comm), mode_(DeviceCommMode::kStream), stream_(&stream), world_size_(comm.world_size()) {}

DeviceCollectives::~DeviceCollectives() { shutdown(); }

void DeviceCollectives::shutdown() {
  if (!worker_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dropping_ = true;
    quit_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void DeviceCollectives::attach_node_group(CollectiveGroup* group, StreamCollectives* stream, int size) {
  STRATA_CHECK(node_ == nullptr && node_stream_ == nullptr, "the node's group is attached once");
  STRATA_CHECK(size >= 1 && size <= world_size_, "a node group larger than the world");
  STRATA_CHECK(mode_ == DeviceCommMode::kStream ? stream != nullptr : group != nullptr,
               "the node's group does not match the collectives' mode");
  node_ = group;
  node_stream_ = stream;
  node_size_ = size;
}

Completion DeviceCollectives::node_all_gather(DevicePtr in, DevicePtr out, int64_t count, DType t) {
  STRATA_CHECK(node_ != nullptr || node_stream_ != nullptr, "a node gather without the node's group");
  node_sent_ += ring_gather_bytes(node_size_, count, t);
  return issue(Op::kAllGather, in, out, count, t, /*node=*/true);
}

Completion DeviceCollectives::all_gather(DevicePtr in, DevicePtr out, int64_t count, DType t) {
  sent_ += ring_gather_bytes(world_size_, count, t);
  return issue(Op::kAllGather, in, out, count, t);
}

Completion DeviceCollectives::reduce_scatter(DevicePtr in, DevicePtr out, int64_t count, DType t) {
  sent_ += ring_gather_bytes(world_size_, count, t);
  return issue(Op::kReduceScatter, in, out, count, t);
}

Completion DeviceCollectives::all_reduce(DevicePtr buf, int64_t count, DType t) {
  sent_ += ring_all_reduce_bytes(world_size_, count, t);
  return issue(Op::kAllReduce, buf, buf, count, t);
}

Completion DeviceCollectives::issue(Op op, DevicePtr in, DevicePtr out, int64_t count, DType t, bool node) {
  switch (mode_) {
    case DeviceCommMode::kInPlace:
      if (node) return node_->all_gather(in.raw(), out.raw(), count, t);
      if (op == Op::kAllGather) return comm_.all_gather(in.raw(), out.raw(), count, t);
      if (op == Op::kReduceScatter) return comm_.reduce_scatter(in.raw(), out.raw(), count, t);
      return comm_.all_reduce(in.raw(), count, t, ReduceOp::kSum);
    case DeviceCommMode::kStream:
      // Note [Device collectives]: after the input's writer, on the comm stream.
      device_.stream_wait(Stream::kComm, device_.record(Stream::kCompute));
      if (node) {
        node_stream_->all_gather(in, out, count, t);
      } else if (op == Op::kAllGather) {
        stream_->all_gather(in, out, count, t);
      } else if (op == Op::kReduceScatter) {
        stream_->reduce_scatter(in, out, count, t);
      } else {
        stream_->all_reduce(in, count, t);
      }
      return device_.record(Stream::kComm);
    case DeviceCommMode::kStaged:
      break;
  }
  Job job;
  job.op = op;
  job.group = node ? node_ : data_;
  job.size = node ? node_size_ : world_size_;
  job.in = in;
  job.out = out;
  job.count = count;
  job.t = t;
  job.produced = device_.record(Stream::kCompute);
  uint64_t ticket = 0;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (error_) std::rethrow_exception(error_);
    if (issued_ - done_ >= kJobs) cv_.wait(lock, [&] { return issued_ - done_ < kJobs || quit_; });
    ticket = ++issued_;
    jobs_[ticket % kJobs] = job;
  }
  cv_.notify_all();
  return Completion(this, ticket);
}

void DeviceCollectives::wait_ticket(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  if (done_ < ticket) {
    TraceSpan span(TraceTrack::kComm, "wait staged collective");
    const auto t0 = std::chrono::steady_clock::now();
    cv_.wait(lock, [&] { return done_ >= ticket; });
    wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (error_) std::rethrow_exception(error_);
}

void DeviceCollectives::worker_loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return quit_ || done_ < issued_; });
      if (done_ == issued_) return;
      job = jobs_[(done_ + 1) % kJobs];
    }
    std::exception_ptr failed;
    try {
      bool skip;
      {
        std::lock_guard<std::mutex> lock(mu_);
        skip = error_ != nullptr || dropping_;  // after a failure the group is not used again
      }
      if (!skip) run_staged(job);
    } catch (...) {
      failed = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failed && !error_) error_ = failed;
      ++done_;
    }
    cv_.notify_all();
  }
}

// One staged collective, piece by piece: per rank at most kStagedPieceBytes
// of the collective's per-rank count at a time.
void DeviceCollectives::run_staged(const Job& job) {
  TraceSpan span(TraceTrack::kComm, job.op == Op::kAllGather       ? "staged all_gather"
                                    : job.op == Op::kReduceScatter ? "staged reduce_scatter"
                                                                   : "staged all_reduce");
  Completion produced = job.produced;
  produced.wait();  // the input's writer
  const int64_t eb = dtype_bytes(job.t);
  const int64_t ws = job.size;
  CollectiveGroup& group = *job.group;
  std::byte* in = stage_in_.data();
  std::byte* out = stage_out_.data();
  // The comm stream's copies done (the host buffers are read or reused next).
  auto copied = [&] { device_.record(Stream::kComm).wait(); };
  if (job.op == Op::kAllReduce) {
    const int64_t piece = ws * kStagedPieceBytes / eb;
    for (int64_t o = 0; o < job.count; o += piece) {
      const int64_t n = std::min(piece, job.count - o);
      device_.copy_to_host(in, job.in + o * eb, n * eb, Stream::kComm);
      copied();
      group.all_reduce(in, n, job.t, ReduceOp::kSum).wait();
      device_.copy_to_device(job.out + o * eb, in, n * eb, Stream::kComm);
      copied();
    }
    return;
  }
  const int64_t piece = kStagedPieceBytes / eb;
  for (int64_t o = 0; o < job.count; o += piece) {
    const int64_t n = std::min(piece, job.count - o);
    if (job.op == Op::kAllGather) {
      device_.copy_to_host(in, job.in + o * eb, n * eb, Stream::kComm);
      copied();
      group.all_gather(in, out, n, job.t).wait();
      for (int64_t r = 0; r < ws; ++r) {
        device_.copy_to_device(job.out + (r * job.count + o) * eb, out + r * n * eb, n * eb, Stream::kComm);
      }
      copied();
    } else {
      for (int64_t r = 0; r < ws; ++r) {
        device_.copy_to_host(in + r * n * eb, job.in + (r * job.count + o) * eb, n * eb, Stream::kComm);
      }
      copied();
      group.reduce_scatter(in, out, n, job.t).wait();
      device_.copy_to_device(job.out + o * eb, out, n * eb, Stream::kComm);
      copied();
    }
  }
}

int64_t DeviceCollectives::bytes_sent() const { return mode_ == DeviceCommMode::kInPlace ? 0 : sent_; }

double DeviceCollectives::wait_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return wait_s_;
}

}  // namespace strata
