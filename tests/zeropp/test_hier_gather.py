"""qwZ's two-hop (inter-node, then intra-node) all-gather against the flat one-hop gather.

One 4-rank gloo world (2 nodes x 2 ranks) runs every sub-case; see [Note: qwZ route] and
[Note: qwZ hop order] in qshard/zeropp/all_gather.py. The reference is the same comm with
``hierarchical=False`` (the flat gather over the world group, checked against plain
torch.distributed in test_collectives.py) and, independently, every rank's shard quantized and
dequantized by the quant core's reference functions. The two-hop output must match both bit for
bit; its ledger must count (N-1)/N of the payload per node across nodes (the flat ring: (P-1)/P);
the fallbacks (one node, one rank per node, a group not the world in rank order) take the flat
path; and training with several gathers in flight next to qgZ's deferred reduce-scatter on the
same two process groups gives the flat route's losses and parameters bit for bit.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from qshard.comm import CommLedger, Topology, recording
from qshard.quant.blockwise import dequantize_blocks, quantize_blocks
from qshard.testing import run_world
from qshard.train.model import GPT, GPTConfig
from qshard.zeropp import QuantizedAllGather, ZeroPPConfig, shard

SIZES = (1, 37, 256, 1000, 3001)
DTYPES = (torch.float32, torch.bfloat16)
#: Per-parameter shard sizes of a segmented buffer: scales 100 .. 0.01 (see [Note: qwZ block
#: layout]); 1000 elements in all.
SEGMENTS = (5, 600, 3, 392)


def _data(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g))
    return x.to(dtype)


def _segmented(seed: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    scales = torch.cat([torch.full((k,), 10.0 ** (2 - i)) for i, k in enumerate(SEGMENTS)])
    return (_data(seed, rank, sum(SEGMENTS), torch.float32) * scales).to(dtype)


def _reference(x: torch.Tensor, bits: int, block: int, segments) -> torch.Tensor:
    """One rank's shard through the quant core's reference quantize/dequantize, each segment
    zero-padded to whole blocks, in the shard's dtype."""
    parts = []
    for part in x.split(list(segments) if segments else [x.numel()]):
        n = part.numel()
        padded = torch.nn.functional.pad(part.float(), (0, -n % block))
        codes, scales = quantize_blocks(padded.view(-1, block), bits=bits)
        parts.append(dequantize_blocks(codes, scales, bits=bits, dtype=x.dtype).view(-1)[:n])
    return torch.cat(parts)


def _gather(ag: QuantizedAllGather, x: torch.Tensor, world: int, async_op: bool):
    out = torch.full((world * x.numel(),), float("nan"), dtype=x.dtype)
    work = ag(out, x, dist.group.WORLD, async_op=async_op)
    return out, work


