"""``--grad-accum-steps``: one optimizer step's forward and backward as several micro-batches.

[Note: gradient accumulation in the app] A rank's share of the step's global batch (a pure
function of seed and step, :func:`qshard.train.data.batch_for_step`) is cut into
``grad_accum_steps`` equal micro-batches; each runs forward and ``backward(loss / K)``, so the
summed gradient is that of the mean loss over the whole share, the one step without
accumulation computes (equal micro-batches: the mean of their means is the mean), up to
floating-point rounding. The data, the seed, the checkpoints and the resume point do not
depend on K: a run may resume with another ``--grad-accum-steps``.

Communication per micro-batch follows what each layout needs:

* ZeRO-3 / ZeRO++ (FSDP2): every micro-batch's backward reduce-scatters its gradients into the
  sharded ``.grad`` (FSDP2 accumulates into it), as DeepSpeed's ZeRO-3 and torchtitan do.
  Skipping the reduction until the last micro-batch would keep every rank's whole unsharded
  gradient alive in between: ZeRO-3's memory saving gone. The units keep after backward the
  copy of their weights they held since forward (``qshard.zeropp.set_keep_weights_after_
  backward``: hpZ's node-local secondary shard, the root and the kept last blocks whole), so
  only the first micro-batch's forward gathers them across nodes; blocks without hpZ gather
  across nodes in every micro-batch's forward and backward, and every micro-batch's gradients
  cross the nodes.
* HSDP: every micro-batch reduce-scatters inside the node; only the last one all-reduces
  across nodes (``set_requires_all_reduce``, honoured by the compressed replicate all-reduce
  too), so the cross-node bytes per step do not grow with K.
* 1-bit Adam / 0/1 Adam on a replicated model: gradients accumulate locally; the optimizer
  communicates once, in its step.

With ``--step-in-backward`` the backwards before the last run paused (no unit steps), so the
units step once, on the summed gradients, inside the last backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from qshard.train import _faults
from qshard.train._parallel import forward_context, optional_feature
from qshard.train.config import DATA_PARALLEL_OPTIMIZERS, TrainConfig

__all__ = ["accumulate", "micro_batches"]


def micro_batches(
    x: torch.Tensor, y: torch.Tensor, steps: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(x, y)`` cut along the batch into ``steps`` equal micro-batches (the config checked
    that they divide)."""
    if x.shape[0] % steps:
        raise ValueError(f"{x.shape[0]} rows do not split into {steps} equal micro-batches")
    return list(zip(x.chunk(steps), y.chunk(steps), strict=True))


def _between_micro_batches(model: nn.Module, config: TrainConfig) -> Callable[[bool], None]:
    """What tells the model whether a backward is not the step's last: HSDP's cross-node
    all-reduce waits for the last; ZeRO-3's units keep their weights' copy for the next
    forward (a model :func:`qshard.zeropp.shard` built)."""
    if config.parallel == "hsdp" and isinstance(model, FSDPModule):
        return lambda more: model.set_requires_all_reduce(not more)
    keep = optional_feature("qshard.zeropp", "set_keep_weights_after_backward")
    if config.optim in DATA_PARALLEL_OPTIMIZERS or keep is None:
        return lambda more: None  # replicated, or plain fully_shard: nothing to tell
    return lambda more: keep(model, more)


def accumulate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    config: TrainConfig,
    job: Any,
    *,
    poison: Any = None,
    stepping: Any = None,
) -> torch.Tensor:
    """Forward and backward of this rank's rows ``(x, y)`` in ``config.grad_accum_steps``
    micro-batches ([Note: gradient accumulation in the app]) on ``job``'s device and compute
    dtype; returns their mean loss, detached. ``poison``: the fault-injection hook's value for
    the step (applied to the last micro-batch's loss); ``stepping``: ``--step-in-backward``'s
    :class:`~qshard.train._in_backward.BackwardStepping`, paused but in the last backward."""
    compute_dtype, device = job.compute_dtype, job.device
    steps = config.grad_accum_steps
    parts = micro_batches(x, y, steps)
    more_to_come = _between_micro_batches(model, config) if steps > 1 else None
    losses = []
    try:
        for i, (xm, ym) in enumerate(parts):
            last = i == steps - 1
            if more_to_come is not None:
                more_to_come(not last)
            with forward_context(config, compute_dtype, device):
                _, loss = model(xm.to(device), ym.to(device))
            if poison and last:
                loss = _faults.poison(loss)
            hold = (
                stepping.paused() if stepping is not None and not last else contextlib.nullcontext()
            )
            with hold:
                (loss if steps == 1 else loss / steps).backward()
            losses.append(loss.detach())
    finally:
        if more_to_come is not None:
            more_to_come(False)
    return losses[0] if steps == 1 else torch.stack([v.float() for v in losses]).mean()
