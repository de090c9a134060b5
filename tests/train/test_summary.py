"""The end-of-run summary and the start-up header on small runs: 1 and 2 ranks, one node, a
resumed launch (qshard.train._summary, fed the result dict the loop builds)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qshard.comm import Topology
from qshard.comm.ledger import CommLedger
from qshard.train._summary import _count, estimate_run, header, summary
from qshard.train.config import TrainConfig
from qshard.train.loop import gpt_config_of
from qshard.train.model import GPT

CONFIG = TrainConfig(n_layer=1, n_embd=32, n_head=2, context=32, batch_size=4)


def _estimates(config: TrainConfig, world: int, per_node: int):
    model = GPT(gpt_config_of(config))
    topo = Topology(world_size=world, ranks_per_node=per_node, rank=0)
    return estimate_run(config, model, topo, torch.float32), topo


def _result(world: int, nodes: int, losses: dict[int, float], start: int = 0) -> dict:
    return {
        "losses": losses,
        "val_losses": {},
        "start_step": start,
        "world_size": world,
        "num_nodes": nodes,
        "train_time_s": 2.0,
        "peak_memory_bytes": 1,
        "optimizer_state_bytes": 1,
        "ddp_fp32_inter_node_bytes_per_step": 0.0,
    }


def _text(config, world, per_node, losses, *, start=0, record=None):
    est, topo = _estimates(config, world, per_node)
    ledger = CommLedger(topo)
    if record:
        ledger.record(record[0], group_ranks=list(range(world)), tensor_bytes=4096, tag=record[1])
    result = _result(world, topo.num_nodes, losses, start)
    return summary(config, result, ledger.summary(), max(1, len(losses)), est)


def test_counts_are_readable_at_any_size():
    """The header wrote every count in millions: a small corpus read "0.0M train / 0.00M val
    tokens" and the test model "0.02M params"."""
    assert [_count(n) for n in (0, 7, 950, 999.6, 21_984, 999_600)] == [
        "0",
        "7",
        "950",
        "1.00k",
        "22.0k",
        "1.00M",
    ]
    assert [_count(n) for n in (3_261_696, 178_300_000, 1.2e9, 3.4e12)] == [
        "3.26M",
        "178M",
        "1.20B",
        "3400B",
    ]
    est, _ = _estimates(CONFIG, 1, 1)
    corpus = SimpleNamespace(
        source="corpus.txt", train=SimpleNamespace(size=21_003), val=SimpleNamespace(size=1_107)
    )
    first = header(
        CONFIG,
        num_params=21_984,
        layout="L",
        compute_dtype=torch.float32,
        corpus=corpus,
        estimates=est,
    ).splitlines()[0]
    assert first.startswith("qshard train: 22.0k params, L,"), first
    assert first.endswith("corpus corpus.txt (21.0k train / 1.11k val tokens)"), first


def test_one_step_reads_in_the_singular():
    """A 1-step run read "1 steps in 0.0 s" and "loss A (step 0) -> A (step 0), mean of last 1
    A"; a run under a second read "0.0 s"."""
    text = _text(CONFIG, 1, 1, {0: 5.5})
    assert "1 step in 2.0 s (validation" in text, text
    assert "loss 5.5000 (step 0, the only step)" in text
    two = _text(CONFIG, 1, 1, {0: 5.5, 1: 5.0})
    assert "2 steps in 2.0 s" in two
    assert "loss 5.5000 (step 0) -> 5.0000 (step 1), mean of last 2 5.2500" in two
    est, topo = _estimates(CONFIG, 1, 1)
    fast = {**_result(1, 1, {0: 5.5, 1: 5.0}), "train_time_s": 0.0421}
    text = summary(CONFIG, fast, CommLedger(topo).summary(), 2, est)
    assert "2 steps in 42 ms (validation" in text, text


