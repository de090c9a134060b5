"""Block-wise symmetric absmax INT8 / INT4 quantization and INT4 nibble packing.

This file owns the wire format of qwZ (INT8 weights) and qgZ (INT4 gradients):

* The tensor is flattened and cut into contiguous blocks of ``block_size`` elements (the
  last one zero-padded internally; padding never leaks out of :func:`dequantize_blockwise`).
* Each block stores its fp32 **absmax** (the field is called ``scales`` for the wire format's
  sake: it holds ``max |x|`` of the block, not ``absmax / qmax``). With ``qmax = 2**(bits-1)
  - 1`` (127 for INT8, 7 for INT4) and ``R = fl(1 / qmax)`` (fp32), the codes are
  ``round_half_even(fl(fl(x / absmax) * qmax))`` clamped to ``[-qmax, qmax]`` and
  dequantization is ``fl(fl(code * R) * absmax)``: two fp32 multiplies in that order (never
  fused, never reassociated), on every path (reference, C, torch.compile, Triton).

[Note: scale choice] The block's largest magnitude round-trips **exactly**: ``+-absmax``
normalises to exactly ``+-1`` (an IEEE division of a number by itself), so it takes code
``+-qmax``, and ``fl(qmax * R) == 1`` exactly in fp32 for 127 and 7 (checked at import), so
``fl(fl(qmax * R) * absmax) == absmax`` for every fp32 absmax, subnormals included. The
previous format stored ``scale = absmax / qmax`` and computed ``code * scale``; no fp32 scale
times qmax reaches every mantissa, so ``+-absmax`` came back one ulp off for 0.8% (INT8) / 11%
(INT4) of mantissas. A ``/2**(bits-1)`` scale would even clip ``+absmax`` to 127/128 of itself.
Codes are ``x / absmax`` times ``qmax`` rather than ``x * fl(qmax / absmax)``: the latter
needs a special case where ``qmax / absmax`` overflows to Inf (absmax below ~4e-37, where
``0 * Inf`` is NaN); ``x / absmax`` lies in [-1, 1] for every finite block. The cost is one
unused code (-128 / -8).

[Note: non-finite blocks] A block holding NaN or +-Inf stores a NaN absmax and zero codes, so
the whole block dequantizes to NaN: a diverged value is never silently turned into a finite
one, and a training loop's ``isfinite`` check still fires. An all-zero block stores absmax 0
and dequantizes to exact zeros (never NaN).

[Note: chunk invariance] Codes and scales of a block depend only on that block's elements, so
quantizing any slice that starts and ends on block boundaries gives exactly the codes of the
same blocks of the whole tensor (qgZ quantizes per-destination slices; optimizer shards must
agree with the unsharded tensor). Stochastic rounding draws its random numbers in order over
the blocks it is given, so it is chunk-invariant only in distribution.

[Note: quantizers are outside autograd] Quantization is not differentiable (integer codes),
so the quantizers read a detached ``x``. Without that, the torch paths (reference and
torch.compile: every bf16/fp16 input, stochastic rounding, no C compiler) returned a block
absmax with a ``grad_fn`` when ``x`` was a parameter, while the C kernels (which write through
pointers) did not: the same call gave different tensors by path, kept ``x``'s graph alive, and
turned an ``out=`` buffer into a non-leaf that ``copy.deepcopy`` (of optimizer state) refuses.
The dequantizers likewise read a detached block absmax (and code map): given ``scales`` /
``absmax`` / ``code`` that required grad (scales computed from a parameter, a learned map),
the torch paths returned a result with a ``grad_fn`` and the C kernels a plain tensor, so
gradients reached the scales on some paths only. A learned-scale scheme writes the two
multiplies itself: ``(codes.float() * code_step(qmax)) * scales[:, None]``.

[Note: out buffers are written outside autograd] Every ``out=`` of the dequantizers (and of
:func:`~qshard.quant.quantize_codebook` and :func:`~qshard.quant.unpack_signs`) is checked by
``_prepare_out``: the C kernels write through a pointer, so autograd never saw those writes.
A buffer saved for backward (``loss = (w * buf).sum()``, then ``out=buf``) was overwritten
without a version bump, so ``backward`` silently used the new values on the C path and raised
"modified by an inplace operation" on the torch paths; an ``out`` that requires grad (a
parameter, with grad mode on) or an inference tensor outside inference mode was written by C
and refused with a cryptic in-place error by torch. Now every path bumps the version counter
and refuses the last two up front, naming the fix (``torch.no_grad()`` / ``.detach()``,
``torch.inference_mode()`` / ``.clone()``).

INT4 packing follows DeepSpeed's layout: element ``2k`` in the high nibble of byte ``k``,
``2k+1`` in the low nibble, each a 4-bit two's-complement integer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from qshard import _triton
from qshard._native import advise_huge_pages
from qshard.quant import _fastpath, _native_kernels

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "BlockQuantized",
    "code_step",
    "dequantize_blocks",
    "dequantize_blockwise",
    "pack_int4",
    "qmax_for_bits",
    "quantize_blocks",
    "quantize_blockwise",
    "unpack_int4",
]

#: Default elements per block: 4 bytes of fp32 scale per 256 elements is 1.6% overhead for
#: INT8 and 3.1% for INT4 on the wire; small enough that FSDP shards and qgZ slices (which
#: must be multiples of the block size for chunk invariance) rarely need padding.
DEFAULT_BLOCK_SIZE = 256

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ROUNDINGS = ("nearest", "stochastic")


def qmax_for_bits(bits: int) -> int:
    """Largest code magnitude for ``bits``: 127 for INT8, 7 for INT4 (symmetric range)."""
    if bits not in (4, 8) or not isinstance(bits, int):
        raise ValueError(f"bits must be 4 or 8; got {bits!r}")
    return (1 << (bits - 1)) - 1


def code_step(qmax: int) -> float:
    """``R = fl(1 / qmax)`` in fp32 (as a Python float holding that fp32 value): dequantized
    values are ``fl(fl(code * R) * absmax)``; see [Note: scale choice]."""
    return float(torch.tensor(1.0, dtype=torch.float32) / qmax)


# The exactness of +-absmax rests on fl(qmax * fl(1 / qmax)) == 1 in fp32.
for _q in (127, 7):
    assert float(torch.tensor(_q, dtype=torch.float32) * code_step(_q)) == 1.0, _q
del _q


@dataclass(frozen=True, slots=True, eq=False)  # tensors: identity equality and hash
class BlockQuantized:
    """A block-quantized tensor: plain tensors (so they can be all-gathered) plus metadata.

    Fields:
        codes: ``bits=8``: int8 of shape ``(padded_numel,)``; ``bits=4``: uint8 of shape
            ``(padded_numel // 2,)`` holding two codes per byte (see :func:`pack_int4`).
        scales: fp32 of shape ``(num_blocks,)``: each block's **absmax** (``max |x|``; NaN
            for a block holding NaN/Inf, 0 for an all-zero block), not ``absmax / qmax``;
            ``value = (code * fl(1 / qmax)) * scales[block]`` in fp32 (see
            :func:`code_step` and [Note: scale choice]).
        shape: shape of the original tensor.
        dtype: dtype of the original tensor (the default dequantization dtype).
        numel: number of elements of the original tensor (``<= padded_numel``).
        bits: 8 or 4.
        block_size: elements per block.
    """

    codes: Tensor
    scales: Tensor
    shape: torch.Size
    dtype: torch.dtype
    numel: int
    bits: int
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.scales.numel()

    @property
    def padded_numel(self) -> int:
        return self.num_blocks * self.block_size

    def nbytes(self) -> int:
        """Bytes of payload (codes + scales), what a collective moves."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4

    def to(self, device: torch.device | str | int, *, non_blocking: bool = False) -> BlockQuantized:
        """This quantized tensor with codes and scales on ``device`` (as bitsandbytes'
        ``QuantState.to``); dtypes and metadata unchanged, ``self`` if both are there already.
        Only a device move: ``dtype`` here is the dequantization default, not a cast."""
        if not isinstance(device, (torch.device, str, int)) or isinstance(device, bool):
            raise TypeError(
                f"BlockQuantized.to takes a device (moving only); got {device!r} (to change the "
                "result dtype pass dtype= to dequantize_blockwise)"
            )
        device = torch.device(device)
        codes = self.codes.to(device, non_blocking=non_blocking)
        scales = self.scales.to(device, non_blocking=non_blocking)
        if codes is self.codes and scales is self.scales:
            return self
        return dataclasses.replace(self, codes=codes, scales=scales)


