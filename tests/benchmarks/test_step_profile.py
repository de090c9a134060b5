"""benchmarks/step_profile.py without a cluster: exclusive range times (against hand-made
intervals and a real torch.profiler trace of qshard's DeferredWork ranges), FSDP2 label
cleanup, and the report's grouping on synthetic per-rank numbers."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def sp(load_benchmark):
    return load_benchmark("step_profile")


def test_exclusive_times_subtract_nested_ranges(sp):
    ivs = [
        ("step::forward", 0.0, 10.0),
        ("FSDP::pre_forward", 1.0, 4.0),
        ("qshard::qwz::wait", 2.0, 3.0),
        ("qshard::qwz::finish", 3.0, 3.5),
        ("FSDP::pre_forward", 6.0, 7.0),  # the same label twice: summed
        ("step::backward", 10.0, 15.0),
        ("qshard::qgz::wait_inter", 12.0, 15.0),  # ends with its parent
    ]
    excl = sp.exclusive_times(ivs)
    assert excl == pytest.approx(
        {
            "step::forward": 10 - 3 - 1,
            "FSDP::pre_forward": 3 - 1.5 + 1,
            "qshard::qwz::wait": 1.0,
            "qshard::qwz::finish": 0.5,
            "step::backward": 2.0,
            "qshard::qgz::wait_inter": 3.0,
        }
    )
    assert sum(excl.values()) == pytest.approx(15.0)  # the outermost ranges' union


def test_fsdp_labels_drop_the_module(sp):
    assert sp._label("FSDP::pre_forward (blocks.0)") == "FSDP::pre_forward"
    assert sp._label("FSDP::forward_prefetch for blocks.1") == "FSDP::forward_prefetch"
    assert sp._label("qshard::qgz::wait_intra") == "qshard::qgz::wait_intra"


def test_profiler_sees_qshard_ranges_and_phases_add_up(sp):
    from torch.profiler import ProfilerActivity, profile, record_function

    from qshard.zeropp._common import DeferredWork

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for opt_s in (0.005, 0.03):  # two steps; their ranges must not mix
            with record_function("step"):
                with record_function("step::forward"):
                    handle = DeferredWork([], lambda: time.sleep(0.02), label="qwz")
                    time.sleep(0.01)
                    handle.wait()
                with record_function("step::optimizer"):
                    time.sleep(opt_s)
            time.sleep(0.01)  # between steps: in no step
    (excl, wall), (excl2, wall2) = sp._profile_ranges(prof)
    assert set(excl) == set(excl2) == {"step::forward", "qshard::qwz::finish", "step::optimizer"}
    assert excl["qshard::qwz::finish"] >= 0.02 and excl["step::forward"] >= 0.01
    assert excl["step::optimizer"] >= 0.005 and excl2["step::optimizer"] >= 0.03
    # Exclusive ranges inside a step add up to at most its wall time (the rest is "other");
    # counting the finish inside the forward too would exceed it by >= 20 ms.
    assert 0.035 <= sum(excl.values()) <= wall
    assert 0.06 <= sum(excl2.values()) <= wall2


def _rank(rank, phases, wall):
    """Three profiled steps; the middle one (by wall time) is ``phases``, the others are a fast
    one and a 10x outlier that the report must not pick."""
    step = {"phases": phases, "wall": wall, "cpu_main": wall / 2, "cpu_other": wall / 10}
    fast = dict(step, phases={"step::forward": 0.001}, wall=wall / 2)
    outlier = dict(step, phases={"step::optimizer": 10 * wall}, wall=10 * wall)
    return {
        "rank": rank,
        "times": [wall, wall],
        "steps": [outlier, step, fast],
        "link_bytes": 2**20,
    }


def test_report_groups_the_slowest_rank(sp, tmp_path):
    args = sp._args(["--variants", "all", "--out-md", str(tmp_path / "p.md")])
    fast = {"step::forward": 0.05, "step::backward": 0.1, "step::optimizer": 0.02}
    slow = {
        "step::forward": 0.06,
        "step::backward": 0.12,
        "step::optimizer": 0.02,
        "qshard::qwz::quantize": 0.01,
        "qshard::qgz::reorder": 0.005,
        "qshard::qwz::wait": 0.2,
        "qshard::qgz::wait_inter": 0.03,
        "qshard::reduce_scatter::transfer": 0.01,
        "qshard::qwz::finish": 0.02,
        "qshard::qgz::reduce_intra": 0.01,
        "FSDP::all_gather_copy_out": 0.004,
        "FSDP::pre_forward": 0.003,
    }
    data = {
        "cores": 2,
        "load": [1.0, 2.0],
        "mtu": 1500,
        "results": {
            "0": {"all": [_rank(0, fast, 0.17), _rank(1, slow, 0.5)]},
            "100": {"all": [dict(_rank(0, fast, 0.17), load=3.5), _rank(1, slow, 0.5)]},
        },
    }
    sp.report(args, data)
    text = (tmp_path / "p.md").read_text()
    tables = [t for t in text.split("### ") if t.startswith(("Per phase", "Every range", "CPU"))]
    phase, ranges, cpu = (_rows(t) for t in tables)
    # slowest rank: fwd 60, bwd 120, opt 20, quantize 15, wait 240, dequant 30, copy-out 4,
    # FSDP other 3; other = 500 - 492 = 8 ms; main CPU 250, gloo CPU 50.
    times = ["60", "120", "20", "15", "240", "30", "4", "3", "8", "250", "50"]
    # 1 MiB per step at 100 Mbit/s x 1514/1448: 87.7 ms of link; unshaped: none.
    assert phase == [
        ["unshaped", "all", "500", "500", "-", *times, "-"],
        ["100 Mbit/s", "all", "500", "500", "88", *times, "3.5"],
    ]
    assert ranges[0] == ["unshaped", "all", "qshard::qwz::wait", "0.0", "200.0"]
    assert ["unshaped", "all", "FSDP::pre_forward", "0.0", "3.0"] in ranges
    # all ranks' CPU: (0.17 + 0.5) * 0.6 = 402 ms; over 2 cores 201 ms.
    assert cpu[0] == ["unshaped", "all", "500", "402", "201"]
    assert "host load average 1.0 at the start and 2.0 at the end" in text


def test_report_splits_the_sampled_link_by_the_last_ranks_phase_ends(sp, tmp_path):
    args = sp._args(["--variants", "all", "--out-md", str(tmp_path / "p.md")])
    phases = {"step::forward": 0.2, "step::backward": 0.2, "step::optimizer": 0.05}
    # node 0's link ran at 100 Mbit/s (payload; x 1514/1448 on the wire) from 0.1 s to 0.3 s
    per_s, samples = 100e6 / 8 * 1448 / 1514, []
    for k in range(601):
        t = k / 1000
        sent = int(per_s * (min(max(t, 0.1), 0.3) - 0.1))
        samples.append((t, sent, sent // 4))
    r0 = dict(_rank(0, phases, 0.5), marks=[[0.0, 0.2, 0.45, 0.5]], link_samples=samples)
    # rank 1 (node 1, no sampler) ends its forward last and its backward first
    r1 = dict(_rank(1, phases, 0.5), marks=[[0.0, 0.25, 0.4, 0.5]], link_samples=None)
    assert sp.link_phases([r0, r1], "0", 1500) is None  # unshaped: nothing to split
    r0["link_phases"] = sp.link_phases([r0, r1], "100", 1500)
    unsampled = _rank(0, phases, 0.5)  # a run from before the sampler: no table rows
    data = {
        "cores": 2,
        "mtu": 1500,
        "results": {
            "0": {"all": [unsampled, r1]},
            "100": {"all": [r0, r1], "qwz": [unsampled, r1]},
        },
    }
    sp.report(args, data)
    text = (tmp_path / "p.md").read_text()
    (table,) = [t for t in text.split("### ") if t.startswith("The link per phase")]
    # phases 0-0.25 (forward), 0.25-0.45, 0.45-0.5; busy 0.1-0.3 s
    assert _rows(table) == [
        ["100 Mbit/s", "all", "forward", "250", "150", "100", "100", "0"],
        ["100 Mbit/s", "all", "backward", "200", "50", "150", "0", "150"],
        ["100 Mbit/s", "all", "optimizer", "50", "0", "50", "50", "50"],
        ["100 Mbit/s", "all", "step", "500", "200", "300", "100", "200"],
    ]


def _rows(table: str) -> list[list[str]]:
    """The body rows of a markdown table, as stripped cells."""
    lines = [ln for ln in table.splitlines() if ln.startswith("|")][2:]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]


def _profiled_labels(rank: int, world: int) -> dict[str, list[str]]:
    """One profiled training step of a tiny GPT per variant on 2 nodes x 1 rank: the range
    labels step_profile would see on this rank."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from qshard.comm import Topology
    from qshard.train.model import GPT, GPTConfig
    from qshard.zeropp import ZeroPPConfig, shard

    topo = Topology(world_size=world, ranks_per_node=1)
    configs = {
        "zero3-bf16": ZeroPPConfig(wire_dtype=torch.bfloat16),
        "qwz+qgz": ZeroPPConfig(qwz=True, qgz=True),
    }
    sys.path.insert(0, str(BENCH))
    import step_profile as sp

    out = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = shard(
            GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, context=16, vocab_size=64)),
            topology=topo,
            config=config,
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))

        def step(model=model, opt=opt, x=x) -> None:
            with record_function("step::forward"):
                _, loss = model(x, x)
            with record_function("step::backward"):
                loss.backward()
            with record_function("step::optimizer"):
                opt.step()
                opt.zero_grad()

        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("step"):
            step()
        ((excl, wall),) = sp._profile_ranges(prof)
        assert sum(excl.values()) <= wall * 1.001
        out[name] = sorted(excl)
    return out