def _payload_bytes(n: int, bits: int, block: int, segments) -> int:
    blocks = sum(-(-k // block) for k in (segments or (n,)))
    return blocks * (4 + block * bits // 8)


def _case_bit_identical(topo: Topology, rank: int, res: dict) -> None:
    """Every size, segment layout, width, block, dtype and sync/async: two hops == flat ==
    the per-rank reference, and the ledger shows the two hops."""
    world, nodes = topo.world_size, topo.num_nodes
    cases = 0
    for dtype in DTYPES:
        inputs = [(n, None, _data(n, rank, n, dtype)) for n in SIZES]
        inputs.append((sum(SEGMENTS), SEGMENTS, _segmented(3, rank, dtype)))
        for n, seg, x in inputs:
            every_rank = [
                _segmented(3, r, dtype) if seg else _data(n, r, n, dtype) for r in range(world)
            ]
            for bits in (8, 4):
                for block in (8, 64):
                    kw = {"topology": topo, "bits": bits, "block_size": block, "segment_sizes": seg}
                    flat, _ = _gather(QuantizedAllGather(hierarchical=False, **kw), x, world, False)
                    ref = torch.cat([_reference(xr, bits, block, seg) for xr in every_rank])
                    assert torch.equal(flat, ref), ("flat vs reference", dtype, n, bits, block)
                    for async_op in (False, True):
                        ledger = CommLedger(topo)
                        with recording(ledger):
                            out, work = _gather(QuantizedAllGather(**kw), x, world, async_op)
                        if async_op:
                            assert isinstance(work, dist.distributed_c10d.Work)
                            work.wait()
                            work.wait()  # idempotent: hop 2 is issued once
                        else:
                            assert work is None
                        assert torch.equal(out, flat), (dtype, n, seg, bits, block, async_op)
                        e = ledger.summary().select(tag="fwd_all_gather")[0]
                        payload = _payload_bytes(n, bits, block, seg)
                        assert e.calls == 2  # hop 1 over the peers, hop 2 inside the node
                        assert e.tensor_bytes == (nodes + world) * payload
                        cases += 1
    res["bit_identical_cases"] = cases


def _case_in_flight(topo: Topology, rank: int, res: dict) -> None:
    """Several async gathers in flight at once (FSDP2's prefetch_depth > 1), waited in call
    order, then in another order (the same on every rank): each equals its flat gather."""
    world = topo.world_size
    specs = [(1000, 8, 64, torch.float32), (37, 4, 8, torch.bfloat16), (3001, 8, 256, None)]
    flats, inputs = [], []
    for i, (n, bits, block, dtype) in enumerate(specs):
        x = _data(50 + i, rank, n, dtype or torch.float32)
        kw = {"topology": topo, "bits": bits, "block_size": block}
        flats.append(_gather(QuantizedAllGather(hierarchical=False, **kw), x, world, False)[0])
        inputs.append((kw, x))
    for at_call in (False, True):  # CPU's route, and CUDA's (hop 2 at the call) forced on CPU
        for order in ((0, 1, 2), (2, 0, 1)):
            with mock.patch.object(
                QuantizedAllGather, "_hop2_at_call", lambda self, d, on=at_call: on
            ):
                pending = [_gather(QuantizedAllGather(**kw), x, world, True) for kw, x in inputs]
            for i in order:
                pending[i][1].wait()
            res[f"in_flight_{at_call}_{order}"] = all(
                torch.equal(out, flat) for (out, _), flat in zip(pending, flats)
            )


def _case_bytes(topo: Topology, rank: int, res: dict) -> None:
    """The ledger's inter-node bytes per node for one gather: (N-1)/N of the gathered payload
    on the two-hop route, (P-1)/P on the flat ring, and hop 2 never leaves the node."""
    world, nodes, per_node = topo.world_size, topo.num_nodes, topo.ranks_per_node
    n, bits, block = 4096, 8, 256
    x = _data(9, rank, n, torch.float32)
    gathered = world * _payload_bytes(n, bits, block, None)
    got = {}
    for hierarchical in (True, False):
        ag = QuantizedAllGather(
            topology=topo, bits=bits, block_size=block, hierarchical=hierarchical
        )
        ledger = CommLedger(topo)
        with recording(ledger):
            _gather(ag, x, world, False)
        s = ledger.summary()
        exact = ledger.gather_summary()  # every rank's real share, the busiest node
        got[hierarchical] = (s.inter(), s.intra(), exact.inter(), exact.intra())
    assert got[True][0] == pytest.approx((nodes - 1) / nodes * gathered)
    assert got[True][2] == pytest.approx((nodes - 1) / nodes * gathered)
    assert got[False][0] == pytest.approx((world - 1) / world * gathered)
    # Hop 2: every rank of a node sends (D-1)/D of the whole gathered buffer to its successor.
    assert got[True][1] == pytest.approx(per_node * (per_node - 1) / per_node * gathered)
    res["bytes"] = {k: v[0] / gathered for k, v in got.items()}


def _case_fallbacks(rank: int, res: dict) -> None:
    """One rank per node, one node and a group not in rank order take the flat path (no hop
    over the peer group; the out-of-order group is counted), with the flat path's output."""
    world = dist.get_world_size()
    x = _data(21, rank, 300, torch.float32)
    for name, rpn in (("one_rank_per_node", 1), ("one_node", world)):
        topo = Topology(world_size=world, ranks_per_node=rpn)
        ledger = CommLedger(topo)
        with recording(ledger):
            out, _ = _gather(QuantizedAllGather(topology=topo), x, world, False)
        flat, _ = _gather(QuantizedAllGather(topology=topo, hierarchical=False), x, world, False)
        e = ledger.summary().select(tag="fwd_all_gather")[0]
        res[name] = (e.calls, torch.equal(out, flat))
    # A cross-node group other than the world in rank order: ranks 0 and 2 (one per node).
    topo = Topology(world_size=world, ranks_per_node=2)
    sub = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    ranks = dist.get_process_group_ranks(sub)
    ledger = CommLedger(topo)
    with recording(ledger):
        out = torch.empty(2 * x.numel())
        QuantizedAllGather(topology=topo)(out, x, sub)
    flat = torch.empty_like(out)
    QuantizedAllGather(topology=topo, hierarchical=False)(flat, x, sub)
    s = ledger.summary()
    res["sub_group"] = (
        s.event("qwz_flat_gather"),
        s.select(tag="fwd_all_gather")[0].calls,
        torch.equal(out, flat),
        ranks,
    )
    # The whole world in another order (a custom mesh's group; new_group sorts its ranks, so
    # the decision is checked directly): flat, counted.
    ledger = CommLedger(topo)
    with recording(ledger):
        two_hops = QuantizedAllGather(topology=topo)._two_hops([0, 2, 1, 3])
    res["permuted_world"] = (two_hops, ledger.summary().event("qwz_flat_gather"))


CFG = GPTConfig(vocab_size=64, context=16, n_layer=3, n_head=2, n_embd=32, seed=0)


def _train(topo: Topology, rank: int, config: ZeroPPConfig, steps: int = 3):
    """Losses, final parameters, per-step inter-node gather bytes and deferred qgZ calls of a
    few AdamW steps."""
    model = shard(GPT(CFG), topology=topo, config=config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ledger = CommLedger(topo)
    losses, inter, deferred = [], [], 0
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        idx = torch.randint(0, CFG.vocab_size, (4, CFG.context + 1), generator=g)
        with recording(ledger):
            _, loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
        s = ledger.step()
        losses.append(loss.item())
        inter.append(s.inter(op="all_gather"))
        deferred += s.event("qgz_overlapped")
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = [p.to_local().detach().clone() for p in model.parameters()]
    return losses, params, inter, deferred


def _case_training(topo: Topology, rank: int, res: dict) -> None:
    """qwZ + qgZ without hpZ (the backward's gathers cross nodes too, next to qgZ's deferred
    hops on the same two groups), prefetch depth 1 and 2, and all three features: the two-hop
    route trains exactly as the flat one, with fewer inter-node gather bytes."""
    for name, kw, at_call in (
        ("qwz_qgz_depth2", {"qgz": True, "prefetch_depth": 2}, False),
        ("qwz_qgz_depth1", {"qgz": True}, False),
        ("all_depth2", {"qgz": True, "hpz": True, "prefetch_depth": 2}, False),
        # CUDA's route (hop 2 at the call, behind hop 1's wait), forced on CPU
        ("qwz_qgz_depth2_hop2_at_call", {"qgz": True, "prefetch_depth": 2}, True),
    ):
        config = ZeroPPConfig(qwz=True, overlap_reduce_scatter=True, **kw)
        with mock.patch.object(QuantizedAllGather, "_hop2_at_call", lambda self, d, on=at_call: on):
            hier = _train(topo, rank, config)
        with mock.patch.object(QuantizedAllGather, "_two_hops", lambda self, ranks: False):
            flat = _train(topo, rank, config)
        res[f"train_{name}"] = (
            hier[0] == flat[0],
            all(torch.equal(a, b) for a, b in zip(hier[1], flat[1])),
            all(h < f for h, f in zip(hier[2], flat[2])),
            hier[3] > 0 and hier[3] == flat[3],  # qgZ's hops really ran deferred, alike
        )


def _world(rank: int, world: int, ranks_per_node: int = 2) -> dict:
    topo = Topology(world_size=world, ranks_per_node=ranks_per_node)
    topo.init_groups()
    res: dict = {}
    _case_bit_identical(topo, rank, res)
    _case_in_flight(topo, rank, res)
    _case_bytes(topo, rank, res)
    if world == 4:
        _case_fallbacks(rank, res)
        _case_training(topo, rank, res)
    return res


def test_hierarchical_gather_2x2():
    results = run_world(_world, 4, timeout_s=280)
    for rank, res in enumerate(results):
        assert res["bit_identical_cases"] == 2 * (len(SIZES) + 1) * 2 * 2 * 2, rank
        for at_call in (False, True):
            assert res[f"in_flight_{at_call}_(0, 1, 2)"], (rank, at_call)
            assert res[f"in_flight_{at_call}_(2, 0, 1)"], (rank, at_call)
        # 2 nodes x 2: the two-hop route carries 1/2 of the payload per node link, the ring 3/4
        assert res["bytes"][True] == pytest.approx(0.5)
        assert res["bytes"][False] == pytest.approx(0.75)
        assert res["one_rank_per_node"] == (1, True), rank
        assert res["one_node"][0] == 1, rank  # inside one node: the plain gather
        assert res["sub_group"] == (1, 1, True, [rank % 2, rank % 2 + 2]), rank
        assert res["permuted_world"] == (False, 1), rank
        for name in (
            "qwz_qgz_depth2",
            "qwz_qgz_depth1",
            "all_depth2",
            "qwz_qgz_depth2_hop2_at_call",
        ):
            assert res[f"train_{name}"] == (True, True, True, True), (rank, name)


@pytest.mark.slow
@pytest.mark.parametrize("ranks_per_node", [2, 3])
def test_hierarchical_gather_6_ranks(ranks_per_node):
    """3 nodes x 2 and 2 nodes x 3: nodes != ranks per node, so a row order that swapped the
    two would show (in 2 x 2 both orders look alike)."""
    results = run_world(_world, 6, args=(ranks_per_node,), timeout_s=600)
    nodes = 6 // ranks_per_node
    for rank, res in enumerate(results):
        assert res["bit_identical_cases"] == 2 * (len(SIZES) + 1) * 2 * 2 * 2, rank
        for at_call in (False, True):
            assert res[f"in_flight_{at_call}_(0, 1, 2)"], (rank, at_call)
            assert res[f"in_flight_{at_call}_(2, 0, 1)"], (rank, at_call)
        assert res["bytes"][True] == pytest.approx((nodes - 1) / nodes)
        assert res["bytes"][False] == pytest.approx(5 / 6)
