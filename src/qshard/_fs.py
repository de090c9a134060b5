"""Filesystem helpers shared by the kernel cache and the training application's checkpoints."""

from __future__ import annotations

import os

__all__ = ["cache_home", "fsync_path"]


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush ``path`` (a file, or a folder's entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def cache_home() -> str:
    """``$XDG_CACHE_HOME`` when it is an absolute path, else ``~/.cache`` (an empty or relative
    value is ignored, as the XDG spec says: an empty one put caches in the current directory)."""
    xdg = os.environ.get("XDG_CACHE_HOME") or ""
    return xdg if os.path.isabs(xdg) else os.path.expanduser("~/.cache")
