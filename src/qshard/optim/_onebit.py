"""Shared machinery of the data-parallel 1-bit optimizers (:class:`OneBitAdam`,
:class:`ZeroOneAdam`): argument and parameter validation, the replication check, the two ways to
average (fp32 all-reduce, 1-bit compressed all-reduce with per-parameter error buffers),
structural-zero masks; the state_dict that keeps everything needed to resume bit for bit is
:class:`qshard.optim._onebit_state._OneBitCheckpoint`, a base of the optimizers.

[Note: variance floor] 1 bit cannot send 0: after compression every element of a tensor carries
``+-scale`` (its tensor's compression scale, about the RMS of its momentum), so an element whose
frozen ``sqrt(v)`` is tiny takes steps of ``lr * scale / sqrt(v)``. On the 2000-step GPT run of
``docs/zero_one_adam.md`` a third of each attention qkv bias and half the tied embedding had a
frozen ``sqrt(v)`` of 1e-10..3e-8 and moved by 16..260 per step, and the loss jumped from 1.88
to 3.23. ``variance_floor`` (a ratio r) bounds the denominator of every update that follows a
compressed average from below by ``r * sqrt(mean(v))`` of the tensor (unmasked elements), which
bounds such steps to about ``lr / r``; elements above the floor are untouched, and
``variance_floor=0`` is the papers' exact rule.

[Note: per-rank state] and [Note: DCP checkpoints]: see :mod:`qshard.optim._onebit_state`.

[Note: late parameters] The variance is what keeps a 1-bit step safe: it comes from
full-precision averages until the freeze and is kept afterwards. A parameter that steps for the
first time after the freeze (added with ``add_param_group``, or ``requires_grad`` turned on)
would keep ``v = 0`` and take steps of ``lr * m / eps`` (1e6 * lr and more; 0/1 Adam's phase B
also had no sync anchor for it and raised a KeyError): both optimizers refuse it with an error.
A parameter that trained before the freeze may be frozen and unfrozen at any time. In 0/1 Adam's
phase A, a parameter that joins on a step that is not a variance step makes that step a variance
step (its first update would divide by ``eps`` as well).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from qshard import _replicas
from qshard._stack import user_stacklevel
from qshard.comm.compressed import (
    _all_gather_single,
    _check_same_layout,
    compressed_all_reduce,
)
from qshard.comm.ledger import active_ledger
from qshard.optim._onebit_state import _ERROR_KEYS, _EXTRA_KEY, _OneBitCheckpoint
from qshard.optim._options import listed_once
from qshard.optim._replicate import _dtensor_type, localize

__all__: list[str] = []


# Keys a DeepSpeed or torch user may put in a param group that do nothing per group here.
_NOT_PER_GROUP = frozenset(
    {
        "freeze_step",  # OneBitAdam
        "var_freeze_step",  # ZeroOneAdam
        "var_update_scaler",
        "local_step_scaler",
        "local_step_clipper",
        "phase_a_compression",
        "bias_correction",  # both; per group in DeepSpeed
        "variance_floor",
        "process_group",
        "amsgrad",
        "maximize",  # torch's Adam
        "foreach",
        "fused",
        "capturable",
        "differentiable",
        "decoupled_weight_decay",
        "max_grad_norm",  # DeepSpeed's
        "eps_inside_sqrt",
        "cuda_aware",
        "comm_backend_name",
    }
)


def _refuse_misplaced(group: dict[str, Any], name: str, *, by_hand: bool = False) -> None:
    """Refuse a param group holding a :data:`_NOT_PER_GROUP` key, which the step would ignore
    (``by_hand``: found in ``param_groups`` at a step, set after the group was added)."""
    misplaced = sorted(set(group) & _NOT_PER_GROUP)
    if not misplaced:
        return
    where = "set by hand in a param group" if by_hand else "in a param group"
    fix = (
        f"remove {'them' if len(misplaced) > 1 else 'it'} from the group "
        f"(del opt.param_groups[i][{misplaced[0]!r}]) and pass such settings to the {name} "
        "constructor (see its docstring)"
        if by_hand
        else f"pass the others to the {name} constructor (see its docstring); "
        "torch's ZeroRedundancyOptimizer copies its keyword arguments into every group, and "
        f"cannot wrap {name} anyway (it replicates every parameter; ZeRO-1 shards them)"
    )
    raise ValueError(
        f"{name}: {misplaced} {where}: these are settings of the whole optimizer (or of "
        "DeepSpeed's / torch's Adam, not taken here), which a param group would silently "
        f"ignore. Per group only lr, betas, eps and weight_decay; {fix}"
    )


DEFAULT_VARIANCE_FLOOR = 0.01
"""Default ``variance_floor`` of both optimizers; see [Note: variance floor]."""


def _check_variance_floor(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(
            f"variance_floor must be a float in [0, 1) (a fraction of the tensor's RMS "
            f"sqrt(v); 0 = the papers' exact rule); got {value!r}"
        )
    return float(value)


def _validate_hparams(lr: float, betas: tuple[float, float], eps: float, wd: float) -> None:
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0; got {lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two floats in [0, 1); got {betas}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0; got {eps}")
    if not wd >= 0.0:
        raise ValueError(f"weight_decay must be >= 0; got {wd}")


class _DataParallelOneBitOptimizer(_OneBitCheckpoint, Optimizer):
    """Base class: owns the process group, the per-parameter error buffers and the extra
    (non per-parameter) state. Subclasses implement :meth:`step` with the helpers below."""

    _algorithm: str = ""

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        process_group: dist.ProcessGroup | None,
        amsgrad: bool,
        bias_correction: bool,
        extra_state: dict[str, Any],
    ) -> None:
        name = type(self).__name__
        self.bias_correction = bool(bias_correction)
        if amsgrad:
            raise ValueError(
                f"{name} does not support amsgrad: its variance is frozen (and agreed on by all "
                "ranks) for most of training, which AMSGrad's running max would contradict"
            )
        _validate_hparams(
            defaults["lr"], defaults["betas"], defaults["eps"], defaults["weight_decay"]
        )
        # HSDP DTensors: step on the local shards over the replicate group (qshard.optim._replicate).
        params, process_group, self._shards = localize(params, process_group, name)
        if not dist.is_available() or not dist.is_initialized():
            if process_group is not None:
                raise RuntimeError(
                    f"{name} was given a process_group but torch.distributed is not "
                    "initialised; call init_process_group first (or pass no process_group "
                    "in a single process)"
                )
            # [Note: one process] No process group: one rank, the same compression and error
            # feedback as a world of size 1, no collectives (see qshard.comm.compressed).
            self.process_group = None
            self.rank, self.world_size, self._group_ranks = 0, 1, [0]
        else:
            self.process_group = process_group if process_group is not None else dist.group.WORLD
            self.rank = dist.get_rank(self.process_group)
            if self.rank < 0:
                raise ValueError(
                    f"{name}: global rank {dist.get_rank()} is not a member of process_group; "
                    "build the optimizer only on the ranks of its data-parallel group"
                )
            self.world_size = dist.get_world_size(self.process_group)
            self._group_ranks = dist.get_process_group_ranks(self.process_group)
        super().__init__(params, defaults)  # checks every group: see add_param_group
        self._extra: dict[str, Any] = dict(extra_state)
        self._link_extra()
        self._replication_checked = False
        # masks set before their parameter's first step, by state key: [Note: zero masks
        # through DCP] (keyed by tensor, as self.state: a deep copy maps them alike)
        self._pending_masks: dict[torch.Tensor, torch.Tensor] = {}
        self._error_mesh: Any = None  # built on the first state_dict(); see _export_error
        if self._shards is not None:  # this optimizer syncs their replicas: [Note: replica sync]
            _replicas.claim(self, self._shards.dtensors())

    # ----------------------------------------------------------------------- copies
    # [Note: copies] torch pickles and deep-copies an optimizer as its defaults, state and
    # param_groups only; this one's settings (process group, rank, the freeze schedule, the
    # extra state) live beside them, so such a copy could not step. A copy here takes them all
    # (torch's hook tables excepted: torch's __setstate__ starts them empty, as for its own
    # optimizers). A deep copy shares the process group (a group cannot be copied); a pickle
    # has none to carry, so one is refused where a group is set, and so is any copy on HSDP,
    # whose DTensor parameters this optimizer claimed ([Note: replica sync]).

    def _copy_state(self) -> dict[str, Any]:
        if self._shards is not None:
            raise TypeError(
                f"{type(self).__name__} on HSDP parameters cannot be copied or pickled: it "
                "syncs the replicas of the DTensors it was built on. Save state_dict() (e.g. "
                "with torch.distributed.checkpoint) and load it into a new optimizer instead"
            )
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_optimizer_")}
        state["_error_mesh"] = None  # rebuilt from the process group on the next state_dict()
        state.pop("_frozen_stats", None)  # weak references: [Note: frozen variance statistics]
        return state

    def __getstate__(self) -> dict[str, Any]:
        if self.process_group is not None:
            raise TypeError(
                f"{type(self).__name__} holds a torch.distributed process group, which cannot "
                "be pickled; save optimizer.state_dict() (torch.save or "
                "torch.distributed.checkpoint) and load it into an optimizer built in the new "
                "process (copy.deepcopy works: the copy shares the group)"
            )
        return self._copy_state()

    def __deepcopy__(self, memo: dict[int, Any]) -> _DataParallelOneBitOptimizer:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        if self.process_group is not None:
            memo[id(self.process_group)] = self.process_group
        new.__setstate__(copy.deepcopy(self._copy_state(), memo))
        return new

    # ----------------------------------------------------------------------- parameters
    def _variance_frozen(self) -> bool:
        """Whether the next step comes after the variance freeze (subclasses)."""
        raise NotImplementedError

    def _freeze_name(self) -> str:
        """The freeze argument and its value, for error messages (subclasses)."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As :meth:`torch.optim.Optimizer.add_param_group`, with the constructor's checks
        (hyperparameters, fp32 parameters) and, once the variance is frozen, no trainable
        parameters: they would have no variance (see [Note: late parameters])."""
        name = type(self).__name__
        constructed = hasattr(self, "_extra")  # the constructor adds its groups through here
        if constructed:
            dtensor = _dtensor_type()
            params = param_group.get("params", [])
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group = {**param_group, "params": params}
            if self._shards is not None or (
                dtensor is not None and any(isinstance(p, dtensor) for p in params)
            ):
                raise TypeError(
                    f"{name}.add_param_group: HSDP parameters are localised once, at "
                    "construction; pass every parameter group to the constructor"
                )
        _refuse_misplaced(param_group, name)
        super().add_param_group(listed_once(param_group, name))
        group = self.param_groups[-1]
        try:
            _validate_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            for p in group["params"]:
                self._check_param(p)
            trainable = any(p.requires_grad for p in group["params"])
            if constructed and trainable and self._variance_frozen():
                raise ValueError(
                    f"{name}.add_param_group after the variance freeze "
                    f"({self._freeze_name()}; {self._extra['step']} steps done): the new "
                    "parameters would have no variance estimate and take steps of about "
                    "lr * m / eps. Give the optimizer every parameter before the freeze (one "
                    "may keep requires_grad=False until it is needed, but must train for at "
                    "least one step before the freeze), or train them with another optimizer whose "
                    "gradients you average across ranks yourself (dist.all_reduce(p.grad), "
                    "op=AVG): nothing else averages them"
                )
        except Exception:
            self.param_groups.pop()
            raise
        if constructed:
            self._link_extra()

    def _link_extra(self) -> None:
        # [Note: DCP checkpoints] every live group names the extra state, so that torch's
        # (flattened) optimizer state dict has a place for it; state_dict() fills it in.
        for group in self.param_groups:
            group[_EXTRA_KEY] = self._extra

    # ----------------------------------------------------------------------- state keys
    def _key(self, p: torch.Tensor) -> torch.Tensor:
        """The state key of a stepped tensor: the parameter itself, or on HSDP its DTensor."""
        return p if self._shards is None else self._shards.key(p)

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        return self.state[self._key(p)]

    def _local(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor stepped for a parameter of ``param_groups`` (on HSDP its local shard)."""
        return p if self._shards is None else self._shards.local(p)

    def _init_state(self, pairs: list[tuple[dict[str, Any], torch.Tensor]]) -> bool:
        """Create m and v of the parameters that step for the first time; returns whether
        there were any. Refuses them after the variance freeze: [Note: late parameters]."""
        new = [p for _, p in pairs if "exp_avg" not in self.state.get(self._key(p), {})]
        if new and self._variance_frozen():
            raise RuntimeError(
                f"{type(self).__name__}: {len(new)} parameter(s) (shapes "
                f"{[tuple(p.shape) for p in new[:4]]}) step for the first time at step "
                f"{self._extra['step'] + 1}, after the variance freeze ({self._freeze_name()}):"
                " they have no variance estimate and would take steps of about lr * m / eps. "
                "Let them train (requires_grad=True) for at least one step before the freeze, "
                "or train them with another optimizer whose gradients you average across "
                "ranks yourself (dist.all_reduce(p.grad), op=AVG): nothing else averages them"
            )
        for p in new:
            state = self._state(p)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["variance_updates"] = 0
            pending = self._pending_masks.pop(self._key(p), None)
            if pending is not None:  # set before this first step: [Note: zero masks through DCP]
                state["zero_mask"] = pending
            self._error_buffers(p)  # with m and v: [Note: DCP checkpoints]
        return bool(new)

    def _check_param(self, p: torch.Tensor) -> None:
        # DTensors never get here: localize() steps HSDP shards locally and refuses the rest.
        name = type(self).__name__
        if p.dtype != torch.float32:
            raise TypeError(
                f"{name} keeps fp32 state and updates fp32 parameters; got a {p.dtype} "
                "parameter. Keep fp32 master weights (cast the model with .float())"
            )
        if p.is_sparse:
            raise TypeError(f"{name} does not support sparse parameters")

    # [Note: variance updates per parameter] Bias correction divides v by ``1 - beta2 ** k``,
    # k the number of times *this parameter's* v was updated (``state["variance_updates"]``),
    # as torch.optim.Adam keeps a step count per parameter. One count for the optimizer (the
    # step, or 0/1 Adam's number of T_v steps) over-corrected a parameter that joined late
    # (add_param_group, or requires_grad turned on before the freeze): after one update of
    # ``v = (1 - beta2) g^2`` it divided by ``1 - beta2 ** k_all``, so with beta2 = 0.999 a
    # parameter joining 9 steps before a freeze at 10 kept a frozen ``sqrt(v)`` sqrt(10) times
    # too small and took 3x too large steps for the rest of training. A state saved before the
    # count existed takes the optimizer's count on load (what it was corrected with then).
    def _variance_updates_done(self) -> int:
        """The optimizer-wide number of variance updates so far (subclasses): what a state
        saved without per-parameter counts was corrected with."""
        raise NotImplementedError

    def _update_variance(self, group: dict[str, Any], p: torch.Tensor, g: torch.Tensor) -> None:
        """``v = beta2 v + (1 - beta2) g^2`` and count it: [Note: variance updates per
        parameter]."""
        state = self._state(p)
        beta2 = group["betas"][1]
        state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        state["variance_updates"] = state.get("variance_updates", 0) + 1

    def _denominator(self, group: dict[str, Any], p: torch.Tensor, *, floor: float = 0.0):
        """``sqrt(v) + eps``; with ``bias_correction``, ``v`` is divided by
        ``1 - beta2 ** k``, k the number of times this parameter's ``v`` was updated (under a
        sparse variance schedule far smaller than the step count; [Note: variance updates per
        parameter]). With ``floor > 0``, ``sqrt(v)`` is raised to at least ``floor`` times the
        tensor's RMS ``sqrt(mean(v))`` over its unmasked elements; see [Note: variance
        floor]."""
        state = self._state(p)
        v = stored = state["exp_avg_sq"]
        variance_updates = state.get("variance_updates", 0)
        correction = 1.0
        if self.bias_correction and variance_updates > 0:
            correction = 1 - group["betas"][1] ** variance_updates
            v = v / correction
        d = v.sqrt()
        if floor > 0:
            mask = self._mask(p)

            def compute_threshold() -> torch.Tensor:
                mean_v = v.mean() if mask is None else (v * mask).sum() / mask.sum().clamp_min(1)
                return mean_v.sqrt().mul_(floor)

            sources = (stored, state.get("zero_mask"))  # the stored tensors, not casts of them
            stamp = (correction, floor)
            threshold = self._frozen_stat("threshold", p, sources, stamp, compute_threshold)
            d = torch.maximum(d, threshold, out=d)
        return d.add_(group["eps"])

    # [Note: frozen variance statistics] Once the variance is frozen it changes no more, yet
    # each update read all of v twice more than the update itself needs: the variance floor's
    # mean(v), and the no-variance guard's any(v) (plus a masked_fill pass). Both are kept per
    # parameter and recomputed when an input changes: the tensors they were read from (v and
    # the mask, by identity: load_state_dict or set_zero_mask may replace them) and their
    # version counters (every in-place write bumps one: a variance update, a copy into v), with
    # the numbers they depend on (bias correction, floor). Kept out of copies and pickles.
    def _frozen_stat(self, name: str, p: torch.Tensor, sources: tuple, stamp: tuple, compute):
        """``compute()``, reused while ``sources`` (tensors or None) are the same objects at
        the same versions and ``stamp`` is unchanged; see [Note: frozen variance statistics]."""
        cache = self.__dict__.setdefault("_frozen_stats", {})
        full = (*(None if t is None else t._version for t in sources), *stamp)
        entry = cache.get((name, p))
        if (
            entry is not None
            and entry[1] == full
            and all((r() if r is not None else None) is t for r, t in zip(entry[0], sources))
        ):
            return entry[2]
        value = compute()
        refs = tuple(None if t is None else weakref.ref(t) for t in sources)
        cache[(name, p)] = (refs, full, value)
        return value

    # [Note: no variance yet] A trainable parameter that got no gradient on any rank in every
    # full-precision (variance) step so far, e.g. a branch first used after the warm-up, has
    # m and v but v == 0 everywhere: the variance floor (relative to the tensor's own mean v)
    # cannot help, and an update after a 1-bit average, once the branch is used, moved it by
    # lr * m / eps (2.7e7 x lr measured; torch's Adam takes steps of about lr there). Such a
    # tensor is not moved by the m / d term of those updates (weight decay still applies):
    # in 0/1 Adam's phase A until a variance step gives it a variance, after a freeze for good,
    # with a warning at the freeze naming the fix. v is the same on every rank (it only ever
    # sees averaged gradients), so every rank decides alike; it is read once per change of v
    # ([Note: frozen variance statistics]), so a GPU syncs once per variance update, not per
    # step.
    def _guard_no_variance(self, p: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
        """``denom`` where ``p`` has a variance, +inf (no m / d step) where its v is all zero;
        see [Note: no variance yet]."""
        v = self._state(p)["exp_avg_sq"]
        if self._frozen_stat("any", p, (v,), (), lambda: bool(v.any())):
            return denom
        return denom.fill_(torch.inf)  # in place: the fresh tensor of _denominator

    def _warn_no_variance_at_freeze(self, params: list[torch.Tensor]) -> None:
        """Once, at the variance freeze: name the trainable tensors that have no variance
        (see [Note: no variance yet])."""
        empty = [
            tuple(p.shape)
            for p in params
            if p.numel() > 0 and not bool(self._state(p)["exp_avg_sq"].any())
        ]
        if empty:
            warnings.warn(
                f"{type(self).__name__}: {len(empty)} trainable parameter tensor(s) (shapes "
                f"{empty[:4]}{' ...' if len(empty) > 4 else ''}) got no gradient on any rank "
                f"before the variance freeze ({self._freeze_name()}), so they have no "
                "variance estimate: a 1-bit step would move them by about lr * m / eps. They "
                "are not updated from here on (weight decay still applies). If they are used "
                "later (a branch or head enabled after the warm-up), let them get gradients "
                "before the freeze, or train them with another optimizer whose gradients you "
                "average across ranks yourself (nothing else averages them)",
                stacklevel=user_stacklevel(),
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # on HSDP: the DTensors' gradients
        if self._shards is not None:  # and the local tensors' views of them
            self._shards.zero_grad()

    def _trainable(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """``(group, tensor stepped)`` of every trainable parameter (on HSDP: local shards).
        Refuses first a group given a whole-optimizer key by hand after construction
        (``opt.param_groups[0]["maximize"] = True``), which the step would silently ignore as
        ``add_param_group`` says; before anything moves or communicates."""
        for group in self.param_groups:
            _refuse_misplaced(group, type(self).__name__, by_hand=True)
        self._check_built_after_init()
        if self._shards is not None:
            self._shards.pull()
        return [
            (g, self._local(p)) for g in self.param_groups for p in g["params"] if p.requires_grad
        ]

    def _check_built_after_init(self) -> None:
        """[Note: built before init_process_group] An optimizer built without a process group
        runs as one rank (see [Note: one process]) and keeps doing so: it decided that at
        construction. Built before ``init_process_group`` on every rank of a larger world, it
        averaged nothing, so the replicas silently trained apart from the first step, and the
        first 1-bit step then failed on error buffers sized for one rank ("needs a worker error
        of 16 ... got 8"), as late as ``freeze_step``. Checked on every step (no
        communication): refused as soon as a world of more than one rank exists."""
        if (
            self.process_group is None
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
        ):
            name = type(self).__name__
            raise RuntimeError(
                f"{name} was built before torch.distributed.init_process_group, so it runs as "
                f"a single process and averages nothing, but a world of "
                f"{dist.get_world_size()} ranks exists now: the replicas would train apart. "
                f"Build the {name} after init_process_group (or, for deliberately "
                "independent single-rank optimizers, pass a process_group of one rank)"
            )

    def _grad(self, p: torch.Tensor) -> torch.Tensor:
        # [Note: missing gradients] Every trainable parameter takes part in every step, so all
        # ranks issue identical collectives. A parameter with no gradient on this rank (unused
        # on its data) counts as a zero gradient, which is the correct data-parallel average.
        if p.grad is None or self._amp_zero_grads:  # see [Note: GradScaler]
            return torch.zeros_like(p)
        if p.grad.is_sparse:
            raise TypeError(f"{type(self).__name__} does not support sparse gradients")
        if self._amp_inv_scale is not None:
            return p.grad * self._amp_inv_scale
        return p.grad

    # ----------------------------------------------------------------------- mixed precision
    # [Note: GradScaler] torch.amp.GradScaler checks each rank's *local* gradients for Inf/NaN
    # and, for an ordinary optimizer, skips step() on the ranks that found one. These
    # optimizers communicate inside step(), so one rank skipping while the others step left the
    # others waiting in a collective (1-bit Adam: a hang until the group's timeout) or paired
    # one rank's step k with another's step k + 1 (0/1 Adam: the step counters and schedules
    # silently drifted apart, until a collective of another size aborted). So they declare
    # ``_step_supports_amp_scaling``: the scaler then always calls step() and leaves
    # ``grad_scale`` (None once ``scaler.unscale_(opt)`` was called) and ``found_inf`` (this
    # rank's verdict) on the optimizer. A step that communicates first agrees on the verdict
    # with one all-reduce of one number (MAX over the group; only while a scaler is in use)
    # and is skipped on every rank when any rank found Inf/NaN, exactly as torch skips it in
    # one process (no counter advances, nothing changes). A 0/1 Adam local step communicates
    # nothing and has nothing to agree on: a rank that found Inf/NaN takes it with zero
    # gradients (as for a missing gradient), so every rank's counters, sync anchor decay and
    # lr sum stay the same. Gradients are divided by ``grad_scale`` as they are read
    # (``p.grad`` is not modified, as in torch's fused Adam). On HSDP the replicate group is
    # not all of the model's ranks, but GradScaler's check of DTensor gradients is a DTensor op
    # that already reduces ``found_inf`` over the parameters' mesh (the node's shard group), so
    # agreeing in the replicate group gives every rank of the model one verdict (checked in
    # tests/zeropp/test_hsdp_optim.py with an Inf in one rank's shard).
    _step_supports_amp_scaling = True
    _amp_inv_scale: torch.Tensor | None = None
    _amp_zero_grads = False

    def _amp_begin(self, communicates: bool, tag: str) -> bool:
        """Read what a ``GradScaler`` left on the optimizer for this step; returns whether the
        step is skipped (on every rank). See [Note: GradScaler]."""
        scale = getattr(self, "grad_scale", None)
        found = getattr(self, "found_inf", None)
        self._amp_inv_scale = None
        self._amp_zero_grads = False
        if scale is not None:
            self._amp_inv_scale = torch.as_tensor(scale).double().reciprocal().float()
        if found is None:
            return False
        flag = torch.as_tensor(found).detach().float().reshape(-1)[:1].clone()
        if not communicates:
            self._amp_zero_grads = bool(flag.item() > 0)
            return False
        if self.world_size > 1:
            self._record("all_reduce", flag.numel() * flag.element_size(), tag)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        return bool(flag.item() > 0)

    def _amp_end(self) -> None:
        self._amp_inv_scale = None
        self._amp_zero_grads = False

    def set_zero_mask(self, param: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Declare the elements of ``param`` whose gradient is structurally zero
        (``mask == False``), e.g. padding rows of an embedding.

        1-bit compression cannot send 0: without a mask, these elements would receive
        ``+-scale`` updates. Masked elements are excluded from compression scales and error
        buffers and their averaged gradient / momentum is exactly 0. Must be the same on every
        rank; kept in ``state_dict()``. ``None`` removes the mask. On HSDP ``param`` is the
        model's DTensor and ``mask`` its local shard's mask (or a DTensor of it).
        """
        trainable = self._trainable()
        if self._shards is not None:  # the model's DTensor (or its local shard)
            with contextlib.suppress(KeyError):  # not ours: refused below
                param = self._local(param)
            dtensor = _dtensor_type()
            if mask is not None and dtensor is not None and isinstance(mask, dtensor):
                mask = mask.to_local()
        if not any(param is p for _, p in trainable):
            raise ValueError("set_zero_mask: param is not a trainable parameter of this optimizer")
        key = self._key(param)
        state = self.state.get(key, {})  # (not the defaultdict's: no empty entry made)
        self._pending_masks.pop(key, None)
        if mask is None:
            state.pop("zero_mask", None)
            return
        if mask.shape != param.shape:
            raise ValueError(
                f"zero mask shape {tuple(mask.shape)} must equal the parameter shape "
                f"{tuple(param.shape)}"
            )
        mask = mask.detach().to(device=param.device, dtype=torch.bool).clone()
        if "exp_avg" in state:
            state["zero_mask"] = mask
        else:
            # [Note: zero masks through DCP] kept aside until the parameter's state is made (its
            # first step): a state holding only the mask would make optimizer.state non-empty,
            # and torch.distributed.checkpoint then skips the zero-lr step that builds the
            # template it loads into (no m, v or error buffers in it: none loaded)
            state.pop("zero_mask", None)
            self._pending_masks[key] = mask

    def _mask(self, p: torch.Tensor) -> torch.Tensor | None:
        mask = self._state(p).get("zero_mask")
        # load_state_dict casts floating state to the param dtype; a mask is stored as bool.
        return None if mask is None else mask.to(torch.bool)

    # ----------------------------------------------------------------------- communication
    def _record(self, op: str, tensor_bytes: int, tag: str) -> None:
        ledger = active_ledger()
        if ledger is not None:
            ledger.record(op, group_ranks=self._group_ranks, tensor_bytes=tensor_bytes, tag=tag)

    def _check_replicated(self, params: list[torch.Tensor], *, values_agree: bool = True) -> None:
        """Once, on the first step: every rank must hold the same parameter layout and, when
        ``values_agree`` (not resuming mid local interval), the same values, over the same
        group; otherwise replicas silently drift apart.

        The values are checked at the first step whose learning rates are not all zero: a
        zero-lr step moves no parameter, so the check is as good one step later, and the
        zero-lr step ``torch.distributed.checkpoint.state_dict`` runs on a fresh optimizer to
        build its load template (``get_state_dict`` before ``dcp.load``) ran it on parameters
        the checkpoint was about to overwrite: a model built with a per-rank seed was refused
        as "initial parameters differ across ranks", naming a broadcast a resume does not
        need. A warm-up that starts at lr 0 is checked at its second step alike."""
        if self._replication_checked:
            return
        moves = any(float(g["lr"]) != 0.0 for g in self.param_groups)
        self._replication_checked = moves or not values_agree
        if self.world_size == 1:  # one replica agrees with itself
            return
        layout = 0
        for p in params:
            for d in (*p.shape, -1):
                layout = (layout * 1_000_003 + d + 7) % (2**31 - 1)
        ranks_hash = 0
        for r in self._group_ranks:
            ranks_hash = (ranks_hash * 1_000_003 + r + 1) % (2**31 - 1)
        with torch.no_grad():
            values = sum((p.double().sum() for p in params), torch.zeros((), dtype=torch.float64))
            squares = sum(
                (p.double().square().sum() for p in params), torch.zeros((), dtype=torch.float64)
            )
        mine = torch.tensor(
            [len(params), layout, self.world_size, ranks_hash, float(values), float(squares)],
            dtype=torch.float64,
            device=params[0].device,
        )
        gathered = torch.empty(
            self.world_size, mine.numel(), dtype=torch.float64, device=mine.device
        )
        self._record("all_gather", gathered.numel() * 8, f"{self._algorithm}/replication_check")
        _all_gather_single(gathered, mine, self.process_group)
        name = type(self).__name__
        if not bool((gathered[:, :4] == mine[:4]).all()):
            raise RuntimeError(
                f"{name}: ranks disagree on the parameters or the process group "
                f"(per rank [num params, layout hash, group size, group hash]: "
                f"{gathered[:, :4].tolist()}); build the same model and pass the same "
                "process_group on every rank (a 1-bit optimizer replicates every parameter: "
                "ZeroRedundancyOptimizer, which hands each rank different ones, cannot wrap it)"
            )
        if values_agree and moves and not bool((gathered[:, 4:] == mine[4:]).all()):
            raise RuntimeError(
                f"{name}: initial parameters differ across ranks (sums {gathered[:, 4].tolist()})"
                "; broadcast them from one rank before training, e.g. "
                "`for p in model.parameters(): dist.broadcast(p.data, src=0)`"
            )

    def _all_reduce_mean(self, tensors: list[torch.Tensor], tag: str) -> list[torch.Tensor]:
        """Full-precision (fp32) average: one flat all-reduce for all tensors."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if self.world_size > 1:  # the mean over one rank is its own value
            # [Note: same tensors on every rank] in qshard.comm.compressed: once per layout.
            _check_same_layout(
                tensors, [None] * len(tensors), self.process_group, self._group_ranks, tag
            )
            self._record("all_reduce", flat.numel() * flat.element_size(), tag)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
            flat.div_(self.world_size)
        return [
            chunk.view_as(t) for chunk, t in zip(flat.split([t.numel() for t in tensors]), tensors)
        ]

    def _error_buffers(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self._state(p)
        if "worker_error" not in state:
            state["worker_error"], state["server_error"] = self._fresh_error_buffers(p)
        return state["worker_error"], state["server_error"]

    def _compressed_mean(
        self,
        params: list[torch.Tensor],
        tensors: list[torch.Tensor],
        tag: str,
        *,
        in_place: bool = False,
    ) -> list[torch.Tensor]:
        """1-bit average with this optimizer's per-parameter error buffers (two collectives);
        ``in_place``: into ``tensors`` themselves (no bucket-sized allocation on a CPU)."""
        errors = [self._error_buffers(p) for p in params]
        direct = in_place and all(t.is_contiguous() for t in tensors)
        averaged = compressed_all_reduce(
            tensors,
            [e[0] for e in errors],
            [e[1] for e in errors],
            masks=[self._mask(p) for p in params],
            group=self.process_group,
            tag=tag,
            out=tensors if direct else None,
        )
        if in_place and not direct:  # a state of other strides (e.g. loaded so)
            for t, avg in zip(tensors, averaged):
                t.copy_(avg)
            return tensors
        return averaged

    def _reset_error_buffers(self) -> None:
        for state in self.state.values():
            for key in _ERROR_KEYS:
                if key in state:
                    state[key].zero_()

    # ----------------------------------------------------------------------- state
    @property
    def comm_stats(self) -> dict[str, int]:
        """Steps so far by kind of communication: ``full_precision``, ``compressed`` and
        ``local`` (no communication at all); kept in the state_dict."""
        return {k: self._extra[k] for k in ("full_precision", "compressed", "local")}

    @property
    def in_sync(self) -> bool:
        """True when every rank holds the same parameters and momenta (0/1 Adam overrides)."""
        return True

    def synchronize(self) -> bool:
        """Make the replicas identical again; returns whether it communicated. 1-bit Adam
        averages at every step, so its replicas are always in sync and this returns False
        (0/1 Adam overrides it): code written for either optimizer calls it unchanged (it
        raised ``AttributeError`` on OneBitAdam)."""
        return False
