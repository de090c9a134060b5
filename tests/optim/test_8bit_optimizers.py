"""8-bit optimizers against torch.optim trajectories, the three numerical pitfalls of the
reference kernels (with ``bnb_compat`` reproducing them), state_dict round trips, 32-bit
overrides, StableEmbedding, option validation and state size."""

from __future__ import annotations

import copy
import inspect
import io
import pickle

import pytest
import torch
from torch import nn

from qshard import optim as qoptim
from qshard.nn import StableEmbedding
from qshard.optim import _qstate

from ._helpers import assert_torch_option_refused, continue_from_torch

# ------------------------------------------------------------------------------------------
# Trajectories vs torch.optim.


def _lion_fp32(params, grads, exp_avgs, *, lr, betas, weight_decay):
    """Lion (Chen et al. 2023, Algorithm 2) in fp32, written from the paper."""
    b1, b2 = betas
    for p, g, m in zip(params, grads, exp_avgs):
        c = b1 * m + (1 - b1) * g
        p.mul_(1 - lr * weight_decay).add_(torch.sign(c), alpha=-lr)
        m.mul_(b2).add_(g, alpha=1 - b2)


# (8-bit class, torch reference or None for Lion, kwargs, bound). The bound is on
# max |p_8bit - p_fp32| / (steps * s), s = the largest per-step change of any weight in the
# fp32 run (the bound is a fraction of the longest possible path).
# Why these bounds: each step's state carries at most half a code gap of error, ~0.7% of the
# block absmax for large entries and more for entries far below it; the errors are mostly
# unbiased and partly cancel over steps. Lion only drifts where sign(c) flips (2 lr each).
# Observed (seeded): Adam 0.017, AdamW 0.014, SGD 0.012, RMSprop 0.0025 / 0.014 (momentum),
# Adagrad 0.0027, Lion 0.14: each bound is about twice the observation.
_TRAJ = [
    (qoptim.Adam8bit, torch.optim.Adam, dict(lr=1e-3, weight_decay=1e-2), 0.04),
    (qoptim.AdamW8bit, torch.optim.AdamW, dict(lr=1e-3, weight_decay=1e-1), 0.03),
    (qoptim.SGD8bit, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-2), 0.025),
    (qoptim.SGD8bit, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True), 0.025),
    (qoptim.RMSprop8bit, torch.optim.RMSprop, dict(lr=1e-3, weight_decay=1e-2), 0.006),
    (qoptim.RMSprop8bit, torch.optim.RMSprop, dict(lr=1e-3, momentum=0.9), 0.03),
    (qoptim.Adagrad8bit, torch.optim.Adagrad, dict(lr=1e-2, weight_decay=1e-2), 0.006),
    (qoptim.Lion8bit, None, dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1), 0.25),
]
# Partial blocks per row, whole blocks, a tensor below min_8bit_size, a 1-D tensor above it.
_SHAPES = [(64, 300), (128, 256), (40, 50), (5000,)]
_STEPS = 40


@pytest.mark.parametrize("case", range(len(_TRAJ)), ids=lambda i: _TRAJ[i][0].__name__ + str(i))
def test_trajectory_vs_fp32_reference(case):
    cls8, cls32, kw, bound = _TRAJ[case]
    gen = torch.Generator().manual_seed(case)
    ps = [nn.Parameter(torch.randn(s, generator=gen)) for s in _SHAPES]
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    o8 = cls8(ps, **kw)
    if cls32 is not None:
        o32 = cls32(qs, **kw)
    else:
        m32 = [torch.zeros_like(q) for q in qs]
    step_size = 0.0
    for _ in range(_STEPS):
        before = [q.detach().clone() for q in qs]
        for p, q in zip(ps, qs):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g, g.clone()
        o8.step()
        with torch.no_grad():
            if cls32 is not None:
                o32.step()
            else:
                _lion_fp32(qs, [q.grad for q in qs], m32, **kw)
        step_size = max(step_size, *((q - b).abs().max().item() for q, b in zip(qs, before)))
    scale = _STEPS * step_size
    for p, q, shape in zip(ps, qs, _SHAPES):
        drift = (p - q).abs().max().item()
        if len(shape) == 1 or p.numel() < 4096:
            # fp32 state: the same arithmetic as torch.optim, bit for bit.
            assert drift == 0.0, (shape, drift)
        else:
            assert drift <= bound * scale, (shape, drift / scale, bound)
            assert drift > 0.0  # the state really is quantized


# ------------------------------------------------------------------------------------------
# Pitfall 1: a positive second moment must not round to zero while the first moment survives.


