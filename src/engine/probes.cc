#include "engine/probes.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <set>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <unistd.h>

#include "cpu_adam/adam.h"
#include "cpu_adam/grad_ops.h"
#include "engine/compute_stream.h"
#include "engine/optimizer_pass.h"
#include "memory/placement.h"
#include "model/model.h"
#include "nvme/bench.h"
#include "nvme/crc32c.h"
#include "util/errors.h"
#include "util/fs.h"
#include "util/logging.h"

namespace strata {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Runs `once` after one warm-up call until `budget_s` is spent (at least 5
// times); the fastest call's seconds. The bound is a lower bound, and on a
// shared machine a probe's slow calls are other work's interference, not the
// rate: with the median of 3 calls, the dev VM's bound at a train's start
// came out 1.4x above the steps it bounded (BENCHMARKS.md, "The step's bound").
template <typename F>
double fastest_seconds(double budget_s, F once) {
  once();
  double best = -1;
  int calls = 0;
  const auto start = Clock::now();
  while (calls < 5 || (since(start) < budget_s && calls < 1000)) {
    const auto t0 = Clock::now();
    once();
    const double s = since(t0);
    if (best < 0 || s < best) best = s;
    ++calls;
  }
  return best;
}

// Note [Probes sized to the work]: at most `touched` (> 0) rounded up to
// `unit`, at least one unit.
int64_t at_most_touched(int64_t size, int64_t touched, int64_t unit) {
  if (touched <= 0) return size;
  return std::min(size, std::max(unit, (touched + unit - 1) / unit * unit));
}

at::ScalarType compute_scalar_type(const Config& cfg) {
  switch (cfg.run.compute_dtype) {
    case ComputeDtype::kBf16: return at::kBFloat16;
    case ComputeDtype::kFp16: return at::kHalf;
    case ComputeDtype::kFp32: break;
  }
  return at::kFloat;
}

}  // namespace

// Note [Compute probe's shape]
// The CPU's rate depends on the shape of the products: on an AVX-512 dev VM
// one layer of dim 1024 ran at 137-143 GFLOP/s over 1 x 128 tokens and
// measurably faster over training's 4 x 128 (BENCHMARKS.md, "The step's
// bound"), so a probe narrowed to fewer tokens than a micro-batch read low
// and put the bound above the measured step (0.84-0.88). The probe keeps the
// micro-batch's tokens up to kProbeCallFlops a call (0.3 s at 150 GFLOP/s;
// the fastest of at least 5 calls is kept), and narrows only beyond that.
constexpr double kProbeCallFlops = 5e10;

double probe_compute(const Config& cfg, Device& device, double budget_s, std::string* what) {
  ModelConfig m = cfg.model;
  m.n_layers = 1;
  const bool cpu = !device.is_cuda();
  const at::ScalarType dt = compute_scalar_type(cfg);
  const int64_t elem = dt == at::kFloat ? 4 : 2;
  // A layer over 256 MiB of weights is narrowed on the CPU: width, head width
  // and the MLP by one factor (large products keep their rate), so the probe
  // stays small whatever the model (the plan of a model far too large for
  // the machine must still come out).
  const double layer_params =
      double(m.dim) * double(2 * m.q_dim() + 2 * m.kv_heads() * m.head_dim()) + 3.0 * double(m.dim) * double(m.ffn_dim());
  std::string shape_note;
  if (cpu && layer_params * double(elem) > double(int64_t(256) << 20)) {
    const double k = std::sqrt(layer_params * double(elem) / double(int64_t(256) << 20));
    const int64_t dim = std::max<int64_t>(64, int64_t(double(m.dim) / k) / 64 * 64);
    const int64_t hd = std::max<int64_t>(2, std::min(m.head_dim(), dim) / 2 * 2);
    const int64_t group = m.n_heads / m.kv_heads();
    const int64_t heads = std::max<int64_t>(group, dim / hd / group * group);
    m.ffn_hidden = std::max<int64_t>(64, int64_t(double(m.ffn_dim()) / k));
    m.dim = dim;
    m.explicit_head_dim = hd;
    m.n_heads = heads;
    m.n_kv_heads = heads / group;
    shape_note = strprintf(", narrowed to dim %lld, %lld heads of %lld, ffn %lld", (long long)m.dim,
                           (long long)m.n_heads, (long long)hd, (long long)m.ffn_hidden);
  }
  int64_t batch = cfg.train_micro_batch_size_per_gpu, seq = m.seq_len;
  // On the CPU, at most kProbeCallFlops a call: fewer windows, then shorter ones.
  if (cpu) {
    const double per_token = step_flops(m, 1, false) - 6.0 * double(m.vocab_size * m.dim);
    const int64_t tokens = std::max<int64_t>(64, int64_t(kProbeCallFlops / std::max(per_token, 1.0)));
    if (batch * seq > tokens) {
      batch = std::max<int64_t>(1, tokens / seq);
      if (batch * seq > tokens) seq = std::max<int64_t>(64, std::min(seq, tokens));
    }
  }
  m.seq_len = seq;
  Model model(m);
  const BlockDesc& layer = model.blocks().at(1);
  ComputeStreamScope scope(device);
  const at::TensorOptions opts = at::TensorOptions().dtype(dt).device(torch_device(device));
  at::Generator gen = at::detail::createCPUGenerator(1);
  std::vector<at::Tensor> w;
  for (const ParamSpec& p : layer.params) {
    at::Tensor t = p.init == Init::kOnes ? at::ones(p.shape, opts)
                                         : at::normal(0.0, 0.02, p.shape, gen, at::TensorOptions().dtype(at::kFloat))
                                               .to(opts);
    w.push_back(t.requires_grad_(true));
  }
  at::Tensor x = at::normal(0.0, 1.0, {batch, seq, m.dim}, gen, at::TensorOptions().dtype(at::kFloat)).to(opts);
  x.requires_grad_(true);
  at::Tensor dy = at::normal(0.0, 1.0, {batch, seq, m.dim}, gen, at::TensorOptions().dtype(at::kFloat)).to(opts);
  const double s = fastest_seconds(budget_s, [&] {
    at::Tensor y = model.forward(1, w, x);
    y.backward(dy);
    for (at::Tensor& t : w) t.mutable_grad().reset();
    x.mutable_grad().reset();
    if (!cpu) device.synchronize(Stream::kCompute);
  });
  // One layer's forward and backward: the layer terms of step_flops.
  const double flops = step_flops(m, batch * seq, false) - 6.0 * double(batch * seq) * double(m.vocab_size * m.dim);
  if (what) {
    *what = strprintf("measured: one layer, %lld x %lld tokens, %s%s", (long long)batch, (long long)seq,
                      compute_dtype_name(cfg.run.compute_dtype), shape_note.c_str());
  }
  return flops / s;
}

CopyRates probe_copies(Device& device, double budget_s) {
  const int64_t bytes = budget_s >= 0.5 ? int64_t(64) << 20 : int64_t(16) << 20;
  PinnedHostBuffer host = device.allocate_pinned(2 * bytes, "copy probe (host)");
  DeviceBuffer dev = device.allocate(2 * bytes, "copy probe (device)");
  std::memset(host.data(), 1, size_t(2 * bytes));
  device.copy_to_device(dev.ptr(), host.data(), 2 * bytes, Stream::kH2D);
  device.synchronize(Stream::kH2D);
  CopyRates r;
  const double third = budget_s / 3;
  r.h2d = double(bytes) / fastest_seconds(third, [&] {
            device.copy_to_device(dev.ptr(), host.data(), bytes, Stream::kH2D);
            device.synchronize(Stream::kH2D);
          });
  r.d2h = double(bytes) / fastest_seconds(third, [&] {
            device.copy_to_host(host.data(), dev.ptr(), bytes, Stream::kD2H);
            device.synchronize(Stream::kD2H);
          });
  // Both at once: each direction on its own stream, different halves.
  r.both = double(2 * bytes) / fastest_seconds(third, [&] {
             device.copy_to_device(dev.ptr(), host.data(), bytes, Stream::kH2D);
             device.copy_to_host(host.data() + bytes, dev.ptr() + bytes, bytes, Stream::kD2H);
             device.synchronize(Stream::kH2D);
             device.synchronize(Stream::kD2H);
           });
  return r;
}

int64_t nvme_probe_bytes(double budget_s, int64_t state_numel) {
  // About budget_s at 1 GB/s a pass, within [128 MiB, 1 GiB] (shorter passes
  // hit the device's write cache more than a step's gigabytes do), at most
  // what a step moves (Note [Probes sized to the work]).
  const int64_t step = int64_t(4) << 20;
  static_assert(kMinProbeBytes % (int64_t(4) << 20) == 0, "probe files are whole 4 MiB steps");
  const int64_t bytes = std::clamp<int64_t>(int64_t(budget_s * 1e9) / step * step, int64_t(128) << 20, int64_t(1) << 30);
  return std::max(kMinProbeBytes, at_most_touched(bytes, 16 * state_numel, step));
}

IoRates probe_nvme(const Config& cfg, const std::string& dir, double budget_s, int64_t reserve_bytes, int sharers,
                   int64_t state_numel) {
  if (!is_directory(dir)) {
    throw InputError(dir, "the swap directory does not exist, so the NVMe probe cannot run here; create it, or "
                          "give --nvme-read-gbps and --nvme-write-gbps (run.rates.nvme_read_gbps, nvme_write_gbps)");
  }
  nvme::BenchOptions o;
  o.dir = dir;
  const int64_t step = int64_t(4) << 20;
  o.bytes = nvme_probe_bytes(budget_s, state_numel);
  IoRates r;
  r.asked = o.bytes;
  // Two files at once (both), beside the state, with 1/64 of the disk's
  // free space (at least 4 MiB) left over. A plan that fills the disk leaves
  // no room beside its state; a lone prober then measures in the room the
  // state will take, since its swap files are made after the probe has
  // removed its own (ranks of a node probing together may not: one may make
  // its swap files while another still probes).
  if (const int64_t free = free_bytes_under(dir); free >= 0) {
    auto fits = [&](int64_t reserve) {
      const int64_t room = free - std::max<int64_t>(reserve, 0) - std::max<int64_t>(free / 64, step);
      return std::min(o.bytes, room / 2 / std::max(1, sharers) / step * step);
    };
    const int64_t beside = fits(reserve_bytes);
    if (beside < kMinProbeBytes && sharers == 1 && fits(0) >= kMinProbeBytes) {
      o.bytes = fits(0);
      r.in_state_room = true;
    } else {
      o.bytes = beside;
    }
    if (o.bytes < kMinProbeBytes) {
      throw ConfigError("--nvme-read-gbps",
                        strprintf("no room to measure the disk under %s: %s free, the plan's NVMe state takes %s, "
                                  "the probe needs 2 x %s more; give the disk's rates (--nvme-read-gbps, "
                                  "--nvme-write-gbps, --nvme-both-gbps; run.rates.nvme_read_gbps, ...)",
                                  dir.c_str(), format_bytes(double(free)).c_str(),
                                  format_bytes(double(reserve_bytes)).c_str(),
                                  format_bytes(double(kMinProbeBytes)).c_str()));
    }
  }
  r.bytes = o.bytes;
  o.max_buffer_bytes = int64_t(64) << 20;
  nvme::EngineOptions e;
  e.block_size_bytes = cfg.aio.block_size;
  e.queue_depth = int(cfg.aio.queue_depth);
  e.rings = int(cfg.aio.intra_op_parallelism);
  e.single_submit = cfg.aio.single_submit;
  e.overlap_events = cfg.aio.overlap_events;
  nvme::IoBench bench(o);
  r.write = bench.run(nvme::IoOp::kWrite, e).gbps() * 1e9;
  r.read = bench.run(nvme::IoOp::kRead, e).gbps() * 1e9;
  // Both at once: read the first file back while a second is written.
  nvme::IoBench other(o);
  r.both = nvme::run_both(bench, other, e).gbps() * 1e9;
  return r;
}

int64_t parse_cache_size(const std::string& text) {
  int64_t v = 0;
  size_t i = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') v = v * 10 + (text[i++] - '0');
  if (i == 0) return 0;
  const char unit = i < text.size() ? text[i] : 0;
  if (unit == 'K') return v << 10;
  if (unit == 'M') return v << 20;
  if (unit == 'G') return v << 30;
  return v;
}

namespace {
int64_t scan_last_level_caches() {
  // The last level over every CPU: each distinct cache (its level and the CPUs
  // sharing it) counted once, so that a machine of several L3s (sockets,
  // chiplets) counts them all, as CPU Adam's threads use them all.
  int top = 0;
  int64_t total = 0;
  std::set<std::string> seen;
  for (int cpu = 0; cpu < 4096; ++cpu) {
    const std::string cpu_dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu), dir = cpu_dir + "/cache";
    if (!is_directory(cpu_dir)) break;
    if (!is_directory(dir)) continue;
    for (int i = 0; i < 8; ++i) {
      const std::string idx = dir + "/index" + std::to_string(i);
      std::ifstream level_file(idx + "/level"), size_file(idx + "/size"), shared_file(idx + "/shared_cpu_list");
      int level = 0;
      std::string size, shared;
      if (!(level_file >> level) || !(size_file >> size)) continue;
      shared_file >> shared;
      if (level < top) continue;
      if (level > top) top = level, total = 0, seen.clear();
      if (seen.insert(shared.empty() ? idx : shared).second) total += parse_cache_size(size);
    }
  }
#ifdef _SC_LEVEL3_CACHE_SIZE
  if (total == 0) total = std::max<int64_t>(0, sysconf(_SC_LEVEL3_CACHE_SIZE));
#endif
  return total;
}
}  // namespace

