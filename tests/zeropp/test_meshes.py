"""qshard.zeropp._meshes: the mesh cache lives exactly as long as the default process group.

The multi-rank side (every hpZ unit of every shard() call shares one secondary mesh, and
training stays bit-identical to FSDP2's) is checked in test_training.py.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from qshard.comm import _job
from qshard.zeropp import _meshes


def _init(tmp_path, name: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / name}", rank=0, world_size=1)


def test_cache_is_per_default_group(tmp_path):
    built = []

    def build():
        built.append(object())
        return built[-1]

    _init(tmp_path, "store1")
    try:
        a = _meshes._cached(("test",), build)
        assert _meshes._cached(("test",), build) is a  # same job: reused, built once
        assert len(built) == 1
    finally:
        dist.destroy_process_group()
    _init(tmp_path, "store2")
    try:
        b = _meshes._cached(("test",), build)  # a new job: the old entry is dropped
        assert b is not a and len(built) == 2
        assert all(w is dist.group.WORLD for w, _ in _job._CACHE.values())
    finally:
        dist.destroy_process_group()


def test_hook_is_restored_and_delegates():
    module = importlib.import_module(_meshes._FULLY_SHARD)
    original = getattr(module, _meshes._HOOK)
    with _meshes.shared_post_forward_meshes() as installed:
        assert installed
        hook = getattr(module, _meshes._HOOK)
        assert hook is not original
        # bools, the whole shard group and invalid sizes go to FSDP2's own function: its
        # answers (None, the unit's own mesh info) and its errors
        info = SimpleNamespace(
            shard_mesh_size=4, mesh=SimpleNamespace(device_type="cpu", mesh=torch.arange(4))
        )
        assert hook(False, info) is None
        assert hook(True, info) is info
        assert hook(4, info) is info
        with pytest.raises(ValueError, match="factor of 4"):
            hook(3, info)
    assert getattr(module, _meshes._HOOK) is original
