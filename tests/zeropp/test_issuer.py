"""The ordered background issuer of qwZ's hop 2 ([Note: background hop 2]), in one process with
stand-in work handles: second hops are issued strictly in submission order whatever order the
first hops complete in, a ticket's wait() waits for its own hop, and a failure is raised from its
ticket and from every later one. Its use in the real two-hop gather (gloo, 4 ranks, bit-identical
to the flat gather, training) is in test_hier_gather.py."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from qshard.zeropp._issuer import OrderedIssuer, issuer_for

TIMEOUT = 10.0


class FakeWork:
    """A work handle whose wait() blocks until :meth:`complete` (or raises ``error``)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.event = threading.Event()
        self.error = error
        self.waited = 0

    def complete(self) -> None:
        self.event.set()

    def wait(self, timeout: object = None) -> bool:
        assert self.event.wait(TIMEOUT), "stand-in work never completed"
        self.waited += 1
        if self.error is not None:
            raise self.error
        return True


def test_issues_in_submission_order_whatever_completes_first():
    issuer = OrderedIssuer("test-hop2")
    issued: list[int] = []
    firsts = [FakeWork() for _ in range(3)]
    seconds = [FakeWork() for _ in range(3)]

    def issue(i: int):
        issued.append(i)
        return seconds[i]

    tickets = [issuer.submit(firsts[i], lambda i=i: issue(i)) for i in range(3)]
    firsts[2].complete()  # the last first hop arrives first: nothing may be issued yet
    firsts[1].complete()
    assert not tickets[0]._done.wait(0.2) and issued == []
    firsts[0].complete()
    for s in seconds:
        s.complete()
    for t in tickets:
        t.wait()
    assert issued == [0, 1, 2]
    assert all(s.waited == 1 for s in seconds)
    issuer.close()


def test_ticket_waits_for_its_second_hop():
    issuer = OrderedIssuer("test-hop2")
    first, second = FakeWork(), FakeWork()
    first.complete()
    ticket = issuer.submit(first, lambda: second)
    done = threading.Event()
    threading.Thread(target=lambda: (ticket.wait(), done.set()), daemon=True).start()
    assert not done.wait(0.2)  # hop 2 issued but not arrived
    second.complete()
    assert done.wait(TIMEOUT)
    issuer.close()


def test_failure_is_raised_from_its_ticket_and_every_later_one():
    issuer = OrderedIssuer("test-hop2")
    bad = FakeWork(error=RuntimeError("peer died"))
    bad.complete()
    issued: list[int] = []
    t1 = issuer.submit(bad, lambda: issued.append(1))
    good = FakeWork()
    good.complete()
    t2 = issuer.submit(good, lambda: issued.append(2))
    with pytest.raises(RuntimeError, match=r"intra-node hop failed.*peer died"):
        t1.wait()
    with pytest.raises(RuntimeError, match="out of step across ranks; restart"):
        t2.wait()
    assert issued == []  # nothing issued after the failure: the group's order is lost
    issuer.close()


def test_close_is_idempotent_and_a_closed_issuer_restarts():
    issuer = OrderedIssuer("test-hop2")
    issuer.close()  # never started
    w = FakeWork()
    w.complete()
    second = FakeWork()
    second.complete()
    issuer.submit(w, lambda: second).wait()
    issuer.close()
    issuer.close()
    issuer.submit(w, lambda: second).wait()  # a new thread
    issuer.close()


def test_issuer_for_is_one_per_group():
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    a, b = object(), object()  # stand-ins: issuer_for only keys on the group object
    assert issuer_for(a) is issuer_for(a)  # type: ignore[arg-type]
    assert issuer_for(a) is not issuer_for(b)  # type: ignore[arg-type]
