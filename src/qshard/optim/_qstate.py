"""Quantized optimizer state: the code maps, the row-block layout, and encode/decode of one state
tensor, shared by every 8-bit optimizer.

[Note: row-block layout]
A state tensor of a parameter with global shape ``(d0, d1, ...)`` is viewed as ``d0`` rows of
``row_numel = d1 * ...`` elements, and every row is cut into ``ceil(row_numel / block_size)``
blocks (the last one may be partial), one fp32 absmax per block. FSDP2 shards dim 0 (whole
rows, padded per rank), so a shard always holds whole blocks, and the codes and absmax of a
shard are exactly the rows of the unsharded state: numerics do not depend on the mesh, no
collective is needed to find an absmax, and both state tensors are themselves ``Shard(0)``
DTensors (codes: the parameter's shape; absmax: ``(d0, blocks_per_row)``) that DCP reshards to
any number of ranks without re-quantization. When ``row_numel`` is a multiple of
``block_size`` the layout is the usual flat one (bitsandbytes'). 1-D parameters have one
element per row, so they keep fp32 state (they are biases and norm scales; see
``eligible_for_8bit``).

Encoding is exact nearest (:func:`qshard.quant.dynamic.quantize_codebook`'s rule) with the
optional fixes of the three pitfalls (see :class:`Rounding`). The kernel finds the nearest code
with the search table of :mod:`qshard.quant._codetable` (one table load and one integer compare
per value), the same table and C encoder the dynamic-map quantizer uses.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

# The layout's arithmetic lives torch-free in qshard._layout (qshard.train.estimate prices
# state with it); the 8- and 4-bit optimizers reach it through this module.
from qshard._layout import blocks_per_row, row_view
from qshard.optim import _kernels
from qshard.quant import _codetable
from qshard.quant.dynamic import dynamic_map, quantize_codebook

__all__: list[str] = []  # private module


@dataclass(frozen=True, slots=True)
class QMap:
    """A sorted 256-entry code map with what the kernel needs to encode against it."""

    code: Tensor  # (256,) fp32, sorted
    mid: Tensor  # (255,) fp32 midpoints (ties go to the lower code)
    mid_padded: Tensor  # (256,) the midpoints and +inf (the 4-bit kernel's branchless search)
    lut: Tensor  # (8192,) int32 (read as uint32): qshard.quant._codetable's search table
    zero_idx: int
    signed: bool
    # (129,) int32: the 8-bit kernel's gather-free encoder ([Note: the region encoder]); all
    # zeros (the table search) for a map without one, e.g. the 4-bit maps
    regions: Tensor = field(
        default_factory=lambda: torch.zeros(_codetable.REGION_TABLE_SIZE, dtype=torch.int32)
    )


@functools.cache
def qmap(signed: bool) -> QMap:
    code = dynamic_map(signed=signed).contiguous()
    mid = ((code[:-1] + code[1:]) / 2.0).contiguous()
    zero_idx = int((code == 0).nonzero()[0, 0])
    # The exact nearest-code table shared with the dynamic-map quantizer (one compare per value).
    lut = _codetable.search_table(code)
    if lut is None:  # the dynamic maps always fit; a refusal means the map or table changed
        raise AssertionError("code map too dense for the kernel's search table")
    # The gather-free encoder's region table ([Note: the region encoder]); the dynamic maps
    # always have one (a refusal would leave the kernel on the table search, still exact).
    regions = _codetable.build_region_table(code)
    if regions is None:
        regions = torch.zeros(_codetable.REGION_TABLE_SIZE, dtype=torch.int32)
    mid_padded = torch.cat([mid, torch.tensor([float("inf")])]).contiguous()
    return QMap(
        code=code,
        mid=mid,
        mid_padded=mid_padded,
        lut=lut,
        zero_idx=zero_idx,
        signed=signed,
        regions=regions,
    )


@dataclass(frozen=True, slots=True)
class Rounding:
    """How states are encoded. Defaults fix bitsandbytes' three pitfalls.

    floor_unsigned: a positive unsigned state (second moment) never encodes to 0 (pitfall 1:
        a surviving first moment over a zero second moment makes a weight jump).
    canonical_zero: -0.0 gradients are read as +0.0 and no sign nudge is applied (pitfall 2).
    bnb_sign_nudge: bitsandbytes' CUDA rule: a signed state whose code has the other sign bit
        moves one code towards its own sign; -0.0 then drifts to the smallest negative code.
    stochastic: stochastic rounding between the two neighbouring codes (pitfall 3).
    """

    floor_unsigned: bool = True
    canonical_zero: bool = True
    bnb_sign_nudge: bool = False
    stochastic: bool = False

    @staticmethod
    def make(*, bnb_compat: bool, stochastic: bool) -> Rounding:
        if bnb_compat:
            return Rounding(
                floor_unsigned=False,
                canonical_zero=False,
                bnb_sign_nudge=True,
                stochastic=stochastic,
            )
        return Rounding(stochastic=stochastic)

    def flags(self) -> int:
        f = 0
        f |= _kernels.FLAG_FLOOR_UNSIGNED if self.floor_unsigned else 0
        f |= _kernels.FLAG_CANONICAL_ZERO if self.canonical_zero else 0
        f |= _kernels.FLAG_BNB_SIGN_NUDGE if self.bnb_sign_nudge else 0
        f |= _kernels.FLAG_STOCHASTIC if self.stochastic else 0
        return f


# --------------------------------------------------------------------------------------------
# Torch reference encode/decode (used when the kernel is unavailable, for non-fp32 parameters
# and by the tests as the oracle of the fused kernel).


def quantize_rows(
    x: Tensor,
    q: QMap,
    block_size: int,
    rounding: Rounding = Rounding(),
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Encode ``x`` (any shape, rows along dim 0) -> (uint8 codes shaped like x, absmax
    ``(rows, blocks_per_row)``), through :func:`qshard.quant.dynamic.quantize_codebook` on rows
    zero-padded to whole blocks (zeros never change an absmax)."""
    rows, row_numel = row_view(x.shape)
    nbr = blocks_per_row(row_numel, block_size)
    x2 = x.detach().float().reshape(rows, row_numel)
    if rounding.canonical_zero:
        x2 = x2 + 0.0
    pad = nbr * block_size - row_numel
    xp = torch.nn.functional.pad(x2, (0, pad)) if pad else x2
    mode = "stochastic" if rounding.stochastic else "nearest"
    codes, absmax = quantize_codebook(
        xp, q.code, block_size=block_size, rounding=mode, generator=generator
    )
    codes = codes.view(rows, nbr * block_size)[:, :row_numel]
    absmax = absmax.view(rows, nbr)
    if q.signed and rounding.bnb_sign_nudge:
        sign_x = torch.signbit(x2)
        wrong = torch.signbit(q.code.to(codes.device)[codes.long()]) != sign_x
        step = torch.where(x2 > 0, 1, -1).to(torch.int16)
        codes = torch.where(wrong, (codes.to(torch.int16) + step).to(torch.uint8), codes)
    if not q.signed and rounding.floor_unsigned:
        codes = torch.where((x2 > 0) & (codes == q.zero_idx), q.zero_idx + 1, codes).to(torch.uint8)
    nonfinite = torch.isnan(absmax)  # a block holding NaN/Inf: NaN absmax, zero codes, as the
    # kernels store it ([Note: non-finite state blocks] in _kernels); tested on the host only
    # on the CPU (on a GPU the test synced every tensor's step: the fix-up runs unconditionally)
    if not nonfinite.is_cpu or bool(nonfinite.any()):
        spread = nonfinite.repeat_interleave(block_size, dim=1)[:, :row_numel]
        codes = torch.where(spread, q.zero_idx, codes).to(torch.uint8)
    return codes.reshape(x.shape).contiguous(), absmax.contiguous()


