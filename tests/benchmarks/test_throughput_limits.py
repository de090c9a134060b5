"""benchmarks/throughput.py without a cluster: the schedule-aware phase limit on synthetic
numbers (a link-bound and a compute-bound forward), the ledger-tag -> phase map against every tag
qshard records, and ``--optimizer`` (parsing, the optimizer it builds, the JSON round trip
through ``--from-json``). Nothing here times anything."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from tests.benchmarks.test_reports import _tp_run

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20
WIRE = 1514 / 1448  # (MTU+14)/(MTU-52) at MTU 1500


@pytest.fixture(scope="module")
def tp(load_benchmark):
    return load_benchmark("throughput")


@pytest.fixture(scope="module")
def lim(load_benchmark):
    return load_benchmark("_limits")


def _run(times, node_tx, by_tag, phase_times=None):
    r = _tp_run(times, node_tx, by_tag)
    if phase_times is not None:
        r["phase_times"] = phase_times
    return r


def _link_s(nbytes: float, mbit: int = 100) -> float:
    return nbytes * WIRE * 8 / (mbit * 1e6)


# zero3-bf16: forward and backward link-bound at 100 Mbit/s, optimizer compute-bound.
BF16_TAGS = [
    ["fwd_all_gather", "all_gather", 5 * MiB, 0],
    ["bwd_all_gather", "all_gather", 5 * MiB, 0],
    ["grad_reduce_scatter", "all_to_all", 4 * MiB, 0],
]
# all: every phase compute-bound (its forward link time < its forward compute).
ALL_TAGS = [
    ["fwd_all_gather", "all_gather", 1.0 * MiB, 0],
    ["bwd_all_gather", "all_gather", 0.2 * MiB, 0],
    ["grad_reduce_scatter", "all_to_all", 1.0 * MiB, 0],
]
# hsdp-1bit: the optimizer's own collectives carry the bytes; its optimizer phase is link-bound.
ONEBIT_TAGS = [
    ["fwd_all_gather", "all_gather", 0.0, 1 * MiB],
    ["grad_reduce_scatter", "all_reduce", 0.0, 1 * MiB],
    ["onebit_adam/momentum", "all_to_all", 0.5 * MiB, 0],
    ["onebit_adam/momentum", "all_gather", 0.5 * MiB, 0],
]


def _phases(fwd, bwd, opt):
    return {"forward": fwd, "backward": bwd, "optimizer": opt}


def _data():
    return {
        "n_params": 3_000_000,
        "skipped": {},
        "mtu": 1500,
        "optimizer": "foreach",
        "results": {
            "0": {
                "zero3-bf16": _run(
                    [0.34, 0.39, 0.36],
                    [15 * MiB] * 2,
                    BF16_TAGS,
                    _phases([0.10, 0.12, 0.11], [0.20, 0.22, 0.21], [0.03, 0.05, 0.04]),
                ),
                "all": _run(
                    [0.40, 0.41, 0.39],
                    [2.2 * MiB] * 2,
                    ALL_TAGS,
                    _phases([0.10, 0.09, 0.11], [0.25, 0.24, 0.26], [0.05, 0.05, 0.05]),
                ),
                "hsdp-1bit": _run(
                    [0.30],
                    [1 * MiB] * 2,
                    ONEBIT_TAGS,
                    _phases([0.1], [0.15], [0.05]),
                ),
                # fsdp2 records nothing in the ledger: its link bytes cannot be split by phase.
                "fsdp2": _run([0.4], [37 * MiB] * 2, [], _phases([0.1], [0.2], [0.1])),
            },
            "100": {
                # 15 MiB on the link for 14 MiB in the ledger: link/ledger = 15/14.
                "zero3-bf16": _run([1.50, 1.40, 1.45], [15 * MiB] * 2, BF16_TAGS),
                "all": _run([0.452, 0.42, 0.50], [2.2 * MiB] * 2, ALL_TAGS),
                "hsdp-1bit": _run([0.40], [1 * MiB] * 2, ONEBIT_TAGS),
                "fsdp2": _run([3.5], [37 * MiB] * 2, []),
            },
        },
    }


def test_phase_limit_sums_per_phase_max_of_compute_and_link(tp):
    plim = tp.phase_limits(_data())["100"]
    assert set(plim) == {"zero3-bf16", "all", "hsdp-1bit"}  # fsdp2: no ledger bytes to split

    bf16 = plim["zero3-bf16"]
    link = _link_s(15 * MiB)  # 1.3156 s, the issue's link time
    fwd_link, bwd_link = link * 5 / 14, link * 9 / 14
    ph = bf16["phases"]
    assert ph["forward"]["compute_s"] == pytest.approx(0.11)
    assert ph["forward"]["link_s"] == pytest.approx(fwd_link)
    assert ph["forward"]["bound"] == "link"
    assert ph["backward"]["link_s"] == pytest.approx(bwd_link) and ph["backward"]["bound"] == "link"
    assert ph["optimizer"] == {"compute_s": pytest.approx(0.04), "link_s": 0.0, "bound": "compute"}
    assert bf16["phase_limit_s"] == pytest.approx(fwd_link + bwd_link + 0.04)
    assert bf16["x_phase_limit"] == pytest.approx(1.45 / (fwd_link + bwd_link + 0.04))
    # The phases' link times add up to the issue's link time; the phase limit is above the
    # issue's limit by the optimizer's compute, which no byte can hide behind here.
    assert sum(v["link_s"] for v in ph.values()) == pytest.approx(link)
    issue = tp.limits(_data())["100"]["zero3-bf16"]
    assert issue["limit_s"] == pytest.approx(link)
    assert bf16["phase_limit_s"] - issue["limit_s"] == pytest.approx(0.04)

    zpp = plim["all"]
    ph = zpp["phases"]
    assert ph["forward"]["link_s"] == pytest.approx(_link_s(2.2 * MiB) * 1.0 / 2.2)  # 0.088 s
    assert all(v["bound"] == "compute" for v in ph.values())
    assert zpp["phase_limit_s"] == pytest.approx(0.10 + 0.25 + 0.05)

    onebit = plim["hsdp-1bit"]["phases"]
    assert onebit["optimizer"]["link_s"] == pytest.approx(_link_s(1 * MiB))  # every inter byte
    assert onebit["forward"]["link_s"] == onebit["backward"]["link_s"] == 0.0
    assert plim["hsdp-1bit"]["phase_limit_s"] == pytest.approx(0.1 + 0.15 + _link_s(1 * MiB))


def test_phase_limit_needs_phase_times_of_the_unshaped_pass(tp):
    data = _data()
    for r in data["results"]["0"].values():
        del r["phase_times"]  # a JSON from before the phase timing
    assert tp.phase_limits(data) == {}
    assert tp.limits(data)["100"]["zero3-bf16"]["limit_s"] == pytest.approx(_link_s(15 * MiB))


def test_report_shows_phase_limit_next_to_the_issue_limit_and_round_trips(tp, tmp_path):
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    args = tp._args(["--rates", "100", "--out-md", str(md), "--out-json", str(js)])
    tp.report(args, _data(), wall_s=10.0)
    text = md.read_text()
    # median, limit s, x limit (the issue's, unchanged), phase limit s, x phase limit
    assert "| 100      | zero3-bf16 | 1.450    | 1.316   | 1.10x   | 1.356         | 1.07x" in text
    assert "| 100      | all        | 0.452    | 0.400   | 1.13x   | 0.400         | 1.13x" in text
    assert "| 100      | fsdp2      | 3.500    | 3.245   | 1.08x   | -             | -  " in text
    assert "| unshaped | all        | 0.400    | -       | -       | -             | -  " in text
    # The per-phase table: fwd compute/link, bwd compute/link, opt compute/link.
    assert (
        "| 100    | zero3-bf16 | 0.110       | 0.470    | 0.210       | 0.846    | 0.040       "
        "| 0.000    | 1.356         | 1.07x         | 1.316   |"
    ) in text
    assert "Phase limit = sum over the phases forward, backward" in text
    # The issue's targets still use the issue's limit: all 0.452 / max(0.40, 0.19) = 1.13x.
    assert "all at 100 Mbit/s: 1.13x its limit 0.400 s (compute-bound" in text
    saved = json.loads(js.read_text())
    row = saved["phase_limits"]["100"]["zero3-bf16"]
    assert row["phases"]["forward"]["bound"] == "link"
    assert row["phase_limit_s"] == pytest.approx(_link_s(15 * MiB) + 0.04)
    again = tmp_path / "again.md"
    assert tp.main(["--from-json", str(js), "--rates", "100", "--out-md", str(again)]) == 0
    strip = lambda t: t.split("\n", 4)[4]  # noqa: E731 (the header's date may differ)
    assert strip(again.read_text()) == strip(text)


# ----------------------------------------------------------------------------------------------
# The tag map.


def _source_tags() -> set[str]:
    """Every ledger tag qshard's library source can record: module ``TAG`` constants,
    ``phase_tag("<kind>")`` (fwd_/bwd_ prefixed), literal ``tag="..."`` arguments and the 1-bit
    optimizers' ``f"{self._algorithm}/<what>"`` tags. A parameter's default tag
    (``compressed_all_reduce``'s) is left out: every caller passes its own."""
    tags: set[str] = set()
    algorithms: set[str] = set()
    suffixes: set[str] = set()
    for path in (ROOT / "src" / "qshard").rglob("*.py"):
        if "train" in path.relative_to(ROOT / "src" / "qshard").parts:
            continue  # the app reads tags; the library records them
        text = path.read_text()
        tags.update(re.findall(r'^TAG = "([^"]+)"', text, flags=re.M))
        tags.update(re.findall(r'\btag="([^"]+)"', text))
        for kind in re.findall(r'phase_tag\("([^"]+)"\)', text):
            tags.update({f"fwd_{kind}", f"bwd_{kind}"})
        algorithms.update(re.findall(r'^\s+_algorithm = "([^"]+)"', text, flags=re.M))
        suffixes.update(re.findall(r'f"\{self\._algorithm\}/([^"]+)"', text))
    assert algorithms and suffixes  # the patterns still find the optimizers' tags
    tags.update(f"{a}/{s}" for a in algorithms for s in suffixes)
    return tags


def test_every_tag_qshard_records_has_a_phase(lim):
    tags = _source_tags()
    assert {"fwd_all_gather", "bwd_all_gather", "grad_reduce_scatter", "grad_all_reduce"} <= tags
    assert "zero_one_adam/drift" in tags and "onebit_adam/momentum" in tags
    committed = json.loads((ROOT / "docs" / "results" / "throughput.json").read_text())
    for by_variant in committed["results"].values():
        for r in by_variant.values():
            tags.update(tag for tag, *_ in r["ledger_by_tag"])
    phases = {tag: lim.phase_of_tag(tag) for tag in sorted(tags)}  # raises on an unmapped tag
    assert phases["fwd_all_gather"] == "forward"
    assert phases["bwd_all_gather"] == phases["grad_reduce_scatter"] == "backward"
    assert phases["grad_all_reduce"] == "backward"
    assert phases["zero_one_adam/drift"] == phases["onebit_adam/momentum"] == "optimizer"


def test_an_unmapped_tag_stops_the_phase_limit_and_names_the_fix(tp, lim, tmp_path):
    with pytest.raises(ValueError, match="add it to PHASE_OF_TAG"):
        lim.phase_of_tag("hier_all_gather")
    data = _data()
    data["results"]["100"]["all"]["ledger_by_tag"].append(["new_tag", "all_gather", 1.0, 0.0])
    with pytest.raises(ValueError, match="'new_tag'"):
        tp.phase_limits(data)
    # The report still comes out (a launch's numbers are not lost), without the phase limit.
    args = tp._args(["--rates", "100", "--out-md", str(tmp_path / "t.md")])
    tp.report(args, data, wall_s=1.0)
    text = (tmp_path / "t.md").read_text()
    assert "No phase limit: ledger tag 'new_tag' has no step phase" in text
    assert "| 100      | all        | 0.452    | 0.400   | 1.13x   | -             | -  " in text


# ----------------------------------------------------------------------------------------------
# --optimizer.


def test_optimizer_flag_parses_and_defaults_to_fused(load_benchmark, tp):
    args = tp._args([])
    assert args.optimizer == "fused" and args.optimizer_given is False
    args = tp._args(["--optimizer", "default"])
    assert args.optimizer == "default" and args.optimizer_given is True
    with pytest.raises(SystemExit):
        tp._args(["--optimizer", "lion"])
    sp = load_benchmark("step_profile")
    assert sp._args([]).optimizer == "fused"
    assert sp._args(["--optimizer", "foreach"]).optimizer == "foreach"


@pytest.mark.parametrize(
    ("name", "fused", "foreach"),
    [("fused", True, None), ("foreach", None, True), ("default", None, None)],
)
def test_optimizer_flag_builds_that_torch_adamw(tp, name, fused, foreach):
    import torch

    model = torch.nn.Linear(4, 3)
    ns = argparse.Namespace(optimizer=name, warmup=2, steps=5)
    opt, warmup, steps = tp._optimizer("zero3-bf16", model, ns)
    assert type(opt) is torch.optim.AdamW and (warmup, steps) == (2, 5)
    assert opt.defaults["fused"] == fused and opt.defaults["foreach"] == foreach
    assert opt.defaults["lr"] == 1e-3 and opt.defaults["weight_decay"] == 0.0
    # Each implementation takes the same step as torch's for-loop one (to rounding).
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0, foreach=False)
    x = torch.randn(8, 4)
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(3):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_optimizer_is_in_the_header_and_kept_by_from_json(tp, tmp_path):
    js, md = tmp_path / "t.json", tmp_path / "t.md"
    args = tp._args(["--rates", "100", "--out-json", str(js), "--out-md", str(md)])
    tp.report(args, _data(), wall_s=1.0)  # measured with --optimizer foreach
    assert "torch AdamW (foreach=True; --optimizer foreach)" in md.read_text()
    assert json.loads(js.read_text())["optimizer"] == "foreach"
    # A re-report says what ran, not the command line's default ...
    again = tmp_path / "again.md"
    assert tp.main(["--from-json", str(js), "--rates", "100", "--out-md", str(again)]) == 0
    assert "torch AdamW (foreach=True; --optimizer foreach)" in again.read_text()
    # ... and refuses to relabel it.
    other = tmp_path / "other.md"
    argv = ["--from-json", str(js), "--optimizer", "fused", "--out-md", str(other)]
    assert tp.main(argv) == 2 and not other.exists()
    assert tp.main([*argv[:2], "--optimizer", "foreach", "--out-md", str(other)]) == 0
    # A JSON from before the flag ran torch's default flags.
    legacy = _data()
    del legacy["optimizer"]
    js.write_text(json.dumps(legacy))
    assert tp.main(["--from-json", str(js), "--rates", "100", "--out-md", str(again)]) == 0
    text = again.read_text()
    assert (
        "torch AdamW (torch's default flags: the for-loop update on CPU; --optimizer default)"
        in (text)
    )


