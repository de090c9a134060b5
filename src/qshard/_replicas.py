"""Who keeps the node replicas of HSDP parameters in step: the record ``qshard.zeropp.shard()``
writes and the optimizers read (a module of its own, so that neither package imports the other).

[Note: replica sync] On HSDP every node holds a replica of the model, sharded over its ranks.
The replicas stay equal only if every update is the same on every node, i.e. if something
averages the gradients (or the updates) across nodes. ``shard()`` records, per FSDP unit, which
of three owners does it:

* nothing recorded: FSDP2's own 2-D HSDP (its replicate all-reduce), or no HSDP at all;
* :data:`REDUCED`: shard()'s :class:`~qshard.zeropp.ReplicateAllReduce` hook (``replicate_bits``
  / a 16-bit ``wire_dtype``) averages the gradient shards across nodes, so any optimizer keeps
  the replicas equal; a 1-bit optimizer would sync them a second time (it refuses them);
* :data:`OPTIMIZER`: ``replicate_reduce=False``; no gradient crosses nodes and only an optimizer
  that syncs the replicas itself (``OneBitAdam``, ``ZeroOneAdam``) may step these parameters.
  Such an optimizer *claims* them when it is built (:func:`claim`). Any other optimizer steps
  each node on its own node's gradients and the replicas drift apart without an error.

The :data:`OPTIMIZER` parameters are guarded twice:

* qshard's block-wise optimizers (8-bit / 4-bit) refuse them when given them
  (:func:`refuse_unsynced`);
* every other update (``torch.optim``, a hand-written loop) cannot be seen when it is built, so
  ``shard()`` installs a :class:`SyncGuard` as the all-reduce hook of each such unit (FSDP2
  calls it on the unit's reduce-scattered gradient shard, where HSDP's replicate all-reduce
  would run). At the unit's first gradient reduction it checks that a live claim covers every
  trainable parameter of the unit and raises otherwise, before any optimizer step; then it
  removes itself, so later steps cost nothing. The first reduction is the first backward with
  gradient sync on (a no-sync backward of gradient accumulation reduces nothing and is not
  checked). So the 1-bit optimizer must exist before that backward; one built after it is
  refused, naming that fix. When a claiming optimizer is garbage collected, the guards of every
  :data:`OPTIMIZER` unit are installed again, so an optimizer built in its place is checked at
  the next reduction.

The record is kept per unit (weakly) and a unit's parameters are read from FSDP2 when they are
needed, so a parameter that FSDP2 re-registers after ``shard()`` (``to_empty()`` on a
meta-device model) is still recognised. It is written once per unit: FSDP2 refuses to wrap a
module twice, so a model cannot be sharded a second time.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from qshard._fsdp import fsdp_param_groups

__all__ = [
    "OPTIMIZER",
    "REDUCED",
    "SyncGuard",
    "claim",
    "record_units",
    "refuse_unsynced",
    "replica_sync",
]

REDUCED = "reduced"
"""The unit's gradients are averaged across nodes by shard()'s replicate all-reduce hook."""

OPTIMIZER = "optimizer"
"""No gradient of the unit crosses nodes: an optimizer must sync the replicas itself."""

_SYNCING_OPTIMIZERS = "qshard.optim.OneBitAdam / qshard.optim.ZeroOneAdam"
_FIX = (
    "Shard with ZeroPPConfig(hsdp=True) and replicate_reduce=True (the default: the gradients "
    "are averaged across nodes; replicate_bits=8 or 4 compresses that) to train with this "
    f"optimizer, or step these parameters with {_SYNCING_OPTIMIZERS}"
)

# unit -> (kind, its guard or None); weak, so a dropped model leaves no trace
_units: weakref.WeakKeyDictionary[nn.Module, tuple[str, SyncGuard | None]] = (
    weakref.WeakKeyDictionary()
)
# claiming optimizer -> the parameters it syncs
_claims: weakref.WeakKeyDictionary[Any, tuple[torch.Tensor, ...]] = weakref.WeakKeyDictionary()


def _unit_params(unit: nn.Module) -> list[torch.Tensor]:
    """The sharded parameters FSDP2 manages for ``unit`` (not those of units nested in it)."""
    groups = fsdp_param_groups(unit)
    if groups is not None:
        return [fp.sharded_param for g in groups for fp in g.fsdp_params]
    # FSDP2's internals differ: the unit's own registered parameters
    params, stack = [], [unit]
    while stack:
        module = stack.pop()
        params.extend(module.parameters(recurse=False))
        stack.extend(c for c in module.children() if c not in _units)
    return params


def record_units(units: Iterable[nn.Module], kind: str) -> None:
    """Record who syncs the replicas of ``units`` (:data:`REDUCED` or :data:`OPTIMIZER`). For
    :data:`OPTIMIZER`, install each unit's :class:`SyncGuard` as its all-reduce hook (the unit
    must have no other)."""
    if kind not in (REDUCED, OPTIMIZER):
        raise ValueError(f"kind must be {REDUCED!r} or {OPTIMIZER!r}; got {kind!r}")
    for unit in units:
        guard = SyncGuard(unit) if kind == OPTIMIZER else None
        _units[unit] = (kind, guard)
        if guard is not None:
            guard.arm()


def replica_sync(params: Iterable[torch.Tensor]) -> dict[int, str]:
    """``{id(p): kind}`` for those of ``params`` that a recorded unit manages."""
    wanted = {id(p) for p in params}
    found: dict[int, str] = {}
    for unit, (kind, _) in list(_units.items()):
        for p in _unit_params(unit):
            if id(p) in wanted:
                found[id(p)] = kind
    return found


def refuse_unsynced(params: Iterable[torch.Tensor], name: str) -> None:
    """Raise if any of ``params`` is an :data:`OPTIMIZER` parameter: optimizer ``name`` does
    not sync replicas. Cheap when nothing is recorded (no HSDP with replicate_reduce=False)."""
    if not _units:
        return
    params = list(params)
    kinds = replica_sync(params)
    unsynced = [p for p in params if kinds.get(id(p)) == OPTIMIZER]
    if unsynced:
        raise TypeError(
            f"{name} got {len(unsynced)} HSDP parameter(s) (shapes "
            f"{[tuple(p.shape) for p in unsynced[:4]]}) sharded with replicate_reduce=False: no "
            f"gradient of theirs crosses nodes, and {name} does not sync the node replicas, so "
            f"each node would train its own copy and the replicas would drift apart. {_FIX}"
        )


def claim(owner: object, params: Iterable[torch.Tensor]) -> None:
    """``owner`` (an optimizer that syncs the replicas of ``params`` across nodes) covers them
    for as long as it lives; when it is collected, every guard is installed again."""
    if owner in _claims:
        _claims[owner] = (*_claims[owner], *params)
        return
    _claims[owner] = tuple(params)
    weakref.finalize(owner, _rearm).atexit = False  # nothing to guard once the job ends


def _rearm() -> None:
    for _, guard in list(_units.values()):
        if guard is not None:
            guard.arm()


class SyncGuard:
    """The one-shot all-reduce hook of a :data:`OPTIMIZER` unit: see [Note: replica sync]."""

    def __init__(self, unit: nn.Module) -> None:
        self._unit = weakref.ref(unit)

    def arm(self) -> None:
        """Install this guard as its unit's all-reduce hook (checked at the next reduction)."""
        unit = self._unit()
        if unit is not None and _units.get(unit, (None, None))[1] is self:
            unit.set_all_reduce_hook(self)  # type: ignore[operator]

    def __call__(self, output: torch.Tensor) -> None:
        unit = self._unit()
        if unit is None:
            return
        claimed = {id(p) for params in list(_claims.values()) for p in params}
        missing = [p for p in _unit_params(unit) if p.requires_grad and id(p) not in claimed]
        if missing:
            names = {id(p): n for n, p in unit.named_parameters()}
            shown = [names.get(id(p), str(tuple(p.shape))) for p in missing[:4]]
            raise RuntimeError(
                f"HSDP replicas would drift apart: {len(missing)} trainable parameter(s) of "
                f"{type(unit).__name__} ({', '.join(shown)}{', ...' if len(missing) > 4 else ''})"
                " were sharded with replicate_reduce=False, so no gradient of theirs crosses "
                f"nodes, and no optimizer that syncs the node replicas ({_SYNCING_OPTIMIZERS}) was "
                "built over them before this backward (torch.optim and qshard's 8-bit / 4-bit "
                "optimizers step each node on its own gradients). "
                f"{_FIX}, built over every trainable parameter before the first backward"
            )
        unit.set_all_reduce_hook(None)  # type: ignore[operator, arg-type]  # checked: no cost now
