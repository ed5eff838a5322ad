#include "cli/train.h"

#include <ATen/Parallel.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "cli/monitors.h"
#include "cli/plan.h"
#include "engine/probes.h"
#include "engine/state_checkpoints.h"
#include "memory/bound.h"
#include "memory/placement.h"
#include "comm/communicator.h"
#include "config/config.h"
#include "data/dataset.h"
#include "engine/lr_schedule.h"
#include "engine/trainer.h"
#include "model/model.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"
#include "util/progress.h"
#include "util/trace.h"

namespace strata {

namespace {

struct TrainOptions {
  std::string config_path;
  std::vector<std::string> overrides;
  int64_t steps = 0;        // 0 = from config
  std::string metrics;      // empty = from config
  std::string trace;        // Chrome trace file; empty = no trace
  bool resume = false;      // --resume [DIR]
  std::string resume_dir;   // empty = run.checkpoint.dir
  bool reprobe = false;     // measure the bound's rates again (Note [Kept rates] in engine/probes.h)
};

// The metrics file is opened only once start-up has succeeded, so that a run
// that fails at start-up leaves nothing behind.
class MetricsWriter {
 public:
  // `append`: a resumed run adds to the file of the run it continues.
  MetricsWriter(const std::string& path, bool append) : path_(path) {
    if (path.empty()) return;
    make_dirs(parent_dir(path));
    out_.open(path, std::ios::out | (append ? std::ios::app : std::ios::trunc));
    if (!out_) throw InputError(path, std::string("cannot open metrics file for writing: ") +
                                          std::strerror(errno));
  }
  void write(const nlohmann::json& j) {
    if (!out_.is_open()) return;
    out_ << j.dump() << '\n';
    out_.flush();
    if (!out_) throw IoError(path_, errno, "cannot write metrics");
  }

