"""The data-parallel 1-bit optimizers and AdamW8bit on HSDP-sharded parameters.

* 0/1 Adam and 1-bit Adam on HSDP (``replicate_reduce=False``) against the same optimizer on a
  replicated copy of each shard (plain tensors over the replicate group, fed the same local
  gradients): bit-identical parameters and identical ledger bytes every step, shard by shard.
* A local step of 0/1 Adam sends no byte across nodes (backward included); replicas are
  bit-identical after every sync and after ``synchronize()``.
* Per-rank ``state_dict`` resume is bit-exact; a model saved with DCP and an optimizer state
  saved on 2 nodes load on 1 node, with the documented error-buffer reset.
* Freezing or unfreezing a parameter on the model after construction acts as on the
  replicated reference (bit-identical; a frozen parameter does not move).
* ``torch.distributed.checkpoint``: get_state_dict -> dcp.save -> a fresh model and optimizer
  -> dcp.load -> set_state_dict continues bit for bit (losses and parameters) like the
  uninterrupted run, for 1-bit Adam after its freeze and 0/1 Adam through its freeze and local
  steps, on HSDP and on replicated parameters over all 4 ranks, nested and flattened (as
  torchtitan saves); a DCP state saved between two 0/1 Adam syncs is refused naming
  ``synchronize()``. AdamW8bit the same on FSDP2's 2-D HSDP and on ZeRO-3.
* Refusals: ZeRO-3 shards, FSDP2's own 2-D HSDP (whose all-reduce stays on) and HSDP with a
  compressed replicate reduction (gradients already cross nodes).
* AdamW8bit on HSDP, native and compressed: replicas agree, tracks torch AdamW.
* HSDP with ``replicate_reduce=False`` and an optimizer that does not sync the replicas
  (AdamW8bit / AdamW4bit when built; torch AdamW, one over part of the model, none yet, one
  built after the 1-bit optimizer was deleted at the first gradient-reducing backward) is
  refused with the fix; the 1-bit optimizers pass, and the guard is gone after its check.
"""

from __future__ import annotations

import copy
import gc
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)

from qshard import optim as qoptim
from qshard._fsdp import fsdp_param_groups
from qshard.comm import CommLedger, Topology, recording
from qshard.testing import run_world
from qshard.train.model import GPT, GPTConfig
from qshard.zeropp import ZeroPPConfig, shard

CFG = GPTConfig(vocab_size=64, context=16, n_layer=2, n_head=2, n_embd=32, seed=0)
LOCAL_CFG = ZeroPPConfig(hsdp=True, replicate_reduce=False)
STEPS = 14


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tok = torch.randint(0, CFG.vocab_size, (4, 1), generator=g)
    cols = [tok]
    for _ in range(CFG.context):
        cols.append((cols[-1] * 3 + 1) % CFG.vocab_size)
    idx = torch.cat(cols, dim=1)
    return idx[:, :-1], idx[:, 1:]


def _make(kind: str, params, group=None):
    if kind == "zero_one":
        return qoptim.ZeroOneAdam(
            params,
            lr=2e-3,
            betas=(0.9, 0.95),
            weight_decay=0.01,
            var_freeze_step=5,
            var_update_scaler=2,
            local_step_scaler=4,
            local_step_clipper=4,
            process_group=group,
        )
    return qoptim.OneBitAdam(
        params, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01, freeze_step=4, process_group=group
    )


def _local(model) -> list[torch.Tensor]:
    return [p.detach().to_local().clone() for p in model.parameters()]


def _same_across(group, tensors: list[torch.Tensor]) -> bool:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, flat, group=group)
    return all(torch.equal(o, flat) for o in out)


def _opt_bytes(summary) -> dict:
    # A bucket layout is checked once per group ([Note: same tensors on every rank] in
    # qshard.comm.compressed), by whichever optimizer uses it first on that group.
    return {
        (e.tag, e.op): e.inter_node_bytes
        for e in summary.entries
        if not e.tag.endswith("layout_check")
    }


def _step(model, opt, rank: int, step: int, ledger: CommLedger):
    x, y = _batch(rank, step)
    with recording(ledger):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
    opt.zero_grad()
    return loss.item()