# torch.load reads only allow-listed types by default (weights_only=True since torch 2.6): a
# saved BlockQuantized (tensors, a torch.Size, a dtype, ints) is as safe to read as a tensor.
torch.serialization.add_safe_globals([BlockQuantized])


def _check_rounding(rounding: str) -> None:
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be one of {_ROUNDINGS}; got {rounding!r}")


def _check_block_size(block_size: int, bits: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int; got {block_size!r}")
    if bits == 4 and block_size % 2:
        raise ValueError(
            f"INT4 packs two codes per byte, so block_size must be even; got {block_size}"
        )


def _quantize_blocks_reference(
    x2d: Tensor, qmax: int, rounding: str, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """The plain torch definition every fast path is tested against (bit-exact); returns
    int8 codes and the fp32 block absmax (NaN for non-finite blocks)."""
    x = x2d.float()
    absmax = x.abs().amax(dim=1)
    finite = torch.isfinite(absmax)
    # Zero blocks would divide 0 by 0; they (and non-finite ones) quantize to code 0.
    usable = finite & (absmax > 0)
    divisor = torch.where(usable, absmax, torch.ones_like(absmax))
    v = (x / divisor[:, None]) * qmax  # two fp32 roundings: x / absmax in [-1, 1], then * qmax
    if rounding == "nearest":
        r = torch.round(v)  # round half to even
    else:
        noise = torch.rand(v.shape, generator=generator, device=v.device, dtype=torch.float32)
        r = torch.floor(v + noise)
    r = torch.where(usable[:, None], r.clamp(-qmax, qmax), torch.zeros_like(r))
    codes = r.to(torch.int8)
    absmax = torch.where(finite, absmax, torch.full_like(absmax, float("nan")))
    return codes, absmax


def _dequantize_blocks_reference(codes2d: Tensor, absmax: Tensor, qmax: int) -> Tensor:
    """``fl(fl(code * R) * absmax)`` per row in fp32 (int8 codes); see [Note: scale choice]."""
    return (codes2d.float() * code_step(qmax)) * absmax.float()[:, None]


def quantize_blocks(
    x2d: Tensor,
    *,
    bits: int,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Quantize each row of ``x2d`` (one block per row) to symmetric ``bits``-bit codes.

    Args:
        x2d: ``(num_blocks, block_size)`` fp32, bf16 or fp16; computed in fp32.
        bits: 8 or 4.
        rounding: ``"nearest"`` (round half to even) or ``"stochastic"`` (``floor(v + u)``,
            ``u ~ U[0, 1)`` from ``generator``; unbiased for gradients).
        generator: random source for stochastic rounding (the global one if ``None``).

    Returns:
        ``(codes, scales)``: int8 codes of shape ``(num_blocks, block_size)`` in
        ``[-qmax, qmax]`` (unpacked, also for INT4) and the fp32 block absmax of shape
        ``(num_blocks,)`` (see :class:`BlockQuantized`; dequantize with the same ``bits``).
    """
    qmax = qmax_for_bits(bits)
    _check_rounding(rounding)
    if x2d.dim() != 2:
        raise ValueError(
            f"quantize_blocks expects a 2-D (num_blocks, block_size) tensor; "
            f"got shape {tuple(x2d.shape)}"
        )
    if x2d.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"quantize_blocks supports {_FLOAT_DTYPES}; got {x2d.dtype}")
    if x2d.shape[1] == 0:
        raise ValueError("quantize_blocks needs blocks of at least one element; got 0 columns")
    x2d = x2d.detach()  # [Note: quantizers are outside autograd]
    codes = torch.empty(x2d.shape, dtype=torch.int8, device=x2d.device)
    scales = torch.empty(x2d.shape[0], dtype=torch.float32, device=x2d.device)
    _quantize_into(x2d, qmax, rounding, generator, codes, scales)
    return codes, scales


def _quantize_into(
    x2d: Tensor,
    qmax: int,
    rounding: str,
    generator: torch.Generator | None,
    codes_out: Tensor,
    scales_out: Tensor,
) -> None:
    """Quantize rows of ``x2d`` into ``codes_out`` (int8 unpacked, or uint8 packed INT4)."""
    if _triton.serves(x2d):  # fused Triton kernel, same codes (docs/gpu.md)
        pack = codes_out.dtype == torch.uint8
        bits = 8 if qmax == 127 else 4
        _triton.quantize_blocks(
            x2d,
            bits=bits,
            rounding=rounding,
            generator=generator,
            pack=pack,
            out=(codes_out, scales_out),
        )
        return
    if (
        rounding == "nearest"
        and x2d.numel()
        and codes_out.is_contiguous()
        and scales_out.is_contiguous()
        and _fastpath.use_native(x2d)
    ):
        _native_kernels.quantize_int(x2d, x2d.numel(), x2d.shape[1], qmax, codes_out, scales_out)
        return
    if (
        rounding == "nearest"
        and x2d.shape[0] >= 2
        and x2d.is_contiguous()
        and _fastpath.use_fastpath(x2d)
    ):
        _fastpath.quantize_int_into(x2d, qmax, codes_out, scales_out)
        return
    codes, scales = _quantize_blocks_reference(x2d, qmax, rounding, generator)
    if codes_out.dtype == torch.uint8:
        codes = pack_int4(codes)
    codes_out.copy_(codes.view(codes_out.shape))
    scales_out.copy_(scales)


def dequantize_blocks(
    codes2d: Tensor,
    scales: Tensor,
    *,
    bits: int,
    dtype: torch.dtype = torch.float32,
    out: Tensor | None = None,
) -> Tensor:
    """``(codes2d * fl(1 / qmax)) * scales[:, None]`` in fp32, cast to ``dtype`` (or written
    into ``out``).

    Args:
        codes2d: int8 ``(num_blocks, block_size)`` unpacked codes.
        scales: fp32 ``(num_blocks,)`` block absmax, as :func:`quantize_blocks` returns.
        bits: the ``bits`` the codes were quantized with (8 or 4; required: the codes of
            both are int8 here, and the value of a code depends on ``qmax``).
        dtype: result dtype when ``out`` is not given.
        out: optional preallocated contiguous tensor with ``num_blocks * block_size``
            elements (any shape); its dtype wins.
    """
    if codes2d.dim() != 2 or scales.shape != (codes2d.shape[0],):
        raise ValueError(
            f"dequantize_blocks needs codes (num_blocks, block_size) and scales (num_blocks,); "
            f"got {tuple(codes2d.shape)} and {tuple(scales.shape)}"
        )
    if codes2d.dtype != torch.int8:
        raise TypeError(f"dequantize_blocks expects int8 codes; got {codes2d.dtype}")
    _check_float_scales(scales.dtype, "scales")
    scales = scales.detach()  # [Note: quantizers are outside autograd] (dequantizers too)
    qmax = qmax_for_bits(bits)
    if out is not None:
        _check_out(out, codes2d.numel())
        _prepare_out(out, "out")
        result = out
    else:
        _check_float_output(dtype)
        result = torch.empty(codes2d.shape, dtype=dtype, device=codes2d.device)
    _dequantize_into(codes2d, scales, qmax, result.view(codes2d.shape))
    return result


def _dequantize_into(codes2d: Tensor, scales: Tensor, qmax: int, out2d: Tensor) -> None:
    """``out2d = (code * R) * absmax`` per row; ``codes2d`` int8, or uint8 packed INT4 (half
    width, then ``qmax`` is 7)."""
    if _triton.serves(codes2d) and out2d.is_contiguous():  # docs/gpu.md
        c, s = codes2d.contiguous(), scales.float().contiguous()
        _triton.dequantize_blocks(
            c, s, bits=8 if qmax == 127 else 4, block_size=out2d.shape[1], out=out2d
        )
        return
    if (
        out2d.numel()
        and codes2d.is_contiguous()
        and codes2d.device.type == "cpu"
        and _fastpath.use_native_out(out2d)
    ):
        scales = scales.float().contiguous()
        _native_kernels.dequantize_int(codes2d, scales, out2d.numel(), out2d.shape[1], qmax, out2d)
        return
    if codes2d.shape[0] >= 2 and codes2d.is_contiguous() and _fastpath.use_fastpath(out2d):
        _fastpath.dequantize_int_into(codes2d, scales.float(), qmax, out2d)
        return
    if codes2d.dtype == torch.uint8:
        codes2d = unpack_int4(codes2d).view(out2d.shape)
    out2d.copy_(_dequantize_blocks_reference(codes2d, scales, qmax))


def _check_out(out: Tensor, numel: int) -> None:
    if out.numel() != numel or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous tensor of {numel} elements; got shape {tuple(out.shape)}"
            f" (contiguous={out.is_contiguous()})"
        )
    _check_float_output(out.dtype, "out")


def _prepare_out(t: Tensor, what: str) -> None:
    """Admit a caller's buffer that a kernel is about to overwrite; see [Note: out buffers are
    written outside autograd]. Refuses what torch refuses of an in-place write (the torch paths
    used to raise that cryptically while the C kernels wrote anyway), then bumps ``t``'s version
    counter, which the C and Triton kernels (writing through a pointer) would not."""
    if t.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            f"{what} requires grad, and qshard.quant writes it in place outside autograd; call "
            f"under torch.no_grad() (as for param.copy_) or pass {what}.detach()"
        )
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{what} is an inference tensor (made under torch.inference_mode()), which torch "
            f"does not let anything update in place outside inference mode; call under "
            f"torch.inference_mode() or pass {what}.clone()"
        )
    torch.autograd.graph.increment_version(t)


def _check_float_output(dtype: torch.dtype, what: str = "dtype") -> None:
    """Dequantized values are floats: an integer, bool or complex result would silently
    truncate them (``copy_`` casts), so refuse it."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"dequantized values are floating point; got {what} {dtype} (pass a float dtype such "
            "as torch.float32, then cast the result yourself if you need another type)"
        )


def _check_float_scales(dtype: torch.dtype, what: str) -> None:
    """The block absmax is a float: integer scales (``scales.long()`` by mistake) would
    truncate every block's magnitude (0.9 -> 0 makes the block all zeros) without a word."""
    if not dtype.is_floating_point:
        raise TypeError(
            f"{what} hold each block's fp32 absmax; got {dtype} (pass the float32 tensor the "
            "quantizer returned)"
        )


def _check_quantized(q: BlockQuantized) -> int:
    """Refuse a :class:`BlockQuantized` whose fields disagree (hand-built or edited): the
    kernels index its codes and scales by these sizes. Returns the codes per block."""
    qmax_for_bits(q.bits)
    _check_block_size(q.block_size, q.bits)
    per_block = q.block_size if q.bits == 8 else q.block_size // 2
    want_dtype = torch.int8 if q.bits == 8 else torch.uint8
    num_blocks = -(-q.numel // q.block_size) if q.numel >= 0 else -1
    problems = []
    if q.numel < 0 or math.prod(q.shape) != q.numel:
        problems.append(f"shape {tuple(q.shape)} does not hold numel={q.numel} elements")
    if q.scales.dim() != 1 or q.scales.numel() != num_blocks:
        problems.append(
            f"scales has shape {tuple(q.scales.shape)}, expected ({num_blocks},) "
            f"(ceil(numel / block_size))"
        )
    if q.codes.dtype != want_dtype or q.codes.numel() != num_blocks * per_block:
        problems.append(
            f"codes are {q.codes.dtype} with {q.codes.numel()} elements, expected {want_dtype} "
            f"with {num_blocks * per_block} (bits={q.bits}, block_size={q.block_size})"
        )
    if q.scales.device != q.codes.device:
        problems.append(f"codes on {q.codes.device} but scales on {q.scales.device}")
    if not q.scales.dtype.is_floating_point:
        problems.append(f"scales are {q.scales.dtype}, expected torch.float32 (the block absmax)")
    if problems:
        raise ValueError(
            "inconsistent BlockQuantized: "
            + "; ".join(problems)
            + " (build it with quantize_blockwise, and keep its fields together)"
        )
    return per_block


def pack_int4(codes: Tensor) -> Tensor:
    """Pack int8 codes in ``[-8, 7]`` two per byte: element ``2k`` high nibble, ``2k+1`` low.

    ``codes`` is flattened and must have an even number of elements; returns uint8 of
    ``numel // 2`` elements.
    """
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        raise ValueError(f"pack_int4 needs an even number of codes; got {flat.numel()}")
    if flat.dtype != torch.int8:
        raise TypeError(f"pack_int4 expects int8 codes; got {flat.dtype}")
    if _triton.serves(flat):  # docs/gpu.md
        return _triton.pack_int4(flat.contiguous())
    pairs = flat.view(torch.uint8).view(-1, 2)
    return (pairs[:, 0] << 4) | (pairs[:, 1] & 0x0F)


def unpack_int4(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_int4`: uint8 ``(n,)`` -> int8 codes ``(2n,)`` in ``[-8, 7]``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_int4 expects uint8; got {packed.dtype}")
    if _triton.serves(packed):  # docs/gpu.md
        return _triton.unpack_int4(packed.reshape(-1).contiguous())
    b = packed.reshape(-1).view(torch.int8)
    out = torch.empty(b.numel(), 2, dtype=torch.int8, device=b.device)
    out[:, 0] = b >> 4  # arithmetic shift sign-extends the high nibble
    out[:, 1] = (b << 4) >> 4  # move the low nibble up, then sign-extend it back down
    return out.view(-1)


def quantize_blockwise(
    x: Tensor,
    *,
    bits: int = 8,
    block_size: int = DEFAULT_BLOCK_SIZE,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> BlockQuantized:
    """Block-quantize ``x`` (any shape, fp32/bf16/fp16) to INT8 or packed INT4.

    See the module docstring for the format, the scale choice, and how NaN/Inf and zero
    blocks are handled.
    """
    qmax = qmax_for_bits(bits)
    _check_block_size(block_size, bits)
    _check_rounding(rounding)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"quantize_blockwise supports {_FLOAT_DTYPES}; got {x.dtype}")
    flat = x.detach().reshape(-1)  # [Note: quantizers are outside autograd]
    numel = flat.numel()
    num_blocks = -(-numel // block_size)
    full = numel // block_size
    per_block = block_size if bits == 8 else block_size // 2
    codes = torch.empty(
        num_blocks * per_block, dtype=torch.int8 if bits == 8 else torch.uint8, device=x.device
    )
    if codes.device.type == "cpu":
        advise_huge_pages(codes.data_ptr(), codes.numel())  # fewer first-touch faults
    scales = torch.empty(num_blocks, dtype=torch.float32, device=x.device)
    if rounding == "nearest" and _fastpath.use_native(flat):
        # One call for every block, the partial last one included (padding codes are 0).
        _native_kernels.quantize_int(flat, numel, block_size, qmax, codes, scales)
        full = num_blocks = 0
    if full:
        _quantize_into(
            flat[: full * block_size].view(full, block_size),
            qmax,
            rounding,
            generator,
            codes[: full * per_block].view(full, per_block),
            scales[:full],
        )
    if full != num_blocks:  # the torch paths take whole blocks only
        # The partial last block, zero-padded: zeros cannot raise its absmax, so padding
        # never changes the codes of real elements.
        tail = flat.new_zeros(1, block_size)
        tail[0, : numel - full * block_size] = flat[full * block_size :]
        _quantize_into(
            tail, qmax, rounding, generator, codes[full * per_block :].view(1, -1), scales[full:]
        )
    return BlockQuantized(
        codes=codes,
        scales=scales,
        shape=x.shape,
        dtype=x.dtype,
        numel=numel,
        bits=bits,
        block_size=block_size,
    )


def dequantize_blockwise(
    q: BlockQuantized, *, dtype: torch.dtype | None = None, out: Tensor | None = None
) -> Tensor:
    """Dequantize ``q`` to its original shape in ``dtype`` (default ``q.dtype``).

    With ``out`` (a contiguous tensor of ``q.numel`` elements, e.g. FSDP's all-gather output)
    the values are written there and ``out`` is returned; ``dtype`` must then be ``None`` or
    ``out.dtype``.
    """
    if not isinstance(q, BlockQuantized):
        # bitsandbytes passes (codes, absmax) / a QuantState here: that used to end in
        # "AttributeError: 'tuple' object has no attribute 'bits'"
        raise TypeError(
            f"dequantize_blockwise takes the BlockQuantized that quantize_blockwise returned; got "
            f"{type(q).__name__} (for quantize_codebook's (codes, absmax) use dequantize_codebook, "
            "for quantize_blocks' rows use dequantize_blocks)"
        )
    # the kernels trust these sizes: a hand-built BlockQuantized must not read or write past them
    per_block = _check_quantized(q)
    if q.scales.requires_grad:  # [Note: quantizers are outside autograd] (dequantizers too)
        q = dataclasses.replace(q, scales=q.scales.detach())
    if out is not None:
        _check_out(out, q.numel)
        if dtype is not None and dtype != out.dtype:
            raise ValueError(f"dtype {dtype} conflicts with out.dtype {out.dtype}; pass one")
        _prepare_out(out, "out")
        result = out
    else:
        dtype = q.dtype if dtype is None else dtype
        _check_float_output(dtype)
        result = torch.empty(q.shape, dtype=dtype, device=q.codes.device)
    flat = result.view(-1)
    bs = q.block_size
    full = q.numel // bs
    qmax = qmax_for_bits(q.bits)
    # Codes are read flat on every path (the C kernel reads them through a pointer): a codes
    # tensor of another shape with the right count (a row view of an all-gather output) must
    # not reach the slicing below, which would cut its first dimension.
    codes = q.codes.reshape(-1)
    if codes.is_contiguous() and codes.device.type == "cpu" and _fastpath.use_native_out(flat):
        scales = q.scales.float().contiguous()
        _native_kernels.dequantize_int(codes, scales, q.numel, bs, qmax, flat)
        return result
    if full:
        _dequantize_into(
            codes[: full * per_block].view(full, per_block),
            q.scales[:full],
            qmax,
            flat[: full * bs].view(full, bs),
        )
    if full != q.num_blocks:
        tail = torch.empty(1, bs, dtype=flat.dtype, device=flat.device)
        _dequantize_into(codes[full * per_block :].view(1, per_block), q.scales[full:], qmax, tail)
        flat[full * bs :] = tail[0, : q.numel - full * bs]
    return result
