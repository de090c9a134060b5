"""0/1 Adam (Lu et al., 2022): data-parallel Adam with adaptively frozen variance, 1-bit
compressed averaging and local steps.

The model is replicated on every rank of ``process_group``; each rank runs ``backward()`` on its
own data (no DDP) and calls :meth:`ZeroOneAdam.step`, which does all the communication.

* Phase A (``step <= var_freeze_step``). On a variance step (schedule T_v, see
  :func:`variance_update_steps`) the gradient is averaged in fp32 and both momentum and variance
  are updated. Every other step is a sync with interval 1 (the paper's T_u starts at 1): each
  rank updates the momentum with its local gradient and the momenta are averaged with the 1-bit
  compressed all-reduce (``phase_a_compression="momentum"``, see [Note: phase A compression]);
  or, as DeepSpeed 0.16 did, the gradient is averaged with the 1-bit all-reduce and then folded
  into the momentum (``"gradient"``).
* Phase B (``step > var_freeze_step``). The variance is frozen. Every step is local: momentum
  and parameters are updated from the local gradient, with no communication. On a sync step
  (schedule T_u, see :func:`sync_steps`) the ranks average their drift since the last sync,
  scaled by ``sqrt(v) + eps``, with the 1-bit all-reduce; the averaged drift becomes the new
  parameters (from the last synchronised point) and, divided by the sum of the learning rates
  over the interval, the new momentum.

[Note: sync anchor] The algorithm keeps the drift ``u`` and rolls back with ``x -= u``; in
floating point ``(x - d1 - d2 ...) + (d1 + d2 ...)`` differs from rank to rank in the last bit,
so replicas would slowly drift apart. Instead each parameter keeps its value at the last sync
(the anchor, same memory as ``u``): the drift is ``x - anchor`` and the new parameter is
``anchor + averaged drift / (sqrt(v) + eps)``, bit-identical on every rank.

[Note: phase A compression] In the paper's Algorithm 1 the ranks never exchange gradients in
1 bit: each keeps its momentum from its local gradients and the 1-bit all-reduce averages the
drift ``u = sum(lr * m)`` on the T_u steps, whose interval is 1 until the lr stops rising; T_v
steps additionally average the gradient in fp32 for the variance. Before the freeze every
non-variance step is therefore a sync of ``u = lr * m``, i.e. of the local momenta (``u / lr``),
exactly 1-bit Adam's compression stage. (On a T_v step the fp32-averaged gradient gives the
averaged momentum exactly, so no 1-bit round is needed there; both implementations do that.)
DeepSpeed 0.16's zoadam.py instead 1-bit-averages the raw local gradient and folds it into the
momentum. Same bytes and rounds, very different noise: a local gradient is far noisier than a
momentum (an average over ~1/(1 - beta1) steps), and one scale per tensor sends every element
``+-scale``, so elements with a small gradient, hence a small ``sqrt(v)``, get steps of
``lr * scale / sqrt(v)``. On the convergence benchmark's GPT (local batch 8, beta2 0.95) the
averaged gradient came back with a relative error of 2.2 and the per-element error over
``sqrt(v)`` averaged 3,600 (momentum: 370); validation loss after 120 steps was 2.532 with
gradients vs 2.355 with momenta (AdamW 2.303). The default is the paper's algorithm.

[Note: local steps need a decaying lr] The paper grows the sync interval inversely to the
learning rate ("the approximation noise from local step is proportional to the learning rate",
Section 6): interval 1 while the lr is at its peak, doubling each time it halves. At a constant
lr with local steps the 1-bit sync diverges or stalls even on a realizable least-squares
problem, while the same run with exact averaging converges to rounding (measured in
docs/zero_one_adam.md; a float64 simulation of the paper's Algorithm 1 does the same, so this is
the method, not this implementation): the sync sets the momentum to the compressed average
drift over ``sum(lr)``, so each sync's compression error becomes a momentum error that the
local steps then integrate for a whole interval without error feedback. The optimizer records
the lr of the first phase-B step and warns once, at a sync, when the next interval exceeds
twice ``lr at the freeze / lr now`` (one doubling of slack: interval 2 at a constant lr
converged in every measured case, interval 4 diverged at the largest lr).

[Note: weight decay in the drift] The paper's drift ``u`` sums ``lr * m`` only (its algorithm
has no weight decay), and the momentum after a sync is ``u / sum(lr)``. With decoupled weight
decay in the local steps, ``x - anchor`` also holds the decay ``-lr * wd * x`` of every step
(DeepSpeed 0.16 averages that drift as is): dividing it by ``sum(lr)`` puts ``wd * x * (sqrt(v)
+ eps)`` into the momentum, which then decays the weights again on the following steps, about
``1 / (1 - beta1)`` times over when every step syncs (11x the weight decay at beta1 = 0.9).
Here the decay is taken out exactly: each local step is ``x <- k x - lr m / d`` with
``k = 1 - lr * wd``, so ``x - (prod k) * anchor = -sum_i (prod_{j>i} k_j) lr_i m_i / d``. The
optimizer keeps ``prod k`` (``decay``) and the equally weighted ``sum lr`` (``lr_sum``) per
parameter; the drift ``(x - decay * anchor) * d`` carries the momentum alone, its average
``u`` gives the new parameter ``decay * anchor + u / d`` and the momentum ``-u / lr_sum``. The
decayed anchor is the same on every rank (same lr schedule), so replicas stay bit-identical.
Without weight decay this is the paper's rule exactly.

The first ``step()`` is a real update (a variance step). Update rule as in both papers' code:
``x -= lr * (m / (sqrt(v) + eps) + weight_decay * x)`` without bias correction.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from qshard._stack import user_stacklevel
from qshard.optim._onebit import (
    _EXTRA_KEY,
    DEFAULT_VARIANCE_FLOOR,
    _check_variance_floor,
    _DataParallelOneBitOptimizer,
)
from qshard.optim._options import eager_only
from qshard.optim._schedules import (
    _positive_int,
    next_sync_step,
    next_variance_step,
    sync_interval,
    sync_steps,
    variance_update_steps,
)

__all__ = [
    "PHASE_A_COMPRESSION",
    "ZeroOneAdam",
    "next_sync_step",
    "next_variance_step",
    "sync_interval",
    "sync_steps",
    "variance_update_steps",
]


PHASE_A_COMPRESSION = ("momentum", "gradient")
"""Choices of ``ZeroOneAdam(phase_a_compression=)``; see [Note: phase A compression]."""


class ZeroOneAdam(_DataParallelOneBitOptimizer):
    """0/1 Adam over ``process_group`` (default: the world).

    Args:
        params: parameters or parameter groups (fp32, replicated; or the DTensors of an HSDP
            model sharded with ``replicate_reduce=False``: the local shards are stepped and
            synced over the replicate group, see docs/hsdp.md).
        lr, betas, eps, weight_decay: as in Adam (per group); see the module docstring.
        var_freeze_step: last step of phase A (>= 1); afterwards variance is frozen and local
            steps begin.
        var_update_scaler: kappa of the T_v schedule: the gap between variance updates doubles
            after every ``kappa`` updates (paper: 16).
        local_step_scaler: alpha of the T_u schedule: the sync gap doubles every ``alpha``
            phase-B steps (DeepSpeed default 32678; choose it from the lr schedule: roughly the
            number of steps in which the lr halves).
        local_step_clipper: H, the largest sync gap (paper: 16).
        process_group: the data-parallel group. In a single process without
            ``init_process_group`` leave it None: the optimizer then runs as one rank (same
            compression and error feedback as a world of size 1, no collectives).
        amsgrad: not supported (raises if True).
        phase_a_compression: what a phase-A step that is not a variance step averages with the
            1-bit all-reduce: ``"momentum"`` (default; the paper's Algorithm 1, a sync of the
            local momenta every step) or ``"gradient"`` (DeepSpeed 0.16's zoadam.py: the local
            gradient, then folded into the momentum). Same communication; see [Note: phase A
            compression] in the module docstring for why the default converges much better.
        bias_correction: divide the variance by ``1 - beta2 ** k``, ``k`` the number of variance
            updates of that parameter so far (default False, as both papers' code). The momentum
            is not corrected.
            Recommended when ``var_freeze_step`` is short and beta2 close to 1 (0.999): T_v
            updates the variance rarely, so without it ``sqrt(v)`` stays far below the gradient
            scale and steps are too large. Not with a fast beta2 (0.95): v warms up in ~20
            updates and correcting v but not m makes the early steps too small (measured).
        variance_floor: every update's ``sqrt(v)`` is at least this fraction of its tensor's
            RMS ``sqrt(mean(v))`` (the variance is frozen between T_v updates and after
            ``var_freeze_step``, while 1-bit averages reach every element as ``+-scale``;
            default 0.01, 0 = the paper's exact rule). See [Note: variance floor] in
            ``qshard.optim._onebit``.

    After the last step of training, call :meth:`synchronize` if the last step was local, so
    that every rank holds the same parameters. Local steps need a decaying lr: a
    ``UserWarning`` (once) says when the sync interval outgrows it (see [Note: local steps need
    a decaying lr]).
    """

    _algorithm = "zero_one_adam"

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100_000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        process_group: dist.ProcessGroup | None = None,
        amsgrad: bool = False,
        phase_a_compression: str = "momentum",
        bias_correction: bool = False,
        variance_floor: float = DEFAULT_VARIANCE_FLOOR,
    ) -> None:
        self.variance_floor = _check_variance_floor(variance_floor)
        if phase_a_compression not in PHASE_A_COMPRESSION:
            raise ValueError(
                f"phase_a_compression must be one of {PHASE_A_COMPRESSION}; got "
                f"{phase_a_compression!r}"
            )
        self.phase_a_compression = phase_a_compression
        self.var_freeze_step = _positive_int("var_freeze_step", var_freeze_step)
        self.var_update_scaler = _positive_int("var_update_scaler", var_update_scaler)
        self.local_step_scaler = _positive_int("local_step_scaler", local_step_scaler)
        self.local_step_clipper = _positive_int("local_step_clipper", local_step_clipper)
        super().__init__(
            params,
            {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay},
            process_group=process_group,
            amsgrad=amsgrad,
            bias_correction=bias_correction,
            extra_state={
                "step": 0,
                "next_variance_step": 1,
                "variance_updates": 0,
                "next_sync_step": self._next_sync(var_freeze_step),
                "phase_b_started": False,
                "phase_b_lrs": None,
                "full_precision": 0,
                "compressed": 0,
                "local": 0,
            },
        )

        self._interval_warned = False

    def _next_sync(self, last: int) -> int:
        return next_sync_step(
            last,
            var_freeze_step=self.var_freeze_step,
            local_step_scaler=self.local_step_scaler,
            local_step_clipper=self.local_step_clipper,
        )

    def _variance_frozen(self) -> bool:
        return self._extra["step"] >= self.var_freeze_step

    def _freeze_name(self) -> str:
        return f"var_freeze_step={self.var_freeze_step}"

    def _variance_updates_done(self) -> int:
        return self._extra["variance_updates"]

    @property
    def in_sync(self) -> bool:
        """True when every rank holds the same parameters (always in phase A; in phase B right
        after a sync step)."""
        return all("lr_sum" not in s or s["lr_sum"] == 0.0 for s in self.state.values())

    @torch.no_grad()
    @eager_only
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step (see the module docstring for what communicates when)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pairs = self._trainable()
        params = [p for _, p in pairs]
        if not params:
            return loss
        self._check_replicated(params, values_agree=self.in_sync)
        extra = self._extra
        step = extra["step"] + 1
        # A GradScaler's skip is agreed on where the step communicates: [Note: GradScaler].
        communicates = step <= self.var_freeze_step or step == extra["next_sync_step"]
        if self._amp_begin(communicates, f"{self._algorithm}/found_inf"):
            self._amp_end()
            return loss
        try:
            joined = self._init_state(pairs)  # see [Note: late parameters]
            extra["step"] = step
            if joined:  # their first update needs a variance (phase A; phase B refused them)
                extra["next_variance_step"] = step
            if step <= self.var_freeze_step:
                self._phase_a_step(pairs, step)
            else:
                self._phase_b_step(pairs, step)
        finally:
            self._amp_end()
        return loss

    def _phase_a_step(self, pairs: list[tuple[dict[str, Any], torch.Tensor]], step: int) -> None:
        extra = self._extra
        params = [p for _, p in pairs]
        grads = [self._grad(p).float() for p in params]
        variance_step = step == extra["next_variance_step"]
        if variance_step:
            grads = self._all_reduce_mean(grads, f"{self._algorithm}/variance_gradient")
            extra["variance_updates"] += 1
            extra["next_variance_step"] = next_variance_step(
                step, extra["variance_updates"], kappa=self.var_update_scaler
            )
            extra["full_precision"] += 1
        elif self.phase_a_compression == "momentum":
            # A sync of the local momenta; see [Note: phase A compression].
            momenta = []
            for (group, p), g in zip(pairs, grads):
                m = self._state(p)["exp_avg"]
                m.mul_(group["betas"][0]).add_(g, alpha=1 - group["betas"][0])
                momenta.append(m)
            self._compressed_mean(params, momenta, f"{self._algorithm}/momentum", in_place=True)
            extra["compressed"] += 1
            for group, p in pairs:
                self._apply_update(group, p)
            return
        else:
            grads = self._compressed_mean(params, grads, f"{self._algorithm}/gradient")
            extra["compressed"] += 1
        for (group, p), g in zip(pairs, grads):
            state = self._state(p)
            beta1 = group["betas"][0]
            if variance_step:
                mask = self._mask(p)
                if mask is not None:
                    g = g * mask
                self._update_variance(group, p, g)
            state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
            self._apply_update(group, p)

    def _apply_update(self, group: dict[str, Any], p: torch.Tensor) -> None:
        state = self._state(p)
        lr, wd = group["lr"], group["weight_decay"]
        if wd != 0:
            p.mul_(1 - lr * wd)
        # Every 0/1 Adam update may follow a 1-bit average: [Note: no variance yet].
        p.addcdiv_(state["exp_avg"], self._guard_no_variance(p, self._denom(group, p)), value=-lr)

    def _denom(self, group: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        return self._denominator(group, p, floor=self.variance_floor)

    def _phase_b_step(self, pairs: list[tuple[dict[str, Any], torch.Tensor]], step: int) -> None:
        extra = self._extra
        if not extra["phase_b_started"]:
            self._warn_no_variance_at_freeze([p for _, p in pairs])
            # The error buffers held gradient or momentum residue; now they compress the drift
            # (sum(lr * m) * -1, other units), so they restart from zero, as in DeepSpeed.
            self._reset_error_buffers()
            extra["phase_b_started"] = True
        # Also a parameter frozen when phase B began, now unfrozen, and a state loaded through
        # DCP at a sync (a fresh optimizer's template has no anchor; at a sync it equals p).
        for _, p in pairs:
            if "sync_anchor" not in self._state(p):
                self._state(p)["sync_anchor"] = p.detach().clone()
                self._state(p)["lr_sum"] = 0.0
        if extra["phase_b_lrs"] is None:  # also after loading a state saved before this check
            # Values, not the groups' objects: a tensor lr is updated in place by the
            # schedulers, and the "lr at the freeze" followed it (the check warned always).
            extra["phase_b_lrs"] = [float(g["lr"]) for g in self.param_groups]
        for group, p in pairs:
            state = self._state(p)
            beta1, _ = group["betas"]
            grad, mask = self._grad(p), self._mask(p)
            if mask is not None:  # the local step, too, leaves structural zeros alone
                grad = grad * mask
            state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
            self._apply_update(group, p)
            # See [Note: weight decay in the drift].
            keep = 1.0 - group["lr"] * group["weight_decay"]
            state["decay"] = state.get("decay", 1.0) * keep
            state["lr_sum"] = state["lr_sum"] * keep + group["lr"]
        if step == extra["next_sync_step"]:
            self._sync(pairs)
            extra["next_sync_step"] = self._next_sync(step)
            extra["compressed"] += 1
            self._check_interval_against_lr(step, extra["next_sync_step"] - step)
        else:
            extra["local"] += 1

    def _check_interval_against_lr(self, step: int, interval: int) -> None:
        """Warn once when the sync interval outgrows the lr's decay; see [Note: local steps need
        a decaying lr]."""
        if self._interval_warned or interval <= 2:
            return
        for group, lr_at_freeze in zip(self.param_groups, self._extra["phase_b_lrs"]):
            lr = group["lr"]
            if lr <= 0 or lr_at_freeze <= 0 or interval <= 2 * lr_at_freeze / lr:
                continue
            self._interval_warned = True
            warnings.warn(
                f"ZeroOneAdam: at step {step} the sync interval grew to {interval} steps while "
                f"the learning rate is {lr:.3g}, {lr / lr_at_freeze:.2g}x its value at "
                f"var_freeze_step={self.var_freeze_step}. 0/1 Adam's local steps need an lr "
                "that decays as the interval grows (the paper's T_u policy: interval ~ "
                "lr at the freeze / lr now); at an undecayed lr the 1-bit sync's error in the "
                "averaged momentum is amplified by the local steps, and training stalls or "
                "diverges (docs/zero_one_adam.md, 'Local steps need a decaying learning "
                f"rate'). Raise local_step_scaler={self.local_step_scaler} to the number of "
                f"steps in which the lr halves, or lower local_step_clipper="
                f"{self.local_step_clipper} (1 turns local steps off)",
                stacklevel=user_stacklevel(),
            )
            return

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """See :meth:`_DataParallelOneBitOptimizer.load_state_dict`; a state saved before the
        interval check existed (no ``phase_b_lrs``) takes the lr of its next step. The schedule
        positions are reconciled with this optimizer's ``var_freeze_step``: see
        :meth:`_reconcile_schedule`."""
        extra = state_dict.get(_EXTRA_KEY)
        if isinstance(extra, dict) and "phase_b_lrs" not in extra:
            state_dict = {**state_dict, _EXTRA_KEY: {**extra, "phase_b_lrs": None}}
        super().load_state_dict(state_dict)
        self._reconcile_schedule()

    def _reconcile_schedule(self) -> None:
        """[Note: resuming with another var_freeze_step] The saved schedule positions were
        computed with the saving optimizer's ``var_freeze_step``, and ``qshard train --resume
        --steps N`` (a longer run) derives another one from the new lr schedule. Before phase B
        the next sync is a pure function of the freeze and the step (``var_freeze_step + 1``,
        or the next step when the new freeze is already behind), so it is recomputed; with the
        same settings that is the saved value. Before, the saved position was kept: saved at
        step 5 with ``var_freeze_step=100`` and resumed with 8, the first sync stayed at step
        101 (92 local steps in a row, the replicas apart); resumed with a later freeze, the
        saved sync step was already past when phase B began, and no sync ever came again.
        A state saved in phase B cannot return to phase A (its variance is frozen, its error
        buffers hold drift residue, its momenta and anchors are per interval): it stays in
        phase B, with a warning, as if the variance had frozen at the saved step (the sync
        intervals grow again from 1; before, the replicas never synced again)."""
        extra = self._extra
        step = extra["step"]
        if extra["phase_b_started"] and step < self.var_freeze_step:
            warnings.warn(
                f"ZeroOneAdam.load_state_dict: this state was saved in phase B (step {step}, "
                f"after its variance freeze), but this optimizer has var_freeze_step="
                f"{self.var_freeze_step}: the variance cannot be unfrozen, so it stays frozen "
                f"and var_freeze_step becomes {step} (the sync interval grows again from 1). "
                "Build the ZeroOneAdam with the var_freeze_step it was saved with to keep the "
                "saved schedule",
                stacklevel=user_stacklevel(),
            )
            self.var_freeze_step = step
        if not extra["phase_b_started"]:
            extra["next_sync_step"] = max(self._next_sync(self.var_freeze_step), step + 1)

    def _sync(self, pairs: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
        """Average the drift since the last sync; see [Note: sync anchor]. Parameters frozen
        (``requires_grad=False``) since their last sync are synced too: their replicas differ
        by their local steps (the same parameters on every rank, as the model is replicated)."""
        stepping = {id(p) for _, p in pairs}
        pairs = pairs + [
            (g, self._local(p))
            for g in self.param_groups
            for p in g["params"]
            if id(self._local(p)) not in stepping
            and self.state.get(p, {}).get("lr_sum", 0.0) != 0.0
        ]
        params = [p for _, p in pairs]
        denoms = [self._denom(g, p) for g, p in pairs]
        for p in params:  # the anchor, decayed as every replica decayed it since the last sync
            state = self._state(p)
            decay = state.pop("decay", 1.0)
            if decay != 1.0:
                state["sync_anchor"].mul_(decay)
        drifts = [(p - self._state(p)["sync_anchor"]).mul_(d) for p, d in zip(params, denoms)]
        averaged = self._compressed_mean(params, drifts, f"{self._algorithm}/drift", in_place=True)
        for p, d, u in zip(params, denoms, averaged):
            state = self._state(p)
            if state["lr_sum"] > 0:
                state["exp_avg"].copy_(u).div_(-state["lr_sum"])
            p.copy_(state["sync_anchor"].addcdiv_(u, d))
            state["lr_sum"] = 0.0

    @torch.no_grad()
    def synchronize(self) -> bool:
        """Sync now if any local step happened since the last sync (phase B), e.g. before
        evaluating or saving a replicated checkpoint. Collective: call it on every rank.
        Returns whether it communicated. Does not move the sync schedule."""
        if not self._extra["phase_b_started"] or self.in_sync:
            return False
        self._sync(self._trainable())
        self._extra["compressed"] += 1
        return True
