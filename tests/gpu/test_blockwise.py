"""Block INT8/INT4 kernels vs `qshard.quant.blockwise`'s plain torch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="the GPU kernels need triton (pip install qshard[gpu])")

from qshard import _triton
from qshard.quant import blockwise as ref
from tests.gpu.conftest import DEVICE, huge, interpreter_checks

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


def _reference(x2d: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The plain definition (not the CPU fast path), so the kernel is held to the spec itself.
    return ref._quantize_blocks_reference(x2d.cpu(), ref.qmax_for_bits(bits), "nearest", None)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality that treats NaN == NaN (non-finite blocks dequantize to NaN)."""
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:
        return (
            a.shape == b.shape
            and torch.equal(torch.isnan(a), torch.isnan(b))
            and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
        )
    return torch.equal(a, b)


def _awkward(n_blocks: int, block_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian blocks plus the cases that break quantizers: zeros, ties, NaN/Inf, outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_blocks, block_size, generator=g) * torch.rand(n_blocks, 1, generator=g) * 10
    if n_blocks > 1:
        x[1] = 0.0
    if n_blocks > 2:
        # Values on exact half-steps of the scale: rounding ties must go to even.
        x[2] = (torch.arange(block_size) - block_size / 2 + 0.5) * (127.0 / (block_size / 2))
    if n_blocks > 3:
        x[3, block_size // 2] = float("nan")
    if n_blocks > 4:
        x[4, 0] = float("-inf")
    if n_blocks > 5:
        x[5, -1] = 1e4  # one outlier sets the scale of its block only
    if n_blocks > 6:
        x[6] = 1e-40  # subnormal block
    return x.to(dtype)


@SETTINGS
@given(
    n_blocks=st.integers(1, 9),
    block_size=st.sampled_from([2, 6, 64, 100, 256]),
    bits=st.sampled_from([8, 4]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_quantize_dequantize_match_reference(n_blocks, block_size, bits, dtype, seed):
    x = _awkward(n_blocks, block_size, dtype, seed)
    codes, scales = _triton.quantize_blocks(x.to(DEVICE), bits=bits)
    want_codes, want_scales = _reference(x, bits)
    assert _same(codes, want_codes)
    assert _same(scales, want_scales)
    for out_dtype in DTYPES:
        got = _triton.dequantize_blocks(codes, scales, bits=bits, dtype=out_dtype)
        want = ref.dequantize_blocks(want_codes, want_scales, bits=bits, dtype=out_dtype)
        assert _same(got, want), out_dtype
    if bits == 4:
        # Fused quantize + pack gives exactly the reference's separate pack_int4.
        packed, packed_scales = _triton.quantize_blocks(x.to(DEVICE), bits=4, pack=True)
        assert _same(packed.view(-1), ref.pack_int4(want_codes))
        assert _same(packed_scales, want_scales)
        got = _triton.dequantize_blocks(packed, packed_scales, block_size=block_size)
        assert _same(got, ref.dequantize_blocks(want_codes, want_scales, bits=4))


@SETTINGS
@given(
    numel=st.integers(0, 700),
    block_size=st.sampled_from([4, 64, 256]),
    bits=st.sampled_from([8, 4]),
    dtype=st.sampled_from(DTYPES),
)
def test_flat_matches_quantize_blockwise(numel, block_size, bits, dtype):
    """Any numel: the partial last block is masked in-kernel, never materialised as padding."""
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(dtype)
    q = ref.quantize_blockwise(x, bits=bits, block_size=block_size)
    codes, scales = _triton.quantize_flat(
        x.to(DEVICE), block_size=block_size, bits=bits, pack=bits == 4
    )
    assert _same(codes.view(-1), q.codes)
    assert _same(scales, q.scales)
    out = torch.full((numel,), 7.0, dtype=dtype, device=DEVICE)
    got = _triton.dequantize_blocks(
        codes, scales, bits=bits, block_size=block_size, numel=numel, out=out
    )
    assert got is out
    assert _same(out, ref.dequantize_blockwise(q))


def test_absmax_round_trips_and_error_bound(device):
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0), device="cpu") * 5
    # Mantissas where the old absmax / qmax scale came back one ulp off (blockwise.py).
    x[:, 0] = 1.0 + torch.arange(64) * 2.0**-23 * 131071
    for bits, qmax in ((8, 127), (4, 7)):
        codes, absmax = _triton.quantize_blocks(x.to(device), bits=bits)
        y = _triton.dequantize_blocks(codes, absmax, bits=bits).cpu()
        assert torch.equal(absmax.cpu(), x.abs().amax(1))
        assert torch.equal(y.abs().amax(1), absmax.cpu())  # the block maximum, exactly
        err = (y - x).abs()
        # Half a quantization step (absmax / qmax) per element, plus fp32 rounding.
        assert bool((err <= absmax.cpu()[:, None] / qmax * 0.5 * (1 + 1e-5)).all())
        assert int(codes.abs().max()) == qmax


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 1001])
def test_pack_unpack_int4_match_reference(device, numel):
    codes = torch.randint(
        -8, 8, (numel,), dtype=torch.int8, generator=torch.Generator().manual_seed(1)
    )
    packed = _triton.pack_int4(codes.to(device))
    assert packed.numel() == -(-numel // 2)
    if numel % 2 == 0:
        assert _same(packed, ref.pack_int4(codes))
        assert _same(_triton.unpack_int4(packed), ref.unpack_int4(ref.pack_int4(codes)))
    assert _same(_triton.unpack_int4(packed, numel), codes)


def test_stochastic_rounding_is_unbiased_and_reproducible(device):
    # Every element sits at 0.3 of a step above a code: it must round to that code or the
    # next, up with probability 0.3.
    x = torch.full((64, 256), 0.3 * (10.0 / 127))
    x[:, 0] = 10.0  # absmax 10: one step is 10 / 127
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    c1, s1 = _triton.quantize_blocks(x.to(device), bits=8, rounding="stochastic", generator=g1)
    c2, _ = _triton.quantize_blocks(x.to(device), bits=8, rounding="stochastic", generator=g2)
    assert torch.equal(c1, c2)
    body = c1[:, 1:].cpu().float()
    assert set(body.unique().tolist()) <= {0.0, 1.0}
    # 16320 Bernoulli(0.3) draws: the mean is within 5 standard deviations (0.018) of 0.3.
    assert abs(body.mean().item() - 0.3) < 0.018
    assert int(c1[0, 0]) == 127 and _same(s1, torch.full((64,), 10.0))


def test_rejects_bad_arguments(device):
    x = torch.zeros(2, 8, device=device)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        _triton.quantize_blocks(x, bits=3)
    with pytest.raises(ValueError, match="rounding"):
        _triton.quantize_blocks(x, bits=8, rounding="up")
    with pytest.raises(ValueError, match="pack needs bits=4"):
        _triton.quantize_blocks(x, bits=8, pack=True)
    with pytest.raises(ValueError, match="block_size"):
        _triton.dequantize_blocks(
            torch.zeros(2, 4, dtype=torch.uint8, device=device), torch.zeros(2, device=device)
        )
    with pytest.raises(ValueError, match="need bits=8 or bits=4"):
        _triton.dequantize_blocks(
            torch.zeros(2, 4, dtype=torch.int8, device=device), torch.zeros(2, device=device)
        )
    with pytest.raises(ValueError, match="contiguous"):
        _triton.quantize_flat(torch.zeros(8, 8, device=device).t(), block_size=8, bits=8)
    codes, scales = _triton.quantize_blocks(x, bits=8)
    # More elements than the blocks hold: the tail was left as torch.empty's garbage.
    with pytest.raises(ValueError, match=r"numel=17 must be in 0\.\.16"):
        _triton.dequantize_blocks(codes, scales, bits=8, numel=17)
    # Integer outputs truncated the values without a word (the public API refuses them).
    with pytest.raises(TypeError, match="floating point"):
        _triton.dequantize_blocks(codes, scales, bits=8, dtype=torch.int32)
    with pytest.raises(TypeError, match="floating point"):
        _triton.dequantize_blocks(
            codes, scales, bits=8, out=torch.empty(16, dtype=torch.int8, device=device)
        )
    with pytest.raises(ValueError, match="2-D int8 codes"):
        _triton.dequantize_blocks(codes.view(-1), scales, bits=8)
    with pytest.raises(ValueError, match="2-D int8 codes"):
        _triton.dequantize_blocks(codes.to(torch.int32), scales, bits=8)
    with pytest.raises(TypeError, match="int8 codes"):
        _triton.pack_int4(torch.ones(4, device=device))  # 1.0 was packed as code 1
    with pytest.raises(ValueError, match=r"numel=-1 must be in 0\.\.2"):
        _triton.unpack_int4(torch.zeros(1, dtype=torch.uint8, device=device), -1)


def test_quantize_into_preallocated_out(device):
    x = torch.randn(3, 64, device=device)
    codes = torch.empty(3 * 32, dtype=torch.uint8, device=device)
    scales = torch.empty(3, device=device)
    got = _triton.quantize_blocks(x, bits=4, pack=True, out=(codes, scales))
    assert got[0] is codes and got[1] is scales
    want_codes, want_scales = _reference(x.cpu(), 4)
    assert _same(codes, ref.pack_int4(want_codes)) and _same(scales, want_scales)
    with pytest.raises(ValueError, match="out codes"):
        _triton.quantize_blocks(x, bits=8, out=(codes, scales))


def test_code_offsets_past_2_31_stay_in_bounds():
    """[Note: int64 code offsets]: a tensor of more than 2**31 INT8 codes (an 8 GB fp32 input
    fits an H200) has block code offsets `row * block_size` past int32. Run each kernel's last
    program on tensors of the real size: every access stays inside its tensor and the tail
    equals the reference. In int32 they wrapped 2 GB before the buffer (quantize's codes store,
    dequantize's codes load, pack/unpack_int4's `2 * j`; unpack's masks let it through)."""
    from qshard._triton import _blockwise as kb

    bs, tail = 256, 3000  # a partial last block: 12 blocks of the last program's 16 are real
    numel = 2**31 + tail
    n_blocks = -(-numel // bs)
    block_n, rows, warps = kb._geometry(bs)
    last = -(-n_blocks // rows) - 1
    first = last * rows  # the last program's first block; first * bs = 2**31
    x, codes = huge(numel, torch.float16), huge(n_blocks * bs, torch.int8)
    scales = torch.empty(n_blocks, dtype=torch.float32)  # 32 MB, never touched in full
    src = (torch.randn(numel - first * bs, generator=torch.Generator().manual_seed(0)) * 4).half()
    src[5] = float("nan")
    x[first * bs :] = src
    with interpreter_checks(x, codes, scales, first_program=last):
        kb._quantize_kernel[(1,)](
            x, codes, scales, n_blocks, numel, 0,
            BS=bs, BLOCK_N=block_n, ROWS=rows, QMAX=127, PACK=False, STOCHASTIC=False,
            BF16=False, num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
    q = ref.quantize_blockwise(src, bits=8, block_size=bs)
    assert _same(codes[first * bs :], q.codes) and _same(scales[first:], q.scales)
    x[first * bs :] = 0.0
    with interpreter_checks(codes, scales, x, first_program=last):
        kb._dequantize_kernel[(1,)](
            codes, scales, x, n_blocks, numel,
            BS=bs, BLOCK_N=block_n, ROWS=rows, PACK=False, QMAX=127,
            num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
    assert _same(x[first * bs :], ref.dequantize_blockwise(q))
    del x, codes

    numel = 2**31 + 2  # INT4 codes, two a byte: the last program's `2 * j` is 2**31
    codes, packed = huge(numel, torch.int8), huge(numel // 2, torch.uint8)
    block = kb._ELEMWISE_BLOCK
    last = -(-(numel // 2) // block) - 1
    start = last * block
    want = torch.randint(-8, 8, (numel - 2 * start,), dtype=torch.int8)
    codes[2 * start :] = want
    with interpreter_checks(codes, packed, first_program=last):
        kb._pack_int4_kernel[(1,)](
            codes, packed, numel // 2, numel, BLOCK=block, num_warps=4, enable_fp_fusion=False
        )
    assert _same(packed[start:], ref.pack_int4(want))
    codes[2 * start :] = 0
    with interpreter_checks(packed, codes, first_program=last):
        kb._unpack_int4_kernel[(1,)](
            packed, codes, numel, BLOCK=block, num_warps=4, enable_fp_fusion=False
        )
    assert _same(codes[2 * start :], want)


def test_stochastic_seed_is_drawn_on_the_generators_device(monkeypatch):
    """[Note: seed on the generator's device]: for CUDA tensors callers pass a CUDA generator
    (the torch path's `torch.rand(..., device=x.device, generator=g)` needs one), and the
    kernel's seed draw used to run on the CPU, which torch refuses for a CUDA generator. Without
    CUDA here, a generator reporting another device and a `torch.randint` enforcing torch's rule
    stand in for them."""
    from qshard._triton import _blockwise as kb

    class ElsewhereGenerator(torch.Generator):
        @property
        def device(self) -> torch.device:
            return torch.device("meta")

    real_randint = torch.randint

    def randint(*args, generator=None, device=None, **kwargs):
        where = torch.device("cpu") if device is None else torch.device(device)
        if generator is not None and where != generator.device:
            raise RuntimeError(
                f"Expected a '{where.type}' device type for generator but found "
                f"'{generator.device.type}'"
            )
        return real_randint(*args, generator=generator, **kwargs)  # the draw itself on the CPU

    monkeypatch.setattr(torch, "randint", randint)
    gen = ElsewhereGenerator().manual_seed(3)
    first = kb._seed("stochastic", gen)
    assert first == kb._seed("stochastic", ElsewhereGenerator().manual_seed(3))
    assert 0 <= first < 2**31 - 1
    kb._seed("stochastic", torch.Generator().manual_seed(3))  # CPU generators as before
    kb._seed("stochastic", None)