def _heavy_tail_jump(bnb_compat: bool) -> float:
    lr = 1e-3
    p = nn.Parameter(torch.zeros(1, 256))
    opt = qoptim.Adam8bit([p], lr=lr, min_8bit_size=0, bnb_compat=bnb_compat)
    g = torch.ones(1, 256)
    g[0, 0] = 1e4  # one outlier per block: v_small / v_max = 1e-8, m_small / m_max = 1e-4
    p.grad = g
    opt.step()
    before = p.detach().clone()
    g = torch.zeros(1, 256)
    g[0, 0] = 1e4  # the small entries now get no gradient: their v is all that remains
    p.grad = g
    opt.step()
    return (p.detach() - before)[0, 1:].abs().max().item() / lr


def test_pitfall1_second_moment_floor():
    # Fixed: v is floored at the smallest non-zero code, so the step stays ~lr-sized.
    assert _heavy_tail_jump(bnb_compat=False) < 1.0
    # bitsandbytes rounding: v -> 0 under a surviving m, so the step is m / eps: millions of lr.
    assert _heavy_tail_jump(bnb_compat=True) > 1e6


def test_pitfall1_floor_at_encoder_level():
    q = _qstate.qmap(False)
    x = torch.tensor([[1.0, 1e-9, 0.0]])
    codes, _ = _qstate.quantize_rows(x, q, 256, _qstate.Rounding())
    assert codes.tolist() == [[255, q.zero_idx + 1, q.zero_idx]]
    codes, _ = _qstate.quantize_rows(
        x, q, 256, _qstate.Rounding.make(bnb_compat=True, stochastic=False)
    )
    assert codes.tolist() == [[255, q.zero_idx, q.zero_idx]]


# ------------------------------------------------------------------------------------------
# Pitfall 2: -0.0 gradients on never-updated elements must not create drift.


@pytest.mark.parametrize(
    "cls,kw",
    [
        (qoptim.AdamW8bit, dict(lr=1e-2, weight_decay=0.0)),
        (qoptim.SGD8bit, dict(lr=1e-2, momentum=0.9)),
        (qoptim.Lion8bit, dict(lr=1e-3)),
        (qoptim.RMSprop8bit, dict(lr=1e-3, momentum=0.9)),
    ],
)
def test_pitfall2_negative_zero_gradients_do_not_move_weights(cls, kw):
    p = nn.Parameter(torch.randn(4, 256))
    before = p.detach().clone()
    opt = cls([p], min_8bit_size=0, **kw)
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        g = torch.randn(4, 256, generator=gen)
        g[:, :16] = -0.0
        p.grad = g
        opt.step()
    assert torch.equal(p.detach()[:, :16], before[:, :16])  # bit for bit
    for name, signed in opt._state_specs(opt.param_groups[0]):
        if signed:
            codes = opt.state[p][f"{name}_codes"][:, :16]
            assert bool((codes == _qstate.qmap(True).zero_idx).all())
    assert not torch.equal(p.detach()[:, 16:], before[:, 16:])


def test_pitfall2_sign_nudge_only_in_compat():
    q = _qstate.qmap(True)
    x = torch.tensor([[1.0, -0.0, -1e-9, 1e-9]])
    codes, _ = _qstate.quantize_rows(x, q, 256, _qstate.Rounding())
    assert codes[0, 1:].tolist() == [q.zero_idx] * 3  # exact nearest, -0.0 is zero
    compat = _qstate.Rounding.make(bnb_compat=True, stochastic=False)
    codes, _ = _qstate.quantize_rows(x, q, 256, compat)
    # bitsandbytes: a code whose sign bit differs moves one step; -0.0 becomes negative.
    assert codes[0, 1:].tolist() == [q.zero_idx - 1, q.zero_idx - 1, q.zero_idx]
    kc, _ = _qstate.kernel_quantize_rows(x, q, 256, compat)
    assert torch.equal(kc, codes)


# ------------------------------------------------------------------------------------------
# Pitfall 3: decaying states must not freeze (stochastic rounding).


def _decayed_momentum(stochastic: bool) -> float:
    p = nn.Parameter(torch.zeros(1, 256))
    opt = qoptim.SGD8bit(
        [p], lr=0.0, momentum=0.99, min_8bit_size=0, stochastic_rounding=stochastic
    )
    p.grad = torch.ones(1, 256)
    opt.step()  # buffer = 1 everywhere
    for _ in range(200):
        g = torch.zeros(1, 256)
        g[0, 0] = 0.01  # keeps buffer[0] == 1, so the block absmax stays 1
        p.grad = g
        opt.step()
    st = opt.state[p]
    buf = _qstate.dequantize_rows(
        st["momentum_buffer_codes"], st["momentum_buffer_absmax"], _qstate.qmap(True), 256
    )
    return buf[0, 1:].mean().item()