 private:
  std::string path_;
  std::ofstream out_;
};

// A stop requested by SIGINT/SIGTERM: the first one lets every rank finish
// the step it is in (the request is combined over the ranks at the step
// boundary); a second one exits at once.
std::atomic<int> g_stop_signals{0};

void on_stop_signal(int sig) {
  if (g_stop_signals.fetch_add(1) >= 1) {
    ::signal(sig, SIG_DFL);
    ::raise(sig);
  }
}

// "{rank}" in a path becomes the rank.
std::string with_rank(std::string path, int rank) {
  const size_t at = path.find("{rank}");
  if (at != std::string::npos) path.replace(at, 6, std::to_string(rank));
  return path;
}

// A per-rank output path: with "{rank}" every rank writes its own file;
// without, only rank 0 writes (the others get "").
std::string rank_path(const std::string& path, int rank) {
  if (path.find("{rank}") != std::string::npos) return with_rank(path, rank);
  return rank == 0 ? path : "";
}

// Every rank publishes its effective config (less the per-rank keys); each
// compares with rank 0's, and all agree on whether to stop, so that a
// mismatch ends every rank with the same one line.
void check_configs_agree(const Config& cfg, Communicator& comm) {
  if (comm.world_size() == 1) return;
  const nlohmann::json mine = rank_invariant_config(cfg);
  if (comm.rank() == 0) comm.store_set("config/0", mine.dump());
  std::string diff;
  if (comm.rank() != 0) diff = first_difference(nlohmann::json::parse(comm.store_get("config/0")), mine);
  comm.store_set("configdiff/" + std::to_string(comm.rank()), diff);
  int64_t mismatch = diff.empty() ? 0 : 1;
  comm.all_reduce(&mismatch, 1, DType::kI64, ReduceOp::kSum).wait();
  if (mismatch == 0) return;
  for (int r = 1; r < comm.world_size(); ++r) {
    const std::string d = comm.store_get("configdiff/" + std::to_string(r));
    if (!d.empty()) {
      throw ConfigError(d, strprintf("rank %d's config differs from rank 0's (only metrics, log and trace "
                                     "paths, nvme_path and run.threads may differ between ranks)", r));
    }
  }
}

// Runs `fn` on every rank and agrees on its outcome: when it failed on some
// rank, that rank rethrows its error and the others stop naming it, so that
// no rank goes on to a collective the failed one never reaches.
template <typename Fn>
void on_every_rank(Communicator& comm, const char* what, Fn&& fn) {
  std::exception_ptr mine;
  try {
    fn();
  } catch (const Error&) {
    mine = std::current_exception();
  }
  const int64_t failed = failed_rank(comm, mine != nullptr);
  if (mine) std::rethrow_exception(mine);
  if (failed >= 0) throw Error(strprintf("rank %lld failed %s; see its message", (long long)failed, what));
}

// The value at a dotted key of `j`, as JSON text.
std::string value_at(const nlohmann::json& j, const std::string& dotted) {
  std::string ptr = "/" + dotted;
  std::replace(ptr.begin(), ptr.end(), '.', '/');
  const nlohmann::json::json_pointer p(ptr);
  return j.contains(p) ? j[p].dump() : "nothing";
}

// The resumed run's checkpoint: opened and checked against this run before
// anything is allocated.
std::unique_ptr<CheckpointReader> open_resume(const TrainOptions& opt, const Config& cfg,
                                              const nvme::EngineOptions& engine) {
  const std::string dir = opt.resume_dir.empty() ? cfg.run.checkpoint.dir : opt.resume_dir;
  if (dir.empty()) {
    throw ConfigError("run.checkpoint.dir", "--resume without a directory needs run.checkpoint.dir");
  }
  auto reader = std::make_unique<CheckpointReader>(resolve_checkpoint(dir), engine);
  const nlohmann::json mine = resume_invariants(cfg);
  const nlohmann::json& saved = reader->manifest().invariants;
  const std::string key = first_difference(saved, mine);
  if (!key.empty()) {
    throw ConfigError(key, "the checkpoint " + reader->dir() + " was saved with " + value_at(saved, key) +
                               ", this run has " + value_at(mine, key) +
                               " (a resume may change the world size, ZeRO stage, placement, paths and step "
                               "count, nothing else)");
  }
  return reader;
}

// run.checkpoint.dir is created (private, as checkpoints are) and written to
// at start: a directory the run could not save into is refused now, not at
// the first save after hours of training.
// Its free space is checked too, against the most checkpoints the run will
// hold at once: up to run.checkpoint.keep complete ones while the next is
// written, of the `saves` it makes (every `run.checkpoint.every` steps and
// at the end), less those already there (they take their space already),
// of `bytes` each, beside `swap` bytes of swap files the run is about to
// create on the same file system.
void check_checkpoint_dir(const std::string& dir, int64_t bytes, int64_t keep, int64_t saves, int64_t swap) {
  try {
    make_dirs(dir, 0700);
  } catch (const IoError& e) {
    throw ConfigError("run.checkpoint.dir", std::string("cannot be created: ") + e.what());
  }
  std::string probe = dir + "/.strata-write-probe-XXXXXX";
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) {
    throw ConfigError("run.checkpoint.dir", "'" + dir + "' is not writable: " + std::strerror(errno));
  }
  ::unlink(probe.c_str());  // at once: nothing of the probe outlives this line
  ::close(fd);
  int64_t present = 0;
  for (const std::string& n : list_dir(dir)) {
    const bool tmp = n.size() > 4 && n.compare(n.size() - 4, 4, ".tmp") == 0;
    if (n.rfind("step-", 0) == 0 && !tmp) ++present;
  }
  present = std::min(present, keep);
  const int64_t at_once = std::max<int64_t>(1, std::min(keep, present + saves - 1) + 1 - present);
  const int64_t free = free_bytes_under(dir);
  if (free < 0) return;
  if (free < at_once * bytes + swap) {
    throw ConfigError("run.checkpoint.dir",
                      strprintf("'%s' has %s free; the run needs %s for %lld more checkpoint(s) of about %s "
                                "(run.checkpoint.keep %lld kept while the next is written, %lld there already)%s: "
                                "free space there, lower run.checkpoint.keep, or choose another directory",
                                dir.c_str(), format_bytes(double(free)).c_str(),
                                format_bytes(double(at_once * bytes)).c_str(), (long long)at_once,
                                format_bytes(double(bytes)).c_str(), (long long)keep, (long long)present,
                                swap > 0 ? strprintf(" beside %s of swap files on the same file system",
                                                     format_bytes(double(swap)).c_str())
                                               .c_str()
                                         : ""));
  }
}

// About the bytes one checkpoint's files take (`local` of `world` ranks'
// share; all of them for a directory every rank sees): master weights and moments of every parameter,
// each chunk of kCheckpointChunkElems padded to 4 KiB, and a MiB per rank
// of manifest and parts.
int64_t checkpoint_bytes(const Config& cfg, int local, int world) {
  const StateLayout layout(model_layout_specs(cfg.model), shard_count(cfg));
  const int64_t moment = cfg.run.optimizer_state_dtype == "bf16" ? 2 : 4;
  int64_t total = 0;
  for (size_t b = 0; b < layout.num_blocks(); ++b) {
    const int64_t n = layout.block(b).numel;
    const int64_t chunks = (n + kCheckpointChunkElems - 1) / kCheckpointChunkElems * layout.world_size();
    total += n * (4 + 2 * moment) + chunks * 3 * 4096;
  }
  total += int64_t(world) << 20;
  return total / std::max(1, world) * std::max(1, local);
}

// What each step's bound_s is computed from: the plan's work (its link and
// network counts replaced by each step's own) and the rates.
struct TrainBound {
  StepWork work;
  Rates rates;
  bool cpu_compute = true;
};

// The network's rate from all-reduces of 16 MiB (every rank takes part).
double measure_network(Communicator& comm, double budget_s) {
  const int64_t count = int64_t(4) << 20;
  std::vector<float> buf(size_t(count), 1.0f);
  comm.all_reduce(buf.data(), count, DType::kF32, ReduceOp::kSum).wait();  // warm-up
  std::vector<double> t;
  const auto start = std::chrono::steady_clock::now();
  do {
    const auto t0 = std::chrono::steady_clock::now();
    comm.all_reduce(buf.data(), count, DType::kF32, ReduceOp::kSum).wait();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    // The same number of rounds on every rank: rank 0's clock decides.
    int64_t more = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < budget_s ||
                   t.size() < 3;
    comm.broadcast(&more, 1, DType::kI64, 0).wait();
    if (!more) break;
  } while (true);
  std::sort(t.begin(), t.end());
  return double(ring_all_reduce_bytes(comm.world_size(), count, DType::kF32)) / t[t.size() / 2];
}

// The rates of the step's bound, before the plan (placement auto compares
// its candidates by them): run.rates, else measured here on `device`, each
// rank's replaced by rank 0's so that every rank chooses the same placement.
// Written into cfg.run.rates, which the plan and the trainer then read.
void measure_train_rates(Config& cfg, Device& device, Communicator& comm, int rank, int local_ranks) {
  Rates rates = rates_from_config(cfg.run.rates);
  StateLayout layout(model_layout_specs(cfg.model), shard_count(cfg));
  MachineCapacity cap;
  const PlacementPlan plan = plan_for_machine(cfg, layout, &cap, rank, local_ranks, &device);
  // Nothing is probed before the fit verdict (check_plan_fits, next): a
  // disk too small for the state is too small for the probe's files too.
  // Every rank returns or none: the probes below include collectives.
  int64_t short_somewhere = plan_shortfalls(plan, cap).empty() ? 0 : 1;
  if (comm.world_size() > 1) comm.all_reduce(&short_somewhere, 1, DType::kI64, ReduceOp::kMax).wait();
  if (short_somewhere != 0) return;
  const StepWork work = predicted_work(cfg, plan, train_fetches(plan), step_network_bytes(plan));
  if (work.net_bytes > 0 && !(rates.net > 0)) {
    rates.net = measure_network(comm, 0.2);
    rates.net_source = "measured: all-reduce of 16 MiB";
  }
  // Also where only another candidate of auto's keeps the secondary shard.
  const bool nodes = comm.world_size() > local_ranks && local_ranks > 1;
  if ((work.intra_node_bytes > 0 || nodes) && !(rates.intra_node > 0) && rates.net > 0) {
    // No probe of the node's group of its own: the world's rate, a lower
    // figure where the node has a faster fabric (run.rates.intra_node_gbps).
    rates.intra_node = rates.net;
    rates.intra_node_source = "the network's (no intra-node probe; run.rates.intra_node_gbps gives it)";
  }
  measure_rates(cfg, plan, &device, work, rates, 0.2, ProbeRoom{true, local_ranks, /*keep=*/rank == 0});
  store_rates(rates, cfg.run.rates);
  if (comm.world_size() > 1) {
    double* r = &cfg.run.rates.device_tflops;  // RateOverrides: doubles only
    constexpr size_t kRates = 12;
    static_assert(sizeof(RateOverrides) == kRates * sizeof(double), "RateOverrides holds doubles only");
    std::vector<int64_t> bits(kRates);
    std::memcpy(bits.data(), r, sizeof(RateOverrides));
    comm.broadcast(bits.data(), int64_t(kRates), DType::kI64, 0).wait();
    std::memcpy(r, bits.data(), sizeof(RateOverrides));
  }
}

// What each step's bound_s is computed from: the trainer's plan's work (its
// link and network counts replaced by each step's own) and the rates.
TrainBound train_bound(const Config& cfg, const Trainer& trainer) {
  TrainBound b;
  const PlacementPlan& plan = trainer.plan();
  b.cpu_compute = !trainer.device().is_cuda();
  b.work = predicted_work(cfg, plan, train_fetches(plan), step_network_bytes(plan));
  b.rates = rates_from_config(cfg.run.rates);
  const StepBound bound = step_bound(b.work, b.rates, b.cpu_compute);
  std::string rows;
  for (const ResourceTime& t : bound.resources) rows += strprintf("; %s %.3f s", t.resource.c_str(), t.seconds);
  log::info("bound: %.3f s per step, by %s (docs/design.md, \"The step's bound\")%s", bound.seconds,
            bound.binding.c_str(), rows.c_str());
  if (!plan.auto_choice.empty()) log::info("auto placement: %s", plan.auto_choice.c_str());
  return b;
}

// The GPU of this rank (DESIGN: one rank per GPU): cuda:LOCAL_RANK among the
// visible ones. More local ranks than visible GPUs is refused with NCCL
// (which refuses two ranks on one GPU) and shared round-robin with Gloo.
std::string gpu_of_rank(const RankInfo& who, const std::string& backend) {
  const int visible = cuda_device_count();
  if (who.local_world_size <= visible) return "cuda:" + std::to_string(who.local_rank);
  if (backend == "nccl" || visible == 0) {
    throw ConfigError("run.device", strprintf("%d ranks on this node but %d visible GPU(s): NCCL takes one GPU "
                                              "per rank (start %d ranks per node, or set comm.backend \"gloo\" "
                                              "to share GPUs)",
                                              who.local_world_size, visible, std::max(visible, 1)));
  }
  const int gpu = who.local_rank % visible;
  log::info("%d ranks share %d GPU(s) over Gloo: rank %d takes cuda:%d", who.local_world_size, visible, who.rank,
            gpu);
  return "cuda:" + std::to_string(gpu);
}

int run_train(const TrainOptions& opt) {
  const RankInfo who = rank_info_from_environment();
  std::vector<std::string> overrides = opt.overrides;
  if (opt.steps > 0) overrides.push_back("run.steps=" + std::to_string(opt.steps));
  if (!opt.metrics.empty()) overrides.push_back("run.metrics=" + nlohmann::json(opt.metrics).dump());
  Config cfg = load_config(opt.config_path, overrides, who.world_size);
  const bool multi = who.world_size > 1;
  cfg.run.metrics = rank_path(cfg.run.metrics, who.rank);
  if (!cfg.run.log_file.empty()) cfg.run.log_file = with_rank(cfg.run.log_file, who.rank);
  setup_logging(cfg.run.log_level, cfg.run.log_file, multi ? who.rank : -1);
  // Before any CUDA work (the rate probes included): docs/config.md, run.deterministic.
  const std::string determinism = apply_determinism(cfg.run.deterministic);
  if (!determinism.empty()) log::info("run.deterministic: %s", determinism.c_str());
  const std::string trace_path = rank_path(opt.trace, who.rank);
  for (const std::string& key : cfg.ignored_keys) {
    // wandb and comet need a network service: say what writes the same figures here.
    const bool service = key == "wandb" || key == "comet";
    log::warn("config key '%s' is a DeepSpeed key Strata does not act on; ignored%s", key.c_str(),
              service ? " (no network service here: \"tensorboard\" or \"csv_monitor\" write the same scalars to "
                        "files, run.metrics every step's figures as JSON lines; docs/monitors.md)"
                      : "");
  }
  if (cfg.run.threads > 0) at::set_num_threads(int(cfg.run.threads));

  // The ranks meet first: a rank whose config differs, or a world size that
  // does not divide the batch (load_config), stops every rank at start.
  CommOptions co;
  co.backend = cfg.comm.backend == "auto" ? (cfg.run.device == DeviceKind::kCuda ? "nccl" : "gloo") : cfg.comm.backend;
  co.timeout_s = cfg.comm.timeout_s;
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) co.socket_ifname = ifname;
  std::unique_ptr<Communicator> comm = make_communicator(who, co);
  if (multi) {
    log::info("rank %d of %d (local %d of %d) via %s, %s for device data and gloo for host values, store %s:%d",
              who.rank, who.world_size, who.local_rank, who.local_world_size, who.source.c_str(),
              cfg.run.device == DeviceKind::kCpu ? "gloo" : co.backend.c_str(), who.master_addr.c_str(),
              who.master_port);
  }
  check_configs_agree(cfg, *comm);
  if (cfg.zero.hpz_partition_size > 1 && cfg.zero.hpz_partition_size != who.local_world_size &&
      cfg.zero.stage == 3 && cfg.comm.secondary_shard != "off" && who.world_size > who.local_world_size) {
    throw ConfigError("zero_optimization.zero_hpz_partition_size",
                      strprintf("%lld, but this node has %d rank(s): Strata's secondary shard spans the ranks of a "
                                "node (docs/config.md, comm.secondary_shard)",
                                (long long)cfg.zero.hpz_partition_size, who.local_world_size));
  }