def test_a_zeropp_step_shows_qshard_ranges():
    """The ranges step_profile groups are really set by qshard's comms in a training step (a
    refactor that drops them would silently turn comm time into 'compute')."""
    from qshard.testing import run_world

    labels = run_world(_profiled_labels, 2, timeout_s=240)[0]
    assert {
        "qshard::all_gather::quantize",
        "qshard::all_gather::finish",
        "qshard::reduce_scatter::quantize",
        "qshard::reduce_scatter::finish",
        "step::forward",
        "step::backward",
        "step::optimizer",
        "FSDP::all_gather_copy_out",
    } <= set(labels["zero3-bf16"])
    assert {
        "qshard::qwz::quantize",
        "qshard::qwz::finish",
        "qshard::qgz::reorder",
        "qshard::qgz::quantize_inter",
        "qshard::qgz::reduce_inter",
    } <= set(labels["qwz+qgz"])


def test_link_sampler_stamps_counter_reads_until_stopped(sp, monkeypatch):
    from netsim import link

    reads = iter(range(0, 10**9, 1000))

    def fake_counters(iface=None):
        n = next(reads)
        return link.LinkBytes(tx=n, rx=2 * n)

    monkeypatch.setattr(link, "read_link_bytes", fake_counters)
    sampler = link.LinkSampler(interval_s=0.002)
    with pytest.raises(RuntimeError, match="before start"):
        sampler.stop()
    t0 = time.perf_counter()
    sampler.start()
    with pytest.raises(RuntimeError, match="twice"):
        sampler.start()
    time.sleep(0.05)
    samples = sampler.stop()
    t1 = time.perf_counter()
    assert len(samples) >= 3  # ~25 at 2 ms; a loaded host reads fewer, never none
    times = [s[0] for s in samples]
    assert t0 <= times[0] and times[-1] <= t1 and times == sorted(times)
    assert [s[1] for s in samples] == list(range(0, 1000 * len(samples), 1000))
    assert all(rx == 2 * tx for _, tx, rx in samples)
    with pytest.raises(ValueError, match="interval_s"):
        link.LinkSampler(interval_s=0)
