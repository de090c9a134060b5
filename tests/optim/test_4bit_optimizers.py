"""4-bit Adam/AdamW against torch.optim trajectories, the zero-point problem of the naive
second-moment map (and that the chosen map does not have it), the layout, state bytes,
state_dict round trips and option validation."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qshard import optim as qoptim
from qshard.optim import _qstate4
from qshard.optim.adam4bit import Adam4bit, AdamW4bit

from ._helpers import assert_torch_option_refused, continue_from_torch

# ------------------------------------------------------------------------------------------
# Trajectories vs torch.optim.

# (4-bit class, torch reference, kwargs, bound). As for the 8-bit optimizers, the bound is on
# max |p_4bit - p_fp32| / (steps * s), s = the largest per-step change of any weight in the
# fp32 run (a fraction of the longest possible path). Why larger than 8 bits' 0.03-0.04: a
# 4-bit code gap is 16x wider (the signed map's top gap is 0.22 of the block absmax, the
# linear map's 1/16), so each step's m carries up to ~11% and v up to ~3% of the block absmax
# as error; and entries far below their block's v absmax decode to at least absmax/16 (the
# zero-free floor), so their steps are systematically damped: on these pure-noise gradients a
# weight's 4-bit path can fall a fifth of the longest path behind. Observed (40 steps, seeds
# case and 100 + case, max over the two 4-bit shapes): Adam 0.248 / 0.224, AdamW 0.167 / 0.178,
# AdamW betas (0.9, 0.95) 0.166 / 0.198; each bound is about twice the larger observation.
_TRAJ = [
    (Adam4bit, torch.optim.Adam, dict(lr=1e-3, weight_decay=1e-2), 0.5),
    (AdamW4bit, torch.optim.AdamW, dict(lr=1e-3, weight_decay=1e-1), 0.36),
    (AdamW4bit, torch.optim.AdamW, dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1), 0.4),
]
# Partial blocks per row (300 = 2 x 128 + 44), whole blocks, below min_4bit_size, 1-D.
_SHAPES = [(64, 300), (128, 256), (40, 50), (5000,)]
_STEPS = 40


def _trajectory_drift(cls4, cls32, kw, seed, **extra):
    gen = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn(s, generator=gen)) for s in _SHAPES]
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    o4, o32 = cls4(ps, **kw, **extra), cls32(qs, **kw)
    step_size = 0.0
    for _ in range(_STEPS):
        before = [q.detach().clone() for q in qs]
        for p, q in zip(ps, qs):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g, g.clone()
        o4.step()
        o32.step()
        step_size = max(step_size, *((q - b).abs().max().item() for q, b in zip(qs, before)))
    scale = _STEPS * step_size
    return [(p - q).abs().max().item() / scale for p, q in zip(ps, qs)], o4, ps


@pytest.mark.parametrize("case", range(len(_TRAJ)))
def test_trajectory_vs_fp32_reference(case):
    cls4, cls32, kw, bound = _TRAJ[case]
    drifts, opt, ps = _trajectory_drift(cls4, cls32, kw, case)
    for p, shape, drift in zip(ps, _SHAPES, drifts):
        four = "exp_avg_codes" in opt.state[p]
        assert four == (len(shape) == 2 and p.numel() >= 4096), shape
        if not four:
            # fp32 state: the same arithmetic as torch.optim, bit for bit.
            assert drift == 0.0, (shape, drift)
        else:
            assert 0.0 < drift <= bound, (shape, drift, bound)


# ------------------------------------------------------------------------------------------
# The zero-point problem: why v has no zero code.


def _outlier_jump(second_moment_map: str) -> float:
    """Largest step (in units of lr) of the small entries of a block with one 30x outlier, on
    the step after their gradient stops: their v is ~1/900 of the block absmax."""
    lr = 1e-3
    p = nn.Parameter(torch.zeros(1, 128))
    opt = Adam4bit([p], lr=lr, min_4bit_size=0, second_moment_map=second_moment_map)
    g = torch.ones(1, 128)
    g[0, 0] = 30.0
    for _ in range(3):
        p.grad = g.clone()
        opt.step()
    before = p.detach().clone()
    p.grad = torch.zeros(1, 128)
    p.grad[0, 0] = 30.0
    opt.step()
    return (p.detach() - before)[0, 1:].abs().max().item() / lr


def test_naive_second_moment_map_explodes_where_the_zero_free_one_does_not():
    # linspace(0, 1, 16) rounds v = absmax/900 to 0 while m survives: step = m / eps.
    # Measured: 6.9e7 lr (naive), 0.11 lr ("linear"), 0.84 lr ("dynamic").
    assert _outlier_jump("linear-zero") > 1e4
    # zero-free maps decode v to at least absmax/16 (linear) or 1e-3 absmax (dynamic): damped.
    assert _outlier_jump("linear") < 1.0
    assert _outlier_jump("dynamic") < 1.0


def _regression_loss(second_moment_map: str) -> float:
    """Least squares with features spanning two decades (so v spans four within every block
    row): final loss relative to the first."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=gen) * torch.logspace(-2, 0, 64)
    y = x @ torch.randn(64, 32, generator=gen)
    w = nn.Parameter(torch.zeros(32, 64))
    opt = Adam4bit(
        [w], lr=3e-2, betas=(0.9, 0.95), min_4bit_size=0, second_moment_map=second_moment_map
    )
    first = None
    for _ in range(300):
        loss = (x @ w.t() - y).square().mean()
        first = first if first is not None else loss.item()
        w.grad = None
        loss.backward()
        opt.step()
    last = (x @ w.t() - y).square().mean().item()
    return last / first if last == last else float("inf")


