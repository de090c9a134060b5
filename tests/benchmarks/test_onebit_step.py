"""benchmarks/onebit_step.py: every table fills at toy sizes (the numbers are not checked), the
round is put back, and the ZeroOneAdam rows time 1-bit steps, not its variance steps."""

from __future__ import annotations

import subprocess
import sys

from tests.benchmarks.conftest import BENCH


def test_rounds_are_restored_and_zero_one_adam_times_one_bit_steps(load_benchmark):
    import torch

    import qshard.comm.compressed as compressed
    from qshard.optim import ZeroOneAdam

    mod = load_benchmark("onebit_step")
    before = compressed._per_tensor
    with mod.round_kind("vectorized"):
        assert compressed._per_tensor(None) is False
    assert compressed._per_tensor is before
    assert len(mod.gpt_shapes(8)) == 52
    # the benchmark's schedule: variance steps at powers of two, so steps 33..63 are 1-bit
    p = torch.nn.Parameter(torch.zeros(16))
    opt = ZeroOneAdam([p], lr=1e-4, var_freeze_step=10**6, var_update_scaler=1)
    for _ in range(32 + 30):
        p.grad = torch.randn(16)
        opt.step()
    assert opt.comm_stats["compressed"] == 62 - 6 and opt.comm_stats["full_precision"] == 6


def test_tables_fill(tmp_path):
    out = tmp_path / "onebit.md"
    cmd = [sys.executable, str(BENCH / "onebit_step.py"), "--width", "8", "--tensors", "3"]
    cmd += ["--shape", "4x8", "--steps", "1", "--out-md", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text()
    assert text.count("| GPT width 8 (52 tensors) |") == 2 and text.count("| 3 x 4x8 ") == 2
    for name in ("torch Adam (fused=True)", "OneBitAdam, compressed phase", "ZeroOneAdam"):
        assert text.count(f"| {name}") == (1 if name.startswith("torch") else 2), name
