"""C kernels of qshard.quant for contiguous CPU fp32 tensors: the preferred CPU fast path.

Why C: under ``torch.compile`` the quantizers reach only 0.1-0.4x of ``copy_`` (inductor
splits the block reduction and the per-element pass into separate loops over memory, and the
code-map lookup becomes a generic gather). Here each block of ``block_size`` elements is read
once into cache, its absmax found, and its codes written while it is still in L1; OpenMP
splits the blocks across threads; every inner loop is written so that gcc vectorises it.
Built and cached by :mod:`qshard._native` (about a second, once per machine).

Bit-exactness with the reference path (tests/quant/test_fastpath.py checks every kernel):

* absmax is the maximum of ``bits(x) & 0x7FFFFFFF`` taken as unsigned integers: for
  non-negative floats that order equals the float order, and any NaN or Inf is >= the bit
  pattern of +Inf, so one integer maximum gives both the absmax and the "non-finite" test
  (a float ``max`` would skip NaNs).
* The block absmax is stored; codes are ``rintf(fl(x / absmax) * qmax)`` (an IEEE fp32
  division, then a multiply, compiled with ``-ffp-contract=off``, no reciprocal tricks;
  ``rintf`` rounds half to even under the default rounding mode, as ``torch.round``), then
  the clamp; a non-finite block stores NaN and zero codes, an all-zero block 0 and zero
  codes. Dequantization is ``fl(fl(code * fl(1 / qmax)) * absmax)`` (see blockwise.py
  [Note: scale choice]).
* The code-map quantizer uses the 8192-entry search table of :mod:`qshard.quant._codetable`
  (32 KiB, L1-resident): sign + clamped exponent + 7 mantissa bits of ``x / absmax`` index an
  entry holding the count of midpoints below the bucket and a 16-bit key of the one midpoint
  inside it, so a code is one gather and an integer compare per 8 lanes (ties to the lower
  code, as ``bucketize`` on the midpoints); the 8-bit optimizers' kernel includes the same
  ``NEAREST_C`` text and reads the same table. A map the table refuses (only the 2-bit signed
  linear map among those we ship) uses the older 2^17-entry byte table of
  :mod:`qshard.quant._fastpath` (``codebook_table``): two gathers per 8 lanes, ~1.8x slower.
* Dequantization multiplies in fp32 and, for bf16/fp16 outputs, rounds to nearest even as
  ``Tensor.copy_`` does (NaN stays NaN).
* Sign packing tests ``!(x < 0)``, so -0.0 and NaN pack as +1 like the reference.

The last block may be partial: INT8/INT4 codes of the padding are written as 0 (the padded
reference quantizes zeros), codebook codes and outputs stop at ``numel``.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from qshard._native import NativeLibrary
from qshard.quant._codetable import NEAREST_C, TABLE_SIZE

__all__: list[str] = []  # private module

_SOURCE = (
    r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
"""
    + NEAREST_C
    + r"""
static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Max of |x| as bit patterns: >= 0x7F800000 means the block holds NaN or Inf. */
static inline uint32_t absmax_bits(const float *restrict x, int64_t n) {
    uint32_t m = 0;
    for (int64_t k = 0; k < n; k++) {
        uint32_t u = f2u(x[k]) & 0x7FFFFFFFu;
        m = u > m ? u : m;
    }
    return m;
}

/* rne(fl(fl(x / absmax) * qmax)) clamped: the reference's two roundings, in its order. */
static inline int8_t q1(float x, float a, float qmax) {
    float r = rintf((x / a) * qmax);
    r = r < -qmax ? -qmax : (r > qmax ? qmax : r);
    return (int8_t)r;
}

/* out kind 0: fp32, 1: bf16, 2: fp16, each rounded to nearest even as torch's copy_ does
 * (bf16: the carry trick of c10::BFloat16, NaN -> quiet NaN; fp16: vcvtps2ph via _Float16). */
/* Store n values of buf at out + off in the requested dtype (a loop per dtype: vectorised). */
static inline void store_row(void *out, int kind, int64_t off, const float *restrict buf,
                             int64_t n) {
    if (kind == 0) {
        float *restrict o = (float *)out + off;
        for (int64_t k = 0; k < n; k++) o[k] = buf[k];
    } else if (kind == 1) {
        uint16_t *restrict o = (uint16_t *)out + off;
        for (int64_t k = 0; k < n; k++) {
            uint32_t u = f2u(buf[k]);
            uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
            o[k] = (buf[k] != buf[k]) ? (uint16_t)0x7FC0 : r;
        }
    } else {
#ifdef __FLT16_MAX__
        _Float16 *restrict o = (_Float16 *)out + off;
        for (int64_t k = 0; k < n; k++) o[k] = (_Float16)buf[k];
#endif
    }
}

/* Compilers without _Float16 (gcc < 12 on x86) still build the rest; Python then keeps fp16
 * outputs on the torch path. */
int has_fp16(void) {
#ifdef __FLT16_MAX__
    return 1;
#else
    return 0;
#endif
}

#define CHUNK 1024

/* One block of n <= block values: its absmax into *scale and its codes into cb (INT8, or INT4
 * packed two per byte, element 2k in the high nibble), the padding of a partial block as 0. */
static inline void quant_block(const float *restrict xb, int64_t n, int64_t block, float qmax,
                               int pack4, uint8_t *restrict cb, float *scale) {
    const int64_t per = pack4 ? block / 2 : block;
    const uint32_t m = absmax_bits(xb, n);
    if (m >= 0x7F800000u) {
        *scale = u2f(0x7FC00000u);
        memset(cb, 0, (size_t)per);
        return;
    }
    const float a = u2f(m); /* the stored value is the block absmax */
    *scale = a;
    if (!(a > 0.0f)) {
        memset(cb, 0, (size_t)per);
        return;
    }
    if (!pack4) {
        int8_t *restrict c = (int8_t *)cb;
        for (int64_t k = 0; k < n; k++) c[k] = q1(xb[k], a, qmax);
        if (n < block) memset(c + n, 0, (size_t)(block - n));
        return;
    }
    const int64_t pairs = n / 2;
    for (int64_t k = 0; k < pairs; k++) {
        const uint8_t hi = (uint8_t)q1(xb[2 * k], a, qmax);
        const uint8_t lo = (uint8_t)q1(xb[2 * k + 1], a, qmax);
        cb[k] = (uint8_t)((hi << 4) | (lo & 0x0F));
    }
    int64_t k = pairs;
    if (n & 1) {
        cb[k] = (uint8_t)(((uint8_t)q1(xb[n - 1], a, qmax)) << 4);
        k++;
    }
    if (k < per) memset(cb + k, 0, (size_t)(per - k));
}

/* Block INT8 (pack4 = 0, int8 codes, block per block) or packed INT4 (pack4 = 1, block/2
 * bytes per block, element 2k in the high nibble). codes are padded to whole blocks. */
int quant_int(const float *x, int64_t numel, int64_t block, int qmax_i, int pack4,
              uint8_t *codes, float *scales, int nthreads) {
    if (block <= 0 || (pack4 && (block & 1))) return -1;
    const int64_t nb = (numel + block - 1) / block;
    const int64_t per = pack4 ? block / 2 : block;
    const float qmax = (float)qmax_i;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t off = b * block;
        const int64_t n = (numel - off) < block ? (numel - off) : block;
        quant_block(x + off, n, block, qmax, pack4, codes + b * per, scales + b);
    }
    return 0;
}

/* dst[k] = fl(fl(code_k * R) * s) (add = 0) or dst[k] = fl(dst[k] + that) (add = 1) for the
 * n values of one block, INT8 codes or packed INT4. */
static inline void dq_block(const uint8_t *restrict cb, float s, float R, int pack4, int64_t n,
                            float *restrict dst, int add) {
    const int8_t *restrict c = (const int8_t *)cb;
    if (!pack4) {
        if (add)
            for (int64_t k = 0; k < n; k++) dst[k] += ((float)c[k] * R) * s;
        else
            for (int64_t k = 0; k < n; k++) dst[k] = ((float)c[k] * R) * s;
        return;
    }
    const int64_t pairs = n / 2;
    if (add) {
        for (int64_t k = 0; k < pairs; k++) {
            const int8_t v = c[k];
            dst[2 * k] += ((float)(int8_t)(v >> 4) * R) * s;
            dst[2 * k + 1] += ((float)(int8_t)((int8_t)(v << 4) >> 4) * R) * s;
        }
    } else {
        for (int64_t k = 0; k < pairs; k++) {
            const int8_t v = c[k];
            dst[2 * k] = ((float)(int8_t)(v >> 4) * R) * s;
            dst[2 * k + 1] = ((float)(int8_t)((int8_t)(v << 4) >> 4) * R) * s;
        }
    }
    if (n & 1) {
        const float v = ((float)(int8_t)(c[pairs] >> 4) * R) * s;
        dst[n - 1] = add ? dst[n - 1] + v : v;
    }
}

#define SUM_BLOCK_MAX 4096

/* The fp32 sum over `rows` rows of blocks (row r at base + r * stride: its fp32 block scales at
 * byte scale_off, its codes at code_off, the layout of a wire row), dequantized as dequant_int
 * and added in row order, fl(fl(v0 + v1) + v2) ..., as torch's copy_ / add_ of whole rows
 * (-ffp-contract=off: no fused multiply-add). numel values per row. With qcodes NULL the sum is
 * written to out; otherwise each summed block is requantized as quant_int into qcodes / qscales
 * (the sum never leaves L1; block <= SUM_BLOCK_MAX, else -2). */
int dequant_sum_int(const uint8_t *base, int64_t stride, int64_t scale_off, int64_t code_off,
                    int64_t rows, int64_t numel, int64_t block, int qmax_i, int pack4, float *out,
                    uint8_t *qcodes, float *qscales, int nthreads) {
    if (block <= 0 || (pack4 && (block & 1)) || qmax_i <= 0 || rows <= 0) return -1;
    if (qcodes && block > SUM_BLOCK_MAX) return -2;
    const float R = 1.0f / (float)qmax_i, qmax = (float)qmax_i;
    const int64_t per = pack4 ? block / 2 : block;
    const int64_t nb = (numel + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < nb; b++) {
        float tmp[SUM_BLOCK_MAX];
        const int64_t off = b * block;
        const int64_t n = (numel - off) < block ? (numel - off) : block;
        float *restrict acc = qcodes ? tmp : out + off;
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *row = base + r * stride;
            float s;
            memcpy(&s, row + scale_off + 4 * b, 4);
            dq_block(row + code_off + b * per, s, R, pack4, n, acc, r > 0);
        }
        if (qcodes) quant_block(acc, n, block, qmax, pack4, qcodes + b * per, qscales + b);
    }
    return 0;
}

/* out[i] = fl(fl(code_i * R) * absmax[block]) with R = fl(1 / qmax), numel outputs (the
 * padding of the last block is skipped). Two multiplies: -ffp-contract=off cannot matter
 * (no add to fuse) and C never reassociates them, so +-qmax codes give +-absmax exactly. */
int dequant_int(const uint8_t *codes, const float *scales, int64_t numel, int64_t block,
                int qmax_i, int pack4, void *out, int kind, int nthreads) {
    if (block <= 0 || (pack4 && (block & 1)) || qmax_i <= 0) return -1;
    const float R = 1.0f / (float)qmax_i;
    const int64_t per = pack4 ? block / 2 : block;
    const int64_t nb = (numel + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < nb; b++) {
        float buf[CHUNK];
        const float s = scales[b];
        const int64_t off = b * block;
        const int64_t n = (numel - off) < block ? (numel - off) : block;
        for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
            const int64_t m = (n - c0) < CHUNK ? (n - c0) : CHUNK;
            if (!pack4) {
                const int8_t *restrict c = (const int8_t *)(codes + b * per + c0);
                if (kind == 0) {
                    float *restrict o = (float *)out + off + c0;
                    for (int64_t k = 0; k < m; k++) o[k] = ((float)c[k] * R) * s;
                    continue;
                }
                for (int64_t k = 0; k < m; k++) buf[k] = ((float)c[k] * R) * s;
            } else {
                /* c0 and CHUNK are even, so a chunk starts on a byte boundary */
                const int8_t *restrict c = (const int8_t *)(codes + b * per + c0 / 2);
                const int64_t mp = (m + 1) / 2;
                for (int64_t k = 0; k < mp; k++) {
                    const int8_t v = c[k];
                    buf[2 * k] = ((float)(int8_t)(v >> 4) * R) * s;
                    buf[2 * k + 1] = ((float)(int8_t)((int8_t)(v << 4) >> 4) * R) * s;
                }
            }
            store_row(out, kind, off + c0, buf, m);
        }
    }
    return 0;
}

/* A codebook block's absmax, stored in *out. A NaN/Inf block stores NaN, an all-zero block 0;
 * both get the code of 0 everywhere and return a value that is not > 0 (nothing left to do). */
static inline float codebook_absmax(const float *restrict xb, int64_t n, uint8_t zero_code,
                                    uint8_t *restrict cb, float *out) {
    const uint32_t m = absmax_bits(xb, n);
    const float a = m >= 0x7F800000u ? u2f(0x7FC00000u) : u2f(m);
    *out = a;
    if (!(a > 0.0f)) memset(cb, zero_code, (size_t)n);
    return a;
}

/* Exact nearest code of x / absmax per block: the 8192-entry search table of
 * qshard.quant._codetable (one L1-resident gather and an integer compare per 8 lanes). */
int quant_codebook(const float *x, int64_t numel, int64_t block, const uint32_t *lut,
                   uint8_t *codes, float *absmax, int nthreads) {
    if (block <= 0) return -1;
    const int64_t nb = (numel + block - 1) / block;
    const uint8_t zero_code = (uint8_t)nearest_code(lut, 0.0f);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t off = b * block;
        const int64_t n = (numel - off) < block ? (numel - off) : block;
        const float *restrict xb = x + off;
        uint8_t *restrict cb = codes + off;
        const float a = codebook_absmax(xb, n, zero_code, cb, absmax + b);
        if (!(a > 0.0f)) continue;
        int64_t k = 0;
#ifdef __AVX2__
        const __m256 av = _mm256_set1_ps(a);
        for (; k + 16 <= n; k += 16) {
            const __m256i i0 = nearest_code8(lut, _mm256_div_ps(_mm256_loadu_ps(xb + k), av));
            const __m256i i1 =
                nearest_code8(lut, _mm256_div_ps(_mm256_loadu_ps(xb + k + 8), av));
            /* packs work per 128-bit lane: fix the order with one permute */
            const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(i0, i1), 0xD8);
            const __m128i w8 = _mm_packus_epi16(_mm256_castsi256_si128(w),
                                                _mm256_extracti128_si256(w, 1));
            _mm_storeu_si128((__m128i *)(cb + k), w8);
        }
#endif
        for (; k < n; k++) cb[k] = (uint8_t)nearest_code(lut, xb[k] / a);
    }
    return 0;
}

/* The same with the 2^17-entry byte table of qshard.quant._fastpath (codebook_table), for
 * maps the search table refuses: the code at the bottom of the float interval of
 * bits(x / absmax) >> 15, then one compare with the next midpoint. */
int quant_codebook_bytes(const float *x, int64_t numel, int64_t block, const uint8_t *lut,
                         const float *mids, uint8_t *codes, float *absmax, int nthreads) {
    if (block <= 0) return -1;
    const int64_t nb = (numel + block - 1) / block;
    const uint8_t zb = lut[0];
    const uint8_t zero_code = (uint8_t)(zb + (0.0f > mids[zb]));
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t off = b * block;
        const int64_t n = (numel - off) < block ? (numel - off) : block;
        const float *restrict xb = x + off;
        uint8_t *restrict cb = codes + off;
        const float a = codebook_absmax(xb, n, zero_code, cb, absmax + b);
        if (!(a > 0.0f)) continue;
        int64_t k = 0;
#ifdef __AVX2__
        /* 8 lanes: divide, table gather (4-byte loads from the byte table, which carries 4
         * bytes of padding, masked to the low byte), midpoint gather, compare, pack. */
        const __m256 av = _mm256_set1_ps(a);
        const __m256i low8 = _mm256_set1_epi32(0xFF);
        for (; k + 8 <= n; k += 8) {
            const __m256 v = _mm256_div_ps(_mm256_loadu_ps(xb + k), av);
            const __m256i key = _mm256_srli_epi32(_mm256_castps_si256(v), 15);
            const __m256i base =
                _mm256_and_si256(_mm256_i32gather_epi32((const int *)lut, key, 1), low8);
            const __m256 mid = _mm256_i32gather_ps(mids, base, 4);
            const __m256i gt = _mm256_castps_si256(_mm256_cmp_ps(v, mid, _CMP_GT_OQ));
            const __m256i idx = _mm256_sub_epi32(base, gt); /* gt is -1 where true */
            const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(idx),
                                               _mm256_extracti128_si256(idx, 1));
            _mm_storel_epi64((__m128i *)(cb + k), _mm_packus_epi16(w, w));
        }
#endif
        for (; k < n; k++) {
            const float v = xb[k] / a;
            const uint32_t base = lut[f2u(v) >> 15];
            cb[k] = (uint8_t)(base + (v > mids[base]));
        }
    }
    return 0;
}

int dequant_codebook(const uint8_t *codes, const float *absmax, const float *code,
                     int64_t numel, int64_t block, void *out, int kind, int nthreads) {
    if (block <= 0) return -1;
    const int64_t nb = (numel + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < nb; b++) {
        float buf[CHUNK];
        const float a = absmax[b];
        const int64_t off = b * block;
        const int64_t n = (numel - off) < block ? (numel - off) : block;
        for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
            const int64_t m = (n - c0) < CHUNK ? (n - c0) : CHUNK;
            const uint8_t *restrict c = codes + off + c0;
            if (kind == 0) {
                float *restrict o = (float *)out + off + c0;
                for (int64_t k = 0; k < m; k++) o[k] = code[c[k]] * a;
                continue;
            }
            for (int64_t k = 0; k < m; k++) buf[k] = code[c[k]] * a;
            store_row(out, kind, off + c0, buf, m);
        }
    }
    return 0;
}

/* Bit 7 - (i % 8) of byte i / 8 is !(x[i] < 0); the unused low bits of the last byte are 0. */
int pack_signs(const float *x, int64_t numel, uint8_t *out, int nthreads) {
    const int64_t full = numel / 8;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < full; i++) {
        const float *restrict p = x + 8 * i;
        uint8_t v = 0;
        for (int j = 0; j < 8; j++) v |= (uint8_t)(!(p[j] < 0.0f)) << (7 - j);
        out[i] = v;
    }
    if (full * 8 != numel) {
        uint8_t v = 0;
        for (int64_t j = 0; j < numel - full * 8; j++)
            v |= (uint8_t)(!(x[full * 8 + j] < 0.0f)) << (7 - j);
        out[full] = v;
    }
    return 0;
}

/* One output byte expands to 8 floats: a broadcast, an AND with the 8 bit masks and a select
 * per lane, which gcc vectorises as one 8-lane step per byte. */
static inline void unpack8(uint8_t v, float *restrict o) {
    static const uint8_t mask[8] = {128, 64, 32, 16, 8, 4, 2, 1};
    for (int j = 0; j < 8; j++) o[j] = (v & mask[j]) ? 1.0f : -1.0f;
}

int unpack_signs(const uint8_t *packed, int64_t numel, void *out, int kind, int nthreads) {
    const int64_t nb = (numel + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < nb; b++) {
        float buf[CHUNK];
        const int64_t off = b * CHUNK;
        const int64_t n = (numel - off) < CHUNK ? (numel - off) : CHUNK;
        const uint8_t *restrict p = packed + off / 8;
        float *restrict o = kind == 0 ? (float *)out + off : buf;
        const int64_t full = n / 8;
        for (int64_t i = 0; i < full; i++) unpack8(p[i], o + 8 * i);
        if (full * 8 != n) {
            float last[8];
            unpack8(p[full], last);
            for (int64_t k = full * 8; k < n; k++) o[k] = last[k - full * 8];
        }
        if (kind != 0) store_row(out, kind, off, buf, n);
    }
    return 0;
}
"""
)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.quant_int.restype = i32
    lib.quant_int.argtypes = [p, i64, i64, i32, i32, p, p, i32]
    lib.dequant_int.restype = i32
    lib.dequant_int.argtypes = [p, p, i64, i64, i32, i32, p, i32, i32]
    lib.dequant_sum_int.restype = i32
    lib.dequant_sum_int.argtypes = [p, i64, i64, i64, i64, i64, i64, i32, i32, p, p, p, i32]
    lib.quant_codebook.restype = i32
    lib.quant_codebook.argtypes = [p, i64, i64, p, p, p, i32]
    lib.quant_codebook_bytes.restype = i32
    lib.quant_codebook_bytes.argtypes = [p, i64, i64, p, p, p, p, i32]
    lib.dequant_codebook.restype = i32
    lib.dequant_codebook.argtypes = [p, p, p, i64, i64, p, i32, i32]
    lib.pack_signs.restype = i32
    lib.pack_signs.argtypes = [p, i64, p, i32]
    lib.unpack_signs.restype = i32
    lib.unpack_signs.argtypes = [p, i64, p, i32, i32]
    lib.has_fp16.restype = i32
    lib.has_fp16.argtypes = []


