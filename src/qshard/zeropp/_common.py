"""Pieces shared by qshard's FSDP2 comms: the wire-dtype base, the deferred work handle, the phase
tag, logging once."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.profiler import record_function

from qshard._fsdp import fsdp_param_groups, trainable_shard_numel
from qshard.comm.topology import Topology

__all__ = [
    "WIRE_DTYPES",
    "DeferredWork",
    "SizeVerdict",
    "WireComm",
    "frame_numel",
    "group_ranks",
    "log_once",
    "phase_tag",
    "sum_rows",
    "unequal_shards",
]

logger = logging.getLogger("qshard.zeropp")


def frame_numel(unit: object | None, numel: int) -> int:
    """The shard size a compressed reduction's wire rows are framed for: FSDP unit ``unit``'s
    with every trainable parameter's gradient, or ``numel`` if larger or unknown (no unit), so
    that ranks missing a gradient still send rows of one length and the sizes are refused
    alike ([Note: qgZ frames at the unit's size] in qshard.zeropp.reduce_scatter)."""
    full = trainable_shard_numel(unit) if unit is not None else None
    return numel if full is None else max(numel, full)


def unequal_shards(what: str, unit: object | None) -> str:
    """Why ranks sent gradient shards of different sizes to ``unit``'s reduction, and the fix;
    ``what`` names the ranks' sets ("ranks", "nodes' ranks").

    With ``set_reduce_scatter_unused_params(True)`` on the unit every trainable parameter is
    reduced (zeros where unused), so the sizes can differ only when the ranks paired different
    units' reductions: a whole unit's output took no part in the loss on some ranks, so FSDP2
    reduced it at the end of their backward, out of step with the others (plain FSDP2 hangs or
    mixes the units there; a first-user probe got the fix recommended although it was on)."""
    groups = fsdp_param_groups(unit) if unit is not None else None
    if groups and all(getattr(g, "reduce_scatter_unused_params", False) for g in groups):
        return (
            f"set_reduce_scatter_unused_params(True) is on, so a whole FSDP unit's output took "
            f"no part in the loss on some {what} in this step: FSDP2 reduces such a unit at the "
            "end of their backward, out of step with the other ranks' reductions, which pairs "
            "different units. Make every unit's output reach the loss on every rank (where a "
            "branch is skipped: loss = loss + 0 * out.sum())"
        )
    return (
        f"a parameter of this FSDP unit got a gradient on some {what} and none on others in "
        "this step (a data-dependent branch, an MoE expert without tokens). Call "
        "set_reduce_scatter_unused_params(True) on the model (FSDP2 then reduces every "
        "trainable parameter, zeros for unused ones), or give every trainable parameter a "
        "gradient on every rank"
    )


class SizeVerdict:
    """The gradient shard sizes a reduction received (one per sender, or each node's smallest
    and largest), checked on the host. ``refuse`` gets the sizes when they differ and raises.
    Shared by HSDP's replicate all-reduce ([Note: the shard size travels with hop 1]) and qgZ's
    fused path ([Note: qgZ checks the shard sizes]).

    [Note: size verdicts on a GPU] On the CPU the sizes are read at once. On a GPU reading them
    would make the call wait on the host for its own all-to-all, so they are read later: inside
    a backward, by one callback at its end (after FSDP2's own, whose stream waits order it after
    every reduction), which reads every verdict put in that backward, so ``loss.backward()``
    raises before ``optimizer.step()`` applies a misaligned sum; outside a backward, at the
    reduction's next call. (Reading them only at the next call, as before, let every unit's
    misaligned gradients through one ``optimizer.step()``, and a mismatch in a run's last step
    was never reported.) An event recorded at ``put`` orders the read after the exchange on
    whatever stream reads it."""

    __slots__ = ("_event", "_refuse", "_sizes")

    def __init__(self, refuse: Callable[[list[int]], None]) -> None:
        self._refuse = refuse
        self._sizes: torch.Tensor | None = None
        self._event: torch.Event | None = None

    def put(self, sizes: torch.Tensor) -> None:
        self._sizes = sizes
        if _read_at_once(sizes):
            self.check()
            return
        if sizes.device.type != "cpu":
            self._event = torch.Event(device=sizes.device)
            self._event.record()
        _END_OF_BACKWARD.add(self)

    def check(self) -> None:
        """Read the last sizes put (if not read yet); ``refuse`` them if they differ."""
        if self._sizes is None:
            return
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        sizes, self._sizes = self._sizes.reshape(-1).tolist(), None
        if len(set(sizes)) > 1:
            self._refuse(sizes)


def _read_at_once(sizes: torch.Tensor) -> bool:
    """Whether a verdict's sizes are read on the host when put: on the CPU (a test routing the
    GPU path through Triton's interpreter patches this to see the deferred read)."""
    return sizes.device.type == "cpu"


class _EndOfBackward:
    """The verdicts put during the current backward, read by one autograd-engine callback at
    its end ([Note: size verdicts on a GPU]). Outside a backward nothing is queued: the
    reduction's own next call reads its verdict."""

    def __init__(self) -> None:
        self._pending: list[SizeVerdict] = []
        self._task: int | None = None

    def add(self, verdict: SizeVerdict) -> None:
        task = torch._C._current_graph_task_id()
        if task == -1:
            return
        self._pending.append(verdict)
        if self._task != task:
            self._task = task
            Variable._execution_engine.queue_callback(self._check)

    def _check(self) -> None:
        """Read every pending verdict; the first refusal is raised once all are read (so a
        later backward does not meet this one's leftovers)."""
        self._task = None
        pending, self._pending = self._pending, []
        error: Exception | None = None
        for verdict in pending:
            try:
                verdict.check()
            except Exception as e:  # re-raised below, once the rest are read
                error = error or e
        if error is not None:
            raise error


_END_OF_BACKWARD = _EndOfBackward()


_LOGGED: set[str] = set()

#: The 16-bit wire formats of the paper's ZeRO-3 baseline (compute stays in the param dtype).
WIRE_DTYPES = (torch.bfloat16, torch.float16)


class WireComm:
    """Base of qshard's FSDP2 comms: the validated optional 16-bit ``wire_dtype`` and FSDP2's
    plain buffer allocation (one temporary tensor per call)."""

    def __init__(
        self, *, wire_dtype: torch.dtype | None = None, topology: Topology | None = None
    ) -> None:
        if wire_dtype is not None and wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be None, bf16 or fp16; got {wire_dtype}")
        self.wire_dtype = wire_dtype
        self.topology = topology

    def twin(self, group: dist.ProcessGroup) -> dist.ProcessGroup | None:
        """The twin group that lets a 2-rank exchange on ``group`` run both ways at once on
        gloo ([Note: gloo exchanges are half duplex] in :mod:`qshard.comm.duplex`); ``None``
        without a topology or for other groups."""
        topo = self.topology
        return None if topo is None else topo.twin_for(group_ranks(group))

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


def log_once(key: str, message: str) -> None:
    """Log ``message`` at WARNING the first time ``key`` is seen in this process."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.warning(message)


def sum_rows(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 sum over dim 0 of ``rows`` (2-D), added one row after another in row order
    (as qgZ's Triton kernels add their peers).

    On CPU, torch's ``rows.float().sum(dim=0)`` adds in the same order for rows of whole SIMD
    vectors (every wire row of qshard's: multiples of the block size) and may round a ragged
    tail differently. On CUDA that does not hold: torch's reduction of 8 rows adds them in
    another order (measured on an H200, torch 2.11), one more reason the library defines the
    order itself rather than leaving it to torch. This skips the fp32 copy of every row and is
    2.5-3x faster on CPU, where torch reduces a contiguous tensor's outer dim slowly (2 rows
    of 786,432 fp32: 0.10 vs 0.30 ms; 4 bf16 rows: 0.47 vs 1.35 ms; one thread). ``out``
    (fp32, one row's shape) receives it when given; ``rows`` is not written.
    """
    if out is not None:
        out.copy_(rows[0])
    elif rows.dtype == torch.float32:
        out = rows[0].clone()
    else:
        out = rows[0].float()
    for r in range(1, rows.shape[0]):
        out.add_(rows[r])
    return out


def group_ranks(group: dist.ProcessGroup) -> list[int]:
    """Global ranks of ``group``, in group-rank order."""
    return dist.get_process_group_ranks(group)


def phase_tag(kind: str) -> str:
    """``"fwd_<kind>"`` or ``"bwd_<kind>"``: whether autograd's backward is running now.

    FSDP2 issues the backward all-gather from a pre-backward hook, inside autograd's
    graph task; everything else (forward, prefetch issued in forward) runs outside one.
    """
    in_backward = torch._C._current_graph_task_id() != -1
    return f"{'bwd' if in_backward else 'fwd'}_{kind}"


class DeferredWork(dist.distributed_c10d.Work):
    """A work handle that waits on in-flight collectives, then runs a finishing step once.

    [Note: deferred dequantization] FSDP2 waits on an all-gather's handle only if it is an
    instance of ``torch.distributed.distributed_c10d.Work``; this Python subclass is one. Its
    ``wait()`` finishes the work the collective started (dequantization, a cast, a copy out),
    so with ``async_op=True`` that work runs when FSDP2 needs the unsharded parameters,
    after the next block's compute has overlapped the transfer.

    ``label`` names its profiler ranges, ``qshard::<label>::wait`` (blocked on the transfer)
    and ``qshard::<label>::finish`` (the finishing step), which ``benchmarks/step_profile.py``
    reads; without an active profiler they cost a few microseconds per call.
    """

    def __init__(
        self,
        works: Sequence[dist.Work | None],
        finish: Callable[[], None] | None = None,
        *,
        label: str = "comm",
    ) -> None:
        super().__init__()
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._done = False
        self._label = label

    def wait(self, timeout: object = None) -> bool:
        if not self._done:
            if self._works:
                with record_function(f"qshard::{self._label}::wait"):
                    for w in self._works:
                        w.wait()
            self._works = []
            if self._finish is not None:
                with record_function(f"qshard::{self._label}::finish"):
                    self._finish()
                self._finish = None
            self._done = True
        return True

    @property
    def pending(self) -> list[dist.Work]:
        """The collectives not waited for yet (empty once :meth:`wait` ran)."""
        return list(self._works)

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done
