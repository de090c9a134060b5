"""The multi-tensor step of the 8-bit and 4-bit optimizers ([Note: multi-tensor step] in
qshard.optim._kernels): every CPU-kernel tensor of a parameter group in one ``step8_multi`` /
``adam4bit_multi`` call must write the bits of one call per tensor, for every optimizer,
rounding option and 4-bit map, at 1 and 2 threads, next to tensors the call does not take
(fp32-state, bf16, gradient-less ones) and one whose gradient it copies first."""

from __future__ import annotations

import pytest
import torch

import qshard.optim as qoptim
from qshard.optim import _kernels, _kernels4
from qshard.optim._base8bit import _QuantizedPlan

from ._helpers import assert_same_bits, replay_plan_changes

pytestmark = pytest.mark.skipif(
    not (_kernels.available() and _kernels4.available()), reason="needs the C kernels"
)

_CASES = [
    (qoptim.AdamW8bit, dict(lr=1e-2, weight_decay=0.1)),
    (qoptim.Adam8bit, dict(lr=1e-2, weight_decay=0.1)),
    (qoptim.Lion8bit, dict(lr=1e-3, weight_decay=0.1)),
    (qoptim.SGD8bit, dict(lr=1e-2, momentum=0.9, weight_decay=1e-2, nesterov=True)),
    (qoptim.RMSprop8bit, dict(lr=1e-3, momentum=0.9)),
    (qoptim.Adagrad8bit, dict(lr=1e-2, lr_decay=0.01, weight_decay=1e-2)),
]

# Quantized: partial blocks, one row, narrow rows (one partial block per row), 3-D, a tensor of
# exactly one block; then a 1-D bias and a small matrix (fp32 state) and a bf16 matrix (the
# per-tensor path: the multi-tensor call takes fp32 only).
_SHAPES = [(13, 333), (1, 5000), (300, 16), (7, 3, 200), (16, 256), (64, 65)]
_OTHERS = [((100,), torch.float32), ((8, 8), torch.float32), ((40, 130), torch.bfloat16)]


_CASES_4BIT = [
    (qoptim.AdamW4bit, dict(lr=1e-2, weight_decay=0.1)),
    (qoptim.Adam4bit, dict(lr=1e-2, weight_decay=0.1, second_moment_map="dynamic")),
    (qoptim.AdamW4bit, dict(lr=1e-2, second_moment_map="linear-zero", block_size=64)),
]


class _Counting:
    """A kernel library with its multi-tensor calls counted (tensors per call)."""

    def __init__(self, lib, entry: str, count_arg: int) -> None:
        self._lib, self.calls, self._entry, self._at = lib, [], entry, count_arg

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if name != self._entry:
            return fn

        def counted(*args):
            self.calls.append(args[self._at])
            return fn(*args)

        return counted


def _params(gen):
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in _SHAPES]
    ps += [torch.nn.Parameter(torch.randn(s, generator=gen).to(dt)) for s, dt in _OTHERS]
    return ps


def _one_call_per_tensor(opt):
    """``opt`` stepping each kernel tensor in a call of its own."""
    step_quantized = type(opt)._step_quantized

    def each(gi, group, plan):
        step_quantized(opt, gi, group, _QuantizedPlan(rest=plan.rest))
        for item, row in zip(plan.batch, plan.rows, strict=True):  # (plan.grads: held copies)
            step_quantized(opt, gi, group, _QuantizedPlan([item], [row]))

    opt._step_quantized = each
    return opt


