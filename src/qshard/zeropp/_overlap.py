"""Deferred qgZ: the progress queue that lets a gradient reduce-scatter finish while the next
block's backward runs, and the check of when FSDP2 allows it.

[Note: deferred qgZ] FSDP2 (torch 2.13, ``_fsdp_collectives.foreach_reduce``) calls the custom
reduce-scatter synchronously, without ``async_op``; on CPU there are no streams, so qgZ's two
hops would block the backward thread until the slow inter-node all-to-all arrives. After the
call FSDP2 only (a) divides the output by a post-divide factor (only for reduce dtypes other
than fp32/bf16, or with ``force_sum_reduction_for_comms``), (b) casts it to the parameters'
dtype if the reduce dtype differs, (c) views it as the new sharded gradients, or adds it into
existing ones, (d) runs post-accumulate-grad hooks, (e) runs the HSDP all-reduce / the
all-reduce hook. (c)'s view does not read the values, so when none of (a), (b), (d), (e)
applies and no gradient exists yet to add into, the reduce-scatter may return before its
output is written: it quantizes and starts hop 1, queues the rest here, and returns; FSDP2
views the not-yet-written buffer as the gradients.

At every later qgZ call the queue advances the pending reductions: each finishes its hop 1
(intra-node, over the node's fast links; it had a whole block's backward to arrive),
re-quantizes its node partials and issues hop 2 (inter-node), and each whose hop 2 has arrived
is summed into its output, without waiting for the rest. An autograd-engine callback queued
from inside backward drains the queue (blocking); it runs after FSDP2's own final callback
(queued at the first pre-backward hook; it reads no gradient values) and before
``backward()`` returns. So ``loss.backward()`` keeps its contract: gradients are complete when
it returns (``clip_grad_norm_``, optimizers and checkpoints see final values). Any other case
(outside backward, accumulation into a gradient, hooks, casts, HSDP) drains the queue and runs
the synchronous path.

Collectives must be issued on every process group in the same order on every rank. A
reduction issues its hop-1 all-to-alls (intra-node group) when it is called and its hop-2
all-to-alls (inter-node group) at the next qgZ call or the drain, oldest reduction first; only
the waits for arrival depend on timing, so what a rank has issued is a function of its program
point alone. An error in a deferred hop (a failed collective, a decode error) empties the queue
and is raised from the call or the drain that met it, so ``backward()`` raises it; met in the
drain, every rank has issued the same collectives and training can go on (tested); met at a
later qgZ call, FSDP2's ``reset_iter_state()`` is its recovery, and a transfer that failed on
one rank only leaves the groups out of step, as any failed collective does (restart).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.fsdp._fully_shard import _fsdp_common

from qshard._fsdp import fsdp_param_groups

__all__ = ["OverlapQueue", "defer_reason"]

logger = logging.getLogger("qshard.zeropp")


class Pending(Protocol):
    """A reduction in flight, advanced by the queue."""

    def issue(self) -> None:
        """Issue every collective left (waiting on what they need)."""
        ...

    def finish(self, *, block: bool) -> bool:
        """Consume what arrived (everything, waiting, if ``block``); True once the output is
        written. Issues nothing."""
        ...


class OverlapQueue:
    """The FIFO of deferred reductions of one topology's qgZ / plain reduce-scatter comms (see
    [Note: deferred qgZ]), or of one HSDP model's replicate all-reduce hooks ([Note: deferred
    replicate all-reduce] in ``qshard.zeropp.all_reduce``).

    Every FSDP unit's comm of one :func:`qshard.zeropp.shard` call shares one queue, because
    they share the intra- and inter-node process groups whose issue order must agree. Building
    reduce-scatter comms by hand with ``overlap=True``: pass one queue to every comm over the
    same process groups (``queue=``); each comm makes its own otherwise. ``drain()`` finishes
    every pending reduction (backward does it at its end); ``len()`` counts them.
    """

    def __init__(self, what: str = "reduce-scatter") -> None:
        self.what = what  # the reduction its errors name
        self._items: deque[Pending] = deque()
        self._task: int | None = None  # graph task whose end drains the queue
        # StepInBackward's hook, called with each unit whose reduced gradient is written, in
        # call order; the units (with their pending reduction, or None once FSDP2 has written
        # the gradient itself) wait in _landing until then (see [Note: landing]).
        self.on_landed: Callable[[nn.Module], None] | None = None
        self._landing: deque[tuple[nn.Module, Pending | None]] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def _push(self, item: Pending, unit: nn.Module | None = None) -> None:
        """Queue ``item`` (the reduction of ``unit``'s gradient) and make sure the current
        backward drains it before it returns."""
        task = torch._C._current_graph_task_id()
        if task == -1:
            raise RuntimeError(f"a {self.what} can only be deferred inside backward")
        self._items.append(item)
        if unit is not None and self.on_landed is not None:
            self._landing.append((unit, item))
        self._end_with_backward(task)

    def _end_with_backward(self, task: int) -> None:
        if self._task != task:
            self._task = task
            Variable._execution_engine.queue_callback(_EndOfBackward(self, task))

    def reduced_in_call(self, unit: nn.Module | None) -> None:
        """``unit``'s reduction ran inside the comm's call: FSDP2 writes the gradient as the
        call returns, so the unit lands at the queue's next run (a later reduction's call, or
        the drain at the end of backward). Nothing without ``on_landed`` or outside backward.

        [Note: landing] With :class:`qshard.zeropp.StepInBackward`, ``on_landed`` steps the
        optimizer for a unit's parameters once their reduced gradient is written. A deferred
        reduction's unit lands when its output is written; a synchronous one's at the next run,
        after FSDP2 has viewed (or added) the output as the gradient. Units land in the order
        their reductions were called, the same on every rank: a unit whose reduction finished
        early waits for the older ones, so anything ``on_landed`` issues (an optimizer whose
        step communicates would) goes out in one order everywhere."""
        task = torch._C._current_graph_task_id()
        if unit is None or self.on_landed is None or task == -1:
            return
        self._landing.append((unit, None))
        self._end_with_backward(task)

    def advance(self) -> None:
        """Progress every pending reduction as far as it can go without blocking."""
        self._run(block=False)

    def drain(self) -> None:
        """Finish every pending reduction (blocking), oldest first."""
        self._run(block=True)

    def prepare(self) -> None:
        """Before a new deferral: drain leftovers of an earlier backward (one that raised before
        its callback ran), then progress the rest."""
        if self._items and self._task != torch._C._current_graph_task_id():
            self.drain()
        self.advance()

    def _drain_callback(self) -> None:
        self._task = None  # a deferral after this point queues a new callback
        self.drain()

    def _abandoned(self, task: int) -> None:
        """The backward ``task`` ended without running its drain callback: it raised (see
        [Note: failed backward]). Finish its reductions now, before the error reaches the
        caller; an error here is logged (the backward's own error is the one raised)."""
        if self._task != task:
            return  # a later backward took the queue over
        self._task = None
        self._landing.clear()  # a failed backward steps no more units
        if not self._items:
            return
        try:
            self.drain()
        except Exception as exc:  # a finalizer must not raise
            logger.warning(
                "qshard: finishing the deferred %ss of a backward that raised failed too "
                "(%s); their gradients are incomplete",
                self.what,
                exc,
            )

    def _run(self, *, block: bool) -> None:
        try:
            # Issue first, every time, oldest first: how many collectives a rank has issued is
            # then a function of its program point alone, never of timing.
            for item in self._items:
                item.issue()
            for item in list(self._items):
                if item.finish(block=block):
                    self._items.remove(item)
        except Exception as exc:
            self._items.clear()
            self._landing.clear()
            raise RuntimeError(
                f"a deferred {self.what} failed ({type(exc).__name__}: {exc}); the gradients of "
                f"this backward are incomplete. The error is the reduction's own (the "
                f"synchronous call raises it too); to rule the deferral out, "
                f"ZeroPPConfig(overlap_reduce_scatter=False) (overlap=False on a comm built by "
                f"hand) runs the {self.what} inside FSDP2's call"
            ) from exc
        self._land()

    def _land(self) -> None:
        """Hand ``on_landed`` every unit whose gradient is written, oldest first, stopping at
        the first still in flight ([Note: landing])."""
        landing = self._landing
        while landing and (landing[0][1] is None or landing[0][1] not in self._items):
            unit, _ = landing.popleft()
            if self.on_landed is not None:
                self.on_landed(unit)


class _EndOfBackward:
    """The autograd-engine callback that drains an :class:`OverlapQueue` at the end of the
    backward ``task`` that deferred into it.

    [Note: failed backward] The engine runs its final callbacks only when the backward
    succeeds. When it raises (an exception in a hook, a custom Function, a
    ``KeyboardInterrupt``), it drops them without a call, and this object with them: its
    finalizer then drains the queue, on the thread of ``backward()``, after the graph task
    ended and before the exception reaches the caller. So a failed backward, like FSDP2's
    synchronous reduce-scatter, leaves the gradients of the units reduced before the error
    written and no reduction in flight: a caller who skips the batch and zeroes the
    gradients (``zero_grad(set_to_none=False)`` included), after ``model.reset_iter_state()``
    (FSDP2's recovery: without it plain FSDP2 leaves the units unsharded and the optimizer's
    parameters never get a gradient again), trains on as plain FSDP2 does. Left
    for the next backward's first deferral (as before), the old reduction wrote its sum into
    the gradient buffer the caller had zeroed in between, and FSDP2 then added the next
    step's gradients on top of it. Every rank that raised at the same program point drains
    the same reductions at the same point, so the collectives stay in step. (Checked on CPU,
    where the graph task runs and ends on the caller's thread. On CUDA the engine's device
    threads may release the last reference to the task, so the finalizer could run there,
    racing the caller's next step: not run on a GPU yet.)
    """

    __slots__ = ("queue", "ran", "task")

    def __init__(self, queue: OverlapQueue, task: int) -> None:
        self.queue, self.task, self.ran = queue, task, False

    def __call__(self) -> None:
        self.ran = True
        self.queue._drain_callback()

    def __del__(self) -> None:
        if not self.ran:
            self.queue._abandoned(self.task)


# Mesh infos after whose reduce-scatter FSDP2 all-reduces (HSDP; DDP-style replicate where this
# torch has it): looked up by name, since the set differs between torch releases.
_REPLICATED_MESH_INFOS = tuple(
    cls
    for cls in (
        getattr(_fsdp_common, "DDPMeshInfo", None),
        getattr(_fsdp_common, "HSDPMeshInfo", None),
    )
    if cls is not None
)


def _param_group(unit: nn.Module | None):
    groups = fsdp_param_groups(unit)
    return groups[0] if groups is not None and len(groups) == 1 else None


def defer_reason(
    unit: nn.Module | None, output: torch.Tensor, *, in_all_reduce_hook: bool = False
) -> str | None:
    """None if FSDP2 lets ``unit``'s reduce-scatter into ``output`` finish after the call
    returns (see [Note: deferred qgZ]), else why not. ``in_all_reduce_hook``: asked by the
    unit's all-reduce hook, the last collective before FSDP2 views the output ([Note: deferred
    replicate all-reduce] in ``qshard.zeropp.all_reduce``)."""
    if torch._C._current_graph_task_id() == -1:
        return "outside backward"
    group = _param_group(unit)
    if group is None:
        return "the FSDP unit's parameter group is unknown"
    # FSDP2 internals read here (torch 2.13 names): a torch without one of them is treated as
    # "cannot tell" and runs the synchronous path, never a deferral on a guess.
    missing = [a for a in ("mesh_info", "fsdp_params", "_orig_dtype") if not hasattr(group, a)]
    if missing:
        return f"this torch's FSDP2 parameter group lacks {missing}"
    if isinstance(group.mesh_info, _REPLICATED_MESH_INFOS) or (
        getattr(group, "_all_reduce_hook", None) and not in_all_reduce_hook
    ):
        return "an all-reduce follows the reduce-scatter (HSDP or an all-reduce hook)"
    if getattr(group, "force_sum_reduction_for_comms", False):
        return "FSDP2 post-divides the output (force_sum_reduction_for_comms)"
    if output.dtype not in (torch.float32, torch.bfloat16):
        return f"FSDP2 post-divides a {output.dtype} reduce output"
    if group._orig_dtype is not None and group._orig_dtype != output.dtype:
        return f"FSDP2 casts the {output.dtype} output to {group._orig_dtype}"
    for fp in group.fsdp_params:
        param = fp.sharded_param
        if param.grad is not None:
            return "a sharded gradient exists: FSDP2 adds the output into it"
        if getattr(param, "_post_accumulate_grad_hooks", None):
            return "a post-accumulate-grad hook reads the gradient"
        if getattr(fp, "offload_to_cpu", False):
            return "CPU offload copies the output"
    return None
