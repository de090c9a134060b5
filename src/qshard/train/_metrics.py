"""Rank 0's outputs: JSONL metrics (and TensorBoard when installed), tables for the terminal."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["MetricsWriter", "format_bytes", "peak_memory_bytes", "table"]


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


class MetricsWriter:
    """Appends one JSON object per step to ``<run>/metrics.jsonl``; mirrors scalars to
    TensorBoard (``<run>/tensorboard``) when ``torch.utils.tensorboard`` can be imported.

    On resume, records at or after the resume step are dropped first, so the file describes one
    consistent history; so is a torn last line (a write cut short by a crash or a full disk).
    """

    def __init__(self, run_dir: Path, *, resume_step: int | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [
                line
                for line in _records(self.path)
                if json.loads(line).get("step", 0) < resume_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._file = open(self.path, "a")  # noqa: SIM115 - held for the run, closed in close()
        self._tb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        except Exception:  # tensorboard is optional
            self._tb = None

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
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
    JSON is an error naming the file."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    for i, line in enumerate(lines):
        try:
            json.loads(line)
        except ValueError as exc:
            if i == len(lines) - 1:
                return lines[:-1]
            raise ValueError(
                f"{path} line {i + 1} is not a JSON record ({exc}); remove it to resume"
            ) from exc
    return lines
