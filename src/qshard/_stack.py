"""Where a warning points: the user's line, however deep inside qshard and torch it is raised.
A leaf module: it imports nothing of qshard."""

from __future__ import annotations

import os
import sys

__all__: list[str] = []  # private module

_QSHARD = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the calling function that names the first
    frame outside qshard and torch (an optimizer's ``step`` runs under torch's hook wrappers,
    so a fixed count goes stale when either side adds a frame)."""
    torch = sys.modules.get("torch")
    inside = (_QSHARD,) if torch is None else (_QSHARD, os.path.dirname(torch.__file__) + os.sep)
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level
