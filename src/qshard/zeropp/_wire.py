"""The byte layout qwZ and qgZ put on the wire: rows of [fp32 scales | codes].

The fp32 "scales" are each block's absmax, the format of :mod:`qshard.quant.blockwise`
(``value = (code * fl(1 / qmax)) * absmax``, so a block's largest magnitude arrives exactly).
One row per destination (qgZ's all-to-all) or per source rank (qwZ's all-gather), so a
single uint8 collective moves codes and scales together (one message, one work handle).

A row holds ``m`` values, a multiple of ``block_size``: blocks never straddle rows, so the
codes of a row do not depend on how the buffer was cut (see the quant core's
[Note: chunk invariance]). ``bits=None`` sends the values themselves in ``wire_dtype``
(fp32 by default): the same path with quantization off.

[Note: fused wire rows] On the CPU, with the quant core's C kernels, the passes around a
transfer are fused the way qgZ's Triton kernels fuse them on CUDA: ``encode_slots`` quantizes
slices of the unpermuted source straight into their wire rows (no reordered, padded copy),
``decode_slots`` dequantizes each row's slices straight into their places in the output (no
padded fp32 rows to copy out of), ``reduce`` dequantizes and sums the received rows block by
block (no decoded rows in memory) and ``reduce_encode`` requantizes each summed block while it
is in cache (no fp32 partial sums either). Every one computes what the composition of
``encode`` / ``decode`` / ``sum_rows`` computes, in the same order and roundings, so the bytes
and values are the same (tests/zeropp/test_wire.py); without the C kernels (or for other
dtypes and devices) the methods run that composition.

[Note: a trailer after each row] A caller that sends a few bytes of its own with every row (HSDP's
replicate all-reduce sends each sender's shard size, [Note: the shard size travels with hop 1])
allocates rows ``row_bytes(m) + t`` bytes wide and hands the codec their leading columns:
``encode(x, out=buf[:, :row_bytes(m)])``, then ``reduce`` / ``decode`` of the received
``buf[:, :row_bytes(m)]``. The in-place paths and C kernels address each row by the buffer's row
stride, so no pass copies the rows into or out of the wider buffer; row starts must keep fp32
alignment (``t`` a multiple of 4), or the methods take their copying paths.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import Tensor

from qshard.quant import _fastpath, _native_kernels
from qshard.quant.blockwise import (
    _dequantize_into,
    _quantize_into,
    dequantize_blocks,
    pack_int4,
    qmax_for_bits,
    quantize_blocks,
    unpack_int4,
)
from qshard.zeropp._common import sum_rows

__all__ = ["RowCodec", "Slot", "int64_bytes", "int64s"]

#: ``(start, length, padded)``: ``length`` values of a flat tensor from ``start``, zero-padded
#: to ``padded`` elements (a multiple of the block size) on the wire.
Slot = tuple[int, int, int]


def int64_bytes(values: Sequence[int], device: torch.device) -> Tensor:
    """``values`` as the bytes of int64s: a trailer after each wire row (a shard size, a
    node's range of sizes) that the receivers check, [Note: a trailer after each row]."""
    host = torch.tensor(list(values), dtype=torch.int64)
    if device.type != "cpu":  # pinned: a copy from pageable memory waits on the host
        host = host.pin_memory().to(device, non_blocking=True)
    return host.view(torch.uint8)


def int64s(trailers: Tensor) -> Tensor:
    """The int64s of each row's trailer bytes (:func:`int64_bytes`'s), ``(rows, k)``, on
    their device."""
    return trailers.contiguous().view(torch.int64).reshape(trailers.shape[0], -1)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _byte_rows(buf: Tensor) -> bool:
    """Whether the uint8 ``buf`` is 2-D rows of contiguous bytes the C kernels and the in-place
    paths can address: contiguous, or a column slice of a wider buffer (rows with a trailer,
    [Note: a trailer after each row]) whose row starts keep fp32 alignment."""
    if buf.storage_offset() % 4:
        return False
    if buf.is_contiguous():
        return True
    return (
        buf.dim() == 2
        and buf.stride(1) == 1
        and buf.stride(0) >= buf.shape[1]
        and buf.stride(0) % 4 == 0
    )


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

    def _fused(self, values: Tensor | None = None, *rows: Tensor) -> bool:
        """Whether the fused C kernels of [Note: fused wire rows] serve these CPU tensors:
        quantization on, the quant core's C kernels on, ``values`` (if any) contiguous fp32 and
        the wire ``rows`` rows of contiguous bytes, all on the CPU."""
        if self.bits is None or self.block_size > _native_kernels.SUM_BLOCK_MAX:
            return False
        if not (_fastpath.fastpath_enabled() and _fastpath._native_enabled):
            return False
        if values is not None and not (
            values.dtype == torch.float32 and values.device.type == "cpu" and values.is_contiguous()
        ):
            return False
        if any(r.device.type != "cpu" or not _byte_rows(r) for r in rows):
            return False
        return _native_kernels.available()

    def _check_rows(self, buf: Tensor, m: int) -> None:
        """``buf`` must be wire rows of ``m`` values: the C kernels read by these offsets."""
        if buf.dtype != torch.uint8 or buf.dim() != 2:
            raise TypeError(
                f"wire rows are a 2-D uint8 tensor; got {buf.dtype} of shape {tuple(buf.shape)}"
            )
        if buf.shape[1] != self.row_bytes(m):
            raise ValueError(
                f"rows of {buf.shape[1]} bytes do not hold {m} values ({self.row_bytes(m)} bytes)"
            )

    def encode_slots(
        self, src: Tensor, slots: Sequence[Slot], rows: int, *, out: Tensor | None = None
    ) -> Tensor:
        """The wire rows of slots of the flat ``src``: slot ``(start, length, padded)`` is
        ``src[start : start + length]`` zero-padded to ``padded`` elements; the slots fill
        ``rows`` rows of equal length in order, none straddling two rows. Byte for byte
        :meth:`encode` of those padded rows (in fp32), without building them: see
        [Note: fused wire rows]. ``out``: the rows to write, as :meth:`encode`'s (the leading
        columns of a wider buffer too, [Note: a trailer after each row])."""
        bs, numel = self.block_size, src.numel()
        total = 0
        for start, length, padded in slots:
            if padded % bs or not 0 <= length <= padded or start < 0 or start + length > numel:
                raise ValueError(
                    f"slot {(start, length, padded)} does not fit {numel} elements in blocks "
                    f"of {bs}"
                )
            total += padded
        if rows < 1 or total % rows:
            raise ValueError(f"{total} padded elements do not fill {rows} equal rows")
        m = total // rows
        self._check(m)
        pos = 0
        for slot in slots:
            if pos % m + slot[2] > m:
                raise ValueError(f"slot {slot} straddles rows of {m} elements")
            pos += slot[2]
        if out is not None:
            self._check_rows(out, m)
            if out.shape[0] != rows:
                raise ValueError(f"out has {out.shape[0]} rows; need {rows}")
        if not self._fused(src) or (out is not None and not self._fused(None, out)):
            x = torch.zeros(total, dtype=torch.float32, device=src.device)
            flat, pos = src.reshape(-1), 0
            for start, length, padded in slots:
                x[pos : pos + length].copy_(flat[start : start + length])
                pos += padded
            return self.encode(x.view(rows, m), out=out)
        if out is None:
            out = torch.empty((rows, self.row_bytes(m)), dtype=torch.uint8, device=src.device)
        row_bytes, nb = out.stride(0), m // bs  # a row's start, past any trailer
        per = bs * self.bits // 8  # code bytes per block
        qmax, pack4 = qmax_for_bits(self.bits), self.bits == 4
        base, x_ptr, pos = out.data_ptr(), src.data_ptr(), 0
        for start, length, padded in slots:
            r, col = divmod(pos, m)
            row, b0 = base + r * row_bytes, col // bs
            scales, codes = row + 4 * b0, row + 4 * nb + b0 * per
            if length:
                _native_kernels.quantize_int_at(
                    x_ptr + 4 * start, length, bs, qmax, pack4, codes, scales
                )
            done, blocks = -(-length // bs), padded // bs
            if done < blocks:  # all-padding blocks: absmax 0, codes 0, as encode writes them
                ctypes.memset(scales + 4 * done, 0, 4 * (blocks - done))
                ctypes.memset(codes + per * done, 0, per * (blocks - done))
            pos += padded
        return out

    def reduce(self, buf: Tensor, m: int, *, out: Tensor | None = None) -> Tensor:
        """The fp32 sum of the decoded rows of ``buf`` (``(rows, row_bytes(m))`` uint8),
        added in row order: ``sum_rows(decode(buf, m))``, into ``out`` (fp32, ``m``) when
        given; one pass, no decoded rows in memory (see [Note: fused wire rows])."""
        if out is not None and (out.dtype != torch.float32 or out.numel() != m):
            raise ValueError(f"out must hold {m} fp32 values; got {out.dtype} {tuple(out.shape)}")
        self._check_rows(buf, m)
        if not self._fused(out, buf):
            return sum_rows(self.decode(buf, m), out=out)
        if out is None:
            out = torch.empty(m, dtype=torch.float32, device=buf.device)
        _native_kernels.dequantize_sum_int(
            buf,
            stride=buf.stride(0),
            scale_off=0,
            code_off=4 * (m // self.block_size),
            rows=buf.shape[0],
            numel=m,
            block=self.block_size,
            qmax=qmax_for_bits(self.bits),
            out=out,
        )
        return out

    def reduce_encode(self, buf: Tensor, m: int, rows: int) -> Tensor:
        """``encode(reduce(buf, m).view(rows, m // rows))``: the row-order fp32 sum of the
        decoded rows of ``buf``, re-encoded as ``rows`` wire rows, with each block's sum
        requantized while it is in cache (see [Note: fused wire rows])."""
        if rows < 1 or m % rows:
            raise ValueError(f"{m} values do not make {rows} equal rows")
        self._check_rows(buf, m)
        if not self._fused(None, buf):
            return self.encode(self.reduce(buf, m).view(rows, m // rows))
        bs = self.block_size
        mo = m // rows
        self._check(mo)
        nb, nbo, per = m // bs, mo // bs, bs * self.bits // 8
        out = torch.empty((rows, self.row_bytes(mo)), dtype=torch.uint8, device=buf.device)
        for n in range(rows):
            _native_kernels.dequantize_sum_int(
                buf,
                stride=buf.stride(0),
                scale_off=4 * n * nbo,
                code_off=4 * nb + n * nbo * per,
                rows=buf.shape[0],
                numel=mo,
                block=bs,
                qmax=qmax_for_bits(self.bits),
                codes_out=out[n, 4 * nbo :],
                scales_out=out[n, : 4 * nbo].view(torch.float32),
            )
        return out

    def decode_slots(
        self, buf: Tensor, m: int, out_rows: Sequence[Tensor], slots: Sequence[Slot]
    ) -> None:
        """The inverse of :meth:`encode_slots` for every row of ``buf``: row ``g``'s slot
        ``(start, length, padded)`` (at the same place in the row as when encoded) is decoded
        into ``out_rows[g][start : start + length]``; padding is never written. The rows of
        ``out_rows`` are flat, contiguous, one dtype (fp32/bf16/fp16 on the C path). Values
        as :meth:`decode` with ``dtype`` the output's, without the padded rows in memory."""
        self._check_rows(buf, m)
        rows, bs = buf.shape[0], self.block_size
        if len(out_rows) != rows:
            raise ValueError(f"{rows} rows to decode into {len(out_rows)} outputs")
        if sum(padded for _, _, padded in slots) != m:
            raise ValueError(f"the slots' padded lengths do not add up to the row length {m}")
        room = min((o.numel() for o in out_rows), default=0)
        for start, length, padded in slots:
            if padded % bs or not 0 <= length <= padded or start < 0 or start + length > room:
                raise ValueError(
                    f"slot {(start, length, padded)} does not fit outputs of {room} elements in "
                    f"blocks of {bs}"
                )
        dtype = out_rows[0].dtype if rows else torch.float32
        fused = (
            rows
            and self._fused(None, buf)
            and all(o.dtype == dtype and _native_kernels.serves_output(o) for o in out_rows)
        )
        if not fused:
            values = self.decode(buf, m, dtype=dtype)
            pos = 0
            for start, length, padded in slots:
                for g in range(rows):
                    out_rows[g][start : start + length].copy_(values[g, pos : pos + length])
                pos += padded
            return
        nb, per = m // bs, bs * self.bits // 8
        qmax, pack4 = qmax_for_bits(self.bits), self.bits == 4
        row_bytes, base, el = buf.stride(0), buf.data_ptr(), out_rows[0].element_size()
        targets = [o.data_ptr() for o in out_rows]
        pos = 0
        for start, length, padded in slots:
            if length:
                b0 = pos // bs
                for g in range(rows):
                    row = base + g * row_bytes
                    _native_kernels.dequantize_int_at(
                        row + 4 * nb + b0 * per,
                        row + 4 * b0,
                        length,
                        bs,
                        qmax,
                        pack4,
                        targets[g] + el * start,
                        dtype,
                    )
            pos += padded

    def encode(self, x: Tensor, *, out: Tensor | None = None) -> Tensor:
        """``(rows, m)`` float -> ``(rows, row_bytes(m))`` uint8, written into ``out`` when
        given: a uint8 ``(rows, row_bytes(m))`` tensor on ``x``'s device, contiguous or the
        leading columns of a wider buffer ([Note: a trailer after each row])."""
        rows, m = x.shape
        if out is not None:
            self._check_out(out, rows, m, x.device)
        if self.bits is None:
            values = x.to(self.wire_dtype).contiguous().view(torch.uint8).view(rows, -1)
            return values if out is None else out.copy_(values)
        self._check(m)
        bs = self.block_size
        if _in_place(x) and (out is None or _byte_rows(out)):
            # [Note: wire rows in place] Each row's scales and codes are written straight
            # into its wire row by the quant core's kernels (INT4 packed there), instead of
            # quantizing into temporaries, packing INT4 with torch ops and concatenating:
            # the same bytes with three fewer passes over memory.
            if out is None:
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
        rows_out = torch.cat([scale_bytes, code_bytes], dim=1)
        return rows_out if out is None else out.copy_(rows_out)

    def _check_out(self, out: Tensor, rows: int, m: int, device: torch.device) -> None:
        shape = (rows, self.row_bytes(m))
        if out.dtype != torch.uint8 or tuple(out.shape) != shape or out.device != device:
            raise ValueError(
                f"out must be a uint8 tensor of shape {shape} on {device} (the wire rows of "
                f"{rows} x {m} values); got {out.dtype} of shape {tuple(out.shape)} on "
                f"{out.device}"
            )

    def decode(self, buf: Tensor, m: int, *, dtype: torch.dtype = torch.float32) -> Tensor:
        """``(rows, row_bytes(m))`` uint8 -> ``(rows, m)`` values in ``dtype`` (dequantized in
        fp32 first)."""
        rows = buf.shape[0]
        if self.bits is None:
            return buf.contiguous().view(self.wire_dtype).view(rows, m).to(dtype)
        bs = self.block_size
        nb = m // bs
        if buf.device.type == "cpu" and _byte_rows(buf):
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
