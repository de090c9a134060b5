"""What a rank running under ``netsim.sh`` can ask of its emulated link: its byte counters, the
bytes every node sent and received across a span of collectives, the header overhead to expect,
and a new shaped rate for the whole topology (so one launch can sweep several rates).

Only the standard library and ``torch.distributed``; importable from any script under
``benchmarks/`` (``sys.path`` holds the script's folder) as ``from netsim.link import ...``.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass

__all__ = [
    "LinkBytes",
    "LinkSampler",
    "NodeLinkMeter",
    "in_netsim",
    "read_link_bytes",
    "set_link_rate",
    "wire_overhead",
]


def in_netsim() -> bool:
    """True inside a rank started by ``netsim.sh run``."""
    return "NETSIM_PREFIX" in os.environ


@dataclass(frozen=True, slots=True)
class LinkBytes:
    """Bytes counted by one node's link interface (GSO super-packets, headers counted once each)."""

    tx: int
    rx: int

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(tx=self.tx - other.tx, rx=self.rx - other.rx)


def read_link_bytes(iface: str | None = None) -> LinkBytes:
    """This node's interface counters (``/sys`` is this namespace's view under ``ip netns exec``)."""
    iface = iface or os.environ.get("NETSIM_IFACE", "eth0")
    base = f"/sys/class/net/{iface}/statistics"
    with open(f"{base}/tx_bytes") as f_tx, open(f"{base}/rx_bytes") as f_rx:
        return LinkBytes(tx=int(f_tx.read()), rx=int(f_rx.read()))


def wire_overhead(mtu: int | None = None) -> float:
    """Frame bytes per payload byte as tbf charges them: (MTU + 14) / (MTU - 52) for TCP/IPv4.

    The interface counters see GSO super-packets (headers once per 64 KiB), while the shaper charges
    the headers of every MTU-sized segment, so time predictions use this factor and byte
    comparisons against the counters do not.
    """
    mtu = mtu or int(os.environ.get("NETSIM_MTU", "1500"))
    return (mtu + 14) / (mtu - 52)


class NodeLinkMeter:
    """Bytes each node's link carried between :meth:`start` and :meth:`stop`, on every rank.

    Both ends synchronise the whole world first (a barrier after the measured ops), because a
    rank's collective can return while a peer's bytes are still queued in the shaper: without it
    an all-to-all was under-counted by up to 23% here. The barrier's own few hundred bytes are
    part of the reading.
    """

    def __init__(self, group=None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._start: LinkBytes | None = None

    def start(self) -> None:
        self._dist.barrier(group=self._group)
        self._start = read_link_bytes()

    def stop(self) -> list[LinkBytes]:
        """Per node (indexed by ``NODE_RANK``): the counter deltas since :meth:`start`."""
        if self._start is None:
            raise RuntimeError("NodeLinkMeter.stop() called before start()")
        self._dist.barrier(group=self._group)
        delta = read_link_bytes() - self._start
        self._start = None
        per_rank: list[tuple[int, int, int]] = [None] * self._dist.get_world_size(self._group)  # type: ignore[list-item]
        self._dist.all_gather_object(
            per_rank, (int(os.environ["NODE_RANK"]), delta.tx, delta.rx), group=self._group
        )
        nodes = int(os.environ["NNODES"])
        out: list[LinkBytes] = [LinkBytes(tx=0, rx=0)] * nodes
        for node, tx, rx in per_rank:
            # Every rank of a node reads the same counters; keep the largest (the latest read).
            if tx >= out[node].tx:
                out[node] = LinkBytes(tx=tx, rx=rx)
        return out


class LinkSampler:
    """This node's link counters, read every ``interval_s`` on a background thread and stamped
    with ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux: one clock for every process of the
    host, so the samples line up with the ranks' own marks).

    The counters move when the shaper lets a packet out (tbf sits before the interface's
    transmit), so their slope is what the emulated wire carried at each moment. One sampler per
    node is enough (every rank of a node reads the same counters); a 1 ms period costs the
    sampling rank a few percent of one core.
    """

    def __init__(self, interval_s: float = 0.001) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0; got {interval_s!r}")
        self._interval = interval_s
        self._samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("LinkSampler.start() called twice without stop()")
        self._samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="link-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            b = read_link_bytes()
            self._samples.append((time.perf_counter(), b.tx, b.rx))
            if self._stop.wait(self._interval):
                b = read_link_bytes()
                self._samples.append((time.perf_counter(), b.tx, b.rx))
                return

    def stop(self) -> list[tuple[float, int, int]]:
        """The samples ``(perf_counter seconds, tx bytes, rx bytes)`` since :meth:`start`."""
        if self._thread is None:
            raise RuntimeError("LinkSampler.stop() called before start()")
        self._stop.set()
        self._thread.join()
        self._thread = None
        return self._samples


def set_link_rate(rate_mbit: int, group=None) -> None:
    """Re-shape every node link of this topology to ``rate_mbit`` (0 = unshaped), from all ranks.

    Rank 0 calls ``netsim.sh rate``; everyone waits at barriers on both sides so no collective
    straddles the change.
    """
    import torch.distributed as dist

    if not in_netsim():
        raise RuntimeError("set_link_rate needs a rank started by benchmarks/netsim/netsim.sh run")
    dist.barrier(group=group)
    if dist.get_rank() == 0:
        subprocess.run(
            [
                os.environ["NETSIM_SCRIPT"],
                "-p",
                os.environ["NETSIM_PREFIX"],
                "-b",
                str(int(rate_mbit)),
                "rate",
            ],
            check=True,
        )
    os.environ["NETSIM_RATE_MBIT"] = str(int(rate_mbit))
    dist.barrier(group=group)
