"""The 8- and 4-bit optimizers under torch's LR schedulers: checkpoints of scheduled runs load
and continue bit for bit, and the keys schedulers keep in param groups are accepted."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

from qshard import optim as qoptim

_OPTIMIZERS = [
    (qoptim.AdamW8bit, dict(lr=1e-2, weight_decay=0.1)),
    (qoptim.SGD8bit, dict(lr=1e-2, momentum=0.9)),
    (qoptim.Lion8bit, dict(lr=1e-3)),
    (qoptim.AdamW4bit, dict(lr=1e-2)),
]
_SCHEDULERS = {
    "cosine": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=5),
    # also cycles betas[0] / momentum and keeps max_lr, min_lr, max_momentum, base_momentum
    "onecycle": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10),
}


def _train(params, opt, sched, steps, first):
    for i in range(first, first + steps):
        gen = torch.Generator().manual_seed(i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        sched.step()


@pytest.mark.parametrize("sched", sorted(_SCHEDULERS))
@pytest.mark.parametrize("cls, kw", _OPTIMIZERS, ids=lambda x: getattr(x, "__name__", ""))
def test_a_scheduled_run_resumes_from_its_checkpoint_bit_for_bit(cls, kw, sched):
    # Before: every scheduler writes initial_lr (OneCycleLR four keys more) into the param
    # groups, and load_state_dict refused them as options of another optimizer, so no
    # checkpoint of a scheduled run could be loaded.
    make = _SCHEDULERS[sched]
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(64, 128, generator=gen), torch.randn(7, generator=gen)]
    ps = [nn.Parameter(t.clone()) for t in init]  # a quantized and an fp32-state tensor
    opt = cls(ps, **kw)
    sched_ = make(opt)
    _train(ps, opt, sched_, 3, 0)
    saved = copy.deepcopy((opt.state_dict(), sched_.state_dict(), [p.detach() for p in ps]))
    _train(ps, opt, sched_, 3, 3)

    qs = [nn.Parameter(t.clone()) for t in saved[2]]
    resumed = cls(qs, **kw)
    resumed_sched = make(resumed)
    resumed.load_state_dict(saved[0])
    resumed_sched.load_state_dict(saved[1])
    _train(qs, resumed, resumed_sched, 3, 3)
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
        for k, v in opt.state[p].items():
            assert torch.equal(v, resumed.state[q][k]), k
    assert resumed.param_groups[0] == {**opt.param_groups[0], "params": qs}


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before")
def test_param_groups_may_carry_scheduler_keys_but_not_typos():
    # A scheduler resumed with last_epoch >= 0 reads each group's initial_lr, so groups are
    # built with it (before: refused as an unknown option); a misspelt option is still an error.
    lrs = []
    for cls in (torch.optim.AdamW, qoptim.AdamW8bit):
        opt = cls([nn.Parameter(torch.randn(3))], lr=0.1)
        opt.param_groups[0]["initial_lr"] = 0.1
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3))], "initial_lr": 0.2})
        sched = lr_scheduler.StepLR(opt, step_size=1, gamma=0.5, last_epoch=3)
        sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    assert lrs[1] == lrs[0]
    with pytest.raises(ValueError, match=r"unknown param-group option\(s\) \['weight_decy'\]"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3))], "weight_decy": 0.0})
