"""benchmarks/optim_step.py --phases: every timing variant of the fused kernel builds from the
kernel's own source, runs, and lands in the table (the numbers themselves are not checked)."""

from __future__ import annotations

import pytest

from qshard.optim import _kernels


@pytest.mark.skipif(not _kernels.available(), reason="no C compiler for the kernel")
def test_phases_table_has_every_variant(load_benchmark, tmp_path):
    mod = load_benchmark("optim_step")
    out = tmp_path / "phases.md"
    before = _kernels.library
    mod.main(
        [
            "--phases",
            "--sizes",
            "64K",
            "--threads",
            "1",
            "--repeat",
            "2",
            "--warmup",
            "1",
            "--out-md",
            str(out),
        ]
    )
    text = out.read_text()
    for what, _ in mod._PHASES:
        assert f"| {what}" in text, what
    assert "Load average before" in text
    assert _kernels.library is before  # the benchmark put the real kernel back


@pytest.mark.skipif(not _kernels.available(), reason="no C compiler for the kernel")
@pytest.mark.parametrize("cls_name", ["AdamW8bit", "AdamW4bit"])
def test_one_call_per_tensor_steps_each_tensor_alone_with_the_same_result(load_benchmark, cls_name):
    """The ``--models`` rows 'one call per tensor': one multi-tensor call per quantized tensor
    (it passed the plan where a list of tensors was expected: --models crashed), bit for bit
    what the batched step computes."""
    import torch

    from qshard import optim as qoptim

    mod = load_benchmark("optim_step")
    cls = getattr(qoptim, cls_name)
    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 256), (8, 512), (32, 128), (300,)]  # the 1-D one: fp32 state
    base = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) * 1e-2 for s in shapes] for _ in range(2)]
    runs = []
    for wrap in (False, True):
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        opt = cls(ps, lr=1e-3)
        if wrap:
            opt = mod._one_call_per_tensor(opt)
        calls: list[int] = []
        multi = opt._multi_tensor_step
        opt._multi_tensor_step = lambda gi, group, items, *rest, multi=multi, calls=calls: (
            calls.append(len(items)),
            multi(gi, group, items, *rest),
        )
        for step_grads in grads:
            for p, g in zip(ps, step_grads):
                p.grad = g.clone()
            opt.step()
        runs.append((ps, opt, calls))
    (ps_a, opt_a, calls_a), (ps_b, opt_b, calls_b) = runs
    assert calls_a == [3, 3] and calls_b == [1] * 6
    for a, b in zip(ps_a, ps_b):
        assert torch.equal(a, b)
    for a, b in zip(ps_a, ps_b):
        for k, v in opt_a.state[a].items():
            assert torch.equal(v, opt_b.state[b][k]), k


@pytest.mark.skipif(not _kernels.available(), reason="no C compiler for the kernel")
def test_models_table_has_the_one_call_per_tensor_rows(load_benchmark, tmp_path, monkeypatch):
    mod = load_benchmark("optim_step")
    monkeypatch.setitem(mod.MODELS, "tiny", ("tiny", lambda: [(16, 256)] * 3 + [(64,)]))
    out = tmp_path / "models.md"
    argv = ["--models", "tiny", "--threads", "1", "--repeat", "1", "--warmup", "1"]
    mod.main([*argv, "--out-md", str(out)])
    text = out.read_text()
    assert "tiny: 4 tensors" in text
    assert "| qshard AdamW8bit, one call per tensor" in text
    assert "| qshard AdamW4bit, one call per tensor" in text


def test_phases_thread_count_zero_is_the_process_default(load_benchmark, monkeypatch):
    """``--threads 1,0 --phases``: the 0 table runs at the process's default thread count (it
    took the previous table's count)."""
    import torch

    mod = load_benchmark("optim_step")
    seen: list[int] = []
    monkeypatch.setattr(mod._kernels, "available", lambda: True)
    monkeypatch.setattr(mod, "_time_phases", lambda *a: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the process's count as the script starts; not 1
    try:
        mod.main(["--phases", "--sizes", "1K", "--threads", "1,0"])
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]


def test_sizes_parse_and_a_bad_one_is_named(load_benchmark):
    optim_step = load_benchmark("optim_step")
    assert [optim_step._parse_size(s) for s in ("10M", "1.5k", " 123 ", "2G")] == [
        10_000_000,
        1500,
        123,
        2_000_000_000,
    ]
    for bad in ("", "M", "ten", "-5M", "0"):  # "--sizes 10M," raised IndexError
        with pytest.raises(SystemExit, match="bad size"):
            optim_step._parse_size(bad)
