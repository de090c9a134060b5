"""Sign packing kernels vs `qshard.quant.signs` (MSB first, sign(0) = +1, NaN packs as +1)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="the GPU kernels need triton (pip install qshard[gpu])")

from qshard import _triton
from qshard.quant import signs as ref
from tests.gpu.conftest import DEVICE, huge, interpreter_checks


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    numel=st.integers(0, 2100),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_pack_unpack_match_reference(numel, dtype, seed):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), float("-inf"), -1e-40, 1e-40])
    x[: min(numel, 7)] = special[: min(numel, 7)]
    x = x.to(dtype)
    packed = _triton.pack_signs(x.to(DEVICE))
    want = ref.pack_signs(x)
    assert torch.equal(packed.cpu(), want)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = _triton.unpack_signs(packed, numel, dtype=out_dtype)
        assert torch.equal(got.cpu(), ref.unpack_signs(want, numel, dtype=out_dtype))


def test_unpack_rejects_wrong_byte_count(device):
    with pytest.raises(ValueError, match="bytes"):
        _triton.unpack_signs(torch.zeros(3, dtype=torch.uint8, device=device), 8)


def test_unpack_past_2_31_signs_reads_only_its_bytes():
    """The last program of unpack_signs on 2**31 + 5 signs: its bytes past the end of `packed`
    must stay masked. With an int32 `byte * 8 < numel` the mask wrapped negative and the
    program read up to 1023 bytes past `packed` (the stores were masked, so only a fault or an
    out-of-bounds check shows it)."""
    from qshard._triton import _signs as ks

    numel = 2**31 + 5
    n_bytes = -(-numel // 8)
    packed, out = huge(n_bytes, torch.uint8), huge(numel, torch.bfloat16)
    per = ks._BYTES_PER_PROGRAM
    last = -(-n_bytes // per) - 1
    start = last * per
    x = torch.randn((n_bytes - start) * 8 - 3, generator=torch.Generator().manual_seed(0))
    packed[start:] = ref.pack_signs(x)
    with interpreter_checks(packed, out, first_program=last):
        ks._unpack_signs_kernel[(1,)](
            packed, out, numel, BYTES=per, num_warps=4, enable_fp_fusion=False
        )
    assert torch.equal(
        out[start * 8 :], ref.unpack_signs(ref.pack_signs(x), x.numel(), dtype=torch.bfloat16)
    )
