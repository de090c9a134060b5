"""Deferred qgZ (``ZeroPPConfig.overlap_reduce_scatter``) against the synchronous qgZ it replaces.

One 2 nodes x 2 ranks gloo world runs every sub-case. The reference is the same model with
``overlap_reduce_scatter=False`` (qgZ inside FSDP2's call, the path tests/zeropp/test_training
checks against plain FSDP2): the deferred path must give bit-identical gradients, losses and
parameters and record the same wire bytes, in every case FSDP2 allows it, and must fall back to
the synchronous path (counted: ledger event ``qgz_overlapped`` per deferred call) where FSDP2
does more than view the output. An error inside a deferred hop must raise from ``backward()``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from qshard._fsdp import fsdp_param_groups
from qshard.comm import CommLedger, Topology, duplex, recording
from qshard.testing import run_world
from qshard.train.model import GPT, GPTConfig
from qshard.zeropp import HierarchicalQuantizedReduceScatter, ZeroPPConfig, shard
from qshard.zeropp.reduce_scatter import _Reduction

CFG = GPTConfig(vocab_size=64, context=16, n_layer=3, n_head=2, n_embd=32, seed=0)
UNITS = CFG.n_layer + 1  # every block and the root reduce once per backward


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.context + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _model(topo: Topology, overlap: bool | None, mp: MixedPrecisionPolicy | None = None, **kw):
    kw.setdefault("qgz", True)
    cfg = ZeroPPConfig(overlap_reduce_scatter=overlap, **kw)
    return shard(GPT(CFG), topology=topo, config=cfg, mp_policy=mp)


def _overlapped(summary) -> int:
    """Deferred reduce-scatter calls of a step: qgZ's and the plain ones."""
    return summary.event("qgz_overlapped") + summary.event("reduce_scatter_overlapped")


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.to_local().detach().clone() for p in model.parameters()]


def _backward(model, ledger: CommLedger, rank: int, step: int, *, sync: bool = True):
    x, y = _batch(rank, step)
    model.set_requires_gradient_sync(sync)
    with recording(ledger):
        _, loss = model(x, y)
        loss.backward()
    return loss.item()


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def _bytes(summary) -> dict:
    return {(e.tag, e.op): (e.intra_node_bytes, e.inter_node_bytes) for e in summary.entries}


