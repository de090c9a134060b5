"""The fp32-state path of the 8-bit optimizers: torch's own functional update, one call per
parameter group, bit for bit equal to ``torch.optim`` with the same ``foreach``/``fused`` flags.

Covered: 1-D tensors, tensors below ``min_8bit_size``, ``optim_bits=32`` groups, a group mixing
8-bit and fp32 state, a tensor whose first gradient comes late, StableEmbedding's table, bf16
parameters (fp32 math and state), and FSDP2 DTensor shards on 2 gloo ranks (an empty shard
included). Lion has no torch equivalent: its fp32 path is held to the per-tensor function it
batches.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from qshard import optim as qoptim
from qshard.nn import StableEmbedding
from qshard.optim import _functional
from qshard.testing import run_world

# (8-bit class, torch class, hyperparameters, flag sets torch has for it).
_FLAGS = [{}, {"foreach": False}, {"foreach": True}, {"fused": True}]
_CASES = [
    ("Adam8bit", torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-2), _FLAGS),
    ("AdamW8bit", torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1), _FLAGS),
    ("SGD8bit", torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-2), _FLAGS),
    ("SGD8bit", torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True), _FLAGS),
    ("SGD8bit", torch.optim.SGD, dict(lr=1e-2, momentum=0.5, dampening=0.1), _FLAGS),
    ("SGD8bit", torch.optim.SGD, dict(lr=1e-2), _FLAGS),
    ("RMSprop8bit", torch.optim.RMSprop, dict(lr=1e-3, weight_decay=1e-2), _FLAGS[:3]),
    ("RMSprop8bit", torch.optim.RMSprop, dict(lr=1e-3, momentum=0.9), _FLAGS[:3]),
    ("Adagrad8bit", torch.optim.Adagrad, dict(lr=1e-2, lr_decay=1e-2), _FLAGS),
    (
        "Adagrad8bit",
        torch.optim.Adagrad,
        dict(lr=1e-2, weight_decay=1e-2, initial_accumulator_value=0.3),
        _FLAGS,
    ),
]
_PARAMS = [(_CASES[i], f) for i in range(len(_CASES)) for f in _CASES[i][3]]
_STEPS = 6


def _id(case) -> str:
    (name, _, kw, _), flags = case
    return f"{name}-{'-'.join(f'{k}={v}' for k, v in {**kw, **flags}.items())}"


def _fp32_params(gen: torch.Generator) -> list[list[nn.Parameter]]:
    """Group 0: fp32 state by rule (1-D, small, a scalar) next to an 8-bit tensor; group 1:
    ``optim_bits=32`` on an 8-bit-eligible shape."""
    g0 = [torch.randn(s, generator=gen) for s in [(300,), (40, 50), (64, 300), (1,), (7, 3)]]
    g1 = [torch.randn(s, generator=gen) for s in [(48, 256), (9,)]]
    return [[nn.Parameter(t) for t in g] for g in (g0, g1)]


def _clone(groups):
    return [[nn.Parameter(p.detach().clone()) for p in g] for g in groups]


def _eight(p) -> bool:
    return p.dim() >= 2 and p.numel() >= 4096


def _assert_same_state(o8, o32, p8, p32, what: str) -> None:
    assert torch.equal(p8.detach(), p32.detach()), f"{what}: param"
    st8, st32 = o8.state[p8], o32.state[p32]
    if not st8:  # no gradient yet: no state here (torch's Adagrad creates its state eagerly)
        assert p8.grad is None and int(st32.get("step", 0)) == 0, what
        return
    for k, v in st32.items():
        if v is None:  # torch's SGD without momentum stores a None buffer
            continue
        assert torch.equal(st8[k], v), f"{what}: state {k}"
        assert st8[k].dtype == torch.float32 and st8[k].device == v.device, (what, k)


@pytest.mark.parametrize("case", _PARAMS, ids=_id)
def test_fp32_state_equals_torch_optim_with_the_same_flags(case):
    (name, cls32, kw, _), flags = case
    cls8 = getattr(qoptim, name)
    gen = torch.Generator().manual_seed(0)
    g8 = _fp32_params(gen)
    g32 = _clone(g8)
    o8 = cls8([{"params": g8[0]}, {"params": g8[1], "optim_bits": 32}], **kw, **flags)
    # The late tensor gets a torch optimizer of its own: torch's fused SGD cannot take a group
    # where some momentum buffers exist and others are still to be created.
    fp32_params = [p for p in g32[0] if not _eight(p) and p is not g32[0][4]] + g32[1]
    o32 = cls32(fp32_params, **kw, **flags)
    o32_late = cls32([g32[0][4]], **kw, **flags)
    # The 8-bit tensor alone, in an optimizer of its own: batching must not change its path.
    alone = nn.Parameter(g8[0][2].detach().clone())
    o_alone = cls8([alone], **kw, **flags)
    for step in range(_STEPS):
        for p8, p32 in zip([*g8[0], *g8[1]], [*g32[0], *g32[1]]):
            g = torch.randn(p8.shape, generator=gen)
            if p8 is g8[0][4] and step < 1:  # the (7, 3) tensor's first gradient comes late
                p8.grad = p32.grad = None
                continue
            p8.grad, p32.grad = g, g.clone()
        alone.grad = g8[0][2].grad.clone()
        o8.step()
        o32.step()
        o32_late.step()
        o_alone.step()
        for p8, p32 in zip([*g8[0], *g8[1]], [*g32[0], *g32[1]]):
            if p8 is g8[0][2]:  # the 8-bit tensor: checked against `alone` below
                continue
            ref = o32_late if p32 is g32[0][4] else o32
            _assert_same_state(o8, ref, p8, p32, f"step {step} {tuple(p8.shape)}")
        assert torch.equal(g8[0][2].detach(), alone.detach())
        for k, v in o_alone.state[alone].items():
            assert torch.equal(o8.state[g8[0][2]][k], v), k
    eight = any(k.endswith("_codes") for k in o8.state[g8[0][2]])
    assert eight == bool(o8._state_specs(o8.param_groups[0]))  # the mixed group really is mixed
    assert int(o8.state[g8[0][4]]["step"]) == _STEPS - 1


def test_one_torch_call_per_group_and_step(monkeypatch):
    from qshard.optim import adam8bit

    calls = []
    real = adam8bit._torch_adam

    def counting(params, *args, **kwargs):
        calls.append(len(params))
        return real(params, *args, **kwargs)

    monkeypatch.setattr(adam8bit, "_torch_adam", counting)
    gen = torch.Generator().manual_seed(1)
    groups = _fp32_params(gen)
    opt = qoptim.AdamW8bit([{"params": groups[0]}, {"params": groups[1], "optim_bits": 32}])
    for p in [*groups[0], *groups[1]]:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    opt.step()
    # group 0: four fp32-state tensors (the 8-bit one runs the kernel), group 1: two.
    assert calls == [4, 2, 4, 2]


def test_lion_fp32_state_equals_its_per_tensor_function():
    gen = torch.Generator().manual_seed(2)
    kw = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    ps = [nn.Parameter(torch.randn(s, generator=gen)) for s in [(500,), (30, 40), (1,)]]
    qs = [p.detach().clone() for p in ps]
    ms = [torch.zeros_like(q) for q in qs]
    opt = qoptim.Lion8bit(ps, **kw)
    for step in range(_STEPS):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        if step == _STEPS - 2:  # a NaN and an Inf gradient: NaN propagates, Inf takes its sign
            ps[0].grad[:2] = torch.tensor([float("nan"), float("inf")])
        opt.step()
        for p, q, m in zip(ps, qs, ms):
            _functional.lion_update(
                q, p.grad, m, lr=kw["lr"], beta1=0.9, beta2=0.99, weight_decay=kw["weight_decay"]
            )
            assert torch.equal(p.detach().view(torch.int32), q.view(torch.int32))  # NaNs too
            assert torch.equal(opt.state[p]["exp_avg"].view(torch.int32), m.view(torch.int32))
    assert ps[0].detach()[0].isnan() and not ps[0].detach()[2:].isnan().any()


def test_stable_embedding_table_equals_torch_fused_adamw():
    torch.manual_seed(3)
    emb = StableEmbedding(500, 64)  # 32000 elements: 8-bit-eligible, fp32 by registration
    ref = StableEmbedding(500, 64)
    ref.load_state_dict(emb.state_dict())
    o8 = qoptim.AdamW8bit(emb.parameters(), lr=1e-2, fused=True)
    o32 = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    gen = torch.Generator().manual_seed(4)
    for _ in range(_STEPS):
        idx = torch.randint(0, 500, (8, 5), generator=gen)
        for m in (emb, ref):
            m(idx).square().mean().backward()
        o8.step()
        o32.step()
        o8.zero_grad()
        o32.zero_grad()
    for (n, p), q in zip(emb.named_parameters(), ref.parameters()):
        _assert_same_state(o8, o32, p, q, n)
    assert "exp_avg" in o8.state[emb.weight]


@pytest.mark.parametrize("flags", [{}, {"fused": True}])
def test_bf16_parameters_take_fp32_math_rounded_once_per_step(flags):
    gen = torch.Generator().manual_seed(5)
    p = nn.Parameter(torch.randn(4000, generator=gen).bfloat16())
    q = nn.Parameter(p.detach().float())
    o8 = qoptim.AdamW8bit([p], lr=1e-2, **flags)
    o32 = torch.optim.AdamW([q], lr=1e-2, **flags)
    for _ in range(_STEPS):
        g = torch.randn(p.shape, generator=gen).bfloat16()
        p.grad, q.grad = g, g.float()
        o8.step()
        o32.step()
        with torch.no_grad():
            q.copy_(q.bfloat16().float())  # the bf16 parameter stores each step rounded
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach().float(), q.detach())
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(o8.state[p][k], o32.state[q][k])


@pytest.mark.parametrize("case", [c for c in _PARAMS if c[1] != {"foreach": False}], ids=_id)
def test_fp64_parameters_equal_torch_optim_in_fp64(case):
    # fp64 parameters took fp32 copies through the update and were rounded to fp32 every step
    # (their state fp32 too); torch.optim keeps fp64 parameters and state in fp64.
    (name, cls32, kw, _), flags = case
    gen = torch.Generator().manual_seed(7)
    ps = [
        nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in [(300,), (7, 3)]
    ]
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    o8 = getattr(qoptim, name)(ps, **kw, **flags)
    o32 = cls32(qs, **kw, **flags)
    for step in range(_STEPS):
        for p, q in zip(ps, qs):
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            q.grad = p.grad.clone()
        o8.step()
        o32.step()
        for p, q in zip(ps, qs):
            assert torch.equal(p.detach(), q.detach()), f"step {step} {tuple(p.shape)}"
            for k, v in o32.state[q].items():
                if isinstance(v, torch.Tensor) and k != "step":
                    assert o8.state[p][k].dtype == torch.float64 and torch.equal(o8.state[p][k], v)
    # a checkpoint round trip keeps the fp64 state (and an fp32 one, from before, comes back fp64)
    sd = o8.state_dict()
    sd["state"][0] = {k: v.float() if k != "step" else v for k, v in sd["state"][0].items()}
    o8.load_state_dict(sd)
    assert all(v.dtype == torch.float64 for k, v in o8.state[ps[0]].items() if k != "step")


@pytest.mark.parametrize("name", ["Adam8bit", "SGD8bit", "RMSprop8bit", "Adagrad8bit", "Lion8bit"])
def test_fp64_parameters_with_8bit_state_are_not_rounded_to_fp32(name):
    kw = dict(lr=0.0, momentum=0.9) if name in ("SGD8bit", "RMSprop8bit") else dict(lr=0.0)
    p = nn.Parameter(1.0 + 1e-12 * torch.arange(64 * 128, dtype=torch.float64).reshape(64, 128))
    p0 = p.detach().clone()
    gen = torch.Generator().manual_seed(8)
    o8 = getattr(qoptim, name)([p], min_8bit_size=0, **kw)
    for _ in range(2):
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        o8.step()
    assert any(k.endswith("_codes") for k in o8.state[p])
    assert p.dtype == torch.float64 and torch.equal(p.detach(), p0)  # lr 0: not a bit moves
    # with lr > 0 the fp64 step is the fp32-parameter step (the same 8-bit state) to rounding
    q = nn.Parameter(p0.float())
    o_p = getattr(qoptim, name)([p], min_8bit_size=0, **{**kw, "lr": 1e-3})
    o_q = getattr(qoptim, name)([q], min_8bit_size=0, **{**kw, "lr": 1e-3})
    for _ in range(3):
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        p.grad, q.grad = g, g.float()
        o_p.step()
        o_q.step()
    torch.testing.assert_close(
        p.detach() - p0, (q.detach() - p0.float()).double(), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("name", ["AdamW8bit", "SGD8bit", "Adagrad8bit"])
def test_fused_step_counters_on_another_device(monkeypatch, name):
    # On CUDA a fused kernel reads the step counters on the parameter's device, while the state
    # keeps CPU counters: the kernel gets copies and the counters move once. Forced here on CPU.
    from qshard.optim import _blockwise_base

    monkeypatch.setattr(_blockwise_base, "_steps_off_device", lambda params: True)
    cls32 = {"AdamW8bit": torch.optim.AdamW, "SGD8bit": torch.optim.SGD}.get(
        name, torch.optim.Adagrad
    )
    kw = dict(lr=1e-2, momentum=0.9) if name == "SGD8bit" else dict(lr=1e-2)
    gen = torch.Generator().manual_seed(6)
    ps = [nn.Parameter(torch.randn(s, generator=gen)) for s in [(300,), (20, 30)]]
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    o8 = getattr(qoptim, name)(ps, fused=True, **kw)
    o32 = cls32(qs, fused=True, **kw)
    for _ in range(_STEPS):
        for p, q in zip(ps, qs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        o8.step()
        o32.step()
    for p, q in zip(ps, qs):
        _assert_same_state(o8, o32, p, q, name)
        assert int(o8.state[p]["step"]) == _STEPS


def test_device_step_copies_are_one_buffer_per_device():
    # One copy per device (on CUDA one pinned, non-blocking transfer) instead of one blocking
    # copy per counter, which waited for the stream once per fp32-state tensor per step.
    from qshard.optim._base8bit import _device_steps

    steps = [torch.tensor(float(k), dtype=torch.float32) for k in (3, 5, 7)]
    params = [torch.zeros(2), torch.zeros(3, 4), torch.zeros(1)]
    copies = _device_steps(steps, params)
    assert [float(c) for c in copies] == [3.0, 5.0, 7.0]
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1
    for c in copies:  # the kernel advances the copies; the CPU counters move on their own
        c += 1
    assert [float(s) for s in steps] == [3.0, 5.0, 7.0]


def test_flags_are_validated():
    p = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="cannot both be True"):
        qoptim.AdamW8bit([p], foreach=True, fused=True)
    with pytest.raises(ValueError, match="fused must be None, False or True"):
        qoptim.SGD8bit([{"params": [p], "fused": "yes"}])
    with pytest.raises(TypeError):
        qoptim.RMSprop8bit([p], fused=True)  # torch has no fused RMSprop
    with pytest.raises(ValueError, match="unknown param-group option"):
        qoptim.Lion8bit([{"params": [p], "foreach": True}])  # nor a Lion


# ------------------------------------------------------------------------------------------
# FSDP2: the same comparison on DTensor shards (explicit gradients, as in test_8bit_fsdp.py).


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = StableEmbedding(37, 48)
        self.l1 = nn.Linear(48, 96)  # 4608-element weight: 8-bit unless optim_bits=32
        self.l2 = nn.Linear(96, 1)  # one-row weight and a 1-element bias: empty shard on rank 1


def _sharded(mesh) -> nn.Module:
    torch.manual_seed(0)
    model = _Net()
    for m in (model.l1, model.l2):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_world(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    # (optimizer, torch class, hyperparameters, flags, optim_bits, torch runs unsharded): 8
    # bits is the mixed case (l1.weight 8-bit, the rest fp32); torch's fused Adagrad has no
    # DTensor support, so it runs on the unsharded model (fused updates are elementwise).
    cases = [
        ("AdamW8bit", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), {"fused": True}, 32, 0),
        ("AdamW8bit", torch.optim.AdamW, dict(lr=1e-2), {"fused": True}, 8, 0),
        ("Adam8bit", torch.optim.Adam, dict(lr=1e-2), {}, 32, 0),
        ("SGD8bit", torch.optim.SGD, dict(lr=1e-2, momentum=0.9), {"foreach": True}, 32, 0),
        ("RMSprop8bit", torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5), {}, 8, 0),
        ("Adagrad8bit", torch.optim.Adagrad, dict(lr=1e-2), {"fused": True}, 32, 1),
    ]
    for name, cls32, kw, flags, bits, unsharded in cases:
        m8 = _sharded(mesh)
        if unsharded:
            torch.manual_seed(0)
            m32 = _Net()
        else:
            m32 = _sharded(mesh)
        o8 = getattr(qoptim, name)(m8.parameters(), optim_bits=bits, **kw, **flags)
        o32 = cls32(m32.parameters(), **kw, **flags)
        for step in range(3):
            gen = torch.Generator().manual_seed(100 + step)
            for p8, p32 in zip(m8.parameters(), m32.parameters()):
                g = torch.randn(p8.shape, generator=gen)
                p8.grad = distribute_tensor(g, p8.device_mesh, p8.placements)
                p32.grad = (
                    g.clone() if unsharded else distribute_tensor(g.clone(), mesh, p32.placements)
                )
            o8.step()
            o32.step()
            for (n, p8), p32 in zip(m8.named_parameters(), m32.parameters()):
                assert isinstance(p8, DTensor)
                if any(k.endswith("_codes") for k in o8.state[p8]):
                    assert bits == 8 and n == "l1.weight", n
                    continue
                where = f"{name} rank {rank} step {step} {n}"
                theirs = (lambda t: t) if unsharded else (lambda t: t.to_local())
                ours = (lambda t: t.full_tensor()) if unsharded else (lambda t: t.to_local())
                assert torch.equal(ours(p8), theirs(p32)), where
                for k, v in o32.state[p32].items():
                    if v is None:
                        continue
                    w = o8.state[p8][k]
                    if k == "step":
                        assert not isinstance(w, DTensor) and torch.equal(w, v), (where, k)
                        continue
                    assert isinstance(w, DTensor), (where, k)
                    assert torch.equal(ours(w), theirs(v)), (where, k)
        if rank == 1:
            assert m8.l2.bias.to_local().numel() == 0  # the empty shard took part
            assert int(o8.state[m8.l2.bias]["step"]) == 3


def test_fsdp2_fp32_state_equals_torch_optim_on_shards():
    run_world(_fsdp_world, 2, timeout_s=240)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-x", "-q"])


def test_triton_step_only_takes_its_dtypes(monkeypatch):
    # The 8-bit Triton kernel reads and writes fp32/bf16 parameters with fp32 math; an fp64 CUDA
    # parameter went to it too (rounded to fp32 every step). Forced on CPU: serves() patched.
    from qshard import _triton

    calls = []

    class Launch:  # a prepared launch that runs nothing
        def run(self, hps, **kw):
            pass

    def prepare(**kw):
        calls.extend(p.dtype for p in kw["params"])
        return Launch()

    monkeypatch.setattr(_triton, "serves", lambda t: True)
    monkeypatch.setattr(_triton, "prepare_optim8bit_multi", prepare)
    for dtype in (torch.float64, torch.float16, torch.float32):
        p = nn.Parameter(torch.randn(64, 128, dtype=dtype))
        o8 = qoptim.AdamW8bit([p], min_8bit_size=0)
        p.grad = torch.randn_like(p)
        o8.step()
    assert calls == [torch.float32]
