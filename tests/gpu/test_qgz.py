"""qgZ's fused kernels vs the torch path of `qshard.zeropp` (its wire codec and slice order).

The two-hop reduce-scatter is emulated with tensors (no processes): every rank's send buffer,
the all-to-alls as index shuffles, and each hop's fused kernel, checked bit for bit against
the same algorithm built from `RowCodec` + `torch.sum`, and against the exact mean.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="the GPU kernels need triton (pip install qshard[gpu])")

from qshard import _triton
from qshard.quant import blockwise as ref
from qshard.zeropp._wire import RowCodec
from tests.gpu.conftest import spy_launches

BS = 16


def _layout(x: torch.Tensor, nodes: int, per_node: int, stages: int, size: int) -> torch.Tensor:
    """The send layout of `HierarchicalQuantizedReduceScatter._reduce`: (K, D, N, sub) fp32."""
    world = nodes * per_node
    unit = stages * BS
    padded = -(-size // unit) * unit
    xx = x.reshape(world, size).float()
    if padded != size:
        xx = torch.nn.functional.pad(xx, (0, padded - size))
    return xx.view(nodes, per_node, stages, padded // stages).permute(2, 1, 0, 3).contiguous()


def _wire(codes: torch.Tensor, scales: torch.Tensor, rows: int) -> torch.Tensor:
    """Our (codes, scales) laid out as RowCodec's rows of [fp32 scales | codes]."""
    return torch.cat(
        [scales.view(rows, -1).view(torch.uint8), codes.reshape(rows, -1).view(torch.uint8)], 1
    )


@pytest.mark.parametrize(
    ("nodes", "per_node", "stages", "size", "bits", "dtype"),
    [
        (2, 2, 1, 64, 4, torch.float32),
        (2, 3, 2, 50, 4, torch.bfloat16),  # padding inside the last stage of each partition
        (3, 2, 3, 200, 8, torch.float32),
        (1, 4, 2, 33, 4, torch.float16),
        (4, 1, 1, 16, 8, torch.bfloat16),
    ],
)
def test_reorder_quantize_matches_row_codec(device, nodes, per_node, stages, size, bits, dtype):
    world = nodes * per_node
    x = (torch.randn(world * size, generator=torch.Generator().manual_seed(size)) * 2).to(dtype)
    offsets, lengths, slot = _triton.qgz_slots(
        nodes=nodes, ranks_per_node=per_node, stages=stages, size=size, block_size=BS
    )
    codes, scales = _triton.reorder_quantize(
        x.to(device),
        offsets.to(device),
        lengths=lengths.to(device),
        slot_numel=slot,
        block_size=BS,
        bits=bits,
    )
    want = _layout(x, nodes, per_node, stages, size)  # (K, D, N, sub)
    assert want.shape[-1] == slot
    codec = RowCodec(bits=bits, block_size=BS)
    per_stage = codes.shape[0] // stages
    for k in range(stages):
        sl = slice(k * per_stage, (k + 1) * per_stage)
        got = _wire(codes[sl].cpu(), scales[sl].cpu(), per_node)
        assert torch.equal(got, codec.encode(want[k].view(per_node, nodes * slot))), k


