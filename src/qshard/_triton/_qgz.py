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
  dtype (optionally divided by a factor, for ReduceOp.AVG).

Block numerics are those of `qshard.quant.blockwise` (shared `_quantize_tile`). Each slice is
quantized on its own (ceil(S / block_size) blocks, last one zero-padded), so a block never
straddles two destinations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qshard._triton._blockwise import (
    _geometry,
    _load_codes,
    _qmax,
    _quantize_tile,
    _seed,
    _store_codes,
)
from qshard._triton._common import check_contiguous, check_device, kernel_view, load_f32, store_as

__all__ = ["dequant_reduce", "dequant_reduce_requant", "qgz_slots", "reorder_quantize"]


@triton.jit
def _reorder_quantize_kernel(
    x_ptr,
    offsets_ptr,
    lengths_ptr,
    codes_ptr,
    scales_ptr,
    blocks_per_slot,
    seed,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    QMAX: tl.constexpr,
    PACK: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BF16: tl.constexpr,
):
    slot = tl.program_id(0)
    src = tl.load(offsets_ptr + slot)
    length = tl.load(lengths_ptr + slot)
    local = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
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
    _store_codes(codes_ptr, q, rows, cols, row_ok, BS, PACK)
    tl.store(scales_ptr + rows, scale, mask=row_ok)


@triton.jit
def _dequant_sum(codes_ptr, scales_ptr, rows, row_ok, n_peers, n_blocks, BS, BLOCK_N, PACK, WIDTH):
    """fp32 sum over peers k = 0..K-1 (in that order) of code * scale for a tile of blocks."""
    acc = tl.zeros((rows.shape[0], BLOCK_N), tl.float32)
    peer_codes = codes_ptr
    peer_scales = scales_ptr
    for k in range(n_peers):
        q = _load_codes(peer_codes, rows, row_ok, BS, BLOCK_N, PACK)
        scale = tl.load(peer_scales + rows, mask=row_ok, other=0.0)
        term = q.to(tl.float32) * scale[:, None]
        # ((t0 + t1) + t2) + ...: the reference's order, so the fp32 sum is bit-identical.
        acc = tl.where(k == 0, term, acc + term)
        # Advancing the 64-bit pointers avoids an int32 k * n_blocks * WIDTH overflow.
        peer_codes += n_blocks * WIDTH
        peer_scales += n_blocks
    return acc


