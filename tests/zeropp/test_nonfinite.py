"""Non-finite values through qwZ and qgZ on a real 4-rank gloo world (2 nodes x 2, and 4 x 1):
a NaN or +-Inf on one rank, or a fp32 sum that overflows in qgZ's reduction, is never
quantized into a finite value. Per the quant core's [Note: non-finite blocks] the block that
holds it arrives as NaN on every rank (qwZ) or on the rank that owns it (qgZ); every other
block matches the same collective run without the bad value, bit for bit; subnormal inputs
stay finite.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from qshard.comm import Topology
from qshard.testing import run_world
from qshard.zeropp import HierarchicalQuantizedReduceScatter, QuantizedAllGather

BLOCK = 8
N = 64  # elements per rank: 8 blocks


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _qwz(topo: Topology, rank: int, world: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(N, generator=g).to(dtype)
    tiny = torch.finfo(torch.float32).tiny
    bad = x.clone()
    if rank == 1:
        bad[3] = float("nan")  # block 0
        bad[20] = float("inf")  # block 2
        bad[47] = float("-inf")  # block 5
    if rank == 3:
        bad[56:64] = (tiny * 2**-8) if dtype == torch.float32 else 0.0  # a subnormal block
    for bits in (8, 4):
        ag = QuantizedAllGather(topology=topo, bits=bits, block_size=BLOCK)
        out = torch.empty(world * N, dtype=dtype)
        ag(out, bad, dist.group.WORLD)
        clean = torch.empty(world * N, dtype=dtype)
        ag(clean, torch.where(bad.isfinite(), bad, 0.0), dist.group.WORLD)
        view, ref = out.view(world, -1, BLOCK), clean.view(world, -1, BLOCK)
        nan_blocks = {(1, 0), (1, 2), (1, 5)}
        for r in range(world):
            for b in range(N // BLOCK):
                if (r, b) in nan_blocks:
                    assert bool(view[r, b].isnan().all()), (dtype, bits, r, b)
                else:
                    assert torch.equal(view[r, b], ref[r, b]), (dtype, bits, r, b)
        assert bool(view[3, 7].isfinite().all())


def _qgz(topo: Topology, rank: int, world: int) -> None:
    size = 2 * 4 * BLOCK  # output elements per rank: a multiple of the 4-block wire rows
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(world * size, generator=g)
    bad = x.clone()
    # Rank 1 sends a NaN into rank 0's slice (block 1) and an Inf into rank 2's (block 3);
    # ranks 0 and 1 each send 3e38 into rank 3's block 2: finite, but its fp32 sum overflows.
    if rank == 1:
        bad[0 * size + 1 * BLOCK + 2] = float("nan")
        bad[2 * size + 3 * BLOCK + 5] = float("inf")
    if rank in (0, 1):
        bad[3 * size + 2 * BLOCK + 1] = 3e38
    for bits in (4, 8):
        for stages in (1, 2):
            rs = HierarchicalQuantizedReduceScatter(
                topology=topo, bits=bits, block_size=BLOCK, pipeline_stages=stages
            )
            out = torch.empty(size)
            rs(out, bad, dist.group.WORLD, ReduceOp.AVG)
            clean = torch.empty(size)
            rs(clean, torch.where(bad.isfinite() & (bad.abs() < 1e30), bad, 0.0),
               dist.group.WORLD, ReduceOp.AVG)  # fmt: skip
            nan_block = {0: 1, 2: 3}.get(rank)
            for b in range(size // BLOCK):
                got, want = out[b * BLOCK : (b + 1) * BLOCK], clean[b * BLOCK : (b + 1) * BLOCK]
                if b == nan_block:
                    assert bool(got.isnan().all()), (bits, stages, rank, b, got)
                elif rank == 3 and b == 2:
                    # The overflow: NaN for the block when a hop requantized the overflowed
                    # partial (2x2: the two summands share a node), else the element is +Inf
                    # (4x1: the last hop's sum overflows). Never a finite value.
                    assert not bool(got[1].isfinite()), (bits, stages, got)
                    if topo.ranks_per_node == 2:
                        assert bool(got.isnan().all()), (bits, stages, got)
                else:
                    assert _same(got, want), (bits, stages, rank, b)


def _world(rank: int, world: int) -> list[str]:
    done = []
    for rpn in (2, 1):
        topo = Topology(world_size=world, ranks_per_node=rpn)
        topo.init_groups()
        for dtype in (torch.float32, torch.bfloat16):
            _qwz(topo, rank, world, dtype)
        _qgz(topo, rank, world)
        done.append(f"{topo.num_nodes}x{rpn}")
    return done


def test_nonfinite_values_stay_nonfinite_through_qwz_and_qgz():
    out = run_world(_world, 4, timeout_s=240)
    assert out[0] == ["2x2", "4x1"]
