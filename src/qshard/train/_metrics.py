"""Rank 0's outputs: JSONL metrics (and TensorBoard when installed), tables for the terminal.

[Note: non-finite metrics] Python's ``json`` writes NaN and infinities as the bare words
``NaN`` / ``Infinity``, which are not JSON: jq, JavaScript's ``JSON.parse`` and other strict
parsers reject the line. :func:`encode_record` writes such a value as ``null`` and names it
in a ``"nonfinite"`` object of the same shape as the record: ``{"loss": null, ...,
"nonfinite": {"loss": "NaN"}}`` (``"NaN"``, ``"Infinity"`` or ``"-Infinity"``; a nested
value's name sits at the same place under ``"nonfinite"``). :func:`decode_record` puts the
floats back, and reads the bare words of files written before as well.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MetricsWriter",
    "decode_record",
    "encode_record",
    "format_bytes",
    "peak_memory_bytes",
    "table",
]

NONFINITE = "nonfinite"
"""The key of a record's names of its non-finite values ([Note: non-finite metrics])."""


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA's peak allocation, else the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def format_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def table(header: list[str], rows: list[list[str]], *, title: str | None = None) -> str:
    """A plain fixed-width table (first column left-aligned, the rest right-aligned)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        )

    out = [title] if title else []
    out += [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]
    return "\n".join(out)


def encode_record(record: dict[str, Any], *, indent: int | None = None) -> str:
    """Strict JSON for ``record`` (one line unless ``indent``): non-finite floats become
    ``null``, named under ``"nonfinite"`` ([Note: non-finite metrics])."""
    names: dict[str, Any] = {}
    clean = _without_nonfinite(record, names)
    if names:
        clean[NONFINITE] = names
    return json.dumps(clean, allow_nan=False, indent=indent)


def _without_nonfinite(obj: dict[str, Any], names: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = None
            names[key] = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
        elif isinstance(value, dict):
            inner: dict[str, Any] = {}
            out[key] = _without_nonfinite(value, inner)
            if inner:
                names[key] = inner
        else:
            out[key] = value
    return out


def decode_record(line: str) -> dict[str, Any]:
    """A record written by :func:`encode_record`, its non-finite floats put back; also reads the
    bare ``NaN`` / ``Infinity`` of files written before ([Note: non-finite metrics]). Raises
    ``ValueError`` for a line that is not JSON."""
    record = json.loads(line)
    if not isinstance(record, dict):
        raise ValueError(f"a metrics record is a JSON object, not {type(record).__name__}")
    names = record.pop(NONFINITE, None)
    if isinstance(names, dict):
        _restore_nonfinite(record, names)
    return record


def _restore_nonfinite(obj: dict[str, Any], names: dict[str, Any]) -> None:
    for key, name in names.items():
        if isinstance(name, dict) and isinstance(obj.get(key), dict):
            _restore_nonfinite(obj[key], name)
        elif name in ("NaN", "Infinity", "-Infinity") and obj.get(key) is None:
            obj[key] = float(name)


class MetricsWriter:
    """Appends one JSON object per step to ``<run>/metrics.jsonl``; mirrors scalars to
    TensorBoard (``<run>/tensorboard``) when ``torch.utils.tensorboard`` can be imported.

    On resume, records at or after the resume step are dropped first, so the file describes one
    consistent history; so is a torn last line (a write cut short by a crash or a full disk).
    Every line is strict JSON ([Note: non-finite metrics]); the records kept on resume are
    rewritten so, also those of a file written before with bare ``NaN``.
    """

    def __init__(self, run_dir: Path, *, resume_step: int | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            records = [decode_record(line) for line in _records(self.path)]
            kept = [r for r in records if r.get("step", 0) < resume_step]
            self.path.write_text("".join(encode_record(r) + "\n" for r in kept))
        self._file = open(self.path, "a")  # noqa: SIM115 - held for the run, closed in close()
        self._tb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        except Exception:  # tensorboard is optional
            self._tb = None

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(encode_record(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _records(path: Path) -> list[str]:
    """The record lines of a metrics file, less a torn last line; any other line that is not
    JSON is an error naming the file and the line (its number in the file, blank lines
    counted). The launcher runs it before the ranks of a ``--resume`` start, so a bad line is
    refused before a model is built (:func:`qshard.train.cli.preflight`)."""
    numbered = [
        (n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()
    ]
    for i, (n, line) in enumerate(numbered):
        try:
            decode_record(line)
        except ValueError as exc:
            if i == len(numbered) - 1:
                return [line for _, line in numbered[:-1]]
            raise ValueError(
                f"{path} line {n} is not a JSON record ({exc}); remove that line"
            ) from exc
    return [line for _, line in numbered]
