"""``qshard train --parallel hsdp``: the four optimizers run, the ledger matches the HSDP
estimate, 0/1 Adam on HSDP resumes exactly; the options refuse meaningless combinations; the
memory estimate shows HSDP's cost between ZeRO-3's and a replica's."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from qshard.testing import run_world
from qshard.train.config import DATA_PARALLEL_OPTIMIZERS, OPTIMIZERS, REPLICATE_GRADS, TrainConfig
from qshard.train.estimate import estimate_hsdp_comm, estimate_memory, memory_by_layout


def _corpus_file(tmp: Path) -> None:
    # A few stdlib modules: real text, small enough to build instantly.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (tmp / "corpus.txt").write_bytes(
        b"".join((stdlib / m).read_bytes() for m in ("json/decoder.py", "abc.py", "bisect.py"))
    )


def _config(tmp: Path, world: int, rpn: int, **kw) -> TrainConfig:
    tiny = dict(n_layer=2, n_head=2, n_embd=32, context=32, batch_size=4, warmup_steps=1)
    return TrainConfig(
        **tiny,
        eval_batches=1,
        progress=False,
        lr=3e-3,
        min_lr=3e-4,
        nproc=world,
        ranks_per_node=rpn,
        data=str(tmp / "corpus.txt"),
        cache_dir=str(tmp / "cache"),
        **kw,
    )


def _world(rank: int, world: int, tmp: str) -> dict:
    from qshard.train.loop import train

    tmp_path = Path(tmp)
    out: dict = {}
    for optim, grads in (
        ("adamw", "fp32"),
        ("adamw", "int4"),
        ("adamw8bit", "bf16"),
        ("onebit_adam", "fp32"),
    ):
        cfg = _config(
            tmp_path,
            world,
            2,
            steps=4,
            out=str(tmp_path / f"{optim}-{grads}"),
            parallel="hsdp",
            zeropp="off",
            optim=optim,
            replicate_grads=grads,
            export=False,
            eval_interval=0,
        )
        r = train(cfg)
        out[f"{optim}-{grads}"] = {
            "losses": list(r["losses"].values()),
            "inter": r["inter_node_bytes_per_step"],
            "estimate": r["estimate_inter_node_bytes_per_step"],
        }
    # 0/1 Adam on HSDP: per-rank checkpoints at 3; resuming there reproduces steps 4..8
    zo = _config(
        tmp_path,
        world,
        2,
        steps=8,
        checkpoint_interval=3,
        keep_checkpoints=5,
        out=str(tmp_path / "zo_full"),
        parallel="hsdp",
        zeropp="off",
        optim="zero_one_adam",
        export=False,
        eval_interval=0,
    )
    full = train(zo)
    if rank == 0:
        shutil.copytree(
            tmp_path / "zo_full/checkpoints/step_00000003",
            tmp_path / "zo_resumed/checkpoints/step_00000003",
        )
    dist.barrier()
    resumed = train(zo.replace(out=str(tmp_path / "zo_resumed"), resume=True))
    out["zo_full"], out["zo_resumed"] = full["losses"], resumed["losses"]
    return out


def _other_nodes(rank: int, world: int, tmp: str) -> dict:
    """Load the 2-node 0/1 Adam checkpoint on 1 node x 2 ranks: each rank takes its own shard."""
    import torch

    from qshard.comm import Topology
    from qshard.train import checkpoint as ckpt
    from qshard.train.loop import build

    tmp_path = Path(tmp)
    cfg = _config(tmp_path, world, 2, steps=8, parallel="hsdp", zeropp="off", optim="zero_one_adam")
    model, opt, _ = build(cfg, topology=Topology.from_env(ranks_per_node=2))
    path = tmp_path / "zo_full/checkpoints/step_00000003"
    step = ckpt.load_checkpoint(path, model=model, optimizer=opt)
    saved = torch.load(path / f"rank_{rank:05d}.pt", weights_only=False)["model"]
    own = all(
        torch.equal(p.to_local(), saved[name].to_local()) for name, p in model.named_parameters()
    )
    return {"step": step, "own_shard": own, "world": opt.world_size}


def test_train_hsdp_2x2(tmp_path):
    _corpus_file(tmp_path)
    out = run_world(_world, 4, args=(str(tmp_path),), timeout_s=900)
    other = run_world(_other_nodes, 2, args=(str(tmp_path),), timeout_s=300)
    for r in other:
        assert r == {"step": 3, "own_shard": True, "world": 1}, r
    summary = (tmp_path / "adamw-fp32" / "summary.txt").read_text()
    assert "HSDP baseline, fp32 all-reduce (analytic)" in summary
    r = out[0]
    for name, res in r.items():
        if name.startswith("zo_"):
            continue
        losses = res["losses"]
        assert all(v == v for v in losses) and losses[-1] < losses[0], (name, losses)
    # fp32: FSDP2's replicate all-reduce is exactly the analytic HSDP volume
    fp32 = r["adamw-fp32"]
    assert fp32["inter"] == pytest.approx(fp32["estimate"], rel=1e-6)
    # INT4: about 1/7 of it (codes + scales + padding of the small shards)
    assert r["adamw-int4"]["inter"] < fp32["inter"] / 4
    assert r["adamw8bit-bf16"]["inter"] == pytest.approx(fp32["inter"] / 2, rel=0.02)
    assert r["onebit_adam-fp32"]["estimate"] is None  # its volume follows its schedule
    resumed = r["zo_resumed"]
    assert resumed == {s: r["zo_full"][s] for s in resumed}, (resumed, r["zo_full"])


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"parallel": "hsdp"}, "--zeropp off"),
        ({"parallel": "hsdp", "zeropp": "off", "replicate_grads": "int3"}, "int3"),
        ({"replicate_grads": "int4"}, "--parallel hsdp"),
        (
            {
                "parallel": "hsdp",
                "zeropp": "off",
                "optim": "zero_one_adam",
                "replicate_grads": "int4",
            },
            "nothing to compress",
        ),
        ({"parallel": "ddp"}, "choose from zero3, hsdp"),
    ],
)
def test_config_refusals(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        TrainConfig(**kw)


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_hsdp_sends_no_gradient_only_for_an_optimizer_that_syncs_replicas(tmp_path, optim):
    """``--parallel hsdp`` turns the inter-node gradient reduction off (replicate_reduce=False)
    for exactly the optimizers that sync the node replicas themselves, whatever
    ``--replicate-grads`` says; every other one would be refused by shard()'s guard (or drift)."""
    from qshard.optim._onebit import _DataParallelOneBitOptimizer
    from qshard.train._parallel import _OPTIMIZER_CLASSES, _zeropp_config, optional_feature

    cls = torch.optim.AdamW if optim == "adamw" else optional_feature(*_OPTIMIZER_CLASSES[optim])
    syncs = issubclass(cls, _DataParallelOneBitOptimizer)
    grads = ("fp32",) if optim in DATA_PARALLEL_OPTIMIZERS else REPLICATE_GRADS
    for g in grads:
        cfg = _config(tmp_path, 4, 2, parallel="hsdp", zeropp="off", optim=optim, replicate_grads=g)
        zcfg = _zeropp_config(cfg)
        assert zcfg.hsdp and zcfg.replicate_reduce is not syncs, (optim, g, zcfg)


