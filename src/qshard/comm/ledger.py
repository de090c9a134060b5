"""CommLedger: the bytes every collective moves, split into intra-node and inter-node links.

Every collective qshard issues (and, through the recording comms of :mod:`qshard.zeropp`,
every collective FSDP2 issues in a baseline run) calls :meth:`CommLedger.record` with the
logical size of the tensor it moves. The ledger turns that into link bytes with a fixed cost
model, so ZeRO-3 and ZeRO++ are measured by the same ruler.

[Note: ledger cost model] The paper counts *bytes leaving each node* under bandwidth-optimal
algorithms; so does the ledger. For a collective over a group of ``P`` ranks:

* ``all_gather`` / ``reduce_scatter`` of a full (gathered / pre-scatter) tensor of ``M`` bytes
  run as a ring over the group's ranks in node-major order: every rank sends ``(P-1)/P * M``
  to its successor. A ring over ranks of ``k`` nodes crosses a node boundary on exactly ``k``
  of its links (when ``k > 1``), so each node sends ``(P-1)/P * M`` across nodes and the rest
  of its ring links are intra-node.
* ``all_reduce`` of ``M`` bytes is a ring reduce-scatter plus a ring all-gather: twice that.
* ``all_to_all`` where each rank's input buffer is ``B`` bytes, in ``P`` equal chunks: every
  rank sends ``B/P`` to each of its ``P-1`` peers (direct exchange), intra- or inter-node by
  the peer's node.
* ``broadcast`` of ``M`` bytes is a pipelined chain starting at the root, node-major: every
  rank but the last sends ``M``.

Each rank's ledger sees only the collectives its rank joins. It credits itself with an equal
share of what its node sends in that collective (the node's bytes divided by the group's
ranks on that node). Under SPMD execution, where every rank of a node joins an equivalent
collective (FSDP2 and ZeRO++ do: every node runs its own intra-node gather, every local rank
its own inter-node all-to-all), a node's bytes are its ranks' shares summed, i.e. this rank's
share times ``ranks_per_node``; that is what :class:`LedgerSummary` reports as
``intra_node_bytes`` / ``inter_node_bytes`` ("per node"). :meth:`CommLedger.gather_summary`
sums the shares of the real ranks instead (a collective) and reports the busiest node, with
no SPMD assumption.

Collectives deep inside FSDP2 hooks find the ledger through :func:`active_ledger`, set with
``with recording(ledger): ...``; recording is a no-op when no ledger is active.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from qshard.comm.topology import Topology

__all__ = [
    "OPS",
    "CommLedger",
    "LedgerEntry",
    "LedgerSummary",
    "active_ledger",
    "record",
    "recording",
]

OPS: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
"""The collective kinds the ledger knows the cost of."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LedgerEntry:
    """Bytes of one (tag, op) pair over some span of recording.

    Attributes:
        tag: what the collective is for, e.g. ``"fwd_all_gather"`` or ``"grad_reduce_scatter"``.
        op: the collective kind, one of :data:`OPS`.
        calls: number of collectives recorded.
        tensor_bytes: sum of the logical tensor sizes passed to :meth:`CommLedger.record`.
        intra_node_bytes: bytes sent on links inside a node, per node (see the cost model).
        inter_node_bytes: bytes leaving a node, per node.
    """

    tag: str
    op: str
    calls: int
    tensor_bytes: int
    intra_node_bytes: float
    inter_node_bytes: float


