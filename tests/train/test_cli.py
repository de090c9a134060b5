"""`qshard train` configuration: flags map to TrainConfig, bad combinations are refused with the
fix named, and bad corpora fail in the launcher before any rank starts."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from qshard.train.cli import _report, build_parser, config_from_args, main
from qshard.train.config import TrainConfig, parse_zeropp
from tests.train.test_resume_options import _saved


def test_every_config_field_is_a_flag_with_help():
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions}
    for field in dataclasses.fields(TrainConfig):
        assert field.name in actions, field.name
        assert actions[field.name].help, f"--{field.name} has no help text"
        assert actions[field.name].default == field.default


def test_flags_parse_into_config():
    cfg = config_from_args(
        [
            "--nproc",
            "2",
            "--ranks-per-node",
            "1",
            "--zeropp",
            "qwz,hpz",
            "--optim",
            "adamw",
            "--steps",
            "30",
            "--batch-size",
            "6",
            "--no-export",
            "--lr",
            "1e-3",
        ]
    )
    assert cfg.nproc == 2 and cfg.ranks_per_node == 1
    assert cfg.zeropp_features == frozenset({"qwz", "hpz"})
    assert cfg.optim == "adamw" and cfg.steps == 30 and cfg.batch_size == 6
    assert cfg.export is False and cfg.lr == 1e-3


def test_defaults_are_the_main_job():
    cfg = TrainConfig()
    assert cfg.nproc == 4 and cfg.local_ranks_per_node() == 2
    assert cfg.zeropp_features == frozenset({"qwz", "hpz", "qgz"})
    assert cfg.optim == "adamw8bit"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--zeropp", "qwz,fast"], "--zeropp 'qwz,fast' is not understood; use off, all"),
        (["--optim", "zero_one_adam"], "pass --zeropp off"),
        (["--optim", "onebit_adam", "--zeropp", "hpz"], "cannot run with ZeRO++ sharding"),
        (["--nproc", "6", "--ranks-per-node", "4"], "e.g. --ranks-per-node 3"),
        (["--nproc", "4", "--batch-size", "6"], "e.g. --batch-size 4"),
        (["--n-embd", "100", "--n-head", "3"], "must be divisible by --n-head"),
        (["--steps", "0"], "--steps must be an int >= 1"),
        (["--warmup-steps", "50", "--steps", "50"], "--warmup-steps 50 must be below --steps 50"),
        # --steps 1 was exempt: it trained at a twentieth of --lr
        (["--warmup-steps", "1", "--steps", "1"], "--warmup-steps 1 must be below --steps 1"),
        (["--warmup-steps", "5", "--steps", "3"], "(e.g. --warmup-steps 0)"),
        (["--min-lr", "1", "--lr", "0.1"], "must not exceed --lr"),
        (["--val-fraction", "1.5"], "--val-fraction must be in (0, 1)"),
        # NaN passed every comparison; inf lr / a timeout past timedelta's range crashed ranks.
        (["--lr", "nan"], "--lr must be a number; got nan"),
        (["--lr", "-0.1"], "--lr must be > 0; got -0.1"),  # said >= 0, then refused 0
        (["--lr", "inf"], "--lr must be finite; got inf"),
        (["--min-lr", "nan"], "--min-lr must be a number"),
        (["--weight-decay", "nan"], "--weight-decay must be a number"),
        (["--grad-clip", "nan"], "--grad-clip must be a number"),
        (["--collective-timeout", "inf"], "--collective-timeout must be > 0 and at most 1e+09"),
        (["--collective-timeout", "1e30"], "--collective-timeout must be > 0 and at most 1e+09"),
        (["--seed", str(2**64)], "--seed must be below 2**64"),
        (["--data", ""], "--data is an empty string; omit it"),  # was: train on the cwd
        (["--cache-dir", ""], "--cache-dir is an empty string; omit it"),
        # was: trained on the flags' defaults as if no file had been named
        (["--deepspeed-config", ""], "--deepspeed-config is an empty string; omit it"),
        # stepping inside backward: no global norm to clip to, no step left to skip
        (["--step-in-backward"], "cannot clip to it: pass --grad-clip 0"),
        (
            ["--step-in-backward", "--grad-clip", "0", "--on-nonfinite", "skip"],
            "a non-finite step cannot be skipped: pass --on-nonfinite stop",
        ),
        (
            ["--step-in-backward", "--grad-clip", "0", "--optim", "onebit_adam", "--zeropp", "off"],
            "communicates in its step",
        ),
        (
            ["--step-in-backward", "--grad-clip", "0", "--parallel", "hsdp", "--zeropp", "off"],
            "pass --parallel zero3",
        ),
        # micro-batches: equal, of at least one sequence each
        (["--grad-accum-steps", "0"], "--grad-accum-steps must be an int >= 1; got 0"),
        (
            ["--grad-accum-steps", "3"],  # 8 sequences over 4 ranks: 2 each
            "--grad-accum-steps 3 must divide each rank's 2 sequences (--batch-size 8 over 4 "
            "ranks) into equal micro-batches: pass --grad-accum-steps among 1, 2, or "
            "--batch-size 12",
        ),
        (
            ["--grad-accum-steps", "4", "--nproc", "1", "--batch-size", "6"],
            "each rank's 6 sequences (--batch-size 6 over 1 rank) into equal micro-batches: pass "
            "--grad-accum-steps among 1, 2, 3, 6, or --batch-size 8",
        ),
    ],
)
def test_bad_combinations_are_refused_with_the_fix(argv, message, capsys):
    with pytest.raises(ValueError, match=None) as info:
        config_from_args(argv)
    assert message in str(info.value)
    # The command prints the same message and exits 2, before launching anything.
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("steps", "warmup", "said"),
    [
        (1, 0, "no warm-up instead"),  # ran silently at lr / 20
        (3, 0, "no warm-up instead"),  # refused: "--warmup-steps 20 must be below --steps 3"
        (15, 1, "warming up over 1 step instead"),
        (20, 2, "warming up over 2 steps instead"),
        (21, 20, None),  # the default fits: kept, nothing said
    ],
)
def test_a_short_run_fits_the_default_warmup_and_says_so(steps, warmup, said, capsys):
    from qshard.train.schedule import learning_rate

    cfg = config_from_args(["--steps", str(steps)])
    assert cfg.warmup_steps == warmup
    err = capsys.readouterr().err
    if said is None:
        assert err == ""
    else:
        assert (
            f"note: --warmup-steps defaults to 20, which does not end before --steps {steps}" in err
        )
        assert said in err and "pass --warmup-steps to choose" in err
    if steps == 1:
        assert learning_rate(0, cfg) == cfg.lr  # the one step is at the peak, not lr / 20


def test_defaults_that_cannot_fit_are_noted_once_and_only_for_a_valid_run(capsys, monkeypatch):
    # --lr below the default --min-lr was refused naming --min-lr, a flag never given.
    cfg = config_from_args(["--lr", "1e-4"])
    assert cfg.min_lr == pytest.approx(1e-5)
    assert "note: --min-lr defaults to 0.0003, above --lr 0.0001" in capsys.readouterr().err
    assert config_from_args(["--lr", "1e-3"]).min_lr == 3e-4  # fits: unchanged
    with pytest.raises(ValueError, match=r"--min-lr 0\.001 must not exceed --lr 0\.0001"):
        config_from_args(["--lr", "1e-4", "--min-lr", "1e-3"])  # given: never changed
    # A run refused for another reason prints only its error.
    assert main(["--steps", "3", "--nproc", "3"]) == 2
    err = capsys.readouterr().err
    assert "must be divisible by the number of ranks 3" in err and "note:" not in err
    assert "e.g. --batch-size 6" in err
    # On --resume the batch size is the run's: the fix is --nproc (it suggested --batch-size 3,
    # which the resume then refused as another batch size than the checkpoint's).
    with pytest.raises(ValueError) as refused:
        TrainConfig(nproc=3, batch_size=4, resume=True)
    assert str(refused.value).endswith(
        "a --resume keeps the run's batch size: pass --nproc among 1, 2, 4"
    )
    # Under torchrun every rank parses the flags; rank 0 alone says it.
    for var, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(var, value)
    assert config_from_args(["--steps", "3", "--batch-size", "2"]).warmup_steps == 0
    assert capsys.readouterr().err == ""


def test_unknown_and_mistyped_flags_are_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--stepz", "3"])
    assert info.value.code == 2
    assert "unrecognized arguments: --stepz" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--optim", "sgd"])
    assert "invalid choice: 'sgd'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--step", "3"])  # no silent prefix matching


def test_parse_zeropp():
    assert parse_zeropp("off") == frozenset()
    assert parse_zeropp("ALL") == frozenset({"qwz", "hpz", "qgz"})
    assert parse_zeropp(" qgz , qwz") == frozenset({"qgz", "qwz"})
    with pytest.raises(ValueError, match="comma list"):
        parse_zeropp("")


def test_bad_data_paths_fail_before_launch(tmp_path, capsys):
    base = ["--nproc", "2", "--out", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "c")]
    assert main([*base, "--data", str(tmp_path / "missing.txt")]) == 2
    assert "does not exist; pass a text file or a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([*base, "--data", str(tmp_path / "empty")]) == 2
    assert "holds no (non-hidden) files" in capsys.readouterr().err
    (tmp_path / "blank.txt").write_text("")
    assert main([*base, "--data", str(tmp_path / "blank.txt")]) == 2
    assert "is empty" in capsys.readouterr().err
    (tmp_path / "short.txt").write_text("tiny")
    assert main([*base, "--data", str(tmp_path / "short.txt")]) == 2
    assert "shorter --context" in capsys.readouterr().err


def test_an_out_that_cannot_be_written_fails_before_launch(tmp_path, capsys, monkeypatch):
    """An --out under a file, a file, or a folder that refuses writes: one error naming the fix,
    no rank started, nothing created. (Before: rank 0 crashed with a bare OSError traceback, the
    other ranks waited to be killed, and the report suggested --max-restarts.)"""
    import qshard.train.cli as cli

    (tmp_path / "text.txt").write_text("hello world\n" * 2000)
    base = ["--nproc", "2", "--data", str(tmp_path / "text.txt")]
    base += ["--cache-dir", str(tmp_path / "c")]
    launched = []
    monkeypatch.setattr(cli, "launch", launched.append)
    a_file = tmp_path / "text.txt"
    for out in (a_file, a_file / "run"):
        assert main([*base, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--out {out} cannot be the run directory ({a_file}: not a folder)" in err
        assert "pass --out a folder you can write to" in err
    # A folder without write permission (chmod does not stop root: refuse the probe file).
    real_mkstemp = tempfile.mkstemp

    def read_only(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == tmp_path / "ro":
            raise PermissionError(13, "Permission denied")
        return real_mkstemp(*args, dir=dir, **kwargs)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr("tempfile.mkstemp", read_only)
    assert main([*base, "--out", str(tmp_path / "ro/run")]) == 2
    err = capsys.readouterr().err
    assert f"({tmp_path / 'ro'}: cannot write in it (Permission denied))" in err
    assert not (tmp_path / "ro/run").exists() and launched == []


def test_resume_without_checkpoint_fails_before_launch(tmp_path, capsys):
    (tmp_path / "text.txt").write_text("hello world\n" * 2000)
    argv = [
        "--nproc",
        "2",
        "--out",
        str(tmp_path / "run"),
        "--resume",
        "--data",
        str(tmp_path / "text.txt"),
        "--cache-dir",
        str(tmp_path / "c"),
    ]
    assert main(argv) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def _checkpoint(
    tmp_path: Path, step: int, config: dict | None = None, *, metadata: bool = True
) -> Path:
    """A corpus file and a ``run/checkpoints/step_N`` folder for the launcher's checks: its
    ``qshard.json`` (the saved ``config``) and, with ``metadata``, DCP's ``.metadata``."""
    (tmp_path / "text.txt").write_text("hello world\n" * 2000)
    folder = tmp_path / f"run/checkpoints/step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / "qshard.json").write_text(json.dumps({"step": step, "config": config or {}}))
    if metadata:
        (folder / ".metadata").write_bytes(b"")
    return folder


