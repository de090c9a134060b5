"""Triton kernels for 1-bit sign packing, the GPU twin of `qshard.quant.signs`.

Format (the reference's): bit 7 - (i % 8) of byte i // 8 is 1 when element i is not negative
(so sign(0) = sign(-0.0) = +1 and NaN packs as +1), 0 when negative; the unused low bits of
the last byte are 0. One program packs a (BYTES, 8) tile: 8 loads per output byte, one store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qshard._triton._common import check_contiguous, kernel_view, load_f32, store_as

__all__ = ["pack_signs", "unpack_signs"]

_BYTES_PER_PROGRAM = 1024


@triton.jit
def _pack_signs_kernel(x_ptr, out_ptr, numel, n_bytes, BYTES: tl.constexpr, BF16: tl.constexpr):
    byte = tl.program_id(0) * BYTES + tl.arange(0, BYTES)
    bit = tl.arange(0, 8)
    idx = byte[:, None].to(tl.int64) * 8 + bit[None, :]
    valid = idx < numel
    x = load_f32(x_ptr + idx, valid, BF16)
    # `not (x < 0)` rather than `x >= 0`: NaN must pack as +1, as in the reference.
    ones = tl.where(valid & ~(x < 0), 1, 0)
    weights = 128 >> bit
    packed = tl.sum(ones * weights[None, :], axis=1)
    tl.store(out_ptr + byte, packed.to(tl.uint8), mask=byte < n_bytes)


@triton.jit
def _unpack_signs_kernel(packed_ptr, out_ptr, numel, BYTES: tl.constexpr):
    byte = tl.program_id(0) * BYTES + tl.arange(0, BYTES)
    bit = tl.arange(0, 8)
    idx = byte[:, None].to(tl.int64) * 8 + bit[None, :]
    valid = idx < numel
    # In int64: an int32 `byte * 8` wraps negative past 2**31 signs, passes `< numel` and the
    # last program reads past the end of `packed`.
    b = tl.load(packed_ptr + byte, mask=byte.to(tl.int64) * 8 < numel, other=0).to(tl.int32)
    on = ((b[:, None] >> (7 - bit[None, :])) & 1) != 0
    store_as(out_ptr + idx, tl.where(on, 1.0, -1.0), valid)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """uint8 of ceil(numel / 8) bytes holding the signs of flat `x` (MSB first)."""
    check_contiguous("x", x)
    numel = x.numel()
    n_bytes = -(-numel // 8)
    out = torch.empty((n_bytes,), dtype=torch.uint8, device=x.device)
    if n_bytes:
        xk, bf16 = kernel_view(x)
        _pack_signs_kernel[(triton.cdiv(n_bytes, _BYTES_PER_PROGRAM),)](
            xk,
            out,
            numel,
            n_bytes,
            BYTES=_BYTES_PER_PROGRAM,
            BF16=bf16,
            num_warps=4,
            enable_fp_fusion=False,
        )
    return out


def unpack_signs(
    packed: torch.Tensor, numel: int, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`numel` values of +1 / -1 in `dtype` from bytes written by pack_signs."""
    check_contiguous("packed", packed)
    if numel < 0:
        raise ValueError(f"numel must be >= 0 (the element count given to pack_signs); got {numel}")
    if packed.numel() != -(-numel // 8):
        raise ValueError(f"{numel} signs need ceil({numel} / 8) bytes; got {packed.numel()}")
    out = torch.empty((numel,), dtype=dtype, device=packed.device)
    if numel:
        _unpack_signs_kernel[(triton.cdiv(packed.numel(), _BYTES_PER_PROGRAM),)](
            packed, out, numel, BYTES=_BYTES_PER_PROGRAM, num_warps=4, enable_fp_fusion=False
        )
    return out
