"""4-bit optimizer state: the 16-entry code maps, nibble packing, and the torch reference
encode/decode of one state tensor under the row-block layout of :mod:`qshard.optim._qstate`.

[Note: 4-bit layout]
A state of a parameter with global shape ``(d0, d1, ...)`` is ``d0`` rows of ``row_numel = d1 *
...`` elements (as for 8 bits), each row cut into blocks of ``block_size`` elements (even, so
every block starts on a byte) with one fp32 absmax per block. Two codes share a byte: element
``k`` of a row is the low nibble of byte ``k // 2`` when ``k`` is even and the high nibble when
it is odd; a row of odd length leaves the last high nibble 0. Codes are ``(d0, ceil(row_numel /
2))`` uint8 and absmax ``(d0, blocks_per_row)`` fp32, both sharded on dim 0 like the parameter,
so FSDP2 shards hold whole rows (whole blocks, whole bytes) and DCP reshards the state to any
number of ranks without re-quantization.

The maps (chosen by the measurements in ``docs/optim4bit.md``, ``benchmarks/optim4bit_formats.py``):

* first moment: the signed 4-bit dynamic map (:func:`qshard.quant.dynamic.dynamic_map` with
  ``total_bits=4``; 0, +-0.0055 .. 0.8875 and 1.0);
* second moment: the zero-free linear map ``(i + 1) / 16``, i = 0..15 (Li et al. 2023). With a
  zero code, every ``v`` below ``absmax / 30`` of its block decodes to 0 and the update
  ``m / (sqrt(v) + eps)`` of those elements becomes ``m / eps`` (the zero-point problem);
  without it the smallest decoded ``v`` is ``absmax / 16``: the step is damped, never blown up.
  ``"dynamic"`` (the unsigned 4-bit dynamic map with its zero replaced by 1e-3) and the naive
  ``"linear-zero"`` (``linspace(0, 1, 16)``) exist for the measurements and the ablation test.

Encoding is exact nearest (``torch.bucketize(x / absmax, midpoints)``, ties to the lower code),
the rule of :func:`qshard.quant.dynamic.quantize_codebook`; the fused kernels find it with the
search table of :mod:`qshard.quant._codetable`. No floor or sign nudge is needed: the chosen
second-moment map has no zero, and -0.0 gradients are read as +0.0 before the update.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from qshard._layout import blocks_per_row, row_view
from qshard._layout import packed_row as packed_row  # adam4bit sizes its codes with it
from qshard.optim import _functional
from qshard.optim._qstate import QMap
from qshard.quant import _codetable
from qshard.quant.dynamic import dynamic_map, linear_map

__all__: list[str] = []  # private module

#: Names of the second-moment maps (group option ``second_moment_map``); the first is the default.
SECOND_MOMENT_MAPS: tuple[str, ...] = ("linear", "dynamic", "linear-zero")


def _code(name: str) -> Tensor:
    if name == "signed-dynamic":
        return dynamic_map(signed=True, total_bits=4, max_exponent_bits=3)
    if name == "linear":
        return torch.arange(1, 17, dtype=torch.float32) / 16.0
    if name == "dynamic":
        c = dynamic_map(signed=False, total_bits=4, max_exponent_bits=3).clone()
        c[0] = 1e-3
        return c
    if name == "linear-zero":
        return linear_map(signed=False, total_bits=4)
    raise ValueError(
        f"unknown 4-bit map {name!r}; choose from {('signed-dynamic', *SECOND_MOMENT_MAPS)}"
    )


@functools.cache
def qmap4(name: str) -> QMap:
    """The 16-entry map ``name`` with its midpoints and search table (``zero_idx`` -1: none)."""
    code = _code(name).contiguous()
    mid = ((code[:-1] + code[1:]) / 2.0).contiguous()
    zeros = (code == 0).nonzero()
    lut = _codetable.search_table(code)
    if lut is None:  # every 4-bit map here fits; a refusal means the map or the table changed
        raise AssertionError(f"4-bit map {name!r} too dense for the search table")
    mid_padded = torch.cat([mid, torch.full((256 - mid.numel(),), float("inf"))]).contiguous()
    return QMap(
        code=code,
        mid=mid,
        mid_padded=mid_padded,
        lut=lut,
        zero_idx=int(zeros[0, 0]) if zeros.numel() else -1,
        signed=bool((code < 0).any()),
    )


def symmetric_signed(q: QMap) -> bool:
    """Whether ``q`` is 7 negative codes, 0, the same 7 positive ones and +1.0 (the signed
    dynamic map), which the CPU kernel encodes with 8 compares on ``|x|`` instead of 15."""
    c = q.code
    return bool(
        c.numel() == 16 and c[7] == 0 and c[15] == 1 and torch.equal(c[:7], -c[8:15].flip(0))
    )


def pack(codes: Tensor) -> Tensor:
    """``(rows, row_numel)`` codes 0..15 -> ``(rows, ceil(row_numel / 2))`` bytes."""
    rows, n = codes.shape
    c = codes.to(torch.uint8)
    if n % 2:
        c = torch.nn.functional.pad(c, (0, 1))
    c = c.view(rows, (n + 1) // 2, 2)  # (sizes spelled out: -1 is ambiguous with 0 rows)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def unpack(packed: Tensor, row_numel: int) -> Tensor:
    """Inverse of :func:`pack`: ``(rows, row_numel)`` uint8 codes."""
    rows, nbytes = packed.shape
    both = torch.stack([packed & 15, packed >> 4], dim=-1).view(rows, 2 * nbytes)
    return both[:, :row_numel]


def quantize_rows4(x: Tensor, q: QMap, block_size: int) -> tuple[Tensor, Tensor]:
    """Encode ``x`` (rows along dim 0) -> (packed codes ``(rows, ceil(row_numel/2))``, absmax
    ``(rows, blocks_per_row)``): the nearest code of ``x * (1 / absmax)`` (fp32 reciprocal; block
    and absmax scaled by 2^64 first where the reciprocal overflows, [Note: 4-bit normalisation]
    in :mod:`qshard.optim._kernels4`).
    -0.0 reads as +0.0; an all-zero block gets absmax 0 and the code nearest to 0 of the map
    (it decodes to 0 whatever the code); a block holding NaN or Inf gets a NaN absmax and that
    same code (it decodes to NaN)."""
    rows, row_numel = row_view(x.shape)
    nbr = blocks_per_row(row_numel, block_size)
    x2 = x.detach().float().reshape(rows, row_numel) + 0.0
    pad = nbr * block_size - row_numel
    xp = torch.nn.functional.pad(x2, (0, pad)) if pad else x2
    xb = xp.view(rows, nbr, block_size)
    absmax = xb.abs().amax(dim=2)
    # normalised by multiplying with the fp32 reciprocal of the absmax (what the kernels do:
    # one multiply per element instead of a division); where that reciprocal overflows, block
    # and absmax scaled by 2^64 first ([Note: 4-bit normalisation] in qshard.optim._kernels4)
    r = torch.where(absmax > 0, 1.0 / absmax, torch.ones_like(absmax))
    v = xb * r[..., None]
    over = r.isinf()
    if not over.is_cpu or bool(over.any()):  # no host sync on a GPU: the fix-up always runs
        big = 2.0**64
        v = torch.where(over[..., None], (xb * big) * (1.0 / (absmax * big))[..., None], v)
    mid = q.mid.to(x.device)
    idx = torch.bucketize(v, mid)
    # A block holding NaN or Inf: NaN absmax and, per element, the code of 0.0, so it decodes
    # to NaN on every path (the 8-bit state's rule; [Note: non-finite state blocks] in _kernels)
    bad = ~absmax.isfinite()
    if not bad.is_cpu or bool(bad.any()):  # no host sync on a GPU: the fix-up always runs
        absmax = torch.where(bad, float("nan"), absmax)
        idx = torch.where(
            bad[..., None], torch.bucketize(torch.zeros((), device=x.device), mid), idx
        )
    idx = idx.view(rows, nbr * block_size)[:, :row_numel]
    return pack(idx), absmax.contiguous()


def dequantize_rows4(
    packed: Tensor, absmax: Tensor, q: QMap, block_size: int, shape: torch.Size | tuple[int, ...]
) -> Tensor:
    """fp32 values (``shape``) of a state encoded with :func:`quantize_rows4`."""
    rows, row_numel = row_view(shape)
    nbr = blocks_per_row(row_numel, block_size)
    vals = q.code.to(packed.device)[unpack(packed, row_numel).long()]
    scale = absmax.reshape(rows, nbr).repeat_interleave(block_size, dim=1)[:, :row_numel]
    return (vals * scale).reshape(shape)


#: The 10 hyperparameters of the fused 4-bit kernels: those of the 8-bit Adam kernel
#: (:func:`qshard.optim._functional.adam_hparams`), except that the bias correction of v is
#: its reciprocal, multiplied instead of divided.
adam_hparams = functools.partial(_functional.adam_hparams, inverse_bc2=True)


def adam4bit_reference(
    param: Tensor,
    grad: Tensor,
    m_codes: Tensor,
    m_absmax: Tensor,
    v_codes: Tensor,
    v_absmax: Tensor,
    *,
    m_map: QMap,
    v_map: QMap,
    block_size: int,
    hp: list[float],
) -> None:
    """One Adam/AdamW step of one parameter with 4-bit state, in place: decode both moments,
    update in fp32, re-encode (the pure per-parameter function; ``hp`` from
    :func:`adam_hparams`). ``param`` may be any float dtype (updated in fp32, copied back).

    The update is ``torch.optim.Adam(W)``'s (:func:`qshard.optim._functional.adam_update`)
    written as separate fp32 operations with fp32 hyperparameters, in the order the fused
    kernels evaluate it (the bias correction of v multiplied by its reciprocal: a division
    costs as much as the rest of the update), so all paths agree bit for bit (torch's ``lerp_``/``addcmul_`` use
    fused multiply-adds on CPU and its fp32 ``sqrt`` is not always correctly rounded, each
    differing in the last bit)."""
    _, _, b2, eps, wd, step_size, ibc2, decay, b1w, b2w = (_functional.f32(x) for x in hp)
    shape = param.shape
    m = dequantize_rows4(m_codes, m_absmax, m_map, block_size, shape)
    v = dequantize_rows4(v_codes, v_absmax, v_map, block_size, shape)
    # fp64 parameters are updated in fp64 (an fp32 copy would round them every step); no
    # kernel takes them, so this is their only path
    p = param.double() if param.dtype == torch.float64 else param.float()
    g = grad.float() + 0.0  # -0.0 reads as +0.0
    if decay != 1.0:
        p = p * decay
    elif wd != 0.0:
        g = g + wd * p
    m = m + b1w * (g - m)
    v = v * b2 + (b2w * g) * g
    # sqrt through fp64 is the correctly rounded fp32 square root (the kernels' IEEE sqrtf;
    # torch's vectorised fp32 sqrt can differ from it in the last bit)
    p = p - step_size * (m / (v.double().sqrt().float() * ibc2 + eps))
    param.copy_(p)
    for x, q, codes, absmax in ((m, m_map, m_codes, m_absmax), (v, v_map, v_codes, v_absmax)):
        c, a = quantize_rows4(x, q, block_size)
        codes.copy_(c)
        absmax.copy_(a)
