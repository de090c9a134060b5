"""Training steps that fail and are skipped, with ZeRO++ against plain FSDP2 under the same faults.

One 2 nodes x 2 ranks gloo world runs every sub-case. A step fails on every rank at the same
program point: an exception raised by a gradient hook inside backward (after the last block's
reduce-scatter was deferred and the middle block gathered, with the first one prefetched), a
``KeyboardInterrupt`` there, an exception in the forward after two blocks were gathered, or a
NaN loss the loop skips before backward. The loop catches it, zeroes the gradients (in place:
``set_to_none=False``, the harder case for a reduction still in flight) and goes on, with and
without FSDP2's ``reset_iter_state()``. Then every model must train as it would have:
bit-identical to plain FSDP2 with the features off and with hpZ alone (whose reduce-scatter is
deferred), bit-identical to the same ZeRO++ config with ``overlap_reduce_scatter=False`` and
close to plain FSDP2 with quantization; HSDP with an INT8 replicate all-reduce (deferred)
bit-identical to its synchronous hook; no deferred reduction left in the overlap queue after
the failed ``backward()`` returns; every rank having issued as many collectives on every process
group; and no memory growing over repeated failed steps.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard

from qshard._fsdp import fsdp_param_groups
from qshard.comm import Topology
from qshard.testing import run_world
from qshard.train.model import GPT, GPTConfig
from qshard.zeropp import ZeroPPConfig, shard

CFG = GPTConfig(vocab_size=64, context=16, n_layer=3, n_head=2, n_embd=32, seed=0)
FEATURES = {
    "off": {},
    "hpz": {"hpz": True},  # the plain reduce-scatter, deferred: bit-identical to FSDP2
    "qwz": {"qwz": True},
    "qgz": {"qgz": True},
    "all": {"qwz": True, "hpz": True, "qgz": True},
    "all_sync": {"qwz": True, "hpz": True, "qgz": True, "overlap_reduce_scatter": False},
    # HSDP's replicate all-reduce, deferred through the backward: bit-identical to its
    # synchronous hook ([Note: deferred replicate all-reduce] in qshard.zeropp.all_reduce)
    "hsdp8": {"hsdp": True, "replicate_bits": 8},
    "hsdp8_sync": {"hsdp": True, "replicate_bits": 8, "overlap_reduce_scatter": False},
}
#: kind -> the run it must equal bit for bit (the others: plain FSDP2)
EXACT_AGAINST = {"all": "all_sync", "hsdp8": "hsdp8_sync"}
#: step -> how it fails (every rank): see _Fault.
FAULTS = {0: "backward", 2: "interrupt", 3: "forward", 4: "nan"}
STEPS = 7
# FSDP2's recovery call after a failed backward: in torch 2.13 (2.9 and 2.11 lack it, and
# those cases are left out there).
HAS_RESET = hasattr(FSDPModule, "reset_iter_state")
RESETS = (False, True) if HAS_RESET else (False,)


class _Boom(RuntimeError):
    pass


class _Fault:
    """A forward hook on the middle block that, when armed, raises in the forward or puts a
    gradient hook on its output that raises inside backward (a gradient check), after FSDP2's
    own pre-backward hook there (which gathers the block and prefetches the one before it)."""

    def __init__(self) -> None:
        self.mode: str | None = None

    def __call__(self, module, args, output):
        if self.mode == "forward":
            raise _Boom("forward")
        if self.mode in ("backward", "interrupt") and output.requires_grad:
            exc = KeyboardInterrupt if self.mode == "interrupt" else _Boom

            def check(grad):
                raise exc("gradient check")

            output.register_hook(check)


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.context + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _build(kind: str, topo: Topology):
    model = GPT(CFG)
    if kind == "fsdp":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        model = shard(model, topology=topo, config=ZeroPPConfig(**FEATURES[kind]))
    fault = _Fault()
    model.blocks[1].register_forward_hook(fault)
    return model, fault


def _queue_len(model) -> int:
    groups = [fsdp_param_groups(m)[0] for m in model.modules() if isinstance(m, FSDPModule)]
    comms = [g._reduce_scatter_comm for g in groups] + [g._all_reduce_hook for g in groups]
    return sum(len(c.queue) for c in comms if c is not None and hasattr(c, "queue"))


def _seqs(topo: Topology) -> list[int]:
    """Collectives issued so far on the world, node and peer groups."""
    groups = (dist.group.WORLD, topo.intra_node_group, topo.inter_node_group)
    return [g._get_sequence_number_for_group() for g in groups]


def _step(model, fault, opt, rank: int, step: int, faults: dict) -> tuple[str, float | None]:
    x, y = _batch(rank, step)
    fault.mode = faults.get(step)
    try:
        _, loss = model(x, y)
        if fault.mode == "nan":
            loss = loss * float("nan")
        if not torch.isfinite(loss):
            return "nan", None  # skipped before backward
        loss.backward()
    except (_Boom, KeyboardInterrupt) as exc:
        return type(exc).__name__, None
    finally:
        fault.mode = None
    opt.step()
    return "ok", loss.item()


def _trajectory(kind: str, topo: Topology, rank: int, reset: bool) -> dict:
    model, fault = _build(kind, topo)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    out: dict = {"loss": [], "what": [], "queue": [], "seq": []}
    for step in range(STEPS):
        what, loss = _step(model, fault, opt, rank, step, FAULTS)
        out["what"].append(what)
        out["loss"].append(loss)
        out["queue"].append(_queue_len(model))  # right after the failed backward() returned
        out["seq"].append(_seqs(topo))
        opt.zero_grad(set_to_none=False)
        if what != "ok" and reset:
            model.reset_iter_state()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()  # plain FSDP2 without reset_iter_state() leaves some units unsharded
    # full tensors: HSDP shards inside a node, FSDP2 over the world (collective, same order)
    out["params"] = [p.full_tensor().detach().clone() for p in model.parameters()]
    return out


def _case_trajectories(topo: Topology, rank: int, res: dict) -> None:
    for reset in RESETS:
        runs = {kind: _trajectory(kind, topo, rank, reset) for kind in ("fsdp", *FEATURES)}
        ref = runs["fsdp"]
        for kind, run in runs.items():
            key = f"{kind}_{'reset' if reset else 'noreset'}"
            res[f"{key}_what"] = run["what"]
            res[f"{key}_queue"] = run["queue"]
            res[f"{key}_seq"] = run["seq"]
            same = runs[EXACT_AGAINST.get(kind, "fsdp")]
            res[f"{key}_exact"] = run["loss"] == same["loss"] and all(
                torch.equal(a, b) for a, b in zip(run["params"], same["params"])
            )
            res[f"{key}_close"] = max(
                (a - b).abs().max().item() for a, b in zip(run["params"], ref["params"])
            )
            res[f"{key}_loss_close"] = max(
                abs(a - b) for a, b in zip(run["loss"], ref["loss"]) if a is not None
            )


def _live_tensor_bytes() -> int:
    # gloo's worker thread may still hold the last reference to a finished collective's
    # tensors (it drops it after the waiter wakes; [Note: exit after collectives] in
    # qshard/comm/_exit.py): on a loaded machine one count saw 4224 bytes more on one rank.
    # Sleeping releases the GIL so the worker can drop them before counting.
    time.sleep(0.05)
    gc.collect()
    total, seen = 0, set()
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                key = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # a DTensor, a freed storage
                continue
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def _case_repeated_failures(topo: Topology, rank: int, res: dict) -> None:
    """20 failed backwards in a row (all features, reset_iter_state after each): the live
    tensor bytes after 20 equal those after 2, and nothing stays in the queue."""
    model, fault = _build("all", topo)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    faults = dict.fromkeys(range(1, 21), "backward")
    _step(model, fault, opt, rank, 0, faults)  # a good step: optimizer state exists
    opt.zero_grad(set_to_none=True)
    sizes = []
    for step in range(1, 21):
        what, _ = _step(model, fault, opt, rank, step, faults)
        assert what == "_Boom", what
        opt.zero_grad(set_to_none=True)
        model.reset_iter_state()
        if step in (2, 20):
            sizes.append(_live_tensor_bytes())
    res["repeat_bytes"] = sizes
    res["repeat_queue"] = _queue_len(model)
    res["repeat_unsharded"] = [
        g._all_gather_result is None
        for m in model.modules()
        if isinstance(m, FSDPModule)
        for g in fsdp_param_groups(m)
    ]


def _run(rank: int, world: int) -> dict:
    topo = Topology(world_size=world, ranks_per_node=2)
    topo.init_groups()
    res: dict = {}
    for case in (_case_trajectories, _case_repeated_failures)[: 2 if HAS_RESET else 1]:
        case(topo, rank, res)
        dist.barrier()
    # (d): every rank issued as many collectives on each group it belongs to.
    gathered = [None] * world
    dist.all_gather_object(gathered, {k: v for k, v in res.items() if k.endswith("_seq")})
    res["seq_all_ranks"] = gathered
    return res


@pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < "2.11",
    reason="plain FSDP2 of torch 2.9 cannot go on after a failed backward (the next forward "
    "meets 'mixed torch.Tensor and DTensor'), and it has no reset_iter_state() (measured on 2.9.1)",
)
def test_failed_steps_train_on_like_plain_fsdp2_2x2():
    out = run_world(_run, 4, timeout_s=300)
    expected = ["_Boom", "ok", "KeyboardInterrupt", "_Boom", "nan", "ok", "ok"]
    topo = [Topology(world_size=4, ranks_per_node=2, rank=r) for r in range(4)]
    for rank, r in enumerate(out):
        for reset in ("noreset", "reset")[: len(RESETS)]:
            for kind in ("fsdp", *FEATURES):
                key = f"{kind}_{reset}"
                assert r[f"{key}_what"] == expected, (rank, key, r[f"{key}_what"])
                if kind in ("off", "hpz", *EXACT_AGAINST):  # see EXACT_AGAINST
                    assert r[f"{key}_exact"], (rank, key)
                assert r[f"{key}_queue"] == [0] * STEPS, (rank, key, r[f"{key}_queue"])
                assert r[f"{key}_close"] < 0.05, (rank, key, r[f"{key}_close"])
                assert r[f"{key}_loss_close"] < 0.05, (rank, key, r[f"{key}_loss_close"])
        if HAS_RESET:
            a, b = r["repeat_bytes"]
            assert a == b, (rank, a, b)
            assert r["repeat_queue"] == 0 and all(r["repeat_unsharded"]), rank
    # Collective counts per group agree among the group's members at every step.
    seqs = out[0]["seq_all_ranks"]
    for key in seqs[0]:
        for step in range(STEPS):
            world = {seqs[p][key][step][0] for p in range(4)}
            assert len(world) == 1, (key, step, world)
            for p in range(4):
                t = topo[p]
                for q in t.node_ranks(t.node):
                    assert seqs[p][key][step][1] == seqs[q][key][step][1], (key, step, p, q)
                for q in t.peer_ranks(t.local_rank):
                    assert seqs[p][key][step][2] == seqs[q][key][step][2], (key, step, p, q)