def test_pitfall3_stochastic_rounding_lets_states_decay():
    exact = 0.99**200  # 0.134
    # Nearest rounding: a 1% decay is below half a code gap once the value is < ~0.7: frozen.
    assert _decayed_momentum(stochastic=False) > 0.5
    # Stochastic rounding is unbiased: the mean follows the exact decay.
    assert abs(_decayed_momentum(stochastic=True) - exact) < 0.03


# ------------------------------------------------------------------------------------------
# State handling.


def _trained(cls=qoptim.AdamW8bit, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 40))
    opt = cls(model.parameters(), min_8bit_size=1024, **kw)
    for _ in range(3):
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize(
    "cls,kw",
    [(qoptim.AdamW8bit, {}), (qoptim.Lion8bit, {}), (qoptim.RMSprop8bit, dict(momentum=0.5))],
)
def test_state_dict_round_trip_is_bit_exact(cls, kw):
    model, opt = _trained(cls, **kw)
    sd = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = cls(model2.parameters(), min_8bit_size=1024, **kw)
    opt2.load_state_dict(sd)
    for p, p2 in zip(model.parameters(), model2.parameters()):
        s, s2 = opt.state[p], opt2.state[p2]
        assert sorted(s) == sorted(s2)
        for k in s:
            assert s[k].dtype == s2[k].dtype and torch.equal(s[k], s2[k]), k
    x = torch.randn(8, 64)
    for m, o in ((model, opt), (model2, opt2)):
        m(x).square().mean().backward()
        o.step()
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)


def test_state_format_per_tensor_and_group_override():
    big, small, vec = (nn.Parameter(torch.randn(s)) for s in [(64, 128), (10, 10), (8192,)])
    forced = nn.Parameter(torch.randn(64, 128))
    opt = qoptim.AdamW8bit([{"params": [big, small, vec]}, {"params": [forced], "optim_bits": 32}])
    for p in (big, small, vec, forced):
        p.grad = torch.randn_like(p)
    opt.step()
    assert sorted(opt.state[big]) == [
        "exp_avg_absmax",
        "exp_avg_codes",
        "exp_avg_sq_absmax",
        "exp_avg_sq_codes",
        "step",
    ]
    assert opt.state[big]["exp_avg_codes"].dtype == torch.uint8
    assert opt.state[big]["exp_avg_absmax"].shape == (64, 1)
    for p in (small, vec, forced):
        assert sorted(opt.state[p]) == ["exp_avg", "exp_avg_sq", "step"]
        assert opt.state[p]["exp_avg"].dtype == torch.float32
    # The override is a param-group option, so it is in the state dict and survives a reload.
    assert opt.state_dict()["param_groups"][1]["optim_bits"] == 32


def test_stable_embedding():
    torch.manual_seed(0)
    emb = StableEmbedding(1000, 64)
    bound = (6 / (1000 + 64)) ** 0.5  # Xavier-uniform
    assert emb.weight.abs().max() <= bound and emb.weight.abs().max() > 0.9 * bound
    out = emb(torch.tensor([[1, 2, 3]]))
    torch.testing.assert_close(out.mean(-1), torch.zeros(1, 3), atol=1e-5, rtol=0)
    # bf16 weight: the LayerNorm still runs in fp32 and the output has the weight's dtype; its
    # affine parameters are bf16 too (one dtype per module, as FSDP2 wants of a unit: made in
    # fp32, shard() of such a model failed at the first forward)
    emb_bf16 = StableEmbedding(10, 8, dtype=torch.bfloat16)
    out = emb_bf16(torch.tensor([1]))
    assert out.dtype == torch.bfloat16
    assert emb_bf16.norm.weight.dtype == emb_bf16.norm.bias.dtype == torch.bfloat16
    lookup = emb_bf16.weight[1].float()
    expected = torch.nn.functional.layer_norm(lookup, (8,))  # fp32, then rounded once
    assert torch.equal(out[0], expected.to(torch.bfloat16))
    # 32-bit state automatically, also for a deep copy (no identity-keyed registry).
    for model in (nn.Sequential(emb, nn.Linear(64, 64)), copy.deepcopy(nn.Sequential(emb))):
        opt = qoptim.Adam8bit(model.parameters(), min_8bit_size=0)
        model(torch.tensor([[1, 2]])).sum().backward()
        opt.step()
        assert "exp_avg" in opt.state[model[0].weight]
        if len(model) > 1:
            assert "exp_avg_codes" in opt.state[model[1].weight]


