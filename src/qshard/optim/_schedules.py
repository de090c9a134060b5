"""The communication schedules of 0/1 Adam as small pure functions of step numbers.

Steps are counted from 1 (the first ``optimizer.step()`` is step 1). Two policies (0/1 Adam
paper, Section 6; ``shared/papers/zero-one-adam-algorithm.md``):

* T_v, the variance-update steps (phase A, ``step <= var_freeze_step``): the first update is at
  step 1 and the gap after the j-th update (j = 0, 1, ...) is ``2 ** (j // kappa)``: the gap
  starts at 1 and doubles after every ``kappa`` updates. With kappa = 16 that is 45 updates in the
  first 100 steps and 96 in the first 1,000.
* T_u, the synchronisation steps (phase B, ``step > var_freeze_step``): with ``b`` the phase-B
  step number (``step - var_freeze_step``), the gap after a sync at phase-B step ``b`` is
  ``min(H, 2 ** (b // alpha))``; the first sync is at ``b = 1``. So the gap starts at 1, doubles
  every ``alpha`` phase-B steps and is capped at ``H`` (``local_step_clipper``).

The optimizer keeps only "the next step at which to do X" and calls these functions, so the
schedules are testable and plottable without an optimizer.
"""

from __future__ import annotations

import operator

__all__ = [
    "next_sync_step",
    "next_variance_step",
    "sync_interval",
    "sync_steps",
    "variance_update_steps",
]


def _positive_int(name: str, value: object, why: str = "") -> int:
    """``value`` as an int >= 1: any integer (Python's, numpy's: anything with ``__index__``)
    but a bool; else a ValueError naming ``name`` (``why``: said after "an int >= 1")."""
    if not isinstance(value, bool):
        try:
            number = operator.index(value)  # np.int64(1000) // 4 was refused as "not an int"
        except TypeError:
            pass
        else:
            if number >= 1:
                return number
    raise ValueError(f"{name} must be an int >= 1{why}; got {value!r}")


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        _positive_int(name, v)


def next_variance_step(step: int, updates_done: int, *, kappa: int) -> int:
    """The step of the next variance update, after the update number ``updates_done - 1``
    (0-based) happened at ``step``: ``step + 2 ** ((updates_done - 1) // kappa)``."""
    _check_positive(step=step, updates_done=updates_done, kappa=kappa)
    return step + 2 ** ((updates_done - 1) // kappa)


def variance_update_steps(num_steps: int, *, kappa: int) -> list[int]:
    """All variance-update steps in ``1..num_steps`` (ignoring ``var_freeze_step``)."""
    _check_positive(kappa=kappa)
    steps: list[int] = []
    step = 1
    while step <= num_steps:
        steps.append(step)
        step = next_variance_step(step, len(steps), kappa=kappa)
    return steps


def sync_interval(phase_b_step: int, *, local_step_scaler: int, local_step_clipper: int) -> int:
    """Gap to the next sync after a sync at phase-B step ``phase_b_step`` (0 = phase start)."""
    _check_positive(local_step_scaler=local_step_scaler, local_step_clipper=local_step_clipper)
    if phase_b_step < 0:
        raise ValueError(f"phase_b_step must be >= 0; got {phase_b_step}")
    # Compare exponents, not powers: 2 ** (b // alpha) is astronomically large for alpha = 1.
    exponent = phase_b_step // local_step_scaler
    if exponent >= local_step_clipper.bit_length():
        return local_step_clipper
    return min(local_step_clipper, 2**exponent)


def next_sync_step(
    last_sync_step: int, *, var_freeze_step: int, local_step_scaler: int, local_step_clipper: int
) -> int:
    """The step of the next sync after one at ``last_sync_step`` (pass ``var_freeze_step`` for
    "no sync yet in phase B")."""
    if last_sync_step < var_freeze_step:
        raise ValueError(
            f"syncs happen after var_freeze_step={var_freeze_step}; got last_sync_step "
            f"{last_sync_step}"
        )
    return last_sync_step + sync_interval(
        last_sync_step - var_freeze_step,
        local_step_scaler=local_step_scaler,
        local_step_clipper=local_step_clipper,
    )


def sync_steps(
    num_steps: int, *, var_freeze_step: int, local_step_scaler: int, local_step_clipper: int
) -> list[int]:
    """All phase-B sync steps in ``var_freeze_step+1..num_steps``."""
    out: list[int] = []
    step = var_freeze_step
    while True:
        step = next_sync_step(
            step,
            var_freeze_step=var_freeze_step,
            local_step_scaler=local_step_scaler,
            local_step_clipper=local_step_clipper,
        )
        if step > num_steps:
            return out
        out.append(step)
