"""The fused 8-bit kernel against its references: its encoder against
``qshard.quant.dynamic.quantize_codebook`` (value for value), and one fused optimizer step
against the fp32 update of ``torch.optim``-ordered pure functions from the same dequantized state.
"""

from __future__ import annotations

import copy
import ctypes
import platform

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qshard import _native
from qshard import optim as qoptim
from qshard.optim import _kernel_common, _kernels, _qstate
from qshard.quant import _codetable
from qshard.quant.dynamic import quantize_codebook

from ._helpers import assert_same_bits

pytestmark = pytest.mark.skipif(not _kernels.available(), reason="no C compiler for the kernel")


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 9),
    row_numel=st.integers(1, 700),
    block=st.sampled_from([64, 256, 2048]),
    signed=st.booleans(),
    power=st.integers(1, 7),
    scale=st.floats(1e-30, 1e30),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_encoder_equals_quantize_codebook(
    rows, row_numel, block, signed, power, scale, seed
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, row_numel, generator=gen).pow(power) * scale  # heavy tails
    if not signed:
        x = x.abs()
    x[0, : min(3, row_numel)] = 0.0
    q = _qstate.qmap(signed)
    codes, absmax = _qstate.kernel_quantize_rows(
        x, q, block, _qstate.Rounding(floor_unsigned=False)
    )
    # The reference quantizer on each row zero-padded to whole blocks.
    ref_codes, ref_absmax = _qstate.quantize_rows(
        x, q, block, _qstate.Rounding(floor_unsigned=False)
    )
    assert torch.equal(codes, ref_codes)
    assert torch.equal(absmax, ref_absmax)
    if row_numel % block == 0:  # then the layout is the flat one: compare directly
        flat_codes, flat_absmax = quantize_codebook(x, q.code, block_size=block)
        assert torch.equal(codes.reshape(-1), flat_codes)
        assert torch.equal(absmax.reshape(-1), flat_absmax)


def test_kernel_encoder_ties_and_edges():
    q = _qstate.qmap(True)
    # Every midpoint exactly (ties go to the lower code), the codes themselves, and +-1.
    x = torch.cat([q.mid, q.code, torch.tensor([1.0, -1.0, -0.0, 1e-38, -1e-38])])
    x = x.reshape(1, -1)
    codes, absmax = _qstate.kernel_quantize_rows(x, q, 4096, _qstate.Rounding())
    assert absmax.item() == 1.0
    expected = torch.bucketize(x.reshape(-1), q.mid).to(torch.uint8)
    assert torch.equal(codes.reshape(-1), expected)
    assert torch.equal(codes[0, 255 : 255 + 256], torch.arange(256, dtype=torch.uint8))


def _warm(opt_cls, kwargs, shape, steps=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(shape, generator=gen))
    opt = opt_cls([p], **kwargs)
    for _ in range(steps):
        p.grad = torch.randn(shape, generator=gen) * 0.3
        opt.step()
    p.grad = torch.randn(shape, generator=gen) * 0.3
    return p, opt


_ONE_STEP = [
    (qoptim.Adam8bit, dict(lr=1e-2, weight_decay=0.1)),
    (qoptim.AdamW8bit, dict(lr=1e-2, weight_decay=0.1)),
    (qoptim.Lion8bit, dict(lr=1e-3, weight_decay=0.1)),
    (qoptim.SGD8bit, dict(lr=1e-2, momentum=0.9, weight_decay=1e-2, nesterov=True)),
    (qoptim.SGD8bit, dict(lr=1e-2, momentum=0.9, dampening=0.1)),
    (qoptim.RMSprop8bit, dict(lr=1e-3, weight_decay=1e-2)),
    (qoptim.RMSprop8bit, dict(lr=1e-3, momentum=0.9)),
    (qoptim.Adagrad8bit, dict(lr=1e-2, lr_decay=0.01, weight_decay=1e-2)),
]


def _reference(opt, p, states, step):
    group = opt.param_groups[0]
    opt._reference_update(p, p.grad.clone(), states, group, step)


