"""metrics.jsonl is strict JSON: non-finite values (a skipped step's NaN loss) are written as
null and named under "nonfinite"; resume and `qshard report` read them back as floats, and
still read files written before with Python's bare NaN / Infinity."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from qshard.train._metrics import MetricsWriter, decode_record, encode_record
from qshard.train.report import load_metrics


def _strict(line: str) -> dict:
    """json.loads as jq or JavaScript parse: NaN, Infinity and -Infinity are errors."""

    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(line, parse_constant=refuse)


RECORD = {
    "step": 3,
    "loss": math.nan,
    "lr": 1e-3,
    "grad_norm": math.inf,
    "val_loss": -math.inf,
    "skipped": True,
    "ledger": {"fwd/all_gather": {"intra": 10.0, "inter": math.nan}, "bwd/rs": {"intra": 1}},
}


def test_every_line_is_strict_json_naming_the_nonfinite_values(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write({"step": 0, "loss": 5.5, "grad_norm": 1.0})
    writer.write(RECORD)
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first, second = (_strict(line) for line in lines)  # before: ValueError("not JSON: NaN")
    assert first == {"step": 0, "loss": 5.5, "grad_norm": 1.0}  # no "nonfinite" when all finite
    assert second["loss"] is None and second["grad_norm"] is None and second["val_loss"] is None
    assert second["ledger"]["fwd/all_gather"] == {"intra": 10.0, "inter": None}
    assert second["nonfinite"] == {
        "loss": "NaN",
        "grad_norm": "Infinity",
        "val_loss": "-Infinity",
        "ledger": {"fwd/all_gather": {"inter": "NaN"}},
    }
    assert second["lr"] == 1e-3 and second["skipped"] is True


def test_readers_get_the_floats_back(tmp_path):
    back = decode_record(encode_record(RECORD))
    assert math.isnan(back["loss"]) and math.isnan(back["ledger"]["fwd/all_gather"]["inter"])
    assert back["grad_norm"] == math.inf and back["val_loss"] == -math.inf
    assert "nonfinite" not in back
    assert {k: v for k, v in back.items() if k not in ("loss", "ledger")} == {
        k: v for k, v in RECORD.items() if k not in ("loss", "ledger")
    }
    writer = MetricsWriter(tmp_path)
    writer.write(RECORD)
    writer.close()
    (record,) = load_metrics(tmp_path)  # qshard report
    assert math.isnan(record["loss"]) and record["grad_norm"] == math.inf


def test_files_written_before_with_bare_nan_still_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 0, "loss": 5.5}\n{"step": 1, "loss": NaN, "grad_norm": Infinity}\n'
        '{"step": 2, "loss": 5.0}\n'
    )
    records = load_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2] and math.isnan(records[1]["loss"])
    # A resume keeps the records before its step and rewrites them as strict JSON.
    writer = MetricsWriter(tmp_path, resume_step=2)
    writer.write({"step": 2, "loss": -math.inf})
    writer.close()
    lines = [_strict(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]
    assert lines[1]["nonfinite"] == {"loss": "NaN", "grad_norm": "Infinity"}
    assert lines[2] == {"step": 2, "loss": None, "nonfinite": {"loss": "-Infinity"}}
    records = load_metrics(tmp_path)
    assert math.isnan(records[1]["loss"]) and records[2]["loss"] == -math.inf


def test_a_line_that_is_not_a_record_is_refused():
    with pytest.raises(ValueError):
        decode_record('{"step": 1, "lo')
    with pytest.raises(ValueError, match="JSON object"):
        decode_record("[1, 2]")


def test_summary_json_is_strict_json(tmp_path):
    """summary.json of a run whose last validation loss was NaN (a skipped run) parses strictly
    and reads back through decode_record."""
    from qshard.train._summary import write_summary

    result = {"val_losses": {"10": math.nan, "5": 2.5}, "skipped_steps": [9], "losses": [1.0]}
    write_summary(tmp_path, "text", result)
    data = _strict((tmp_path / "summary.json").read_text())
    assert data["val_losses"] == {"10": None, "5": 2.5}
    assert data["nonfinite"] == {"val_losses": {"10": "NaN"}}
    assert "losses" not in data
    back = decode_record((tmp_path / "summary.json").read_text())
    assert math.isnan(back["val_losses"]["10"]) and back["skipped_steps"] == [9]


def test_loss_curve_smoothing_skips_a_nonfinite_step():
    """One skipped step (NaN loss) leaves a gap in the plotted curve, not NaN from there on."""
    from qshard.train.report import _smooth

    out = _smooth([1.0, 3.0, math.nan, 5.0, 7.0, 9.0], 2)
    assert out[:2] == [1.0, 2.0] and out[2] == 3.0 and out[3] == 5.0 and out[4:] == [6.0, 8.0]
    assert math.isnan(_smooth([math.nan], 3)[0])


def test_report_of_a_killed_run_and_its_errors_name_the_fix(tmp_path, capsys):
    """`qshard report` of a run killed while writing a line plots the complete records (as
    --resume keeps them); a line that is no record elsewhere, and an --out that cannot be
    written, are one error each, exit 2 (all three were tracebacks)."""
    from qshard.train.report import main

    run = tmp_path / "run"
    run.mkdir()
    lines = [encode_record({"step": s, "loss": 5.0 - s, "inter_node_bytes": 1.0}) for s in (0, 1)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 2, "lo')
    assert [r["step"] for r in load_metrics(run)] == [0, 1]
    assert main([str(run)]) == 0
    assert (run / "loss.png").is_file() and (run / "bytes.png").is_file()
    capsys.readouterr()
    (run / "metrics.jsonl").write_text("\n".join(["garbage", *lines]) + "\n")
    assert main([str(run)]) == 2
    assert "metrics.jsonl line 1 is not a JSON record" in capsys.readouterr().err
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert main(["--out", str(a_file / "plots"), str(run)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the plots into {a_file / 'plots'}" in err
    assert "pass --out a folder you can write to" in err


def test_report_labels_runs_that_share_a_folder_name_by_their_paths(tmp_path):
    """Two runs named alike (a/run and b/run) were both labelled "run" in the legend."""
    from qshard.train.report import _labels

    assert _labels([tmp_path / "a/run", tmp_path / "b/run", tmp_path / "c"]) == [
        str(tmp_path / "a/run"),
        str(tmp_path / "b/run"),
        "c",
    ]
    assert _labels(["."]) == [Path.cwd().name]
