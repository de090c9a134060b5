"""Fault injection on the real launcher: a rank killed with restarts on (the job finishes with the
uninterrupted run's final loss and model, also under torchrun with its own --max-restarts) and
off (a clean failure naming the rank), a rank SIGSTOPped (the job ends with a message naming
rank, step and checkpoint; no process is left), a rank killed inside a checkpoint save (the
restart resumes from the previous complete one), a newest checkpoint with a shard cut short (the
restart moves it aside and falls back to the previous one), NaN gradients on one rank (skip: every rank
skips the same step; stop: an error naming step and rank), and the fault-spec parser.

Faults come from the ``QSHARD_FAULT`` testing hook (see [Note: fault injection] in
``qshard.train._faults``). Every job runs in its own process group, which the test kills in a
``finally`` block, and each test asserts that no process of the group outlived the job. The jobs
take about a minute each on a loaded 2-core machine, so they are marked slow.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from qshard.train import _faults
from qshard.train import checkpoint as ckpt

# The tiniest GPT and schedule that show the behaviour: 6 steps, checkpoints every 2.
TINY = [
    "--nproc", "2", "--steps", "6", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
    "--context", "32", "--batch-size", "2", "--warmup-steps", "1", "--eval-interval", "0",
    "--checkpoint-interval", "2", "--keep-checkpoints", "5", "--no-progress",
]  # fmt: skip
JOB_TIMEOUT_S = 420  # one job on a loaded 2-core machine takes ~1 minute


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("faults")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = tmp / "corpus.txt"
    path.write_bytes(
        b"".join((stdlib / m).read_bytes() for m in ("json/decoder.py", "abc.py", "bisect.py"))
    )
    return path


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of the process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            members.append(int(entry.name))
    return members


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return f"{pid} (exited)"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _run(cmd: list[str], fault: str | None, cwd: Path) -> tuple[int, str, str, float, bool]:
    """Run ``cmd`` in a new process group; returns (rc, stdout, stderr, seconds, whether any
    process of the group was still there once the command exited). The group is killed in
    every case."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(_faults.ENV, None)
    if fault:
        env[_faults.ENV] = fault
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the launcher and every rank
    )
    try:
        out, err = proc.communicate(timeout=JOB_TIMEOUT_S)
        seconds = time.monotonic() - t0
        _report_stop_time(cmd, out, time.time())
        # Helpers of the launcher (multiprocessing's resource tracker) exit on their own once
        # it is gone; a process still there after a few seconds was left running.
        deadline = time.monotonic() + 10
        while _group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        leftover = [_cmdline(pid) for pid in _group_members(proc.pid)]
        return proc.returncode, out, err, seconds, leftover
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _report_stop_time(cmd: list[str], stdout: str, ended: float) -> None:
    """Print the seconds from the injected fault to the end of the job (docs/reliability.md
    quotes them; run with -s to see them). Not asserted: wall-clock time depends on the load."""
    marks = re.findall(r"qshard fault injection: (.*?) \(time ([0-9.]+)\)", stdout)
    if marks:
        what, t = marks[0]
        print(f"\nFAULT-TIMING {what}: job ended {ended - float(t):.1f} s after the fault")


def _train(corpus: Path, out: Path, *flags: str, fault: str | None = None):
    cmd = [sys.executable, "-m", "qshard.cli", "train", *TINY, "--data", str(corpus)]
    cmd += ["--cache-dir", str(corpus.parent / "cache"), "--out", str(out), *flags]
    return _run(cmd, fault, corpus.parent)


