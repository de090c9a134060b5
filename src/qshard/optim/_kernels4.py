"""Fused CPU kernel of the 4-bit Adam/AdamW step: unpack + decode -> update -> block absmax ->
encode + pack, in one pass over each block while it sits in L1 (the 8-bit kernel's scheme,
:mod:`qshard.optim._kernels`; built and cached the same way by :mod:`qshard._native`).

A 16-entry map fits in two AVX2 registers, so decoding needs no memory gather: the 8 nibbles
of 4 code bytes become 8 lane indices (one broadcast, one variable shift, one mask) and two
in-register permutes plus a blend give the 8 code values. Encoding is exact nearest of
``x * (1 / absmax)``: the scalar loop uses the search table of :mod:`qshard.quant._codetable`
(``nearest_code``, shared with the other encoders); the AVX2 loop counts the midpoints below
``x`` with compares (measured: the table gather cost ~0.5 ns per value, more than the whole
rest of the step): 8 on ``|x|`` for the symmetric signed map of m, 15 for other maps; the
AVX-512 loop finds the same count by a 4-step binary search over the midpoints held in
registers, 64 lanes (four independent search chains) at a time: side by side with the 16-lane
8-compare loop, 0.81x its step in the fastest of 31 rounds and 0.93-0.94x by the median
per-round ratio (10M, one thread, load 4-5). The zero-free linear map of v needs no search at all
(``ceil(16x - 1.5)``, exact, see ``encode4``). Pairs of codes are packed into bytes with a
variable shift, a 64-bit shift-or, one permute and two packs (AVX-512: ``vpmovqb``). The update
is the 8-bit kernel's Adam loop (same operations and order, ``-ffp-contract=off``), with the
bias correction of v multiplied by its reciprocal, so results equal the torch reference
:func:`qshard.optim._qstate4.adam4bit_reference` bit for bit; the vector paths write exactly the
bits of the scalar loops (tested against ``-mno-avx2`` and ``-mno-avx512f`` builds). Gradients
are always read with -0.0 as +0.0. A block whose new m or v holds NaN or Inf stores a NaN absmax
and the code of 0.0 (the 8-bit kernel's [Note: non-finite state blocks]), so it decodes to NaN.
The parameter, gradient and codes 1024 elements ahead are prefetched before the encoders run
(they touch no memory): 0.86x the step at 10M with one thread side by side (256 to 4096 ahead
measured the same within noise; load 7-8).
Rows of 8 to 64 elements (LoRA's B: one block per row) are stepped up to 256 elements at a
time, each lane decoded and encoded with its own row's absmax (the 8-bit kernel's [Note: narrow
rows]): AdamW4bit on (262144, 16) 3.5-3.9 -> 1.3-1.4 ns per parameter on Zen 4 (one thread; the
AVX2 build 2.6 -> 2.0), the same bits; the search, packing and decoding bodies are helpers shared
by both paths, and the narrow rows' loop is a separate copy of the step's loop.
"""

from __future__ import annotations

import ctypes

from qshard._native import NativeLibrary
from qshard.optim._kernel_common import NONFINITE_C, THREAD_SHARE_C, adam_block_c
from qshard.quant._codetable import NEAREST_C

__all__: list[str] = []  # private module

MAX_BLOCK = 4096