def test_a_registration_survives_copies_of_the_module():
    """register_full_precision_state on an ordinary module: a deepcopy, a pickle round trip and
    torch.save / torch.load of the model gave the copy's weight 8-bit state without a word (the
    registry was keyed by the module object; only StableEmbedding re-registered its copies)."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    qoptim.register_full_precision_state(model[0], "weight")
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copies = [
        model,
        copy.deepcopy(model),
        pickle.loads(pickle.dumps(model)),
        torch.load(buf, weights_only=False),
    ]
    for i, m in enumerate(copies):
        opt = qoptim.AdamW8bit(m.parameters(), min_8bit_size=0)
        m(torch.randn(2, 64)).sum().backward()
        opt.step()
        assert "exp_avg" in opt.state[m[0].weight], i  # registered: fp32 state
        assert "exp_avg_codes" in opt.state[m[1].weight], i


@pytest.mark.parametrize(
    "cls",
    [
        qoptim.Adam8bit,
        qoptim.AdamW8bit,
        qoptim.SGD8bit,
        qoptim.Lion8bit,
        qoptim.Adagrad8bit,
        qoptim.RMSprop8bit,
        qoptim.AdamW4bit,
    ],
)
def test_a_parameter_listed_twice_in_a_group_is_refused(cls):
    """torch only warns about a duplicate and steps it twice per step. Here the kernel got two
    rows aliasing one tensor: one step counter for two updates, and with two threads the
    result changed from run to run. Refused now, in the constructor and in add_param_group,
    and a refused group is not left behind; a generator of parameters still works."""
    kw = {"momentum": 0.9} if cls is qoptim.SGD8bit else {}
    p = nn.Parameter(torch.randn(64, 64))
    with pytest.raises(
        ValueError, match=r"lists one parameter twice \(params\[0\] and params\[2\]"
    ):
        cls([p, nn.Parameter(torch.zeros(3)), p], **kw)
    opt = cls(iter([p]), **kw)
    q = nn.Parameter(torch.randn(8))
    with pytest.raises(ValueError, match="lists one parameter twice"):
        opt.add_param_group({"params": [q, q]})
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"] == [p]


@pytest.mark.parametrize(
    "cls",
    [
        qoptim.Adam8bit,
        qoptim.AdamW8bit,
        qoptim.SGD8bit,
        qoptim.Adagrad8bit,
        qoptim.RMSprop8bit,
        qoptim.AdamW4bit,
    ],
)
def test_maximize_false_is_taken_and_true_refused_naming_the_class(cls):
    """Code written for torch.optim that passed maximize=False was refused with a TypeError,
    and AdamW8bit's named its parent ("Adam8bit.__init__() got an unexpected keyword
    argument 'maximize'")."""
    p = [nn.Parameter(torch.randn(4, 4))]
    cls(p, maximize=False)
    with pytest.raises(ValueError, match=rf"^{cls.__name__} does not support maximize=True"):
        cls(p, maximize=True)


@pytest.mark.parametrize(
    ("cls", "parent"), [(qoptim.AdamW8bit, qoptim.Adam8bit), (qoptim.AdamW4bit, qoptim.Adam4bit)]
)
def test_adamw_takes_every_option_of_adam_by_name_and_refuses_a_misspelt_one(cls, parent):
    """AdamW8bit / AdamW4bit took ``**kwargs``: help() showed none of the options, and a
    misspelt one was refused naming the parent ("Adam8bit.__init__() got an unexpected keyword
    argument 'blocksize'")."""
    ours = inspect.signature(cls.__init__).parameters
    theirs = inspect.signature(parent.__init__).parameters
    assert list(ours) == list(theirs)
    for name, param in ours.items():
        assert param.kind == theirs[name].kind, name
        if name != "weight_decay":
            assert param.default == theirs[name].default, name
    assert ours["weight_decay"].default == 1e-2  # torch.optim.AdamW's
    with pytest.raises(TypeError, match=rf"^{cls.__name__}.__init__\(\) got an unexpected"):
        cls([nn.Parameter(torch.randn(4, 4))], blocksize=64)


def test_bf16_parameters_use_fp32_math_and_keep_state_dtypes():
    p = nn.Parameter(torch.randn(64, 128, dtype=torch.bfloat16))
    ref = nn.Parameter(p.detach().float())
    opt = qoptim.AdamW8bit([p], min_8bit_size=0)
    opt_ref = qoptim.AdamW8bit([ref], min_8bit_size=0)
    g = torch.randn(64, 128)
    p.grad, ref.grad = g.bfloat16(), g.bfloat16().float()
    opt.step()
    opt_ref.step()
    assert p.dtype == torch.bfloat16
    assert opt.state[p]["exp_avg_absmax"].dtype == torch.float32
    torch.testing.assert_close(p.detach().float(), ref.detach(), atol=1e-2, rtol=1e-2)


