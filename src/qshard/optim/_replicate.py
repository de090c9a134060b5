"""The data-parallel 1-bit optimizers on HSDP-sharded parameters: which DTensors they accept,
their replicate group, and the local shards they step on.

[Note: 1-bit optimizers on HSDP] On HSDP each node holds a full copy of the model, sharded over
its ranks; rank ``(node n, local rank d)`` holds shard ``d`` of every parameter, as does local
rank ``d`` of every other node. So 1-bit Adam / 0/1 Adam run unchanged on the local shards, as
if the model were replicated over the *replicate group* (one rank per node, same local rank):
the shard is the replicated parameter, the node-averaged reduce-scattered gradient is the local
gradient, and the 1-bit sync crosses nodes. The optimizer finds that group from the
parameter's own mesh; no argument is needed.

The parameters must come from HSDP whose inter-node gradient all-reduce is off:
``shard(..., config=ZeroPPConfig(hsdp=True, replicate_reduce=False))``, i.e. FSDP2 over the
node-sized ``mesh["shard"]`` of a 2-D ``("replicate", "shard")`` mesh (the DTensors' mesh is
that 1-D slice; its root mesh names both dims). FSDP2's own 2-D HSDP cannot switch its
all-reduce off and still produce gradients in torch 2.13 (see [Note: HSDP through the
all-reduce hook] in :mod:`qshard.zeropp.all_reduce`), so its parameters are refused, as are
those of a compressed replicate reduction (``replicate_bits`` / ``wire_dtype``: the same 1-D
DTensors, recorded by ``shard()``, whose gradients cross nodes already) and ZeRO-3 parameters
(sharded across nodes: no rank holds a replica to sync). An optimizer built here claims its
DTensors (:func:`qshard._replicas.claim`): ``shard()``'s guard refuses a backward over
``replicate_reduce=False`` parameters that no such optimizer claims ([Note: replica sync]).

The optimizer's ``param_groups`` and ``state`` are keyed by the model's DTensors, as torch.optim's
are (so ``torch.distributed.checkpoint.state_dict`` maps them to the model's names); it steps
on their *local tensors* (views of FSDP2's sharded storage, so an in-place update is the
DTensor's update), copying each DTensor's local gradient onto them before a step. The state
values are plain local tensors; ``state_dict()`` presents the shard-shaped ones as DTensors of
the parameter's layout (see [Note: DCP checkpoints] in :mod:`qshard.optim._onebit`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from qshard import _replicas

__all__: list[str] = []

#: The dims of an HSDP mesh (``qshard.zeropp.HSDP_MESH_DIMS``; not imported, to keep optim
#: independent of the FSDP plug-ins).
_HSDP_DIMS = ("replicate", "shard")
_FIX = "shard(model, topology=..., config=ZeroPPConfig(hsdp=True, replicate_reduce=False))"


def _dtensor_type():
    # No DTensor can exist unless its module was imported; importing it costs seconds.
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def _root_mesh(mesh):
    get_root = getattr(mesh, "_get_root_mesh", None)
    if get_root is not None:
        return get_root()
    from torch.distributed.device_mesh import _mesh_resources  # older torch

    return _mesh_resources.get_root_mesh(mesh)


def _replicate_group(p, name: str, reduced: bool) -> dist.ProcessGroup:
    mesh, placements = p.device_mesh, p.placements
    dims = tuple(mesh.mesh_dim_names or ())
    if dims == _HSDP_DIMS:
        raise TypeError(
            f"{name}: these parameters come from FSDP2's own HSDP (placements {placements} on "
            f"{mesh}), whose inter-node gradient all-reduce stays on, so {name} would not own "
            f"the inter-node sync; shard with {_FIX}"
        )
    if mesh.ndim != 1 or not all(pl.is_shard() for pl in placements):
        raise TypeError(
            f"{name} supports HSDP-sharded DTensors (FSDP2 over mesh['shard']); got placements "
            f"{placements} on {mesh}: shard with {_FIX}"
        )
    if reduced:  # recorded by qshard.zeropp.shard(): [Note: replica sync]
        raise TypeError(
            f"{name}: these HSDP parameters' gradients are already all-reduced across nodes "
            f"(shard() with replicate_bits or wire_dtype), so {name} would sync them a second "
            f"time instead of owning the inter-node sync; shard with {_FIX}"
        )
    root = _root_mesh(mesh)
    if root is mesh or tuple(root.mesh_dim_names or ()) != _HSDP_DIMS or dims != ("shard",):
        raise TypeError(
            f"{name} needs a replica of every parameter on other nodes, and these are ZeRO-3 "
            f"shards ({placements} on {mesh}, no replicate dim): use HSDP, {_FIX}"
        )
    return root.get_group("replicate")


class LocalShards:
    """The optimizer's view of HSDP DTensor parameters: local tensors, synced gradients."""

    def __init__(self, pairs: list[tuple[torch.Tensor, Any]]) -> None:
        self._pairs = pairs  # (local tensor the optimizer steps on, its DTensor parameter)
        self._dtensor_of = {id(local): dt for local, dt in pairs}
        self._local_of = {id(dt): local for local, dt in pairs}

    def key(self, p: torch.Tensor) -> Any:
        """The DTensor parameter (the optimizer's state key) of a local tensor or DTensor."""
        return p if id(p) in self._local_of else self._dtensor_of[id(p)]

    def local(self, p: torch.Tensor) -> torch.Tensor:
        """The local tensor stepped for a DTensor parameter (or the local tensor itself)."""
        return p if id(p) in self._dtensor_of else self._local_of[id(p)]

    def pull(self) -> None:
        """Before a step: re-point each local tensor at its DTensor's storage (should FSDP2
        have reallocated it), give it the DTensor's local gradient and its ``requires_grad``
        (a parameter frozen or unfrozen on the model after construction is frozen or unfrozen
        here too, as on replicated parameters; the optimizers step only trainable ones)."""
        with torch.no_grad():
            for local, dt in self._pairs:
                current = dt.to_local()
                if current.data_ptr() != local.data_ptr() or current.shape != local.shape:
                    local.data = current
                if local.requires_grad != dt.requires_grad:
                    local.requires_grad_(dt.requires_grad)
                local.grad = None if dt.grad is None else dt.grad.to_local()

    def dtensors(self) -> list[Any]:
        """The model's DTensor parameters these local tensors stand for."""
        return [dt for _, dt in self._pairs]

    def zero_grad(self) -> None:
        """Drop the local tensors' gradients (views of the DTensors' gradients, which
        ``Optimizer.zero_grad`` clears on the parameters themselves)."""
        for local, _ in self._pairs:
            local.grad = None


