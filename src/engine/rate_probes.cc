// Which rates a step needs and has not got (measure_missing_rates): the probes
// that measure them, run or taken from the kept rates (Note [Kept rates]).
// The probes themselves are in probes.cc.
#include <ATen/Parallel.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <fstream>
#include <functional>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cpu_adam/grad_ops.h"
#include "engine/optimizer/optimizer_pass.h"
#include "engine/probes.h"
#include "memory/placement.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"

namespace strata {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

namespace {

// ---- Note [Kept rates] ----

struct KeptRatesOptions {
  std::string path;  // "" until configured: the default
  bool reprobe = false;
};
KeptRatesOptions& kept_options() {
  static KeptRatesOptions o;
  return o;
}

std::string default_rates_cache() {
  if (const char* e = std::getenv("STRATA_RATES_CACHE"); e != nullptr && *e != '\0') return e;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0') return std::string(x) + "/strata/rates.json";
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') return std::string(h) + "/.cache/strata/rates.json";
  return "off";
}

// The CPU's model name and count: the first part of every key.
const std::string& cpu_identity() {
  static const std::string id = [] {
    std::ifstream f("/proc/cpuinfo");
    std::string line, name = "unknown cpu";
    while (std::getline(f, line)) {
      if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
        name = line.substr(line.find(':') + 2);
        break;
      }
    }
    return strprintf("%s x%u", name.c_str(), std::thread::hardware_concurrency());
  }();
  return id;
}

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

nlohmann::json read_kept(const std::string& path, bool warn) {
  if (path.empty() || !path_exists(path)) return nlohmann::json::object();
  try {
    nlohmann::json j = nlohmann::json::parse(file_contents(path));
    if (j.is_object()) return j;
  } catch (const std::exception&) {
  }
  if (warn) log::warn("%s: not a file of kept rates; measuring again and rewriting it (Note [Kept rates] in "
            "src/engine/probes.h)", path.c_str());
  return nlohmann::json::object();
}

// The rates kept in `j` (the file `path`) under `key` when fresh: their
// values and source.
bool lookup_kept(const nlohmann::json& j, const std::string& path, const std::string& key, size_t count,
                 std::vector<double>* values, std::string* source) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_object()) return false;
  try {
    const double at = it->at("at").get<double>();
    const auto v = it->at("v").get<std::vector<double>>();
    if (v.size() != count || !(unix_now() - at < kKeptRatesMaxAgeS) || at > unix_now() + 60) return false;
    for (double x : v) {
      if (!(x > 0) || !std::isfinite(x)) return false;
    }
    *values = v;
    char when[32];
    const std::time_t t = std::time_t(at);
    std::tm tm{};
    localtime_r(&t, &tm);
    std::strftime(when, sizeof when, "%Y-%m-%d %H:%M", &tm);
    *source = it->at("source").get<std::string>() + " (kept from " + when + ": " + path + ")";
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

void keep(const std::string& key, const std::vector<double>& values, const std::string& source) {
  const std::string path = rates_cache_path();
  if (path.empty()) return;
  try {
    nlohmann::json j = read_kept(path, /*warn=*/false);
    j[key] = {{"v", values}, {"source", source}, {"at", unix_now()}};
    make_dirs(parent_dir(path), 0700);
    write_file_atomic(path, j.dump(1) + "\n");
  } catch (const std::exception& e) {
    log::warn("cannot keep the measured rates in %s (%s): the next run measures them again", path.c_str(), e.what());
  }
}

// One rate probe: its key, what it reads, about how long it takes and how to
// run it; `run` fills `values` and `source`.
struct Probe {
  std::string key;
  std::string what;
  double about_s = 0;
  std::function<void(std::vector<double>*, std::string*)> run;
  size_t count = 1;
  std::vector<double> values;
  std::string source;
  std::function<void(const Probe&)> apply;  // its figures into the Rates
  bool keep = true;                         // false: measured in a way later runs must not take
};

}  // namespace

