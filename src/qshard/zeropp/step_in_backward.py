"""Stepping the optimizer inside backward, unit by unit.

[Note: step in backward] :class:`StepInBackward` steps each FSDP unit's parameters as soon as
its reduced gradient is written, inside backward (the last blocks first, in the order their
reductions were called on every rank: [Note: landing] in :mod:`qshard.zeropp._overlap`), and
frees the unit's sharded gradient right after, instead of holding every gradient to the end of
backward. Unlike stepping from FSDP2's post-accumulate-grad hooks (torchtitan's
``early_step_in_backward``, torchtune's optimizer in backward), it keeps qgZ's reduce-scatter
deferred behind the next block's backward: a hook on the gradient forces the synchronous path
([Note: deferred qgZ]).

It was built to send each unit's next forward gather (qwZ's inter-node hop) right after the
unit's step, so that a forward bound by the node link would find its gathers done. Measured with
consecutive steps (docs/zeropp.md, "Stepping the optimizer inside backward"), that made the step
15-20% slower: the link that backward leaves idle lies before its first unit lands, and sent
later the early hops delay the last reductions, which backward waits for, or the forward's first
gathers. So only the stepping is kept; with it the step takes as long as the usual loop.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from qshard._fsdp import fsdp_param_groups
from qshard.zeropp._overlap import _REPLICATED_MESH_INFOS, OverlapQueue
from qshard.zeropp.reduce_scatter import RecordingReduceScatter

__all__ = ["StepInBackward"]


class StepInBackward:
    """Step ``optimizer`` inside backward, one FSDP unit at a time, as each unit's reduced
    gradient is written; its sharded gradient is freed right after, not held to the end of
    backward ([Note: step in backward]).

    ``model`` is what :func:`qshard.zeropp.shard` returned (any ZeRO++ feature, or
    ``ZeroPPConfig(overlap_reduce_scatter=True)`` for the plain ZeRO-3 wire). After this, a
    training step is ``loss.backward()`` alone: when it returns, every unit's parameters have been
    stepped and their gradients set to ``None``; do not call ``optimizer.step()`` or
    ``zero_grad()`` (a step finds no gradient and does nothing). Learning-rate schedulers step
    as usual, after ``backward()``. Gradient accumulation: run the micro-batches before the last
    inside :meth:`paused` (needed where they reduce their gradients; with
    ``model.set_requires_gradient_sync(False)`` nothing lands before the last anyway).

    What cannot work this way, refused or documented: a global gradient-norm clip (the step of
    the first units runs before the last units' gradients exist; torchtitan's
    ``early_step_in_backward`` has the same limit), a ``GradScaler`` (it must see every gradient
    before any step), the 1-bit optimizers (their step is a collective over all gradients;
    refused), HSDP or an all-reduce hook (the gradient is final only after the all-reduce;
    refused). A backward that raises steps no further unit, but units stepped before the error
    stay stepped.

    Args:
        model: the sharded model.
        optimizer: a local optimizer over the model's parameters (every parameter it holds must
            belong to one of the model's FSDP units; parameters it does not hold keep their
            gradients, for another optimizer stepped after ``backward()``): ``torch.optim`` or
            qshard's 8-bit / 4-bit optimizers. Each unit's step calls ``optimizer.step()`` with
            the other units' gradients hidden (state, hyperparameters and step counts are the
            optimizer's own: a checkpoint of it is the usual one); its step hooks run once per
            unit.

    Call on every rank. It stays installed until :meth:`close` (which hands the optimizer back
    to the usual loop) or until a new ``StepInBackward`` on the same model replaces it (with a
    warning).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(model, FSDPModule):
            raise TypeError(
                f"model must be the FSDP2 model qshard.zeropp.shard() returned; got "
                f"{type(model).__name__}"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer)}")
        _refuse_collective_step(optimizer)
        self.optimizer = optimizer
        self._paused = False
        self._closed = False
        self._units: dict[int, dict[int, torch.Tensor]] = {}  # unit id -> its parameters
        self._hooks: list = []
        queue: OverlapQueue | None = None
        owner: dict[int, str] = {}
        found: list[tuple[nn.Module, object, dict]] = []
        for name, module in model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            groups = fsdp_param_groups(module)
            if groups is None or len(groups) > 1:
                raise RuntimeError(
                    f"FSDP unit {name or '<root>'}: this torch's FSDP2 keeps its parameter "
                    "groups in a way StepInBackward cannot read (one group per unit expected)"
                )
            if not groups:
                continue
            group = groups[0]
            _refuse_all_reduce(group, name)
            comm = getattr(group, "_reduce_scatter_comm", None)
            if not isinstance(comm, RecordingReduceScatter) or comm.unit is not module:
                raise ValueError(
                    f"FSDP unit {name or '<root>'} reduces its gradients with FSDP2's own "
                    "reduce-scatter, whose end StepInBackward cannot see: shard the model with "
                    "qshard.zeropp.shard() and a ZeRO++ feature, or "
                    "ZeroPPConfig(overlap_reduce_scatter=True) for the plain wire"
                )
            if queue is None:
                queue = comm.queue
            elif comm.queue is not queue:
                raise ValueError(
                    "the model's reduce-scatter comms do not share one progress queue; install "
                    "them with qshard.zeropp.shard() (or pass one queue= to every comm)"
                )
            params = {id(fp.sharded_param): fp.sharded_param for fp in group.fsdp_params}
            for pid in params:
                owner[pid] = name or "<root>"
            found.append((module, group, params))
        if queue is None:
            raise ValueError("the model has no FSDP unit with parameters")
        previous = getattr(queue.on_landed, "__self__", None)
        if queue.on_landed is not None and not isinstance(previous, StepInBackward):
            raise RuntimeError("the model's progress queue already has an on_landed callback")
        for gi, g in enumerate(optimizer.param_groups):
            for p in g["params"]:
                if id(p) not in owner:
                    raise ValueError(
                        f"optimizer parameter group {gi} holds a parameter of shape "
                        f"{tuple(p.shape)} that is not a sharded parameter of the model's FSDP "
                        "units: build the optimizer after shard(), over model.parameters()"
                    )
        # Checked: now replace an installed stepper, and add the hooks.
        if isinstance(previous, StepInBackward):
            warnings.warn(
                "qshard: a StepInBackward was installed on this model; the new one replaces it "
                "(the old one is closed)",
                stacklevel=2,
            )
            previous.close()
        for module, group, params in found:
            if getattr(group.mesh_info, "shard_mesh_size", None) == 1:
                # One rank: FSDP2 calls no reduce-scatter (it copies the gradient); its
                # post-accumulate-grad hooks tell the queue instead (nothing to defer there).
                landing = _OneRankLanding(queue, module)
                self._hooks += [
                    p.register_post_accumulate_grad_hook(landing)
                    for p in params.values()
                    if p.requires_grad
                ]
            self._units[id(module)] = params
        self._queue = queue
        queue.on_landed = self._landed

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Backwards inside do not step (gradient accumulation's micro-batches before the
        last); the units land with their gradients kept."""
        self._check_open()
        before, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = before

    def close(self) -> None:
        """Stop stepping inside backward (``optimizer.step()`` after ``backward()`` again)."""
        if self._closed:
            return
        self._closed = True
        self._queue.on_landed = None
        for handle in self._hooks:
            handle.remove()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this StepInBackward is closed")

    def _landed(self, module: nn.Module) -> None:
        params = self._units.get(id(module))
        if params is None or self._paused:
            return
        # (a parameter the optimizer does not hold keeps its gradient, for another optimizer
        # stepped after backward; read each time: _step_only walks the groups anyway)
        held = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        live = [p for p in params.values() if p.grad is not None and id(p) in held]
        if not live:
            return
        _step_only(self.optimizer, {id(p) for p in live})
        for p in live:
            p.grad = None


class _OneRankLanding:
    """A post-accumulate-grad hook of a one-rank unit's parameters: the unit lands at the
    queue's next run (the end of backward), once per backward."""

    def __init__(self, queue: OverlapQueue, unit: nn.Module) -> None:
        self.queue, self.unit, self.task = queue, unit, None

    def __call__(self, param: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if self.task != task:  # (shared by the unit's parameters)
            self.task = task
            self.queue.reduced_in_call(self.unit)


def _step_only(optimizer: torch.optim.Optimizer, ids: set[int]) -> None:
    """``optimizer.step()`` over the parameters in ``ids`` alone: every other parameter's
    gradient (another unit's, assigned but not yet landed) is hidden for the call and put back
    after. The groups stay whole, so a parameter keeps its place in them (the 8-bit optimizers'
    stochastic rounding seeds each tensor by it)."""
    hidden = [
        (p, p.grad)
        for g in optimizer.param_groups
        for p in g["params"]
        if p.grad is not None and id(p) not in ids
    ]
    for p, _ in hidden:
        p.grad = None
    try:
        optimizer.step()
    finally:
        for p, grad in hidden:
            p.grad = grad


def _refuse_collective_step(optimizer: torch.optim.Optimizer) -> None:
    from qshard.optim._onebit import _DataParallelOneBitOptimizer

    if isinstance(optimizer, _DataParallelOneBitOptimizer):
        raise TypeError(
            f"{type(optimizer).__name__} communicates in its step (a collective over every "
            "gradient), so it cannot step one unit at a time inside backward: use it with "
            "optimizer.step() after backward()"
        )


def _refuse_all_reduce(group: object, name: str) -> None:
    if isinstance(getattr(group, "mesh_info", None), _REPLICATED_MESH_INFOS) or getattr(
        group, "_all_reduce_hook", None
    ):
        raise ValueError(
            f"FSDP unit {name or '<root>'} all-reduces its gradients after the reduce-scatter "
            "(HSDP or an all-reduce hook): StepInBackward steps on the reduce-scatter's output "
            "and does not support it; step after backward()"
        )
