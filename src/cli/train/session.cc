#include "cli/train/session.h"

#include <ATen/Parallel.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "cli/plan.h"
#include "engine/probes.h"
#include "engine/state_checkpoints.h"
#include "memory/placement.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"

namespace strata {

namespace {

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
  const StateLayout layout(model_layout_specs(cfg.model), shard_count(cfg), frozen_shard_count(cfg));
  const int64_t moment = cfg.run.optimizer_state_dtype == MomentDtype::kBf16 ? 2 : 4;
  int64_t total = 0;
  for (size_t b = 0; b < layout.num_blocks(); ++b) {
    const int64_t n = layout.block(b).numel;
    const int64_t chunks = (n + kCheckpointChunkElems - 1) / kCheckpointChunkElems * layout.world_size();
    total += n * (4 + 2 * moment) + chunks * 3 * 4096;
  }
  total += int64_t(world) << 20;
  return total / std::max(1, world) * std::max(1, local);
}


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
  StateLayout layout(model_layout_specs(cfg.model), shard_count(cfg), frozen_shard_count(cfg));
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
    std::array<double, kNumRates>& r = cfg.run.rates.given;  // the rates table's rows
    std::vector<int64_t> bits(kNumRates);
    std::memcpy(bits.data(), r.data(), sizeof(r));
    comm.broadcast(bits.data(), int64_t(kNumRates), DType::kI64, 0).wait();
    std::memcpy(r.data(), bits.data(), sizeof(r));
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
  if (!plan.state.auto_choice.empty()) log::info("auto placement: %s", plan.state.auto_choice.c_str());
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

// The start-up report: the model, its memory, the placement, the schedule and
// the data, one line each.
void report_start(const TrainSession& s) {
  const Config& cfg = s.cfg;
  const Trainer& trainer = *s.trainer;
  const StateBytes sb = trainer.state_bytes();
  const std::array<int64_t, kNumTiers>& peak = s.peak;
  log::info("model: %lld layers, dim %lld, %lld heads (%lld kv), ffn %lld, seq %lld, vocab %lld: "
            "%.3fM parameters",
            (long long)cfg.model.n_layers, (long long)cfg.model.dim, (long long)cfg.model.n_heads,
            (long long)cfg.model.kv_heads(), (long long)cfg.model.ffn_dim(),
            (long long)cfg.model.seq_len, (long long)cfg.model.vocab_size,
            double(trainer.layout().parameter_count()) / 1e6);
  if (cfg.model.is_moe()) {
    const MoeConfig& e = cfg.model.moe;
    log::info("experts: %lld a layer of width %lld, top %lld%s%s; load-balancing loss %s", (long long)e.num_experts,
              (long long)cfg.model.expert_dim(), (long long)e.num_experts_per_tok,
              e.norm_topk_prob ? " renormalised" : "",
              cfg.model.shared_expert() ? strprintf(", a shared expert of %lld", (long long)e.shared_expert_intermediate_size).c_str() : "",
              e.output_router_logits ? strprintf("in the loss x %g", e.router_aux_loss_coef).c_str()
                                     : "reported, not trained (model.output_router_logits false)");
  }
  if (trainer.layout().has_frozen()) {  // Note [State kinds] in memory/layout.h
    const PlacementPlan& p = trainer.plan();
    const auto& fb = p.state.bytes[size_t(Category::kFrozen)];
    log::info("LoRA: %.3fM adapter parameters (r %lld) trained over a frozen base of %.3fM parameters: "
              "%s of values only (%s), on device %s, host %s, nvme %s",
              double(trainer.layout().parameter_count()) / 1e6, (long long)cfg.model.lora.r,
              double(trainer.layout().frozen_parameter_count()) / 1e6,
              format_bytes(double(fb[0] + fb[1] + fb[2])).c_str(), compute_dtype_name(cfg.run.compute_dtype),
              format_bytes(double(fb[0])).c_str(), format_bytes(double(fb[1])).c_str(),
              format_bytes(double(fb[2])).c_str());
  }
  log::info("memory: parameters %s (fp32 master) + %s working copy (%s), gradients %s, "
            "optimizer state %s, total %s",
            format_bytes(double(sb.master)).c_str(), format_bytes(double(sb.param16)).c_str(),
            trainer.layout().has_frozen() ? "fp32" : compute_dtype_name(cfg.run.compute_dtype),
            format_bytes(double(sb.grad)).c_str(), format_bytes(double(sb.optimizer)).c_str(),
            format_bytes(double(sb.total())).c_str());
  log::info("placement (%s): device %s, host %s, nvme %s (state + staging)",
            trainer.plan().state.source.c_str(), format_bytes(double(peak[0])).c_str(),
            format_bytes(double(peak[1])).c_str(), format_bytes(double(peak[2])).c_str());
  {
    const PlacementPlan& p = trainer.plan();
    const int64_t slots = speculated_slot_numel(p);
    log::info("schedule: %s; optimizer behind the backward: %s%s", schedule_name(p.step.schedule),
              p.optimizer.speculate_choice.c_str(),
              slots > 0 ? strprintf(", %s elements in alternate swap slots (%s more disk)",
                                    strprintf("%.4g M", double(slots) / 1e6).c_str(),
                                    format_bytes(double(p.optimizer.nvme_spare_bytes)).c_str())
                              .c_str()
                        : "");
  }
  const TokenDataset& data = *s.data;
  if (cfg.data.sampling != DataSampling::kWindows) {  // docs/token-format.md, "Examples and loss masks"
    log::info("data: %lld examples (%lld train, %lld held out) drawn %s in epochs, loss over counted tokens%s",
              (long long)data.num_examples(), (long long)data.train_examples(), (long long)data.val_examples(),
              data_sampling_name(cfg.data.sampling), cfg.data.truncate ? ", longer ones cut" : "");
  } else if (data.masked()) {
    log::info("data: loss masks: the loss is over the counted tokens");
  }
  log::info("data: %lld tokens (%lld train, %lld held out); batch %lld = %lld micro x %lld "
            "accumulation x %d ranks; ZeRO stage %lld; compute %s; %d threads",
            (long long)data.num_tokens(), (long long)data.train_tokens(),
            (long long)data.val_tokens(), (long long)cfg.train_batch_size,
            (long long)cfg.train_micro_batch_size_per_gpu,
            (long long)cfg.gradient_accumulation_steps, s.who.world_size, (long long)cfg.zero.stage,
            compute_dtype_name(cfg.run.compute_dtype), at::get_num_threads());
}

// The config with the command line's overrides, logging, determinism (before
// any CUDA work, the rate probes included: docs/config.md, run.deterministic)
// and threads.
void load_run_config(const TrainOptions& opt, TrainSession& s) {
  const RankInfo& who = s.who;
  std::vector<std::string> overrides = opt.overrides;
  if (opt.steps > 0) overrides.push_back("run.steps=" + std::to_string(opt.steps));
  if (!opt.metrics.empty()) overrides.push_back("run.metrics=" + nlohmann::json(opt.metrics).dump());
  s.cfg = load_config(opt.config_path, overrides, who.world_size);
  Config& cfg = s.cfg;
  cfg.run.metrics = rank_path(cfg.run.metrics, who.rank);
  if (!cfg.run.log_file.empty()) cfg.run.log_file = with_rank(cfg.run.log_file, who.rank);
  setup_logging(cfg.run.log_level, cfg.run.log_file, who.world_size > 1 ? who.rank : -1);
  const std::string determinism = apply_determinism(cfg.run.deterministic);
  if (!determinism.empty()) log::info("run.deterministic: %s", determinism.c_str());
  s.trace_path = rank_path(opt.trace, who.rank);
  for (const std::string& key : cfg.ignored_keys) {
    // wandb and comet need a network service: say what writes the same figures here.
    const bool service = key == "wandb" || key == "comet";
    log::warn("config key '%s' is a DeepSpeed key Strata does not act on; ignored%s", key.c_str(),
              service ? " (no network service here: \"tensorboard\" or \"csv_monitor\" write the same scalars to "
                        "files, run.metrics every step's figures as JSON lines; docs/monitors.md)"
                      : "");
  }
  if (cfg.run.threads > 0) at::set_num_threads(int(cfg.run.threads));
}

// The ranks meet first: a rank whose config differs, or a world size that
// does not divide the batch (load_config), stops every rank at start.
// Returns the backend of the device group.
std::string meet_ranks(TrainSession& s) {
  const Config& cfg = s.cfg;
  const RankInfo& who = s.who;
  CommOptions co;
  co.backend = comm_backend_name(comm_backend(cfg));
  co.timeout_s = cfg.comm.timeout_s;
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) co.socket_ifname = ifname;
  s.comm = make_communicator(who, co);
  if (who.world_size > 1) {
    log::info("rank %d of %d (local %d of %d) via %s, %s for device data and gloo for host values, store %s:%d",
              who.rank, who.world_size, who.local_rank, who.local_world_size, who.source.c_str(),
              cfg.run.device == DeviceKind::kCpu ? "gloo" : co.backend.c_str(), who.master_addr.c_str(),
              who.master_port);
  }
  check_configs_agree(cfg, *s.comm);
  if (cfg.zero.hpz_partition_size > 1 && cfg.zero.hpz_partition_size != who.local_world_size &&
      cfg.zero.stage == 3 && cfg.comm.secondary_shard != SecondaryShard::kOff && who.world_size > who.local_world_size) {
    throw ConfigError("zero_optimization.zero_hpz_partition_size",
                      strprintf("%lld, but this node has %d rank(s): Strata's secondary shard spans the ranks of a "
                                "node (docs/config.md, comm.secondary_shard)",
                                (long long)cfg.zero.hpz_partition_size, who.local_world_size));
  }
  return co.backend;
}

