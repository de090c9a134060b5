"""The options every 8-bit optimizer takes and their checks: :data:`COMMON_DEFAULTS`, the
keys LR schedulers add to param groups (:data:`SCHEDULER_KEYS`), and the checks of a group's
options and parameters (``lr``, real dtypes, DTensor placements; the 4-bit optimizers use
these too). An error names the option, the value and what to pass instead.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from qshard.optim import _kernels

__all__ = [
    "COMMON_DEFAULTS",
    "SCHEDULER_KEYS",
    "_check_lr",
    "_check_placements",
    "_check_real",
    "check_common_options",
    "check_numbers",
    "check_params_and_torch_flags",
    "eager_only",
    "listed_once",
    "refuse_maximize",
    "whole_int",
]

#: Options every 8-bit optimizer accepts, per parameter group.
COMMON_DEFAULTS: dict[str, Any] = {
    # 8: quantized state for eligible tensors; 32: fp32 state for the whole group.
    "optim_bits": 8,
    # Tensors with fewer elements (global count) keep fp32 state.
    "min_8bit_size": 4096,
    # Elements per absmax block, 1..4096 (256 default; the paper used 2048).
    "block_size": 256,
    # Reproduce bitsandbytes' CUDA rounding (no second-moment floor, sign nudge, -0.0 kept).
    "bnb_compat": False,
    # Stochastic instead of nearest rounding of the states.
    "stochastic_rounding": False,
}


#: Keys torch's LR schedulers write into param groups (``LRScheduler``: ``initial_lr``;
#: ``OneCycleLR``/``CyclicLR``: the others; ``swa_utils.SWALR``: ``swa_lr``). They are not
#: options of ours, but a group carries them as in ``torch.optim`` (a scheduler resumed with
#: ``last_epoch`` reads ``initial_lr``), so a checkpoint of a scheduled run loads.
SCHEDULER_KEYS = frozenset(
    {"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr"}
)


def whole_int(value: Any) -> int | None:
    """``value`` as a Python int when it is an integer of any type (numpy's too: anything with
    ``__index__``) but a bool; else None. The options take numpy integers (``np.int64(4096)``
    was refused as "must be an int") and keep Python ints in the param groups."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


_F = TypeVar("_F", bound=Callable[..., Any])


def eager_only(step: _F) -> _F:
    """``step`` kept out of ``torch.compile``: a compiled function that calls it runs it eagerly
    (a graph break), as FSDP2 keeps its hooks out.

    [Note: the optimizers' step under torch.compile] Dynamo traces a ``torch.optim.Optimizer``
    subclass's ``step`` into the graph. Ours hand raw pointers to C kernels (ctypes), keep
    numpy plans of addresses across steps, call ``lru_cache``d map builders and the 1-bit
    optimizers' collectives: traced, the step read stale addresses (AdamW4bit's first
    compiled step differed from eager by ~lr, the next one crashed with a segmentation fault,
    AdamW8bit in a training step corrupted the heap). Run eagerly, the step is exactly the
    eager step; the rest of the compiled function (forward, backward) stays compiled.

    ``torch._disable_dynamo`` is ``torch.compiler.disable`` imported at the first call (what
    torch.optim's own methods use): importing torch._dynamo with qshard (and triton with it)
    cost ~0.8 s per process, and fixed Triton's interpreter setting before a test could."""
    return torch._disable_dynamo(step, recursive=True)  # type: ignore[return-value]


def refuse_maximize(maximize: Any, name: str) -> None:
    """``maximize`` as torch's optimizers take it: False (torch's default) is accepted, so code
    written for ``torch.optim`` that passes it runs; True is refused (the kernels minimize)."""
    if maximize is not False:
        raise ValueError(
            f"{name} does not support maximize={maximize!r} (it minimizes); minimize the "
            "negated objective instead, or leave maximize=False"
        )


def listed_once(param_group: dict[str, Any], name: str) -> dict[str, Any]:
    """``param_group`` with its ``params`` as a list, refused if it lists a tensor twice.

    torch only warns about a duplicate ("in future, this will cause an error") and steps the
    tensor twice per step; in the block-wise kernels the two rows alias one tensor, and with two
    threads they raced: the result changed from run to run, with one step counter for two
    updates (the 1-bit optimizers would average and step it twice too).
    """
    params = param_group.get("params")
    if params is None or isinstance(params, (Tensor, set)):
        return param_group  # torch's own handling (one tensor; its TypeError for a set)
    params = list(params)
    seen: dict[int, int] = {}
    for i, p in enumerate(params):
        j = seen.setdefault(id(p), i)
        if j != i:
            raise ValueError(
                f"{name}: a param group lists one parameter twice (params[{j}] and params[{i}], "
                f"shape {tuple(p.shape)}); list each parameter once (e.g. "
                "list(dict.fromkeys(params)), or model.parameters(), which lists a tied one once)"
            )
    return {**param_group, "params": params}


# Real numbers as torch.optim takes them (np.float32 and NumPy's ints are not Python floats
# and ints; np.float64 is one).
_REAL = (float, int, np.floating, np.integer)


