"""The switch between the plain reference kernels and the fast CPU kernels of qshard.quant.

The fast kernels must be bit-identical to the reference ones (tests compare them); this
module only decides which one runs. ``QSHARD_QUANT_FASTPATH=0`` in the environment (read at
import) or :func:`set_fastpath(False) <set_fastpath>` forces the reference path, e.g. in
short-lived multi-rank test processes that should not pay a first-call compile.
"""

from __future__ import annotations

import os

from torch import Tensor

__all__ = ["fastpath_enabled", "set_fastpath", "use_fastpath"]

_enabled = os.environ.get("QSHARD_QUANT_FASTPATH", "1").strip().lower() not in (
    "0",
    "false",
    "off",
    "no",
)


def set_fastpath(enabled: bool) -> None:
    """Turn the fast CPU kernels on or off for this process (the reference path is always
    available and gives the same bits)."""
    global _enabled
    _enabled = bool(enabled)


def fastpath_enabled() -> bool:
    """Whether the fast CPU kernels are used (``QSHARD_QUANT_FASTPATH``, :func:`set_fastpath`)."""
    return _enabled


def use_fastpath(t: Tensor) -> bool:
    """Fast kernels exist for CPU tensors only; CUDA goes through the torch reference path."""
    return _enabled and t.device.type == "cpu" and _available


# Set to True once the compiled kernels below exist and are verified.
_available = False


def quantize_blocks(x2d: Tensor, qmax: int):  # pragma: no cover - replaced by fast kernels
    raise NotImplementedError


def dequantize_blocks(codes2d: Tensor, scales: Tensor, dtype):  # pragma: no cover
    raise NotImplementedError
