"""Fixtures shared by the quantization tests."""

from __future__ import annotations

import pytest

from qshard import quant as Q
from qshard.quant import _fastpath


@pytest.fixture
def fast_mode():
    """Yield a function that switches between 'ref', 'native' (C kernels), 'eager'
    (torch.compile kernel bodies run eagerly) and 'compiled'."""
    saved = (
        _fastpath._enabled,
        _fastpath._min_numel,
        _fastpath._compile_kernels,
        _fastpath._native_enabled,
    )

    def set_mode(mode: str) -> None:
        _fastpath._compile_kernels = mode == "compiled"
        _fastpath._native_enabled = mode == "native"
        Q.set_fastpath(mode != "ref", min_numel=0)

    yield set_mode
    (
        _fastpath._enabled,
        _fastpath._min_numel,
        _fastpath._compile_kernels,
        _fastpath._native_enabled,
    ) = saved