def _case_vs_replicated(topo: Topology, kind: str, results: dict) -> None:
    group = topo.inter_node_group
    model = shard(GPT(CFG), topology=topo, config=LOCAL_CFG)
    opt = _make(kind, model.parameters())
    ref_params = [t.clone().requires_grad_(True) for t in _local(model)]
    ref = _make(kind, ref_params, group)
    ledger, ref_ledger = CommLedger(topo), CommLedger(topo)
    identical, same_bytes, local_quiet, replicas, losses = True, True, [], [], []
    for step in range(STEPS):
        x, y = _batch(topo.rank, step)
        with recording(ledger):
            _, loss = model(x, y)
            loss.backward()
            for rp, p in zip(ref_params, model.parameters()):
                rp.grad = p.grad.to_local().clone()
            opt.step()
        opt.zero_grad()
        with recording(ref_ledger):
            ref.step()
        ref.zero_grad()
        losses.append(loss.item())
        mine, theirs = ledger.step(), ref_ledger.step()
        identical &= all(torch.equal(a, b) for a, b in zip(_local(model), ref_params))
        opt_bytes = {k: v for k, v in _opt_bytes(mine).items() if k[0].startswith(kind[:4])}
        same_bytes &= opt_bytes == _opt_bytes(theirs)
        in_sync = getattr(opt, "in_sync", True)
        if kind == "zero_one" and not in_sync:
            local_quiet.append(mine.inter_node_bytes)
        if in_sync:
            replicas.append(_same_across(group, _local(model)))
    results[f"{kind}_identical"] = identical
    results[f"{kind}_same_bytes"] = same_bytes
    results[f"{kind}_replicas"] = all(replicas) and len(replicas) > 0
    results[f"{kind}_losses"] = losses
    results[f"{kind}_stats"] = dict(opt.comm_stats)
    if kind == "zero_one":
        results["local_quiet"] = local_quiet
        results["out_of_sync_before"] = not opt.in_sync
        opt.synchronize()
        results["synchronized_replicas"] = _same_across(group, _local(model))


def _case_grad_scaler(topo: Topology, kind: str, results: dict) -> None:
    """torch.amp.GradScaler with an Inf in rank 0's shard only: every rank of the model skips
    that step ([Note: GradScaler]). Agreeing in the replicate group alone skipped it on shard 0's
    ranks and took it on shard 1's (the model's shards one step apart)."""
    model = shard(GPT(CFG), topology=topo, config=LOCAL_CFG)
    opt = _make(kind, model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    first = next(model.parameters())
    counters, unchanged = [], False
    for step in range(1, 6):
        x, y = _batch(topo.rank, step)
        _, loss = model(x, y)
        scaler.scale(loss).backward()
        if step == 3 and topo.rank == 0:
            first.grad.to_local().view(-1)[0] = float("inf")
        before = _local(model)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if step == 3:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, _local(model)))
        counters.append(opt._extra["step"])
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (unchanged, counters))
    results[f"{kind}_scaler"] = everyone


def _case_freeze(topo: Topology, kind: str, results: dict) -> None:
    """Freezing / unfreezing on the model's DTensors after the optimizer is built (a parameter
    frozen at construction unfrozen at step 2, another frozen from step 3) acts as on the
    replicated reference: bit-identical parameters, the frozen one left alone."""
    group = topo.inter_node_group
    model = shard(GPT(CFG), topology=topo, config=LOCAL_CFG)
    params = list(model.parameters())
    late, frozen = params[1], params[2]
    late.requires_grad_(False)
    opt = _make(kind, params)
    ref_params = [t.clone().requires_grad_(p.requires_grad) for t, p in zip(_local(model), params)]
    ref = _make(kind, ref_params, group)
    identical, frozen_kept = True, True
    for step in range(8):
        if step == 2:
            late.requires_grad_(True)
            ref_params[1].requires_grad_(True)
        if step == 3:
            frozen.requires_grad_(False)
            ref_params[2].requires_grad_(False)
            before = frozen.to_local().clone()
        x, y = _batch(topo.rank, step)
        model(x, y)[1].backward()
        for rp, p in zip(ref_params, params):
            rp.grad = None if p.grad is None else p.grad.to_local().clone()
        opt.step()
        opt.zero_grad()
        ref.step()
        ref.zero_grad()
        identical &= all(torch.equal(a, b) for a, b in zip(_local(model), ref_params))
        if step >= 3:
            frozen_kept &= torch.equal(frozen.to_local(), before)
    results[f"{kind}_freeze_identical"] = identical
    results[f"{kind}_frozen_kept"] = frozen_kept