  // The device the step computes on, and the rates of the step's bound
  // (auto placement chooses by them): a second or so.
  std::unique_ptr<Device> own_device;
  Device* device = &cpu_device();
  if (cfg.run.device != DeviceKind::kCpu) {
    std::string name = device_kind_name(cfg.run.device);
    if (multi && cfg.run.device == DeviceKind::kCuda) {
      on_every_rank(*comm, "to take its GPU", [&] { name = gpu_of_rank(who, co.backend); });
    }
    own_device = make_device(name);
    device = own_device.get();
  }
  set_rates_cache("", opt.reprobe);
  measure_train_rates(cfg, *device, *comm, who.rank, who.local_world_size);

  // Everything that can fail on bad input happens before the first byte of
  // output is written. First: does the placement fit this machine?
  const PlacementPlan fitted = check_plan_fits(cfg, who.rank, who.local_world_size, device);
  if (!cfg.run.checkpoint.dir.empty()) {
    // A directory every rank can see: every rank's files, whatever node checks.
    const int64_t bytes = checkpoint_bytes(cfg, who.world_size, who.world_size);
    const int64_t every = cfg.run.checkpoint.every;
    const int64_t saves = every > 0 ? (cfg.run.steps + every - 1) / every : 1;  // at most: a resume makes fewer
    // The node's swap files, created next, on the same file system come first.
    int64_t swap = 0;
    if (!fitted.nvme_paths.empty() && device_of(fitted.nvme_paths.front()) == device_of(cfg.run.checkpoint.dir)) {
      swap = fitted.total()[size_t(Tier::kNvme)] * who.local_world_size;
    }
    on_every_rank(*comm, "to write run.checkpoint.dir", [&] {
      check_checkpoint_dir(cfg.run.checkpoint.dir, bytes, cfg.run.checkpoint.keep, saves, swap);
    });
  }
  TokenDataset data(cfg.data.paths, parse_token_format(cfg.data.format), cfg.model.vocab_size,
                    cfg.model.seq_len, cfg.data.val_fraction);
  Model model(cfg.model);
  // Events of about 400 steps of a small model; later ones are dropped (and
  // said so). Declared before the trainer, whose optimizer thread records
  // into it until the trainer is gone, also when a step throws.
  std::unique_ptr<Tracer> tracer;
  struct Uninstall {
    ~Uninstall() { Tracer::install(nullptr); }
  } uninstall;
  if (!trace_path.empty()) {
    tracer = std::make_unique<Tracer>(size_t(1) << 18);
    if (multi) tracer->set_rank(who.rank);
    Tracer::install(tracer.get());
  }
  // Checkpoint files are long sequential streams: at least 4 MiB requests,
  // 32 in flight, whatever the aio section asks of the swap.
  nvme::EngineOptions ckpt_engine;
  ckpt_engine.block_size_bytes = std::max<int64_t>(cfg.aio.block_size, int64_t(4) << 20);
  ckpt_engine.queue_depth = int(std::max<int64_t>(cfg.aio.queue_depth, 32));
  ckpt_engine.rings = int(cfg.aio.intra_op_parallelism);
  std::unique_ptr<CheckpointReader> resume;
  if (opt.resume) on_every_rank(*comm, "to open the checkpoint", [&] { resume = open_resume(opt, cfg, ckpt_engine); });