void set_rates_cache(const std::string& path, bool reprobe) {
  kept_options().path = path.empty() ? default_rates_cache() : path;
  kept_options().reprobe = reprobe;
}

std::string rates_cache_path() {
  if (kept_options().path.empty()) kept_options().path = default_rates_cache();
  return kept_options().path == "off" ? std::string() : kept_options().path;
}

namespace {

// The probes one call of measure_missing_rates needs, each added by the
// rate it measures, then run (or taken from the kept rates) by run().
// The probes' closures refer to this object: it outlives them.
class RateProbes {
 public:
  RateProbes(const Config& cfg, const PlacementPlan& plan, Device* device, Rates& rates, double budget_s,
             const ProbeRoom& room)
      : cfg_(cfg), plan_(plan), device_(device), rates_(rates), budget_s_(budget_s), room_(room),
        cpu_compute_(device == nullptr || !device->is_cuda()),
        state_(plan.state.shard_space_numel),  // Note [Probes sized to the work]
        llc_(last_level_cache_bytes()),
        // Ranks probing at once share the cores and the disk: their figures are not a lone run's.
        cpu_(cpu_identity() + strprintf("|sharers %d", room.sharers)),
        host_(device ? *device : cpu_device()) {}

  static bool need(double rate, bool has_work) { return has_work && !(rate > 0); }

  void compute();
  void adam();
  void checksum();
  void grad_add();
  void copies(bool h2d, bool d2h, bool both);
  void nvme(bool rd, bool wr, bool rw);
  // Kept rates first (Note [Kept rates]); one line on what is measured and for how long.
  void run();

 private:
  void add(std::string key, std::string what, double touched_bytes, size_t count,
           std::function<void(std::vector<double>*, std::string*)> run) {
    // A warm-up and at least 5 timed calls, at least budget_s; buffers filled once.
    constexpr double kMemBytesPerS = 4e9;  // for the time a line says a probe takes: about
    const double about = std::max(budget_s_, 6 * touched_bytes / kMemBytesPerS) + touched_bytes / kMemBytesPerS;
    probes_.push_back(Probe{std::move(key), std::move(what), about, std::move(run), count, {}, {}, {}, true});
  }

