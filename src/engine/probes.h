// Short measurements of the rates the step's bound divides work by
// (plan/bound.h; docs/design.md, "The step's bound"), on the machine and
// device the run uses: the device's compute at this model's shapes, host <->
// device copies, the I/O engine in a swap directory, CPU Adam. Each takes
// about `budget_s` seconds after a warm-up.
#pragma once

#include <string>

#include "config/config.h"
#include "cpu_adam/types.h"
#include "plan/bound.h"
#include "memory/device.h"
#include "memory/placement.h"

namespace strata {

// FLOP/s of one layer's forward and backward at the configured micro-batch
// shape and compute dtype, on `device` (its compute stream). On the CPU, a
// shape whose FLOPs would take long is shortened to fewer tokens, and a layer
// over 256 MiB of weights is narrowed (the rate of large matrix products
// changes little with size); `what` says what ran.
double probe_compute(const Config& cfg, Device& device, double budget_s, std::string* what);

// Bytes/s of copies between registered host memory and `device`: H2D alone,
// D2H alone, and both at once (aggregate). On the CPU device, memcpy.
struct CopyRates {
  double h2d = 0, d2h = 0, both = 0;
};
CopyRates probe_copies(Device& device, double budget_s);

// Bytes/s of the I/O engine (the config's aio settings) writing then reading
// a temporary file in `dir`, and reading one file while writing another
// (both at once, aggregate: what the optimizer's pipeline does). Throws
// InputError naming the directory when it does not exist.
// The two files (nameless: Note [Nameless bench files] in nvme/bench.cc)
// take at most the free space under `dir` less `reserve_bytes` (the state
// the plan puts there) and a margin, split among `sharers` (ranks probing
// the disk at once): smaller than asked when the disk is
// short (`bytes` < `asked`); ConfigError naming the rate flags when not even
// kMinProbeBytes each fit.
struct IoRates {
  double read = 0, write = 0, both = 0;
  int64_t bytes = 0, asked = 0;  // per file: measured over, and wanted
  bool in_state_room = false;    // no room beside the reserved state: measured in its room (probe_nvme)
};
// `state_numel` > 0 caps each file at 16 bytes an element (Note [Probes
// sized to the work]), at least kMinProbeBytes.
inline constexpr int64_t kMinProbeBytes = int64_t(4) << 20;
int64_t nvme_probe_bytes(double budget_s, int64_t state_numel = 0);
IoRates probe_nvme(const Config& cfg, const std::string& dir, double budget_s, int64_t reserve_bytes = 0,
                   int sharers = 1, int64_t state_numel = 0);

// The last-level CPU caches in bytes: the highest level sysfs lists for this
// machine's CPUs (a VM's own share), each distinct cache once (several
// sockets or chiplets add up), else sysconf's L3; 0 when neither says. Read
// once per process.
int64_t last_level_cache_bytes();
// A sysfs cache size ("32768K", "300M", "512"): bytes, 0 when unreadable.
int64_t parse_cache_size(const std::string& text);

// The sizes of the CPU probes' buffers, given the last-level caches: a probe that
// repeats over a buffer the cache holds measures the cache, not memory (on the
// H100 host, 300 MiB of L3, CPU Adam over 8 Mi elements ran 4x faster than the
// optimizer over 6.6 G: BENCHMARKS.md, "GPU"). CPU Adam's elements: 8 Mi (4 Mi
// for a probe under 0.5 s), or 4x the cache in elements of 18 bytes rounded
// up to 1 Mi where that is more, at most 256 Mi (4.5 GiB of buffers at
// start). The checksums' bytes: 512 MiB (128 MiB), or 4x the cache, at most
// 4 GiB.
// `state_numel` (> 0: the rank's shard space, StatePlacement::shard_space_numel)
// caps each at what a step can touch (Note [Probes sized to the work]): CPU
// Adam's elements at state_numel rounded up to 1 Mi, the checksums' bytes at
// 16 bytes an element rounded up to 1 MiB.
int64_t adam_probe_numel(double budget_s, int64_t cache_bytes, int64_t state_numel = 0);
int64_t checksum_probe_bytes(double budget_s, int64_t cache_bytes, int64_t state_numel = 0);

// CPU Adam's elements/s with the optimizer's threads, ISA and state dtype,
// emitting the compute dtype's working copy (fp32: copying it after the step,
// as the optimizer does), over adam_probe_numel elements.
double probe_adam(const Config& cfg, const Device& device, double budget_s, int64_t state_numel = 0);

// Bytes/s of the swap checksums (CRC-32C of 4 KiB blocks) on CPU Adam's
// threads, as the optimizer's pipeline runs them (Note [Parallel checksums]
// in nvme/swap_store.h), over a buffer past the caches: a read's blocks
// arrive from the disk by DMA, not through the cache.
double probe_checksum(const Config& cfg, const Device& device, double budget_s, int64_t state_numel = 0);

// Elements/s of one thread adding landed gradients of `wire` into fp32 homes
// (cpu_adam::accumulate_grad, what the gradient path's lander does for homes
// off the device), over grad_add_probe_numel elements: 16 Mi (4 Mi for a
// probe under 0.5 s), or 4x the last-level cache in elements of home and
// wire bytes where that is more, at most 256 Mi. With `first` the landing is
// the home's first write (a converting copy), as a block's fp32 sum lands
// under the layer schedule.
int64_t grad_add_probe_numel(double budget_s, int64_t cache_bytes, int wire_bytes, int64_t state_numel = 0);
double probe_grad_add(cpu_adam::GradType wire, bool first, double budget_s, int64_t state_numel = 0);

// Note [Probes sized to the work]
// The probes' buffers are sized to measure memory, not the caches (4x the
// last-level cache, up to 4.5 GiB for CPU Adam). A model whose whole state
// is smaller than that runs its step over no more than its state, so its
// probes need no more: each is capped at what a step can touch (the rank's
// shard space in elements; 16 bytes an element for checksums and swap
// files). Before this, the 0.8 M-parameter configs/tiny-cpu.json with its
// optimizer on NVMe was silent for 8-10 s at start (CPU Adam probed over
// 107 Mi elements, CRC-32C over 1920 MiB, gradient adds over 240 Mi) for
// steps of 0.14 s.
//
// Note [Kept rates]
// A machine's rates change with its hardware, not between runs. What a
// probe measured is kept in a JSON file (rates_cache_path) under a key of
// everything that would change it: the CPU's model and count, the ranks
// probing at once, the device, the threads, the instruction set and dtypes,
// the probe's size, the swap directory's file system and the aio settings,
// the model's layer shape, family and determinism for the compute probe.
// One rank keeps (ProbeRoom::keep); a disk pass cut short by the free space
// is used but not kept. A later run on the machine takes a kept rate that
// is under a week old instead of measuring it (its source says "kept from"
// and when); `--reprobe` (strata train, strata plan) measures again and
// replaces them. A file that cannot be read or written costs a warning and
// the probes, never the run.
//
// Where measured rates are kept (Note [Kept rates]): `path` "" is the
// default (the environment's STRATA_RATES_CACHE, else
// $XDG_CACHE_HOME/strata/rates.json, else $HOME/.cache/strata/rates.json),
// "off" keeps none; `reprobe` measures every rate again (and keeps the new
// figures). Process-wide; call before measure_rates.
void set_rates_cache(const std::string& path, bool reprobe);
// The file in use; "" when kept rates are off.
std::string rates_cache_path();
inline constexpr double kKeptRatesMaxAgeS = 7 * 24 * 3600.0;

// Fills each rate `work` needs and `rates` lacks by measuring it here (NVMe
// in plan.state.nvme_paths' first directory), naming the source "measured". A rate
// that cannot be measured here (no swap directory yet, no GPU for cuda, the
// network) throws ConfigError naming the flag or run.rates key that gives it.
// The NVMe probe's room (probe_nvme): `reserve_state` leaves the first swap
// directory's share of the plan's NVMe bytes free (false when the plan's
// disk is described, --nvme-gb, and this one only stands in for it), times
// `sharers`, the ranks of this node probing the same disk at once, who split
// what is left.
struct ProbeRoom {
  bool reserve_state = true;
  int sharers = 1;
  bool keep = true;  // keep what is measured (Note [Kept rates]): one rank of those probing at once
};
void measure_missing_rates(const Config& cfg, const PlacementPlan& plan, Device* device, const StepWork& work,
                           Rates& rates, double budget_s, const ProbeRoom& room = {});

// `work` with every link auto's other candidates could use (copies both
// ways, NVMe and with `checksums` (run.swap_checksums) their checksums when
// the plan has swap directories, CPU Adam), so that the rates to judge them
// by are measured too.
StepWork union_work(const StepWork& work, const PlacementPlan& plan, bool checksums);

// The rates of `work` (errors as measure_missing_rates), then, where it can
// measure them here, those of union_work as well.
void measure_rates(const Config& cfg, const PlacementPlan& plan, Device* device, const StepWork& work, Rates& rates,
                   double budget_s, const ProbeRoom& room = {});

// `rates` as run.rates (the overrides a config carries), so that a planner
// given the config sees them.
void store_rates(const Rates& rates, RateOverrides& out);

}  // namespace strata
