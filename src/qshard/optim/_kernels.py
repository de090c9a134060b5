"""Fused CPU kernels for the 8-bit optimizers: dequantize -> update -> block absmax -> requantize
in one pass over each quantization block, compiled on first use with the system C compiler.

Why a C kernel: done with eager torch ops, one 8-bit AdamW step is ~25 passes over memory
(gathers, casts, the update, a block reduction, a nearest-code search) and costs ~20x a fused
fp32 AdamW step. Here every block of ``block_size`` elements is handled while it sits in L1:
the states are decoded, updated, their new absmax found and re-encoded before moving on.

The source is strings in this module and its codecs' in :mod:`qshard.optim._codec8` (nothing to
package), built with ``cc -O3 -fopenmp`` by
:mod:`qshard._native` into a per-user cache keyed by the hash of source and flags, and called
through :mod:`ctypes` with raw pointers (no torch headers, so the build takes about a second). Without a compiler the
optimizers use the torch reference path in :mod:`qshard.optim._qstate`, logged once.

Encoding is exact nearest over the sorted 256-entry code: the index is the number of code
midpoints strictly below the normalised value (ties go to the lower code), the rule of
:func:`qshard.quant.dynamic.quantize_codebook` (tested value for value). Two exact encoders:

* the table search (every CPU): an 8192-entry table indexed by sign, clamped exponent and 7
  mantissa bits holds, per bucket, the count of midpoints below it and a 16-bit compare key of
  the (at most one) midpoint inside it, so the code is one table load and one integer compare.
  The table, its builder and the C primitives ``nearest_code`` / ``nearest_code8`` are those of
  :mod:`qshard.quant._codetable` (``NEAREST_C`` is concatenated into the source below), shared
  with the dynamic-map quantizer. With AVX2 the loads are 8-lane gathers, with AVX-512 16-lane.
* the region encoder (AVX-512 F/BW, 64 lanes at a time with VBMI; the two dynamic maps): no
  gather. The map's positive midpoints are runs of equally spaced values joined by "bridge"
  midpoints; the binade and one exact compare pick the run, an fma line inside it gives the
  count, and a lane that lands within 2^-12 of an integer (near a midpoint) is re-encoded by
  the table search, so the codes are the table's (for every fp32 in [-1, 1], a slow test). Its table is built and checked in
  :mod:`qshard.quant._codetable` ([Note: the region encoder]) and travels as ``QMap.regions``.

Choices made by measurement (AMD EPYC Zen 5, AVX-512 F/BW/VL/VBMI, one thread, side by side in
one process; the host is shared, so ratios, not absolute times, are what carry over):

* decoding: with VBMI each byte of the fp32 code is a 256-entry byte table in 4 registers, so
  64 lanes take 8 byte permutes, 4 blends and 8 unpacks (the 16-lane float-permute decoder
  before it cost ~0.3 ns per parameter more in the full step, a variant build side by side).
  Without VBMI: the table in 16 registers and 8 two-table permutes per 16 lanes (AVX-512 F), or
  8 scalar loads per vector (AVX2: faster than a gather on Zen 3).
* Adam's update also finds both new absmaxes (on the bit patterns, see the Note below), saving
  two passes; its square root and two divisions are kept exact (torch's rounding).
* encoding: the region encoder replaced the 16-lane gathers (~0.4 ns per element each on Zen 5)
  and works on 64 lanes per flag test, finishing the codes on bytes (multishift, byte permutes,
  one masked saturating byte op for the sign rule): 0.78x the step with the gathers, then
  0.91x for the byte finish. It is still the largest phase (~35-45% of the step).
* no divider for divisions by a constant: the encoders' ``s / absmax`` and Adam's
  ``sqrt(v) / bc2`` are ``q = s * (1/d)`` corrected by one fma, the correctly rounded quotient
  (``[Note: exact quotients by a constant]`` in :mod:`qshard.optim._kernel_common`; blocks
  outside its range are divided first). On an Intel Xeon (Emerald Rapids, AVX-512) a 16-lane
  division occupies the divider ~10 cycles and the step was divider-bound: 0.855x the step
  time at 10M, one thread (the update's part alone 0.89x). On Zen 5, whose divider is ~4x
  faster per division, the same change measured 0.97-1.06x in an earlier pass (noise). The
  unsigned floor tests the state itself (``s > 0``), as the torch reference does, so a
  quotient that underflows cannot decide it.
* the parameter, gradient and codes of the block after next are prefetched before the encoder
  runs (it touches no memory): 0.84x the step time at 10M.
* the 64-lane loop computes the four vectors' z step by step side by side (``region_z4``)
  rather than one vector's whole chain after the other: 0.92-0.95x the step (10M and 50M, one
  thread, load 11-15).

* one call per parameter group (``step8_multi``, [Note: multi-tensor step] below): the blocks
  of all its tensors split evenly between the threads; a call per tensor cost ~25 us of Python
  and ctypes each (2,000 matrices of 16 x 256: 4.3x fused fp32 AdamW, now 2.0x).
* rows of 8 to 32 elements (one block per row) stepped up to 256 elements at a time, each
  lane decoded and encoded with its own row's absmax ([Note: narrow rows]): AdamW8bit on
  (262144, 16) 3.7 -> 1.8 ns per parameter on Zen 4 (one thread; the same source built without
  VBMI 3.5 -> 2.2, AVX2 only 3.8 -> 3.0), the same bits.

Where the step's time goes now, and the measured ratios to torch's fused fp32 AdamW:
docs/optim8bit.md ("Where the time goes"; ``benchmarks/optim_step.py --phases`` times kernel
variants built with one phase taken out by the ``QS_PHASE_*`` defines below). Every vector path
writes the same bits as the scalar loops, which are what a CPU without AVX2 runs (tests build
the source with ``-mno-avx2``, ``-mno-avx512f`` and ``-mno-avx512vbmi`` and compare every
byte).
"""

