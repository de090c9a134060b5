"""8-bit Lion: one momentum state on the signed dynamic map."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from qshard.optim import _functional, _kernels
from qshard.optim._base8bit import Optimizer8bit
from qshard.optim._options import check_numbers

__all__ = ["Lion8bit"]


class Lion8bit(Optimizer8bit):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") with 8-bit state.

    ``c = beta1*m + (1-beta1)*g``; ``p = p*(1 - lr*wd) - lr*sign(c)``;
    ``m = beta2*m + (1-beta2)*g``. The 8-bit options are those of :class:`Adam8bit`.

    torch has no Lion, so the tensors with fp32 state take this module's own update: the
    operations of :func:`qshard.optim._functional.lion_update` as ``torch._foreach_*`` calls, one
    sequence per group (the same bits as that per-tensor function).
    """

    _kind = _kernels.KIND_LION

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        optim_bits: int = 8,
        min_8bit_size: int = 4096,
        block_size: int = 256,
        bnb_compat: bool = False,
        stochastic_rounding: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            optim_bits=optim_bits,
            min_8bit_size=min_8bit_size,
            block_size=block_size,
            bnb_compat=bnb_compat,
            stochastic_rounding=stochastic_rounding,
        )
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        check_numbers(group, type(self).__name__, ("betas", "weight_decay"))
        b1, b2 = group["betas"]
        if not (0.0 <= b1 <= 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must be in [0, 1]; got {group['betas']}")
        if not group["weight_decay"] >= 0:  # NaN too
            raise ValueError(f"weight_decay must be >= 0; got {group['weight_decay']!r}")

    def _state_specs(self, group: dict[str, Any]) -> tuple[tuple[str, bool], ...]:
        return (("exp_avg", True),)

    def _reference_update(self, p, g, states, group, step) -> None:
        b1, b2 = group["betas"]
        _functional.lion_update(
            p, g, states[0], lr=group["lr"], beta1=b1, beta2=b2, weight_decay=group["weight_decay"]
        )

    def _torch_update(self, group, params, grads, states, steps) -> None:
        b1, b2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        exp_avgs = states[0]
        torch._foreach_mul_(params, 1.0 - lr * wd)
        direction = torch._foreach_mul(exp_avgs, b1)
        torch._foreach_add_(direction, grads, alpha=1.0 - b1)
        # sign, except that NaN stays NaN (as _functional.lion_update and the fused kernels do);
        # on a CPU only tensors holding a NaN (their norm is NaN) take the where, read on the
        # host at no cost (a GPU would sync: it takes the where on every tensor)
        signs = torch._foreach_sign(direction)
        if direction[0].device.type == "cpu":
            has_nan = torch.stack(torch._foreach_norm(direction)).isnan().tolist()
        else:
            has_nan = [True] * len(direction)
        signs = [
            torch.where(d.isnan(), d, sg) if nan else sg
            for d, sg, nan in zip(direction, signs, has_nan)
        ]
        torch._foreach_add_(params, signs, alpha=-lr)
        torch._foreach_mul_(exp_avgs, b2)
        torch._foreach_add_(exp_avgs, grads, alpha=1.0 - b2)
        torch._foreach_add_(steps, 1)

    def _kernel_hparams(self, group: dict[str, Any], step: int) -> list[float]:
        b1, b2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        return [lr, b1, b2, wd, 1.0 - lr * wd, 1.0 - b1, 1.0 - b2]
