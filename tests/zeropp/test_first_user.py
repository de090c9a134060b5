"""shard() as a first user from DeepSpeed ZeRO++ or torchtitan would use it, on a model that is
not qshard's GPT, against plain FSDP2 (``fully_shard`` on the same blocks, then the root).

One 2 nodes x 2 ranks gloo world runs every case. The model has what such models have and the
GPT does not: blocks that are attributes, not an ``nn.ModuleList`` (``blocks=``); a frozen block
and a LoRA-style block (frozen base weight, trainable adapters); BatchNorm running stats and
non-persistent buffers; a block with no parameters; a bias of 3 elements on 4 ranks; and a block
called twice in one forward (weight sharing). Every feature off and hpZ must be bit-identical
to plain FSDP2 (losses, evaluation losses, parameters, buffers); all three features close.

Regressions (each case failed before its fix):

* gradient accumulation (``set_requires_gradient_sync(False)`` on all but the last
  micro-batch) with hpZ: FSDP2 reduces the twice-called block twice in the synced backward,
  the first reduction was deferred ([Note: deferred qgZ]) and the plain reduce-scatter's
  synchronous second call did not drain it, so FSDP2 added the second output into the
  not-yet-written first one, which then overwrote the sum: one call's gradient was lost;
* ``set_reshard_after_backward(False)`` left on across optimizer steps: every later forward
  computed with the copy gathered before the step (plain FSDP2 alike); ``shard()`` now
  reshards such copies at the step, as plain FSDP2 with ``model.reshard()`` before it;
* an evaluation forward between backward and the optimizer step that skips a block:
  ``shard()``'s forward prefetch had gathered that block, the gather stayed pending over the
  step, and the next forward computed the block with its old weights (every feature off, where
  plain FSDP2, which prefetches nothing in forward, gathers the new ones);
* ``shard()`` twice on a model whose blocks were passed as ``blocks=``: refused as "found no
  blocks ... pass blocks=" instead of as already sharded;
* ``ZeroPPConfig(hpz=8)`` (DeepSpeed's ``zero_hpz_partition_size``): the error now names the
  topology's ``ranks_per_node``.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from qshard.comm import Topology
from qshard.testing import run_world
from qshard.zeropp import ZeroPPConfig, shard

D = 16
OFF = ZeroPPConfig()
HPZ = ZeroPPConfig(hpz=True)
ALL = ZeroPPConfig(qwz=True, hpz=True, qgz=True, pipeline_stages=2)


class Block(nn.Module):
    def __init__(self, *, lora: bool = False, bn: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)
        self.lora = lora
        if lora:  # LoRA-style: the base weight frozen, two small adapters trained
            self.fc.requires_grad_(False)
            self.a = nn.Linear(D, 4, bias=False)
            self.b = nn.Linear(4, D, bias=False)
        self.bn = nn.BatchNorm1d(D) if bn else None
        self.register_buffer("gain", torch.full((D,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.norm(x))
        if self.lora:
            h = h + self.b(self.a(x))
        if self.bn is not None:
            h = self.bn(h)
        return x + torch.tanh(h) * self.gain.to(h.dtype)


class NoParams(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)


class Narrow(nn.Module):
    """A bias of 3 elements (and a 3-row weight): smaller than the 4-rank world."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Linear(D, 3)
        self.up = nn.Linear(3, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(torch.relu(self.down(x)))


class Net(nn.Module):
    def __init__(self, *, bn: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, D)
        self.enc = Block(bn=bn)
        self.frozen = Block()
        self.frozen.requires_grad_(False)
        self.adapter = Block(lora=True)
        self.act = NoParams()
        self.narrow = Narrow()
        self.shared = Block()  # called twice per forward
        self.out = nn.Linear(D, 1)
        self.register_buffer("center", torch.linspace(-1, 1, 8), persistent=False)
        self.skip_adapter = False  # an evaluation path that leaves a block out

    def block_list(self) -> list[nn.Module]:
        return [self.enc, self.frozen, self.adapter, self.act, self.narrow, self.shared]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x - self.center.to(x.dtype))
        for block in (self.enc, self.frozen, self.adapter, self.act, self.narrow):
            if block is not self.adapter or not self.skip_adapter:
                h = block(h)
        h = self.shared(self.shared(h))
        return self.out(h).squeeze(-1)


