"""What a user coming from ``torch.optim`` / bitsandbytes does with the 8- and 4-bit optimizers
in one process, where it broke: NumPy learning rates (constructor and checkpoints of scheduled
runs) and ``load_state_dict`` hooks."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from qshard.optim import (
    Adagrad8bit,
    Adam4bit,
    Adam8bit,
    AdamW4bit,
    AdamW8bit,
    Lion8bit,
    RMSprop8bit,
    SGD8bit,
)

ALL = [Adam8bit, AdamW8bit, SGD8bit, Lion8bit, RMSprop8bit, Adagrad8bit, Adam4bit, AdamW4bit]


def _params(seed: int = 0) -> list[nn.Parameter]:
    """A quantized-state matrix (partial blocks) and an fp32-state bias."""
    gen = torch.Generator().manual_seed(seed)
    return [
        nn.Parameter(torch.randn(96, 130, generator=gen)),
        nn.Parameter(torch.randn(7, generator=gen)),
    ]


def _grads(params: list[nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
@pytest.mark.parametrize("lr", [np.float32(1e-3), np.int64(0)], ids=["np.float32", "np.int64"])
def test_numpy_lr_is_taken_as_torch_optim_takes_it(cls, lr):
    # torch.optim takes any real lr; np.float32 is not a Python float, and was refused
    ps = _params()
    opt = cls(ps, lr=lr)
    _grads(ps, 1)
    opt.step()
    assert all(torch.isfinite(p).all() for p in ps)


def test_numpy_lr_fp32_state_equals_torch_optim():
    ps, qs = _params(), _params()
    ref = torch.optim.AdamW(ps, lr=np.float32(3e-3))
    ours = AdamW8bit(qs, lr=np.float32(3e-3), optim_bits=32)
    for s in range(3):
        _grads(ps, s)
        _grads(qs, s)
        ref.step()
        ours.step()
    for p, q in zip(ps, qs):
        assert torch.equal(p.view(torch.int32), q.view(torch.int32))


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_checkpoint_of_a_run_scheduled_with_numpy_values_loads(cls):
    # The scheduler writes base_lr * np.float32 (an np.float32) into the group; the step took
    # it, but load_state_dict checks the saved groups and refused the checkpoint.
    ps = _params()
    opt = cls(ps)
    sched = LambdaLR(opt, lambda epoch: np.float32(0.5) ** epoch)
    _grads(ps, 0)
    opt.step()
    sched.step()
    assert isinstance(opt.param_groups[0]["lr"], np.floating)
    sd = copy.deepcopy(opt.state_dict())
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    resumed = cls(qs)
    resumed.load_state_dict(sd)
    assert resumed.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    _grads(ps, 1)
    _grads(qs, 1)
    opt.step()
    resumed.step()
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)


def _saved_after_one_step(cls) -> dict:
    """A ``cls`` optimizer's state_dict (a deep copy) after one step on :func:`_params`."""
    ps = _params()
    opt = cls(ps)
    _grads(ps, 0)
    opt.step()
    return copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize("cls", [AdamW8bit, AdamW4bit], ids=lambda c: c.__name__)
def test_load_state_dict_pre_hook_adapts_the_checkpoint_before_the_check(cls):
    # torch's documented way to migrate a checkpoint; our check used to run before the hooks
    sd = _saved_after_one_step(cls)
    sd["param_groups"][0]["legacy_option"] = 1  # what an older version might have saved

    def drop_legacy(optimizer, state_dict):
        state_dict = copy.deepcopy(state_dict)
        del state_dict["param_groups"][0]["legacy_option"]
        return state_dict

    fresh = cls(_params())
    fresh.register_load_state_dict_pre_hook(drop_legacy)
    fresh.load_state_dict(sd)
    assert "legacy_option" not in fresh.param_groups[0]

    plain = cls(_params())  # without the hook: still refused, naming the option
    with pytest.raises(ValueError, match="legacy_option"):
        plain.load_state_dict(sd)