def test_state_bytes_per_param():
    p = nn.Parameter(torch.randn(1024, 1024))
    opt = qoptim.AdamW8bit([p])
    p.grad = torch.randn_like(p)
    opt.step()
    bpp = qoptim.state_bytes_per_param(opt)
    assert 2.0 < bpp <= 2.04  # 2 codes + 2 * 4 / 256 absmax + the step scalar
    assert qoptim.optimizer_state_bytes(opt) == 2 * 1024 * 1024 + 2 * 4 * 4096 + 4
    opt32 = qoptim.AdamW8bit([p], optim_bits=32)
    opt32.step()
    assert qoptim.state_bytes_per_param(opt32) == pytest.approx(8.0, abs=1e-5)


def test_options_are_validated():
    p = [nn.Parameter(torch.randn(4, 4))]
    with pytest.raises(ValueError, match="unknown param-group option"):
        qoptim.AdamW8bit([{"params": p, "optim_bit": 32}])
    with pytest.raises(ValueError, match="block_size"):
        qoptim.AdamW8bit(p, block_size=8192)
    with pytest.raises(ValueError, match="optim_bits"):
        qoptim.Lion8bit(p, optim_bits=16)
    with pytest.raises(ValueError, match="amsgrad"):
        qoptim.Adam8bit(p, amsgrad=True)
    with pytest.raises(ValueError, match="centered"):
        qoptim.RMSprop8bit(p, centered=True)
    with pytest.raises(ValueError, match="Nesterov"):
        qoptim.SGD8bit(p, nesterov=True)
    with pytest.raises(TypeError):
        qoptim.AdamW8bit(p, percentile_clipping=5)


@pytest.mark.parametrize(
    "kw, match",
    [
        # bools are ints: block_size=True made one-element blocks (an absmax per element),
        # and a config's "false" switched the rounding mode on
        (dict(block_size=True), "block_size must be an int"),
        (dict(min_8bit_size=False), "min_8bit_size must be an int"),
        (dict(stochastic_rounding="false"), "stochastic_rounding must be True or False"),
        (dict(bnb_compat=1), "bnb_compat must be True or False"),
    ],
)
def test_flags_and_sizes_of_the_wrong_type_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        qoptim.AdamW8bit([nn.Parameter(torch.randn(64, 128))], **kw)


@pytest.mark.parametrize("cls", [qoptim.AdamW8bit, qoptim.AdamW4bit], ids=lambda c: c.__name__)
def test_sizes_given_as_numpy_integers_are_taken_as_ints(cls):
    # np.int64(128) (a size computed with numpy) was refused as "must be an int".
    import numpy as np

    size, bits = ("min_8bit_size", 8) if cls is qoptim.AdamW8bit else ("min_4bit_size", 4)
    kw = {"block_size": np.int64(64), size: np.uint16(16), "optim_bits": np.int32(bits)}
    p = nn.Parameter(torch.randn(64, 64))
    ref = nn.Parameter(p.detach().clone())
    opt, opt_ref = cls([p], **kw), cls([ref], block_size=64, **{size: 16, "optim_bits": bits})
    assert all(type(opt.param_groups[0][k]) is int for k in kw)  # Python ints in the group
    for _ in range(2):
        g = torch.randn_like(p)
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        opt_ref.step()
    assert torch.equal(p, ref)


_NAN = float("nan")


@pytest.mark.parametrize(
    "cls, kw",
    [
        (qoptim.AdamW8bit, dict(eps=_NAN)),
        (qoptim.Adam8bit, dict(weight_decay=_NAN)),
        (qoptim.SGD8bit, dict(momentum=_NAN)),
        (qoptim.SGD8bit, dict(weight_decay=_NAN)),
        (qoptim.RMSprop8bit, dict(eps=_NAN)),
        (qoptim.RMSprop8bit, dict(momentum=_NAN)),
        (qoptim.Adagrad8bit, dict(lr_decay=_NAN)),
        (qoptim.Adagrad8bit, dict(initial_accumulator_value=_NAN)),
        (qoptim.Lion8bit, dict(weight_decay=_NAN)),
    ],
)
def test_nan_hyperparameters_are_refused(cls, kw):
    # Before: `x < 0` let NaN through, and the first step made every parameter NaN.
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"must be >= 0.*{name}=nan|{name} must be >= 0; got nan"):
        cls([nn.Parameter(torch.randn(4, 4))], **kw)