@triton.jit
def _dequant_reduce_requant_kernel(
    codes_ptr,
    scales_ptr,
    out_codes_ptr,
    out_scales_ptr,
    n_peers,
    n_blocks,
    seed,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    PACK_IN: tl.constexpr,
    WIDTH_IN: tl.constexpr,
    QMAX: tl.constexpr,
    PACK_OUT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_blocks
    acc = _dequant_sum(
        codes_ptr, scales_ptr, rows, row_ok, n_peers, n_blocks, BS, BLOCK_N, PACK_IN, WIDTH_IN
    )
    valid = row_ok[:, None] & (cols[None, :] < BS)
    idx = rows[:, None].to(tl.int64) * BS + cols[None, :]
    q, scale = _quantize_tile(acc, valid, QMAX, STOCHASTIC, seed, idx)
    _store_codes(out_codes_ptr, q, rows, cols, row_ok, BS, PACK_OUT)
    tl.store(out_scales_ptr + rows, scale, mask=row_ok)


@triton.jit
def _dequant_reduce_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    n_peers,
    n_blocks,
    numel,
    divisor,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    PACK: tl.constexpr,
    WIDTH: tl.constexpr,
    DIVIDE: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_blocks
    acc = _dequant_sum(
        codes_ptr, scales_ptr, rows, row_ok, n_peers, n_blocks, BS, BLOCK_N, PACK, WIDTH
    )
    if DIVIDE:
        acc = tl.math.div_rn(acc, tl.full(acc.shape, divisor, tl.float32))
    idx = rows[:, None].to(tl.int64) * BS + cols[None, :]
    valid = row_ok[:, None] & (cols[None, :] < BS) & (idx < numel)
    store_as(out_ptr + idx, acc, valid)


def qgz_slots(
    *, nodes: int, ranks_per_node: int, stages: int, size: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where qgZ's send slots come from: (offsets, lengths, slot_numel).

    The gradient buffer is `nodes * ranks_per_node` partitions of `size` elements (rank-major).
    Each partition is padded to a multiple of `stages * block_size` and cut into `stages`
    sub-slices of `slot_numel`; slot (k, d, n) (k-major, the paper's eq. 2 generalised by
    Algorithm 2, as `qshard.zeropp.reduce_scatter` lays it out) takes sub-slice k of
    partition n * ranks_per_node + d. `lengths` < slot_numel where the padding starts.
    """
    unit = stages * block_size
    slot_numel = -(-size // unit) * unit // stages
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
    n_slots = offsets.numel()
    if lengths is None:
        lengths = torch.full_like(offsets, slot_numel)
    check_device(x, lengths)
    if lengths.shape != offsets.shape:
        raise ValueError(
            f"lengths {tuple(lengths.shape)} must match offsets {tuple(offsets.shape)}"
        )
    if n_slots and bool(((offsets < 0) | (lengths < 0) | (lengths > slot_numel)).any()):
        raise ValueError(f"need offsets >= 0 and 0 <= lengths <= slot_numel={slot_numel}")
    if n_slots and int((offsets + lengths).max()) > x.numel():
        raise ValueError(f"a slot reads past the end of x ({x.numel()} elements)")
    blocks_per_slot = -(-slot_numel // block_size)
    n_blocks = n_slots * blocks_per_slot
    width = block_size // 2 if pack else block_size
    codes = torch.empty(
        (n_blocks, width), dtype=torch.uint8 if pack else torch.int8, device=x.device
    )
    scales = torch.empty((n_blocks,), dtype=torch.float32, device=x.device)
    if n_blocks == 0:
        return codes, scales
    block_n, rows, warps = _geometry(block_size)
    xk, bf16 = kernel_view(x)
    _reorder_quantize_kernel[(n_slots, triton.cdiv(blocks_per_slot, rows))](
        xk,
        offsets.to(torch.int64).contiguous(),
        lengths.to(torch.int64).contiguous(),
        codes,
        scales,
        blocks_per_slot,
        _seed(rounding, generator),
        BS=block_size,
        BLOCK_N=block_n,
        ROWS=rows,
        QMAX=qmax,
        PACK=pack,
        STOCHASTIC=rounding == "stochastic",
        BF16=bf16,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    return codes, scales


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


def dequant_reduce_requant(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    block_size: int,
    bits: int = 4,
    pack: bool | None = None,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum K peers' quantized blocks in fp32 and requantize the sum, in one pass.

    `codes`: (K, M, block_size) int8 or (K, M, block_size // 2) packed INT4; `scales`: fp32
    (K, M). Returns (codes (M, ...), scales (M,)) in the layout of `reorder_quantize`.
    """
    qmax = _qmax(bits)
    pack_out = bits == 4 if pack is None else pack
    if pack_out and (bits != 4 or block_size % 2):
        raise ValueError(f"pack needs bits=4 and an even block_size; got {bits}, {block_size}")
    n_peers, n_blocks, pack_in = _peer_layout(codes, scales, block_size)
    width = block_size // 2 if pack_out else block_size
    out_codes = torch.empty(
        (n_blocks, width), dtype=torch.uint8 if pack_out else torch.int8, device=codes.device
    )
    out_scales = torch.empty((n_blocks,), dtype=torch.float32, device=codes.device)
    if n_blocks == 0 or n_peers == 0:
        out_codes.zero_()
        out_scales.zero_()
        return out_codes, out_scales
    block_n, rows, warps = _geometry(block_size)
    _dequant_reduce_requant_kernel[(triton.cdiv(n_blocks, rows),)](
        codes,
        scales.contiguous(),
        out_codes,
        out_scales,
        n_peers,
        n_blocks,
        _seed(rounding, generator),
        BS=block_size,
        BLOCK_N=block_n,
        ROWS=rows,
        PACK_IN=pack_in,
        WIDTH_IN=codes.shape[2],
        QMAX=qmax,
        PACK_OUT=pack_out,
        STOCHASTIC=rounding == "stochastic",
        num_warps=warps,
        enable_fp_fusion=False,
    )
    return out_codes, out_scales


def dequant_reduce(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    numel: int | None = None,
    out: torch.Tensor | None = None,
    divisor: float | None = None,
) -> torch.Tensor:
    """Sum K peers' quantized blocks in fp32 (peer order), optionally `/ divisor`, cast.

    Returns flat (numel,) (default M * block_size; `numel` drops the padding of the last
    block), written into `out` when given (its dtype wins).
    """
    n_peers, n_blocks, pack = _peer_layout(codes, scales, block_size)
    total = n_blocks * block_size if numel is None else numel
    if total > n_blocks * block_size:
        raise ValueError(f"numel={total} exceeds the {n_blocks * block_size} quantized elements")
    if out is None:
        out = torch.empty((total,), dtype=dtype, device=codes.device)
    elif out.numel() != total or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of {total} elements (its dtype wins)")
    if n_peers == 0:
        return out.zero_()
    if total == 0:
        return out
    block_n, rows, warps = _geometry(block_size)
    _dequant_reduce_kernel[(triton.cdiv(n_blocks, rows),)](
        codes,
        scales.contiguous(),
        out,
        n_peers,
        n_blocks,
        total,
        1.0 if divisor is None else float(divisor),
        BS=block_size,
        BLOCK_N=block_n,
        ROWS=rows,
        PACK=pack,
        WIDTH=codes.shape[2],
        DIVIDE=divisor is not None,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    return out