@pytest.mark.parametrize("block", [256, 2048])
@pytest.mark.parametrize("case", range(len(_ONE_STEP)))
def test_one_fused_step_equals_fp32_reference(case, block):
    cls, kw = _ONE_STEP[case]
    p, opt = _warm(cls, {**kw, "block_size": block}, (48, 300))
    specs = opt._state_specs(opt.param_groups[0])
    st_ = opt.state[p]
    maps = [_qstate.qmap(s) for _, s in specs]
    before = [
        _qstate.dequantize_rows(st_[f"{n}_codes"], st_[f"{n}_absmax"], q, block)
        for (n, _), q in zip(specs, maps)
    ]
    step = int(st_["step"]) + 1
    ref_p = p.detach().clone()
    ref_states = [s.clone() for s in before]
    ref_p.grad = p.grad
    _reference(opt, ref_p, ref_states, step)
    opt.step()
    # Parameters: the fp32 update from the same dequantized state, to float rounding.
    torch.testing.assert_close(p.detach(), ref_p, rtol=2e-6, atol=1e-7)
    # States: the stored code is the nearest to the fp32 state (within half a code gap).
    for (n, _), q, ref in zip(specs, maps, ref_states):
        absmax = st_[f"{n}_absmax"]
        deq = _qstate.dequantize_rows(st_[f"{n}_codes"], absmax, q, block)
        scale = absmax.repeat_interleave(block, dim=1)[:, : ref.shape[1]]
        x = (ref / scale).clamp(-1, 1)
        hi = torch.searchsorted(q.code, x.contiguous()).clamp(1, 255)
        half_gap = (q.code[hi] - q.code[hi - 1]) / 2 * scale
        err = (deq - ref).abs()
        # slack: the fp32 states of the two paths may differ in the last bits
        slack = 1e-6 * ref.abs() + 1e-30
        assert bool((err <= half_gap * (1 + 1e-5) + slack).all()), (
            n,
            float((err - half_gap).max()),
        )


@pytest.mark.parametrize("shape", [(40, 500), (301, 16), (13, 333)])
def test_kernel_and_torch_paths_write_the_same_bits(monkeypatch, shape):
    """[Note: the kernel's order] in qshard.optim._functional: the torch path (no compiler,
    QSHARD_NO_KERNELS=1) evaluates the kernel's update in the kernel's order, so the two write
    the same bits for every optimizer and rounding rule but the stochastic one (its own random
    stream), also through -0.0 gradients, a NaN, rows whose states are 0, tiny or huge, and
    narrow rows (before: ~1 ulp apart after a step, now and then a code)."""
    for cls, kw in [*_ONE_STEP, (qoptim.AdamW8bit, dict(lr=1e-2, bnb_compat=True))]:
        kw = {**kw, "min_8bit_size": 1}
        gen = torch.Generator().manual_seed(3)
        p1 = torch.nn.Parameter(torch.randn(shape, generator=gen))
        p2 = torch.nn.Parameter(p1.detach().clone())
        o1, o2 = cls([p1], **kw), cls([p2], **kw)
        for step in range(4):
            g = _narrow_grad(shape, gen)
            g[0, :3] = -0.0
            if step == 3:
                g[min(6, shape[0] - 1), 5] = float("nan")
            p1.grad, p2.grad = g.clone(), g.clone()
            o1.step()
            monkeypatch.setattr(_kernels, "library", lambda: None)
            o2.step()
            monkeypatch.undo()
            assert any(k.endswith("_codes") for k in o1.state[p1]), "8-bit state"
            assert_same_bits((p1, o1), (p2, o2), (cls.__name__, kw, shape, step))


def test_kernel_encodes_with_the_quantizers_search_table():
    # One table and one C encoder for both exact-nearest encoders (qshard.quant._codetable,
    # whose test_codetable.py checks the table against bucketize on every midpoint).
    for signed in (True, False):
        q = _qstate.qmap(signed)
        assert torch.equal(q.lut, _codetable.search_table(q.code))
        mid = (q.code[:-1] + q.code[1:]) / 2
        x = torch.cat([mid, torch.nextafter(mid, -mid.sign() * 2), q.code]).clamp(-1, 1)
        x = x if signed else x.abs()
        assert torch.equal(_codetable.nearest_reference(x, q.lut), torch.bucketize(x, mid))
    assert _kernels._SOURCE.count(_codetable.NEAREST_C) == 1


def test_bad_block_size_is_rejected_by_kernel():
    q = _qstate.qmap(True)
    with pytest.raises(ValueError, match="block_size"):
        _qstate.kernel_quantize_rows(torch.ones(2, 8), q, 8192, _qstate.Rounding())


