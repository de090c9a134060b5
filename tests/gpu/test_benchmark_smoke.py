"""The prepared GPU benchmark must not break silently: run it at toy sizes on CPU (--smoke)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the GPU kernels need triton (pip install qshard[gpu])")

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu", "run_all.py")


def test_fails_fast_without_cuda(monkeypatch, capsys):
    import importlib.util

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    spec = importlib.util.spec_from_file_location("gpu_run_all", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SystemExit) as exit_info:
        module._require_cuda()
    assert exit_info.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.slow
def test_smoke_run_every_section(tmp_path):
    out = tmp_path / "gpu.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--smoke", "--out-md", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "failed:" not in proc.stdout, proc.stdout[-3000:]
    text = out.read_text()
    for heading in (
        "On-device correctness",
        "Kernel bandwidth",
        "qgZ middle hop",
        "qgZ reduce-scatter per rank",
        "AdamW step",
        "GPT training step",
    ):
        assert heading in text
    assert "|False|" not in text.replace(" ", "")  # every kernel bit-exact in the smoke run
