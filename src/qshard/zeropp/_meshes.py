"""The device meshes shard() reuses: hpZ's secondary (post-forward) mesh and the default HSDP mesh.

[Note: one secondary mesh per job] FSDP2 builds the post-forward mesh of an integer
``reshard_after_forward`` (hpZ's node-sized secondary shard) inside every ``fully_shard`` call:
a new ``DeviceMesh`` and with it a new process group per mesh dim, per FSDP unit. shard() wraps
every block and the root, so a model of L blocks got 2 (L + 1) new groups per rank, and every
further shard() as many again (measured: 10 groups and 30 gloo threads per rank for a 4-block
GPT; with NCCL each would be its own communicator, with its own buffers, for the same node's
ranks). The groups are identical, row ``n`` of ``mesh.view(-1, ranks_per_node)`` is node ``n``,
so :func:`shared_post_forward_meshes` hands every unit of every shard() call the mesh info
built by the first one: two groups per rank per job. FSDP2 reads it only as data (its shard
group, size and rank), as it does when ``reshard_after_forward=True`` shares one mesh info.

The cache (:func:`qshard.comm._job.per_job`) is keyed by the mesh's ranks, the device type and
the resharding size, and is valid for one default process group: after
``destroy_process_group`` and a new ``init_process_group`` (tests do that), stale entries are
dropped, not reused.

The hook is FSDP2's private ``_get_post_forward_mesh_info`` (torch 2.9-2.14 have it, with this
signature). If a torch build lacks it, shard() runs FSDP2 unchanged: correct, with one mesh per
unit as before.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from qshard.comm._job import per_job

__all__ = ["cached_hsdp_mesh", "shared_post_forward_meshes"]

_FULLY_SHARD = "torch.distributed.fsdp._fully_shard._fully_shard"
_HOOK = "_get_post_forward_mesh_info"

# (the per-job cache, shared with Topology's process groups)
_cached = per_job


def cached_hsdp_mesh(device_type: str, num_nodes: int, ranks_per_node: int, dims) -> DeviceMesh:
    """The ``(num_nodes, ranks_per_node)`` mesh with dim names ``dims``, built once per default
    group (collective on first use: every rank must call it at the same point)."""
    return _cached(
        ("hsdp", device_type, num_nodes, ranks_per_node, tuple(dims)),
        lambda: init_device_mesh(
            device_type, (num_nodes, ranks_per_node), mesh_dim_names=tuple(dims)
        ),
    )


@contextlib.contextmanager
def shared_post_forward_meshes() -> Iterator[bool]:
    """Inside the block, ``fully_shard(..., reshard_after_forward=<int>)`` reuses one
    post-forward mesh info per (mesh ranks, device type, size); see [Note: one secondary mesh
    per job]. Yields whether the hook could be installed."""
    try:
        module = importlib.import_module(_FULLY_SHARD)
        original = getattr(module, _HOOK)
    except (ImportError, AttributeError):
        yield False
        return

    def shared(reshard_after_forward: Any, mesh_info: Any) -> Any:
        size = reshard_after_forward
        if isinstance(size, bool) or not isinstance(size, int):
            return original(reshard_after_forward, mesh_info)
        try:
            mesh, whole = mesh_info.mesh, mesh_info.shard_mesh_size
            key = ("post_forward", mesh.device_type, tuple(mesh.mesh.flatten().tolist()), size)
        except AttributeError:  # a mesh info this hook does not know: FSDP2's own path
            return original(reshard_after_forward, mesh_info)
        if not 1 < size < whole or whole % size:
            # FSDP2 answers these itself: the unit's own mesh info, None, or its error
            return original(reshard_after_forward, mesh_info)
        return _cached(key, lambda: original(reshard_after_forward, mesh_info))

    setattr(module, _HOOK, shared)
    try:
        yield True
    finally:
        setattr(module, _HOOK, original)