def _pair(cls, kw, threads_note):
    gen = torch.Generator().manual_seed(0)
    p1 = _params(gen)
    p2 = [torch.nn.Parameter(p.detach().clone()) for p in p1]
    # two groups: the second has its own options and no tensor the call takes (fp32 state, bf16)
    o1 = cls([{"params": p1[:-2]}, {"params": p1[-2:], "lr": kw["lr"] / 2}], **kw)
    o2 = cls([{"params": p2[:-2]}, {"params": p2[-2:], "lr": kw["lr"] / 2}], **kw)
    return p1, o1, p2, _one_call_per_tensor(o2), gen


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "extra",
    [{}, {"bnb_compat": True}, {"stochastic_rounding": True}, {"block_size": 64}],
    ids=["default", "bnb_compat", "stochastic", "block64"],
)
def test_multi_tensor_step_writes_the_bits_of_one_call_per_tensor(monkeypatch, extra, threads):
    counting = _Counting(_kernels.library(), "step8_multi", 2)
    counting4 = _Counting(_kernels4.library(), "adam4bit_multi", 1)
    monkeypatch.setattr(_kernels, "library", lambda: counting)
    monkeypatch.setattr(_kernels4, "library", lambda: counting4)
    # the 4-bit optimizers have no rounding options: they run with the first variant only
    cases = _CASES + (_CASES_4BIT if not extra else [])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for cls, kw in cases:
            kw = {**kw, **extra}
            four = cls in (qoptim.Adam4bit, qoptim.AdamW4bit)
            calls = counting4.calls if four else counting.calls
            p1, o1, p2, o2, gen = _pair(cls, kw, threads)
            calls.clear()
            for step in range(4):
                for i, (a, b) in enumerate(zip(p1, p2)):
                    # the (1, 5000) tensor skips step 0: its step count lags the others', so
                    # the call carries two rows of hyperparameters (and SGD two first steps)
                    g = None if (i == 1 and step == 0) else torch.randn(a.shape, generator=gen)
                    if i == 5 and g is not None:  # (64, 65): a transposed, non-contiguous grad
                        g = torch.randn(a.shape[::-1], generator=gen).t()
                    a.grad = None if g is None else g.to(a.dtype)
                    b.grad = None if g is None else g.to(b.dtype)
                o1.step()
                seen = len(calls)
                o2.step()
                del calls[seen:]  # o2's calls (one a tensor) are not counted
            for a, b in zip(p1, p2):
                assert_same_bits((a, o1), (b, o2), (cls.__name__, extra, tuple(a.shape)))
            quantized = [p for p in p1 if any(k.endswith("_codes") for k in o1.state[p])]
            assert len(quantized) == len(_SHAPES) + 1, "the fixture's tensors must be 8-bit"
            # group 0: the six fp32 matrices in one call a step (five on the step the one-row
            # tensor sits out); group 1's single bf16 matrix never takes the call
            assert calls == [5, 6, 6, 6], (cls.__name__, calls)
    finally:
        torch.set_num_threads(before)


def test_multi_tensor_step_refuses_a_bad_layout_before_anything_moves():
    gen = torch.Generator().manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(20, 300), (30, 300)]]
    opt = qoptim.AdamW8bit(ps, lr=1e-2)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    st = opt.state[ps[1]]
    st["exp_avg_absmax"] = torch.zeros(30, 1)  # the layout of another block size
    params = [p.detach().clone() for p in ps]
    state0 = {k: v.clone() for k, v in opt.state[ps[0]].items()}
    with pytest.raises(RuntimeError, match="does not fit block_size=256"):
        opt.step()
    for p, q in zip(ps, params):
        assert torch.equal(p.detach(), q)
    for k, v in opt.state[ps[0]].items():
        assert torch.equal(v, state0[k]), k  # its codes, absmax and step counter too


def test_triton_launches_split_by_dtype_and_device():
    # One Triton launch reads its tensors through one device's pointers: a group spanning
    # devices (a model split over GPUs) must give one launch per device, not an error from the
    # kernel's device check. A meta tensor stands in for a second device.
    from qshard.optim._multi_tensor import _triton_launches

    def item(i, device, dtype=torch.float32):
        p = torch.nn.Parameter(torch.zeros(4, 8, device=device, dtype=dtype))
        p.grad = torch.zeros_like(p)
        return (i, p, {"c": torch.zeros(4, 8, dtype=torch.uint8, device=device)})

    items = [item(0, "cpu"), item(1, "meta"), item(2, "cpu"), item(3, "cpu", torch.bfloat16)]
    launches, copies = _triton_launches(items, {"codes1": "c"})
    assert [positions for positions, _ in launches] == [[0, 2], [1], [3]]
    assert [{p.device.type for p in call["params"]} for _, call in launches] == [
        {"cpu"}, {"meta"}, {"cpu"}
    ]  # fmt: skip
    assert copies == []