@dataclass(frozen=True, kw_only=True, slots=True)
class LedgerSummary:
    """Per (tag, op) bytes plus totals and event counters (e.g. counted fallbacks).

    Attributes:
        entries: one :class:`LedgerEntry` per (tag, op), in first-recorded order.
        events: named counters recorded with :meth:`CommLedger.count`.
        steps: number of closed steps this summary covers (0 for an open step alone).
    """

    entries: tuple[LedgerEntry, ...]
    events: tuple[tuple[str, int], ...] = ()
    steps: int = 0

    @property
    def intra_node_bytes(self) -> float:
        return sum(e.intra_node_bytes for e in self.entries)

    @property
    def inter_node_bytes(self) -> float:
        return sum(e.inter_node_bytes for e in self.entries)

    def select(self, *, tag: str | None = None, op: str | None = None) -> list[LedgerEntry]:
        """Entries matching ``tag`` and/or ``op`` (``None`` matches all)."""
        return [
            e for e in self.entries if (tag is None or e.tag == tag) and (op is None or e.op == op)
        ]

    def inter(self, *, tag: str | None = None, op: str | None = None) -> float:
        """Inter-node bytes per node of the matching entries."""
        return sum(e.inter_node_bytes for e in self.select(tag=tag, op=op))

    def intra(self, *, tag: str | None = None, op: str | None = None) -> float:
        """Intra-node bytes per node of the matching entries."""
        return sum(e.intra_node_bytes for e in self.select(tag=tag, op=op))

    def event(self, name: str) -> int:
        return dict(self.events).get(name, 0)

    def rows(self) -> list[tuple[str, str, int, int, float, float]]:
        """(tag, op, calls, tensor_bytes, intra_node_bytes, inter_node_bytes) per entry."""
        return [
            (e.tag, e.op, e.calls, e.tensor_bytes, e.intra_node_bytes, e.inter_node_bytes)
            for e in self.entries
        ]


def _ring_order(ranks: Sequence[int]) -> list[int]:
    return sorted(ranks)


def link_bytes(
    op: str,
    *,
    group_ranks: Sequence[int],
    tensor_bytes: int,
    topology: Topology,
    root: int | None = None,
) -> dict[int, tuple[float, float]]:
    """Bytes each rank of the group sends under the cost model, as ``rank -> (intra, inter)``.

    See [Note: ledger cost model]. Exposed for tests and benchmarks.
    """
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; expected one of {OPS}")
    ranks = list(group_ranks)
    if len(set(ranks)) != len(ranks) or not ranks:
        raise ValueError(f"group_ranks must be non-empty and distinct; got {ranks}")
    if tensor_bytes < 0:
        raise ValueError(f"tensor_bytes must be >= 0; got {tensor_bytes}")
    sent: dict[int, list[float]] = {r: [0.0, 0.0] for r in ranks}
    p = len(ranks)
    if p == 1:
        return {r: (0.0, 0.0) for r in ranks}

    def send(src: int, dst: int, nbytes: float) -> None:
        cross = topology.node_of(src) != topology.node_of(dst)
        sent[src][1 if cross else 0] += nbytes

    if op in ("all_gather", "reduce_scatter", "all_reduce"):
        order = _ring_order(ranks)
        per_link = (p - 1) / p * tensor_bytes * (2 if op == "all_reduce" else 1)
        for i, src in enumerate(order):
            send(src, order[(i + 1) % p], per_link)
    elif op == "all_to_all":
        # every rank sends a chunk to each other rank: k - 1 of them on its node (k: the
        # group's ranks there), p - k across. Counted per node, not per pair: the pairs cost
        # O(p^2) per record (a record over 2048 ranks took a second of host time).
        chunk = tensor_bytes / p
        node = {r: topology.node_of(r) for r in ranks}
        on_node = collections.Counter(node.values())
        for src in ranks:
            k = on_node[node[src]]
            sent[src][0] += chunk * (k - 1)
            sent[src][1] += chunk * (p - k)
    else:  # broadcast
        order = _ring_order(ranks)
        root = order[0] if root is None else root
        if root not in order:
            raise ValueError(f"broadcast root {root} is not in group {ranks}")
        start = order.index(root)
        chain = order[start:] + order[:start]
        for src, dst in itertools.pairwise(chain):
            send(src, dst, float(tensor_bytes))
    return {r: (v[0], v[1]) for r, v in sent.items()}


class _Acc:
    __slots__ = ("calls", "inter", "intra", "tensor_bytes")

    def __init__(self) -> None:
        self.calls = 0
        self.tensor_bytes = 0
        self.intra = 0.0
        self.inter = 0.0

    def add(self, other: _Acc) -> None:
        self.calls += other.calls
        self.tensor_bytes += other.tensor_bytes
        self.intra += other.intra
        self.inter += other.inter


