"""The app sizes 0/1 Adam's T_v / T_u to the run's lr schedule by the paper's rules
(qshard.train._parallel.zero_one_adam_schedule): checked against the lr function itself."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from qshard.train._parallel import zero_one_adam_schedule
from qshard.train.config import TrainConfig
from qshard.train.loop import learning_rate


def _config(**kw) -> TrainConfig:
    base = dict(out="/tmp/qshard-unused", optim="zero_one_adam", zeropp="off", nproc=4)
    return TrainConfig(**{**base, **kw})


def _lr(config: TrainConfig, optimizer_step: int) -> float:
    return learning_rate(optimizer_step - 1, config)  # the loop's step s is optimizer step s + 1


def test_convergence_benchmark_run():
    cfg = _config(steps=600, lr=3e-3, min_lr=3e-4, warmup_steps=30)
    assert zero_one_adam_schedule(cfg) == {
        "var_freeze_step": 337,
        "local_step_scaler": 112,
        "var_update_scaler": 32,
    }


def test_lr_that_never_halves_freezes_late_and_never_grows_the_interval():
    cfg = _config(steps=400, lr=1e-3, min_lr=6e-4, warmup_steps=10)
    assert zero_one_adam_schedule(cfg) == {
        "var_freeze_step": 300,
        "local_step_scaler": 400,
        "var_update_scaler": 32,
    }


@settings(max_examples=60, deadline=None)
@given(
    steps=st.integers(10, 5000),
    warmup_frac=st.floats(0.0, 0.5),
    min_frac=st.floats(0.0, 1.0),
)
def test_freeze_where_the_lr_has_halved_and_scaler_is_the_next_halving(
    steps, warmup_frac, min_frac
):
    warmup = min(steps - 1, int(warmup_frac * steps))
    cfg = _config(steps=steps, lr=1e-3, min_lr=1e-3 * min_frac, warmup_steps=warmup)
    out = zero_one_adam_schedule(cfg)
    freeze, scaler = out["var_freeze_step"], out["local_step_scaler"]
    assert 1 <= freeze <= steps and scaler >= 1
    peak = max(1, warmup)
    halved = [s for s in range(peak + 1, steps + 1) if _lr(cfg, s) <= _lr(cfg, peak) / 2]
    if not halved or halved[0] >= steps:
        assert out == {
            "var_freeze_step": max(1, 3 * steps // 4),
            "local_step_scaler": steps,
            "var_update_scaler": 32,
        }
        return
    assert freeze == halved[0]
    again = [s for s in range(freeze + 1, steps + 1) if _lr(cfg, s) <= _lr(cfg, freeze) / 2]
    assert scaler == (again[0] if again else steps + 1) - freeze
