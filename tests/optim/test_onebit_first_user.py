"""OneBitAdam and ZeroOneAdam used as a first user coming from DeepSpeed would: each defect that
turned up, pinned down (docs/zero_one_adam.md: "One process", "Checkpoints", "Parameters added
or unfrozen later"). Each defect's test failed before its fix; two guards pin what the fixes
must not change (one process without a world, resume with the same settings)."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from qshard.optim import OneBitAdam, ZeroOneAdam
from qshard.testing import run_world

# ------------------------------------------------------------------ built before init


def _built_before_init(rank: int, world: int, store: str) -> list[str]:
    """Both optimizers built while no process group exists, then the world comes up. Before,
    they kept running as one rank: nothing was averaged (the replicas differed after the
    first step) and the first 1-bit step raised a ValueError about error-buffer sizes."""
    dist.destroy_process_group()
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(7))]
    early = [
        OneBitAdam([params[0]], lr=1e-2, freeze_step=2),
        ZeroOneAdam([params[1]], lr=1e-2, var_freeze_step=2),
    ]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    messages = []
    for opt, p in zip(early, params):
        p.grad = torch.randn(7, generator=torch.Generator().manual_seed(rank))
        before = p.detach().clone()
        with pytest.raises(
            RuntimeError, match=r"built before torch\.distributed\.init_process_group"
        ):
            opt.step()
        assert torch.equal(p.detach(), before)  # refused before anything moved
        with pytest.raises(RuntimeError, match="after init_process_group"):
            opt.zero_grad()
            opt.step()
        messages.append(type(opt).__name__)
    # A branch with no gradient on any rank through the warm-up, then used on rank 1 only:
    # no variance, so no lr * m / eps step, and every rank decides alike (replicas agree).
    for cls, kw in ((OneBitAdam, {"freeze_step": 4}), (ZeroOneAdam, {"var_freeze_step": 4})):
        torch.manual_seed(0)
        used, branch = nn.Parameter(torch.randn(33)), nn.Parameter(torch.randn(33))
        opt = cls([used, branch], lr=1e-2, **kw)
        start = branch.detach().clone()
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            for step in range(10):
                g = torch.Generator().manual_seed(100 * step + rank)
                used.grad = torch.randn(33, generator=g)
                branch.grad = torch.randn(33, generator=g) if step >= 6 and rank == 1 else None
                opt.step()
        assert any("no variance estimate" in str(w.message) for w in got)
        if cls is ZeroOneAdam:
            opt.synchronize()
        assert torch.equal(branch.detach(), start)  # not moved by 1e6 x lr
        views = [torch.empty(66) for _ in range(world)]
        dist.all_gather(views, torch.cat([used.detach(), branch.detach()]))
        assert torch.equal(views[0], views[1])
    # Built after init_process_group, the same optimizers average: replicas agree.
    for cls in (OneBitAdam, ZeroOneAdam):
        p = nn.Parameter(torch.ones(7))
        opt = cls([p], lr=1e-2)
        p.grad = torch.randn(7, generator=torch.Generator().manual_seed(10 + rank))
        opt.step()
        views = [torch.empty(7) for _ in range(world)]
        dist.all_gather(views, p.detach().clone())
        assert torch.equal(views[0], views[1])
    return messages


def test_optimizer_built_before_init_process_group_is_refused(tmp_path):
    store = os.path.join(tmp_path, "reinit_store")
    results = run_world(_built_before_init, 2, args=(store,), timeout_s=120)
    assert results[0] == results[1] == ["OneBitAdam", "ZeroOneAdam"]


def test_one_process_optimizer_still_runs_without_a_world():
    """The check refuses only a world of more than one rank: one process keeps working."""
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    for cls in (OneBitAdam, ZeroOneAdam):
        p = nn.Parameter(torch.ones(3))
        opt = cls([p], lr=1e-2)
        p.grad = torch.ones(3)
        opt.step()
        assert not torch.equal(p.detach(), torch.ones(3))


def test_inputs_other_integer_and_tensor_types_work_as_in_torch():
    """A first-user review's findings: each of these was refused or misread."""
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    import numpy as np

    # numpy integers (a step count computed with numpy) were refused as "not an int".
    assert (
        OneBitAdam([nn.Parameter(torch.ones(2))], freeze_step=np.int64(1000) // 4).freeze_step
        == 250
    )
    zo = ZeroOneAdam(
        [nn.Parameter(torch.ones(2))], var_freeze_step=np.int32(7), local_step_clipper=np.uint8(4)
    )
    assert (zo.var_freeze_step, zo.local_step_clipper) == (7, 4)
    assert type(zo.var_freeze_step) is int
    for bad in (True, 0, 2.0, "3"):
        with pytest.raises(ValueError, match="var_freeze_step must be an int >= 1"):
            ZeroOneAdam([nn.Parameter(torch.ones(2))], var_freeze_step=bad)
    # One Parameter instead of a list: torch.optim's TypeError; it was split into its rows and
    # refused as "can't optimize a non-leaf Tensor".
    for cls in (OneBitAdam, ZeroOneAdam):
        with pytest.raises(TypeError, match=r"iterable of Tensors or dicts.*pass \[param\]"):
            cls(nn.Parameter(torch.ones(3, 2)))
    # A tensor lr decayed in place by a scheduler: the lr at the freeze was the group's own
    # tensor, so the "interval outgrows the lr" check compared the lr with itself and warned
    # at every interval above 2; with a float lr (the same schedule) it stays quiet.
    for lr in (1e-2, torch.tensor(1e-2)):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        opt = ZeroOneAdam(
            model.parameters(), lr=lr, var_freeze_step=2, local_step_scaler=1, local_step_clipper=8
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)  # halves every step
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(20):
                opt.zero_grad()
                model(torch.randn(4, 3)).sum().backward()
                opt.step()
                sched.step()
        assert opt.comm_stats["local"] > 0  # the interval did grow


# ------------------------------------------------------------------ resume, other freeze


def _grad(p: nn.Parameter, step: int) -> None:
    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))


