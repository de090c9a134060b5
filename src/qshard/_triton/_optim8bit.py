"""Triton kernel for the fused 8-bit optimizer step, the GPU twin of the CPU kernel
`step8_multi` in `qshard.optim._kernels` (one tensor's arguments of it, same expressions in the
same order, same encoder).

One program owns whole state blocks: it decodes both states through the 256-entry maps, applies
the update in fp32 registers, writes the parameter, finds each block's new absmax and encodes
the states back, so every byte of parameter, gradient and state moves once each way (the
8-bit-optimizer paper's kernel). For Adam that is 4+4+1+1 bytes read and 4+1+1 written per
parameter against 16 + 12 for fused fp32 AdamW.

`optim8bit_step_multi` steps a list of tensors in one launch ([Note: multi-tensor launch]):
the bytes of one `optim8bit_step` per tensor, without a launch and its host checks per tensor.

Layout ([Note: row-block layout] in `qshard.optim._qstate`): a state of `rows * row_numel`
elements; each row is cut into ceil(row_numel / block_size) blocks (the last one partial), one
fp32 absmax per block, block b = row * blocks_per_row + j.

Encoding is exact nearest: the code index is the number of map midpoints strictly below
x / absmax (ties to the lower code), read from the map's search table of
`qshard.quant._codetable` (one gather and one integer compare, the C kernel's rule) when the
caller passes it, else found with an 8-step branchless binary search over the 255 midpoints
(L1-resident). On an H200 the table took the 134M-parameter AdamW step from 2.57 to 1.82 ms
at the same launch geometry: the binary search's 16 dependent gathers per parameter, not HBM
traffic, bounded the kernel. With the maps' region tables too (`regions1` / `regions2`,
`QMap.regions`) it encodes by the C kernel's gather-free region encoder ([Note: the region
encoder] in `qshard.quant._codetable`): five loads from 128-byte tables and an fma per value,
the 32 KiB search table only for the ~1 in 2000 values near a midpoint. Same codes, byte for
byte (tests); on an H200 it took 1.25x the table's time (runs 6 and 7, at 2048-element
programs; benchmarks/gpu/sweep.py times it beside the table), so the optimizers dispatch the
table. Then come the reference's optional fix-ups (flags
below). An all-zero block encodes s * 0.0. Stochastic rounding is not implemented here (the CPU kernel's hash
stream would have to be reproduced); callers keep their torch path for it.

The kernel is launched with fp fusion off, so no multiply-add is contracted into an FMA and
the fp32 results equal the C kernel's (built with -ffp-contract=off); the region encoder's one
explicit fma is the C kernel's own.
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
    region_code,
    region_table_on,
    row_tensors_fine,
    rows_per_program,
    search_table_on,
    store_as,
    table_code,
)

__all__ = [
    "FLAG_BNB_SIGN_NUDGE",
    "FLAG_CANONICAL_ZERO",
    "FLAG_FIRST_STEP",
    "FLAG_FLOOR_UNSIGNED",
    "FLAG_STOCHASTIC",
    "KINDS",
    "Step8Launch",
    "optim8bit_step",
    "optim8bit_step_multi",
    "prepare_optim8bit_multi",
]

# Mirrors qshard.optim._kernels (kept as literals so this module never imports the C builder).
KINDS = {"adam": 0, "lion": 1, "sgd": 2, "rmsprop": 3, "adagrad": 4}
FLAG_CANONICAL_ZERO = 1
FLAG_FLOOR_UNSIGNED = 2
FLAG_BNB_SIGN_NUDGE = 4
FLAG_STOCHASTIC = 8
FLAG_FIRST_STEP = 16
_KNOWN_FLAGS = 31
# Where step8_multi's hp carries w1 / w2 for each kind (None: unused by the kind).
_COMPLEMENTS = {0: (8, 9), 1: (5, 6), 2: (None, 5), 3: (5, None), 4: (None, None)}


def _complement(hp: Sequence[float], i: int) -> float:
    """1 - hp[i] in double, rounded to fp32 (hp lists without the complements)."""
    return float(np.float32(1.0 - float(hp[i]))) if len(hp) > i else 0.0


_MAX_BLOCK = 4096


@triton.jit
def _nearest(x, mid_ptr):
    """Number of the 255 sorted midpoints strictly below x (NaN -> 0): the nearest code."""
    lo = tl.zeros(x.shape, tl.int32)
    # Branchless lower bound, unrolled: after the step of 2**k, lo has its bits >= k fixed.
    lo = tl.where(tl.load(mid_ptr + lo + 127) < x, lo + 128, lo)
    lo = tl.where(tl.load(mid_ptr + lo + 63) < x, lo + 64, lo)
    lo = tl.where(tl.load(mid_ptr + lo + 31) < x, lo + 32, lo)
    lo = tl.where(tl.load(mid_ptr + lo + 15) < x, lo + 16, lo)
    lo = tl.where(tl.load(mid_ptr + lo + 7) < x, lo + 8, lo)
    lo = tl.where(tl.load(mid_ptr + lo + 3) < x, lo + 4, lo)
    lo = tl.where(tl.load(mid_ptr + lo + 1) < x, lo + 2, lo)
    lo = tl.where(tl.load(mid_ptr + lo) < x, lo + 1, lo)
    return lo


@triton.jit
def _signbit(x):
    return x.to(tl.int32, bitcast=True) < 0


@triton.jit
def _encode(
    s,
    amax,
    code_ptr,
    mid_ptr,
    lut_ptr,
    reg_ptr,
    zero_idx,
    SIGNED: tl.constexpr,
    FLAGS: tl.constexpr,
    LUT: tl.constexpr,
    REGION: tl.constexpr,
):
    """uint8 codes of a (G, BLOCK_N) fp32 state tile given each block's absmax (G,)."""
    zero_block = (amax == 0.0)[:, None]
    x = tl.where(zero_block, s * 0.0, tl.math.div_rn(s, tl.where(zero_block, 1.0, amax[:, None])))
    if REGION:  # the gather-free encoder, the search table only near a midpoint
        i = region_code(x, reg_ptr, lut_ptr, SIGNED)
    elif LUT:
        i = table_code(x, lut_ptr)
    else:  # a map without a search table: the 8-step binary search
        i = _nearest(x, mid_ptr)
    if SIGNED:
        if FLAGS & 4:  # bitsandbytes: a code of the other sign moves one step towards x's sign
            wrong = _signbit(tl.load(code_ptr + i)) != _signbit(x)
            i = tl.where(wrong, i + tl.where(x > 0.0, 1, -1), i)
    else:
        if FLAGS & 2:  # a positive state never encodes to the zero code (pitfall 1), also
            # where s / absmax underflows to 0 (the torch reference tests the state too)
            i = tl.where((s > 0.0) & (i == zero_idx), zero_idx + 1, i)
    # A non-finite block (NaN absmax) stores zero codes, as the C kernel does.
    i = tl.where((amax != amax)[:, None], zero_idx, i)
    return i.to(tl.uint8)