def test_naive_second_moment_map_diverges_where_the_chosen_one_trains():
    # Measured (seed 0): fp32 Adam 2e-6, "linear" 5e-4, "dynamic" 5e-5, "linear-zero" 1350:
    # the naive map's zero point sends the small-feature weights off by m / eps steps.
    assert _regression_loss("linear") < 0.01
    assert _regression_loss("dynamic") < 0.01
    assert _regression_loss("linear-zero") > 10.0


# ------------------------------------------------------------------------------------------
# Layout, bytes, round trips, options.


def test_state_layout_and_bytes_per_param():
    p = nn.Parameter(torch.randn(1024, 1024))
    opt = AdamW4bit([p])
    p.grad = torch.randn_like(p)
    opt.step()
    st = opt.state[p]
    assert st["exp_avg_codes"].shape == (1024, 512) and st["exp_avg_codes"].dtype == torch.uint8
    assert st["exp_avg_sq_absmax"].shape == (1024, 8)
    # Two codes a byte for each of the two moments + one fp32 absmax per 128 per moment + step.
    assert qoptim.optimizer_state_bytes(opt) == 2 * 1024 * 512 + 2 * 4 * 1024 * 8 + 4
    assert qoptim.state_bytes_per_param(opt) <= 1.1
    assert qoptim.state_bytes_per_param(opt) == pytest.approx(1.0625, abs=1e-5)
    opt32 = AdamW4bit([nn.Parameter(torch.randn(64, 64))], optim_bits=32)
    for p32 in opt32.param_groups[0]["params"]:
        p32.grad = torch.ones_like(p32)
    opt32.step()
    assert qoptim.state_bytes_per_param(opt32) == pytest.approx(8.0, abs=1e-3)