def _zero_one(p: nn.Parameter, var_freeze_step: int) -> ZeroOneAdam:
    return ZeroOneAdam(
        [p], lr=1e-3, var_freeze_step=var_freeze_step, local_step_scaler=4, local_step_clipper=4
    )


@pytest.mark.parametrize("through_groups", [False, True], ids=["per_rank", "dcp_layout"])
def test_resume_with_an_earlier_var_freeze_step_starts_syncing(through_groups):
    """Saved at step 5 with var_freeze_step=100, resumed with 8: the saved next sync (101)
    was kept, so steps 9 to 100 were all local steps, the replicas apart for 92 steps. The
    first phase-B step now syncs and the intervals then follow the schedule (at most H=4)."""
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    p = nn.Parameter(torch.zeros(8))
    opt = _zero_one(p, 100)
    for step in range(5):
        _grad(p, step)
        opt.step()
    saved = opt.state_dict()
    if through_groups:  # torch.distributed.checkpoint keeps the counters in param_groups only
        saved = {k: v for k, v in saved.items() if k != "qshard"}
    q = nn.Parameter(p.detach().clone())
    resumed = _zero_one(q, 8)
    resumed.load_state_dict(saved)
    gap = 0
    for step in range(5, 40):
        _grad(q, step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a constant lr: the interval warning is not the point
            resumed.step()
        gap = 0 if resumed.in_sync else gap + 1
        assert gap < 4, step  # never more than H - 1 local steps in a row
        if step + 1 == 9:  # the first phase-B step is a sync
            assert resumed.in_sync and resumed.comm_stats["local"] == 0
    assert resumed.comm_stats["local"] > 0


def test_resume_with_the_same_var_freeze_step_keeps_the_schedule():
    """The reconciliation is a no-op with the saved settings, at every save point."""
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    for split in (3, 8, 9, 14):
        p = nn.Parameter(torch.zeros(8))
        opt = _zero_one(p, 8)
        for step in range(split):
            _grad(p, step)
            opt.step()
        q = nn.Parameter(p.detach().clone())
        resumed = _zero_one(q, 8)
        resumed.load_state_dict(opt.state_dict())
        assert resumed._extra == opt._extra, split


def test_phase_b_state_into_a_later_freeze_stays_in_phase_b():
    """A state saved after the variance freeze (step 14, var_freeze_step=8), loaded with
    var_freeze_step=20 (as ``qshard train --resume --steps N`` derives a later one): the saved
    sync step was past by the time phase B began again, so the replicas never synced again.
    The state now stays in phase B (the variance cannot be unfrozen), with a warning, and
    syncs at least every H = 4 steps; the variance is not touched."""
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    p = nn.Parameter(torch.zeros(8))
    opt = _zero_one(p, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a constant lr: the interval warning is not the point
        for step in range(14):
            _grad(p, step)
            opt.step()
    saved = opt.state_dict()
    frozen_v = opt.state[p]["exp_avg_sq"].clone()
    for sd in (saved, {k: v for k, v in saved.items() if k != "qshard"}):
        q = nn.Parameter(p.detach().clone())
        later = _zero_one(q, 20)
        with pytest.warns(UserWarning, match=r"var_freeze_step=20: .* becomes 14"):
            later.load_state_dict(sd)
        gap = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in range(14, 60):
                _grad(q, step)
                later.step()
                gap = 0 if later.in_sync else gap + 1
                assert gap < 4, step
        assert torch.equal(later.state[q]["exp_avg_sq"], frozen_v)
        assert later.comm_stats["full_precision"] == opt.comm_stats["full_precision"]


# ------------------------------------------------------------------ no variance yet


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam])
def test_a_branch_first_used_after_the_freeze_is_not_thrown(cls):
    """A parameter with no gradient through the warm-up (a branch or head enabled later) has
    m and v, but v == 0: its first 1-bit steps moved it by lr * m / eps, 2.7e7 x lr here
    (torch's Adam: lr). It now stays put after the freeze, with a warning at the freeze."""
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    lr = 1e-3
    torch.manual_seed(0)
    used, branch = nn.Parameter(torch.randn(16)), nn.Parameter(torch.randn(16))
    freeze = {"freeze_step": 10} if cls is OneBitAdam else {"var_freeze_step": 10}
    opt = cls([used, branch], lr=lr, **freeze)
    largest = 0.0
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for step in range(20):
            used.grad = torch.randn(16)
            branch.grad = torch.randn(16) if step >= 12 else None
            before = branch.detach().clone()
            opt.step()
            largest = max(largest, (branch.detach() - before).abs().max().item() / lr)
    assert largest == 0.0, largest
    mine = [w for w in got if "no variance estimate" in str(w.message)]
    assert len(mine) == 1 and "(16,)" in str(mine[0].message)
    assert mine[0].filename == __file__  # the user's opt.step()