// The device the step computes on, and the rates of the step's bound (auto
// placement chooses by them): a second or so.
void open_device(const TrainOptions& opt, TrainSession& s, const std::string& backend) {
  Config& cfg = s.cfg;  // the measured rates go into run.rates
  s.device = &cpu_device();
  if (cfg.run.device != DeviceKind::kCpu) {
    std::string name = device_kind_name(cfg.run.device);
    if (s.who.world_size > 1 && cfg.run.device == DeviceKind::kCuda) {
      on_every_rank(*s.comm, "to take its GPU", [&] { name = gpu_of_rank(s.who, backend); });
    }
    s.own_device = make_device(name);
    s.device = s.own_device.get();
  }
  set_rates_cache("", opt.reprobe);
  measure_train_rates(cfg, *s.device, *s.comm, s.who.rank, s.who.local_world_size);
}

// Everything that can fail on bad input happens before the first byte of
// output is written: the plan's fit on this machine, the checkpoint
// directory and the data, on every rank.
void check_inputs(TrainSession& s) {
  const Config& cfg = s.cfg;
  const RankInfo& who = s.who;
  const PlacementPlan fitted = check_plan_fits(cfg, who.rank, who.local_world_size, s.device);
  if (!cfg.run.checkpoint.dir.empty()) {
    // A directory every rank can see: every rank's files, whatever node checks.
    const int64_t bytes = checkpoint_bytes(cfg, who.world_size, who.world_size);
    const int64_t every = cfg.run.checkpoint.every;
    const int64_t saves = every > 0 ? (cfg.run.steps + every - 1) / every : 1;  // at most: a resume makes fewer
    // The node's swap files, created next, on the same file system come first.
    int64_t swap = 0;
    if (!fitted.state.nvme_paths.empty() && device_of(fitted.state.nvme_paths.front()) == device_of(cfg.run.checkpoint.dir)) {
      swap = fitted.total()[size_t(Tier::kNvme)] * who.local_world_size;
    }
    on_every_rank(*s.comm, "to write run.checkpoint.dir", [&] {
      check_checkpoint_dir(cfg.run.checkpoint.dir, bytes, cfg.run.checkpoint.keep, saves, swap);
    });
  }
  // Every rank reads the data files: one that cannot (a file missing on its node) stops them all here, not
  // in the next collective.
  on_every_rank(*s.comm, "to read data.path", [&] {
    s.data = std::make_unique<TokenDataset>(cfg.data, cfg.model.vocab_size, cfg.model.seq_len);
  });
}

