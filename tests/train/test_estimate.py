"""The analytic model against the ZeRO++ paper's Table 1 and the learning-rate schedule."""

from __future__ import annotations

import itertools
import math

import pytest

from qshard.train.config import TrainConfig
from qshard.train.estimate import estimate_comm, estimate_memory
from qshard.train.loop import learning_rate

M = 1_000_000_000


def test_table1_volumes():
    # Large world: (P-1)/P -> 1. ZeRO-3 with an fp16 wire is 3M elements of 2 bytes.
    kw = dict(num_params=M, world_size=4096, ranks_per_node=8)
    z3 = estimate_comm(**kw, wire_bytes=2)
    assert z3.total / (2 * M) == pytest.approx(3.0, rel=3e-3)
    zpp = estimate_comm(
        **kw,
        wire_bytes=2,
        features=frozenset({"qwz", "hpz", "qgz"}),
        weight_block=2**20,
        grad_block=2**20,
    )
    # paper: 0.5M + 0 + 0.25M in fp16 units (scales negligible with huge blocks)
    assert zpp.fwd_all_gather / (2 * M) == pytest.approx(0.5, rel=3e-3)
    assert zpp.bwd_all_gather == 0
    assert zpp.grad_reduce_scatter / (2 * M) == pytest.approx(0.25, rel=3e-3)
    assert z3.total / zpp.total == pytest.approx(4.0, rel=3e-3)


def test_one_node_sends_nothing_across():
    est = estimate_comm(num_params=M, world_size=8, ranks_per_node=8)
    assert est.total == 0


def test_memory_components():
    rows = estimate_memory(
        num_params=1000,
        largest_unit_params=100,
        world_size=4,
        ranks_per_node=2,
        features=frozenset({"hpz"}),
        optim="adamw",
    )
    assert rows["parameter shard"] == 1000
    assert rows["hpZ secondary shard"] == 2000
    assert rows["optimizer state (adamw)"] == 2000
    small = estimate_memory(
        num_params=1000,
        largest_unit_params=100,
        world_size=4,
        ranks_per_node=2,
        features=frozenset(),
        optim="adamw8bit",
    )
    assert small["optimizer state (adamw8bit)"] < rows["optimizer state (adamw)"] / 3.9
    assert "hpZ secondary shard" not in small


def test_learning_rate_schedule():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr=0.1)
    assert learning_rate(0, cfg) == pytest.approx(0.1)
    assert learning_rate(9, cfg) == pytest.approx(1.0)
    assert learning_rate(10, cfg) == pytest.approx(1.0)
    assert learning_rate(55, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert learning_rate(100, cfg) == pytest.approx(0.1)
    lrs = [learning_rate(s, cfg) for s in range(10, 100)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))
