"""The arithmetic of ``benchmarks/throughput.py``'s [Note: the limit column]: the issue's limit
``max(compute-only step, link time)`` and the schedule-aware phase limit ``sum over phases of
max(compute-only time of the phase, link time of the phase)``, from the numbers a launch wrote
(no cluster, no torch), plus where each comm-ledger tag's bytes sit in a step."""

from __future__ import annotations

import statistics

__all__ = [
    "OPTIMIZER_TAG_PREFIXES",
    "PHASES",
    "PHASE_OF_TAG",
    "UNSHAPED",
    "ledger_by_phase",
    "limits",
    "link_seconds",
    "phase_limits",
    "phase_of_tag",
]

UNSHAPED = "0"  # the results key of the unshaped (compute-only) pass


def link_seconds(r: dict, rate_mbit: int, mtu: int = 1500) -> float:
    """Seconds per step the busiest direction of the busiest node link needs at ``rate_mbit``:
    see [Note: the limit column]."""
    from netsim.link import wire_overhead

    busiest = max(*r["node_tx"], *r.get("node_rx", r["node_tx"]))
    return busiest * wire_overhead(mtu) * 8 / (rate_mbit * 1e6)


def limits(data: dict) -> dict[str, dict[str, dict[str, object]]]:
    """Per shaped rate and variant: the compute-only step (the unshaped pass's median), the link
    time, the limit (their max), which one binds, the median and median / limit. Empty without
    an unshaped pass."""
    out: dict[str, dict[str, dict[str, object]]] = {}
    for rate, variant, r, u, link in _shaped_rows(data):
        compute = statistics.median(u["times"])
        limit = max(compute, link)
        med = statistics.median(r["times"])
        out.setdefault(rate, {})[variant] = {
            "compute_s": compute,
            "link_s": link,
            "limit_s": limit,
            "bound": "link" if link >= compute else "compute",
            "median_s": med,
            "x_limit": med / limit,
        }
    return out


def _shaped_rows(data: dict):
    """(rate, variant, its row, its unshaped row, its link seconds) of every shaped row that
    has an unshaped twin."""
    results, mtu = data["results"], int(data.get("mtu", 1500))
    unshaped = results.get(UNSHAPED, {})
    for rate, by_variant in results.items():
        if rate == UNSHAPED:
            continue
        for variant, r in by_variant.items():
            if variant in unshaped:
                yield rate, variant, r, unshaped[variant], link_seconds(r, int(rate), mtu)


PHASES = ("forward", "backward", "optimizer")
# Where each ledger tag's collectives run in a step (the phase limit of [Note: the limit
# column]). An unmapped tag stops the phase limit (phase_of_tag raises) rather than be guessed.
PHASE_OF_TAG = {
    "fwd_all_gather": "forward",  # issued outside autograd's backward (zeropp phase_tag)
    "bwd_all_gather": "backward",  # FSDP2's pre-backward re-gather
    "grad_reduce_scatter": "backward",  # FSDP2's post-backward (qgZ's deferred one drained in it)
    "grad_all_reduce": "backward",  # HSDP's replicate all-reduce, after the reduce-scatter
}
# The 1-bit / 0/1 Adam optimizers record their collectives as "<algorithm>/<what>".
OPTIMIZER_TAG_PREFIXES = ("onebit_adam/", "zero_one_adam/")


def phase_of_tag(tag: str) -> str:
    """The step phase (one of :data:`PHASES`) whose critical path a ledger tag's bytes are on."""
    if tag in PHASE_OF_TAG:
        return PHASE_OF_TAG[tag]
    if tag.startswith(OPTIMIZER_TAG_PREFIXES):
        return "optimizer"
    raise ValueError(
        f"ledger tag {tag!r} has no step phase: add it to PHASE_OF_TAG (or a prefix to "
        "OPTIMIZER_TAG_PREFIXES) in benchmarks/_limits.py, by where in the step its "
        "collectives run"
    )


def ledger_by_phase(r: dict) -> dict[str, float]:
    """A row's ledger inter-node bytes per step, summed per phase."""
    out = dict.fromkeys(PHASES, 0.0)
    for tag, _op, inter, _intra in r["ledger_by_tag"]:
        out[phase_of_tag(tag)] += inter
    return out


def phase_limits(data: dict) -> dict[str, dict[str, dict[str, object]]]:
    """Per shaped rate and variant: the phase limit of [Note: the limit column], sum over the
    phases of max(the unshaped pass's median time of the phase, the row's link time x the
    phase's share of its ledger bytes), with each phase's parts, the median and median / phase
    limit. Leaves out rows without an unshaped pass with phase times, and rows whose link bytes
    the ledger does not split (no ledger bytes: fsdp2). Raises ValueError on an unmapped tag."""
    out: dict[str, dict[str, dict[str, object]]] = {}
    for rate, variant, r, u, link in _shaped_rows(data):
        if "phase_times" not in u:
            continue
        ledger = ledger_by_phase(r)
        total = sum(ledger.values())
        if total <= 0 and link > 0:
            continue
        phases = {}
        for ph in PHASES:
            compute = statistics.median(u["phase_times"][ph])
            ph_link = link * ledger[ph] / total if total > 0 else 0.0
            phases[ph] = {
                "compute_s": compute,
                "link_s": ph_link,
                "bound": "link" if ph_link >= compute else "compute",
            }
        bound = sum(max(v["compute_s"], v["link_s"]) for v in phases.values())
        med = statistics.median(r["times"])
        out.setdefault(rate, {})[variant] = {
            "phases": phases,
            "phase_limit_s": bound,
            "median_s": med,
            "x_phase_limit": med / bound,
        }
    return out