def dequantize_rows(codes: Tensor, absmax: Tensor, q: QMap, block_size: int) -> Tensor:
    """fp32 values of a state encoded with :func:`quantize_rows` (same shape as ``codes``)."""
    rows, row_numel = row_view(codes.shape)
    nbr = blocks_per_row(row_numel, block_size)
    vals = q.code.to(codes.device)[codes.reshape(rows, row_numel).long()]
    scale = absmax.reshape(rows, nbr).repeat_interleave(block_size, dim=1)[:, :row_numel]
    return (vals * scale).reshape(codes.shape)


def kernel_quantize_rows(
    x: Tensor, q: QMap, block_size: int, rounding: Rounding, seed: int = 0, global_offset: int = 0
) -> tuple[Tensor, Tensor]:
    """The fused kernel's encoder on a contiguous fp32 tensor (same result as
    :func:`quantize_rows` for nearest rounding)."""
    lib = _kernels.library()
    assert lib is not None
    rows, row_numel = row_view(x.shape)
    nbr = blocks_per_row(row_numel, block_size)
    x = x.detach().float().contiguous()
    codes = torch.empty(x.shape, dtype=torch.uint8)
    absmax = torch.empty(rows, nbr, dtype=torch.float32)
    rc = lib.quantize_rows(
        x.data_ptr(),
        codes.data_ptr(),
        absmax.data_ptr(),
        q.code.data_ptr(),
        q.regions.data_ptr(),
        q.lut.data_ptr(),
        q.zero_idx,
        int(q.signed),
        rows,
        row_numel,
        block_size,
        rounding.flags(),
        ctypes.c_uint64(seed & (2**64 - 1)),
        global_offset,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"block_size must be in 1..{_kernels.MAX_BLOCK}; got {block_size}")
    return codes, absmax
