"""The 8192-entry search table (qshard.quant._codetable) and the C encoder built on it equal
``bucketize`` on the fp32 midpoints: on strided bit patterns, on every midpoint and its two fp32
neighbours (the tie rule), and through the public quantizer with the C kernels on."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qshard.quant as Q
from qshard.quant import _codetable, _fastpath, _native_kernels

from ._helpers import FAST

needs_cc = pytest.mark.skipif(not _native_kernels.available(), reason="no C compiler")


def shipped_maps() -> list[torch.Tensor]:
    maps = [Q.linear_map(signed=s, total_bits=b) for s in (True, False) for b in range(2, 9)]
    maps += [
        Q.dynamic_map(signed=s, total_bits=b, max_exponent_bits=b - 1)
        for s in (True, False)
        for b in range(2, 9)
    ]
    maps += [Q.dynamic_map(signed=True, total_bits=8, max_exponent_bits=e) for e in (1, 3, 5)]
    return maps


def near_midpoints(code: torch.Tensor) -> torch.Tensor:
    """Every midpoint, its fp32 neighbours on both sides, +-0, +-1 and the codes themselves."""
    mids = (code[:-1] + code[1:]) / 2
    up = torch.nextafter(mids, torch.full_like(mids, 2.0))
    down = torch.nextafter(mids, torch.full_like(mids, -2.0))
    x = torch.cat([mids, up, down, code, torch.tensor([0.0, -0.0, 1.0, -1.0])])
    return x.clamp(-1.0, 1.0)


def strided_patterns(stride: int) -> torch.Tensor:
    v = torch.arange(0, 0x3F800001, stride, dtype=torch.int32).view(torch.float32)
    return torch.cat([v, -v])


def test_table_rule_equals_bucketize_for_every_shipped_map():
    x = torch.cat([strided_patterns(8191), torch.tensor([-0.0])])
    refused = []
    for code in shipped_maps():
        lut = _codetable.search_table(code)
        if lut is None:
            refused.append(code.tolist())
            continue
        mids = (code[:-1] + code[1:]) / 2
        for v in (x, near_midpoints(code)):
            assert torch.equal(_codetable.nearest_reference(v, lut), torch.bucketize(v, mids))
    # Only the 2-bit signed linear map (a duplicate zero: a midpoint at 0, inside the clamped
    # bucket 0) needs the byte-table encoder.
    assert refused == [[-1.0, 0.0, 0.0, 1.0]]


def test_table_refuses_maps_it_cannot_encode_exactly():
    # Two midpoints in one bucket (7 mantissa bits), and a midpoint in the clamped bucket 0.
    assert _codetable.search_table(torch.tensor([0.0, 0.5, 0.5000001, 0.5000002, 1.0])) is None
    assert _codetable.search_table(torch.tensor([-1.0, 0.0, 0.0, 1.0])) is None
    assert _codetable.search_table(torch.tensor([-1.0, -1e-12, 1e-12, 1.0])) is None


@needs_cc
def test_c_encoder_equals_bucketize_near_every_midpoint(monkeypatch):
    monkeypatch.setattr(_fastpath, "_native_enabled", True)
    monkeypatch.setattr(_fastpath, "_enabled", True)
    calls: list[str] = []
    real = _native_kernels.quantize_codebook
    monkeypatch.setattr(
        _native_kernels,
        "quantize_codebook",
        lambda *a: (calls.append("table"), real(*a))[1],
    )
    for code in shipped_maps():
        x = near_midpoints(code)
        x = x if bool(code[0] < 0) else x.abs()
        # +-1 first so that the block absmax is 1 and x / absmax == x exactly.
        x = torch.cat([torch.tensor([1.0]), x, strided_patterns(40009).clamp(code[0], 1.0)])
        for block in (x.numel(), 8, 7):
            codes, absmax = Q.quantize_codebook(x, code, block_size=block)
            blocks = -(-x.numel() // block)
            pad = blocks * block - x.numel()
            v = torch.cat([x, x.new_zeros(pad)]).view(blocks, block)
            a = v.abs().amax(1, keepdim=True)
            expect = torch.bucketize(v / torch.where(a > 0, a, 1.0), (code[:-1] + code[1:]) / 2)
            assert torch.equal(codes.long(), expect.view(-1)[: x.numel()])
            assert torch.equal(absmax, a.view(-1))
    assert len(calls) == 3 * (len(shipped_maps()) - 1)  # all but the 2-bit signed linear map


@needs_cc
@FAST
@given(
    seed=st.integers(0, 2**31 - 1),
    numel=st.integers(1, 3000),
    block_size=st.sampled_from([1, 3, 8, 16, 17, 256]),
    signed=st.booleans(),
)
def test_c_encoder_on_values_placed_on_and_beside_midpoints(seed, numel, block_size, signed):
    # Values that normalise to a midpoint or one ulp off it (the absmax of each block is a
    # code value 1.0 * scale with a power-of-two scale, so the division is exact).
    g = torch.Generator().manual_seed(seed)
    code = Q.dynamic_map(signed=signed)
    x = near_midpoints(code)
    x = x if signed else x.abs()
    x = x[torch.randint(0, x.numel(), (numel,), generator=g)]
    scale = 2.0 ** torch.randint(-20, 20, (1,), generator=g).item()
    x[::block_size] = 1.0
    x = x * scale
    saved = (_fastpath._enabled, _fastpath._native_enabled, _fastpath._min_numel)
    try:
        Q.set_fastpath(True, min_numel=0)
        _fastpath._native_enabled = True
        got = Q.quantize_codebook(x, code, block_size=block_size)
        Q.set_fastpath(False)
        ref = Q.quantize_codebook(x, code, block_size=block_size)
    finally:
        _fastpath._enabled, _fastpath._native_enabled, _fastpath._min_numel = saved
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_out_buffers_are_written_and_checked():
    x = torch.randn(1000)
    code = Q.dynamic_map(signed=True)
    codes = torch.empty(1000, dtype=torch.uint8)
    absmax = torch.empty(4)
    got = Q.quantize_codebook(x, code, block_size=256, out=(codes, absmax))
    ref = Q.quantize_codebook(x, code, block_size=256)
    assert got[0].data_ptr() == codes.data_ptr() and got[1].data_ptr() == absmax.data_ptr()
    assert torch.equal(codes, ref[0]) and torch.equal(absmax, ref[1])
    with pytest.raises(ValueError, match="absmax must be a contiguous"):
        Q.quantize_codebook(x, code, block_size=256, out=(codes, torch.empty(3)))
    with pytest.raises(ValueError, match="codes must be a contiguous"):
        Q.quantize_codebook(x, code, block_size=256, out=(codes.int(), absmax))


def test_code_map_caches_are_bounded():
    """A map per tensor (a user's learned or per-layer maps) evicts the oldest lookup tables
    instead of keeping 32 KiB per map forever; a map asked for again is there."""
    from qshard.quant import _fastpath

    keep = torch.linspace(-1.0, 1.0, 16)
    _codetable.search_table(keep)
    _fastpath.codebook_table(keep)
    for i in range(_codetable.MAX_TABLES + 8):
        code = torch.linspace(-1.0, 1.0, 16) * (1.0 - i * 1e-3)
        _codetable.search_table(code)
        _fastpath.codebook_table(code)
        _codetable.search_table(keep)  # asked for again: rebuilt if evicted
    sizes = len(_codetable._tables), len(_fastpath._tables)  # (no repr of 32 KiB keys)
    assert max(sizes) <= _codetable.MAX_TABLES, sizes
    assert _codetable.search_table(keep) is _codetable._tables[keep.numpy().tobytes()]
