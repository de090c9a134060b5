"""``qshard report RUN_DIR...``: PNG plots of one or more ``qshard train`` runs.

Reads each run's ``metrics.jsonl`` and writes, into ``--out`` (default: the first run's folder):

* ``loss.png``: training loss (smoothed) and validation loss of every run, overlaid;
* ``bytes.png``: intra-node and inter-node bytes per step (comm ledger) of every run.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qshard.train._metrics import _records, decode_record

__all__ = ["load_metrics", "main", "plot_runs"]


def load_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The per-step records of a run (raises ``FileNotFoundError`` naming the fix). A torn
    last line (a run killed while writing it) is left out, as ``--resume`` does; any other
    line that is not a record raises ``ValueError`` naming the file and line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; pass a run directory written by `qshard train --out DIR`"
        )
    # Non-finite values come back as floats, from this format and the bare NaN of older files.
    return [decode_record(line) for line in _records(path)]


def _smooth(values: list[float], window: int) -> list[float]:
    """The running mean of the finite values among the last ``window`` (NaN where there is
    none): a skipped step's NaN loss leaves a gap in the curve, not NaN from there on."""
    out, acc, count = [], 0.0, 0
    for i, v in enumerate(values):
        if math.isfinite(v):
            acc, count = acc + v, count + 1
        if i >= window and math.isfinite(values[i - window]):
            acc, count = acc - values[i - window], count - 1
        out.append(acc / count if count else math.nan)
    return out


def _labels(run_dirs: Sequence[str | Path]) -> list[str]:
    """Each run's legend label: its folder's name, or the path as given where two runs share a
    name (``a/run b/run`` were both labelled ``run``)."""
    names = [Path(d).resolve().name or str(d) for d in run_dirs]
    return [name if names.count(name) == 1 else str(d) for name, d in zip(names, run_dirs)]


def plot_runs(run_dirs: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Write ``loss.png`` and ``bytes.png`` for ``run_dirs`` into ``out_dir``; return paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(zip(_labels(run_dirs), [load_metrics(d) for d in run_dirs]))  # before writing
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, records in runs:
        steps = [r["step"] for r in records]
        loss = [r["loss"] for r in records]
        window = max(1, len(loss) // 50)
        (line,) = ax.plot(steps, _smooth(loss, window), label=f"{name} train", linewidth=1.2)
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        if val:
            ax.plot(*zip(*val), "o--", color=line.get_color(), label=f"{name} val", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    loss_png = out_dir / "loss.png"
    fig.savefig(loss_png, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, records in runs:
        steps = [r["step"] for r in records]
        (line,) = ax.plot(
            steps, [r.get("inter_node_bytes", 0) / 2**20 for r in records], label=f"{name} inter"
        )
        ax.plot(
            steps,
            [r.get("intra_node_bytes", 0) / 2**20 for r in records],
            ":",
            color=line.get_color(),
            label=f"{name} intra",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("MiB per step, per node")
    ax.set_title("bytes per step by link class (comm ledger)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    bytes_png = out_dir / "bytes.png"
    fig.savefig(bytes_png, dpi=120)
    plt.close(fig)
    return [loss_png, bytes_png]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``qshard report RUN_DIR... [--out DIR]``: plot the runs' metrics as PNGs, print
    their paths and return the exit code (2 with the reason on stderr)."""
    parser = argparse.ArgumentParser(
        prog="qshard report", description="Plot the metrics of qshard train runs (PNG)."
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories to overlay")
    parser.add_argument("--out", default=None, help="output folder (default: the first run)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    out = args.out or args.runs[0]
    if importlib.util.find_spec("matplotlib") is None:  # the library alone is installed
        print(
            "qshard report: error: the plots need matplotlib, which is not installed: "
            "pip install 'qshard[train]' (or pip install matplotlib)",
            file=sys.stderr,
        )
        return 2
    try:
        paths = plot_runs(args.runs, out)
    except (FileNotFoundError, ValueError) as exc:  # no metrics, or a line that is no record
        print(f"qshard report: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the plots cannot be written there
        print(
            f"qshard report: error: cannot write the plots into {out} ({exc}); pass --out a "
            "folder you can write to",
            file=sys.stderr,
        )
        return 2
    for p in paths:
        print(p)
    return 0
