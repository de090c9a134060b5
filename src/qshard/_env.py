"""Reading qshard's and the launcher's environment variables, with errors that name them.
A leaf module: it imports nothing of qshard."""

from __future__ import annotations

import os

__all__: list[str] = []  # private module


_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def env_flag(name: str, default: bool) -> bool:
    """The switch in environment variable ``name``: ``1/true/on/yes`` or ``0/false/off/no``
    (any case, blanks around), ``default`` when it is unset or empty; anything else is a
    ``ValueError`` naming the variable. One reading for every qshard switch: before,
    ``QSHARD_NO_KERNELS=0`` turned the kernels *off* (any value did), while
    ``QSHARD_QUANT_FASTPATH=0`` and ``QSHARD_DISABLE_TRITON=0`` meant the opposite."""
    raw = os.environ.get(name)
    value = "" if raw is None else raw.strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"environment variable {name}={raw!r} must be 1 or 0 (also true/false, on/off, yes/no); "
        "unset it for the default"
    )


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
