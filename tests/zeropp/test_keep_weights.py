"""``qshard.zeropp.set_keep_weights_after_backward`` ([Note: weights kept across
micro-batches]) against the same accumulation without it.

One 2 nodes x 2 ranks gloo world runs every sub-case: K micro-batches per step with the copies
kept after every backward but the last must give bit-identical losses and parameters (the kept
copy is the forward's own weights) while the forward's cross-node gathers happen once per step
instead of K times; a keep left on across an optimizer step must not serve pre-step weights
(shard()'s guard reshards); bad inputs are refused with the fix. A world of one checks the first
user's single process.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from qshard.comm import CommLedger, Topology, recording
from qshard.testing import run_world
from qshard.train.model import GPT, GPTConfig
from qshard.zeropp import ZeroPPConfig, set_keep_weights_after_backward, shard

CFG = GPTConfig(vocab_size=64, context=16, n_layer=4, n_head=2, n_embd=32, seed=0)
STEPS, K = 3, 3


def _batch(rank: int, step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.context + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _run(topo, rank, keep: str, mp=None, **features):
    """Losses, final shards, forward gather bytes and kept units of STEPS steps of K
    micro-batches. ``keep``: "off", "until_last" (the intended use) or "always" (never turned
    off: the guard must drop the copies at each step)."""
    model = shard(GPT(CFG), topology=topo, config=ZeroPPConfig(**features), mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ledger = CommLedger(topo)
    losses, kept, warned = [], set(), []
    for step in range(STEPS):
        with recording(ledger):
            for m in range(K):
                if keep != "off":
                    on = keep == "always" or m < K - 1
                    kept.add(set_keep_weights_after_backward(model, on))
                x, y = _batch(rank, step, m)
                loss = model(x, y)[1]
                (loss / K).backward()
                losses.append(loss.item())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
        warned += [str(w.message) for w in caught if "set_keep_weights" in str(w.message)]
        optimizer.zero_grad(set_to_none=True)
    for unit in model.modules():  # what a keep left on holds (the guard drops it at a step)
        if isinstance(unit, FSDPModule):
            unit.reshard()
    s = ledger.summary()
    return {
        "losses": losses,
        "params": [p.to_local().detach().clone() for p in model.parameters()],
        "fwd_inter": s.inter(tag="fwd_all_gather"),
        "fwd_intra": s.intra(tag="fwd_all_gather"),
        "rest_inter": s.inter_node_bytes - s.inter(tag="fwd_all_gather"),
        "kept": kept,
        "warned": warned,
    }


def _same(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(
        torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True)
    )


CASES = {
    "hpz": dict(hpz=True),
    "all": dict(hpz=True, qwz=True, qgz=True),
    "qwz": dict(qwz=True),  # no hpZ: only the root and the kept last blocks hold a copy
    "off": dict(),
}


def _world(rank, world):
    topo = Topology.from_env(ranks_per_node=2)
    out: dict = {}
    for name, features in CASES.items():
        runs = {k: _run(topo, rank, k, **features) for k in ("off", "until_last", "always")}
        out[name] = {
            "same": _same(runs["off"], runs["until_last"]),
            "same_always": _same(runs["off"], runs["always"]),
            **{
                f"{k}_{f}": runs[k][f]
                for k in runs
                for f in ("fwd_inter", "fwd_intra", "kept", "warned")
            },
            "rest": (runs["off"]["rest_inter"], runs["until_last"]["rest_inter"]),
        }
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    a = _run(topo, rank, "off", mp=bf16, hpz=True, qwz=True)
    b = _run(topo, rank, "until_last", mp=bf16, hpz=True, qwz=True)
    out["bf16_same"] = _same(a, b)
    out["bf16_ratio"] = b["fwd_inter"] / a["fwd_inter"]
    # refused: a model sharded by hand (no guard to drop a kept copy), a keep that is not bool
    plain = GPT(CFG)
    for block in plain.blocks:
        fully_shard(block, reshard_after_forward=2)
    fully_shard(plain)
    errors = []
    for model, keep in ((plain, True), (shard(GPT(CFG), topology=topo), 1)):
        try:
            set_keep_weights_after_backward(model, keep)
            errors.append("accepted")
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(_world, 4, timeout_s=300)


def test_kept_weights_give_the_same_bits_and_one_cross_node_forward_per_step(results):
    for r in results:
        for name in CASES:
            case = r[name]
            assert case["same"], name
            assert case["rest"][0] == case["rest"][1], name  # backward traffic unchanged
        for name in ("hpz", "all"):  # every unit holds a copy: the forward crosses once
            case = r[name]
            assert case["until_last_kept"] == {CFG.n_layer + 1}, name
            assert case["until_last_fwd_inter"] * K == pytest.approx(case["off_fwd_inter"]), name
            assert case["until_last_fwd_intra"] > 0, name  # the later ones stay in the node
        for name in ("qwz", "off"):  # the root and the kept blocks only
            case = r[name]
            kept = ZeroPPConfig(**CASES[name]).kept_blocks + 1
            assert case["until_last_kept"] == {kept}, name
            assert 0 < case["until_last_fwd_inter"] < case["off_fwd_inter"], name
        assert r["bf16_same"]
        assert r["bf16_ratio"] == pytest.approx(1 / K)


def test_a_keep_left_on_never_serves_pre_step_weights(results):
    """Never turned off, the copies outlive the last backward; the optimizer step's guard
    reshards them, so the next forward gathers the new weights (the losses and parameters of
    the run that keeps nothing), and warns: until then ``model.parameters()`` were the copies,
    so a ``clip_grad_norm_`` before the step saw none of their gradients."""
    for r in results:
        for name in CASES:
            assert r[name]["same_always"], name
            # ... and says that a clip before the step saw the copies, not the gradients
            assert len(r[name]["always_warned"]) == STEPS, name
            assert "Turn it off before the last micro-batch" in r[name]["always_warned"][0]
            assert r[name]["until_last_warned"] == r[name]["off_warned"] == [], name


def test_bad_uses_are_refused_with_the_fix(results):
    plain, not_bool = results[0]["errors"]
    assert plain.startswith("ValueError: set_keep_weights_after_backward: the model was not ")
    assert "shard it with shard() first" in plain
    assert not_bool == "TypeError: keep must be True or False; got 1"


def _one_rank(rank, world):
    topo = Topology.from_env(ranks_per_node=1)
    a = _run(topo, rank, "off", hpz=True, qwz=True, qgz=True)
    b = _run(topo, rank, "until_last", hpz=True, qwz=True, qgz=True)
    return _same(a, b)


def test_a_world_of_one():
    assert run_world(_one_rank, 1, timeout_s=120) == [True]