def _case_resume(topo: Topology, tmp: str, results: dict) -> None:
    """Save at the first local step (phase B, mid interval), run 5 more steps; reload into a
    fresh model and optimizer, replay the same 5 steps: bit-identical."""
    model = shard(GPT(CFG), topology=topo, config=LOCAL_CFG)
    opt = _make("zero_one", model.parameters())
    ledger = CommLedger(topo)
    step = 0
    while step < STEPS and (step < 6 or opt.in_sync):
        _step(model, opt, topo.rank, step, ledger)
        step += 1
    save_at = step
    saved_model = _local(model)
    saved_opt = copy.deepcopy(opt.state_dict())
    results["saved_mid_interval"] = not opt.in_sync
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(tmp, "model"))
    torch.save(opt.state_dict(), os.path.join(tmp, f"opt_{topo.rank}.pt"))
    for step in range(save_at, save_at + 5):
        _step(model, opt, topo.rank, step, ledger)
    first = _local(model)

    again = shard(GPT(CFG), topology=topo, config=LOCAL_CFG)
    with torch.no_grad():
        for p, t in zip(again.parameters(), saved_model):
            p.to_local().copy_(t)
    opt2 = _make("zero_one", again.parameters())
    opt2.load_state_dict(saved_opt)
    for step in range(save_at, save_at + 5):
        _step(again, opt2, topo.rank, step, ledger)
    results["resume_bit_exact"] = all(torch.equal(a, b) for a, b in zip(_local(again), first))
    results["save_at"] = save_at


def _case_refusals(topo: Topology, results: dict) -> None:
    errors = {}
    zero3 = shard(GPT(CFG), topology=topo)
    native = shard(GPT(CFG), topology=topo, config=ZeroPPConfig(hsdp=True))
    int8 = shard(GPT(CFG), topology=topo, config=ZeroPPConfig(hsdp=True, replicate_bits=8))
    bf16 = shard(GPT(CFG), topology=topo, config=ZeroPPConfig(hsdp=True, wire_dtype=torch.bfloat16))
    for name, model in (("zero3", zero3), ("native", native), ("int8", int8), ("bf16", bf16)):
        try:
            _make("zero_one", model.parameters())
        except TypeError as e:
            errors[name] = str(e)
    results["errors"] = errors


def _case_adamw8bit(topo: Topology, results: dict) -> None:
    group = topo.inter_node_group
    for name, cfg in (
        ("native", ZeroPPConfig(hsdp=True)),
        ("int8", ZeroPPConfig(hsdp=True, replicate_bits=8)),
    ):
        ledger = CommLedger(topo)
        losses = {}
        for opt_name in ("AdamW8bit", "AdamW"):
            model = shard(GPT(CFG), topology=topo, config=cfg)
            if opt_name == "AdamW":
                opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
            else:
                opt = qoptim.AdamW8bit(
                    model.parameters(), lr=3e-3, weight_decay=0.01, min_8bit_size=256
                )
            losses[opt_name] = [_step(model, opt, topo.rank, s, ledger) for s in range(8)]
            if opt_name == "AdamW8bit":
                results[f"a8_{name}_replicas"] = _same_across(group, _local(model))
                results[f"a8_{name}_has_8bit"] = any(
                    isinstance(v, torch.Tensor) and v.dtype == torch.uint8
                    for st in opt.state.values()
                    for v in st.values()
                )
        first = losses["AdamW"][0]
        results[f"a8_{name}_diff"] = max(
            abs(a - b) / first for a, b in zip(losses["AdamW8bit"], losses["AdamW"])
        )