int64_t last_level_cache_bytes() {
  static const int64_t bytes = scan_last_level_caches();  // the machine's, read once
  return bytes;
}

namespace {
// `base`, or 4x `cache_bytes` in units of `bytes_each` rounded up to 1 Mi
// when that is larger, at most `cap` (never under `base`).
int64_t past_the_caches(int64_t base, int bytes_each, int64_t cap, int64_t cache_bytes) {
  const int64_t mi = int64_t(1) << 20;
  const int64_t want = (4 * std::max<int64_t>(0, cache_bytes) / bytes_each + mi - 1) / mi * mi;
  return std::max(base, std::min(want, cap));
}

}  // namespace

int64_t adam_probe_numel(double budget_s, int64_t cache_bytes, int64_t state_numel) {
  return at_most_touched(past_the_caches(budget_s >= 0.5 ? int64_t(8) << 20 : int64_t(4) << 20, 18,
                                         int64_t(256) << 20, cache_bytes),
                         state_numel, int64_t(1) << 20);
}

int64_t checksum_probe_bytes(double budget_s, int64_t cache_bytes, int64_t state_numel) {
  return at_most_touched(past_the_caches(budget_s >= 0.5 ? int64_t(512) << 20 : int64_t(128) << 20, 1,
                                         int64_t(4) << 30, cache_bytes),
                         16 * state_numel, int64_t(1) << 20);
}

