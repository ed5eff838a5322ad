// The local communicator (world size 1) and the c10d one (Gloo or NCCL over a
// TCPStore), with the heartbeats of Note [Lost ranks].
#include "comm/communicator.h"

#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/c10d_backend.h"
#include "util/errors.h"
#include "util/logging.h"
#include "util/trace.h"

namespace strata {

int dtype_bytes(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kI64: return 8;
  }
  return 0;
}

int64_t ring_gather_bytes(int world_size, int64_t count, DType t) {
  return int64_t(world_size - 1) * count * dtype_bytes(t);
}

int64_t ring_all_reduce_bytes(int world_size, int64_t count, DType t) {
  if (world_size <= 1) return 0;
  // reduce-scatter then all-gather of count / n per rank each.
  return 2 * int64_t(world_size - 1) * count * dtype_bytes(t) / world_size;
}

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---- world size 1 -------------------------------------------------------------

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  const char* backend() const override { return "local"; }
  Completion all_gather(const void* in, void* out, int64_t count, DType t) override {
    if (in != out) std::memcpy(out, in, size_t(count * dtype_bytes(t)));
    return {};
  }
  Completion reduce_scatter(const void* in, void* out, int64_t count, DType t) override {
    if (in != out) std::memcpy(out, in, size_t(count * dtype_bytes(t)));
    return {};
  }
  Completion all_reduce(void*, int64_t, DType, ReduceOp) override { return {}; }
  Completion broadcast(void*, int64_t, DType, int) override { return {}; }
  void barrier() override {}
  void store_set(const std::string& key, const std::string& value) override { kv_[key] = value; }
  std::string store_get(const std::string& key) override {
    auto it = kv_.find(key);
    if (it == kv_.end()) throw CommError("store key '" + key + "' was never set");
    return it->second;
  }
  std::string lost_rank(double) override { return ""; }
  void mark_exit(const std::string&) override {}
  int64_t bytes_sent() const override { return 0; }
  double wait_seconds() const override { return 0.0; }
  void wait_ticket(uint64_t) override {}
  CollectiveGroup* open_data_group(const DataGroupOptions&) override { return this; }
  CollectiveGroup* open_node_group(const DataGroupOptions&) override { return this; }

 private:
  std::map<std::string, std::string> kv_;
};

// ---- c10d ---------------------------------------------------------------------

at::ScalarType scalar_type(DType t) {
  switch (t) {
    case DType::kF32: return at::kFloat;
    case DType::kF64: return at::kDouble;
    case DType::kBF16: return at::kBFloat16;
    case DType::kF16: return at::kHalf;
    case DType::kI64: return at::kLong;
  }
  return at::kFloat;
}

std::string exception_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    std::string s = x.what();
    // c10 appends a C++ stack trace to its messages; one line is enough.
    const size_t nl = s.find('\n');
    return nl == std::string::npos ? s : s.substr(0, nl);
  } catch (...) {
    return "unknown error";
  }
}

std::string hb_key(int r) { return "hb/" + std::to_string(r); }
std::string exit_key(int r) { return "exit/" + std::to_string(r); }

// One c10d process group's collectives (the host group, or the data group of
// Note [Data group]); failures go to the communicator's fail_hard, which
// names the lost rank.
class C10dGroup final : public CollectiveGroup {
 public:
  using FailFn = std::function<void(const std::string&)>;  // [[noreturn]]: throws
  C10dGroup(c10::intrusive_ptr<c10d::Backend> pg, const char* name, int world_size, at::Device device,
            void* stream, FailFn fail)
      : pg_(std::move(pg)), name_(name), world_size_(world_size), device_(device), stream_(stream),
        fail_(std::move(fail)) {}
  ~C10dGroup() override {
    // Note [Lost ranks]: a group after a failed collective is never destroyed.
    if (failed_) (void)pg_.release();
  }

  const char* backend() const override { return name_; }
  bool orders_streams() const override { return device_.is_cuda(); }

