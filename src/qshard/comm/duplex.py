"""Exchanges that use both directions of a gloo connection at once.

[Note: gloo exchanges are half duplex] gloo keeps one TCP connection per pair of ranks in a
process group, and a pair's sends and receives take turns on it: when two ranks exchange
buffers (a 2-rank all-gather, any all-to-all, an ``isend`` / ``irecv`` pair), one rank's bytes
go first and the other's mostly after. Measured on the emulated cluster (``netsim.sh -n 2 -r 1
-b 400``, 3.16 MB each way, one thread per rank, 2026-12-04 on a 2-core Zen 4 host):

- one way (``send`` / ``recv``): 0.89-0.94x of bytes over the link rate;
- both ways on one group (``isend`` + ``irecv``): 1.66-1.94x; ``all_gather`` of 2 ranks:
  1.42-1.52x (a tbf queue of 5 ms instead of 100 ms and cubic instead of BBR changed nothing;
  ``ss -ti`` showed rank 0's 12.6 MB all sent before rank 1's first byte arrived);
- both ways, each direction on a group of its own: **1.00-1.03x**.

So a full-duplex exchange on gloo needs two groups of the same ranks. Here a group of 2
ranks exchanges as two broadcasts, rank 0's bytes on ``group`` and rank 1's on its ``twin``,
so each connection carries one direction; they are gloo collectives, run by each group's own
worker threads, so ``is_completed()`` polls them (gloo's ``isend`` / ``irecv`` handles report
completion only once waited for, which would stall a non-blocking drain). Larger groups,
NCCL and any other backend, and CUDA tensors get the plain collective: NCCL is full duplex
already, and a gloo ring over more than 2 ranks sends each pair's bytes one way only (gloo's
all-to-all over more than 2 ranks stays half duplex per pair: not changed here).

The twin is a second ``new_group`` of the same ranks (:meth:`qshard.comm.Topology.twin_group`),
created like every group, collectively. Every rank issues its exchanges at the same program
points, group by group in the same order, as for any collective. Values are bit-identical to
the collectives' (the same bytes, placed the same way; tested).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["all_gather_single", "all_to_all_single", "is_duplex"]


class _ExchangeWork(dist.distributed_c10d.Work):
    """The handle of a duplex exchange: its two broadcasts, one per direction.

    A ``torch.distributed`` ``Work`` (FSDP2 waits only on those). ``wait()`` waits for all of
    them; ``is_completed()`` polls without blocking.
    """

    def __init__(self, works: Sequence[dist.Work]) -> None:
        super().__init__()
        self._works = list(works)

    def wait(self, timeout: object = None) -> bool:
        for w in self._works:
            w.wait()
        self._works = []
        return True

    def is_completed(self) -> bool:
        if all(w.is_completed() for w in self._works):
            self._works = []
        return not self._works

    def is_success(self) -> bool:
        return self.is_completed()


def is_duplex(
    group: dist.ProcessGroup | None, twin: dist.ProcessGroup | None, t: torch.Tensor
) -> bool:
    """Whether an exchange on ``group`` of tensor ``t`` takes the two-group path: a twin was
    given, the group has 2 ranks, the backend is gloo and the tensor lives on the CPU."""
    if twin is None or group is None or t.device.type != "cpu":
        return False
    return dist.get_world_size(group) == 2 and dist.get_backend(group) == "gloo"


def _exchange(
    send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup, twin: dist.ProcessGroup
) -> _ExchangeWork:
    """Send ``send`` to the group's other rank and receive its row into ``recv``: group rank
    0's bytes as a broadcast on ``group``, rank 1's on ``twin``."""
    first, second = dist.get_process_group_ranks(group)
    mine_first = dist.get_rank(group) == 0
    works = [
        dist.broadcast(send if mine_first else recv, src=first, group=group, async_op=True),
        dist.broadcast(recv if mine_first else send, src=second, group=twin, async_op=True),
    ]
    return _ExchangeWork(works)


def _swap(
    output: torch.Tensor,
    input: torch.Tensor,
    rows_of: int,
    group: dist.ProcessGroup,
    twin: dist.ProcessGroup,
    async_op: bool,
) -> dist.Work | None:
    """The 2-rank exchange of both functions: ``output`` as 2 rows, the other rank's received
    in its row and this rank's own copied in; ``input`` as ``rows_of`` rows (2: row j goes to
    group rank j; 1: the whole input goes to both)."""
    if not (input.is_contiguous() and output.is_contiguous()):
        raise ValueError("duplex exchanges need contiguous input and output tensors")
    me = dist.get_rank(group)
    out, inp = output.view(2, -1), input.view(rows_of, -1)
    handle = _exchange(inp[(1 - me) % rows_of], out[1 - me], group, twin)
    out[me].copy_(inp[me % rows_of])
    if async_op:
        return handle
    handle.wait()
    return None


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    twin: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """``dist.all_to_all_single(output, input, group=group)`` with equal splits (row ``j`` of
    ``input`` viewed as ``(group size, -1)`` goes to group rank ``j``; row ``j`` of ``output``
    comes from it); on gloo, a group of 2 exchanges both ways at once (the module's Note)."""
    if not is_duplex(group, twin, input):
        return dist.all_to_all_single(output, input, group=group, async_op=async_op)
    if input.numel() % 2 or output.numel() != input.numel():
        raise ValueError(
            f"all_to_all_single with equal splits needs input and output of one size divisible "
            f"by the group size 2; got {input.numel()} and {output.numel()} elements"
        )
    assert twin is not None
    return _swap(output, input, 2, group, twin, async_op)


def all_gather_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    twin: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """``dist.all_gather_into_tensor(output, input, group=group)``; on gloo, a group of 2
    exchanges its two rows both ways at once (larger groups: gloo's ring, which already sends
    each pair's bytes one way)."""
    if not is_duplex(group, twin, input):
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(output, input, group=group, async_op=async_op)
    if output.numel() != 2 * input.numel():
        raise ValueError(
            f"all_gather_single over 2 ranks needs an output of twice the input's "
            f"{input.numel()} elements; got {output.numel()}"
        )
    assert twin is not None
    return _swap(output, input, 1, group, twin, async_op)