def test_a_launch_records_its_settings_and_machine_and_from_json_reports_them(
    tp, tmp_path, monkeypatch
):
    """[Note: re-reported settings]: ``--from-json`` describes the run that measured the
    numbers (its model, steps, command, date and machine), not its own command line's defaults
    and host, and refuses a flag that contradicts the file."""
    import types

    import netsim.cluster

    js, md = tmp_path / "t.json", tmp_path / "t.md"
    run = types.SimpleNamespace(rc=0, data=_data(), load=(1.0, 1.5))
    monkeypatch.setattr(netsim.cluster, "needs_root", lambda what: None)
    monkeypatch.setattr(netsim.cluster, "run_cluster_args", lambda *a, **k: run)
    monkeypatch.setattr(
        tp, "run_origin", lambda: {"command": "python X", "date": "D0", "machine": "M0"}
    )
    argv = ["--rates", "100", "--steps", "3", "--n-layer", "2", "--optimizer", "foreach"]
    assert tp.main([*argv, "--out-json", str(js), "--out-md", str(md)]) == 0
    saved = json.loads(js.read_text())
    assert saved["settings"]["n_layer"] == 2 and saved["settings"]["steps"] == 3
    assert saved["measured"] == {"command": "python X", "date": "D0", "machine": "M0"}
    assert "(2 layers, width 256" in md.read_text()
    # Re-reported with none of the launch's flags: the file's settings, origin and machine.
    again = tmp_path / "again.md"
    assert tp.main(["--from-json", str(js), "--out-md", str(again)]) == 0
    text = again.read_text()
    assert "(2 layers, width 256" in text and "; 3 timed steps after 2 warm-up" in text
    assert "- command: `python X`\n- date: D0\n- machine: M0\n- report rebuilt by: `" in text
    assert text.split("\n", 6)[6] == md.read_text().split("\n", 5)[5]  # the same body
    # A flag that contradicts the file is refused; one that agrees is fine.
    other = tmp_path / "other.md"
    assert tp.main(["--from-json", str(js), "--n-layer", "4", "--out-md", str(other)]) == 2
    assert not other.exists()
    assert tp.main(["--from-json", str(js), "--n-layer", "2", "--out-md", str(other)]) == 0


