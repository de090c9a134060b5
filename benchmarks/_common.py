"""Shared helpers for the benchmark scripts: tables, machine facts, timing, markdown reports.

Every benchmark prints its table(s) to stdout and, with ``--out-md FILE``, writes the same
tables as markdown with the exact command, the date and the machine, so docs/RESULTS.md is
assembled from files the scripts produced (never typed by hand).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Report",
    "Timing",
    "add_report_args",
    "at_least",
    "cpu_vendor",
    "format_table",
    "machine_info",
    "out_path",
    "run_origin",
    "time_call",
    "topologies",
    "topology",
    "vector_isa",
]


def _cpuinfo() -> tuple[str, str, str, set[str]]:
    """(model name, family, model, flags) of the first CPU in /proc/cpuinfo ('' / empty off
    Linux)."""
    name = platform.processor() or platform.machine()
    family = model = ""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name":
                    name = value
                elif key == "cpu family" and not family:
                    family = value
                elif key == "model" and not model:
                    model = value
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return name, family, model, flags


def cpu_vendor() -> str:
    """'Intel', 'AMD' or '' (from the CPU's model name): hosts of one vector ISA still differ in
    what costs what (a 16-lane division takes the divider ~10 cycles on Intel's AVX-512 cores,
    ~2.5 on Zen 5), so results from each are their own section."""
    name = _cpuinfo()[0].lower()
    return "Intel" if "intel" in name else ("AMD" if "amd" in name else "")


def vector_isa() -> str:
    """The widest x86 vector instruction set the 8-bit kernel can use here ('AVX-512 F/BW/VBMI',
    'AVX-512 F without VBMI', 'AVX2', 'no AVX2'), '' where /proc/cpuinfo has no flags. It decides
    the kernel's path: the AVX-512 region encoder, the AVX2 table gathers, or the scalar loops."""
    flags = _cpuinfo()[3]
    if not flags:
        return ""
    if {"avx512f", "avx512bw", "avx512vbmi"} <= flags:
        return "AVX-512 F/BW/VBMI"
    if "avx512f" in flags:
        return "AVX-512 F without VBMI"
    return "AVX2" if "avx2" in flags else "no AVX2"


def machine_info() -> str:
    """One line naming the machine, so a number is never separated from where it came from; on
    Linux with the CPU family/model and :func:`vector_isa`."""
    import torch

    cpu, family, model, _ = _cpuinfo()
    if family:
        isa = vector_isa()
        cpu += (
            f" (family {family}, model {model}, {isa}{'' if 'AVX-512' in isa else ', no AVX-512'})"
        )
    dev = "no GPU"
    if torch.cuda.is_available():
        dev = torch.cuda.get_device_name(0)
    return (
        f"{cpu}, {os.cpu_count()} cores, {dev}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, Python {platform.python_version()}"
    )


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-markdown table (also readable as plain text on a terminal)."""

    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    return "\n".join(lines)


@dataclass(slots=True)
class Timing:
    """Wall-clock samples of one measured call, in seconds."""

    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)


def time_call(fn: Callable[[], object], *, repeat: int = 5, warmup: int = 1) -> Timing:
    """Time ``fn`` ``repeat`` times after ``warmup`` untimed calls (synchronising CUDA)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return Timing(samples)


def matrix_shape(text: str) -> tuple[int, int]:
    """An argparse ``type``: ``ROWSxCOLS`` (e.g. ``16x256``), both sides >= 1."""
    try:
        rows, cols = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS, e.g. 16x256; got {text!r}") from None
    if rows < 1 or cols < 1:
        raise argparse.ArgumentTypeError(f"both sides must be >= 1; got {text!r}")
    return rows, cols


def load_text() -> str:
    """The host's load averages over 1, 5 and 15 minutes, as ``a/b/c``."""
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an int >= ``low``, else a usage error naming the bound (instead of
    a traceback from deep inside the run, or a division by zero after it)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def topology(text: str) -> tuple[int, int]:
    """An argparse ``type``: ``NODESxRANKS_PER_NODE`` (e.g. ``2x2``) as two ints >= 1."""
    nodes, sep, rpn = text.lower().partition("x")
    try:
        parsed = (int(nodes), int(rpn)) if sep else None
    except ValueError:
        parsed = None
    if parsed is None or min(parsed) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NODESxRANKS_PER_NODE with both >= 1 (e.g. 2x2)"
        )
    return parsed


def topologies(text: str) -> list[tuple[int, int]]:
    """An argparse ``type``: a comma separated list of :func:`topology` (e.g. ``2x2,4x2``)."""
    return [topology(t) for t in text.split(",")]


def out_path(text: str) -> str:
    """An argparse ``type`` for an output file: checked before the run, so a path that cannot
    be written fails in a second with the reason, not with a traceback after the whole run.
    A missing folder is fine (:meth:`Report.write` creates it); an existing non-folder on the
    way, a folder at the path, or a place this user may not write are not."""
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; name a file in it")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text!r} is not writable; choose another file")
        return text
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(
            f"cannot create {text!r}: {parent!r} is a file, not a folder"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(
            f"cannot create {text!r}: folder {parent!r} is not writable; choose another path"
        )
    return text


def add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out-md",
        metavar="FILE",
        type=out_path,
        help="also write the tables as markdown to FILE (a missing folder is created)",
    )


def _command_line() -> str:
    return " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0]), *sys.argv[1:]])


def run_origin() -> dict[str, str]:
    """Where and how numbers are being measured: this process's command line, the date and
    :func:`machine_info`. A benchmark that re-reports from a results file keeps this in the file
    and hands it to :class:`Report` (``origin``), so the header names the run that measured the
    numbers, not the one that rebuilt the tables."""
    return {
        "command": f"python {_command_line()}",
        "date": f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M UTC}",
        "machine": machine_info(),
    }


@dataclass(slots=True)
class Report:
    """Collects titled tables; prints each as it is added and writes them all as markdown.

    ``origin`` (a :func:`run_origin` saved with the numbers): the header names that run's
    command, date and machine, and the command that rebuilt the report on a line of its own.
    """

    title: str
    sections: list[str] = field(default_factory=list)
    origin: dict[str, str] | None = None

    def table(self, heading: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        text = format_table(header, rows)
        print(f"\n## {heading}\n{text}", flush=True)
        self.sections.append(f"### {heading}\n\n{text}\n")

    def note(self, text: str) -> None:
        print(text, flush=True)
        self.sections.append(text + "\n")

    def write(self, path: str | None) -> None:
        if not path:
            return
        now = run_origin()
        origin = self.origin or now
        header = (
            f"## {self.title}\n\n"
            f"- command: `{origin['command']}`\n"
            f"- date: {origin['date']}\n"
            f"- machine: {origin['machine']}\n"
        )
        if self.origin:
            header += f"- report rebuilt by: `{now['command']}` ({now['date']})\n"
        header += "\n"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(header + "\n".join(self.sections))