  const Config& cfg_;
  const PlacementPlan& plan_;
  Device* device_;
  Rates& rates_;
  const double budget_s_;
  const ProbeRoom& room_;
  const bool cpu_compute_;
  const int64_t state_;
  const int64_t llc_;
  const std::string cpu_;
  const Device& host_;
  std::vector<Probe> probes_;
};

void RateProbes::compute() {
  if (device_ == nullptr) {
    throw ConfigError("--device-tflops", "run.device is cuda and this machine has no GPU to measure: give the "
                                         "device's rate (run.rates.device_tflops)");
  }
  const ModelConfig& m = cfg_.model;
  // A LoRA layer is other work (no base weight gradients, the adapters): its own key.
  const std::string lora = m.lora.enabled ? strprintf("|lora r %lld params %lld", (long long)m.lora.r,
                                                      (long long)lora_layer_params(m))
                                          : std::string();
  // An MoE layer too: its expert GEMMs are smaller than a dense layer's.
  const std::string moe = m.is_moe() ? strprintf("|experts %lld top %lld of %lld shared %lld explicit grouped %d",
                                                 (long long)m.moe.num_experts,
                                                 (long long)m.moe.num_experts_per_tok, (long long)m.expert_dim(),
                                                 (long long)m.moe.shared_expert_intermediate_size,
                                                 int(m.moe.grouped_gemm))
                                     : std::string();
  add(strprintf("compute|%s|%s|%s|%s dim %lld heads %lld/%lld of %lld ffn %lld seq %lld window %lld micro %lld|"
                "threads %d|deterministic %d%s%s",
                cpu_.c_str(), device_->name().c_str(), compute_dtype_name(cfg_.run.compute_dtype),
                model_family_name(m.family), (long long)m.dim, (long long)m.n_heads, (long long)m.kv_heads(),
                (long long)m.head_dim(), (long long)m.ffn_dim(), (long long)m.seq_len, (long long)m.sliding_window,
                (long long)cfg_.train_micro_batch_size_per_gpu, at::get_num_threads(), int(cfg_.run.deterministic),
                lora.c_str(), moe.c_str()),
      "one layer's compute", 0, 1, [this](std::vector<double>* v, std::string* src) {
        v->assign(1, probe_compute(cfg_, *device_, budget_s_, src));
      });
  probes_.back().about_s = 2 * budget_s_;
  probes_.back().apply = [this](const Probe& p) {
    rates_.device_flops = p.values[0], rates_.device_flops_source = p.source;
  };
}

void RateProbes::adam() {
  const int64_t n = adam_probe_numel(budget_s_, llc_, state_);
  add(strprintf("adam|%s|threads %d|isa %s|state %s|emit %s|%lld", cpu_.c_str(), adam_threads(cfg_, host_),
                cfg_.run.cpu_adam_isa.c_str(), moment_dtype_name(cfg_.run.optimizer_state_dtype),
                cfg_.model.lora.enabled ? "fp32" : compute_dtype_name(cfg_.run.compute_dtype), (long long)n),
      strprintf("CPU Adam over %s elements", n >= (int64_t(1) << 20) ? strprintf("%lld Mi", (long long)(n >> 20)).c_str()
                                                                     : std::to_string(n).c_str()),
      double(n) * 28, 1, [this, n](std::vector<double>* v, std::string* src) {
        v->assign(1, probe_adam(cfg_, host_, budget_s_, state_));
        *src = strprintf("measured: CPU Adam over %lld Mi elements", (long long)(n >> 20));
      });
  probes_.back().apply = [this](const Probe& p) { rates_.adam = p.values[0], rates_.adam_source = p.source; };
}

void RateProbes::checksum() {
  const int64_t bytes = checksum_probe_bytes(budget_s_, llc_, state_);
  const int threads =
      adam_threads(cfg_, host_) > 0 ? adam_threads(cfg_, host_) : int(std::thread::hardware_concurrency());
  add(strprintf("crc32c|%s|threads %d|%lld", cpu_.c_str(), threads, (long long)bytes),
      strprintf("CRC-32C over %lld MiB", (long long)(bytes >> 20)), double(bytes), 1,
      [this, bytes, threads](std::vector<double>* v, std::string* src) {
        v->assign(1, probe_checksum(cfg_, host_, budget_s_, state_));
        *src = strprintf("measured: CRC-32C over %lld MiB on %d thread(s)", (long long)(bytes >> 20), threads);
      });
  probes_.back().apply = [this](const Probe& p) { rates_.checksum = p.values[0], rates_.checksum_source = p.source; };
}

void RateProbes::grad_add() {
  // What most blocks' landings do (plan/bound.cc, predicted_work): add
  // their wire into the fp32 home, or under the layer schedule with
  // several micro-batches write the block's fp32 sum as the home's first
  // write (Note [Gradient path] in engine/gradient_path.h).
  const bool summed = plan_.step.sums_each_block();
  const cpu_adam::GradType wire = plan_.param_bytes() == 4 || plan_.world_size > 1 || summed ? cpu_adam::GradType::kF32
                                  : cfg_.run.compute_dtype == ComputeDtype::kFp16 ? cpu_adam::GradType::kF16
                                                                                  : cpu_adam::GradType::kBF16;
  const int wire_bytes = wire == cpu_adam::GradType::kF32 ? 4 : 2;
  const int64_t n = grad_add_probe_numel(budget_s_, llc_, wire_bytes, state_);
  add(strprintf("grad_add|%s|%s|first %d|%lld", cpu_.c_str(), cpu_adam::grad_type_name(wire), int(summed), (long long)n),
      strprintf("gradient adds over %lld Mi elements", (long long)(n >> 20)), double(n) * (8 + wire_bytes), 1,
      [this, wire, summed, n](std::vector<double>* v, std::string* src) {
        v->assign(1, probe_grad_add(wire, summed, budget_s_, state_));
        *src = strprintf("measured: %s gradients %s fp32 on 1 thread, %lld Mi elements",
                         cpu_adam::grad_type_name(wire), summed ? "written as" : "added into", (long long)(n >> 20));
      });
  probes_.back().apply = [this](const Probe& p) { rates_.grad_add = p.values[0], rates_.grad_add_source = p.source; };
}

void RateProbes::copies(bool h2d, bool d2h, bool both) {
  if (device_ == nullptr) {
    throw ConfigError(h2d ? "--h2d-gbps" : d2h ? "--d2h-gbps" : "--pcie-both-gbps",
                      "run.device is cuda and this machine has no GPU to measure copies with");
  }
  add(strprintf("copies|%s|%s|%.2f", cpu_.c_str(), device_->name().c_str(), budget_s_), "host-device copies",
      double(int64_t(16) << 20) * 6, 3, [this](std::vector<double>* v, std::string* src) {
        const CopyRates c = probe_copies(*device_, budget_s_);
        *v = {c.h2d, c.d2h, c.both};
        *src = cpu_compute_ ? "measured: memcpy (CPU device)" : "measured: registered memory";
      });
  probes_.back().apply = [this, h2d, d2h, both](const Probe& p) {
    if (h2d) rates_.h2d = p.values[0], rates_.h2d_source = p.source;
    if (d2h) rates_.d2h = p.values[1], rates_.d2h_source = p.source;
    if (both) rates_.pcie_both = p.values[2], rates_.pcie_both_source = p.source;
  };
}

void RateProbes::nvme(bool rd, bool wr, bool rw) {
  STRATA_CHECK(!plan_.state.nvme_paths.empty(), "NVMe work without a swap directory");
  // A swap directory training has not created yet is measured in its
  // nearest existing parent (the same file system, as a rule).
  std::string dir = plan_.state.nvme_paths.front();
  while (!is_directory(dir) && dir != "/" && dir != "." && !dir.empty()) {
    dir = dir.find('/') == std::string::npos ? "." : parent_dir(dir);
  }
  // The swap store splits its capacity evenly over the directories.
  const int64_t share = plan_.total()[size_t(Tier::kNvme)] / int64_t(plan_.state.nvme_paths.size());
  const int64_t bytes = nvme_probe_bytes(budget_s_, state_);
  const size_t index = probes_.size();
  const AioConfig& aio = cfg_.aio;
  add(strprintf("nvme|%lld|block %lld qd %lld rings %lld single %d overlap %d|%lld|sharers %d", (long long)device_of(dir),
                (long long)aio.block_size, (long long)aio.queue_depth, (long long)aio.intra_op_parallelism,
                int(aio.single_submit), int(aio.overlap_events), (long long)bytes, room_.sharers),
      strprintf("the disk under %s over 2 x %s", dir.c_str(), format_bytes(double(bytes)).c_str()), 0, 3,
      [this, share, dir, index](std::vector<double>* v, std::string* src) {
        const IoRates io = probe_nvme(cfg_, dir, budget_s_, room_.reserve_state ? share * room_.sharers : 0,
                                      room_.sharers, state_);
        *src = "measured: I/O engine in " + dir;
        if (dir != plan_.state.nvme_paths.front()) *src += " (" + plan_.state.nvme_paths.front() + " does not exist yet)";
        if (io.in_state_room) *src += " (before the swap files exist, in the room they will take)";
        if (io.bytes < io.asked) {
          *src += strprintf(" over %s a pass, less than the %s asked: the disk's free space%s "
                            "(short passes may meet the drive's write cache: a high rate)",
                            format_bytes(double(io.bytes)).c_str(), format_bytes(double(io.asked)).c_str(),
                            io.in_state_room ? "" : " beside the plan's state");
        }
        *v = {io.read, io.write, io.both};
        // A pass cut short by the free space, or made in the state's room, is not what a later run with
        // its swap files in place would measure: used, not kept.
        if (io.bytes < io.asked || io.in_state_room) probes_[index].keep = false;
      });
  // Written, read, then both at once; the files laid out first (at about 1 GB/s).
  probes_.back().about_s = 5 * double(bytes) / 1e9;
  probes_.back().apply = [this, rd, wr, rw](const Probe& p) {
    if (rd) rates_.nvme_read = p.values[0], rates_.nvme_read_source = p.source;
    if (wr) rates_.nvme_write = p.values[1], rates_.nvme_write_source = p.source;
    if (rw) rates_.nvme_both = p.values[2], rates_.nvme_both_source = p.source;
  };
}

void RateProbes::run() {
  std::vector<Probe*> todo;
  const std::string path = rates_cache_path();
  const nlohmann::json kept = path.empty() || kept_options().reprobe || probes_.empty()
                                  ? nlohmann::json::object() : read_kept(path, /*warn=*/true);
  for (Probe& p : probes_) {
    if (!lookup_kept(kept, path, p.key, p.count, &p.values, &p.source)) todo.push_back(&p);
  }
  if (!todo.empty()) {
    std::string what;
    double about = 0;
    for (const Probe* p : todo) what += (what.empty() ? "" : ", ") + p->what, about += p->about_s;
    log::info("measuring this machine's rates for the step's bound: %s; about %.1f s%s", what.c_str(), about,
              path.empty() ? "" : strprintf(" (kept in %s for later runs; --reprobe measures again)", path.c_str()).c_str());
    // Each rate is taken and kept as soon as it is measured: a later probe that throws (auto's other
    // candidates are measured where they can be) leaves the earlier ones in place.
    for (Probe& p : probes_) {
      if (std::find(todo.begin(), todo.end(), &p) == todo.end()) p.apply(p);
    }
    const auto t0 = Clock::now();
    for (Probe* p : todo) {
      p->run(&p->values, &p->source);
      p->apply(*p);
      if (room_.keep && p->keep) keep(p->key, p->values, p->source);
    }
    log::info("rates measured in %.1f s", since(t0));
  } else if (!probes_.empty()) {
    for (Probe& p : probes_) p.apply(p);
    log::info("rates for the step's bound kept from an earlier run (%s; --reprobe measures again)", path.c_str());
  }
}

}  // namespace