_BUILDS = {
    # the scalar loops a CPU without AVX2 runs
    "scalar": ("-mno-avx", "-mno-avx2", "-mno-fma"),
    # the AVX2 paths (table gathers, 32-lane encoder, scalar-load decoder) a CPU without
    # AVX-512 runs; on an AVX-512 host the default build runs the 16-lane paths instead
    "avx2": ("-mno-avx512f",),
    # AVX-512 without VBMI: the 16-lane region encoder and float-permute decoder
    "avx512-no-vbmi": ("-mno-avx512vbmi", "-mno-avx512vbmi2"),
}


def _other_library(build="scalar"):
    """The kernel source built for a smaller instruction set (see _BUILDS)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the -mno-avx2 / -mno-avx512f builds are x86 checks")
    flags = (*_native.DEFAULT_FLAGS, *_BUILDS[build])
    lib = _native.build_library(f"optim8bit_test_{build}", _kernels._SOURCE, flags)
    _kernels._declare(lib)
    return lib


def _scalar_library():
    return _other_library("scalar")


@pytest.mark.parametrize("build", list(_BUILDS))
@pytest.mark.parametrize(
    "extra",
    [{}, {"bnb_compat": True}, {"stochastic_rounding": True}, {"block_size": 64}],
    ids=["default", "bnb_compat", "stochastic", "block64"],
)
def test_scalar_build_writes_the_same_bits(monkeypatch, extra, build):
    """The vector paths (AVX-512: region encoder, register decoder; AVX2: table gathers,
    32-lane encoder, scalar-load decoder) are exact rewrites of the scalar loops: the default
    build and the smaller ones write bit-identical parameters, codes and absmax, for every
    optimizer, on rows with partial blocks and tails shorter than a vector."""
    scalar = _other_library(build)
    for cls, kw in _ONE_STEP:
        kw = {**kw, **extra}
        # 13 x 333 >= min_8bit_size; rows of 256 + 77 (or 5 x 64 + 13): every vector loop and
        # the scalar tails run
        p1, o1 = _warm(cls, kw, (13, 333), steps=2)
        assert any(k.endswith("_codes") for k in o1.state[p1]), "state must be 8-bit"
        p2 = torch.nn.Parameter(p1.detach().clone())
        p2.grad = p1.grad.clone()
        o2 = cls([p2], **kw)
        o2.load_state_dict(copy.deepcopy(o1.state_dict()))
        for _ in range(2):
            o1.step()
            monkeypatch.setattr(_kernels, "library", lambda: scalar)
            o2.step()
            monkeypatch.undo()
            p1.grad = p2.grad = torch.randn(p1.shape) * torch.rand(()).item() * 3
        assert_same_bits((p1, o1), (p2, o2), cls)


def _narrow_grad(shape, gen):
    """A gradient whose rows, stepped alike, give blocks of every kind: row 1 keeps its states
    at zero (absmax 0), rows 2, 4 and 5 put them below and above the exact-quotient range (row
    5: Adam's v near the largest float, whose reciprocal is subnormal)."""
    g = torch.randn(shape, generator=gen) * 0.3
    for row, scale in ((1, 0.0), (2, 1e-35), (4, 1e19), (5, 6e20)):
        if row < shape[0]:
            g[row] *= scale
    return g


@pytest.mark.parametrize("build", [None, "avx512-no-vbmi", "avx2"], ids=["vbmi", "no-vbmi", "avx2"])
def test_narrow_rows_write_the_same_bits(monkeypatch, build):
    """[Note: narrow rows]: every vector build (AVX-512 VBMI: the default here; without VBMI;
    AVX2) steps rows of 8 to 32 elements up to 256 elements at a time (rows of 64 block by block:
    checked too); the scalar build steps them block by block. Same bits for every optimizer, with
    blocks that leave the grouped encoder (absmax 0, below and above the exact-quotient range, a
    row that turns NaN, lanes near a midpoint: random data has a few per step), with row counts
    that leave a remainder or form no group, bitsandbytes' rules (not grouped), and 1 and 2
    threads (other splits of the blocks)."""
    grouped = _kernels.library() if build is None else _other_library(build)
    scalar = _other_library("scalar")
    threads = torch.get_num_threads()
    try:
        for nthreads in (1, 2):
            torch.set_num_threads(nthreads)
            for shape in ((301, 16), (150, 32), (3, 16), (70, 16), (601, 8), (75, 64)):
                for cls, kw in [*_ONE_STEP, (qoptim.AdamW8bit, dict(lr=1e-2, bnb_compat=True))]:
                    kw = {**kw, "min_8bit_size": 1}
                    gen = torch.Generator().manual_seed(nthreads)
                    p1 = torch.nn.Parameter(torch.randn(shape, generator=gen))
                    p2 = torch.nn.Parameter(p1.detach().clone())
                    o1, o2 = cls([p1], **kw), cls([p2], **kw)
                    for step in range(3):
                        g = _narrow_grad(shape, gen)
                        if step == 2:
                            g[min(6, shape[0] - 1), 3] = float("nan")
                        p1.grad, p2.grad = g.clone(), g.clone()
                        for o_, lib in ((o1, grouped), (o2, scalar)):
                            monkeypatch.setattr(_kernels, "library", lambda lib=lib: lib)
                            o_.step()
                            monkeypatch.undo()
                        assert any(k.endswith("_codes") for k in o1.state[p1]), "8-bit state"
                        assert_same_bits((p1, o1), (p2, o2), (cls, kw, shape, nthreads, step))
    finally:
        torch.set_num_threads(threads)


def _edge_values(q):
    """Every midpoint, the floats either side of it, and every code, in [-1, 1]."""
    mid = q.mid
    x = torch.cat([mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1), q.code])
    x = torch.cat([x, torch.tensor([1.0, 0.0, 1e-38, 1e-45, 2.0**-30, 2.0**-31])]).clamp(-1, 1)
    return torch.cat([x, -x])