def _argv(tmp_path: Path, *flags: str) -> list[str]:
    """The launcher's arguments for 2 ranks, ``--out tmp/run`` and :func:`_checkpoint`'s
    corpus, with ``flags``."""
    data = ["--data", str(tmp_path / "text.txt"), "--cache-dir", str(tmp_path / "c")]
    return ["--nproc", "2", "--out", str(tmp_path / "run"), *flags, *data]


def test_resume_with_other_model_options_is_refused(tmp_path, capsys):
    _checkpoint(tmp_path, 10, {"n_embd": 64}, metadata=False)
    assert main(_argv(tmp_path, "--resume", "--n-embd", "32")) == 2
    assert "was written with --n-embd 64 (now 32); pass the same options" in capsys.readouterr().err


def test_failure_report_names_every_rank_whatever_its_error_file_holds(tmp_path):
    """The launcher's report of a failed job: ranks that raised first, then killed ones, each
    with its reason. A rank without an error file (an exception that is not an ``Exception``,
    e.g. DCP's ``CheckpointException``, escapes ``@record``) has elastic's placeholder
    ``{"message": "<NONE>"}``: the report crashed on it with ``AttributeError``."""
    recorded = tmp_path / "error.json"
    recorded.write_text(
        json.dumps(
            {"message": {"message": "RankFailure: rank 2 lost", "extraInfo": {"timestamp": "1"}}}
        )
    )
    failures = {
        0: ProcessFailure(local_rank=0, pid=100, exitcode=-9, error_file=str(tmp_path / "none")),
        1: ProcessFailure(local_rank=1, pid=101, exitcode=1, error_file=str(tmp_path / "none")),
        2: ProcessFailure(local_rank=2, pid=102, exitcode=1, error_file=str(recorded)),
    }
    text = _report(ChildFailedError("train", failures), TrainConfig(out=str(tmp_path), nproc=4))
    lines = text.splitlines()
    assert lines[0] == "qshard train: error: the job failed:"
    assert (
        lines[1]
        == "  rank 1 (pid 101) failed (exit code 1): no error recorded (its traceback is printed above)"
    )
    assert lines[2] == "  rank 2 (pid 102) failed (exit code 1): RankFailure: rank 2 lost"
    assert lines[3] == "  rank 0 (pid 100) was killed by SIGKILL"
    assert "no complete checkpoint was written" in lines[4]


