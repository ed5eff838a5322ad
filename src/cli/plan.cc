#include "cli/plan.h"

#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <tuple>
#include <memory>

#include <nlohmann/json.hpp>

#include "cli/plan_experts.h"
#include "cli/plan_json.h"
#include "comm/communicator.h"
#include "engine/probes.h"
#include "plan/planner.h"
#include "memory/layout.h"
#include "memory/param_window.h"
#include "model/model.h"
#include "util/errors.h"
#include "util/logging.h"

namespace strata {

namespace {

struct PlanOptions {
  std::string config_path;
  std::vector<std::string> overrides;
  bool json = false;
  int world_size = 1;
  int nodes = 1;
  double net_gbps = 100.0;
  bool net_given = false;
  // The node group's (comm.secondary_shard): H100 SXM's NVLink, 450 GB/s each way.
  double intra_node_gbps = 3600.0;
  bool intra_node_given = false;
  // The step's bound (plan/bound.h): rates given instead of measured
  // (0 = run.rates' figure, else measured here), the probes' time, or none.
  bool no_bound = false;
  double probe_s = 0.5;
  bool reprobe = false;  // Note [Kept rates] in engine/probes.h
  // Per row of the rates table (config/rates.h), in the row's unit; the
  // network's two rows are net_gbps and intra_node_gbps above (assumed, with
  // defaults). --nvme-gbps sets the three NVMe rows their own flags override.
  std::array<double, kNumRates> rates{};
  double nvme_gbps = 0;
  // A machine described instead of measured (0 = measure): per node, per GPU.
  double host_memory_gb = 0, nvme_gb = 0, device_memory_gb = 0;
  std::string gpu;  // --gpu NAME: a GpuPreset
};

// `strata plan --gpu NAME` (docs/planning.md): a GPU described by its
// datasheet instead of measured, so that a laptop plans a cluster. Memory
// is what nvidia-smi reports in total; compute the dense (no sparsity)
// tensor rate of the compute dtype times kAchievableFraction; the host link
// its generation's rates.
struct GpuPreset {
  const char* name;
  int64_t memory_mib;
  double bf16_tflops, fp32_tflops;  // dense peak: bf16/fp16 tensor cores, fp32 (LibTorch's default matmuls)
  const char* link;
  double h2d_gbps, d2h_gbps, both_gbps;
};
// The H100 host of BENCHMARKS.md ("GPU") ran Llama-3-8B's shape at 544 of
// the H100 SXM's 989 dense bf16 TFLOP/s.
constexpr double kAchievableFraction = 0.55;
// A run plans with the memory the GPU reports free, less than its total by
// the CUDA context and LibTorch's start-up: an allowance (docs/planning.md),
// not a measured figure.
constexpr int64_t kCudaContextMib = 512;
// PCIe 5.0 x16 as measured on that host (pinned copies); 4.0 x16 half of it;
// NVLink-C2C at 0.8 of its nominal 450 GB/s each way.
constexpr GpuPreset kGpuPresets[] = {
    {"h100-sxm", 81559, 989.4, 66.9, "PCIe 5.0 x16", 55, 55, 64},
    {"h100-pcie", 81559, 756.5, 51.2, "PCIe 5.0 x16", 55, 55, 64},
    {"h200", 143771, 989.4, 66.9, "PCIe 5.0 x16", 55, 55, 64},
    {"a100-80g", 81920, 312, 19.5, "PCIe 4.0 x16", 27.5, 27.5, 32},
    {"a100-40g", 40960, 312, 19.5, "PCIe 4.0 x16", 27.5, 27.5, 32},
    {"l40s", 46068, 362.05, 91.6, "PCIe 4.0 x16", 27.5, 27.5, 32},
    {"rtx-4090", 24564, 165.2, 82.6, "PCIe 4.0 x16", 27.5, 27.5, 32},
    {"gh200", 97871, 989.4, 66.9, "NVLink-C2C", 360, 360, 720},
};

const GpuPreset* gpu_preset(const std::string& name) {
  if (name.empty()) return nullptr;
  std::string names;
  for (const GpuPreset& g : kGpuPresets) {
    if (name == g.name) return &g;
    names += std::string(names.empty() ? "" : ", ") + g.name;
  }
  throw ConfigError("--gpu", "no preset named '" + name + "'; presets: " + names + " (docs/planning.md)");
}

std::string cell(int64_t bytes) { return bytes == 0 ? "-" : format_bytes(double(bytes)); }
std::string cap_cell(int64_t bytes) { return bytes < 0 ? "unlimited" : format_bytes(double(bytes)); }



// What the data path uses (Note [Mapped tokens] in data/dataset.h): the token
// files are mapped read-only, so they take page cache shared by a node's
// ranks, not a rank's own memory; the rank's own is the step's token batches
// (staging.tokens, in the table). Files not on this machine are listed.
struct DataUse {
  int64_t mapped_bytes = 0;
  std::vector<std::string> missing;
};

DataUse data_use(const Config& cfg) {
  DataUse d;
  for (const std::string& f : cfg.data.paths) {
    struct stat st;
    if (::stat(f.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      d.mapped_bytes += int64_t(st.st_size);
    } else {
      d.missing.push_back(f);
    }
  }
  return d;
}

Computed compute(const Config& cfg, int rank, int local_ranks, const GivenCapacity& given,
                 const Rates* rates = nullptr, const Device* device = nullptr) {
  // From the specs alone, never the model: its tensors could be larger than
  // the machine, which is what the plan is there to say.
  StateLayout layout(model_layout_specs(cfg.model), shard_count(cfg), frozen_shard_count(cfg));
  Computed c;
  c.plan = plan_for_machine(cfg, layout, &c.cap, rank, local_ranks, device, given, rates);
  c.parameters = layout.parameter_count();
  c.shortfalls = plan_shortfalls(c.plan, c.cap);
  c.ranks_per_node = local_ranks;
  c.net = step_network_bytes(c.plan);
  return c;
}

// The rates of the bound: the flags, else --gpu's preset, else run.rates,
// else measured here.
Rates bound_rates(const PlanOptions& opt, const Config& cfg) {
  Rates r = rates_from_config(cfg.run.rates);
  if (const GpuPreset* g = gpu_preset(opt.gpu)) {
    const bool fp32 = cfg.run.compute_dtype == ComputeDtype::kFp32;
    const std::string tag = "--gpu " + std::string(g->name) + " preset";
    r.device_flops = (fp32 ? g->fp32_tflops : g->bf16_tflops) * 1e12 * kAchievableFraction;
    r.device_flops_source = strprintf("%s (%g dense %s TFLOP/s x %.2f)", tag.c_str(),
                                      fp32 ? g->fp32_tflops : g->bf16_tflops, fp32 ? "fp32" : "bf16",
                                      kAchievableFraction);
    r.h2d = g->h2d_gbps * 1e9, r.d2h = g->d2h_gbps * 1e9, r.pcie_both = g->both_gbps * 1e9;
    r.h2d_source = r.d2h_source = r.pcie_both_source = tag + " (" + g->link + ")";
  }
  auto flag = [](double v, double scale, const char* name, double& rate, std::string& source) {
    if (v < 0 || std::isnan(v)) throw ConfigError(name, "must be a positive number");
    if (v > 0) rate = v * scale, source = name;
  };
  for (RateKind k : {RateKind::kNvmeRead, RateKind::kNvmeWrite, RateKind::kNvmeBoth}) {
    flag(opt.nvme_gbps, 1e9, "--nvme-gbps", r.value(k), r.source(k));
  }
  for (const RateSpec& s : kRateTable) {
    if (s.kind == RateKind::kNet || s.kind == RateKind::kIntraNode) continue;  // below
    flag(opt.rates[size_t(s.kind)], s.scale, s.flag, r.value(s.kind), r.source(s.kind));
  }
  if (opt.net_given || !(r.net > 0)) r.net = opt.net_gbps * 1e9 / 8, r.net_source = "--net-gbps";
  if (opt.intra_node_given || !(r.intra_node > 0)) {
    r.intra_node = opt.intra_node_gbps * 1e9 / 8, r.intra_node_source = "--intra-node-gbps";
  }
  return r;
}

std::string bound_text(const StepBound& b, const Rates& r, const StepWork& w, int64_t tokens) {
  std::string out = "step bound (one optimizer step of one rank; docs/design.md, \"The step's bound\"):\n";
  out += strprintf("  %-32s %-44s %-34s %9s\n", "resource", "work", "rate", "seconds");
  for (const ResourceTime& t : b.resources) {
    out += strprintf("  %-32s %-44s %-34s %9.3f\n", t.resource.c_str(), t.work.c_str(), t.rate.c_str(), t.seconds);
  }
  out += strprintf("bound: %.3f s per step, by %s (at most %.0f tokens/s)\n", b.seconds, b.binding.c_str(),
                   b.seconds > 0 ? double(tokens) / b.seconds : 0.0);
  std::string src;
  for (const auto& [name, s, used] : std::vector<std::tuple<const char*, const std::string*, bool>>{
           {"device", &r.device_flops_source, w.flops > 0}, {"adam", &r.adam_source, w.adam_elems > 0},
           {"checksums", &r.checksum_source, w.checksum_bytes > 0},
           {"gradient adds", &r.grad_add_source, w.grad_add_elems > 0},
           {"h2d", &r.h2d_source, w.links.h2d > 0}, {"d2h", &r.d2h_source, w.links.d2h > 0},
           {"pcie", &r.pcie_both_source, w.links.h2d > 0 && w.links.d2h > 0},
           {"nvme read", &r.nvme_read_source, w.links.nvme_read > 0},
           {"nvme write", &r.nvme_write_source, w.links.nvme_write > 0},
           {"nvme both", &r.nvme_both_source, w.links.nvme_read > 0 && w.links.nvme_write > 0},
           {"network", &r.net_source, w.net_bytes > 0},
           {"intra-node", &r.intra_node_source, w.intra_node_bytes > 0}}) {
    if (used && !s->empty()) src += std::string(src.empty() ? "" : "; ") + name + ": " + *s;
  }
  return out + "  rates: " + src + "\n";
}

void check_plan_options(const PlanOptions& opt) {
  if (opt.world_size < 1) throw ConfigError("--world-size", "must be at least 1");
  if (opt.nodes < 1 || opt.world_size % opt.nodes != 0) {
    throw ConfigError("--nodes", strprintf("%d nodes do not divide --world-size %d into equal nodes", opt.nodes,
                                           opt.world_size));
  }
  if (!(opt.net_gbps > 0)) throw ConfigError("--net-gbps", "must be positive");
  if (!(opt.intra_node_gbps > 0)) throw ConfigError("--intra-node-gbps", "must be positive");
  for (auto [name, v] : {std::pair<const char*, double>{"--host-memory-gb", opt.host_memory_gb},
                         {"--nvme-gb", opt.nvme_gb}, {"--device-memory-gb", opt.device_memory_gb},
                         {"--probe-seconds", opt.probe_s}}) {
    if (v < 0 || std::isnan(v)) throw ConfigError(name, "must be a positive number");
  }
}

// The machine the flags describe (--host-memory-gb, --nvme-gb,
// --device-memory-gb, --gpu); what they leave out is measured.
GivenCapacity given_capacity(const PlanOptions& opt, const GpuPreset* preset) {
  GivenCapacity given;
  auto gb = [](double v) { return v > 0 ? int64_t(v * double(int64_t(1) << 30)) : int64_t(-1); };
  given.host_bytes = gb(opt.host_memory_gb);
  given.nvme_bytes = gb(opt.nvme_gb);
  given.device_bytes = gb(opt.device_memory_gb);
  if (preset != nullptr && given.device_bytes < 0) {
    // What a run finds free: the total less the CUDA context's.
    given.device_bytes = (preset->memory_mib - kCudaContextMib) << 20;
    given.device_source = strprintf("--gpu %s preset (%lld MiB, less %lld MiB for the CUDA context)", preset->name,
                                    (long long)preset->memory_mib, (long long)kCudaContextMib);
  }
  return given;
}

// The plan's step bound: its work, the rates (given or measured here) and
// the bound, a clipped step's too when the plan speculates.
struct PlanBound {
  bool bounded = false;
  StepWork work;
  StepBound bound, clipped;
  Rates rates;
};

// Work from the plan, rates given or measured on this machine (a GPU only
// when run.device is cuda and one is here). With placement auto the rates
// come first: auto compares its candidates by the bound, so `c` is computed
// again with them. Nothing is probed before the fit verdict: a plan that
// does not fit gets its shortfalls, not a probe's error (a disk too small for
// the state is too small for the probe's files too).
PlanBound bound_plan(const PlanOptions& opt, const Config& cfg, const GivenCapacity& given, int per_node,
                     Computed& c) {
  PlanBound b;
  b.bounded = !opt.no_bound && c.shortfalls.empty();
  if (!b.bounded) return b;
  b.rates = bound_rates(opt, cfg);
  b.work = predicted_work(cfg, c.plan, train_fetches(c.plan), c.net);
  const bool cpu_compute = cfg.run.device == DeviceKind::kCpu;
  std::unique_ptr<Device> gpu;
  Device* dev = &cpu_device();
  if (!cpu_compute) {
    DeviceMemoryInfo info;
    dev = nullptr;
    if (!missing_rates(union_work(b.work, c.plan, cfg.run.swap_checksums), b.rates, false).empty() &&
        query_device_memory("cuda", &info)) {
      gpu = make_device("cuda");
      dev = gpu.get();
    }
  }
  set_rates_cache("", opt.reprobe);
  // A described disk (--nvme-gb): this one only stands in for its rates.
  measure_rates(cfg, c.plan, dev, b.work, b.rates, opt.probe_s, ProbeRoom{given.nvme_bytes < 0, 1});
  // Auto placements, and NVMe state speculated into alternate slots (which
  // optimizer.speculate auto keeps only where the bound gains: Note
  // [Speculating NVMe state]), are decided again with the rates, as
  // strata train decides them.
  if (cfg.placement.auto_place || c.plan.optimizer.speculate_slots || weighs_host_activations(cfg, c.plan)) {
    c = compute(cfg, 0, per_node, given, &b.rates);
    b.work = predicted_work(cfg, c.plan, train_fetches(c.plan), c.net);
  }
  b.bound = step_bound(b.work, b.rates, cpu_compute);
  if (b.work.speculated_elems > 0) b.clipped = step_bound(clipped_work(b.work), b.rates, cpu_compute);
  return b;
}

void print_plan_json(const PlanOptions& opt, const Config& cfg, const Computed& c, const PlanBound& b,
                     const DataUse& data) {
  nlohmann::json j = plan_json(c);
  const int64_t step_tokens = cfg.train_micro_batch_size_per_gpu * cfg.model.seq_len * c.plan.step.accum;
  if (cfg.model.is_moe()) j["experts"] = experts_json(cfg.model, c.parameters, step_tokens);
  if (b.bounded) j["bound"] = bound_json(b.work, b.bound, b.rates);
  if (!opt.no_bound && !b.bounded) j["bound"] = nullptr;
  if (b.bounded && b.work.speculated_elems > 0) j["bound"]["clipped_step_seconds"] = b.clipped.seconds;
  if (!c.plan.state.auto_choice.empty()) j["auto_choice"] = c.plan.state.auto_choice;
  j["data"] = {{"files", cfg.data.paths.size()}, {"mapped_bytes", data.mapped_bytes},
               {"token_batch_bytes", c.plan.staging.tokens}, {"missing_files", data.missing}};
  j["nodes"] = opt.nodes;
  j["network"]["net_gbps"] = opt.net_gbps;
  j["network"]["seconds_per_step"] = double(c.net.world) * 8.0 / (opt.net_gbps * 1e9);
  j["network"]["intra_node_gbps"] = opt.intra_node_gbps;
  j["network"]["intra_node_seconds_per_step"] = double(c.net.node) * 8.0 / (opt.intra_node_gbps * 1e9);
  std::printf("%s\n", j.dump(2).c_str());
}

// The node's totals and the network's share of a step with ranks.
void print_ranks_text(const PlanOptions& opt, const Config& cfg, const Computed& c) {
  const int per_node = opt.world_size / opt.nodes;
  const double net_s = double(c.net.world) * 8.0 / (opt.net_gbps * 1e9);
  const double intra_s = double(c.net.node) * 8.0 / (opt.intra_node_gbps * 1e9);
  const auto tot = c.plan.total();
  std::printf("node total (%d ranks): device %s, host %s, nvme %s\n", per_node,
              cell(tot[0] * per_node).c_str(), cell(tot[1] * per_node).c_str(), cell(tot[2] * per_node).c_str());
  std::printf("network: each rank sends %s per step: %.3f s at %g Gbit/s%s; gradients reduced %s in %s\n",
              format_bytes(double(c.net.world)).c_str(), net_s, opt.net_gbps,
              opt.nodes > 1 ? "" : " (one node: loopback or NVLink in practice)",
              c.plan.step.schedule == StepSchedule::kLayer ? "once per step (the layer schedule)"
              : c.plan.comm.reduce_per_step ? "once per step (comm.gradient_reduction)"
                                       : "once per micro-batch (comm.gradient_reduction)",
              c.plan.comm.grad_bytes == 4 ? "fp32" : "16 bits (communication_data_type)");
  if (c.plan.comm.secondary_shard) {
    std::printf("secondary shard (comm.secondary_shard): the step's later gathers stay inside the node: "
                "each rank sends %s per step to its node's ranks: %.3f s at %g Gbit/s (--intra-node-gbps)\n",
                format_bytes(double(c.net.node)).c_str(), intra_s, opt.intra_node_gbps);
  } else if (opt.nodes > 1 && c.plan.stage == 3 && per_node > 1) {
    std::printf("secondary shard (comm.secondary_shard): off%s\n",
                cfg.comm.secondary_shard == SecondaryShard::kOff ? "" : " (does not fit)");
  }
}

void print_plan_text(const PlanOptions& opt, const Config& cfg, const Computed& c, const PlanBound& b,
                     const DataUse& data) {
  const int per_node = opt.world_size / opt.nodes;
  std::printf("Placement plan for %s (from %s keys), rank 0 of %d (%d per node, ZeRO stage %d)\n",
              opt.config_path.c_str(), c.plan.state.source.c_str(), opt.world_size, per_node, c.plan.stage);
  std::fputs(format_plan(c.plan, c.cap, c.shortfalls).c_str(), stdout);
  if (!c.plan.state.auto_choice.empty()) std::printf("auto placement: %s\n", c.plan.state.auto_choice.c_str());
  std::printf("data: %zu token file(s), %s mapped read-only (page cache, shared by a node's ranks; not in the "
              "totals); each rank's own: the token batches above%s\n",
              cfg.data.paths.size(), format_bytes(double(data.mapped_bytes)).c_str(),
              data.missing.empty() ? "" : strprintf(" (%zu not on this machine, not counted)", data.missing.size()).c_str());
  const int64_t step_tokens = cfg.train_micro_batch_size_per_gpu * cfg.model.seq_len * c.plan.step.accum;
  std::fputs(experts_text(cfg.model, c.parameters, step_tokens).c_str(), stdout);
  if (b.bounded) std::fputs(bound_text(b.bound, b.rates, b.work, step_tokens).c_str(), stdout);
  if (!opt.no_bound && !b.bounded) std::printf("step bound: not computed (the plan does not fit; nothing was probed)\n");
  if (b.bounded && b.work.speculated_elems > 0) {
    std::printf("  a clipped step (its speculation redone after the backward): %.3f s, by %s\n", b.clipped.seconds,
                b.clipped.binding.c_str());
  }
  if (opt.world_size > 1) print_ranks_text(opt, cfg, c);
}

int run_plan(const PlanOptions& opt) {
  setup_logging("warn", "");  // stderr: stdout carries the plan or its JSON
  check_plan_options(opt);
  const GpuPreset* preset = gpu_preset(opt.gpu);
  std::vector<std::string> overrides = opt.overrides;
  if (preset != nullptr) overrides.push_back("run.device=cuda");  // a plan for that GPU
  Config cfg = load_config(opt.config_path, overrides, opt.world_size);
  const int per_node = opt.world_size / opt.nodes;
  const GivenCapacity given = given_capacity(opt, preset);
  Computed c = compute(cfg, 0, per_node, given);
  const DataUse data = data_use(cfg);
  const PlanBound b = bound_plan(opt, cfg, given, per_node, c);
  if (opt.json) {
    print_plan_json(opt, cfg, c, b, data);
  } else {
    print_plan_text(opt, cfg, c, b, data);
  }
  return c.shortfalls.empty() ? kExitOk : kExitBadInput;
}

}  // namespace

namespace {

// format_plan's activation rows: the total and the rows the schedule decides
// (Note [Step schedules] in memory/schedule.h).
template <typename Row>
void activation_table_rows(const PlacementPlan& p, const Row& row, std::string& out) {
  const ActivationPlan& act = p.activations;
  row(strprintf("activations (%.6g layers kept)", double(act.packs() - act.recomputed_packs()) / double(act.micro)),
      act.bytes, 0, 0);
  const std::string held = p.step.held_micro > 1 ? strprintf(" (x%lld)", (long long)p.step.held_micro) : "";
  row("  saved inputs" + held, p.activations.checkpoint_activation_bytes, 0, 0);
  if (p.activations.held_output_grad_bytes > 0) row("  output grads" + held, p.activations.held_output_grad_bytes, 0, 0);
  if (p.activations.held_tied_grad_bytes > 0) row("  tied head grads" + held, p.activations.held_tied_grad_bytes, 0, 0);
  if (p.staging.ckpt_host > 0) row("  on the host" + held, p.staging.ckpt_device, p.staging.ckpt_host, 0);
  if (act.lent_packs > 0) {  // not in the totals: the gradients' memory (Note [Packs in gradient homes])
    out += strprintf("    in gradient homes    %12s %12s %12s  (not counted again: %lld micro-batches' entries)\n",
                     format_bytes(double(act.lent_packs * act.lend_stride)).c_str(), "-", "-",
                     (long long)act.lent_packs);
  }
}

}  // namespace

std::string format_plan(const PlacementPlan& p, const MachineCapacity& cap,
                        const std::vector<std::string>& shortfalls) {
  std::string out;
  auto row = [&](const std::string& name, int64_t d, int64_t h, int64_t n) {
    out += strprintf("  %-22s %12s %12s %12s\n", name.c_str(), cell(d).c_str(), cell(h).c_str(),
                     cell(n).c_str());
  };
  out += strprintf("  %-22s %12s %12s %12s\n", "", "device", "host", "nvme");
  for (int c = 0; c < kNumCategories; ++c) {
    const auto& b = p.state.bytes[size_t(c)];
    if (Category(c) == Category::kFrozen) {
      // Note [State kinds]: the frozen base's values, when there is one.
      if (p.state.frozen_space_numel > 0) row("frozen base", b[0], b[1], b[2]);
      continue;
    }
    // Under LoRA the trained categories are the adapters'.
    row(std::string(p.state.frozen_space_numel > 0 ? "adapter " : "") + category_name(Category(c)), b[0], b[1], b[2]);
  }
  const auto st = p.state.total();
  row("state total", st[0], st[1], st[2]);
  activation_table_rows(p, row, out);
  row("parameter window", p.staging.gathered, p.staging.window_bounce, 0);
  if (p.state.frozen_space_numel > 0) row("frozen base window", p.staging.frozen_gathered, p.staging.frozen_window_bounce, 0);
  row("gradient staging", p.staging.grad_stage + p.staging.grad_norms, p.staging.grad_host + p.staging.grad_rmw, 0);
  if (p.world_size > 1) {
    row("gathered blocks", p.staging.gather, 0, 0);
    if (p.staging.frozen_gather > 0) row("frozen base gathered", p.staging.frozen_gather, 0, 0);
    row("gradient reduction", p.staging.grad_sync, 0, 0);
    if (p.comm.staged) row("staged collectives", 0, p.staging.comm_host, 0);
    if (p.comm.reduce_per_step) row("gradients summed/step", p.staging.grad_accum, 0, 0);
    if (p.comm.secondary_shard) row("secondary shard", p.staging.secondary, 0, 0);
  } else if (p.staging.grad_accum > 0) {
    row("block gradient sum", p.staging.grad_accum, 0, 0);
  }
  row("optimizer staging", 0, p.staging.opt_grad + p.staging.opt_state + p.staging.opt_emit, 0);
  row("token batches", p.staging.tokens, p.staging.tokens, 0);
  if (p.staging.save_bounce > 0) row("checkpoint save buffer", 0, p.staging.save_bounce, 0);
  if (p.staging.save_snapshot > 0) row("checkpoint snapshots", 0, p.staging.save_snapshot, 0);
  const auto tot = p.total();
  row("total", tot[0], tot[1], tot[2]);
  out += strprintf("  %-22s %12s %12s %12s\n", "this machine has", cap_cell(cap.device_bytes).c_str(),
                   cap_cell(cap.host_bytes).c_str(), cap_cell(cap.nvme_bytes).c_str());
  if (cap.device_is_host) out += "  (CPU compute: the device tier is host memory)\n";
  if (!cap.device_is_host && !cap.device_source.empty()) out += "  (device memory: " + cap.device_source + ")\n";
  out += "  (host memory: " + cap.host_source + (p.world_size > 1 ? ", shared by the node's ranks" : "") +
         "; nvme: " + cap.nvme_source + ")\n";
  out += strprintf("  schedule: %s%s\n", schedule_name(p.step.schedule),
                   p.step.choice.empty() ? "" : (" (run.schedule auto: " + p.step.choice + ")").c_str());
  if (p.optimizer.speculate) {
    const int64_t n = speculated_numel(p), slots = speculated_slot_numel(p);
    std::string how;
    if (n > slots) {
      how = strprintf("two passes over %s elements of CPU Adam (the working copy beside the backward, master and "
                      "moments after the verdict)",
                      strprintf("%.4g M", double(n - slots) / 1e6).c_str());
    }
    if (slots > 0) {
      how += strprintf("%salternate swap slots for %s elements on NVMe (the new state written beside the backward, "
                       "committed by a flip; %s more disk)",
                       how.empty() ? "" : "; ", strprintf("%.4g M", double(slots) / 1e6).c_str(),
                       format_bytes(double(p.optimizer.nvme_spare_bytes)).c_str());
    }
    out += strprintf("  optimizer behind the backward: %s: %s%s\n", p.optimizer.speculate_choice.c_str(), how.c_str(),
                     n < p.state.shard_space_numel ? "; the pieces in HBM wait for the verdict" : "");
  } else {
    out += strprintf("  optimizer behind the backward: %s\n", p.optimizer.speculate_choice.c_str());
  }
  out += strprintf("  optimizer sub-groups of %lld elements; Adam moments in %s; swap directories: %s\n",
                   (long long)p.state.sub_group_numel,
                   p.state.bf16_moments() ? "bf16 (stochastic rounding)" : "fp32",
                   p.state.nvme_paths.empty() ? "none" : nlohmann::json(p.state.nvme_paths).dump().c_str());
  if (shortfalls.empty()) {
    out += "verdict: fits\n";
  } else {
    out += "verdict: does not fit\n";
    for (const std::string& s : shortfalls) out += "  " + s + "\n";
  }
  return out;
}


PlacementPlan check_plan_fits(const Config& cfg, int rank, int local_ranks, const Device* device) {
  const Rates rates = rates_from_config(cfg.run.rates);
  Computed c = compute(cfg, rank, local_ranks, GivenCapacity{}, &rates, device);
  if (c.shortfalls.empty()) return c.plan;
  std::string msg = "the placement plan does not fit this machine (see `strata plan`): ";
  for (size_t i = 0; i < c.shortfalls.size(); ++i) msg += (i ? "; " : "") + c.shortfalls[i];
  throw ConfigError("", msg);
}

void register_plan(CLI::App& app, int& result) {
  auto opt = std::make_shared<PlanOptions>();
  CLI::App* cmd = app.add_subcommand(
      "plan", "Print where each state category goes, the staging and activation memory, and whether it fits");
  cmd->add_option("config", opt->config_path, "JSON config file")->required();
  cmd->add_option("--set", opt->overrides, "Override a config key")->type_name("KEY=VALUE");
  cmd->add_flag("--json", opt->json, "Print the plan as one JSON object");
  cmd->add_option("--world-size", opt->world_size, "Plan for this many ranks (one rank's plan, the node's total)");
  cmd->add_option("--nodes", opt->nodes, "Nodes the ranks are spread over (each plans with its node's share)");
  cmd->add_option("--net-gbps", opt->net_gbps, "Network bandwidth per rank for the communication time (Gbit/s)")
      ->each([opt](const std::string&) { opt->net_given = true; });
  cmd->add_option("--intra-node-gbps", opt->intra_node_gbps,
                  "Bandwidth per rank between the ranks of a node, for the secondary shard's gathers (Gbit/s; "
                  "default 3600, NVLink 4)")
      ->each([opt](const std::string&) { opt->intra_node_given = true; });
  cmd->add_option("--host-memory-gb", opt->host_memory_gb, "Plan for a node with this much RAM (GiB), not this one");
  cmd->add_option("--nvme-gb", opt->nvme_gb, "Plan for a node with this much free NVMe (GiB) under the swap directories");
  cmd->add_option("--device-memory-gb", opt->device_memory_gb, "Plan for GPUs with this much memory each (GiB)");
  cmd->add_option("--gpu", opt->gpu,
                  "Plan for this GPU, described instead of measured: h100-sxm, h100-pcie, h200, a100-80g, a100-40g, "
                  "l40s, rtx-4090, gh200 (its memory, compute and host-link rates; docs/planning.md)");
  cmd->add_flag("--no-bound", opt->no_bound, "Skip the step's bound (no probes)");
  cmd->add_option("--probe-seconds", opt->probe_s, "Time each rate probe takes (default 0.5)");
  cmd->add_flag("--reprobe", opt->reprobe,
                "Measure the rates again instead of taking those an earlier run on this machine kept");
  cmd->add_option("--nvme-gbps", opt->nvme_gbps, "NVMe read and write rate in the swap directories (GB/s)");
  for (const RateSpec& s : kRateTable) {
    if (s.kind == RateKind::kNet || s.kind == RateKind::kIntraNode) continue;  // with their defaults, above
    cmd->add_option(s.flag, opt->rates[size_t(s.kind)], s.help);
  }
  cmd->callback([opt, &result]() { result = run_plan(*opt); });
}

}  // namespace strata
