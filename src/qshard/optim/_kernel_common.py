"""C text shared by the fused 8-bit and 4-bit optimizer kernels (:mod:`qshard.optim._kernels`,
:mod:`qshard.optim._kernels4`): the block absmax on bit patterns with its non-finite rule, and
that of narrow rows' blocks (``NONFINITE_C``), a thread's share of a multi-tensor call
(``THREAD_SHARE_C``) and the Adam / AdamW update of one decoded block (``adam_block_c``). Plain
strings, concatenated into each kernel's source; this module compiles nothing and imports no
other part of qshard.
"""

from __future__ import annotations

__all__: list[str] = []  # private module

#: The block absmax on bit patterns (both kernels).
NONFINITE_C = r"""
/* [Note: non-finite state blocks] The block absmax is the maximum of |x| taken on the bit
 * patterns: for non-negative floats the integer order is the float order, and NaN and Inf are
 * >= 0x7F800000, so one integer maximum finds both the absmax and whether the block holds a
 * non-finite value (a float max skips NaNs and would store a finite absmax for a NaN state).
 * Such a block stores a NaN absmax and zero codes, so it decodes to NaN everywhere: the quant
 * core's [Note: non-finite blocks], and what the torch reference (_qstate.quantize_rows) does. */
static inline float absmax_of_bits(uint32_t m) {
    if (m >= 0x7F800000u) m = 0x7FC00000u; /* NaN or Inf somewhere: the block is NaN */
    float f;
    memcpy(&f, &m, 4);
    return f;
}

static inline uint32_t abs_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u & 0x7FFFFFFFu;
}

#ifdef __AVX512F__
/* Narrow rows ([Note: narrow rows] in qshard.optim._kernels): rows of n = 8, 16, 32 or 64
 * elements, one block each, stepped together. narrow_absmax: a row's absmax by the rule above.
 * narrow_scale: lanes k..k+15 of such rows (k a multiple of 16), each lane the value v[] of its
 * row (n = 8: two rows per vector). */
static inline float narrow_absmax(const float *s, int n) {
    const __m512i mask = _mm512_set1_epi32(0x7FFFFFFF);
    if (n == 8)
        return absmax_of_bits((uint32_t)_mm512_mask_reduce_max_epu32(
            0xFF, _mm512_and_si512(_mm512_maskz_loadu_epi32(0xFF, s), mask)));
    __m512i acc = _mm512_and_si512(_mm512_loadu_si512((const void *)s), mask);
    for (int k = 16; k < n; k += 16)
        acc = _mm512_max_epu32(acc,
                               _mm512_and_si512(_mm512_loadu_si512((const void *)(s + k)), mask));
    return absmax_of_bits((uint32_t)_mm512_reduce_max_epu32(acc));
}

static inline __m512 narrow_scale(const float *v, int k, int n) {
    if (n == 8)
        return _mm512_castpd_ps(
            _mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(v[k >> 3])),
                               _mm256_castps_pd(_mm256_set1_ps(v[(k >> 3) + 1])), 1));
    return _mm512_set1_ps(v[k / n]);
}
#elif defined(__AVX2__)
static inline float narrow_absmax(const float *s, int n) { /* n = 8, 16, 32 or 64 */
    const __m256i mask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i acc = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)s), mask);
    for (int k = 8; k < n; k += 8)
        acc = _mm256_max_epu32(
            acc, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(s + k)), mask));
    __m128i x = _mm_max_epu32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0x4E));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0xB1));
    return absmax_of_bits((uint32_t)_mm_cvtsi128_si32(x));
}
#endif

"""


#: A thread's share of a multi-tensor call's blocks (both kernels; [Note: multi-tensor step]).
THREAD_SHARE_C = r"""
#ifdef _OPENMP
#include <omp.h>
#endif
/* [lo, hi): the blocks of `total` (all tensors' in a row) this thread of the parallel region
 * steps, an even split in order; each thread then walks the tensors its range overlaps. */
static inline void qs_thread_share(int64_t total, int64_t *lo, int64_t *hi) {
    int id = 0, nt = 1;
#ifdef _OPENMP
    id = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    *lo = total * id / nt;
    *hi = total * (id + 1) / nt;
}
"""


