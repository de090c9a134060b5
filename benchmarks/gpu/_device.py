"""The device a `run_all.py` section measures on, and the helpers every section shares.

``DEVICE`` is "cuda" on the GPU; the smoke run sets it to "cpu" (Triton's interpreter) in the
section's child process before any section runs. Read it as ``_device.DEVICE`` (an attribute
lookup at call time), never ``from _device import DEVICE``.
"""

from __future__ import annotations

import contextlib
import os

import _harness
from _harness import Recorder

DEVICE = "cuda"


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _ms(fn, repeat: int, warmup: int = 2) -> float:
    """`_harness.median_ms` on this run's device."""
    return _harness.median_ms(fn, repeat, DEVICE == "cuda", warmup)


def _gbs(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def _optimizer_dispatches_to_triton() -> bool:
    """AdamW8bit steps CUDA parameters through the Triton kernel (not the CPU C kernel)."""
    import inspect

    from qshard.optim import _base8bit

    return "_triton" in inspect.getsource(_base8bit)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


class _Rows(list):
    """A table's rows, written to the section's files at every append (a section stopped
    half-way keeps what it measured)."""

    def __init__(self, rec: Recorder, heading: str, header: list[str]) -> None:
        super().__init__()
        self.rec, self.heading, self.header = rec, heading, header

    def append(self, row) -> None:
        super().append(row)
        self.rec.table(self.heading, self.header, self)


@contextlib.contextmanager
def _route():
    """--smoke: CPU tensors take the CUDA dispatch (in the interpreter), as in tests/gpu."""
    if DEVICE != "cpu":
        yield
        return
    from unittest import mock

    from qshard import _triton
    from qshard.quant import _fastpath

    with (
        mock.patch.object(_triton, "serves", lambda t: True),
        mock.patch.object(_fastpath, "use_native", lambda t: False),
        mock.patch.object(_fastpath, "use_native_out", lambda t: False),
    ):
        yield


class _TorchPath:
    """References must not dispatch to the kernels they check: force qshard's torch path."""

    def __enter__(self) -> None:
        os.environ["QSHARD_DISABLE_TRITON"] = "1"

    def __exit__(self, *exc: object) -> None:
        os.environ.pop("QSHARD_DISABLE_TRITON", None)