def test_rank_tracebacks_go_to_a_file_the_report_names(tmp_path, capsys):
    """torch elastic logged every failed rank's whole traceback (37 lines of ``E...`` for one
    rank) on the terminal before the report. The launcher's filter writes those records to
    OUT/failures.log, which the report names; any other record of that logger, or one the file
    cannot take, still reaches the terminal."""
    import logging

    import torch.multiprocessing as mp

    from qshard.train.cli import _ELASTIC_LOGGER, _RankTracebacks

    logger = logging.getLogger(_ELASTIC_LOGGER)
    seen: list[logging.LogRecord] = []
    terminal = logging.Handler()
    terminal.emit = seen.append
    logger.addHandler(terminal)
    child = (
        "\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call "
        'last):\n  File "loop.py", line 9, in _step\nqshard.train.loop.RankFailure: rank 1: '
        "step 3: loss nan"
    )

    def fail() -> None:
        try:
            raise mp.ProcessRaisedException(child, 1, 4242)
        except mp.ProcessRaisedException:
            logger.exception("failed (exitcode: %s) local_rank: %s", 1, 1)
        logger.warning("Sending process 4241 closing signal SIGTERM")

    try:
        tracebacks = _RankTracebacks(TrainConfig(out=str(tmp_path), max_restarts=1))
        with tracebacks.installed():
            fail()
        assert [r.getMessage() for r in seen] == ["Sending process 4241 closing signal SIGTERM"]
        log = (tmp_path / "failures.log").read_text()
        assert "failed (exitcode: 1) local_rank: 1" in log and "Traceback" in log
        assert 'File "loop.py", line 9, in _step' in log and "step 3: loss nan" in log
        # with restarts, the next attempt follows: one line says why, naming the file
        assert capsys.readouterr().err == (
            "qshard train: rank 1 (pid 4242) failed: RankFailure: rank 1: step 3: loss nan; its "
            f"traceback is in {tmp_path / 'failures.log'}\n"
        )
        fail()  # the filter is gone with the launch
        assert len(seen) == 3
        seen.clear()
        (tmp_path / "file").write_text("")  # an --out the log cannot go into: nothing is lost
        unwritable = _RankTracebacks(TrainConfig(out=str(tmp_path / "file"), max_restarts=0))
        with unwritable.installed():
            fail()
        assert len(seen) == 2 and not unwritable.written
    finally:
        logger.removeHandler(terminal)
    failures = {
        1: ProcessFailure(local_rank=1, pid=4242, exitcode=1, error_file=str(tmp_path / "none"))
    }
    text = _report(
        ChildFailedError("train", failures),
        TrainConfig(out=str(tmp_path), nproc=2),
        tracebacks=tmp_path / "failures.log",
    ).splitlines()
    assert text[1] == (
        "  rank 1 (pid 4242) failed (exit code 1): no error recorded (its traceback is in "
        f"{tmp_path / 'failures.log'})"
    )
    assert text[2] == f"  (the tracebacks are in {tmp_path / 'failures.log'})"


