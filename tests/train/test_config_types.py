"""TrainConfig built in Python (not by the CLI's parser): each field's kind is checked and
named with its flag."""

from __future__ import annotations

import pytest

from qshard.train.config import TrainConfig


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("resume", "no", r"TrainConfig.resume \(--resume\) must be True or False; got 'no'"),
        ("export", "false", r"TrainConfig.export \(--export\) must be True or False"),
        ("progress", 0, r"TrainConfig.progress \(--progress\) must be True or False; got 0"),
        ("lr", "0.001", r"TrainConfig.lr \(--lr\) must be a number; got '0.001'"),
        ("val_fraction", None, r"TrainConfig.val_fraction \(--val-fraction\) must be a number"),
        ("steps", 10.0, r"TrainConfig.steps \(--steps\) must be an int; got 10.0"),
        ("zeropp", None, r"TrainConfig.zeropp \(--zeropp\) must be a string; got None"),
        ("data", 123, r"TrainConfig.data \(--data\) must be a path or None; got 123"),
    ],
)
def test_train_config_built_in_python_checks_each_fields_kind(field, value, message):
    """Built in Python, not by the CLI's parser: ``resume="no"`` resumed (a non-empty string is
    true), ``lr="0.001"`` failed with "must be real number, not str" and ``zeropp=None`` with an
    AttributeError; each field's kind is now checked and named with its flag."""
    with pytest.raises(TypeError, match=message):
        TrainConfig(**{field: value})


def test_train_config_takes_paths_as_path_objects(tmp_path):
    cfg = TrainConfig(out=tmp_path / "run", data=tmp_path, cache_dir=None)
    assert cfg.out == str(tmp_path / "run") and cfg.data == str(tmp_path)
