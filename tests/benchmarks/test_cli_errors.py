"""The benchmarks' command lines as a new contributor meets them: a bad value (``--steps 0``, a
negative size, an unknown name, an output path that cannot be written) stops the script at once
with a usage error naming the fix, not with a traceback from inside the run or after it; and the
timed reports record the host's load average, as docs/RESULTS.md says sections do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# (script, argv, words the error must contain). Each argv is otherwise tiny, so a script that
# does not check the value fails fast (a traceback, or a run that ends without the usage error).
BAD = [
    ("quant_throughput", ["--numel", "-1", "--repeat", "1", "--no-bnb"], "--numel: must be >= 1"),
    ("quant_throughput", ["--numel", "256", "--repeat", "0", "--no-bnb"], "--repeat: must be >= 1"),
    ("quant_error", ["--numel", "0"], "--numel: must be >= 1"),
    ("quant_error", ["--numel", "256", "--block-sizes", "0"], "--block-sizes: must be >= 1"),
    (
        "optim_step",
        ["--sizes", "1K", "--threads", "1", "--repeat", "0", "--warmup", "1"],
        "--repeat: must be >= 1",
    ),
    (
        "optim4bit_formats",
        ["--steps", "0", "--n-layer", "1", "--n-embd", "32", "--context", "8", "--formats", "0"],
        "--steps: must be >= 1",
    ),
    (
        "optim4bit_formats",
        ["--steps", "1", "--n-layer", "1", "--n-embd", "32", "--context", "8", "--formats", "99"],
        "pass comma separated indices",
    ),
    ("zero_one_adam", ["--steps", "0", "--world", "2", "--batch", "2"], "--steps: must be >= 1"),
    # One rank sends nothing: the bytes ratio divided by zero after the whole run.
    ("zero_one_adam", ["--steps", "2", "--world", "1", "--batch", "2"], "--world: must be >= 2"),
    (
        "zero_one_adam_lsq",
        ["--steps", "0", "--ranks", "1", "--lrs", "1e-2"],
        "--steps must be >= 1",
    ),
    ("comm_volume", ["--topologies", "2y2"], "is not NODESxRANKS_PER_NODE"),
    ("comm_volume", ["--topologies", "1x2"], "one node has no cross-node bytes"),
    ("overlap", ["--topology", "0x2", "--steps", "1"], "is not NODESxRANKS_PER_NODE"),
    ("optim8bit_nonfinite_cost", ["--rounds", "0", "--numel", "1000"], "--rounds must be >= 1"),
    (
        "optim8bit_nonfinite_cost",
        ["--rounds", "1", "--numel", "1000", "--base", "no-such-revision"],
        "is not a commit of this checkout",
    ),
]


@pytest.mark.parametrize(("script", "argv", "words"), BAD, ids=[f"{b[0]}:{b[2]}" for b in BAD])
def test_a_bad_value_is_a_usage_error(load_benchmark, capsys, script, argv, words):
    mod = load_benchmark(script)
    with pytest.raises(SystemExit) as exc:
        mod.main(argv)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def _unwritable(tmp_path):
    """Paths that cannot be written, even by root: under a file, and a folder."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    return [(str(a_file / "out.md"), "is a file, not a folder"), (str(tmp_path), "is a folder")]


def _no_cluster(*_args, **_kwargs):
    raise AssertionError("the emulated cluster was launched: the bad path was not refused first")


@pytest.mark.parametrize("flag", ["--out-md", "--out-json"])
@pytest.mark.parametrize("script", ["throughput", "step_profile"])
def test_unwritable_output_is_refused_before_the_run(
    load_benchmark, capsys, monkeypatch, tmp_path, script, flag
):
    mod = load_benchmark(script)
    # Never start the emulated cluster here (it needs root and network namespaces).
    import netsim.cluster

    for name in ("needs_root", "run_cluster_args", "run_in_cluster"):
        monkeypatch.setattr(netsim.cluster, name, _no_cluster, raising=False)
    for path, words in _unwritable(tmp_path):
        with pytest.raises(SystemExit) as exc:
            mod.main(["--steps", "1", flag, path])
        assert exc.value.code == 2
        assert words in capsys.readouterr().err


def test_unwritable_out_md_is_refused_before_the_run(load_benchmark, capsys, tmp_path):
    # Without the check quant_error measured everything, then failed writing the file.
    mod = load_benchmark("quant_error")
    for path, words in _unwritable(tmp_path):
        with pytest.raises(SystemExit) as exc:
            mod.main(["--numel", "256", "--block-sizes", "64", "--out-md", path])
        assert exc.value.code == 2
        assert words in capsys.readouterr().err


def test_out_md_in_a_missing_folder_is_created(load_benchmark, tmp_path):
    out = tmp_path / "new" / "deeper" / "qe.md"
    load_benchmark("quant_error").main(
        ["--numel", "256", "--block-sizes", "64", "--out-md", str(out)]
    )
    assert out.read_text().startswith("## qshard.quant error")


def test_from_json_that_is_missing_names_the_fix(load_benchmark, capsys, tmp_path):
    rc = load_benchmark("throughput").main(["--from-json", str(tmp_path / "none.json")])
    assert rc == 2
    assert "pass a file an earlier run wrote with --out-json" in capsys.readouterr().err


def test_quant_throughput_records_the_load_average(load_benchmark, tmp_path):
    out = tmp_path / "qt.md"
    load_benchmark("quant_throughput").main(
        ["--numel", "256", "--repeat", "1", "--block-size", "64", "--no-bnb", "--out-md", str(out)]
    )
    assert "Host load average" in out.read_text()


def test_nonfinite_cost_finds_its_checkout_from_any_directory(
    load_benchmark, monkeypatch, tmp_path
):
    # It asked git for the caller's working directory's checkout: run from outside the
    # repository it died with a CalledProcessError before measuring anything.
    mod = load_benchmark("optim8bit_nonfinite_cost")
    monkeypatch.chdir(tmp_path)
    assert mod._has_revision("HEAD")


@pytest.fixture
def one_rank_in_process(monkeypatch, tmp_path):
    """qshard.testing.run_world for a world of 1, in this process: a script loaded by path
    cannot be unpickled in a spawned rank."""
    import torch.distributed as dist

    import qshard.testing

    def run_world(fn, world_size, args=(), **_kwargs):
        assert world_size == 1
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
        )
        try:
            return [fn(0, 1, *args)]
        finally:
            dist.destroy_process_group()

    monkeypatch.setattr(qshard.testing, "run_world", run_world)


def test_overlap_records_the_load_average(load_benchmark, tmp_path, one_rank_in_process):
    out = tmp_path / "overlap.md"
    argv = ["--topology", "1x1", "--steps", "1", "--n-layer", "1", "--n-embd", "32"]
    load_benchmark("overlap").main([*argv, "--out-md", str(out)])
    assert "Host load average" in out.read_text()


def test_out_json_in_a_missing_folder_is_created(load_benchmark, tmp_path):
    # --out-md created its folder, --out-json did not: the report was printed, then
    # FileNotFoundError.
    measured = Path(__file__).resolve().parents[2] / "docs" / "results" / "throughput.json"
    if not measured.exists():
        pytest.skip(f"{measured} is not in this checkout")
    out = tmp_path / "new" / "deeper" / "throughput.json"
    rc = load_benchmark("throughput").main(["--from-json", str(measured), "--out-json", str(out)])
    assert rc == 0
    assert "limits" in json.loads(out.read_text())