def _backward_error(model, rank: int, step: int = 0) -> str | None:
    """The error of one forward + backward of ``model``, or None."""
    x, y = _batch(rank, step)
    try:
        model(x, y)[1].backward()
    except RuntimeError as e:
        return str(e)
    return None


def _hooks_left(model) -> int:
    """Units of ``model`` that still have an all-reduce hook (FSDP2's private state)."""
    return sum(
        g._all_reduce_hook is not None
        for m in model.modules()
        if hasattr(m, "set_all_reduce_hook")
        for g in fsdp_param_groups(m)
    )


def _case_unsynced(topo: Topology, results: dict) -> None:
    """replicate_reduce=False with an optimizer that does not sync the node replicas is refused:
    qshard's 8-bit / 4-bit optimizers when built, any other update (torch AdamW, one built too
    late, one over part of the model, one built after the claiming optimizer was deleted) at
    the first backward that reduces gradients, before any step; a claimed model runs, and its
    guard is gone after that first check."""
    out: dict = {}
    for name in ("AdamW8bit", "AdamW4bit"):
        model = shard(GPT(CFG), topology=topo, config=LOCAL_CFG)
        try:
            getattr(qoptim, name)(model.parameters(), lr=1e-3)
        except TypeError as e:
            out[f"built_{name}"] = str(e)
    # meta-device model materialised after shard(): FSDP2 re-registers the parameters
    with torch.device("meta"):
        meta = GPT(CFG)
    meta = shard(meta, topology=topo, config=LOCAL_CFG)
    meta.to_empty(device="cpu")
    try:
        qoptim.AdamW8bit(meta.parameters(), lr=1e-3)
    except TypeError as e:
        out["built_to_empty"] = str(e)
    with torch.device("meta"):
        meta_int8 = GPT(CFG)
    meta_int8 = shard(meta_int8, topology=topo, config=ZeroPPConfig(hsdp=True, replicate_bits=8))
    meta_int8.to_empty(device="cpu")
    try:
        _make("zero_one", meta_int8.parameters())
    except TypeError as e:
        out["onebit_to_empty_int8"] = str(e)

    # torch AdamW: built fine, refused at the first backward (before any step)
    model = shard(GPT(CFG), topology=topo, config=LOCAL_CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out["torch_adamw"] = _backward_error(model, topo.rank)
    del opt

    # gradient accumulation: the no-sync backward reduces nothing; the synced one is refused
    model = shard(GPT(CFG), topology=topo, config=LOCAL_CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.set_requires_gradient_sync(False)
    out["no_sync"] = _backward_error(model, topo.rank, 0)
    model.set_requires_gradient_sync(True)
    out["synced_after_no_sync"] = _backward_error(model, topo.rank, 1)
    del opt

    # 1-bit Adam over the blocks only, torch AdamW over the rest (embeddings, head, norm)
    model = shard(GPT(CFG), topology=topo, config=LOCAL_CFG)
    in_blocks = {id(p) for p in model.blocks.parameters()}
    opts = (
        _make("onebit", list(model.blocks.parameters())),
        torch.optim.AdamW([p for p in model.parameters() if id(p) not in in_blocks], lr=1e-3),
    )
    out["partial"] = _backward_error(model, topo.rank)
    del opts

    # no optimizer yet at the first backward (one built after it is refused there)
    model = shard(GPT(CFG), topology=topo, config=LOCAL_CFG)
    out["late"] = _backward_error(model, topo.rank)

    # claimed: accumulation, then steps; the guards are gone after the first check; a torch
    # AdamW built once the claiming optimizer is deleted is refused at its next backward
    for kind in ("zero_one", "onebit"):
        model = shard(GPT(CFG), topology=topo, config=LOCAL_CFG)
        out[f"{kind}_hooks_before"] = _hooks_left(model)
        opt = _make(kind, model.parameters())
        model.set_requires_gradient_sync(False)
        errors = [_backward_error(model, topo.rank, 0)]
        model.set_requires_gradient_sync(True)
        for step in range(1, 4):
            errors.append(_backward_error(model, topo.rank, step))
            opt.step()
            opt.zero_grad()
        out[f"{kind}_claimed"] = errors
        out[f"{kind}_hooks_after"] = _hooks_left(model)
        del opt
        gc.collect()
        out[f"{kind}_rearmed"] = _hooks_left(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out[f"{kind}_after_delete"] = _backward_error(model, topo.rank, 5)
        del opt

    # two models: the one 0/1 Adam covers trains, the other one (torch AdamW) is refused
    a = shard(GPT(CFG), topology=topo, config=LOCAL_CFG)
    b = shard(GPT(CFG), topology=topo, config=LOCAL_CFG)
    opt_a = _make("zero_one", a.parameters())
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-3)
    out["two_a"] = _backward_error(a, topo.rank)
    opt_a.step()
    out["two_b"] = _backward_error(b, topo.rank)
    del opt_a, opt_b
    results["unsynced"] = out


def _dcp_round_trip(topo, tmp, build, make, *, save_at, end, flatten, tag):
    """Train ``build()`` with ``make(params)`` for ``end`` steps; at each step of ``save_at``
    save model and optimizer with DCP, load them into a fresh pair and train that pair to
    ``end`` too. Returns, per save step, whether its losses and parameters equal the
    uninterrupted run's bit for bit."""
    opts = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model = build()
    opt = make(model.parameters())
    ledger = CommLedger(topo)
    losses, ckpts = {}, {}
    for step in range(end):
        if step in save_at:
            ckpts[step] = os.path.join(tmp, f"{tag}_{step}")
            msd, osd = get_state_dict(model, opt, options=opts)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpts[step])
        losses[step] = _step(model, opt, topo.rank, step, ledger)
    final = [p.detach().clone() for p in model.parameters()]
    out = {}
    for start, ckpt in ckpts.items():
        again = build()
        opt2 = make(again.parameters())
        msd, osd = get_state_dict(again, opt2, options=opts)  # the layout (a zero-lr step)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(
            again,
            opt2,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=opts,
        )
        same = all(_step(again, opt2, topo.rank, s, ledger) == losses[s] for s in range(start, end))
        same &= all(torch.equal(a, b) for a, b in zip(again.parameters(), final))
        out[start] = same
    return out, opt


