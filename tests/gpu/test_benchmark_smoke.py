"""The prepared GPU benchmark must not break silently: run it at toy sizes on CPU (--smoke), and
check that a section that raises, hangs or crashes costs only its own results."""

from __future__ import annotations

import json
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


def _run(tmp_path, *args, inject="", timeout=240):
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "QSHARD_GPU_RUN_INJECT": inject}
    env.pop("OUT", None)
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--smoke", "--out-dir", str(out), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    summary = json.loads((out / "results.json").read_text())
    return proc, out, summary


def test_failing_sections_keep_the_others_results(tmp_path):
    """One section raises, one hangs past its cap, one kills its process: the sections around
    them still run and record their tables, the summary names each failure, and the output
    stays within what the device tool returns (8 files)."""
    proc, out, summary = _run(
        tmp_path,
        "--sections",
        "kernels,adamw8bit,adamw4bit,qgz_middle_hop,qgz_reduce_scatter",
        "--cap",
        "adamw4bit=4",
        # the sections that must pass get room: on a loaded host the interpreter ran adamw8bit
        # past its 120 s smoke cap (load average 10 on 2 cores)
        "--cap",
        "adamw8bit=300",
        "--cap",
        "qgz_reduce_scatter=300",
        inject="kernels=raise,adamw4bit=hang,qgz_middle_hop=crash",
        timeout=560,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    status = {s["section"]: s["status"] for s in summary["summary"]}
    assert status == {
        "env": "ok",
        "kernels": "failed",
        "adamw8bit": "ok",
        "adamw4bit": "timeout",
        "qgz_middle_hop": "crashed",
        "qgz_reduce_scatter": "ok",
    }, summary["summary"]
    assert summary["finished"] is True
    assert summary["not_ok"] == ["kernels", "adamw4bit", "qgz_middle_hop"]
    errors = {s["section"]: s["error"] or "" for s in summary["summary"]}
    assert "injected failure in section 'kernels'" in errors["kernels"]
    assert "killed at its cap" in errors["adamw4bit"]
    assert "exited with status 134" in errors["qgz_middle_hop"]
    # The sections after each failure measured and wrote their tables.
    assert summary["sections"]["adamw8bit"]["tables"][0]["heading"].startswith("AdamW step on")
    assert summary["sections"]["qgz_reduce_scatter"]["tables"]
    assert summary["sections"]["env"]["facts"]["triton"]
    results = (out / "results.md").read_text()
    assert "AdamW step on" in results and "qgZ reduce-scatter per rank" in results
    text = (out / "summary.md").read_text()
    for name, st in (
        ("kernels", "failed"),
        ("adamw4bit", "timeout"),
        ("qgz_middle_hop", "crashed"),
    ):
        assert f"## {name}: {st}" in text
    assert "RuntimeError: injected failure" in text
    assert sorted(p.name for p in out.iterdir()) == [
        "logs.txt",
        "results.json",
        "results.md",
        "summary.md",
    ]


def test_budget_spent_skips_and_still_writes_a_summary(tmp_path):
    proc, _, summary = _run(tmp_path, "--sections", "kernels", "--budget-s", "5")
    assert proc.returncode == 1
    assert [(s["section"], s["status"]) for s in summary["summary"]] == [
        ("env", "skipped"),
        ("kernels", "skipped"),
    ]
    assert "time budget spent" in summary["summary"][1]["error"]


def test_out_directory_is_OUT_when_set(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "o"), "QSHARD_GPU_RUN_INJECT": ""}
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--smoke", "--sections", "env", "--budget-s", "60"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (tmp_path / "o" / "summary.md").exists()


def test_step_in_backward_section_compares_the_same_steps(tmp_path):
    """The StepInBackward section (one world of one under FSDP2): both optimizers stepped after
    backward and inside it, the parameters equal bit for bit."""
    proc, _, summary = _run(tmp_path, "--sections", "step_in_backward")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (table,) = summary["sections"]["step_in_backward"]["tables"]
    rows = [dict(zip(table["header"], row)) for row in table["rows"]]
    assert [(r["optimizer"], r["stepped"]) for r in rows] == [
        ("torch AdamW(fused)", "after backward"),
        ("torch AdamW(fused)", "inside backward"),
        ("AdamW8bit", "after backward"),
        ("AdamW8bit", "inside backward"),
    ]
    assert [r["same parameters"] for r in rows] == ["-", "True", "-", "True"]


@pytest.mark.slow
def test_smoke_run_every_section(tmp_path):
    proc, _, summary = _run(tmp_path, "--out-md", str(tmp_path / "gpu.md"), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["not_ok"] == [], summary["summary"]
    text = (tmp_path / "gpu.md").read_text()
    for heading in (
        "Environment",
        "On-device correctness",
        "Kernel bandwidth",
        "qgZ middle hop",
        "qgZ reduce-scatter per rank",
        "AdamW step",
        "AdamW4bit step",
        "tests/gpu on the device",
        "GPT training step",
        "1-bit compressed_all_reduce on the device",
        "OneBitAdam compressed step vs torch Adam",
        "StepInBackward on one device",
    ):
        assert heading in text
    # every kernel bit-exact in the smoke run (the Environment table's cuda_available is False
    # on CPU: the check reads the tables after it)
    measured = text.split("### On-device correctness", 1)[1]
    assert "|False|" not in measured.replace(" ", "")
    # AdamW4bit's step is one launch: the section counts the kernel's launches
    four = text.split("AdamW4bit step on", 1)[1].split("###", 1)[0]
    calls = [row.split("|")[4].strip() for row in four.splitlines() if "AdamW4bit.step()" in row]
    assert calls and all(c == "1" for c in calls), calls


@pytest.mark.slow
def test_profile_step_smoke(tmp_path):
    """benchmarks/gpu/profile_step.py at toy sizes on CPU: every part runs (ncu is skipped where
    it is absent) and profile.md has both torch.profiler tables."""
    script = os.path.join(os.path.dirname(SCRIPT), "profile_step.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    proc = subprocess.run(
        [sys.executable, script, "--smoke", "--skip-ncu", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (tmp_path / "profile.md").read_text()
    parts = [row for row in text.splitlines() if row.startswith("| 2. torch.profiler")]
    assert len(parts) == 2 and all("| ok " in row for row in parts), parts
    assert "AdamW8bit.step() on" in text and "GPT training step" in text