def test_adagrad_initial_accumulator_value_matches_torch():
    a = nn.Parameter(torch.randn(64, 128))
    b = nn.Parameter(a.detach().clone())
    o8 = qoptim.Adagrad8bit([a], lr=0.1, initial_accumulator_value=0.5, min_8bit_size=0)
    o32 = torch.optim.Adagrad([b], lr=0.1, initial_accumulator_value=0.5)
    g = torch.randn(64, 128) * 0.01
    a.grad, b.grad = g, g.clone()
    o8.step()
    o32.step()
    # The constant initial sum is exact in 8 bits (code 1.0 times the value).
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [qoptim.AdamW8bit, qoptim.AdamW4bit, qoptim.Adagrad8bit])
def test_sparse_gradient_is_refused_before_any_tensor_moves(cls):
    # An 8-bit tensor ahead of a sparse embedding in the same group: the step used to update it
    # (and count its step) before raising on the embedding, leaving a half-applied step.
    lin = nn.Linear(128, 64)
    emb = nn.Embedding(100, 8, sparse=True)
    opt = cls([lin.weight, emb.weight])
    (lin(torch.randn(2, 128)).sum() + emb(torch.tensor([1, 2])).sum()).backward()
    before = lin.weight.detach().clone()
    with pytest.raises(RuntimeError, match="sparse=False"):
        opt.step()
    assert torch.equal(lin.weight, before)
    assert not opt.state


@pytest.mark.parametrize("cls", [qoptim.AdamW8bit, qoptim.SGD8bit, qoptim.AdamW4bit])
def test_complex_parameters_are_refused(cls):
    # The fp32 copy of a complex parameter is its real part: a step zeroed the imaginary part
    # (torch only warned about the cast).
    p = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="view_as_real"):
        cls([p])
    opt = cls([nn.Parameter(torch.randn(3))])
    with pytest.raises(ValueError, match="complex"):
        opt.add_param_group({"params": [p]})
    assert len(opt.param_groups) == 1  # the refused group is not left behind
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3))], "lr": -1.0})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", [qoptim.AdamW8bit, qoptim.Lion8bit, qoptim.AdamW4bit])
def test_lr_must_be_a_number_and_not_nan(cls):
    p = [nn.Parameter(torch.randn(4, 4))]
    with pytest.raises(ValueError, match=r"float\(lr\)"):  # torch.optim takes a Tensor lr
        cls(p, lr=torch.tensor(1e-3))
    with pytest.raises(ValueError, match="lr must be a float >= 0"):  # NaN passed `lr < 0`
        cls(p, lr=float("nan"))
    cls(p, lr=1)  # an int is a number
    # Written into param_groups by hand: stepped without a word (a checkpoint then rounded it
    # to a float and the resumed run drifted); refused at step() before anything moves.
    opt = cls(p, lr=1e-3)
    p[0].grad = torch.randn(4, 4)
    before = p[0].detach().clone()
    opt.param_groups[0]["lr"] = torch.tensor(3e-3)
    with pytest.raises(ValueError, match=r"param group 0: lr must be a Python float.*float\(lr\)"):
        opt.step()
    assert torch.equal(p[0], before) and not opt.state[p[0]]
    opt.param_groups[0]["lr"] = 3e-3
    opt.step()
    assert not torch.equal(p[0], before)


def _stepped_once(cls, width: int) -> tuple[nn.Parameter, torch.optim.Optimizer]:
    """A (64, width) parameter with quantized state after one step of ``cls``."""
    size = dict(min_4bit_size=0) if cls is qoptim.AdamW4bit else dict(min_8bit_size=0)
    p = nn.Parameter(torch.randn(64, width))
    opt = cls([p], **size)
    p.grad = torch.randn_like(p)
    opt.step()
    return p, opt


@pytest.mark.parametrize("cls", [qoptim.AdamW8bit, qoptim.AdamW4bit])
def test_state_left_on_another_device_is_refused(cls):
    # Stepped on one device, the model then moved (model.cpu() after CUDA steps): the C kernel
    # took the CPU parameter and wrote through the state's device addresses (a segfault; here
    # the state is on "meta", whose data the host cannot reach either).
    p, opt = _stepped_once(cls, 256)
    state = opt.state[p]
    for k in [k for k in state if k.endswith(("_codes", "_absmax"))]:
        state[k] = state[k].to("meta")
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match="is on meta but the parameter is on cpu"):
        opt.step()
    assert torch.equal(p, before)


@pytest.mark.parametrize("cls", [qoptim.AdamW8bit, qoptim.AdamW4bit])
def test_state_that_does_not_fit_the_layout_is_refused(cls):
    # The fused kernels index the state by raw pointer: a group's block_size changed after the
    # state was made, or state loaded from a parameter of another shape, wrote out of bounds
    # (the process hung). Now a clear error, before anything moves.
    p, opt = _stepped_once(cls, 1024)
    opt.param_groups[0]["block_size"] = 16
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match="does not fit block_size=16"):
        opt.step()
    assert torch.equal(p, before)
    opt.param_groups[0]["block_size"] = opt.defaults["block_size"]
    opt.step()  # back to the layout's block size: fine
    wide = nn.Parameter(torch.randn(64, 2048))  # torch.optim checks group sizes, not shapes
    opt2 = cls([wide], **{k: v for k, v in opt.defaults.items() if k.startswith("min_")})
    opt2.load_state_dict(opt.state_dict())
    wide.grad = torch.randn_like(wide)
    with pytest.raises(RuntimeError, match="fresh state"):
        opt2.step()


