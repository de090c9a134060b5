"""Duplex exchanges (qshard.comm.duplex) against torch.distributed's own collectives on gloo."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

from qshard.comm import Topology, duplex
from qshard.testing import run_world
from qshard.train.model import GPT, GPTConfig
from qshard.zeropp import ZeroPPConfig, shard


def _duplex_world(rank: int, world: int) -> dict[str, object]:
    topo = Topology(world_size=world, ranks_per_node=2)
    topo.init_groups()
    world_group, world_twin = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    trio, trio_twin = dist.new_group([0, 1, 2]), dist.new_group([0, 1, 2])
    cases = [
        ("intra", topo.intra_node_group, topo.twin_group("intra")),
        ("inter", topo.inter_node_group, topo.twin_group("inter")),
        ("world", world_group, world_twin),
    ]
    if rank < 3:
        cases.append(("trio", trio, trio_twin))
    gen = torch.Generator().manual_seed(1000 + rank)
    checked: list[str] = []

    # Which group each direction travels on: record the broadcasts the exchange makes.
    routes: list[tuple[int, bool]] = []
    broadcast = dist.broadcast
    twins = {id(t) for _, _, t in cases}

    twin_groups_seen: list[tuple[str, dist.ProcessGroup]] = []

    def rec_broadcast(t, src=None, group=None, **kw):
        routes.append((src, id(group) in twins))
        if id(group) in twins:  # with the module that asked for the exchange
            frame = sys._getframe(1)
            while frame.f_code.co_filename.endswith("duplex.py"):
                frame = frame.f_back
            twin_groups_seen.append((os.path.basename(frame.f_code.co_filename), group))
        return broadcast(t, src=src, group=group, **kw)

    dist.broadcast = rec_broadcast
    try:
        for name, group, twin in cases:
            size = dist.get_world_size(group)
            ranks = dist.get_process_group_ranks(group)
            for dtype, row in ((torch.uint8, 7), (torch.float32, 1), (torch.float32, 513)):
                if dtype == torch.uint8:
                    x = torch.randint(0, 256, (size * row,), generator=gen, dtype=torch.uint8)
                else:
                    x = torch.randn(size * row, generator=gen)
                ref = torch.empty_like(x)
                dist.all_to_all_single(ref, x, group=group)
                routes.clear()
                got = torch.full_like(x, 3)
                assert duplex.all_to_all_single(got, x, group, twin=twin) is None
                assert torch.equal(got, ref), (name, dtype, row)
                # 2 ranks: group rank 0's bytes on the group, rank 1's on the twin; more: the
                # plain collective (nothing recorded)
                assert routes == ([(ranks[0], False), (ranks[1], True)] if size == 2 else [])
                # two exchanges in flight on the same groups, waited in reverse order
                y = x.flip(0).contiguous()
                ref2 = torch.empty_like(y)
                dist.all_to_all_single(ref2, y, group=group)
                a, b = torch.empty_like(x), torch.empty_like(y)
                wa = duplex.all_to_all_single(a, x, group, twin=twin, async_op=True)
                wb = duplex.all_to_all_single(b, y, group, twin=twin, async_op=True)
                assert isinstance(wa, dist.distributed_c10d.Work)
                wb.wait()
                while not wa.is_completed():
                    pass
                wa.wait()
                assert torch.equal(a, ref) and torch.equal(b, ref2), (name, dtype, row)

                part = x[:row].clone()
                gref = torch.empty(size * row, dtype=dtype)
                dist.all_gather_into_tensor(gref, part, group=group)
                routes.clear()
                g = torch.empty_like(gref)
                work = duplex.all_gather_single(g, part, group, twin=twin, async_op=True)
                work.wait()
                assert torch.equal(g, gref), (name, dtype, row)
                assert routes == ([(ranks[0], False), (ranks[1], True)] if size == 2 else [])
            checked.append(name)

        # Without a twin the plain collective runs.
        routes.clear()
        x = torch.arange(8.0)
        out = torch.empty_like(x)
        duplex.all_to_all_single(out, x, topo.inter_node_group)
        assert routes == []

        errors = []
        for call in (
            lambda: duplex.all_to_all_single(
                torch.empty(5), torch.empty(5), topo.inter_node_group, twin=topo.twin_group("inter")
            ),
            lambda: duplex.all_to_all_single(
                torch.empty(8),
                torch.empty(8, 2)[:, 0],
                topo.inter_node_group,
                twin=topo.twin_group("inter"),
            ),
            lambda: duplex.all_gather_single(
                torch.empty(5), torch.empty(2), topo.inter_node_group, twin=topo.twin_group("inter")
            ),
        ):
            with pytest.raises(ValueError) as info:
                call()
            errors.append(str(info.value))
        # shard() with every ZeRO++ feature: qwZ's two hops, hpZ's backward gather inside the
        # node and qgZ's two hops are 2-rank exchanges here, each one both ways on a twin.
        routes.clear()
        twin_groups_seen.clear()
        model = shard(
            GPT(GPTConfig(vocab_size=64, context=8, n_layer=2, n_head=2, n_embd=32, seed=0)),
            topology=topo,
            config=ZeroPPConfig(qwz=True, hpz=True, qgz=True),
        )
        idx = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(rank))
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        # HSDP with the INT4 replicate reduction: its two hops cross nodes between 2 peers.
        hsdp = shard(
            GPT(GPTConfig(vocab_size=64, context=8, n_layer=2, n_head=2, n_embd=32, seed=0)),
            topology=topo,
            config=ZeroPPConfig(hsdp=True, replicate_bits=4),
        )
        _, loss = hsdp(idx[:, :-1], idx[:, 1:])
        loss.backward()
        twin_of = {id(topo.twin_group("inter")): "inter", id(topo.twin_group("intra")): "intra"}
        used = sorted({(caller, twin_of[id(g)]) for caller, g in twin_groups_seen})
    finally:
        dist.broadcast = broadcast
    dist.barrier()
    return {"checked": checked, "errors": errors, "shard_twins": used}


def test_duplex_exchanges_match_the_collectives():
    out = run_world(_duplex_world, 4, timeout_s=180)
    assert out[0]["checked"] == ["intra", "inter", "world", "trio"]
    assert out[3]["checked"] == ["intra", "inter", "world"]
    assert "divisible by the group size 2" in out[0]["errors"][0]
    assert "contiguous" in out[0]["errors"][1]
    assert "twice the input's 2 elements" in out[0]["errors"][2]
    for r in out:  # shard()'s exchanges went both ways on both twins
        assert r["shard_twins"] == [
            ("all_gather.py", "inter"),  # qwZ's hop 1
            ("all_gather.py", "intra"),  # qwZ's hop 2, hpZ's and HSDP's gathers in the node
            ("all_reduce.py", "inter"),  # HSDP's INT4 replicate hops
            ("reduce_scatter.py", "inter"),  # qgZ's hops
            ("reduce_scatter.py", "intra"),
        ], r


def test_twin_group_kind_is_checked():
    with pytest.raises(ValueError, match="'intra' or 'inter'"):
        Topology(world_size=4, ranks_per_node=2, rank=0).twin_group("world")
