"""Filesystem helpers shared by the kernel cache and the training application's checkpoints."""

from __future__ import annotations

import os

__all__ = ["fsync_path"]


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush ``path`` (a file, or a folder's entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