def localize(
    params: Iterable[Any], process_group: dist.ProcessGroup | None, name: str
) -> tuple[Any, dist.ProcessGroup | None, LocalShards | None]:
    """``(params, process_group, shards)`` for the optimizer: the parameters (unchanged), the
    process group (the replicate group when they are HSDP DTensors) and the
    :class:`LocalShards` of the DTensors (None without DTensors). See
    [Note: 1-bit optimizers on HSDP]."""
    if torch.is_tensor(params):  # list() split it into rows, refused as "non-leaf Tensors"
        raise TypeError(
            f"{name}: params should be an iterable of Tensors or dicts (torch.optim's rule); "
            f"got one {torch.typename(params)}: pass [param]"
        )
    params = list(params)
    dtensor = _dtensor_type()
    if params and isinstance(params[0], dict):  # lists, not iterators: read here and by torch
        params = [
            {**g, "params": [g["params"]] if torch.is_tensor(g["params"]) else list(g["params"])}
            if "params" in g
            else g
            for g in params
        ]
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    flat = [p for g in groups for p in g.get("params", [])]
    if dtensor is None or not any(isinstance(p, dtensor) for p in flat):
        return params, process_group, None
    if not all(isinstance(p, dtensor) for p in flat):
        raise TypeError(f"{name}: either every parameter is an HSDP DTensor or none is; got a mix")
    found: dict[tuple[int, ...], dist.ProcessGroup] = {}
    kinds = _replicas.replica_sync(flat)
    for p in flat:
        group = _replicate_group(p, name, kinds.get(id(p)) == _replicas.REDUCED)
        found.setdefault(tuple(dist.get_process_group_ranks(group)), group)
    if len(found) != 1:
        raise ValueError(
            f"{name}: the parameters' meshes name different replicate groups {list(found)}; "
            "shard the whole model with one HSDP mesh"
        )
    ((ranks, group),) = found.items()
    if process_group is not None and dist.get_process_group_ranks(process_group) != list(ranks):
        raise ValueError(
            f"{name}: process_group {dist.get_process_group_ranks(process_group)} is not the "
            f"parameters' replicate group {list(ranks)}; leave process_group=None on HSDP"
        )
    pairs: list[tuple[torch.Tensor, Any]] = []
    seen: set[int] = set()
    with torch.no_grad():
        for p in flat:
            if id(p) not in seen:
                seen.add(id(p))
                local = p.to_local()
                local.requires_grad_(p.requires_grad)
                pairs.append((local, p))
    return params, group, LocalShards(pairs)