def test_zero_one_phase_a_waits_for_a_variance_step():
    """In 0/1 Adam's phase A, a parameter first used on a 1-bit step (not a variance step)
    took lr * m / eps; it now waits for the next variance step and then trains normally."""
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    from qshard.optim.zero_one_adam import variance_update_steps

    lr = 1e-3
    torch.manual_seed(0)
    used, branch = nn.Parameter(torch.randn(16)), nn.Parameter(torch.randn(16))
    opt = ZeroOneAdam([used, branch], lr=lr, var_freeze_step=100, var_update_scaler=2)
    variance_steps = variance_update_steps(100, kappa=2)
    first = next(s for s in range(10, 100) if s not in variance_steps)  # a 1-bit step
    moves = {}
    for step in range(1, 60):
        used.grad = torch.randn(16)
        branch.grad = torch.randn(16) if step >= first else None
        before = branch.detach().clone()
        opt.step()
        moves[step] = (branch.detach() - before).abs().max().item() / lr
    assert max(moves.values()) < 1000, max(moves.values())  # measured 51 (a fresh v, m of 2 steps)
    later = [s for s in variance_steps if s > first]
    assert moves[first] == 0.0 and moves[later[0]] > 0  # trains from its first variance step


@pytest.mark.parametrize("option", ["maximize", "freeze_step", "var_freeze_step"])
def test_a_whole_optimizer_option_set_by_hand_in_param_groups_is_refused_at_step(option):
    """The 1-bit optimizers refuse such keys in ``add_param_group`` (a group would ignore
    them); written into ``param_groups`` by hand they were ignored at every step."""
    for cls in (OneBitAdam, ZeroOneAdam):
        p = nn.Parameter(torch.ones(8))
        opt = cls([p], lr=1e-2)
        opt.param_groups[0][option] = 5
        p.grad = torch.ones(8)
        with pytest.raises(ValueError, match=rf"\['{option}'\] set by hand in a param group"):
            opt.step()
        assert torch.equal(p, torch.ones(8))
        del opt.param_groups[0][option]
        opt.step()
        assert not torch.equal(p, torch.ones(8))


