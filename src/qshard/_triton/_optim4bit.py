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
reciprocal of 1, one whose reciprocal overflows is scaled by 2^64 first ([Note: 4-bit
normalisation] in `qshard.optim._kernels4`); a block holding NaN/Inf stores a NaN absmax and the code of 0.0 (the C kernel's
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
    TABLE_WORDS,
    PreparedLaunch,
    explain_row,
    find_row,
    load_f32,
    next_pow2,
    on_device,
    read_row,
    row_tensors_fine,
    rows_per_program,
    search_table_on,
    store_as,
    table_code,
)

__all__ = ["optim4bit_step", "optim4bit_step_multi", "prepare_optim4bit_multi"]

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
def _reciprocal(d):
    """(scale, reciprocal) per block: x is normalised as (x * scale) * reciprocal, 1 and 1 / d,
    or 2^64 and 1 / (d * 2^64) where 1 / d overflows ([Note: 4-bit normalisation] in
    qshard.optim._kernels4)."""
    one = tl.full(d.shape, 1.0, tl.float32)
    r = tl.math.div_rn(one, d)
    scale = tl.where(r <= 3.4028234663852886e38, 1.0, 18446744073709551616.0)
    return scale[:, None], tl.math.div_rn(one, d * scale)[:, None]


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
def _step4_blocks(
    pid,
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
    """Program `pid`'s G state blocks of one tensor (the whole step)."""
    b = pid * G + tl.arange(0, G)
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
    k1, r1 = _reciprocal(tl.where(n1 == 0.0, 1.0, n1))  # zero block: 1
    k2, r2 = _reciprocal(tl.where(n2 == 0.0, 1.0, n2))
    bad1, bad2 = (n1 != n1)[:, None], (n2 != n2)[:, None]
    q1e = _code16(tl.where(bad1, 0.0, (m_e * k1) * r1), mid1_ptr, lut1_ptr, LUT1)
    q1o = tl.where(v1, _code16(tl.where(bad1, 0.0, (m_o * k1) * r1), mid1_ptr, lut1_ptr, LUT1), 0)
    q2e = _code16(tl.where(bad2, 0.0, (v_e * k2) * r2), mid2_ptr, lut2_ptr, LUT2)
    q2o = tl.where(v1, _code16(tl.where(bad2, 0.0, (v_o * k2) * r2), mid2_ptr, lut2_ptr, LUT2), 0)
    tl.store(c1_ptr + coff, (q1e | (q1o << 4)).to(tl.uint8), mask=v0)
    tl.store(c2_ptr + coff, (q2e | (q2o << 4)).to(tl.uint8), mask=v0)
    tl.store(a1_ptr + b, n1, mask=b_ok)
    tl.store(a2_ptr + b, n2, mask=b_ok)


# [Note: multi-tensor launch] in _common: a row's fields, then b2 .. w2 as fp32.
_META = ("param", "grad", "m_codes", "m_absmax", "v_codes", "v_absmax", "n_blocks",
         "blocks_per_row", "row_numel", "first_program", "row_bytes")  # fmt: skip
_HP_AT = 24  # the first hyperparameter, in fp32 words (after the 11 fields, 16-byte aligned)
# The kernel spells these as literals (16 words a row, fields 9 and 10, fp32 word 24).
assert TABLE_WORDS == 16 and _META.index("first_program") == 9 and _META.index("row_bytes") == 10
assert 2 * len(_META) <= _HP_AT and _HP_AT + 8 <= 2 * TABLE_WORDS


@triton.jit
def _step4_multi_kernel(
    meta_ptr,
    hpf_ptr,
    n_tensors,
    code1_ptr,
    mid1_ptr,
    lut1_ptr,
    code2_ptr,
    mid2_ptr,
    lut2_ptr,
    LOG_T: tl.constexpr,
    ALIGNED: tl.constexpr,
    BS: tl.constexpr,
    HALF_N: tl.constexpr,
    G: tl.constexpr,
    P_BF16: tl.constexpr,
    G_BF16: tl.constexpr,
    LUT1: tl.constexpr,
    LUT2: tl.constexpr,
):
    """The 4-bit step of every tensor of a launch table ([Note: multi-tensor launch])."""
    pid = tl.program_id(0)
    t = find_row(meta_ptr, pid, n_tensors, LOG_T, 9)
    p_ptr, g_ptr, c1_ptr, a1_ptr, c2_ptr, a2_ptr, n_blocks, blocks_per_row, row_numel, first = (
        read_row(meta_ptr, t, P_BF16, G_BF16, ALIGNED)
    )
    row_bytes = tl.load(meta_ptr + t * 16 + 10).to(tl.int32)
    if ALIGNED:  # (the host checked it with the rest)
        row_bytes = tl.multiple_of(row_bytes, 16)
    hp = hpf_ptr + t * 32 + 24
    _step4_blocks(
        pid - first, p_ptr, g_ptr, c1_ptr, a1_ptr, code1_ptr, mid1_ptr, lut1_ptr, c2_ptr, a2_ptr,
        code2_ptr, mid2_ptr, lut2_ptr, n_blocks, blocks_per_row, row_numel, row_bytes,
        tl.load(hp), tl.load(hp + 1), tl.load(hp + 2), tl.load(hp + 3), tl.load(hp + 4),
        tl.load(hp + 5), tl.load(hp + 6), tl.load(hp + 7), BS, HALF_N, G, P_BF16, G_BF16, LUT1,
        LUT2,
    )  # fmt: skip


def _geometry(block_size: int) -> tuple[int, int, int]:
    """(padded half-block width, blocks per program, warps) of a launch: 256 elements a warp,
    as the 8-bit step ([Note: step geometry] in `_optim8bit`). On an H200 (run 6,
    benchmarks/gpu/sweep.py, 134M parameters, block 128, torch's fused fp32 AdamW 1.08 ms) the
    step took 0.812 ms (0.75x fused fp32) with 256 elements and 1 warp, 0.943 ms with 512 and 2,
    1.00 ms with 256 and 2, 1.70 ms with 2048 and 4 (the earlier default; ncu: 153 registers a
    thread, 18% occupancy, its loads throttled), 3.79 ms with 4096 and 8."""
    block_n = next_pow2(block_size)
    g = rows_per_program(block_size, 256)
    return next_pow2(block_size // 2), g, max(1, block_n * g // 256)


def _maps(dev, m_code, m_mid, v_code, v_mid, m_lut, v_lut):
    """The two maps and their search tables on ``dev``, checked (copied once)."""
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
    luts = (search_table_on("m_lut", m_lut, dev), search_table_on("v_lut", v_lut, dev))
    return tuple(on_device(t, dev) for t in (m_code, m_mid, v_code, v_mid)), luts


def _scalars(hp: Sequence[float]) -> list[float]:
    """b2, eps, wd, step_size, ibc2, decay, w1, w2 of the 10 values of adam_hparams, as
    fp32-exact floats: the C kernel reads hp as fp32 (CUDA and the interpreter then evaluate
    the same fp32 expressions)."""
    if len(hp) != 10:
        raise ValueError(f"hp takes the 10 values of adam_hparams; got {len(hp)}")
    return np.asarray(hp, dtype=np.float64).astype(np.float32).tolist()[2:]


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
    `adam4bit_multi` does for one tensor (`optim4bit_step_multi` with a list of one: tensor
    errors name it [0]); `hp` the 10 values of
    `qshard.optim._qstate4.adam_hparams`, the maps 16 fp32 codes and their 15 midpoints (more
    entries are ignored); `m_lut` / `v_lut` the maps' exact search tables (`QMap.lut` of
    `qshard.quant._codetable`: one gather per code instead of a 4-step binary search)."""
    optim4bit_step_multi(
        params=[param], grads=[grad], layouts=[(rows, row_numel)], m_codes=[m_codes],
        m_absmax=[m_absmax], v_codes=[v_codes], v_absmax=[v_absmax], m_code=m_code, m_mid=m_mid,
        v_code=v_code, v_mid=v_mid, block_size=block_size, hps=[hp], m_lut=m_lut, v_lut=v_lut,
    )  # fmt: skip


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def optim4bit_step_multi(*, hps: Sequence[Sequence[float]], **kwargs) -> None:
    """`optim4bit_step` for every tensor of a list, in one launch ([Note: multi-tensor launch]
    in `_common`): the same bytes as one call per tensor. `prepare_optim4bit_multi(**kwargs)
    .run(hps)`: tensor i steps with the hyperparameters `hps[i]`."""
    prepare_optim4bit_multi(**kwargs).run(hps)


def prepare_optim4bit_multi(
    *,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    layouts: Sequence[tuple[int, int]],
    m_codes: Sequence[torch.Tensor],
    m_absmax: Sequence[torch.Tensor],
    v_codes: Sequence[torch.Tensor],
    v_absmax: Sequence[torch.Tensor],
    m_code: torch.Tensor,
    m_mid: torch.Tensor,
    v_code: torch.Tensor,
    v_mid: torch.Tensor,
    block_size: int,
    m_lut: torch.Tensor | None = None,
    v_lut: torch.Tensor | None = None,
) -> PreparedLaunch:
    """The checked launch of `optim4bit_step_multi` for these tensors, to `run` with each
    step's hyperparameters ([Note: prepared launch] in `_common`). Tensor i is `params[i]` with
    `grads[i]`, its moments' codes and absmaxes and its `layouts[i] = (rows, row_numel)`; the
    parameters share one dtype and the gradients one, each fp32 or bf16."""
    if not 2 <= block_size <= _MAX_BLOCK or block_size % 2:
        raise ValueError(f"block_size must be even, in 2..{_MAX_BLOCK}; got {block_size}")
    n = len(params)
    for name, seq in (("grads", grads), ("layouts", layouts), ("m_codes", m_codes),
                      ("m_absmax", m_absmax), ("v_codes", v_codes),
                      ("v_absmax", v_absmax)):  # fmt: skip
        if len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} entries for {n} params")
    if n == 0:
        return PreparedLaunch(None, [], 0, _HP_AT, None, (), {}, None)
    p_dtype, g_dtype = params[0].dtype, grads[0].dtype
    if p_dtype not in _KERNEL_DTYPES or g_dtype not in _KERNEL_DTYPES:
        raise ValueError(f"params and grads must be fp32 or bf16; got {p_dtype} and {g_dtype}")
    dev = params[0].device
    maps, luts = _maps(dev, m_code, m_mid, v_code, v_mid, m_lut, v_lut)
    half_n, g, warps = _geometry(block_size)
    rows_ = []
    programs = 0
    dev_index = params[0].get_device()
    for i in range(n):
        tensors = p, gr, c1, a1, c2, a2 = (
            params[i], grads[i], m_codes[i], m_absmax[i], v_codes[i], v_absmax[i]
        )  # fmt: skip
        rows, row_numel = layouts[i]
        numel, nbr, row_bytes = rows * row_numel, -(-row_numel // block_size), (row_numel + 1) // 2
        n_blocks, n_bytes = rows * nbr, rows * row_bytes
        if not row_tensors_fine(tensors, p_dtype, g_dtype, numel, n_bytes, n_blocks, dev_index):
            explain_row(i, [("params", p, None, numel), ("grads", gr, None, numel),
                            ("m_codes", c1, torch.uint8, n_bytes),
                            ("m_absmax", a1, torch.float32, n_blocks),
                            ("v_codes", c2, torch.uint8, n_bytes),
                            ("v_absmax", a2, torch.float32, n_blocks)], p_dtype, g_dtype)  # fmt: skip
        if numel >= 2**31:
            raise ValueError(f"tensor {i}: {numel} elements; the multi-tensor step takes < 2**31")
        rows_.append([p.data_ptr(), gr.data_ptr(), c1.data_ptr(), a1.data_ptr(), c2.data_ptr(),
                      a2.data_ptr(), n_blocks, nbr, row_numel, programs, row_bytes])  # fmt: skip
        programs += -(-n_blocks // g)
    # 16-byte vector access needs the starts (param, grad, both codes) and the rows' lengths
    # (elements and code bytes) to keep every vector aligned.
    aligned = all(
        r[0] % 16 == r[1] % 16 == r[2] % 16 == r[4] % 16 == r[8] % 16 == r[10] % 16 == 0
        for r in rows_
    )
    args = (maps[0], maps[1], maps[0] if luts[0] is None else luts[0], maps[2], maps[3],
            maps[2] if luts[1] is None else luts[1])  # fmt: skip
    consts = dict(
        LOG_T=max(1, (n - 1).bit_length()), ALIGNED=bool(aligned), BS=block_size, HALF_N=half_n,
        G=g, P_BF16=p_dtype == torch.bfloat16, G_BF16=g_dtype == torch.bfloat16,
        LUT1=luts[0] is not None, LUT2=luts[1] is not None, num_warps=warps,
        enable_fp_fusion=False,
    )  # fmt: skip
    return PreparedLaunch(_step4_multi_kernel, rows_, programs, _HP_AT, dev, args, consts, _scalars)
