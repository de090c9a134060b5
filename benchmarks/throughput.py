"""Training throughput of ZeRO-3 vs ZeRO++ on an emulated slow inter-node network (the ZeRO++
paper's Tables 2-3 and Figure 9, in miniature), with the bytes that really crossed each node's
link next to the comm ledger's prediction.

One launch of ``benchmarks/netsim/netsim.sh`` (2 nodes x 2 ranks by default, each node's link
shaped with tbf) runs every variant at every rate inside one gloo world, because importing torch
costs ~10 s per process here. Per rate (the links are re-shaped between rates) and per variant,
each rank builds the same GPT (``qshard.train.model``, fp32 compute: bf16 matmuls are ~65x slower
on this CPU), shards it, and trains on the same batches of the embedded corpus:

- ``fsdp2``: plain ``torch.distributed.fsdp.fully_shard`` per block and root, no qshard code;
- ``zero3``: ``qshard.zeropp.shard`` with every feature off (must cost what ``fsdp2`` costs);
- ``zero3-bf16``: the same with a bf16 wire (the paper's fp16 ZeRO-3 baseline), when supported;
- ``qwz``, ``hpz``, ``qgz``, ``all``: the ZeRO++ features alone and together;
- ``all-sib`` (opt-in, not in the default sweep): ``all`` with the optimizer stepped inside
  backward, unit by unit (``qshard.zeropp.StepInBackward``); its optimizer phase is inside its
  backward;
- ``hsdp``: HSDP (``ZeroPPConfig(hsdp=True)``: shard inside a node, FSDP2's own fp32 replicate
  all-reduce across nodes); ``hsdp-bf16``: its replicate all-reduce (and intra-node comms) on a
  16-bit wire; ``hsdp-int4``: the replicate all-reduce block-quantized to INT4 (qgZ's format,
  fp32 between the two hops); both defer their replicate all-reduce through the backward (the
  default); ``hsdp-bf16-sync`` / ``hsdp-int4-sync`` (opt-in, not in the default sweep) run it
  synchronously inside FSDP2's hook, the A/B of that deferral;
- ``hsdp-1bit``, ``hsdp-01``: HSDP with no gradient crossing nodes and 1-bit Adam / 0/1 Adam
  syncing the replicas. 1-bit Adam is timed after its full-precision warm-up (``--warmup``
  steps); 0/1 Adam in its phase-B steady state, with a sync every ``--zero-one-interval``
  steps: the timed window is two whole intervals, starting right after a sync.

Every variant but ``hsdp-1bit`` / ``hsdp-01`` (whose own optimizers sync the replicas) steps
``torch.optim.AdamW(lr=1e-3, weight_decay=0)`` with the implementation ``--optimizer`` names:
``fused`` (the default: torch's fused kernel, as users run it: torchtitan's optimizer config
defaults to ``implementation="fused"``, and DeepSpeed builds its own fused multi-tensor Adam for
an Adam/AdamW config unless ``torch_adam`` is set or ZeRO-Offload picks its CPU Adam),
``foreach``, or ``default`` (torch's default flags: the for-loop update on CPU, ~10x fused's
time in docs/results/optim_step.md, 36-125 ms per step in step_profile.md's optimizer column,
and what every run before this flag used). The choice is in the report's header and the JSON.
``--prefetch-depth N`` sets ``ZeroPPConfig.prefetch_depth`` for every variant but ``fsdp2``
(default: the library's, 1; the kept last blocks follow it, N + 1): the memory-for-overlap trade
docs/zeropp.md measures, named in the header and recorded with the settings.

Step time is the slowest rank's time from a barrier to the end of ``optimizer.step()``; median and
min over ``--steps`` timed steps after ``--warmup`` untimed ones. [Note: interleaved rows] With
``--interleave`` (the default) each rate first builds and warms up every variant (the same seed,
batches and warm-up count as alone, so the losses do not change), then times them side by side:
round ``i`` times step ``i`` of every variant that has one left, the order rotating by one
variant per round (``round_schedule``). One after another (``--no-interleave``, the order before)
the same variant got slower the later it ran in a launch (``all`` 0.334 s/step first, 0.385 s
last; cause not found, see docs/netsim.md), a bias that then decided the ratios between rows.
Everything a row reports stays the variant's own: its step and phase times, the link bytes
(metered around each of its timed steps and summed), its ledger (recording only inside its own
steps) and the load as its first timed step started. Each rank also reads
``time.perf_counter()`` as its forward (the model call) and its ``loss.backward()`` end, with no
extra barrier; per step, each boundary is reduced with MAX over ranks like the step's end, so a
phase lasts from the last rank's end of the previous phase to the last rank's end of this one and
the three phases (forward, backward, optimizer step) add up to the step time. (The MAX of each
phase's own duration would count a rank's lag twice: a rank late out of its forward makes the
others wait in their backward.) Link bytes are the node's ``eth0`` tx counter over the timed
steps (read after a barrier before and after each), divided by the steps; the ledger column is
``CommLedger.gather_summary()``'s inter-node bytes of the busiest node per step.

[Note: the limit column] Per variant and shaped rate, ``limit = max(compute-only step, link
time)``, printed as ``limit s`` next to the median and ``x limit`` = median / limit:

- compute-only step: with ``--limit`` (default) the launch first runs every variant with the
  links unshaped (``set_link_rate(0)``: no tbf at all), timed in the same interleaved rounds as
  the shaped rows, with the same model, ranks, kernels, collectives and bytes, so the link is
  never the bottleneck and communication is off the critical path as far as this machine
  allows; its median step time (the ``unshaped`` rows) is the variant's compute floor. It still
  holds the CPU cost of moving the bytes (gloo's copies, the TCP stack on loopback and the
  bridge: on 2 cores the unshaped bridge carries 3-6 Gbit/s) and the ranks' waits on each
  other, as any step on these cores does.
- link time: the busiest direction of the busiest node link, ``max(node tx, node rx)`` bytes per
  timed step from the eth0 counters, times ``netsim.link.wire_overhead()`` = (MTU+14)/(MTU-52)
  (1514/1448 at MTU 1500: tbf charges every segment's headers; the TCP payload share 1448/1514 =
  95.6% is what iperf3 reached through these shapers, 95.2-95.6 Mbit/s at 100 Mbit/s), over the
  shaped rate. The counters see GSO super-packets, so the headers they already hold (one per
  64 KiB) are counted twice: <= 0.1%.

A step at its limit either keeps the link busy all the time or runs as fast as with no link.

The issue's limit assumes every byte can overlap every computation. In a ZeRO-3 step that
prefetches nothing across the step boundary it cannot: the forward's all-gathers carry the
weights the previous optimizer step just wrote, so none starts before the step does, and a
block's forward needs its gather; a backward reduce-scatter cannot start before its block's
gradients exist, and ``loss.backward()`` returns with every reduction done (the deferred qgZ
reduce-scatter is drained inside it); the optimizer step needs the gradients and its own
collectives (1-bit / 0/1 Adam) run inside it. So each phase's bytes can hide only behind that
phase's compute, and ``phase limit = sum over phases p of max(compute-only time of p, link time
of p)``, printed as ``phase limit s`` and ``x phase limit`` (median / phase limit), for phases
forward, backward (through the end of ``loss.backward()``) and optimizer step:

- compute-only time of p: the median over the unshaped pass's timed steps of the phase's time
  (the MAX-over-ranks boundaries above);
- link time of p: the row's ledger inter-node bytes of the collectives that run in p (the
  ledger's tags, mapped by ``PHASE_OF_TAG`` / ``OPTIMIZER_TAG_PREFIXES``: forward-tagged
  all-gathers to forward; backward-tagged all-gathers, gradient reduce-scatters and HSDP
  all-reduces to backward; the 1-bit / 0/1 Adam optimizers' collectives to the optimizer step),
  times the row's measured link/ledger ratio (``link time / ledger inter-node bytes``, the link
  time above with its header factor), so the phases' link times add up to the limit's link time.

It is a bound for such a schedule, not for every schedule: crossing it would take starting the
next step's forward gathers during the optimizer step, i.e. holding (or re-gathering) the next
step's gathered weights through the optimizer step, as a schedule that updates a block and
immediately re-gathers it could. A row without ledger bytes but with link bytes (``fsdp2``: plain
FSDP2 records nothing in the ledger) cannot be split and shows ``-``. ``issue_targets()`` keeps
checking the issue's targets against the issue's limit.

Needs root (network namespaces); run from the repository root, e.g.

    python benchmarks/throughput.py --rates 100,200,400 --steps 10
        --out-md docs/results/throughput.md --out-json docs/results/throughput.json

``--out-json FILE`` also writes the raw numbers with the limits and targets, the launch's
settings (model, ranks, steps, batch) and its command, date and machine; ``--from-json FILE``
rebuilds the report from such a file without a cluster, describing that launch (its header
names the rebuilding command on a line of its own) and refusing a flag that contradicts the
file ([Note: re-reported settings] in ``_throughput_report.py``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import add_report_args, at_least, out_path, run_origin  # noqa: E402
from _limits import limits, phase_limits  # noqa: E402, F401  (re-exported for the tests)
from _throughput_report import (  # noqa: E402, F401  (re-exported: tests, step_profile.py)
    LEGACY_OPTIMIZER,
    SETTINGS,
    issue_targets,
    optimizer_text,
    prefetch_text,
    rate_name,
    report,
    run_settings,
)

HSDP_VARIANTS = ("hsdp", "hsdp-bf16", "hsdp-int4", "hsdp-1bit", "hsdp-01")
# Opt-in A/B rows (not in the default sweep): the compressed replicate all-reduce run
# synchronously inside FSDP2's hook, as before it was deferred ([Note: deferred replicate
# all-reduce] in qshard.zeropp.all_reduce).
SYNC_VARIANTS = ("hsdp-bf16-sync", "hsdp-int4-sync")
# Opt-in row: the optimizer stepped inside backward, unit by unit (qshard.zeropp.StepInBackward);
# no optimizer.step() after backward, so the optimizer's time is inside the backward phase.
STEP_IN_BACKWARD = {"all-sib": "all"}
DEFAULT_VARIANTS = ("fsdp2", "zero3", "zero3-bf16", "qwz", "hpz", "qgz", "all", *HSDP_VARIANTS)
ALL_VARIANTS = (*DEFAULT_VARIANTS, *SYNC_VARIANTS, *STEP_IN_BACKWARD)
# ZeroPPConfig switches per variant; "fsdp2" bypasses qshard entirely.
FEATURES: dict[str, dict[str, object]] = {
    "zero3": {},
    "zero3-bf16": {"wire_dtype": "bf16"},
    "qwz": {"qwz": True},
    "hpz": {"hpz": True},
    "qgz": {"qgz": True},
    "all": {"qwz": True, "hpz": True, "qgz": True},
    "hsdp": {"hsdp": True},
    "hsdp-bf16": {"hsdp": True, "wire_dtype": "bf16"},
    "hsdp-int4": {"hsdp": True, "replicate_bits": 4},
    "hsdp-bf16-sync": {"hsdp": True, "wire_dtype": "bf16", "overlap_reduce_scatter": False},
    "hsdp-int4-sync": {"hsdp": True, "replicate_bits": 4, "overlap_reduce_scatter": False},
    "hsdp-1bit": {"hsdp": True, "replicate_reduce": False},
    "hsdp-01": {"hsdp": True, "replicate_reduce": False},
}
FEATURES.update({sib: FEATURES[base] for sib, base in STEP_IN_BACKWARD.items()})
# Variants whose optimizer owns the inter-node sync (the rest use torch AdamW).
DATA_PARALLEL = {"hsdp-1bit": "OneBitAdam", "hsdp-01": "ZeroOneAdam"}
# --optimizer: torch AdamW's implementation flags. "default" passes none (torch picks: the
# for-loop update on CPU).
ADAMW_FLAGS: dict[str, dict[str, bool]] = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "default": {},
}
DEFAULT_OPTIMIZER = "fused"


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    from netsim.cluster import check_cluster_args

    p = _parser()
    args = p.parse_args(argv)
    check_cluster_args(p, args, variants=ALL_VARIANTS)
    check_optimizer_arg(args)
    if args.back_to_back < 0 or (args.back_to_back and not args.interleave):
        p.error("--back-to-back N takes N >= 0 and runs with --interleave")
    return args


def _given(argv: list[str], names: Sequence[str]) -> dict[str, object]:
    """The values ``argv`` itself sets for the options ``names`` (dests), defaults left out."""
    p = _parser()
    p.set_defaults(**dict.fromkeys(names, None))
    args = p.parse_args(argv)
    return {k: getattr(args, k) for k in names if getattr(args, k) is not None}


def _parser() -> argparse.ArgumentParser:
    from netsim.cluster import add_cluster_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_cluster_args(p, default_variants=DEFAULT_VARIANTS)
    p.add_argument(
        "--zero-one-interval",
        type=int,
        default=8,
        help="0/1 Adam's sync interval H in the timed window (hsdp-01)",
    )
    p.add_argument(
        "--limit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first run every variant with the links unshaped: the compute-only step of the "
        "limit column (see [Note: the limit column])",
    )
    p.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="per rate, build every variant first and alternate their timed steps round by "
        "round (rotating the order); --no-interleave runs one variant after another",
    )
    p.add_argument(
        "--back-to-back",
        type=int,
        default=0,
        metavar="N",
        help="after the interleaved steps, also time N blocks of each variant's --steps steps "
        "run back to back, the variants' blocks taking turns (see [Note: back-to-back blocks]; "
        "needs --interleave)",
    )
    add_optimizer_arg(p)
    add_prefetch_arg(p)
    p.add_argument(
        "--out-json",
        metavar="FILE",
        type=out_path,
        help="also write raw numbers, limits, targets",
    )
    p.add_argument(
        "--from-json",
        metavar="FILE",
        help="report from an --out-json file, with its settings and machine; no run",
    )
    add_report_args(p)
    return p


def add_optimizer_arg(p: argparse.ArgumentParser) -> None:
    """``--optimizer``, shared with ``step_profile.py``: torch AdamW's implementation."""
    p.add_argument(
        "--optimizer",
        choices=tuple(ADAMW_FLAGS),
        default=None,
        help=f"torch AdamW's implementation for every variant but hsdp-1bit / hsdp-01 (default "
        f"{DEFAULT_OPTIMIZER}; 'default' = torch's default flags, the for-loop on CPU)",
    )