  Completion all_gather(const void* in, void* out, int64_t count, DType t) override {
    at::Tensor input = wrap(const_cast<void*>(in), count, t);
    at::Tensor output = wrap(out, count * world_size_, t);
    sent_ += ring_gather_bytes(world_size_, count, t);
    return track([&] { return pg_->_allgather_base(output, input); });
  }
  Completion reduce_scatter(const void* in, void* out, int64_t count, DType t) override {
    at::Tensor input = wrap(const_cast<void*>(in), count * world_size_, t);
    at::Tensor output = wrap(out, count, t);
    sent_ += ring_gather_bytes(world_size_, count, t);
    return track([&] { return pg_->_reduce_scatter_base(output, input); });
  }
  Completion all_reduce(void* buf, int64_t count, DType t, ReduceOp op) override {
    std::vector<at::Tensor> v{wrap(buf, count, t)};
    c10d::AllreduceOptions o;
    o.reduceOp = op == ReduceOp::kSum ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
    sent_ += ring_all_reduce_bytes(world_size_, count, t);
    return track([&] { return pg_->allreduce(v, o); });
  }
  Completion broadcast(void* buf, int64_t count, DType t, int root, int rank) {
    std::vector<at::Tensor> v{wrap(buf, count, t)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    if (rank == root) sent_ += count * dtype_bytes(t);
    return track([&] { return pg_->broadcast(v, o); });
  }
  Completion barrier() {
    return track([&] { return pg_->barrier(); });
  }

  int64_t bytes_sent() const override { return sent_; }
  double wait_seconds() const override { return wait_s_; }

  // A host wait (Gloo), or on NCCL the group's stream ordered after the work
  // (Note [Data group]).
  void wait_ticket(uint64_t ticket) override {
    Slot& s = slots_[ticket % kSlots];
    if (s.ticket != ticket || !s.work) return;
    c10::intrusive_ptr<c10d::Work> work = std::move(s.work);
    s.work.reset();
    const auto t0 = std::chrono::steady_clock::now();
    try {
      TraceSpan span(TraceTrack::kComm, "wait");
      if (stream_ != nullptr) {
        detail::on_stream(stream_, device_.index(), [&] { work->wait(); });
      } else {
        work->wait();
      }
    } catch (const std::exception&) {
      wait_s_ += seconds_since(t0);
      failed_ = true;
      fail_(exception_text(std::current_exception()));
    }
    wait_s_ += seconds_since(t0);
  }

 private:
  static constexpr size_t kSlots = 64;  // collectives in flight at once, at most
  struct Slot {
    uint64_t ticket = 0;
    c10::intrusive_ptr<c10d::Work> work;
  };

  at::Tensor wrap(void* p, int64_t count, DType t) const {
    return at::from_blob(p, {count}, at::TensorOptions().dtype(scalar_type(t)).device(device_));
  }

  template <typename Fn>
  Completion track(Fn&& issue) {
    const uint64_t ticket = ++next_ticket_;
    Slot& s = slots_[ticket % kSlots];
    if (s.work) wait_ticket(s.ticket);  // a caller that never waited: keep the bound
    try {
      if (stream_ != nullptr) {
        detail::on_stream(stream_, device_.index(), [&] { s.work = issue(); });
      } else {
        s.work = issue();
      }
    } catch (const std::exception&) {
      failed_ = true;
      fail_(exception_text(std::current_exception()));
    }
    s.ticket = ticket;
    return Completion(this, ticket);
  }

  c10::intrusive_ptr<c10d::Backend> pg_;
  const char* name_;
  int world_size_;
  at::Device device_;
  void* stream_;
  FailFn fail_;
  std::array<Slot, kSlots> slots_;
  uint64_t next_ticket_ = 0;
  int64_t sent_ = 0;
  double wait_s_ = 0.0;
  bool failed_ = false;
};

class C10dCommunicator final : public Communicator {
 public:
  C10dCommunicator(const RankInfo& who, const CommOptions& options) : who_(who), options_(options) {
    // c10d logs every failed store or socket operation as a warning with a
    // C++ stack trace; Strata reports a lost peer in one line of its own.
    FLAGS_caffe2_log_level = std::max<int>(FLAGS_caffe2_log_level, 2);
    const auto timeout = std::chrono::milliseconds(int64_t(options.timeout_s * 1000.0));
    const bool server = who.rank == 0 && !who.agent_store;
    try {
      store_ = connect(server, timeout);
      // The monitor's own connection: c10d store clients are not for two threads.
      monitor_store_ = server ? connect(false, timeout) : connect(false, timeout);
    } catch (const std::exception& e) {
      const std::string what = exception_text(std::current_exception());
      if (server) {
        throw CommError(strprintf("rank 0 cannot serve the rendezvous store on port %d (MASTER_PORT): %s",
                                  who.master_port, what.c_str()));
      }
      throw CommError(strprintf("rank %d cannot reach the rendezvous store at %s:%d (MASTER_ADDR:MASTER_PORT) "
                                "within comm.timeout_s = %g s: %s",
                                who.rank, who.master_addr.c_str(), who.master_port, options.timeout_s,
                                what.c_str()));
    }
    // Every rank beats before the process group exists, so the monitor never
    // sees a key that was not set yet.
    monitor_store_->add(hb_key(who.rank), 1);
    changed_.assign(size_t(who.world_size), std::chrono::steady_clock::now());
    exited_.assign(size_t(who.world_size), 0);
    monitor_ = std::thread([this] { monitor(); });
    try {
      // Note [Data group]: host values always over Gloo.
      auto pg_store = c10::make_intrusive<c10d::PrefixStore>("pg", store_);
      host_ = std::make_unique<C10dGroup>(detail::make_gloo_backend(pg_store, who, options), "gloo",
                                          who.world_size, at::Device(at::kCPU), nullptr,
                                          [this](const std::string& what) { fail_hard(what); });
    } catch (const CommError&) {
      stop_monitor();
      throw;
    } catch (const std::exception&) {
      const std::string what = exception_text(std::current_exception());
      fail_hard(what);
    }
  }