def test_state_bytes_per_param_of_the_app_gpt():
    """The app's default GPT (4 layers, width 256): every tensor counted, fp32 ones included."""
    from qshard.train.model import GPT, GPTConfig

    model = GPT(GPTConfig())
    opt = AdamW4bit(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert qoptim.state_bytes_per_param(opt) <= 1.1


def test_odd_rows_pack_and_unpack():
    q = _qstate4.qmap4("signed-dynamic")
    x = torch.randn(3, 301)
    codes, absmax = _qstate4.quantize_rows4(x, q, 128)
    assert codes.shape == (3, 151) and absmax.shape == (3, 3)
    assert int((codes[:, -1] >> 4).max()) == 0  # the unused last high nibble stays 0
    idx = _qstate4.unpack(codes, 301)
    assert torch.equal(_qstate4.pack(idx), codes)
    y = _qstate4.dequantize_rows4(codes, absmax, q, 128, x.shape)
    # within half the widest code gap (0.225 of the block absmax; -absmax itself is 0.1125 from
    # the lowest code, -0.8875: the signed dynamic map has no -1) of the value
    scale = absmax.repeat_interleave(128, dim=1)[:, :301]
    assert bool(((y - x).abs() <= 0.1125 * scale * (1 + 1e-6)).all())


@pytest.mark.parametrize("shape", [(0, 5), (0,), (3, 0), (0, 0)])
def test_empty_tensors_quantize_to_empty_state(shape):
    # quantize_rows4 refused zero rows (pack's view(rows, -1, 2) is ambiguous with 0 elements)
    q = _qstate4.qmap4("signed-dynamic")
    x = torch.zeros(shape)
    codes, absmax = _qstate4.quantize_rows4(x, q, 64)
    rows, row_numel = _qstate4.row_view(x.shape)
    assert codes.shape == (rows, (row_numel + 1) // 2)
    assert absmax.shape == (rows, _qstate4.blocks_per_row(row_numel, 64))
    assert _qstate4.unpack(codes, row_numel).shape == (rows, row_numel)
    assert _qstate4.dequantize_rows4(codes, absmax, q, 64, x.shape).shape == x.shape


def test_maps():
    m = _qstate4.qmap4("signed-dynamic")
    assert m.code.numel() == 16 and m.zero_idx == 7 and float(m.code[-1]) == 1.0
    v = _qstate4.qmap4("linear")
    assert torch.equal(v.code, torch.arange(1, 17) / 16.0) and v.zero_idx == -1
    assert float(_qstate4.qmap4("dynamic").code.min()) > 0
    assert _qstate4.qmap4("linear-zero").zero_idx == 0


@pytest.mark.parametrize("cls", [Adam4bit, AdamW4bit])
def test_state_dict_round_trip_is_bit_exact(cls):
    gen = torch.Generator().manual_seed(3)
    p1 = nn.Parameter(torch.randn(48, 300, generator=gen))
    b1 = nn.Parameter(torch.randn(48, generator=gen))
    o1 = cls([p1, b1], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        p1.grad, b1.grad = torch.randn(p1.shape, generator=gen), torch.randn(48, generator=gen)
        o1.step()
    p2, b2 = nn.Parameter(p1.detach().clone()), nn.Parameter(b1.detach().clone())
    o2 = cls([p2, b2], lr=1e-2, weight_decay=0.1)
    o2.load_state_dict(copy.deepcopy(o1.state_dict()))
    for k, v in o1.state[p1].items():
        assert v.dtype == o2.state[p2][k].dtype and torch.equal(v, o2.state[p2][k]), k
    for _ in range(2):
        g, gb = torch.randn(p1.shape, generator=gen), torch.randn(48, generator=gen)
        p1.grad, p2.grad, b1.grad, b2.grad = g, g.clone(), gb, gb.clone()
        o1.step()
        o2.step()
    assert torch.equal(p1, p2) and torch.equal(b1, b2)
    for k in o1.state[p1]:
        assert torch.equal(o1.state[p1][k], o2.state[p2][k]), k


def test_bf16_parameters_and_group_override():
    p = nn.Parameter(torch.randn(64, 128, dtype=torch.bfloat16))
    q = nn.Parameter(torch.randn(64, 128))
    opt = AdamW4bit([{"params": [p]}, {"params": [q], "optim_bits": 32}], lr=1e-2)
    p.grad, q.grad = torch.randn_like(p), torch.randn_like(q)
    before = p.detach().clone()
    opt.step()
    assert p.dtype == torch.bfloat16 and not torch.equal(p, before)
    assert opt.state[p]["exp_avg_absmax"].dtype == torch.float32
    assert sorted(opt.state[q]) == ["exp_avg", "exp_avg_sq", "step"]


def test_full_precision_registry_applies():
    from qshard.nn import StableEmbedding

    emb = StableEmbedding(100, 64)
    opt = AdamW4bit(emb.parameters(), min_4bit_size=0)
    for p in emb.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert "exp_avg" in opt.state[emb.weight]


def test_options_are_validated():
    p = [nn.Parameter(torch.randn(4, 4))]
    with pytest.raises(ValueError, match="optim_bits must be 4 or 32"):
        AdamW4bit(p, optim_bits=8)
    with pytest.raises(ValueError, match="even int"):
        AdamW4bit(p, block_size=127)
    with pytest.raises(ValueError, match="second_moment_map"):
        AdamW4bit(p, second_moment_map="log")
    with pytest.raises(ValueError, match="unknown param-group option"):
        AdamW4bit([{"params": p, "min_8bit_size": 4}])
    with pytest.raises(ValueError, match="amsgrad"):
        AdamW4bit(p, amsgrad=True)
    with pytest.raises(ValueError, match="betas"):
        AdamW4bit(p, betas=(0.9, 1.0))
    for kw in (dict(eps=float("nan")), dict(weight_decay=float("nan"))):  # NaN passed `x < 0`
        with pytest.raises(ValueError, match=r"eps and weight_decay must be >= 0.*nan"):
            AdamW4bit(p, **kw)


def test_exported():
    assert qoptim.AdamW4bit is AdamW4bit and qoptim.Adam4bit is Adam4bit


def test_train_estimate_matches_the_state_it_creates():
    """`qshard train --optim adamw4bit`'s memory estimate is the state AdamW4bit really keeps
    (the app's default GPT, one rank; only the 4-byte step counters are not estimated)."""
    from qshard.train._parallel import build_optimizer
    from qshard.train._summary import _state_sizes
    from qshard.train.config import TrainConfig
    from qshard.train.estimate import estimate_memory
    from qshard.train.model import GPT, GPTConfig

    config = TrainConfig(optim="adamw4bit", zeropp="off")
    model = GPT(GPTConfig())
    opt = build_optimizer(model, config)
    assert isinstance(opt, AdamW4bit)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    est = estimate_memory(
        num_params=n,
        largest_unit_params=n,
        world_size=1,
        ranks_per_node=1,
        features=frozenset(),
        optim="adamw4bit",
        fp32_state_params=_state_sizes(model, config)["fp32_state_params"],
    )["optimizer state (adamw4bit)"]
    measured = qoptim.optimizer_state_bytes(opt)
    assert abs(measured - est) <= 4 * len(opt.state), (measured, est)


def test_foreign_state_dicts_load_where_they_mean_the_same_and_are_refused_otherwise():
    # [Note: loading foreign state_dicts]: before, torch.optim.AdamW's groups loaded without
    # optim_bits & co (KeyError at the first parameter without state), amsgrad=True was
    # silently dropped, and an 8-bit optimizer's state failed only at the step.
    ps, qs, ours, _ = continue_from_torch(AdamW4bit, torch.optim.AdamW, dict(lr=1e-2), steps=2)
    assert torch.equal(qs[0], ps[0])  # its fp32 state, stepped as torch's
    assert "exp_avg_codes" in ours.state[qs[1]]
    assert_torch_option_refused(Adam4bit, torch.optim.Adam, dict(amsgrad=True), "amsgrad")
    p = nn.Parameter(torch.randn(64, 128))
    p.grad = torch.randn_like(p)
    eight = qoptim.AdamW8bit([p])
    eight.step()
    with pytest.raises(ValueError, match=r"min_8bit_size.*another optimizer"):
        AdamW4bit([p]).load_state_dict(eight.state_dict())


@pytest.mark.parametrize("kernel", [True, False])
def test_a_changed_second_moment_map_is_refused_while_state_written_with_the_old_one_lives(
    kernel, monkeypatch
):
    """[Note: the map the codes were written with]: switching a group's second_moment_map after
    the state was made read the codes with the other map, silently (a wrong second moment).
    Now refused naming both maps, on the kernel's path and the torch reference's; a load
    restores the saved map with the state, and a fresh optimizer takes any map."""
    from qshard.optim import _kernels4

    if not kernel:
        monkeypatch.setattr(_kernels4, "library", lambda: None)  # the torch reference path
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(64, 128))
    opt = AdamW4bit([p])
    p.grad = torch.randn_like(p)
    opt.step()
    opt.param_groups[0]["second_moment_map"] = "dynamic"
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"second_moment_map is 'dynamic' but .* 'linear'"):
        opt.step()
    assert torch.equal(p.detach(), before)  # refused before anything moved
    opt.param_groups[0]["second_moment_map"] = "linear"
    opt.step()

    saved = copy.deepcopy(opt.state_dict())
    other = AdamW4bit([p], second_moment_map="dynamic")
    other.load_state_dict(saved)  # the saved group's map comes with its state
    assert other.param_groups[0]["second_moment_map"] == "linear"
    other.step()
    other.param_groups[0]["second_moment_map"] = "dynamic"
    with pytest.raises(ValueError, match="start from fresh state"):
        other.step()

    fresh = AdamW4bit([p], second_moment_map="dynamic")
    fresh.step()
    fresh.step()

    # An in-place load, as DCP's get_state_dict -> dcp.load -> set_state_dict does it: the
    # codes tensors this optimizer made (stamped 'dynamic') receive the saved bytes and the
    # groups the saved 'linear'. It was refused naming 'dynamic' as the codes' map, and
    # following that advice read 'linear' codes with the dynamic map.
    in_place = fresh.state_dict()
    for i, st in saved["state"].items():
        for k, v in st.items():
            in_place["state"][i][k].copy_(v)
    in_place["param_groups"] = copy.deepcopy(saved["param_groups"])
    fresh.load_state_dict(in_place)
    assert fresh.param_groups[0]["second_moment_map"] == "linear"
    fresh.step()
    fresh.param_groups[0]["second_moment_map"] = "dynamic"
    with pytest.raises(ValueError, match="written with 'linear'"):
        fresh.step()
