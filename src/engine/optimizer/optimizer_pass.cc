// The optimizer pass and its staging (optimizer_pass.h).
#include "engine/optimizer/optimizer_pass.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "util/errors.h"
#include "util/kill_hook.h"
#include "util/trace.h"

#ifdef STRATA_WITH_CUDA
#include "kernels/adam.h"
#endif

namespace strata {

namespace {

// Device-tier copies of optimizer state and working copies that no kernel
// reads or writes while the optimizer runs (Note [Optimizer overlap]: the next
// forward waits for a block's range to be published): not ordered after the
// compute queued so far. (The copy stream may still carry waits for compute
// that the other thread queued, e.g. a window fetch's: slower, never wrong.)
const Completion kNoKernel;

// Tests (checkpoint_cli_test): a deterministic kill.
// STRATA_OPTIMIZER_KILL_AT=<kind>:<step>, kind one of speculate, commit,
// full, restore: SIGKILL as that kind of job of optimizer step <step> starts
// its second piece (or its first, when it has one).
struct OptimizerKill {
  int kind = -1;
  int64_t step = 0;
};
const OptimizerKill& optimizer_kill() {
  static const OptimizerKill k = [] {
    OptimizerKill o;
    const KillAt at = kill_at_from_env("STRATA_OPTIMIZER_KILL_AT");
    if (at.event.empty()) return o;
    const char* names[] = {"full", "speculate", "commit", "restore"};  // OptimizerThread::Kind's order
    for (int i = 0; i < 4; ++i) {
      if (at.event == names[i]) o.kind = i;
    }
    o.step = at.numbers.at(0);
    return o;
  }();
  return k;
}

void maybe_kill(const OptimizerThread::Job& job, size_t pos, size_t n) {
  const OptimizerKill& k = optimizer_kill();
  if (k.kind < 0 || k.kind != int(job.kind) || k.step != job.step || pos != std::min<size_t>(1, n - 1)) return;
  std::raise(SIGKILL);
}

}  // namespace

OptimizerStaging::OptimizerStaging(const PlacementPlan& plan, TieredState& state)
    : sets_(std::max(1, plan.staging.opt_sets)), piece_numel_(pipeline_piece_numel(plan)),
      elem_bytes_(plan.state.elem_bytes) {
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
    // Registered with a GPU too: device-tier parts of pieces CPU Adam updates
    // cross PCIe through them, asynchronously (pageable memory would make
    // those copies synchronous). Zero-filled either way.
    crossing(Category::kMaster, int64_t(bytes_of(Category::kMaster)), "optimizer staging: master");
    crossing(Category::kExpAvg, int64_t(bytes_of(Category::kExpAvg)), "optimizer staging: exp_avg");
    crossing(Category::kExpAvgSq, int64_t(bytes_of(Category::kExpAvgSq)), "optimizer staging: exp_avg_sq");
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

// ---- the pass ---------------------------------------------------------------------

// CPU Adam's threads (docs/config.md, run.threads): run.threads when set; on
// the CPU device every core (the compute is the CPU's, and it waits for the
// optimizer anyway); on a GPU every core but two, which the thread that
// launches the GPU's work and the gradient path's lander keep: a launch
// thread preempted by Adam's workers leaves the GPU idle.
int adam_threads(const Config& cfg, const Device& device) {
  if (cfg.run.threads > 0) return int(cfg.run.threads);
  if (device.host_addressable()) return 0;
  const int cores = int(std::thread::hardware_concurrency());
  return std::max(1, cores - 2);
}

// Note [Speculative optimizer]: the speculating pieces in the order their
// gradients become final (memory/schedule.h, gradient_final_order): a piece
// is ready when the last of its blocks is; among pieces ready together, the
// later in shard space first. Both schedules finalise blocks from the head
// down, so this is the pieces from the last to the first.
std::vector<size_t> OptimizerPass::speculation_order(const PlacementPlan& plan) const {
  const size_t blocks = ctx_.layout->num_blocks();
  std::vector<int64_t> final_at(blocks, 0);
  const std::vector<int32_t> order = gradient_final_order(plan.step.ops(int(blocks), plan.tied));
  for (size_t i = 0; i < order.size(); ++i) final_at[size_t(order[i])] = int64_t(i);
  std::vector<std::pair<int64_t, size_t>> ready;  // (when its gradients are final, piece)
  for (size_t j = 0; j < pieces_.size(); ++j) {
    if (!piece_speculates_[j]) continue;
    const PlacementUnit& p = pieces_[j];
    int64_t at = 0;
    for (size_t b = 0; b < blocks; ++b) {
      const int64_t lo = ctx_.shard_offset[b], hi = lo + ctx_.shard_numel(b);
      if (lo < p.offset + p.numel && p.offset < hi) at = std::max(at, final_at[b]);
    }
    ready.emplace_back(at, j);
  }
  std::sort(ready.begin(), ready.end(), [](const auto& x, const auto& y) {
    return x.first != y.first ? x.first < y.first : x.second > y.second;
  });
  std::vector<size_t> out;
  for (const auto& r : ready) out.push_back(r.second);
  return out;
}

OptimizerPass::OptimizerPass(const StepContext& ctx, const PlacementPlan& plan, cpu_adam::Isa isa)
    : ctx_(ctx), adam_(std::make_unique<cpu_adam::CpuAdam>(adam_threads(*ctx.cfg, *ctx.device), isa)) {
  pieces_ = pipeline_pieces(plan);
  for (const PlacementUnit& piece : pieces_) piece_on_device_.push_back(device_adam_piece(plan, piece) ? 1 : 0);
  for (const PlacementUnit& piece : pieces_) {
    bool device = false;
    for (Category c : {Category::kMaster, Category::kExpAvg, Category::kExpAvgSq}) {
      const std::optional<Tier> t = range_tier(plan, c, piece.offset, piece.numel);
      device |= !t.has_value() || *t == Tier::kDevice;  // a piece across tiers may have device parts
    }
    piece_device_state_.push_back(!plan.device_addressable && device ? 1 : 0);
  }
  device_done_.resize(pieces_.size());
  for (size_t j = 0; j < pieces_.size(); ++j) {
    piece_speculates_.push_back(plan.optimizer.speculate && !piece_on_device_[j] ? 1 : 0);
    piece_slots_.push_back(speculates_in_slots(plan, pieces_[j]) ? 1 : 0);
    speculates_ |= piece_speculates_.back() != 0;
    ascending_.push_back(j);
  }
  speculated_numel_ = ::strata::speculated_numel(plan);  // the pieces flagged above
  descending_ = speculation_order(plan);
  set_of_.assign(pieces_.size(), 0);
  staging_ = std::make_unique<OptimizerStaging>(plan, *ctx.state);
  sets_.resize(size_t(staging_->sets()));
  checksum_threads_.adam = adam_.get();
  for (int k = 0; k < staging_->sets(); ++k) {
    staging_->reads(k).set_checksum_threads(&checksum_threads_);
    staging_->writes(k).set_checksum_threads(&checksum_threads_);
  }
  param_write_.set_checksum_threads(&checksum_threads_);
  grad_read_.set_checksum_threads(&checksum_threads_);
  cut_runs();
  if (optimizer_overlaps(*ctx.cfg, plan)) {
    thread_ = std::make_unique<OptimizerThread>([this](const OptimizerThread::Job& job) { run(job); });
  }
}

OptimizerPass::~OptimizerPass() { thread_.reset(); }

// Each piece's runs inside one block shard; device pieces' runs merged while
// they continue the same block shard.
void OptimizerPass::cut_runs() {
  const StateLayout& layout = *ctx_.layout;
  for (const PlacementUnit& piece : pieces_) {
    std::vector<AdamRun> runs;
    for (size_t b = 0; b < layout.num_blocks(); ++b) {
      const int64_t lo = std::max(piece.offset, ctx_.shard_offset[b]);
      const int64_t hi = std::min(piece.offset + piece.numel, ctx_.block_end[b]);
      if (lo >= hi) continue;
      const int64_t in_block = ctx_.shard_rank * ctx_.shard_numel(b) + (lo - ctx_.shard_offset[b]);
      runs.push_back({lo - piece.offset, hi - lo, uint64_t(ctx_.global_index[b] + in_block), int32_t(b)});
    }
    // Trace span names (Note [Speculative optimizer]): the piece's first block.
    const std::string block = runs.empty() ? "padding" : layout.block(size_t(runs.front().block)).name;
    speculate_names_.push_back("speculate " + block);
    commit_names_.push_back("commit " + block);
    piece_runs_.push_back(std::move(runs));
  }
  device_launch_.assign(pieces_.size(), {});
  size_t open_piece = SIZE_MAX;
  DeviceRun open;
  int32_t open_block = -1;
  auto close = [&] {
    if (open_piece != SIZE_MAX) device_launch_[open_piece].push_back(open);
    open_piece = SIZE_MAX;
  };
  for (size_t j = 0; j < pieces_.size(); ++j) {
    if (!piece_on_device_[j]) {
      close();
      continue;
    }
    for (const AdamRun& r : piece_runs_[j]) {
      const int64_t at = pieces_[j].offset + r.start;
      if (open_piece != SIZE_MAX && open.offset + open.numel == at && open_block == r.block &&
          open.key + uint64_t(open.numel) == r.key) {
        open.numel += r.numel;
      } else {
        close();
        open = DeviceRun{at, r.numel, r.key};
        open_piece = j;
        open_block = r.block;
      }
    }
  }
  close();
}

OptimizerPass::Report OptimizerPass::step(const OptimizerThread::Job& job) {
  if (thread_) {
    finish();  // the previous step's write-backs are done and its staging is free
    const Report last = thread_->take_report();  // the previous step's
    thread_->start(job);
    return last;
  }
  Report r;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    TieredState::TallyScope tally(&r.links);
    run(job);
  } catch (...) {
    broken_ = true;  // some pieces may have been updated and others not
    throw;
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

void OptimizerPass::wait(int64_t offset) {
  if (!thread_) return;
  try {
    thread_->wait(offset, &wait_s_);
  } catch (...) {
    broken_ = true;  // some pieces may have been updated and others not
    throw;
  }
}

int64_t OptimizerPass::progress() { return thread_ ? thread_->progress() : INT64_MAX; }

bool OptimizerPass::wait_for_job(int64_t step, int64_t offset) {
  return thread_ ? thread_->wait_for_job(step, offset) : true;
}

void OptimizerPass::add_checkpoint_wait(double seconds) {
  if (seconds > 0) checkpoint_wait_ns_.fetch_add(int64_t(seconds * 1e9), std::memory_order_relaxed);
}

double OptimizerPass::take_checkpoint_wait() {
  return double(checkpoint_wait_ns_.exchange(0, std::memory_order_relaxed)) * 1e-9;
}

void OptimizerPass::set_save(std::shared_ptr<SaveGate> save) {
  std::lock_guard<std::mutex> lock(save_mu_);
  save_ = std::move(save);
}

// Per piece, wherever its state lives: resident state is updated in place,
// swapped state is read into staging, updated and written back. The working
// copy comes out of the same pass (bf16: emitted by CPU Adam; fp32: copied).
//
// Note [Optimizer pipeline] in optimizer_pass.h.
cpu_adam::AdamParams OptimizerPass::adam_params(const OptimizerThread::Job& job) const {
  const Config& cfg = *ctx_.cfg;
  cpu_adam::AdamParams h;
  h.lr = job.lr;
  h.beta1 = cfg.optimizer.beta1;
  h.beta2 = cfg.optimizer.beta2;
  h.eps = cfg.optimizer.eps;
  h.weight_decay = cfg.optimizer.weight_decay;
  h.adamw = cfg.optimizer.adam_w_mode;
  return h;
}

// A save of an earlier step in flight (Note [Saving while training]): a job
// that writes state waits per piece until the save has written what the
// piece's update overwrites.
std::shared_ptr<SaveGate> OptimizerPass::save_for(const OptimizerThread::Job& job) {
  using Kind = OptimizerThread::Kind;
  if (job.kind == Kind::kSpeculate || job.kind == Kind::kRestore) return nullptr;  // the state is only read
  std::lock_guard<std::mutex> lock(save_mu_);
  if (save_ && job.step > save_->applied()) return save_;
  return nullptr;
}

// Per piece, wherever its state lives: resident state is updated in place,
// swapped state is read into staging, updated and written back. The working
// copy comes out of the same pass (bf16: emitted by CPU Adam; fp32: copied).
// The kinds of Note [Speculative optimizer] walk their own pieces in their
// own order through the same pipeline.
//
// Note [Optimizer pipeline] in optimizer_pass.h.
void OptimizerPass::run(const OptimizerThread::Job& job) {
  using Kind = OptimizerThread::Kind;
  const cpu_adam::AdamParams h = adam_params(job);
  OptimizerStaging& st = *staging_;
  const int sets = st.sets();
  const std::vector<size_t>& order =
      job.kind == Kind::kSpeculate || job.kind == Kind::kCommit ? descending_ : ascending_;
  // Pieces read ahead of the one updated: with 3 or more sets, all but the
  // set being updated and the one whose write-back was issued last; with 2,
  // one; with 1, none (the next piece is read after the write-back).
  const size_t ahead = sets >= 3 ? size_t(sets - 2) : sets == 2 ? 1 : 0;
  const std::shared_ptr<SaveGate> save = save_for(job);
  // Staging sets go round by position in the order (the pieces a job
  // works on need not be consecutive); a kind other than kFull works on
  // the pieces that speculate, and publishes the others as they are.
  for (size_t pos = 0; pos < order.size(); ++pos) set_of_[order[pos]] = int(pos % size_t(sets));
  try {
    walk(job, order, ahead, save, h);
  } catch (const Abandoned&) {
    // The step failed before its verdict: nothing of the state was written;
    // the staging's transfers end before the buffers are reused.
    for (int k = 0; k < sets; ++k) {
      st.read_done(k).wait();
      st.write_done(k).wait();
    }
  }
}

void OptimizerPass::walk(const OptimizerThread::Job& job, const std::vector<size_t>& order, size_t ahead,
                         const std::shared_ptr<SaveGate>& save, const cpu_adam::AdamParams& h) {
  using Kind = OptimizerThread::Kind;
  OptimizerStaging& st = *staging_;
  const int sets = st.sets();
  const size_t n = order.size();
  auto works_on = [&](size_t j) { return job.kind == Kind::kFull || piece_speculates_[j] != 0; };
  auto stage_at = [&](size_t pos) {
    if (works_on(order[pos])) stage_piece(order[pos], job);
  };
  for (size_t i = 0; i < std::max<size_t>(ahead, 1) && i < n; ++i) stage_at(i);
  for (size_t pos = 0; pos < n; ++pos) {
    maybe_kill(job, pos, n);
    const size_t j = order[pos];
    const int k = set_of_[j];
    const PlacementUnit& g = pieces_[j];
    if (ahead > 0 && pos + ahead < n) stage_at(pos + ahead);  // read ahead
    if (works_on(j) && piece_hook_) piece_hook_(int(job.kind));
    if (works_on(j)) {
      {
        TraceSpan span(TraceTrack::kAdam, "wait for the piece's reads (and verify them)");
        st.read_done(k).wait();
      }
      int64_t end = g.offset + g.numel;  // what this piece's update overwrites
      for (const DeviceRun& r : device_launch_[j]) end = std::max(end, r.offset + r.numel);
      if (save) {
        TraceSpan span(TraceTrack::kAdam, "wait for checkpoint (or snapshot)");
        add_checkpoint_wait(save->make_writable(g.offset, end));
      }
      switch (job.kind) {
        case Kind::kFull:
          if (piece_on_device_[j]) {
            TraceSpan span(TraceTrack::kAdam, "adam on the device");
            for (const DeviceRun& r : device_launch_[j]) launch_device_run(h, job, r);
            // One event per launch: a piece a merged run covers shares its launch's.
            if (!device_launch_[j].empty()) last_launch_ = ctx_.device->record(Stream::kCompute);
            device_done_[j] = last_launch_;
          } else {
            update_piece(j, job, h);
            write_back_piece(j, /*state=*/true, /*working=*/true);
            if (piece_device_state_[j]) device_done_[j] = ctx_.device->record(Stream::kStateH2D);
          }
          break;
        case Kind::kSpeculate:
          speculate_piece(j, job, h);
          // Note [Alternate swap slots]: the new state into the spare slots.
          write_back_piece(j, /*state=*/piece_slots_[j] != 0, /*working=*/true, /*spare=*/piece_slots_[j] != 0);
          break;
        case Kind::kCommit:
          if (piece_slots_[j]) {  // its new state is written: flip to it
            TraceSpan span(TraceTrack::kAdam, commit_names_[j].c_str());
            for (Category c : {Category::kMaster, Category::kExpAvg, Category::kExpAvgSq}) {
              ctx_.state->commit_spare(c, g.offset, g.numel);
            }
            if (thread_) thread_->publish_low(g.offset);
            break;
          }
          update_piece(j, job, h);
          if (thread_) thread_->publish_low(g.offset);  // its gradient is read
          write_back_piece(j, /*state=*/true, /*working=*/false);
          if (piece_device_state_[j]) device_done_[j] = ctx_.device->record(Stream::kStateH2D);
          break;
        case Kind::kRestore:
          restore_piece(j);
          write_back_piece(j, /*state=*/false, /*working=*/true);
          break;
      }
    }
    if (thread_ && (job.kind == Kind::kFull || job.kind == Kind::kRestore)) thread_->publish(g.offset + g.numel);
    if (sets == 1 && pos + 1 < n) stage_at(pos + 1);  // sequential: after the write-back
  }
  for (int k = 0; k < sets; ++k) st.write_done(k).wait();
}

void OptimizerPass::order_after_updates(Stream s, int64_t offset, int64_t numel) const {
  // The first piece ending after `offset`, then every piece starting before the range's end.
  auto it = std::upper_bound(pieces_.begin(), pieces_.end(), offset,
                             [](int64_t o, const PlacementUnit& p) { return o < p.offset + p.numel; });
  for (size_t j = size_t(it - pieces_.begin()); j < pieces_.size() && pieces_[j].offset < offset + numel; ++j) {
    if (device_done_[j].pending()) ctx_.device->stream_wait(s, device_done_[j]);
  }
}

// Piece j's spans: resident homes in place, the rest read into its set.
// A speculation reads the gradient later, once final (speculate_piece); a
// restore reads the master weights only.
void OptimizerPass::stage_piece(size_t j, const OptimizerThread::Job& job) {
  using Kind = OptimizerThread::Kind;
  OptimizerStaging& st = *staging_;
  TieredState& state = *ctx_.state;
  const PlacementPlan& plan = state.plan();
  const int k = set_of_[j];
  const PlacementUnit& g = pieces_[j];
  if (st.write_done(k).pending()) {
    TraceSpan span(TraceTrack::kAdam, "wait for the set's write-back");
    st.write_done(k).wait();  // the set's previous user is written back
  }
  OptSet& sp = sets_[size_t(k)];
  sp.adam = cpu_adam::AdamSpans();
  sp.adam.state_type = plan.state.bf16_moments() ? cpu_adam::StateType::kBF16 : cpu_adam::StateType::kF32;
  sp.adam.grad_type = cpu_adam::GradType::kF32;
  sp.adam.numel = g.numel;
  sp.keeps_state = false;
  if (piece_on_device_[j]) return;  // updated in place on the device (launch_device_run)
  if (job.kind == Kind::kCommit && piece_slots_[j]) return;  // a flip (Note [Alternate swap slots])
  const bool after_backward = job.kind == Kind::kFull || job.kind == Kind::kCommit;
  auto fetch = [&](Category c) -> std::byte* {
    std::byte* p = state.resident(c, g.offset, g.numel);
    if (p != nullptr) {
      sp.keeps_state |= c != Category::kGrad;
      return p;
    }
    std::byte* dst = st.slot(c, k);
    STRATA_CHECK(dst != nullptr, "optimizer staging without a slot for a piece that needs one");
    // Device-tier parts (a GPU) after the backward that wrote the gradient,
    // not behind the next step's forward this thread may run beside; state
    // no kernel writes (a speculation's, a restore's) at once.
    st.read_done(k) = state.read_async(c, g.offset, g.numel, dst, st.reads(k),
                                       after_backward ? &job.backward_done : &kNoKernel);
    return dst;
  };
  if (job.kind != Kind::kSpeculate && job.kind != Kind::kRestore) sp.adam.grad = fetch(Category::kGrad);
  sp.adam.param = reinterpret_cast<float*>(fetch(Category::kMaster));
  if (job.kind != Kind::kRestore) {
    sp.adam.exp_avg = fetch(Category::kExpAvg);
    sp.adam.exp_avg_sq = fetch(Category::kExpAvgSq);
  }
  sp.working = state.resident(Category::kParam16, g.offset, g.numel);
  sp.working_resident = sp.working != nullptr;
  if (!sp.working_resident) sp.working = st.slot(Category::kParam16, k);
  STRATA_CHECK(sp.working != nullptr, "optimizer staging without a working-copy slot");
  if (ctx_.param_dtype != at::kFloat && job.kind != Kind::kCommit) {
    sp.adam.emit = sp.working;
    sp.adam.emit_type = ctx_.param_dtype == at::kBFloat16 ? cpu_adam::EmitType::kBF16 : cpu_adam::EmitType::kF16;
  }
}

cpu_adam::AdamSpans run_part(const cpu_adam::AdamSpans& whole, int64_t start, int64_t numel, int64_t moment_bytes,
                             int64_t working_bytes) {
  cpu_adam::AdamSpans part = whole;
  part.param += start;
  part.grad = static_cast<const float*>(part.grad) + start;
  part.exp_avg = static_cast<std::byte*>(part.exp_avg) + start * moment_bytes;
  part.exp_avg_sq = static_cast<std::byte*>(part.exp_avg_sq) + start * moment_bytes;
  if (part.emit != nullptr) part.emit = static_cast<std::byte*>(part.emit) + start * working_bytes;
  part.numel = numel;
  return part;
}

// CPU Adam over piece j, one call per run inside a block shard: the rounding
// of bf16 moments is keyed by the global unpadded parameter index (Note [bf16
// state]), so it depends on neither pieces, placement nor world size. A
// commit (Note [Speculative optimizer]) leaves the working copy alone.
void OptimizerPass::update_piece(size_t j, const OptimizerThread::Job& job, const cpu_adam::AdamParams& h) {
  const OptSet& sp = sets_[size_t(set_of_[j])];
  const int64_t moment_bytes = ctx_.state->elem_bytes(Category::kExpAvg);
  TraceSpan span(TraceTrack::kAdam,
                 job.kind == OptimizerThread::Kind::kCommit ? commit_names_[j].c_str() : "adam sub-group");
  for (const AdamRun& run : piece_runs_[j]) {
    adam_->step(h, cpu_adam::StepArgs{job.step, job.grad_scale, run.key},
                run_part(sp.adam, run.start, run.numel, moment_bytes, ctx_.param_bytes));
  }
  if (ctx_.param_dtype == at::kFloat && job.kind != OptimizerThread::Kind::kCommit) {
    std::memcpy(sp.working, sp.adam.param, size_t(pieces_[j].numel * 4));
  }
}

// Piece j's staged state (`state`) and working copy (`working`) back to
// their homes; with `spare`, the state into its spare slots (Note
// [Alternate swap slots] in memory/tiered_state.h).
void OptimizerPass::write_back_piece(size_t j, bool state_too, bool working, bool spare) {
  OptimizerStaging& st = *staging_;
  TieredState& state = *ctx_.state;
  const int k = set_of_[j];
  const PlacementUnit& g = pieces_[j];
  const OptSet& sp = sets_[size_t(k)];
  PendingIo& w = st.writes(k);
  Completion& written = st.write_done(k);
  if (state_too && spare) {
    written = state.write_spare_async(Category::kMaster, g.offset, g.numel, sp.adam.param, w);
    written = state.write_spare_async(Category::kExpAvg, g.offset, g.numel, sp.adam.exp_avg, w);
    written = state.write_spare_async(Category::kExpAvgSq, g.offset, g.numel, sp.adam.exp_avg_sq, w);
  } else if (state_too) {
    if (!state.resident(Category::kMaster, g.offset, g.numel)) {
      written = state.write_async(Category::kMaster, g.offset, g.numel, sp.adam.param, w, &kNoKernel);
    }
    if (!state.resident(Category::kExpAvg, g.offset, g.numel)) {
      written = state.write_async(Category::kExpAvg, g.offset, g.numel, sp.adam.exp_avg, w, &kNoKernel);
    }
    if (!state.resident(Category::kExpAvgSq, g.offset, g.numel)) {
      written = state.write_async(Category::kExpAvgSq, g.offset, g.numel, sp.adam.exp_avg_sq, w, &kNoKernel);
    }
  }
  if (!working || sp.working_resident) return;
  if (thread_) {
    // The next forward may read it as soon as the progress says so.
    state.write_async(Category::kParam16, g.offset, g.numel, sp.working, param_write_, &kNoKernel).wait();
  } else {
    written = state.write_async(Category::kParam16, g.offset, g.numel, sp.working, w, &kNoKernel);
  }
}

// Note [Speculative optimizer], a commit: the pieces wholly in HBM, not
// speculated, updated by the device's Adam on the compute stream (from the
// compute thread: the next forward's kernels queue after them).
void OptimizerPass::launch_device_pieces(const OptimizerThread::Job& job) {
  const cpu_adam::AdamParams h = adam_params(job);
  const std::shared_ptr<SaveGate> save = save_for(job);
  for (size_t j = 0; j < pieces_.size(); ++j) {
    if (!piece_on_device_[j] || device_launch_[j].empty()) {
      if (piece_on_device_[j]) device_done_[j] = last_launch_;
      continue;
    }
    int64_t end = pieces_[j].offset + pieces_[j].numel;
    for (const DeviceRun& r : device_launch_[j]) end = std::max(end, r.offset + r.numel);
    if (save) {
      TraceSpan span(TraceTrack::kCompute, "wait for checkpoint (or snapshot)");
      add_checkpoint_wait(save->make_writable(pieces_[j].offset, end));
    }
    for (const DeviceRun& r : device_launch_[j]) launch_device_run(h, job, r);
    last_launch_ = ctx_.device->record(Stream::kCompute);
    device_done_[j] = last_launch_;
  }
}

// One launch over a stretch of device-resident state (DeviceRun): master,
// moments and gradient in place, the working copy emitted (bf16/fp16) or
// copied (fp32) on the compute stream.
void OptimizerPass::launch_device_run(const cpu_adam::AdamParams& h, const OptimizerThread::Job& job, const DeviceRun& r) {
  auto home = [&](Category c) {
    const DevicePtr p = ctx_.state->resident_on_device(c, r.offset, r.numel);
    STRATA_CHECK(p, "a device optimizer run that is not resident on the device");
    return p;
  };
  cpu_adam::AdamSpans s;
  s.grad = home(Category::kGrad).raw();
  s.param = reinterpret_cast<float*>(home(Category::kMaster).raw());
  s.exp_avg = home(Category::kExpAvg).raw();
  s.exp_avg_sq = home(Category::kExpAvgSq).raw();
  s.state_type = ctx_.state->plan().state.bf16_moments() ? cpu_adam::StateType::kBF16 : cpu_adam::StateType::kF32;
  s.grad_type = cpu_adam::GradType::kF32;
  s.numel = r.numel;
  const DevicePtr working = home(Category::kParam16);
  if (ctx_.param_dtype != at::kFloat) {
    s.emit = working.raw();
    s.emit_type = ctx_.param_dtype == at::kBFloat16 ? cpu_adam::EmitType::kBF16 : cpu_adam::EmitType::kF16;
  }
  device_adam(h, cpu_adam::StepArgs{job.step, job.grad_scale, r.key}, s);
  if (ctx_.param_dtype == at::kFloat) {
    ctx_.device->copy_on_device(working, home(Category::kMaster), r.numel * 4, Stream::kCompute);
  }
}

void OptimizerPass::device_adam(const cpu_adam::AdamParams& h, const cpu_adam::StepArgs& args,
                          const cpu_adam::AdamSpans& spans) {
#ifdef STRATA_WITH_CUDA
  if (ctx_.device->is_cuda()) {
    ctx_.device->make_current();  // the optimizer thread's launches go to this GPU
    kernels::adam_step(cpu_adam::detail::make_constants(h, args), spans, /*nonfinite=*/nullptr,
                       ctx_.device->native_stream(Stream::kCompute));
    return;
  }
#endif
  // A device that is neither CUDA nor host-addressable is a test's, with
  // host memory behind it and a compute stream that runs at once: CPU Adam
  // on that memory is its kernel (the same bits, as kernels_test shows for
  // CUDA's).
  STRATA_CHECK(!ctx_.device->is_cuda(), "a CUDA device in a build without the CUDA path");
  adam_->step(h, args, spans);
}

}  // namespace strata