class CommLedger:
    """Accumulates this rank's share of link bytes per (tag, op), step by step.

    Thread-safe: FSDP2 may issue collectives from autograd hooks.
    """

    def __init__(self, topology: Topology, *, max_history: int | None = 1000) -> None:
        if max_history is not None and (
            isinstance(max_history, bool) or not isinstance(max_history, int) or max_history < 0
        ):
            raise ValueError(f"max_history must be None or an int >= 0; got {max_history!r}")
        self.topology = topology
        self._max_history = max_history
        self._lock = threading.Lock()
        self._current: dict[tuple[str, str], _Acc] = {}
        self._total: dict[tuple[str, str], _Acc] = {}
        self._events_current: dict[str, int] = {}
        self._events_total: dict[str, int] = {}
        self._steps = 0
        self.history: collections.deque[LedgerSummary] = collections.deque(maxlen=max_history)
        """Summaries of the last ``max_history`` closed steps (all with ``None``), in order:
        kept whole, a long run grew by ~0.6 KiB per step and rank without bound (the totals
        are kept apart, in :meth:`summary`)."""

    def record(
        self,
        op: str,
        *,
        group_ranks: Sequence[int],
        tensor_bytes: int,
        tag: str,
        root: int | None = None,
    ) -> None:
        """Record one collective this rank takes part in.

        Args:
            op: one of :data:`OPS`.
            group_ranks: global ranks of the collective's group (this rank among them).
            tensor_bytes: for ``all_gather`` / ``reduce_scatter`` / ``all_reduce`` /
                ``broadcast``: bytes of the FULL tensor (gathered, pre-scatter, reduced,
                broadcast); for ``all_to_all``: bytes of ONE rank's input buffer.
            tag: what it is for; entries are kept per (tag, op).
            root: the source rank of a ``broadcast`` (default: the lowest rank).
        """
        me = self.topology.rank
        if me not in group_ranks:
            raise ValueError(
                f"rank {me} recorded a collective over {list(group_ranks)} it is not part of; "
                "record only collectives this rank joins"
            )
        sent = link_bytes(
            op,
            group_ranks=group_ranks,
            tensor_bytes=int(tensor_bytes),
            topology=self.topology,
            root=root,
        )
        my_node = self.topology.node_of(me)
        on_my_node = [r for r in sent if self.topology.node_of(r) == my_node]
        # An equal share of what this node sends in this collective (see the cost model).
        intra = sum(sent[r][0] for r in on_my_node) / len(on_my_node)
        inter = sum(sent[r][1] for r in on_my_node) / len(on_my_node)
        with self._lock:
            acc = self._current.setdefault((tag, op), _Acc())
            acc.calls += 1
            acc.tensor_bytes += int(tensor_bytes)
            acc.intra += intra
            acc.inter += inter

    def count(self, event: str, n: int = 1) -> None:
        """Count a named event (e.g. a fallback), reported in the summaries."""
        with self._lock:
            self._events_current[event] = self._events_current.get(event, 0) + n

    def _summarize(
        self, accs: dict[tuple[str, str], _Acc], events: dict[str, int], steps: int
    ) -> LedgerSummary:
        rpn = self.topology.ranks_per_node
        return LedgerSummary(
            entries=tuple(
                LedgerEntry(
                    tag=tag,
                    op=op,
                    calls=a.calls,
                    tensor_bytes=a.tensor_bytes,
                    intra_node_bytes=a.intra * rpn,
                    inter_node_bytes=a.inter * rpn,
                )
                for (tag, op), a in accs.items()
            ),
            events=tuple(events.items()),
            steps=steps,
        )

    def step(self) -> LedgerSummary:
        """Close the current step: return its summary and start a new one."""
        with self._lock:
            out = self._summarize(self._current, self._events_current, 1)
            for key, acc in self._current.items():
                self._total.setdefault(key, _Acc()).add(acc)
            for name, n in self._events_current.items():
                self._events_total[name] = self._events_total.get(name, 0) + n
            self._current = {}
            self._events_current = {}
            self._steps += 1
            self.history.append(out)
        return out

    def current(self) -> LedgerSummary:
        """The open step so far (not closed)."""
        with self._lock:
            return self._summarize(self._current, self._events_current, 0)

    def summary(self) -> LedgerSummary:
        """Totals over every closed step plus the open one."""
        with self._lock:
            merged: dict[tuple[str, str], _Acc] = {}
            for src in (self._total, self._current):
                for key, acc in src.items():
                    merged.setdefault(key, _Acc()).add(acc)
            events = dict(self._events_total)
            for name, n in self._events_current.items():
                events[name] = events.get(name, 0) + n
            return self._summarize(merged, events, self._steps)

    def reset(self) -> None:
        """Forget everything recorded."""
        with self._lock:
            self._current, self._total = {}, {}
            self._events_current, self._events_total = {}, {}
            self._steps = 0
            self.history = collections.deque(maxlen=self._max_history)

    def gather_summary(self, group: object | None = None) -> LedgerSummary:
        """Totals with exact per-node bytes: every rank's share summed per node, busiest node
        reported per entry. Collective over ``group`` (default: the world); needs every rank
        of the world to call it. ``calls``, ``tensor_bytes`` and the events are this rank's,
        as in :meth:`summary`. In a single process without an initialised process group (a
        topology of world size 1), this process's own totals: there is nothing to gather."""
        import torch.distributed as dist

        with self._lock:
            merged: dict[tuple[str, str], _Acc] = {}
            for src in (self._total, self._current):
                for key, acc in src.items():
                    merged.setdefault(key, _Acc()).add(acc)
            mine = {key: (a.calls, a.tensor_bytes, a.intra, a.inter) for key, a in merged.items()}
            events = dict(self._events_total)
            for name, n in self._events_current.items():
                events[name] = events.get(name, 0) + n
        if dist.is_available() and dist.is_initialized():
            gathered: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, (self.topology.rank, mine), group=group)
        elif group is None and self.topology.world_size == 1:
            gathered = [(self.topology.rank, mine)]  # a single process: nothing to gather
        else:
            raise RuntimeError(
                "gather_summary is a collective over the ranks of the job: call "
                "torch.distributed.init_process_group first (without one, it works only for a "
                "single-process topology, world_size=1, with group=None; summary() is the "
                "SPMD estimate without communication)"
            )
        keys: list[tuple[str, str]] = []
        for _, d in gathered:
            keys += [k for k in d if k not in keys]
        entries = []
        for key in keys:
            per_node_intra: dict[int, float] = {}
            per_node_inter: dict[int, float] = {}
            calls = tbytes = 0
            for rank, d in gathered:
                if key not in d:
                    continue
                c, t, intra, inter = d[key]
                node = self.topology.node_of(rank)
                per_node_intra[node] = per_node_intra.get(node, 0.0) + intra
                per_node_inter[node] = per_node_inter.get(node, 0.0) + inter
                if rank == self.topology.rank:
                    calls, tbytes = c, t
            entries.append(
                LedgerEntry(
                    tag=key[0],
                    op=key[1],
                    calls=calls,
                    tensor_bytes=tbytes,
                    intra_node_bytes=max(per_node_intra.values()),
                    inter_node_bytes=max(per_node_inter.values()),
                )
            )
        return LedgerSummary(
            entries=tuple(entries), events=tuple(events.items()), steps=self._steps
        )


