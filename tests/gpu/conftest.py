"""Run the Triton kernels on CUDA when there is a GPU, else in Triton's CPU interpreter.

Triton decides interpreter vs. compiler when a kernel is *defined*, so TRITON_INTERPRET must be
set before `qshard._triton`'s kernel modules are first imported; this conftest is loaded
before the test modules of this folder, and those modules import kernels lazily.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def interpreter_checks(*tensors: torch.Tensor, first_program: int = 0):
    """Interpreter only: every load and store a kernel makes while this is active must address
    bytes of `tensors` (an out-of-bounds access fails the test, where it would read garbage or
    crash the process), and program ids along axis 0 start at `first_program`.

    The offset runs a kernel's last program of a grid too large to interpret (2**31 elements
    and more): launch it with grid (1,) and `first_program` = the real grid's size - 1, on
    tensors of the real size (allocated, but only the pages that program touches are used).
    That checks what the interpreter cannot reach otherwise: int32 index arithmetic.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    needed = ("_get_np_dtype", "TensorHandle")
    if builder is None or not all(hasattr(interpreter, n) for n in needed):
        pytest.skip("this Triton's interpreter lacks the internals these checks patch (3.9's)")
    ranges = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]

    def check(ptrs, mask, what):
        size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        addr = ptrs.data.astype(np.uint64)[mask.data.astype(bool)]
        inside = np.zeros(addr.shape, dtype=bool)
        for lo, hi in ranges:
            inside |= (addr >= lo) & (addr + size <= hi)
        if not inside.all():
            bad = int(addr[~inside][0])
            raise AssertionError(f"{what} out of bounds at {bad:#x}; tensors at {ranges}")

    def load(ptrs, mask, *args):
        check(ptrs, mask, "load")
        return original["create_masked_load"](ptrs, mask, *args)

    def store(ptrs, value, mask, *args):
        check(ptrs, mask, "store")
        return original["create_masked_store"](ptrs, value, mask, *args)

    def program_id(axis):
        offset = first_program if axis == 0 else 0
        return interpreter.TensorHandle(
            np.array([builder.grid_idx[axis] + offset], dtype=np.int32), tl.int32
        )

    patches = {
        "create_masked_load": load,
        "create_masked_store": store,
        "create_get_program_id": program_id,
    }
    original = {name: getattr(builder, name) for name in patches}
    for name, fn in patches.items():
        setattr(builder, name, fn)
    try:
        yield
    finally:
        for name in patches:
            delattr(builder, name)  # the class's methods again


def huge(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor of 2**31 elements or more, for `interpreter_checks`'
    last-program runs: only the pages a kernel touches are ever backed by memory. Skips where
    the interpreter is not in use or the address space cannot be reserved."""
    if DEVICE.type != "cpu" or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs one program of a huge grid in Triton's interpreter")
    try:
        return torch.empty(numel, dtype=dtype)
    except (RuntimeError, MemoryError) as e:  # a strict overcommit policy refuses it
        pytest.skip(f"cannot reserve {numel} {dtype} elements: {e}")


def spy_launches(monkeypatch, module, name: str) -> list[tuple[tuple, tuple, dict]]:
    """Record every launch of the Triton kernel `module.<name>` (grid, arguments, keyword
    arguments: constexprs and options), then launch it. Patch before the code under test reads
    the kernel (a prepared launch keeps the kernel it was built with)."""
    launches: list[tuple[tuple, tuple, dict]] = []
    kernel = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, args, kwargs))
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(module, name, Spy())
    return launches