  ~C10dCommunicator() override {
    stop_monitor();
    if (failed_) {
      // Note [Lost ranks]: never destroy a group after a failed collective.
      (void)data_.release();
      (void)node_.release();
      (void)host_.release();
      (void)store_.release();
      (void)monitor_store_.release();
    }
  }

  int rank() const override { return who_.rank; }
  int world_size() const override { return who_.world_size; }
  const char* backend() const override { return data_ ? data_->backend() : "gloo"; }

  CollectiveGroup* open_data_group(const DataGroupOptions& o) override {
    STRATA_CHECK(!data_, "the data group is opened once");
    data_ = open_group(o, "data", who_);
    return data_.get();
  }

  CollectiveGroup* open_node_group(const DataGroupOptions& o) override {
    STRATA_CHECK(!node_, "the node group is opened once");
    const int per_node = who_.local_world_size;
    if (who_.world_size % per_node != 0 || who_.rank % per_node != who_.local_rank) {
      throw CommError(strprintf("rank %d is local rank %d of %d on its node: the ranks are not numbered node by "
                                "node (RANK = node x LOCAL_WORLD_SIZE + LOCAL_RANK), which the node's group of "
                                "comm.secondary_shard needs; set it \"off\" or launch with block numbering",
                                who_.rank, who_.local_rank, per_node));
    }
    RankInfo mine = who_;
    mine.rank = who_.local_rank;
    mine.world_size = per_node;
    node_ = open_group(o, "node" + std::to_string(who_.rank / per_node), mine);
    return node_.get();
  }

  Completion all_gather(const void* in, void* out, int64_t count, DType t) override {
    return host_->all_gather(in, out, count, t);
  }
  Completion reduce_scatter(const void* in, void* out, int64_t count, DType t) override {
    return host_->reduce_scatter(in, out, count, t);
  }
  Completion all_reduce(void* buf, int64_t count, DType t, ReduceOp op) override {
    return host_->all_reduce(buf, count, t, op);
  }
  Completion broadcast(void* buf, int64_t count, DType t, int root) override {
    return host_->broadcast(buf, count, t, root, who_.rank);
  }
  void barrier() override {
    // A one-element all-reduce: Gloo's barrier needs no buffers either way.
    int64_t one = 1;
    all_reduce(&one, 1, DType::kI64, ReduceOp::kSum).wait();
  }