#: int64 words per tensor of ``adam4bit_multi`` (its ``tensor4_t``: p, g, c1, a1, c2, a2 as
#: addresses, rows, row_numel, the address of the tensor's hp).
TENSOR4_FIELDS = 9

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
    + NONFINITE_C
    + THREAD_SHARE_C
    + r"""

#ifndef QS_AHEAD4
#define QS_AHEAD4 1024 /* elements */
#endif

/* Nibble k of a packed row segment. */
static inline int nib(const uint8_t *c, int k) { return (c[k >> 1] >> ((k & 1) * 4)) & 15; }

#if defined(__AVX512F__)
/* The code values of the 16 nibbles in the 8 bytes at c (element 2i: the low nibble of byte i),
 * the 16-entry map in the register tab. */
static inline __attribute__((always_inline)) __m512 decode16(__m512 tab, const uint8_t *c) {
    const __m512i shz = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24,
                                          28);
    uint32_t w0, w1;
    memcpy(&w0, c, 4);
    memcpy(&w1, c + 4, 4);
    const __m512i words = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32((int)w0)),
                                             _mm256_set1_epi32((int)w1), 1);
    const __m512i idx = _mm512_and_si512(_mm512_srlv_epi32(words, shz), _mm512_set1_epi32(15));
    return _mm512_permutexvar_ps(idx, tab);
}

/* The encoder's midpoint search in registers (see encode4): mid[7] and the tables of steps 4, 2
 * and 1. */
typedef struct {
    __m512 mid7, t4, t2, t1;
} search4_t;

static inline search4_t search_tables(const float *mid) {
    float t4[16], t2[16], t1[16];
    for (int m = 0; m < 16; m++) {
        t4[m] = m + 3 < 15 ? mid[m + 3] : 0.0f;
        t2[m] = m + 1 < 15 ? mid[m + 1] : 0.0f;
        t1[m] = m < 15 ? mid[m] : 0.0f;
    }
    search4_t T;
    T.mid7 = _mm512_set1_ps(mid[7]);
    T.t4 = _mm512_loadu_ps(t4);
    T.t2 = _mm512_loadu_ps(t2);
    T.t1 = _mm512_loadu_ps(t1);
    return T;
}

/* The codes of 16 normalised values: the linear map's formula, or the 4-step search. */
static inline __attribute__((always_inline)) __m512i count16(const search4_t *T, __m512 x,
                                                             int linear) {
    if (linear == 1) {
        const __m512 t = _mm512_roundscale_ps(
            _mm512_sub_ps(_mm512_mul_ps(x, _mm512_set1_ps(16.0f)), _mm512_set1_ps(1.5f)),
            _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
        return _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(t), _mm512_setzero_si512()),
                                _mm512_set1_epi32(15));
    }
    __m512i i = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(x, T->mid7, _CMP_GT_OQ),
                                       _mm512_set1_epi32(8));
    i = _mm512_mask_add_epi32(i, _mm512_cmp_ps_mask(x, _mm512_permutexvar_ps(i, T->t4), _CMP_GT_OQ),
                              i, _mm512_set1_epi32(4));
    i = _mm512_mask_add_epi32(i, _mm512_cmp_ps_mask(x, _mm512_permutexvar_ps(i, T->t2), _CMP_GT_OQ),
                              i, _mm512_set1_epi32(2));
    return _mm512_mask_add_epi32(
        i, _mm512_cmp_ps_mask(x, _mm512_permutexvar_ps(i, T->t1), _CMP_GT_OQ), i,
        _mm512_set1_epi32(1));
}

/* The search on 4 x 16 values, each step done for the four before the next (four independent
 * chains side by side: the module docstring's numbers). */
static inline __attribute__((always_inline)) void count64(const search4_t *T, const __m512 *x,
                                                          __m512i *i) {
    for (int h = 0; h < 4; h++)
        i[h] = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(x[h], T->mid7, _CMP_GT_OQ),
                                      _mm512_set1_epi32(8));
    for (int h = 0; h < 4; h++)
        i[h] = _mm512_mask_add_epi32(
            i[h], _mm512_cmp_ps_mask(x[h], _mm512_permutexvar_ps(i[h], T->t4), _CMP_GT_OQ), i[h],
            _mm512_set1_epi32(4));
    for (int h = 0; h < 4; h++)
        i[h] = _mm512_mask_add_epi32(
            i[h], _mm512_cmp_ps_mask(x[h], _mm512_permutexvar_ps(i[h], T->t2), _CMP_GT_OQ), i[h],
            _mm512_set1_epi32(2));
    for (int h = 0; h < 4; h++)
        i[h] = _mm512_mask_add_epi32(
            i[h], _mm512_cmp_ps_mask(x[h], _mm512_permutexvar_ps(i[h], T->t1), _CMP_GT_OQ), i[h],
            _mm512_set1_epi32(1));
}

/* 16 codes packed two a byte into the 8 bytes at c: byte j = i[2j] | i[2j + 1] << 4, the low
 * byte of each 64-bit lane. */
static inline __attribute__((always_inline)) void pack16(__m512i i, uint8_t *c) {
    const __m512i oddz = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    const __m512i sh = _mm512_sllv_epi32(i, oddz);
    const __m512i pair = _mm512_or_si512(sh, _mm512_srli_epi64(sh, 32));
    const uint64_t out = (uint64_t)_mm_cvtsi128_si64(_mm512_cvtepi64_epi8(pair));
    memcpy(c, &out, 8);
}
#endif

#ifdef __AVX2__
/* The code values of the 8 nibbles in the 4 bytes at c (element 2i: the low nibble of byte i),
 * the 16-entry map in the registers lo, hi: two permutes and a blend. */
static inline __attribute__((always_inline)) __m256 decode8(__m256 lo, __m256 hi,
                                                            const uint8_t *c) {
    uint32_t w;
    memcpy(&w, c, 4);
    const __m256i idx =
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w),
                                           _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                         _mm256_set1_epi32(15));
    const __m256 vl = _mm256_permutevar8x32_ps(lo, idx);
    const __m256 vh = _mm256_permutevar8x32_ps(hi, idx);
    return _mm256_blendv_ps(vl, vh, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

/* The AVX2 encoder's 15 midpoints, broadcast. */
typedef struct {
    __m256 mid[15];
} mids8_t;

static inline void load_mids8(const float *mid, mids8_t *M) {
    for (int m = 0; m < 15; m++) M->mid[m] = _mm256_set1_ps(mid[m]);
}

/* The codes of 8 normalised values (see encode4 for `linear`). */
static inline __attribute__((always_inline)) __m256i count8(const mids8_t *M, __m256 x,
                                                            int linear) {
    const __m256i zero = _mm256_setzero_si256(), seven = _mm256_set1_epi32(7);
    if (linear == 1) {
        const __m256 t = _mm256_ceil_ps(
            _mm256_sub_ps(_mm256_mul_ps(x, _mm256_set1_ps(16.0f)), _mm256_set1_ps(1.5f)));
        return _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(t), zero),
                                _mm256_set1_epi32(15));
    }
    if (linear == 2) {
        /* A symmetric signed map (codes -c6..-c0, 0, c0..c6, 1; midpoints -P6..-P0, P0..P7):
         * for x > 0 the count is 7 + #(P < |x|); for x <= 0 it is #(P_k > |x|, k < 7) =
         * 7 - #(P <= |x|) = 7 - #(P < next float above |x|), clamped (P7 may be below it). */
        const __m256 a = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
        const __m256i pos =
            _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
        const __m256 ae = _mm256_castsi256_ps(_mm256_add_epi32(
            _mm256_castps_si256(a), _mm256_andnot_si256(pos, _mm256_set1_epi32(1))));
        __m256i cnt = zero;
        for (int m = 0; m < 8; m++)
            cnt = _mm256_sub_epi32(
                cnt, _mm256_castps_si256(_mm256_cmp_ps(ae, M->mid[7 + m], _CMP_GT_OQ)));
        return _mm256_blendv_epi8(_mm256_sub_epi32(seven, _mm256_min_epi32(cnt, seven)),
                                  _mm256_add_epi32(seven, cnt), pos);
    }
    /* 15 compares against the midpoints beat a table gather (0.5 ns/value) */
    __m256i i = zero;
    for (int m = 0; m < 15; m++)
        i = _mm256_sub_epi32(i, _mm256_castps_si256(_mm256_cmp_ps(x, M->mid[m], _CMP_GT_OQ)));
    return i;
}

/* 8 codes packed two a byte into the 4 bytes at c. */
static inline __attribute__((always_inline)) void pack8(__m256i i, uint8_t *c) {
    const __m256i sh = _mm256_sllv_epi32(i, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    const __m256i pair = _mm256_or_si256(sh, _mm256_srli_epi64(sh, 32)); /* even lanes */
    const __m128i b = _mm256_castsi256_si128(
        _mm256_permutevar8x32_epi32(pair, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)));
    const __m128i w = _mm_packus_epi16(_mm_packus_epi32(b, b), _mm_setzero_si128());
    const uint32_t out = (uint32_t)_mm_cvtsi128_si32(w);
    memcpy(c, &out, 4);
}
#endif

/* s[0..n) = code[nibble k] * amax. */
static void decode4(const float *code, const uint8_t *c, float amax, int n, float *s) {
    int k = 0;
#if defined(__AVX512F__)
    { /* 16 lanes: the whole 16-entry map in one register, one permute per 16 values */
        const __m512 tab = _mm512_loadu_ps(code), az = _mm512_set1_ps(amax);
        for (; k + 16 <= n; k += 16)
            _mm512_storeu_ps(s + k, _mm512_mul_ps(decode16(tab, c + (k >> 1)), az));
    }
#endif
#ifdef __AVX2__
    const __m256 lo = _mm256_loadu_ps(code), hi = _mm256_loadu_ps(code + 8);
    const __m256 a = _mm256_set1_ps(amax);
    for (; k + 8 <= n; k += 8)
        _mm256_storeu_ps(s + k, _mm256_mul_ps(decode8(lo, hi, c + (k >> 1)), a));
#endif
    for (; k < n; k++) s[k] = code[nib(c, k)] * amax;
}

/* [Note: 4-bit normalisation] A block is normalised by multiplying with the fp32 reciprocal of
 * its absmax, x = s * (1 / amax) (an all-zero block by 1). Where that reciprocal overflows (an
 * absmax below ~2^-128, subnormal: the first moment of a row without gradient reaches it after
 * ~800 steps of beta1 = 0.9) it is +Inf, and the quotients were +-Inf or NaN (0 * Inf), whose
 * codes differed between the vector and scalar loops, the torch reference and the builds (the
 * scalar linear loop converted a NaN to an integer: undefined behaviour). Such a block is scaled
 * by 2^64 first, exactly: x = (s * 2^64) * (1 / (amax * 2^64)), finite (|x| <= ~1), on every
 * path (the loops below, the narrow rows' grouped encoder, _qstate4.quantize_rows4, the Triton
 * kernel), one multiply more per element there (a division instead would cost the GPU kernel one
 * per element on every block, as a select evaluates both sides). This returns the reciprocal to
 * multiply with, after scaling s in place where needed. */
static inline float normalise4(float *s, int n, float amax) {
    const float r = amax == 0.0f ? 1.0f : 1.0f / amax;
    if (r <= 3.4028234663852886e38f) return r;
    for (int k = 0; k < n; k++) s[k] = s[k] * 0x1p64f;
    return 1.0f / (amax * 0x1p64f);
}

/* Nearest codes of s[0..n) * (1 / amax) packed two a byte into c (n odd: the last high nibble
 * is 0; s is scaled in place where the reciprocal overflows: [Note: 4-bit normalisation]).
 * `linear` 2: a symmetric signed map (AVX2: 8 compares on |x|, below); 1: the map is
 * (i + 1) / 16, whose code needs no table: the number of midpoints
 * (2i + 3) / 32 below x >= 0 is ceil(16x - 1.5) clamped to 0..15, exactly (16x is exact, and so
 * is 16x - 1.5 where it is >= -0.75; below, the count is 0 either way). */
static void encode4(const uint32_t *lut, const float *mid, int linear, float *s, int n,
                    float amax, uint8_t *c) {
    if (amax != amax) { /* a non-finite block: the code of 0.0 ([Note: non-finite state blocks]) */
        const uint8_t z = linear == 1 ? 0 : (uint8_t)nearest_code(lut, 0.0f);
        memset(c, z | (z << 4), (size_t)(n >> 1));
        if (n & 1) c[n >> 1] = z;
        return;
    }
    const float r = normalise4(s, n, amax); /* an all-zero block: codes of 0.0 */
    int k = 0;
#if defined(__AVX512F__)
    { /* 16 lanes (64 for the search): the same counts as the 8-lane loop below. Any map: the
       * count of midpoints below x by a 4-step binary search, the 16-lane midpoint tables in
       * registers (step h compares with mid[i + h - 1] at the count i so far; entries past the
       * 15 midpoints are never read): 12 operations per 16 lanes instead of 15 (or 8 on |x|)
       * compares and their adds. The predicate mid < x is monotone over the sorted midpoints,
       * so the result is the compare count's. The search is a chain of 4 dependent
       * compare-permute steps (~40 cycles): 64 lanes per iteration, four independent chains
       * side by side, keep the core busy (the module docstring's numbers; the linear map's
       * short chain run this way measured slower, so it keeps the 16-lane loop). */
        const __m512 rz = _mm512_set1_ps(r);
        const search4_t T = search_tables(mid);
        for (; linear != 1 && k + 64 <= n; k += 64) {
            __m512 x[4];
            __m512i i[4];
            for (int h = 0; h < 4; h++) x[h] = _mm512_mul_ps(_mm512_loadu_ps(s + k + 16 * h), rz);
            count64(&T, x, i);
            for (int h = 0; h < 4; h++) pack16(i[h], c + ((k + 16 * h) >> 1));
        }
        for (; k + 16 <= n; k += 16)
            pack16(count16(&T, _mm512_mul_ps(_mm512_loadu_ps(s + k), rz), linear), c + (k >> 1));
    }
#endif
#ifdef __AVX2__
    mids8_t M;
    load_mids8(mid, &M);
    const __m256 rv = _mm256_set1_ps(r);
    /* one loop per map kind (a loop testing `linear` per vector took 1.04x the step) */
    if (linear == 1)
        for (; k + 8 <= n; k += 8)
            pack8(count8(&M, _mm256_mul_ps(_mm256_loadu_ps(s + k), rv), 1), c + (k >> 1));
    else if (linear == 2)
        for (; k + 8 <= n; k += 8)
            pack8(count8(&M, _mm256_mul_ps(_mm256_loadu_ps(s + k), rv), 2), c + (k >> 1));
    else
        for (; k + 8 <= n; k += 8)
            pack8(count8(&M, _mm256_mul_ps(_mm256_loadu_ps(s + k), rv), 0), c + (k >> 1));
#endif
    for (; k < n; k += 2) {
        uint32_t code[2] = {0, 0};
        for (int h = 0; h < 2 && k + h < n; h++) {
            const float x = s[k + h] * r;
            if (linear == 1) {
                const float t = ceilf(x * 16.0f - 1.5f);
                code[h] = t <= 0.0f ? 0u : (t >= 15.0f ? 15u : (uint32_t)t);
            } else {
                code[h] = nearest_code(lut, x);
            }
        }
        c[k >> 1] = (uint8_t)(code[0] | (code[1] << 4));
    }
}

#ifdef __AVX2__
#define QS_GROUP4 1
/* [Note: narrow rows] of the 8-bit kernel (qshard.optim._kernels), here: rows of 8, 16, 32 or 64
 * elements are stepped up to 256 elements at a time, each lane decoded and encoded with its own
 * row's absmax; the same operations as block by block, so the same bits. */
static inline void decode4_group(const float *code, const uint8_t *c, const float *amax, int n,
                                 int nel, float *s) {
#if defined(__AVX512F__)
    const __m512 tab = _mm512_loadu_ps(code);
    for (int k = 0; k < nel; k += 16)
        _mm512_storeu_ps(s + k, _mm512_mul_ps(decode16(tab, c + (k >> 1)),
                                              narrow_scale(amax, k, n)));
#else
    const __m256 lo = _mm256_loadu_ps(code), hi = _mm256_loadu_ps(code + 8);
    for (int k = 0; k < nel; k += 8)
        _mm256_storeu_ps(s + k, _mm256_mul_ps(decode8(lo, hi, c + (k >> 1)),
                                              _mm256_set1_ps(amax[k / n])));
#endif
}

/* encode4 of nel / n blocks of n (8, 16, 32 or 64) elements at s (nel a multiple of 64, at
 * most 256), absmaxes m[], packed codes at c. */
static void encode4_group(const uint32_t *lut, const float *mid, int linear, float *s, int n,
                          int nel, const float *m, uint8_t *c) {
    float r[32];
    for (int b = 0; b < nel / n; b++) r[b] = normalise4(s + b * n, n, m[b]); /* encode4's */
#if defined(__AVX512F__)
    const search4_t T = search_tables(mid);
    for (int k = 0; k < nel; k += 64) {
        __m512 x[4];
        __m512i i[4];
        for (int h = 0; h < 4; h++)
            x[h] = _mm512_mul_ps(_mm512_loadu_ps(s + k + 16 * h), narrow_scale(r, k + 16 * h, n));
        if (linear != 1) count64(&T, x, i);
        else
            for (int h = 0; h < 4; h++) i[h] = count16(&T, x[h], 1);
        for (int h = 0; h < 4; h++) pack16(i[h], c + ((k + 16 * h) >> 1));
    }
#else
    mids8_t M;
    load_mids8(mid, &M);
    for (int k = 0; k < nel; k += 8)
        pack8(count8(&M, _mm256_mul_ps(_mm256_loadu_ps(s + k), _mm256_set1_ps(r[k / n])), linear),
              c + (k >> 1));
#endif
    for (int b = 0; b < nel / n; b++)
        if (m[b] != m[b]) { /* a non-finite block: the code of 0.0, as encode4 writes */
            const uint8_t z = linear == 1 ? 0 : (uint8_t)nearest_code(lut, 0.0f);
            memset(c + b * (n >> 1), z | (z << 4), (size_t)(n >> 1));
        }
}
#endif

"""
    + adam_block_c(bias_correction="mul")
    + r"""

/*
 * One Adam/AdamW step over `ntensors` tensors with 4-bit m (map code1, table lut1) and v (code2,
 * lut2), in one call ([Note: multi-tensor step] in qshard.optim._kernels): each tensor is one
 * row of TENSOR4_FIELDS int64 words (tensor4_t: p, g, c1, a1, c2, a2 as addresses, rows,
 * row_numel, the address of its hp: the 8-bit Adam kernel's 10 hyperparameters); codes (rows,
 * ceil(row_numel/2)) bytes, absmax (rows, ceil(row_numel/block)).
 */
typedef struct {
    int64_t p, g, c1, a1, c2, a2, rows, row_numel, hp;
} tensor4_t;

static inline int64_t tensor4_blocks(const tensor4_t *X, int64_t block) {
    return X->rows * ((X->row_numel + block - 1) / block);
}

/* Blocks [b0, b1) of one tensor (its fields constant over the loop, as in the 8-bit kernel);
 * `narrow`: rows of 8 to 64 elements, stepped several a pass ([Note: narrow rows]). */
static inline __attribute__((always_inline)) void adam4_blocks_k(
    const tensor4_t *X, const float *code1, const float *mid1, const uint32_t *lut1, int linear1,
    const float *code2, const float *mid2, const uint32_t *lut2, int linear2, int64_t block,
    int64_t b0, int64_t b1, int narrow) {
    float *p = (float *)(intptr_t)X->p;
    const float *g = (const float *)(intptr_t)X->g;
    uint8_t *c1 = (uint8_t *)(intptr_t)X->c1, *c2 = (uint8_t *)(intptr_t)X->c2;
    float *a1 = (float *)(intptr_t)X->a1, *a2 = (float *)(intptr_t)X->a2;
    const float *hp = (const float *)(intptr_t)X->hp;
    const int64_t rows = X->rows, row_numel = X->row_numel;
    const int64_t nbr = (row_numel + block - 1) / block;
    const int64_t nbytes = (row_numel + 1) / 2;
    const int mode = hp[7] != 1.0f ? 1 : (hp[4] != 0.0f ? 2 : 0);
    /* blocks per 64 elements, when rows are stepped together: [Note: narrow rows] */
    const int group = narrow ? 64 / (int)row_numel : 0;
    for (int64_t b = b0; b < b1; b++) {
        float s1[4096], s2[4096];
        const int64_t r = b / nbr, j = b % nbr;
        const int64_t off = r * row_numel + j * block;
        const int64_t coff = r * nbytes + j * (block / 2);
        const int n = (int)((row_numel - j * block) < block ? (row_numel - j * block) : block);
        int nblk = 1; /* blocks stepped now: up to 256 elements of narrow rows, in 64s */
        if (group && b + group <= b1) {
            const int64_t left = (b1 - b) / group * group;
            nblk = (int)(left < 4 * group ? left : 4 * group);
        }
        const int nu = n * nblk; /* their elements (rows of even length: their codes follow) */
#ifdef QS_GROUP4
        if (nblk > 1) {
            decode4_group(code1, c1 + coff, a1 + b, n, nu, s1);
            decode4_group(code2, c2 + coff, a2 + b, n, nu, s2);
        } else
#endif
        {
            decode4(code1, c1 + coff, a1[b], n, s1);
            decode4(code2, c2 + coff, a2[b], n, s2);
        }
        float m1, m2;
        if (mode == 1) adam_block(p + off, g + off, s1, s2, nu, hp, 0.0f, 1, &m1, &m2);
        else if (mode == 2) adam_block(p + off, g + off, s1, s2, nu, hp, 0.0f, 2, &m1, &m2);
        else adam_block(p + off, g + off, s1, s2, nu, hp, 0.0f, 0, &m1, &m2);
        float g1[32], g2[32];
#ifdef QS_GROUP4
        if (nblk > 1)
            for (int h = 0; h < nblk; h++) {
                a1[b + h] = g1[h] = narrow_absmax(s1 + h * n, n);
                a2[b + h] = g2[h] = narrow_absmax(s2 + h * n, n);
            }
        else
#endif
        {
            a1[b] = m1;
            a2[b] = m2;
        }
#ifdef __AVX2__
        /* Prefetch the parameter, gradient and both code rows QS_AHEAD4 elements ahead: the
         * encoders below touch no memory, so without this DRAM idles while they run (the 8-bit
         * kernel's prefetch). Ahead in the flat stream, rows included; a hint, it never faults. */
        {
            const int64_t ahead = off + QS_AHEAD4, cahead = coff + QS_AHEAD4 / 2;
            if (ahead + nu <= rows * row_numel && cahead + (nu >> 1) <= rows * nbytes) {
                for (int l = 0; l < nu; l += 16) {
                    _mm_prefetch((const char *)(p + ahead + l), _MM_HINT_T0);
                    _mm_prefetch((const char *)(g + ahead + l), _MM_HINT_T0);
                }
                for (int l = 0; l < (nu >> 1); l += 64) {
                    _mm_prefetch((const char *)(c1 + cahead + l), _MM_HINT_T0);
                    _mm_prefetch((const char *)(c2 + cahead + l), _MM_HINT_T0);
                }
            }
        }
#endif
#ifdef QS_GROUP4
        if (nblk > 1) {
            encode4_group(lut1, mid1, linear1, s1, n, nu, g1, c1 + coff);
            encode4_group(lut2, mid2, linear2, s2, n, nu, g2, c2 + coff);
            b += nblk - 1;
            continue;
        }
#endif
        encode4(lut1, mid1, linear1, s1, n, m1, c1 + coff);
        encode4(lut2, mid2, linear2, s2, n, m2, c2 + coff);
    }
}

/* adam4_blocks_k, its narrow-rows loop a separate copy (one loop for both cost the AVX2 build
 * 1.07x the step on whole blocks). */
static inline __attribute__((always_inline)) void adam4_blocks(
    const tensor4_t *X, const float *code1, const float *mid1, const uint32_t *lut1, int linear1,
    const float *code2, const float *mid2, const uint32_t *lut2, int linear2, int64_t block,
    int64_t b0, int64_t b1) {
#ifdef QS_GROUP4
    const int64_t rn = X->row_numel;
    if ((rn + block - 1) / block == 1 && (rn == 8 || rn == 16 || rn == 32 || rn == 64)) {
        adam4_blocks_k(X, code1, mid1, lut1, linear1, code2, mid2, lut2, linear2, block, b0, b1, 1);
        return;
    }
#endif
    adam4_blocks_k(X, code1, mid1, lut1, linear1, code2, mid2, lut2, linear2, block, b0, b1, 0);
}

int adam4bit_multi(const int64_t *tensors, int64_t ntensors, const float *code1,
                   const float *mid1, const uint32_t *lut1, int linear1, const float *code2,
                   const float *mid2, const uint32_t *lut2, int linear2, int64_t block,
                   int nthreads) {
    if (block > 4096 || block <= 0 || (block & 1) || ntensors < 0) return -1;
    const tensor4_t *T = (const tensor4_t *)tensors;
    int64_t nblocks = 0;
    for (int64_t t = 0; t < ntensors; t++) {
        if (T[t].rows < 0 || T[t].row_numel < 0) return -1;
        nblocks += tensor4_blocks(T + t, block);
    }
#pragma omp parallel num_threads(nthreads)
    {
    int64_t lo, hi, first = 0;
    qs_thread_share(nblocks, &lo, &hi);
    for (int64_t t = 0; t < ntensors && first < hi; t++) {
        const int64_t last = first + tensor4_blocks(T + t, block);
        if (last > lo)
            adam4_blocks(T + t, code1, mid1, lut1, linear1, code2, mid2, lut2, linear2, block,
                         (lo > first ? lo : first) - first, (hi < last ? hi : last) - first);
        first = last;
    }
    }
    return 0;
}

/* Encode rows x row_numel floats with the 4-bit layout (tests: the encoder vs the torch one). */
int quantize_rows4(const float *x, uint8_t *c, float *a, const float *mid, const uint32_t *lut,
                   int linear, int64_t rows,
                   int64_t row_numel, int64_t block, int nthreads) {
    if (block > 4096 || block <= 0 || (block & 1)) return -1;
    const int64_t nbr = (row_numel + block - 1) / block;
    const int64_t nbytes = (row_numel + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < rows * nbr; b++) {
        const int64_t r = b / nbr, j = b % nbr;
        const int64_t off = r * row_numel + j * block;
        const int n = (int)((row_numel - j * block) < block ? (row_numel - j * block) : block);
        float buf[4096];
        uint32_t m = 0;
        for (int k = 0; k < n; k++) {
            buf[k] = x[off + k] + 0.0f;
            const uint32_t f = abs_bits(buf[k]);
            m = f > m ? f : m;
        }
        a[b] = absmax_of_bits(m);
        encode4(lut, mid, linear, buf, n, a[b], c + r * nbytes + j * (block / 2));
    }
    return 0;
}

/* Decode (tests). */
int dequantize_rows4(const uint8_t *c, const float *a, const float *code, float *x,
                     int64_t rows, int64_t row_numel, int64_t block) {
    if (block > 4096 || block <= 0 || (block & 1)) return -1;
    const int64_t nbr = (row_numel + block - 1) / block;
    const int64_t nbytes = (row_numel + 1) / 2;
    for (int64_t b = 0; b < rows * nbr; b++) {
        const int64_t r = b / nbr, j = b % nbr;
        const int n = (int)((row_numel - j * block) < block ? (row_numel - j * block) : block);
        decode4(code, c + r * nbytes + j * (block / 2), a[b], n, x + r * row_numel + j * block);
    }
    return 0;
}
"""
)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.adam4bit_multi.restype = i32
    lib.adam4bit_multi.argtypes = [p, i64, p, p, p, i32, p, p, p, i32, i64, i32]
    lib.quantize_rows4.restype = i32
    lib.quantize_rows4.argtypes = [p, p, p, p, p, i32, i64, i64, i64, i32]
    lib.dequantize_rows4.restype = i32
    lib.dequantize_rows4.argtypes = [p, p, p, p, i64, i64, i64]


# Built and cached by qshard._native (source + flags + compiler + CPU in the file name).
_LIBRARY = NativeLibrary(
    "optim4bit",
    _SOURCE,
    declare=_declare,
    what="qshard.optim: fused 4-bit kernel",
    fallback="slower torch reference path",
    disable_env="QSHARD_NO_KERNELS",
)


def library() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it cannot be built (reason logged once)."""
    return _LIBRARY.get()


def available() -> bool:
    return library() is not None