@pytest.mark.parametrize("cls", [qoptim.AdamW8bit, qoptim.AdamW4bit])
@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_a_refused_step_moves_nothing_in_any_group(cls, path):
    # A layout refused in the second group: the first group's tensors used to be stepped (and
    # the reference path's counter advanced) before the error, a half-applied step.
    size = dict(min_4bit_size=0) if cls is qoptim.AdamW4bit else dict(min_8bit_size=0)
    dtype = torch.float32 if path == "kernel" else torch.bfloat16  # bf16: the torch reference
    a = nn.Parameter(torch.randn(32, 512, dtype=dtype))
    b = nn.Parameter(torch.randn(32, 512, dtype=dtype))
    opt = cls([{"params": [a]}, {"params": [b]}], **size)
    for p in (a, b):
        p.grad = torch.randn_like(p)
    opt.step()
    opt.param_groups[1]["block_size"] = 16
    saved = copy.deepcopy(opt.state_dict())
    before = [a.detach().clone(), b.detach().clone()]
    with pytest.raises(RuntimeError, match="does not fit block_size=16"):
        opt.step()
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])
    after = opt.state_dict()["state"]
    for i, st in saved["state"].items():
        for k, v in st.items():
            assert torch.equal(after[i][k], v), (i, k)


@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_switched_on_later_starts_from_the_gradient(bits, path, nesterov):
    # A hand-written momentum warm-up (momentum 0 for the first steps): torch.optim.SGD starts
    # the buffer as the gradient at its first use; SGD8bit raised KeyError. The switching step
    # is bit for bit a fresh SGD8bit's first step with that momentum, and the run follows
    # torch's (exactly with fp32 state, which takes torch's own kernel).
    shape = (64, 128) if path == "kernel" else (128, 64)
    g = torch.Generator().manual_seed(0)
    init = torch.randn(shape, generator=g)
    ours = nn.Parameter(init.clone() if path == "kernel" else init.clone().t().contiguous().t())
    ref = nn.Parameter(init.clone())
    kw = dict(lr=0.1, optim_bits=bits, min_8bit_size=0)
    opt = qoptim.SGD8bit([ours], momentum=0.0, **kw)
    ref_opt = torch.optim.SGD([ref], lr=0.1, momentum=0.0)
    for step in range(5):
        grad = torch.randn(shape, generator=g)
        if step == 2:
            for o in (opt, ref_opt):
                o.param_groups[0].update(momentum=0.9, nesterov=nesterov)
            fresh = nn.Parameter(ours.detach().clone())
            fresh.grad = grad.clone()
            qoptim.SGD8bit([fresh], momentum=0.9, nesterov=nesterov, **kw).step()
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
        if step == 2:
            assert torch.equal(ours.detach(), fresh.detach())
        if bits == 32:
            assert torch.equal(ours.detach(), ref.detach()), step
        else:
            torch.testing.assert_close(ours.detach(), ref.detach(), rtol=0, atol=1e-2)
    quantized = "momentum_buffer_codes" in opt.state[ours]
    assert quantized == (bits == 8)


@pytest.mark.parametrize("bits", [8, 32])
def test_rmsprop_momentum_switched_on_later_starts_from_zero(bits):
    # torch.optim.RMSprop makes its momentum buffer (zeros) only at the first step and raises
    # KeyError if momentum is switched on later; RMSprop8bit makes it then, at zero: what torch
    # computes if given that buffer.
    g = torch.Generator().manual_seed(1)
    init = torch.randn(64, 128, generator=g)
    ours, ref = nn.Parameter(init.clone()), nn.Parameter(init.clone())
    opt = qoptim.RMSprop8bit([ours], lr=1e-2, optim_bits=bits, min_8bit_size=0)
    ref_opt = torch.optim.RMSprop([ref], lr=1e-2)
    for step in range(5):
        if step == 2:
            opt.param_groups[0]["momentum"] = 0.9
            ref_opt.param_groups[0]["momentum"] = 0.9
            ref_opt.state[ref]["momentum_buffer"] = torch.zeros_like(ref)
        grad = torch.randn(64, 128, generator=g)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
        if bits == 32:
            assert torch.equal(ours.detach(), ref.detach()), step
        else:
            torch.testing.assert_close(ours.detach(), ref.detach(), rtol=0, atol=2e-2)
    names = {k for k in opt.state[ours] if k != "step"}
    assert len(names) == (4 if bits == 8 else 2), names