  void store_set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::recursive_mutex> lock(store_mu_);
    try {
      store_->set("kv/" + key, std::vector<uint8_t>(value.begin(), value.end()));
    } catch (const std::exception&) {
      fail_hard(exception_text(std::current_exception()));
    }
  }
  std::string store_get(const std::string& key) override {
    std::lock_guard<std::recursive_mutex> lock(store_mu_);
    std::vector<uint8_t> v;
    try {
      v = store_->get("kv/" + key);
    } catch (const std::exception&) {
      fail_hard(exception_text(std::current_exception()));
    }
    return std::string(v.begin(), v.end());
  }

  std::string lost_rank(double max_wait_s) override {
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (store_lost_) {
          // A peer that left on purpose before the store went named the rank it lost.
          if (!blamed_.empty()) return blamed_;
          return who_.agent_store ? "the rendezvous store (torchrun's agent)" : "rank 0 (store host)";
        }
        const auto now = std::chrono::steady_clock::now();
        int worst = -1;
        double worst_s = 0.0;
        for (int r = 0; r < who_.world_size; ++r) {
          if (r == who_.rank || exited_[size_t(r)]) continue;
          const double stale = std::chrono::duration<double>(now - changed_[size_t(r)]).count();
          if (stale > 3.0 * options_.heartbeat_s && stale > worst_s) {
            worst = r;
            worst_s = stale;
          }
        }
        if (worst >= 0) {
          return strprintf("rank %d (no heartbeat for %.0f s: it died or stopped responding)", worst, worst_s);
        }
        if (!blamed_.empty()) return blamed_;
      }
      if (seconds_since(t0) >= max_wait_s) return "";
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  void mark_exit(const std::string& why) override {
    std::lock_guard<std::recursive_mutex> lock(store_mu_);
    try {
      store_->set(exit_key(who_.rank), std::vector<uint8_t>(why.begin(), why.end()));
    } catch (...) {
      // The store may be what was lost.
    }
  }

  int64_t bytes_sent() const override { return host_->bytes_sent(); }
  double wait_seconds() const override { return host_->wait_seconds(); }
  void wait_ticket(uint64_t ticket) override { host_->wait_ticket(ticket); }

 private:
  using FailFn = C10dGroup::FailFn;

  // A group of the data's backend (Note [Data group]) among `as`'s ranks,
  // rendezvousing under `prefix` in the store.
  std::unique_ptr<C10dGroup> open_group(const DataGroupOptions& o, const std::string& prefix, const RankInfo& as) {
    std::unique_ptr<C10dGroup> g;
    try {
      auto pg_store = c10::make_intrusive<c10d::PrefixStore>(prefix, store_);
      FailFn fail = [this](const std::string& what) { fail_hard(what); };
      if (o.backend == "nccl") {
        g = std::make_unique<C10dGroup>(detail::make_nccl_backend(pg_store, as, options_, o.device_index), "nccl",
                                        as.world_size, at::Device(at::kCUDA, at::DeviceIndex(o.device_index)),
                                        o.stream, std::move(fail));
      } else {
        g = std::make_unique<C10dGroup>(detail::make_gloo_backend(pg_store, as, options_), "gloo", as.world_size,
                                        at::Device(at::kCPU), nullptr, std::move(fail));
      }
    } catch (const CommError&) {
      throw;
    } catch (const std::exception&) {
      fail_hard(exception_text(std::current_exception()));
    }
    return g;
  }

  c10::intrusive_ptr<c10d::Store> connect(bool server, std::chrono::milliseconds timeout) {
    c10d::TCPStoreOptions o;
    o.port = uint16_t(who_.master_port);
    o.isServer = server;
    o.numWorkers = who_.world_size;
    o.waitWorkers = false;
    o.timeout = timeout;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(who_.master_addr, o);
    return c10::make_intrusive<c10d::PrefixStore>("strata", tcp);
  }

  // A collective or the store failed: name the lost rank (Note [Lost ranks]),
  // tell the others why this rank leaves, and throw.
  [[noreturn]] void fail_hard(const std::string& what) {
    // The data group's thread and the step's may both fail: one at a time.
    std::lock_guard<std::recursive_mutex> lock(store_mu_);
    failed_ = true;
    const std::string lost = lost_rank(options_.timeout_s);
    std::string msg;
    if (!lost.empty()) {
      msg = "lost " + lost + "; rank " + std::to_string(who_.rank) + " stops (" + what + ")";
      mark_exit("lost " + lost);
    } else {
      msg = "rank " + std::to_string(who_.rank) + ": communication failed: " + what;
      mark_exit("communication failed");
    }
    if (who_.rank == 0 && !who_.agent_store) linger_as_store_host();
    throw CommError(msg);
  }

