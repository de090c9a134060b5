"""Run the Triton kernels on CUDA when there is a GPU, else in Triton's CPU interpreter.

Triton decides interpreter vs. compiler when a kernel is *defined*, so TRITON_INTERPRET must be
set before `qshard._triton`'s kernel modules are first imported; this conftest is loaded
before the test modules of this folder, and those modules import kernels lazily.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device() -> torch.device:
    if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    return DEVICE
