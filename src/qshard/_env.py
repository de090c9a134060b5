"""Reading qshard's and the launcher's environment variables, with errors that name them.
A leaf module: it imports nothing of qshard."""

from __future__ import annotations

import os

__all__: list[str] = []  # private module


def env_int(name: str, default: int, *, minimum: int, hint: str = "") -> int:
    """The integer in environment variable ``name`` (surrounding blanks allowed), ``default``
    when it is unset; anything else than a whole number ``>= minimum`` is a ``ValueError``
    naming the variable and its value (``hint`` is appended to the message)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(
            f"environment variable {name}={raw!r} must be a whole number >= {minimum}{hint}"
        )
    return value