def _final(out: Path) -> tuple[float, bytes]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 5
    return records[-1]["loss"], (out / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def uninterrupted(corpus) -> tuple[float, bytes]:
    out = corpus.parent / "uninterrupted"
    rc, _, err, _, _ = _train(corpus, out)
    assert rc == 0, err[-3000:]
    return _final(out)


def test_fault_spec_parses_and_refuses_nonsense():
    assert _faults.parse("kill:rank=1:step=3; stop:rank=0:step=2:at=save:restart=1") == (
        _faults.Fault(kind="kill", rank=1, step=3),
        _faults.Fault(kind="stop", rank=0, step=2, at="save", restart=1),
    )
    for bad, message in [
        ("explode:rank=1:step=3", "unknown fault"),
        ("kill:rank=1", "needs rank= and step="),
        ("kill:rank=1:step=3:when=now", r"bad field .*restart="),
        ("kill:rank=one:step=3", r"rank= takes a whole number >= 0; got 'rank=one'"),
        ("kill:rank=1:step=-3", r"step= takes a whole number >= 0; got 'step=-3'"),
        ("kill:rank=1:step=3:restart=x", r"restart= takes a whole number >= 0"),
        ("kill:rank=1:step=3:at=eval", "at= must be one of"),
        ("corrupt:rank=1:step=4", "corrupt cuts a checkpoint's files: it needs at=save"),
    ]:
        with pytest.raises(ValueError, match=message):
            _faults.parse(bad)


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 60)
def test_killed_rank_with_restarts_finishes_like_the_uninterrupted_run(corpus, uninterrupted):
    out = corpus.parent / "kill_restart"
    rc, stdout, err, _, leftover = _train(
        corpus, out, "--max-restarts", "1", fault="kill:rank=1:step=3"
    )
    assert rc == 0, err[-3000:]
    assert "qshard fault injection: kill rank 1 at step 3 (time " in stdout
    assert "resumed from step 2" in stdout  # the newest complete checkpoint when rank 1 died
    assert _final(out) == uninterrupted  # same final loss, same exported bytes
    assert not leftover, leftover


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 60)
def test_killed_rank_under_torchrun_restarts_with_torchruns_max_restarts(corpus, uninterrupted):
    out = corpus.parent / "torchrun_restart"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    # --nproc is torchrun's to decide (and its argparse would take it for --nproc-per-node).
    tiny = TINY[2:]
    assert TINY[:2] == ["--nproc", "2"]
    cmd += ["--max-restarts", "1", "-m", "qshard.train", *tiny, "--data", str(corpus)]
    # The local launch's layout (2 emulated nodes of 1); torchrun's default is its one node.
    cmd += ["--cache-dir", str(corpus.parent / "cache"), "--out", str(out), "--ranks-per-node", "1"]
    rc, stdout, err, _, leftover = _run(cmd, "kill:rank=1:step=3", corpus.parent)
    assert rc == 0, err[-3000:]
    assert "qshard fault injection: kill rank 1 at step 3 (time " in stdout
    assert "resumed from step 2" in stdout
    assert _final(out) == uninterrupted
    assert not leftover, leftover


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_killed_rank_without_restarts_fails_naming_the_rank(corpus):
    out = corpus.parent / "kill_no_restart"
    rc, _, err, _, leftover = _train(corpus, out, fault="kill:rank=1:step=3")
    assert rc == 1
    assert "qshard train: error: the job failed" in err
    assert "rank 1 (pid " in err and "was killed by SIGKILL" in err
    assert f"the newest complete checkpoint is {out / 'checkpoints' / 'step_00000002'}" in err
    assert "--max-restarts" in err
    assert not leftover, leftover


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize(
    ("stopped", "fault"),
    [(1, "stop:rank=1:step=3"), (0, "stop:rank=0:step=4:at=save")],  # 0: hung inside a save
)
def test_stopped_rank_ends_the_job_within_the_timeout_and_is_killed(corpus, stopped, fault):
    out = corpus.parent / f"stop_{stopped}"
    rc, _, err, _, leftover = _train(corpus, out, "--collective-timeout", "10", fault=fault)
    reporter = 1 - stopped
    assert rc == 1
    # The reporting rank's diagnosis is the report, also when the stopped rank has the lower
    # local rank (before: "rank 0 (pid N) was killed by SIGKILL" alone, [Note: reaped first]).
    assert f"rank {reporter} (pid " in err and "failed (exit code 1): RankFailure: " in err, err
    assert f"rank {reporter} stopped at step 3" in err
    assert "--collective-timeout 10 s" in err
    assert (
        f"rank {stopped} did not answer (hung or dead); stopped rank {stopped} on this host: "
        "killed" in err
    )
    assert f"resume from {out / 'checkpoints' / 'step_00000002'} with --resume" in err
    assert not leftover, leftover  # the stopped rank too