from __future__ import annotations

import ctypes

import torch

from qshard._native import NativeLibrary
from qshard.optim._codec8 import BYTE_TABLES_C, CODEC8_C
from qshard.optim._kernel_common import NONFINITE_C, QUOTIENT_C, THREAD_SHARE_C, adam_block_c
from qshard.quant._codetable import NEAREST_C

__all__: list[str] = []  # private module

# Update kinds understood by the kernel (mirrors the switch in _SOURCE).
KIND_ADAM = 0
KIND_LION = 1
KIND_SGD = 2
KIND_RMSPROP = 3
KIND_ADAGRAD = 4

#: int64 words per tensor of ``step8_multi`` (its ``tensor_t``: p, g, c1, a1, c2, a2 as
#: addresses, rows, row_numel, the address of the tensor's hp, flags, seed, global offset).
TENSOR_FIELDS = 12

# Bits of the ``flags`` argument.
FLAG_CANONICAL_ZERO = 1  # turn -0.0 gradients into +0.0 (pitfall 2)
FLAG_FLOOR_UNSIGNED = 2  # positive unsigned state never encodes to the zero code (pitfall 1)
FLAG_BNB_SIGN_NUDGE = 4  # bitsandbytes: move a signed code whose sign bit differs one step away
FLAG_STOCHASTIC = 8  # stochastic rounding between the two neighbouring codes (pitfall 3)
FLAG_FIRST_STEP = 16  # SGD: the momentum buffer starts as the gradient (torch semantics)

MAX_BLOCK = 4096

