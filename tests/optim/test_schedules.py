"""The 0/1 Adam schedules (T_v: variance updates with kappa; T_u: syncs with alpha and H) as pure
functions: the paper's counts and the defining gap rules, for fixed and random arguments."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qshard.optim.zero_one_adam import (
    next_sync_step,
    next_variance_step,
    sync_interval,
    sync_steps,
    variance_update_steps,
)


def test_variance_counts_for_kappa_16():
    # zero-one-adam-algorithm.md: 45 full-precision steps in the first 100, 96 in 1,000,
    # 201 in 100,000.
    assert len(variance_update_steps(100, kappa=16)) == 45
    assert len(variance_update_steps(1000, kappa=16)) == 96
    assert len(variance_update_steps(100_000, kappa=16)) == 201


def test_variance_steps_start_at_one_and_double_after_kappa_updates():
    steps = variance_update_steps(60, kappa=4)
    assert steps[:6] == [1, 2, 3, 4, 5, 7]
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    assert gaps == [1] * 4 + [2] * 4 + [4] * 4 + [8] * 3


@settings(deadline=None, max_examples=50)
@given(st.integers(1, 40), st.integers(1, 3000))
def test_variance_gap_rule(kappa, num_steps):
    steps = variance_update_steps(num_steps, kappa=kappa)
    assert steps[0] == 1 and steps[-1] <= num_steps
    for j, (a, b) in enumerate(itertools.pairwise(steps)):
        assert b - a == 2 ** (j // kappa)
        assert next_variance_step(a, j + 1, kappa=kappa) == b
    assert next_variance_step(steps[-1], len(steps), kappa=kappa) > num_steps


def test_sync_steps_example():
    # alpha 2, H 4, phase B from step 11: gaps 1, 1, 2, 4 (2**(4//2)), then capped at 4.
    assert sync_steps(30, var_freeze_step=10, local_step_scaler=2, local_step_clipper=4) == [
        11,
        12,
        14,
        18,
        22,
        26,
        30,
    ]


@settings(deadline=None, max_examples=50)
@given(st.integers(1, 500), st.integers(1, 64), st.integers(0, 200), st.integers(1, 3000))
def test_sync_gap_rule(alpha, cap, freeze, horizon):
    steps = sync_steps(
        freeze + horizon, var_freeze_step=freeze, local_step_scaler=alpha, local_step_clipper=cap
    )
    assert steps[0] == freeze + 1  # the first phase-B step synchronises
    prev = freeze
    for s in steps:
        gap = s - prev
        assert gap == min(cap, 2 ** min((prev - freeze) // alpha, 64))
        assert gap == cap or (gap < cap and gap & (gap - 1) == 0)
        prev = s
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    assert gaps == sorted(gaps)  # never shrinks


def test_sync_interval_is_capped_for_huge_exponents():
    assert sync_interval(10**9, local_step_scaler=1, local_step_clipper=16) == 16
    assert sync_interval(0, local_step_scaler=1, local_step_clipper=16) == 1
    assert sync_interval(31, local_step_scaler=32, local_step_clipper=16) == 1
    assert sync_interval(32, local_step_scaler=32, local_step_clipper=16) == 2


def test_schedule_argument_errors():
    with pytest.raises(ValueError, match="kappa"):
        variance_update_steps(10, kappa=0)
    with pytest.raises(ValueError, match="local_step_clipper"):
        sync_interval(3, local_step_scaler=2, local_step_clipper=0)
    with pytest.raises(ValueError, match="after var_freeze_step"):
        next_sync_step(5, var_freeze_step=10, local_step_scaler=2, local_step_clipper=4)
    with pytest.raises(ValueError, match="phase_b_step"):
        sync_interval(-1, local_step_scaler=2, local_step_clipper=4)
