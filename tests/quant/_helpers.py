"""Shared strategies and settings for the qshard.quant tests."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Property tests run a bounded number of examples so tests/quant stays inside its budget.
FAST = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@st.composite
def float_tensors(draw, *, max_numel: int = 600, dtypes=DTYPES) -> torch.Tensor:
    """1-D tensors of varied length, magnitude, and dtype (finite values, zeros and ties)."""
    dtype = draw(st.sampled_from(dtypes))
    numel = draw(st.integers(0, max_numel))
    seed = draw(st.integers(0, 2**31 - 1))
    log_scale = draw(st.sampled_from([-30.0, -8.0, 0.0, 3.0, 30.0]))
    if dtype == torch.float16:
        log_scale = min(max(log_scale, -4.0), 1.0)  # stay inside fp16's range
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["normal", "outliers", "integers", "sparse"]))
    v = rng.standard_normal(numel)
    if kind == "outliers":
        v[rng.random(numel) < 0.01] *= 50.0
    elif kind == "integers":  # exact ties after scaling
        v = rng.integers(-20, 21, numel).astype(np.float64) / 2.0
    elif kind == "sparse":
        v[rng.random(numel) < 0.7] = 0.0
    return torch.from_numpy(v * 10.0**log_scale).to(torch.float32).to(dtype)


def ulp(x: torch.Tensor) -> torch.Tensor:
    """fp32 unit in the last place of |x|."""
    x = x.float().abs()
    return torch.nextafter(x, torch.full_like(x, float("inf"))) - x
