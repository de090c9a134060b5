"""The fast CPU kernels give the same bits as the reference path.

Default suite: the C kernels (the preferred CPU path) on hypothesis-drawn sizes, block sizes
and special blocks; the torch.compile kernel bodies run eagerly (checks their math: exponent lookup table,
fused packing, block splitting) plus one compiled kernel pair; the whole compiled matrix and
the thread test are ``slow`` (each kernel compiles for ~10-30 s on 2 cores with a cold cache).
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qshard.quant as Q
from qshard._env import env_flag, env_int
from qshard.quant import _fastpath, _native_kernels

from ._helpers import FAST, float_tensors


def same(a, b) -> bool:
    if isinstance(a, Q.BlockQuantized):
        return same(a.codes, b.codes) and same(a.scales, b.scales)
    if isinstance(a, tuple):
        return all(same(x, y) for x, y in zip(a, b))
    if a.is_floating_point():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))
    return torch.equal(a, b)


def all_ops(x: torch.Tensor, block_size: int):
    """Every public kernel on ``x``; returns the list of results."""
    results = []
    for bits in (8, 4):
        q = Q.quantize_blockwise(x, bits=bits, block_size=block_size)
        results += [q, Q.dequantize_blockwise(q), Q.dequantize_blockwise(q, dtype=torch.float32)]
    n_rows = x.numel() // block_size
    if n_rows:
        rows = x.reshape(-1)[: n_rows * block_size].view(n_rows, block_size)
        codes, scales = Q.quantize_blocks(rows, bits=8)
        results += [codes, scales, Q.dequantize_blocks(codes, scales, bits=8, dtype=x.dtype)]
    for code in (Q.dynamic_map(signed=True), Q.linear_map(signed=True)):
        codes, absmax = Q.quantize_codebook(x, code, block_size=block_size)
        results += [codes, absmax]
        results.append(Q.dequantize_codebook(codes, absmax, code, block_size=block_size))
    unsigned = Q.dynamic_map(signed=False)
    codes, absmax = Q.quantize_codebook(x.abs(), unsigned, block_size=block_size)
    results += [
        codes,
        absmax,
        Q.dequantize_codebook(codes, absmax, unsigned, block_size=block_size),
    ]
    packed = Q.pack_signs(x)
    results += [packed, Q.unpack_signs(packed, x.numel(), dtype=x.dtype)]
    return results


def with_specials(x: torch.Tensor, seed: int) -> torch.Tensor:
    x = x.clone()
    if x.numel() > 40:
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, x.numel(), (3,), generator=g)
        x[idx[0]] = float("nan")
        x[idx[1]] = float("inf")
        x[idx[2] : idx[2] + 16] = 0.0
    return x


@FAST
@given(
    x=float_tensors(max_numel=3000),
    block_size=st.sampled_from([2, 8, 64, 256]),
    specials=st.booleans(),
)
def test_kernel_bodies_match_reference(fast_mode, x, block_size, specials):
    if specials:
        x = with_specials(x, x.numel())
    fast_mode("ref")
    ref = all_ops(x, block_size)
    fast_mode("eager")
    got = all_ops(x, block_size)
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert same(a, b), f"result {i} differs"


def test_lookup_table_is_exact_for_all_shipped_maps_and_refused_otherwise(fast_mode):
    maps = [Q.linear_map(signed=s, total_bits=b) for s in (True, False) for b in range(2, 9)]
    maps += [
        Q.dynamic_map(signed=s, total_bits=b, max_exponent_bits=b - 1)
        for s in (True, False)
        for b in range(2, 9)
    ]
    for code in maps:
        assert _fastpath.codebook_table(code) is not None
    # Two midpoints inside one lookup interval: the trick is refused, bucketize runs instead.
    crowded = torch.tensor([0.0, 0.5, 0.5000001, 0.5000002, 1.0])
    assert _fastpath.codebook_table(crowded) is None
    x = torch.linspace(0, 1, 4096)
    fast_mode("ref")
    ref = Q.quantize_codebook(x, crowded, block_size=512)
    fast_mode("eager")
    assert same(Q.quantize_codebook(x, crowded, block_size=512), ref)


def test_every_normalised_float_takes_the_exact_code(fast_mode):
    # Exhaustive over fp32 bit patterns in [-1, 1], strided: the lookup + one comparison
    # equals bucketize on the midpoints.
    bits = torch.arange(0, 0x3F800001, 4099, dtype=torch.int32)
    v = bits.view(torch.float32)
    v = torch.cat([v, -v, torch.tensor([1.0, -1.0])])
    for code in (Q.dynamic_map(signed=True), Q.linear_map(signed=True)):
        table = _fastpath.codebook_table(code)
        key = (v.view(torch.int32) >> 15) & 0x1FFFF
        base = table.lut[key.long()].long()
        fast = base + (v > table.mids[base]).long()
        assert torch.equal(fast, torch.bucketize(v, (code[:-1] + code[1:]) / 2))


def test_switch_and_threshold(fast_mode):
    fast_mode("ref")
    assert not Q.fastpath_enabled()
    Q.set_fastpath(True, min_numel=10**9)
    assert Q.fastpath_enabled() and not _fastpath.use_fastpath(torch.empty(10))
    assert not _fastpath.use_fastpath(torch.empty(10**6, device="meta"))
    with pytest.raises(ValueError):
        Q.set_fastpath(True, min_numel=-1)
    with pytest.raises(ValueError, match="int >= 0"):
        Q.set_fastpath(True, min_numel=2.5)
    # set_fastpath("false") left the fast path on; min_numel=True was taken as 1
    was = _fastpath.fastpath_enabled()
    for bad in ("false", "0", None, 1):
        with pytest.raises(TypeError, match="enabled must be True or False"):
            Q.set_fastpath(bad)
    with pytest.raises(ValueError, match="min_numel must be an int"):
        Q.set_fastpath(True, min_numel=True)
    assert _fastpath.fastpath_enabled() == was


def test_min_numel_environment_variable_names_itself(monkeypatch):
    """QSHARD_QUANT_FASTPATH_MIN_NUMEL=1e6 made `import qshard` fail with int()'s bare
    'invalid literal' message."""
    name = "QSHARD_QUANT_FASTPATH_MIN_NUMEL"
    for bad in ("1e6", "", "-3", "lots"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}={bad!r} must be a whole number >= 0"):
            env_int(name, 1 << 18, minimum=0)
    monkeypatch.setenv(name, " 4096 ")
    assert env_int(name, 1 << 18, minimum=0) == 4096
    monkeypatch.delenv(name)
    assert env_int(name, 1 << 18, minimum=0) == 1 << 18


def test_switch_variables_read_one_way(monkeypatch):
    # QSHARD_NO_KERNELS=0 turned the kernels off (any value did), while QSHARD_QUANT_FASTPATH=0
    # and QSHARD_DISABLE_TRITON=0 meant the opposite: every switch is now read by env_flag.
    name = "QSHARD_TEST_SWITCH"
    for raw, want in (("1", True), (" Yes ", True), ("on", True), ("0", False), ("FALSE", False)):
        monkeypatch.setenv(name, raw)
        assert env_flag(name, not want) is want
    for raw in ("", "  "):
        monkeypatch.setenv(name, raw)
        assert env_flag(name, True) is True and env_flag(name, False) is False
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match=f"{name}='maybe' must be 1 or 0"):
        env_flag(name, False)
    from qshard._native import NativeLibrary
    from qshard.optim import _kernels

    monkeypatch.setenv("QSHARD_NO_KERNELS", "0")
    base = _kernels._LIBRARY
    for raw, loads in (("0", True), ("1", False)):
        monkeypatch.setenv("QSHARD_NO_KERNELS", raw)
        lib = NativeLibrary(
            base.name,
            base.source,
            declare=base._declare,
            what=base._what,
            fallback=base._fallback,
            disable_env="QSHARD_NO_KERNELS",
            flags=base.flags,
        )
        assert (lib.get() is not None) is loads


def test_compiled_int8_matches_reference(fast_mode):
    x = with_specials(torch.randn(64 * 256 + 77), 0)
    fast_mode("ref")
    ref = Q.quantize_blockwise(x)
    ref_d = Q.dequantize_blockwise(ref)
    fast_mode("compiled")
    got = Q.quantize_blockwise(x)
    assert same(got, ref) and same(Q.dequantize_blockwise(got), ref_d)
    assert {"quant_int8", "dequant_int8"} <= set(_fastpath.compiled_kernels())


def test_a_failed_compile_runs_the_kernels_eagerly(fast_mode, monkeypatch, caplog):
    # [Note: no C++ compiler]: inductor needs g++; without one every large quantize call raised
    # InvalidCxxCompiler (qshard train died) where the docs promised a fallback.
    from torch._inductor.exc import InvalidCxxCompiler

    def no_compiler(fn, **kwargs):
        def compiled(*args):
            raise InvalidCxxCompiler()

        return compiled

    x = with_specials(torch.randn(64 * 256 + 77), 0)
    fast_mode("ref")
    ref = Q.quantize_blockwise(x)
    fast_mode("compiled")
    monkeypatch.setattr(_fastpath, "_compiled", {})
    monkeypatch.setattr(_fastpath, "_compile_failed", None)
    monkeypatch.setattr(torch, "compile", no_compiler)
    with caplog.at_level("WARNING", logger="qshard.quant"):
        got = Q.quantize_blockwise(x)
        again = Q.quantize_blockwise(x)  # no second attempt, no second warning
    assert same(got, ref) and same(again, ref)
    assert _fastpath._compile_failed and "C++ compiler" in _fastpath._compile_failed
    warned = [r for r in caplog.records if "running them eagerly" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert not _fastpath.compiled_kernels()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "block_size"),
    [(torch.float32, 256), (torch.float32, 2048), (torch.bfloat16, 256), (torch.float16, 256)],
)
def test_compiled_matrix_matches_reference(fast_mode, dtype, block_size):
    # Each (dtype, block size) compiles every kernel once: ~10 kernels x 10-30 s.
    g = torch.Generator().manual_seed(1)
    for numel in (100_003, 70_000 // block_size * block_size):
        x = with_specials((torch.randn(numel, generator=g) * 3).to(dtype), numel)
        fast_mode("ref")
        ref = all_ops(x, block_size)
        fast_mode("compiled")
        got = all_ops(x, block_size)
        for i, (a, b) in enumerate(zip(got, ref)):
            assert same(a, b), f"result {i} differs ({numel}, {block_size})"


def _assert_same_from_threads(xs, ops, reps: int, timeout_s: float) -> None:
    """``ops(x)`` from one thread per input, ``reps`` times each, equals its single-thread result."""
    expect = [ops(x) for x in xs]
    failures: list[int] = []

    def work(i: int) -> None:
        for _ in range(reps):
            if not all(same(a, b) for a, b in zip(ops(xs[i]), expect[i])):
                failures.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    assert not failures and not any(t.is_alive() for t in threads)


@pytest.mark.slow
def test_compiled_kernels_from_many_threads(fast_mode):
    fast_mode("compiled")
    xs = [torch.randn(50_000 + 256 * i) for i in range(8)]
    _assert_same_from_threads(xs, lambda x: (Q.quantize_blockwise(x, bits=4),), 5, 300)


# ---------------------------------------------------------------------------------------
# C kernels (qshard.quant._native_kernels): bit-exact with the reference on fp32 input.
# ---------------------------------------------------------------------------------------

needs_cc = pytest.mark.skipif(not _native_kernels.available(), reason="no C compiler")


def native_ops(x: torch.Tensor, block_size: int):
    """all_ops plus every output dtype of the dequantizers."""
    results = all_ops(x, block_size)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for bits in (8, 4):
            q = Q.quantize_blockwise(x, bits=bits, block_size=block_size)
            results.append(Q.dequantize_blockwise(q, dtype=dtype))
            out = torch.empty(x.numel(), dtype=dtype)
            results.append(Q.dequantize_blockwise(q, out=out))
        for code in (
            Q.dynamic_map(signed=True),
            Q.dynamic_map(signed=False, total_bits=4, max_exponent_bits=3),
        ):
            xs = x if bool(code[0] < 0) else x.abs()
            codes, absmax = Q.quantize_codebook(xs, code, block_size=block_size)
            results += [codes, absmax]
            results.append(
                Q.dequantize_codebook(codes, absmax, code, block_size=block_size, dtype=dtype)
            )
        packed = Q.pack_signs(x)
        results.append(Q.unpack_signs(packed, x.numel(), dtype=dtype))
        out = torch.full((x.numel(),), 7.0, dtype=dtype)
        assert Q.unpack_signs(packed, x.numel(), out=out) is out
        results.append(out)
    return results


def check_native(fast_mode, x: torch.Tensor, block_size: int) -> None:
    fast_mode("ref")
    ref = native_ops(x, block_size)
    fast_mode("native")
    got = native_ops(x, block_size)
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"result {i}: {a.dtype} vs {b.dtype}"
        assert same(a, b), f"result {i} differs (numel {x.numel()}, block {block_size})"


@needs_cc
@FAST
@given(
    x=float_tensors(max_numel=5000, dtypes=(torch.float32,)),
    block_size=st.sampled_from([2, 6, 8, 64, 256, 2048]),
    specials=st.booleans(),
)
def test_native_kernels_match_reference(fast_mode, x, block_size, specials):
    # Sizes 0..5000: empty, tiny, single partial block, partial last block, many blocks.
    if specials:
        x = with_specials(x, x.numel())
    check_native(fast_mode, x, block_size)


def special_blocks(block_size: int) -> torch.Tensor:
    """One block per case: ties, NaN, +-Inf, zeros, -0.0, subnormals, huge, then a partial one."""
    tiny = torch.finfo(torch.float32).tiny
    b = block_size
    blocks = []

    def block(values) -> None:
        v = torch.zeros(b)
        vals = torch.as_tensor(values, dtype=torch.float32)[:b]
        v[: vals.numel()] = vals
        blocks.append(v)

    # Exact .5 ties after scaling: absmax 127 (INT8 scale 1.0) and 7 (INT4 scale 1.0).
    block([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5])
    block([7.0, 0.5, 1.5, 2.5, 3.5, -0.5, -2.5, -3.5, 6.5, -6.5])
    # Codebook ties: x / absmax exactly on a midpoint of the dynamic map.
    code = Q.dynamic_map(signed=True)
    mids = (code[:-1] + code[1:]) / 2
    block(torch.cat([torch.ones(1), mids[torch.randperm(255)]]))
    block([1.0, float("nan"), 2.0])
    block([float("inf"), 1.0])
    block([-float("inf"), 1.0])
    block([0.0])  # all zeros
    block([-0.0, 0.0, -0.0])
    block([tiny * 0.5, -tiny * 0.25, tiny * 2**-20])  # all subnormal: scale underflows to 0
    block([tiny * 100, tiny * 0.5, -tiny * 3])  # subnormal scale
    block([3e38, -3.4028234e38, 1.0])
    block([-1.0, 1e-30, -1e-30, 5.5e-7, -5.5e-7])
    tail = torch.tensor([1.0, -2.0, 0.5, float("nan")])[: b - 1]  # partial last block
    return torch.cat([*blocks, tail])


@needs_cc
@pytest.mark.parametrize("block_size", [2, 8, 64, 256, 2048])
def test_native_special_blocks(fast_mode, block_size):
    x = special_blocks(block_size)
    check_native(fast_mode, x, block_size)
    # Partial last block without the NaN, and the 2-D quantize_blocks entry point.
    check_native(fast_mode, x[: x.numel() - 1], block_size)
    rows = x[: (x.numel() // block_size) * block_size].view(-1, block_size)
    fast_mode("ref")
    ref = [Q.quantize_blocks(rows, bits=b) for b in (8, 4)]
    fast_mode("native")
    assert all(same(Q.quantize_blocks(rows, bits=b), r) for b, r in zip((8, 4), ref))


@needs_cc
def test_native_kernels_are_used_and_switch_off(fast_mode, monkeypatch):
    # Guard against a vacuous comparison: the C entry points must actually run in 'native'
    # mode, and QSHARD_QUANT_FASTPATH=0 (set_fastpath(False)) must keep them out.
    calls: list[str] = []
    names = [
        "quantize_int",
        "dequantize_int",
        "quantize_codebook",
        "dequantize_codebook",
        "pack_signs",
        "unpack_signs",
    ]
    for name in names:
        real = getattr(_native_kernels, name)

        def spy(*args, _real=real, _name=name):
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(_native_kernels, name, spy)
    x = torch.randn(1000)
    code = Q.dynamic_map(signed=True)

    def run() -> None:
        Q.dequantize_blockwise(Q.quantize_blockwise(x, bits=4))
        Q.dequantize_codebook(*Q.quantize_codebook(x, code), code)
        Q.unpack_signs(Q.pack_signs(x), x.numel())

    fast_mode("native")
    run()
    assert sorted(set(calls)) == sorted(names)
    calls.clear()
    fast_mode("ref")
    run()
    assert calls == []
    # Non-fp32 input and stochastic rounding stay on the torch paths.
    fast_mode("native")
    Q.quantize_blockwise(x.bfloat16())
    Q.quantize_blockwise(x, rounding="stochastic")
    assert "quantize_int" not in calls


@needs_cc
def test_native_kernels_from_many_threads(fast_mode):
    # gloo's async threads quantize concurrently; ctypes drops the GIL, so the OpenMP regions
    # of several calls overlap. Results must not change.
    fast_mode("native")
    code = Q.dynamic_map(signed=True)
    xs = [torch.randn(70_000 + 256 * i) for i in range(6)]
    _assert_same_from_threads(
        xs, lambda x: (Q.quantize_blockwise(x, bits=4), Q.quantize_codebook(x, code)), 4, 120
    )


@needs_cc
def test_native_codebook_encoder_on_strided_bit_patterns(fast_mode):
    # Every 4099th fp32 bit pattern in [-1, 1] (both signs, and +-1 so the absmax is 1 and
    # x / absmax == x) through the C encoder equals bucketize on the midpoints.
    bits = torch.arange(0, 0x3F800001, 4099, dtype=torch.int32)
    v = bits.view(torch.float32)
    x = torch.cat([torch.tensor([1.0, -1.0, -0.0]), v, -v])
    fast_mode("native")
    for code in (
        Q.dynamic_map(signed=True),
        Q.dynamic_map(signed=False),
        Q.linear_map(signed=True),
        Q.linear_map(signed=True, total_bits=2),
    ):
        xs = x if bool(code[0] < 0) else x.abs()
        codes, absmax = Q.quantize_codebook(xs, code, block_size=xs.numel())
        assert absmax.tolist() == [1.0]
        expect = torch.bucketize(xs, (code[:-1] + code[1:]) / 2)
        assert torch.equal(codes.long(), expect)