def add_prefetch_arg(p: argparse.ArgumentParser) -> None:
    """``--prefetch-depth``, shared with ``step_profile.py``: ``ZeroPPConfig.prefetch_depth``."""
    p.add_argument(
        "--prefetch-depth",
        type=at_least(1),
        default=None,
        metavar="N",
        help="ZeroPPConfig.prefetch_depth for every variant but fsdp2 (default: the library's, "
        "1); the kept last blocks follow it (N + 1), so N + 1 blocks stay unsharded from "
        "forward to backward",
    )


def check_optimizer_arg(args: argparse.Namespace) -> None:
    """Fill in the default; ``args.optimizer_given`` says whether the command named one (a
    ``--from-json`` report refuses one that differs from the file's)."""
    args.optimizer_given = args.optimizer is not None
    if args.optimizer is None:
        args.optimizer = DEFAULT_OPTIMIZER


# ----------------------------------------------------------------------------------------------
# Worker: one process per rank, inside the emulated cluster.


def _build(variant: str, args: argparse.Namespace, topology):
    """The GPT of this benchmark, sharded as ``variant`` says."""
    from qshard.train.model import GPT, GPTConfig

    cfg = GPTConfig(
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        context=args.context,
        seed=args.seed,
    )
    model = GPT(cfg)
    if variant == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    from qshard.zeropp import ZeroPPConfig, shard

    kw = _zeropp_kwargs(variant, getattr(args, "prefetch_depth", None))
    return shard(model, topology=topology, config=ZeroPPConfig(**kw))


