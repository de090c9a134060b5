"""qwZ / qgZ / recording comms against plain torch.distributed, on real gloo worlds.

One spawned world per world size; inside it every topology that divides the world is tested
(4 ranks: 1x4, 2x2, 4x1; 3 ranks: 1x3, 3x1; 2 ranks: 1x2, 2x1), each over odd sizes, dtypes,
ops, bit widths and pipeline depths.

Error bounds (derived in docs/zeropp.md):
* qwZ: each element is off by at most half a quantization step of its block,
  ``absmax_block / (2 * qmax)``, then rounded once to the parameter dtype.
* qgZ: every hop quantizes each summand block with error <= ``A / (2 * qmax)`` where ``A``
  bounds the block's absmax; a node partial's absmax is at most the sum of its summands'
  absmaxes, so over ``h`` quantized hops the error of an element is at most
  ``h * sum_i A_i / (2 * qmax)`` (``A_i`` = absmax of rank ``i``'s block holding it), times the
  op's factor, plus fp32 / output-dtype rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from qshard.comm import CommLedger, Topology, recording
from qshard.testing import run_world
from qshard.zeropp import (
    HierarchicalQuantizedReduceScatter,
    QuantizedAllGather,
    RecordingAllGather,
    RecordingReduceScatter,
)

SIZES = (1, 37, 256, 1000)
DTYPES = (torch.float32, torch.bfloat16)


def _data(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g))
    return x.to(dtype)


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element: absmax of its block (blocks over ``x``'s last dim, zero padded)."""
    n = x.shape[-1]
    pad = -(-n // block) * block
    xp = torch.nn.functional.pad(x.float().abs(), (0, pad - n))
    a = xp.view(*x.shape[:-1], -1, block).amax(dim=-1, keepdim=True)
    return a.expand(*x.shape[:-1], pad // block, block).reshape(*x.shape[:-1], pad)[..., :n]


def _all_equal_across(t: torch.Tensor, group=None) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, t.contiguous(), group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _check_all_gather(topo: Topology, world: int) -> list[str]:
    done = []
    group = dist.group.WORLD
    rank = dist.get_rank()
    # An empty input (a unit of frozen 0-element parameters): across nodes qwZ divided by its
    # rows' zero length (ZeroDivisionError in the slot check); now a plain gather of nothing.
    for async_op in (False, True):
        out = torch.empty(0)
        work = QuantizedAllGather(topology=topo)(out, torch.empty(0), group, async_op=async_op)
        if async_op:
            work.wait()
    done.append("ag empty")
    for dtype in DTYPES:
        for n in SIZES:
            x = _data(n, rank, n, dtype)
            ref = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(ref, x)
            # Recording plain gather: bit-identical, and recorded.
            ledger = CommLedger(topo)
            with recording(ledger):
                out = torch.empty_like(ref)
                assert RecordingAllGather()(out, x, group) is None
                assert torch.equal(out, ref)
                out16 = torch.empty_like(ref)
                RecordingAllGather(wire_dtype=torch.bfloat16)(out16, x, group)
                assert torch.equal(out16, ref.to(torch.bfloat16).to(dtype))
            fwd = ledger.summary().select(tag="fwd_all_gather")[0]
            assert fwd.calls == 2
            assert fwd.tensor_bytes == world * n * (x.element_size() + 2)
            for bits in (8, 4):
                qmax = 2 ** (bits - 1) - 1
                for block in (8, 64):
                    for async_op in (False, True):
                        ag = QuantizedAllGather(topology=topo, bits=bits, block_size=block)
                        out = torch.full_like(ref, float("nan"))
                        ledger = CommLedger(topo)
                        with recording(ledger):
                            work = ag(out, x, group, async_op=async_op)
                        if async_op:
                            assert isinstance(work, dist.distributed_c10d.Work)
                            work.wait()
                            work.wait()  # idempotent
                        else:
                            assert work is None
                        err = (out.float() - ref.float()).abs()
                        amax = _block_absmax(ref.view(world, n), block).reshape(-1)
                        rounding = ref.float().abs() * (2**-8 if dtype == torch.bfloat16 else 0)
                        bound = (
                            amax / (2 * qmax) * (1 + 1e-5)
                            + rounding
                            + amax * 2**-8 * (dtype == torch.bfloat16)
                        )
                        crosses = not topo.is_intra_node(range(world))
                        if crosses:
                            assert bool((err <= bound).all()), (dtype, n, bits, block)
                            nb = -(-n // block)
                            payload = 4 * nb + nb * block * bits // 8
                            e = ledger.summary().select(tag="fwd_all_gather")[0]
                            # Two hops with > 1 rank per node (N rows among the peers, then
                            # all rows inside the node; tests/zeropp/test_hier_gather.py).
                            rows = world + (topo.num_nodes if topo.ranks_per_node > 1 else 0)
                            assert e.tensor_bytes == rows * payload
                        else:  # inside one node: the plain gather, exact, and said so
                            assert torch.equal(out, ref)
                            assert ledger.summary().event("qwz_single_node") == 1
                        assert _all_equal_across(out)
            done.append(f"ag {dtype} n={n}")
    # Per-parameter block layout: segments of very different scales never share a block, so
    # each segment's error is bounded by its own blocks' absmax.
    if not topo.is_intra_node(range(world)):
        sizes = [5, 300, 3, 200]
        n = sum(sizes)
        scales = torch.cat([torch.full((k,), 10.0 ** (2 - i)) for i, k in enumerate(sizes)])
        x = _data(11, rank, n, torch.float32) * scales
        ref = torch.empty(world * n)
        dist.all_gather_into_tensor(ref, x)
        for seg in (sizes, lambda: sizes):
            out = torch.empty_like(ref)
            QuantizedAllGather(topology=topo, block_size=64, segment_sizes=seg)(out, x, group)
            bounds = torch.cat(
                [_block_absmax(part, 64) for part in ref.view(world, n).split(sizes, dim=1)],
                dim=1,
            ).reshape(-1)
            assert bool(((out - ref).abs() <= bounds / 254 * (1 + 1e-5)).all())
        # sizes that do not add up: one segment, still within the whole-buffer bound
        out = torch.empty_like(ref)
        QuantizedAllGather(topology=topo, block_size=64, segment_sizes=[1, 2])(out, x, group)
        bound = _block_absmax(ref.view(world, n), 64).reshape(-1) / 254 * (1 + 1e-5)
        assert bool(((out - ref).abs() <= bound).all())
        done.append("ag segments")
    # A node-sized group is gathered unquantized (hpZ's backward gather).
    if topo.ranks_per_node > 1 and topo.num_nodes > 1:
        x = _data(7, rank, 300, torch.float32)
        intra = topo.intra_node_group
        ref = torch.empty(300 * topo.ranks_per_node)
        dist.all_gather_into_tensor(ref, x, group=intra)
        out = torch.empty_like(ref)
        QuantizedAllGather(topology=topo)(out, x, intra)
        assert torch.equal(out, ref)
        done.append("ag intra exact")
    return done


def _rs_reference(seed: int, world: int, size: int, dtype, rank: int):
    inputs = torch.stack([_data(seed, r, world * size, dtype) for r in range(world)])
    mine = inputs.float().view(world, world, size)[:, rank]  # (source rank, size)
    return inputs[rank], mine


def _check_reduce_scatter(topo: Topology, world: int) -> list[str]:
    done = []
    rank = dist.get_rank()
    group = dist.group.WORLD
    nodes, per_node = topo.num_nodes, topo.ranks_per_node
    ops = [
        (ReduceOp.SUM, 1.0),
        (ReduceOp.AVG, 1.0 / world),
        (dist._make_nccl_premul_sum(1 / 3), 1 / 3),
    ]
    # An empty output: qgZ's wire rows had no length (ZeroDivisionError, or a misaligned view
    # for INT4 with one rank per node); now a plain reduce-scatter of nothing.
    for bits in (None, 8, 4):
        out = torch.empty(0)
        HierarchicalQuantizedReduceScatter(topology=topo, bits=bits)(
            out, torch.empty(0), group, ReduceOp.SUM
        )
    done.append("rs empty")
    for size in (1, 37, 300):
        # Quantization off: integer-valued data sums exactly in any order, so routing (the
        # slice order, the padding, the pipeline) must be exact.
        g = torch.Generator().manual_seed(size * 10 + rank)
        xi = torch.randint(-50, 50, (world * size,), generator=g).float()
        ref = torch.empty(size)
        dist.reduce_scatter_tensor(ref, xi, op=ReduceOp.SUM)
        for stages in (1, 3):
            out = torch.full((size,), float("nan"))
            HierarchicalQuantizedReduceScatter(
                topology=topo, bits=None, block_size=8, pipeline_stages=stages
            )(out, xi, group, ReduceOp.SUM)
            assert torch.equal(out, ref), (size, stages)
        plain = torch.empty(size)
        RecordingReduceScatter()(plain, xi, group, ReduceOp.SUM)
        assert torch.equal(plain, ref)
        done.append(f"rs exact routing size={size}")
        for dtype in DTYPES:
            x, mine = _rs_reference(size, world, size, dtype, rank)
            exact = mine.sum(dim=0)
            amax = _block_absmax(mine, 8)  # blocks of 8 align with the slice start
            # 16-bit wire baseline: an fp32 input goes out as bf16 summands, summed in fp32; a
            # bf16 input is already 16-bit and takes FSDP2's own reduce-scatter.
            out = torch.empty(size, dtype=dtype)
            RecordingReduceScatter(wire_dtype=torch.bfloat16)(out, x, group, ReduceOp.AVG)
            if dtype == torch.float32:
                want = mine.to(torch.bfloat16).float().sum(dim=0) / world
                torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
            else:
                want = torch.empty(size, dtype=dtype)
                dist.reduce_scatter_tensor(want, x, op=ReduceOp.AVG)
                assert torch.equal(out, want)
            for bits in (4, 8):
                qmax = 2 ** (bits - 1) - 1
                hops = int(per_node > 1) + int(nodes > 1)
                for op, factor in ops:
                    for stages in (1, 2):
                        rs = HierarchicalQuantizedReduceScatter(
                            topology=topo, bits=bits, block_size=8, pipeline_stages=stages
                        )
                        out = torch.full((size,), float("nan"), dtype=dtype)
                        ledger = CommLedger(topo)
                        with recording(ledger):
                            assert rs(out, x, group, op) is None
                        bound = hops * amax.sum(dim=0) / (2 * qmax) * factor * (1 + 1e-4)
                        bound += 1e-6 * (mine.abs().sum(dim=0) * factor)
                        want = exact * factor
                        if dtype == torch.bfloat16:
                            bound += (want.abs() + bound) * 2**-8
                        err = (out.float() - want).abs()
                        assert bool((err <= bound).all()), (size, dtype, bits, op, stages)
                        s = ledger.summary()
                        if nodes == 1:
                            assert s.event("qgz_single_node") == 1
                            assert s.inter() == 0
                        if per_node == 1:
                            assert s.event("qgz_single_rank_nodes") == 1
                            assert s.intra() == 0
            done.append(f"rs quantized {dtype} size={size}")
    # Not the world group: plain reduce-scatter, counted.
    if per_node > 1 and nodes > 1:
        x = _data(3, rank, per_node * 16, torch.float32)
        ref = torch.empty(16)
        dist.reduce_scatter_tensor(ref, x, group=topo.intra_node_group)
        out = torch.empty(16)
        ledger = CommLedger(topo)
        with recording(ledger):
            HierarchicalQuantizedReduceScatter(topology=topo)(
                out, x, topo.intra_node_group, ReduceOp.SUM
            )
        assert torch.equal(out, ref)
        assert ledger.summary().event("qgz_fallback_plain") == 1
        done.append("rs fallback")
    return done


def _ledger_bytes_2x2(topo: Topology) -> None:
    """qgZ's inter-node bytes for M fp32 gradient elements at INT4: each node sends its
    partials for the other node: (N-1)/N of M/2 bytes of codes, plus scales."""
    world = topo.world_size
    size = 1024
    x = torch.randn(world * size)
    out = torch.empty(size)
    ledger = CommLedger(topo)
    with recording(ledger):
        HierarchicalQuantizedReduceScatter(topology=topo, bits=4, block_size=256)(
            out, x, dist.group.WORLD, ReduceOp.AVG
        )
    m = world * size  # elements of the full gradient
    wire = m * 0.5 + m / 256 * 4
    s = ledger.summary()
    d = topo.ranks_per_node
    n = topo.num_nodes
    # hop 2: each rank of a node sends its node partial for the other nodes (1/D of m each),
    # stage 0's N rows with the node's range of shard sizes (16 bytes each)
    assert s.inter() == pytest.approx((n - 1) / n * wire + (n - 1) * 16 * d)
    # hop 1: each rank sends (D-1)/D of its whole buffer inside the node, stage 0's D rows
    # with its shard size (8 bytes each); [Note: qgZ checks the shard sizes]
    assert s.intra() == pytest.approx(d * (d - 1) / d * wire + (d - 1) * d * 8)


def _check_fused_equals_reference(topo: Topology, world: int) -> list[str]:
    """[Note: fused wire rows]: qwZ and qgZ on the fused C kernels give the bits of the
    reference composition (fast path off), for ragged multi-parameter shards, fp32 and bf16,
    both bit widths and pipeline depths; so a world that mixes the two agrees."""
    from qshard.quant import _fastpath

    rank, group = dist.get_rank(), dist.group.WORLD
    was = _fastpath.fastpath_enabled()
    done = []
    try:
        for dtype in DTYPES:
            for bits in (4, 8):
                sizes = (37, 256, 1, 300)  # one rank's shards of 4 parameters
                x = _data(7, rank, sum(sizes), dtype)
                got = []
                for fast in (True, False):
                    _fastpath.set_fastpath(fast)
                    out = torch.empty(world * sum(sizes), dtype=dtype)
                    QuantizedAllGather(
                        topology=topo, bits=bits, block_size=64, segment_sizes=sizes
                    )(out, x, group)
                    got.append(out)
                assert torch.equal(got[0].view(torch.uint8), got[1].view(torch.uint8)), (
                    dtype,
                    bits,
                )
                for size in (37, 1000):
                    g = _data(8, rank, world * size, dtype)
                    for stages in (1, 2):
                        got = []
                        for fast in (True, False):
                            _fastpath.set_fastpath(fast)
                            out = torch.full((size,), float("nan"), dtype=dtype)
                            HierarchicalQuantizedReduceScatter(
                                topology=topo, bits=bits, block_size=64, pipeline_stages=stages
                            )(out, g, group, ReduceOp.AVG)
                            got.append(out)
                        assert torch.equal(got[0].view(torch.uint8), got[1].view(torch.uint8)), (
                            dtype,
                            bits,
                            size,
                            stages,
                        )
                done.append(f"fused == reference {dtype} int{bits}")
    finally:
        _fastpath.set_fastpath(was)
    return done


def _check_shard_size_mismatch(topo: Topology, world: int) -> list[str]:
    """[Note: qgZ checks the shard sizes]: ranks whose gradient shards differ in size but pad
    to the same wire rows (a parameter with a gradient on rank 0 only) made qgZ sum misaligned
    elements without a word. Every rank refuses alike, and the next reduce-scatter works."""
    rank, group = dist.get_rank(), dist.group.WORLD
    done = []
    for bits in (4, 8):
        for stages in (1, 2):
            comm = HierarchicalQuantizedReduceScatter(
                topology=topo, bits=bits, block_size=64, pipeline_stages=stages
            )
            size = 100 if rank == 0 else 68  # both pad to the same rows
            out = torch.empty(size)
            with pytest.raises(RuntimeError, match=r"different sizes .*\[68, 100\].*unused_params"):
                comm(out, torch.randn(world * size), group, ReduceOp.AVG)
            # the refused call left nothing behind: the same comm then equals a fresh one
            g = _data(9, rank, world * 68, torch.float32)
            got, fresh = torch.empty(68), torch.empty(68)
            comm(got, g, group, ReduceOp.AVG)
            HierarchicalQuantizedReduceScatter(
                topology=topo, bits=bits, block_size=64, pipeline_stages=stages
            )(fresh, g, group, ReduceOp.AVG)
            assert torch.equal(got, fresh), (bits, stages)
            done.append(f"size mismatch refused int{bits} x{stages}")
    return done


def _world(rank: int, world: int, rpns: tuple[int, ...]) -> list[str]:
    done = []
    for rpn in rpns:
        topo = Topology(world_size=world, ranks_per_node=rpn)
        topo.init_groups()
        done += [f"{topo.num_nodes}x{rpn}: {c}" for c in _check_all_gather(topo, world)]
        done += [f"{topo.num_nodes}x{rpn}: {c}" for c in _check_reduce_scatter(topo, world)]
        done += [f"{topo.num_nodes}x{rpn}: {c}" for c in _check_fused_equals_reference(topo, world)]
        done += [f"{topo.num_nodes}x{rpn}: {c}" for c in _check_shard_size_mismatch(topo, world)]
        if topo.num_nodes == 2 and rpn == 2:
            _ledger_bytes_2x2(topo)
    return done


def test_collectives_4_ranks_1x4_2x2_4x1():
    out = run_world(_world, 4, args=((4, 2, 1),), timeout_s=280)
    assert any("2x2: rs fallback" in c for c in out[0])
    assert any("2x2: fused == reference torch.bfloat16 int4" in c for c in out[0])
    for layout in ("1x4", "2x2", "4x1"):
        assert f"{layout}: size mismatch refused int8 x2" in out[3]


def test_collectives_3_ranks_3x1_1x3():
    run_world(_world, 3, args=((1, 3),), timeout_s=200)


def test_collectives_2_ranks_1x2():
    run_world(_world, 2, args=((2, 1),), timeout_s=150)


@pytest.mark.slow
def test_collectives_6_ranks_3x2_2x3():
    run_world(_world, 6, args=((2, 3),), timeout_s=600)