def test_failure_hint_skips_checkpoints_that_fail_their_checks(tmp_path):
    """The report's last line names the checkpoint a --resume can continue from: it named the
    newest complete one even when that one had just been refused as damaged (its bytes changed
    since the save), so following it failed the same way."""
    import zlib

    root = tmp_path / "checkpoints"

    def fake(step: int, data: bytes, saved: bytes) -> Path:
        path = root / f"step_{step:08d}"
        path.mkdir(parents=True)
        (path / ".metadata").write_bytes(data)
        sums = {".metadata": {"bytes": len(saved), "crc32": f"{zlib.crc32(saved):08x}"}}
        info = {"step": step, "world_size": 1, "format": "dcp", "files": sums}
        (path / "qshard.json").write_text(json.dumps(info))
        return path

    config = TrainConfig(out=str(tmp_path), nproc=2)
    killed = {0: ProcessFailure(local_rank=0, pid=100, exitcode=-9, error_file=str(tmp_path / "x"))}
    report = _report(ChildFailedError("train", killed), config).splitlines()[-1]
    assert report.startswith("no complete checkpoint was written: rerun from the start")
    old = fake(2, b"intact", b"intact")
    report = _report(ChildFailedError("train", killed), config).splitlines()[-1]
    assert f"the newest complete checkpoint is {old}: rerun with --resume" in report
    new = fake(4, b"xxxxxx", b"intact")  # same size, other bytes
    report = _report(ChildFailedError("train", killed), config).splitlines()[-1]
    assert report.startswith(f"the newest complete checkpoint {new.name} (.metadata cannot be ")
    assert f"is damaged: move it out of {root} and rerun with --resume" in report
    assert report.endswith(
        f"to continue from {old}, or pass --max-restarts N to restart automatically"
    )
    (old / ".metadata").write_bytes(b"zzzzzz")
    report = _report(ChildFailedError("train", killed), config).splitlines()[-1]
    assert report.startswith("no checkpoint passes its checks (step_00000004 (")
    assert "step_00000002 (" in report and "rerun from the start" in report

    # The final checkpoint of a run that died exporting: --resume finishes it (the hint said
    # "continue", and that --resume was refused: "leaves nothing to train").
    shutil.rmtree(root)
    final = fake(200, b"intact", b"intact")
    report = _report(ChildFailedError("train", killed), config).splitlines()[-1]
    assert report.startswith(f"the final checkpoint {final} is complete: rerun with --resume to ")
    assert "finish the run (the export and summary; nothing is trained again)" in report