@pytest.mark.parametrize("signed", [True, False])
def test_region_table_is_exact_where_it_does_not_fall_back(signed):
    # [Note: the region encoder]: the torch twin of the kernel's gather-free encoder equals
    # bucketize on every lane it does not flag, at every midpoint, its neighbours, the codes
    # and random values of both signs; few lanes are flagged (each costs a table search).
    q = _qstate.qmap(signed)
    gen = torch.Generator().manual_seed(0)
    rnd = torch.randn(1 << 18, generator=gen)
    rnd = torch.cat([rnd / rnd.abs().max(), rnd.pow(9) / rnd.pow(9).abs().max()])
    x = torch.cat([_edge_values(q), rnd])
    codes, flagged = _codetable.region_reference(x, q.regions)
    ref = torch.bucketize(x, q.mid)
    if not signed:
        ref = torch.where(x < 0, 0, ref)  # an unsigned state is never negative; code 0
    assert torch.equal(codes[~flagged], ref[~flagged])
    assert float(flagged[-rnd.numel() :].float().mean()) < 2e-3
    # a midpoint is either a bridge (decided by the exact compare) or flagged: never decided
    # by the line alone, so ties go to the lower code
    thr = q.regions[:32].view(torch.float32)
    at_mid = x[: q.mid.numel()]
    assert bool((flagged[: q.mid.numel()] | torch.isin(at_mid.abs(), thr)).all())


def test_region_table_refuses_maps_of_another_shape():
    from qshard.quant.dynamic import dynamic_map, linear_map

    assert _codetable.build_region_table(linear_map(signed=True)) is None
    assert (
        _codetable.build_region_table(dynamic_map(signed=True, total_bits=4, max_exponent_bits=3))
        is None
    )
    gen = torch.Generator().manual_seed(0)
    odd = torch.sort(torch.rand(256, generator=gen)).values
    odd[0] = 0.0
    assert _codetable.build_region_table(odd) is None
    for signed in (True, False):
        table = _qstate.qmap(signed).regions
        assert table.numel() == _codetable.REGION_TABLE_SIZE
        assert int(table[-1]) == (1 if signed else 2)


