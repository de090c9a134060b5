"""C text of the fused 8-bit kernel's codecs (:mod:`qshard.optim._kernels`, whose docstring
describes them and the choices made by measurement): the block absmax, the exact nearest-code
encoders (the table search with AVX2 / AVX-512 gathers, the region encoder of
:mod:`qshard.quant._codetable` 16 and 64 lanes at a time, the scalar loop with the stochastic and
bitsandbytes rules), the decoders (scalar loads, float permutes, VBMI byte permutes) and the
narrow rows' grouped encoder and decoder ([Note: narrow rows]). Plain strings, concatenated into
the kernel's source after the ``qmap_t`` / ``encode`` definitions and ``NONFINITE_C`` /
``QUOTIENT_C`` of :mod:`qshard.optim._kernel_common`; this module compiles nothing.
"""

from __future__ import annotations

from qshard.quant._codetable import REGION_C

__all__: list[str] = []  # private module

# Byte-permute indices of the AVX-512 VBMI paths, as C constants (built once per call they cost
# ~0.5 ns/param: byte stores then a vector load that cannot be forwarded).
# DECODE_ORDER: position 16l + 4q + j holds element 16q + 4l + j, so the decoder's in-lane
# unpacks come out in element order. ENCODE_PICK: bytes 0 and 1 of every qword of the first
# source (positions 0-15) then of the second (16-31), the multishifted codes.
_DECODE_ORDER = [16 * q + 4 * lane + j for lane in range(4) for q in range(4) for j in range(4)]
_ENCODE_PICK = [(64 if p >= 16 else 0) + 8 * ((p & 15) >> 1) + (p & 1) for p in range(32)]
BYTE_TABLES_C = (
    "static const uint8_t DECODE_ORDER[64] __attribute__((aligned(64))) = {"
    + ", ".join(map(str, _DECODE_ORDER))
    + "};\nstatic const uint8_t ENCODE_PICK[64] __attribute__((aligned(64))) = {"
    + ", ".join(map(str, _ENCODE_PICK + [0] * 32))
    + "};\n"
)

