"""Shared checks of the optimizer tests."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn


def assert_same_bits(a, b, where) -> None:
    """Two ``(parameter, optimizer)`` pairs hold bit-identical parameters and state tensors
    (float tensors compared as int32 patterns, so NaNs and signed zeros count too)."""
    (p1, o1), (p2, o2) = a, b
    assert torch.equal(p1.detach().view(torch.int32), p2.detach().view(torch.int32)), where
    for k, v in o1.state[p1].items():
        w = o2.state[p2][k]
        if v.dtype == torch.float32:
            v, w = v.view(torch.int32), w.view(torch.int32)
        assert torch.equal(v, w), (where, k)


# [Note: loading foreign state_dicts] in qshard.optim: the 8- and 4-bit optimizers' tests.


def continue_from_torch(cls, torch_cls, kw, *, steps):
    """A ``torch_cls(**kw)`` state_dict loaded into ``cls(**kw)``: torch steps the first of two
    (64, 128) parameters once, ``cls`` loads its state_dict over copies of both, then both take
    ``steps`` steps on the same gradients. Returns (torch's parameters, ours, our optimizer, the
    state_dict loaded); only the first parameter came with state."""
    gen = torch.Generator().manual_seed(0)
    ps = [nn.Parameter(torch.randn(64, 128, generator=gen)) for _ in range(2)]
    ref = torch_cls(ps, **kw)
    ps[0].grad = torch.randn(64, 128, generator=gen)
    ref.step()
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    ours = cls(qs, **kw)
    sd = copy.deepcopy(ref.state_dict())
    ours.load_state_dict(sd)
    for _ in range(steps):
        for p, q in zip(ps, qs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        ref.step()
        ours.step()
    return ps, qs, ours, sd


def assert_torch_option_refused(cls, torch_cls, kw, option) -> None:
    """A ``torch_cls`` state_dict with ``kw`` set, an option ``cls`` does not implement, is
    refused naming ``option`` and loads nothing (it used to load and step without it)."""
    p = nn.Parameter(torch.randn(64, 128))
    ref = torch_cls([p], lr=1e-2, **kw)
    p.grad = torch.randn_like(p)
    ref.step()
    ours = cls([p], lr=1e-2)
    before = copy.deepcopy(ours.state_dict())
    with pytest.raises(ValueError, match=f"{option}.*does not implement"):
        ours.load_state_dict(ref.state_dict())
    assert ours.state_dict() == before  # nothing loaded


def replay_plan_changes(opt, ps, gen, count) -> tuple[list[int], list[torch.Tensor]]:
    """Step ``opt`` on parameters ``ps`` through what a kept plan ([Note: prepared launch] in
    qshard._triton._common) must follow: new gradients and the same ones, replaced parameter
    memory, replaced states (a reload), ``ps[1]`` sitting out a step, gradients 4 bytes past
    an aligned start; then a block-size change, which must be refused. Returns ``count()``
    after each of the 11 steps and every parameter and state tensor before the refusal."""
    alive = []  # old gradients kept alive, so new ones cannot reuse their memory

    def step(new_grads: bool = True, out: int | None = None, odd: bool = False) -> int:
        for i, p in enumerate(ps):
            g = torch.randn(p.shape, generator=gen) * 0.1
            alive.append(p.grad)
            if i == out:
                p.grad = None
            elif odd:  # contiguous, 4 bytes past an aligned start
                p.grad = torch.cat([torch.zeros(1), g.flatten()])[1:].view(p.shape)
            elif new_grads or p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)  # same tensor, same memory
        opt.step()
        return count()

    counts = [step(), step(False), step(False), step()]  # new, kept, kept, new gradients
    for p in ps:
        p.data = p.data.clone()  # a parameter's memory replaced
    counts.append(step(False))
    opt.load_state_dict(opt.state_dict())  # the states replaced
    counts += [step(False), step(out=1), step(), step(), step(odd=True), step()]
    out = [t.clone() for p in ps for t in (p.detach(), *opt.state[p].values())]
    block = opt.param_groups[0]["block_size"]
    opt.param_groups[0]["block_size"] = block // 2
    with pytest.raises(RuntimeError, match=f"does not fit block_size={block // 2}"):
        step(False)
    return counts, out