@triton.jit
def _block_absmax(s, valid):
    # A block holding NaN or Inf has a NaN absmax (the C kernel's [Note: non-finite state
    # blocks]). tl.max would skip NaNs, so NaN and Inf are raised to +Inf first: one reduction
    # answers both "the largest magnitude" and "any non-finite" (a finite block's maximum is
    # at most FLT_MAX).
    a = tl.where(valid, tl.abs(s), 0.0)
    m = tl.max(tl.where(a <= 3.4028234663852886e38, a, float("inf")), axis=1)
    return tl.where(m <= 3.4028234663852886e38, m, float("nan"))


@triton.jit
def _step8_blocks(
    pid,
    p_ptr,
    g_ptr,
    c1_ptr,
    a1_ptr,
    code1_ptr,
    mid1_ptr,
    lut1_ptr,
    reg1_ptr,
    zero1,
    c2_ptr,
    a2_ptr,
    code2_ptr,
    mid2_ptr,
    lut2_ptr,
    reg2_ptr,
    zero2,
    n_blocks,
    blocks_per_row,
    row_numel,
    hp0,
    hp1,
    hp2,
    hp3,
    hp4,
    hp5,
    hp6,
    hp7,
    w1,
    w2,
    KIND: tl.constexpr,
    FLAGS: tl.constexpr,
    HAS2: tl.constexpr,
    SIGNED1: tl.constexpr,
    SIGNED2: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    G: tl.constexpr,
    P_BF16: tl.constexpr,
    G_BF16: tl.constexpr,
    LUT1: tl.constexpr,
    LUT2: tl.constexpr,
    REGION1: tl.constexpr,
    REGION2: tl.constexpr,
):
    """Program `pid`'s G state blocks of one tensor (the whole step: load, update, encode)."""
    b = pid * G + tl.arange(0, G)
    b_ok = b < n_blocks
    r = b // blocks_per_row
    j = b % blocks_per_row
    base = r.to(tl.int64) * row_numel + j.to(tl.int64) * BS
    n = tl.minimum(row_numel - j * BS, BS)
    cols = tl.arange(0, BLOCK_N)
    valid = b_ok[:, None] & (cols[None, :] < n[:, None])
    off = base[:, None] + cols[None, :]

    gi = load_f32(g_ptr + off, valid, G_BF16)
    if FLAGS & 1:
        gi = gi + 0.0  # -0.0 -> +0.0 (pitfall 2)
    pi = load_f32(p_ptr + off, valid, P_BF16)
    c1 = tl.load(c1_ptr + off, mask=valid, other=0).to(tl.int32)
    old1 = tl.load(a1_ptr + b, mask=b_ok, other=0.0)
    s1 = tl.load(code1_ptr + c1) * old1[:, None]
    s2 = s1  # placeholder for one-state kinds; only stored when HAS2
    if HAS2:
        c2 = tl.load(c2_ptr + off, mask=valid, other=0).to(tl.int32)
        old2 = tl.load(a2_ptr + b, mask=b_ok, other=0.0)
        s2 = tl.load(code2_ptr + c2) * old2[:, None]

    # w1, w2: the kind's complements (1 - beta...), see [Note: fp32 scalars] and _COMPLEMENTS.
    if KIND == 0:  # Adam / AdamW: lr, b1, b2, eps, wd, step_size, bc2_sqrt, decay, (1-b1, 1-b2)
        decoupled = hp7 != 1.0
        pi = tl.where(decoupled, pi * hp7, pi)
        gi = tl.where(~decoupled & (hp4 != 0.0), gi + hp4 * pi, gi)
        s1 = s1 + w1 * (gi - s1)
        s2 = s2 * hp2 + w2 * gi * gi
        denom = tl.math.div_rn(tl.math.sqrt_rn(s2), tl.full(s2.shape, hp6, tl.float32)) + hp3
        pi = pi - hp5 * tl.math.div_rn(s1, denom)
    elif KIND == 1:  # Lion: hp = lr, beta1, beta2, wd, decay, (1 - beta1, 1 - beta2)
        c = hp1 * s1 + w1 * gi
        sg = tl.where(c > 0.0, 1.0, tl.where(c < 0.0, -1.0, tl.where(c == c, 0.0, c)))
        pi = pi * hp4 - hp0 * sg
        s1 = hp2 * s1 + w2 * gi
    elif KIND == 2:  # SGD momentum: hp = lr, momentum, dampening, wd, nesterov, (1 - dampening)
        gi = tl.where(hp3 != 0.0, gi + hp3 * pi, gi)
        if FLAGS & 16:
            s1 = gi
        else:
            s1 = s1 * hp1 + w2 * gi
        d = tl.where(hp4 != 0.0, gi + hp1 * s1, s1)
        pi = pi - hp0 * d
    elif KIND == 3:  # RMSprop: lr, alpha, eps, wd, momentum, (1 - alpha); state1 v, state2 buffer
        gi = tl.where(hp3 != 0.0, gi + hp3 * pi, gi)
        s1 = s1 * hp1 + w1 * gi * gi
        avg = tl.math.sqrt_rn(s1) + hp2
        if HAS2:
            s2 = s2 * hp4 + tl.math.div_rn(gi, avg)
            pi = pi - hp0 * s2
        else:
            pi = pi - hp0 * tl.math.div_rn(gi, avg)
    else:  # Adagrad: hp = clr, eps, wd
        gi = tl.where(hp2 != 0.0, gi + hp2 * pi, gi)
        s1 = s1 + gi * gi
        pi = pi - hp0 * tl.math.div_rn(gi, tl.math.sqrt_rn(s1) + hp1)

    store_as(p_ptr + off, pi, valid)
    m1 = _block_absmax(s1, valid)
    tl.store(
        c1_ptr + off,
        _encode(
            s1, m1, code1_ptr, mid1_ptr, lut1_ptr, reg1_ptr, zero1, SIGNED1, FLAGS, LUT1, REGION1
        ),
        mask=valid,
    )
    tl.store(a1_ptr + b, m1, mask=b_ok)
    if HAS2:
        m2 = _block_absmax(s2, valid)
        tl.store(
            c2_ptr + off,
            _encode(
                s2,
                m2,
                code2_ptr,
                mid2_ptr,
                lut2_ptr,
                reg2_ptr,
                zero2,
                SIGNED2,
                FLAGS,
                LUT2,
                REGION2,
            ),
            mask=valid,
        )
        tl.store(a2_ptr + b, m2, mask=b_ok)


