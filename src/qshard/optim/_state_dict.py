"""Loading a state_dict saved by another optimizer (``torch.optim``'s, another qshard one's) or
by an older version: the saved param groups and states are checked and made loadable before
anything is loaded, or refused with an error that says why ([Note: loading foreign
state_dicts]). ``BlockwiseOptimizer._checked_state_dict`` is :func:`checked_state_dict`; the
optimizer's hooks it reads are :class:`_Loading`'s.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from qshard.optim._options import SCHEDULER_KEYS

__all__ = ["checked_state_dict"]


class _Loading(Protocol):
    """What :func:`checked_state_dict` reads of the optimizer (``BlockwiseOptimizer``'s)."""

    defaults: dict[str, Any]
    param_groups: list[dict[str, Any]]

    def _neutral_options(self) -> dict[str, Any]: ...

    def _validate_common(self, group: dict[str, Any]) -> None: ...

    def _validate_group(self, group: dict[str, Any]) -> None: ...

    def _state_specs(self, group: dict[str, Any]) -> tuple[tuple[str, bool], ...]: ...

    _optional_states: frozenset[str]

    def _missing_step(self, state: dict[str, Any]) -> float | None: ...


def checked_state_dict(opt: _Loading, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with its param groups and states made loadable, or an error that says
    why not, before anything is loaded."""
    # [Note: loading foreign state_dicts]
    # torch's load_state_dict replaces each group's options by the saved ones, unchecked.
    # A state_dict of torch.optim (or of another qshard optimizer) then left groups without
    # our options (KeyError 'optim_bits' at the first tensor without state), with options
    # we do not implement silently ignored (a saved amsgrad=True or maximize=True stepped
    # as plain Adam), and SGD states without the 'step' counter our step loop reads
    # (KeyError 'step'). So: torch-only options load only at their neutral value (and are
    # dropped); any other unknown option is refused (state saved by another optimizer);
    # options the saved group lacks keep this optimizer's current value (as torch's own
    # __setstate__ fills options added after a checkpoint was written); the result passes
    # the checks add_param_group runs; a state without 'step' gets the count
    # _missing_step gives or is refused; None entries (torch's absent buffers) are dropped;
    # a one-element tensor lr (torch's, for fused/capturable) becomes the float we read;
    # the keys LR schedulers add (SCHEDULER_KEYS: every scheduled run's groups have
    # initial_lr) load as they are.
    # Loaded fp32 states stay fp32: a tensor's state format is recorded in its state.
    name = type(opt).__name__
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        return state_dict  # torch's own error
    neutral = opt._neutral_options()
    groups = []
    for gi, (saved, current) in enumerate(zip(saved_groups, opt.param_groups)):
        extra = set(saved) - set(opt.defaults) - {"params", "param_names"} - SCHEDULER_KEYS
        unknown = sorted(k for k in extra if k not in neutral)
        if unknown:
            raise ValueError(
                f"{name}.load_state_dict: param group {gi} has option(s) {unknown} that "
                f"{name} does not take (was the state_dict saved by another optimizer?); "
                f"known options: {sorted(opt.defaults)}"
            )
        differ = {k: saved[k] for k in sorted(extra) if saved[k] != neutral[k]}
        if differ:
            raise ValueError(
                f"{name}.load_state_dict: param group {gi} was saved with {differ}, which "
                f"{name} does not implement (it computes "
                f"{ {k: neutral[k] for k in differ} }); load it into an optimizer that "
                f"implements it"
            )
        group = {k: v for k, v in saved.items() if k not in extra}
        for k, v in current.items():
            if k not in group and k != "params":
                group[k] = v
        lr = group.get("lr")
        if isinstance(lr, Tensor) and lr.numel() == 1:  # torch's tensor lr; ours is a float
            group["lr"] = float(lr)
        try:
            checked = {**group, "params": current["params"]}
            opt._validate_common(checked)
            opt._validate_group(checked)
        except ValueError as e:
            raise ValueError(f"{name}.load_state_dict: param group {gi}: {e}") from e
        groups.append(group)
    group_of = {k: gi for gi, g in enumerate(saved_groups) for k in g["params"]}
    states = {}
    for key, st in state_dict["state"].items():
        st = {k: v for k, v in st.items() if v is not None}
        if st and key in group_of:
            _check_complete(opt, key, st, groups[group_of[key]])
        if st and "step" not in st:
            step = opt._missing_step(st)
            if step is None:
                raise ValueError(
                    f"{name}.load_state_dict: the state of parameter {key} has no 'step' "
                    f"counter (keys {sorted(st)}); {name} needs it"
                )
            st["step"] = torch.tensor(float(step), dtype=torch.float32)
        states[key] = st
    return {**state_dict, "state": states, "param_groups": groups}


def _check_complete(opt: _Loading, key: Any, state: dict[str, Any], group: dict[str, Any]) -> None:
    """Refuse a stepped state that lacks a state the optimizer always keeps for its group (a
    Lion8bit state, momentum only, loaded into AdamW8bit took the momentum as Adam's and made
    a zero second moment at the saved step count without a word), or half of a quantized one
    (codes without absmax, or absmax without codes: a bare KeyError at the next step, or the
    momentum silently restarted from zero). States an option switched on later adds
    (``_optional_states``: SGD's or RMSprop's momentum buffer) may be absent."""
    name = type(opt).__name__
    for spec, _signed in opt._state_specs({**group, "params": []}):
        codes, absmax = f"{spec}_codes" in state, f"{spec}_absmax" in state
        if spec in state or (codes and absmax):
            continue
        if codes or absmax:
            half = f"{spec}_codes" if codes else f"{spec}_absmax"
            raise ValueError(
                f"{name}.load_state_dict: the state of parameter {key} has {half!r} without "
                f"its other half ({sorted(state)}): a quantized state is codes and absmax"
            )
        if spec not in opt._optional_states:
            raise ValueError(
                f"{name}.load_state_dict: the state of parameter {key} has no {spec!r} (keys "
                f"{sorted(state)}), which {name} keeps for every parameter it steps: was the "
                f"state_dict saved by another optimizer?"
            )
