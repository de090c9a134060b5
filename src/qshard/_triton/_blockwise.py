"""Triton kernels for symmetric absmax block quantization (INT8 / INT4), the GPU twin of
`qshard.quant.blockwise`.

One program owns ROWS whole quantization blocks: it reads them once, finds each block's absmax in
registers, writes the codes (INT4 packed two per byte in the same pass) and one fp32 scale per
block. Memory traffic is therefore the minimum: input bytes in, code bytes + 4/block_size out.

Numerics (the reference contract of blockwise.py [Note: scale choice], checked bit for bit by
tests/gpu): computed in fp32; the stored per-block value (`scales`) is the block absmax;
code = round_half_even(fl(fl(x / absmax) * qmax)) clamped to [-qmax, qmax] (qmax 127 or 7);
value = fl(fl(code * R) * absmax) with R = fl(1 / qmax), so the block's largest magnitude
round-trips exactly; an all-zero block stores 0 and codes 0; a block holding NaN or +-Inf
stores NaN and codes 0, so it dequantizes to NaN. Every launch passes enable_fp_fusion=False
and divides with div_rn (IEEE), so no FMA contraction or approximate division changes a bit.
INT4 packing: element 2k in the high nibble, 2k+1 in the low nibble, two's complement.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qshard._triton._common import (
    check_contiguous,
    check_device,
    kernel_view,
    load_f32,
    next_pow2,
    num_warps_for,
    rint,
    rows_per_program,
    store_as,
)

__all__ = [
    "dequantize_blocks",
    "pack_int4",
    "quantize_blocks",
    "quantize_flat",
    "unpack_int4",
]

_QMAX = {8: 127, 4: 7}
_FLT_MAX = 3.4028234663852886e38


@triton.jit
def _quantize_tile(x, valid, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr, seed, idx):
    """Quantize a (ROWS, BLOCK_N) fp32 tile whose rows are blocks; returns (int32 codes, the
    stored per-block absmax).

    Shared by the plain quantizer and qgZ's fused kernels so that all of them round alike.
    """
    # NaN and Inf poison the block. Raising both to +Inf before the reduction (which would
    # skip a NaN) lets one maximum answer "absmax" and "any non-finite" (a finite block's
    # maximum is at most FLT_MAX).
    xa = tl.where(valid, tl.abs(x), 0.0)
    absmax = tl.max(tl.where(xa <= 3.4028234663852886e38, xa, float("inf")), axis=1)
    nonfinite = absmax > 3.4028234663852886e38
    stored = tl.where(nonfinite, float("nan"), absmax)
    # A zero (or poisoned) block divides by 1: its codes come out 0 and `stored` says the rest.
    divisor = tl.where((absmax == 0.0) | nonfinite, 1.0, absmax)
    t = tl.math.div_rn(x, divisor[:, None]) * tl.full((1, 1), QMAX, tl.float32)
    if STOCHASTIC:
        # floor(t + u), u ~ U[0, 1): rounds up with probability frac(t), so E[code] = t.
        t = tl.floor(t + tl.rand(seed, idx))
    else:
        t = rint(t)
    t = tl.minimum(tl.maximum(t, -QMAX), QMAX)
    codes = tl.where(valid & ~nonfinite[:, None], t, 0.0).to(tl.int32)
    return codes, stored


@triton.jit
def _dequant_tile(q, absmax, QMAX: tl.constexpr):
    """fl(fl(code * R) * absmax) for an int32 (ROWS, BLOCK_N) code tile, R = fl(1 / QMAX)."""
    r = tl.math.div_rn(tl.full((1, 1), 1.0, tl.float32), tl.full((1, 1), QMAX, tl.float32))
    return (q.to(tl.float32) * r) * absmax[:, None]


@triton.jit
def _store_codes(codes_ptr, q, rows, cols, row_ok, BS: tl.constexpr, PACK: tl.constexpr):
    """Store an int32 (ROWS, BLOCK_N) code tile as int8 codes or as packed INT4 bytes.

    [Note: int64 code offsets] `rows` is int32 (program id * ROWS + arange), and a block's
    code offset `rows * width` passes 2**31 once a tensor holds 2**31 code bytes (2G INT8
    elements, an 8 GB fp32 input: within an H200's memory). In int32 it wraps negative and the
    kernel reads or writes 2 GB before the buffer, so offsets are formed in int64 here (and in
    `_load_codes`), as the element offsets of the callers already are.
    """
    start = rows[:, None].to(tl.int64)
    if PACK:
        ROWS: tl.constexpr = q.shape[0]
        HALF: tl.constexpr = q.shape[1] // 2
        hi, lo = tl.split(tl.reshape(q, (ROWS, HALF, 2)))
        byte = ((hi & 15) << 4) | (lo & 15)
        j = tl.arange(0, HALF)[None, :]
        mask = row_ok[:, None] & (j < BS // 2)
        tl.store(codes_ptr + start * (BS // 2) + j, byte.to(tl.uint8), mask=mask)
    else:
        mask = row_ok[:, None] & (cols[None, :] < BS)
        tl.store(codes_ptr + start * BS + cols[None, :], q.to(tl.int8), mask=mask)


@triton.jit
def _load_codes(
    codes_ptr, rows, row_ok, BS: tl.constexpr, BLOCK_N: tl.constexpr, PACK: tl.constexpr
):
    """Load a (ROWS, BLOCK_N) int32 tile of codes stored as int8 or packed INT4 (offsets in
    int64: [Note: int64 code offsets])."""
    ROWS: tl.constexpr = rows.shape[0]
    start = rows[:, None].to(tl.int64)
    if PACK:
        HALF: tl.constexpr = BLOCK_N // 2
        j = tl.arange(0, HALF)[None, :]
        mask = row_ok[:, None] & (j < BS // 2)
        b = tl.load(codes_ptr + start * (BS // 2) + j, mask=mask, other=0).to(tl.int32)
        # Sign-extend each nibble by moving it to the top of the int32 and shifting back.
        hi = (b << 24) >> 28
        lo = (b << 28) >> 28
        q = tl.reshape(tl.join(hi, lo), (ROWS, BLOCK_N))
    else:
        cols = tl.arange(0, BLOCK_N)[None, :]
        mask = row_ok[:, None] & (cols < BS)
        q = tl.load(codes_ptr + start * BS + cols, mask=mask, other=0).to(tl.int32)
    return q


@triton.jit
def _quantize_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    n_blocks,
    numel,
    seed,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    QMAX: tl.constexpr,
    PACK: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BF16: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_blocks
    idx = rows[:, None].to(tl.int64) * BS + cols[None, :]
    # Elements past numel are the padding of a partial last block: read as 0, never stored.
    valid = row_ok[:, None] & (cols[None, :] < BS) & (idx < numel)
    x = load_f32(x_ptr + idx, valid, BF16)
    q, scale = _quantize_tile(x, valid, QMAX, STOCHASTIC, seed, idx)
    _store_codes(codes_ptr, q, rows, cols, row_ok, BS, PACK)
    tl.store(scales_ptr + rows, scale, mask=row_ok)


@triton.jit
def _dequantize_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    n_blocks,
    numel,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    PACK: tl.constexpr,
    QMAX: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_blocks
    q = _load_codes(codes_ptr, rows, row_ok, BS, BLOCK_N, PACK)
    absmax = tl.load(scales_ptr + rows, mask=row_ok, other=0.0)
    y = _dequant_tile(q, absmax, QMAX)
    idx = rows[:, None].to(tl.int64) * BS + cols[None, :]
    valid = row_ok[:, None] & (cols[None, :] < BS) & (idx < numel)
    store_as(out_ptr + idx, y, valid)


@triton.jit
def _pack_int4_kernel(codes_ptr, out_ptr, n_bytes, numel, BLOCK: tl.constexpr):
    # int64: `2 * j` passes 2**31 for 2G codes ([Note: int64 code offsets]).
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = j < n_bytes
    hi = tl.load(codes_ptr + 2 * j, mask=ok & (2 * j < numel), other=0).to(tl.int32)
    lo = tl.load(codes_ptr + 2 * j + 1, mask=ok & (2 * j + 1 < numel), other=0).to(tl.int32)
    tl.store(out_ptr + j, (((hi & 15) << 4) | (lo & 15)).to(tl.uint8), mask=ok)


@triton.jit
def _unpack_int4_kernel(packed_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    # int64: in int32 `2 * j` wraps negative past 2G codes, passes the `< numel` masks and
    # writes before `out` ([Note: int64 code offsets]).
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    b = tl.load(packed_ptr + j, mask=2 * j < numel, other=0).to(tl.int32)
    tl.store(out_ptr + 2 * j, ((b << 24) >> 28).to(tl.int8), mask=2 * j < numel)
    tl.store(out_ptr + 2 * j + 1, ((b << 28) >> 28).to(tl.int8), mask=2 * j + 1 < numel)


def _check_float_dtype(dtype: torch.dtype, what: str) -> None:
    """Dequantized values are floats: an integer output would truncate them silently."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dequantized values are floating point; got {what} {dtype}")