  Trainer trainer(cfg, model, nullptr, comm.get(), who.local_world_size, device);
  std::mt19937_64 rng(cfg.run.seed);
  int64_t first_step = 1;
  if (resume) {
    const Manifest& m = resume->manifest();
    on_every_rank(*comm, "to load the checkpoint", [&] {
      const std::string mpath = resume->dir() + "/manifest.json";
      if (m.data.value("tokens", int64_t(-1)) != data.num_tokens()) {
        throw ConfigError("data.path", strprintf("the checkpoint %s was trained on data of %lld tokens, this "
                                                 "run's data has %lld", resume->dir().c_str(),
                                                 (long long)m.data.value("tokens", int64_t(-1)),
                                                 (long long)data.num_tokens()));
      }
      std::istringstream state(m.data.value("rng", std::string()));
      state >> rng;
      if (state.fail()) throw InputError(mpath, "manifest data.rng: not a generator state");
      const auto t0 = std::chrono::steady_clock::now();
      trainer.load_checkpoint(*resume);
      log::info("resumed from %s (step %lld, saved by %lld rank(s)) in %.3f s", resume->dir().c_str(),
                (long long)m.step, (long long)m.saved_world_size,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    });
    first_step = m.step + 1;
    resume.reset();
  }
  Monitors monitors(cfg, who.rank == 0);  // DeepSpeed's tensorboard / csv_monitor (docs/monitors.md)
  MetricsWriter metrics(cfg.run.metrics, opt.resume);
  for (const std::string& d : monitors.dirs()) log::info("monitor %s", d.c_str());

  const StateBytes sb = trainer.state_bytes();
  const std::array<int64_t, kNumTiers> peak = trainer.peak_bytes();
  log::info("model: %lld layers, dim %lld, %lld heads (%lld kv), ffn %lld, seq %lld, vocab %lld: "
            "%.3fM parameters",
            (long long)cfg.model.n_layers, (long long)cfg.model.dim, (long long)cfg.model.n_heads,
            (long long)cfg.model.kv_heads(), (long long)cfg.model.ffn_dim(),
            (long long)cfg.model.seq_len, (long long)cfg.model.vocab_size,
            double(trainer.layout().parameter_count()) / 1e6);
  log::info("memory: parameters %s (fp32 master) + %s working copy (%s), gradients %s, "
            "optimizer state %s, total %s",
            format_bytes(double(sb.master)).c_str(), format_bytes(double(sb.param16)).c_str(),
            compute_dtype_name(cfg.run.compute_dtype),
            format_bytes(double(sb.grad)).c_str(), format_bytes(double(sb.optimizer)).c_str(),
            format_bytes(double(sb.total())).c_str());
  log::info("placement (%s): device %s, host %s, nvme %s (state + staging)",
            trainer.plan().source.c_str(), format_bytes(double(peak[0])).c_str(),
            format_bytes(double(peak[1])).c_str(), format_bytes(double(peak[2])).c_str());
  {
    const PlacementPlan& p = trainer.plan();
    const int64_t slots = speculated_slot_numel(p);
    log::info("schedule: %s; optimizer behind the backward: %s%s", schedule_name(p.schedule),
              p.speculate_choice.c_str(),
              slots > 0 ? strprintf(", %s elements in alternate swap slots (%s more disk)",
                                    strprintf("%.4g M", double(slots) / 1e6).c_str(),
                                    format_bytes(double(p.nvme_spare_bytes)).c_str())
                              .c_str()
                        : "");
  }
  log::info("data: %lld tokens (%lld train, %lld held out); batch %lld = %lld micro x %lld "
            "accumulation x %d ranks; ZeRO stage %lld; compute %s; %d threads",
            (long long)data.num_tokens(), (long long)data.train_tokens(),
            (long long)data.val_tokens(), (long long)cfg.train_batch_size,
            (long long)cfg.train_micro_batch_size_per_gpu,
            (long long)cfg.gradient_accumulation_steps, who.world_size, (long long)cfg.zero.stage,
            compute_dtype_name(cfg.run.compute_dtype), at::get_num_threads());

  // The step's bound (docs/design.md, "The step's bound"): each step's own
  // byte counts over rates given in run.rates or measured here now, in a
  // second or so (every rank measures its own; the network by all-reduces).
  const TrainBound bound = train_bound(cfg, trainer);

  const int64_t micro = cfg.train_micro_batch_size_per_gpu;
  const int64_t accum = cfg.gradient_accumulation_steps;
  const int64_t window = cfg.model.seq_len + 1;
  // Batch buffers sized once; sampling fills them in place every step. The
  // global batch of a step is the same windows whatever the world size: every
  // rank draws all of it from the same generator and trains on its slice.
  std::vector<int64_t> batch(size_t(cfg.train_batch_size * window));
  const int64_t* my_batch = batch.data() + size_t(who.rank) * size_t(accum * micro * window);
  const int64_t eval_batches = cfg.data.eval_batches;
  std::vector<int64_t> eval_batch(size_t(eval_batches * micro * window));
  const bool can_eval = data.val_tokens() > cfg.model.seq_len && cfg.data.eval_interval > 0;

  // Checkpoints (Note [Checkpoint protocol]).
  CheckpointOptions ckpt;
  ckpt.dir = cfg.run.checkpoint.dir;
  ckpt.keep = cfg.run.checkpoint.keep;
  ckpt.engine = ckpt_engine;
  // The manifest's header for a save after step s (lr: the step's).
  auto header = [&](int64_t s, double lr) {
    Manifest h;
    std::ostringstream state;
    state << rng;
    // The trainer adds step, optimizer_step and loss_scale.
    // After an fp16-skipped step r.lr is the next applied step's: record the
    // rate of the last step applied.
    const int64_t applied = trainer.optimizer_steps();
    if (applied != s) lr = applied > 0 ? learning_rate(cfg.scheduler, cfg.optimizer.lr, applied) : 0.0;
    h.trainer = {{"scheduler", {{"type", cfg.scheduler.type}, {"step", applied}, {"lr", lr}}}};
    h.data = {{"rng", state.str()}, {"sequences", s * cfg.train_batch_size}, {"tokens", data.num_tokens()}};
    h.config = rank_invariant_config(cfg);
    h.invariants = resume_invariants(cfg);
    return h;
  };
  // A finished save into the step's metrics line and the log.
  auto report = [&](const Trainer::FinishedSave& f, nlohmann::json& line, bool in_background) {
    if (line.contains("checkpoint_step")) {  // two finished at this step: the earlier one kept aside
      line["checkpoint_earlier"] = {{"checkpoint_step", line["checkpoint_step"]},
                                    {"checkpoint_s", line["checkpoint_s"]},
                                    {"checkpoint_write_s", line["checkpoint_write_s"]},
                                    {"checkpoint_bytes", line["checkpoint_bytes"]},
                                    {"checkpoint_snapshot_bytes", line["checkpoint_snapshot_bytes"]}};
    }
    line["checkpoint_step"] = f.step;
    line["checkpoint_s"] = f.seconds;
    line["checkpoint_write_s"] = f.write_seconds;
    line["checkpoint_bytes"] = f.bytes;
    line["checkpoint_snapshot_bytes"] = f.snapshot_bytes;
    log::info("checkpoint: step %lld saved to %s in %.3f s%s (%s from this rank, written at %s/s%s)",
              (long long)f.step, f.dir.c_str(), f.seconds, in_background ? " while training" : "",
              format_bytes(double(f.bytes)).c_str(),
              format_bytes(double(f.bytes) / std::max(f.write_seconds, 1e-9)).c_str(),
              f.snapshot_bytes > 0
                  ? (", " + format_bytes(double(f.snapshot_bytes)) + " of it from snapshots").c_str()
                  : "");
  };
  // Periodic saves ride on training (Note [Saving while training]); the last
  // one, and one on a stop signal, are waited for.
  auto begin_save = [&](int64_t s, double lr) {
    log::info("checkpoint: saving step %lld to %s while training", (long long)s, ckpt.dir.c_str());
    trainer.begin_checkpoint(ckpt, header(s, lr));
  };
  auto save_now = [&](int64_t s, double lr, nlohmann::json& line) {
    log::info("checkpoint: saving step %lld to %s", (long long)s, ckpt.dir.c_str());
    trainer.finish();  // the step's optimizer (overlapped) is not the save's time
    trainer.begin_checkpoint(ckpt, header(s, lr));
    const Trainer::FinishedSave f = *trainer.poll_checkpoint(true);
    report(f, line, false);
  };

  if (first_step > cfg.run.steps) {
    log::warn("the checkpoint is at step %lld, run.steps is %lld: nothing to train (--steps is the total)",
              (long long)(first_step - 1), (long long)cfg.run.steps);
    comm->barrier();
    return kExitOk;
  }
  // Progress from rank 0 only.
  std::unique_ptr<ProgressBar> bar;
  if (who.rank == 0) bar = std::make_unique<ProgressBar>("train", cfg.run.steps, cfg.steps_per_print);
  ::signal(SIGINT, on_stop_signal);
  ::signal(SIGTERM, on_stop_signal);
  const auto start = std::chrono::steady_clock::now();
  double first_loss = NAN, last_loss = NAN;
  int64_t steps_done = 0;
  for (int64_t s = first_step; s <= cfg.run.steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    data.sample_train(rng, cfg.train_batch_size, batch.data());
    StepResult r = trainer.step(my_batch, g_stop_signals.load() > 0);
    steps_done = s;
    const double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!std::isfinite(r.loss) && !r.skipped) {
      throw Error("loss is " + std::to_string(r.loss) + " at step " + std::to_string(s) +
                  "; lower optimizer.params.lr or enable gradient_clipping");
    }
    if (s == first_step) first_loss = r.loss;
    last_loss = r.loss;
    const double tokens_per_s = double(r.tokens) / step_s;
    StepWork done = bound.work;
    done.links = r.links;
    if (done.checksum_bytes > 0) done.checksum_bytes = r.links.nvme_read + r.links.nvme_write;
    done.net_bytes = r.net_bytes;
    done.intra_node_bytes = r.intra_node_bytes;
    const double bound_s = step_bound(done, bound.rates, bound.cpu_compute).seconds;
    nlohmann::json line = {
        {"step", s},
        {"loss", r.loss},
        {"lr", r.lr},
        {"grad_norm", r.grad_norm},
        {"tokens", r.tokens},
        {"tokens_per_s", tokens_per_s},
        {"flops_per_s", tokens_per_s * model.flops_per_token()},
        {"step_s", step_s},
        {"bound_s", bound_s},
        {"elapsed_s", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()},
        {"h2d_bytes", r.links.h2d},
        {"d2h_bytes", r.links.d2h},
        {"nvme_read_bytes", r.links.nvme_read},
        {"nvme_write_bytes", r.links.nvme_write},
        {"wait_s", r.wait_s},
        {"optimizer_s", r.optimizer_s},
        {"optimizer_wait_s", r.optimizer_wait_s},
        {"checkpoint_wait_s", r.checkpoint_wait_s},
        {"peak_device_bytes", peak[0]},
        {"peak_host_bytes", peak[1]},
        {"peak_nvme_bytes", peak[2]},
        {"world_size", who.world_size},
        {"net_bytes", r.net_bytes},
        {"intra_node_bytes", r.intra_node_bytes},
        {"comm_wait_s", r.comm_wait_s},
    };
    if (!r.speculation.empty()) {
      // Note [Speculative optimizer] in engine/optimizer_pass.h.
      line["speculation"] = r.speculation;
      line["optimizer_hidden_s"] = r.optimizer_hidden_s;
      line["redone_elements"] = r.redone_elements;
    }
    if (trainer.loss_scaler()) {
      line["loss_scale"] = r.loss_scale;
      line["skipped"] = r.skipped;
      if (r.skipped) {
        log::warn("step %lld: fp16 gradients overflowed at loss scale %g: step skipped, scale now %g", (long long)s,
                  r.loss_scale, trainer.loss_scaler()->scale());
      }
    }
    if (can_eval && (s % cfg.data.eval_interval == 0 || s == cfg.run.steps)) {
      // The same held-out windows at every eval, so eval losses compare.
      std::mt19937_64 eval_rng(cfg.run.seed ^ 0x5eedULL);
      data.sample_val(eval_rng, eval_batches * micro, eval_batch.data());
      line["eval_loss"] = trainer.eval_loss(eval_batch.data(), eval_batches);
      log::info("step %lld: eval loss %.4f", (long long)s, line["eval_loss"].get<double>());
    }
    if (r.stop) {
      log::warn("stop requested (SIGINT/SIGTERM on some rank): every rank stops after step %lld%s", (long long)s,
                ckpt.dir.empty() ? "" : " and saves a checkpoint");
    }
    // A save in flight is published at the first step boundary where every
    // rank has written its part (one all-reduce per step while it is).
    if (trainer.checkpoint_in_flight()) {
      if (auto f = trainer.poll_checkpoint(false)) report(*f, line, true);
    }
    const bool due = cfg.run.checkpoint.every > 0 && s % cfg.run.checkpoint.every == 0;
    const bool last = r.stop || s == cfg.run.steps;
    if (!ckpt.dir.empty() && (due || last)) {
      if (auto f = trainer.poll_checkpoint(true)) report(*f, line, true);  // one at a time
      if (last) {
        save_now(s, r.lr, line);
      } else {
        begin_save(s, r.lr);
        line["checkpoint_begun"] = s;
      }
    }
    metrics.write(line);
    if (monitors.any()) {
      std::map<std::string, double> figures;
      for (const auto& [k, v] : line.items()) {
        if (v.is_number()) figures[k] = v.get<double>();
      }
      monitors.step(s, cfg.train_batch_size, figures);
    }
    char suffix[128];
    std::snprintf(suffix, sizeof(suffix), "loss %.4f | %.0f tok/s | %.0f%% of bound | lr %.2e", r.loss, tokens_per_s,
                  100.0 * bound_s / step_s, r.lr);
    if (bar) bar->update(s, suffix);
    if (r.stop) break;
  }
  if (trainer.checkpoint_in_flight()) trainer.poll_checkpoint(true);
  trainer.finish();  // the last optimizer step (run.overlap_optimizer)
  comm->barrier();   // no rank leaves while another may still need it
  if (bar) bar->finish();
  if (tracer) {
    Tracer::install(nullptr);
    tracer->write(trace_path);
    log::info("trace: %zu events written to %s%s (open in https://ui.perfetto.dev)", tracer->size(),
              trace_path.c_str(), tracer->dropped() ? strprintf(", %lld dropped", (long long)tracer->dropped()).c_str() : "");
  }
  const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log::info("done: %lld steps in %.1fs; loss %.4f -> %.4f", (long long)steps_done, total_s,
            first_loss, last_loss);
  return kExitOk;
}

}  // namespace