def _batch(rank: int, step: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 8, generator=g)
    return x.to(dtype), x.sum(-1).sin().to(dtype)


def _plain(mesh, mp=None, dtype=None) -> Net:
    model = Net() if dtype is None else Net().to(dtype)
    kw = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
    for block in model.block_list():
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _sharded(topo: Topology, config: ZeroPPConfig, mp=None, dtype=None) -> Net:
    model = Net() if dtype is None else Net().to(dtype)
    return shard(model, topology=topo, config=config, mp_policy=mp, blocks=model.block_list())


def _train(
    model,
    rank: int,
    steps: int = 4,
    *,
    accum: int = 1,
    evaluate: bool = True,
    reshard_before_step: bool = False,
    eval_before_step: bool = False,
    dtype: torch.dtype = torch.float32,
):
    """AdamW with clip_grad_norm_ and, with ``evaluate``, an eval()/no_grad forward after
    every step; ``accum`` micro-batches per step, all but the last without gradient sync;
    with ``eval_before_step`` a no_grad forward that skips the adapter block between backward
    and step. Returns (losses, eval losses, full parameters, buffers)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, evals = [], []
    for step in range(steps):
        for k in range(accum):
            if accum > 1:
                model.set_requires_gradient_sync(k == accum - 1)
            x, y = _batch(rank, step * accum + k, dtype)
            loss = F.mse_loss(model(x).float(), y.float())
            loss.backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if eval_before_step:
            model.skip_adapter = True
            with torch.no_grad():
                x, y = _batch(rank, 998, dtype)
                evals.append(F.mse_loss(model(x).float(), y.float()).item())
            model.skip_adapter = False
        if reshard_before_step:
            for unit in model.modules():
                if isinstance(unit, FSDPModule):
                    unit.reshard()
        opt.step()
        opt.zero_grad()
        if evaluate:
            model.eval()
            with torch.no_grad():
                x, y = _batch(rank, 999, dtype)
                evals.append(F.mse_loss(model(x).float(), y.float()).item())
            model.train()
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()  # FSDP2 keeps the root unsharded after forward
    params = [p.full_tensor().detach().float().clone() for p in model.parameters()]
    buffers = [b.detach().float().clone() for b in model.buffers()]
    return losses, evals, params, buffers


def _train_in_backward(model, rank: int, steps: int = 3):
    """torchtune's optimizer in backward: one SGD per parameter, stepped from its
    post-accumulate-grad hook. Returns (losses, [], full parameters, buffers) as _train."""
    opts = {p: torch.optim.SGD([p], lr=1e-2) for p in model.parameters() if p.requires_grad}

    def step(p):
        opts[p].step()
        opts[p].zero_grad()

    for p in opts:
        p.register_post_accumulate_grad_hook(step)
    losses = []
    for i in range(steps):
        x, y = _batch(rank, i)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
    params = [p.full_tensor().detach().float().clone() for p in model.parameters()]
    return losses, [], params, [b.detach().float().clone() for b in model.buffers()]


def _same(a, b) -> bool:
    return (
        a[0] == b[0]
        and a[1] == b[1]
        and all(torch.equal(u, v) for u, v in zip(a[2] + a[3], b[2] + b[3]))
    )


def _loss_gap(a, b) -> float:
    return max(abs(u - v) / b[0][0] for u, v in zip(a[0], b[0]))


def _resume(topo: Topology, rank: int, path: str) -> bool:
    """DCP save mid-run through get_state_dict, load into a fresh shard()ed model and
    optimizer through set_state_dict: the resumed run's losses equal the continued run's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def steps(model, opt, start: int) -> list[float]:
        out = []
        for step in range(start, start + 2):
            x, y = _batch(rank, step)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    def build():
        model = _sharded(topo, ALL)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])

    model, opt = build()
    steps(model, opt, 0)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    continued = steps(model, opt, 2)
    model, opt = build()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return steps(model, opt, 2) == continued


class _Branch(nn.Module):
    def __init__(self, wide: int = 0) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)  # _batch gives 8 features
        # wide: an extra branch of ~17 K elements, so that a shard without its gradients is
        # ~4.4 K elements short, more than qgZ's padding to 2 stages of 4 blocks of 256
        hidden = nn.Sequential(nn.Linear(8, wide), nn.Linear(wide, 8)) if wide else None
        self.extra = hidden or nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return h + self.extra(h) if use else h