def _case_dcp(topo: Topology, tmp: str, results: dict) -> None:
    def hsdp():
        return shard(GPT(CFG), topology=topo, config=LOCAL_CFG)

    def replicated():
        return GPT(CFG)

    for layout, build in (("hsdp", hsdp), ("replicated", replicated)):
        for flatten in (False, True):
            tag = f"{layout}_{int(flatten)}"
            # 1-bit Adam after its freeze (step 4; its error buffers carry on). 0/1 Adam after
            # its one phase-A 1-bit step (4; variance steps 1, 2, 3, 5), carried through the
            # freeze (5) and local steps; and right after a phase-B sync (9; syncs at 6, 7, 8,
            # 9, 11, 13), whose error buffers the later syncs use.
            r1, _ = _dcp_round_trip(
                topo,
                tmp,
                build,
                lambda ps: _make("onebit", ps),
                save_at={6},
                end=10,
                flatten=flatten,
                tag=f"onebit_{tag}",
            )
            r01, opt = _dcp_round_trip(
                topo,
                tmp,
                build,
                lambda ps: _make("zero_one", ps),
                save_at={4, 9},
                end=STEPS,
                flatten=flatten,
                tag=f"zero_one_{tag}",
            )
            results[f"dcp_{tag}"] = {
                **{f"onebit@{k}": v for k, v in r1.items()},
                **{f"zero_one@{k}": v for k, v in r01.items()},
            }
            results[f"dcp_{tag}_local"] = opt.comm_stats["local"]
    # Between two syncs every rank has its own momentum and parameters: refused on load.
    model = hsdp()
    opt = _make("zero_one", model.parameters())
    ledger = CommLedger(topo)
    step = 0
    while step < 6 or opt.in_sync:
        _step(model, opt, topo.rank, step, ledger)
        step += 1
    msd, osd = get_state_dict(model, opt)
    ckpt = os.path.join(tmp, "mid_interval")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    again = hsdp()
    opt2 = _make("zero_one", again.parameters())
    msd, osd = get_state_dict(again, opt2)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    try:
        set_state_dict(again, opt2, model_state_dict=msd, optim_state_dict=osd)
        results["dcp_mid_interval"] = "loaded"
    except ValueError as e:
        results["dcp_mid_interval"] = str(e)