# ----------------------------------------------------------------------------------------------
# link_by_phase: the sampled link counters split by a step's phases (step_profile's link table).


def _ramp(t0: float, t1: float, rate_mbit: int, dt: float = 0.001):
    """Counter samples of a link that carried nothing, then ran at ``rate_mbit`` (payload, so
    that bytes x WIRE / rate is the span) from ``t0`` to ``t1``, then nothing, over 0..1 s."""
    out, per_s = [], rate_mbit * 1e6 / 8 / WIRE
    for k in range(1001):
        t = k * dt
        sent = per_s * (min(max(t, t0), t1) - t0)
        out.append((t, int(sent), int(sent / 2)))
    return out


def test_link_by_phase_splits_busy_and_idle_time_per_phase(lim):
    # The link is busy from 0.1 s to 0.5 s; forward 0-0.3, backward 0.3-0.8, optimizer 0.8-0.9.
    node = _ramp(0.1, 0.5, 100)
    quiet = [(t, 0, 0) for t, _, _ in node]
    out = lim.link_by_phase([node, quiet], [[0.0, 0.3, 0.8, 0.9]], 100)
    fwd, bwd, opt, step = (out[p] for p in ("forward", "backward", "optimizer", "step"))
    assert fwd["wall_s"] == pytest.approx(0.3)
    assert fwd["busy_s"] == pytest.approx(0.2, abs=2e-3)
    assert fwd["idle_s"] == pytest.approx(0.1, abs=2e-3)
    assert fwd["head_s"] == pytest.approx(0.1, abs=2e-3)
    assert fwd["tail_s"] == pytest.approx(0.0, abs=2e-3)
    assert bwd["busy_s"] == pytest.approx(0.2, abs=2e-3)
    assert bwd["head_s"] == pytest.approx(0.0, abs=2e-3)
    assert bwd["tail_s"] == pytest.approx(0.3, abs=2e-3)
    # nothing moved in the optimizer step: all idle, head and tail the whole phase
    assert opt["busy_s"] == pytest.approx(0.0, abs=1e-6)
    assert opt["head_s"] == opt["tail_s"] == pytest.approx(0.1)
    assert step["busy_s"] == pytest.approx(0.4, abs=2e-3)
    assert step["idle_s"] == pytest.approx(0.5, abs=2e-3)