def test_no_cross_node_bytes_says_why():
    """On 1 rank (ZeRO++ all: the default) the summary blamed "plain FSDP2 does not report to
    it"; on one node of 2 ranks it said "(one node)" without saying that the analytic rows are
    cross-node bytes too. Each case now names its own reason."""
    one_rank = _text(CONFIG, 1, 1, {0: 5.5, 1: 5.0})
    assert "one rank: nothing is communicated, so every row above is 0" in one_rank
    assert "plain FSDP2" not in one_rank
    one_node = _text(CONFIG, 2, 2, {0: 5.5, 1: 5.0}, record=("all_gather", "fwd_all_gather"))
    assert "no cross-node bytes measured: the 2 ranks are one node" in one_node, one_node
    assert "plain FSDP2" not in one_node
    # Two ranks and an empty ledger: a layout whose collectives do not record (plain FSDP2).
    plain = _text(CONFIG, 2, 2, {0: 5.5, 1: 5.0})
    assert "the ledger recorded no collectives (plain FSDP2 without qshard.zeropp" in plain
    two_nodes = _text(CONFIG, 2, 1, {0: 5.5, 1: 5.0}, record=("all_gather", "fwd_all_gather"))
    assert "cross-node bytes saved vs ZeRO-3" in two_nodes


def test_gloo_all_reduce_note_on_one_node():
    """On one node the gradient "reduce-scatter" that gloo runs as an all-reduce showed twice a
    reduce-scatter's intra-node bytes without the note (it was tied to inter-node bytes)."""
    config = CONFIG.replace(zeropp="off", optim="adamw")
    text = _text(config, 2, 2, {0: 5.5, 1: 5.0}, record=("all_reduce", "grad_reduce_scatter"))
    assert "gloo has no reduce-scatter" in text, text


def test_resumed_summary_says_what_it_covers():
    """After --resume the loss, throughput and bytes are this launch's: the summary read like
    the whole run's. A restart after the last checkpoint trained nothing and printed a table of
    zeros blamed on plain FSDP2."""
    config = CONFIG.replace(steps=6, warmup_steps=1)
    text = _text(config, 1, 1, {3: 5.0, 4: 4.9, 5: 4.8}, start=3)
    assert (
        "resumed from the step-3 checkpoint: the figures below cover this launch only, "
        "steps 3-5 (3 of the run's 6 steps;" in text
    ), text
    assert "3 steps in 2.0 s" in text
    fresh = _text(config, 1, 1, {0: 5.0, 1: 4.9})
    assert "resumed" not in fresh
    nothing = _text(config, 1, 1, {}, start=6)
    assert (
        "resumed from the step-6 checkpoint, which is --steps 6: this launch trained no step"
        in (nothing)
    ), nothing
    assert "comm ledger" not in nothing and "plain FSDP2" not in nothing


@pytest.mark.parametrize("world,per_node,row", [(2, 2, False), (4, 2, True), (2, 1, True)])
def test_hpz_secondary_shard_only_across_nodes(world, per_node, row):
    """On one node hpZ reshards to the whole world (ZeRO-3's shard, no secondary copy), but the
    memory estimate added an "hpZ secondary shard" row."""
    est, _ = _estimates(CONFIG, world, per_node)  # --zeropp all, the default
    assert ("hpZ secondary shard" in est.memory) is row, est.memory
    if row:
        # only the blocks before the kept last ones (2 by default) get a secondary shard: the
        # kept ones and the root stay unsharded ("unsharded units"); every parameter was priced
        # (2.06x what hpZ held on the app's GPT; tests/zeropp/test_training.py measures it)
        blocks = list(GPT(gpt_config_of(CONFIG)).blocks)
        resharded = sum(p.numel() for b in blocks[: len(blocks) - 2] for p in b.parameters())
        assert est.memory["hpZ secondary shard"] == resharded * 4 / per_node, est.memory


def test_the_layout_line_counts_in_the_right_number():
    """The summary's layout line said "1 nodes x 1" and "(1 ranks)" (qshard.train._parallel)."""
    from qshard.train._parallel import _n

    assert [_n(1, "node"), _n(2, "node"), _n(1, "rank"), _n(4, "rank")] == [
        "1 node",
        "2 nodes",
        "1 rank",
        "4 ranks",
    ]
