// The step's bound's rates (docs/design.md, "The step's bound"): one row per
// rate, the one list of them. run.rates reads its keys from it
// (config/strata_sections.cc), strata plan its flags (cli/plan.cc), the
// bound's Rates its values, sources and JSON names (plan/bound.h), strata
// train keeps and shares the measured ones through it (engine/probes.cc,
// cli/train/session.cc), and tools/plan_rates.py takes them as run.rates
// keys from `strata plan --json` (bound.rates.run_rates).
#pragma once

#include <array>
#include <cstddef>

namespace strata {

enum class RateKind {
  kDeviceFlops, kH2d, kD2h, kPcieBoth, kNvmeRead, kNvmeWrite, kNvmeBoth, kAdam, kChecksum, kGradAdd, kNet,
  kIntraNode
};
inline constexpr size_t kNumRates = 12;

struct RateSpec {
  RateKind kind;
  const char* key;    // run.rates.<key>, in the key's unit
  const char* flag;   // strata plan's flag, in the same unit
  double scale;       // the key's unit in the bound's: FLOP/s, bytes/s, elements/s
  const char* value;  // the bound's rate in strata plan --json's bound.rates
  const char* source; // where it came from, there
  const char* help;   // what it is, with its unit
};

// In RateKind's order.
inline constexpr RateSpec kRateTable[kNumRates] = {
    {RateKind::kDeviceFlops, "device_tflops", "--device-tflops", 1e12, "device_flops", "device_flops_source",
     "The device's compute rate for the bound (TFLOP/s)"},
    {RateKind::kH2d, "h2d_gbps", "--h2d-gbps", 1e9, "h2d_bytes_per_s", "h2d_source", "Host-to-device copy rate (GB/s)"},
    {RateKind::kD2h, "d2h_gbps", "--d2h-gbps", 1e9, "d2h_bytes_per_s", "d2h_source", "Device-to-host copy rate (GB/s)"},
    {RateKind::kPcieBoth, "pcie_both_gbps", "--pcie-both-gbps", 1e9, "pcie_both_bytes_per_s", "pcie_both_source",
     "Both directions at once, aggregate (GB/s)"},
    {RateKind::kNvmeRead, "nvme_read_gbps", "--nvme-read-gbps", 1e9, "nvme_read_bytes_per_s", "nvme_read_source",
     "NVMe read rate (GB/s)"},
    {RateKind::kNvmeWrite, "nvme_write_gbps", "--nvme-write-gbps", 1e9, "nvme_write_bytes_per_s", "nvme_write_source",
     "NVMe write rate (GB/s)"},
    {RateKind::kNvmeBoth, "nvme_both_gbps", "--nvme-both-gbps", 1e9, "nvme_both_bytes_per_s", "nvme_both_source",
     "NVMe reads and writes at once, aggregate (GB/s)"},
    {RateKind::kAdam, "adam_gelems", "--adam-gelems", 1e9, "adam_elements_per_s", "adam_source",
     "CPU Adam rate (G elements/s)"},
    {RateKind::kChecksum, "checksum_gbps", "--checksum-gbps", 1e9, "checksum_bytes_per_s", "checksum_source",
     "CRC-32C rate of the swap checksums on CPU Adam's threads (GB/s; run.swap_checksums)"},
    {RateKind::kGradAdd, "grad_add_gelems", "--grad-add-gelems", 1e9, "grad_add_elements_per_s", "grad_add_source",
     "Rate of adding landed gradients into their host homes, one thread (G elements/s)"},
    {RateKind::kNet, "net_gbps", "--net-gbps", 1e9 / 8, "net_bytes_per_s", "net_source",
     "Network bandwidth per rank for the communication time (Gbit/s)"},
    {RateKind::kIntraNode, "intra_node_gbps", "--intra-node-gbps", 1e9 / 8, "intra_node_bytes_per_s",
     "intra_node_source", "Bandwidth per rank inside a node (Gbit/s)"},
};

inline constexpr const RateSpec& rate_spec(RateKind k) { return kRateTable[size_t(k)]; }

// run.rates as given (each in its key's unit; 0 = not given), or as strata
// train measured and shares them.
struct RateOverrides {
  std::array<double, kNumRates> given{};
  double& operator[](RateKind k) { return given[size_t(k)]; }
  double operator[](RateKind k) const { return given[size_t(k)]; }
};

}  // namespace strata