def test_resume_from_a_damaged_checkpoint_fails_before_launch(tmp_path, capsys):
    """A newest checkpoint with a broken qshard.json (the message was json's own, naming no
    file, or an AttributeError for a non-object) or without its state files is refused by the
    launcher, naming the folder and the fix."""
    (tmp_path / "text.txt").write_text("hello world\n" * 2000)
    ckpt_dir = tmp_path / "run/checkpoints/step_00000010"
    ckpt_dir.mkdir(parents=True)
    argv = ["--nproc", "2", "--out", str(tmp_path / "run"), "--resume"]
    argv += ["--data", str(tmp_path / "text.txt"), "--cache-dir", str(tmp_path / "c")]
    for text, message in (
        ('{"step": 10', "qshard.json cannot be read (Expecting ',' delimiter"),
        ("[10]", "qshard.json holds list, not an object"),
        ('{"step": 10}', "step_00000010 has qshard.json but no DCP .metadata: it is damaged"),
    ):
        (ckpt_dir / "qshard.json").write_text(text)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "move it out of the checkpoints folder" in err, err


def test_resume_from_a_damaged_checkpoint_names_the_newest_intact_one(tmp_path, capsys):
    """--resume does not fall back (the user decides), but names where it could resume from:
    the newest earlier checkpoint that passes the file checks (a damaged one in between is not
    it)."""
    (tmp_path / "text.txt").write_text("hello world\n" * 2000)
    checkpoints = tmp_path / "run/checkpoints"
    for step, files in ((4, {".metadata": ""}), (6, {}), (8, {".metadata": ""})):
        folder = checkpoints / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / "qshard.json").write_text(json.dumps({"step": step, "config": {}}))
        for name, text in files.items():
            (folder / name).write_text(text)
    (checkpoints / "step_00000008/qshard.json").write_text('{"step": 8')
    argv = ["--nproc", "2", "--out", str(tmp_path / "run"), "--resume", "--steps", "50"]
    argv += ["--data", str(tmp_path / "text.txt"), "--cache-dir", str(tmp_path / "c")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "step_00000008/qshard.json cannot be read" in err, err
    assert (
        "the newest earlier checkpoint that passes the file checks (qshard.json and state files "
        f"there) is {checkpoints / 'step_00000004'}" in err
    ), err
    assert (checkpoints / "step_00000008").is_dir()  # nothing moved: the user decides


def test_resume_refuses_a_newest_step_folder_without_qshard_json(tmp_path, capsys):
    """A step_N folder that lost its qshard.json (no save leaves one: the file is written
    before the rename) but kept its shards was skipped as incomplete: an explicit --resume went
    on from the older checkpoint without a word. It is refused before launch like any damaged
    newest checkpoint, naming it and the intact one; the failure report's hint says the same."""
    (tmp_path / "text.txt").write_text("hello world\n" * 2000)
    checkpoints = tmp_path / "run/checkpoints"
    for step in (5, 10):
        folder = checkpoints / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / "qshard.json").write_text(json.dumps({"step": step, "config": {}}))
        (folder / ".metadata").write_bytes(b"")
        (folder / "__0_0.distcp").write_bytes(b"shard")
    (checkpoints / "step_00000010/qshard.json").unlink()
    argv = ["--nproc", "2", "--out", str(tmp_path / "run"), "--resume", "--steps", "50"]
    argv += ["--data", str(tmp_path / "text.txt"), "--cache-dir", str(tmp_path / "c")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        f"--resume: {checkpoints / 'step_00000010'} has no qshard.json, which a save writes "
        "before the folder takes its name: it is damaged" in err
    ), err
    assert (
        f"passes the file checks (qshard.json and state files there) is {checkpoints / 'step_00000005'}"
        in err
    )
    killed = {0: ProcessFailure(local_rank=0, pid=100, exitcode=-9, error_file=str(tmp_path / "x"))}
    config = TrainConfig(out=str(tmp_path / "run"), nproc=2)
    hint = _report(ChildFailedError("train", killed), config).splitlines()[-1]
    assert hint.startswith("the newest complete checkpoint step_00000010 (has no qshard.json"), hint
    assert f"to continue from {checkpoints / 'step_00000005'}" in hint
    (checkpoints / "step_00000005").rename(checkpoints / "old")  # no earlier one: said so
    assert main(argv) == 2
    assert "; no earlier checkpoint passes the file checks" in capsys.readouterr().err


