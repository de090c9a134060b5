"""benchmarks/optim_host_overhead.py: both tables fill at toy sizes, the no-op kernel is put
back, and the FSDP2 table's process group is gone afterwards (the numbers are not checked)."""

from __future__ import annotations

import subprocess
import sys

from tests.benchmarks.conftest import BENCH


def test_tables_fill_and_the_kernels_are_restored(load_benchmark, tmp_path):
    from qshard.optim import _kernels, _kernels4

    mod = load_benchmark("optim_host_overhead")
    before = (_kernels.library, _kernels4.library)
    args = mod.argparse.Namespace(tensors=3, shape=(4, 64), steps=1)
    rows = mod._cpu_call_rows(args)
    assert [r[0] for r in rows] == ["AdamW8bit", "AdamW4bit"]
    assert (_kernels.library, _kernels4.library) == before
    # the FSDP2 table starts a process group of its own: in a child process, as a user runs it
    out = tmp_path / "host.md"
    cmd = [sys.executable, str(BENCH / "optim_host_overhead.py"), "--tensors", "3"]
    cmd += ["--shape", "4x64", "--units", "2", "--dim", "8", "--steps", "1", "--out-md", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text()
    assert "kernel a no-op: 3 tensors of 4 x 64" in text
    for name in ("qshard AdamW8bit (fp32", "qshard AdamW8bit(fused=True)", "torch AdamW(fused"):
        assert f"| {name}" in text, name