  // The store lives in this process and leaves with it: before leaving, give
  // the ranks still beating a moment to find out who was lost and to say why
  // they leave, or they would all blame rank 0 (Note [Lost ranks]). Bounded:
  // a rank that neither beats nor leaves within a few intervals is given up.
  void linger_as_store_host() {
    const double limit = std::min(options_.timeout_s, 5.0 * options_.heartbeat_s + 2.0);
    const auto t0 = std::chrono::steady_clock::now();
    while (seconds_since(t0) < limit) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (store_lost_) return;
        const auto now = std::chrono::steady_clock::now();
        bool waiting = false;
        for (int r = 1; r < who_.world_size; ++r) {
          const double stale = std::chrono::duration<double>(now - changed_[size_t(r)]).count();
          waiting = waiting || (!exited_[size_t(r)] && stale <= 3.0 * options_.heartbeat_s);
        }
        if (!waiting) return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  // Note [Lost ranks]: beat, and watch the others' beats.
  void monitor() {
    const int n = who_.world_size;
    std::vector<int64_t> last(size_t(n), -1);
    std::unique_lock<std::mutex> lock(mu_);
    while (!quit_) {
      lock.unlock();
      bool lost_store = false;
      std::vector<int64_t> now_vals(static_cast<size_t>(n), 0);
      std::vector<std::string> exits(static_cast<size_t>(n));
      try {
        monitor_store_->add(hb_key(who_.rank), 1);
        for (int r = 0; r < n; ++r) {
          if (r == who_.rank) continue;
          now_vals[size_t(r)] = monitor_store_->add(hb_key(r), 0);
          if (monitor_store_->check({exit_key(r)})) {
            std::vector<uint8_t> v = monitor_store_->get(exit_key(r));
            exits[size_t(r)] = std::string(v.begin(), v.end());
          }
        }
      } catch (...) {
        lost_store = true;
      }
      lock.lock();
      if (lost_store) {
        store_lost_ = true;
        break;
      }
      const auto t = std::chrono::steady_clock::now();
      for (int r = 0; r < n; ++r) {
        if (now_vals[size_t(r)] != last[size_t(r)]) {
          last[size_t(r)] = now_vals[size_t(r)];
          changed_[size_t(r)] = t;
        }
        if (!exits[size_t(r)].empty() && !exited_[size_t(r)]) {
          exited_[size_t(r)] = 1;
          // A peer that left because it lost someone names who.
          if (exits[size_t(r)].rfind("lost ", 0) == 0 && blamed_.empty()) blamed_ = exits[size_t(r)].substr(5);
        }
      }
      cv_.wait_for(lock, std::chrono::duration<double>(options_.heartbeat_s), [&] { return quit_; });
    }
  }

  void stop_monitor() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    if (monitor_.joinable()) monitor_.join();
  }

  RankInfo who_;
  CommOptions options_;
  c10::intrusive_ptr<c10d::Store> store_, monitor_store_;
  std::unique_ptr<C10dGroup> host_;  // Note [Data group]
  std::unique_ptr<C10dGroup> data_;
  std::unique_ptr<C10dGroup> node_;  // comm.secondary_shard: this node's ranks
  // store_ is one connection, and c10d store clients are not for two
  // threads: the step's and a staged data group's (fail_hard) share it.
  std::recursive_mutex store_mu_;
  bool failed_ = false;

  std::thread monitor_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool quit_ = false;                      // guarded by mu_, as are the next five
  bool store_lost_ = false;
  std::vector<std::chrono::steady_clock::time_point> changed_;  // per rank: its counter last moved
  std::vector<char> exited_;               // per rank: left on purpose
  std::string blamed_;                     // what a peer that left on purpose blamed
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator() { return std::make_unique<LocalCommunicator>(); }

std::unique_ptr<Communicator> make_communicator(const RankInfo& who, const CommOptions& options) {
  if (who.world_size == 1 && !options.process_group_at_one) return make_local_communicator();
  return std::make_unique<C10dCommunicator>(who, options);
}

}  // namespace strata