_ACTIVE: list[CommLedger] = []
_ACTIVE_LOCK = threading.Lock()


def active_ledger() -> CommLedger | None:
    """The innermost ledger set by :func:`recording`, or ``None``.

    A process-wide stack rather than a context variable: autograd runs backward hooks on
    other threads, which would not see a context variable set on the main thread.
    """
    with _ACTIVE_LOCK:
        return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def recording(ledger: CommLedger) -> Iterator[CommLedger]:
    """Make ``ledger`` the active ledger inside the ``with`` block."""
    with _ACTIVE_LOCK:
        _ACTIVE.append(ledger)
    try:
        yield ledger
    finally:
        with _ACTIVE_LOCK:
            # The innermost entry of this ledger: list.remove took the outermost, so after
            # `with recording(a): with recording(b): with recording(a): ...` b's block went on
            # recording into a.
            idx = max(i for i, entry in enumerate(_ACTIVE) if entry is ledger)
            del _ACTIVE[idx]


def record(
    op: str,
    *,
    group_ranks: Sequence[int],
    tensor_bytes: int,
    tag: str,
    root: int | None = None,
) -> None:
    """Record onto the active ledger, if any (see :meth:`CommLedger.record`)."""
    ledger = active_ledger()
    if ledger is not None:
        ledger.record(op, group_ranks=group_ranks, tensor_bytes=tensor_bytes, tag=tag, root=root)
