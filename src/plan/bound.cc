#include "plan/bound.h"

#include <algorithm>
#include <functional>
#include <thread>

#include "memory/param_window.h"
#include "util/errors.h"
#include "util/logging.h"

namespace strata {

double step_flops(const ModelConfig& m, int64_t tokens, int64_t recomputed_layers) {
  const double d = double(m.dim), q = double(m.q_dim()), kv = double(m.kv_heads() * m.head_dim());
  const double v = double(m.vocab_size), t = double(m.seq_len);
  // Forward FLOPs per token: 2 per multiply-add of each matrix, and the
  // attention's two T x head_dim products per head (causal halving ignored).
  // With experts, the matrices a token meets: its top k experts', the
  // router's and the shared expert's (ModelConfig::mlp_active_params).
  const double layer_matrices = d * q + 2 * d * kv + q * d + m.mlp_active_params();
  const double down = m.mlp_down_active_params();
  const double layer_fwd = 2 * layer_matrices + 4 * t * q;
  const double fwd = double(m.n_layers) * layer_fwd + 2 * v * d;  // the head's matrix, tied or not
  if (m.lora.enabled) {
    // LoRA (docs/design.md, "LoRA layers"): the frozen matrices' backward is
    // their input gradients only (2 a parameter, not 4); the adapters' A and
    // B cost 2 forward and 4 backward a parameter; the attention core its
    // full forward and backward. A recompute skips the base's down
    // projection and its adapter's B, not the adapter's middle.
    const double adapters = double(lora_layer_params(m));
    const double fwd_layer = layer_fwd + 2 * adapters;
    const double bwd_layer = 2 * layer_matrices + 4 * adapters + 8 * t * q;
    const double down_b = m.lora.targets_module(LoraModule::kDown) ? 2 * d * double(m.lora.r) : 0.0;
    const double step = double(m.n_layers) * (fwd_layer + bwd_layer) + 4 * v * d;
    return double(tokens) * (step + double(recomputed_layers) * (fwd_layer - 2 * down - down_b));
  }
  // Backward is twice the forward; a recomputed layer runs its forward again
  // but for its down projections (d x f, or the experts').
  return double(tokens) * (3 * fwd + double(recomputed_layers) * (layer_fwd - 2 * down));
}

double forward_flops(const ModelConfig& m, int64_t tokens) {
  if (!m.lora.enabled) return step_flops(m, tokens, 0) / 3;  // the backward is twice the forward
  // LoRA: the forward with the adapters' (step_flops' LoRA terms).
  const double d = double(m.dim), q = double(m.q_dim()), kv = double(m.kv_heads() * m.head_dim());
  const double v = double(m.vocab_size), t = double(m.seq_len);
  const double layer_fwd =
      2 * (d * q + 2 * d * kv + q * d + m.mlp_active_params()) + 4 * t * q + 2 * double(lora_layer_params(m));
  return double(tokens) * (double(m.n_layers) * layer_fwd + 2 * v * d);
}

namespace {

// Rates' members in the rates table's order (config/rates.h).
constexpr double Rates::* kRateValues[kNumRates] = {
    &Rates::device_flops, &Rates::h2d,  &Rates::d2h,      &Rates::pcie_both, &Rates::nvme_read, &Rates::nvme_write,
    &Rates::nvme_both,    &Rates::adam, &Rates::checksum, &Rates::grad_add,  &Rates::net,       &Rates::intra_node};
constexpr std::string Rates::* kRateSources[kNumRates] = {
    &Rates::device_flops_source, &Rates::h2d_source,      &Rates::d2h_source,  &Rates::pcie_both_source,
    &Rates::nvme_read_source,    &Rates::nvme_write_source, &Rates::nvme_both_source, &Rates::adam_source,
    &Rates::checksum_source,     &Rates::grad_add_source,   &Rates::net_source,  &Rates::intra_node_source};

}  // namespace

double& Rates::value(RateKind k) { return this->*kRateValues[size_t(k)]; }
std::string& Rates::source(RateKind k) { return this->*kRateSources[size_t(k)]; }

Rates rates_from_config(const RateOverrides& o) {
  Rates r;
  for (const RateSpec& s : kRateTable) {
    if (o[s.kind] > 0) r.value(s.kind) = o[s.kind] * s.scale, r.source(s.kind) = std::string("run.rates.") + s.key;
  }
  return r;
}

namespace {

// A ring all_gather / reduce_scatter of `count` elements of `eb` bytes per
// rank, and a ring all_reduce of `count`: what one rank sends (the
// communicators' ring_gather_bytes and ring_all_reduce_bytes, in
// comm/communicator.h, count the same).
int64_t gather_bytes(int ranks, int64_t count, int eb) { return int64_t(ranks - 1) * count * eb; }
int64_t all_reduce_bytes(int ranks, int64_t count, int eb) {
  return ranks <= 1 ? 0 : 2 * int64_t(ranks - 1) * count * eb / ranks;
}

}  // namespace

// Bytes one rank sends per training step, from the step's schedule of uses
// (Note [Gathered blocks] in engine/trainer.h): the param16 all-gathers
// (stage 3: every use, or once per step for blocks kept gathered; stages 1-2:
// each block once per step), stage 3's frozen parts' at every use (Note
// [Frozen shards] in engine/gathered_blocks.h), one gradient
// reduction per block per micro-batch, or per step with
// CommPlan::reduce_per_step (reduce-scatter at stages 2-3, all-reduce
// at 0-1), and the all-reduce of the norm, loss and stop flag. With the
// secondary shard, a block's first gather of the step spans the world and its
// later ones the node (count: the block / ranks per node). Ring collectives,
// the byte counts the communicators report as net_bytes and intra_node_bytes.
NetworkBytes step_network_bytes(const PlacementPlan& p) {
  const int ws = p.world_size;
  NetworkBytes out;
  if (ws <= 1) return out;
  const int param_t = p.param_bytes();
  int64_t& bytes = out.world;
  if (p.shards > 1) {
    if (p.stage == 3) {
      const auto uses = plan_train_schedule(p);
      std::vector<char> seen(p.block_numel.size(), 0);
      for (size_t k = 0; k < uses.size(); ++k) {
        const StepOp& u = uses[k];
        // A use of the blocks the use before it had reads its gathered copy
        // (the layer schedule's micro-batches of one block).
        if (k > 0 && u.count == uses[k - 1].count && u.block[0] == uses[k - 1].block[0] &&
            u.block[1] == uses[k - 1].block[1]) {
          continue;
        }
        for (int i = 0; i < u.count; ++i) {
          const size_t b = size_t(u.block[i]);
          // Note [Frozen shards]: a frozen part is gathered at every use, across the world.
          if (p.frozen_shards > 1) bytes += gather_bytes(ws, p.frozen_block_numel[b], p.compute_bytes);
          if (!p.comm.keep_gathered.empty() && p.comm.keep_gathered[b]) continue;  // once per step, below
          if (p.comm.secondary_shard && seen[b]) {
            out.node += gather_bytes(p.ranks_per_node, p.block_numel[b] * p.nodes(), param_t);
          } else {
            bytes += gather_bytes(ws, p.block_numel[b], param_t);
          }
          seen[b] = 1;
        }
      }
      for (size_t b = 0; b < p.comm.keep_gathered.size(); ++b) {
        if (p.comm.keep_gathered[b]) bytes += gather_bytes(ws, p.block_numel[b], param_t);
      }
    } else {
      for (int64_t shard : p.block_numel) bytes += gather_bytes(ws, shard, param_t);
    }
  }
  const int grad_t = p.comm.grad_bytes;  // communication_data_type
  // comm.gradient_reduction; the layer schedule reduces each block once per step.
  const int64_t reductions = p.step.hand_offs_per_step(p.comm.reduce_per_step);
  for (int64_t shard : p.block_numel) {
    bytes += reductions * (p.stage >= 2 ? gather_bytes(ws, shard, grad_t)
                                     : all_reduce_bytes(ws, shard * p.shards, grad_t));
  }
  bytes += all_reduce_bytes(ws, p.step_sums, 8) + all_reduce_bytes(ws, p.expert_load_sums, 8);
  return out;
}

std::vector<int64_t> train_fetches(const PlacementPlan& plan) {
  std::unique_ptr<ParamWindow> w = make_param_window(plan);
  const std::vector<StepOp> train = plan_train_schedule(plan);
  w->plan({&train});
  return w->planned_fetches();
}

namespace {

// Elements of unit `u` inside [begin, begin + n).
int64_t overlap(const PlacementUnit& u, int64_t begin, int64_t n) {
  return std::max<int64_t>(0, std::min(u.offset + u.numel, begin + n) - std::max(u.offset, begin));
}

// Elements of category `c` on tier `t` inside [begin, begin + n).
int64_t on_tier(const PlacementPlan& p, Category c, Tier t, int64_t begin, int64_t n) {
  int64_t s = 0;
  for (const PlacementUnit& u : p.state.units[size_t(c)]) {
    if (u.tier == t) s += overlap(u, begin, n);
  }
  return s;
}

// The optimizer's part of one step under `p`: CPU Adam's elements (and what
// it speculates) and the bytes its pieces move, into w.optimizer_links.
void optimizer_work(const PlacementPlan& p, StepWork& w) {
  LinkBytes& o = w.optimizer_links;
  const int64_t c = p.param_bytes();
  const int64_t m = p.state.elem_bytes[size_t(Category::kExpAvg)];
  const std::vector<PlacementUnit>& p16 = p.state.units[size_t(Category::kParam16)];
  const int64_t moment[3] = {4, m, m};
  const Category opt[3] = {Category::kMaster, Category::kExpAvg, Category::kExpAvgSq};
  // Block 0's range of the shard space: its pieces' speculation ends last.
  const PlacementUnit& first_block = p16.front();
  for (const PlacementUnit& piece : pipeline_pieces(p)) {
    const int64_t at = piece.offset, n = piece.numel;
    bool all_device = true;
    for (Category cat : {Category::kParam16, Category::kGrad, Category::kMaster, Category::kExpAvg, Category::kExpAvgSq}) {
      if (on_tier(p, cat, Tier::kDevice, at, n) != n) all_device = false;
    }
    // The device's own Adam (on a GPU) or CPU Adam in place (on the CPU device).
    if (all_device && !p.device_addressable) continue;
    // A speculated piece is stepped twice (Note [Speculative optimizer]):
    // beside the backward, and again to commit (or redo) it, reading its
    // state twice and writing it once; once when it speculates into
    // alternate swap slots (a commit flips them), twice only when redone
    // (clipped_work).
    const bool slots = speculates_in_slots(p, piece);
    const int64_t passes = p.optimizer.speculate && !slots ? 2 : 1;
    w.adam_elems += n * passes;
    if (p.optimizer.speculate) {
      w.speculated_elems += n;
      w.speculation_tail_elems += overlap(first_block, at, n);
      if (slots) w.slot_elems += n;
    }
    if (all_device) continue;
    LinkBytes one;  // the piece's bytes
    for (int k = 0; k < 3; ++k) {
      const int64_t dev = on_tier(p, opt[k], Tier::kDevice, at, n), nv = on_tier(p, opt[k], Tier::kNvme, at, n);
      if (!p.device_addressable) one.h2d += moment[k] * dev, one.d2h += moment[k] * dev * passes;
      one.nvme_read += moment[k] * nv * passes;
      one.nvme_write += moment[k] * nv;
    }
    const int64_t g_dev = on_tier(p, Category::kGrad, Tier::kDevice, at, n);
    const int64_t w_dev = on_tier(p, Category::kParam16, Tier::kDevice, at, n);
    if (!p.device_addressable) one.d2h += 4 * g_dev * passes, one.h2d += c * w_dev;
    one.nvme_read += 4 * on_tier(p, Category::kGrad, Tier::kNvme, at, n) * passes;
    one.nvme_write += c * on_tier(p, Category::kParam16, Tier::kNvme, at, n);
    o += one;
    if (slots) w.slot_links += one;
  }
}

}  // namespace

// Docs/design.md "Bytes per link" is the table this follows, row by row; on
// the CPU device (host-addressable) the optimizer's device-tier state is used
// in place, so its rows move nothing.
StepWork predicted_work(const Config& cfg, const PlacementPlan& p, const std::vector<int64_t>& fetches,
                        const NetworkBytes& net) {
  StepWork w;
  const int64_t A = std::max<int64_t>(p.step.accum, 1);
  const int64_t tokens = cfg.train_micro_batch_size_per_gpu * cfg.model.seq_len;
  // A recomputed pack: its layer's forward again, for its micro-batch.
  w.flops = double(A) * step_flops(cfg.model, tokens, 0) +
            double(p.activations.recomputed_packs()) * p.activations.layer_recompute_flops;
  // The forward the optimizer of the step before overlaps (Note [Optimizer
  // overlap]): until the last block's forward, the first micro-batch's under
  // micro_batch, every micro-batch's under layer (Note [Step schedules]).
  // The forward is a third of forward + backward.
  w.first_forward_flops = double(p.step.held_micro) * forward_flops(cfg.model, tokens);
  w.overlap_optimizer = optimizer_overlaps(cfg, p);
  w.cpu_threads = cfg.run.threads > 0 ? int(cfg.run.threads) : std::max(1, int(std::thread::hardware_concurrency()));
  w.net_bytes = net.world;
  w.intra_node_bytes = net.node;
  LinkBytes& e = w.links;
  const int64_t c = p.param_bytes();
  const std::vector<PlacementUnit>& p16 = p.state.units[size_t(Category::kParam16)];
  const std::vector<PlacementUnit>& grad = p.state.units[size_t(Category::kGrad)];
  STRATA_CHECK(fetches.size() == p16.size(), "one fetch count per block");
  for (size_t b = 0; b < p16.size(); ++b) {
    const int64_t n = p16[b].numel, F = fetches[b];
    if (p16[b].tier == Tier::kHost) e.h2d += c * n * F;
    if (p16[b].tier == Tier::kNvme) e.nvme_read += c * n * F, e.h2d += c * n * F;
    const int64_t wire = grad_wire_bytes(p, b);
    // Gradients land in their home once per micro-batch, or once per step
    // when ranks reduce once per step (CommPlan::reduce_per_step) and
    // under the layer schedule (summed on the device first).
    const int64_t G = p.step.hand_offs_per_step(p.comm.reduce_per_step);
    if (grad[b].tier != Tier::kDevice) e.d2h += wire * grad[b].numel * G, w.grad_add_elems += grad[b].numel * G;
    if (grad[b].tier == Tier::kNvme) e.nvme_write += 4 * grad[b].numel * G, e.nvme_read += 4 * grad[b].numel * (G - 1);
  }
  // Note [State kinds]: the frozen base's fetches, reads only; a persistent
  // frozen block is fetched once per run (its window is never invalidated).
  if (std::unique_ptr<ParamWindow> fw = make_frozen_window(p)) {
    const std::vector<StepOp> train = plan_train_schedule(p);
    fw->plan({&train});
    const std::vector<PlacementUnit>& fu = p.state.units[size_t(Category::kFrozen)];
    const int64_t fb = p.state.elem_bytes[size_t(Category::kFrozen)];
    for (size_t b = 0; b < fu.size(); ++b) {
      const int64_t F = fw->persistent(int32_t(b)) ? 0 : fw->planned_fetches()[b];
      if (fu[b].tier == Tier::kHost) e.h2d += fb * fu[b].numel * F;
      if (fu[b].tier == Tier::kNvme) e.nvme_read += fb * fu[b].numel * F, e.h2d += fb * fu[b].numel * F;
    }
  }
  // What the layers keep in host RAM (Note [Activation placement] in
  // memory/placement.h) goes down in the forward and up in the backward.
  w.activation_link_bytes = p.activations.host_link_bytes();
  w.forward_flops = double(A) * forward_flops(cfg.model, tokens);
  e.d2h += w.activation_link_bytes;
  e.h2d += w.activation_link_bytes;
  optimizer_work(p, w);  // into w.optimizer_links, added to the links below
  const LinkBytes& o = w.optimizer_links;
  e += o;
  if (cfg.run.swap_checksums) {
    w.checksum_bytes = e.nvme_read + e.nvme_write;
    w.optimizer_checksum_bytes = o.nvme_read + o.nvme_write;
  }
  return w;
}

StepWork clipped_work(const StepWork& w) {
  StepWork c = w;
  c.clipped = true;
  // The pieces in alternate swap slots are stepped again, their state read
  // again and written in place (Note [Alternate swap slots] in
  // memory/tiered_state.h); two-pass pieces count their second pass already.
  c.adam_elems += w.slot_elems;
  c.links += w.slot_links;
  c.optimizer_links += w.slot_links;
  if (w.checksum_bytes > 0 || w.optimizer_checksum_bytes > 0) {
    c.checksum_bytes += w.slot_links.nvme_read + w.slot_links.nvme_write;
    c.optimizer_checksum_bytes += w.slot_links.nvme_read + w.slot_links.nvme_write;
  }
  return c;
}

namespace {

std::string flops_text(double f) {
  if (f >= 1e15) return strprintf("%.3g PFLOP", f / 1e15);
  if (f >= 1e12) return strprintf("%.3g TFLOP", f / 1e12);
  return strprintf("%.3g GFLOP", f / 1e9);
}
std::string bytes_text(double b) { return format_bytes(b); }
std::string elems_text(double n) {
  return n >= 1e9 ? strprintf("%.3g G elements", n / 1e9) : strprintf("%.3g M elements", n / 1e6);
}
std::string gbps_text(double r) { return strprintf("%.3g GB/s", r / 1e9); }

// The disk's time for `l`'s NVMe bytes: reads alone, writes alone, or both
// at the aggregate rate, whichever is longest.
double nvme_seconds(const LinkBytes& l, const Rates& r) {
  double s = 0;
  if (l.nvme_read > 0) s = std::max(s, double(l.nvme_read) / r.nvme_read);
  if (l.nvme_write > 0) s = std::max(s, double(l.nvme_write) / r.nvme_write);
  if (l.nvme_read > 0 && l.nvme_write > 0) s = std::max(s, double(l.nvme_read + l.nvme_write) / r.nvme_both);
  return s;
}

}  // namespace

std::vector<std::string> missing_rates(const StepWork& w, const Rates& r, bool cpu_compute) {
  std::vector<std::string> out;
  if (w.flops > 0 && !(r.device_flops > 0)) out.push_back("--device-tflops");
  if (w.adam_elems > 0 && !(r.adam > 0)) out.push_back("--adam-gelems");
  if (w.checksum_bytes > 0 && !(r.checksum > 0)) out.push_back("--checksum-gbps");
  if (w.grad_add_elems > 0 && !(r.grad_add > 0)) out.push_back("--grad-add-gelems");
  if (w.links.h2d > 0 && !(r.h2d > 0)) out.push_back("--h2d-gbps");
  if (w.links.d2h > 0 && !(r.d2h > 0)) out.push_back("--d2h-gbps");
  if (!cpu_compute && w.links.h2d > 0 && w.links.d2h > 0 && !(r.pcie_both > 0)) out.push_back("--pcie-both-gbps");
  if (w.links.nvme_read > 0 && !(r.nvme_read > 0)) out.push_back("--nvme-read-gbps");
  if (w.links.nvme_write > 0 && !(r.nvme_write > 0)) out.push_back("--nvme-write-gbps");
  if (w.links.nvme_read > 0 && w.links.nvme_write > 0 && !(r.nvme_both > 0)) out.push_back("--nvme-both-gbps");
  if (w.net_bytes > 0 && !(r.net > 0)) out.push_back("--net-gbps");
  if (w.intra_node_bytes > 0 && !(r.intra_node > 0)) out.push_back("--intra-node-gbps");
  return out;
}

namespace {

// The seconds each kind of work takes at its rate, shared by the rows of the
// bound and its dependencies.
struct WorkSeconds {
  double compute = 0, adam = 0, checksum = 0, optimizer_checksum = 0;
  // On CPU compute: the copies (memcpy on the compute's thread) and the
  // lander's gradient adds as the cores' time; 0 on a GPU.
  double landing = 0;
  double grad_add = 0;  // the lander's one thread
};

WorkSeconds work_seconds(const StepWork& w, const Rates& r, bool cpu_compute) {
  WorkSeconds t;
  t.compute = w.flops > 0 ? w.flops / r.device_flops : 0.0;
  t.adam = w.adam_elems > 0 ? double(w.adam_elems) / r.adam : 0.0;
  t.checksum = w.checksum_bytes > 0 ? double(w.checksum_bytes) / r.checksum : 0.0;
  t.optimizer_checksum = w.optimizer_checksum_bytes > 0 ? double(w.optimizer_checksum_bytes) / r.checksum : 0.0;
  // On CPU compute, H2D and D2H are memcpy on the compute's thread (the
  // CPU device copies in the calling thread: the window's fetches, the
  // gradients' landing), between its parallel regions: their whole seconds.
  const double copies_s = !cpu_compute ? 0.0
                                       : (w.links.h2d > 0 ? double(w.links.h2d) / r.h2d : 0.0) +
                                             (w.links.d2h > 0 ? double(w.links.d2h) / r.d2h : 0.0);
  // The lander's adds of landed gradients into their host homes: one thread,
  // beside the backward.
  t.grad_add = w.grad_add_elems > 0 ? double(w.grad_add_elems) / r.grad_add : 0.0;
  // With CPU compute the adds are the lander's work beside the compute's
  // threads: their share of the cores' time is their CPU time over the
  // pool's threads.
  t.landing = cpu_compute ? copies_s + t.grad_add / std::max(1, w.cpu_threads) : 0.0;
  return t;
}

using AddRow = std::function<void(std::string, std::string, std::string, double)>;

// The rows of the resources with work: one pool of cores on CPU compute, the
// device and the host's apart on a GPU; the links, the disk, the network.
void add_resources(const StepWork& w, const Rates& r, bool cpu_compute, const WorkSeconds& t, const AddRow& add) {
  const bool checksums = w.checksum_bytes > 0;
  const std::string checksum_work = checksums ? " + " + bytes_text(double(w.checksum_bytes)) + " checksummed" : "";
  const std::string checksum_rate = checksums ? " + " + gbps_text(r.checksum) + " CRC-32C" : "";
  const std::string grad_add_rate = w.grad_add_elems > 0 ? strprintf("%.3g G elements/s", r.grad_add / 1e9) : "";
  if (cpu_compute) {
    // One pool of cores and memory bandwidth does all of it.
    const bool copies = w.links.h2d > 0 || w.links.d2h > 0;
    std::string name = "cpu (compute + Adam", work = flops_text(w.flops) + " + " + elems_text(double(w.adam_elems));
    std::string rate = strprintf("%.3g TFLOP/s + %.3g G elements/s", r.device_flops / 1e12, r.adam / 1e9);
    if (copies) {
      name += " + copies";
      work += " + " + bytes_text(double(w.links.h2d + w.links.d2h)) + " copied";
      if (w.links.h2d > 0) rate += " + " + gbps_text(r.h2d) + " h2d";
      if (w.links.d2h > 0) rate += " + " + gbps_text(r.d2h) + " d2h";
    }
    if (w.grad_add_elems > 0) {
      name += " + gradient adds";
      work += " + " + elems_text(double(w.grad_add_elems)) + " added";
      rate += " + " + grad_add_rate + " adds";
    }
    if (w.grad_add_elems > 0) rate += strprintf(" (adds: 1 of %d threads)", std::max(1, w.cpu_threads));
    if (checksums) name += " + checksums";
    add(name + ")", work + checksum_work, rate + checksum_rate,
        t.compute + t.adam + t.landing + t.checksum);
  } else {
    if (w.flops > 0) add("device", flops_text(w.flops), strprintf("%.3g TFLOP/s", r.device_flops / 1e12), t.compute);
    if (w.adam_elems > 0 || checksums) {
      add(checksums ? "cpu (Adam + checksums)" : "cpu adam", elems_text(double(w.adam_elems)) + checksum_work,
          strprintf("%.3g G elements/s", r.adam / 1e9) + checksum_rate, t.adam + t.checksum);
    }
    // Its own thread on the host; the compute does not wait for it until the
    // step's last landing, so it is a resource, not a step of the dependencies.
    if (w.grad_add_elems > 0) {
      add("host gradient adds", elems_text(double(w.grad_add_elems)) + " added", grad_add_rate, t.grad_add);
    }
  }
  if (!cpu_compute && w.links.h2d > 0) add("h2d", bytes_text(double(w.links.h2d)), gbps_text(r.h2d), double(w.links.h2d) / r.h2d);
  if (!cpu_compute && w.links.d2h > 0) add("d2h", bytes_text(double(w.links.d2h)), gbps_text(r.d2h), double(w.links.d2h) / r.d2h);
  if (!cpu_compute && w.links.h2d > 0 && w.links.d2h > 0) {
    const double both = double(w.links.h2d + w.links.d2h);
    add("pcie (h2d + d2h)", bytes_text(both), gbps_text(r.pcie_both), both / r.pcie_both);
  }
  if (w.links.nvme_read > 0 || w.links.nvme_write > 0) {
    add("nvme (read + write)",
        bytes_text(double(w.links.nvme_read)) + " read + " + bytes_text(double(w.links.nvme_write)) + " written",
        gbps_text(r.nvme_read) + " read, " + gbps_text(r.nvme_write) + " write" +
            (w.links.nvme_read > 0 && w.links.nvme_write > 0 ? ", " + gbps_text(r.nvme_both) + " both" : ""),
        nvme_seconds(w.links, r));
  }
  if (w.net_bytes > 0) add("network", bytes_text(double(w.net_bytes)), gbps_text(r.net), double(w.net_bytes) / r.net);
  if (w.intra_node_bytes > 0) {
    add("intra-node", bytes_text(double(w.intra_node_bytes)), gbps_text(r.intra_node),
        double(w.intra_node_bytes) / r.intra_node);
  }
}

// The step's dependencies (see the header): the optimizer of step s between
// its backward and step s+1's forward; 0 when there is no work.
void add_dependencies(const StepWork& w, const Rates& r, bool cpu_compute, const WorkSeconds& t, const AddRow& add) {
  const double compute_s = t.compute, adam_s = t.adam, landing_s = t.landing;
  // The dependencies (see the header): the optimizer's own time is the
  // longest of its resources (its pipeline overlaps reads, Adam and writes).
  const LinkBytes& o = w.optimizer_links;
  double opt_io = nvme_seconds(o, r);
  if (!cpu_compute) {
    if (o.h2d > 0) opt_io = std::max(opt_io, double(o.h2d) / r.h2d);
    if (o.d2h > 0) opt_io = std::max(opt_io, double(o.d2h) / r.d2h);
    if (o.h2d > 0 && o.d2h > 0) opt_io = std::max(opt_io, double(o.h2d + o.d2h) / r.pcie_both);
  }
  const double fwd = w.first_forward_flops > 0 ? std::min(w.first_forward_flops / r.device_flops, compute_s) : 0.0;
  double path = 0;
  // The optimizer's thread checksums its pieces between their updates.
  const double opt_cpu = adam_s + t.optimizer_checksum;
  // On CPU compute the cores make the step's copies and gradient adds too
  // (the fetches in the forward, the gradients' landing in the backward):
  // landing_s, 0 on a GPU.
  // Note [Speculative optimizer]: a committed step's optimizer runs beside
  // the backward and the next step's compute (its seconds are the
  // resources' rows); the step waits only for the last block's
  // speculation, after the backward. A clipped step is redone after the
  // backward: the overlapped optimizer's path, the speculation wasted.
  const bool speculated = w.speculated_elems > 0 && w.overlap_optimizer && !w.clipped;
  const double spec_share = w.speculated_elems > 0 ? double(w.speculation_tail_elems) / double(w.speculated_elems) : 0.0;
  // The speculation's pass: its share of CPU Adam's elements (half of them
  // by two passes, all of them in alternate swap slots).
  const double pass_share = w.adam_elems > 0 ? std::min(1.0, double(w.speculated_elems) / double(w.adam_elems)) : 0.0;
  const double tail_s = spec_share * std::max(opt_cpu, opt_io) * pass_share;
  // A redo's optimizer is one pass of the two counted.
  const double redo_cpu = w.speculated_elems > 0 ? opt_cpu - double(w.speculated_elems) / r.adam : opt_cpu;
  if (!w.overlap_optimizer) {
    path = compute_s + landing_s + std::max(opt_cpu, opt_io);
  } else if (speculated) {
    // On CPU compute the cores run both passes beside the compute.
    path = cpu_compute ? std::max(compute_s + landing_s + opt_cpu, opt_io) : compute_s + tail_s;
  } else if (cpu_compute) {  // the forward and CPU Adam share the cores
    path = std::max(fwd + redo_cpu, opt_io) + (compute_s - fwd) + landing_s;
  } else {
    path = std::max(fwd, std::max(redo_cpu, opt_io)) + (compute_s - fwd);
  }
  // Note [Activation copies] (in the header).
  if (!cpu_compute && w.activation_link_bytes > 0) {
    const double fwd_all = std::min(w.forward_flops / r.device_flops, compute_s);
    const double down = double(w.activation_link_bytes) / r.d2h, up = double(w.activation_link_bytes) / r.h2d;
    add("activation copies", "max(forwards, their D2H) + max(backwards, their H2D)",
        strprintf("forwards %.3f s, D2H %.3f s; backwards %.3f s, H2D %.3f s", fwd_all, down, compute_s - fwd_all, up),
        std::max(fwd_all, down) + std::max(compute_s - fwd_all, up));
  }
  if (path > 0) {
    if (speculated) {
      add("dependencies", cpu_compute ? "compute + both optimizer passes (one pool of cores)"
                                      : "compute + the last block's speculation (optimizer behind the backward)",
          strprintf("speculation tail %.3f s", tail_s), path);
    } else {
      add("dependencies",
          w.overlap_optimizer ? (w.clipped ? "max(first forward, optimizer redone) + rest of compute"
                                           : "max(first forward, optimizer) + rest of compute")
                              : "compute, then the optimizer (not overlapped)",
          strprintf("optimizer %.3f s, first forward %.3f s", std::max(w.clipped ? redo_cpu : opt_cpu, opt_io), fwd),
          path);
    }
  }
}

}  // namespace

StepBound step_bound(const StepWork& w, const Rates& r, bool cpu_compute) {
  const std::vector<std::string> missing = missing_rates(w, r, cpu_compute);
  STRATA_CHECK(missing.empty(), "step_bound without a rate for " + missing.front());
  StepBound b;
  const AddRow add = [&](std::string name, std::string work, std::string rate, double s) {
    b.resources.push_back({std::move(name), std::move(work), std::move(rate), s});
  };
  const WorkSeconds t = work_seconds(w, r, cpu_compute);
  add_resources(w, r, cpu_compute, t, add);
  add_dependencies(w, r, cpu_compute, t, add);
  // The first of equal times binds (the dependencies equal the cores' time
  // when nothing overlaps, up to rounding).
  for (const ResourceTime& t : b.resources) {
    if (t.seconds > b.seconds * (1 + 1e-9)) b.seconds = t.seconds, b.binding = t.resource;
  }
  return b;
}

}  // namespace strata