def test_step_counters_share_one_buffer_and_count_each_tensors_steps(monkeypatch):
    # [Note: step bank]: a group's counters become views of one buffer, advanced by one add.
    # Each tensor must still count its own steps through skipped steps, a reload and a
    # checkpoint round trip, and the trajectory must be the one of separate counters.
    import io

    from qshard.optim import _multi_tensor

    def run(bank: bool):
        if not bank:  # the counters as they were: separate tensors, one foreach add
            monkeypatch.setattr(_multi_tensor, "_step_bank", lambda *args: None)
        gen = torch.Generator().manual_seed(3)
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in _SHAPES[:4]]
        opt = qoptim.AdamW8bit(ps, lr=1e-2, weight_decay=0.1)
        counts, storages, saved = [], [], io.BytesIO()
        for step in range(7):
            for i, p in enumerate(ps):  # tensor 1 sits out step 2, tensor 2 step 3
                out = (i, step) in ((1, 2), (2, 3))
                p.grad = None if out else torch.randn(p.shape, generator=gen)
            if step == 4:  # loading the checkpoint of step 1 replaces every counter
                opt.load_state_dict(torch.load(saved))
            opt.step()
            if step == 1:
                torch.save(opt.state_dict(), saved)
                saved.seek(0)
            steps = [opt.state[p]["step"] for p in ps]
            counts.append([int(s) for s in steps])
            storages.append(len({s.untyped_storage().data_ptr() for s in steps}))
        monkeypatch.undo()
        return [p.detach().clone() for p in ps], counts, storages, opt

    p_bank, counts, storages, opt = run(bank=True)
    assert counts == [[1, 1, 1, 1], [2, 2, 2, 2], [3, 2, 3, 3], [4, 3, 3, 4],
                      [3, 3, 3, 3], [4, 4, 4, 4], [5, 5, 5, 5]]  # fmt: skip
    # one buffer for the batch from its first step; the three that step while one sits out
    # get a buffer of their own (the one sitting out keeps its view of the last), and after
    # the reload the four share one again
    assert storages == [1, 1, 2, 2, 1, 1, 1], storages
    p_sep, counts_sep, storages_sep, _ = run(bank=False)
    assert counts_sep == counts and storages_sep[-1] == 4
    for a, b in zip(p_bank, p_sep):
        assert torch.equal(a, b)
    # a saved state_dict keeps each counter's value, however the counters share storage
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert [int(loaded["state"][i]["step"]) for i in range(4)] == [5, 5, 5, 5]


def test_cpu_call_kept_only_while_its_tensors_are():
    # The split and the CPU call's rows are kept across steps while the tensors are the same
    # ([Note: prepared launch]), and take each step's gradients wherever they are (FSDP2 and
    # zero_grad make new ones); a replaced parameter or state, a tensor sitting out, a gradient
    # off 16-byte alignment or a changed block size builds them again. Bits equal to planning
    # every step: a kept row still pointing at an old gradient would step with it.
    def run(keep: bool):
        gen = torch.Generator().manual_seed(4)
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in _SHAPES[:3]]
        opt = qoptim.AdamW8bit(ps, lr=1e-2, weight_decay=0.1)
        built, real = [], opt._multi_tensor_row
        opt._multi_tensor_row = lambda *args: (built.append(1), real(*args))[1]
        if not keep:
            step = opt.step
            opt.step = lambda: (opt.__dict__.pop("_plan_cache", None), step())[1]
        return replay_plan_changes(opt, ps, gen, lambda: len(built))

    counts, kept = run(keep=True)
    assert counts == [3, 3, 3, 3, 6, 9, 11, 14, 14, 17, 20], counts
    counts_fresh, fresh = run(keep=False)
    assert counts_fresh == [3, 6, 9, 12, 15, 18, 20, 23, 26, 29, 32], counts_fresh
    assert len(kept) == len(fresh) and all(torch.equal(a, b) for a, b in zip(kept, fresh))


@pytest.mark.parametrize(
    ("cls", "extra"),
    [
        (qoptim.AdamW8bit, {}),
        (qoptim.AdamW8bit, {"stochastic_rounding": True}),
        (qoptim.AdamW4bit, {}),
    ],
)
def test_a_group_stepped_unit_by_unit_keeps_a_plan_per_unit(cls, extra):
    """StepInBackward steps one FSDP unit's parameters of a group at a time (the others'
    gradients hidden): the same bits as stepping the whole group, stochastic rounding included
    (each tensor keeps its place in the group, which seeds it), and each unit keeps its plan (the
    kept CPU call and step bank are reused at the next step, not rebuilt at every call)."""
    from qshard.zeropp.step_in_backward import _step_only

    torch.manual_seed(0)
    shapes = [(64, 300), (40, 257), (128,), (90, 130)]
    whole = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    split = [torch.nn.Parameter(p.detach().clone()) for p in whole]
    units = [split[:2], split[2:]]
    kw = {"min_4bit_size": 64} if cls is qoptim.AdamW4bit else {"min_8bit_size": 64, **extra}
    opt_whole, opt_split = (cls(ps, lr=1e-2, **kw) for ps in (whole, split))
    plans = []
    for step in range(3):
        grads = [torch.randn(s) for s in shapes]
        for p, q, g in zip(whole, split, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt_whole.step()
        for unit in units:
            _step_only(opt_split, {id(p) for p in unit})
        for p, q in zip(whole, split):
            assert torch.equal(p, q), step
        plans.append(dict(opt_split.__dict__["_plan_cache"]))
    assert len(plans[-1]) == len(units)
    assert all(plans[-1][k] is plans[1][k] for k in plans[-1])  # kept, not rebuilt
