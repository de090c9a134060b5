"""1-bit Adam (Tang et al., 2021): data-parallel Adam whose momentum is averaged with the 1-bit
compressed all-reduce after a full-precision warm-up.

The model is replicated on every rank of ``process_group``; each rank runs ``backward()`` on its
own data (no DDP) and calls :meth:`OneBitAdam.step`, which does all the communication:

* steps ``1..freeze_step``: the gradients are averaged with an fp32 all-reduce and Adam updates
  momentum and variance;
* afterwards the variance is frozen; each rank folds its *local* gradient into the momentum and
  the momentum is averaged with :func:`qshard.comm.compressed.compressed_all_reduce` (1 bit per
  element, with worker and server error feedback).

Update rule of both papers' code (no bias correction; decoupled weight decay scaled by lr):
``x -= lr * (m / (sqrt(v) + eps) + weight_decay * x)``. Every rank holds bit-identical
parameters after every step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from qshard._stack import user_stacklevel
from qshard.optim._onebit import (
    DEFAULT_VARIANCE_FLOOR,
    _check_variance_floor,
    _DataParallelOneBitOptimizer,
)
from qshard.optim._options import eager_only
from qshard.optim._schedules import _positive_int

__all__ = ["OneBitAdam"]


class OneBitAdam(_DataParallelOneBitOptimizer):
    """1-bit Adam over ``process_group`` (default: the world).

    Args:
        params: parameters or parameter groups (fp32, replicated; or the DTensors of an HSDP
            model sharded with ``replicate_reduce=False``: the local shards are stepped and
            synced over the replicate group, see docs/hsdp.md).
        lr, betas, eps, weight_decay: as in Adam (per group); see the module docstring for the
            exact update.
        freeze_step: number of full-precision warm-up steps (>= 1) after which the variance is
            frozen and momentum is compressed to 1 bit.
        process_group: the data-parallel group. In a single process without
            ``init_process_group`` leave it None: the optimizer then runs as one rank (same
            compression and error feedback as a world of size 1, no collectives).
        amsgrad: not supported (raises if True).
        bias_correction: divide the variance by ``1 - beta2 ** k``, ``k`` the number of variance
            updates of that parameter so far (default False, as both papers' code). The momentum
            is not corrected.
        variance_floor: in the compression stage, each element's frozen ``sqrt(v)`` is at least
            this fraction of its tensor's RMS ``sqrt(mean(v))``, so elements with a near-zero
            variance do not take huge steps from the 1-bit noise (default 0.01; 0 = the paper's
            exact rule). See [Note: variance floor] in ``qshard.optim._onebit``.

    Use :meth:`set_zero_mask` for structurally zero gradient elements; :attr:`comm_stats`
    counts the steps by kind of communication.
    """

    _algorithm = "onebit_adam"

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100_000,
        process_group: dist.ProcessGroup | None = None,
        amsgrad: bool = False,
        bias_correction: bool = False,
        variance_floor: float = DEFAULT_VARIANCE_FLOOR,
    ) -> None:
        self.variance_floor = _check_variance_floor(variance_floor)
        self.freeze_step = _positive_int(
            "freeze_step",
            freeze_step,
            " (the variance needs at least one full-precision step)",
        )
        super().__init__(
            params,
            {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay},
            process_group=process_group,
            amsgrad=amsgrad,
            bias_correction=bias_correction,
            extra_state={"step": 0, "full_precision": 0, "compressed": 0, "local": 0},
        )

    def _variance_frozen(self) -> bool:
        return self._extra["step"] >= self.freeze_step

    def _freeze_name(self) -> str:
        return f"freeze_step={self.freeze_step}"

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """See :meth:`_DataParallelOneBitOptimizer.load_state_dict`. A state saved after its
        variance froze (a compressed step done) stays frozen under a later ``freeze_step``:
        ``freeze_step`` becomes the saved step, with a warning, as ZeroOneAdam does with
        ``var_freeze_step``. Before, the next steps went back to full precision and updated the
        frozen variance again, and the compressed phase later resumed on stale error buffers."""
        super().load_state_dict(state_dict)
        step = self._extra["step"]
        if self._extra["compressed"] > 0 and step < self.freeze_step:
            warnings.warn(
                f"OneBitAdam.load_state_dict: this state was saved after its variance froze "
                f"(step {step}, compressed steps done), but this optimizer has freeze_step="
                f"{self.freeze_step}: the variance cannot be unfrozen, so it stays frozen and "
                f"freeze_step becomes {step}. Build the OneBitAdam with the freeze_step it was "
                "saved with to keep the saved schedule",
                stacklevel=user_stacklevel(),
            )
            self.freeze_step = step

    def _variance_updates_done(self) -> int:
        return min(self._extra["step"], self.freeze_step)

    @torch.no_grad()
    @eager_only
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step: average (fp32 or 1-bit) and update every trainable parameter."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pairs = self._trainable()
        params = [p for _, p in pairs]
        if not params:
            return loss
        self._check_replicated(params)
        # Every step communicates; a GradScaler's skip is agreed on: [Note: GradScaler].
        if self._amp_begin(True, f"{self._algorithm}/found_inf"):
            self._amp_end()
            return loss
        try:
            self._step(pairs)
        finally:
            self._amp_end()
        return loss

    def _step(self, pairs: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
        params = [p for _, p in pairs]
        self._init_state(pairs)  # see [Note: late parameters]
        extra = self._extra
        extra["step"] += 1

        compressed = extra["step"] > self.freeze_step
        if extra["step"] == self.freeze_step + 1:
            self._warn_no_variance_at_freeze(params)  # [Note: no variance yet]
        if not compressed:
            grads = self._all_reduce_mean(
                [self._grad(p).float() for p in params], f"{self._algorithm}/gradient"
            )
            for (group, p), g in zip(pairs, grads):
                mask = self._mask(p)
                if mask is not None:
                    g = g * mask
                beta1 = group["betas"][0]
                self._state(p)["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
                self._update_variance(group, p, g)
            extra["full_precision"] += 1
        else:
            for group, p in pairs:
                beta1, _ = group["betas"]
                self._state(p)["exp_avg"].mul_(beta1).add_(self._grad(p), alpha=1 - beta1)
            momenta = [self._state(p)["exp_avg"] for p in params]
            self._compressed_mean(params, momenta, f"{self._algorithm}/momentum", in_place=True)
            extra["compressed"] += 1

        for group, p in pairs:
            state = self._state(p)
            lr, wd = group["lr"], group["weight_decay"]
            if wd != 0:
                p.mul_(1 - lr * wd)
            denom = self._denominator(group, p, floor=self.variance_floor if compressed else 0.0)
            if compressed:  # see [Note: no variance yet] in qshard.optim._onebit
                denom = self._guard_no_variance(p, denom)
            p.addcdiv_(state["exp_avg"], denom, value=-lr)