void register_train(CLI::App& app, int& result) {
  auto opt = std::make_shared<TrainOptions>();
  CLI::App* cmd = app.add_subcommand("train", "Train the model a config describes");
  cmd->add_option("config", opt->config_path, "JSON config file")->required();
  cmd->add_option("--set", opt->overrides, "Override a config key: --set optimizer.params.lr=3e-4")
      ->type_name("KEY=VALUE");
  cmd->add_option("--steps", opt->steps, "Number of optimizer steps (overrides run.steps)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--metrics", opt->metrics, "JSON-lines metrics file (overrides run.metrics)");
  CLI::Option* resume =
      cmd->add_option("--resume", opt->resume_dir,
                      "Resume from the latest checkpoint in DIR (default: run.checkpoint.dir), or from DIR when it "
                      "is a checkpoint itself; --steps is then the total")
          ->expected(0, 1)
          ->type_name("[DIR]");
  cmd->add_option("--trace", opt->trace,
                  "Write a Chrome trace (compute, copies, NVMe I/O, CPU Adam tracks) to FILE at the end");
  cmd->add_flag("--reprobe", opt->reprobe,
                "Measure the step bound's rates again instead of taking those an earlier run on this machine kept");
  cmd->callback([opt, resume, &result]() {
    opt->resume = resume->count() > 0;
    result = run_train(*opt);
  });
}

}  // namespace strata
