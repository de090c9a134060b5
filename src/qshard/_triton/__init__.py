"""The GPU path: Triton kernels for qshard's quantizers, qgZ's fused steps, the 8-bit optimizer
update and 1-bit sign packing, behind one small dispatch layer.

Public functions of `qshard.quant` and `qshard.optim` call into here for CUDA tensors
(`if _triton.serves(x): ...`); their torch code stays the reference these
kernels are tested against. The kernel modules import `triton` and are loaded lazily on first
use, so importing qshard never needs triton, and tests can set `TRITON_INTERPRET=1` (which Triton
reads when a kernel is defined) before any kernel exists, to run every kernel on CPU tensors.

Set `QSHARD_DISABLE_TRITON=1` to force the torch path on CUDA (debugging, A/B timing).

[Note: launch on the tensors' device] Triton launches a kernel on the *current* CUDA device and
its current stream, not on its arguments' device; ATen sets the device per op, so torch code
never notices. A tensor on another GPU than the current one (a model spread over GPUs in one
process, `device_map="auto"`, with an 8-bit optimizer) ran the kernel on the current GPU with
the other GPU's pointers. Every entry below (and `PreparedLaunch.run`) makes the tensors'
device current for the launch when it is not already.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from qshard._env import env_flag

if TYPE_CHECKING:
    import torch

__all__ = [
    "adam8bit_step",
    "available",
    "dequant_reduce",
    "dequant_reduce_requant",
    "dequant_reduce_requant_rows",
    "dequant_reduce_rows",
    "dequantize_blocks",
    "interpreter",
    "on_device_of",
    "optim4bit_step",
    "optim4bit_step_multi",
    "optim8bit_step",
    "optim8bit_step_multi",
    "pack_int4",
    "pack_signs",
    "prepare_optim4bit_multi",
    "prepare_optim8bit_multi",
    "qgz_slots",
    "quantize_blocks",
    "quantize_flat",
    "reorder_quantize",
    "reorder_quantize_rows",
    "serves",
    "unpack_int4",
    "unpack_signs",
]


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def available() -> bool:
    """True when the Triton kernels can serve CUDA tensors (triton installed, not disabled).

    Callers check `tensor.is_cuda` themselves; this says nothing about CPU tensors, which the
    kernels only accept under `TRITON_INTERPRET=1` (see `interpreter()`).
    """
    return not env_flag("QSHARD_DISABLE_TRITON", False) and _triton_importable()


def serves(t: torch.Tensor) -> bool:
    """Whether a public qshard function should hand `t` to its Triton kernel: a CUDA tensor and
    `available()`. The one predicate every dispatch hook uses, so tests can route CPU tensors
    through the kernels under TRITON_INTERPRET=1 by patching it."""
    return t.is_cuda and available()


def interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _module(name: str) -> Any:
    if not _triton_importable():
        raise ModuleNotFoundError(
            "qshard's GPU kernels need triton; install it with `pip install qshard[gpu]`"
        )
    return importlib.import_module(f"qshard._triton.{name}")


def on_device_of(values: Iterable[Any]) -> contextlib.AbstractContextManager[Any]:
    """The device guard of a launch ([Note: launch on the tensors' device]): the first tensor
    among ``values`` (or the first of a list of tensors) names the launch's device (the kernels
    check that all share it); a CUDA one that is not current is made current."""
    import torch

    for v in values:
        if isinstance(v, (list, tuple)) and v:
            v = v[0]
        if isinstance(v, torch.Tensor):
            if v.is_cuda and v.get_device() != torch.cuda.current_device():
                return torch.cuda.device(v.device)
            break
    return contextlib.nullcontext()


def _launch(module: str, fn: str, *args: Any, **kwargs: Any) -> Any:
    with on_device_of(itertools.chain(args, kwargs.values())):
        return getattr(_module(module), fn)(*args, **kwargs)


def quantize_blocks(x2d: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `qshard.quant.blockwise.quantize_blocks` (plus `pack=` for fused INT4)."""
    return _launch("_blockwise", "quantize_blocks", x2d, **kwargs)


def quantize_flat(x: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a flat tensor of any numel without materialising the padding."""
    return _launch("_blockwise", "quantize_flat", x, **kwargs)


def dequantize_blocks(codes2d: torch.Tensor, scales: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Triton twin of `qshard.quant.blockwise.dequantize_blocks` (int8 or packed INT4 codes)."""
    return _launch("_blockwise", "dequantize_blocks", codes2d, scales, **kwargs)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Triton twin of `qshard.quant.blockwise.pack_int4`."""
    return _launch("_blockwise", "pack_int4", codes)


def unpack_int4(packed: torch.Tensor, numel: int | None = None) -> torch.Tensor:
    """Triton twin of `qshard.quant.blockwise.unpack_int4`."""
    return _launch("_blockwise", "unpack_int4", packed, numel)


def reorder_quantize(x: torch.Tensor, offsets: torch.Tensor, **kwargs: Any) -> Any:
    """qgZ's first step: gather slots at `offsets` and block-quantize them in one pass."""
    return _launch("_qgz", "reorder_quantize", x, offsets, **kwargs)


def reorder_quantize_rows(
    x: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """qgZ's first hop: `reorder_quantize` written straight into the all-to-all's wire rows."""
    return _launch("_qgz", "reorder_quantize_rows", x, offsets, lengths, **kwargs)


def qgz_slots(**kwargs: Any) -> Any:
    """(offsets, lengths, slot_numel) of qgZ's send slots (eq. 2 order, pipelined, padded)."""
    return _module("_qgz").qgz_slots(**kwargs)


def dequant_reduce_requant(codes: torch.Tensor, scales: torch.Tensor, **kwargs: Any) -> Any:
    """qgZ's middle hop: dequantize K peers' blocks, sum in fp32, requantize, in one pass."""
    return _launch("_qgz", "dequant_reduce_requant", codes, scales, **kwargs)


def dequant_reduce_requant_rows(recv: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """qgZ's middle hop on wire rows: received rows in, the next hop's send rows out."""
    return _launch("_qgz", "dequant_reduce_requant_rows", recv, **kwargs)


def dequant_reduce(codes: torch.Tensor, scales: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """qgZ's last hop: dequantize K peers' blocks and sum them in fp32 into the output dtype."""
    return _launch("_qgz", "dequant_reduce", codes, scales, **kwargs)


def dequant_reduce_rows(recv: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """qgZ's last hop on wire rows: received rows summed (times a scale) into the output."""
    return _launch("_qgz", "dequant_reduce_rows", recv, **kwargs)


def optim8bit_step(**kwargs: Any) -> None:
    """Fused in-place 8-bit optimizer step (Adam/AdamW, momentum, RMSprop, Lion, Adagrad)."""
    return _launch("_optim8bit", "optim8bit_step", **kwargs)


def optim8bit_step_multi(**kwargs: Any) -> None:
    """Fused in-place 8-bit step of a list of tensors in one launch; see
    `_optim8bit.optim8bit_step_multi`."""
    return _launch("_optim8bit", "optim8bit_step_multi", **kwargs)


def prepare_optim8bit_multi(**kwargs: Any) -> Any:
    """The checked launch of `optim8bit_step_multi` without hyperparameters, to `run` each
    step ([Note: prepared launch] in `_common`); see `_optim8bit.prepare_optim8bit_multi`."""
    return _module("_optim8bit").prepare_optim8bit_multi(**kwargs)


def optim4bit_step(**kwargs: Any) -> None:
    """Fused in-place 4-bit Adam/AdamW step (`qshard.optim.AdamW4bit`'s CUDA path)."""
    return _launch("_optim4bit", "optim4bit_step", **kwargs)


def optim4bit_step_multi(**kwargs: Any) -> None:
    """Fused in-place 4-bit Adam/AdamW step of a list of tensors in one launch; see
    `_optim4bit.optim4bit_step_multi`."""
    return _launch("_optim4bit", "optim4bit_step_multi", **kwargs)


def prepare_optim4bit_multi(**kwargs: Any) -> Any:
    """The checked launch of `optim4bit_step_multi` without hyperparameters, to `run` each
    step ([Note: prepared launch] in `_common`); see `_optim4bit.prepare_optim4bit_multi`."""
    return _module("_optim4bit").prepare_optim4bit_multi(**kwargs)


def adam8bit_step(**kwargs: Any) -> None:
    """Fused in-place 8-bit Adam/AdamW step; see `_optim8bit.optim8bit_step`."""
    return _launch("_optim8bit", "optim8bit_step", kind="adam", **kwargs)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Triton twin of `qshard.quant.signs.pack_signs` (MSB first, sign(0) = +1)."""
    return _launch("_signs", "pack_signs", x)


def unpack_signs(packed: torch.Tensor, numel: int, **kwargs: Any) -> torch.Tensor:
    """Triton twin of `qshard.quant.signs.unpack_signs` (+1 / -1 values)."""
    return _launch("_signs", "unpack_signs", packed, numel, **kwargs)
