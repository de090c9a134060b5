"""Which parameters must keep 32-bit optimizer state regardless of the optimizer's settings.

A module registers the *names* of its parameters (``register_full_precision_state(self,
"weight")``), not the parameter objects: FSDP2's ``fully_shard`` replaces every parameter with
a new DTensor parameter, so an identity-keyed override (bitsandbytes' ``GlobalOptimManager``)
silently stops applying after sharding. The optimizer resolves the names when it creates a
parameter's state, i.e. after sharding, and the choice is then recorded in the state itself
(fp32 tensors instead of codes), so it also survives ``state_dict()`` and DCP checkpoints.
"""

from __future__ import annotations

import weakref

from torch import Tensor, nn

__all__ = ["is_full_precision_param", "register_full_precision_state"]

_registry: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()


def register_full_precision_state(module: nn.Module, *names: str) -> None:
    """Give the parameters ``module.<name>`` 32-bit state in every qshard 8-bit optimizer."""
    if not names:
        raise ValueError(
            "name at least one parameter, e.g. register_full_precision_state(m, 'weight')"
        )
    for n in names:
        if not isinstance(getattr(module, n, None), Tensor):
            raise ValueError(f"{type(module).__name__} has no parameter {n!r}")
    _registry[module] = _registry.get(module, frozenset()) | frozenset(names)


def is_full_precision_param(param: Tensor) -> bool:
    """Whether some live registered module currently holds ``param`` under a registered name."""
    for module, names in list(_registry.items()):
        for n in names:
            if module._parameters.get(n) is param:
                return True
    return False