double probe_adam(const Config& cfg, const Device& device, double budget_s, int64_t state_numel) {
  const cpu_adam::Isa isa = cpu_adam::parse_isa(cfg.run.cpu_adam_isa);
  cpu_adam::CpuAdam adam(adam_threads(cfg, device), isa);
  const int64_t n = adam_probe_numel(budget_s, last_level_cache_bytes(), state_numel);
  const bool bf16_state = cfg.run.optimizer_state_dtype == "bf16";
  std::vector<float> param(size_t(n), 0.5f), grad(size_t(n), 1e-3f);
  std::vector<uint32_t> m(size_t(n), 0), v(size_t(n), 0);  // zero in fp32 and in bf16 pairs
  std::vector<uint16_t> emit(static_cast<size_t>(n), uint16_t{0});
  // fp32 compute: the working copy is the master's copy, made after the step
  // (OptimizerPass::update_piece).
  std::vector<float> working(cfg.run.compute_dtype == ComputeDtype::kFp32 ? size_t(n) : 0);
  cpu_adam::AdamSpans s;
  s.param = param.data();
  s.grad = grad.data();
  s.exp_avg = m.data();
  s.exp_avg_sq = v.data();
  s.state_type = bf16_state ? cpu_adam::StateType::kBF16 : cpu_adam::StateType::kF32;
  s.numel = n;
  if (cfg.run.compute_dtype != ComputeDtype::kFp32) {
    s.emit = emit.data();
    s.emit_type = cfg.run.compute_dtype == ComputeDtype::kBf16 ? cpu_adam::EmitType::kBF16 : cpu_adam::EmitType::kF16;
  }
  cpu_adam::AdamParams h;
  cpu_adam::StepArgs a;
  return double(n) / fastest_seconds(budget_s, [&] {
           adam.step(h, a, s);
           if (!working.empty()) std::memcpy(working.data(), param.data(), size_t(n) * 4);
           ++a.step;
         });
}