#: Exact quotients by a divisor shared by many values (the 8-bit kernel's block absmax and v's
#: bias correction), without the divider. Needs <immintrin.h> under AVX2.
QUOTIENT_C = r"""
/* [Note: exact quotients by a constant] x / d where d is the same for many x, with r = 1/d
 * rounded once (one division) and then per value q = x * r, e = x - q * d (exact: one fma) and
 * the quotient fma(e, r, q): Markstein's correction step (r is the correctly rounded 1/d and
 * e is exact), which gives the correctly rounded x / d, bit for bit what the division gives, as
 * long as nothing underflows or overflows on the way: d in [QS_QUOT_LO, QS_QUOT_HI] and
 * |x| >= 2^-101 or x = 0 (below that e loses bits). Checked against the division for every x
 * of whole binades, both signs: 6.5e10 pairs for 3,000 divisors across the range in a one-off
 * sweep, and the same sweep for ~280 divisors in tests/optim/test_8bit_kernel.py (all-ones,
 * near-all-ones and near-power-of-two significands, the range's ends), no difference.
 * Callers keep the division outside that range. Why: a 16-lane division occupies the divider
 * ~10 cycles on Intel cores with AVX-512 (and a 16-lane square root ~12), and the 8-bit Adam
 * step had four divisions and one square root per element; these three fma-class operations
 * issue on two ports. An infinite x gives NaN here (inf - inf): callers that can see one
 * and divide by d > 0 use qs_quot16_inf (x itself where x is infinite); a quotient must stay below 2^126 in magnitude (the encoders' lie in
 * [-1, 1]; the update's sqrt(v) / bc2 does for bc2 >= 2^-60). -0.0 gives +0.0 (the encoders map
 * both zeros to the same code). */
#define QS_QUOT_LO 0x1p-70f
#define QS_QUOT_HI 0x1p60f
static inline int qs_quot_ok(float d) { return d >= QS_QUOT_LO && d <= QS_QUOT_HI; }
#ifdef __AVX2__
static inline __attribute__((always_inline)) __m256 qs_quot8(__m256 x, __m256 d, __m256 r) {
    const __m256 q = _mm256_mul_ps(x, r);
    return _mm256_fmadd_ps(_mm256_fnmadd_ps(q, d, x), r, q);
}
/* as qs_quot8 for d > 0, and an infinite x gives its quotient, x itself (as the division) */
static inline __attribute__((always_inline)) __m256 qs_quot8_inf(__m256 x, __m256 d, __m256 r) {
    const __m256 inf = _mm256_castsi256_ps(_mm256_set1_epi32(0x7F800000));
    const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    return _mm256_blendv_ps(qs_quot8(x, d, r), x, _mm256_cmp_ps(ax, inf, _CMP_EQ_OQ));
}
#endif
#ifdef __AVX512F__
static inline __attribute__((always_inline)) __m512 qs_quot16(__m512 x, __m512 d, __m512 r) {
    const __m512 q = _mm512_mul_ps(x, r);
    return _mm512_fmadd_ps(_mm512_fnmadd_ps(q, d, x), r, q);
}
static inline __attribute__((always_inline)) __m512 qs_quot16_inf(__m512 x, __m512 d,
                                                                  __m512 r) {
    const __m512 inf = _mm512_castsi512_ps(_mm512_set1_epi32(0x7F800000));
    const __mmask16 big = _mm512_cmp_ps_mask(_mm512_abs_ps(x), inf, _CMP_EQ_OQ);
    return _mm512_mask_mov_ps(qs_quot16(x, d, r), big, x);
}
#endif
"""