def _trajectory(topo, rank, overlap, steps=4, **kw):
    """Losses, per-step grads, final params, per-step bytes and overlapped calls."""
    model = _model(topo, overlap, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ledger = CommLedger(topo)
    out = {"loss": [], "grads": [], "bytes": [], "overlapped": []}
    for i in range(steps):
        out["loss"].append(_backward(model, ledger, rank, i))
        out["grads"].append(_grads(model))
        s = ledger.step()
        out["bytes"].append(_bytes(s))
        out["overlapped"].append(_overlapped(s))
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = [p.to_local().detach().clone() for p in model.parameters()]
    return out


def _case_trajectories(topo, rank, res):
    for name, kw in (
        ("qgz", {}),
        ("qgz_k2_int8", {"pipeline_stages": 2, "grad_bits": 8}),
        ("all", {"qwz": True, "hpz": True}),
        ("all_depth2", {"qwz": True, "hpz": True, "prefetch_depth": 2}),
        # The plain reduce-scatter deferred (ZeRO++ features without qgZ, and forced on ZeRO-3).
        ("hpz", {"hpz": True, "qgz": False}),
        ("qwz", {"qwz": True, "qgz": False}),
        ("hpz_bf16_wire", {"hpz": True, "qgz": False, "wire_dtype": torch.bfloat16}),
        ("zero3_forced", {"qgz": False}),
    ):
        sync = _trajectory(topo, rank, False, **kw)
        over = _trajectory(topo, rank, True, **kw)
        res[f"{name}_loss"] = over["loss"] == sync["loss"]
        res[f"{name}_grads"] = all(_equal(a, b) for a, b in zip(over["grads"], sync["grads"]))
        res[f"{name}_params"] = _equal(over["params"], sync["params"])
        res[f"{name}_bytes"] = over["bytes"] == sync["bytes"]
        res[f"{name}_overlapped"] = (over["overlapped"], sync["overlapped"])


def _case_defaults(topo, rank, res):
    """overlap_reduce_scatter=None: on with a ZeRO++ feature, off for plain ZeRO-3."""
    for name, kw in (
        ("default_zero3", {"qgz": False}),
        ("default_hpz", {"qgz": False, "hpz": True}),
    ):
        model, ledger = _model(topo, None, **kw), CommLedger(topo)
        _backward(model, ledger, rank, 0)
        res[name] = _overlapped(ledger.step())


def _case_accumulation(topo, rank, res):
    """Microbatch 1 without gradient sync, microbatch 2 with it (FSDP2 reduces the accumulated
    unsharded grads: deferrable); then a second synced backward adds into existing sharded
    grads (not deferrable: FSDP2 adds the output into them)."""
    got = {}
    for overlap in (False, True):
        model, ledger = _model(topo, overlap), CommLedger(topo)
        _backward(model, ledger, rank, 0, sync=False)
        _backward(model, ledger, rank, 1, sync=True)
        first = _grads(model)
        n_first = ledger.step().event("qgz_overlapped")
        _backward(model, ledger, rank, 2, sync=True)  # accumulates into the sharded grads
        got[overlap] = (first, _grads(model), n_first, ledger.step().event("qgz_overlapped"))
    (f0, s0, _, _), (f1, s1, n1, n2) = got[False], got[True]
    res["accum_no_sync_then_sync"] = _equal(f0, f1)
    res["accum_into_existing"] = _equal(s0, s1)
    res["accum_events"] = (n1, n2)


def _case_hook(topo, rank, res):
    """A post-accumulate-grad hook on one block's parameter: that unit runs synchronously and
    the hook reads final values; the other units still overlap."""
    got = {}
    for overlap in (False, True):
        model, ledger = _model(topo, overlap), CommLedger(topo)
        seen = []
        param = next(model.blocks[1].parameters())
        param.register_post_accumulate_grad_hook(
            lambda p, seen=seen: seen.append(p.grad.to_local().detach().clone())
        )
        _backward(model, ledger, rank, 0)
        got[overlap] = (seen, _grads(model), ledger.step().event("qgz_overlapped"))
    res["hook_seen"] = _equal(got[False][0], got[True][0]) and len(got[True][0]) == 1
    res["hook_grads"] = _equal(got[False][1], got[True][1])
    res["hook_events"] = got[True][2]


def _case_mixed_precision(topo, rank, res):
    """bf16 params with fp32 reduction (FSDP2 views the fp32 output: deferrable) and with bf16
    reduction (FSDP2 casts the output to fp32: synchronous)."""
    for name, reduce_dtype in (("mp_fp32_reduce", torch.float32), ("mp_bf16_reduce", None)):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        got = {}
        for overlap in (False, True):
            model, ledger = _model(topo, overlap, mp), CommLedger(topo)
            loss = _backward(model, ledger, rank, 0)
            got[overlap] = (loss, _grads(model), ledger.step().event("qgz_overlapped"))
        res[name] = got[False][0] == got[True][0] and _equal(got[False][1], got[True][1])
        res[f"{name}_events"] = got[True][2]


def _case_clip(topo, rank, res):
    """clip_grad_norm_ right after backward sees the final gradients."""
    got = {}
    for overlap in (False, True):
        model, ledger = _model(topo, overlap), CommLedger(topo)
        _backward(model, ledger, rank, 0)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        got[overlap] = (norm.full_tensor().item(), _grads(model))
    res["clip_norm"] = got[False][0] == got[True][0]
    res["clip_grads"] = _equal(got[False][1], got[True][1])


class _FailingWork:
    """A work handle whose wait() raises, as a failed inter-node transfer would. ``done``: what
    is_completed() says, so the queue meets it at the next qgZ call inside backward (True) or
    only in the drain at the end of backward (False)."""

    def __init__(self, real, done: bool):
        self._real, self._done = real, done

    def is_completed(self) -> bool:
        return self._done

    def wait(self, timeout=None):
        self._real.wait()
        raise RuntimeError("injected inter-node hop failure")


def _failing_backward(topo, model, rank: int, done: bool) -> str:
    # qgZ's hops go through qshard.comm.duplex (its 2-rank exchanges never reach
    # dist.all_to_all_single on gloo)
    real = duplex.all_to_all_single
    inter = topo.inter_node_group

    def failing(output, input, group, **kw):
        work = real(output, input, group, **kw)
        return _FailingWork(work, done) if group is inter else work

    duplex.all_to_all_single = failing
    try:
        _backward(model, CommLedger(topo), rank, 0)
        return "no error"
    except RuntimeError as exc:
        return str(exc)
    finally:
        duplex.all_to_all_single = real


def _case_error(topo, rank, res):
    """An error in a deferred hop is raised from backward(), whether it surfaces at a later qgZ
    call or in the drain at the end; the queue is left empty. Met in the drain (FSDP2 has
    finished its backward), the next step trains normally: the same grads as the synchronous
    model's. Met mid-backward, FSDP2's own recovery (reset_iter_state) follows."""
    ref = _model(topo, False)
    model = _model(topo, True)
    res["error_drain"] = _failing_backward(topo, model, rank, done=False)
    queue = _units(model)[0]._reduce_scatter_comm.queue
    res["error_queue_empty"] = len(queue) == 0 and all(
        u._reduce_scatter_comm.queue is queue for u in _units(model)
    )
    model.zero_grad(set_to_none=True)
    _backward(model, CommLedger(topo), rank, 1)
    _backward(ref, CommLedger(topo), rank, 1)
    res["error_recovers"] = _equal(_grads(model), _grads(ref))
    model = _model(topo, True)
    res["error_mid"] = _failing_backward(topo, model, rank, done=True)
    res["error_mid_queue_empty"] = len(_units(model)[0]._reduce_scatter_comm.queue) == 0
    if hasattr(model, "reset_iter_state"):  # not in torch 2.9 or 2.11
        model.reset_iter_state()


def _units(model) -> list:
    return [fsdp_param_groups(m)[0] for m in model.modules() if isinstance(m, FSDPModule)]


def _case_direct_call(topo, rank, res):
    """Called outside backward (no autograd callback to finish it), an overlapping comm runs
    synchronously: the output is written when the call returns."""
    comm = HierarchicalQuantizedReduceScatter(topology=topo, unit=None, overlap=True)
    inp = torch.randn(4 * 1000, generator=torch.Generator().manual_seed(rank))
    out, ref = torch.empty(1000), torch.empty(1000)
    comm(out, inp, dist.group.WORLD, dist.ReduceOp.AVG)
    HierarchicalQuantizedReduceScatter(topology=topo)(ref, inp, dist.group.WORLD, dist.ReduceOp.AVG)
    res["direct_sync"] = torch.equal(out, ref) and len(comm.queue) == 0
    # The state machine advanced step by step gives the bits of one blocking pass.
    out2 = torch.empty(1000)
    r = _Reduction(comm, out2, inp, 0.25)
    r.issue()
    while not r.finish(block=False):
        pass
    res["stepwise_equal"] = torch.equal(out2, ref)
    # prefetch_depth=2 (the trajectory case checks it changes no bits): what each block asks
    # FSDP2 to prefetch, 3 blocks.
    st = [b._get_fsdp_state() for b in _model(topo, True, prefetch_depth=2).blocks]
    res["depth2_lists"] = (
        len(st[0]._states_to_forward_prefetch),
        len(st[1]._states_to_forward_prefetch),
        len(st[2]._states_to_backward_prefetch),
        len(st[0]._states_to_backward_prefetch),
    )


def _case_issue_before_wait(topo, rank, res):
    """[Note: issue the prefetch before the wait] in zeropp/_prefetch.py: when FSDP2 waits for block i's
    gather in forward, block i + 1's is already issued (queued behind it), for a qwZ (two hops)
    and a plain recording model; not in a forward recomputed inside backward. Numerics are the
    trajectory cases' (every model here prefetches)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    original = FSDPParamGroup.wait_for_unshard
    for name, kw in (
        ("qwz_hpz", {"qwz": True, "hpz": True}),
        ("plain", {}),
        ("plain_no_kept", {"keep_last_blocks": 0}),  # backward re-gathers every block
    ):
        kw = {"qgz": False, **kw}
        model = _model(topo, None, **kw)
        blocks = list(model.blocks)
        groups = [fsdp_param_groups(b)[0] for b in blocks]
        seen: list[tuple[str, int, bool]] = []

        def logged(self, groups=groups, seen=seen):
            if self in groups and self._all_gather_result is not None:
                i = groups.index(self)
                backward = torch._C._current_graph_task_id() != -1
                j = i - 1 if backward else i + 1  # the block that runs next
                if 0 <= j < len(groups):
                    nxt = groups[j]
                    issued = nxt._all_gather_result is not None or nxt.is_unsharded
                    seen.append(("bwd" if backward else "fwd", i, issued))
            return original(self)

        FSDPParamGroup.wait_for_unshard = logged
        try:
            x, y = _batch(rank, 0)
            _, loss = model(x, y)
            loss.backward()
        finally:
            FSDPParamGroup.wait_for_unshard = original
        res[f"issue_{name}"] = seen


def _case_activation_checkpointing(topo, rank, res):
    """Blocks run under torch.utils.checkpoint inside the model's forward (Hugging Face's
    gradient checkpointing): FSDP2's hooks and shard()'s early-issue hooks fire again in the
    recompute inside backward, where the early issue must stay out. Same losses and parameters
    as without checkpointing, bit for bit (all three features; every block re-gathered)."""
    import types

    from torch.utils.checkpoint import checkpoint

    def ac_forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1])
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.head(self.ln_f(x))
        loss = torch.nn.functional.cross_entropy(
            logits.float().view(-1, logits.size(-1)), targets.reshape(-1)
        )
        return logits, loss

    out = {}
    for name in ("plain", "ac"):
        cfg = ZeroPPConfig(qwz=True, hpz=True, qgz=True, keep_last_blocks=0)
        gpt = GPT(CFG)
        if name == "ac":
            gpt.forward = types.MethodType(ac_forward, gpt)
        model = shard(gpt, topology=topo, config=cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ledger = CommLedger(topo)
        losses, nbytes = [], []
        for i in range(3):
            losses.append(_backward(model, ledger, rank, i))
            nbytes.append(_bytes(ledger.step()))
            opt.step()
            opt.zero_grad(set_to_none=True)
        params = [p.to_local().detach().clone() for p in model.parameters()]
        out[name] = (losses, params, nbytes)
    res["ac_losses"] = out["plain"][0] == out["ac"][0]
    res["ac_params"] = _equal(out["plain"][1], out["ac"][1])
    # no gather more: the recompute issues nothing early (a forward prefetch there would gather
    # a block whose backward is over)
    res["ac_bytes"] = out["plain"][2] == out["ac"][2]


def _case_no_unshard_in_backward(topo, rank, res):
    """A unit set ``set_unshard_in_backward(False)`` (an embedding: its backward needs no
    weights) is never gathered in backward, also not by the backward early issue of the unit
    after it (which runs before FSDP2 puts the unit in its pre-backward state, where FSDP2's
    own check sits)."""
    from torch import nn

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList([nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, 8)])

        def forward(self, idx):
            x = self.blocks[0](idx)
            return self.blocks[2](torch.tanh(self.blocks[1](x))).square().mean()

    toy = Toy()
    model = shard(
        toy, topology=topo, config=ZeroPPConfig(keep_last_blocks=0), blocks=list(toy.blocks)
    )
    emb = model.blocks[0]
    emb.set_unshard_in_backward(False)
    (group,) = fsdp_param_groups(emb)
    gathered_in_backward = []
    original = group.unshard

    def unshard(async_op=False):
        before = group._all_gather_result is not None or group.is_unsharded
        original(async_op)
        after = group._all_gather_result is not None or group.is_unsharded
        if torch._C._current_graph_task_id() != -1 and after and not before:
            gathered_in_backward.append(True)

    group.unshard = unshard
    idx = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        model(idx).backward()
    grad = emb.weight.grad
    res["no_unshard_bwd"] = (
        gathered_in_backward,
        grad is not None and bool(grad.to_local().ne(0).any()),
    )


def _run(rank: int, world: int) -> dict:
    topo = Topology(world_size=world, ranks_per_node=2)
    topo.init_groups()
    res: dict = {}
    for case in (
        _case_trajectories,
        _case_defaults,
        _case_accumulation,
        _case_hook,
        _case_mixed_precision,
        _case_clip,
        _case_error,
        _case_direct_call,
        _case_issue_before_wait,
        _case_activation_checkpointing,
        _case_no_unshard_in_backward,
    ):
        case(topo, rank, res)
        dist.barrier()
    return res


TRAJECTORIES = (
    "qgz",
    "qgz_k2_int8",
    "all",
    "all_depth2",
    "hpz",
    "qwz",
    "hpz_bf16_wire",
    "zero3_forced",
)


def test_deferred_qgz_matches_synchronous_2x2():
    out = run_world(_run, 4, timeout_s=600)
    for rank, r in enumerate(out):
        for name in TRAJECTORIES:
            for what in ("loss", "grads", "params", "bytes"):
                assert r[f"{name}_{what}"], (rank, name, what)
            over, sync = r[f"{name}_overlapped"]
            assert over == [UNITS] * 4 and sync == [0] * 4, (rank, name, over, sync)
        assert r["default_zero3"] == 0 and r["default_hpz"] == UNITS, rank
        assert r["accum_no_sync_then_sync"] and r["accum_into_existing"], rank
        assert r["accum_events"] == (UNITS, 0), (rank, r["accum_events"])
        assert r["hook_seen"] and r["hook_grads"], rank
        assert r["hook_events"] == UNITS - 1, (rank, r["hook_events"])
        assert r["mp_fp32_reduce"] and r["mp_bf16_reduce"], rank
        assert r["mp_fp32_reduce_events"] == UNITS and r["mp_bf16_reduce_events"] == 0, rank
        assert r["clip_norm"] and r["clip_grads"], rank
        for where in ("error_drain", "error_mid"):
            assert "injected inter-node hop failure" in r[where], (where, r[where])
            assert "a deferred reduce-scatter failed" in r[where], (where, r[where])
        assert r["error_queue_empty"] and r["error_mid_queue_empty"], rank
        assert r["error_recovers"], rank
        assert r["direct_sync"] and r["stepwise_equal"], rank
        assert r["depth2_lists"] == (2, 1, 2, 0), r["depth2_lists"]
        # Every wait on a gather, but that of the last block to run in a phase, found the
        # next block's gather issued already: forward waits for blocks 0 and 1 (block 2's wait
        # has no next), backward (keep_last_blocks=0) for 2 and 1 (then 0, which has none).
        # With blocks kept, backward re-gathers only block 0 (prefetched by kept block 1).
        for name in ("qwz_hpz", "plain"):
            assert r[f"issue_{name}"] == [("fwd", 0, True), ("fwd", 1, True)], (name, r)
        assert r["ac_losses"] and r["ac_params"] and r["ac_bytes"], rank
        assert r["no_unshard_bwd"] == ([], True), (rank, r["no_unshard_bwd"])
        waits = r["issue_plain_no_kept"]
        assert waits == [("fwd", 0, True), ("fwd", 1, True), ("bwd", 2, True), ("bwd", 1, True)]
