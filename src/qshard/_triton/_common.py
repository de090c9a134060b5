"""Shared Triton helpers: rounding, launch geometry and input checks for every qshard kernel.

Everything here is used by the kernel modules of this package; nothing is public.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 1.5 * 2**23. Adding and subtracting it rounds an fp32 |t| < 2**22 to an integer with the
# FPU's round-half-to-even, the rounding torch.round uses. [Note: rint] libdevice.rint does the
# same on CUDA but Triton's interpreter cannot run it, and one formula for both keeps the
# interpreter tests honest about what the GPU executes. Every caller rounds values bounded by
# a few hundred; NaN stays NaN. The two adds must not be reassociated, which LLVM never does
# without fast-math flags, and there is no multiply before them to contract into an FMA.
_RINT_MAGIC = 12582912.0

# Elements one program handles; enough for wide vector loads and latency hiding on
# Hopper-class GPUs without spilling registers. Block sizes above it get one row per program.
_TILE_ELEMENTS = 4096


@triton.jit
def rint(t):
    """Round fp32 to the nearest integer, ties to even (valid for |t| < 2**22). See [Note: rint]."""
    return (t + 12582912.0) - 12582912.0


@triton.jit
def store_as(ptr, y, mask):
    """Store fp32 `y` into `ptr`'s dtype, rounding to nearest even as torch's `.to()` does.

    [Note: bf16 cast] Triton's interpreter truncates fp32 -> bf16 (and its "rtne" mode rounds
    ties up), while CUDA rounds to nearest even. Rounding the bits by hand gives torch's result
    on both, so interpreter tests check exactly what the GPU stores; it is a few integer ops in
    a memory-bound kernel.
    """
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(y != y, 0x7FC0, rounded)
        tl.store(ptr, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def rows_per_program(block_size: int, tile_elements: int = _TILE_ELEMENTS) -> int:
    """How many quantization blocks one program owns so that a tile has ~tile_elements."""
    return max(1, tile_elements // next_pow2(block_size))


def num_warps_for(tile: int) -> int:
    if tile >= 8192:
        return 8
    if tile >= 2048:
        return 4
    return 2


def check_device(*tensors: torch.Tensor) -> None:
    """All kernel inputs must live on one device: CUDA, or CPU under TRITON_INTERPRET=1."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(
                f"qshard Triton kernels need all tensors on one device; got {device} and {t.device}"
            )


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous for the Triton kernel; call .contiguous()")