#: The codecs (see the module docstring), in the kernel's source after THREAD_SHARE_C.
CODEC8_C = (
    r"""
static inline float block_absmax(const float *s, int n) {
    int k = 0;
    uint32_t m = 0;
#ifdef __AVX2__
    const __m256i mask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i acc = _mm256_setzero_si256();
    for (; k + 8 <= n; k += 8)
        acc = _mm256_max_epu32(acc, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(s + k)), mask));
    uint32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, acc);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
#endif
    for (; k < n; k++) {
        const uint32_t v = abs_bits(s[k]);
        m = v > m ? v : m;
    }
    return absmax_of_bits(m);
}

#ifdef __AVX2__
/* The code of x = s / d on 8 lanes (r = 1/d: [Note: exact quotients by a constant]), with the
 * unsigned floor when `floor0` (a constant at every call, so the unused branch compiles away):
 * a positive s never takes the zero code, also where s / d underflows to 0. */
static inline __attribute__((always_inline)) __m256i code8(const uint32_t *lut, const float *s,
                                                           __m256 dv, __m256 rv, __m256i zidx,
                                                           int floor0) {
    const __m256 sv = _mm256_loadu_ps(s);
    const __m256i i = nearest_code8(lut, qs_quot8(sv, dv, rv));
    if (!floor0) return i;
    const __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(sv, _mm256_setzero_ps(), _CMP_GT_OQ));
    return _mm256_sub_epi32(i, _mm256_and_si256(pos, _mm256_cmpeq_epi32(i, zidx)));
}

/* Nearest codes of s[0..n) / d, 32 then 8 lanes at a time; returns how many were written. Four
 * independent gathers per iteration overlap, and 32 codes pack to bytes in 3 packs + 1 permute. */
static inline __attribute__((always_inline)) int encode_avx2(const uint32_t *lut, const float *s,
                                                             int n, float d, float r, int zero,
                                                             uint8_t *out, int floor0) {
    const __m256 dv = _mm256_set1_ps(d), rv = _mm256_set1_ps(r);
    const __m256i zidx = _mm256_set1_epi32(zero);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int k = 0;
    for (; k + 32 <= n; k += 32) {
        const __m256i i0 = code8(lut, s + k, dv, rv, zidx, floor0);
        const __m256i i1 = code8(lut, s + k + 8, dv, rv, zidx, floor0);
        const __m256i i2 = code8(lut, s + k + 16, dv, rv, zidx, floor0);
        const __m256i i3 = code8(lut, s + k + 24, dv, rv, zidx, floor0);
        const __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(i0, i1),
                                              _mm256_packus_epi32(i2, i3));
        _mm256_storeu_si256((__m256i *)(out + k), _mm256_permutevar8x32_epi32(w, order));
    }
    for (; k + 8 <= n; k += 8) {
        const __m256i i = code8(lut, s + k, dv, rv, zidx, floor0);
        const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(i),
                                           _mm256_extracti128_si256(i, 1));
        _mm_storel_epi64((__m128i *)(out + k), _mm_packus_epi16(w, w));
    }
    return k;
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QS_AVX512 1
/* code8 on 16 lanes (nearest_code8's table search with a 16-lane gather). */
static inline __attribute__((always_inline)) __m512i code16(const uint32_t *lut, const float *s,
                                                            __m512 dv, __m512 rv, __m512i zidx,
                                                            int floor0) {
    const __m512 sv = _mm512_loadu_ps(s);
    const __m512 x = qs_quot16(sv, dv, rv);
    const __m512i b = _mm512_castps_si512(x);
    const __m512i hi = _mm512_srli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF)), 16);
    __m512i t = _mm512_subs_epu16(hi, _mm512_set1_epi32(96 << 7)); /* clamps at 0, as in AVX2 */
    t = _mm512_min_epi32(t, _mm512_set1_epi32(4095));
    const __m512i neg = _mm512_srai_epi32(b, 31);
    const __m512i idx = _mm512_or_si512(_mm512_and_si512(neg, _mm512_set1_epi32(4096)), t);
    const __m512i e = _mm512_i32gather_epi32(idx, (const int *)lut, 4);
    const __m512i low16 = _mm512_set1_epi32(0xFFFF), one = _mm512_set1_epi32(1);
    const __m512i key = _mm512_and_si512(_mm512_xor_si512(b, neg), low16);
    const __m512i base = _mm512_srli_epi32(e, 16);
    const __m512i i = _mm512_mask_add_epi32(
        base, _mm512_cmpgt_epi32_mask(key, _mm512_and_si512(e, low16)), base, one);
    if (!floor0) return i;
    const __mmask16 pos = _mm512_cmp_ps_mask(sv, _mm512_setzero_ps(), _CMP_GT_OQ);
    return _mm512_mask_add_epi32(i, _mm512_mask_cmpeq_epi32_mask(pos, i, zidx), i, one);
}

/* Timing hooks (benchmarks/optim_step.py --phases builds variants with -DQS_PHASE_*; every one
 * writes wrong values and none is ever built for training): QS_PHASE_NO_DECODE, _NO_UPDATE,
 * _NO_ENCODE skip a phase; _ENCODE_MUL only multiplies by the reciprocal of the block absmax in
 * the region encoder (no exactness correction); _NO_DIVSQRT takes the square root and the
 * divisions out of Adam's update. */
#ifdef QS_PHASE_ENCODE_MUL
#define QS_NORMALISE(x, d, r) _mm512_mul_ps((x), (r))
#else
#define QS_NORMALISE(x, d, r) qs_quot16((x), (d), (r))
#endif

"""
    + REGION_C
    + r"""
/* 16 codes: the region encoder, or the table search when a lane lies near a midpoint. */
static inline __attribute__((always_inline)) __m512i code16_fast(
    const uint32_t *lut, const regions_t *R, const float *s, __m512 dv, __m512 rv, __m512i zidx,
    int kind, int floor0) {
    __mmask16 flag = 0;
    const __m512 sv = _mm512_loadu_ps(s);
    const __m512i i = code16_region(R, QS_NORMALISE(sv, dv, rv), sv, kind, floor0, &flag);
    return flag ? code16(lut, s, dv, rv, zidx, floor0) : i;
}

#ifdef __AVX512VBMI__
/* The finish of 64 codes on bytes: z[h] holds the counts of vector h in the byte lanes a
 * multishift took them to (bits 14-21 of every dword); two byte permutes and an insert gather
 * the 64 codes, and one masked byte op applies the sign rule (254 - count saturating at 0) or the
 * unsigned floor to all of them (m: region_z4's masks). */
static inline __attribute__((always_inline)) void finish64(const __m512i *z, const __mmask16 *m,
                                                           __m512i idx, uint8_t *out,
                                                           int floor0, int kind) {
    const __m512i lo = _mm512_permutex2var_epi8(z[0], idx, z[1]);
    const __m512i hi = _mm512_permutex2var_epi8(z[2], idx, z[3]);
    __m512i w = _mm512_inserti64x4(lo, _mm512_castsi512_si256(hi), 1);
    const __mmask64 mm = _mm512_kunpackd(
        (__mmask64)_mm512_kunpackw((__mmask32)m[3], (__mmask32)m[2]),
        (__mmask64)_mm512_kunpackw((__mmask32)m[1], (__mmask32)m[0]));
    if (kind == 1) w = _mm512_mask_subs_epu8(w, mm, _mm512_set1_epi8((char)254), w);
    else if (floor0) w = _mm512_maskz_max_epu8(mm, w, _mm512_set1_epi8(1));
    else w = _mm512_maskz_mov_epi8(mm, w);
    _mm512_storeu_si512((void *)out, w);
}
#endif


/* 64 lanes per iteration, then 16: the region encoder when the map has a region table
 * (`kind` != 0), else the table search (4 independent gathers in flight). */
static inline __attribute__((always_inline)) int encode_avx512(const uint32_t *lut,
                                                               const uint32_t *regions,
                                                               const float *s, int n, float d,
                                                               float rd, int zero, uint8_t *out,
                                                               int floor0, int kind) {
    const __m512 dv = _mm512_set1_ps(d), rv = _mm512_set1_ps(rd);
    const __m512i zidx = _mm512_set1_epi32(zero);
    int k = 0;
    if (kind) {
        const regions_t R = load_regions(regions);
#ifdef __AVX512VBMI__
        /* 64 lanes per iteration, one flag test (a flagged group finishes the block 16 at a
         * time), finished on bytes (finish64). The same steps as the narrow rows' loop
         * (encode_group_k) with one divisor: written out here, as a shared helper taking the
         * four vectors' divisors this loop took 1.03-1.04x the step on rows of 64. */
        const __m512i ctrl = _mm512_set1_epi64(14 | (46 << 8));
        const __m512i idx = _mm512_loadu_si512((const void *)ENCODE_PICK);
        for (; k + 64 <= n; k += 64) {
            __mmask16 flag = 0, m[4];
            __m512i z[4], zi[4];
            __m512 sv[4], x[4];
            for (int h = 0; h < 4; h++) sv[h] = _mm512_loadu_ps(s + k + 16 * h);
            for (int h = 0; h < 4; h++) x[h] = QS_NORMALISE(sv[h], dv, rv);
            region_z4(&R, x, sv, kind, &flag, m, zi);
            for (int h = 0; h < 4; h++) z[h] = _mm512_multishift_epi64_epi8(ctrl, zi[h]);
            if (flag) break;
            finish64(z, m, idx, out + k, floor0, kind);
        }
#endif
        for (; k + 16 <= n; k += 16)
            _mm_storeu_si128((__m128i *)(out + k),
                             _mm512_cvtepi32_epi8(code16_fast(lut, &R, s + k, dv, rv, zidx,
                                                              kind, floor0)));
        return k;
    }
    for (; k + 64 <= n; k += 64) {
        const __m512i i0 = code16(lut, s + k, dv, rv, zidx, floor0);
        const __m512i i1 = code16(lut, s + k + 16, dv, rv, zidx, floor0);
        const __m512i i2 = code16(lut, s + k + 32, dv, rv, zidx, floor0);
        const __m512i i3 = code16(lut, s + k + 48, dv, rv, zidx, floor0);
        _mm_storeu_si128((__m128i *)(out + k), _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(out + k + 16), _mm512_cvtepi32_epi8(i1));
        _mm_storeu_si128((__m128i *)(out + k + 32), _mm512_cvtepi32_epi8(i2));
        _mm_storeu_si128((__m128i *)(out + k + 48), _mm512_cvtepi32_epi8(i3));
    }
    for (; k + 16 <= n; k += 16)
        _mm_storeu_si128((__m128i *)(out + k),
                         _mm512_cvtepi32_epi8(code16(lut, s + k, dv, rv, zidx, floor0)));
    return k;
}
#endif

/* Encode a block from its fp32 buffer `s` (clobbered). */
static void encode_block(const qmap_t *q, float *s, int n, float amax, uint8_t *c, int flags,
                         uint64_t seed, int64_t gidx0) {
    float d = amax; /* the normalisation divides (as quantize_codebook does), in the loops */
    if (amax != amax) { /* a non-finite block: zero codes ([Note: non-finite state blocks]) */
        memset(c, q->zero_idx, (size_t)n);
        return;
    }
    if (amax == 0.0f) {
        /* an all-zero block: zero code, except -0.0 under the bitsandbytes sign nudge */
        for (int k = 0; k < n; k++) s[k] = s[k] * 0.0f;
        flags &= ~8;
        d = 1.0f;
    }
    if (flags & (4 | 8)) {
        for (int k = 0; k < n; k++)
            c[k] = (uint8_t)encode(q, s[k] / d, s[k] > 0.0f, flags, seed, gidx0 + k);
        return;
    }
    const int floor0 = (!q->is_signed && (flags & 2)) ? 1 : 0;
    if (!qs_quot_ok(d)) {
        /* outside the range where the vector loops' quotients are exact ([Note: exact quotients
         * by a constant]): divide here, then encode the quotients with d = 1. A positive value
         * whose quotient underflows keeps the smallest positive float, which encodes as 0.0
         * does but stays positive for the unsigned floor (a positive state never takes the zero
         * code: pitfall 1, the torch reference's rule). */
        for (int k = 0; k < n; k++) {
            const float x = s[k] / d;
            s[k] = (x == 0.0f && s[k] > 0.0f) ? 0x1p-149f : x;
        }
        d = 1.0f;
    }
    const float r = 1.0f / d;
    const int zero = q->zero_idx;
    uint8_t *restrict out = c;
    int k = 0;
    (void)r;
#ifdef QS_AVX512
    const int kind = q->regions[128] == 1 || q->regions[128] == 2 ? (int)q->regions[128] : 0;
    if (kind == 1) k = encode_avx512(q->lut, q->regions, s, n, d, r, zero, out, 0, 1);
    else if (kind == 2 && floor0) k = encode_avx512(q->lut, q->regions, s, n, d, r, zero, out, 1, 2);
    else if (kind == 2) k = encode_avx512(q->lut, q->regions, s, n, d, r, zero, out, 0, 2);
    else if (floor0) k = encode_avx512(q->lut, q->regions, s, n, d, r, zero, out, 1, 0);
    else k = encode_avx512(q->lut, q->regions, s, n, d, r, zero, out, 0, 0);
#endif
#ifdef __AVX2__
    k += floor0 ? encode_avx2(q->lut, s + k, n - k, d, r, zero, out + k, 1)
                : encode_avx2(q->lut, s + k, n - k, d, r, zero, out + k, 0);
#endif
    for (; k < n; k++) {
        const float x = s[k] / d;
        int i = (int)nearest_code(q->lut, x);
        i += floor0 & (s[k] > 0.0f) & (i == zero);
        out[k] = (uint8_t)i;
    }
}

#ifdef __AVX2__
#define QS_NARROW 1
/* [Note: narrow rows] A tensor whose rows hold 8, 16 or 32 elements (LoRA's B of shape
 * (out, r), say) has one block per row under the row-block layout, and stepped block by block
 * each block paid its fixed costs (loading the decoder's and the encoder's tables into
 * registers, the update's set-up, the chain from the block's absmax through 1/absmax to its
 * codes) for a few elements: per element 2.7x (rows of 16) and 4.8x (rows of 8) the time of a
 * 256-element block (AdamW8bit, one thread, Zen 4). The step takes such rows up to 256
 * elements (at least 64) at a time instead: one decode with each lane scaled by its own row's
 * absmax, one update over all of them (elementwise: the same bits as block by block), each
 * row's absmax, and a 64-lane encode with each lane normalised by its own row's absmax (rows of
 * 8: two rows per vector). Every value comes from the same operations as block by block, so
 * the bits are the same (blocks whose absmax is 0, not finite or outside the exact-quotient
 * range, and the stochastic and bitsandbytes rules, take the per-block encoders as before; a
 * 64-lane group with a lane near a midpoint is re-encoded 16 lanes at a time, as inside a
 * block; tests compare every build with the scalar loops). Without VBMI
 * the encode is 16 lanes at a time (the region encoder, or the table search for a map without
 * a region table), with AVX2 only 8 (the table search); the decode likewise. Rows of 64 keep the
 * per-block path here (one 64-lane pass each already; grouped they took 1.03x the time); the
 * 4-bit kernel groups them too (0.85x). */
#if defined(QS_AVX512) && defined(__AVX512VBMI__)
static inline __attribute__((always_inline)) void encode_group_k(
    const qmap_t *q, const regions_t *R, float *s, int n, int nel, const float *m,
    const float *rm, uint8_t *c, int floor0, int kind) {
    const __m512i zidx = _mm512_set1_epi32(q->zero_idx);
    const __m512i ctrl = _mm512_set1_epi64(14 | (46 << 8));
    const __m512i idx = _mm512_loadu_si512((const void *)ENCODE_PICK);
    for (int k = 0; k < nel; k += 64) {
        __mmask16 flag = 0, mk[4];
        __m512i z[4], zi[4];
        __m512 sv[4], x[4], dv[4], rv[4];
        for (int h = 0; h < 4; h++) {
            dv[h] = narrow_scale(m, k + 16 * h, n);
            rv[h] = narrow_scale(rm, k + 16 * h, n);
            sv[h] = _mm512_loadu_ps(s + k + 16 * h);
            x[h] = QS_NORMALISE(sv[h], dv[h], rv[h]);
        }
        region_z4(R, x, sv, kind, &flag, mk, zi);
        if (!flag) {
            for (int h = 0; h < 4; h++) z[h] = _mm512_multishift_epi64_epi8(ctrl, zi[h]);
            finish64(z, mk, idx, c + k, floor0, kind);
            continue;
        }
        for (int h = 0; h < 4; h++) /* a lane near a midpoint: the table search (code16_fast) */
            _mm_storeu_si128((__m128i *)(c + k + 16 * h),
                             _mm512_cvtepi32_epi8(code16_fast(q->lut, R, s + k + 16 * h, dv[h],
                                                              rv[h], zidx, kind, floor0)));
    }
}
#elif defined(QS_AVX512)
static inline __attribute__((always_inline)) void encode_group_k(
    const qmap_t *q, const regions_t *R, float *s, int n, int nel, const float *m,
    const float *rm, uint8_t *c, int floor0, int kind) {
    const __m512i zidx = _mm512_set1_epi32(q->zero_idx);
    for (int k = 0; k < nel; k += 16) {
        const __m512 dv = narrow_scale(m, k, n), rv = narrow_scale(rm, k, n);
        const __m512i i = kind ? code16_fast(q->lut, R, s + k, dv, rv, zidx, kind, floor0)
                               : code16(q->lut, s + k, dv, rv, zidx, floor0);
        _mm_storeu_si128((__m128i *)(c + k), _mm512_cvtepi32_epi8(i));
    }
}
#else
static inline __attribute__((always_inline)) void encode_group_k(
    const qmap_t *q, const void *R, float *s, int n, int nel, const float *m, const float *rm,
    uint8_t *c, int floor0, int kind) {
    (void)R;
    (void)kind;
    const __m256i zidx = _mm256_set1_epi32(q->zero_idx);
    for (int k = 0; k < nel; k += 8) {
        const __m256i i = code8(q->lut, s + k, _mm256_set1_ps(m[k / n]), _mm256_set1_ps(rm[k / n]),
                                zidx, floor0);
        const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(i),
                                           _mm256_extracti128_si256(i, 1));
        _mm_storel_epi64((__m128i *)(c + k), _mm_packus_epi16(w, w));
    }
}
#endif

/* Encode nel / n blocks of n (8, 16 or 32) elements at s (nel a multiple of 64, at most 256),
 * absmaxes m[], codes at c ([Note: narrow rows]); flags has neither the stochastic nor the
 * bitsandbytes bit. */
static void encode_group(const qmap_t *q, float *s, int n, int nel, const float *m, uint8_t *c,
                         int flags, uint64_t seed, int64_t gidx0) {
    const int kind = q->regions[128] == 1 || q->regions[128] == 2 ? (int)q->regions[128] : 0;
    const int nb = nel / n;
#if defined(QS_AVX512) && defined(__AVX512VBMI__)
    int plain = kind != 0; /* the 64-lane loop is the region encoder's */
#else
    int plain = 1;
#endif
    /* Every absmax in the exact-quotient range (so finite and nonzero: qs_quot_ok), tested
     * without branches (a branch per row cost rows of 8 13% of the step), and 1 / m (vector
     * divisions: correctly rounded, as the scalar one). */
    float rm[32];
#ifdef QS_AVX512
    for (int b = 0; b < nb; b += 16) {
        const __mmask16 live = (__mmask16)(nb - b >= 16 ? 0xFFFF : (1u << (nb - b)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(live, m + b);
        const __mmask16 ok =
            _mm512_mask_cmp_ps_mask(live, v, _mm512_set1_ps(QS_QUOT_LO), _CMP_GE_OQ) &
            _mm512_mask_cmp_ps_mask(live, v, _mm512_set1_ps(QS_QUOT_HI), _CMP_LE_OQ);
        plain &= ok == live;
        _mm512_mask_storeu_ps(rm + b, live, _mm512_maskz_div_ps(live, _mm512_set1_ps(1.0f), v));
    }
#else
    for (int b = 0; b < nb; b++) plain &= (m[b] >= QS_QUOT_LO) & (m[b] <= QS_QUOT_HI);
#endif
    if (!plain) {
        for (int b = 0; b < nb; b++)
            encode_block(q, s + b * n, n, m[b], c + b * n, flags, seed, gidx0 + b * n);
        return;
    }
#ifdef QS_AVX512
    const regions_t R = load_regions(q->regions);
#else
    for (int b = 0; b < nb; b++) rm[b] = 1.0f / m[b];
    const int R = 0;
#endif
    const int floor0 = (!q->is_signed && (flags & 2)) ? 1 : 0;
    if (kind == 1) encode_group_k(q, &R, s, n, nel, m, rm, c, 0, 1);
    else if (kind == 2 && floor0) encode_group_k(q, &R, s, n, nel, m, rm, c, 1, 2);
    else if (kind == 2) encode_group_k(q, &R, s, n, nel, m, rm, c, 0, 2);
    else if (floor0) encode_group_k(q, &R, s, n, nel, m, rm, c, 1, 0);
    else encode_group_k(q, &R, s, n, nel, m, rm, c, 0, 0);
}
#endif

/* Decode a block: s = code[c] * amax. Eight scalar table loads assembled into a vector beat a
 * vector gather here (measured on AMD Zen 3, where an 8-lane gather costs more than 8 loads);
 * with AVX-512 the table sits in registers. */
/* Byte j of code[i] at planes[256 * j + i]: the decoder's VBMI tables (filled once per call). */
static void code_planes(const float *code, uint8_t *planes) {
    for (int i = 0; i < 256; i++) {
        uint32_t u;
        memcpy(&u, code + i, 4);
        for (int j = 0; j < 4; j++) planes[256 * j + i] = (uint8_t)(u >> (8 * j));
    }
}

#if defined(QS_AVX512) && defined(__AVX512VBMI__)
/* The code values of 64 bytes c, in element order (d[q]: elements 16q..16q+15), the byte
 * planes pl in registers (see decode_block). */
static inline __attribute__((always_inline)) void decode64(const __m512i *pl, __m512i perm,
                                                           const uint8_t *c, __m512 *d) {
    const __m512i i = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512((const void *)c));
    const __mmask64 m7 = _mm512_movepi8_mask(i);
    __m512i b[4];
    for (int j = 0; j < 4; j++)
        b[j] = _mm512_mask_blend_epi8(m7, _mm512_permutex2var_epi8(pl[4 * j], i, pl[4 * j + 1]),
                                      _mm512_permutex2var_epi8(pl[4 * j + 2], i, pl[4 * j + 3]));
    const __m512i w01l = _mm512_unpacklo_epi8(b[0], b[1]);
    const __m512i w01h = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i w23l = _mm512_unpacklo_epi8(b[2], b[3]);
    const __m512i w23h = _mm512_unpackhi_epi8(b[2], b[3]);
    d[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01l, w23l));
    d[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01l, w23l));
    d[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01h, w23h));
    d[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01h, w23h));
}
#endif

#ifdef QS_AVX512
/* The code values of the 16 bytes at c, the 256-entry table in the 16 registers t: 8 two-table
 * permutes and a 3-level blend on index bits 5-7 (decode_block). */
static inline __attribute__((always_inline)) __m512 decode16t(const __m512 *t, const uint8_t *c) {
    const __m512i i = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
    const __mmask16 m5 = _mm512_test_epi32_mask(i, _mm512_set1_epi32(32));
    const __mmask16 m6 = _mm512_test_epi32_mask(i, _mm512_set1_epi32(64));
    const __mmask16 m7 = _mm512_test_epi32_mask(i, _mm512_set1_epi32(128));
    __m512 q[4];
    for (int h = 0; h < 4; h++)
        q[h] = _mm512_mask_blend_ps(m5, _mm512_permutex2var_ps(t[4 * h], i, t[4 * h + 1]),
                                    _mm512_permutex2var_ps(t[4 * h + 2], i, t[4 * h + 3]));
    const __m512 lo = _mm512_mask_blend_ps(m6, q[0], q[1]);
    const __m512 hi = _mm512_mask_blend_ps(m6, q[2], q[3]);
    return _mm512_mask_blend_ps(m7, lo, hi);
}
#endif

#ifdef __AVX2__
/* The code values of the 8 bytes at c: eight scalar table loads assembled into a vector (faster
 * than a gather on Zen 3). */
static inline __attribute__((always_inline)) __m256 decode8l(const float *code, const uint8_t *c) {
    uint64_t w;
    memcpy(&w, c, 8); /* x86: little-endian, byte l is bits 8l..8l+7 */
    return _mm256_setr_ps(code[w & 255], code[(w >> 8) & 255], code[(w >> 16) & 255],
                          code[(w >> 24) & 255], code[(w >> 32) & 255], code[(w >> 40) & 255],
                          code[(w >> 48) & 255], code[w >> 56]);
}
#endif

static inline void decode_block(const float *code, const uint8_t *planes, const uint8_t *c,
                                float amax, int n, float *s) {
    int k = 0;
#if defined(QS_AVX512) && defined(__AVX512VBMI__)
    /* AVX-512 VBMI: 64 lanes per iteration. Each byte of the fp32 code is a 256-entry byte
     * table in 4 registers: two 128-entry byte permutes and a blend on index bit 7 look it up
     * for 64 lanes at once; 8 unpacks interleave the 4 byte planes into 4 x 16 floats. The
     * unpacks work inside 128-bit lanes, so the indices are first permuted into the order that
     * makes the unpacked dwords come out in element order. */
    if (n >= 64) {
        __m512i pl[16];
        for (int i = 0; i < 16; i++) pl[i] = _mm512_loadu_si512((const void *)(planes + 64 * i));
        const __m512i perm = _mm512_loadu_si512((const void *)DECODE_ORDER);
        const __m512 a5 = _mm512_set1_ps(amax);
        for (; k + 64 <= n; k += 64) {
            __m512 d[4];
            decode64(pl, perm, c + k, d);
            for (int q = 0; q < 4; q++) _mm512_storeu_ps(s + k + 16 * q, _mm512_mul_ps(d[q], a5));
        }
    }
#endif
#ifdef QS_AVX512
    /* AVX-512: the 256-entry table in 16 registers, 16 lanes per 8 two-table permutes and a
     * 3-level blend on index bits 5-7 (measured ~3x faster than the scalar loads on Zen 5). */
    if (n >= 16) {
        __m512 t[16];
        for (int i = 0; i < 16; i++) t[i] = _mm512_loadu_ps(code + 16 * i);
        const __m512 a5 = _mm512_set1_ps(amax);
        for (; k + 16 <= n; k += 16)
            _mm512_storeu_ps(s + k, _mm512_mul_ps(decode16t(t, c + k), a5));
    }
#endif
#ifdef __AVX2__
    const __m256 a = _mm256_set1_ps(amax);
    for (; k + 8 <= n; k += 8) _mm256_storeu_ps(s + k, _mm256_mul_ps(decode8l(code, c + k), a));
#endif
    for (; k < n; k++) s[k] = code[c[k]] * amax;
}

#ifdef QS_NARROW
/* decode_block on nel elements (a multiple of 64) of blocks of n elements ([Note: narrow rows]):
 * each lane scaled by its own block's absmax (AVX2: 8-lane vectors, each in one block). */
static inline void decode_group(const float *code, const uint8_t *planes, const uint8_t *c,
                                const float *amax, int n, int nel, float *s) {
#if defined(QS_AVX512) && defined(__AVX512VBMI__)
    __m512i pl[16];
    for (int i = 0; i < 16; i++) pl[i] = _mm512_loadu_si512((const void *)(planes + 64 * i));
    const __m512i perm = _mm512_loadu_si512((const void *)DECODE_ORDER);
    for (int k = 0; k < nel; k += 64) {
        __m512 d[4];
        decode64(pl, perm, c + k, d);
        for (int q = 0; q < 4; q++)
            _mm512_storeu_ps(s + k + 16 * q,
                             _mm512_mul_ps(d[q], narrow_scale(amax, k + 16 * q, n)));
    }
#elif defined(QS_AVX512)
    (void)planes;
    __m512 t[16];
    for (int i = 0; i < 16; i++) t[i] = _mm512_loadu_ps(code + 16 * i);
    for (int k = 0; k < nel; k += 16)
        _mm512_storeu_ps(s + k, _mm512_mul_ps(decode16t(t, c + k), narrow_scale(amax, k, n)));
#else
    (void)planes;
    for (int k = 0; k < nel; k += 8)
        _mm256_storeu_ps(s + k,
                         _mm256_mul_ps(decode8l(code, c + k), _mm256_set1_ps(amax[k / n])));
#endif
}
#endif

"""
)
