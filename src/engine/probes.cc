#include "engine/probes.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

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
#include "engine/optimizer/optimizer_pass.h"
#include "memory/placement.h"
#include "model/model.h"
#include "model/saved_activations.h"
#include "nvme/bench.h"
#include "nvme/crc32c.h"
#include "plan/planner.h"
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
  // (An MoE layer's MLP: all its experts, the router and the shared expert.)
  const double mlp_params = m.is_moe() ? 3.0 * double(m.dim) * double(m.expert_dim() * m.moe.num_experts +
                                                                      m.moe.shared_expert_intermediate_size) +
                                             double(m.dim * m.moe.num_experts)
                                       : 3.0 * double(m.dim) * double(m.ffn_dim());
  const double layer_params = double(m.dim) * double(2 * m.q_dim() + 2 * m.kv_heads() * m.head_dim()) + mlp_params;
  std::string shape_note;
  if (cpu && layer_params * double(elem) > double(int64_t(256) << 20)) {
    const double k = std::sqrt(layer_params * double(elem) / double(int64_t(256) << 20));
    const int64_t dim = std::max<int64_t>(64, int64_t(double(m.dim) / k) / 64 * 64);
    const int64_t hd = std::max<int64_t>(2, std::min(m.head_dim(), dim) / 2 * 2);
    const int64_t group = m.n_heads / m.kv_heads();
    const int64_t heads = std::max<int64_t>(group, dim / hd / group * group);
    if (m.is_moe()) {  // the experts narrowed like the MLP; their number and top k kept
      m.moe.moe_intermediate_size = std::max<int64_t>(16, int64_t(double(m.expert_dim()) / k));
      if (m.shared_expert()) {
        m.moe.shared_expert_intermediate_size =
            std::max<int64_t>(16, int64_t(double(m.moe.shared_expert_intermediate_size) / k));
      }
    }
    m.ffn_hidden = std::max<int64_t>(64, int64_t(double(m.ffn_dim()) / k));
    m.dim = dim;
    m.explicit_head_dim = hd;
    m.n_heads = heads;
    m.n_kv_heads = heads / group;
    shape_note = strprintf(", narrowed to dim %lld, %lld heads of %lld, ffn %lld", (long long)m.dim,
                           (long long)m.n_heads, (long long)hd, (long long)m.ffn_hidden);
  }
  int64_t batch = cfg.train_micro_batch_size_per_gpu, seq = m.seq_len;
  // The head's FLOPs a token per vocab x dim (step_flops): frozen under LoRA,
  // without its weight gradient.
  const double head_flops = m.lora.enabled ? 4.0 : 6.0;
  // On the CPU, at most kProbeCallFlops a call: fewer windows, then shorter ones.
  if (cpu) {
    const double per_token = step_flops(m, 1, 0) - head_flops * double(m.vocab_size * m.dim);
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
  // The layer's work as training does it: with LoRA, no weight gradients for
  // the frozen base and the adapters in fp32 (docs/design.md, "LoRA layers"),
  // so the rate is not a dense layer's.
  for (const ParamSpec& p : layer.params) {
    const at::TensorOptions o = p.frozen || !m.lora.enabled ? opts : opts.dtype(at::kFloat);
    at::Tensor t = p.init == Init::kOnes ? at::ones(p.shape, o)
                                         : at::normal(0.0, 0.02, p.shape, gen, at::TensorOptions().dtype(at::kFloat))
                                               .to(o);
    w.push_back(t.requires_grad_(!p.frozen));
  }
  at::Tensor x = at::normal(0.0, 1.0, {batch, seq, m.dim}, gen, at::TensorOptions().dtype(at::kFloat)).to(opts);
  x.requires_grad_(true);
  at::Tensor dy = at::normal(0.0, 1.0, {batch, seq, m.dim}, gen, at::TensorOptions().dtype(at::kFloat)).to(opts);
  // An MoE layer runs as training runs it, its explicit forward and backward
  // (Note [Experts] in model/experts.cc): autograd's path through the
  // per-expert gathers and sums measured 4x slower on the CPU, which would
  // put the bound far above the step.
  const bool explicit_path = m.is_moe();
  const double s = fastest_seconds(budget_s, [&] {
    if (explicit_path) {
      at::NoGradGuard no_grad;
      LayerSaved saved;
      model.layer_forward_saving(w, x, &saved);
      std::vector<at::Tensor> dw;
      model.layer_backward(w, &saved, dy, &dw);
      if (!cpu) device.synchronize(Stream::kCompute);
      return;
    }
    at::Tensor y = model.forward(1, w, x);
    y.backward(dy);
    for (at::Tensor& t : w) {
      if (t.requires_grad()) t.mutable_grad().reset();
    }
    x.mutable_grad().reset();
    if (!cpu) device.synchronize(Stream::kCompute);
  });
  // One layer's forward and backward: the layer terms of step_flops.
  const double flops = step_flops(m, batch * seq, 0) - head_flops * double(batch * seq) * double(m.vocab_size * m.dim);
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
  const bool bf16_state = cfg.run.optimizer_state_dtype == MomentDtype::kBf16;
  std::vector<float> param(size_t(n), 0.5f), grad(size_t(n), 1e-3f);
  std::vector<uint32_t> m(size_t(n), 0), v(size_t(n), 0);  // zero in fp32 and in bf16 pairs
  std::vector<uint16_t> emit(static_cast<size_t>(n), uint16_t{0});
  // An fp32 working copy (fp32 compute, or LoRA's adapters: StepContext::
  // param_dtype) is the master's copy, made after the step
  // (OptimizerPass::update_piece); a 16-bit one is emitted by the step.
  const bool fp32_working = cfg.run.compute_dtype == ComputeDtype::kFp32 || cfg.model.lora.enabled;
  std::vector<float> working(fp32_working ? size_t(n) : 0);
  cpu_adam::AdamSpans s;
  s.param = param.data();
  s.grad = grad.data();
  s.exp_avg = m.data();
  s.exp_avg_sq = v.data();
  s.state_type = bf16_state ? cpu_adam::StateType::kBF16 : cpu_adam::StateType::kF32;
  s.numel = n;
  if (!fp32_working) {
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

StepWork union_work(const StepWork& work, const PlacementPlan& plan, bool checksums) {
  StepWork u = work;
  u.adam_elems = std::max<int64_t>(u.adam_elems, 1);
  u.links.h2d = std::max<int64_t>(u.links.h2d, 1);
  u.links.d2h = std::max<int64_t>(u.links.d2h, 1);
  u.grad_add_elems = std::max<int64_t>(u.grad_add_elems, 1);
  if (!plan.state.nvme_paths.empty()) {
    u.links.nvme_read = std::max<int64_t>(u.links.nvme_read, 1);
    u.links.nvme_write = std::max<int64_t>(u.links.nvme_write, 1);
    if (checksums) u.checksum_bytes = std::max<int64_t>(u.checksum_bytes, 1);
  }
  return u;
}

void measure_rates(const Config& cfg, const PlacementPlan& plan, Device* device, const StepWork& work, Rates& rates,
                   double budget_s, const ProbeRoom& room) {
  measure_missing_rates(cfg, plan, device, work, rates, budget_s, room);
  // Auto's candidates may need rates the plan's own work does not; entries
  // kept in host RAM (Note [Activations by the bound] in plan/planner.h) the
  // copies' both ways.
  StepWork more;
  if (cfg.placement.auto_place) {
    more = union_work(work, plan, cfg.run.swap_checksums);
  } else if (weighs_host_activations(cfg, plan)) {
    more = work;
    more.links.h2d = std::max<int64_t>(more.links.h2d, plan.activations.entries_bytes);
    more.links.d2h = std::max<int64_t>(more.links.d2h, plan.activations.entries_bytes);
  } else {
    return;
  }
  try {
    measure_missing_rates(cfg, plan, device, more, rates, budget_s, room);
  } catch (const Error&) {
    // What cannot be measured here leaves those candidates unjudged.
  }
}

void store_rates(const Rates& r, RateOverrides& o) {
  for (const RateSpec& s : kRateTable) o[s.kind] = r.value(s.kind) / s.scale;
}

}  // namespace strata
