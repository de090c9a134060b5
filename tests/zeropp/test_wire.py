"""RowCodec's wire rows written in place (the quant core's kernels straight into each row) are
the bytes of the plain composition they replace: block-quantize, pack INT4 with torch ops,
concatenate scales and codes; and decode back to the same values, for every input and output
dtype, special values included (zero, subnormal, NaN and Inf blocks, -0.0)."""

from __future__ import annotations

import pytest
import torch

from qshard.quant import _native_kernels, blockwise
from qshard.zeropp._common import sum_rows
from qshard.zeropp._wire import RowCodec, _byte_rows


def _composed_encode(codec: RowCodec, x: torch.Tensor) -> torch.Tensor:
    rows, m = x.shape
    bs = codec.block_size
    codes, scales = blockwise.quantize_blocks(x.reshape(-1, bs), bits=codec.bits)
    scale_bytes = scales.view(rows, m // bs).view(torch.uint8)
    if codec.bits == 4:
        code_bytes = blockwise.pack_int4(codes).view(rows, m // 2)
    else:
        code_bytes = codes.view(torch.uint8).view(rows, m)
    return torch.cat([scale_bytes, code_bytes], dim=1)


def _composed_decode(codec: RowCodec, buf: torch.Tensor, m: int, dtype) -> torch.Tensor:
    rows, bs = buf.shape[0], codec.block_size
    nb = m // bs
    scales = buf[:, : 4 * nb].contiguous().view(torch.float32).reshape(-1)
    code_bytes = buf[:, 4 * nb :].contiguous()
    if codec.bits == 4:
        codes = blockwise.unpack_int4(code_bytes.view(-1))
    else:
        codes = code_bytes.view(torch.int8)
    values = blockwise.dequantize_blocks(codes.view(-1, bs), scales, bits=codec.bits, dtype=dtype)
    return values.view(rows, m)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


def _rows(rows: int, m: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(rows, m, generator=torch.Generator().manual_seed(rows * m))
    x[0, :64] = 0.0  # an all-zero block with block_size 64
    x[0, 70] = -0.0
    x[0, 130] = float("nan")
    x[-1, -64:] *= 1e-40  # subnormals
    if rows > 1:
        x[1, 200] = float("inf")
        x[1, 270] = float("-inf")
    return x.to(dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "m"), [(1, 384), (2, 1024), (4, 64 * 1024)])
@pytest.mark.parametrize("fastpath", [True, False])
def test_in_place_rows_equal_composition(bits, dtype, rows, m, fastpath):
    from qshard.quant import _fastpath

    codec = RowCodec(bits=bits, block_size=64)
    x = _rows(rows, m, dtype)
    was = _fastpath.fastpath_enabled()
    _fastpath.set_fastpath(fastpath)  # both the C kernels and the reference path
    try:
        buf = codec.encode(x)
        assert _bits_equal(buf, _composed_encode(codec, x))
        for out_dtype in (torch.float32, torch.bfloat16):
            got = codec.decode(buf, m, dtype=out_dtype)
            assert _bits_equal(got, _composed_decode(codec, buf, m, out_dtype))
    finally:
        _fastpath.set_fastpath(was)


@pytest.mark.parametrize("sizes", [(5,), (1, 64, 65, 300, 7), (128, 128), (0, 3, 0, 70)])
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_qwz_slots_equal_index_layout(sizes, bits):
    """qwZ's padded row ([Note: qwZ block layout]) written slot by slot == the index_copy of
    every element into a zero row, then encoded; decoding slot by slot == decoding the row,
    then the index_select back; padding is never written."""
    from qshard.zeropp.all_gather import _padded_layout

    bs, n, world = 64, sum(sizes), 3
    padded, slots = _padded_layout(sizes, bs)
    starts, offset = [], 0
    for size in sizes:
        starts.append(torch.arange(offset, offset + size))
        offset += -(-size // bs) * bs
    assert padded == (offset if len(sizes) > 1 else -(-n // bs) * bs)
    positions = torch.cat(starts) if len(sizes) > 1 else torch.arange(n)
    codec = RowCodec(bits=bits, block_size=bs)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    row = x.new_zeros(1, padded).index_copy_(1, positions, x.view(1, n))
    assert _bits_equal(codec.encode_slots(x, slots, 1), codec.encode(row))
    bufs = torch.cat([codec.encode(row * (g + 1)) for g in range(world)])
    want = codec.decode(bufs, padded).index_select(1, positions)
    out = torch.full((world, n + 5), float("nan"))
    codec.decode_slots(bufs, padded, list(out[:, 2 : 2 + n]), slots)
    assert torch.equal(out[:, 2 : 2 + n], want)
    assert out[:, :2].isnan().all() and out[:, 2 + n :].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
def test_sum_rows_adds_in_row_order(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    for m in (256, 1001):  # a wire row's length, and a ragged one
        x = (torch.randn(rows, m, generator=g) * 100).to(dtype)
        x[:, :3] = -0.0
        before = x.clone()
        want = x[0].float().clone()
        for r in range(1, rows):
            want = want + x[r].float()  # fp32, one row at a time
        got = sum_rows(x)
        assert got.dtype == torch.float32 and torch.equal(got, want)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # zero signs too
        out = torch.full((m,), float("nan"))
        assert sum_rows(x, out=out) is out and torch.equal(out, want)
        assert torch.equal(x.view(torch.uint8), before.view(torch.uint8))  # rows not written
        if m % 256 == 0:  # torch's reduction adds whole vectors in the same order
            assert torch.equal(got, x.float().sum(dim=0))


def _special(n: int, seed: int) -> torch.Tensor:
    """Values with every special case the quantizer and the sums must carry alike."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 10
    x[:64] = 0.0  # an all-zero block (block_size 64)
    x[70] = -0.0
    x[130] = float("nan")
    x[200] = float("inf")
    x[-64:] *= 1e-40  # subnormals
    return x


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fastpath", [True, False])
def test_fused_rows_equal_composition(bits, fastpath):
    """[Note: fused wire rows]: encode_slots / reduce / reduce_encode give the bytes and values
    of the encode / decode / sum_rows composition they fuse, with the C kernels and without
    (the reference), for ragged, empty and all-padding slots and NaN / Inf / zero blocks."""
    from qshard.quant import _fastpath

    bs = 64
    codec = RowCodec(bits=bits, block_size=bs)
    src = _special(1000, bits)
    # 2 rows of 3 slots of 256: full, ragged (ends mid-block), empty (all padding)
    slots = [
        (0, 256, 256),
        (300, 77, 256),
        (999, 0, 256),
        (256, 256, 256),
        (999, 1, 256),
        (5, 0, 256),
    ]
    rows = torch.zeros(2, 768)
    pos = 0
    for start, length, padded in slots:
        rows.view(-1)[pos : pos + length] = src[start : start + length]
        pos += padded
    was = _fastpath.fastpath_enabled()
    _fastpath.set_fastpath(fastpath)
    try:
        assert _bits_equal(codec.encode_slots(src, slots, 2), codec.encode(rows))
        for n_rows in (1, 2, 3, 4):
            m = 768
            buf = torch.cat(
                [codec.encode(_special(m, r).view(1, m) * (r + 1)) for r in range(n_rows)]
            )
            want = sum_rows(codec.decode(buf, m))
            got = codec.reduce(buf, m)
            assert _bits_equal(got, want)
            out = torch.full((m,), 7.0)
            assert codec.reduce(buf, m, out=out) is out and _bits_equal(out, want)
            for split in (1, 3):
                assert _bits_equal(
                    codec.reduce_encode(buf, m, split), codec.encode(want.view(split, -1))
                )
    finally:
        _fastpath.set_fastpath(was)


@pytest.mark.parametrize("bits", [None, 4, 8])
@pytest.mark.parametrize("trailer", [8, 3])
@pytest.mark.parametrize("fastpath", [True, False])
def test_rows_with_a_trailer_equal_contiguous_rows(bits, trailer, fastpath):
    """[Note: a trailer after each row]: encode into the leading columns of a wider buffer,
    then decode / reduce / reduce_encode of those columns, give the contiguous rows' bytes and
    values, and never touch the trailer (an aligned one of 8 bytes: the in-place paths; an
    unaligned one of 3: the copying paths)."""
    from qshard.quant import _fastpath

    codec = RowCodec(bits=bits, block_size=64)
    rows, m = 3, 768
    x = torch.cat([_special(m, r).view(1, m) * (r + 1) for r in range(rows)])
    was = _fastpath.fastpath_enabled()
    _fastpath.set_fastpath(fastpath)
    try:
        plain = codec.encode(x)
        rb = codec.row_bytes(m)
        wide = torch.full((rows, rb + trailer), 0xA5, dtype=torch.uint8)
        cols = wide[:, :rb]
        assert codec.encode(x, out=cols) is cols
        assert torch.equal(cols, plain)
        # the aligned trailer is served in place (the C kernels where they run), not copied
        assert _byte_rows(cols) == (trailer % 4 == 0)
        if bits is not None and fastpath and trailer % 4 == 0:
            assert codec._fused(None, cols) == _native_kernels.available()
        assert bool((wide[:, rb:] == 0xA5).all())  # the trailer is the caller's
        assert _bits_equal(codec.decode(cols, m), codec.decode(plain, m))
        slots = [(0, 256, 256), (300, 77, 256), (999, 1, 256)]
        got, want = ([torch.zeros(1000) for _ in range(rows)] for _ in range(2))
        codec.decode_slots(cols, m, got, slots)
        codec.decode_slots(plain, m, want, slots)
        assert all(_bits_equal(g, w) for g, w in zip(got, want, strict=True))
        if bits is not None:
            assert _bits_equal(codec.reduce(cols, m), codec.reduce(plain, m))
            assert _bits_equal(codec.reduce_encode(cols, m, 3), codec.reduce_encode(plain, m, 3))
        with pytest.raises(ValueError, match="out must be a uint8 tensor of shape"):
            codec.encode(x, out=wide)
    finally:
        _fastpath.set_fastpath(was)


def test_fused_rows_refuse_bad_layouts():
    codec = RowCodec(bits=4, block_size=64)
    src = torch.randn(100)
    with pytest.raises(ValueError, match="does not fit"):
        codec.encode_slots(src, [(50, 64, 64)], 1)  # reads past the end
    with pytest.raises(ValueError, match="does not fit"):
        codec.encode_slots(src, [(0, 10, 60)], 1)  # padding not whole blocks
    with pytest.raises(ValueError, match="equal rows"):
        codec.encode_slots(src, [(0, 10, 64)] * 3, 5)
    with pytest.raises(ValueError, match="straddles"):
        codec.encode_slots(src, [(0, 10, 64), (0, 10, 128), (0, 10, 64)], 2)
    buf = codec.encode(torch.randn(2, 128))
    with pytest.raises(ValueError, match="fp32"):
        codec.reduce(buf, 128, out=torch.empty(128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="equal rows"):
        codec.reduce_encode(buf, 128, 3)
    outs = [torch.empty(100), torch.empty(100)]
    with pytest.raises(ValueError, match="does not fit"):
        codec.decode_slots(buf, 128, outs, [(0, 64, 64), (64, 64, 64)])  # 128 > 100
    with pytest.raises(ValueError, match="add up"):
        codec.decode_slots(buf, 128, outs, [(0, 64, 64)])
    with pytest.raises(ValueError, match="do not hold"):  # rows of another length
        codec.reduce(buf, 256)
    with pytest.raises(TypeError, match="uint8"):
        codec.reduce(buf.view(torch.float32), 128)


@pytest.mark.parametrize("bits", [None, 4, 8])
def test_qgz_stage_slots_equal_reorder_layout(bits):
    """qgZ's hop-1 send rows from the slots of `_stage_slots`, quantized in place, are the bytes
    of `encode` of `reorder_slices`' layout, for every topology, stage count and ragged size
    (all-padding stages and partitions shorter than a block included)."""
    from qshard.zeropp.reduce_scatter import _stage_slots, reorder_slices

    bs = 8
    codec = RowCodec(bits=bits, block_size=bs)
    unit_blocks = 1 if bits is None else 4
    for nodes, per_node in ((1, 2), (2, 2), (2, 1), (3, 2), (2, 3)):
        world = nodes * per_node
        for size in (1, 7, 32, 33, 100):
            for stages in (1, 2, 3):
                unit = stages * unit_blocks * bs
                padded = -(-size // unit) * unit
                sub = padded // stages
                g = torch.Generator().manual_seed(world * 1000 + size * 10 + stages)
                x = torch.randn(world * size, generator=g)
                laid = reorder_slices(x.view(world, size), nodes, per_node, stages, padded)
                for k, slots in enumerate(_stage_slots(nodes, per_node, stages, size, sub)):
                    want = codec.encode(laid[k].reshape(per_node, nodes * sub))
                    got = codec.encode_slots(x, slots, per_node)
                    assert _bits_equal(got, want), (nodes, per_node, size, stages, k)
