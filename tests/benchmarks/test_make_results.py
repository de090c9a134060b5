"""docs/RESULTS.md is assembled from the benchmarks' --out-md files, never typed by hand."""

from __future__ import annotations


def test_sections_in_order_images_relinked_missing_listed_and_staleness_detected(
    load_benchmark, tmp_path, capsys
):
    mr = load_benchmark("make_results")
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "throughput.md").write_text(
        "## Throughput\n\n- command: `python benchmarks/throughput.py`\n\n### Table\n\n| a |\n"
    )
    (results / "convergence.md").write_text(
        "## Convergence\n\n![curves](convergence_zeropp.png)\n![web](https://x.org/a.png)\n"
    )
    (results / "zz_extra.md").write_text("## Extra\n")
    out = tmp_path / "docs" / "RESULTS.md"
    # Sections missing stop the build (it wrote a RESULTS.md without them and exited 0),
    # naming what measures them; --allow-missing lists them instead.
    assert mr.main(["--results-dir", str(results), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "netsim_check.md: benchmarks/netsim/netsim.sh" in err and not out.exists(), err
    args = ["--results-dir", str(results), "--out", str(out), "--allow-missing"]
    assert mr.main(args) == 0
    # an extra file that is not a benchmark's report (no command in its header) is flagged
    assert "zz_extra.md has no '- command:' line" in capsys.readouterr().err
    text = out.read_text()
    # Known sections first in their fixed order, then the others.
    assert text.index("## Throughput") < text.index("## Convergence") < text.index("## Extra")
    assert "### Table" in text
    # Image paths resolve from docs/, URLs are left alone.
    assert "![curves](results/convergence_zeropp.png)" in text
    assert "![web](https://x.org/a.png)" in text
    # What was not measured is listed with the command that measures it.
    assert "docs/results/netsim_check.md" in text.split("## Not yet measured")[1]
    assert "Regenerate at full length: `python benchmarks/throughput.py --rates 100,200,400" in text
    assert mr.main([*args, "--check"]) == 0
    (results / "zz_extra.md").write_text("## Extra, changed\n")
    assert mr.main([*args, "--check"]) == 1


def test_a_results_dir_without_results_is_refused_and_out_is_left_alone(
    load_benchmark, tmp_path, capsys
):
    # A mistyped --results-dir used to rebuild RESULTS.md with every section gone.
    mr = load_benchmark("make_results")
    out = tmp_path / "RESULTS.md"
    out.write_text("## Kept\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    for results in (tmp_path / "no-such-folder", empty):
        try:
            mr.main(["--results-dir", str(results), "--out", str(out)])
        except SystemExit as exc:
            assert exc.code == 2
        else:
            raise AssertionError(f"--results-dir {results} was accepted")
        assert "--results-dir" in capsys.readouterr().err
        assert out.read_text() == "## Kept\n"
