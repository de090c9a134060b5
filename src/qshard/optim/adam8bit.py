"""8-bit Adam and AdamW: first moment on the signed dynamic map, second on the unsigned one."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor
from torch.optim.adam import adam as _torch_adam

from qshard.optim import _functional, _kernels
from qshard.optim._base8bit import Optimizer8bit
from qshard.optim._options import check_numbers, refuse_maximize

__all__ = ["Adam8bit", "AdamW8bit"]


def torch_adam_group(
    group: dict[str, Any],
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    decoupled: bool,
) -> None:
    """torch's functional Adam/AdamW on fp32-state tensors of ``group``, with the arguments
    ``torch.optim`` passes (its ``foreach``/``fused`` flags), so the same bits."""
    b1, b2 = group["betas"]
    _torch_adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        foreach=group.get("foreach"),
        fused=group.get("fused"),
        decoupled_weight_decay=decoupled,
        amsgrad=False,
        beta1=b1,
        beta2=b2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )


def adam_group_hparams(
    group: dict[str, Any], step: int, *, decoupled: bool, inverse_bc2: bool
) -> list[float]:
    """The fused kernels' Adam hyperparameters (:func:`._functional.adam_hparams`) of a group."""
    b1, b2 = group["betas"]
    return _functional.adam_hparams(
        step=step,
        lr=group["lr"],
        beta1=b1,
        beta2=b2,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        decoupled=decoupled,
        inverse_bc2=inverse_bc2,
    )


class Adam8bit(Optimizer8bit):
    """Adam with block-wise 8-bit state (Dettmers et al. 2022); ``torch.optim.Adam`` semantics.

    Args:
        params: parameters or parameter groups (groups may override every option below).
        lr, betas, eps, weight_decay: as ``torch.optim.Adam`` (L2 decay added to the gradient).
        amsgrad: must be False (not supported with quantized state).
        maximize: must be False (accepted as torch.optim takes it; the kernels minimize).
        optim_bits: 8 (quantized state for eligible tensors) or 32 (fp32 state).
        min_8bit_size: tensors with fewer (global) elements keep fp32 state; 1-D tensors always
            do (see [Note: row-block layout] in ``_qstate.py``).
        block_size: elements per absmax block (1..4096; 256 default, 2048 as in the paper).
        bnb_compat: reproduce bitsandbytes' CUDA rounding instead of the fixed one.
        stochastic_rounding: stochastic rounding of the states.
        foreach, fused: as ``torch.optim.Adam``, for the tensors with fp32 state, which take
            torch's own update in one call per group: the same bits as ``torch.optim.Adam``
            with the same flags (None: torch's default; ``fused=True`` is the fast one on CPU).
    """

    _kind = _kernels.KIND_ADAM
    _decoupled = False

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
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
        if amsgrad:
            raise ValueError(f"{type(self).__name__} does not support amsgrad; use amsgrad=False")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
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
        check_numbers(group, type(self).__name__, ("betas", "eps", "weight_decay"))
        b1, b2 = group["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must be in [0, 1); got {group['betas']}")
        if not (group["eps"] >= 0 and group["weight_decay"] >= 0):  # NaN too, as torch.optim
            raise ValueError(
                f"eps and weight_decay must be >= 0; got eps={group['eps']!r}, "
                f"weight_decay={group['weight_decay']!r}"
            )

    def _state_specs(self, group: dict[str, Any]) -> tuple[tuple[str, bool], ...]:
        return (("exp_avg", True), ("exp_avg_sq", False))

    def _neutral_options(self) -> dict[str, Any]:
        # torch.optim.Adam and AdamW are one class that records the decay kind in the group
        return {**super()._neutral_options(), "decoupled_weight_decay": self._decoupled}

    def _reference_update(self, p, g, states, group, step) -> None:
        b1, b2 = group["betas"]
        _functional.adam_update(
            p,
            g,
            states[0],
            states[1],
            step=step,
            lr=group["lr"],
            beta1=b1,
            beta2=b2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            decoupled=self._decoupled,
        )

    def _torch_update(self, group, params, grads, states, steps) -> None:
        torch_adam_group(
            group, params, grads, states[0], states[1], steps, decoupled=self._decoupled
        )

    def _kernel_hparams(self, group: dict[str, Any], step: int) -> list[float]:
        return adam_group_hparams(group, step, decoupled=self._decoupled, inverse_bc2=False)


class AdamW8bit(Adam8bit):
    """AdamW (decoupled weight decay, default 1e-2) with block-wise 8-bit state; arguments as
    :class:`Adam8bit`, semantics of ``torch.optim.AdamW``."""

    _decoupled = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
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
        # Spelled out (not **kwargs) so that help() shows every option and a misspelt one is
        # refused naming this class; tests pin the signature to Adam8bit's.
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            optim_bits=optim_bits,
            min_8bit_size=min_8bit_size,
            block_size=block_size,
            bnb_compat=bnb_compat,
            stochastic_rounding=stochastic_rounding,
            foreach=foreach,
            fused=fused,
            maximize=maximize,
        )