# [Note: multi-tensor launch] in _common: a row's fields, then hp0..hp7, w1, w2 as fp32.
_META = ("param", "grad", "codes1", "absmax1", "codes2", "absmax2", "n_blocks", "blocks_per_row",
         "row_numel", "first_program")  # fmt: skip
_HP_AT = 2 * len(_META)  # the first hyperparameter, in fp32 words
# The kernel spells these as literals (16 words a row, field 9, fp32 word 20).
assert TABLE_WORDS == 16 and _META.index("first_program") == 9 and _HP_AT == 20


@triton.jit
def _step8_multi_kernel(
    meta_ptr,
    hpf_ptr,
    n_tensors,
    code1_ptr,
    mid1_ptr,
    lut1_ptr,
    reg1_ptr,
    zero1,
    code2_ptr,
    mid2_ptr,
    lut2_ptr,
    reg2_ptr,
    zero2,
    LOG_T: tl.constexpr,
    ALIGNED: tl.constexpr,
    KIND: tl.constexpr,
    FLAGS: tl.constexpr,
    HAS2: tl.constexpr,
    SIGNED1: tl.constexpr,
    SIGNED2: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    G: tl.constexpr,
    P_BF16: tl.constexpr,
    G_BF16: tl.constexpr,
    LUT1: tl.constexpr,
    LUT2: tl.constexpr,
    REGION1: tl.constexpr,
    REGION2: tl.constexpr,
):
    """The step of every tensor of a launch table ([Note: multi-tensor launch]): program `pid`
    finds its tensor's row, reads its pointers, sizes and hyperparameters, and steps its G
    blocks; a one-tensor step is a table of one row."""
    pid = tl.program_id(0)
    t = find_row(meta_ptr, pid, n_tensors, LOG_T, 9)
    p_ptr, g_ptr, c1_ptr, a1_ptr, c2_ptr, a2_ptr, n_blocks, blocks_per_row, row_numel, first = (
        read_row(meta_ptr, t, P_BF16, G_BF16, ALIGNED)
    )
    hp = hpf_ptr + t * 32 + 20
    _step8_blocks(
        pid - first, p_ptr, g_ptr, c1_ptr, a1_ptr, code1_ptr, mid1_ptr, lut1_ptr, reg1_ptr,
        zero1, c2_ptr, a2_ptr, code2_ptr, mid2_ptr, lut2_ptr, reg2_ptr, zero2, n_blocks,
        blocks_per_row, row_numel, tl.load(hp), tl.load(hp + 1), tl.load(hp + 2), tl.load(hp + 3),
        tl.load(hp + 4), tl.load(hp + 5), tl.load(hp + 6), tl.load(hp + 7), tl.load(hp + 8),
        tl.load(hp + 9), KIND, FLAGS, HAS2, SIGNED1, SIGNED2, BS, BLOCK_N, G, P_BF16, G_BF16,
        LUT1, LUT2, REGION1, REGION2,
    )  # fmt: skip