def _qmax(bits: int) -> int:
    if bits not in _QMAX:
        raise ValueError(f"bits must be 8 or 4; got {bits}")
    return _QMAX[bits]


def _seed(rounding: str, generator: torch.Generator | None) -> int:
    if rounding == "nearest":
        return 0
    if rounding != "stochastic":
        raise ValueError(f"rounding must be 'nearest' or 'stochastic'; got {rounding!r}")
    # One draw from the caller's generator seeds Triton's Philox stream, so a seeded
    # generator gives a reproducible (though not torch-identical) rounding pattern.
    # [Note: seed on the generator's device] The draw runs where the generator lives: a CUDA
    # tensor's caller passes a CUDA generator (the torch path draws its noise on the tensor's
    # device, which needs one), and torch refuses a CUDA generator for a CPU draw. Without a
    # generator the draw is on the CPU's default one (seeded by torch.manual_seed too), which
    # spares the device sync of `.item()`.
    device = torch.device("cpu") if generator is None else generator.device
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=device).item())


def _geometry(block_size: int, pack: bool = False) -> tuple[int, int, int]:
    """(padded block width, blocks per program, warps) of a quantize/dequantize launch.

    Packing INT4 codes pairs neighbouring lanes (a reshape and split of the tile), which costs
    more with larger tiles: on an H200, quantize+pack of 268M fp32 elements took 0.361 ms with
    1024-element tiles of 2 warps, 0.381 with 2048 / 4 warps and 0.47 with 4096 / 4 (0.79-0.80,
    0.75 and 0.61 of copy bandwidth; three sweeps, benchmarks/gpu/sweep.py), where the unpacked
    kernels move within 3% from 1024 to 4096.
    """
    block_n = next_pow2(max(block_size, 2))
    rows = rows_per_program(block_size, 1024) if pack else rows_per_program(block_size)
    return block_n, rows, num_warps_for(block_n * rows)


