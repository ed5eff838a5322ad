"""The step's bound's rates from `strata plan --json` as run.rates keys.

`strata plan --json` reports bound.rates in base units (FLOP, bytes and
elements per second); run.rates takes TFLOP/s, GB/s and G elements/s
(docs/config.md). The benchmark scripts probe once with `strata plan` and
give the same rates to several training runs.
"""

# run.rates key: (bound.rates field, scale)
RATE_KEYS = {"device_tflops": ("device_flops", 1e12), "adam_gelems": ("adam_elements_per_s", 1e9),
             "checksum_gbps": ("checksum_bytes_per_s", 1e9), "d2h_gbps": ("d2h_bytes_per_s", 1e9),
             "h2d_gbps": ("h2d_bytes_per_s", 1e9), "nvme_read_gbps": ("nvme_read_bytes_per_s", 1e9),
             "nvme_write_gbps": ("nvme_write_bytes_per_s", 1e9), "nvme_both_gbps": ("nvme_both_bytes_per_s", 1e9),
             "grad_add_gelems": ("grad_add_elements_per_s", 1e9)}


def run_rates(rates):
    """bound.rates of `strata plan --json` as run.rates, the rates it measured
    or was given only (0 = none). On the CPU device H2D and D2H are both
    memcpy: a plan whose work has no H2D takes D2H's figure for it."""
    out = {k: rates[src] / scale for k, (src, scale) in RATE_KEYS.items() if rates.get(src)}
    if "h2d_gbps" not in out and "d2h_gbps" in out and rates.get("d2h_source", "").endswith("(CPU device)"):
        out["h2d_gbps"] = out["d2h_gbps"]
    return out