_LIBRARY = NativeLibrary(
    "quant",
    _SOURCE,
    declare=_declare,
    what="qshard.quant: C kernels",
    fallback="torch.compile / reference path",
    disable_env="QSHARD_NO_KERNELS",
)

# Output dtypes the kernels can write (``kind`` argument of the C functions).
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def library() -> ctypes.CDLL | None:
    """The compiled library, or ``None`` when it cannot be built (reason logged once)."""
    return _LIBRARY.get()


def available() -> bool:
    return library() is not None


def serves_input(x: Tensor) -> bool:
    """Whether the C kernels take ``x`` as quantizer input: contiguous CPU fp32."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.is_contiguous()
        and library() is not None
    )


def serves_output(out: Tensor) -> bool:
    """Whether the C kernels can write ``out``: contiguous CPU fp32/bf16/fp16."""
    lib = library()
    return (
        out.device.type == "cpu"
        and out.dtype in _OUT_KIND
        and out.is_contiguous()
        and lib is not None
        and (out.dtype != torch.float16 or bool(lib.has_fp16()))
    )


def _threads(numel: int) -> int:
    # Below ~64K elements a parallel region costs more than it saves (thread wake-up).
    return 1 if numel < (1 << 16) else max(1, torch.get_num_threads())


def _ok(rc: int, name: str) -> None:
    if rc != 0:  # only reachable through a bad argument that the Python side should catch
        raise RuntimeError(f"qshard.quant C kernel {name} rejected its arguments (rc={rc})")


def quantize_int(x: Tensor, numel: int, block: int, qmax: int, codes: Tensor, scales: Tensor):
    """Quantize the first ``numel`` elements of contiguous fp32 ``x``; ``codes`` int8 (INT8)
    or uint8 packed (INT4, ``qmax == 7``), padded to whole blocks; ``scales`` receives the
    fp32 block absmax."""
    assert codes.is_contiguous() and scales.is_contiguous() and scales.dtype == torch.float32
    quantize_int_at(
        x.data_ptr(),
        numel,
        block,
        qmax,
        codes.dtype == torch.uint8,
        codes.data_ptr(),
        scales.data_ptr(),
    )


def dequantize_int(
    codes: Tensor, scales: Tensor, numel: int, block: int, qmax: int, out: Tensor
) -> None:
    """``out[:numel] = (code * fl(1 / qmax)) * absmax``; ``codes`` int8 or uint8 packed INT4,
    ``scales`` the fp32 block absmax."""
    assert codes.is_contiguous() and scales.is_contiguous() and scales.dtype == torch.float32
    dequantize_int_at(
        codes.data_ptr(),
        scales.data_ptr(),
        numel,
        block,
        qmax,
        codes.dtype == torch.uint8,
        out.data_ptr(),
        out.dtype,
    )


def quantize_int_at(
    x_ptr: int, numel: int, block: int, qmax: int, pack4: bool, codes_ptr: int, scales_ptr: int
) -> None:
    """:func:`quantize_int` on raw addresses: ``numel`` fp32 values at ``x_ptr``, their codes
    (padded to whole blocks) at ``codes_ptr`` and block absmaxes at ``scales_ptr``. For callers
    that write many slices of one buffer (a wire row's slots) without a tensor view each; the
    caller owns the bounds."""
    rc = library().quant_int(
        x_ptr, numel, block, qmax, int(pack4), codes_ptr, scales_ptr, _threads(numel)
    )
    _ok(rc, "quant_int")


def dequantize_int_at(
    codes_ptr: int,
    scales_ptr: int,
    numel: int,
    block: int,
    qmax: int,
    pack4: bool,
    out_ptr: int,
    out_dtype: torch.dtype,
) -> None:
    """:func:`dequantize_int` on raw addresses (see :func:`quantize_int_at`)."""
    rc = library().dequant_int(
        codes_ptr,
        scales_ptr,
        numel,
        block,
        qmax,
        int(pack4),
        out_ptr,
        _OUT_KIND[out_dtype],
        _threads(numel),
    )
    _ok(rc, "dequant_int")


#: The largest block :func:`dequantize_sum_int` requantizes (the C kernel's stack buffer).
SUM_BLOCK_MAX = 4096


def dequantize_sum_int(
    base: Tensor,
    *,
    stride: int,
    scale_off: int,
    code_off: int,
    rows: int,
    numel: int,
    block: int,
    qmax: int,
    out: Tensor | None = None,
    codes_out: Tensor | None = None,
    scales_out: Tensor | None = None,
) -> None:
    """The fp32 sum over ``rows`` rows of dequantized blocks, added in row order, in one pass.

    Row ``r`` starts at byte ``r * stride`` of the uint8 ``base`` (contiguous, or 2-D rows of
    contiguous bytes ``stride`` apart: rows with a trailer the caller reads): its fp32 block
    absmaxes at byte ``scale_off``, its codes (INT8, or packed INT4 when ``qmax == 7``) at
    ``code_off``, ``numel`` values. The sum is written to fp32 ``out`` (``numel``), or, with
    ``codes_out`` / ``scales_out``, requantized block by block as :func:`quantize_int` would
    quantize it (``block <= SUM_BLOCK_MAX``). Bit for bit ``sum_rows`` of the decoded rows,
    then the quantizer."""
    pack4 = qmax == 7
    requant = codes_out is not None
    assert base.dtype == torch.uint8 and base.device.type == "cpu"
    assert base.is_contiguous() or (base.dim() == 2 and base.stride() == (stride, 1))
    assert requant == (scales_out is not None) and requant != (out is not None)
    if requant:
        assert codes_out.is_contiguous() and scales_out.is_contiguous()
        assert scales_out.dtype == torch.float32 and block <= SUM_BLOCK_MAX
        dst, qc, qs = None, codes_out.data_ptr(), scales_out.data_ptr()
    else:
        assert out.dtype == torch.float32 and out.is_contiguous() and out.numel() >= numel
        dst, qc, qs = out.data_ptr(), None, None
    rc = library().dequant_sum_int(
        base.data_ptr(),
        stride,
        scale_off,
        code_off,
        rows,
        numel,
        block,
        qmax,
        int(pack4),
        dst,
        qc,
        qs,
        _threads(numel * rows),
    )
    _ok(rc, "dequant_sum_int")


def quantize_codebook(x: Tensor, block: int, lut: Tensor, codes: Tensor, absmax: Tensor) -> None:
    """Codes (uint8, ``x.numel()``) and absmax (fp32 per block) of contiguous fp32 ``x``, with
    the search table ``lut`` of :func:`qshard.quant._codetable.search_table`."""
    assert lut.dtype == torch.int32 and lut.numel() == TABLE_SIZE and lut.is_contiguous()
    rc = library().quant_codebook(
        x.data_ptr(),
        x.numel(),
        block,
        lut.data_ptr(),
        codes.data_ptr(),
        absmax.data_ptr(),
        _threads(x.numel()),
    )
    _ok(rc, "quant_codebook")


def quantize_codebook_bytes(
    x: Tensor, block: int, lut: Tensor, mids: Tensor, codes: Tensor, absmax: Tensor
) -> None:
    """As :func:`quantize_codebook` with the byte table of ``_fastpath.codebook_table`` (maps
    the search table refuses)."""
    # The AVX2 loop reads 4 bytes at each table index: the table carries 4 bytes of padding.
    assert lut.dtype == torch.uint8 and lut.numel() >= (1 << 17) + 4 and mids.dtype == torch.float32
    rc = library().quant_codebook_bytes(
        x.data_ptr(),
        x.numel(),
        block,
        lut.data_ptr(),
        mids.data_ptr(),
        codes.data_ptr(),
        absmax.data_ptr(),
        _threads(x.numel()),
    )
    _ok(rc, "quant_codebook_bytes")


def dequantize_codebook(
    codes: Tensor, absmax: Tensor, code: Tensor, block: int, out: Tensor
) -> None:
    """``out = code[codes] * absmax[block]`` for contiguous uint8 ``codes`` (``out.numel()``)."""
    assert absmax.dtype == torch.float32 and code.dtype == torch.float32
    rc = library().dequant_codebook(
        codes.data_ptr(),
        absmax.data_ptr(),
        code.data_ptr(),
        out.numel(),
        block,
        out.data_ptr(),
        _OUT_KIND[out.dtype],
        _threads(out.numel()),
    )
    _ok(rc, "dequant_codebook")


def pack_signs(x: Tensor, out: Tensor) -> None:
    rc = library().pack_signs(x.data_ptr(), x.numel(), out.data_ptr(), _threads(x.numel()))
    _ok(rc, "pack_signs")


def unpack_signs(packed: Tensor, out: Tensor) -> None:
    rc = library().unpack_signs(
        packed.data_ptr(), out.numel(), out.data_ptr(), _OUT_KIND[out.dtype], _threads(out.numel())
    )
    _ok(rc, "unpack_signs")
