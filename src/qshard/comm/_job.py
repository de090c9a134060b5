"""Objects made once per job: process groups and meshes every caller of the same ranks shares.

An entry belongs to one default process group: after ``destroy_process_group`` and a new
``init_process_group`` (tests do that) the old entries are dropped, not reused (their groups
are gone). Building an entry is usually collective (``new_group``, ``init_device_mesh``): every
rank asks for the same keys at the same calls, so every rank builds and finds them alike.
Used by :class:`qshard.comm.Topology` ([Note: one set of groups per job]) and by
:mod:`qshard.zeropp._meshes` ([Note: one secondary mesh per job]).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["per_job"]

# key -> (the default group it was built under, the cached object)
_CACHE: dict[tuple, tuple[Any, Any]] = {}
_LOCK = threading.Lock()


def per_job(key: tuple, build: Callable[[], Any]) -> Any:
    """The object cached under ``key`` for the current default process group, built by
    ``build()`` on first use."""
    world = dist.group.WORLD
    with _LOCK:
        for k in [k for k, (w, _) in _CACHE.items() if w is not world]:
            del _CACHE[k]  # built under a destroyed default group: its groups are gone
        hit = _CACHE.get(key)
    if hit is not None:
        return hit[1]
    value = build()
    with _LOCK:
        _CACHE[key] = (world, value)
    return value