# [Note: step geometry] A program owns 256 elements a warp: one warp per block of 256 (the
# default block), so each block's absmax is a reduction inside one warp (shuffles; no shared
# memory, no barrier), 8 elements a thread. The kernel is bound by latency, not bandwidth: with
# 2048-element programs of 4 warps it held 168 registers a thread, so 18% occupancy, and issued
# in half its cycles (ncu, run 6). On an H200 (run 6, benchmarks/gpu/sweep.py, 134M parameters,
# block 256, torch's fused fp32 AdamW 1.08 ms) the step took 0.864 ms (0.80x fused fp32) with
# 256 elements and 1 warp, 1.066 ms with 2 warps, 1.38 ms with 4; 1.118 ms with 512 elements
# and 2 warps, 1.39 ms with 2048 and 4 (the earlier default), 1.69 ms with 4096 and 4.
_TILE = 256


def _geometry(block_size: int) -> tuple[int, int, int]:
    """(padded block width, blocks per program, warps) of a launch: [Note: step geometry]."""
    block_n = next_pow2(block_size)
    g = rows_per_program(block_size, _TILE)
    return block_n, g, max(1, block_n * g // _TILE)


def _check_map(name: str, code: torch.Tensor, mid: torch.Tensor) -> None:
    if code.shape != (256,) or code.dtype != torch.float32:
        raise ValueError(
            f"{name}: code must be the fp32 (256,) map; got {code.dtype} {tuple(code.shape)}"
        )
    if mid.shape != (255,) or mid.dtype != torch.float32:
        raise ValueError(
            f"{name}: mid must be fp32 (255,) midpoints; got {mid.dtype} {tuple(mid.shape)}"
        )


def _check_flags(flags: int) -> None:
    if flags & ~_KNOWN_FLAGS:
        raise ValueError(f"unknown flag bits {flags & ~_KNOWN_FLAGS:#x}")
    if flags & FLAG_STOCHASTIC:
        raise NotImplementedError(
            "stochastic state rounding has no Triton kernel; use the torch path for it"
        )


def _kind_id(kind: int | str, block_size: int, has2: bool) -> int:
    """The kernel's kind, after the checks every entry point shares."""
    kind_id = KINDS.get(kind, -1) if isinstance(kind, str) else int(kind)
    if kind_id not in KINDS.values():
        raise ValueError(f"kind must be one of {sorted(KINDS)}; got {kind!r}")
    if not 1 <= block_size <= _MAX_BLOCK:
        raise ValueError(f"block_size must be in 1..{_MAX_BLOCK}; got {block_size}")
    if (kind_id == 0) != has2 and kind_id != 3:
        raise ValueError(f"kind {kind!r} {'needs' if kind_id == 0 else 'takes no'} a second state")
    return kind_id


class _Maps:
    """Both states' code maps, midpoints and tables on the kernel's device, checked: kernel
    arguments (`state1`, `state2`: code, mid, search table, region table) and constexprs
    (`consts`). A missing state 2 repeats state 1's (never read)."""

    def __init__(self, dev, has2, code1, mid1, lut1, regions1, signed1, code2, mid2, lut2,
                 regions2, signed2) -> None:  # fmt: skip
        _check_map("state 1", code1, mid1)
        for name, reg, lut in (("regions1", regions1, lut1), ("regions2", regions2, lut2)):
            if reg is not None and lut is None:
                raise ValueError(f"{name} needs lut{name[-1]} (its exact fallback near midpoints)")
        lut1 = search_table_on("lut1", lut1, dev)
        regions1 = region_table_on("regions1", regions1, bool(signed1), dev)
        code1, mid1 = on_device(code1, dev), on_device(mid1, dev)
        if code2 is not None and mid2 is not None:
            _check_map("state 2", code2, mid2)
            lut2 = search_table_on("lut2", lut2, dev)
            regions2 = region_table_on("regions2", regions2, bool(signed2), dev)
            code2, mid2 = on_device(code2, dev), on_device(mid2, dev)
        if has2 and (code2 is None or mid2 is None):
            raise ValueError("a second state needs code2 and mid2")
        if not has2:
            code2, mid2, lut2, regions2 = code1, mid1, None, None
        # An absent table's pointer is never read (its constexpr is off): any tensor will do.
        self.state1 = (code1, mid1, code1 if lut1 is None else lut1,
                       code1 if regions1 is None else regions1)  # fmt: skip
        self.state2 = (code2, mid2, code1 if lut2 is None else lut2,
                       code1 if regions2 is None else regions2)  # fmt: skip
        self.consts = dict(
            LUT1=lut1 is not None,
            LUT2=lut2 is not None,
            REGION1=regions1 is not None and lut1 is not None,
            REGION2=regions2 is not None and lut2 is not None,
        )


def _scalars(kind_id: int, hp: Sequence[float]) -> list[float]:
    """hp0..hp7, w1, w2 of the kernel as fp32-exact Python floats.

    [Note: fp32 scalars] step8_multi reads hp as fp32; the complements (1 - beta1, 1 - beta2,
    1 - dampening, 1 - alpha) ride in hp too, computed in double and rounded once, as torch
    rounds its Python-float constants. They are passed as fp32-exact values, so CUDA (fp32
    arguments) and the interpreter (Python floats) evaluate the same fp32 expressions."""
    if len(hp) > 10:
        raise ValueError(f"hp takes at most 10 values; got {len(hp)}")
    hps = np.asarray(hp, dtype=np.float64).astype(np.float32).tolist() + [0.0] * (10 - len(hp))
    w1_at, w2_at = _COMPLEMENTS[kind_id]
    w1 = hps[w1_at] if w1_at is not None and len(hp) > w1_at else _complement(hp, 1)
    w2 = hps[w2_at] if w2_at is not None and len(hp) > w2_at else _complement(hp, 2)
    return [*hps[:8], w1, w2]


def optim8bit_step(
    *,
    kind: int | str,
    param: torch.Tensor,
    grad: torch.Tensor,
    codes1: torch.Tensor,
    absmax1: torch.Tensor,
    code1: torch.Tensor,
    mid1: torch.Tensor,
    zero1: int,
    signed1: bool,
    rows: int,
    row_numel: int,
    block_size: int,
    hp: Sequence[float],
    flags: int,
    codes2: torch.Tensor | None = None,
    absmax2: torch.Tensor | None = None,
    code2: torch.Tensor | None = None,
    mid2: torch.Tensor | None = None,
    zero2: int = 0,
    signed2: bool = False,
    lut1: torch.Tensor | None = None,
    lut2: torch.Tensor | None = None,
    regions1: torch.Tensor | None = None,
    regions2: torch.Tensor | None = None,
) -> None:
    """One in-place step on `param` (fp32 or bf16) and its 8-bit states, as `step8_multi` does
    for one tensor: `optim8bit_step_multi` with a list of one (tensor errors name it [0]).

    `kind` is "adam" | "lion" | "sgd" | "rmsprop" | "adagrad" (or the C kernel's int);
    `hp` the kind's hyperparameters in `step8_multi`'s order; `flags` its FLAG_* bits. State 2 is
    given for Adam (second moment) and RMSprop with momentum (buffer). `lut1` / `lut2`: the
    maps' exact search tables (`QMap.lut`, `qshard.quant._codetable`), which turn the encoder's
    8-gather binary search into one gather; without them the kernel searches the midpoints.
    `regions1` / `regions2`: the maps' region tables (`QMap.regions`, CPU), which with the
    search table select the gather-free region encoder ([Note: the region encoder]); same codes.
    """
    has2 = codes2 is not None
    optim8bit_step_multi(
        kind=kind, params=[param], grads=[grad], layouts=[(rows, row_numel)], codes1=[codes1],
        absmax1=[absmax1], code1=code1, mid1=mid1, zero1=zero1, signed1=signed1,
        block_size=block_size, hps=[hp], flags=flags,
        codes2=[codes2] if has2 else None, absmax2=[absmax2] if has2 else None, code2=code2,
        mid2=mid2, zero2=zero2, signed2=signed2, lut1=lut1, lut2=lut2, regions1=regions1,
        regions2=regions2,
    )  # fmt: skip


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class Step8Launch(PreparedLaunch):
    """`prepare_optim8bit_multi`'s checked launch ([Note: prepared launch] in `_common`)."""

    __slots__ = ()

    def run(self, hps: Sequence[Sequence[float]], *, flags: int) -> None:  # type: ignore[override]
        """Step every tensor: tensor i with the hyperparameters `hps[i]`, all with `flags`."""
        _check_flags(flags)
        super().run(hps, FLAGS=int(flags))


def optim8bit_step_multi(*, hps: Sequence[Sequence[float]], flags: int, **kwargs) -> None:
    """`optim8bit_step` for every tensor of a list, in one launch ([Note: multi-tensor launch]):
    the same bytes as one call per tensor. `prepare_optim8bit_multi(**kwargs).run(hps,
    flags=flags)`: tensor i steps with the hyperparameters `hps[i]`."""
    prepare_optim8bit_multi(**kwargs).run(hps, flags=flags)


def prepare_optim8bit_multi(
    *,
    kind: int | str,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    layouts: Sequence[tuple[int, int]],
    codes1: Sequence[torch.Tensor],
    absmax1: Sequence[torch.Tensor],
    code1: torch.Tensor,
    mid1: torch.Tensor,
    zero1: int,
    signed1: bool,
    block_size: int,
    codes2: Sequence[torch.Tensor] | None = None,
    absmax2: Sequence[torch.Tensor] | None = None,
    code2: torch.Tensor | None = None,
    mid2: torch.Tensor | None = None,
    zero2: int = 0,
    signed2: bool = False,
    lut1: torch.Tensor | None = None,
    lut2: torch.Tensor | None = None,
    regions1: torch.Tensor | None = None,
    regions2: torch.Tensor | None = None,
) -> Step8Launch:
    """The checked launch of `optim8bit_step_multi` for these tensors, to `run` with each
    step's hyperparameters and flags ([Note: prepared launch] in `_common`).

    Tensor i is `params[i]` with `grads[i]`, its states' `codes1[i]` / `absmax1[i]` (and
    `codes2[i]` / `absmax2[i]`) and its `layouts[i] = (rows, row_numel)`; the maps, tables and
    block size are shared. The parameters share one dtype and the gradients one dtype, each
    fp32 or bf16 (split a list of mixed dtypes into calls).
    """
    has2 = codes2 is not None
    kind_id = _kind_id(kind, block_size, has2)
    n = len(params)
    lists = {"grads": grads, "layouts": layouts, "codes1": codes1, "absmax1": absmax1}
    if has2:
        lists |= {"codes2": codes2, "absmax2": absmax2}
    for name, seq in lists.items():
        if seq is None or len(seq) != n:
            raise ValueError(
                f"{name} has {None if seq is None else len(seq)} entries for {n} params"
            )
    if n == 0:
        return Step8Launch(None, [], 0, _HP_AT, None, (), {}, None)
    p_dtype, g_dtype = params[0].dtype, grads[0].dtype
    if p_dtype not in _KERNEL_DTYPES or g_dtype not in _KERNEL_DTYPES:
        raise ValueError(f"params and grads must be fp32 or bf16; got {p_dtype} and {g_dtype}")
    dev = params[0].device
    maps = _Maps(dev, has2, code1, mid1, lut1, regions1, signed1, code2, mid2, lut2, regions2,
                 signed2)  # fmt: skip
    block_n, g, warps = _geometry(block_size)
    rows_ = []
    programs = 0
    dev_index = params[0].get_device()  # (an int: cheaper than comparing torch.device objects)
    for i in range(n):
        p, gr, c1, a1 = params[i], grads[i], codes1[i], absmax1[i]
        c2, a2 = (codes2[i], absmax2[i]) if has2 else (c1, a1)  # type: ignore[index]
        rows, row_numel = layouts[i]
        numel, nbr = rows * row_numel, -(-row_numel // block_size)
        n_blocks = rows * nbr
        tensors = (p, gr, c1, a1, c2, a2)
        if not row_tensors_fine(tensors, p_dtype, g_dtype, numel, numel, n_blocks, dev_index):
            named = [
                ("params", p, None, numel),
                ("grads", gr, None, numel),
                ("codes1", c1, torch.uint8, numel),
                ("absmax1", a1, torch.float32, n_blocks),
            ]
            if has2:
                named += [("codes2", c2, torch.uint8, numel),
                          ("absmax2", a2, torch.float32, n_blocks)]  # fmt: skip
            explain_row(i, named, p_dtype, g_dtype)
        if numel >= 2**31:
            raise ValueError(f"tensor {i}: {numel} elements; the multi-tensor step takes < 2**31")
        rows_.append([p.data_ptr(), gr.data_ptr(), c1.data_ptr(), a1.data_ptr(), c2.data_ptr(),
                      a2.data_ptr(), n_blocks, nbr, row_numel, programs])  # fmt: skip
        programs += -(-n_blocks // g)
    # 16-byte vector loads need every vector's address aligned: the tensors' starts (the four
    # the vectors read) and the rows' lengths (a row's start is r * row_numel elements in).
    aligned = all(r[0] % 16 == r[1] % 16 == r[2] % 16 == r[4] % 16 == r[8] % 16 == 0
                  for r in rows_)  # fmt: skip
    consts = dict(
        LOG_T=max(1, (n - 1).bit_length()), ALIGNED=bool(aligned), KIND=kind_id, HAS2=has2,
        SIGNED1=bool(signed1), SIGNED2=bool(signed2), BS=block_size, BLOCK_N=block_n, G=g,
        P_BF16=p_dtype == torch.bfloat16, G_BF16=g_dtype == torch.bfloat16, **maps.consts,
        num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    args = (*maps.state1, int(zero1), *maps.state2, int(zero2))
    return Step8Launch(
        _step8_multi_kernel, rows_, programs, _HP_AT, dev, args, consts,
        lambda hp: _scalars(kind_id, hp),
    )  # fmt: skip