class _Branchy(nn.Module):
    """Two blocks whose ``extra`` layer runs where ``use`` says: a data-dependent branch."""

    def __init__(self, wide: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Branch(wide) for _ in range(2))
        self.use = [False, False]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, use in zip(self.blocks, self.use, strict=True):
            x = block(x, use)
        return x.sum(-1)


def _unused_on_some_ranks(topo: Topology, rank: int) -> dict:
    """[Note: qgZ checks the shard sizes]: a parameter with a gradient on rank 0 only gave
    qgZ's ranks gradient shards of different sizes padded to the same rows, and the unit's
    other gradients came out wrong without a word (relative error 0.6-1.6). Every rank now
    refuses it, deferred or not; set_reduce_scatter_unused_params(True) trains.

    [Note: qgZ frames at the unit's size]: with the wide branch the shards differ by more than
    the rows' padding, the rows' lengths differed, and gloo aborted rank 0's process
    ("Received data size doesn't match expected size"; the world then failed on connection
    resets) before any size was read. Every rank now refuses that too; and where no rank uses
    the branch (equal sizes, rows framed for the whole unit) the gradients are those of the
    same model sharded with every feature off, to qgZ's quantization error."""
    out = {}
    sync = dataclasses.replace(ALL, overlap_reduce_scatter=False)
    cases = (
        ("deferred", ALL, False, 0),
        ("sync", sync, False, 0),
        ("fix", ALL, True, 0),
        ("wide_deferred", ALL, False, 1024),
        ("wide_sync", sync, False, 1024),
    )
    for name, cfg, fix, wide in cases:
        model = _Branchy(wide)
        shard(model, topology=topo, config=cfg, blocks=list(model.blocks))
        if fix:
            model.set_reduce_scatter_unused_params(True)
        model.use = [False, rank == 0]
        x, y = _batch(rank, 0)
        try:
            F.mse_loss(model(x), y).backward()
            out[name] = "trained"
        except RuntimeError as exc:
            out[name] = "refused" if "different sizes" in str(exc) else str(exc)
    grads = []
    # the wide branch unused everywhere; INT8 gradients (INT4's own error on these small
    # layers is ~0.1, used or not; misaligned sums give ~1)
    for cfg in (dataclasses.replace(ALL, grad_bits=8), OFF):
        model = _Branchy(1024)
        shard(model, topology=topo, config=cfg, blocks=list(model.blocks))
        x, y = _batch(rank, 0)
        F.mse_loss(model(x), y).backward()
        grads.append(torch.cat([b.fc.weight.grad.full_tensor().reshape(-1) for b in model.blocks]))
    err = (grads[0] - grads[1]).norm() / grads[1].norm()
    out["wide_unused_everywhere"] = "close" if err < 0.03 else f"relative error {err:.3f}"
    # A whole unit whose output reaches the loss on some ranks only, with the fix on: FSDP2
    # reduces it at the end of those ranks' backward, pairing different units' reductions.
    # Refused (here the units differ in size), naming that cause: the message recommended
    # the fix that was already on.
    model = _TwoUnits()
    shard(model, topology=topo, config=ALL, blocks=[model.first, model.second])
    model.set_reduce_scatter_unused_params(True)
    model.skip_second = rank == 0
    x, y = _batch(rank, 0)
    try:
        F.mse_loss(model(x), y).backward()
        out["unit_unused_fix_on"] = "trained"
    except RuntimeError as exc:
        text = str(exc)
        fix_on = "is on, so a whole FSDP unit's output took no part in the loss"
        out["unit_unused_fix_on"] = "refused, unit named" if fix_on in text else text
    return out