def test_link_by_phase_takes_the_busiest_direction_and_the_median_step(lim):
    # the second node's rx carries the full rate, every other direction half of it or less
    full = _ramp(0.0, 0.4, 100)
    light = [(t, tx // 2, rx // 2) for t, tx, rx in full]
    rx_heavy = [(t, 0, tx) for t, tx, _ in full]
    steps = [[0.0, 0.2, 0.4, 0.5], [0.5, 0.6, 0.7, 0.8], [0.0, 0.1, 0.3, 0.4]]
    out = lim.link_by_phase([light, rx_heavy], steps, 100)
    # forward spans 0.2, 0.1 and 0.1 s of a busy link (the second one after it stopped: 0)
    assert out["forward"]["busy_s"] == pytest.approx(0.1, abs=2e-3)
    assert out["step"]["wall_s"] == pytest.approx(0.4)


def test_link_by_phase_refuses_what_it_cannot_split(lim):
    node = _ramp(0.1, 0.5, 100)
    with pytest.raises(ValueError, match="shaped rate"):
        lim.link_by_phase([node], [[0.0, 0.1, 0.2, 0.3]], 0)
    with pytest.raises(ValueError, match="two samples"):
        lim.link_by_phase([node[:1]], [[0.0, 0.1, 0.2, 0.3]], 100)
    with pytest.raises(ValueError, match="increasing"):
        lim.link_by_phase([node], [[0.0, 0.2, 0.1, 0.3]], 100)


def test_prefetch_depth_flag_reaches_every_qshard_variant_and_the_header(
    load_benchmark, tp, tmp_path, monkeypatch
):
    """``--prefetch-depth`` (both scripts): parsed and checked, passed to every variant's
    ZeroPPConfig but plain FSDP2's, recorded with the launch's settings, named in the header,
    and refused by a re-report of a run measured without it."""
    import types

    import netsim.cluster
    from qshard.zeropp import ZeroPPConfig

    assert tp._args([]).prefetch_depth is None
    assert tp._args(["--prefetch-depth", "2"]).prefetch_depth == 2
    sp = load_benchmark("step_profile")
    assert sp._args(["--prefetch-depth", "3"]).prefetch_depth == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            tp._args(["--prefetch-depth", bad])
    assert "prefetch_depth" not in tp._zeropp_kwargs("qgz")
    for variant in ("zero3", "qwz", "all", "hsdp-int4"):
        kw = tp._zeropp_kwargs(variant, 2)
        assert ZeroPPConfig(**kw).prefetch_depth == 2 and ZeroPPConfig(**kw).kept_blocks == 3
        assert tp._supported(variant, 2) is None

    js, md = tmp_path / "t.json", tmp_path / "t.md"
    run = types.SimpleNamespace(rc=0, data=_data(), load=(1.0, 1.5))
    monkeypatch.setattr(netsim.cluster, "needs_root", lambda what: None)
    monkeypatch.setattr(netsim.cluster, "run_cluster_args", lambda *a, **k: run)
    argv = ["--rates", "100", "--prefetch-depth", "2"]
    assert tp.main([*argv, "--out-json", str(js), "--out-md", str(md)]) == 0
    words = "ZeroPPConfig(prefetch_depth=2) for every variant but fsdp2 (--prefetch-depth 2;"
    assert words in md.read_text()
    assert json.loads(js.read_text())["settings"]["prefetch_depth"] == 2
    again = tmp_path / "again.md"
    assert tp.main(["--from-json", str(js), "--out-md", str(again)]) == 0
    assert words in again.read_text()
    # a run at the library's default says nothing, and a re-report cannot relabel it
    plain = tmp_path / "plain.json"
    assert tp.main(["--rates", "100", "--out-json", str(plain), "--out-md", str(md)]) == 0
    assert "prefetch_depth=" not in md.read_text()
    argv = ["--from-json", str(plain), "--prefetch-depth", "2", "--out-md", str(again)]
    assert tp.main(argv) == 2
