"""The byte layout qwZ and qgZ put on the wire: rows of [fp32 scales | codes].

The fp32 "scales" are each block's absmax, the format of :mod:`qshard.quant.blockwise`
(``value = (code * fl(1 / qmax)) * absmax``, so a block's largest magnitude arrives exactly).
One row per destination (qgZ's all-to-all) or per source rank (qwZ's all-gather), so a
single uint8 collective moves codes and scales together (one message, one work handle).
A row holds ``m`` values, a multiple of ``block_size``: blocks never straddle rows, so the
codes of a row do not depend on how the buffer was cut (see the quant core's
[Note: chunk invariance]). ``bits=None`` sends the values themselves in ``wire_dtype``
(fp32 by default): the same path with quantization off.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qshard.quant.blockwise import (
    _dequantize_into,
    _quantize_into,
    dequantize_blocks,
    pack_int4,
    qmax_for_bits,
    quantize_blocks,
    unpack_int4,
)

__all__ = ["RowCodec"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _in_place(x: Tensor) -> bool:
    # CPU fp32/bf16/fp16 rows: every path of the quant core writes caller-given buffers.
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and x.is_contiguous()
    )


class RowCodec:
    """Encodes ``(rows, m)`` fp32 into ``(rows, row_bytes)`` uint8 and back."""

    __slots__ = ("bits", "block_size", "wire_dtype")

    def __init__(
        self, *, bits: int | None, block_size: int, wire_dtype: torch.dtype | None = None
    ) -> None:
        # ints only: a float (8.0, 256.0) passes the callers' range checks but not the byte
        # arithmetic of the rows
        if bits is not None and not (_is_int(bits) and bits in (4, 8)):
            raise ValueError(f"bits must be 4, 8 or None; got {bits!r}")
        if not _is_int(block_size) or block_size < 8 or block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8; got {block_size!r}")
        self.bits = bits
        self.block_size = block_size
        self.wire_dtype = wire_dtype or torch.float32

    def row_bytes(self, m: int) -> int:
        if self.bits is None:
            return m * self.wire_dtype.itemsize
        self._check(m)
        return 4 * (m // self.block_size) + m * self.bits // 8

    def _check(self, m: int) -> None:
        if m % self.block_size:
            raise ValueError(f"row length {m} is not a multiple of block_size {self.block_size}")

    def encode(self, x: Tensor) -> Tensor:
        """``(rows, m)`` float -> ``(rows, row_bytes(m))`` uint8."""
        rows, m = x.shape
        if self.bits is None:
            return x.to(self.wire_dtype).contiguous().view(torch.uint8).view(rows, -1)
        self._check(m)
        bs = self.block_size
        if _in_place(x):
            # [Note: wire rows in place] Each row's scales and codes are written straight
            # into its wire row by the quant core's kernels (INT4 packed there), instead of
            # quantizing into temporaries, packing INT4 with torch ops and concatenating:
            # the same bytes with three fewer passes over memory.
            out = torch.empty((rows, self.row_bytes(m)), dtype=torch.uint8, device=x.device)
            nb, qmax = m // bs, qmax_for_bits(self.bits)
            for r in range(rows):
                scales = out[r, : 4 * nb].view(torch.float32)
                codes = out[r, 4 * nb :].view(nb, bs * self.bits // 8)
                if self.bits == 8:
                    codes = codes.view(torch.int8)
                _quantize_into(x[r].view(nb, bs), qmax, "nearest", None, codes, scales)
            return out
        codes, scales = quantize_blocks(x.reshape(-1, bs), bits=self.bits)
        scale_bytes = scales.view(rows, m // bs).view(torch.uint8)
        if self.bits == 4:
            code_bytes = pack_int4(codes).view(rows, m // 2)
        else:
            code_bytes = codes.view(torch.uint8).view(rows, m)
        return torch.cat([scale_bytes, code_bytes], dim=1)

    def decode(self, buf: Tensor, m: int, *, dtype: torch.dtype = torch.float32) -> Tensor:
        """``(rows, row_bytes(m))`` uint8 -> ``(rows, m)`` values in ``dtype`` (dequantized in
        fp32 first)."""
        rows = buf.shape[0]
        if self.bits is None:
            return buf.contiguous().view(self.wire_dtype).view(rows, m).to(dtype)
        bs = self.block_size
        nb = m // bs
        if buf.device.type == "cpu" and buf.is_contiguous():
            # See [Note: wire rows in place]: each row decoded straight from its wire bytes.
            out = torch.empty((rows, m), dtype=dtype, device=buf.device)
            qmax = qmax_for_bits(self.bits)
            for r in range(rows):
                scales = buf[r, : 4 * nb].view(torch.float32)
                codes = buf[r, 4 * nb :].view(nb, bs * self.bits // 8)
                if self.bits == 8:
                    codes = codes.view(torch.int8)
                _dequantize_into(codes, scales, qmax, out[r].view(nb, bs))
            return out
        scales = buf[:, : 4 * nb].contiguous().view(torch.float32).reshape(-1)
        code_bytes = buf[:, 4 * nb :].contiguous()
        if self.bits == 4:
            codes = unpack_int4(code_bytes.view(-1))
        else:
            codes = code_bytes.view(torch.int8)
        return dequantize_blocks(codes.view(-1, bs), scales, bits=self.bits, dtype=dtype).view(
            rows, m
        )
