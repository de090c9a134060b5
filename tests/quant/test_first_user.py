"""What a first user coming from bitsandbytes / torchao ran into (each test failed before its
fix): ``out=`` buffers written behind autograd's back on the C path only, a reference path
that materialised a block far longer than the tensor, ``unpack_signs`` taking a float count,
and no ``BlockQuantized.to``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import qshard.quant as Q

MODES = ("native", "eager", "ref")


N = 1000  # several blocks of 256 and a partial one: every path has full rows and a tail
CODE = Q.dynamic_map(signed=True)


def _writers():
    """(name, write(out)) for every public function with an ``out=`` float buffer of N."""
    x = torch.randn(N, generator=torch.Generator().manual_seed(0))
    q8 = Q.quantize_blockwise(x)
    q4 = Q.quantize_blockwise(x, bits=4)
    codes, absmax = Q.quantize_codebook(x, CODE)
    signs = Q.pack_signs(x)
    rows, row_scales = Q.quantize_blocks(x.view(4, 250), bits=8)
    return [
        ("dequantize_blockwise int8", lambda out: Q.dequantize_blockwise(q8, out=out)),
        ("dequantize_blockwise int4", lambda out: Q.dequantize_blockwise(q4, out=out)),
        ("dequantize_blocks", lambda out: Q.dequantize_blocks(rows, row_scales, bits=8, out=out)),
        ("dequantize_codebook", lambda out: Q.dequantize_codebook(codes, absmax, CODE, out=out)),
        ("unpack_signs", lambda out: Q.unpack_signs(signs, N, out=out)),
    ]


WRITERS = [name for name, _ in _writers()]


def _writer(name):
    return dict(_writers())[name]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", WRITERS)
def test_out_saved_for_backward_is_seen_as_modified(fast_mode, mode, name):
    # The C kernels wrote through a pointer without bumping the version counter, so backward
    # silently used the overwritten buffer (a wrong gradient); torch's copy_ raised.
    fast_mode(mode)
    write = _writer(name)
    buf = torch.randn(N)
    w = torch.randn(N, requires_grad=True)
    loss = (w * buf).sum()  # saves buf for backward
    write(buf)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("mode", MODES)
def test_quantize_codebook_out_absmax_saved_for_backward(fast_mode, mode):
    fast_mode(mode)
    x = torch.randn(N)
    absmax = torch.ones(4)
    w = torch.randn(4, requires_grad=True)
    loss = (w * absmax).sum()
    Q.quantize_codebook(x, CODE, out=(torch.empty(N, dtype=torch.uint8), absmax))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", WRITERS)
def test_out_that_requires_grad_is_refused_alike_and_written_under_no_grad(fast_mode, mode, name):
    # Before: the C path wrote a parameter in place with grad mode on; the torch paths failed
    # with "a view of a leaf Variable that requires grad is being used in an in-place op".
    fast_mode(mode)
    write = _writer(name)
    expect = write(torch.empty(N))
    param = torch.nn.Parameter(torch.zeros(N))
    with pytest.raises(RuntimeError, match=r"requires grad.*torch\.no_grad\(\)"):
        write(param)
    assert bool((param == 0).all())
    with torch.no_grad():
        assert write(param) is param
    assert torch.equal(param.detach(), expect) and param.grad_fn is None and param.is_leaf
    assert write(param.detach()).data_ptr() == param.data_ptr()


@pytest.mark.parametrize("mode", MODES)
def test_quantize_codebook_out_absmax_that_requires_grad_is_refused(fast_mode, mode):
    fast_mode(mode)
    x = torch.randn(N)
    absmax = torch.zeros(4, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"out absmax requires grad.*no_grad"):
        Q.quantize_codebook(x, CODE, out=(torch.empty(N, dtype=torch.uint8), absmax))
    with torch.no_grad():
        Q.quantize_codebook(x, CODE, out=(torch.empty(N, dtype=torch.uint8), absmax))
    assert torch.equal(absmax.detach(), Q.quantize_codebook(x, CODE)[1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", WRITERS)
def test_inference_tensor_out_is_refused_alike_outside_inference_mode(fast_mode, mode, name):
    # Before: the C path wrote it; torch's copy_ raised "Inplace update to inference tensor".
    fast_mode(mode)
    write = _writer(name)
    with torch.inference_mode():
        out = torch.zeros(N)
    with pytest.raises(RuntimeError, match=r"inference tensor.*torch\.inference_mode\(\)"):
        write(out)
    with torch.inference_mode():
        assert write(out) is out
    assert torch.equal(out, write(torch.empty(N)))


@pytest.mark.parametrize("mode", ("native", "ref"))
def test_unpack_signs_refuses_a_non_integer_count(fast_mode, mode):
    fast_mode(mode)
    packed = Q.pack_signs(torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0, -6.0, 7.0, -8.0, -9.0]))
    for bad in (9.0, True, "9"):
        with pytest.raises(TypeError, match="numel must be an int"):
            Q.unpack_signs(packed, bad)
        with pytest.raises(TypeError, match="numel must be an int"):
            Q.unpack_signs(packed, bad, out=torch.empty(9))  # 9.0 used to pass with out=
    want = [1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0]
    for ok in (9, np.int64(9), torch.tensor(9)):
        assert Q.unpack_signs(packed, ok).tolist() == want


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_codebook_block_longer_than_the_tensor_is_not_materialised(fast_mode, dtype):
    # Codebook codes have no padding, and the C kernels take any block size; the torch paths
    # (bf16 input by default, or the fast path switched off) padded the one block to
    # block_size, so 2**40 asked the allocator for 4 TiB (2**31 got a process OOM-killed).
    x = torch.tensor([0.5, -2.0, 1e-3, 0.0, 1.5]).to(dtype)
    fast_mode("native")
    want_codes, want_absmax = Q.quantize_codebook(x.float(), CODE, block_size=64)
    want = Q.dequantize_codebook(want_codes, want_absmax, CODE, block_size=64)
    for mode in ("native", "ref"):
        fast_mode(mode)
        codes, absmax = Q.quantize_codebook(x, CODE, block_size=2**40)
        assert torch.equal(codes, want_codes) and torch.equal(absmax, want_absmax)
        got = Q.dequantize_codebook(codes, absmax, CODE, block_size=2**40)
        assert torch.equal(got, want)


def test_block_quantized_moves_with_to():
    # bitsandbytes' QuantState has .to(device); BlockQuantized had no .to at all.
    q = Q.quantize_blockwise(torch.randn(300, dtype=torch.bfloat16), bits=4, block_size=64)
    assert q.to("cpu") is q and q.to(torch.device("cpu")) is q
    m = q.to("meta")
    assert m.codes.device.type == "meta" and m.scales.device.type == "meta"
    assert (m.codes.dtype, m.scales.dtype) == (torch.uint8, torch.float32)
    assert (m.shape, m.dtype, m.numel, m.bits, m.block_size) == (
        q.shape,
        q.dtype,
        q.numel,
        q.bits,
        q.block_size,
    )
    with pytest.raises(TypeError, match="dtype= to dequantize_blockwise"):
        q.to(torch.float16)


@pytest.mark.parametrize("mode", MODES)
def test_dequantizers_ignore_grad_on_scales_and_maps_on_every_path(fast_mode, mode):
    # A block absmax / code map that required grad gave a result with a grad_fn on the torch
    # paths and a plain tensor from the C kernels (gradient reached the scales on some paths).
    fast_mode(mode)
    x = torch.randn(N)
    q = Q.quantize_blockwise(x)
    rows, row_scales = Q.quantize_blocks(x.view(4, 250), bits=8)
    codes, absmax = Q.quantize_codebook(x, CODE)
    grad_q = dataclasses.replace(q, scales=q.scales.clone().requires_grad_())
    results = [
        (Q.dequantize_blockwise(grad_q), Q.dequantize_blockwise(q)),
        (
            Q.dequantize_blocks(rows, row_scales.clone().requires_grad_(), bits=8),
            Q.dequantize_blocks(rows, row_scales, bits=8),
        ),
        (
            Q.dequantize_codebook(codes, absmax.clone().requires_grad_(), CODE),
            Q.dequantize_codebook(codes, absmax, CODE),
        ),
        (
            Q.dequantize_codebook(codes, absmax, CODE.clone().requires_grad_()),
            Q.dequantize_codebook(codes, absmax, CODE),
        ),
    ]
    for got, want in results:
        assert not got.requires_grad and got.grad_fn is None
        assert torch.equal(got, want)


def test_dequantize_codebook_out_error_says_what_it_got():
    codes, absmax = Q.quantize_codebook(torch.randn(300), CODE)
    with pytest.raises(ValueError, match=r"300 elements.*got shape \(299,\)"):
        Q.dequantize_codebook(codes, absmax, CODE, out=torch.empty(299))
    with pytest.raises(ValueError, match=r"got shape \(30, 10\) \(contiguous=False\)"):
        Q.dequantize_codebook(codes, absmax, CODE, out=torch.empty(10, 30).t())


def test_wrong_containers_get_errors_naming_the_right_call():
    # bitsandbytes-style calls used to end in "too many values to unpack" (a single tensor as
    # out=) and "'tuple' object has no attribute 'bits'".
    x = torch.randn(300)
    with pytest.raises(TypeError, match=r"out must be a \(codes, absmax\) pair"):
        Q.quantize_codebook(x, CODE, out=torch.empty(300, dtype=torch.uint8))
    with pytest.raises(TypeError, match=r"out must be a \(codes, absmax\) pair"):
        Q.quantize_codebook(x, CODE, out=(torch.empty(300, dtype=torch.uint8),))
    codes, absmax = Q.quantize_codebook(
        x, CODE, out=[torch.empty(300, dtype=torch.uint8), torch.empty(2)]
    )
    assert codes.shape == (300,) and absmax.shape == (2,)
    for bad in ((codes, absmax), codes):
        with pytest.raises(TypeError, match="use dequantize_codebook"):
            Q.dequantize_blockwise(bad)
