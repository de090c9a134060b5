"""Triton kernel for the fused 4-bit Adam/AdamW step, the GPU twin of the CPU kernel
`adam4bit_multi` in `qshard.optim._kernels4` (one tensor's arguments of it, same fp32 expressions
in the same order, same exact-nearest encoder), and so of the torch reference
`qshard.optim._qstate4.adam4bit_reference`, bit for bit.

Layout ([Note: 4-bit layout] in `qshard.optim._qstate4`): `rows` rows of `row_numel` elements,
blocks of `block_size` (even) along each row with one fp32 absmax each, codes two a byte
(element 2c in the low nibble of byte c of its row, 2c + 1 in the high nibble). One program owns
G whole blocks and works on the even and the odd elements of each block as two tiles, so a byte
of codes is loaded, decoded into two values, and stored once, without interleaving lanes. Per
parameter that is 4 + 4 + 1 bytes read (param, grad, both codes) and 4 + 1 written.

Encoding: the code is the number of the map's 15 midpoints strictly below ``x * (1 / absmax)``
(ties to the lower code), read from the map's search table (`table_code`: one gather) when the
caller passes it, else found by a 4-step branchless binary search; an all-zero block uses a
reciprocal of 1; a block holding NaN/Inf stores a NaN absmax and the code of 0.0 (the C kernel's
[Note: non-finite state blocks]). Launched with fp fusion off (no FMA), like the C kernel's -ffp-contract=off;
division and square root are the IEEE-rounded `div_rn` / `sqrt_rn`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from qshard._triton._common import (
    check_contiguous,
    check_device,
    kernel_view,
    load_f32,
    next_pow2,
    on_device,
    rows_per_program,
    search_table_on,
    store_as,
    table_code,
)

__all__ = ["optim4bit_step"]

_MAX_BLOCK = 4096


@triton.jit
def _nearest16(x, mid_ptr):
    """Number of the 15 sorted midpoints strictly below x (NaN -> 0): the nearest code."""
    lo = tl.zeros(x.shape, tl.int32)
    lo = tl.where(tl.load(mid_ptr + lo + 7) < x, lo + 8, lo)
    lo = tl.where(tl.load(mid_ptr + lo + 3) < x, lo + 4, lo)
    lo = tl.where(tl.load(mid_ptr + lo + 1) < x, lo + 2, lo)
    lo = tl.where(tl.load(mid_ptr + lo) < x, lo + 1, lo)
    return lo


@triton.jit
def _code16(x, mid_ptr, lut_ptr, LUT: tl.constexpr):
    if LUT:  # the map's search table: one gather (`table_code`)
        return table_code(x, lut_ptr)
    else:
        return _nearest16(x, mid_ptr)


@triton.jit
def _absmax2(x_e, x_o, v0, v1):
    """max |x| over the valid even and odd elements of each block; NaN where one of them is NaN
    or Inf (raised to +Inf before the reduction, which skips NaNs: as in the 8-bit kernel)."""
    big = 3.4028234663852886e38
    a_e = tl.where(v0, tl.abs(x_e), 0.0)
    a_o = tl.where(v1, tl.abs(x_o), 0.0)
    a_e = tl.where(a_e <= big, a_e, float("inf"))
    a_o = tl.where(a_o <= big, a_o, float("inf"))
    m = tl.maximum(tl.max(a_e, axis=1), tl.max(a_o, axis=1))
    return tl.where(m <= big, m, float("nan"))


@triton.jit
def _adam(pi, gi, m, v, b2, eps, wd, step_size, ibc2, decay, w1, w2):
    """The C kernel's adam_block4 on one tile (decoupled decay when decay != 1, else L2)."""
    decoupled = decay != 1.0
    pi = tl.where(decoupled, pi * decay, pi)
    gi = tl.where(~decoupled & (wd != 0.0), gi + wd * pi, gi)
    m = m + w1 * (gi - m)
    v = v * b2 + w2 * gi * gi
    denom = tl.math.sqrt_rn(v) * ibc2 + eps
    pi = pi - step_size * tl.math.div_rn(m, denom)
    return pi, m, v


