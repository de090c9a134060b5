"""benchmarks/optim_step.py --phases: every timing variant of the fused kernel builds from the
kernel's own source, runs, and lands in the table (the numbers themselves are not checked)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from qshard.optim import _kernels

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.skipif(not _kernels.available(), reason="no C compiler for the kernel")
def test_phases_table_has_every_variant(tmp_path):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("_bench_optim_step", BENCH / "optim_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "phases.md"
    before = _kernels.library
    mod.main(
        [
            "--phases",
            "--sizes",
            "64K",
            "--threads",
            "1",
            "--repeat",
            "2",
            "--warmup",
            "1",
            "--out-md",
            str(out),
        ]
    )
    text = out.read_text()
    for what, _ in mod._PHASES:
        assert f"| {what}" in text, what
    assert "Load average before" in text
    assert _kernels.library is before  # the benchmark put the real kernel back
