"""benchmarks/deepspeed_zero3.py without DeepSpeed: its arguments mirror throughput.py's, the
DeepSpeed configs it builds, its report on synthetic numbers (speed-ups, the exact failure of
each ZeRO++ option), and a clear message instead of a traceback when DeepSpeed is missing."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(scope="module")
def ds(load_benchmark):
    return load_benchmark("deepspeed_zero3")


MiB = 2**20
QUANT_ERROR = "ValueError: This op had not been implemented on CPU backend."


def test_defaults_are_throughput_defaults(load_benchmark, ds):
    """Same GPT, batches, steps, rates and cluster as throughput.py, so the rows compare."""
    tp = load_benchmark("throughput")
    a, b = ds._args([]), tp._args([])
    for name in (
        "rates",
        "nodes",
        "ranks_per_node",
        "steps",
        "warmup",
        "n_layer",
        "n_embd",
        "n_head",
        "context",
        "batch_per_rank",
        "seed",
    ):
        assert getattr(a, name) == getattr(b, name), name
    assert a.variant_list == list(ds.ALL_VARIANTS)
    assert a.optimizer == "torch-adamw-fused"  # throughput.py's default (fused torch AdamW)
    assert a.persistence_threshold == 0 and a.reuse_distance == 0
    assert a.prefetch_bucket == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["--variants", "ds-zero3,zero3"],
        ["--variants", ","],
        ["--rates", "100,fast"],
        ["--rates", "0"],
        ["--steps", "0"],
        ["--optimizer", "sgd"],
        ["--persistence-threshold", "-1"],
        ["--reuse-distance", "-5"],
        ["--prefetch-bucket", "-1"],
        ["--n-embd", "100", "--n-head", "3"],
    ],
)
def test_bad_arguments_are_refused(ds, argv, capsys):
    with pytest.raises(SystemExit) as info:
        ds._args(argv)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_configs_per_variant(ds):
    args = ds._args(["--ranks-per-node", "2", "--batch-per-rank", "3"])
    base = ds.ds_config(args, "ds-zero3", 4)
    zero = base["zero_optimization"]
    # ZeRO-3 as FSDP2 runs it: everything partitioned, re-gathered for backward.
    assert zero == {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 0,
    }
    assert ds.ds_config(args, "ds-defaults", 4)["zero_optimization"] == {"stage": 3}
    tuned = ds._args(
        ["--persistence-threshold", "7", "--reuse-distance", "9", "--prefetch-bucket", "11"]
    )
    assert ds.ds_config(tuned, "ds-hpz", 4)["zero_optimization"] == {
        "stage": 3,
        "stage3_param_persistence_threshold": 7,
        "stage3_max_reuse_distance": 9,
        "stage3_prefetch_bucket_size": 11,
        "zero_hpz_partition_size": 2,
    }
    assert base["train_micro_batch_size_per_gpu"] == 3
    assert base["train_batch_size"] == 12 and base["gradient_accumulation_steps"] == 1
    assert not {"fp16", "bf16", "optimizer"} & base.keys()  # fp32, the client's torch optimizer
    expect = {
        "ds-qwz": {"zero_quantized_weights": True},
        "ds-hpz": {"zero_hpz_partition_size": 2},
        "ds-qgz": {"zero_quantized_gradients": True},
        "ds-all": {
            "zero_quantized_weights": True,
            "zero_hpz_partition_size": 2,
            "zero_quantized_gradients": True,
        },
    }
    for variant, keys in expect.items():
        assert ds.ds_config(args, variant, 4)["zero_optimization"] == {**zero, **keys}
    # hpZ's secondary partition is one node's ranks.
    args4 = ds._args(["--ranks-per-node", "4"])
    assert ds.zeropp_options("ds-hpz", args4.ranks_per_node) == {"zero_hpz_partition_size": 4}
    with pytest.raises(ValueError, match="unknown variant"):
        ds.zeropp_options("zero3", 2)


def _run(times, tx, loss=4.0):
    return {"times": times, "node_tx": tx, "node_rx": tx, "loss_first": 5.5, "loss_last": loss}


def test_report_speedups_and_recorded_failures(ds):
    # No --out-md: writing it names the machine, which imports torch (slow; tested elsewhere).
    args = ds._args(["--rates", "100,200"])
    data = {
        "n_params": 3_260_000,
        "versions": {
            "deepspeed": "0.19.8",
            "torch": "2.13.0",
            "accelerator": "cpu",
            "backend": "gloo",
            "python": "/tmp/dsvenv/bin/python",
        },
        "configs": {v: ds.ds_config(args, v, 4) for v in args.variant_list},
        "results": {
            "100": {
                "ds-zero3": _run([6.0, 4.0, 5.0], [28 * MiB, 27 * MiB]),
                "ds-hpz": _run([2.0, 3.0, 2.5], [10 * MiB, 12 * MiB], loss=3.9),
            },
            "200": {"ds-zero3": _run([3.0, 2.0, 2.5], [28 * MiB, 28 * MiB])},
        },
        "failed": {
            "ds-qwz": {
                "phase": "deepspeed.initialize",
                "error": QUANT_ERROR,
                "origin": "deepspeed/runtime/zero/partition_parameters.py:865 __init__",
                "rate": 100,
                "ranks_failed": 4,
            },
            "ds-qgz": {"phase": "step 0 backward", "error": "RuntimeError: a | b", "rate": 100},
        },
        "done": False,
        "rc": 124,
        "load": [1.0, 2.0],
        "build_s": 12.0,
    }
    rep = ds.report(args, data, wall_s=100.0)
    text = "\n".join(rep.sections)
    assert rep.title == "Throughput: DeepSpeed ZeRO-3 on CPU on an emulated slow network"
    steps = next(s for s in rep.sections if "Step time" in s)
    lines = {tuple(c.strip() for c in ln.strip("|").split("|")) for ln in steps.splitlines()}
    # median 5.0 / 2.5 = 2.00x, min 4.0 / 2.0 = 2.00x; the baseline is 1.00x of itself.
    assert ("100", "ds-hpz", "2.500", "2.000", "2.00x (2.00x)", "12.00", "3.900") in lines
    assert ("100", "ds-zero3", "5.000", "4.000", "1.00x (1.00x)", "28.00", "4.000") in lines
    assert ("200", "ds-zero3", "2.500", "2.000", "1.00x (1.00x)", "28.00", "4.000") in lines
    options = next(s for s in rep.sections if "ZeRO++ options" in s)
    rows = {
        cells[0]: cells
        for cells in (
            tuple(c.strip() for c in ln.strip("|").split("|")) for ln in options.splitlines()[4:]
        )
    }
    assert rows["ds-zero3"][1:] == ("(none)", "ran", "-")
    assert rows["ds-defaults"][1].startswith("(none; DeepSpeed's default")
    assert rows["ds-defaults"][2] == "not reached (the run stopped before it)"
    assert rows["ds-hpz"][1:] == ("zero_hpz_partition_size=2", "ran", "-")
    assert rows["ds-qwz"][1] == "zero_quantized_weights=true"
    assert rows["ds-qwz"][2] == f"failed in deepspeed.initialize on 4 rank(s): {QUANT_ERROR}"
    assert rows["ds-qwz"][3] == "deepspeed/runtime/zero/partition_parameters.py:865 __init__"
    # A '|' in an error message must not split the markdown cell.
    assert rows["ds-qgz"][2] == "failed in step 0 backward on ? rank(s): RuntimeError: a / b"
    assert rows["ds-qgz"][3] == "?"
    assert rows["ds-all"][2] == "not reached (the run stopped before it)"
    assert "stopped early (status 124)" in text
    assert "12 s of DeepSpeed op builds" in text and "DeepSpeed 0.19.8" in text
    assert "run with /tmp/dsvenv/bin/python" in text


def test_missing_deepspeed_is_a_message_not_a_traceback(ds, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` fail
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    problem = ds.deepspeed_problem()
    assert problem and "DeepSpeed is not importable" in problem and "pip install" in problem
    assert ds.main(["--rates", "100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deepspeed_zero3: DeepSpeed is not importable")
    assert "Traceback" not in err and "/tmp/dsvenv" in err


def _raise_from_op_builder():
    def load():  # stands in for op_builder/cpu/no_impl.py, which only raises
        raise ValueError("This op had not been implemented on CPU backend.")

    load.__code__ = load.__code__.replace(
        co_filename="/x/site-packages/deepspeed/ops/op_builder/cpu/no_impl.py"
    )
    load()


def test_origin_names_the_caller_of_the_missing_op(ds):
    with pytest.raises(ValueError) as info:
        _raise_from_op_builder()
    assert ds._first_line(info.value) == QUANT_ERROR
    origin = ds._origin(info.value)
    assert origin.endswith(" _raise_from_op_builder") and "test_deepspeed_zero3.py:" in origin