// The trainer's state, the data order and the first step from the
// checkpoint `resume` (every rank).
void resume_from(TrainSession& s, std::unique_ptr<CheckpointReader> resume) {
  const Manifest& m = resume->manifest();
  on_every_rank(*s.comm, "to load the checkpoint", [&] {
    const std::string mpath = resume->dir() + "/manifest.json";
    if (m.data.value("tokens", int64_t(-1)) != s.data->num_tokens()) {
      throw ConfigError("data.path", strprintf("the checkpoint %s was trained on data of %lld tokens, this "
                                               "run's data has %lld", resume->dir().c_str(),
                                               (long long)m.data.value("tokens", int64_t(-1)),
                                               (long long)s.data->num_tokens()));
    }
    std::istringstream state(m.data.value("rng", std::string()));
    state >> s.rng;
    if (state.fail()) throw InputError(mpath, "manifest data.rng: not a generator state");
    if (s.cfg.data.sampling != DataSampling::kWindows) {  // Note [Example epochs]: mid-epoch
      const int64_t epoch = m.data.value("epoch", int64_t(-1)), next = m.data.value("example", int64_t(-1));
      if (epoch < 0 || next < 0 || next > s.data->train_examples()) {
        throw InputError(mpath, "manifest data.epoch / data.example: not a place among this data's " +
                                    std::to_string(s.data->train_examples()) + " training examples");
      }
      s.examples.epoch = epoch;
      s.examples.next = next;
    }
    const auto t0 = std::chrono::steady_clock::now();
    s.trainer->load_checkpoint(*resume);
    log::info("resumed from %s (step %lld, saved by %lld rank(s)) in %.3f s", resume->dir().c_str(),
              (long long)m.step, (long long)m.saved_world_size,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  });
  s.first_step = m.step + 1;
}

}  // namespace

