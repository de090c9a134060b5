"""Dynamic (tree) 8-bit code maps and block-wise codebook quantization for optimizer state.

This file owns the number formats of the 8-bit optimizers (Dettmers et al., "8-bit
Optimizers via Block-wise Quantization"):

* :func:`dynamic_map` builds the dynamic data type value for value as bitsandbytes'
  ``create_dynamic_map`` does. Every step runs in fp32 (fp32 ``linspace`` -> fp32 bin centres
  -> fp32 multiply by the power of ten rounded to fp32); that is the only recipe that
  reproduces all 256 entries (a float64 recipe differs in the last bit of many of them).
* :func:`linear_map` is the paper's ablation baseline (evenly spaced codes, bitsandbytes'
  ``create_linear_map`` with ``add_zero=True``).
* :func:`quantize_codebook` normalises each block of ``block_size`` elements by its absmax
  and stores the index of the **nearest** code, exactly: the result equals
  ``torch.bucketize(x / absmax, midpoints)`` with ``midpoints = (code[:-1] + code[1:]) / 2``
  in fp32. A value exactly on a midpoint takes the lower code (the one nearer -inf).
  bitsandbytes' CPU kernel approximates this with a lookup table and picks a wrong code for
  about a fifth of second-moment entries; we do not copy that.

Blocks: the flattened tensor is cut into contiguous blocks (last one partial); codes depend
only on their block, so any block-aligned slice quantizes exactly like the same blocks of the
whole tensor. All-zero blocks get absmax 0 and dequantize to zeros; a block holding NaN or
Inf gets a NaN absmax and dequantizes to NaN (see [Note: non-finite blocks] in blockwise.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qshard._native import advise_huge_pages
from qshard.quant import _codetable, _fastpath, _native_kernels
from qshard.quant.blockwise import _check_float_output, _check_float_scales, _prepare_out

__all__ = [
    "DEFAULT_CODEBOOK_BLOCK_SIZE",
    "dequantize_codebook",
    "dynamic_map",
    "linear_map",
    "quantize_codebook",
]

#: Elements per absmax block for optimizer state. The paper used 2048; 256 costs 1.6% extra
#: memory (one fp32 absmax per 256 bytes) and isolates outliers better. Both work.
DEFAULT_CODEBOOK_BLOCK_SIZE = 256

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ROUNDINGS = ("nearest", "stochastic")


def _check_total_bits(total_bits: int) -> None:
    # An int check first: 8.0 used to fail inside torch.linspace ("invalid combination of
    # arguments") and True passed as 1 into the range message.
    if not isinstance(total_bits, int) or isinstance(total_bits, bool) or not 2 <= total_bits <= 8:
        raise ValueError(f"total_bits must be an int in 2..8; got {total_bits!r}")


# The maps are constants: built eagerly also inside torch.compile, where Inductor's linspace
# differs from eager's in the last bit (42 of the signed map's 256 values differed, so codes made
# under compile decoded with another map than eager's). Lazily: see qshard.optim._options.eager_only.
@torch._disable_dynamo
def dynamic_map(*, signed: bool, total_bits: int = 8, max_exponent_bits: int = 7) -> Tensor:
    """The dynamic (tree) quantization map: ``2**total_bits`` sorted fp32 values in [-1, 1].

    Each power of ten ``10**-(max_exponent_bits-1) .. 10**0`` gets a run of linearly spaced
    fractions in [0.1, 1] (bin centres of an fp32 ``linspace``); the runs double in length
    as the exponent grows, so small magnitudes get relative precision and large ones get
    fine absolute steps. The map always holds 0 and +1.0; the signed map has no -1.0
    (index 127 is 0, 255 is +1.0, the smallest positive value is 5.5e-7); the unsigned map
    has 0 at index 0, 1.0 at 255 and 3.25e-7 as smallest non-zero.

    ``total_bits`` 2..8 gives few-bit variants; ``max_exponent_bits`` must be in
    ``1..total_bits-1`` (signed) and equal to ``total_bits - 1`` for unsigned maps (the
    recipe has no filler run for unsigned maps, as in bitsandbytes).
    """
    _check_total_bits(total_bits)
    non_sign_bits = total_bits - 1
    if (
        not isinstance(max_exponent_bits, int)
        or isinstance(max_exponent_bits, bool)
        or not 1 <= max_exponent_bits <= non_sign_bits
    ):
        raise ValueError(
            f"max_exponent_bits must be an int in 1..{non_sign_bits} for total_bits="
            f"{total_bits}; got {max_exponent_bits!r} (pass max_exponent_bits={non_sign_bits})"
        )
    if not signed and max_exponent_bits != non_sign_bits:
        raise ValueError(
            f"an unsigned dynamic map needs max_exponent_bits == total_bits - 1 == "
            f"{non_sign_bits}; got {max_exponent_bits}"
        )
    values: list[Tensor] = []

    def add_run(power: int, fraction_items: int) -> None:
        boundaries = torch.linspace(0.1, 1.0, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        # The Python scalar is rounded to fp32 and the product is computed in fp32.
        values.append((10**power) * means)
        if signed:
            values.append((-(10**power)) * means)

    power = 0
    for i in range(max_exponent_bits):
        power = -(max_exponent_bits - 1) + i
        shift = i + non_sign_bits - max_exponent_bits + (0 if signed else 1)
        add_run(power, 2**shift + 1)
    filler = 2 ** (non_sign_bits - max_exponent_bits) - 1
    if filler > 0:
        # Filler run at the largest exponent: bitsandbytes reuses the last loop exponent.
        add_run(power, filler + 1)
    values.append(torch.tensor([0.0, 1.0], dtype=torch.float32))
    out = torch.sort(torch.cat(values)).values
    assert out.numel() == 2**total_bits, (out.numel(), total_bits)
    return out


@torch._disable_dynamo
def linear_map(*, signed: bool, total_bits: int = 8) -> Tensor:
    """Evenly spaced codes, the paper's linear-quantization baseline (sorted fp32).

    Signed: ``linspace(-1, 1, 2**total_bits - 1)`` plus an exact 0 to fill the last index, as
    bitsandbytes' ``create_linear_map(add_zero=True)`` does. The fp32 ``linspace`` middle value
    is exactly 0 only for ``total_bits=2`` (then 0 appears twice); otherwise it is a tiny
    +-3.7e-9 .. 5.8e-8 next to the added 0 (for 8 bits: 0.0 at index 127, 3.7e-9 at 128).
    Unsigned: ``linspace(0, 1, 2**total_bits)``.
    """
    _check_total_bits(total_bits)
    n = 2**total_bits
    if not signed:
        return torch.linspace(0.0, 1.0, n, dtype=torch.float32)
    values = torch.linspace(-1.0, 1.0, n - 1, dtype=torch.float32)
    return torch.sort(torch.cat([values, values.new_zeros(1)])).values


def _check_code(code: Tensor) -> None:
    if code.dim() != 1 or not 2 <= code.numel() <= 256 or code.dtype != torch.float32:
        raise ValueError(
            f"code must be a 1-D fp32 map of 2..256 values; got shape {tuple(code.shape)}, "
            f"{code.dtype}"
        )
    unsorted, nonfinite = torch.stack(
        [(code[1:] < code[:-1]).any(), ~torch.isfinite(code).all()]
    ).tolist()
    if nonfinite:  # a NaN passes the sort check and then matches no midpoint
        raise ValueError(f"code must hold finite values; got {code.tolist()}")
    if unsorted:
        raise ValueError("code must be sorted ascending (use torch.sort(code).values)")


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int; got {block_size!r}")


def _check_out(
    out: tuple[Tensor, Tensor], numel: int, num_blocks: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    if (
        isinstance(out, Tensor)
        or not isinstance(out, (tuple, list))
        or len(out) != 2
        or not all(isinstance(t, Tensor) for t in out)
    ):
        raise TypeError(
            "out must be a (codes, absmax) pair of tensors, as quantize_codebook returns; got "
            f"{type(out).__name__} (pass out=(codes, absmax))"
        )
    codes, absmax = out
    for t, name, dtype, n in (
        (codes, "codes", torch.uint8, numel),
        (absmax, "absmax", torch.float32, num_blocks),
    ):
        if t.dtype != dtype or t.numel() != n or not t.is_contiguous() or t.device != device:
            raise ValueError(
                f"out {name} must be a contiguous {dtype} tensor of {n} elements on {device}; "
                f"got {t.dtype}, {t.numel()} elements, contiguous={t.is_contiguous()}, "
                f"{t.device}"
            )
    for t, name in ((codes, "out codes"), (absmax, "out absmax")):
        _prepare_out(t, name)  # [Note: out buffers are written outside autograd]
    return codes.view(-1), absmax.view(-1)


def _normalize(flat: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Pad to whole blocks, return (x / absmax per block, absmax); see the module docstring."""
    numel = flat.numel()
    num_blocks = -(-numel // block_size)
    padded = num_blocks * block_size
    x = flat.float()
    if padded != numel:
        x = torch.cat([x, x.new_zeros(padded - numel)])
    x2d = x.view(num_blocks, block_size)
    absmax = x2d.abs().amax(dim=1)
    finite = torch.isfinite(absmax)
    usable = finite & (absmax > 0)
    v = x2d / torch.where(usable, absmax, torch.ones_like(absmax))[:, None]
    v = torch.where(usable[:, None], v, torch.zeros_like(v))
    absmax = torch.where(finite, absmax, torch.full_like(absmax, float("nan")))
    return v, absmax


def _nearest_reference(v: Tensor, code: Tensor) -> Tensor:
    midpoints = (code[:-1] + code[1:]) / 2.0
    return torch.bucketize(v, midpoints.to(v.device))


def _stochastic(v: Tensor, code: Tensor, generator: torch.Generator | None) -> Tensor:
    """Round to one of the two codes around ``v`` with probability linear in the distance."""
    code = code.to(v.device)
    n = code.numel()
    lo = (torch.searchsorted(code, v, right=True) - 1).clamp(0, n - 1)
    hi = (lo + 1).clamp(max=n - 1)
    c_lo, c_hi = code[lo], code[hi]
    gap = c_hi - c_lo
    p = torch.where(gap > 0, (v - c_lo) / torch.where(gap > 0, gap, 1.0), 0.0).clamp(0.0, 1.0)
    u = torch.rand(v.shape, generator=generator, device=v.device, dtype=torch.float32)
    return torch.where(u < p, hi, lo)


def quantize_codebook(
    x: Tensor,
    code: Tensor,
    *,
    block_size: int = DEFAULT_CODEBOOK_BLOCK_SIZE,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    out: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Block-wise absmax normalisation, then the index of the nearest value of ``code``.

    Args:
        x: any shape, fp32/bf16/fp16 (computed in fp32).
        code: sorted fp32 map of at most 256 values (e.g. :func:`dynamic_map`).
        block_size: elements per absmax block (last block may be partial).
        rounding: ``"nearest"`` (exact, ties to the lower code) or ``"stochastic"`` (one of
            the two neighbouring codes, with probability linear in the distance).
        generator: random source for stochastic rounding.
        out: optional preallocated ``(codes, absmax)`` to write into (as optimizer state
            is updated in place): contiguous uint8 of ``x.numel()`` elements and fp32 of
            ``num_blocks`` elements on ``x``'s device. Allocating 1 byte per element costs
            as much as the C encoder itself on large tensors (page faults), so hot loops
            should pass buffers.

    Returns:
        ``(codes, absmax)``: uint8 ``(x.numel(),)`` and fp32 ``(num_blocks,)`` (``out``'s
        tensors, flat views of them, when given).
    """
    _check_code(code)
    _check_block_size(block_size)
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be one of {_ROUNDINGS}; got {rounding!r}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"quantize_codebook supports {_FLOAT_DTYPES}; got {x.dtype}")
    flat = x.detach().reshape(-1)  # [Note: quantizers are outside autograd] in blockwise.py
    numel = flat.numel()
    num_blocks = -(-numel // block_size)
    if out is None:
        codes = torch.empty(numel, dtype=torch.uint8, device=x.device)
        absmax = torch.empty(num_blocks, dtype=torch.float32, device=x.device)
        if codes.device.type == "cpu":
            advise_huge_pages(codes.data_ptr(), numel)  # fewer first-touch faults
    else:
        codes, absmax = _check_out(out, numel, num_blocks, x.device)
    full = numel // block_size
    table = None
    if rounding == "nearest" and numel and _fastpath.use_native(flat):
        lut = _codetable.search_table(code)
        if lut is not None:
            _native_kernels.quantize_codebook(flat, block_size, lut, codes, absmax)
            return codes, absmax
        table = _fastpath.codebook_table(code)
        if table is not None:
            _native_kernels.quantize_codebook_bytes(
                flat, block_size, table.lut, table.mids, codes, absmax
            )
            return codes, absmax
    if rounding == "nearest" and full >= 2 and _fastpath.use_fastpath(flat):
        table = _fastpath.codebook_table(code)
    if table is None:
        codes.copy_(
            _quantize_codebook_reference(flat, code, block_size, rounding, generator, absmax)
        )
        return codes, absmax
    split = full * block_size
    _fastpath.quantize_codebook_into(
        flat[:split].view(full, block_size),
        table,
        codes[:split].view(full, block_size),
        absmax[:full],
    )
    if split != numel:
        codes[split:] = _quantize_codebook_reference(
            flat[split:], code, block_size, rounding, generator, absmax[full:]
        )
    return codes, absmax


def _quantize_codebook_reference(
    flat: Tensor,
    code: Tensor,
    block_size: int,
    rounding: str,
    generator: torch.Generator | None,
    absmax_out: Tensor,
) -> Tensor:
    """The plain torch definition (bit-exact reference of the fast path); returns codes."""
    if rounding == "nearest":
        # A block longer than the tensor is one block either way, and the codes have no
        # padding: do not materialise it. block_size=2**31 on 4 elements asked this path for
        # 8 GiB (the C kernels, which never pad, took it in stride). Stochastic rounding keeps
        # the padded shape, so a seeded generator still draws the same uniforms.
        block_size = min(block_size, max(flat.numel(), 1))
    v, absmax = _normalize(flat, block_size)
    absmax_out.copy_(absmax)
    if rounding == "nearest":
        idx = _nearest_reference(v, code)
    else:
        idx = _stochastic(v, code, generator)
    return idx.to(torch.uint8).view(-1)[: flat.numel()]


def dequantize_codebook(
    codes: Tensor,
    absmax: Tensor,
    code: Tensor,
    *,
    block_size: int = DEFAULT_CODEBOOK_BLOCK_SIZE,
    shape: torch.Size | tuple[int, ...] | None = None,
    dtype: torch.dtype = torch.float32,
    out: Tensor | None = None,
) -> Tensor:
    """``code[codes] * absmax[block]`` in fp32, cast to ``dtype``.

    Args:
        codes: uint8, ``numel`` elements (any shape; read flat).
        absmax: fp32 ``(ceil(numel / block_size),)``.
        code: the map used to quantize.
        block_size: as used to quantize.
        shape: result shape (default ``(numel,)``).
        dtype: result dtype when ``out`` is not given.
        out: optional preallocated contiguous tensor of ``numel`` elements; its dtype and
            shape win.
    """
    _check_code(code)
    _check_block_size(block_size)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8; got {codes.dtype}")
    flat = codes.reshape(-1)
    numel = flat.numel()
    num_blocks = -(-numel // block_size)
    if absmax.shape != (num_blocks,):
        raise ValueError(
            f"absmax must have ceil({numel} / {block_size}) = {num_blocks} entries; "
            f"got shape {tuple(absmax.shape)}"
        )
    _check_float_scales(absmax.dtype, "absmax")
    # outside autograd on every path: blockwise.py [Note: quantizers are outside autograd]
    absmax, code = absmax.detach(), code.detach()
    if out is not None:
        if out.numel() != numel or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous tensor of {numel} elements (one per code); got shape "
                f"{tuple(out.shape)} (contiguous={out.is_contiguous()})"
            )
        _check_float_output(out.dtype, "out")
        result = out
    else:
        _check_float_output(dtype)
        result = torch.empty(
            shape if shape is not None else (numel,), dtype=dtype, device=codes.device
        )
        if result.numel() != numel:
            raise ValueError(f"shape {tuple(shape)} does not hold {numel} elements")
    if numel and code.numel() < 256 and int(flat.max()) >= code.numel():
        # the kernels index the map by the code: a code past a short map would read past it
        raise ValueError(
            f"codes hold {int(flat.max())}, but the map has {code.numel()} values; dequantize "
            "with the map the codes were made with"
        )
    if out is not None:
        _prepare_out(out, "out")  # [Note: out buffers are written outside autograd]
    values = result.view(-1)
    full = numel // block_size
    split = 0
    if (
        numel
        and flat.is_contiguous()
        and flat.device.type == "cpu"
        and code.device.type == "cpu"
        and absmax.device.type == "cpu"
        and _fastpath.use_native_out(values)
    ):
        _native_kernels.dequantize_codebook(
            flat, absmax.float().contiguous(), code.contiguous(), block_size, values
        )
        return result
    if full >= 2 and _fastpath.use_fastpath(flat):
        split = full * block_size
        _fastpath.dequantize_codebook_into(
            flat[:split].view(full, block_size),
            absmax[:full].float(),
            code.to(flat.device),
            values[:split].view(full, block_size),
        )
    if split != numel:
        values[split:] = _dequantize_codebook_reference(
            flat[split:], absmax[split // block_size :], code, block_size
        )
    return result


def _dequantize_codebook_reference(
    flat: Tensor, absmax: Tensor, code: Tensor, block_size: int
) -> Tensor:
    numel = flat.numel()
    num_blocks = absmax.numel()
    if num_blocks == 1:
        block_size = numel  # one block: no padding to materialise (see the quantizer)
    padded = num_blocks * block_size
    idx = flat.long()
    if padded != numel:
        idx = torch.cat([idx, idx.new_zeros(padded - numel)])
    values = code.to(flat.device)[idx].view(num_blocks, block_size) * absmax.float()[:, None]
    return values.view(-1)[:numel]
