"""8-bit SGD with momentum (optionally Nesterov): the momentum buffer on the signed map."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.sgd import sgd as _torch_sgd

from qshard.optim import _functional, _kernels
from qshard.optim._base8bit import Optimizer8bit
from qshard.optim._options import check_numbers, refuse_maximize

__all__ = ["SGD8bit"]


class SGD8bit(Optimizer8bit):
    """SGD with an 8-bit momentum buffer; ``torch.optim.SGD`` semantics (the buffer starts as the
    first gradient). With ``momentum=0`` there is no state and this is plain SGD. The 8-bit
    options are those of :class:`qshard.optim.Adam8bit`; ``foreach``/``fused`` are
    ``torch.optim.SGD``'s, for the tensors with fp32 state (the same bits as torch with the same
    flags); ``maximize`` must be False.
    """

    _kind = _kernels.KIND_SGD
    _sparse_alternative = "torch.optim.SGD (which takes sparse gradients)"

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
        foreach: bool | None = None,
        fused: bool | None = None,
        maximize: bool = False,
    ) -> None:
        refuse_maximize(maximize, type(self).__name__)
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
            foreach=foreach,
            fused=fused,
        )
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        check_numbers(group, type(self).__name__, ("momentum", "dampening", "weight_decay"))
        if group["dampening"] != group["dampening"]:  # NaN (torch.optim does not check it)
            raise ValueError(f"dampening must be a number, not NaN; got {group['dampening']!r}")
        if not (group["momentum"] >= 0 and group["weight_decay"] >= 0):  # NaN too
            raise ValueError(
                f"momentum and weight_decay must be >= 0; got momentum={group['momentum']!r}, "
                f"weight_decay={group['weight_decay']!r}"
            )
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum needs momentum > 0 and dampening = 0")

    _optional_states = frozenset({"momentum_buffer"})  # momentum may be switched on later

    def _state_specs(self, group: dict[str, Any]) -> tuple[tuple[str, bool], ...]:
        return (("momentum_buffer", True),) if group["momentum"] != 0 else ()

    def _missing_step(self, state: dict[str, Any]) -> float | None:
        # torch.optim.SGD keeps no counter; ours only marks the buffer's first use
        return 1.0 if "momentum_buffer" in state else 0.0

    def _states_added(self, state: dict[str, Any]) -> None:
        # Momentum switched on after the tensor stepped without it: as in torch.optim.SGD, the
        # new buffer starts as the gradient at its first use, the step every path treats as the
        # first (step count 1; SGD's counter marks nothing else).
        state["step"].zero_()

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

    def _torch_update(self, group, params, grads, states, steps) -> None:
        kw = dict(
            foreach=group.get("foreach"),
            fused=group.get("fused"),
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=False,
        )
        if not states:  # momentum 0: torch passes no buffers
            _torch_sgd(params, grads, [], **kw)
        else:
            # torch's buffer is None until a tensor's first step (then it starts as the gradient);
            # fused SGD takes all-new or all-existing buffers, so the two kinds go separately.
            first = [i for i, s in enumerate(steps) if s.item() == 0]
            later = [i for i, s in enumerate(steps) if s.item() != 0]
            for idx, new in ((first, True), (later, False)):
                if not idx:
                    continue
                bufs = [None if new else states[0][i] for i in idx]
                _torch_sgd([params[i] for i in idx], [grads[i] for i in idx], bufs, **kw)
                if new:
                    for i, b in zip(idx, bufs):
                        states[0][i].copy_(b)
        torch._foreach_add_(steps, 1)

    def _kernel_hparams(self, group: dict[str, Any], step: int) -> list[float]:
        return [
            group["lr"],
            group["momentum"],
            group["dampening"],
            group["weight_decay"],
            1.0 if group["nesterov"] else 0.0,
            1.0 - group["dampening"],
        ]