double probe_checksum(const Config& cfg, const Device& device, double budget_s, int64_t state_numel) {
  cpu_adam::CpuAdam adam(adam_threads(cfg, device), cpu_adam::parse_isa(cfg.run.cpu_adam_isa));
  constexpr int64_t kBlock = 4096, kChunk = 48 * kBlock;  // as the swap store checksums
  const int64_t bytes =
      std::max(kChunk, checksum_probe_bytes(budget_s, last_level_cache_bytes(), state_numel) / kChunk * kChunk);
  std::vector<std::byte> buf(size_t(bytes), std::byte{0x5a});
  std::vector<uint32_t> crc(size_t(bytes / kBlock));
  struct Job {
    const std::byte* data;
    uint32_t* crc;
    static void chunk(void* self, int64_t begin, int64_t end) {
      const auto& j = *static_cast<const Job*>(self);
      for (int64_t c = begin; c < end; ++c) {
        nvme::crc32c_blocks(j.data + c * kChunk, size_t(kChunk), size_t(kBlock), j.crc + c * (kChunk / kBlock));
      }
    }
  } job{buf.data(), crc.data()};
  return double(bytes) / fastest_seconds(budget_s, [&] { adam.parallel_for(bytes / kChunk, &Job::chunk, &job); });
}

int64_t grad_add_probe_numel(double budget_s, int64_t cache_bytes, int wire_bytes, int64_t state_numel) {
  return at_most_touched(past_the_caches(budget_s >= 0.5 ? int64_t(16) << 20 : int64_t(4) << 20, 4 + wire_bytes,
                                         int64_t(256) << 20, cache_bytes),
                         state_numel, int64_t(1) << 20);
}

