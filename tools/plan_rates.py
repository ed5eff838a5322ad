"""The step's bound's rates from `strata plan --json` as run.rates keys.

`strata plan --json` reports bound.rates in base units (FLOP, bytes and
elements per second); run.rates takes TFLOP/s, GB/s and G elements/s
(docs/config.md). The benchmark scripts probe once with `strata plan` and
give the same rates to several training runs.
"""

# bound.rates.run_rates holds every rate of the rates table (src/config/rates.h)
# as run.rates keys. Not handed on: the network's, which strata plan assumes
# (--net-gbps, --intra-node-gbps and their defaults) rather than measures,
# and pcie_both, which the training runs measure themselves.
NOT_HANDED_ON = ("net_gbps", "intra_node_gbps", "pcie_both_gbps")


def run_rates(rates):
    """bound.rates of `strata plan --json` as run.rates, the rates it measured
    or was given only (0 = none). On the CPU device H2D and D2H are both
    memcpy: a plan whose work has no H2D takes D2H's figure for it."""
    out = {k: v for k, v in rates.get("run_rates", {}).items() if v and k not in NOT_HANDED_ON}
    if "h2d_gbps" not in out and "d2h_gbps" in out and rates.get("d2h_source", "").endswith("(CPU device)"):
        out["h2d_gbps"] = out["d2h_gbps"]
    return out