def test_the_watcher_kills_a_stopped_peer_only_once_the_reporting_rank_is_reaped():
    """[Note: reaped first] in qshard.train._faults: killed while the reporting rank was an
    unreaped zombie, the stopped peer was found dead at the agent's same poll, and the agent
    reported the lower local rank's SIGKILL instead of the diagnosis."""
    peer = subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(120)"])
    reporter = subprocess.Popen([sys.executable, "-S", "-c", "pass"])  # exits; reaped below
    watcher = None
    try:
        os.kill(peer.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while _faults._proc_state(reporter.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.02)
        watcher = subprocess.Popen(
            [sys.executable, "-S", "-c", _faults._WATCHER, str(reporter.pid), str(peer.pid)]
        )
        time.sleep(1.0)  # the old watcher killed within 50 ms of seeing the zombie
        assert _faults._proc_state(peer.pid) == "T"  # held back: the agent has not reaped it
        reporter.wait()  # the agent reaps the reporting rank: its error is recorded
        assert watcher.wait(timeout=60) == 0
        assert peer.wait(timeout=60) == -signal.SIGKILL
    finally:
        for proc in (peer, reporter, watcher):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 60)
def test_kill_during_a_save_resumes_from_the_previous_checkpoint(corpus, uninterrupted):
    out = corpus.parent / "kill_save"
    # Rank 1 dies with its shard of step_00000004 on disk, before the save is complete.
    rc, stdout, err, _, leftover = _train(
        corpus, out, "--max-restarts", "1", fault="kill:rank=1:step=4:at=save"
    )
    assert rc == 0, err[-3000:]
    assert "qshard fault injection: kill rank 1 at save 4 (time " in stdout
    assert "resumed from step 2" in stdout  # the torn step-4 save was never loaded
    assert _final(out) == uninterrupted
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_00000002",
        "step_00000004",
        "step_00000006",
    ]  # the restarted run rewrote step 4 whole and removed the torn folder
    assert not leftover, leftover


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT_S + 60)
def test_restart_falls_back_past_a_damaged_newest_checkpoint(corpus, uninterrupted):
    out = corpus.parent / "damaged_restart"
    # Rank 1's shard of step_00000004 is cut to half inside its save, which then completes (a
    # lost write); rank 1 dies before step 5. Before: every restart failed loading step 4.
    rc, stdout, err, _, leftover = _train(
        corpus,
        out,
        "--max-restarts",
        "1",
        fault="corrupt:rank=1:step=4:at=save;kill:rank=1:step=5",
    )
    assert rc == 0, err[-3000:]
    assert "qshard fault injection: corrupt rank 1 at save 4: cut __1_0.distcp" in stdout
    assert "qshard fault injection: kill rank 1 at step 5 (time " in stdout
    damaged = out / "checkpoints" / "step_00000004"
    assert (
        f"qshard train: WARNING: restart 1: the newest checkpoint could not be loaded: {damaged} "
        "(__1_0.distcp cannot be loaded (it has " in err
    ), err[-3000:]
    assert "moved aside to step_00000004.damaged. Falling back to " in err
    assert f"{out / 'checkpoints' / 'step_00000002'} (step 2)" in err
    assert "resumed from step 2" in stdout
    assert _final(out) == uninterrupted  # same final loss, same exported bytes
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_00000002",
        "step_00000004",
        "step_00000004.damaged",
        "step_00000006",
    ]  # the damaged folder kept for inspection, step 4 rewritten whole
    assert not leftover, leftover