double probe_grad_add(cpu_adam::GradType wire, bool first, double budget_s, int64_t state_numel) {
  const int wire_bytes = wire == cpu_adam::GradType::kF32 ? 4 : 2;
  const int64_t n = grad_add_probe_numel(budget_s, last_level_cache_bytes(), wire_bytes, state_numel);
  std::vector<float> home(size_t(n), 0.25f);
  std::vector<std::byte> landed(size_t(n) * size_t(wire_bytes), std::byte{0x3c});  // finite in every dtype
  return double(n) /
         fastest_seconds(budget_s, [&] { cpu_adam::accumulate_grad(home.data(), landed.data(), wire, n, first); });
}

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

void measure_missing_rates(const Config& cfg, const PlacementPlan& plan, Device* device, const StepWork& work,
                           Rates& rates, double budget_s, const ProbeRoom& room) {
  const bool cpu_compute = device == nullptr || !device->is_cuda();
  auto need = [&](double rate, bool has_work) { return has_work && !(rate > 0); };
  const int64_t state = plan.shard_space_numel;  // Note [Probes sized to the work]
  const int64_t llc = last_level_cache_bytes();
  // Ranks probing at once share the cores and the disk: their figures are not a lone run's.
  const std::string cpu = cpu_identity() + strprintf("|sharers %d", room.sharers);
  const Device& host = device ? *device : cpu_device();
  const double kMemBytesPerS = 4e9;  // for the time a line says a probe takes: about
  std::vector<Probe> probes;
  auto add = [&](std::string key, std::string what, double touched_bytes, size_t count,
                 std::function<void(std::vector<double>*, std::string*)> run) {
    // A warm-up and at least 5 timed calls, at least budget_s; buffers filled once.
    const double about = std::max(budget_s, 6 * touched_bytes / kMemBytesPerS) + touched_bytes / kMemBytesPerS;
    probes.push_back(Probe{std::move(key), std::move(what), about, std::move(run), count, {}, {}, {}, true});
  };
  if (need(rates.device_flops, work.flops > 0)) {
    if (device == nullptr) {
      throw ConfigError("--device-tflops", "run.device is cuda and this machine has no GPU to measure: give the "
                                           "device's rate (run.rates.device_tflops)");
    }
    const ModelConfig& m = cfg.model;
    add(strprintf("compute|%s|%s|%s|%s dim %lld heads %lld/%lld of %lld ffn %lld seq %lld window %lld micro %lld|"
                  "threads %d|deterministic %d",
                  cpu.c_str(), device->name().c_str(), compute_dtype_name(cfg.run.compute_dtype),
                  model_family_name(m.family), (long long)m.dim, (long long)m.n_heads, (long long)m.kv_heads(),
                  (long long)m.head_dim(), (long long)m.ffn_dim(), (long long)m.seq_len, (long long)m.sliding_window,
                  (long long)cfg.train_micro_batch_size_per_gpu, at::get_num_threads(), int(cfg.run.deterministic)),
        "one layer's compute", 0, 1, [&](std::vector<double>* v, std::string* src) {
          v->assign(1, probe_compute(cfg, *device, budget_s, src));
        });
    probes.back().about_s = 2 * budget_s;
    probes.back().apply = [&](const Probe& p) { rates.device_flops = p.values[0], rates.device_flops_source = p.source; };
  }
  if (need(rates.adam, work.adam_elems > 0)) {
    const int64_t n = adam_probe_numel(budget_s, llc, state);
    add(strprintf("adam|%s|threads %d|isa %s|state %s|emit %s|%lld", cpu.c_str(), adam_threads(cfg, host),
                  cfg.run.cpu_adam_isa.c_str(), cfg.run.optimizer_state_dtype.c_str(),
                  compute_dtype_name(cfg.run.compute_dtype), (long long)n),
        strprintf("CPU Adam over %s elements", n >= (int64_t(1) << 20) ? strprintf("%lld Mi", (long long)(n >> 20)).c_str()
                                                                       : std::to_string(n).c_str()),
        double(n) * 28, 1, [&, n](std::vector<double>* v, std::string* src) {
          v->assign(1, probe_adam(cfg, host, budget_s, state));
          *src = strprintf("measured: CPU Adam over %lld Mi elements", (long long)(n >> 20));
        });
    probes.back().apply = [&](const Probe& p) { rates.adam = p.values[0], rates.adam_source = p.source; };
  }
  if (need(rates.checksum, work.checksum_bytes > 0)) {
    const int64_t bytes = checksum_probe_bytes(budget_s, llc, state);
    const int threads = adam_threads(cfg, host) > 0 ? adam_threads(cfg, host) : int(std::thread::hardware_concurrency());
    add(strprintf("crc32c|%s|threads %d|%lld", cpu.c_str(), threads, (long long)bytes),
        strprintf("CRC-32C over %lld MiB", (long long)(bytes >> 20)), double(bytes), 1,
        [&, bytes, threads](std::vector<double>* v, std::string* src) {
          v->assign(1, probe_checksum(cfg, host, budget_s, state));
          *src = strprintf("measured: CRC-32C over %lld MiB on %d thread(s)", (long long)(bytes >> 20), threads);
        });
    probes.back().apply = [&](const Probe& p) { rates.checksum = p.values[0], rates.checksum_source = p.source; };
  }
  if (need(rates.grad_add, work.grad_add_elems > 0)) {
    // What most blocks' landings do (memory/bound.cc, predicted_work): add
    // their wire into the fp32 home, or under the layer schedule with
    // several micro-batches write the block's fp32 sum as the home's first
    // write (Note [Gradient path] in engine/gradient_path.h).
    const bool summed = plan.layer_major() && plan.accum > 1;
    const cpu_adam::GradType wire = plan.compute_bytes == 4 || plan.world_size > 1 || summed ? cpu_adam::GradType::kF32
                                    : cfg.run.compute_dtype == ComputeDtype::kFp16 ? cpu_adam::GradType::kF16
                                                                                   : cpu_adam::GradType::kBF16;
    const int wire_bytes = wire == cpu_adam::GradType::kF32 ? 4 : 2;
    const int64_t n = grad_add_probe_numel(budget_s, llc, wire_bytes, state);
    add(strprintf("grad_add|%s|%s|first %d|%lld", cpu.c_str(), cpu_adam::grad_type_name(wire), int(summed), (long long)n),
        strprintf("gradient adds over %lld Mi elements", (long long)(n >> 20)), double(n) * (8 + wire_bytes), 1,
        [&, wire, summed, n](std::vector<double>* v, std::string* src) {
          v->assign(1, probe_grad_add(wire, summed, budget_s, state));
          *src = strprintf("measured: %s gradients %s fp32 on 1 thread, %lld Mi elements",
                           cpu_adam::grad_type_name(wire), summed ? "written as" : "added into", (long long)(n >> 20));
        });
    probes.back().apply = [&](const Probe& p) { rates.grad_add = p.values[0], rates.grad_add_source = p.source; };
  }
  const bool h2d = need(rates.h2d, work.links.h2d > 0), d2h = need(rates.d2h, work.links.d2h > 0);
  const bool both = !cpu_compute && need(rates.pcie_both, work.links.h2d > 0 && work.links.d2h > 0);
  if (h2d || d2h || both) {
    if (device == nullptr) {
      throw ConfigError(h2d ? "--h2d-gbps" : d2h ? "--d2h-gbps" : "--pcie-both-gbps",
                        "run.device is cuda and this machine has no GPU to measure copies with");
    }
    add(strprintf("copies|%s|%s|%.2f", cpu.c_str(), device->name().c_str(), budget_s), "host-device copies",
        double(int64_t(16) << 20) * 6, 3, [&](std::vector<double>* v, std::string* src) {
          const CopyRates c = probe_copies(*device, budget_s);
          *v = {c.h2d, c.d2h, c.both};
          *src = cpu_compute ? "measured: memcpy (CPU device)" : "measured: registered memory";
        });
    probes.back().apply = [&, h2d, d2h, both](const Probe& p) {
      if (h2d) rates.h2d = p.values[0], rates.h2d_source = p.source;
      if (d2h) rates.d2h = p.values[1], rates.d2h_source = p.source;
      if (both) rates.pcie_both = p.values[2], rates.pcie_both_source = p.source;
    };
  }
  const bool rd = need(rates.nvme_read, work.links.nvme_read > 0), wr = need(rates.nvme_write, work.links.nvme_write > 0);
  const bool rw = need(rates.nvme_both, work.links.nvme_read > 0 && work.links.nvme_write > 0);
  std::string nvme_dir;
  if (rd || wr || rw) {
    STRATA_CHECK(!plan.nvme_paths.empty(), "NVMe work without a swap directory");
    // A swap directory training has not created yet is measured in its
    // nearest existing parent (the same file system, as a rule).
    nvme_dir = plan.nvme_paths.front();
    while (!is_directory(nvme_dir) && nvme_dir != "/" && nvme_dir != "." && !nvme_dir.empty()) {
      nvme_dir = nvme_dir.find('/') == std::string::npos ? "." : parent_dir(nvme_dir);
    }
    // The swap store splits its capacity evenly over the directories.
    const int64_t share = plan.total()[size_t(Tier::kNvme)] / int64_t(plan.nvme_paths.size());
    const int64_t bytes = nvme_probe_bytes(budget_s, state);
    const size_t nvme_index = probes.size();
    add(strprintf("nvme|%lld|block %lld qd %lld rings %lld single %d overlap %d|%lld|sharers %d", (long long)device_of(nvme_dir),
                  (long long)cfg.aio.block_size, (long long)cfg.aio.queue_depth, (long long)cfg.aio.intra_op_parallelism,
                  int(cfg.aio.single_submit), int(cfg.aio.overlap_events), (long long)bytes, room.sharers),
        strprintf("the disk under %s over 2 x %s", nvme_dir.c_str(), format_bytes(double(bytes)).c_str()), 0, 3,
        [&, share, nvme_dir, nvme_index](std::vector<double>* v, std::string* src) {
          const IoRates io = probe_nvme(cfg, nvme_dir, budget_s, room.reserve_state ? share * room.sharers : 0,
                                        room.sharers, state);
          *src = "measured: I/O engine in " + nvme_dir;
          if (nvme_dir != plan.nvme_paths.front()) *src += " (" + plan.nvme_paths.front() + " does not exist yet)";
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
          if (io.bytes < io.asked || io.in_state_room) probes[nvme_index].keep = false;
        });
    // Written, read, then both at once; the files laid out first (at about 1 GB/s).
    probes.back().about_s = 5 * double(bytes) / 1e9;
    probes.back().apply = [&, rd, wr, rw](const Probe& p) {
      if (rd) rates.nvme_read = p.values[0], rates.nvme_read_source = p.source;
      if (wr) rates.nvme_write = p.values[1], rates.nvme_write_source = p.source;
      if (rw) rates.nvme_both = p.values[2], rates.nvme_both_source = p.source;
    };
  }
  if (need(rates.net, work.net_bytes > 0)) {
    throw ConfigError("--net-gbps", "ranks send bytes each step and no network rate was given (run.rates.net_gbps)");
  }
  if (need(rates.intra_node, work.intra_node_bytes > 0)) {
    throw ConfigError("--intra-node-gbps", "ranks send bytes within their node each step and no intra-node rate "
                                           "was given (run.rates.intra_node_gbps)");
  }

  // Kept rates first (Note [Kept rates]); one line on what is measured and for how long.
  std::vector<Probe*> todo;
  const std::string path = rates_cache_path();
  const nlohmann::json kept = path.empty() || kept_options().reprobe || probes.empty()
                                  ? nlohmann::json::object() : read_kept(path, /*warn=*/true);
  for (Probe& p : probes) {
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
    for (Probe& p : probes) {
      if (std::find(todo.begin(), todo.end(), &p) == todo.end()) p.apply(p);
    }
    const auto t0 = Clock::now();
    for (Probe* p : todo) {
      p->run(&p->values, &p->source);
      p->apply(*p);
      if (room.keep && p->keep) keep(p->key, p->values, p->source);
    }
    log::info("rates measured in %.1f s", since(t0));
  } else if (!probes.empty()) {
    for (Probe& p : probes) p.apply(p);
    log::info("rates for the step's bound kept from an earlier run (%s; --reprobe measures again)", path.c_str());
  }
}

