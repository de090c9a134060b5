"""Topology: numbering, validation, environment, and the process groups on a real gloo world."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist

from qshard.comm import Topology
from qshard.testing import run_world

_LAUNCH_VARIABLES = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_WORLD_SIZE",
    "LOCAL_RANK",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
)


def test_numbering_is_node_major():
    t = Topology(world_size=6, ranks_per_node=3, rank=4)
    assert t.num_nodes == 2 and t.node == 1 and t.local_rank == 1
    assert [t.node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [t.local_rank_of(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert t.node_ranks(1) == [3, 4, 5]
    assert t.peer_ranks(2) == [2, 5]
    assert t.global_rank(1, 2) == 5
    assert t.is_intra_node([3, 5]) and not t.is_intra_node([2, 3])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 6, "ranks_per_node": 4}, "got world 6, ranks_per_node 4"),
        ({"world_size": 0, "ranks_per_node": 1}, "world_size"),
        ({"world_size": 4, "ranks_per_node": 0}, "ranks_per_node"),
        ({"world_size": 4, "ranks_per_node": 2, "rank": 4}, "rank"),
        ({"world_size": True, "ranks_per_node": 1}, "world_size"),  # a bool is not a count
        ({"world_size": 2, "ranks_per_node": True}, "ranks_per_node"),
        # a float rank gave float nodes (node 0.0 for rank 1.5), a str a bare TypeError
        ({"world_size": 4, "ranks_per_node": 2, "rank": 1.5}, "rank must be an int"),
        ({"world_size": 4, "ranks_per_node": 2, "rank": "1"}, "rank must be an int"),
        ({"world_size": 4, "ranks_per_node": 2, "rank": True}, "rank must be an int"),
    ],
)
def test_validation_names_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Topology(**kwargs)


def test_from_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    t = Topology.from_env()
    assert (t.world_size, t.ranks_per_node, t.rank, t.node) == (8, 4, 5, 1)
    assert Topology.from_env(ranks_per_node=2).num_nodes == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        Topology.from_env()


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' must be a whole number"),
        ({"WORLD_SIZE": ""}, "WORLD_SIZE='' must be a whole number"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be a whole number >= 1"),
        (
            {"WORLD_SIZE": "-2", "LOCAL_WORLD_SIZE": "1"},
            "WORLD_SIZE='-2' must be a whole number >= 1",
        ),
        ({"WORLD_SIZE": "4", "RANK": "x", "LOCAL_WORLD_SIZE": "2"}, "RANK='x'"),
        (
            {"WORLD_SIZE": "4", "RANK": "-1", "LOCAL_WORLD_SIZE": "2"},
            "RANK='-1' must be a whole number >= 0",
        ),
        ({"WORLD_SIZE": "4", "RANK": "7", "LOCAL_WORLD_SIZE": "2"}, "RANK=7 is not below WORLD_"),
        ({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_WORLD_SIZE": "2.0"}, "LOCAL_WORLD_SIZE='2.0'"),
        ({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE='0' must"),
        ({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3 does not"),
        ({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE=8 does not"),
        (
            {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"},
            "LOCAL_RANK=0 does not match rank 1",
        ),
        (
            {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "one"},
            "LOCAL_RANK='one'",
        ),
        # torchrun with nodes of 2, 1 and 1 ranks: each LOCAL_WORLD_SIZE divides the world, so
        # every rank built its own topology (then mismatched groups); see [Note: uneven nodes]
        (
            {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "3"},
            "GROUP_WORLD_SIZE=3 nodes of LOCAL_WORLD_SIZE=2 ranks are 6 ranks, not the world's 4",
        ),
        (
            {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "3"},
            "same --nproc-per-node on every node",
        ),
        (
            {"WORLD_SIZE": "6", "RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"},
            "GROUP_RANK=1 does not match rank 1",
        ),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "-1"}, "GROUP_RANK='-1'"),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "x"}, "GROUP_WORLD_"),
    ],
)
def test_from_env_names_the_bad_variable(monkeypatch, env, match):
    """Odd or inconsistent launch variables used to fail with int()'s bare message, with the
    wrong cause (WORLD_SIZE=0 blamed LOCAL_WORLD_SIZE) or not at all (a LOCAL_RANK that
    contradicts node-major numbering gave a silently wrong node; uneven nodes gave each node
    its own topology)."""
    for name in _LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        Topology.from_env()


def test_from_env_accepts_torchrun_values(monkeypatch):
    for rank in range(6):
        monkeypatch.setenv("WORLD_SIZE", " 6 ")
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
        monkeypatch.setenv("LOCAL_RANK", str(rank % 3))
        monkeypatch.setenv("GROUP_RANK", str(rank // 3))
        monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
        t = Topology.from_env()
        assert (t.node, t.local_rank) == (rank // 3, rank % 3)
    # An explicit ranks_per_node (emulated nodes) does not read LOCAL_* or GROUP_*.
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert Topology.from_env(ranks_per_node=2).node == 2


def _groups_world(rank: int, world_size: int, rpn: int) -> list:
    # A topology of another rank (as one built before init_process_group: rank 0 everywhere)
    # handed each process node 0's group, which ranks 2 and 3 are not in; refused on every
    # rank before any collective.
    other = Topology(world_size=world_size, ranks_per_node=rpn, rank=(rank + 1) % world_size)
    with pytest.raises(RuntimeError, match="Build it after init_process_group"):
        other.init_groups()
    topo = Topology.from_env(ranks_per_node=rpn)
    topo.init_groups()
    # A deep copy describes the same ranks and shares the groups (a process group cannot be
    # copied: deepcopy failed with "cannot pickle ProcessGroup").
    twin = copy.deepcopy(topo)
    assert twin == topo and twin.intra_node_group is topo.intra_node_group
    assert twin.inter_node_group is topo.inter_node_group
    # Pickled, it is its three numbers (pickle.dumps failed on its process groups): the copy
    # describes the same rank and has made no group yet
    thawed = pickle.loads(pickle.dumps(topo))
    assert thawed == topo and thawed.rank == rank and not thawed._groups
    # [Note: one set of groups per job]: another topology of the job (a new
    # Topology.from_env() per shard()) gets the same groups; each made its own, never freed
    made = len(dist.distributed_c10d._world.pg_map)
    again = Topology.from_env(ranks_per_node=rpn)
    again.init_groups()
    assert again.intra_node_group is topo.intra_node_group
    assert again.inter_node_group is topo.inter_node_group
    assert again.twin_group("intra") is topo.twin_group("intra")
    assert len(dist.distributed_c10d._world.pg_map) == made
    intra = dist.get_process_group_ranks(topo.intra_node_group)
    inter = dist.get_process_group_ranks(topo.inter_node_group)
    # The groups work: a sum over the node and over the peers.
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=topo.intra_node_group)
    y = torch.tensor([float(rank)])
    dist.all_reduce(y, group=topo.inter_node_group)
    return [intra, inter, x.item(), y.item()]


def test_groups_on_gloo_2x2():
    out = run_world(_groups_world, 4, args=(2,), timeout_s=120)
    assert out[0] == [[0, 1], [0, 2], 1.0, 2.0]
    assert out[3] == [[2, 3], [1, 3], 5.0, 4.0]


def test_a_topology_kept_across_a_new_init_uses_the_new_jobs_groups(tmp_path):
    # A Topology kept across destroy_process_group / init_process_group (a notebook, a
    # module-scoped fixture) handed out the old job's groups: the first collective failed with
    # "Process group ... is not initialized in the world group map".
    def init(name: str) -> None:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path / name}", rank=0, world_size=1
        )

    init("store1")
    try:
        topo = Topology(world_size=1, ranks_per_node=1)
        old = topo.intra_node_group
        # the world size is checked before the rank: it blamed the rank on some ranks
        with pytest.raises(ValueError, match="world_size 2 differs"):
            Topology(world_size=2, ranks_per_node=1, rank=2)
    finally:
        dist.destroy_process_group()
    init("store2")
    try:
        new = topo.intra_node_group
        assert new is not old
        x = torch.ones(1)
        dist.all_reduce(x, group=new)
        assert x.item() == 1.0 and topo.twin_group("intra") is topo.twin_group("intra")
    finally:
        dist.destroy_process_group()
