"""Where a parameter's optimizer state lives and what shape it has: the local shard of a
DTensor, a local state tensor wrapped as a DTensor like its parameter, the dtype of a
full-precision state, the row offset of a shard, and the check that refuses quantized state whose
layout no longer fits its parameter (the kernels index it by raw pointer).

Shared by the 8-bit and 4-bit optimizers (``_base8bit.py``, ``adam4bit.py``) and the
multi-tensor entries (``_multi_tensor.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from qshard.optim import _qstate

__all__ = [
    "_check_layout",
    "_contiguous_stride",
    "_full_state_dtype",
    "_global_row_offset",
    "_layout_fits",
    "_local",
    "_wrap_like",
]


def _local(t: Tensor) -> Tensor:
    """The local tensor of a DTensor, else ``t``. Without grad mode (an optimizer step) the
    DTensor's own local tensor: ``to_local()`` would return a fresh view of it for a parameter,
    ~1 us per call, several calls per tensor per step."""
    if isinstance(t, DTensor):
        return t.to_local() if torch.is_grad_enabled() else t._local_tensor
    return t


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(stride))


def _wrap_like(p: Tensor, local: Tensor, global_shape: tuple[int, ...]) -> Tensor:
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(
        local,
        p.device_mesh,
        p.placements,
        run_check=False,
        shape=torch.Size(global_shape),
        stride=_contiguous_stride(global_shape),
    )


def _check_layout(
    name: str,
    p: Tensor,
    codes: list[Tensor],
    absmax: list[Tensor],
    codes_shape: tuple[int, ...],
    block_size: int,
) -> None:
    """Refuse quantized state whose layout no longer fits ``p`` and the group's ``block_size``
    (the group option changed after the state was made, or state loaded from another shape):
    the kernels index it by raw pointer, so a mismatch wrote out of bounds."""
    for t in (*codes, *absmax):
        if t.device != p.device:
            # (the kernels read it by raw pointer: the C kernel wrote through CUDA addresses)
            raise RuntimeError(
                f"{name}: the state of a parameter of (local) shape {tuple(p.shape)} is on "
                f"{t.device} but the parameter is on {p.device} (moved, e.g. by model.to(), "
                "after the optimizer stepped?). Move the optimizer's state with it (load its "
                "state_dict() again after the move: load_state_dict puts state on each "
                "parameter's device), or build the optimizer after moving the model"
            )
    rows, row_numel = _qstate.row_view(p.shape)
    want_absmax = (rows, _qstate.blocks_per_row(row_numel, block_size))
    for c, a in zip(codes, absmax):
        if (
            tuple(c.shape) != codes_shape
            or tuple(a.shape) != want_absmax
            or c.dtype != torch.uint8
            or a.dtype != torch.float32
            or not (c.is_contiguous() and a.is_contiguous())
        ):
            raise RuntimeError(
                f"{name}: the quantized state of a parameter of (local) shape {tuple(p.shape)} "
                f"does not fit block_size={block_size}: codes {c.dtype} {tuple(c.shape)}, absmax "
                f"{a.dtype} {tuple(a.shape)}; expected uint8 {codes_shape} and float32 "
                f"{want_absmax}. The layout is fixed when the state is created: keep the "
                f"group's block_size (and the checkpoint's parameter shapes), or start from "
                f"fresh state"
            )


def _layout_fits(
    codes_shape: tuple[int, ...],
    codes: list[Tensor],
    absmax: list[Tensor],
    absmax_shape: tuple[int, int],
) -> bool:
    """The quick form of :func:`_check_layout`'s test (which says what does not fit)."""
    for c, a in zip(codes, absmax):
        if not (
            c.dtype == torch.uint8
            and a.dtype == torch.float32
            and c.shape == codes_shape
            and a.shape == absmax_shape
            and c.is_contiguous()
            and a.is_contiguous()
        ):
            return False
    return True


def _global_row_offset(p: Tensor) -> int:
    if not isinstance(p, DTensor):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return int(offset[0]) if len(offset) else 0


def _full_state_dtype(p: Tensor) -> torch.dtype:
    """The dtype of ``p``'s full-precision state and update math: fp64 for an fp64 parameter
    (as ``torch.optim``; fp32 math would round the parameter to fp32 every step), else fp32."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32