def _check_lr(lr: Any, name: str) -> None:
    """``lr`` is a real number >= 0: a Python float or int, or a NumPy scalar (as
    ``torch.optim`` takes them; an LR scheduler whose lambda returns NumPy values writes such an
    lr into the group, and a checkpoint of that run must load); not a Tensor, bool or NaN."""
    if isinstance(lr, Tensor):
        raise ValueError(
            f"{name}: lr must be a Python float, not a Tensor (the update reads it as a number; "
            f"pass lr=float(lr)); got {lr!r}"
        )
    real = isinstance(lr, _REAL)
    if isinstance(lr, bool) or not real or not lr >= 0:  # NaN too
        raise ValueError(f"{name}: lr must be a float >= 0; got {lr!r}{_str_hint(lr)}")


def _str_hint(value: Any) -> str:
    """What to do about a number given as a string (from a config file), else nothing."""
    if not isinstance(value, str):
        return ""
    return " (a string: pass float(value); YAML 1.1 reads 1e-8 as a string, write 1.0e-8)"


def check_numbers(group: dict[str, Any], name: str, keys: tuple[str, ...]) -> None:
    """The hyperparameters ``keys`` of ``group`` are numbers (``betas``: a pair of them; a
    one-element Tensor too, as ``torch.optim`` takes), checked before the range checks compare
    them: a config value read as a string (YAML 1.1 reads ``1e-8`` as one) was a TypeError of
    a comparison that named nothing, and SGD's ``dampening``, never compared, passed and
    failed at the first step, after that step's counters had advanced."""
    for k in keys:
        value = group[k]
        if k == "betas":  # any pair: a tuple, a list, a NumPy array, a Tensor of two
            items = list(value) if isinstance(value, Iterable) else []
            if len(items) != 2:
                raise ValueError(f"{name}: betas must be a pair (beta1, beta2); got {value!r}")
        else:
            items = [value]
        for v in items:
            if isinstance(v, Tensor) and v.numel() == 1:
                continue
            if not isinstance(v, _REAL):
                what = "two numbers" if k == "betas" else "a number"
                raise ValueError(f"{name}: {k} must be {what}; got {value!r}{_str_hint(v)}")


def _check_real(params: Iterable[Tensor], name: str) -> None:
    for p in params:
        if p.is_complex():
            # the fp32 copy of a complex tensor is its real part: the update would zero the
            # imaginary part without a word
            raise ValueError(
                f"{name} does not take complex parameters (got {p.dtype}, shape "
                f"{tuple(p.shape)}); register torch.view_as_real(p) as the parameter or use "
                f"torch.optim for it"
            )


def _check_placements(p: DTensor, what: str = "8-bit optimizer state") -> None:
    for pl in p.placements:
        if not (type(pl) is Replicate or (type(pl) is Shard and pl.dim == 0)):
            raise NotImplementedError(
                f"{what} supports DTensor parameters sharded on dim 0 (FSDP2/HSDP)"
                f" or replicated; got placements {p.placements}. Use optim_bits=32 for this "
                f"parameter group."
            )


def check_common_options(group: dict[str, Any], name: str) -> None:
    """Check the options of :data:`COMMON_DEFAULTS`, ``lr``, the parameters and torch's
    ``foreach``/``fused`` flags of ``group`` (``Optimizer8bit._validate_common``); ``name``:
    the optimizer's class name, for the errors."""
    bits = whole_int(group["optim_bits"])
    if bits not in (8, 32):
        raise ValueError(f"{name}: optim_bits must be 8 or 32; got {group['optim_bits']!r}")
    size = whole_int(group["min_8bit_size"])
    if size is None or size < 0:
        raise ValueError(
            f"{name}: min_8bit_size must be an int >= 0; got {group['min_8bit_size']!r}"
        )
    # (a bool is an int: block_size=True made blocks of one element, absmax per element)
    bs = whole_int(group["block_size"])
    if bs is None or not 1 <= bs <= _kernels.MAX_BLOCK:
        raise ValueError(
            f"{name}: block_size must be an int in 1..{_kernels.MAX_BLOCK} (256 or 2048 are "
            f"usual); got {group['block_size']!r}"
        )
    group.update(optim_bits=bits, min_8bit_size=size, block_size=bs)
    for flag in ("bnb_compat", "stochastic_rounding"):
        if not isinstance(group[flag], bool):  # a config's "false" is truthy
            raise ValueError(f"{name}: {flag} must be True or False; got {group[flag]!r}")
    _check_lr(group["lr"], name)
    check_params_and_torch_flags(group, name, "8-bit optimizer state")


def check_params_and_torch_flags(group: dict[str, Any], name: str, what: str) -> None:
    """Real parameters, DTensors placed as the state's blocks need (``what`` names the state
    in the error), and torch.optim's ``foreach``/``fused`` flags where the optimizer takes
    them; shared by the 8- and 4-bit optimizers."""
    _check_real(group["params"], name)
    for p in group["params"]:
        if isinstance(p, DTensor):
            _check_placements(p, what)
    for flag in ("foreach", "fused"):  # torch.optim's flags, where the optimizer takes them
        if group.get(flag) not in (None, False, True):
            raise ValueError(f"{name}: {flag} must be None, False or True; got {group[flag]!r}")
    if group.get("foreach") and group.get("fused"):
        raise ValueError(f"{name}: fused and foreach cannot both be True (as in torch.optim)")
