"""Where the time of one ZeRO-3 / ZeRO++ training step goes, per phase and rank, on the emulated
cluster of ``benchmarks/throughput.py`` (the same GPT, batches, optimizer, cluster and variants;
``--optimizer`` picks torch AdamW's implementation as there, default ``fused``).

One launch of ``benchmarks/netsim/netsim.sh`` (2 nodes x 2 ranks by default). For every rate of
``--rates`` and, with ``--unshaped`` (default), once with the links unshaped (no tbf: the
communication is as fast as the CPUs move it), each variant trains ``--warmup`` untimed steps,
``--steps`` timed steps (barrier to the end of ``optimizer.step()``, as throughput.py times them)
and then ``--steps`` steps under ``torch.profiler``. From the profiled steps each rank takes its
main thread's ranges:

- ``step::forward`` / ``step::backward`` / ``step::optimizer``: set here around the model call,
  ``loss.backward()`` and ``optimizer.step()`` + ``zero_grad``;
- ``qshard::<comm>::<part>``: set by qshard's FSDP2 comms (``qshard.zeropp``): ``quantize``
  (block quantization or the 16-bit cast before a send), ``transfer`` (issuing a collective; all
  of it when the call is synchronous, as FSDP2's reduce-scatter is), ``wait`` (blocked on an
  async collective's handle), ``finish`` (dequantize / sum / copy out after it); qgZ's hops as
  ``qshard::qgz::{reorder,quantize_intra,wait_intra,reduce_intra,quantize_inter,wait_inter,
  reduce_inter}`` (``reorder`` and ``quantize_inter`` with one rank per node only: otherwise hop 1
  quantizes its slots in place and ``reduce_intra`` requantizes the node partials);
- ``FSDP::*``: FSDP2's own ranges (hooks, copy-in/out; its copy-out also holds the wait on a
  plain all-gather that qshard does not wrap, e.g. hpZ's intra-node backward gather).

Every range's time is exclusive (minus the ranges nested in it), so "forward compute" is the
forward's wall time with every comm and FSDP2 range taken out, and the phases of a step add up
to its profiled wall time. Each rank also reads its main thread's CPU time and its process's
(the difference is gloo's threads and the kernel's network work charged to the process), which
shows how much of a phase's wall time the rank was runnable but waiting for a core: 4 ranks
share the machine's cores.

On a shaped link the first rank of each node also samples its node's ``eth0`` counters every
1 ms during the timed steps (``netsim.link.LinkSampler``), and the report splits them by the
steps' phase boundaries (``_limits.link_by_phase``): per phase, the time the busiest node
direction's bytes needed at the rate ('link busy'), the rest ('link idle'), and how much of that
idle time sits at the phase's start and end. A link-bound phase with idle time lost the step that
much; idle at a phase's edges is a pipeline filling or draining (the first gather, the last
block's compute), idle in its middle a gap between transfers.

The profiler adds a per-op cost, so the profiled steps are slower than the timed ones: both are
printed. Needs root (network namespaces); run from the repository root, e.g.

    python benchmarks/step_profile.py --rates 100 --steps 3 --out-md docs/results/step_profile.md
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import throughput as tp  # noqa: E402
from _common import Report, add_report_args, out_path  # noqa: E402

VARIANTS = ("zero3", "zero3-bf16", "qwz", "hpz", "qgz", "all")
DEFAULT_VARIANTS = ("zero3-bf16", "qwz", "hpz", "qgz", "all")
TOP = ("step::forward", "step::backward", "step::optimizer")
# Summary columns: (heading, predicate on an exclusive-range label).
GROUPS: tuple[tuple[str, object], ...] = (
    ("fwd compute", lambda n: n == "step::forward"),
    ("bwd compute", lambda n: n == "step::backward"),
    ("optimizer", lambda n: n == "step::optimizer"),
    ("quantize", lambda n: n.startswith("qshard::") and ("quantize" in n or "reorder" in n)),
    (
        "transfer wait",
        lambda n: n.startswith("qshard::") and ("wait" in n or n.endswith("::transfer")),
    ),
    (
        "dequant/reduce",
        lambda n: n.startswith("qshard::") and (n.endswith("::finish") or "::reduce_" in n),
    ),
    ("FSDP2 copy-out", lambda n: n == "FSDP::all_gather_copy_out"),
    ("FSDP2 other", lambda n: n.startswith("FSDP::") and n != "FSDP::all_gather_copy_out"),
)


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    from netsim.cluster import add_cluster_args, check_cluster_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_cluster_args(p, default_variants=DEFAULT_VARIANTS)
    p.set_defaults(rates="100", steps=3)
    p.add_argument(
        "--unshaped",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also profile every variant with the links unshaped (reported as rate 0)",
    )
    tp.add_optimizer_arg(p)
    tp.add_prefetch_arg(p)
    p.add_argument(
        "--out-json",
        metavar="FILE",
        type=out_path,
        help="also write the raw per-rank numbers here",
    )
    add_report_args(p)
    args = p.parse_args(argv)
    check_cluster_args(p, args, variants=VARIANTS)
    tp.check_optimizer_arg(args)
    return args


# ----------------------------------------------------------------------------------------------
# The ranges of a profile, made exclusive.


def _label(name: str) -> str:
    """FSDP2 appends the module (``FSDP::pre_forward (blocks.0)``, ``... for blocks.1``)."""
    return name.split(" (", 1)[0].split(" for ", 1)[0]


def exclusive_times(intervals: list[tuple[str, float, float]]) -> dict[str, float]:
    """Per label, the summed time of its ranges minus the ranges nested in them.

    ``intervals`` are ``(label, start, end)`` of one thread, so any two are nested or disjoint
    (record_function ranges); the exclusive times add up to the union of the outermost ranges.
    """
    out: dict[str, float] = {}
    stack: list[tuple[str, float, float]] = []
    for label, start, end in sorted(intervals, key=lambda iv: (iv[1], -iv[2])):
        while stack and stack[-1][2] <= start:
            stack.pop()
        dur = end - start
        out[label] = out.get(label, 0.0) + dur
        if stack:
            parent = stack[-1][0]
            out[parent] = out.get(parent, 0.0) - dur
        stack.append((label, start, end))
    return out


def _profile_ranges(prof) -> list[tuple[dict[str, float], float]]:
    """Per profiled step (a ``step`` range): exclusive seconds per label and the step's wall
    time, from the thread that ran ``step::*``."""
    events = [e for e in prof.events() if e.name.startswith(("step", "qshard::", "FSDP::"))]
    main = {e.thread for e in events if e.name in TOP}
    ivs = [
        (_label(e.name), e.time_range.start / 1e6, e.time_range.end / 1e6)
        for e in events
        if e.thread in main
    ]
    steps = sorted((start, end) for name, start, end in ivs if name == "step")
    inside: list[list[tuple[str, float, float]]] = [[] for _ in steps]
    for iv in ivs:
        if iv[0] != "step":
            i = bisect.bisect_right(steps, (iv[1], float("inf"))) - 1
            if i >= 0 and iv[1] < steps[i][1]:
                inside[i].append(iv)
    return [(exclusive_times(ivs_i), end - start) for ivs_i, (start, end) in zip(inside, steps)]


# ----------------------------------------------------------------------------------------------
# Worker: one process per rank, inside the emulated cluster.


def _measure(variant, args, topology, corpus, rank, world):
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from netsim.link import LinkSampler, NodeLinkMeter
    from qshard.train.data import batch_for_step

    load = os.getloadavg()[0]  # the host's, as this row starts
    torch.manual_seed(args.seed)
    model = tp._build(variant, args, topology)
    opt, warmup, steps = tp._optimizer(variant, model, args)
    global_batch = args.batch_per_rank * world

    def step(i: int, marks: list[float] | None = None) -> None:
        x, y = batch_for_step(
            corpus.train,
            step=i,
            seed=args.seed,
            global_batch=global_batch,
            context=args.context,
            rank=rank,
            world_size=world,
        )
        with record_function("step::forward"):
            _, loss = model(x, y)
        if marks is not None:
            marks.append(time.perf_counter())
        with record_function("step::backward"):
            loss.backward()
        if marks is not None:
            marks.append(time.perf_counter())
        with record_function("step::optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        if marks is not None:
            marks.append(time.perf_counter())

    for i in range(warmup):
        step(i)
    times, marks = [], []
    meter = NodeLinkMeter()
    # One counter sampler per node on a shaped link: when its bytes moved within each phase.
    shaped = int(os.environ.get("NETSIM_RATE_MBIT", "0")) > 0
    sampler = LinkSampler() if shaped and int(os.environ.get("LOCAL_RANK", "0")) == 0 else None
    meter.start()
    if sampler is not None:
        sampler.start()
    for i in range(warmup, warmup + steps):
        dist.barrier()
        m = [time.perf_counter()]
        step(i, m)
        marks.append(m)
        times.append(m[-1] - m[0])
    samples = sampler.stop() if sampler is not None else None
    per_node = meter.stop()
    cpu = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(warmup + steps, warmup + 2 * steps):
            dist.barrier()
            c0, p0 = time.thread_time(), time.process_time()
            with record_function("step"):
                step(i)
            c1, p1 = time.thread_time(), time.process_time()
            cpu.append((c1 - c0, (p1 - p0) - (c1 - c0)))
    prof_steps = [
        {"phases": excl, "wall": wall, "cpu_main": main, "cpu_other": other}
        for (excl, wall), (main, other) in zip(_profile_ranges(prof), cpu, strict=True)
    ]
    busiest = max(max(b.tx, b.rx) for b in per_node) / steps
    mine = {
        "rank": rank,
        "times": times,
        "marks": marks,
        "link_samples": samples,
        "steps": prof_steps,
        "link_bytes": busiest,
        "load": load,
    }
    del prof
    per_rank: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(per_rank, mine)
    return per_rank


def worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from netsim.link import set_link_rate

    topology, corpus, rank, world = tp.start_worker(args)
    rates = ([0] if args.unshaped else []) + list(args.rate_list)
    mtu = int(os.environ.get("NETSIM_MTU", "1500"))
    results: dict[str, dict[str, list[dict]]] = {}
    for rate in rates:
        set_link_rate(rate)
        results[str(rate)] = {}
        for variant in args.variant_list:
            t0 = time.perf_counter()
            per_rank = _measure(variant, args, topology, corpus, rank, world)
            # the samples (~1,000 per node and second) are summarized here, not kept in the JSON
            phases = link_phases(per_rank, rate, mtu)
            for r in per_rank:
                r.pop("link_samples", None)
            if phases is not None:
                per_rank[0]["link_phases"] = phases
            gc.collect()
            results[str(rate)][variant] = per_rank
            if rank == 0:
                med = statistics.median(map(max, zip(*(r["times"] for r in per_rank))))
                print(
                    f"[step_profile] {_rate_name(rate)} {variant:>10}: timed median {med:.3f} "
                    f"s/step ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    if rank == 0 and args.result_json:
        with open(args.result_json, "w") as f:
            cores = len(os.sched_getaffinity(0))
            json.dump(
                {
                    "results": results,
                    "cores": cores,
                    "mtu": mtu,
                    "optimizer": args.optimizer,
                    "prefetch_depth": args.prefetch_depth,
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------------------------
# Launcher and report.


def _rate_name(rate: int | str) -> str:
    return "unshaped" if int(rate) == 0 else f"{int(rate)} Mbit/s"


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    from netsim.cluster import needs_root, run_cluster_args

    refused = needs_root("step_profile")
    if refused is not None:
        return refused
    t0 = time.perf_counter()
    run = run_cluster_args(__file__, argv, args, prefix="qsp")
    if run.rc != 0 or run.data is None:
        print(
            f"step_profile: the emulated cluster run failed with status {run.rc}", file=sys.stderr
        )
        return run.rc or 1
    data = dict(run.data, load=list(run.load), wall_s=time.perf_counter() - t0)
    if args.out_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.out_json)), exist_ok=True)
        with open(args.out_json, "w") as f:
            json.dump(data, f)
    report(args, data)
    return 0


def median_step(per_rank: list[dict]) -> list[dict]:
    """Every rank's numbers at the median profiled step (by the slowest rank's wall time), so
    the phases still add up to one step and one slow step (a descheduled rank) does not
    inflate them: ``phases``, ``prof_wall``, ``cpu_main``, ``cpu_other`` per rank."""
    walls = [max(r["steps"][i]["wall"] for r in per_rank) for i in range(len(per_rank[0]["steps"]))]
    i = sorted(range(len(walls)), key=walls.__getitem__)[(len(walls) - 1) // 2]
    return [
        {
            "phases": r["steps"][i]["phases"],
            "prof_wall": r["steps"][i]["wall"],
            "cpu_main": r["steps"][i]["cpu_main"],
            "cpu_other": r["steps"][i]["cpu_other"],
        }
        for r in per_rank
    ]


def _link_ms(link_bytes: float | None, rate: str, mtu: int) -> str:
    from netsim.link import wire_overhead

    if link_bytes is None or int(rate) == 0:
        return "-"
    return f"{link_bytes * wire_overhead(mtu) * 8 / (int(rate) * 1e6) * 1e3:.0f}"


def _slowest(per_rank: list[dict]) -> dict:
    return max(per_rank, key=lambda r: r["prof_wall"])


def _grouped(phases: dict[str, float]) -> dict[str, float]:
    out = {name: 0.0 for name, _ in GROUPS}
    for label, sec in phases.items():
        for name, pred in GROUPS:
            if pred(label):  # type: ignore[operator]
                out[name] += sec
                break
    return out


def link_phases(per_rank: list[dict], rate: int | str, mtu: int) -> dict | None:
    """``_limits.link_by_phase`` of one row's timed steps: the node samples of the ranks that
    took them, against each step's phase ends taken as the last rank's. None unshaped or
    without samples."""
    from _limits import link_by_phase

    samples = [r["link_samples"] for r in per_rank if r.get("link_samples")]
    if int(rate) == 0 or not samples or "marks" not in per_rank[0]:
        return None
    steps = [list(map(max, zip(*m, strict=True))) for m in zip(*(r["marks"] for r in per_rank))]
    return link_by_phase(samples, steps, int(rate), mtu)


def link_phase_rows(results: dict) -> list[list[str]]:
    """The report's link-per-phase rows: every row whose first rank carries ``link_phases``
    (the worker's summary of its samples; rows from runs before the sampler have none)."""
    from _limits import LINK_KEYS, PHASES

    rows = []
    for rate, by_variant in results.items():
        for variant, ranks in by_variant.items():
            if not (by_phase := ranks[0].get("link_phases")):
                continue
            for phase in (*PHASES, "step"):
                v = by_phase[phase]
                ms = (f"{v[k] * 1e3:.0f}" for k in LINK_KEYS)
                rows.append([_rate_name(rate), variant, phase, *ms])
    return rows


def report(args: argparse.Namespace, data: dict) -> None:
    results = data["results"]
    rep = Report("Step profile: where a ZeRO-3 / ZeRO++ step's time goes")
    load = data.get("load")
    rep.note(
        f"The throughput GPT ({args.n_layer} layers, width {args.n_embd}, context "
        f"{args.context}, fp32; {tp.optimizer_text(data.get('optimizer', tp.LEGACY_OPTIMIZER))}"
        f"{tp.prefetch_text(data.get('prefetch_depth'))}), "
        f"{args.batch_per_rank} sequences per rank, "
        f"{args.nodes} nodes x {args.ranks_per_node} ranks on {data.get('cores', '?')} cores; "
        f"{args.steps} timed then {args.steps} profiled steps after {args.warmup} warm-up steps "
        "per variant and rate; 'unshaped' = no tbf on the links"
        + (
            f"; whole run {data.get('wall_s', 0):.0f} s, host load average {load[0]:.1f} at the "
            f"start and {load[1]:.1f} at the end (the machine is shared: times are noisy)."
            if load
            else "."
        )
        + " Times are ms of the median profiled step (by its slowest rank's wall time) on "
        "the slowest rank of that step, exclusive: "
        "'fwd/bwd compute' is the forward / backward with every comm and FSDP2 range taken out; "
        "'quantize' qwZ/qgZ block quantization, qgZ's slice reorder and the 16-bit casts; "
        "'transfer wait' the time blocked in a collective (a synchronous call, or waiting on an "
        "async handle); 'dequant/reduce' what runs after a transfer (dequantize, fp32 sums, "
        "copies out); 'FSDP2 copy-out' FSDP2's split of a gathered buffer into parameters; "
        "'other' the step's wall time outside every range. 'link need' is the time the busiest "
        "node link direction needs for a step's bytes (eth0 counters over the timed steps, x "
        "(MTU+14)/(MTU-52), over the rate): a 'transfer wait' close to it means the transfer "
        "did not overlap compute. "
        "'main CPU' is the rank's main-thread CPU time, 'gloo CPU' its other threads' (and the "
        "kernel's network work charged to it); wall time above CPU time is time the rank was "
        "blocked or waiting for a core. 'load': the host's 1-minute load average as the row "
        "started."
    )
    heads = [name for name, _ in GROUPS]
    rows = []
    detail = []
    for rate, by_variant in results.items():
        for variant, ranks in by_variant.items():
            timed = list(map(max, zip(*(r["times"] for r in ranks))))
            per_rank = median_step(ranks)
            slow = _slowest(per_rank)
            g = _grouped(slow["phases"])
            other = slow["prof_wall"] - sum(g.values())
            rows.append(
                [
                    _rate_name(rate),
                    variant,
                    f"{statistics.median(timed) * 1e3:.0f}",
                    f"{slow['prof_wall'] * 1e3:.0f}",
                    _link_ms(ranks[0].get("link_bytes"), rate, int(data.get("mtu", 1500))),
                    *(f"{g[h] * 1e3:.0f}" for h in heads),
                    f"{other * 1e3:.0f}",
                    f"{slow['cpu_main'] * 1e3:.0f}",
                    f"{slow['cpu_other'] * 1e3:.0f}",
                    f"{ranks[0]['load']:.1f}" if "load" in ranks[0] else "-",
                ]
            )
            labels = sorted(
                {k for r in per_rank for k in r["phases"]},
                key=lambda k: -max(r["phases"].get(k, 0.0) for r in per_rank),
            )
            for label in labels:
                vals = [r["phases"].get(label, 0.0) * 1e3 for r in per_rank]
                if max(vals) < 1.0:
                    continue
                detail.append([_rate_name(rate), variant, label, *(f"{v:.1f}" for v in vals)])
    rep.table(
        "Per phase, slowest rank (ms per step)",
        [
            "link",
            "variant",
            "timed median",
            "profiled",
            "link need",
            *heads,
            "other",
            "main CPU",
            "gloo CPU",
            "load",
        ],
        rows,
    )
    world = len(next(iter(next(iter(results.values())).values())))
    rep.table(
        "Every range per rank (exclusive ms per step; ranges under 1 ms left out)",
        ["link", "variant", "range", *(f"rank {i}" for i in range(world))],
        detail,
    )
    link_rows = link_phase_rows(results)
    if link_rows:
        rep.table(
            "The link per phase (timed steps; ms per step, median over steps)",
            [
                "link",
                "variant",
                "phase",
                "wall",
                "link busy",
                "link idle",
                "idle at start",
                "idle at end",
            ],
            link_rows,
        )
        rep.note(
            "Each node's eth0 counters, read every 1 ms by a thread of its first rank during "
            "the timed steps (netsim.link.LinkSampler), against each step's phase boundaries "
            "(the last rank's, as throughput.py takes them). 'link busy': the time the bytes "
            "the phase's busiest node direction carried need at the rate (x (MTU+14)/(MTU-52)); "
            "'link idle' = wall - busy, time that direction carried nothing, in a phase where "
            "the link binds the step time lost to it; 'idle at start' / 'idle at end': from the "
            "phase's start to that direction's first transfer-sized counter step, and from its "
            "last to the phase's end (+-1 ms; the whole phase when nothing moved). "
            "benchmarks/_limits.py link_by_phase."
        )
    cpu_rows = []
    cores = data.get("cores") or 1
    for rate, by_variant in results.items():
        for variant, ranks in by_variant.items():
            per_rank = median_step(ranks)
            total = sum(r["cpu_main"] + r["cpu_other"] for r in per_rank)
            cpu_rows.append(
                [
                    _rate_name(rate),
                    variant,
                    f"{_slowest(per_rank)['prof_wall'] * 1e3:.0f}",
                    f"{total * 1e3:.0f}",
                    f"{total / cores * 1e3:.0f}",
                ]
            )
    rep.table(
        f"CPU of all ranks per profiled step ({cores} cores)",
        ["link", "variant", "step wall ms", "CPU ms, all ranks", "CPU ms / cores"],
        cpu_rows,
    )
    rep.write(args.out_md)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    if args.worker:
        return worker(args)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
