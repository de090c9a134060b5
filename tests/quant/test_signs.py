"""1-bit sign packing: layout, round trips, odd sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from qshard.quant import pack_signs, unpack_signs

from ._helpers import FAST, float_tensors


def test_layout_msb_first_and_sign_of_zero():
    x = torch.tensor([1.0, -1.0, 0.0, -0.0, -2.0, 3.0, -1.0, 1.0, -5.0, 2.0])
    packed = pack_signs(x)
    assert packed.tolist() == [0b10110101, 0b01000000]  # unused low bits are zero
    assert unpack_signs(packed, 10).tolist() == [1, -1, 1, 1, -1, 1, -1, 1, -1, 1]


@FAST
@given(x=float_tensors(max_numel=300, dtypes=(torch.float32, torch.bfloat16, torch.float16)))
def test_round_trip_equals_sign_with_zero_positive(x):
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.shape == (-(-x.numel() // 8),)
    for dtype in (torch.float32, torch.bfloat16):
        signs = unpack_signs(packed, x.numel(), dtype=dtype)
        assert signs.dtype == dtype and signs.shape == (x.numel(),)
        assert torch.equal(signs, torch.where(x < 0, -1.0, 1.0).to(dtype))


def test_any_shape_and_empty():
    x = torch.randn(3, 5, 7)
    assert torch.equal(
        unpack_signs(pack_signs(x), x.numel()).view(x.shape), torch.where(x < 0, -1.0, 1.0)
    )
    assert pack_signs(torch.empty(0)).numel() == 0
    assert unpack_signs(torch.empty(0, dtype=torch.uint8), 0).numel() == 0


def test_validation():
    with pytest.raises(ValueError, match="bytes"):
        unpack_signs(torch.zeros(2, dtype=torch.uint8), 17)
    with pytest.raises(ValueError, match="numel must be >= 0"):  # said "need ... 0 bytes"
        unpack_signs(torch.zeros(1, dtype=torch.uint8), -1)
    with pytest.raises(TypeError):
        pack_signs(torch.arange(4))
    with pytest.raises(TypeError):
        unpack_signs(torch.zeros(2, dtype=torch.int8), 16)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.int32])
def test_unpack_refuses_non_float_results(dtype):
    """-1 came back as 255 in uint8 and True in bool."""
    packed = pack_signs(torch.tensor([1.0, -1.0]))
    with pytest.raises(TypeError, match="floating point"):
        unpack_signs(packed, 2, dtype=dtype)
    with pytest.raises(TypeError, match="floating point"):
        unpack_signs(packed, 2, out=torch.empty(2, dtype=dtype))
    assert unpack_signs(packed, 2, dtype=torch.float64).tolist() == [1.0, -1.0]