def test_resume_with_a_bad_metrics_line_fails_before_launch(tmp_path, capsys, monkeypatch):
    """A metrics.jsonl line that is not a record (other than a torn last one) was refused only
    by rank 0's MetricsWriter, after the model was built, and the failure report then said
    "rank 0 had logged step 5", read from the old file, of a launch that trained nothing. The
    launcher refuses it first, naming the file's own line number (blank lines counted)."""
    import qshard.train.cli as cli

    _checkpoint(tmp_path, 3)
    run = tmp_path / "run"
    records = [json.dumps({"step": step, "loss": 5.0}) for step in range(6)]
    (run / "metrics.jsonl").write_text("\n".join([records[0], "", "garbage", *records[2:]]))
    launched = []
    monkeypatch.setattr(cli, "launch", launched.append)
    argv = _argv(tmp_path, "--resume", "--steps", "40")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"qshard train: error: --resume: {run / 'metrics.jsonl'} line 3 is not a JSON record ("
    ), err
    assert err.rstrip().endswith("); remove that line") and launched == []
    # a torn last line is a crash's, dropped on resume: no refusal
    (run / "metrics.jsonl").write_text("\n".join([*records, '{"step": 6, "lo']))
    assert main(argv) == 0 and len(launched) == 1


def test_resume_with_nothing_left_to_train_fails_before_launch(tmp_path, capsys, monkeypatch):
    """--resume from a checkpoint at or past --steps trained nothing, said "resumed" and
    overwrote the finished run's summary with an empty one. A run that stopped after its final
    checkpoint without its summary (a rank died exporting) is finished by that --resume."""
    import qshard.train.cli as cli

    _checkpoint(tmp_path, 10)
    argv = _argv(tmp_path, "--resume", "--warmup-steps", "1")
    launched = []
    monkeypatch.setattr(cli, "launch", launched.append)
    assert main([*argv, "--steps", "10"]) == 0 and len(launched) == 1  # unfinished: finish it
    # an extended run's earlier launch's summary (it finished at step 6): still unfinished
    summary = tmp_path / "run/summary.json"
    summary.write_text(json.dumps({"start_step": 0, "steps_trained": 6}))
    assert main([*argv, "--steps", "10"]) == 0 and len(launched) == 2
    summary.write_text(json.dumps({"start_step": 6, "steps_trained": 4}))  # finished at 10
    for steps in ("10", "4"):
        assert main([*argv, "--steps", steps]) == 2
        err = capsys.readouterr().err
        assert f"is at step 10, so --steps {steps} leaves nothing to train" in err, err
        assert "pass --steps above 10 to continue that run" in err
    assert len(launched) == 2