def test_onebit_adam_synchronize_is_a_no_op_returning_false():
    """docs/zero_one_adam.md: OneBitAdam is "used the same way" as ZeroOneAdam, whose loop ends
    with ``opt.synchronize()``; OneBitAdam had no such method (AttributeError)."""
    p = nn.Parameter(torch.ones(8))
    opt = OneBitAdam([p], lr=1e-2)
    p.grad = torch.ones(8)
    opt.step()
    after = p.detach().clone()
    assert opt.synchronize() is False and opt.in_sync
    assert torch.equal(p, after)


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam])
def test_zero_masks_through_dcp_are_restored_or_refused(cls, tmp_path):
    """[Note: zero masks through DCP]: DCP loads into a fresh optimizer's template, which holds
    no ``zero_mask``, so a masked run resumed through DCP dropped its masks without a word and
    the masked elements trained on (max |w| ~ 800 after 3 steps, where they stay 0). The load
    now refuses, naming set_zero_mask; with the masks set on the fresh optimizer first the run
    continues bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    kw = {"freeze_step": 2} if cls is OneBitAdam else {"var_freeze_step": 2}
    mask = torch.ones(16, 16, dtype=torch.bool)
    mask[:, :4] = False

    def build():
        torch.manual_seed(0)
        m = nn.Linear(16, 16, bias=False)
        with torch.no_grad():
            m.weight[~mask] = 0
        return m, cls(m.parameters(), lr=1e-2, **kw)

    def steps(m, opt, n, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(n):
            opt.zero_grad()
            m(torch.randn(8, 16, generator=gen)).square().mean().backward()
            opt.step()
        return m.weight.detach().clone()

    m, opt = build()
    opt.set_zero_mask(m.weight, mask)
    steps(m, opt, 3, 0)
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    expected = steps(m, opt, 3, 1)
    assert torch.all(expected[~mask] == 0)

    for with_mask in (False, True):
        m2, opt2 = build()
        if with_mask:
            opt2.set_zero_mask(m2.weight, mask)
        msd, osd = get_state_dict(m2, opt2)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(tmp_path))
        if not with_mask:
            with pytest.raises(ValueError, match=r"zero masks .*set_zero_mask\(param, mask\)"):
                set_state_dict(m2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            continue
        set_state_dict(m2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        assert torch.equal(steps(m2, opt2, 3, 1), expected)


def _resume_into_a_per_rank_seeded_model(rank: int, world: int, path: str) -> list:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = []
    for cls in (OneBitAdam, ZeroOneAdam):
        ckpt = os.path.join(path, cls.__name__)

        def steps(m, opt, n, seed):
            gen = torch.Generator().manual_seed(seed + rank)
            for _ in range(n):
                opt.zero_grad()
                m(torch.randn(4, 8, generator=gen)).square().mean().backward()
                opt.step()
            return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

        torch.manual_seed(0)
        m = nn.Linear(8, 8)
        opt = cls(m.parameters(), lr=1e-3)
        steps(m, opt, 2, 0)
        msd, osd = get_state_dict(m, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        expected = steps(m, opt, 2, 100)
        torch.manual_seed(rank)  # a per-rank seed (data, dropout): weights about to be loaded
        m2 = nn.Linear(8, 8)
        opt2 = cls(m2.parameters(), lr=1e-3)
        msd, osd = get_state_dict(m2, opt2)  # torch's zero-lr template step: no refusal
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=ckpt)
        set_state_dict(m2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        out.append(torch.equal(steps(m2, opt2, 2, 100), expected))
        # a zero-lr first step defers the check, it does not drop it
        torch.manual_seed(rank)
        m3 = nn.Linear(8, 8)
        opt3 = cls(m3.parameters(), lr=0.0)
        steps(m3, opt3, 1, 0)
        opt3.param_groups[0]["lr"] = 1e-3
        try:
            steps(m3, opt3, 1, 0)
            out.append("not refused")
        except RuntimeError as exc:
            out.append("refused" if "initial parameters differ" in str(exc) else str(exc))
    return out


def test_dcp_resume_into_a_model_built_with_a_per_rank_seed(tmp_path):
    """torch's ``get_state_dict`` runs a zero-lr step on the fresh optimizer to build the
    template ``dcp.load`` fills; that step ran the one-time replica check on parameters the
    checkpoint was about to overwrite, and a fresh model built after ``torch.manual_seed(rank)``
    was refused ("initial parameters differ across ranks ... broadcast them"). The values are
    now checked at the first step that can move a parameter: the resume continues bit for bit,
    and differing replicas are still refused after a zero-lr first step."""
    results = run_world(
        _resume_into_a_per_rank_seeded_model, 2, args=(str(tmp_path),), timeout_s=120
    )
    for r in results:
        assert r == [True, "refused", True, "refused"], r


def test_onebit_adam_resumed_with_a_later_freeze_stays_frozen():
    """A OneBitAdam state saved after its freeze (compressed steps done), loaded into one with
    a later ``freeze_step``, went back to full-precision steps and updated the frozen variance
    again, without a word (ZeroOneAdam warned and stayed in phase B). It now stays frozen, with
    a warning; a state saved before its freeze takes the new one."""
    gen = torch.Generator().manual_seed(0)
    p = nn.Parameter(torch.randn(64, generator=gen))
    opt = OneBitAdam([p], lr=1e-2, freeze_step=2)
    for _ in range(4):
        p.grad = torch.randn(64, generator=gen)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    q = nn.Parameter(p.detach().clone())
    later = OneBitAdam([q], lr=1e-2, freeze_step=10)
    with pytest.warns(UserWarning, match=r"cannot be unfrozen.*freeze_step becomes 4"):
        later.load_state_dict(saved)
    v = later.state[q]["exp_avg_sq"].clone()
    q.grad = torch.randn(64, generator=gen)
    later.step()
    assert torch.equal(later.state[q]["exp_avg_sq"], v)
    assert later.comm_stats["compressed"] == 3 and later.comm_stats["full_precision"] == 2
    # saved in the warm-up: the new freeze applies, no warning
    early = OneBitAdam([nn.Parameter(torch.ones(8))], lr=1e-2, freeze_step=10)
    early.param_groups[0]["params"][0].grad = torch.ones(8)
    early.step()
    again = OneBitAdam([nn.Parameter(torch.ones(8))], lr=1e-2, freeze_step=20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.load_state_dict(copy.deepcopy(early.state_dict()))
    assert again.freeze_step == 20


def test_a_state_with_one_moment_is_refused_at_load():
    """A hand-edited state_dict with ``exp_avg`` but no ``exp_avg_sq`` loaded and failed at the
    next step with a bare ``KeyError: 'exp_avg_sq'``."""
    for cls in (OneBitAdam, ZeroOneAdam):
        p = nn.Parameter(torch.ones(8))
        opt = cls([p], lr=1e-2)
        p.grad = torch.ones(8)
        opt.step()
        sd = copy.deepcopy(opt.state_dict())
        del sd["state"][0]["exp_avg_sq"]
        fresh = cls([nn.Parameter(torch.ones(8))], lr=1e-2)
        with pytest.raises(ValueError, match=r"has 'exp_avg' without 'exp_avg_sq'"):
            fresh.load_state_dict(sd)