def _launch_script(corpus: Path, out: Path, mode: str) -> list[str]:
    """``launch()`` in a child process, printing every rank's skipped steps and losses."""
    flags = [*TINY, "--data", str(corpus), "--cache-dir", str(corpus.parent / "cache")]
    flags += ["--out", str(out), "--on-nonfinite", mode, "--no-export"]
    code = (
        "import json, sys\n"
        "from qshard.train.cli import config_from_args, launch, preflight\n"
        f"cfg = config_from_args({flags!r})\n"
        "preflight(cfg)\n"
        "res = launch(cfg)\n"
        "print('RESULT', json.dumps({r: [v['skipped_steps'], v['losses']] for r, v in "
        "res.items()}))\n"
    )
    return [sys.executable, "-c", code]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_nan_gradients_on_one_rank_skip_the_step_on_every_rank(corpus):
    out = corpus.parent / "nan_skip"
    rc, stdout, err, _, leftover = _run(
        _launch_script(corpus, out, "skip"), "nan_grad:rank=1:step=3", corpus.parent
    )
    assert rc == 0, err[-3000:]
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
    results = {int(r): v for r, v in json.loads(line.removeprefix("RESULT ")).items()}
    assert sorted(results) == [0, 1]
    for skipped, losses in results.values():
        assert skipped == [3]  # every rank decided alike, from the same reduced values
        assert losses["3"] != losses["3"]  # the skipped step's loss is NaN ...
        assert all(v == v for k, v in losses.items() if k != "3")  # ... and nothing else
    assert "(local loss non-finite on rank 1); skipped on every rank" in stdout
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[3])
    assert record["step"] == 3 and record["skipped"] is True
    assert not leftover, leftover


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_nan_gradients_stop_the_job_naming_step_and_rank(corpus):
    out = corpus.parent / "nan_stop"
    rc, _, err, _, leftover = _train(corpus, out, fault="nan_grad:rank=1:step=3")
    assert rc == 1
    assert "step 3: loss nan" in err
    assert "(local loss non-finite on rank 1); stopped (--on-nonfinite stop" in err
    assert ckpt.latest_checkpoint(out / "checkpoints").name == "step_00000002"
    assert not leftover, leftover


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_a_failed_ranks_traceback_goes_to_failures_log_not_the_terminal(corpus):
    """Every rank failure printed ~37 lines of torch elastic's ``E...`` traceback before the
    report; the report's line is the diagnosis, the traceback is in OUT/failures.log, which the
    report names ([Note: rank tracebacks] in qshard.train.cli). One rank, one step: not slow."""
    out = corpus.parent / "traceback_file"
    flags = ("--nproc", "1", "--steps", "3")
    rc, _, err, _, leftover = _train(corpus, out, *flags, fault="nan_grad:rank=0:step=1")
    assert rc == 1, err[-3000:]
    assert "Traceback" not in err and not re.search(r"^E\d{4} ", err, re.M), err
    assert "rank 0 (pid " in err and "step 1: loss nan" in err
    assert f"  (the tracebacks are in {out / 'failures.log'})" in err
    log = (out / "failures.log").read_text()
    assert "Traceback (most recent call last)" in log and "in _check_finite" in log, log
    assert "RankFailure: rank 0: step 1: loss nan" in log
    assert not leftover, leftover


def test_summary_loss_mean_leaves_out_skipped_steps():
    """With --on-nonfinite skip the summary said "mean of last 6 nan": the skipped step's NaN
    loss was averaged in."""
    from qshard.train._summary import _loss_line

    losses = {0: 5.5, 1: 5.25, 2: math.nan, 3: 5.0}
    line = _loss_line(losses, {3: 5.1}, [2])
    assert line == (
        "loss 5.5000 (step 0) -> 5.0000 (step 3), mean of last 3 5.2500 (1 skipped), val loss 5.1000"
    )
    assert _loss_line({0: 5.5, 1: 5.0}, {}) == (
        "loss 5.5000 (step 0) -> 5.0000 (step 1), mean of last 2 5.2500"
    )


def _roll_call(rank: int, world: int) -> str:
    from qshard.train import _faults

    if rank == 1:
        time.sleep(2.0)  # stalled (stopped, swapping) while the collective timed out
    failure = _faults.diagnose(
        RuntimeError("Timed out waiting 6000ms"),
        step=3,
        timeout_s=6.0,
        latest=None,
        checkpoints=Path("/nowhere/checkpoints"),
    )
    return str(failure)


def test_the_roll_call_names_a_rank_that_answered_late():
    """A rank stopped for a while (between the collective timeout and the roll call's grace)
    answered in time, and the report said only "every rank answered afterwards (a transient
    network failure?)", naming no rank (a first-user probe with SIGSTOP for 8 s)."""
    from qshard.testing import run_world

    on_time, late = run_world(_roll_call, 2, timeout_s=60)
    assert "every rank answered afterwards, rank 1 only after " in on_time, on_time
    assert "(stalled: it was stopped, swapping or starved of CPU while the collective" in on_time
    assert "every rank answered afterwards (a transient network failure?)" in late, late