def _case_dcp_adamw8bit(topo: Topology, tmp: str, results: dict) -> None:
    for name, cfg in (("native_hsdp", ZeroPPConfig(hsdp=True)), ("zero3", None)):

        def build(cfg=cfg):
            return shard(GPT(CFG), topology=topo, config=cfg)

        def make(ps):
            return qoptim.AdamW8bit(ps, lr=3e-3, weight_decay=0.01, min_8bit_size=256)

        out, _ = _dcp_round_trip(
            topo, tmp, build, make, save_at={3}, end=6, flatten=True, tag=f"a8_{name}"
        )
        results[f"dcp_a8_{name}"] = out


def _run(rank: int, world: int, rpn: int, tmp: str) -> dict:
    topo = Topology(world_size=world, ranks_per_node=rpn)
    topo.init_groups()
    results: dict = {}
    _case_unsynced(topo, results)
    for kind in ("zero_one", "onebit"):
        _case_vs_replicated(topo, kind, results)
        _case_freeze(topo, kind, results)
        _case_grad_scaler(topo, kind, results)
    _case_resume(topo, tmp, results)
    _case_dcp(topo, tmp, results)
    _case_dcp_adamw8bit(topo, tmp, results)
    _case_refusals(topo, results)
    _case_adamw8bit(topo, results)
    return results


