"""The arithmetic of ``benchmarks/throughput.py``'s [Note: the limit column]: the issue's limit
``max(compute-only step, link time)`` and the schedule-aware phase limit ``sum over phases of
max(compute-only time of the phase, link time of the phase)``, from the numbers a launch wrote
(no cluster, no torch), plus where each comm-ledger tag's bytes sit in a step."""

from __future__ import annotations

import bisect
import itertools
import statistics

__all__ = [
    "LINK_KEYS",
    "LINK_MOVE_BYTES",
    "OPTIMIZER_TAG_PREFIXES",
    "PHASES",
    "PHASE_OF_TAG",
    "UNSHAPED",
    "ledger_by_phase",
    "limits",
    "link_by_phase",
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


# A sample-to-sample counter step below this is control traffic (barriers, gloo's headers), not a
# transfer in flight (link_by_phase's head and tail).
LINK_MOVE_BYTES = 4096
# What link_by_phase gives per phase, in seconds (see its docstring).
LINK_KEYS = ("wall_s", "busy_s", "idle_s", "head_s", "tail_s")


def _counter_at(samples: list, times: list[float], t: float, col: int) -> float:
    """A sampled counter at time ``t``, linear between samples (clamped to the ends);
    ``times`` is the samples' first column."""
    i = bisect.bisect_left(times, t)
    if i <= 0:
        return float(samples[0][col])
    if i >= len(samples):
        return float(samples[-1][col])
    (t0, *v0), (t1, *v1) = samples[i - 1], samples[i]
    a, b = v0[col - 1], v1[col - 1]
    return a + (b - a) * (t - t0) / (t1 - t0) if t1 > t0 else float(b)


def _first_last_move(samples: list, a: float, b: float, col: int) -> tuple[float, float] | None:
    """When a counter first and last moved by a transfer's worth inside ``[a, b]``: the sample
    before its first step (the earliest it can have started) and the sample after its last."""
    first = last = None
    for (t0, *v0), (t1, *v1) in itertools.pairwise(samples):
        if t1 <= a or t0 >= b or v1[col - 1] - v0[col - 1] < LINK_MOVE_BYTES:
            continue
        first = max(t0, a) if first is None else first
        last = min(t1, b)
    return None if first is None else (first, last)


def link_by_phase(
    node_samples: list[list[tuple[float, int, int]]],
    step_marks: list[list[float]],
    rate_mbit: int,
    mtu: int = 1500,
) -> dict[str, dict[str, float]]:
    """How busy the emulated link was in each phase of each step, from sampled counters.

    ``node_samples``: per node, ``(perf_counter s, tx bytes, rx bytes)`` samples
    (``netsim.link.LinkSampler``) spanning the steps; ``step_marks``: per step, its start and the
    ends of its forward, backward and optimizer step on the shared clock, ``[t0, t_fwd, t_bwd,
    t_end]`` (each boundary the last rank's, as throughput.py takes them). Per phase of
    :data:`PHASES` and for the whole ``"step"``, the median over steps of:

    - ``wall_s``: the phase's duration;
    - ``busy_s``: the link time its bytes needed, in the busiest node direction of that phase
      (bytes x (MTU+14)/(MTU-52) x 8 / rate), at most ``wall_s``;
    - ``idle_s``: ``wall_s - busy_s``, the time the bottleneck direction carried nothing;
    - ``head_s`` / ``tail_s``: from the phase's start to that direction's first transfer-sized
      counter step, and from its last to the phase's end (the whole phase when nothing moved):
      idle time at the edges, where no transfer was in flight yet or any more.
    """
    from netsim.link import wire_overhead

    if rate_mbit <= 0:
        raise ValueError(f"link_by_phase needs a shaped rate (Mbit/s > 0); got {rate_mbit!r}")
    if not node_samples or any(len(s) < 2 for s in node_samples):
        raise ValueError("link_by_phase needs at least two samples per node")
    per_byte = wire_overhead(mtu) * 8 / (rate_mbit * 1e6)
    names = (*PHASES, "step")
    timed = [(s, [x[0] for x in s]) for s in node_samples]
    rows: dict[str, dict[str, list[float]]] = {n: {k: [] for k in LINK_KEYS} for n in names}
    for marks in step_marks:
        if len(marks) != len(PHASES) + 1 or sorted(marks) != list(marks):
            raise ValueError(f"step marks must be {len(PHASES) + 1} increasing times; got {marks}")
        spans = [*itertools.pairwise(marks), (marks[0], marks[-1])]
        for name, (a, b) in zip(names, spans, strict=True):
            # (bytes, node samples, column) of every node direction; the busiest one binds
            sent = [
                (_counter_at(s, ts, b, col) - _counter_at(s, ts, a, col), s, col)
                for s, ts in timed
                for col in (1, 2)
            ]
            nbytes, samples, col = max(sent, key=lambda x: x[0])
            wall = b - a
            busy = min(nbytes * per_byte, wall)
            moved = _first_last_move(samples, a, b, col)
            head, tail = (wall, wall) if moved is None else (moved[0] - a, b - moved[1])
            for key, v in zip(LINK_KEYS, (wall, busy, wall - busy, head, tail), strict=True):
                rows[name][key].append(v)
    return {n: {k: statistics.median(v) for k, v in d.items()} for n, d in rows.items()}