@pytest.mark.parametrize("signed", [True, False])
def test_region_encoder_in_the_kernel_on_midpoints(signed):
    # The kernel's encoder (region encoder on AVX-512 hosts) on blocks whose absmax is 1, so the
    # normalised values are exactly the edge values: bucketize's codes.
    q = _qstate.qmap(signed)
    x = _edge_values(q)
    if not signed:
        x = x.abs()
    body = x.reshape(-1)
    n = body.numel()
    rows = torch.ones(-(-n // 255), 256)
    flat = torch.ones(rows.shape[0] * 255)
    flat[:n] = body
    rows[:, 1:] = flat.view(-1, 255)
    codes, absmax = _qstate.kernel_quantize_rows(
        rows, q, 256, _qstate.Rounding(floor_unsigned=False)
    )
    assert bool((absmax == 1.0).all())
    assert torch.equal(codes[:, 1:].reshape(-1)[:n].long(), torch.bucketize(body, q.mid))


@pytest.mark.slow
def test_region_encoder_every_float_in_the_unit_interval():
    """Exhaustive: every fp32 in [0, 1] (and its negative for the signed map) encodes to the
    same code in the default build (the region encoder on AVX-512 hosts) as in the AVX2 build
    (the table search, itself equal to bucketize: test_codetable.py). ~1 min."""
    other = _other_library("avx2")
    chunk = 4095 * 4096
    for signed in (True, False):
        q = _qstate.qmap(signed)
        top = 0x3F800000 + 1  # bit patterns of 0.0 .. 1.0
        for start in range(0, top, chunk):
            m = min(chunk, top - start)
            vals = torch.arange(start, start + m, dtype=torch.int64).to(torch.int32)
            body = torch.ones(-(-m // 4095) * 4095)
            body[:m] = vals.view(torch.float32)
            x = torch.cat([torch.ones(body.numel() // 4095, 1), body.view(-1, 4095)], 1)
            for xx in [x, -x] if signed else [x]:
                xx = xx.contiguous()
                rnd = _qstate.Rounding(floor_unsigned=False)
                c1, _ = _qstate.kernel_quantize_rows(xx, q, 4096, rnd)
                saved = _kernels.library
                _kernels.library = lambda: other
                try:
                    c2, _ = _qstate.kernel_quantize_rows(xx, q, 4096, rnd)
                finally:
                    _kernels.library = saved
                assert torch.equal(c1, c2), (signed, start)


# ------------------------------------------------------------ exact quotients by a constant

# A checker around the kernels' QUOTIENT_C ([Note: exact quotients by a constant]): for one
# divisor d, every float x with bit pattern in [lo, hi) (and -x) divided by d both ways;
# returns the count of results whose bits differ (zeros of either sign count as equal: -0.0
# gives +0.0, as the Note says).
_QUOTIENT_CHECK_C = r"""
int64_t quot_mismatches(float d, uint32_t lo, uint32_t hi, int inf_variant) {
    const float r = 1.0f / d;
    int64_t bad = 0;
#if defined(__AVX512F__)
    const __m512 dv = _mm512_set1_ps(d), rv = _mm512_set1_ps(r);
    const __m512i step = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (uint64_t u = lo; u < hi; u += 16) {
        const __m512i bits = _mm512_add_epi32(_mm512_set1_epi32((int)u), step);
        const __mmask16 in = _mm512_cmplt_epu32_mask(bits, _mm512_set1_epi32((int)hi));
        for (int sgn = 0; sgn < 2; sgn++) {
            const __m512 x = _mm512_castsi512_ps(
                _mm512_or_si512(bits, _mm512_set1_epi32(sgn ? (int)0x80000000u : 0)));
            const __m512 want = _mm512_div_ps(x, dv);
            const __m512 got = inf_variant ? qs_quot16_inf(x, dv, rv) : qs_quot16(x, dv, rv);
            const __mmask16 zeros = _mm512_cmp_ps_mask(want, _mm512_setzero_ps(), _CMP_EQ_OQ) &
                                    _mm512_cmp_ps_mask(got, _mm512_setzero_ps(), _CMP_EQ_OQ);
            bad += __builtin_popcount(_mm512_mask_cmpneq_epi32_mask(
                in & ~zeros, _mm512_castps_si512(want), _mm512_castps_si512(got)));
        }
    }
#elif defined(__AVX2__)
    const __m256 dv = _mm256_set1_ps(d), rv = _mm256_set1_ps(r);
    for (uint64_t u = lo; u < hi; u += 8) {
        uint32_t b[8];
        for (int l = 0; l < 8; l++) b[l] = (uint32_t)(u + l) < hi ? (uint32_t)(u + l) : lo;
        for (int sgn = 0; sgn < 2; sgn++) {
            __m256i bits = _mm256_loadu_si256((const __m256i *)b);
            if (sgn) bits = _mm256_or_si256(bits, _mm256_set1_epi32((int)0x80000000u));
            const __m256 x = _mm256_castsi256_ps(bits);
            const __m256 want = _mm256_div_ps(x, dv);
            const __m256 got = inf_variant ? qs_quot8_inf(x, dv, rv) : qs_quot8(x, dv, rv);
            const __m256i ne = _mm256_xor_si256(_mm256_castps_si256(want),
                                                _mm256_castps_si256(got));
            const __m256 zeros = _mm256_and_ps(_mm256_cmp_ps(want, _mm256_setzero_ps(), _CMP_EQ_OQ),
                                               _mm256_cmp_ps(got, _mm256_setzero_ps(), _CMP_EQ_OQ));
            uint32_t o[8];
            _mm256_storeu_si256((__m256i *)o, _mm256_andnot_si256(_mm256_castps_si256(zeros), ne));
            for (int l = 0; l < 8; l++) bad += o[l] != 0;
        }
    }
#endif
    return bad;
}
"""


def _quotient_checker(build: str):
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the exact-quotient helpers are x86 vector code")
    with open("/proc/cpuinfo") as f:
        cpu_flags = f.read()
    need = {"avx512": " avx512f", "avx2": " avx2"}[build]
    if need not in cpu_flags:
        pytest.skip(f"this CPU has no{need}")
    flags = (*_native.DEFAULT_FLAGS, *(("-mno-avx512f",) if build == "avx2" else ()))
    head = "#include <stdint.h>\n#include <string.h>\n#include <immintrin.h>\n"
    source = head + _kernel_common.QUOTIENT_C + _QUOTIENT_CHECK_C
    lib = _native.build_library(f"quotient_check_{build}", source, flags)
    lib.quot_mismatches.restype = ctypes.c_int64
    lib.quot_mismatches.argtypes = [ctypes.c_float, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int]
    return lib


def _f32_bits(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float32).view(torch.int32).item()) & 0xFFFFFFFF


def _divisors(count: int, seed: int) -> list[float]:
    """Divisors in the helpers' range: its two ends, and per exponent significands that are all
    ones, near all ones, near a power of two and random (the hard cases of reciprocals)."""
    gen = torch.Generator().manual_seed(seed)
    lo_e, hi_e = -70, 60
    out = [2.0**lo_e, 2.0**hi_e, float(torch.tensor(2.0**hi_e).nextafter(torch.tensor(0.0)))]
    for i in range(count):
        e = int(torch.randint(lo_e, hi_e, (1,), generator=gen))
        r = int(torch.randint(0, 1 << 23, (1,), generator=gen))
        man = [0x7FFFFF, 0x7FFFFF - (r & 63), r & 63, r][i % 4]
        bits = ((e + 127) << 23) | man
        out.append(float(torch.tensor([bits], dtype=torch.int32).view(torch.float32)))
    return out


def _check_quotients(lib, divisors, binades_below):
    """Every x of d's own binade up to d and of the binades ``binades_below`` lower (as long as
    |x| >= 2^-101), both signs, divided by d both ways."""
    floor_exp = 127 - 101  # biased exponent of 2^-101
    for d in divisors:
        top = _f32_bits(d)
        e = top >> 23
        ranges = [(e << 23, top + 1)]
        for k in binades_below:
            if e - k >= floor_exp:
                ranges.append(((e - k) << 23, (e - k + 1) << 23))
        for lo, hi in ranges:
            for inf_variant in (0, 1):
                assert lib.quot_mismatches(d, lo, hi, inf_variant) == 0, (d.hex(), lo, hi)


@pytest.mark.parametrize("build", ["avx512", "avx2"])
def test_exact_quotients_equal_the_division(build):
    """[Note: exact quotients by a constant]: x * r corrected by one fma is the division's
    result bit for bit, for every x of whole binades (d's own up to d, one 17 binades lower and
    one at the bottom of the range, 2^-101) and divisors of every hard shape across the range."""
    lib = _quotient_checker(build)
    divisors = _divisors(24, seed=0)
    _check_quotients(lib, divisors, binades_below=(17,))
    # the bottom of the x range for the smallest divisors
    for d in (2.0**-70, float(torch.tensor(2.0**-69).nextafter(torch.tensor(0.0)))):
        assert lib.quot_mismatches(d, 26 << 23, 27 << 23, 0) == 0
    # zeros, infinities and NaN: the division's results (the _inf variant for infinities)
    for d in divisors[:4]:
        for x in (0x00000000, 0x7F800000, 0x7FC00000):
            assert lib.quot_mismatches(d, x, x + 1, 1) == 0, (d, hex(x))


@pytest.mark.slow
@pytest.mark.parametrize("build", ["avx512", "avx2"])
def test_exact_quotients_equal_the_division_many_divisors(build):
    """As above for 250 more divisors and four binades of x each (~1 min for both builds)."""
    lib = _quotient_checker(build)
    _check_quotients(lib, _divisors(250, seed=1), binades_below=(1, 24, 60))


def _block(absmax: float, body: list[float]) -> torch.Tensor:
    """One 256-element row: the absmax, then ``body``, then zeros."""
    row = torch.zeros(1, 256)
    row[0, 0] = absmax
    row[0, 1 : 1 + len(body)] = torch.tensor(body, dtype=torch.float32)
    return row


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("build", ["default", *_BUILDS])
def test_encoder_on_blocks_outside_the_exact_quotient_range(signed, build):
    """Blocks whose absmax lies outside the vector encoders' exact-quotient range (the kernel
    divides those first) and values whose quotient underflows: the kernel's codes equal the torch
    reference's, and a positive state never takes the zero code under the unsigned floor, also
    where value / absmax underflows to 0 (the reference tests the state, not the quotient)."""
    q = _qstate.qmap(signed)
    rows = []
    for absmax in (1e-30, 2.0**-71, 2.0**-70, 0.7, 3e5, 2.0**60, 2.0**61, 1e25, 3e38):
        body = (q.mid[::7] * absmax).tolist()  # midpoints scaled: ties in the quotient
        body += [absmax * 1e-7, absmax * 3e-8, 1e-45, 1e-42, 3e-39, 2.0**-126]
        body = [v for v in body if abs(v) <= absmax]
        if not signed:
            body = [abs(v) for v in body]
        rows.append(_block(absmax, body))
    x = torch.cat(rows)
    lib = None if build == "default" else _other_library(build)
    for floor in (False, True):
        rnd = _qstate.Rounding(floor_unsigned=floor)
        saved = _kernels.library
        if lib is not None:
            _kernels.library = lambda: lib
        try:
            codes, absmax = _qstate.kernel_quantize_rows(x, q, 256, rnd)
        finally:
            _kernels.library = saved
        ref_codes, ref_absmax = _qstate.quantize_rows(x, q, 256, rnd)
        assert torch.equal(absmax, ref_absmax)
        assert torch.equal(codes, ref_codes), (floor, (codes != ref_codes).nonzero()[:5])
        if floor and not signed:
            assert bool((codes[x > 0] != q.zero_idx).all())


def test_update_with_an_overflowing_square_gradient_matches_the_scalar_build(monkeypatch):
    """A finite gradient whose square overflows (v = inf, m finite): Adam's sqrt(v) / bc2 is the
    division's inf in the vector loops too (qs_quot16_inf), so the parameter keeps its value
    this step as torch's does; the next step's NaN block and the untouched elements agree with
    the scalar loops bit for bit."""
    scalar = _scalar_library()
    p1, o1 = _warm(qoptim.AdamW8bit, {"lr": 1e-2}, (13, 333), steps=2)
    p2 = torch.nn.Parameter(p1.detach().clone())
    o2 = qoptim.AdamW8bit([p2], lr=1e-2)
    o2.load_state_dict(copy.deepcopy(o1.state_dict()))
    g = torch.randn(p1.shape)
    g[3, 5], g[7, 300], g[12, 0] = 2e21, -1e22, 0.0  # (1 - beta2) * g * g overflows
    before = p1.detach().clone()
    for step in range(2):
        p1.grad, p2.grad = g.clone(), g.clone()
        o1.step()
        monkeypatch.setattr(_kernels, "library", lambda: scalar)
        o2.step()
        monkeypatch.undo()
        if step == 0:  # m / inf = 0: only the decoupled decay moves the element
            decay = torch.tensor(1 - 1e-2 * 1e-2, dtype=torch.float32)
            assert torch.equal(p1.detach()[3, 5], before[3, 5] * decay)
        assert_same_bits((p1, o1), (p2, o2), step)
