"""The optimizer kernels' one-gather encoder (`table_code` of `qshard._triton._common`, the C
kernels' `NEAREST_C` rule over `qshard.quant._codetable`'s table) vs `torch.searchsorted`: the
number of midpoints strictly below x, NaN -> 0, for every map the 8- and 4-bit optimizers use,
on both edges of every table bucket and around every midpoint. The same for the 8-bit kernel's
gather-free `region_code` ([Note: the region encoder]) on [-1, 1], where the lanes it flags
near a midpoint take the table's code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="the GPU kernels need triton (pip install qshard[gpu])")

import triton
import triton.language as tl

from qshard._triton._common import region_code, table_code
from qshard.optim import _qstate4
from qshard.optim._qstate import qmap
from tests.gpu.conftest import DEVICE


@triton.jit
def _search_kernel(x_ptr, out_ptr, lut_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, table_code(x, lut_ptr), mask=ok)


@triton.jit
def _region_kernel(x_ptr, out_ptr, reg_ptr, lut_ptr, n, SIGNED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, region_code(x, reg_ptr, lut_ptr, SIGNED), mask=ok)


def _points(mid: torch.Tensor) -> torch.Tensor:
    """Both edges of every bucket (top 16 bits of |x|), one ulp either side, both signs; every
    midpoint and its fp32 neighbours; zeros, ones, tiny values, NaN; random values in [-1, 1]."""
    tops = np.arange(0, 0x4000, dtype=np.int64) << 16
    bits = np.concatenate([tops, tops - 1, tops + 1]).clip(0, 0x7F7FFFFF)
    edges = bits.astype(np.int32).view(np.float32)
    m = mid.numpy()
    near = np.concatenate([m, np.nextafter(m, -2), np.nextafter(m, 2)]).astype(np.float32)
    special = np.array([np.nan, 0.0, 1.0, 1.5, 2.0**-40, 1e-7, 3e-7], np.float32)
    rand = np.random.default_rng(0).uniform(-1, 1, 20000).astype(np.float32)
    pos = np.concatenate([edges, special])
    return torch.from_numpy(np.concatenate([pos, -pos, near, rand]))


def _maps():
    maps = {"8-bit signed": qmap(True), "8-bit unsigned": qmap(False)}
    for name in ("signed-dynamic", *_qstate4.SECOND_MOMENT_MAPS):
        maps[f"4-bit {name}"] = _qstate4.qmap4(name)
    return maps


@pytest.mark.parametrize("name", list(_maps()))
def test_table_code_equals_searchsorted(name):
    q = _maps()[name]
    mid = q.mid[: q.code.numel() - 1].contiguous()
    x = _points(mid)
    out = torch.empty(x.numel(), dtype=torch.int32, device=DEVICE)
    _search_kernel[(triton.cdiv(x.numel(), 1024),)](
        x.to(DEVICE), out, q.lut.to(DEVICE), x.numel(), BLOCK=1024
    )
    got = out.cpu()
    want = torch.searchsorted(mid, x, side="left").to(torch.int32)
    want = torch.where(x.isnan(), 0, want)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(x[i]), int(got[i]), int(want[i])) for i in bad[:5]]


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_region_code_equals_searchsorted(signed):
    """On [-1, 1] (the encoder's domain: a state over its block's absmax), including every
    midpoint and its fp32 neighbours, where the line alone would be wrong and the flagged lanes
    must take the table's code; and the binade edges, where the region changes."""
    q = qmap(signed)
    x = _points(q.mid)
    x = x[(x.abs() <= 1.0) & ~x.isnan()]
    assert x.numel() > 40000
    out = torch.empty(x.numel(), dtype=torch.int32, device=DEVICE)
    _region_kernel[(triton.cdiv(x.numel(), 1024),)](
        x.to(DEVICE), out, q.regions.to(DEVICE), q.lut.to(DEVICE), x.numel(), signed, BLOCK=1024
    )
    got = out.cpu()
    want = torch.searchsorted(q.mid, x, side="left").to(torch.int32)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(x[i]), int(got[i]), int(want[i])) for i in bad[:5]]