StepWork union_work(const StepWork& work, const PlacementPlan& plan, bool checksums) {
  StepWork u = work;
  u.adam_elems = std::max<int64_t>(u.adam_elems, 1);
  u.links.h2d = std::max<int64_t>(u.links.h2d, 1);
  u.links.d2h = std::max<int64_t>(u.links.d2h, 1);
  u.grad_add_elems = std::max<int64_t>(u.grad_add_elems, 1);
  if (!plan.nvme_paths.empty()) {
    u.links.nvme_read = std::max<int64_t>(u.links.nvme_read, 1);
    u.links.nvme_write = std::max<int64_t>(u.links.nvme_write, 1);
    if (checksums) u.checksum_bytes = std::max<int64_t>(u.checksum_bytes, 1);
  }
  return u;
}

void measure_rates(const Config& cfg, const PlacementPlan& plan, Device* device, const StepWork& work, Rates& rates,
                   double budget_s, const ProbeRoom& room) {
  measure_missing_rates(cfg, plan, device, work, rates, budget_s, room);
  if (!cfg.placement.auto_place) return;
  try {
    measure_missing_rates(cfg, plan, device, union_work(work, plan, cfg.run.swap_checksums), rates, budget_s, room);
  } catch (const Error&) {
    // What cannot be measured here leaves those candidates unjudged.
  }
}

void store_rates(const Rates& r, RateOverrides& o) {
  o.device_tflops = r.device_flops / 1e12;
  o.h2d_gbps = r.h2d / 1e9;
  o.d2h_gbps = r.d2h / 1e9;
  o.pcie_both_gbps = r.pcie_both / 1e9;
  o.nvme_read_gbps = r.nvme_read / 1e9;
  o.nvme_write_gbps = r.nvme_write / 1e9;
  o.nvme_both_gbps = r.nvme_both / 1e9;
  o.adam_gelems = r.adam / 1e9;
  o.checksum_gbps = r.checksum / 1e9;
  o.grad_add_gelems = r.grad_add / 1e9;
  o.net_gbps = r.net * 8 / 1e9;
  o.intra_node_gbps = r.intra_node * 8 / 1e9;
}

}  // namespace strata