@triton.jit
def _step4_kernel(
    p_ptr,
    g_ptr,
    c1_ptr,
    a1_ptr,
    code1_ptr,
    mid1_ptr,
    lut1_ptr,
    c2_ptr,
    a2_ptr,
    code2_ptr,
    mid2_ptr,
    lut2_ptr,
    n_blocks,
    blocks_per_row,
    row_numel,
    row_bytes,
    b2,
    eps,
    wd,
    step_size,
    ibc2,
    decay,
    w1,
    w2,
    BS: tl.constexpr,
    HALF_N: tl.constexpr,
    G: tl.constexpr,
    P_BF16: tl.constexpr,
    G_BF16: tl.constexpr,
    LUT1: tl.constexpr,
    LUT2: tl.constexpr,
):
    b = tl.program_id(0) * G + tl.arange(0, G)
    b_ok = b < n_blocks
    r = b // blocks_per_row
    j = b % blocks_per_row
    base = r.to(tl.int64) * row_numel + j.to(tl.int64) * BS
    cbase = r.to(tl.int64) * row_bytes + j.to(tl.int64) * (BS // 2)
    n = tl.minimum(row_numel - j * BS, BS)
    cols = tl.arange(0, HALF_N)
    k0 = 2 * cols[None, :]  # the even element of byte `cols`
    v0 = b_ok[:, None] & (k0 < n[:, None])
    v1 = b_ok[:, None] & (k0 + 1 < n[:, None])
    off0 = base[:, None] + k0
    coff = cbase[:, None] + cols[None, :]

    cb1 = tl.load(c1_ptr + coff, mask=v0, other=0).to(tl.int32)
    cb2 = tl.load(c2_ptr + coff, mask=v0, other=0).to(tl.int32)
    am1 = tl.load(a1_ptr + b, mask=b_ok, other=0.0)[:, None]
    am2 = tl.load(a2_ptr + b, mask=b_ok, other=0.0)[:, None]
    m_e = tl.load(code1_ptr + (cb1 & 15)) * am1
    m_o = tl.load(code1_ptr + (cb1 >> 4)) * am1
    v_e = tl.load(code2_ptr + (cb2 & 15)) * am2
    v_o = tl.load(code2_ptr + (cb2 >> 4)) * am2

    p_e = load_f32(p_ptr + off0, v0, P_BF16)
    p_o = load_f32(p_ptr + off0 + 1, v1, P_BF16)
    g_e = load_f32(g_ptr + off0, v0, G_BF16) + 0.0  # -0.0 -> +0.0
    g_o = load_f32(g_ptr + off0 + 1, v1, G_BF16) + 0.0
    p_e, m_e, v_e = _adam(p_e, g_e, m_e, v_e, b2, eps, wd, step_size, ibc2, decay, w1, w2)
    p_o, m_o, v_o = _adam(p_o, g_o, m_o, v_o, b2, eps, wd, step_size, ibc2, decay, w1, w2)
    store_as(p_ptr + off0, p_e, v0)
    store_as(p_ptr + off0 + 1, p_o, v1)

    # New absmaxes over the block's valid elements, then codes of x * (1 / absmax); a block
    # holding NaN/Inf gets a NaN absmax and the codes of 0.0 (the C kernel's rule).
    n1 = _absmax2(m_e, m_o, v0, v1)
    n2 = _absmax2(v_e, v_o, v0, v1)
    one = tl.full(n1.shape, 1.0, tl.float32)
    r1 = tl.math.div_rn(one, tl.where(n1 == 0.0, 1.0, n1))[:, None]  # zero block: 1
    r2 = tl.math.div_rn(one, tl.where(n2 == 0.0, 1.0, n2))[:, None]
    bad1, bad2 = (n1 != n1)[:, None], (n2 != n2)[:, None]
    q1e = _code16(tl.where(bad1, 0.0, m_e * r1), mid1_ptr, lut1_ptr, LUT1)
    q1o = tl.where(v1, _code16(tl.where(bad1, 0.0, m_o * r1), mid1_ptr, lut1_ptr, LUT1), 0)
    q2e = _code16(tl.where(bad2, 0.0, v_e * r2), mid2_ptr, lut2_ptr, LUT2)
    q2o = tl.where(v1, _code16(tl.where(bad2, 0.0, v_o * r2), mid2_ptr, lut2_ptr, LUT2), 0)
    tl.store(c1_ptr + coff, (q1e | (q1o << 4)).to(tl.uint8), mask=v0)
    tl.store(c2_ptr + coff, (q2e | (q2o << 4)).to(tl.uint8), mask=v0)
    tl.store(a1_ptr + b, n1, mask=b_ok)
    tl.store(a2_ptr + b, n2, mask=b_ok)


def _geometry(block_size: int) -> tuple[int, int, int]:
    """(padded half-block width, blocks per program, warps) of a launch."""
    # 2048 elements a program, 4 warps. On an H200 the 134M-parameter step took 1.75-1.77 ms
    # with these and 3.79 ms with 4096 elements and 8 warps (the earlier default); the table
    # and the binary search were within 3% of each other here (benchmarks/gpu/sweep.py).
    return next_pow2(block_size // 2), rows_per_program(block_size, 2048), 4


def optim4bit_step(
    *,
    param: torch.Tensor,
    grad: torch.Tensor,
    m_codes: torch.Tensor,
    m_absmax: torch.Tensor,
    m_code: torch.Tensor,
    m_mid: torch.Tensor,
    v_codes: torch.Tensor,
    v_absmax: torch.Tensor,
    v_code: torch.Tensor,
    v_mid: torch.Tensor,
    rows: int,
    row_numel: int,
    block_size: int,
    hp: Sequence[float],
    m_lut: torch.Tensor | None = None,
    v_lut: torch.Tensor | None = None,
) -> None:
    """One in-place Adam/AdamW step on `param` (fp32 or bf16) and its 4-bit moments, as
    `adam4bit_multi` does for one tensor; `hp` the 10 values of
    `qshard.optim._qstate4.adam_hparams`, the maps 16 fp32 codes and their 15 midpoints (more
    entries are ignored); `m_lut` / `v_lut` the maps' exact search tables (`QMap.lut` of
    `qshard.quant._codetable`: one gather per code instead of a 4-step binary search)."""
    if not 2 <= block_size <= _MAX_BLOCK or block_size % 2:
        raise ValueError(f"block_size must be even, in 2..{_MAX_BLOCK}; got {block_size}")
    numel = rows * row_numel
    nbr = -(-row_numel // block_size)
    row_bytes = (row_numel + 1) // 2
    n_blocks = rows * nbr
    for name, t, dtype, count in (
        ("param", param, None, numel),
        ("grad", grad, None, numel),
        ("m_codes", m_codes, torch.uint8, rows * row_bytes),
        ("v_codes", v_codes, torch.uint8, rows * row_bytes),
        ("m_absmax", m_absmax, torch.float32, n_blocks),
        ("v_absmax", v_absmax, torch.float32, n_blocks),
    ):
        check_contiguous(name, t)
        if t.numel() != count or (dtype is not None and t.dtype != dtype):
            raise ValueError(
                f"{name}: expected {count} elements of {dtype or 'float'}; got {t.dtype}"
                f" {t.numel()}"
            )
    for name, t, count in (
        ("m_code", m_code, 16),
        ("v_code", v_code, 16),
        ("m_mid", m_mid, 15),
        ("v_mid", v_mid, 15),
    ):
        # The binary search reads mid[0..14], the decode code[0..15], unmasked.
        if t.dtype != torch.float32 or t.numel() < count or not t.is_contiguous():
            raise ValueError(
                f"{name}: expected >= {count} contiguous fp32 values; got {t.dtype} {t.numel()}"
            )
    check_device(param, grad, m_codes, m_absmax, v_codes, v_absmax)
    if len(hp) != 10:
        raise ValueError(f"hp takes the 10 values of adam_hparams; got {len(hp)}")
    if n_blocks == 0:
        return
    dev = param.device
    m_lut, v_lut = search_table_on("m_lut", m_lut, dev), search_table_on("v_lut", v_lut, dev)
    m_code, m_mid = on_device(m_code, dev), on_device(m_mid, dev)
    v_code, v_mid = on_device(v_code, dev), on_device(v_mid, dev)
    # The C kernel reads hp as fp32: pass fp32-exact values (CUDA and the interpreter then
    # evaluate the same fp32 expressions).
    _, _, b2, eps, wd, step_size, ibc2, decay, w1, w2 = (
        np.asarray(hp, dtype=np.float64).astype(np.float32).tolist()
    )
    half_n, g, warps = _geometry(block_size)
    pk, p_bf16 = kernel_view(param)
    gk, g_bf16 = kernel_view(grad)
    _step4_kernel[(triton.cdiv(n_blocks, g),)](
        pk,
        gk,
        m_codes,
        m_absmax,
        m_code,
        m_mid,
        m_code if m_lut is None else m_lut,
        v_codes,
        v_absmax,
        v_code,
        v_mid,
        v_code if v_lut is None else v_lut,
        n_blocks,
        nbr,
        row_numel,
        row_bytes,
        b2,
        eps,
        wd,
        step_size,
        ibc2,
        decay,
        w1,
        w2,
        BS=block_size,
        HALF_N=half_n,
        G=g,
        P_BF16=p_bf16,
        G_BF16=g_bf16,
        LUT1=m_lut is not None,
        LUT2=v_lut is not None,
        num_warps=warps,
        enable_fp_fusion=False,
    )