def _peer_codes(peers: int, m: int, bits: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(peers, m, generator=g) * torch.rand(peers, 1, generator=g) * 4
    x[0, :BS] = 0.0  # a block that is zero on one peer only
    codes, scales = ref.quantize_blocks(x.view(-1, BS), bits=bits)
    if bits == 4:
        codes = ref.pack_int4(codes)
    return codes.view(peers, m // BS, -1), scales.view(peers, m // BS)


def _sum_reference(codes, scales, bits):
    peers = codes.shape[0]
    flat = ref.unpack_int4(codes.reshape(-1)) if bits == 4 else codes.reshape(-1)
    deq = ref.dequantize_blocks(flat.view(-1, BS), scales.reshape(-1), bits=bits).view(peers, -1)
    return deq.sum(dim=0)  # the torch path's reduction


@pytest.mark.parametrize(("peers", "bits"), [(1, 4), (2, 4), (3, 8), (5, 4), (8, 4)])
def test_middle_hop_matches_torch_path(device, peers, bits):
    m = 6 * BS
    codes, scales = _peer_codes(peers, m, bits, seed=peers)
    total = _sum_reference(codes, scales, bits)
    want_codes, want_scales = ref.quantize_blocks(total.view(-1, BS), bits=4)
    # INT8 peers arrive as int8 codes (in_bits says how to read them), INT4 ones packed.
    in_bits = bits if bits == 8 else None
    got_codes, got_scales = _triton.dequant_reduce_requant(
        codes.to(device), scales.to(device), block_size=BS, bits=4, in_bits=in_bits
    )
    assert torch.equal(got_codes.cpu().view(-1), ref.pack_int4(want_codes))
    assert torch.equal(got_scales.cpu(), want_scales)
    # The last hop: sum, divide, cast, drop the padding.
    for dtype, divisor in ((torch.float32, None), (torch.bfloat16, 6.0)):
        got = _triton.dequant_reduce(
            codes.to(device),
            scales.to(device),
            block_size=BS,
            in_bits=in_bits,
            dtype=dtype,
            numel=m - 3,
            divisor=divisor,
        )
        want = total if divisor is None else total / divisor
        assert torch.equal(got.cpu(), want.to(dtype)[: m - 3])


@pytest.mark.parametrize(("nodes", "per_node", "stages"), [(2, 2, 1), (2, 3, 2)])
def test_two_hop_reduce_scatter_emulated(device, nodes, per_node, stages):
    """Every rank's qgZ built from the three fused kernels equals the torch path bit for bit,
    and both are the AVG reduce-scatter up to INT4 quantization error."""
    world, size, bits = nodes * per_node, 70, 4
    grads = torch.randn(world, world * size, generator=torch.Generator().manual_seed(world))
    offsets, lengths, slot = _triton.qgz_slots(
        nodes=nodes, ranks_per_node=per_node, stages=stages, size=size, block_size=BS
    )
    codec = RowCodec(bits=bits, block_size=BS)
    nb_slot = slot // BS
    # Hop 0: each rank's fused reorder+quantize -> (K, D, N * nb_slot) blocks.
    sent = []
    for r in range(world):
        c, s = _triton.reorder_quantize(
            grads[r].to(device),
            offsets.to(device),
            lengths=lengths.to(device),
            slot_numel=slot,
            block_size=BS,
        )
        sent.append(
            (
                c.cpu().view(stages, per_node, nodes * nb_slot, -1),
                s.cpu().view(stages, per_node, -1),
            )
        )
    result = torch.zeros(world, stages, slot)
    want = torch.zeros(world, stages, slot)
    for k in range(stages):
        partial, partial_ref = {}, {}
        for n in range(nodes):
            for d in range(per_node):
                # Hop 1 (intra-node all-to-all): local rank d gets chunk d from each local peer.
                peers = [n * per_node + j for j in range(per_node)]
                codes = torch.stack([sent[p][0][k, d] for p in peers])
                scales = torch.stack([sent[p][1][k, d] for p in peers])
                pc, ps = _triton.dequant_reduce_requant(
                    codes.to(device), scales.to(device), block_size=BS, bits=bits
                )
                partial[n, d] = (pc.cpu().view(nodes, nb_slot, -1), ps.cpu().view(nodes, -1))
                # Torch path: decode rows, sum, re-encode (RowCodec wire bytes).
                wire = torch.stack([_wire(sent[p][0][k, d], sent[p][1][k, d], 1)[0] for p in peers])
                summed = codec.decode(wire, nodes * slot).sum(dim=0).view(nodes, slot)
                partial_ref[n, d] = codec.encode(summed)
                assert torch.equal(_wire(pc.cpu(), ps.cpu(), nodes), partial_ref[n, d])
        for n in range(nodes):
            for d in range(per_node):
                # Hop 2 (inter-node all-to-all among local rank d): node n's slice from each node.
                codes = torch.stack([partial[m_, d][0][n] for m_ in range(nodes)])
                scales = torch.stack([partial[m_, d][1][n] for m_ in range(nodes)])
                out = _triton.dequant_reduce(
                    codes.to(device), scales.to(device), block_size=BS, divisor=float(world)
                )
                result[n * per_node + d, k] = out.cpu()
                rows = torch.stack([partial_ref[m_, d][n] for m_ in range(nodes)])
                want[n * per_node + d, k] = codec.decode(rows, slot).sum(dim=0) / world
    assert torch.equal(result, want)
    exact = grads.mean(0).view(world, size)
    got = result.view(world, stages * slot)[:, :size]
    rel = (got - exact).norm() / exact.norm()
    # Two INT4 roundings of per-block absmax-scaled data: ~10-20% relative L2 error.
    assert rel < 0.3, rel


def test_rejects_bad_slots(device):
    x = torch.zeros(32, device=device)
    with pytest.raises(ValueError, match="past the end"):
        _triton.reorder_quantize(x, torch.tensor([24], device=device), slot_numel=16, block_size=BS)
    with pytest.raises(ValueError, match="lengths"):
        _triton.reorder_quantize(
            x,
            torch.tensor([0], device=device),
            lengths=torch.tensor([17], device=device),
            slot_numel=16,
            block_size=BS,
        )
    with pytest.raises(ValueError, match="scales must be fp32"):
        _triton.dequant_reduce(
            torch.zeros(2, 3, BS // 2, dtype=torch.uint8, device=device),
            torch.zeros(2, 4, device=device),
            block_size=BS,
        )
    with pytest.raises(ValueError, match="need in_bits"):
        _triton.dequant_reduce(
            torch.zeros(2, 3, BS, dtype=torch.int8, device=device),
            torch.zeros(2, 3, device=device),
            block_size=BS,
        )
    # An integer output truncated the fp32 sums without a word.
    packed = torch.zeros(2, 3, BS // 2, dtype=torch.uint8, device=device)
    with pytest.raises(TypeError, match="floating point"):
        _triton.dequant_reduce(packed, torch.zeros(2, 3, device=device), block_size=BS,
                               dtype=torch.int32)  # fmt: skip
    with pytest.raises(TypeError, match="floating point"):
        _triton.dequant_reduce_rows(
            torch.zeros(2, 3 * (4 + BS // 2), dtype=torch.uint8, device=device),
            block_size=BS,
            bits=4,
            out=torch.empty(3 * BS, dtype=torch.int16, device=device),
        )


def test_block_maximum_survives_both_hops_exactly(device):
    # One peer: the middle hop requantizes its own dequantized values, whose block maximum is
    # the stored absmax exactly (the format's guarantee), so the absmax is unchanged bit for
    # bit and the last hop returns +-absmax itself.
    m = 4 * BS
    x = torch.randn(1, m, generator=torch.Generator().manual_seed(3))
    x[0, ::BS] = 1.0 + torch.arange(4) * 2.0**-23 * 1234567  # awkward mantissas
    codes, absmax = ref.quantize_blocks(x.view(-1, BS), bits=4)
    packed = ref.pack_int4(codes).view(1, 4, -1)
    pc, ps = _triton.dequant_reduce_requant(
        packed.to(device), absmax.view(1, 4).to(device), block_size=BS, bits=4
    )
    assert torch.equal(ps.cpu(), absmax)
    out = _triton.dequant_reduce(pc.view(1, 4, -1), ps.view(1, 4), block_size=BS)
    assert torch.equal(out.cpu().view(4, BS).abs().amax(1), x.view(4, BS).abs().amax(1))


@pytest.mark.parametrize("bits", [4, 8])
def test_row_kernels_write_and_read_row_codec_rows(device, bits):
    """The `*_rows` kernels zeropp dispatches read and write RowCodec's [scales | codes] rows
    in place, byte for byte what encode / decode / sum / encode give (2 nodes x 3 ranks, 2
    stages, padding in the last stage)."""
    nodes, per_node, stages, size = 2, 3, 2, 50
    world = nodes * per_node
    codec = RowCodec(bits=bits, block_size=BS)
    x = torch.randn(world * size, generator=torch.Generator().manual_seed(bits)) * 3
    offsets, lengths, slot = _triton.qgz_slots(
        nodes=nodes, ranks_per_node=per_node, stages=stages, size=size, block_size=BS
    )
    layout = _layout(x, nodes, per_node, stages, size)  # (K, D, N, slot)
    per_stage = per_node * nodes
    for k in range(stages):
        sl = slice(k * per_stage, (k + 1) * per_stage)
        send = torch.full((per_node, codec.row_bytes(nodes * slot)), 0xAB, dtype=torch.uint8)
        got = _triton.reorder_quantize_rows(
            x.to(device),
            offsets[sl].to(device),
            lengths[sl].to(device),
            slot_numel=slot,
            block_size=BS,
            bits=bits,
            out=send.to(device),
        )
        assert torch.equal(got.cpu(), codec.encode(layout[k].view(per_node, nodes * slot))), k
    # Middle hop: D peers' rows of N slots each -> N rows of one slot.
    peers = torch.randn(per_node, nodes * slot, generator=torch.Generator().manual_seed(1))
    recv = codec.encode(peers)
    out = torch.empty((nodes, codec.row_bytes(slot)), dtype=torch.uint8)
    got = _triton.dequant_reduce_requant_rows(
        recv.to(device), block_size=BS, bits=bits, out=out.to(device)
    )
    summed = codec.decode(recv, nodes * slot).sum(dim=0)
    assert torch.equal(got.cpu(), codec.encode(summed.view(nodes, slot)))
    # Last hop: N rows of one slot, times the op's factor, into a shorter bf16 output.
    rows = got.cpu()
    keep = slot - 5
    for scale in (None, 1 / 3):
        dst = torch.empty(keep, dtype=torch.bfloat16)
        res = _triton.dequant_reduce_rows(
            rows.to(device), block_size=BS, bits=bits, out=dst.to(device), scale=scale
        )
        total = codec.decode(rows, slot).sum(dim=0)
        if scale is not None:
            total = total * scale
        assert torch.equal(res.cpu(), total[:keep].to(torch.bfloat16)), scale


def test_row_kernels_reject_bad_rows(device):
    rows = torch.zeros(2, 4 * (4 + BS // 2) + 1, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="not whole blocks"):
        _triton.dequant_reduce_rows(rows, block_size=BS, bits=4, out=torch.empty(4, device=device))
    good = torch.zeros(2, 4 * (4 + BS // 2), dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="do not fill"):
        _triton.dequant_reduce_requant_rows(
            good, block_size=BS, bits=4, out=torch.zeros_like(good[:1, : good.shape[1] // 2])
        )
    with pytest.raises(ValueError, match="more than"):
        _triton.dequant_reduce_rows(
            good, block_size=BS, bits=4, out=torch.empty(4 * BS + 1, device=device)
        )
    with pytest.raises(ValueError, match="multiple of 4"):
        _triton.dequant_reduce_rows(good, block_size=4, bits=4, out=torch.empty(1, device=device))


def test_reorder_quantize_grid_keeps_the_long_axis_first(monkeypatch):
    """CUDA caps grid axes 1 and 2 at 65535 programs: a slot of 2**29 elements (an 8 GB fp32
    gradient over 4 ranks) is 131072 tiles, which on axis 1 failed to launch; the tiles now go
    on axis 0 and the slots (world x stages) on axis 1. Checked on the launch grid itself (no
    kernel runs)."""
    from qshard._triton import _qgz

    grids = []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(_qgz, "_reorder_quantize_kernel", Recorder())
    x = torch.zeros(8)
    offsets = torch.zeros(4, dtype=torch.int64)
    blocks = _qgz._separate(torch.empty(0, dtype=torch.int8), torch.empty(0), 1)
    _qgz._launch_reorder_quantize(x, offsets, offsets, 2**29, 256, 7, True, "nearest", None, blocks)
    ((tiles, slots),) = grids
    assert slots == 4 and tiles > 65535
    with pytest.raises(ValueError, match="at most 65535 slots"):
        many = torch.zeros(65536, dtype=torch.int64)
        _qgz._launch_reorder_quantize(x, many, many, 256, 256, 7, True, "nearest", None, blocks)


def test_aligned_slots_take_vector_loads_and_the_same_bytes(monkeypatch, device):
    """[Note: aligned slots]: the kernel is told ALIGNED only when every offset and length is a
    multiple of a 16-byte vector (4 fp32, 8 bf16 elements) and x starts on 16 bytes, found by
    the host check or promised by a trusted caller (zeropp: gcd(partition size, slot)); a
    broken promise is refused when checked; the bytes do not change."""
    from qshard._triton import _qgz

    launches = spy_launches(monkeypatch, _qgz, "_reorder_quantize_kernel")
    codec = RowCodec(bits=4, block_size=BS)
    gen = torch.Generator().manual_seed(0)
    for size, dtype, aligned in ((64, torch.float32, True), (50, torch.float32, False),
                                 (52, torch.float32, True), (52, torch.bfloat16, False),
                                 (56, torch.bfloat16, True)):  # fmt: skip
        x = (torch.randn(4 * size, generator=gen) * 3).to(dtype)
        offsets, lengths, slot = _triton.qgz_slots(
            nodes=2, ranks_per_node=2, stages=1, size=size, block_size=BS
        )
        send = torch.empty((2, codec.row_bytes(2 * slot)), dtype=torch.uint8, device=device)
        args = (x.to(device), offsets.to(device), lengths.to(device))
        kw = dict(slot_numel=slot, block_size=BS, bits=4)
        checked = _triton.reorder_quantize_rows(*args, out=send.clone(), **kw).clone()
        promised = _triton.reorder_quantize_rows(
            *args, out=send.clone(), check=False, aligned_to=math.gcd(size, slot), **kw
        )
        want = codec.encode(_layout(x, 2, 2, 1, size)[0].view(2, 2 * slot))
        assert torch.equal(checked.cpu(), want) and torch.equal(promised.cpu(), want), (size, dtype)
        flags = [kw["ALIGNED"] for _, _, kw in launches[-2:]]
        assert flags == [aligned, aligned], (size, dtype, flags)
    # A view that starts 4 bytes in: its slots are multiples of 4 elements, x is not aligned.
    x = torch.randn(4 * 64 + 1, device=device)[1:]
    offsets, lengths, slot = _triton.qgz_slots(
        nodes=2, ranks_per_node=2, stages=1, size=64, block_size=BS
    )
    send = torch.empty((2, codec.row_bytes(2 * slot)), dtype=torch.uint8, device=device)
    offsets, lengths = offsets.to(device), lengths.to(device)
    _triton.reorder_quantize_rows(
        x, offsets, lengths, slot_numel=slot, block_size=BS, bits=4, out=send
    )
    assert launches[-1][2]["ALIGNED"] is False
    with pytest.raises(ValueError, match="multiples of aligned_to=8"):
        _triton.reorder_quantize_rows(
            x, offsets + 4, lengths - 4, slot_numel=slot, block_size=BS, bits=4, out=send,
            aligned_to=8,
        )  # fmt: skip
