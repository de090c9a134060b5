"""qgZ's reduce-scatter dispatched to its fused Triton kernels equals the torch path, bit for bit.

A real 4-rank gloo world (2 nodes x 2, and 1 x 4, 4 x 1) runs
`HierarchicalQuantizedReduceScatter` three ways on the same gradients: the CPU/torch path;
with `qshard._triton.serves` patched to accept CPU tensors, so it takes the fused path
(`reorder_quantize_rows` -> all-to-all -> `dequant_reduce_requant_rows` -> all-to-all ->
`dequant_reduce_rows`) in Triton's interpreter; and a mixed world where half the ranks take each
path. Every all-to-all send buffer (the wire bytes) and every output must be identical, and the
fused kernels must have been called (counted), so a silent fallback to the torch path fails.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton", reason="the GPU kernels need triton (pip install qshard[gpu])")

from tests.gpu.conftest import DEVICE

pytestmark = pytest.mark.skipif(
    DEVICE.type != "cpu" or os.environ.get("TRITON_INTERPRET") != "1",
    reason="routes CPU tensors through the kernels under the interpreter",
)

BS = 8
FUSED = ("reorder_quantize_rows", "dequant_reduce_requant_rows", "dequant_reduce_rows")


def _grads(rank: int, world: int, size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(world * size, generator=g) * torch.exp(
        2 * torch.randn(world * size, generator=g)
    )
    x[:BS] = 0.0  # an all-zero block on every rank (scale 0)
    return x.to(dtype)


class _Recorder:
    """Counts calls of the fused kernels and RowCodec, and keeps every all-to-all send."""

    def __init__(self, route: bool) -> None:
        self.route = route
        self.calls = dict.fromkeys(FUSED, 0)
        self.aligned_to: list[int] = []  # reorder_quantize_rows' promises ([Note: aligned slots])
        self.codec_calls = 0
        self.sends: list[torch.Tensor] = []

    def __enter__(self) -> _Recorder:
        from qshard import _triton
        from qshard.comm import duplex
        from qshard.zeropp._wire import RowCodec

        self._saved = [
            (_triton, "serves", _triton.serves),
            (duplex, "all_to_all_single", duplex.all_to_all_single),  # qgZ's every hop
            (RowCodec, "encode", RowCodec.encode),
            (RowCodec, "decode", RowCodec.decode),
            (RowCodec, "encode_slots", RowCodec.encode_slots),
            (RowCodec, "reduce", RowCodec.reduce),
            (RowCodec, "reduce_encode", RowCodec.reduce_encode),
        ] + [(_triton, name, getattr(_triton, name)) for name in FUSED]
        if self.route:
            _triton.serves = lambda t: True
        for name in FUSED:
            setattr(_triton, name, self._count(name, getattr(_triton, name)))
        a2a = duplex.all_to_all_single

        def all_to_all(out, inp, *args, **kwargs):
            self.sends.append(inp.clone())
            return a2a(out, inp, *args, **kwargs)

        duplex.all_to_all_single = all_to_all
        for name in ("encode", "decode", "encode_slots", "reduce", "reduce_encode"):
            original = getattr(RowCodec, name)

            def wrapped(codec, *args, _original=original, **kwargs):
                self.codec_calls += 1
                return _original(codec, *args, **kwargs)

            setattr(RowCodec, name, wrapped)
        return self

    def _count(self, name, fn):
        def wrapped(*args, **kwargs):
            self.calls[name] += 1
            if "aligned_to" in kwargs:
                self.aligned_to.append(kwargs["aligned_to"])
            return fn(*args, **kwargs)

        return wrapped

    def __exit__(self, *exc: object) -> None:
        for owner, name, value in self._saved:
            setattr(owner, name, value)


def _run(rs, x, size, dtype, op, route: bool):
    import torch.distributed as dist

    out = torch.full((size,), float("nan"), dtype=dtype)
    with _Recorder(route) as rec:
        rs(out, x, dist.group.WORLD, op)
    return out, rec


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))


def _refused_on_every_route(rs, rank: int, world: int, size0: int, size: int, *, seed, where):
    """Rank 0's shard has ``size0`` elements, the others ``size``: every rank refuses the
    reduce-scatter, fused, on the torch path, and in a world mixing both."""
    from torch.distributed import ReduceOp

    n = size0 if rank == 0 else size
    for route in (True, False, rank % 2 == 0):
        try:
            _run(rs, _grads(rank, world, n, torch.float32, seed), n, torch.float32,
                 ReduceOp.AVG, route=route)  # fmt: skip
        except RuntimeError as exc:
            assert "different sizes" in str(exc), str(exc)
            assert f"[{size}, {size0}]" in str(exc), str(exc)
        else:
            raise AssertionError(f"{where} route={route}: a size mismatch passed")


def _world(rank: int, world: int) -> list[str]:
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    from qshard.comm import Topology
    from qshard.zeropp import HierarchicalQuantizedReduceScatter

    ops = {
        "SUM": ReduceOp.SUM,
        "AVG": ReduceOp.AVG,
        "PREMUL_SUM(1/3)": dist._make_nccl_premul_sum(1 / 3),
    }
    done = []
    for rpn in (2, 4, 1):
        topo = Topology(world_size=world, ranks_per_node=rpn)
        topo.init_groups()
        nodes = world // rpn
        if rpn == 2:
            # Each bit width with each op once, over: uneven numel with a partial block; two
            # stages with padding in the last; a size whose second stage is all padding (no
            # output to write). The interpreter is slow: few cases, each one a full world run.
            cases = [
                (4, "SUM", 37, 1, torch.float32),
                (4, "AVG", 37, 2, torch.bfloat16),
                (4, "PREMUL_SUM(1/3)", 5, 2, torch.float32),
                (8, "AVG", 37, 1, torch.float32),
                (8, "PREMUL_SUM(1/3)", 37, 2, torch.bfloat16),
                (8, "SUM", 5, 2, torch.float32),
                (4, "SUM", 64, 2, torch.float32),  # slots of whole 16-byte vectors
            ]
        else:
            cases = [(4, "AVG", 37, 2, torch.bfloat16), (8, "SUM", 21, 1, torch.float32)]
        for seed, (bits, op_name, size, stages, dtype) in enumerate(cases):
            rs = HierarchicalQuantizedReduceScatter(
                topology=topo, bits=bits, block_size=BS, pipeline_stages=stages
            )
            x = _grads(rank, world, size, dtype, seed)
            op = ops[op_name]
            case = (f"{nodes}x{rpn}", bits, op_name, size, stages, dtype)
            want, ref = _run(rs, x, size, dtype, op, route=False)
            got, fused = _run(rs, x, size, dtype, op, route=True)
            assert not any(ref.calls.values()) and ref.codec_calls > 0, case
            # Fused path: no RowCodec, and each kernel ran as often as the topology needs.
            assert fused.codec_calls == 0, case
            assert fused.calls["reorder_quantize_rows"] == stages, (case, fused.calls)
            middle = stages if rpn > 1 and nodes > 1 else 0
            assert fused.calls["dequant_reduce_requant_rows"] == middle, (case, fused.calls)
            unit = stages * 4 * BS  # sub-slices are padded to 4-block rows
            sub = -(-size // unit) * unit // stages
            last = sum(1 for k in range(stages) if k * sub < size)
            assert fused.calls["dequant_reduce_rows"] == last, (case, fused.calls)
            # The slots' promise: every offset and length a multiple of gcd(size, sub).
            assert fused.aligned_to == [math.gcd(size, sub)] * stages, (case, fused.aligned_to)
            assert len(fused.sends) == len(ref.sends) > 0, case
            for i, (a, b) in enumerate(zip(ref.sends, fused.sends)):
                assert _same(a, b), (case, "wire", i)
            assert not want.isnan().any(), case
            assert _same(want, got), (case, (want.float() - got.float()).abs().max())
            if rpn == 2 and dtype == torch.float32:
                # Mixed world: even ranks fused, odd ranks torch, in one collective.
                mixed, _ = _run(rs, x, size, dtype, op, route=rank % 2 == 0)
                assert _same(want, mixed), (case, "mixed")
            done.append(str(case))
        # [Note: qgZ checks the shard sizes]: shards of different sizes padded to the same rows
        # (a parameter with a gradient on rank 0 only) are refused by every rank, fused or not
        rs = HierarchicalQuantizedReduceScatter(topology=topo, bits=8, block_size=BS)
        _refused_on_every_route(rs, rank, world, 21, 13, seed=9, where=f"{nodes}x{rpn}")
        done.append(f"{nodes}x{rpn} sizes refused")
        # [Note: qgZ frames at the unit's size]: rows framed for more than the shard (a unit
        # whose parameters did not all get a gradient) are the same bytes on both paths...
        rs = HierarchicalQuantizedReduceScatter(
            topology=topo, bits=8, block_size=BS, pipeline_stages=2
        )
        rs._frame_size = lambda size: size + 60  # type: ignore[method-assign]
        x = _grads(rank, world, 37, torch.float32, 11)
        want, ref = _run(rs, x, 37, torch.float32, ops["AVG"], route=False)
        got, fused = _run(rs, x, 37, torch.float32, ops["AVG"], route=True)
        assert all(_same(a, b) for a, b in zip(ref.sends, fused.sends)), "framed wire"
        assert ref.sends[0].numel() > 0 and _same(want, got), "framed output"
        # ...and sizes further apart than the padding, framed alike, are refused everywhere
        # (unframed, their rows differed in length and gloo aborted the process)
        rs._frame_size = lambda size: 300  # type: ignore[method-assign]
        _refused_on_every_route(rs, rank, world, 300, 13, seed=12, where=f"{nodes}x{rpn}")
        done.append(f"{nodes}x{rpn} framed")
    done += _verdicts_read_later(rank, world)
    return done


class _Branch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 8)
        self.use = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return h + self.extra(h) if self.use else h


def _verdicts_read_later(rank: int, world: int) -> list[str]:
    """[Note: size verdicts on a GPU]: the fused path's shard sizes read later, as for CUDA
    tensors. A mismatch inside a backward makes ``loss.backward()`` raise on every rank before
    any optimizer step (read only at each unit's next call, every unit's misaligned sum went
    through one step); outside a backward the comm's next call raises it."""
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    from qshard import _triton
    from qshard.comm import Topology
    from qshard.zeropp import HierarchicalQuantizedReduceScatter, ZeroPPConfig, _common, shard

    saved = (_triton.serves, _common._read_at_once)
    _triton.serves = lambda t: True
    _common._read_at_once = lambda sizes: False
    try:
        topo = Topology(world_size=world, ranks_per_node=2)
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList(_Branch() for _ in range(3))
        model = torch.nn.Sequential(*blocks)
        shard(model, topology=topo, config=ZeroPPConfig(qgz=True, prefetch=False),
              blocks=list(blocks))  # fmt: skip
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        before = [p.detach().clone() for p in model.parameters()]
        blocks[1].use = rank == 0  # the middle unit: not the backward's last reduction
        try:
            model(x).square().sum().backward()
        except RuntimeError as exc:
            assert "different sizes" in str(exc), str(exc)
        else:
            raise AssertionError("a size mismatch read later passed the backward")
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        model.zero_grad(set_to_none=True)
        blocks[1].use = False  # training goes on once the sizes agree
        model(x).square().sum().backward()
        assert all(p.grad.isfinite().all() for p in blocks[0].fc.parameters())
        # outside a backward nothing waits: the same comm's next call reads it
        rs = HierarchicalQuantizedReduceScatter(topology=topo, bits=8, block_size=BS)
        n = 21 if rank == 0 else 13
        out = torch.empty(n)
        rs(out, _grads(rank, world, n, torch.float32, 3), dist.group.WORLD, ReduceOp.AVG)
        try:
            rs(torch.empty(13), _grads(rank, world, 13, torch.float32, 4), dist.group.WORLD,
               ReduceOp.AVG)  # fmt: skip
        except RuntimeError as exc:
            assert "[13, 21]" in str(exc), str(exc)
        else:
            raise AssertionError("the next call did not read the earlier mismatch")
    finally:
        _triton.serves, _common._read_at_once = saved
    return ["verdicts read at the end of backward", "verdicts read at the next call"]


def test_qgz_reduce_scatter_fused_equals_torch_path():
    from qshard.testing import run_world

    out = run_world(_world, 4, env={"TRITON_INTERPRET": "1"}, timeout_s=240)
    assert all(len(r) == 19 for r in out), out