def adam_block_c(*, bias_correction: str) -> str:
    """C text of ``adam_block``, the Adam / AdamW update of one decoded block, shared by the 8-bit
    and the 4-bit kernel: it also returns both new absmaxes (on the bit patterns, as
    ``block_absmax``: a NaN or Inf makes them NaN), saving two passes. The operations and their
    order are those of the torch references (mode 1: decoupled decay of p, 2: L2 weight decay
    into g, 0: neither; ``canon``: 0.0f turns -0.0 into +0.0); 16-lane (AVX-512), 8-lane (AVX2)
    and scalar loops give the same bits. The kernels keep v's bias correction in ``hp[6]`` in two
    forms: ``bias_correction="div"`` divides ``sqrt(v)`` by it (8-bit: ``sqrt(1 - b2^t)``; the
    vector loops by [Note: exact quotients by a constant], so the text needs ``QUOTIENT_C``
    first), ``"mul"`` multiplies by it (4-bit: its reciprocal)."""
    ops = {
        "div": (
            # sqrt(v) / bc2 without the divider where that is exact (qs_quot_ok, and quotients
            # below 2^126: sqrt(v) <= 2^64)
            "    const int bc_quot = qs_quot_ok(bc2) && bc2 >= 0x1p-60f;\n"
            "    const float rbc2 = 1.0f / bc2;\n",
            "(bc_quot ? qs_quot16_inf(_mm512_sqrt_ps(v), bcz, _mm512_set1_ps(rbc2))"
            " : _mm512_div_ps(_mm512_sqrt_ps(v), bcz))",
            "(bc_quot ? qs_quot8_inf(_mm256_sqrt_ps(v), bcv, _mm256_set1_ps(rbc2))"
            " : _mm256_div_ps(_mm256_sqrt_ps(v), bcv))",
            "/",
        ),
        "mul": (
            "",
            "_mm512_mul_ps(_mm512_sqrt_ps(v), bcz)",
            "_mm256_mul_ps(_mm256_sqrt_ps(v), bcv)",
            "*",
        ),
    }
    if bias_correction not in ops:
        raise ValueError(f"bias_correction must be 'div' or 'mul'; got {bias_correction!r}")
    setup, vec16, vec8, scalar = ops[bias_correction]
    return (
        _ADAM_BLOCK_C.replace("@QUOT_SETUP@", setup)
        .replace("@SQRT_V_BC16@", vec16)
        .replace("@SQRT_V_BC8@", vec8)
        .replace("@SCALAR@", scalar)
    )


