"""8-bit RMSprop: the square average on the unsigned map, the momentum buffer on the signed one."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor
from torch.optim.rmsprop import rmsprop as _torch_rmsprop

from qshard.optim import _functional, _kernels
from qshard.optim._base8bit import Optimizer8bit
from qshard.optim._options import check_numbers, refuse_maximize

__all__ = ["RMSprop8bit"]


class RMSprop8bit(Optimizer8bit):
    """RMSprop with 8-bit state; ``torch.optim.RMSprop`` semantics (uncentered). The 8-bit
    options are those of :class:`qshard.optim.Adam8bit`; ``foreach`` is ``torch.optim.RMSprop``'s,
    for the tensors with fp32 state (the same bits as torch with the same flag; torch has no
    fused RMSprop); ``maximize`` must be False."""

    _kind = _kernels.KIND_RMSPROP

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        *,
        optim_bits: int = 8,
        min_8bit_size: int = 4096,
        block_size: int = 256,
        bnb_compat: bool = False,
        stochastic_rounding: bool = False,
        foreach: bool | None = None,
        maximize: bool = False,
    ) -> None:
        refuse_maximize(maximize, type(self).__name__)
        if centered:
            raise ValueError(
                "RMSprop8bit does not support centered=True (a third state); use "
                "torch.optim.RMSprop(centered=True) or centered=False"
            )
        defaults = dict(
            lr=lr,
            alpha=alpha,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            optim_bits=optim_bits,
            min_8bit_size=min_8bit_size,
            block_size=block_size,
            bnb_compat=bnb_compat,
            stochastic_rounding=stochastic_rounding,
            foreach=foreach,
        )
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        check_numbers(group, type(self).__name__, ("alpha", "eps", "weight_decay", "momentum"))
        if not 0.0 <= group["alpha"] < 1.0:
            raise ValueError(f"alpha must be in [0, 1); got {group['alpha']}")
        for k in ("eps", "weight_decay", "momentum"):
            if not group[k] >= 0:  # NaN too, as torch.optim.RMSprop
                raise ValueError(f"{k} must be >= 0; got {group[k]!r}")

    _optional_states = frozenset({"momentum_buffer"})  # momentum may be switched on later

    def _state_specs(self, group: dict[str, Any]) -> tuple[tuple[str, bool], ...]:
        if group["momentum"] > 0:
            return (("square_avg", False), ("momentum_buffer", True))
        return (("square_avg", False),)

    def _reference_update(self, p, g, states, group, step) -> None:
        _functional.rmsprop_update(
            p,
            g,
            states[0],
            states[1] if len(states) > 1 else None,
            lr=group["lr"],
            alpha=group["alpha"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
        )

    def _torch_update(self, group, params, grads, states, steps) -> None:
        _torch_rmsprop(
            params,
            grads,
            states[0],
            [],
            states[1] if len(states) > 1 else [],
            steps,
            foreach=group.get("foreach"),
            maximize=False,
            differentiable=False,
            capturable=False,
            has_complex=False,
            lr=group["lr"],
            alpha=group["alpha"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            centered=False,
        )

    def _kernel_hparams(self, group: dict[str, Any], step: int) -> list[float]:
        return [
            group["lr"],
            group["alpha"],
            group["eps"],
            group["weight_decay"],
            group["momentum"],
            1.0 - group["alpha"],
        ]