@pytest.mark.parametrize("cls", [AdamW8bit, AdamW4bit], ids=lambda c: c.__name__)
def test_load_state_dict_pre_hook_changes_to_states_are_loaded(cls):
    # The dtype restore after torch's load used to copy the states of the state_dict as given,
    # so a pre-hook's change to a state tensor was silently dropped.
    sd = _saved_after_one_step(cls)

    def reset_second_moments(optimizer, state_dict):
        state_dict = copy.deepcopy(state_dict)
        state_dict["state"][0]["exp_avg_sq_absmax"].zero_()  # quantized
        state_dict["state"][1]["exp_avg_sq"].zero_()  # fp32
        return state_dict

    qs = _params()
    fresh = cls(qs)
    fresh.register_load_state_dict_pre_hook(reset_second_moments)
    fresh.load_state_dict(sd)
    assert fresh.state[qs[0]]["exp_avg_sq_absmax"].abs().max() == 0
    assert fresh.state[qs[1]]["exp_avg_sq"].abs().max() == 0
    assert fresh.state[qs[0]]["exp_avg_absmax"].abs().max() > 0  # the rest as saved


def test_load_state_dict_post_hook_sees_the_loaded_dtypes():
    # bf16 parameters: torch's load casts codes and fp32 states to bf16; post-hooks ran
    # inside it, before the dtypes were restored.
    gen = torch.Generator().manual_seed(0)
    ps = [nn.Parameter(torch.randn(96, 130, generator=gen).bfloat16())]
    opt = AdamW8bit(ps)
    ps[0].grad = torch.randn(96, 130, generator=gen).bfloat16()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    fresh = AdamW8bit([nn.Parameter(ps[0].detach().clone())])
    seen = {}

    def record(optimizer):
        st = next(iter(optimizer.state.values()))
        seen.update({k: v.dtype for k, v in st.items()})

    fresh.register_load_state_dict_post_hook(record)
    fresh.load_state_dict(sd)
    assert seen["exp_avg_codes"] == torch.uint8
    assert seen["exp_avg_absmax"] == torch.float32


# A hyperparameter read from a config as a string (YAML 1.1 reads 1e-8 as one), per optimizer
# and option: refused at construction naming the option (it was a TypeError of a comparison).
STRING_OPTIONS = [
    (Adam8bit, "eps"),
    (AdamW8bit, "weight_decay"),
    (AdamW8bit, "betas"),
    (SGD8bit, "momentum"),
    (SGD8bit, "weight_decay"),
    (Lion8bit, "betas"),
    (Lion8bit, "weight_decay"),
    (RMSprop8bit, "alpha"),
    (RMSprop8bit, "eps"),
    (Adagrad8bit, "lr_decay"),
    (Adagrad8bit, "initial_accumulator_value"),
    (Adam4bit, "eps"),
    (AdamW4bit, "betas"),
]


@pytest.mark.parametrize(("cls", "option"), STRING_OPTIONS, ids=lambda x: getattr(x, "__name__", x))
def test_a_hyperparameter_given_as_a_string_is_refused_naming_it(cls, option):
    value = ("0.9", "0.999") if option == "betas" else "1e-8"
    with pytest.raises(ValueError, match=f"{option} must be .*write 1.0e-8"):
        cls(_params(), **{option: value})


@pytest.mark.parametrize("dampening", ["0.1", None, float("nan")], ids=["str", "None", "nan"])
def test_sgd_dampening_is_checked_at_construction(dampening):
    # Never compared, it passed construction; the first step then failed after advancing the
    # step counters (str, None), or made every parameter NaN at the second step (NaN).
    with pytest.raises(ValueError, match="dampening must be a number"):
        SGD8bit(_params(), lr=0.1, momentum=0.9, dampening=dampening)


def test_numeric_hyperparameters_of_other_kinds_still_load():
    # NumPy scalars and one-element tensors (torch.optim takes tensor betas) stay accepted
    ps = _params()
    opt = AdamW8bit(ps, betas=(torch.tensor(0.9), np.float32(0.99)), eps=np.float64(1e-8))
    _grads(ps, 0)
    opt.step()
    SGD8bit(_params(), momentum=np.float32(0.9), dampening=np.int64(0))
    for betas in (np.array([0.9, 0.99]), torch.tensor([0.9, 0.99])):  # any pair, as before
        Lion8bit(_params(), betas=betas)
        Adam4bit(_params(), betas=betas)


