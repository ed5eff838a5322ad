// The training state's checkpoints (state_checkpoints.h).
#include "engine/state_checkpoints.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "util/errors.h"
#include "util/logging.h"
#include "util/trace.h"

namespace strata {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// A save in flight: its ranges in shard-space order (as the optimizer walks
// it), and the gate the optimizer's later passes wait at.
class StateCheckpoints::InFlight final : public SaveGate {
 public:
  std::unique_ptr<CheckpointSave> save;
  std::vector<ShardRange> ranges;
  std::vector<int64_t> offsets;    // their shard offsets
  std::vector<int64_t> ends;       // and ends (non-decreasing: every category is cut alike)
  int64_t applied_step = 0;        // the optimizer step saved
  std::chrono::steady_clock::time_point t0;
  std::shared_ptr<Resources> res;
  // The save's thread (joined here) uses `ranges` and `res` through the callbacks: it ends first.
  ~InFlight() override { save.reset(); }

  int64_t applied() const override { return applied_step; }
  double make_writable(int64_t begin, int64_t end) override {
    const size_t lo = size_t(std::upper_bound(ends.begin(), ends.end(), begin) - ends.begin());
    const size_t hi = size_t(std::lower_bound(offsets.begin(), offsets.end(), end) - offsets.begin());
    return lo < hi ? save->make_writable(lo, hi) : 0.0;
  }
};

StateCheckpoints::StateCheckpoints(const StepContext& ctx, OptimizerPass& optimizer)
    : ctx_(ctx), optimizer_(optimizer), res_(std::make_shared<Resources>()) {
  static_assert(kSaveBounceBytes >= RankFileWriter::kWriterSlotBytes, "a save fills one writer slot at a time");
  const int64_t bytes = ctx.state->plan().staging.save_bounce;
  if (bytes > 0) res_->bounce = ctx.device->allocate_pinned(bytes, "checkpoint save: device state bounce");
  // Note [Save snapshots] (checkpoint/checkpoint.h): registered with the
  // device, so that device-tier ranges come D2H straight into it.
  const int64_t pool = ctx.state->plan().staging.save_snapshot;
  if (pool > 0) res_->snapshot_pool = ctx.device->allocate_pinned(pool, "checkpoint save: snapshot pool");
}

StateCheckpoints::~StateCheckpoints() {
  optimizer_.set_save(nullptr);
  save_.reset();  // an unfinished save's thread: it may wait for the optimizer
}

std::vector<ShardRange> StateCheckpoints::ranges(bool save) const {
  std::vector<ShardRange> out;
  const StateLayout& layout = *ctx_.layout;
  const int64_t world = ctx_.comm->world_size(), rank = ctx_.comm->rank();
  int64_t j = 0;  // chunk counter: with replicated state, chunk j is saved by rank j % world
  for (Category c : kSavedCategories) {
    for (size_t b = 0; b < layout.num_blocks(); ++b) {
      const BlockLayout& bl = layout.block(b);
      const int64_t sn = bl.shard_numel();
      const int64_t first = ctx_.shard_rank * sn;  // the held range's first element within the block
      const int64_t real = std::clamp<int64_t>(bl.numel - first, 0, sn);
      for (int64_t a = 0; a < real; a += kCheckpointChunkElems, ++j) {
        if (save && ctx_.shards == 1 && j % world != rank) continue;
        ShardRange r;
        r.category = c;
        r.numel = std::min(kCheckpointChunkElems, real - a);
        r.shard_offset = ctx_.shard_offset[b] + a;
        r.shard_numel = std::min(sn - a, (r.numel + kShardAlignElems - 1) / kShardAlignElems * kShardAlignElems);
        r.start = ctx_.global_index[b] + first + a;
        out.push_back(r);
      }
    }
  }
  return out;
}

std::vector<TensorEntry> StateCheckpoints::tensor_entries() const {
  std::vector<TensorEntry> out;
  const StateLayout& layout = *ctx_.layout;
  for (size_t b = 0; b < layout.num_blocks(); ++b) {
    for (const ParamLayout& p : layout.block(b).params) {
      out.push_back({layout.block(b).name + "." + p.spec.name, p.spec.shape, ctx_.global_index[b] + p.offset});
    }
  }
  return out;
}

void StateCheckpoints::fill_header(Manifest& header, const TrainerCounters& counters, const LossScaler* scaler) const {
  header.step = counters.step;
  header.trainer["step"] = counters.step;
  header.trainer["optimizer_step"] = counters.optimizer_step;
  header.trainer["loss_scale"] = scaler ? scaler->to_json() : nlohmann::json();
  header.parameters = ctx_.layout->parameter_count();
  header.tensors = tensor_entries();
  for (Category c : kSavedCategories) header.elem_bytes[c] = ctx_.state->elem_bytes(c);
}

// The callbacks run on the save's thread and on the passes that overtake
// it, which may outlive the StateCheckpoints (Resources): they hold the save,
// the context and the optimizer (the trainer's, which outlive both).
RangeSource StateCheckpoints::range_source(const StepContext* ctx, OptimizerPass* opt, InFlight* raw) {
  RangeSource source;
  source.resident = [ctx, raw](size_t i) -> const std::byte* {
    const ShardRange& r = raw->ranges[i];
    return ctx->state->resident(r.category, r.shard_offset, r.shard_numel);
  };
  source.fill = [ctx, opt, raw](size_t i, int64_t at, int64_t numel, std::byte* buf) {
    const ShardRange& r = raw->ranges[i];
    const int64_t offset = r.shard_offset + at;
    const int64_t bytes = numel * ctx->state->elem_bytes(r.category);
    Resources& res = *raw->res;
    // Device-tier parts after the saved step's update of them, not after
    // the compute queued since (the next steps' forward and backward).
    opt->order_after_updates(Stream::kSaveD2H, offset, numel);
    const Completion none;
    if (res.bounce.data() != nullptr && bytes <= res.bounce.bytes() &&
        ctx->state->resident_on_device(r.category, offset, numel)) {
      ctx->state->read_async(r.category, offset, numel, res.bounce.data(), res.save_io, &none, Stream::kSaveD2H).wait();
      std::memcpy(buf, res.bounce.data(), size_t(bytes));
    } else {
      ctx->state->read_async(r.category, offset, numel, buf, res.save_io, &none, Stream::kSaveD2H).wait();
    }
  };
  // Note [Save snapshots]: a range the next optimizer pass is about to
  // overwrite, read now by that pass's thread (or, for device-resident
  // state, the compute thread that launches its update) into the pool. The
  // state there is still the saved step's: whatever overwrites it comes
  // through make_writable() first.
  if (raw->res->snapshot_pool.bytes() > 0) {
    source.snapshot_ok = [ctx, raw](size_t i) {  // in memory: host or device, not NVMe
      const ShardRange& r = raw->ranges[i];
      const std::optional<Tier> t = range_tier(ctx->state->plan(), r.category, r.shard_offset, r.shard_numel);
      return t.has_value() && *t != Tier::kNvme;
    };
    source.snapshot = [ctx, opt, raw](size_t i, std::byte* dst) {
      const ShardRange& r = raw->ranges[i];
      // The save's traffic, as its own thread's reads: not the step's links
      // (which the step's bound is computed from).
      TieredState::TallyScope not_the_steps(nullptr);
      opt->order_after_updates(Stream::kSaveD2H, r.shard_offset, r.shard_numel);
      const Completion none;
      ctx->state->read_async(r.category, r.shard_offset, r.shard_numel, dst, raw->res->snapshot_io, &none,
                             Stream::kSaveD2H)
          .wait();
    };
  }
  return source;
}

void StateCheckpoints::begin(const CheckpointOptions& options, Manifest header, const TrainerCounters& counters,
                             const LossScaler* scaler) {
  STRATA_CHECK(!save_, "a checkpoint save is already in flight");
  auto f = std::make_shared<InFlight>();
  f->t0 = std::chrono::steady_clock::now();
  fill_header(header, counters, scaler);
  // In the order the optimizer walks the shard space (all categories of a
  // piece together): it waits for a prefix of them.
  f->ranges = ranges(true);
  std::stable_sort(f->ranges.begin(), f->ranges.end(),
                   [](const ShardRange& a, const ShardRange& b) { return a.shard_offset < b.shard_offset; });
  for (const ShardRange& r : f->ranges) {
    f->offsets.push_back(r.shard_offset);
    f->ends.push_back(r.shard_offset + r.shard_numel);
    STRATA_CHECK(f->ends.size() < 2 || f->ends.back() >= f->ends[f->ends.size() - 2],
                 "checkpoint ranges of categories cut differently");
  }
  f->applied_step = counters.optimizer_step;
  f->res = res_;
  InFlight* raw = f.get();
  OptimizerPass* opt = &optimizer_;
  RangeSource source = range_source(&ctx_, opt, raw);
  // The step being saved may still be updating (run.overlap_optimizer):
  // each range waits until the update is final there.
  std::function<bool(size_t)> ready;
  if (optimizer_.threaded()) {
    ready = [opt, raw](size_t i) {
      const ShardRange& r = raw->ranges[i];
      return opt->wait_for_job(raw->applied_step, r.shard_offset + r.shard_numel);
    };
  }
  TraceSpan span(TraceTrack::kNvme, "checkpoint begin");
  f->save = std::make_unique<CheckpointSave>(options, *ctx_.comm, std::move(header), f->ranges, std::move(source),
                                             std::move(ready),
                                             SnapshotPool{res_->snapshot_pool.data(), res_->snapshot_pool.bytes()});
  save_ = f;
  optimizer_.set_save(std::move(f));
}

std::optional<FinishedSave> StateCheckpoints::poll(bool wait) {
  if (!save_) return std::nullopt;
  if (!wait && !save_->save->done_everywhere()) return std::nullopt;
  std::shared_ptr<InFlight> f = save_;
  // Dropped only once finish() has joined the save's thread: an optimizer
  // pass that starts (takes its reference) late must still find it while
  // anything remains to be written.
  auto drop = [&] {
    optimizer_.set_save(nullptr);  // a running optimizer pass keeps its own reference
    save_.reset();
  };
  TraceSpan span(TraceTrack::kNvme, "checkpoint finish");
  FinishedSave done;
  try {
    done.dir = f->save->finish();
  } catch (...) {
    drop();
    throw;
  }
  drop();
  done.step = f->save->step();
  done.seconds = seconds_since(f->t0);
  done.write_seconds = f->save->write_seconds();
  done.bytes = f->save->bytes();
  done.snapshot_bytes = f->save->snapshot_bytes();
  return done;
}

void StateCheckpoints::check_shape(const Manifest& m, const std::string& mpath) const {
  const std::vector<TensorEntry> mine = tensor_entries();
  auto shape_text = [](const std::vector<int64_t>& s) {
    std::string t = "[";
    for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
    return t + "]";
  };
  if (m.tensors.size() != mine.size() || m.parameters != ctx_.layout->parameter_count()) {
    throw InputError(mpath, strprintf("a checkpoint of another model shape: %zu tensors, %lld parameters there; "
                                      "%zu tensors, %lld parameters here",
                                      m.tensors.size(), (long long)m.parameters, mine.size(),
                                      (long long)ctx_.layout->parameter_count()));
  }
  for (size_t i = 0; i < mine.size(); ++i) {
    const TensorEntry& a = m.tensors[i];
    const TensorEntry& b = mine[i];
    if (a.name != b.name || a.shape != b.shape || a.start != b.start) {
      throw InputError(mpath, "a checkpoint of another model shape: tensor " + std::to_string(i) + " is " + a.name +
                                  " " + shape_text(a.shape) + " there, " + b.name + " " + shape_text(b.shape) + " here");
    }
  }
}

namespace {

// The trainer's counters a checkpoint records (trainer.optimizer_step: at
// most its step; absent in checkpoints older than it: the step).
TrainerCounters counters_of(const Manifest& m, const std::string& mpath) {
  TrainerCounters counters{m.step, m.step};
  if (m.trainer.contains("optimizer_step")) {
    const nlohmann::json& o = m.trainer["optimizer_step"];
    if (!o.is_number_integer() || o.get<int64_t>() < 0 || o.get<int64_t>() > m.step) {
      throw InputError(mpath, "manifest trainer.optimizer_step: must be an integer in [0, step]");
    }
    counters.optimizer_step = o.get<int64_t>();
  }
  return counters;
}

// A chunk read from a checkpoint (`data`: in its home when `resident`, else
// staged) placed: its padding zeroed, written through the state when not
// resident, and for master weights the working copy derived from it, in
// `working_home` where resident, else through `working`.
void place_chunk(TieredState& state, at::ScalarType compute_dtype, const ShardRange& r, std::byte* data,
                 bool resident, std::byte* working_home, HostBuffer& working) {
  const int eb = state.elem_bytes(r.category);
  std::memset(data + r.numel * eb, 0, size_t((r.shard_numel - r.numel) * eb));  // padding
  if (!resident) state.write(r.category, r.shard_offset, r.shard_numel, data);
  if (r.category != Category::kMaster) return;
  // The working copy is the master weights in its dtype (ctx.param_dtype), as the
  // optimizer emits it: converted straight into its home where resident.
  std::byte* dst = working_home != nullptr ? working_home : working.as<std::byte>();
  if (compute_dtype == at::kFloat) {
    std::memcpy(dst, data, size_t(r.shard_numel * 4));
  } else {
    at::from_blob(dst, {r.shard_numel}, at::TensorOptions().dtype(compute_dtype))
        .copy_(at::from_blob(data, {r.shard_numel}, at::TensorOptions().dtype(at::kFloat)));
  }
  if (working_home == nullptr) state.write(Category::kParam16, r.shard_offset, r.shard_numel, dst);
}

}  // namespace

TrainerCounters StateCheckpoints::load(CheckpointReader& reader, LossScaler* scaler) {
  TieredState& state = *ctx_.state;
  const Manifest& m = reader.manifest();
  const std::string mpath = reader.dir() + "/manifest.json";
  check_shape(m, mpath);
  for (Category c : kSavedCategories) {
    if (reader.elem_bytes(c) != state.elem_bytes(c)) {
      throw InputError(mpath, std::string("dtypes.") + category_name(c) +
                                  " differs from this run's (run.optimizer_state_dtype)");
    }
  }
  // The counters first: nothing is written before every check has passed.
  const TrainerCounters counters = counters_of(m, mpath);
  std::optional<LossScaler> loaded;
  if (scaler) {
    loaded = *scaler;
    const nlohmann::json ls = m.trainer.value("loss_scale", nlohmann::json());
    if (!ls.is_null()) loaded->load_json(ls, mpath);
  }
  TraceSpan span(TraceTrack::kNvme, "checkpoint load");
  const std::vector<ShardRange> rs = ranges(false);
  std::vector<CheckpointReader::Target> targets;
  targets.reserve(rs.size());
  std::vector<std::byte*> homes;
  std::vector<std::byte*> working_homes;  // the param16 home of each master range, where resident
  int64_t largest_staged = 0;
  int64_t largest_working = 0;
  for (const ShardRange& r : rs) {
    // Resident ranges are read into their homes in place; the others through `buf`.
    std::byte* home = state.resident(r.category, r.shard_offset, r.shard_numel);
    homes.push_back(home);
    if (home == nullptr) largest_staged = std::max(largest_staged, r.shard_numel);
    std::byte* p16 = nullptr;
    if (r.category == Category::kMaster) {
      p16 = state.resident(Category::kParam16, r.shard_offset, r.shard_numel);
      if (p16 == nullptr) largest_working = std::max(largest_working, r.shard_numel);
    }
    working_homes.push_back(p16);
  }
  // Start-up only, and only what some range needs: staging for one chunk
  // that is not resident, and for a working copy whose home is not.
  HostBuffer buf;
  if (largest_staged > 0) buf = HostBuffer(size_t(largest_staged * 4), "checkpoint load staging");
  HostBuffer working;
  if (largest_working > 0) {
    working = HostBuffer(size_t(largest_working * ctx_.param_bytes), "checkpoint load working copy");
  }
  for (size_t k = 0; k < rs.size(); ++k) {
    const ShardRange& r = rs[k];
    const int64_t own = homes[k] != nullptr ? r.shard_numel * state.elem_bytes(r.category) : 0;
    targets.push_back({r.category, r.start, r.numel, homes[k] != nullptr ? homes[k] : buf.as<std::byte>(), own});
  }
  // The reader reads ahead while each chunk is placed.
  reader.read_all(targets, [&](size_t k) {
    place_chunk(state, ctx_.param_dtype, rs[k], targets[k].out, homes[k] != nullptr, working_homes[k], working);
  });
  if (scaler) *scaler = *loaded;
  return counters;
}

}  // namespace strata
