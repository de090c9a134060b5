"""The ordered background issuer of qwZ's second hop (CPU / gloo).

[Note: background hop 2] qwZ's two-hop gather ([Note: qwZ route]) can only issue its intra-node
hop once the inter-node hop has arrived. On gloo, ``Work.wait()`` blocks the calling thread, so
issuing hop 2 from the handle's ``wait()`` ([Note: qwZ hop order]) puts the intra-node transfer,
and the wait for the node partner to issue its own hop 2, on the compute thread's critical path:
the step profile measured 15-62 ms per rank per step in ``qshard::qwz::wait_intra`` at
100 Mbit/s. An :class:`OrderedIssuer` is one daemon thread per process group that takes the
hop 2s in submission order (the program order of the gathers' calls, the same on every rank),
waits for each one's hop 1 and issues its hop 2 at once, so hop 2 runs while the compute
thread goes on; the handle's ``wait()`` then only waits for a transfer already under way.

Collectives of one group must be issued in the same order on every rank. The issuer's group is
used by the issuer thread alone (a second group over the node's ranks, not the one qgZ's hops
use from the compute thread), and it issues strictly in submission order, one at a time, so its
order is the calls' program order, independent of timing. Deadlock-free for the same reason as
[Note: qwZ hop order]: the issuer only waits for a hop 1 that every rank issued at an earlier
program point.

Errors: a failed hop 1 or hop 2 (a dead peer, a timeout) is stored in its ticket and raised
from that gather's ``wait()``; the issuer then refuses every later ticket (its group's order
is lost, as with any failed collective: restart), raising the first error from each.

On CUDA (NCCL) ``Work.wait()`` only makes the current stream wait, without blocking the host,
so there hop 2 is issued at the call right after hop 1 and needs no thread (see
:class:`~qshard.zeropp.all_gather.QuantizedAllGather`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch.distributed as dist

__all__ = ["OrderedIssuer", "Ticket", "issuer_for"]


class Ticket:
    """One submitted second hop: wait for it with :meth:`wait`."""

    __slots__ = ("_done", "_error", "_first", "_issue", "_work")

    def __init__(self, first: dist.Work, issue: Callable[[], dist.Work]) -> None:
        self._first, self._issue = first, issue
        self._work: dist.Work | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()

    def wait(self) -> None:
        """Block until the second hop has been issued and has arrived; raise its error."""
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(
                f"qwZ's intra-node hop failed ({type(self._error).__name__}: {self._error})"
            ) from self._error
        assert self._work is not None
        self._work.wait()
        self._work = None


class OrderedIssuer:
    """A daemon thread issuing second hops in submission order (see [Note: background hop 2]).

    Args:
        name: the thread's name (shows in stack dumps and profilers).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Ticket | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._failed: BaseException | None = None

    def submit(self, first: dist.Work, issue: Callable[[], dist.Work]) -> Ticket:
        """Queue ``issue`` (which issues the second hop and returns its handle) to run as soon
        as ``first`` (the first hop's handle) has completed and every earlier ticket is issued."""
        ticket = Ticket(first, issue)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, args=(self._queue,), name=self._name, daemon=True
                )
                self._thread.start()
            self._queue.put(ticket)
        return ticket

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread after the tickets queued so far (tests, a new default group). A
        thread still blocked on a hop that never arrives (its group torn down) is left behind
        after ``timeout`` seconds: it is a daemon and holds nothing but the dead group."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:  # the old thread ends on its own queue; a new one gets a new one
                self._queue.put(None)
                self._queue = queue.SimpleQueue()
        if thread is not None:
            thread.join(timeout)

    def _run(self, tickets: queue.SimpleQueue[Ticket | None]) -> None:
        while (ticket := tickets.get()) is not None:
            try:
                if self._failed is not None:
                    raise RuntimeError(
                        "an earlier intra-node hop of this group failed, so its collectives are "
                        "out of step across ranks; restart the job"
                    ) from self._failed
                ticket._first.wait()
                ticket._work = ticket._issue()
            except BaseException as exc:  # raised from the gather's wait(), on the caller
                ticket._error = exc
                if self._failed is None:
                    self._failed = exc
            finally:
                ticket._first = ticket._issue = None  # type: ignore[assignment]
                ticket._done.set()


# id(group) -> (the default group it was created under, the group, its issuer)
_ISSUERS: dict[int, tuple[object, dist.ProcessGroup, OrderedIssuer]] = {}
_ISSUERS_LOCK = threading.Lock()


def issuer_for(group: dist.ProcessGroup) -> OrderedIssuer:
    """The one issuer of ``group`` in this process (every gather on the group must share it, or
    two threads would issue on one group). Issuers of groups created under an earlier default
    process group are closed and dropped."""
    world = dist.group.WORLD
    with _ISSUERS_LOCK:
        for key in [k for k, (w, _, _) in _ISSUERS.items() if w is not world]:
            _ISSUERS.pop(key)[2].close()
        hit = _ISSUERS.get(id(group))
        if hit is None or hit[1] is not group:
            hit = (world, group, OrderedIssuer(f"qshard-hop2-{id(group):x}"))
            _ISSUERS[id(group)] = hit
        return hit[2]