def _remap_groups_by_names(optimizer, state_dict):
    """torch's recipe for a checkpoint whose groups are in another order (its
    ``load_state_dict`` docs): a pre-hook that reorders the saved groups by ``param_names``."""
    saved = state_dict["param_groups"]
    groups, states, new_id = [], {}, 0
    for current in optimizer.param_groups:
        group = dict(next(g for g in saved if g["param_names"] == current["param_names"]))
        ids = []
        for old in group["params"]:
            if old in state_dict["state"]:
                states[new_id] = state_dict["state"][old]
            ids.append(new_id)
            new_id += 1
        group["params"] = ids
        groups.append(group)
    return {"state": states, "param_groups": groups}


@pytest.mark.parametrize("cls", [AdamW8bit, AdamW4bit], ids=lambda c: c.__name__)
def test_a_pre_hook_remapping_groups_by_name_puts_states_on_their_parameters(cls):
    # The states restored after torch's load were those of the state_dict as given, so the
    # remapped checkpoint's states went onto the parameters of the old order.
    model = nn.ModuleDict({"a": nn.Linear(128, 96), "b": nn.Linear(80, 64)})

    def groups(m, order):
        named = list(m.named_parameters())
        return [
            {
                "params": [p for n, p in named if n.startswith(k)],
                "param_names": [n for n, _ in named if n.startswith(k)],
                "lr": lr,
            }
            for k, lr in order
        ]

    opt = cls(groups(model, [("a", 1e-3), ("b", 1e-4)]))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    copy_ = copy.deepcopy(model)
    resumed = cls(groups(copy_, [("b", 1e-4), ("a", 1e-3)]))
    resumed.register_load_state_dict_pre_hook(_remap_groups_by_names)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert [g["lr"] for g in resumed.param_groups] == [1e-4, 1e-3]
    for p, q in zip(model.parameters(), copy_.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v, resumed.state[q][k]), k


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize("option", ["maximize", "amsgrad", "centered"])
def test_a_torch_option_set_by_hand_in_param_groups_is_refused_at_step(cls, option):
    """``maximize=True`` (or ``amsgrad``, ``centered``) written into ``param_groups`` after
    construction, as one switches torch.optim's options, was stepped as if it were not there
    (the parameter still went downhill); the constructor, add_param_group and load_state_dict
    refuse it. The step now refuses it before any tensor moves, and steps again once it is set
    back."""
    params = _params()
    opt = cls(params, lr=1e-2)
    _grads(params, 1)
    opt.step()
    before = [p.detach().clone() for p in params]
    opt.param_groups[0][option] = True
    with pytest.raises(ValueError, match=rf"param group 0 has {option}=True, set by hand"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # nothing moved
    opt.param_groups[0][option] = False  # torch's neutral value: steps as before
    opt.step()
    assert not all(torch.equal(p, b) for p, b in zip(params, before))


def test_a_state_missing_what_the_optimizer_keeps_is_refused_at_load():
    """A Lion8bit state_dict (momentum only, options a subset of AdamW8bit's) loaded into
    AdamW8bit took Lion's momentum as Adam's and a zero second moment at the saved step count,
    without a word; a state with half of a quantized state (codes without absmax) loaded and
    failed at the next step with a bare KeyError, or (absmax without codes) restarted the
    momentum from zero. Both are refused at load; a momentum switched on later (SGD8bit's
    buffer is made at its next step) still loads."""
    params = _params()
    lion = Lion8bit(params, lr=1e-3)
    _grads(params, 1)
    lion.step()
    adam = AdamW8bit(_params(), lr=1e-3)
    with pytest.raises(ValueError, match=r"has no 'exp_avg_sq'.*another optimizer"):
        adam.load_state_dict(lion.state_dict())
    src = AdamW8bit(params, lr=1e-3)
    src.step()
    for half in ("exp_avg_codes", "exp_avg_absmax"):
        sd = copy.deepcopy(src.state_dict())
        del sd["state"][0][half]
        with pytest.raises(ValueError, match=r"without its other half"):
            AdamW8bit(_params(), lr=1e-3).load_state_dict(sd)
    sgd = SGD8bit(params, lr=1e-2)  # no momentum: no buffer
    sgd.step()
    sd = sgd.state_dict()
    sd["param_groups"][0]["momentum"] = 0.9  # switched on before saving, not stepped since
    target = SGD8bit(_params(), lr=1e-2, momentum=0.9)
    target.load_state_dict(sd)
    _grads(target.param_groups[0]["params"], 2)
    target.step()  # the buffer is made now
    assert "momentum_buffer_codes" in target.state[target.param_groups[0]["params"][0]]