def quantize_flat(
    x: torch.Tensor,
    *,
    block_size: int,
    bits: int,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    pack: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize the flattened `x` (any numel; the last block is zero-padded internally).

    Returns codes int8 (n_blocks, block_size), or uint8 (n_blocks, block_size // 2) when `pack`
    (INT4 only, even block_size), and the fp32 block absmax (n_blocks,) ("scales", the format of
    qshard.quant.blockwise); written into `out` = (codes, scales) when given (contiguous, right
    dtype and numel, any shape).
    """
    qmax = _qmax(bits)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1; got {block_size}")
    if pack and (bits != 4 or block_size % 2):
        raise ValueError(f"pack needs bits=4 and an even block_size; got {bits}, {block_size}")
    check_contiguous("x", x)
    numel = x.numel()
    n_blocks = -(-numel // block_size)
    width = block_size // 2 if pack else block_size
    code_dtype = torch.uint8 if pack else torch.int8
    if out is None:
        codes = torch.empty((n_blocks, width), dtype=code_dtype, device=x.device)
        scales = torch.empty((n_blocks,), dtype=torch.float32, device=x.device)
    else:
        codes, scales = out
        for name, t, dtype, count in (
            ("codes", codes, code_dtype, n_blocks * width),
            ("scales", scales, torch.float32, n_blocks),
        ):
            if t.dtype != dtype or t.numel() != count or not t.is_contiguous():
                raise ValueError(f"out {name} must be contiguous {dtype} of {count} elements")
        check_device(x, codes, scales)
    if n_blocks == 0:
        return codes, scales
    block_n, rows, warps = _geometry(block_size, pack)
    xk, bf16 = kernel_view(x)
    _quantize_kernel[(triton.cdiv(n_blocks, rows),)](
        xk,
        codes,
        scales,
        n_blocks,
        numel,
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


def quantize_blocks(
    x2d: torch.Tensor,
    *,
    bits: int,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    pack: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of `x2d` (n_blocks, block_size) as one block. See quantize_flat."""
    if x2d.dim() != 2:
        raise ValueError(f"x2d must be 2-D (n_blocks, block_size); got shape {tuple(x2d.shape)}")
    return quantize_flat(
        x2d.contiguous(),
        block_size=x2d.shape[1],
        bits=bits,
        rounding=rounding,
        generator=generator,
        pack=pack,
        out=out,
    )


def dequantize_blocks(
    codes2d: torch.Tensor,
    scales: torch.Tensor,
    *,
    bits: int | None = None,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    block_size: int | None = None,
    numel: int | None = None,
) -> torch.Tensor:
    """(code * fl(1 / qmax)) * absmax per block (`scales` holds the block absmax), cast to
    `dtype`.

    `codes2d` is int8 (n_blocks, block_size) (then `bits`, 8 or 4, must be given: both store
    int8 codes) or packed INT4 uint8 (n_blocks, block_size // 2) (then `block_size` must be
    given; `bits` may be omitted or 4). The result is (n_blocks, block_size), or flat with the
    first `numel` elements when `numel` is given (written straight into `out` if supplied, so
    the padding of a partial last block is never materialised). `out`'s dtype wins over `dtype`.
    """
    check_contiguous("codes2d", codes2d)
    check_device(codes2d, scales)
    if codes2d.dtype not in (torch.int8, torch.uint8) or codes2d.dim() != 2:
        raise ValueError(
            f"codes2d must be 2-D int8 codes or packed INT4 uint8; got {codes2d.dtype} "
            f"{tuple(codes2d.shape)}"
        )
    pack = codes2d.dtype == torch.uint8
    if bits is None and not pack:
        raise ValueError(
            "int8 codes need bits=8 or bits=4 to dequantize: a code's value is "
            "code / qmax * absmax and both widths store int8 codes"
        )
    qmax = _qmax(4 if bits is None else bits)
    if pack and qmax != 7:
        raise ValueError(f"packed uint8 codes are INT4; got bits={bits}")
    n_blocks = codes2d.shape[0]
    if block_size is None:
        if pack:
            raise ValueError("packed INT4 codes need block_size= to dequantize")
        block_size = codes2d.shape[1]
    if codes2d.shape[1] != (block_size // 2 if pack else block_size):
        raise ValueError(
            f"codes2d shape {tuple(codes2d.shape)} does not fit block_size {block_size}"
        )
    if scales.shape != (n_blocks,) or scales.dtype != torch.float32:
        raise ValueError(
            f"scales must be fp32 of shape ({n_blocks},); got {scales.dtype} {tuple(scales.shape)}"
        )
    if numel is not None and not 0 <= numel <= n_blocks * block_size:
        # Elements past the last block would be left as torch.empty's garbage.
        raise ValueError(
            f"numel={numel} must be in 0..{n_blocks * block_size} ({n_blocks} blocks of "
            f"{block_size})"
        )
    shape = (n_blocks, block_size) if numel is None else (numel,)
    total = n_blocks * block_size if numel is None else numel
    if out is None:
        _check_float_dtype(dtype, "dtype")
        out = torch.empty(shape, dtype=dtype, device=codes2d.device)
    else:
        if out.numel() != total or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous tensor of {total} elements (its dtype wins)"
            )
        _check_float_dtype(out.dtype, "out")
        check_device(codes2d, out)
    if n_blocks == 0:
        return out
    block_n, rows, warps = _geometry(block_size)
    _dequantize_kernel[(triton.cdiv(n_blocks, rows),)](
        codes2d,
        scales.contiguous(),
        out,
        n_blocks,
        total,
        BS=block_size,
        BLOCK_N=block_n,
        ROWS=rows,
        PACK=pack,
        QMAX=qmax,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    return out


_ELEMWISE_BLOCK = 4096


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack int8 codes in [-8, 7] two per byte (element 2k high nibble); odd numel pads a 0."""
    check_contiguous("codes", codes)
    if codes.dtype != torch.int8:  # float codes would be truncated, wider ints read as int8
        raise TypeError(f"pack_int4 expects int8 codes; got {codes.dtype}")
    numel = codes.numel()
    n_bytes = -(-numel // 2)
    out = torch.empty((n_bytes,), dtype=torch.uint8, device=codes.device)
    if n_bytes:
        _pack_int4_kernel[(triton.cdiv(n_bytes, _ELEMWISE_BLOCK),)](
            codes, out, n_bytes, numel, BLOCK=_ELEMWISE_BLOCK, num_warps=4, enable_fp_fusion=False
        )
    return out


def unpack_int4(packed: torch.Tensor, numel: int | None = None) -> torch.Tensor:
    """Inverse of pack_int4: the first `numel` int8 codes (default all 2 * packed.numel())."""
    check_contiguous("packed", packed)
    if packed.dtype not in (torch.uint8, torch.int8):
        raise TypeError(f"unpack_int4 expects packed uint8 bytes; got {packed.dtype}")
    if numel is None:
        numel = 2 * packed.numel()
    if not 0 <= numel <= packed.numel() * 2:
        raise ValueError(
            f"numel={numel} must be in 0..{packed.numel() * 2} (the codes {packed.numel()} "
            "packed bytes hold)"
        )
    out = torch.empty((numel,), dtype=torch.int8, device=packed.device)
    if numel:
        _unpack_int4_kernel[(triton.cdiv(-(-numel // 2), _ELEMWISE_BLOCK),)](
            packed, out, numel, BLOCK=_ELEMWISE_BLOCK, num_warps=4, enable_fp_fusion=False
        )
    return out