def test_a_fresh_run_over_an_earlier_one_is_refused_before_launch(tmp_path, capsys):
    """A run without --resume in an --out holding checkpoints: refused, naming --resume and
    --overwrite, before any rank starts and without touching them (a forgotten --resume must
    not delete a long run's checkpoints; ./run.sh passes --overwrite)."""
    ckpt_dir = _checkpoint(tmp_path, 10)
    argv = _argv(tmp_path, "--steps", "4", "--warmup-steps", "1")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "holds an earlier run's checkpoints (newest: " in err, err
    assert "--resume" in err and "--overwrite" in err
    assert (ckpt_dir / "qshard.json").is_file()
    assert "--overwrite" in (Path(__file__).parents[2] / "run.sh").read_text()
    # A damaged checkpoint (a step folder whose qshard.json is gone, its shards kept) counts
    # too: passed over as incomplete, the fresh run deleted it without a word.
    (ckpt_dir / "qshard.json").unlink()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"holds an earlier run's checkpoints (newest: {ckpt_dir})" in err, err
    assert (ckpt_dir / ".metadata").is_file()


def test_resume_of_a_per_rank_checkpoint_with_another_parallel_is_refused(tmp_path, capsys):
    """0/1 Adam's per-rank files hold each rank's part of the model: replicated (zero3) and HSDP
    parts differ. Before, the ranks failed with a bare tensor size mismatch."""
    _checkpoint(tmp_path, 10, {"optim": "zero_one_adam", "parallel": "zero3"}, metadata=False)
    argv = _argv(tmp_path, "--resume", "--optim", "zero_one_adam", "--zeropp", "off")
    argv += ["--parallel", "hsdp", "--ranks-per-node", "2"]
    assert main(argv) == 2
    assert "was written with --parallel zero3 (now hsdp)" in capsys.readouterr().err


def test_resume_with_another_seed_or_corpus_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    import qshard.train.cli as cli

    launched = []
    monkeypatch.setattr(cli, "launch", launched.append)
    (tmp_path / "text.txt").write_text("hello world\n" * 2000)
    (tmp_path / "other.txt").write_text("another text\n" * 2000)
    run = TrainConfig(data=str(tmp_path / "text.txt"), nproc=2, out=str(tmp_path / "run"))
    ckpt_dir = tmp_path / "run/checkpoints/step_00000010"
    ckpt_dir.mkdir(parents=True)
    (ckpt_dir / "qshard.json").write_text(json.dumps(_saved(run)))
    argv = ["--nproc", "2", "--out", str(tmp_path / "run"), "--resume", "--seed", "1"]
    argv += ["--data", str(tmp_path / "other.txt"), "--cache-dir", str(tmp_path / "c")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        f"was written with --seed 0 (now 1), --data {tmp_path / 'text.txt'} "
        f"(now {tmp_path / 'other.txt'}); pass the same options to resume it" in err
    ), err
    assert "or a new --out to start fresh" in err and launched == []


def test_a_second_job_in_a_run_directory_in_use_is_refused(tmp_path, capsys, monkeypatch):
    """Two jobs in one --out (a command started twice, two ./run.sh with --overwrite): before,
    both ran, truncating each other's metrics.jsonl, saving checkpoints side by side and
    removing each other's. The launcher claims --out until its job ends."""
    import qshard.train.cli as cli

    (tmp_path / "text.txt").write_text("hello world\n" * 2000)
    launched = []
    monkeypatch.setattr(cli, "launch", launched.append)
    out = tmp_path / "run"
    argv = ["--nproc", "2", "--out", str(out), "--overwrite", "--data", str(tmp_path / "text.txt")]
    argv += ["--cache-dir", str(tmp_path / "c")]
    with cli.claim_run_dir(str(out), create=True):  # the first job, still running
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"--out {out} is in use by another qshard train job (pid {os.getpid()} on " in err
        assert "wait for it to end, or pass another --out" in err
        assert launched == []
    assert main(argv) == 0 and len(launched) == 1  # ended: the folder is free again
    assert main(argv) == 0 and len(launched) == 2  # and the launcher released its own claim