def _zeropp_kwargs(variant: str, prefetch_depth: int | None = None) -> dict[str, object]:
    import torch

    kw = dict(FEATURES[variant])
    if kw.get("wire_dtype") == "bf16":
        kw["wire_dtype"] = torch.bfloat16
    if prefetch_depth is not None:
        kw["prefetch_depth"] = prefetch_depth
    return kw


def _supported(variant: str, prefetch_depth: int | None = None) -> str | None:
    """None if ``variant`` can run with the installed qshard, else why not."""
    if variant == "fsdp2":
        return None
    try:
        from qshard.zeropp import ZeroPPConfig, shard  # noqa: F401
    except ImportError as exc:
        return f"qshard.zeropp.shard is not available ({exc})"
    try:
        ZeroPPConfig(**_zeropp_kwargs(variant, prefetch_depth))
    except (TypeError, ValueError) as exc:
        return f"ZeroPPConfig refuses it: {exc}"
    return None


def _optimizer(variant: str, model, args: argparse.Namespace):
    """The variant's optimizer, and its (warm-up, timed) step counts."""
    import torch

    if variant not in DATA_PARALLEL:
        flags = ADAMW_FLAGS[args.optimizer]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, **flags)
        return opt, args.warmup, args.steps
    from qshard import optim as qoptim

    # The variance freezes after the few warm-up steps here, so it is bias-corrected (otherwise
    # sqrt(v) is ~sqrt(1 - 0.999**2) of the gradient scale and the steps blow up: the loss of
    # the first sweep went to 310 / NaN); the timing and bytes do not depend on it.
    if variant == "hsdp-1bit":
        opt = qoptim.OneBitAdam(
            model.parameters(), lr=1e-3, freeze_step=max(1, args.warmup), bias_correction=True
        )
        return opt, args.warmup, args.steps
    from qshard.optim._schedules import next_sync_step

    h, freeze = args.zero_one_interval, max(1, args.warmup)
    kw = {"var_freeze_step": freeze, "local_step_scaler": 1, "local_step_clipper": h}
    opt = qoptim.ZeroOneAdam(model.parameters(), lr=1e-3, bias_correction=True, **kw)
    # Warm up through phase A and the growing intervals, up to a sync followed by interval H.
    sync = freeze
    while True:
        nxt = next_sync_step(sync, **kw)
        if nxt - sync >= h:
            break
        sync = nxt
    return opt, sync, 2 * h