# nearest_code / nearest_code8 (the exact nearest-code encoder and its search table) come from
# qshard.quant._codetable, shared with the dynamic-map quantizer.

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
    + BYTE_TABLES_C
    + r"""

typedef struct {
    const float *code;    /* 256 sorted values */
    const uint32_t *regions; /* 129 words: qshard.quant._codetable's region table */
    const uint32_t *lut;  /* 8192 entries: qshard.quant._codetable's search table */
    int zero_idx;         /* index of the 0.0 code */
    int is_signed;
} qmap_t;

static inline uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The code of x = s / d under `flags`; `positive`: s > 0 (the unsigned floor's test, on the
 * state itself as in the torch reference: a quotient that underflows to 0 is still floored). */
static inline int encode(const qmap_t *q, float x, int positive, int flags, uint64_t seed,
                         int64_t gidx) {
    int i = (int)nearest_code(q->lut, x);
    if (flags & 8) { /* stochastic: round up with probability proportional to the distance */
        int lo = (q->code[i] <= x) ? i : i - 1;
        if (lo < 0) lo = 0;
        int hi = lo < 255 ? lo + 1 : lo;
        float gap = q->code[hi] - q->code[lo];
        if (gap > 0.0f) {
            float u = (float)(mix64(seed ^ (uint64_t)gidx * 0xD1B54A32D192ED03ull) >> 40)
                      * (1.0f / 16777216.0f);
            i = (u * gap < x - q->code[lo]) ? hi : lo;
        }
    }
    if (!q->is_signed) {
        if ((flags & 2) && positive && i == q->zero_idx) i = q->zero_idx + 1;
    } else if (flags & 4) {
        if (signbit(q->code[i]) != signbit(x)) i += (x > 0.0f) ? 1 : -1;
    }
    return i;
}

"""
    + NONFINITE_C
    + QUOTIENT_C
    + THREAD_SHARE_C
    + CODEC8_C
    + adam_block_c(bias_correction="div")
    + r"""
/*
 * [Note: multi-tensor step] One optimizer step over `ntensors` tensors that share the update
 * kind, the two code maps and the block size (the quantized tensors of one parameter group).
 * Each tensor is one row of TENSOR_FIELDS int64 words (tensor_t below; addresses as integers):
 * its `rows` rows of `row_numel` elements are cut into blocks of `block` elements (the last of a
 * row may be partial) with one absmax each. The blocks of all tensors form one list, split
 * evenly between the threads, so small tensors cost neither a call nor a parallel region each
 * (a Python call per tensor cost ~25 us, against ~6 us of kernel for a 4096-element tensor).
 * Per block: decode the states into L1 buffers, update (a loop the compiler vectorises), find
 * the new absmax, encode. hp: the tensor's kind-specific hyperparameters (see the optimizers'
 * _kernel_hparams); flags: its FLAG_* bits; seed / global_offset: its stochastic-rounding
 * stream and its first element's index in the whole parameter. c2/a2 are 0 for one state.
 */
typedef struct {
    int64_t p, g, c1, a1, c2, a2, rows, row_numel, hp, flags, seed, global_offset;
} tensor_t;

static inline int64_t tensor_blocks(const tensor_t *X, int64_t block) {
    return X->rows * ((X->row_numel + block - 1) / block);
}

/* Blocks [b0, b1) of one tensor, with the thread's buffers s1, s2. The tensor's fields are
 * arguments here, constant over the loop as in a one-tensor call (read from the table inside the
 * loop instead, the step at 10M took 1.03-1.05x the time). */
static inline __attribute__((always_inline)) void step_blocks(
    int kind, const tensor_t *X, const qmap_t *q1p, const qmap_t *q2p, const uint8_t *planes1,
    const uint8_t *planes2, int64_t block, int64_t b0, int64_t b1, float *s1, float *s2) {
    const qmap_t q1 = *q1p, q2 = *q2p;
    const float *code1 = q1.code, *code2 = q2.code;
    float *p = (float *)(intptr_t)X->p;
    const float *g = (const float *)(intptr_t)X->g;
    uint8_t *c1 = (uint8_t *)(intptr_t)X->c1, *c2 = (uint8_t *)(intptr_t)X->c2;
    float *a1 = (float *)(intptr_t)X->a1, *a2 = (float *)(intptr_t)X->a2;
    const float *hp = (const float *)(intptr_t)X->hp;
    const int64_t rows = X->rows, row_numel = X->row_numel, global_offset = X->global_offset;
    const int64_t nbr = (row_numel + block - 1) / block, nblocks = rows * nbr;
    const int flags = (int)X->flags, has2 = (c2 != NULL);
    /* the two states' rounding streams (read by the stochastic rounding only) */
    const uint64_t seed1 = mix64((uint64_t)X->seed);
    const uint64_t seed2 = mix64((uint64_t)X->seed ^ 0x5555555555555555ull);
    const float canon = (flags & 1) ? 0.0f : -0.0f; /* x + 0.0f turns -0.0 into +0.0 */
    int group = 0; /* blocks per 64 elements, when rows are stepped together: [Note: narrow rows] */
#ifdef QS_NARROW
    if (nbr == 1 && (row_numel == 8 || row_numel == 16 || row_numel == 32) && !(flags & (4 | 8)))
        group = 64 / (int)row_numel;
#endif
    for (int64_t b = b0; b < b1; b++) {
        const int64_t r = b / nbr, j = b % nbr;
        const int64_t off = r * row_numel + j * block;
        const int n = (int)((row_numel - j * block) < block ? (row_numel - j * block) : block);
        int nblk = 1; /* blocks stepped now: up to 256 elements of narrow rows, in 64s */
        if (group && b + group <= b1) {
            const int64_t left = (b1 - b) / group * group;
            nblk = (int)(left < 4 * group ? left : 4 * group);
        }
        const int nu = n * nblk; /* their elements */
        float *restrict pp = p + off;
        const float *restrict gg = g + off;
        uint8_t *cc1 = c1 + off;
        uint8_t *cc2 = has2 ? c2 + off : NULL;
#ifndef QS_PHASE_NO_DECODE
#ifdef QS_NARROW
        if (nblk > 1) {
            decode_group(code1, planes1, cc1, a1 + b, n, nu, s1);
            if (has2) decode_group(code2, planes2, cc2, a2 + b, n, nu, s2);
        } else
#endif
        {
            decode_block(code1, planes1, cc1, a1[b], n, s1);
            if (has2) decode_block(code2, planes2, cc2, a2[b], n, s2);
        }
#endif
        float m1 = -1.0f, m2 = -1.0f; /* the new absmaxes, when an update found them (NaN stays) */
        int todo = kind;                /* the update still to run (per block: threads share kind) */
#ifdef QS_PHASE_NO_UPDATE
        m1 = a1[b];
        m2 = has2 ? a2[b] : -1.0f;
        todo = -1;
#endif
#ifdef __AVX2__
        if (todo == 0 && has2) {
            const int mode = hp[7] != 1.0f ? 1 : (hp[4] != 0.0f ? 2 : 0);
            if (mode == 1) adam_block(pp, gg, s1, s2, nu, hp, canon, 1, &m1, &m2);
            else if (mode == 2) adam_block(pp, gg, s1, s2, nu, hp, canon, 2, &m1, &m2);
            else adam_block(pp, gg, s1, s2, nu, hp, canon, 0, &m1, &m2);
            todo = -1;
        }
#endif
        switch (todo) {
        case 0: { /* Adam / AdamW: lr, beta1, beta2, eps, wd, step_size, bc2_sqrt, decay, 1-beta1,
                   1-beta2 (the complements rounded from double, as torch does) */
            const float b1w = hp[8], b2 = hp[2], b2w = hp[9], eps = hp[3];
            const float wd = hp[4], step_size = hp[5], bc2s = hp[6], decay = hp[7];
            if (decay != 1.0f) {
                for (int k = 0; k < nu; k++) {
                    const float gi = gg[k] + canon;
                    const float pi = pp[k] * decay;
                    const float m = s1[k] + b1w * (gi - s1[k]);
                    const float v = s2[k] * b2 + b2w * gi * gi;
                    pp[k] = pi - step_size * (m / (sqrtf(v) / bc2s + eps));
                    s1[k] = m; s2[k] = v;
                }
            } else {
                for (int k = 0; k < nu; k++) {
                    const float pi = pp[k];
                    const float gi = (wd != 0.0f) ? (gg[k] + canon) + wd * pi : gg[k] + canon;
                    const float m = s1[k] + b1w * (gi - s1[k]);
                    const float v = s2[k] * b2 + b2w * gi * gi;
                    pp[k] = pi - step_size * (m / (sqrtf(v) / bc2s + eps));
                    s1[k] = m; s2[k] = v;
                }
            }
            break;
        }
        case 1: { /* Lion: hp = lr, beta1, beta2, wd, decay, 1-beta1, 1-beta2 */
            const float lr = hp[0], b1 = hp[1], b1w = hp[5], b2 = hp[2];
            const float b2w = hp[6], decay = hp[4];
            for (int k = 0; k < nu; k++) {
                const float gi = gg[k] + canon;
                const float c = b1 * s1[k] + b1w * gi;
                /* sign(c), NaN staying NaN (torch.sign's rule, the reference path's) */
                const float sg = (c > 0.0f) ? 1.0f : ((c < 0.0f) ? -1.0f : (c == c ? 0.0f : c));
                pp[k] = pp[k] * decay - lr * sg;
                s1[k] = b2 * s1[k] + b2w * gi;
            }
            break;
        }
        case 2: { /* SGD momentum: hp = lr, momentum, dampening, wd, nesterov, 1-dampening */
            const float lr = hp[0], mom = hp[1], damp = hp[5], wd = hp[3];
            const int nesterov = hp[4] != 0.0f, first = (flags & 16) != 0;
            for (int k = 0; k < nu; k++) {
                const float pi = pp[k];
                const float gi = (wd != 0.0f) ? (gg[k] + canon) + wd * pi : gg[k] + canon;
                const float buf = first ? gi : s1[k] * mom + damp * gi;
                const float d = nesterov ? gi + mom * buf : buf;
                pp[k] = pi - lr * d;
                s1[k] = buf;
            }
            break;
        }
        case 3: { /* RMSprop: lr, alpha, eps, wd, momentum, 1-alpha; state1 = v, state2 = buffer */
            const float lr = hp[0], alpha = hp[1], aw = hp[5], eps = hp[2], wd = hp[3];
            const float mom = hp[4];
            for (int k = 0; k < nu; k++) {
                const float pi = pp[k];
                const float gi = (wd != 0.0f) ? (gg[k] + canon) + wd * pi : gg[k] + canon;
                const float v = s1[k] * alpha + aw * gi * gi;
                const float avg = sqrtf(v) + eps;
                if (has2) {
                    const float buf = s2[k] * mom + gi / avg;
                    pp[k] = pi - lr * buf;
                    s2[k] = buf;
                } else {
                    pp[k] = pi - lr * (gi / avg);
                }
                s1[k] = v;
            }
            break;
        }
        case 4: { /* Adagrad: hp = clr, eps, wd */
            const float clr = hp[0], eps = hp[1], wd = hp[2];
            for (int k = 0; k < nu; k++) {
                const float pi = pp[k];
                const float gi = (wd != 0.0f) ? (gg[k] + canon) + wd * pi : gg[k] + canon;
                const float sum = s1[k] + gi * gi;
                pp[k] = pi - clr * (gi / (sqrtf(sum) + eps));
                s1[k] = sum;
            }
            break;
        }
        default:
            break;
        }
        const int64_t gidx = global_offset + off;
#ifdef __AVX2__
        /* Prefetch the parameter, gradient and codes of the block after next: the encoder
         * below touches no memory, so without this the memory sits idle while it runs and the
         * next update waits for DRAM (measured side by side: 0.84x the step time at 10M, one
         * thread; one block ahead 0.89x, four 0.86x). A hint only: it never faults. */
        if (b + 2 * nblk < nblocks) {
            const int64_t nb = off + (nblk > 1 ? 2 * nu : 2 * block);
            if (nb + nu <= rows * row_numel) {
                for (int l = 0; l < nu; l += 16) {
                    _mm_prefetch((const char *)(p + nb + l), _MM_HINT_T0);
                    _mm_prefetch((const char *)(g + nb + l), _MM_HINT_T0);
                }
                for (int l = 0; l < nu; l += 64) {
                    _mm_prefetch((const char *)(c1 + nb + l), _MM_HINT_T0);
                    if (has2) _mm_prefetch((const char *)(c2 + nb + l), _MM_HINT_T0);
                }
            }
        }
#endif
#ifdef QS_NARROW
        if (nblk > 1) {
            float g1[32], g2[32];
            for (int h = 0; h < nblk; h++) a1[b + h] = g1[h] = narrow_absmax(s1 + h * n, n);
#ifndef QS_PHASE_NO_ENCODE
            encode_group(&q1, s1, n, nu, g1, cc1, flags, seed1, gidx);
#endif
            if (has2) {
                for (int h = 0; h < nblk; h++) a2[b + h] = g2[h] = narrow_absmax(s2 + h * n, n);
#ifndef QS_PHASE_NO_ENCODE
                encode_group(&q2, s2, n, nu, g2, cc2, flags, seed2, gidx);
#endif
            }
            (void)m1;
            (void)m2;
            b += nblk - 1;
            continue;
        }
#endif
        if (m1 < 0.0f) m1 = block_absmax(s1, n);
        a1[b] = m1;
#ifndef QS_PHASE_NO_ENCODE
        encode_block(&q1, s1, n, m1, cc1, flags, seed1, gidx);
#endif
        if (has2) {
            if (m2 < 0.0f) m2 = block_absmax(s2, n);
            a2[b] = m2;
#ifndef QS_PHASE_NO_ENCODE
            encode_block(&q2, s2, n, m2, cc2, flags, seed2, gidx);
#endif
        }
    }
}

int step8_multi(int kind, const int64_t *tensors, int64_t ntensors,
                const float *code1, const uint32_t *regions1, const uint32_t *lut1, int zero1,
                int signed1, const float *code2, const uint32_t *regions2,
                const uint32_t *lut2, int zero2, int signed2, int64_t block, int nthreads) {
    if (block > 4096 || block <= 0 || ntensors < 0) return -1;
    const tensor_t *T = (const tensor_t *)tensors;
    const qmap_t q1 = {code1, regions1, lut1, zero1, signed1};
    const qmap_t q2 = {code2, regions2, lut2, zero2, signed2};
    int64_t nblocks = 0;
    for (int64_t t = 0; t < ntensors; t++) {
        if (T[t].rows < 0 || T[t].row_numel < 0 || (T[t].c2 != 0 && code2 == NULL)) return -1;
        nblocks += tensor_blocks(T + t, block);
    }
    uint8_t planes1[1024], planes2[1024];
    code_planes(code1, planes1);
    if (code2 != NULL) code_planes(code2, planes2);
#pragma omp parallel num_threads(nthreads)
    {
    float s1[4096], s2[4096]; /* per thread: the decoded states of the current block */
#ifdef QS_PHASE_NO_DECODE
    for (int k = 0; k < 4096; k++) { /* defined stand-ins for the skipped decode */
        s1[k] = 1e-3f * (float)(k % 7 - 3);
        s2[k] = 1e-6f * (float)(k % 5 + 1);
    }
#endif
    int64_t lo, hi, first = 0;
    qs_thread_share(nblocks, &lo, &hi);
    for (int64_t t = 0; t < ntensors && first < hi; t++) {
        const int64_t last = first + tensor_blocks(T + t, block);
        if (last > lo)
            step_blocks(kind, T + t, &q1, &q2, planes1, planes2, block,
                        (lo > first ? lo : first) - first, (hi < last ? hi : last) - first, s1,
                        s2);
        first = last;
    }
    } /* omp parallel */
    return 0;
}

/* Encode `rows` x `row_numel` floats with the row-block layout (used to initialise states and by
 * tests to check the kernel's encoder against the torch reference). */
int quantize_rows(const float *x, uint8_t *c, float *a, const float *code, const uint32_t *regions,
                  const uint32_t *lut, int zero, int is_signed, int64_t rows, int64_t row_numel,
                  int64_t block, int flags, uint64_t seed, int64_t global_offset, int nthreads) {
    if (block > 4096 || block <= 0) return -1;
    qmap_t q = {code, regions, lut, zero, is_signed};
    const int64_t nbr = (row_numel + block - 1) / block;
    const uint64_t seed1 = mix64(seed);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < rows * nbr; b++) {
        const int64_t r = b / nbr, j = b % nbr;
        const int64_t off = r * row_numel + j * block;
        const int n = (int)((row_numel - j * block) < block ? (row_numel - j * block) : block);
        float buf[4096];
        memcpy(buf, x + off, (size_t)n * sizeof(float));
        const float m = block_absmax(buf, n);
        encode_block(&q, buf, n, m, c + off, flags, seed1, global_offset + off);
        a[b] = m;
    }
    return 0;
}
"""
)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64
    lib.step8_multi.restype = i32
    lib.step8_multi.argtypes = [i32, p, i64, p, p, p, i32, i32, p, p, p, i32, i32, i64, i32]
    lib.quantize_rows.restype = i32
    lib.quantize_rows.argtypes = [p, p, p, p, p, p, i32, i32, i64, i64, i64, i32, u64, i64, i32]


# Built and cached by qshard._native (source + flags + compiler + CPU in the file name).
_LIBRARY = NativeLibrary(
    "optim8bit",
    _SOURCE,
    declare=_declare,
    what="qshard.optim: fused 8-bit kernel",
    fallback="slower torch reference path",
    disable_env="QSHARD_NO_KERNELS",
)


def library() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it cannot be built (reason logged once)."""
    return _LIBRARY.get()


def available() -> bool:
    return library() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor; got {t.dtype}")