def test_resume_of_per_rank_hsdp_checkpoints_with_other_ranks_per_node_is_refused_before_launch(
    tmp_path, capsys, monkeypatch
):
    """1-bit Adam on --parallel hsdp saves per-rank files holding each rank's shard of its
    node's model: resumed with another number of ranks per node (4 ranks as 2 x 2, then 2 as
    2 x 1) the ranks refused it after they had started, and the report suggested --resume or
    --max-restarts, which fail alike. Now refused before launch, naming --ranks-per-node."""
    import qshard.train.cli as cli

    launched = []
    monkeypatch.setattr(cli, "launch", launched.append)
    (tmp_path / "text.txt").write_text("hello world\n" * 2000)
    flags = {"parallel": "hsdp", "optim": "onebit_adam", "zeropp": "off"}
    run = TrainConfig(data=str(tmp_path / "text.txt"), nproc=4, out=str(tmp_path / "run"), **flags)
    ckpt_dir = tmp_path / "run/checkpoints/step_00000010"
    ckpt_dir.mkdir(parents=True)
    (ckpt_dir / "qshard.json").write_text(json.dumps({**_saved(run), "format": "per_rank"}))
    argv = ["--out", str(tmp_path / "run"), "--resume", "--data", str(tmp_path / "text.txt")]
    argv += ["--cache-dir", str(tmp_path / "c"), "--parallel", "hsdp", "--optim", "onebit_adam"]
    argv += ["--zeropp", "off"]
    assert main([*argv, "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert (
        f"--resume: {ckpt_dir} holds per-rank HSDP checkpoints of 2 ranks per node (4 ranks), "
        "1 here" in err
    ), err
    assert "pass --ranks-per-node 2" in err and launched == []
    # The same layout gets past this check (to the state files' own checks).
    main([*argv, "--nproc", "2", "--ranks-per-node", "2"])
    assert "holds per-rank HSDP checkpoints" not in capsys.readouterr().err


def test_a_full_disk_is_named_with_its_fix(tmp_path, monkeypatch):
    """A full disk under --out (a first-user probe on a 2 MiB tmpfs): the launcher died with a
    raw traceback writing its lock file (creating the empty file needed no space), a rank's
    report said only "OSError: [Errno 28] No space left on device", and a DCP save into it was
    reported by its last line, the torch.save error the full disk led to."""
    import builtins

    import qshard.train.cli as cli
    from qshard.train.checkpoint import _last_line

    class _FullFile:
        def __init__(self, file):
            self.file = file

        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.file, name)

    real_open = builtins.open
    monkeypatch.setattr(cli, "open", lambda *a, **k: _FullFile(real_open(*a, **k)), raising=False)
    with pytest.raises(ValueError) as refused:
        cli.claim_run_dir(str(tmp_path / "run"), create=True)
    assert str(refused.value) == (
        f"--out {tmp_path / 'run'}: cannot write {tmp_path / 'run' / '.qshard.lock'} (No space "
        "left on device); free space on the file system that holds --out (checkpoints, metrics, "
        "the export), or pass another --out"
    )
    monkeypatch.undo()

    (tmp_path / "error.json").write_text(
        json.dumps(
            {
                "message": {
                    "message": "OSError: [Errno 28] No space left on device",
                    "extraInfo": {"timestamp": "0"},
                }
            }
        )
    )
    failures = {
        0: ProcessFailure(local_rank=0, pid=11, exitcode=1, error_file=str(tmp_path / "error.json"))
    }
    text = _report(ChildFailedError("train", failures), TrainConfig(out=str(tmp_path))).splitlines()
    assert text[2] == (
        "  (a disk is full: free space on the file system that holds --out (checkpoints, metrics, "
        f"the export), or pass another --out; --out is {tmp_path})"
    )
    dcp_error = RuntimeError(
        '[rank0]: Traceback (most recent call last):\n  File "x.py", line 1, in save\n'
        "OSError: [Errno 28] No space left on device\n\nDuring handling of the above...\n"
        "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    )
    assert _last_line(dcp_error) == "OSError: [Errno 28] No space left on device"
    assert _last_line(RuntimeError("a\nb\nlast words")) == "last words"