_ADAM_BLOCK_C = r"""
static inline __attribute__((always_inline)) void adam_block(
    float *restrict pp, const float *restrict gg, float *restrict s1, float *restrict s2, int n,
    const float *hp, float canon, int mode, float *amax1, float *amax2) {
    const float b1w = hp[8], b2 = hp[2], b2w = hp[9], eps = hp[3];
    const float wd = hp[4], step_size = hp[5], bc2 = hp[6], decay = hp[7];
@QUOT_SETUP@    uint32_t r1 = 0, r2 = 0; /* the integer maximum does not depend on the lanes' order */
    int k = 0;
#if defined(__AVX512F__)
    {
        const __m512 canz = _mm512_set1_ps(canon), b1wz = _mm512_set1_ps(b1w);
        const __m512 b2z = _mm512_set1_ps(b2), b2wz = _mm512_set1_ps(b2w);
        const __m512 epsz = _mm512_set1_ps(eps), wdz = _mm512_set1_ps(wd);
        const __m512 stz = _mm512_set1_ps(step_size), bcz = _mm512_set1_ps(bc2);
        const __m512 decz = _mm512_set1_ps(decay);
        const __m512i absz = _mm512_set1_epi32(0x7FFFFFFF);
        __m512i z1 = _mm512_setzero_si512(), z2 = _mm512_setzero_si512();
        for (; k + 16 <= n; k += 16) {
            const __m512 m0 = _mm512_loadu_ps(s1 + k), v0 = _mm512_loadu_ps(s2 + k);
            const __m512 p0 = _mm512_loadu_ps(pp + k);
            __m512 gi = _mm512_add_ps(_mm512_loadu_ps(gg + k), canz), pi = p0;
            if (mode == 1) pi = _mm512_mul_ps(p0, decz);
            if (mode == 2) gi = _mm512_add_ps(gi, _mm512_mul_ps(wdz, p0));
            const __m512 m = _mm512_add_ps(m0, _mm512_mul_ps(b1wz, _mm512_sub_ps(gi, m0)));
            const __m512 v = _mm512_add_ps(_mm512_mul_ps(v0, b2z),
                                           _mm512_mul_ps(_mm512_mul_ps(b2wz, gi), gi));
#ifndef QS_PHASE_NO_DIVSQRT
            const __m512 den = _mm512_add_ps(@SQRT_V_BC16@, epsz);
            _mm512_storeu_ps(pp + k,
                             _mm512_sub_ps(pi, _mm512_mul_ps(stz, _mm512_div_ps(m, den))));
#else /* timing variant only (benchmarks/optim_step.py --phases): wrong values */
            const __m512 den = _mm512_add_ps(_mm512_mul_ps(v, bcz), epsz);
            _mm512_storeu_ps(pp + k, _mm512_sub_ps(pi, _mm512_mul_ps(stz, _mm512_mul_ps(m, den))));
#endif
            _mm512_storeu_ps(s1 + k, m);
            _mm512_storeu_ps(s2 + k, v);
            z1 = _mm512_max_epu32(z1, _mm512_and_si512(_mm512_castps_si512(m), absz));
            z2 = _mm512_max_epu32(z2, _mm512_and_si512(_mm512_castps_si512(v), absz));
        }
        r1 = _mm512_reduce_max_epu32(z1);
        r2 = _mm512_reduce_max_epu32(z2);
    }
#endif
#ifdef __AVX2__
    {
        const __m256 canv = _mm256_set1_ps(canon), b1wv = _mm256_set1_ps(b1w);
        const __m256 b2v = _mm256_set1_ps(b2), b2wv = _mm256_set1_ps(b2w);
        const __m256 epsv = _mm256_set1_ps(eps), wdv = _mm256_set1_ps(wd);
        const __m256 stv = _mm256_set1_ps(step_size), bcv = _mm256_set1_ps(bc2);
        const __m256 decv = _mm256_set1_ps(decay);
        const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF);
        __m256i acc1 = _mm256_setzero_si256(), acc2 = _mm256_setzero_si256();
        for (; k + 8 <= n; k += 8) {
            const __m256 m0 = _mm256_loadu_ps(s1 + k), v0 = _mm256_loadu_ps(s2 + k);
            const __m256 p0 = _mm256_loadu_ps(pp + k);
            __m256 gi = _mm256_add_ps(_mm256_loadu_ps(gg + k), canv), pi = p0;
            if (mode == 1) pi = _mm256_mul_ps(p0, decv);
            if (mode == 2) gi = _mm256_add_ps(gi, _mm256_mul_ps(wdv, p0));
            const __m256 m = _mm256_add_ps(m0, _mm256_mul_ps(b1wv, _mm256_sub_ps(gi, m0)));
            const __m256 v = _mm256_add_ps(_mm256_mul_ps(v0, b2v),
                                           _mm256_mul_ps(_mm256_mul_ps(b2wv, gi), gi));
            const __m256 den = _mm256_add_ps(@SQRT_V_BC8@, epsv);
            _mm256_storeu_ps(pp + k,
                             _mm256_sub_ps(pi, _mm256_mul_ps(stv, _mm256_div_ps(m, den))));
            _mm256_storeu_ps(s1 + k, m);
            _mm256_storeu_ps(s2 + k, v);
            acc1 = _mm256_max_epu32(acc1, _mm256_and_si256(_mm256_castps_si256(m), absmask));
            acc2 = _mm256_max_epu32(acc2, _mm256_and_si256(_mm256_castps_si256(v), absmask));
        }
        uint32_t l1[8], l2[8];
        _mm256_storeu_si256((__m256i *)l1, acc1);
        _mm256_storeu_si256((__m256i *)l2, acc2);
        for (int l = 0; l < 8; l++) {
            r1 = l1[l] > r1 ? l1[l] : r1;
            r2 = l2[l] > r2 ? l2[l] : r2;
        }
    }
#endif
    for (; k < n; k++) {
        float pi = pp[k], gi = gg[k] + canon;
        if (mode == 1) pi = pi * decay;
        if (mode == 2) gi = gi + wd * pi;
        const float m = s1[k] + b1w * (gi - s1[k]);
        const float v = s2[k] * b2 + b2w * gi * gi;
        pp[k] = pi - step_size * (m / (sqrtf(v) @SCALAR@ bc2 + eps));
        s1[k] = m; s2[k] = v;
        const uint32_t f1 = abs_bits(m), f2 = abs_bits(v);
        r1 = f1 > r1 ? f1 : r1;
        r2 = f2 > r2 ? f2 : r2;
    }
    *amax1 = absmax_of_bits(r1);
    *amax2 = absmax_of_bits(r2);
}
"""