def _run_other_nodes(rank: int, world: int, rpn: int, tmp: str) -> dict:
    """Load the 2-node checkpoint on 1 node x 2 ranks: same shards, fewer replicas."""
    topo = Topology(world_size=world, ranks_per_node=rpn)
    model = shard(GPT(CFG), topology=topo, config=LOCAL_CFG)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=os.path.join(tmp, "model"))
    opt = _make("zero_one", model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(torch.load(os.path.join(tmp, f"opt_{rank}.pt"), weights_only=False))
    errors_left = [
        k for st in opt.state.values() for k in st if k in ("worker_error", "server_error")
    ]
    ledger = CommLedger(topo)
    losses = [_step(model, opt, rank, s, ledger) for s in range(20, 23)]
    # A DCP optimizer state of 2 x 2 on 1 x 2: the per-rank error buffers do not fit.
    fresh = shard(GPT(CFG), topology=topo, config=LOCAL_CFG)
    osd = get_optimizer_state_dict(fresh, _make("onebit", fresh.parameters()))
    try:
        dcp.load({"optim": osd}, checkpoint_id=os.path.join(tmp, "onebit_hsdp_0_6"))
        dcp_refusal = "loaded"
    except CheckpointException as e:  # a BaseException carrying each rank's error
        dcp_refusal = str(e)
    return {
        "dcp_refusal": dcp_refusal,
        "warned": any("error buffers restart from zero" in str(w.message) for w in caught),
        "errors_reset": not errors_left,
        "losses": losses,
        "inter": ledger.summary().inter_node_bytes,
    }


def test_hsdp_optimizers_2x2(tmp_path):
    out = run_world(_run, 4, args=(2, str(tmp_path)), timeout_s=900)
    for rank, r in enumerate(out):
        for kind in ("zero_one", "onebit"):
            assert r[f"{kind}_identical"], (rank, kind)
            assert r[f"{kind}_same_bytes"], (rank, kind)
            assert r[f"{kind}_replicas"], (rank, kind)
            assert r[f"{kind}_losses"][-1] < 0.9 * r[f"{kind}_losses"][0], r[f"{kind}_losses"]
            assert r[f"{kind}_freeze_identical"] and r[f"{kind}_frozen_kept"], (rank, kind)
            # every rank skipped the Inf step (3): unchanged weights, one counter for all
            assert r[f"{kind}_scaler"] == [(True, [1, 2, 2, 3, 4])] * len(out), r[f"{kind}_scaler"]
        stats = r["zero_one_stats"]
        assert stats["local"] > 0 and stats["compressed"] > 0, stats
        assert r["local_quiet"] and all(b == 0 for b in r["local_quiet"]), r["local_quiet"]
        assert r["out_of_sync_before"] and r["synchronized_replicas"]
        assert r["saved_mid_interval"] and r["resume_bit_exact"], r["save_at"]
        for layout in ("hsdp", "replicated"):
            for flatten in (0, 1):
                tag = f"{layout}_{flatten}"
                assert r[f"dcp_{tag}"] == {
                    "onebit@6": True,
                    "zero_one@4": True,
                    "zero_one@9": True,
                }, (tag, r)
                assert r[f"dcp_{tag}_local"] > 0, tag  # the resumed span had local steps
        assert "synchronize()" in r["dcp_mid_interval"], r["dcp_mid_interval"]
        assert r["dcp_a8_native_hsdp"] == {3: True} and r["dcp_a8_zero3"] == {3: True}, r
        assert "use HSDP" in r["errors"]["zero3"], r["errors"]
        assert "replicate_reduce=False" in r["errors"]["native"], r["errors"]
        for name in ("int8", "bf16"):  # their gradients cross nodes already
            assert "already all-reduced" in r["errors"][name], r["errors"]
            assert "replicate_reduce=False" in r["errors"][name], r["errors"]
        for name in ("native", "int8"):
            assert r[f"a8_{name}_replicas"], name
            assert r[f"a8_{name}_has_8bit"], name
            assert r[f"a8_{name}_diff"] < 0.02, (name, r[f"a8_{name}_diff"])
        _check_unsynced(r["unsynced"])
    other = run_world(_run_other_nodes, 2, args=(2, str(tmp_path)), timeout_s=300)
    for r in other:
        assert r["warned"] and r["errors_reset"]
        assert all(map(lambda v: v == v, r["losses"]))  # finite, training continues
        assert r["inter"] == 0  # one node: nothing crosses nodes
        assert "Size mismatch" in r["dcp_refusal"] and "error" in r["dcp_refusal"], r


def _check_unsynced(u: dict) -> None:
    for name in ("built_AdamW8bit", "built_AdamW4bit", "built_to_empty"):
        msg = u.get(name, "")
        assert "replicate_reduce=False" in msg and "drift apart" in msg, (name, u)
        assert "replicate_reduce=True" in msg and "OneBitAdam" in msg, (name, msg)
    assert "already all-reduced" in u.get("onebit_to_empty_int8", ""), u
    for name in ("torch_adamw", "synced_after_no_sync", "partial", "late"):
        msg = u[name] or ""
        assert "replicas would drift apart" in msg, (name, u)
        assert "replicate_reduce=True" in msg and "ZeroOneAdam" in msg, (name, msg)
        assert "before the first backward" in msg, (name, msg)
    assert u["no_sync"] is None, u["no_sync"]
    named = u["partial"].split(") were")[0]  # the unclaimed parameters the message names
    assert "tok_emb" in named and "blocks." not in named, u["partial"]  # the claimed pass
    for kind in ("zero_one", "onebit"):
        assert u[f"{kind}_hooks_before"] > 0
        assert u[f"{kind}_claimed"] == [None] * 4, u[f"{kind}_claimed"]
        assert u[f"{kind}_hooks_after"] == 0  # checked once: no cost per step afterwards
        assert u[f"{kind}_rearmed"] == u[f"{kind}_hooks_before"]
        assert "replicas would drift apart" in (u[f"{kind}_after_delete"] or ""), u
    assert u["two_a"] is None and "replicas would drift apart" in (u["two_b"] or ""), u


@pytest.mark.slow
def test_hsdp_optimizers_3x2(tmp_path):
    out = run_world(_run, 6, args=(2, str(tmp_path)), timeout_s=1500)
    for r in out:
        for kind in ("zero_one", "onebit"):
            assert r[f"{kind}_identical"] and r[f"{kind}_same_bytes"] and r[f"{kind}_replicas"]
        assert r["resume_bit_exact"]
