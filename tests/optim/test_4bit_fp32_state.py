"""The fp32-state path of Adam4bit/AdamW4bit: the 8-bit optimizers' (one call of torch's
functional Adam per parameter group), bit for bit equal to ``torch.optim.Adam``/``AdamW`` with
the same ``foreach``/``fused`` flags, next to a 4-bit tensor whose path batching leaves alone;
and ``load_state_dict`` keeping the packed codes' dtype.

Covered: 1-D tensors, tensors below ``min_4bit_size``, an ``optim_bits=32`` group on a
4-bit-eligible shape, a tensor whose first gradient comes late, bf16 parameters.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qshard import optim as qoptim

_FLAGS = [{}, {"foreach": False}, {"foreach": True}, {"fused": True}]
_CASES = [
    ("Adam4bit", torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-2)),
    ("AdamW4bit", torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)),
]
_STEPS = 5


def _groups(gen: torch.Generator) -> list[list[nn.Parameter]]:
    """Group 0: fp32 state by rule (1-D, small, a scalar, a late one) next to a 4-bit tensor
    (index 2); group 1: ``optim_bits=32`` on a 4-bit-eligible shape and a 1-D tensor."""
    g0 = [torch.randn(s, generator=gen) for s in [(300,), (40, 50), (64, 300), (1,), (7, 3)]]
    g1 = [torch.randn(s, generator=gen) for s in [(48, 256), (9,)]]
    return [[nn.Parameter(t) for t in g] for g in (g0, g1)]


@pytest.mark.parametrize("flags", _FLAGS, ids=lambda f: "-".join(map(str, f.items())) or "none")
@pytest.mark.parametrize("case", _CASES, ids=lambda c: c[0])
def test_fp32_state_equals_torch_optim_with_the_same_flags(case, flags):
    name, cls32, kw = case
    cls4 = getattr(qoptim, name)
    gen = torch.Generator().manual_seed(0)
    g4 = _groups(gen)
    g32 = [[nn.Parameter(p.detach().clone()) for p in g] for g in g4]
    o4 = cls4([{"params": g4[0]}, {"params": g4[1], "optim_bits": 32}], **kw, **flags)
    fp32 = [p for i, p in enumerate(g32[0]) if i not in (2, 4)] + g32[1]
    o32 = cls32(fp32, **kw, **flags)
    o32_late = cls32([g32[0][4]], **kw, **flags)
    alone = nn.Parameter(g4[0][2].detach().clone())  # the 4-bit tensor in its own optimizer
    o_alone = cls4([alone], **kw, **flags)
    for step in range(_STEPS):
        for p4, p32 in zip([*g4[0], *g4[1]], [*g32[0], *g32[1]]):
            if p4 is g4[0][4] and step < 1:  # the (7, 3) tensor's first gradient comes late
                p4.grad = p32.grad = None
                continue
            g = torch.randn(p4.shape, generator=gen)
            p4.grad, p32.grad = g, g.clone()
        alone.grad = g4[0][2].grad.clone()
        for o in (o4, o32, o32_late, o_alone):
            o.step()
        for i, (p4, p32) in enumerate(zip([*g4[0], *g4[1]], [*g32[0], *g32[1]])):
            if i == 2:
                continue
            ref = o32_late if i == 4 else o32
            assert torch.equal(p4.detach(), p32.detach()), (step, i)
            if p4.grad is None:
                continue
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(o4.state[p4][k], ref.state[p32][k]), (step, i, k)
                assert o4.state[p4][k].dtype == torch.float32
        assert torch.equal(g4[0][2].detach(), alone.detach())
        for k, v in o_alone.state[alone].items():
            assert torch.equal(o4.state[g4[0][2]][k], v), k
    assert "exp_avg_codes" in o4.state[g4[0][2]]  # the mixed group really is mixed
    assert "exp_avg" in o4.state[g4[1][0]]  # optim_bits=32 on an eligible shape
    assert int(o4.state[g4[0][4]]["step"]) == _STEPS - 1


def test_one_torch_call_per_group_and_step(monkeypatch):
    from qshard.optim import adam8bit

    calls = []
    real = adam8bit._torch_adam

    def counting(params, *args, **kwargs):
        calls.append(len(params))
        return real(params, *args, **kwargs)

    monkeypatch.setattr(adam8bit, "_torch_adam", counting)
    gen = torch.Generator().manual_seed(1)
    groups = _groups(gen)
    opt = qoptim.AdamW4bit([{"params": groups[0]}, {"params": groups[1], "optim_bits": 32}])
    for p in [*groups[0], *groups[1]]:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    opt.step()
    assert calls == [4, 2, 4, 2]  # the 4-bit tensor of group 0 runs its kernel


@pytest.mark.parametrize("flags", [{}, {"fused": True}])
def test_bf16_parameters_take_fp32_math_rounded_once_per_step(flags):
    gen = torch.Generator().manual_seed(5)
    p = nn.Parameter(torch.randn(4000, generator=gen).bfloat16())
    q = nn.Parameter(p.detach().float())
    o4 = qoptim.AdamW4bit([p], lr=1e-2, **flags)
    o32 = torch.optim.AdamW([q], lr=1e-2, **flags)
    for _ in range(_STEPS):
        g = torch.randn(p.shape, generator=gen).bfloat16()
        p.grad, q.grad = g, g.float()
        o4.step()
        o32.step()
        with torch.no_grad():
            q.copy_(q.bfloat16().float())  # the parameter is stored in bf16 after each step
        assert torch.equal(p.detach().float(), q.detach())
        assert torch.equal(o4.state[p]["exp_avg_sq"], o32.state[q]["exp_avg_sq"])


@pytest.mark.parametrize("flags", [{}, {"fused": True}])
@pytest.mark.parametrize("case", _CASES, ids=lambda c: c[0])
def test_fp64_parameters_keep_fp64(case, flags):
    # fp64 parameters went through fp32 copies and were rounded to fp32 every step, on the
    # fp32-state path (state fp32 too) and on the 4-bit path alike.
    name, cls32, kw = case
    gen = torch.Generator().manual_seed(9)
    p = nn.Parameter(torch.randn(300, generator=gen, dtype=torch.float64))
    q = nn.Parameter(p.detach().clone())
    o4, o32 = getattr(qoptim, name)([p], **kw, **flags), cls32([q], **kw, **flags)
    for _ in range(_STEPS):
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        q.grad = p.grad.clone()
        o4.step()
        o32.step()
        assert torch.equal(p.detach(), q.detach())
        for k in ("exp_avg", "exp_avg_sq"):
            assert o4.state[p][k].dtype == torch.float64
            assert torch.equal(o4.state[p][k], o32.state[q][k])
    # 4-bit state, lr 0 and no decay: the parameter keeps every bit
    w = nn.Parameter(1.0 + 1e-12 * torch.arange(64 * 128, dtype=torch.float64).reshape(64, 128))
    w0 = w.detach().clone()
    o = getattr(qoptim, name)([w], lr=0.0, min_4bit_size=0)
    for _ in range(2):
        w.grad = torch.randn(w.shape, generator=gen, dtype=torch.float64)
        o.step()
    assert "exp_avg_codes" in o.state[w]
    assert w.dtype == torch.float64 and torch.equal(w.detach(), w0)


def test_flags_are_checked_as_torch_checks_them():
    p = [nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="fused and foreach cannot both be True"):
        qoptim.AdamW4bit(p, foreach=True, fused=True)
    with pytest.raises(ValueError, match="foreach must be None, False or True"):
        qoptim.Adam4bit(p, foreach="yes")


def test_load_state_dict_keeps_codes_dtype_and_resumes_bit_exact():
    gen = torch.Generator().manual_seed(6)
    w = nn.Parameter(torch.randn(32, 256, generator=gen).bfloat16())
    b = nn.Parameter(torch.randn(32, generator=gen).bfloat16())
    opt = qoptim.AdamW4bit([w, b], lr=1e-2, min_4bit_size=0)
    grads = [[torch.randn(t.shape, generator=gen).bfloat16() for t in (w, b)] for _ in range(4)]
    for gw, gb in grads[:2]:
        w.grad, b.grad = gw, gb
        opt.step()
    w2, b2 = nn.Parameter(w.detach().clone()), nn.Parameter(b.detach().clone())
    opt2 = qoptim.AdamW4bit([w2, b2], lr=1e-2, min_4bit_size=0)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from a checkpoint: no sharing
    assert opt2.state[w2]["exp_avg_codes"].dtype == torch.uint8
    assert opt2.state[w2]["exp_avg_absmax"].dtype == torch.float32
    assert opt2.state[b2]["exp_avg"].dtype == torch.float32  # not cast to the bf16 parameter
    for gw, gb in grads[2:]:
        w.grad, b.grad, w2.grad, b2.grad = gw, gb, gw.clone(), gb.clone()
        opt.step()
        opt2.step()
    assert torch.equal(w.detach(), w2.detach()) and torch.equal(b.detach(), b2.detach())
    for k, v in opt.state[w].items():
        assert torch.equal(opt2.state[w2][k], v), k
