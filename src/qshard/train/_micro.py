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
  sharded ``.grad`` (FSDP2 accumulates into it), as DeepSpeed's ZeRO-3 does. Skipping the
  reduction until the last micro-batch would keep every rank's whole unsharded gradient alive in
  between: ZeRO-3's memory saving gone. Cross-node bytes per step grow K times (forward
  gathers too: the units reshard after each micro-batch's backward).
* HSDP: every micro-batch reduce-scatters inside the node; only the last one all-reduces
  across nodes (``set_requires_all_reduce``, honoured by the compressed replicate all-reduce
  too), so the cross-node bytes per step do not grow with K.
* 1-bit Adam / 0/1 Adam on a replicated model: gradients accumulate locally; the optimizer
  communicates once, in its step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from qshard.train import _faults
from qshard.train._parallel import forward_context
from qshard.train.config import TrainConfig

__all__ = ["accumulate", "micro_batches"]


def micro_batches(
    x: torch.Tensor, y: torch.Tensor, steps: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(x, y)`` cut along the batch into ``steps`` equal micro-batches (the config checked
    that they divide)."""
    if x.shape[0] % steps:
        raise ValueError(f"{x.shape[0]} rows do not split into {steps} equal micro-batches")
    return list(zip(x.chunk(steps), y.chunk(steps), strict=True))


def _all_reduce_on(model: nn.Module, config: TrainConfig, on: bool) -> None:
    """HSDP: whether this backward all-reduces across nodes (the last micro-batch only)."""
    if config.parallel == "hsdp" and isinstance(model, FSDPModule):
        model.set_requires_all_reduce(on)


def accumulate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    config: TrainConfig,
    *,
    compute_dtype: torch.dtype,
    device: torch.device,
    poison: Any = None,
) -> torch.Tensor:
    """Forward and backward of this rank's rows ``(x, y)`` in ``config.grad_accum_steps``
    micro-batches ([Note: gradient accumulation in the app]); returns their mean loss, detached.
    ``poison``: the fault-injection hook's value
    for the step (applied to the last micro-batch's loss)."""
    steps = config.grad_accum_steps
    parts = micro_batches(x, y, steps)
    losses = []
    try:
        for i, (xm, ym) in enumerate(parts):
            last = i == steps - 1
            if steps > 1:
                _all_reduce_on(model, config, last)
            with forward_context(config, compute_dtype, device):
                _, loss = model(xm.to(device), ym.to(device))
            if poison and last:
                loss = _faults.poison(loss)
            (loss if steps == 1 else loss / steps).backward()
            losses.append(loss.detach())
    finally:
        if steps > 1:
            _all_reduce_on(model, config, True)
    return losses[0] if steps == 1 else torch.stack([v.float() for v in losses]).mean()