void measure_missing_rates(const Config& cfg, const PlacementPlan& plan, Device* device, const StepWork& work,
                           Rates& rates, double budget_s, const ProbeRoom& room) {
  RateProbes probes(cfg, plan, device, rates, budget_s, room);
  const auto need = RateProbes::need;
  if (need(rates.device_flops, work.flops > 0)) probes.compute();
  if (need(rates.adam, work.adam_elems > 0)) probes.adam();
  if (need(rates.checksum, work.checksum_bytes > 0)) probes.checksum();
  if (need(rates.grad_add, work.grad_add_elems > 0)) probes.grad_add();
  const bool cpu_compute = device == nullptr || !device->is_cuda();
  const bool h2d = need(rates.h2d, work.links.h2d > 0), d2h = need(rates.d2h, work.links.d2h > 0);
  const bool both = !cpu_compute && need(rates.pcie_both, work.links.h2d > 0 && work.links.d2h > 0);
  if (h2d || d2h || both) probes.copies(h2d, d2h, both);
  const bool rd = need(rates.nvme_read, work.links.nvme_read > 0), wr = need(rates.nvme_write, work.links.nvme_write > 0);
  const bool rw = need(rates.nvme_both, work.links.nvme_read > 0 && work.links.nvme_write > 0);
  if (rd || wr || rw) probes.nvme(rd, wr, rw);
  if (need(rates.net, work.net_bytes > 0)) {
    throw ConfigError("--net-gbps", "ranks send bytes each step and no network rate was given (run.rates.net_gbps)");
  }
  if (need(rates.intra_node, work.intra_node_bytes > 0)) {
    throw ConfigError("--intra-node-gbps", "ranks send bytes within their node each step and no intra-node rate "
                                           "was given (run.rates.intra_node_gbps)");
  }
  probes.run();
}

}  // namespace strata
