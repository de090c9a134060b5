"""The training application on a bare ``pip install qshard`` (no ``[train]`` extra): a first
user's ``qshard train`` died in every rank with ``No module named 'tqdm'`` (the progress bar is
on by default) and ``qshard report`` with a traceback about matplotlib."""

from __future__ import annotations

import importlib.util

import pytest

from qshard.train import report
from qshard.train._parallel import missing_features
from qshard.train.cli import config_from_args


@pytest.fixture
def without(monkeypatch):
    """Make ``importlib.util.find_spec`` say the named modules are not installed."""
    real = importlib.util.find_spec

    def hide(*names: str) -> None:
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a: None if name in names else real(name, *a)
        )

    return hide


def test_no_tqdm_turns_the_default_progress_bar_off_and_says_so(without, capsys):
    without("tqdm")
    cfg = config_from_args(["--steps", "30"])
    assert cfg.progress is False and missing_features(cfg) == []
    assert "no progress bar: tqdm is not installed (pip install 'qshard[train]'" in (
        capsys.readouterr().err
    )
    # asked for by name: refused before any rank starts, naming both ways out
    cfg = config_from_args(["--steps", "30", "--progress"])
    (problem,) = missing_features(cfg)
    assert "--progress needs tqdm" in problem and "--no-progress" in problem
    assert config_from_args(["--steps", "30", "--no-progress"]).progress is False
    assert capsys.readouterr().err == ""


def test_report_without_matplotlib_is_one_line(without, tmp_path, capsys):
    without("matplotlib")
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("qshard report: error: the plots need matplotlib") and err.count("\n") == 1
    )


def test_paths_given_as_flag_equals_tilde_are_expanded(monkeypatch, tmp_path):
    # `--out=~/runs`: the shell leaves ~ alone after "=", and a folder named "~" appeared in
    # the current directory (inviting a later `rm -rf ~`)
    from qshard.train.data import default_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = config_from_args(["--out=~/runs", "--cache-dir=~/cache", "--no-progress"])
    assert (cfg.out, cfg.cache_dir) == (str(tmp_path / "runs"), str(tmp_path / "cache"))
    monkeypatch.setenv("QSHARD_CACHE", "~/qc")
    assert default_cache_dir() == tmp_path / "qc"
    monkeypatch.delenv("QSHARD_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    assert default_cache_dir() == tmp_path / ".cache" / "qshard"
