"""Triton kernels for qgZ's fused steps (ZeRO++ §4.2), the GPU twin of the torch path in
`qshard.zeropp.reduce_scatter`.

* `reorder_quantize`: output slot t holds x[offsets[t] : offsets[t] + lengths[t]], zero-padded
  and block-quantized (`qgz_slots` gives qgZ's eq. 2 / Algorithm 2 order with per-partition
  padding). Reordering and padding happen in the load addresses, so the permuted, padded
  copy of the gradients is never written (the paper's "tensor slice reordering fused into
  quantization").
* `dequant_reduce_requant`: the middle hop. K peers' quantized copies of the same M blocks are
  dequantized, summed in fp32 in peer order 0..K-1, and requantized in one pass: each peer's
  codes are read once, the fp32 sum never touches memory (the paper's ~9x traffic cut).
* `dequant_reduce`: the last hop, the same without requantization, written in the output
  dtype (optionally divided or multiplied by a factor: ReduceOp.AVG / PREMUL_SUM).

* `*_rows`: the same three kernels reading and writing `zeropp._wire.RowCodec`'s wire rows
  ([fp32 scales | codes] per destination, one uint8 message) in place, which is what
  `zeropp.reduce_scatter` dispatches for CUDA tensors: hop 1 quantizes straight into the
  all-to-all's send buffer, the middle hop turns the received rows into the next hop's send
  rows, the last hop writes FSDP2's output. See [Note: qgZ row layout].

Block numerics are those of `qshard.quant.blockwise` (shared `_quantize_tile`, `_dequant_tile`,
`_store_codes`, `_load_codes`): the fp32 "scales" are block absmax values and a code's value is
(code * fl(1 / qmax)) * absmax (blockwise.py [Note: scale choice]), so int8 input codes need the
bits they were quantized with (`in_bits`; packed input is INT4). Each slice is quantized on its
own (ceil(S / block_size) blocks, last one zero-padded), so a block never straddles two
destinations.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from qshard._triton._blockwise import (
    _check_float_dtype,
    _dequant_tile,
    _geometry,
    _load_codes,
    _qmax,
    _quantize_tile,
    _seed,
    _store_codes,
)
from qshard._triton._common import (
    check_contiguous,
    check_device,
    kernel_view,
    load_f32,
    next_pow2,
    rows_per_program,
    store_as,
)

__all__ = [
    "dequant_reduce",
    "dequant_reduce_requant",
    "dequant_reduce_requant_rows",
    "dequant_reduce_rows",
    "qgz_slots",
    "reorder_quantize",
    "reorder_quantize_rows",
    "wire_row_bytes",
]


@triton.jit
def _block_addresses(rows, blocks_per_row, scale_stride, code_stride, WIDTH: tl.constexpr):
    """Where blocks `rows` live in a row layout: (scale index, code shift).

    [Note: qgZ row layout] Block r sits in row r // blocks_per_row at position
    r % blocks_per_row; a row's scales start `scale_stride` fp32 words after the previous
    row's, its codes `code_stride` code elements after. RowCodec's wire rows are
    [fp32 scales | codes] of row_bytes each, so both strides come from row_bytes; two separate
    tensors are the layout with one row (strides 0). The code shift is what to add to the
    codes pointer so that `_store_codes` / `_load_codes` of `_blockwise` (which address block
    r at r * WIDTH) land on the row layout: those helpers stay shared with the plain kernels.
    """
    r = rows.to(tl.int64)
    row = r // blocks_per_row
    local = r - row * blocks_per_row
    return row * scale_stride + local, row * code_stride + local * WIDTH - r * WIDTH


@triton.jit
def _reorder_quantize_kernel(
    x_ptr,
    offsets_ptr,
    lengths_ptr,
    codes_ptr,
    scales_ptr,
    blocks_per_slot,
    blocks_per_row,
    scale_stride,
    code_stride,
    seed,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    QMAX: tl.constexpr,
    PACK: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BF16: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    # Axis 0 walks the slot's blocks, axis 1 the slots: CUDA allows 2**31 - 1 programs on
    # axis 0 but 65535 on axis 1, and a slot can hold far more than 65535 tiles (slots are
    # world x pipeline stages).
    slot = tl.program_id(1)
    src = tl.load(offsets_ptr + slot)
    length = tl.load(lengths_ptr + slot)
    if ALIGNED:  # [Note: aligned slots]: 16-byte vector loads of the gradients
        src = tl.multiple_of(src, 8 if BF16 else 4)
        length = tl.multiple_of(length, 8 if BF16 else 4)
    local = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = local < blocks_per_slot
    within = local[:, None].to(tl.int64) * BS + cols[None, :]
    # Past `length` is the slot's zero padding: read as 0, so it never raises an absmax.
    valid = row_ok[:, None] & (cols[None, :] < BS) & (within < length)
    x = load_f32(x_ptr + src + within, valid, BF16)
    rows = slot * blocks_per_slot + local
    # Random stream indexed by the output position, so the draw does not depend on the order.
    idx = rows[:, None].to(tl.int64) * BS + cols[None, :]
    in_block = row_ok[:, None] & (cols[None, :] < BS)
    q, scale = _quantize_tile(x, in_block, QMAX, STOCHASTIC, seed, idx)
    WIDTH: tl.constexpr = BS // 2 if PACK else BS
    s_idx, c_shift = _block_addresses(rows, blocks_per_row, scale_stride, code_stride, WIDTH)
    _store_codes(codes_ptr + c_shift[:, None], q, rows, cols, row_ok, BS, PACK)
    tl.store(scales_ptr + s_idx, scale, mask=row_ok)


@triton.jit
def _dequant_sum(
    codes_ptr,
    scales_ptr,
    rows,
    row_ok,
    n_peers,
    scale_stride,
    code_stride,
    BS,
    BLOCK_N,
    PACK,
    QMAX: tl.constexpr,
):
    """fp32 sum over peers k = 0..K-1 (in that order) of (code * fl(1 / QMAX)) * absmax for a
    tile of blocks.

    Peer k's block r: scale at scales_ptr[k * scale_stride + r], codes at
    codes_ptr[k * code_stride + r * width] (one peer per row of the layout).
    """
    acc = tl.zeros((rows.shape[0], BLOCK_N), tl.float32)
    peer_codes = codes_ptr
    peer_scales = scales_ptr
    for k in range(n_peers):
        q = _load_codes(peer_codes, rows, row_ok, BS, BLOCK_N, PACK)
        absmax = tl.load(peer_scales + rows, mask=row_ok, other=0.0)
        term = _dequant_tile(q, absmax, QMAX)
        # ((t0 + t1) + t2) + ...: the reference's order, so the fp32 sum is bit-identical.
        acc = tl.where(k == 0, term, acc + term)
        # Advancing the 64-bit pointers avoids an int32 k * stride overflow.
        peer_codes += code_stride
        peer_scales += scale_stride
    return acc


@triton.jit
def _dequant_reduce_requant_kernel(
    codes_ptr,
    scales_ptr,
    out_codes_ptr,
    out_scales_ptr,
    n_peers,
    n_blocks,
    in_scale_stride,
    in_code_stride,
    out_blocks_per_row,
    out_scale_stride,
    out_code_stride,
    seed,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    PACK_IN: tl.constexpr,
    QMAX_IN: tl.constexpr,
    QMAX: tl.constexpr,
    PACK_OUT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_blocks
    acc = _dequant_sum(
        codes_ptr,
        scales_ptr,
        rows,
        row_ok,
        n_peers,
        in_scale_stride,
        in_code_stride,
        BS,
        BLOCK_N,
        PACK_IN,
        QMAX_IN,
    )
    valid = row_ok[:, None] & (cols[None, :] < BS)
    idx = rows[:, None].to(tl.int64) * BS + cols[None, :]
    q, scale = _quantize_tile(acc, valid, QMAX, STOCHASTIC, seed, idx)
    WIDTH_OUT: tl.constexpr = BS // 2 if PACK_OUT else BS
    s_idx, c_shift = _block_addresses(
        rows, out_blocks_per_row, out_scale_stride, out_code_stride, WIDTH_OUT
    )
    _store_codes(out_codes_ptr + c_shift[:, None], q, rows, cols, row_ok, BS, PACK_OUT)
    tl.store(out_scales_ptr + s_idx, scale, mask=row_ok)


@triton.jit
def _dequant_reduce_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    n_peers,
    n_blocks,
    numel,
    in_scale_stride,
    in_code_stride,
    factor,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    PACK: tl.constexpr,
    QMAX_IN: tl.constexpr,
    DIVIDE: tl.constexpr,
    MULTIPLY: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_blocks
    acc = _dequant_sum(
        codes_ptr,
        scales_ptr,
        rows,
        row_ok,
        n_peers,
        in_scale_stride,
        in_code_stride,
        BS,
        BLOCK_N,
        PACK,
        QMAX_IN,
    )
    if DIVIDE:
        acc = tl.math.div_rn(acc, tl.full(acc.shape, factor, tl.float32))
    if MULTIPLY:
        # The torch path's `sum * scale` (ReduceOp.AVG / PREMUL_SUM): one fp32 rounding.
        acc = acc * factor
    idx = rows[:, None].to(tl.int64) * BS + cols[None, :]
    valid = row_ok[:, None] & (cols[None, :] < BS) & (idx < numel)
    store_as(out_ptr + idx, acc, valid)


class _Blocks(NamedTuple):
    """Where a kernel finds blocks: see [Note: qgZ row layout]."""

    codes: torch.Tensor  # int8, or packed INT4 uint8; block 0's codes first
    scales: torch.Tensor  # fp32 block absmax; block 0's first
    per_row: int
    scale_stride: int
    code_stride: int


def _separate(codes: torch.Tensor, scales: torch.Tensor, n_blocks: int) -> _Blocks:
    """Codes (n_blocks, width) and scales (n_blocks,) as two tensors: a one-row layout."""
    return _Blocks(codes, scales, max(n_blocks, 1), 0, 0)


def _wire_width(block_size: int, bits: int) -> int:
    width = block_size * bits // 8
    if block_size * bits % 8 or width % 4:
        raise ValueError(
            f"wire rows need block_size * bits / 8 to be a multiple of 4 (fp32 scales stay "
            f"aligned); got block_size {block_size}, bits {bits}"
        )
    return width


def wire_row_bytes(blocks: int, *, block_size: int, bits: int) -> int:
    """Bytes of one wire row of `blocks` blocks: fp32 scales, then the codes (RowCodec)."""
    return blocks * (4 + _wire_width(block_size, bits))


def _wire_rows(buf: torch.Tensor, name: str, block_size: int, bits: int) -> _Blocks:
    """The blocks of RowCodec rows `buf` (rows, row_bytes) uint8: each row is its blocks'
    fp32 scales followed by their codes (INT4 packed, element 2k in the high nibble)."""
    if buf.dtype != torch.uint8 or buf.dim() != 2:
        raise ValueError(
            f"{name} must be uint8 wire rows (rows, row_bytes); got {buf.dtype} {tuple(buf.shape)}"
        )
    check_contiguous(name, buf)
    row_bytes = buf.shape[1]
    per_row, rest = divmod(row_bytes, 4 + _wire_width(block_size, bits))
    if rest:
        raise ValueError(
            f"{name} rows of {row_bytes} bytes are not whole blocks of {block_size} "
            f"{bits}-bit codes plus an fp32 scale"
        )
    flat = buf.view(-1)
    if buf.data_ptr() % 4:
        raise ValueError(f"{name} must start 4-byte aligned (its fp32 scales are read in place)")
    scales = flat.view(torch.float32)  # row_bytes is a multiple of 4 (see _wire_width)
    codes = flat[4 * per_row :] if per_row else flat
    return _Blocks(
        codes if bits == 4 else codes.view(torch.int8), scales, per_row, row_bytes // 4, row_bytes
    )


def qgz_slots(
    *,
    nodes: int,
    ranks_per_node: int,
    stages: int,
    size: int,
    block_size: int,
    frame: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where qgZ's send slots come from: (offsets, lengths, slot_numel).

    The gradient buffer is `nodes * ranks_per_node` partitions of `size` elements (rank-major).
    Each partition is padded to a multiple of `stages * block_size` at least `frame` long
    (default `size`; qgZ frames its rows for the unit's size, [Note: qgZ frames at the unit's
    size]) and cut into `stages` sub-slices of `slot_numel`; slot (k, d, n) (k-major, the
    paper's eq. 2 generalised by Algorithm 2, as `qshard.zeropp.reduce_scatter` lays it out)
    takes sub-slice k of partition n * ranks_per_node + d. `lengths` < slot_numel where the
    padding starts.
    """
    unit = stages * block_size
    slot_numel = -(-max(size, frame or 0) // unit) * unit // stages
    k = torch.arange(stages).view(stages, 1, 1)
    d = torch.arange(ranks_per_node).view(1, ranks_per_node, 1)
    n = torch.arange(nodes).view(1, 1, nodes)
    start_in_partition = k * slot_numel
    offsets = (n * ranks_per_node + d) * size + start_in_partition
    lengths = (size - start_in_partition).clamp(0, slot_numel)
    offsets = torch.where(lengths > 0, offsets, torch.zeros_like(offsets))
    shape = (stages, ranks_per_node, nodes)
    return (
        offsets.expand(shape).reshape(-1).contiguous(),
        lengths.expand(shape).reshape(-1).contiguous(),
        slot_numel,
    )


def _vector(x: torch.Tensor) -> int:
    """Elements of `x` in a 16-byte vector (the width [Note: aligned slots] asks for)."""
    return 16 // x.element_size()


def _check_slots(x, offsets, lengths, slot_numel, aligned_to: int = 1) -> int:
    """Host-side validation (one device sync; trusted callers skip it). Returns the vector
    width ([Note: aligned slots]) every offset and length is a multiple of (1 if not), and
    refuses a promised `aligned_to` they break."""
    if lengths.shape != offsets.shape:
        raise ValueError(
            f"lengths {tuple(lengths.shape)} must match offsets {tuple(offsets.shape)}"
        )
    if not offsets.numel():
        return _vector(x)
    vec = _vector(x)
    out_of_range = ((offsets < 0) | (lengths < 0) | (lengths > slot_numel)).any()
    past_end = (offsets + lengths).max() > x.numel()
    promise = max(int(aligned_to), 1)
    broken = ((offsets % promise) | (lengths % promise)).ne(0).any()
    unaligned = ((offsets % vec) | (lengths % vec)).ne(0).any()
    out_of_range, past_end, broken, unaligned = torch.stack(
        [out_of_range, past_end, broken, unaligned]
    ).tolist()  # one sync for all four
    if out_of_range:
        raise ValueError(f"need offsets >= 0 and 0 <= lengths <= slot_numel={slot_numel}")
    if past_end:
        raise ValueError(f"a slot reads past the end of x ({x.numel()} elements)")
    if broken:
        raise ValueError(f"offsets and lengths must be multiples of aligned_to={aligned_to}")
    return 1 if unaligned else vec


def _reorder_geometry(block_size: int, pack: bool) -> tuple[int, int, int]:
    """(padded block width, blocks per program, warps) of the reorder+quantize launch. Packed
    INT4 rows: 4096-element programs of 4 warps. On an H200 (2 nodes x 4 ranks, 268M fp32
    elements) they took 0.390 ms vs 0.43 at the quantize kernels' geometry (2048 / 4), 0.42 at
    1024 / 2 and 0.42 at 8192 / 8: 0.73-0.74 of copy bandwidth vs 0.67, in three sweeps
    (benchmarks/gpu/sweep.py). INT8 rows (not swept) take the quantize kernels' geometry."""
    if not pack:
        return _geometry(block_size)
    return next_pow2(max(block_size, 2)), rows_per_program(block_size, 4096), 4


# [Note: aligned slots] The slots start at runtime offsets, so the compiler cannot know that a
# row of gradients starts on a 16-byte boundary: without a hint it loads them one fp32 at a
# time (compiled for sm_90: no vector load, a 106 KB cubin; with the hint 16-byte loads and
# 45 KB, as the plain quantize kernel, which reads at copy bandwidth on an H200 where this one
# read at 0.42 of it). ALIGNED tells it so when every offset and length is a multiple of a
# 16-byte vector's elements and x starts on one: checked on the host (`_check_slots`) or
# promised by a trusted caller (`aligned_to`; zeropp's slots are multiples of
# gcd(partition size, slot)).
def _launch_reorder_quantize(
    x, offsets, lengths, slot_numel, block_size, qmax, pack, rounding, generator, dst: _Blocks,
    aligned_to: int = 1,
) -> None:  # fmt: skip
    n_slots = offsets.numel()
    blocks_per_slot = -(-slot_numel // block_size)
    if n_slots * blocks_per_slot == 0:
        return
    block_n, rows, warps = _reorder_geometry(block_size, pack)
    xk, bf16 = kernel_view(x)
    if n_slots > 65535:
        raise ValueError(f"reorder_quantize takes at most 65535 slots (CUDA's grid); got {n_slots}")
    _reorder_quantize_kernel[(triton.cdiv(blocks_per_slot, rows), n_slots)](
        xk,
        offsets.to(torch.int64).contiguous(),
        lengths.to(torch.int64).contiguous(),
        dst.codes,
        dst.scales,
        blocks_per_slot,
        dst.per_row,
        dst.scale_stride,
        dst.code_stride,
        _seed(rounding, generator),
        BS=block_size,
        BLOCK_N=block_n,
        ROWS=rows,
        QMAX=qmax,
        PACK=pack,
        STOCHASTIC=rounding == "stochastic",
        BF16=bf16,
        ALIGNED=aligned_to % _vector(x) == 0 and x.data_ptr() % 16 == 0,
        num_warps=warps,
        enable_fp_fusion=False,
    )


def reorder_quantize(
    x: torch.Tensor,
    offsets: torch.Tensor,
    *,
    slot_numel: int,
    lengths: torch.Tensor | None = None,
    block_size: int,
    bits: int = 4,
    pack: bool | None = None,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather slots of `slot_numel` elements from flat `x` and block-quantize them in one pass.

    Slot t reads x[offsets[t] : offsets[t] + lengths[t]] (lengths default to slot_numel) and
    is zero-padded to slot_numel, itself padded to whole blocks. `qgz_slots` gives qgZ's
    offsets. Returns codes (T * blocks_per_slot, block_size) int8, or packed uint8
    (.., block_size // 2) (default for bits=4), and fp32 scales (T * blocks_per_slot,).
    """
    qmax = _qmax(bits)
    pack = bits == 4 if pack is None else pack
    if pack and (bits != 4 or block_size % 2):
        raise ValueError(f"pack needs bits=4 and an even block_size; got {bits}, {block_size}")
    check_contiguous("x", x)
    check_device(x, offsets)
    if lengths is None:
        lengths = torch.full_like(offsets, slot_numel)
    check_device(x, lengths)
    aligned_to = _check_slots(x, offsets, lengths, slot_numel)
    n_blocks = offsets.numel() * -(-slot_numel // block_size)
    width = block_size // 2 if pack else block_size
    codes = torch.empty(
        (n_blocks, width), dtype=torch.uint8 if pack else torch.int8, device=x.device
    )
    scales = torch.empty((n_blocks,), dtype=torch.float32, device=x.device)
    _launch_reorder_quantize(
        x,
        offsets,
        lengths,
        slot_numel,
        block_size,
        qmax,
        pack,
        rounding,
        generator,
        _separate(codes, scales, n_blocks),
        aligned_to,
    )
    return codes, scales


def reorder_quantize_rows(
    x: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    *,
    slot_numel: int,
    block_size: int,
    bits: int,
    out: torch.Tensor,
    check: bool = True,
    aligned_to: int = 1,
) -> torch.Tensor:
    """`reorder_quantize` written straight into wire rows `out` (rows, row_bytes) uint8.

    The slots' blocks fill the rows in order (slot t's blocks, then slot t+1's, ...), each
    row holding row_bytes / (4 + code bytes per block) blocks as RowCodec lays them out:
    [fp32 scales | codes]. So qgZ's first hop writes the very buffer its all-to-all sends,
    byte for byte what `RowCodec.encode` of zeropp's reordered (D, N * slot) rows would be.
    `check=False` skips the host-side slot validation (a device sync) for trusted slots;
    `aligned_to`: such a caller's promise that every offset and length is a multiple of it (it
    picks 16-byte loads, [Note: aligned slots]; the check finds that by itself, and refuses a
    broken promise).
    """
    dst = _wire_rows(out, "out", block_size, bits)
    check_contiguous("x", x)
    check_device(x, offsets, lengths, out)
    if check:
        aligned_to = _check_slots(x, offsets, lengths, slot_numel, aligned_to)
    n_blocks = offsets.numel() * -(-slot_numel // block_size)
    if n_blocks != out.shape[0] * dst.per_row:
        raise ValueError(
            f"{n_blocks} blocks do not fill {out.shape[0]} rows of {dst.per_row} blocks"
        )
    _launch_reorder_quantize(
        x, offsets, lengths, slot_numel, block_size, _qmax(bits), bits == 4, "nearest", None, dst,
        aligned_to,
    )  # fmt: skip
    return out


def _peer_layout(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int
) -> tuple[int, int, bool]:
    check_contiguous("codes", codes)
    check_device(codes, scales)
    if codes.dim() != 3:
        raise ValueError(f"codes must be (peers, n_blocks, width); got shape {tuple(codes.shape)}")
    n_peers, n_blocks, width = codes.shape
    pack = codes.dtype == torch.uint8
    if width != (block_size // 2 if pack else block_size):
        raise ValueError(
            f"codes width {width} does not fit block_size {block_size} (packed={pack})"
        )
    if scales.shape != (n_peers, n_blocks) or scales.dtype != torch.float32:
        raise ValueError(
            f"scales must be fp32 ({n_peers}, {n_blocks}); got {scales.dtype} {tuple(scales.shape)}"
        )
    return n_peers, n_blocks, pack


def _peers(codes: torch.Tensor, scales: torch.Tensor, block_size: int):
    """(n_peers, n_blocks, pack, layout) of K peers' separate (codes, scales) tensors."""
    n_peers, n_blocks, pack = _peer_layout(codes, scales, block_size)
    src = _Blocks(codes, scales.contiguous(), n_blocks, n_blocks, n_blocks * codes.shape[2])
    return n_peers, n_blocks, pack, src


def _in_qmax(pack: bool, in_bits: int | None) -> int:
    """qmax of K peers' input codes: packed codes are INT4; int8 codes need their bits."""
    if pack:
        if in_bits not in (None, 4):
            raise ValueError(f"packed uint8 codes are INT4; got in_bits={in_bits}")
        return 7
    if in_bits is None:
        raise ValueError(
            "int8 codes need in_bits=8 or in_bits=4 (the bits they were quantized with): a "
            "code's value is code / qmax * absmax"
        )
    return _qmax(in_bits)


def _launch_dequant_reduce_requant(
    src: _Blocks,
    n_peers,
    n_blocks,
    block_size,
    pack_in,
    qmax_in,
    qmax,
    pack_out,
    rounding,
    generator,
    dst: _Blocks,
) -> None:
    block_n, rows, warps = _geometry(block_size, pack_out)
    _dequant_reduce_requant_kernel[(triton.cdiv(n_blocks, rows),)](
        src.codes,
        src.scales,
        dst.codes,
        dst.scales,
        n_peers,
        n_blocks,
        src.scale_stride,
        src.code_stride,
        dst.per_row,
        dst.scale_stride,
        dst.code_stride,
        _seed(rounding, generator),
        BS=block_size,
        BLOCK_N=block_n,
        ROWS=rows,
        PACK_IN=pack_in,
        QMAX_IN=qmax_in,
        QMAX=qmax,
        PACK_OUT=pack_out,
        STOCHASTIC=rounding == "stochastic",
        num_warps=warps,
        enable_fp_fusion=False,
    )


def dequant_reduce_requant(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    block_size: int,
    bits: int = 4,
    in_bits: int | None = None,
    pack: bool | None = None,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum K peers' quantized blocks in fp32 and requantize the sum to `bits`, in one pass.

    `codes`: (K, M, block_size) int8 (then `in_bits`, the bits they were quantized with, is
    required) or (K, M, block_size // 2) packed INT4; `scales`: fp32 block absmax (K, M).
    Returns (codes (M, ...), absmax (M,)) in the layout of `reorder_quantize`.
    """
    qmax = _qmax(bits)
    pack_out = bits == 4 if pack is None else pack
    if pack_out and (bits != 4 or block_size % 2):
        raise ValueError(f"pack needs bits=4 and an even block_size; got {bits}, {block_size}")
    n_peers, n_blocks, pack_in, src = _peers(codes, scales, block_size)
    qmax_in = _in_qmax(pack_in, in_bits)
    width = block_size // 2 if pack_out else block_size
    out_codes = torch.empty(
        (n_blocks, width), dtype=torch.uint8 if pack_out else torch.int8, device=codes.device
    )
    out_scales = torch.empty((n_blocks,), dtype=torch.float32, device=codes.device)
    if n_blocks == 0 or n_peers == 0:
        out_codes.zero_()
        out_scales.zero_()
        return out_codes, out_scales
    _launch_dequant_reduce_requant(
        src,
        n_peers,
        n_blocks,
        block_size,
        pack_in,
        qmax_in,
        qmax,
        pack_out,
        rounding,
        generator,
        _separate(out_codes, out_scales, n_blocks),
    )
    return out_codes, out_scales


def dequant_reduce_requant_rows(
    recv: torch.Tensor, *, block_size: int, bits: int, out: torch.Tensor
) -> torch.Tensor:
    """qgZ's middle hop on wire rows: K received rows (K, row_bytes) of M blocks each, one per
    peer, are dequantized, summed in fp32 in peer order and requantized into the wire rows
    `out` (R, row_bytes'), which take the M blocks in order (M / R per row): the send buffer
    of the next all-to-all. Byte for byte `RowCodec.encode(RowCodec.decode(recv).sum(0))`
    cut in R rows."""
    src = _wire_rows(recv, "recv", block_size, bits)
    dst = _wire_rows(out, "out", block_size, bits)
    check_device(recv, out)
    n_peers, n_blocks = recv.shape[0], src.per_row
    if n_blocks != out.shape[0] * dst.per_row:
        raise ValueError(
            f"{n_blocks} received blocks per peer do not fill {out.shape[0]} rows of "
            f"{dst.per_row} blocks"
        )
    if n_blocks == 0:
        return out
    if n_peers == 0:
        return out.zero_()
    pack, qmax = bits == 4, _qmax(bits)
    _launch_dequant_reduce_requant(
        src, n_peers, n_blocks, block_size, pack, qmax, qmax, pack, "nearest", None, dst
    )
    return out


def _launch_dequant_reduce(
    src: _Blocks, n_peers, n_blocks, block_size, pack, qmax_in, out, total, divisor, scale
) -> None:
    block_n, rows, warps = _geometry(block_size)
    if divisor is not None and scale is not None:
        raise ValueError("give divisor or scale, not both")
    factor = divisor if divisor is not None else scale
    _dequant_reduce_kernel[(triton.cdiv(n_blocks, rows),)](
        src.codes,
        src.scales,
        out,
        n_peers,
        n_blocks,
        total,
        src.scale_stride,
        src.code_stride,
        1.0 if factor is None else float(factor),
        BS=block_size,
        BLOCK_N=block_n,
        ROWS=rows,
        PACK=pack,
        QMAX_IN=qmax_in,
        DIVIDE=divisor is not None,
        MULTIPLY=scale is not None,
        num_warps=warps,
        enable_fp_fusion=False,
    )


def _reduce_out(out, total, dtype, device) -> torch.Tensor:
    if out is None:
        _check_float_dtype(dtype, "dtype")
        return torch.empty((total,), dtype=dtype, device=device)
    if out.numel() != total or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of {total} elements (its dtype wins)")
    _check_float_dtype(out.dtype, "out")
    if out.device != device:
        raise ValueError(f"out is on {out.device}; the codes are on {device}")
    return out


def dequant_reduce(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    block_size: int,
    in_bits: int | None = None,
    dtype: torch.dtype = torch.float32,
    numel: int | None = None,
    out: torch.Tensor | None = None,
    divisor: float | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Sum K peers' quantized blocks in fp32 (peer order), optionally `/ divisor` or
    `* scale` (fp32, one rounding), cast. Codes and `scales` (block absmax) as in
    `dequant_reduce_requant` (int8 codes need `in_bits`).

    Returns flat (numel,) (default M * block_size; `numel` drops the padding of the last
    block), written into `out` when given (its dtype wins).
    """
    n_peers, n_blocks, pack, src = _peers(codes, scales, block_size)
    qmax_in = _in_qmax(pack, in_bits)
    total = n_blocks * block_size if numel is None else numel
    if total > n_blocks * block_size:
        raise ValueError(f"numel={total} exceeds the {n_blocks * block_size} quantized elements")
    out = _reduce_out(out, total, dtype, codes.device)
    if n_peers == 0:
        return out.zero_()
    if total == 0:
        return out
    _launch_dequant_reduce(
        src, n_peers, n_blocks, block_size, pack, qmax_in, out, total, divisor, scale
    )
    return out


def dequant_reduce_rows(
    recv: torch.Tensor,
    *,
    block_size: int,
    bits: int,
    out: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """qgZ's last hop on wire rows: K received rows (K, row_bytes) of M blocks, summed in fp32
    in peer order, times `scale` when given (fp32), cast into flat contiguous `out`, which
    keeps the first out.numel() <= M * block_size elements (the rest is padding)."""
    src = _wire_rows(recv, "recv", block_size, bits)
    check_device(recv, out)
    n_peers, n_blocks = recv.shape[0], src.per_row
    total = out.numel()
    if total > n_blocks * block_size:
        raise ValueError(f"out has {total} elements, more than the {n_blocks * block_size} sent")
    _reduce_out(out, total, out.dtype, out.device)
    if n_peers == 0:
        return out.zero_()
    if total == 0:
        return out
    _launch_dequant_reduce(
        src, n_peers, n_blocks, block_size, bits == 4, _qmax(bits), out, total, None, scale
    )
    return out