@pytest.mark.parametrize(
    "cls, alternative",
    [
        (qoptim.AdamW8bit, "SparseAdam"),
        (qoptim.SGD8bit, "torch.optim.SGD"),
        (qoptim.Adagrad8bit, "torch.optim.Adagrad"),
    ],
)
def test_the_sparse_gradient_error_names_an_optimizer_that_takes_them(cls, alternative):
    emb = nn.Embedding(10, 4, sparse=True)
    opt = cls(emb.parameters(), lr=0.1)
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match=alternative):
        opt.step()


# ------------------------------------------------------------------------------------------
# Loading state_dicts written by torch.optim or by another optimizer
# ([Note: loading foreign state_dicts] in qshard/optim/_state_dict.py).


@pytest.mark.parametrize(
    "cls, torch_cls, kw",
    [
        (qoptim.AdamW8bit, torch.optim.AdamW, dict(lr=1e-2)),
        (qoptim.Adam8bit, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
        (qoptim.SGD8bit, torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
        (qoptim.RMSprop8bit, torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5)),
        (qoptim.Adagrad8bit, torch.optim.Adagrad, dict(lr=1e-2)),
    ],
)
def test_a_torch_optim_state_dict_loads_and_continues_as_torch(cls, torch_cls, kw):
    # Before: the loaded groups lacked optim_bits & co (KeyError at the first parameter without
    # state) and torch.optim.SGD's states lacked 'step' (KeyError 'step').
    ps, qs, ours, sd = continue_from_torch(cls, torch_cls, kw, steps=3)
    assert ours.param_groups[0]["optim_bits"] == 8
    assert torch.equal(qs[0], ps[0])  # the loaded fp32 state steps as torch's
    if 1 not in sd["state"]:  # (torch.optim.Adagrad makes every state at construction)
        first_state = ours._state_specs(ours.param_groups[0])[0][0]
        assert f"{first_state}_codes" in ours.state[qs[1]]  # new state: 8-bit
    torch.testing.assert_close(qs[1], ps[1], rtol=0, atol=2e-2)


@pytest.mark.parametrize(
    "cls, torch_cls, kw, option",
    [
        (qoptim.Adam8bit, torch.optim.Adam, dict(amsgrad=True), "amsgrad"),
        (qoptim.AdamW8bit, torch.optim.AdamW, dict(maximize=True), "maximize"),
        (qoptim.AdamW8bit, torch.optim.Adam, {}, "decoupled_weight_decay"),
        (qoptim.RMSprop8bit, torch.optim.RMSprop, dict(centered=True), "centered"),
        (qoptim.SGD8bit, torch.optim.SGD, dict(momentum=0.9, maximize=True), "maximize"),
    ],
)
def test_a_state_dict_with_options_we_do_not_implement_is_refused(cls, torch_cls, kw, option):
    # Before: loaded and silently stepped without the option.
    assert_torch_option_refused(cls, torch_cls, kw, option)


def test_a_state_dict_of_another_qshard_optimizer_is_refused_at_load():
    # Before: AdamW8bit's groups loaded into SGD8bit failed at step with KeyError 'momentum'.
    p = nn.Parameter(torch.randn(64, 128))
    opt = qoptim.AdamW8bit([p])
    p.grad = torch.randn_like(p)
    opt.step()
    with pytest.raises(ValueError, match=r"\['betas', 'eps'\].*another optimizer"):
        qoptim.SGD8bit([p], momentum=0.9).load_state_dict(opt.state_dict())
    bad = copy.deepcopy(opt.state_dict())
    bad["param_groups"][0]["block_size"] = 0
    with pytest.raises(ValueError, match=r"param group 0: .*block_size"):
        qoptim.AdamW8bit([p]).load_state_dict(bad)
    bad = copy.deepcopy(opt.state_dict())
    del bad["state"][0]["step"]
    with pytest.raises(ValueError, match="no 'step'"):
        qoptim.AdamW8bit([p]).load_state_dict(bad)


def test_named_param_groups_are_taken_as_torch_takes_them():
    """torch.optim groups may carry ``param_names`` (named_parameters() builds them); an explicit
    one in add_param_group was refused as an unknown option."""
    p, q = nn.Parameter(torch.randn(64, 128)), nn.Parameter(torch.randn(64, 128))
    opt = qoptim.AdamW8bit([{"params": [p], "param_names": ["p"]}])
    opt.add_param_group({"params": [q], "param_names": ["q"]})
    assert [g["param_names"] for g in opt.state_dict()["param_groups"]] == [["p"], ["q"]]