class _TwoUnits(nn.Module):
    """Two units of different sizes; rank 0 runs the second but leaves it out of the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 8)
        self.second = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))
        self.skip_second = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        out = self.second(h)
        return (h if self.skip_second else out).sum(-1)


def _world(rank: int, world: int, tmp: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    topo = Topology(world_size=world, ranks_per_node=2)
    res: dict = {}

    ref = _train(_plain(mesh), rank)
    res["off"] = _same(_train(_sharded(topo, OFF), rank), ref)
    res["hpz"] = _same(_train(_sharded(topo, HPZ), rank), ref)
    # [Note: qgZ frames at the unit's size]: with every gradient present the frame is the
    # shard size (frozen LoRA bases, a 3-element bias, a parameter-free block, a block called
    # twice): a frame larger than the size would send padding on every step
    from qshard.zeropp.reduce_scatter import HierarchicalQuantizedReduceScatter as Qgz

    frames, frame_size = [], Qgz._frame_size

    def recorded(self, size):
        frames.append((size, frame_size(self, size)))
        return frames[-1][1]

    Qgz._frame_size = recorded
    try:
        res["all_gap"] = _loss_gap(_train(_sharded(topo, ALL), rank), ref)
    finally:
        Qgz._frame_size = frame_size
    res["frames"] = bool(frames) and all(size == frame for size, frame in frames)

    # an evaluation that skips a block, between backward and step; plain FSDP2 keeps its root
    # unsharded after forward, and asks for model.reshard() (reshard_before_step) here
    ref = _train(
        _plain(mesh), rank, evaluate=False, eval_before_step=True, reshard_before_step=True
    )
    for name, cfg in (("off", OFF), ("hpz", HPZ)):
        r = _train(_sharded(topo, cfg), rank, evaluate=False, eval_before_step=True)
        res[f"skip_{name}"] = _same(r, ref)
    r = _train(_sharded(topo, ALL), rank, evaluate=False, eval_before_step=True)
    res["skip_all_gap"] = _loss_gap(r, ref)

    # gradient accumulation: the twice-called block is reduced twice in the synced backward
    ref = _train(_plain(mesh), rank, accum=2, evaluate=False)
    res["accum_hpz"] = _same(_train(_sharded(topo, HPZ), rank, accum=2, evaluate=False), ref)
    forced = ZeroPPConfig(overlap_reduce_scatter=True)
    res["accum_off_overlap"] = _same(
        _train(_sharded(topo, forced), rank, accum=2, evaluate=False), ref
    )
    sync = dataclasses.replace(ALL, overlap_reduce_scatter=False)
    res["accum_all_overlap_is_sync"] = _same(
        _train(_sharded(topo, ALL), rank, accum=2, evaluate=False),
        _train(_sharded(topo, sync), rank, accum=2, evaluate=False),
    )

    # set_reshard_after_backward(False) left on: no copy may outlive an optimizer step
    model = _plain(mesh)
    model.set_reshard_after_backward(False)
    ref = _train(model, rank, evaluate=False, reshard_before_step=True)
    for name, cfg in (("off", OFF), ("hpz", HPZ)):
        model = _sharded(topo, cfg)
        model.set_reshard_after_backward(False)
        res[f"rab_{name}"] = _same(_train(model, rank, evaluate=False), ref)

    # The optimizer stepped inside backward: with no kept block, the step resharded the hpZ
    # blocks whose backward gather was in flight (FSDP2 failed: "split_with_sizes expects
    # split_sizes to sum exactly to ..."); a copy kept by set_reshard_after_backward(False)
    # must not outlive the steps either.
    ref = _train_in_backward(_plain(mesh), rank)
    hpz0 = dataclasses.replace(HPZ, keep_last_blocks=0)
    res["inbwd_hpz0"] = _same(_train_in_backward(_sharded(topo, hpz0), rank), ref)
    res["inbwd_hpz"] = _same(_train_in_backward(_sharded(topo, HPZ), rank), ref)
    model = _sharded(topo, OFF)
    model.set_reshard_after_backward(False)
    res["inbwd_rab_off"] = _same(_train_in_backward(model, rank), ref)
    all0 = dataclasses.replace(ALL, keep_last_blocks=0)
    res["inbwd_all0_gap"] = _loss_gap(_train_in_backward(_sharded(topo, all0), rank), ref)

    res["unused"] = _unused_on_some_ranks(topo, rank)

    # a mesh not in node order: hpZ's secondary rows [0, 2], [1, 3] crossed nodes and its
    # backward gathers left the node without a word; refused now, accepted without hpZ
    from torch.distributed.device_mesh import DeviceMesh

    perm = DeviceMesh("cpu", torch.tensor([0, 2, 1, 3]))
    model = Net()
    try:
        shard(model, topology=topo, config=HPZ, blocks=model.block_list(), mesh=perm)
        res["hpz_perm_mesh"] = "accepted"
    except ValueError as exc:
        res["hpz_perm_mesh"] = str(exc)
    model = Net()
    shard(model, topology=topo, config=OFF, blocks=model.block_list(), mesh=perm)

    # bf16 parameters, bf16 compute, fp32 reduction
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    bf16 = torch.bfloat16
    ref = _train(_plain(mesh, mp, bf16), rank, steps=2, dtype=bf16)
    res["bf16_hpz"] = _same(_train(_sharded(topo, HPZ, mp, bf16), rank, steps=2, dtype=bf16), ref)

    res["dcp_resume_all"] = _resume(topo, rank, os.path.join(tmp, "ckpt"))

    model = _sharded(topo, OFF)
    try:
        shard(model, topology=topo, blocks=model.block_list())
        res["twice"] = "accepted"
    except ValueError as exc:
        res["twice"] = str(exc)
    try:
        shard(model, topology=topo)
        res["twice_no_blocks"] = "accepted"
    except ValueError as exc:
        res["twice_no_blocks"] = str(exc)
    return res


def test_first_user_model_2x2(tmp_path):
    out = run_world(_world, 4, args=(str(tmp_path),), timeout_s=180)
    for rank, r in enumerate(out):
        for key in (
            "off",
            "hpz",
            "accum_hpz",
            "accum_off_overlap",
            "accum_all_overlap_is_sync",
            "rab_off",
            "rab_hpz",
            "bf16_hpz",
            "dcp_resume_all",
            "skip_off",
            "skip_hpz",
            "inbwd_hpz0",
            "inbwd_hpz",
            "inbwd_rab_off",
            "frames",
        ):
            assert r[key] is True, (rank, key)
        for key in ("all_gap", "skip_all_gap", "inbwd_all0_gap"):
            assert r[key] < 0.06, (rank, key, r[key])
        assert r["unused"] == {
            "deferred": "refused",
            "sync": "refused",
            "fix": "trained",
            "wide_deferred": "refused",
            "wide_sync": "refused",
            "wide_unused_everywhere": "close",
            "unit_unused_fix_on": "refused, unit named",
        }, (rank, r["unused"])
        assert "row [0, 2] crosses nodes" in r["hpz_perm_mesh"], r["hpz_perm_mesh"]
        for key in ("twice", "twice_no_blocks"):
            assert "already sharded" in r[key] and "found no blocks" not in r[key], r[key]


def test_hpz_as_a_partition_size_names_ranks_per_node():
    with pytest.raises(TypeError, match=r"Topology.from_env\(ranks_per_node=8\)"):
        ZeroPPConfig(hpz=8)
    with pytest.raises(TypeError, match=r"hpz must be a bool; got 1$"):
        ZeroPPConfig(hpz=1)


class _WithEmpty(nn.Module):
    """Two blocks, the second holding an ``nn.Linear(D, 0)`` (a (0, D) weight, a (0,) bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.blocks[1].empty = nn.Linear(D, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        return self.blocks[1](x) + self.blocks[1].empty(x).sum()


def test_a_trainable_empty_parameter_is_refused_before_anything_is_wrapped(tmp_path):
    """nn.Linear(d, 0) in a block: shard() wrapped it and the forward ran, then the first
    backward failed inside FSDP2's reduce-scatter copy-in ("_chunk_cat expects non-empty
    tensor", plain fully_shard alike). Now refused up front, naming the parameter and the fix;
    frozen, the same model shards and trains."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        topo = Topology(world_size=1, ranks_per_node=1)
        model = _WithEmpty()
        with pytest.raises(
            ValueError, match=r"'blocks.1.empty.weight' has no elements \(shape \(0, 16\)\)"
        ):
            shard(model, topology=topo)
        assert not any(isinstance(m, FSDPModule) for m in model.modules())
        model.blocks[1].empty.requires_grad_(False)
        shard(model, topology=topo)
        model(torch.randn(2, D)).sum().backward()
        assert all(p.grad is not None for p in model.blocks[0].parameters())
    finally:
        dist.destroy_process_group()
