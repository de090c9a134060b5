"""8-bit Adagrad: the sum of squared gradients on the unsigned map."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor
from torch.optim.adagrad import adagrad as _torch_adagrad

from qshard.optim import _functional, _kernels
from qshard.optim._base8bit import Optimizer8bit
from qshard.optim._options import check_numbers, refuse_maximize

__all__ = ["Adagrad8bit"]


class Adagrad8bit(Optimizer8bit):
    """Adagrad with an 8-bit accumulator; ``torch.optim.Adagrad`` semantics. The 8-bit options
    are those of :class:`qshard.optim.Adam8bit`; ``foreach``/``fused`` are
    ``torch.optim.Adagrad``'s, for the tensors with fp32 state (the same bits as torch with the
    same flags; torch's fused Adagrad runs on CPU only); ``maximize`` must be False."""

    _kind = _kernels.KIND_ADAGRAD
    _sparse_alternative = "torch.optim.Adagrad (which takes sparse gradients)"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        optim_bits: int = 8,
        min_8bit_size: int = 4096,
        block_size: int = 256,
        bnb_compat: bool = False,
        stochastic_rounding: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        maximize: bool = False,
    ) -> None:
        refuse_maximize(maximize, type(self).__name__)
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            eps=eps,
            optim_bits=optim_bits,
            min_8bit_size=min_8bit_size,
            block_size=block_size,
            bnb_compat=bnb_compat,
            stochastic_rounding=stochastic_rounding,
            foreach=foreach,
            fused=fused,
        )
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        keys = ("lr_decay", "weight_decay", "initial_accumulator_value", "eps")
        check_numbers(group, type(self).__name__, keys)
        for k in keys:
            if not group[k] >= 0:  # NaN too, as torch.optim.Adagrad
                raise ValueError(f"{k} must be >= 0; got {group[k]!r}")

    def _state_specs(self, group: dict[str, Any]) -> tuple[tuple[str, bool], ...]:
        return (("sum", False),)

    def _initial_state_value(self, group: dict[str, Any], name: str) -> float:
        return float(group["initial_accumulator_value"])

    def _reference_update(self, p, g, states, group, step) -> None:
        _functional.adagrad_update(
            p,
            g,
            states[0],
            step=step,
            lr=group["lr"],
            lr_decay=group["lr_decay"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )

    def _torch_update(self, group, params, grads, states, steps) -> None:
        _torch_adagrad(
            params,
            grads,
            states[0],
            steps,
            fused=group.get("fused"),
            has_sparse_grad=False,
            foreach=group.get("foreach"),
            differentiable=False,
            has_complex=False,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            lr_decay=group["lr_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _kernel_hparams(self, group: dict[str, Any], step: int) -> list[float]:
        clr = group["lr"] / (1.0 + (step - 1) * group["lr_decay"])
        return [clr, group["eps"], group["weight_decay"]]
