"""1-bit sign compression: 8 signs per byte, for 1-bit Adam and 0/1 Adam.

Format: bit ``7 - (i % 8)`` of byte ``i // 8`` is 1 when element ``i`` is non-negative
(most significant bit first) and 0 when it is negative. ``sign(0) = +1`` (also for -0.0,
matching 1-bit Adam, which never sends a zero); NaN packs as +1, so a caller that must
detect divergence checks its scale, not the signs. The unused low bits of the last byte
are zero. The magnitude (the compression scale) travels separately; see
``qshard.comm.compressed``.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from qshard import _triton
from qshard.quant import _fastpath, _native_kernels
from qshard.quant.blockwise import _check_float_output, _prepare_out

__all__ = ["pack_signs", "unpack_signs"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _bit_weights(device: torch.device) -> Tensor:
    return torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=device)


def pack_signs(x: Tensor) -> Tensor:
    """Pack the signs of ``x`` (any shape, read flat): uint8 of ``ceil(numel / 8)`` bytes."""
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"pack_signs supports {_FLOAT_DTYPES}; got {x.dtype}")
    flat = x.reshape(-1)
    if _triton.serves(flat) and flat.dtype != torch.float64:  # docs/gpu.md
        return _triton.pack_signs(flat.contiguous())
    numel = flat.numel()
    out = torch.empty(-(-numel // 8), dtype=torch.uint8, device=flat.device)
    if numel and _fastpath.use_native(flat):
        _native_kernels.pack_signs(flat, out)
        return out
    full = numel // 8
    split = 0
    if full >= 2 and _fastpath.use_fastpath(flat):
        split = full
        _fastpath.pack_signs_into(flat[: full * 8].view(full, 8), out[:full])
    if split != out.numel():
        out[split:] = _pack_signs_reference(flat[split * 8 :])
    return out


def _pack_signs_reference(flat: Tensor) -> Tensor:
    numel = flat.numel()
    nbytes = -(-numel // 8)
    bits = (~(flat < 0)).to(torch.uint8)
    if nbytes * 8 != numel:
        bits = torch.cat([bits, bits.new_zeros(nbytes * 8 - numel)])
    return (bits.view(nbytes, 8) * _bit_weights(flat.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(
    packed: Tensor, numel: int, *, dtype: torch.dtype = torch.float32, out: Tensor | None = None
) -> Tensor:
    """Inverse of :func:`pack_signs`: ``numel`` values of ``+1`` / ``-1`` in ``dtype``.

    With ``out`` (a contiguous tensor of ``numel`` elements on ``packed``'s device, any shape)
    the values are written there and ``out`` is returned (``dtype`` is then ignored in favour
    of ``out.dtype``); this saves the allocation, which for large tensors costs as much as
    the unpacking itself.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_signs expects uint8; got {packed.dtype}")
    # 9.0 passed the size check below (-(-9.0 // 8) == 2) and then failed inside torch.empty
    # ("must be tuple of ints, not float"), or was accepted with out=; True unpacked one sign.
    try:
        if isinstance(numel, bool):
            raise TypeError
        numel = operator.index(numel)  # ints, numpy ints, 0-d integer tensors
    except TypeError:
        raise TypeError(
            f"numel must be an int (the element count given to pack_signs); got {numel!r} "
            f"(pass int(numel))"
        ) from None
    flat = packed.reshape(-1)
    if numel < 0:
        raise ValueError(f"numel must be >= 0 (the element count given to pack_signs); got {numel}")
    if flat.numel() != -(-numel // 8):
        raise ValueError(
            f"{numel} signs need ceil({numel} / 8) = {-(-numel // 8)} bytes; got {flat.numel()}"
        )
    result = None
    if out is not None:
        if out.numel() != numel or not out.is_contiguous() or out.device != flat.device:
            raise ValueError(
                f"out must be a contiguous tensor of {numel} elements on {flat.device}; got "
                f"shape {tuple(out.shape)} on {out.device} (contiguous={out.is_contiguous()})"
            )
        result = out
        out = out.view(-1)
        dtype = out.dtype
    _check_float_output(dtype, "out" if result is not None else "dtype")
    if result is not None:
        _prepare_out(result, "out")  # blockwise.py [Note: out buffers are written outside autograd]
    if _triton.serves(flat):  # docs/gpu.md
        values = _triton.unpack_signs(flat.contiguous(), numel, dtype=dtype)
        if result is None:
            return values
        out.copy_(values)
        return result
    if result is None:
        out = result = torch.empty(numel, dtype=dtype, device=flat.device)
    if numel and flat.is_contiguous() and _fastpath.use_native_out(out):
        _native_kernels.unpack_signs(flat, out)
        return result
    full = numel // 8
    split = 0
    if full >= 2 and _fastpath.use_fastpath(out):
        split = full
        _fastpath.unpack_signs_into(flat[:full], out[: full * 8].view(full, 8))
    if split != flat.numel():
        out[split * 8 :] = _unpack_signs_reference(flat[split:], dtype)[: numel - split * 8]
    return result


def _unpack_signs_into(packed: Tensor, out: Tensor) -> None:
    """:func:`unpack_signs` for trusted callers in a loop over many tensors (the 1-bit
    all-reduce's per-tensor round): ``packed`` holds the ``ceil(out.numel() / 8)`` bytes,
    ``out`` is contiguous; nothing is checked, so the C kernel is called with no wrapper."""
    if out.numel() and packed.is_contiguous() and _fastpath.use_native_out(out):
        _native_kernels.unpack_signs(packed, out)
    else:
        unpack_signs(packed, out.numel(), out=out)


def _unpack_signs_reference(flat: Tensor, dtype: torch.dtype) -> Tensor:
    bits = (flat[:, None] & _bit_weights(flat.device)) != 0
    return torch.where(bits, 1.0, -1.0).to(dtype).view(-1)
