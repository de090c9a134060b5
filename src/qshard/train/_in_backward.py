"""``--step-in-backward``: the run's optimizer stepped inside backward, unit by unit.

[Note: stepping inside backward in the app] :class:`qshard.zeropp.StepInBackward` steps each
FSDP unit as its reduced gradient lands and frees the gradient right after, so when
``backward()`` returns no gradient is left for the loop's usual global norm. The norm the run
logs and checks (``--on-nonfinite stop``) is summed here instead: an optimizer step pre-hook
sees exactly one unit's gradients at each per-unit step (StepInBackward hides the others), adds
the squares of this rank's shards, and the loop's one reduction of the step sums the ranks'
(FSDP2's shards are disjoint). The norm is not used to clip (the config refuses
``--grad-clip``): the first units are stepped before the last gradients exist.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from qshard.train._parallel import optional_feature

__all__ = ["BackwardStepping"]


class BackwardStepping:
    """The run's optimizer stepped inside backward (``StepInBackward``), plus the sum of squares
    of the gradients each per-unit step saw ([Note: stepping inside backward in the app])."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        stepper_cls = optional_feature("qshard.zeropp", "StepInBackward")
        if stepper_cls is None:  # refused in the launcher; reachable only when called directly
            raise RuntimeError("--step-in-backward needs qshard.zeropp.StepInBackward")
        self._squares: list[torch.Tensor] = []
        hook = optimizer.register_step_pre_hook(self._add)
        try:  # installed for the run (the model's progress queue holds it)
            self._stepper = stepper_cls(model, optimizer)
        except Exception:
            hook.remove()
            raise

    def paused(self) -> Any:
        """A context in which backwards do not step (the micro-batches before the last)."""
        return self._stepper.paused()

    def _add(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    if grad.numel():
                        self._squares.append(grad.detach().float().square().sum())

    def take_squared_norm(self) -> float:
        """This rank's sum of squared gradients over the per-unit steps since the last call."""
        squares, self._squares = self._squares, []
        if not squares:
            return 0.0
        return float(torch.stack(squares).sum())
