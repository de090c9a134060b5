"""``qshard.zeropp.StepInBackward`` against the usual loop (``backward()``, then
``optimizer.step()``).

One 2 nodes x 2 ranks gloo world runs every sub-case; a world of one checks the first user's
single process. The reference is the same model and optimizer stepped after ``backward()``:
stepping each unit inside backward, as its reduced gradient lands, must give bit-identical losses
and parameters (each update is elementwise per parameter) and the same wire bytes, with qgZ still
deferred (the same ``qgz_overlapped`` count) and every stepped gradient freed when ``backward()``
returns. Bad inputs are refused with errors that name the fix.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from qshard.comm import CommLedger, Topology, recording
from qshard.optim import AdamW8bit, OneBitAdam
from qshard.testing import run_world
from qshard.train.model import GPT, GPTConfig
from qshard.zeropp import StepInBackward, ZeroPPConfig, shard

CFG = GPTConfig(vocab_size=64, context=16, n_layer=3, n_head=2, n_embd=32, seed=0)
UNITS = CFG.n_layer + 1  # every block and the root
STEPS = 4


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.context + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _optimizer(name: str, params):
    if name == "adamw8bit":
        return AdamW8bit(params, lr=3e-3, min_8bit_size=64)
    return torch.optim.AdamW(params, lr=3e-3, **({"fused": True} if name == "fused" else {}))


def _trajectory(topo, rank, *, stepper: bool, opt="fused", accumulate=False, **kw):
    """Losses, final local shards, per-step events and inter-node bytes of ``STEPS`` steps."""
    mp = kw.pop("mp", None)
    model = shard(GPT(CFG), topology=topo, config=ZeroPPConfig(**kw), mp_policy=mp)
    other = None
    if opt == "two":  # the blocks' AdamW inside backward, the root's SGD after it
        blocks = {id(p) for p in model.blocks.parameters()}
        optimizer = _optimizer("fused", [p for p in model.parameters() if id(p) in blocks])
        rest = [p for p in model.parameters() if id(p) not in blocks]
        other = torch.optim.SGD(rest, lr=0.1, momentum=0.9)
    else:
        optimizer = _optimizer(opt, model.parameters())
    sib = StepInBackward(model, optimizer) if stepper else None
    alive: list[int] = []  # gradients alive as each unit lands (the memory stepping frees)
    if sib is not None:
        landed = sib._queue.on_landed

        def count(unit):
            alive.append(sum(p.grad is not None for p in model.parameters()))
            landed(unit)

        sib._queue.on_landed = count
    ledger = CommLedger(topo)
    out: dict = {"loss": [], "events": [], "inter": []}
    for i in range(STEPS):
        with recording(ledger):
            if accumulate:  # two micro-batches: the first reduced and kept, not stepped
                x, y = _batch(rank + 10, i)
                with sib.paused() if sib else contextlib.nullcontext():
                    model(x, y)[1].backward()
            x, y = _batch(rank, i)
            _, loss = model(x, y)
            loss.backward()
        if sib is None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            held = {id(p) for g in optimizer.param_groups for p in g["params"]}
            for p in model.parameters():  # stepped and freed; another optimizer's kept
                assert (p.grad is None) == (id(p) in held)
            assert optimizer.step() is None  # no gradient left: nothing happens
        if other is not None:
            other.step()
            other.zero_grad(set_to_none=True)
        s = ledger.step()
        out["loss"].append(loss.item())
        out["events"].append(s.event("qgz_overlapped"))
        out["inter"].append(s.inter_node_bytes)
    out["params"] = [p.to_local().detach().clone() for p in model.parameters()]
    out["alive"] = (max(alive, default=0), sum(1 for _ in model.parameters()))
    if sib is not None:
        sib.close()
    return out


CASES = {
    "all": {"qwz": True, "hpz": True, "qgz": True},
    "qwz": {"qwz": True},
    "qgz": {"qgz": True},
    "zero3": {"overlap_reduce_scatter": True},
    "zero3_synchronous": {},  # every reduction inside FSDP2's call: units land a call later
    "qwz_int4_foreach": {"qwz": True, "weight_bits": 4, "opt": "foreach"},
    "all_adamw8bit": {"qwz": True, "hpz": True, "qgz": True, "opt": "adamw8bit"},
    "qwz_bf16": {"qwz": True, "mp": MixedPrecisionPolicy(param_dtype=torch.bfloat16)},
    "all_accumulate": {"qwz": True, "hpz": True, "qgz": True, "accumulate": True},
    "qwz_two_optimizers": {"qwz": True, "opt": "two"},
}


def _case_trajectories(topo, rank, res):
    for name, kw in CASES.items():
        ref = _trajectory(topo, rank, stepper=False, **dict(kw))
        got = _trajectory(topo, rank, stepper=True, **dict(kw))
        res[name] = {
            "loss": ref["loss"] == got["loss"],
            "params": all(torch.equal(a, b) for a, b in zip(ref["params"], got["params"])),
            "overlapped": (ref["events"], got["events"]),
            "inter": (ref["inter"], got["inter"]),
            "alive": got["alive"],
        }
        dist.barrier()


def _case_refusals(topo, rank, res):
    errors = {}
    model = shard(GPT(CFG), topology=topo, config=ZeroPPConfig(qwz=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for key, call in (
        ("not_fsdp", lambda: StepInBackward(GPT(CFG), opt)),
        ("not_optimizer", lambda: StepInBackward(model, object())),
        ("onebit", lambda: StepInBackward(model, OneBitAdam([torch.nn.Parameter(torch.ones(3))]))),
        ("foreign", lambda: StepInBackward(model, torch.optim.SGD([torch.zeros(3)], lr=1))),
    ):
        try:
            call()
        except (TypeError, ValueError) as exc:
            errors[key] = str(exc)
    plain = GPT(CFG)  # FSDP2's own comms
    for block in plain.blocks:
        fully_shard(block)
    fully_shard(plain)
    try:
        StepInBackward(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3))
    except ValueError as exc:
        errors["plain_fsdp2_comm"] = str(exc)
    first = StepInBackward(model, opt)
    with pytest.warns(UserWarning, match="replaces it"):
        second = StepInBackward(model, opt)  # (the first one lost: nothing left to close)
    assert first._closed and second._queue.on_landed == second._landed
    second.close()
    StepInBackward(model, opt).close()  # after close() another one takes over silently
    with pytest.raises(RuntimeError, match="closed"), first.paused():
        pass
    res["errors"] = errors


def _run(rank: int, world: int) -> dict:
    topo = Topology(world_size=world, ranks_per_node=2)
    topo.init_groups()
    res: dict = {}
    for case in (_case_trajectories, _case_refusals):
        case(topo, rank, res)
        dist.barrier()
    return res


def test_step_in_backward_matches_the_usual_loop_2x2():
    out = run_world(_run, 4, timeout_s=600)
    for rank, r in enumerate(out):
        for name in CASES:
            c = r[name]
            assert c["loss"] and c["params"], (rank, name)
            # qgZ stays deferred: stepping reads the gradients only once they are written
            assert c["overlapped"][0] == c["overlapped"][1], (rank, name, c["overlapped"])
            assert c["inter"][0] == c["inter"][1], (rank, name, c["inter"])
            # Units stepped and freed during backward: with synchronous reductions each lands at
            # the next call, so never every gradient is alive at once; deferred ones land when
            # their hops arrive (here often all in the final drain: timing, not asserted).
            most, total = c["alive"]
            assert most > 0 and (most < total or name != "zero3_synchronous"), (rank, name, most)
        errors = r["errors"]
        assert "FSDP2 model" in errors["not_fsdp"]
        assert "torch.optim.Optimizer" in errors["not_optimizer"]
        assert "optimizer.step() after backward()" in errors["onebit"]
        assert "build the optimizer after shard()" in errors["foreign"]
        assert "overlap_reduce_scatter=True" in errors["plain_fsdp2_comm"]


def _run_one(rank: int, world: int) -> dict:
    topo = Topology(world_size=1, ranks_per_node=1)
    res = {}
    for name, kw in (("qwz", {"qwz": True}), ("zero3", {"overlap_reduce_scatter": True})):
        ref = _trajectory(topo, rank, stepper=False, **kw)
        got = _trajectory(topo, rank, stepper=True, **kw)
        res[name] = ref["loss"] == got["loss"] and all(
            torch.equal(a, b) for a, b in zip(ref["params"], got["params"])
        )
        res[f"{name}_moved"] = got["loss"][0] != got["loss"][-1]
    return res


def test_step_in_backward_on_one_rank():
    (r,) = run_world(_run_one, 1, timeout_s=300)
    assert r == {"qwz": True, "qwz_moved": True, "zero3": True, "zero3_moved": True}