def host_cpu_jiffies() -> tuple[int, int] | None:
    """The host's (busy, total) CPU time over all cores since boot, in clock ticks, from
    ``/proc/stat`` (not namespaced: every process on the machine counts), or None off Linux.
    Idle and iowait are idle; guest time is already inside user time."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    total = sum(fields)
    return total - fields[3] - fields[4], total


def round_schedule(steps: Sequence[int]) -> list[list[tuple[int, int]]]:
    """The interleaved timing order of variants with ``steps[v]`` timed steps each: round ``i``
    times step ``i`` of every variant that has one, as ``(variant index, step index)`` pairs, in
    the variant order rotated to start at variant ``i mod V`` (so no variant always runs right
    after the same one). Every step of every variant appears exactly once."""
    n = len(steps)
    return [
        [(v, i) for v in (*range(i % n, n), *range(i % n)) if i < steps[v]]
        for i in range(max(steps, default=0))
    ]


class _Run:
    """One variant's model, optimizer, ledger and link meter, with what its timed steps measured
    so far: built and warmed up as ``__init__`` runs, timed one step per :meth:`timed_step` call
    (each behind a barrier and metered alone, so steps of several variants can alternate), read
    out by :meth:`result` (collectives: every rank calls it, for the variants in one order)."""

    def __init__(self, variant, args, topology, corpus, rank, world):
        import torch

        from netsim.link import NodeLinkMeter
        from qshard.comm import CommLedger, recording

        self.args, self.corpus, self.rank, self.world = args, corpus, rank, world
        torch.manual_seed(args.seed)
        self.model = _build(variant, args, topology)
        self.opt, self.warmup, self.steps = _optimizer(variant, self.model, args)
        self.stepper = None
        if variant in STEP_IN_BACKWARD:
            from qshard.zeropp import StepInBackward

            self.stepper = StepInBackward(self.model, self.opt)
        self.ledger = CommLedger(topology)
        self.meter = NodeLinkMeter()
        self.load: float | None = None
        self.cpu: list[int] | None = [0, 0]  # host (busy, total) ticks over the timed steps
        self.ends: list[list[float]] = []  # per timed step: its forward's, backward's, step's end
        self.node_bytes: list[list[int]] = []  # per node: [tx, rx] summed over the timed steps
        with recording(self.ledger):
            self.losses = [self._step(i) for i in range(self.warmup)]
        self.ledger.reset()

    def _step(self, i: int, marks: list[float] | None = None) -> float:
        from qshard.train.data import batch_for_step

        x, y = batch_for_step(
            self.corpus.train,
            step=i,
            seed=self.args.seed,
            global_batch=self.args.batch_per_rank * self.world,
            context=self.args.context,
            rank=self.rank,
            world_size=self.world,
        )
        _, loss = self.model(x, y)
        if marks is not None:
            marks.append(time.perf_counter())
        loss.backward()
        if marks is not None:
            marks.append(time.perf_counter())
        if self.stepper is None:  # (else stepped inside backward)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def timed_step(self, i: int) -> None:
        """Time this variant's timed step ``i`` (0-based, after its warm-up)."""
        import torch.distributed as dist

        from qshard.comm import recording

        if self.load is None:  # the host's (not namespaced): what else ran as this row started
            self.load = os.getloadavg()[0]
        # The meter's barriers sit outside the timed span; every collective of a step has
        # finished when optimizer.step() returns (no prefetch crosses the step boundary), so
        # the bytes between start() and stop() are this step's alone.
        self.meter.start()
        with recording(self.ledger):
            dist.barrier()
            cpu0 = host_cpu_jiffies()  # read outside the timed span
            marks = [time.perf_counter()]
            self.losses.append(self._step(self.warmup + i, marks))
            marks.append(time.perf_counter())
            cpu1 = host_cpu_jiffies()
        if self.cpu is not None and cpu0 is not None and cpu1 is not None:
            self.cpu = [a + c1 - c0 for a, c0, c1 in zip(self.cpu, cpu0, cpu1, strict=True)]
        else:
            self.cpu = None
        per_node = self.meter.stop()
        self.ends.append([m - marks[0] for m in marks[1:]])
        if not self.node_bytes:
            self.node_bytes = [[0, 0] for _ in per_node]
        for acc, b in zip(self.node_bytes, per_node, strict=True):
            acc[0] += b.tx
            acc[1] += b.rx

    def result(self) -> dict[str, object]:
        import torch
        import torch.distributed as dist

        steps = self.steps
        summary = self.ledger.gather_summary()
        # Each boundary is its slowest rank's, the step's end (its time) included: one reduction
        # for all steps, after the metering. See the docstring for why not each phase's own MAX.
        t = torch.tensor(self.ends, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        fwd_end, bwd_end, step_end = t.unbind(1)
        return {
            "times": step_end.tolist(),
            "phase_times": {
                "forward": fwd_end.tolist(),
                "backward": (bwd_end - fwd_end).tolist(),
                "optimizer": (step_end - bwd_end).tolist(),
            },
            "node_tx": [tx / steps for tx, _ in self.node_bytes],
            "node_rx": [rx / steps for _, rx in self.node_bytes],
            "ledger_inter": summary.inter_node_bytes / steps,
            "ledger_intra": summary.intra_node_bytes / steps,
            "ledger_by_tag": [
                [e.tag, e.op, e.inter_node_bytes / steps, e.intra_node_bytes / steps]
                for e in summary.entries
            ],
            "warmup": self.warmup,
            "load": self.load,
            "cpu_busy": self.cpu[0] / self.cpu[1] if self.cpu and self.cpu[1] else None,
            "steps": steps,
            "loss_first": self.losses[0],
            "loss_last": self.losses[-1],
        }


def _measure_rate(variants, args, topology, corpus, rank, world) -> list[tuple[str, dict]]:
    """Every variant's row at the current link rate, as ``(variant, row)`` in the variant order
    (a variant named twice runs twice: a check of the order bias): with ``--interleave`` all
    variants are built and warmed up first and their timed steps alternate
    (:func:`round_schedule`); with ``--no-interleave`` each variant runs all its steps and is
    freed before the next is built."""
    if not args.interleave:
        out = []
        for variant in variants:
            run = _Run(variant, args, topology, corpus, rank, world)
            for i in range(run.steps):
                run.timed_step(i)
            out.append((variant, run.result()))
            del run
            gc.collect()  # the previous variant's model and optimizer go before the next is built
        return out
    runs = [_Run(v, args, topology, corpus, rank, world) for v in variants]
    for step_round in round_schedule([r.steps for r in runs]):
        for v, i in step_round:
            runs[v].timed_step(i)
    out = [(v, r.result()) for v, r in zip(variants, runs, strict=True)]
    if args.back_to_back:
        for (_, row), seconds in zip(out, _back_to_back(runs, args.back_to_back), strict=True):
            row["back_to_back"] = seconds
    del runs
    gc.collect()  # every variant's model and optimizer go before the next rate's are built
    return out


def _back_to_back(runs: list[_Run], blocks: int) -> list[list[float]]:
    """[Note: back-to-back blocks] Per run, the mean step time of each of ``blocks`` blocks of
    its ``steps`` steps run back to back (one barrier before the block and one after, none
    between its steps; the runs' blocks take turns). The interleaved timed steps are each
    metered alone between barriers, and other variants' steps run between two of a variant's:
    work a step leaves in flight past its end (the early forward gathers once tried with
    ``StepInBackward``) then finishes for free, which flattered such a schedule by 13%
    (docs/zeropp.md). Blocks time steps as training runs them."""
    import torch.distributed as dist

    out: list[list[float]] = [[] for _ in runs]
    for block in range(blocks):
        for k, run in enumerate(runs):
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(run.steps):
                run._step(run.warmup + run.steps * (block + 1) + i)
            dist.barrier()
            out[k].append((time.perf_counter() - t0) / run.steps)
    return out


def start_worker(args: argparse.Namespace):
    """A cluster rank's start, shared with ``step_profile.py``: one torch thread, the gloo world,
    the topology and the corpus. Returns ``(topology, corpus, rank, world)``."""
    import warnings

    import torch
    import torch.distributed as dist

    from qshard.comm import Topology
    from qshard.train.data import load_corpus

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.rank_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    topology = Topology.from_env()
    if rank == 0:
        load_corpus(min_tokens=args.context + 1)  # build the cache once, before the others read it
    dist.barrier()
    return topology, load_corpus(min_tokens=args.context + 1), rank, world


def worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from netsim.link import set_link_rate

    topology, corpus, rank, world = start_worker(args)
    results: dict[str, dict[str, object]] = {}
    skipped: dict[str, str] = {}
    # Rate 0 = unshaped: the compute-only steps of the limit column, first.
    for rate in ([0] if args.limit else []) + list(args.rate_list):
        set_link_rate(rate)
        variants = []
        for variant in args.variant_list:
            if why := _supported(variant, args.prefetch_depth):
                skipped[variant] = why
            else:
                variants.append(variant)
        t0 = time.perf_counter()
        rows = _measure_rate(variants, args, topology, corpus, rank, world)
        results[str(rate)] = dict(rows)  # a variant named twice: its last run's row
        if rank != 0:
            continue
        for variant, res in rows:
            blocks = res.get("back_to_back")
            print(
                f"[throughput] {rate_name(rate)} {variant:>10}: median "
                f"{statistics.median(res['times']):.3f} s/step, link "
                f"{max(res['node_tx']) / 2**20:.2f} MiB/step, ledger "
                f"{res['ledger_inter'] / 2**20:.2f} MiB/step"
                + (f", back to back {statistics.median(blocks):.3f} s/step" if blocks else ""),
                flush=True,
            )
        print(f"[throughput] {rate_name(rate)}: {time.perf_counter() - t0:.0f} s", flush=True)
    if rank == 0 and args.result_json:
        from qshard.train.model import GPT, GPTConfig

        n_params = GPT(
            GPTConfig(
                n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, context=args.context
            )
        ).num_params()
        with open(args.result_json, "w") as f:
            mtu = int(os.environ.get("NETSIM_MTU", "1500"))
            json.dump(
                {
                    "results": results,
                    "skipped": skipped,
                    "n_params": n_params,
                    "mtu": mtu,
                    "optimizer": args.optimizer,
                    "interleaved": args.interleave,
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------------------------
# Launcher: starts the emulated cluster, then turns the workers' numbers into the report.


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    if args.from_json:
        try:
            with open(args.from_json) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            print(
                f"throughput: cannot read --from-json {args.from_json}: {e}; pass a file an "
                "earlier run wrote with --out-json",
                file=sys.stderr,
            )
            return 2
        measured = data.get("optimizer", LEGACY_OPTIMIZER)
        if args.optimizer_given and args.optimizer != measured:
            print(
                f"throughput: {args.from_json} was measured with --optimizer {measured}; drop "
                f"--optimizer {args.optimizer} (a report cannot change what ran)",
                file=sys.stderr,
            )
            return 2
        # [Note: re-reported settings] in _throughput_report.py
        recorded = data.get("settings")
        if recorded is None:
            print(
                f"throughput: {args.from_json} does not record its settings or machine (written "
                "before they were recorded): the header gives this command line's model, steps "
                "and batch and this machine",
                file=sys.stderr,
            )
        else:
            given = _given(argv, SETTINGS)
            if wrong := {k: v for k, v in given.items() if k in recorded and recorded[k] != v}:
                flags = ", ".join(
                    f"--{k.replace('_', '-')} {v} (measured with {recorded[k]})"
                    for k, v in wrong.items()
                )
                print(
                    f"throughput: {args.from_json} was measured with other settings; drop "
                    f"{flags} (a report cannot change what ran)",
                    file=sys.stderr,
                )
                return 2
        report(args, data, data.get("wall_s", 0.0), origin=data.get("measured"))
        return 0
    from netsim.cluster import needs_root, run_cluster_args

    refused = needs_root("throughput")
    if refused is not None:
        return refused
    t0 = time.perf_counter()
    measured = run_origin()  # the launcher's host is the ranks' (network namespaces)
    run = run_cluster_args(__file__, argv, args, prefix="qtp")
    if run.rc != 0 or run.data is None:
        print(f"throughput: the emulated cluster run failed with status {run.rc}", file=sys.stderr)
        return run.rc or 1
    data = dict(
        run.data,
        load=list(run.load),
        wall_s=time.perf_counter() - t0,
        settings=run_settings(args),
        measured=measured,
    )
    report(args, data, data["wall_s"])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    if args.worker:
        return worker(args)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
