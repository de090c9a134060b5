"""The 8192-entry search table of exact nearest-code encoding, its one builder, and the one C
definition of the encoder that reads it (``NEAREST_C``, compiled into both the dynamic-map
quantizer, :mod:`qshard.quant._native_kernels`, and the fused 8-bit optimizer kernel,
:mod:`qshard.optim._kernels`).

Encoding against a sorted code map of at most 256 values means: the index of the code is the
number of code midpoints strictly below the value (``torch.bucketize(v, mids)``, a value on a
midpoint takes the lower code). Normalised values lie in [-1, 1], and in the maps we ship
(dynamic, few-bit dynamic, unsigned) consecutive midpoints are never closer than one fp32
"bucket" of 7 mantissa bits, so the search needs no loop:

* a bucket is the sign of ``v`` and the top 15 bits of ``|v|`` (8 exponent bits, 7 mantissa
  bits), with the magnitude clamped to [2^-31, 2^1): ``t = clamp((|bits| >> 16) - (96 << 7),
  0, 4095)``; index ``(sign << 12) | t``. 8192 entries of 4 bytes: 32 KiB, one L1.
* entry bits 16-31: ``base``, the number of midpoints certainly below the bucket (at most
  255); bits 0-15: a 16-bit compare ``key`` such that ``v`` lies above the one midpoint inside
  the bucket iff ``key(v) > key`` with ``key(v) = low16(v) ^ (sign ? 0xFFFF : 0)``. A midpoint
  inside the bucket shares ``v``'s top 16 bits, so comparing the low 16 bits decides
  ``v > mid`` (reversed for negative values, where ``v > mid`` means ``|v| < |mid|``: hence the
  XOR and the stored ``0xFFFF - low16(mid)``); a bucket without a midpoint stores 0xFFFF, which
  no ``key(v)`` exceeds.
* the code is ``(e >> 16) + (key(v) > (e & 0xFFFF))``: one table load and ONE integer compare,
  8 lanes at a time with AVX2 (one gather).

:func:`build_search_table` builds the table from the fp32 midpoints with ``torch.bucketize``
and refuses (``None``) a map where a bucket holds two midpoints or the clamped bucket 0 holds
one (e.g. the signed linear map, whose duplicate zero puts a midpoint at 0); the quantizer then
uses its slower exact byte-table path, and the 8-bit optimizers (which only use the dynamic
maps, always served) treat a refusal as a bug.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from torch import Tensor

__all__: list[str] = []  # private module

#: Entries of the table (two signs x 4096 magnitude buckets).
TABLE_SIZE = 8192

#: C text, included by both C kernels: ``nearest_code(lut, v)`` (scalar, the code index of fp32
#: ``v``) and, under AVX2, ``nearest_code8(lut, v)`` (8 int32 code indices of an ``__m256``).
#: Needs <stdint.h>, <string.h> and (under AVX2) <immintrin.h> first.
NEAREST_C = r"""
static inline uint32_t nearest_code(const uint32_t *restrict lut, float v) {
    uint32_t b; memcpy(&b, &v, 4);
    int t = (int)((b & 0x7FFFFFFFu) >> 16) - (96 << 7);
    t = t < 0 ? 0 : (t > 4095 ? 4095 : t);
    const uint32_t e = lut[((b >> 31) << 12) | (uint32_t)t];
    const uint32_t key = (b ^ (uint32_t)((int32_t)b >> 31)) & 0xFFFFu;
    return (e >> 16) + (key > (e & 0xFFFFu));
}
#ifdef __AVX2__
static inline __m256i nearest_code8(const uint32_t *restrict lut, __m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i hi = _mm256_srli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF)), 16);
    /* a saturating 16-bit subtract clamps at 0 (the upper halves are 0 - 0) */
    __m256i t = _mm256_subs_epu16(hi, _mm256_set1_epi32(96 << 7));
    t = _mm256_min_epi32(t, _mm256_set1_epi32(4095));
    const __m256i neg = _mm256_srai_epi32(b, 31);
    const __m256i idx = _mm256_or_si256(_mm256_and_si256(neg, _mm256_set1_epi32(4096)), t);
    const __m256i e = _mm256_i32gather_epi32((const int *)lut, idx, 4);
    const __m256i low16 = _mm256_set1_epi32(0xFFFF);
    const __m256i key = _mm256_and_si256(_mm256_xor_si256(b, neg), low16);
    /* cmpgt is -1 where v lies above the bucket's midpoint */
    return _mm256_sub_epi32(_mm256_srli_epi32(e, 16),
                            _mm256_cmpgt_epi32(key, _mm256_and_si256(e, low16)));
}
#endif
"""


def _f32(bits: np.ndarray) -> Tensor:
    return torch.from_numpy(bits.astype(np.uint32).view(np.float32).copy())


def build_search_table(mids: Tensor) -> Tensor | None:
    """The int32 (read as uint32) table of sorted fp32 ``mids``, or ``None`` when one compare
    per bucket cannot be exact for them (see the module docstring)."""
    mids = mids.detach().cpu().float().contiguous()
    if mids.numel() == 0 or mids.numel() > 255:
        return None
    t = np.arange(TABLE_SIZE // 2, dtype=np.int64)
    lo = _f32((t + (96 << 7)) << 16)
    hi = _f32((t + 1 + (96 << 7)) << 16)
    lo[0] = 0.0  # bucket 0 also holds every smaller magnitude (the clamp)
    mid_bits = torch.from_numpy(mids.numpy().view(np.uint32).astype(np.int64))
    halves = []
    # Positive values: magnitudes [lo, hi); negative values: (-hi, -lo].
    for negative in (False, True):
        if negative:
            base = torch.bucketize(-hi, mids, right=True)  # midpoints <= -hi: all below v
            upto = torch.bucketize(-lo, mids, right=True)
        else:
            base = torch.bucketize(lo, mids)  # midpoints < lo: all below v
            upto = torch.bucketize(hi, mids)
        inside = (upto - base).long()
        if int(inside.max()) > 1 or int(inside[0]) != 0:
            return None
        low16 = mid_bits[base.clamp(max=mids.numel() - 1)] & 0xFFFF
        key = (0xFFFF - low16) if negative else low16
        key = torch.where(inside == 1, key, 0xFFFF)
        halves.append((base.long() << 16) | key)
    table = torch.cat(halves).numpy().astype(np.uint32).view(np.int32)
    return torch.from_numpy(table.copy())


_lock = threading.Lock()
_tables: dict[bytes, Tensor | None] = {}


def search_table(code: Tensor) -> Tensor | None:
    """Cached :func:`build_search_table` of the fp32 midpoints of sorted ``code``."""
    key = code.detach().cpu().float().numpy().tobytes()
    table = _tables.get(key, False)
    if table is False:
        c = code.detach().cpu().float()
        table = build_search_table((c[:-1] + c[1:]) / 2.0)
        with _lock:
            _tables[key] = table
    return table


def nearest_reference(v: Tensor, lut: Tensor) -> Tensor:
    """The table rule in torch (int64 code indices of fp32 ``v``), for tests."""
    b = v.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    t = (((b & 0x7FFFFFFF) >> 16) - (96 << 7)).clamp(0, 4095)
    e = lut.long()[((b >> 31) << 12) | t] & 0xFFFFFFFF
    sign = torch.where((b >> 31) == 1, 0xFFFF, 0)
    key = (b & 0xFFFF) ^ sign
    return (e >> 16) + (key > (e & 0xFFFF)).long()
