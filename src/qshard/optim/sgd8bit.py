"""8-bit SGD with momentum (optionally Nesterov): the momentum buffer on the signed map."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from qshard.optim import _functional, _kernels
from qshard.optim._base8bit import Optimizer8bit

__all__ = ["SGD8bit"]


class SGD8bit(Optimizer8bit):
    """SGD with an 8-bit momentum buffer; ``torch.optim.SGD`` semantics (the buffer starts as the
    first gradient). With ``momentum=0`` there is no state and this is plain SGD. The 8-bit
    options are those of :class:`qshard.optim.Adam8bit`.
    """

    _kind = _kernels.KIND_SGD

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        optim_bits: int = 8,
        min_8bit_size: int = 4096,
        block_size: int = 256,
        bnb_compat: bool = False,
        stochastic_rounding: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            optim_bits=optim_bits,
            min_8bit_size=min_8bit_size,
            block_size=block_size,
            bnb_compat=bnb_compat,
            stochastic_rounding=stochastic_rounding,
        )
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        if group["momentum"] < 0 or group["weight_decay"] < 0:
            raise ValueError("momentum and weight_decay must be >= 0")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum needs momentum > 0 and dampening = 0")

    def _state_specs(self, group: dict[str, Any]) -> tuple[tuple[str, bool], ...]:
        return (("momentum_buffer", True),) if group["momentum"] != 0 else ()

    def _reference_update(self, p, g, states, group, step) -> None:
        _functional.sgd_update(
            p,
            g,
            states[0] if states else None,
            first_step=step == 1,
            lr=group["lr"],
            momentum=group["momentum"],
            dampening=group["dampening"],
            weight_decay=group["weight_decay"],
            nesterov=group["nesterov"],
        )

    def _kernel_hparams(self, group: dict[str, Any], step: int) -> list[float]:
        return [
            group["lr"],
            group["momentum"],
            group["dampening"],
            group["weight_decay"],
            1.0 if group["nesterov"] else 0.0,
            1.0 - group["dampening"],
        ]
