"""benchmarks/throughput.py's interleaved rows ([Note: interleaved rows]) without a cluster: the
round schedule (a pure function), the order in which a rate builds, times and frees its variants
(the per-variant runner replaced by a recorder), and an interleaved launch's JSON through
``report()`` and ``--from-json``. Nothing here times anything."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from typing import ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.benchmarks.test_throughput_limits import _data


@pytest.fixture(scope="module")
def tp(load_benchmark):
    return load_benchmark("throughput")


def test_round_schedule_rotates_and_skips_finished_variants(tp):
    # Three variants, the last with more steps (as 0/1 Adam's two sync intervals).
    assert tp.round_schedule([2, 3, 5]) == [
        [(0, 0), (1, 0), (2, 0)],
        [(1, 1), (2, 1), (0, 1)],
        [(2, 2), (1, 2)],  # variant 0 is done; the round still starts at variant 2 mod 3
        [(2, 3)],
        [(2, 4)],
    ]
    assert tp.round_schedule([]) == []
    assert tp.round_schedule([0, 0]) == []
    assert tp.round_schedule([1]) == [[(0, 0)]]


def test_round_schedule_no_variant_always_follows_the_same_one(tp):
    rounds = tp.round_schedule([6, 6, 6])
    followers: dict[int, set[int]] = {0: set(), 1: set(), 2: set()}
    flat = [v for r in rounds for v, _ in r]
    for a, b in itertools.pairwise(flat):
        followers[a].add(b)
    # Within and across rounds each variant is followed by both others at some point.
    assert all(f == {0, 1, 2} - {v} for v, f in followers.items())
    # Each variant leads a round equally often (6 rounds, 3 variants).
    assert Counter(r[0][0] for r in rounds) == {0: 2, 1: 2, 2: 2}


@given(st.lists(st.integers(min_value=0, max_value=12), max_size=7))
def test_round_schedule_times_every_step_exactly_once_in_order(load_benchmark, steps):
    tp = load_benchmark("throughput")
    rounds = tp.round_schedule(steps)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == [(v, i) for v, n in enumerate(steps) for i in range(n)]
    assert len(rounds) == max(steps, default=0)
    n = len(steps)
    for i, r in enumerate(rounds):
        assert {s for _, s in r} == {i}  # round i times step i only
        # the variant order rotated to start at i mod n, finished variants left out
        rotated = [(i + k) % n for k in range(n)]
        assert [v for v, _ in r] == [v for v in rotated if steps[v] > i]


class _Recorder:
    """Stands in for throughput._Run: records when each variant is built, timed and read out."""

    events: ClassVar[list[tuple]] = []
    steps: ClassVar[dict[str, int]] = {"zero3-bf16": 3, "all": 3, "hsdp-01": 5}

    def __init__(self, variant, args, topology, corpus, rank, world):
        self.variant, self.steps = variant, _Recorder.steps[variant]
        self.events.append(("build", variant))

    def timed_step(self, i):
        self.events.append(("step", self.variant, i))

    def result(self):
        self.events.append(("result", self.variant))
        return {"variant": self.variant}


@pytest.mark.parametrize("interleave", [True, False])
def test_a_rate_builds_times_and_reads_out_variants_in_the_schedule_order(
    tp, monkeypatch, interleave
):
    monkeypatch.setattr(tp, "_Run", _Recorder)
    monkeypatch.setattr(_Recorder, "events", [])
    args = tp._args(
        ["--variants", "zero3-bf16,all,hsdp-01"] + ([] if interleave else ["--no-interleave"])
    )
    assert args.interleave is interleave
    variants = ["zero3-bf16", "all", "hsdp-01"]
    out = tp._measure_rate(variants, args, None, None, 0, 4)
    assert out == [(v, {"variant": v}) for v in variants]  # each row is its own variant's
    ev = _Recorder.events
    if interleave:
        steps = [3, 3, 5]
        assert ev[:3] == [("build", v) for v in variants]  # all built (and warmed up) first
        timed = [("step", variants[v], i) for r in tp.round_schedule(steps) for v, i in r]
        assert ev[3:-3] == timed
        assert ev[-3:] == [("result", v) for v in variants]
        assert timed[3:6] == [("step", "all", 1), ("step", "hsdp-01", 1), ("step", "zero3-bf16", 1)]
    else:
        expect = []
        for v in variants:
            n = _Recorder.steps[v]
            expect += [("build", v), *(("step", v, i) for i in range(n)), ("result", v)]
        assert ev == expect


def test_a_variant_named_twice_runs_twice_interleaved(tp, monkeypatch):
    """The order-bias check (the same variant first and last) keeps both runs' rows."""
    monkeypatch.setattr(tp, "_Run", _Recorder)
    monkeypatch.setattr(_Recorder, "events", [])
    args = tp._args(["--variants", "all,zero3-bf16,all"])
    out = tp._measure_rate(["all", "zero3-bf16", "all"], args, None, None, 0, 4)
    assert [v for v, _ in out] == ["all", "zero3-bf16", "all"]
    assert _Recorder.events.count(("build", "all")) == 2
    assert _Recorder.events.count(("step", "all", 2)) == 2


def test_interleave_defaults_on(tp):
    assert tp._args([]).interleave is True
    assert tp._args(["--no-interleave"]).interleave is False


def test_an_interleaved_launch_json_goes_through_report_and_from_json(tp, tmp_path):
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    data = dict(_data(), interleaved=True, load=[1.5, 2.5])
    data["results"]["100"]["all"]["load"] = 2.1
    args = tp._args(["--rates", "100", "--out-md", str(md), "--out-json", str(js)])
    tp.report(args, data, wall_s=12.0)
    text = md.read_text()
    assert "timed steps interleaved round by round" in text
    assert "one variant after another" not in text
    saved = json.loads(js.read_text())
    assert saved["interleaved"] is True
    assert set(saved["results"]["100"]) == {"zero3-bf16", "all", "hsdp-1bit", "fsdp2"}
    assert saved["limits"]["100"]["all"]["x_limit"] == pytest.approx(0.452 / 0.40)
    again = tmp_path / "again.md"
    assert tp.main(["--from-json", str(js), "--rates", "100", "--out-md", str(again)]) == 0
    strip = lambda t: t.split("\n", 4)[4]  # noqa: E731 (the header's date may differ)
    assert strip(again.read_text()) == strip(text)
    # A launch timed one variant after another (or written before the field) says so.
    old = tmp_path / "old.md"
    tp.report(
        tp._args(["--rates", "100", "--out-md", str(old)]),
        dict(_data(), interleaved=False),
        wall_s=1.0,
    )
    assert "one variant after another" in old.read_text()
    legacy = _data()
    assert "interleaved" not in legacy
    tp.report(tp._args(["--rates", "100", "--out-md", str(old)]), legacy, wall_s=1.0)
    assert "one variant after another" in old.read_text()


def test_host_cpu_jiffies_counts_busy_time(tp):
    """The CPU-busy column's reader: busy <= total, both only grow, and a busy loop in this
    process shows up as busy time (on Linux; elsewhere the reader says None)."""
    import os
    import sys
    import time

    first = tp.host_cpu_jiffies()
    if not sys.platform.startswith("linux"):
        assert first is None
        return
    busy0, total0 = first
    assert 0 <= busy0 <= total0
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    busy1, total1 = tp.host_cpu_jiffies()
    ticks = os.sysconf("SC_CLK_TCK")  # /proc/stat's unit
    assert total1 >= total0 and busy1 >= busy0 + 0.2 * ticks  # >= 0.2 s of the 0.3 s busy
