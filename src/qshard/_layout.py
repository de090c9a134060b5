"""The row-block layout of quantized optimizer state as integer arithmetic: how a state tensor is
cut into rows and blocks ([Note: row-block layout] in :mod:`qshard.optim._qstate`) and how many
bytes a row of packed 4-bit codes takes ([Note: 4-bit layout] in :mod:`qshard.optim._qstate4`).

Torch-free, so that :mod:`qshard.train.estimate` prices the state of a run with the same
arithmetic the optimizers allocate it with, without importing torch.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__: list[str] = []  # private module


def row_view(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, row_numel) of a tensor shape under [Note: row-block layout]."""
    if len(shape) == 0:
        return 1, 1
    rows = int(shape[0])
    row_numel = 1
    for d in shape[1:]:
        row_numel *= int(d)
    return rows, row_numel


def blocks_per_row(row_numel: int, block_size: int) -> int:
    """Blocks (one fp32 absmax each) of a row of ``row_numel`` elements; the last may be partial."""
    return -(-row_numel // block_size)


def packed_row(row_numel: int) -> int:
    """Bytes per row of packed 4-bit codes (two a byte; an odd row leaves the last nibble 0)."""
    return (row_numel + 1) // 2
