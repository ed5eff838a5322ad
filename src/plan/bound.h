// The step's bound (docs/design.md, "The step's bound"): the work one
// optimizer step gives each resource (model FLOPs, bytes per link exactly as
// training counts them, CPU Adam's elements, network bytes), each resource's
// busy time at a rate, and the busiest resource's time, a lower bound on the
// step. No LibTorch here: the rates are measured by engine/probes.h or given.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "memory/layout.h"
#include "memory/placement.h"
#include "memory/tiered_state.h"

namespace strata {

// Rates in base units per second; 0 = unknown (a resource with work and no
// rate is an error of the caller, see missing_rates). `source` says where
// each came from ("measured: ...", "--nvme-read-gbps", "run.rates.h2d_gbps").
struct Rates {
  double device_flops = 0;     // the device's FLOP/s at this model's shapes and dtype
  double h2d = 0, d2h = 0;     // bytes/s host -> device, device -> host
  double pcie_both = 0;        // bytes/s of H2D and D2H together, both at once
  double nvme_read = 0, nvme_write = 0;  // bytes/s through the I/O engine
  double nvme_both = 0;                   // bytes/s reading and writing at once, aggregate
  double adam = 0;             // CPU Adam elements/s
  double checksum = 0;         // bytes/s of CRC-32C on CPU Adam's threads (the swap checksums)
  double grad_add = 0;         // elements/s of gradients added into host homes (the lander's one thread)
  double net = 0;              // bytes/s one rank sends
  double intra_node = 0;       // bytes/s one rank sends to its node's ranks (the node group)
  std::string device_flops_source, h2d_source, d2h_source, pcie_both_source, nvme_read_source,
      nvme_write_source, nvme_both_source, adam_source, checksum_source, grad_add_source, net_source,
      intra_node_source;
  // The same by the rates table's row (config/rates.h).
  double& value(RateKind k);
  double value(RateKind k) const { return const_cast<Rates*>(this)->value(k); }
  std::string& source(RateKind k);
  const std::string& source(RateKind k) const { return const_cast<Rates*>(this)->source(k); }
};

// run.rates as Rates (units converted), each named by its key.
Rates rates_from_config(const RateOverrides& o);

// The work of one optimizer step of one rank.
// Bytes one rank sends per step (ring algorithms, as the communicators count
// them): over the groups that span the world
// (the host and data groups), and over its node's group (the secondary
// shard's gathers).
struct NetworkBytes {
  int64_t world = 0;
  int64_t node = 0;
};
NetworkBytes step_network_bytes(const PlacementPlan& plan);

struct StepWork {
  double flops = 0;        // model FLOPs, recompute included
  LinkBytes links;         // as the metrics count them (docs/design.md, "Bytes per link")
  int64_t adam_elems = 0;  // elements CPU Adam updates
  // Gradient elements added into homes off the device (host or NVMe), one
  // pass per landing (the first a copy): the gradient path's lander thread
  // reads each landed gradient and its home and writes the sum.
  int64_t grad_add_elems = 0;
  // The CPU device's pool of cores: the compute's threads (run.threads, else
  // every core). The gradient adds run on the lander's one thread beside the
  // compute, so on CPU compute they take 1/cpu_threads of the pool for their
  // seconds (CPU time is what they share); the copies run on the compute's
  // own thread and take their whole seconds.
  int cpu_threads = 1;
  // Bytes whose CRC-32C is computed (swap writes) or verified (swap reads):
  // every NVMe byte when run.swap_checksums; the optimizer's part apart
  // (its pipeline's thread checksums them between updates).
  int64_t checksum_bytes = 0;
  int64_t optimizer_checksum_bytes = 0;
  int64_t net_bytes = 0;   // sent by this rank over the world's groups
  int64_t intra_node_bytes = 0;  // sent by this rank over its node's group (comm.secondary_shard)
  // For the step's dependencies: the first micro-batch's forward (what can
  // run beside the previous step's optimizer), the optimizer's part of
  // `links`, and whether the optimizer overlaps the next forward at all.
  double first_forward_flops = 0;
  LinkBytes optimizer_links;
  // Note [Activation copies]: the step's forwards (every micro-batch's, no
  // recompute), and the bytes of the activations kept in host RAM, which go
  // down during the forwards and come up during the backwards (each way).
  double forward_flops = 0;
  int64_t activation_link_bytes = 0;
  bool overlap_optimizer = true;
  // Note [Speculative optimizer] (engine/optimizer/optimizer_pass.h), with
  // OptimizerPlan::speculate: the elements CPU Adam speculates beside the
  // backward (counted twice in adam_elems: the speculation and the commit
  // or redo), those of block 0, whose backward comes last (the
  // speculation's tail after the backward), and whether the step is costed
  // as clipped (redone after the backward, as without speculation).
  int64_t speculated_elems = 0;
  int64_t speculation_tail_elems = 0;
  bool clipped = false;
  // Of the speculated elements, those in alternate swap slots
  // (OptimizerPlan::speculate_slots): stepped once in adam_elems (a commit
  // flips the slots), and the optimizer's bytes of one pass over them, which
  // a clipped step spends again (clipped_work).
  int64_t slot_elems = 0;
  LinkBytes slot_links;
};

// Model FLOPs of one micro-batch of `tokens` tokens: forward and backward
// (6 x matrix parameters + attention scores per token, model/model.h's
// convention), plus each of `recomputed_layers` layers recomputed for the
// backward: its forward again up to its last matrix (w2's product makes only
// the output, which the backward does not read: Model::layer_recompute).
double step_flops(const ModelConfig& m, int64_t tokens, int64_t recomputed_layers);
// The forward's part of step_flops(m, tokens, 0): a third for a dense model;
// with LoRA more (the frozen base's backward has no weight gradients).
double forward_flops(const ModelConfig& m, int64_t tokens);

// The work of one step under `plan` (its placement, window fetches per block
// `fetches` from train_fetches, micro-batch shape from `cfg`), with
// `net` sent per rank (step_network_bytes).
StepWork predicted_work(const Config& cfg, const PlacementPlan& plan, const std::vector<int64_t>& fetches,
                        const NetworkBytes& net);
// The same step clipped (or skipped by fp16): its speculation redone after
// the backward (StepWork::clipped), the alternate-slot pieces' pass repeated.
StepWork clipped_work(const StepWork& w);

// Per block, how often the training step fetches its working copy (a dry run
// of the parameter window over one step's schedule; 0 for device-resident
// blocks, 1 for persistent ones).
std::vector<int64_t> train_fetches(const PlacementPlan& plan);

struct ResourceTime {
  // "cpu (compute + Adam)" (with " + copies", " + gradient adds", " + checksums" where they
  // have work), "device", "cpu adam" (or "cpu (Adam + checksums)"), "host gradient adds", "h2d",
  // "d2h", "pcie (h2d + d2h)",
  // "nvme (read + write)", "network", "intra-node", "dependencies", "activation copies"
  std::string resource;
  std::string work;      // the work, in words ("1.20 TFLOP + 81.0 M elements")
  std::string rate;      // the rate, in words ("98.3 GFLOP/s + 1.52 G elements/s")
  double seconds = 0;
};

struct StepBound {
  std::vector<ResourceTime> resources;  // every resource with work
  double seconds = 0;                   // the busiest one's
  std::string binding;                  // its name
};

// The resources that really share hardware: with CPU compute
// (`cpu_compute`), compute, CPU Adam, the copies (H2D/D2H are memcpy by the
// cores, on the compute's thread), the gradient adds into host homes and the
// swap checksums share the cores, in the step's dependencies too (the adds,
// the lander's one thread beside the compute, at 1/cpu_threads of their
// seconds: their CPU time); on a GPU the device and the PCIe
// directions are apart, CPU Adam and the checksums share the host's cores,
// and the gradient adds are one thread's (a resource of their own). NVMe reads and writes share the
// disk: its time is the longest of reads alone, writes alone and both at the
// aggregate rate. Besides each resource's busy time, the step's dependencies: the
// optimizer of step s starts after its backward and must finish before step
// s+1's forward can (its last block waits for its update), and step s+1's
// backward starts after that forward; so a step takes at least
// max(first forward, optimizer) + the rest of its compute (the forward and
// the optimizer in sequence without run.overlap_optimizer), where the
// optimizer's CPU time is Adam's and its checksums' in sequence. And on a
// GPU with activations in host RAM, their copies' (Note [Activation
// copies]). Throws InternalError for work without a rate (missing_rates
// first).
//
// Note [Activation copies]
// A pack of activations kept in host RAM goes down right after its forward
// and comes up ahead of its backward (engine/activation_checkpoints.h); the
// host packs are spread over the forwards (Note [Activation placement] in
// memory/placement.h), so each copy runs beside the forwards (backwards) of
// the packs between it and the next. But the forwards cannot end before
// their packs are down, nor the backwards before theirs are up. So a step
// takes at least max(forwards, their D2H) + max(backwards and recomputes,
// their H2D), whatever else the link has room for over the whole step: a
// link that carries the packs in the step's time may still not carry the
// forward's share in the forward's time (about a third of the compute).
StepBound step_bound(const StepWork& work, const Rates& rates, bool cpu_compute);

// The rates `work` needs and `rates` lacks, by the flag that gives each
// ("--device-tflops", "--nvme-read-gbps", ...). Empty when the bound can be
// computed.
std::vector<std::string> missing_rates(const StepWork& work, const Rates& rates, bool cpu_compute);

}  // namespace strata