def test_estimates_show_hsdp_between_zero3_and_replicated():
    sizes = dict(num_params=10_000_000, largest_unit_params=1_000_000, fp32_state_params=0)
    layouts = memory_by_layout(world_size=8, ranks_per_node=4, optim="adamw", **sizes)
    zero3, hsdp, replicated = layouts.values()
    assert zero3 < hsdp < replicated
    # params + grads + AdamW state (16 bytes/param) split 8 ways vs 4 ways
    assert hsdp - zero3 == pytest.approx(16 * 10_000_000 * (1 / 4 - 1 / 8))
    one = estimate_memory(
        world_size=8,
        ranks_per_node=4,
        features=frozenset(),
        optim="zero_one_adam",
        shard_ranks=4,
        **sizes,
    )
    # 0/1 Adam on HSDP: fp32 m, v, worker error, sync anchor and a server error of 1/nodes,
    # on 1/4 of M
    assert one["optimizer state (zero_one_adam)"] == pytest.approx((16 + 4 / 2) * 10_000_000 / 4)
    comm = estimate_hsdp_comm(num_params=1000, world_size=8, ranks_per_node=4)
    assert comm.total == pytest.approx(2 * (1 / 2) * 1000 * 4)
    assert estimate_hsdp_comm(num_params=1000, world_size=4, ranks_per_node=4).total == 0
