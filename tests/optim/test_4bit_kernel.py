"""The fused 4-bit CPU kernel against the torch reference: its encoder value for value
(``_qstate4.quantize_rows4``, i.e. ``torch.bucketize`` on the midpoints), whole optimizer steps
bit for bit (``_qstate4.adam4bit_reference``), the scalar (no-AVX2) build, OpenMP threads and
concurrent Python threads."""

from __future__ import annotations

import copy
import platform
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qshard import _native
from qshard.optim import _kernels4, _qstate4
from qshard.optim.adam4bit import Adam4bit, AdamW4bit
from qshard.quant import _codetable

from ._helpers import assert_same_bits

pytestmark = pytest.mark.skipif(not _kernels4.available(), reason="no C compiler for the kernel")

_MAPS = ("signed-dynamic", *_qstate4.SECOND_MOMENT_MAPS)


def _kernel_quantize(x: torch.Tensor, q, block: int, linear: int = 0):
    lib = _kernels4.library()
    rows, row_numel = x.shape
    x = x.float().contiguous()
    codes = torch.empty(rows, _qstate4.packed_row(row_numel), dtype=torch.uint8)
    absmax = torch.empty(rows, -(-row_numel // block), dtype=torch.float32)
    rc = lib.quantize_rows4(
        x.data_ptr(), codes.data_ptr(), absmax.data_ptr(), q.mid_padded.data_ptr(),
        q.lut.data_ptr(), linear, rows, row_numel, block, 1,
    )  # fmt: skip
    assert rc == 0
    return codes, absmax


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    row_numel=st.integers(1, 700),
    block=st.sampled_from([2, 64, 128, 2048]),
    name=st.sampled_from(_MAPS),
    power=st.integers(1, 5),
    scale=st.floats(1e-30, 1e30),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_encoder_equals_reference(rows, row_numel, block, name, power, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, row_numel, generator=gen).pow(power) * scale  # heavy tails
    q = _qstate4.qmap4(name)
    if not q.signed:
        x = x.abs()
    x[0, : min(3, row_numel)] = 0.0
    codes, absmax = _kernel_quantize(x, q, block)
    ref_codes, ref_absmax = _qstate4.quantize_rows4(x, q, block)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(absmax, ref_absmax)
    if name == "linear":  # the arithmetic encoder of the linear map == the table
        assert torch.equal(_kernel_quantize(x, q, block, linear=1)[0], ref_codes)
    if name == "signed-dynamic":  # the symmetric 8-compare encoder == the table
        assert _qstate4.symmetric_signed(q)
        assert torch.equal(_kernel_quantize(x, q, block, linear=2)[0], ref_codes)
    # and the kernel's decoder is the reference decoder
    out = torch.empty_like(x)
    lib = _kernels4.library()
    lib.dequantize_rows4(
        codes.data_ptr(), absmax.data_ptr(), q.code.data_ptr(), out.data_ptr(), rows,
        row_numel, block,
    )  # fmt: skip
    assert torch.equal(out, _qstate4.dequantize_rows4(codes, absmax, q, block, x.shape))


@pytest.mark.parametrize("name", _MAPS)
def test_kernel_encoder_ties_and_codes(name):
    q = _qstate4.qmap4(name)
    # Every midpoint (ties go to the lower code), its neighbours, the codes, and an absmax of 1.
    x = torch.cat([q.mid, torch.nextafter(q.mid, q.mid + 1), q.code, torch.tensor([1.0])])
    x = torch.cat([x, torch.nextafter(q.mid, q.mid - 1)])
    if not q.signed:
        x = torch.cat([x, torch.tensor([0.0, 1e-30, 0.0468749, 0.046875, 0.0468751])])
    if q.signed:  # every value's negative twin (the symmetric encoder's two cases), and -0.0
        x = torch.cat([x, -x, torch.tensor([-0.0, -1.0])])
    x = x.reshape(1, -1)
    expected = torch.bucketize(x.reshape(-1), q.mid)
    kinds = {"linear": (0, 1), "signed-dynamic": (0, 2)}.get(name, (0,))
    for linear in kinds:
        codes, absmax = _kernel_quantize(x, q, 2048, linear)
        assert absmax.item() == 1.0
        assert torch.equal(_qstate4.unpack(codes, x.shape[1]).reshape(-1).long(), expected)
    assert torch.equal(q.lut, _codetable.search_table(q.code))


def _warm(cls, kw, shape, steps=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(shape, generator=gen))
    opt = cls([p], min_4bit_size=0, **kw)
    for _ in range(steps):
        p.grad = torch.randn(shape, generator=gen) * 0.3
        p.grad[0, :3] = -0.0
        opt.step()
    p.grad = torch.randn(shape, generator=gen) * 0.3
    return p, opt


# mode 1 (decoupled decay), mode 2 (L2 decay into the gradient), mode 0 (no decay)
_CASES = [
    (AdamW4bit, dict(lr=1e-2, weight_decay=0.1)),
    (Adam4bit, dict(lr=1e-2, weight_decay=0.1)),
    (Adam4bit, dict(lr=1e-2, betas=(0.8, 0.95))),
    (AdamW4bit, dict(lr=1e-2, block_size=64, second_moment_map="dynamic")),
]
# rows of 300 = 2 x 128 + 44 (partial block); 129 (odd: a half byte, a tail of 1); 7 x 13.
_SHAPES = [(40, 300), (9, 129), (7, 13)]


def _step_both(cls, kw, shape, monkeypatch, lib_b, steps=3):
    """Run `steps` steps on two copies: one on the fused kernel, one on `lib_b` (None: the torch
    reference path). Returns the (param, optimizer) pairs."""
    p1, o1 = _warm(cls, kw, shape)
    p2 = torch.nn.Parameter(p1.detach().clone())
    p2.grad = p1.grad.clone()
    o2 = cls([p2], min_4bit_size=0, **kw)
    o2.load_state_dict(copy.deepcopy(o1.state_dict()))
    gen = torch.Generator().manual_seed(9)
    for _ in range(steps):
        o1.step()
        monkeypatch.setattr(_kernels4, "library", lambda: lib_b)
        o2.step()
        monkeypatch.undo()
        g = torch.randn(shape, generator=gen) * torch.rand((), generator=gen).item() * 3
        p1.grad, p2.grad = g, g.clone()
    return (p1, o1), (p2, o2)


@pytest.mark.parametrize("case", range(len(_CASES)))
def test_fused_step_equals_torch_reference_bit_for_bit(case, monkeypatch):
    cls, kw = _CASES[case]
    for shape in _SHAPES:
        a, b = _step_both(cls, kw, shape, monkeypatch, None)
        assert "exp_avg_codes" in a[1].state[a[0]]
        assert_same_bits(a, b, (cls.__name__, kw, shape))


_BUILDS = {
    "scalar": ("-mno-avx", "-mno-avx2", "-mno-fma"),  # the loops a CPU without AVX2 runs
    "avx2": ("-mno-avx512f",),  # the 8-lane paths (and the prefetch) without AVX-512
}


def _variant_library(build):
    """The kernel source built with the flags of ``_BUILDS[build]`` added."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the -mno-avx2 / -mno-avx512f builds are x86 checks")
    flags = (*_native.DEFAULT_FLAGS, *_BUILDS[build])
    lib = _native.build_library(f"optim4bit_test_{build}", _kernels4._SOURCE, flags)
    _kernels4._declare(lib)
    return lib


def _scalar_library():
    """The kernel source built without AVX/AVX2/FMA (the nonfinite tests use it too)."""
    return _variant_library("scalar")


@pytest.mark.parametrize("build", sorted(_BUILDS))
def test_variant_builds_write_the_same_bits(build, monkeypatch):
    """The vector paths (register-permute decoder, compare encoders and nibble packer) are exact
    rewrites of the scalar loops, and the AVX2 paths of the AVX-512 ones."""
    lib = _variant_library(build)
    for cls, kw in _CASES:
        for shape in _SHAPES:
            a, b = _step_both(cls, kw, shape, monkeypatch, lib, steps=2)
            assert_same_bits(a, b, (cls.__name__, kw, shape, build))


def _steps_match(lib_a, lib_b, shapes, grad_of, monkeypatch, threads=(1, 2)):
    """Three steps of every case on ``lib_a`` and on ``lib_b`` (None: the torch reference), from
    the same start, with gradients ``grad_of(shape, gen, step)``: the same bits after each step,
    at each thread count."""
    saved = torch.get_num_threads()
    try:
        for nthreads in threads:
            torch.set_num_threads(nthreads)
            for shape in shapes:
                for cls, kw in _CASES:
                    gen = torch.Generator().manual_seed(nthreads)
                    p1 = torch.nn.Parameter(torch.randn(shape, generator=gen))
                    p2 = torch.nn.Parameter(p1.detach().clone())
                    o1 = cls([p1], min_4bit_size=0, **kw)
                    o2 = cls([p2], min_4bit_size=0, **kw)
                    for step in range(3):
                        g = grad_of(shape, gen, step)
                        p1.grad, p2.grad = g.clone(), g.clone()
                        for o_, lib in ((o1, lib_a), (o2, lib_b)):
                            monkeypatch.setattr(_kernels4, "library", lambda lib=lib: lib)
                            o_.step()
                            monkeypatch.undo()
                        assert "exp_avg_codes" in o1.state[p1]
                        assert_same_bits((p1, o1), (p2, o2), (kw, shape, nthreads, step))
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("ref", ["scalar", None], ids=["scalar", "torch"])
@pytest.mark.parametrize("build", [None, "avx2"], ids=["avx512", "avx2"])
def test_narrow_rows_write_the_same_bits(build, ref, monkeypatch):
    """[Note: narrow rows]: the vector builds (AVX-512: the default here; AVX2) step rows of 8 to
    64 elements up to 256 elements at a time; the scalar build steps them block by block, and the
    torch reference is the specification. Same bits for every case (both second-moment maps),
    with blocks of every kind (states at zero, tiny, subnormal, huge, a row that turns NaN), row
    counts that leave a remainder or form no group, and 1 and 2 threads (other splits of the
    blocks)."""

    def grad_of(shape, gen, step):
        g = torch.randn(shape, generator=gen) * 0.3
        for row, scale in ((1, 0.0), (2, 1e-35), (3, 1e-40), (4, 1e19)):
            if row < shape[0]:
                g[row] *= scale
        if step == 2:
            g[min(6, shape[0] - 1), 3] = float("nan")
        return g

    grouped = _kernels4.library() if build is None else _variant_library(build)
    reference = None if ref is None else _variant_library(ref)
    shapes = ((301, 16), (150, 32), (3, 16), (70, 16), (601, 8), (75, 64))
    _steps_match(grouped, reference, shapes, grad_of, monkeypatch)


@pytest.mark.parametrize("build", ["scalar", "avx2", None], ids=["scalar", "avx2", "torch"])
def test_blocks_whose_reciprocal_overflows_write_the_same_bits(build, monkeypatch):
    """[Note: 4-bit normalisation]: a block whose absmax is subnormal (its fp32 reciprocal
    overflows: m after ~800 steps without gradient, v of gradients ~1e-21) is divided, not
    multiplied by +Inf, on every path: the same codes on every build and on the torch reference
    (they differed, and the scalar linear encoder converted NaN to an integer)."""

    def grad_of(shape, gen, step):
        g = torch.randn(shape, generator=gen) * 0.3
        for row, scale in ((0, 1e-21), (1, 1e-39), (2, 1e-41), (3, 1e-44)):
            if row < shape[0]:
                g[row] *= scale
        return g

    lib = None if build is None else _variant_library(build)
    shapes = ((9, 13), (8, 8), (40, 300), (17, 16))
    _steps_match(_kernels4.library(), lib, shapes, grad_of, monkeypatch, threads=(1,))


def test_openmp_threads_and_concurrent_callers_write_the_same_bits():
    """The kernel keeps no shared mutable state: 1 or 2 OpenMP threads, and four Python threads
    stepping their own optimizers at once, all give the single-threaded bits."""
    shape = (96, 300)

    def run(nthreads: int | None = None):
        p, opt = _warm(AdamW4bit, dict(lr=1e-2, weight_decay=0.1), shape, steps=0)
        gen = torch.Generator().manual_seed(5)
        for _ in range(4):
            p.grad = torch.randn(shape, generator=gen)
            if nthreads is None:
                opt.step()
            else:
                old = torch.get_num_threads()
                torch.set_num_threads(nthreads)
                try:
                    opt.step()
                finally:
                    torch.set_num_threads(old)
        return [p.detach().clone()] + [v.clone() for v in opt.state[p].values()]

    ref = run(1)
    assert all(torch.equal(x, y) for x, y in zip(ref, run(2)))
    results: list = [None] * 4
    errors: list = []

    def worker(i):
        try:
            for _ in range(3):
                results[i] = run()
        except BaseException as e:  # report in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    for r in results:
        assert all(torch.equal(x, y) for x, y in zip(ref, r))


def test_kernel_shares_the_search_table_encoder():
    assert _kernels4._SOURCE.count(_codetable.NEAREST_C) == 1


def test_bad_block_size_is_rejected_by_kernel():
    q = _qstate4.qmap4("linear")
    x = torch.ones(2, 8)
    lib = _kernels4.library()
    c = torch.empty(2, 4, dtype=torch.uint8)
    a = torch.empty(2, 1)
    for bad in (3, 8192, 0):
        assert lib.quantize_rows4(x.data_ptr(), c.data_ptr(), a.data_ptr(),
                                  q.mid_padded.data_ptr(), q.lut.data_ptr(), 0, 2, 8, bad,
                                  1) == -1  # fmt: skip