std::unique_ptr<TrainSession> open_session(const TrainOptions& opt) {
  auto session = std::make_unique<TrainSession>();
  TrainSession& s = *session;
  s.who = rank_info_from_environment();
  load_run_config(opt, s);
  const std::string backend = meet_ranks(s);
  open_device(opt, s, backend);
  check_inputs(s);
  const Config& cfg = s.cfg;
  s.model = std::make_unique<Model>(cfg.model);
  // Events of about 400 steps of a small model; later ones are dropped (and
  // said so). Made before the trainer, whose optimizer thread records into it
  // until the trainer is gone (TracerUninstall).
  if (!s.trace_path.empty()) {
    s.tracer = std::make_unique<Tracer>(size_t(1) << 18);
    if (s.who.world_size > 1) s.tracer->set_rank(s.who.rank);
    Tracer::install(s.tracer.get());
  }
  // Checkpoint files are long sequential streams: at least 4 MiB requests,
  // 32 in flight, whatever the aio section asks of the swap.
  s.ckpt_engine.block_size_bytes = std::max<int64_t>(cfg.aio.block_size, int64_t(4) << 20);
  s.ckpt_engine.queue_depth = int(std::max<int64_t>(cfg.aio.queue_depth, 32));
  s.ckpt_engine.rings = int(cfg.aio.intra_op_parallelism);
  std::unique_ptr<CheckpointReader> resume;
  if (opt.resume) {
    on_every_rank(*s.comm, "to open the checkpoint", [&] { resume = open_resume(opt, cfg, s.ckpt_engine); });
  }
  s.trainer = std::make_unique<Trainer>(cfg, *s.model, nullptr, s.comm.get(), s.who.local_world_size, s.device);
  s.rng = std::mt19937_64(cfg.run.seed);
  if (resume) resume_from(s, std::move(resume));
  s.monitors = std::make_unique<Monitors>(cfg, s.who.rank == 0);  // DeepSpeed's tensorboard / csv_monitor (docs/monitors.md)
  s.metrics = std::make_unique<MetricsWriter>(cfg.run.metrics, opt.resume, s.first_step - 1);
  for (const std::string& d : s.monitors->dirs()) log::info("monitor %s", d.c_str());

  s.peak = s.trainer->peak_bytes();
  report_start(s);

  // The step's bound (docs/design.md, "The step's bound"): each step's own
  // byte counts over rates given in run.rates or measured here now, in a
  // second or so (every rank measures its own; the network by all-reduces).
  s.bound = train_bound(cfg, *s.trainer);
  return session;
}

}  // namespace strata
