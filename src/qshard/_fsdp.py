"""The few FSDP2 internals qshard reads, in one place, across the torch versions it supports.

[Note: FSDP2 across torch versions] qshard plugs into FSDP2 through its public comm hooks, but
a few decisions need FSDP2's per-unit state: the parameters of a unit's flat all-gather (the
qwZ block layout), the unit's reduce-scatter comm (the deferred qgZ queue), and a unit's
sharded parameters (the HSDP replica sync). torch 2.13 keeps a list of parameter groups per
state (``_fsdp_param_groups``); torch 2.9 and 2.11 keep one (``_fsdp_param_group``, ``None``
for a unit without parameters). Reading only the newer name made every such decision fall back
on torch 2.11 (the H200 machines' torch): qwZ lost its exact block layout, deferred qgZ found
no queue. Likewise a ``PREMUL_SUM`` reduce op carries its factor as ``.factor`` from torch
2.13 and only in its pickled state before. Issuing a unit's all-gather early goes through the
function FSDP2's own explicit prefetch calls (``FSDPParamGroup._prefetch_unshard``), so FSDP2's
checks for the pass apply as they do to its prefetch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["fsdp_param_groups", "prefetch_unshard", "premul_sum_factor", "trainable_shard_numel"]


def fsdp_param_groups(module: Any) -> list[Any] | None:
    """The FSDP2 parameter groups of ``module`` (an ``FSDPModule``): a list, empty for a unit
    without parameters; ``None`` if this torch's FSDP2 keeps them some other way."""
    try:
        state = module._get_fsdp_state()
    except AttributeError:
        return None
    groups = getattr(state, "_fsdp_param_groups", None)
    if isinstance(groups, list):
        return groups
    if not hasattr(state, "_fsdp_param_group"):
        return None
    group = state._fsdp_param_group
    return [] if group is None else [group]


def trainable_shard_numel(module: Any) -> int | None:
    """Elements of ``module``'s gradient reduce-scatter output when every trainable parameter
    of the unit has a gradient (the sum of their padded shard sizes, what FSDP2's
    ``foreach_reduce`` makes of them); ``None`` if FSDP2's internals differ or the unit has
    no parameter group or several (each reduce-scattered on its own)."""
    groups = fsdp_param_groups(module)
    if groups is None or len(groups) != 1:  # (one reduce-scatter per group)
        return None
    total = 0
    for fsdp_param in getattr(groups[0], "fsdp_params", None) or ():
        size = getattr(fsdp_param, "padded_sharded_param_size", None)
        param = getattr(fsdp_param, "sharded_param", None)
        if size is None or param is None:
            return None
        if param.requires_grad:
            total += size.numel()
    return total


def premul_sum_factor(op: Any) -> float:
    """The factor of a ``PREMUL_SUM`` ``ReduceOp`` (``ReduceOp.PREMUL_SUM(f)`` or
    ``torch.distributed._make_nccl_premul_sum(f)``)."""
    factor = getattr(op, "factor", None)
    if factor is None:
        state = op.__getstate__()  # (RedOpType.PREMUL_SUM, factor) on torch 2.9 and 2.11
        factor = state[1]
    if not isinstance(factor, (int, float)):
        raise TypeError(
            f"PREMUL_SUM with a tensor factor ({type(factor).__name__}) is not supported; "
            "FSDP2 passes a float"
        )
    return float(factor)


def prefetch_unshard(module: Any, pass_type: str) -> bool:
    """Issue the all-gather of ``module`` (an ``FSDPModule``) as FSDP2's explicit prefetch for
    ``pass_type`` (``"forward"`` or ``"backward"``) does: in that pass's training state, so
    FSDP2's own checks apply (a unit set ``set_unshard_in_backward(False)`` stays sharded in
    backward), and a no-op for a unit already unsharded or with its gather in flight. Unlike the
    public ``FSDPModule.unshard``, it does not re-run the unit's lazy init (~15 us per call).
    Returns False, issuing nothing, where this torch's FSDP2 has no such function or keeps its
    groups some other way (FSDP2's own prefetch after its wait then issues the gather)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        return False
    prefetch = getattr(FSDPParamGroup, "_prefetch_unshard", None)
    groups = fsdp_param_groups(module)
    if prefetch is None or groups is None:
        return False
    for group in groups:
        prefetch(group, pass_type)
    return True
