"""Dynamic / linear code maps (value for value vs bitsandbytes) and codebook quantization."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qshard.quant import dequantize_codebook, dynamic_map, linear_map, quantize_codebook

from ._helpers import FAST, float_tensors

# Frozen from bitsandbytes 0.50.2 `create_dynamic_map` (identical to dynamic_map, checked
# entry by entry below when bitsandbytes is importable): sha256 of the 256 fp32 values.
SIGNED_SHA256 = "e732639a65f497b4ad684bb166a4467708255edd5207757de8b8f0c7e1fda89c"
UNSIGNED_SHA256 = "305f002cc11278fb769d13b25b9fd0c7c83c8402c40a878fe086f4039fde6398"
SIGNED_ANCHORS = {
    0: "-0x1.fc66660000000p-1",
    1: "-0x1.f533340000000p-1",
    126: "-0x1.27476e0000000p-21",
    127: "0x0.0p+0",
    128: "0x1.27476e0000000p-21",
    129: "0x1.b435280000000p-19",
    200: "0x1.de66660000000p-3",
    254: "0x1.fc66660000000p-1",
    255: "0x1.0000000000000p+0",
}
UNSIGNED_ANCHORS = {
    0: "0x0.0p+0",
    1: "0x1.5cf7540000000p-22",
    126: "0x1.96b8520000000p-4",
    127: "0x1.a800000000000p-4",
    128: "0x1.c4cccc0000000p-4",
    200: "0x1.3bcccc0000000p-1",
    254: "0x1.fe33340000000p-1",
    255: "0x1.0000000000000p+0",
}


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def test_dynamic_maps_are_frozen():
    signed, unsigned = dynamic_map(signed=True), dynamic_map(signed=False)
    for m in (signed, unsigned):
        assert m.dtype == torch.float32 and m.shape == (256,)
        assert bool((m[1:] >= m[:-1]).all())
    assert {i: signed[i].item().hex() for i in SIGNED_ANCHORS} == SIGNED_ANCHORS
    assert {i: unsigned[i].item().hex() for i in UNSIGNED_ANCHORS} == UNSIGNED_ANCHORS
    assert sha(signed) == SIGNED_SHA256 and sha(unsigned) == UNSIGNED_SHA256
    assert (signed == 0).sum() == 1 and -1.0 not in signed.tolist()
    assert signed[128].item() == pytest.approx(5.5e-7) and unsigned[1].item() == pytest.approx(
        3.25e-7
    )


def test_only_the_fp32_recipe_reproduces_the_table():
    # The same recipe in float64 (then rounded to fp32) differs in the last bit somewhere.
    values = []
    for i in range(7):
        b = np.linspace(0.1, 1.0, 2**i + 1)
        m = (b[:-1] + b[1:]) / 2 * 10.0 ** (i - 6)
        values += [m, -m]
    f64 = np.sort(np.concatenate([*values, [0.0, 1.0]])).astype(np.float32)
    assert not np.array_equal(f64, dynamic_map(signed=True).numpy())
    np.testing.assert_allclose(f64, dynamic_map(signed=True).numpy(), rtol=1e-6)


@pytest.mark.slow  # importing bitsandbytes takes ~25 s; the frozen hashes above cover CI
def test_matches_bitsandbytes_value_for_value():
    bnb = pytest.importorskip("bitsandbytes.functional")
    for signed in (True, False):
        assert torch.equal(dynamic_map(signed=signed), bnb.create_dynamic_map(signed=signed))
        ref = torch.sort(bnb.create_linear_map(signed=signed)).values
        assert torch.equal(linear_map(signed=signed), ref)
    for bits in range(2, 8):
        ref = bnb.create_dynamic_map(signed=True, total_bits=bits, max_exponent_bits=bits - 1)
        ours = dynamic_map(signed=True, total_bits=bits, max_exponent_bits=bits - 1)
        # bitsandbytes pads few-bit maps with zeros to 256 entries; we do not.
        assert torch.equal(torch.sort(ref[ref != 0]).values, ours[ours != 0])


@pytest.mark.parametrize("bits", range(2, 9))
def test_few_bit_maps(bits):
    for signed in (True, False):
        for m in (
            dynamic_map(signed=signed, total_bits=bits, max_exponent_bits=bits - 1),
            linear_map(signed=signed, total_bits=bits),
        ):
            assert m.shape == (2**bits,) and bool((m[1:] >= m[:-1]).all())
            assert m[-1].item() == 1.0 and 0.0 in m.tolist()
            assert m[0].item() >= -1.0
    if bits >= 3:
        m = dynamic_map(signed=True, total_bits=bits, max_exponent_bits=bits - 2)
        assert m.shape == (2**bits,) and len(set(m.tolist())) == 2**bits


def test_map_validation():
    with pytest.raises(ValueError, match="max_exponent_bits=3"):
        dynamic_map(signed=True, total_bits=4)
    with pytest.raises(ValueError, match="unsigned"):
        dynamic_map(signed=False, total_bits=8, max_exponent_bits=5)
    with pytest.raises(ValueError, match="total_bits"):
        linear_map(signed=True, total_bits=9)
    with pytest.raises(ValueError, match="sorted"):
        quantize_codebook(torch.ones(4), torch.tensor([1.0, 0.0]))


def brute_force_nearest(v: np.ndarray, code: np.ndarray) -> np.ndarray:
    """Index of the nearest code by distance to the fp32 midpoints; ties to the lower code."""
    mids = ((code[:-1] + code[1:]) / np.float32(2)).astype(np.float32)
    return (v[:, None] > mids[None, :]).sum(axis=1)


MAPS = {
    "dynamic_signed": dynamic_map(signed=True),
    "dynamic_unsigned": dynamic_map(signed=False),
    "linear_signed": linear_map(signed=True),
    "dynamic4": dynamic_map(signed=True, total_bits=4, max_exponent_bits=3),
}


@FAST
@given(
    x=float_tensors(max_numel=700),
    name=st.sampled_from(sorted(MAPS)),
    block_size=st.sampled_from([1, 7, 64, 256, 2048]),
)
def test_nearest_code_is_exact(x, name, block_size):
    code = MAPS[name]
    if "unsigned" in name:
        x = x.abs()
    codes, absmax = quantize_codebook(x, code, block_size=block_size)
    assert codes.dtype == torch.uint8 and codes.shape == (x.numel(),)
    assert absmax.shape == (-(-x.numel() // block_size),)
    xf = x.float().numpy()
    pad = (-xf.size) % block_size
    blocks = np.concatenate([xf, np.zeros(pad, np.float32)]).reshape(-1, block_size)
    ref_absmax = np.abs(blocks).max(axis=1) if blocks.size else np.zeros(0, np.float32)
    np.testing.assert_array_equal(absmax.numpy(), ref_absmax)
    with np.errstate(invalid="ignore", divide="ignore"):
        v = blocks / np.where(ref_absmax > 0, ref_absmax, 1)[:, None]
    expect = brute_force_nearest(v.reshape(-1)[: x.numel()].astype(np.float32), code.numpy())
    np.testing.assert_array_equal(codes.numpy(), expect)

    # Error bound: half the gap to the neighbouring code, times the block's absmax, plus the
    # fp32 rounding of normalising and of ``code * absmax`` (a few ulps of absmax): an element
    # exactly on a midpoint is half a gap away before rounding.
    d = dequantize_codebook(codes, absmax, code, block_size=block_size)
    c = code.numpy()
    gaps = np.maximum(np.diff(c, prepend=c[0]), np.diff(c, append=c[-1]))
    per_elem = np.repeat(ref_absmax, block_size)[: x.numel()]
    lower_gap = c[0] + 1.0 if "signed" in name and c[0] > -1 else 0.0  # -1 is not a code
    eps = float(np.finfo(np.float32).eps)
    bound = (gaps[codes.numpy()] / 2 + lower_gap + 4 * eps) * per_elem + 1e-30
    assert bool((np.abs(d.numpy() - xf) <= bound).all())


@pytest.mark.parametrize("name", sorted(MAPS))
def test_code_values_round_trip_exactly(name):
    code = MAPS[name]
    codes, absmax = quantize_codebook(code, code, block_size=code.numel())
    assert absmax.item() == 1.0
    assert torch.equal(code[codes.long()], code)
    d = dequantize_codebook(codes, absmax, code, block_size=code.numel())
    assert torch.equal(d, code)


def test_special_blocks_and_chunk_invariance():
    code = dynamic_map(signed=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g)
    x[256:512] = 0
    x[520] = float("nan")
    x[999] = float("inf")
    codes, absmax = quantize_codebook(x, code, block_size=256)
    d = dequantize_codebook(codes, absmax, code, block_size=256, shape=(10, 100))
    d = d.reshape(-1)
    assert torch.equal(d[256:512], torch.zeros(256))
    assert bool(d[512:768].isnan().all()) and bool(d[768:].isnan().all())
    part_codes, part_absmax = quantize_codebook(x[:256], code, block_size=256)
    assert torch.equal(part_codes, codes[:256]) and torch.equal(part_absmax, absmax[:1])


def test_dequantize_out_dtype_shape():
    code = dynamic_map(signed=True)
    x = torch.randn(3, 100, dtype=torch.bfloat16)
    codes, absmax = quantize_codebook(x, code, block_size=64)
    a = dequantize_codebook(codes, absmax, code, block_size=64, shape=x.shape, dtype=x.dtype)
    assert a.shape == x.shape and a.dtype == torch.bfloat16
    out = torch.empty(300, dtype=torch.float16)
    assert dequantize_codebook(codes, absmax, code, block_size=64, out=out) is out
    with pytest.raises(ValueError, match="absmax"):
        dequantize_codebook(codes, absmax[:-1], code, block_size=64)


def test_stochastic_rounding_picks_neighbours_without_bias():
    code = dynamic_map(signed=True)
    x = torch.linspace(-0.9, 0.9, 256).repeat(400)
    x[::256] = 1.0  # absmax of every block is 1
    g = torch.Generator().manual_seed(1)
    codes, absmax = quantize_codebook(x, code, block_size=256, rounding="stochastic", generator=g)
    d = dequantize_codebook(codes, absmax, code, block_size=256).view(400, 256)
    lo = torch.searchsorted(code, x[:256], right=True) - 1
    hi = (lo + 1).clamp(max=255)
    c = codes.view(400, 256).long()
    assert bool(((c == lo) | (c == hi)).all())
    gap = (code[hi] - code[lo]).max().item()
    assert (d.mean(0) - x[:256]).abs().max().item() < 5 * gap / (2 * 400**0.5)


def test_code_map_and_codes_are_checked():
    """A NaN in the map passed the sort check and quantized to garbage; codes past a short
    map made the C dequantizer read past the map; integer results truncated silently."""
    x = torch.randn(300)
    with pytest.raises(ValueError, match="finite"):
        quantize_codebook(x, torch.tensor([-1.0, float("nan"), 1.0]))
    with pytest.raises(ValueError, match="finite"):
        dequantize_codebook(
            torch.zeros(3, dtype=torch.uint8), torch.ones(1), torch.tensor([0.0, float("inf")])
        )
    codes, absmax = quantize_codebook(x, dynamic_map(signed=True), block_size=64)
    short = dynamic_map(signed=True, total_bits=4, max_exponent_bits=3)
    with pytest.raises(ValueError, match="the map has 16 values"):
        dequantize_codebook(codes, absmax, short, block_size=64)
    codes4, absmax4 = quantize_codebook(x, short, block_size=64)
    assert dequantize_codebook(codes4, absmax4, short, block_size=64).shape == (300,)
    for dtype in (torch.int32, torch.bool):
        with pytest.raises(TypeError, match="floating point"):
            dequantize_codebook(codes, absmax, dynamic_map(signed=True), block_size=64, dtype=dtype)
        with pytest.raises(TypeError, match="floating point"):
            dequantize_codebook(
                codes,
                absmax,
                dynamic_map(signed=True),
                block_size=64,
                out=torch.empty(300, dtype=dtype),
            )


def test_quantize_codebook_is_outside_autograd():
    """On the torch paths (bf16/fp16 inputs, stochastic rounding, no C kernels) the absmax of
    a parameter came back with a grad_fn, and an out= buffer (optimizer state) was turned into
    a non-leaf that copy.deepcopy refused; the C path returned plain tensors."""
    import copy

    from qshard.quant import _fastpath, set_fastpath

    code = dynamic_map(signed=True)
    saved = _fastpath._enabled
    try:
        for enabled in (True, False):
            set_fastpath(enabled)
            for dtype in (torch.float32, torch.bfloat16):
                p = torch.nn.Parameter(torch.randn(300).to(dtype))
                for rounding in ("nearest", "stochastic"):
                    _, absmax = quantize_codebook(p, code, block_size=64, rounding=rounding)
                    assert absmax.grad_fn is None and not absmax.requires_grad
                    state = (torch.empty(300, dtype=torch.uint8), torch.zeros(5))
                    quantize_codebook(p, code, block_size=64, out=state)
                    assert state[1].is_leaf and not state[1].requires_grad
                    copy.deepcopy(state)
    finally:
        _fastpath._enabled = saved


def test_map_and_absmax_types_are_checked():
    """total_bits=8.0 failed inside torch.linspace ('invalid combination of arguments');
    integer absmax truncated every block's scale silently; block_size=True was taken as 1."""
    for bad in (8.0, True, "8"):
        with pytest.raises(ValueError, match=r"total_bits must be an int in 2\.\.8"):
            dynamic_map(signed=True, total_bits=bad)
        with pytest.raises(ValueError, match=r"total_bits must be an int in 2\.\.8"):
            linear_map(signed=True, total_bits=bad)
    with pytest.raises(ValueError, match="max_exponent_bits must be an int"):
        dynamic_map(signed=True, max_exponent_bits=7.0)
    code = dynamic_map(signed=True)
    codes, absmax = quantize_codebook(torch.rand(128) * 0.9, code, block_size=64)
    with pytest.raises(TypeError, match=r"absmax hold each block's fp32 absmax; got torch\.int64"):
        dequantize_codebook(codes, absmax.long(), code, block_size=64)
    with pytest.raises(ValueError, match="positive int; got True"):
        quantize_codebook(torch.randn(8), code, block_size=True)


def test_maps_built_inside_torch_compile_equal_the_eager_maps():
    # Inductor's linspace differs from eager's in the last bit: 42 of the signed dynamic map's
    # 256 values differed when a compiled function built it. The builders now run eagerly.
    torch._dynamo.reset()
    for build in (
        lambda: dynamic_map(signed=True),
        lambda: dynamic_map(signed=False),
        lambda: linear_map(signed=True),
        lambda: linear_map(signed=False),
    ):
        assert torch.equal(torch.compile(build)(), build())
    torch._dynamo.reset()
