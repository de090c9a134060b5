"""Which parameters must keep 32-bit optimizer state regardless of the optimizer's settings.

A module registers the *names* of its parameters (``register_full_precision_state(self,
"weight")``), not the parameter objects: FSDP2's ``fully_shard`` replaces every parameter with
a new DTensor parameter, so an identity-keyed override (bitsandbytes' ``GlobalOptimManager``)
silently stops applying after sharding. The optimizer resolves the names when it creates a
parameter's state, i.e. after sharding, and the choice is then recorded in the state itself
(fp32 tensors instead of codes), so it also survives ``state_dict()`` and DCP checkpoints.

[Note: registrations travel with copies] The registry is keyed by the module object, and
``copy.deepcopy`` or pickling (``torch.save`` of a whole model) builds new module objects
without calling ``__init__``: a copy of a registered ``nn.Linear`` was unregistered, so an
optimizer over the copy gave its weight 8-bit state without a word (only ``StableEmbedding``
re-registered itself, in its ``__setstate__``). So the registration is also an attribute of the
module, a :class:`_Registration` that refers back to its module: both copiers copy it with the
module's ``__dict__`` after the module's copy exists (their memo), so the copied registration
holds the copied module and registers it as it is rebuilt.
"""

from __future__ import annotations

import weakref

from torch import Tensor, nn

__all__ = ["is_full_precision_param", "register_full_precision_state"]

#: Every live registered module; its names are its :class:`_Registration`'s.
_registry: weakref.WeakSet[nn.Module] = weakref.WeakSet()

#: The module attribute holding a module's :class:`_Registration`.
_ATTR = "_qshard_full_precision_state"


class _Registration:
    """A module's registered names, kept in its ``__dict__`` so that copies of the module are
    registered too ([Note: registrations travel with copies])."""

    __slots__ = ("module", "names")

    def __init__(self, module: nn.Module, names: frozenset[str]) -> None:
        self.module = module
        self.names = names
        _registry.add(module)

    def __getstate__(self) -> tuple[nn.Module, frozenset[str]]:
        return self.module, self.names

    def __setstate__(self, state: tuple[nn.Module, frozenset[str]]) -> None:
        self.__init__(*state)


def register_full_precision_state(module: nn.Module, *names: str) -> None:
    """Give the parameters ``module.<name>`` 32-bit state in every qshard 8-bit optimizer (also
    in copies of ``module`` made by ``copy.deepcopy`` or pickling)."""
    if not names:
        raise ValueError(
            "name at least one parameter, e.g. register_full_precision_state(m, 'weight')"
        )
    for n in names:
        if not isinstance(getattr(module, n, None), Tensor):
            raise ValueError(f"{type(module).__name__} has no parameter {n!r}")
    before = module.__dict__.get(_ATTR)
    registered = (before.names if before is not None else frozenset()) | frozenset(names)
    object.__setattr__(module, _ATTR, _Registration(module, registered))


def is_full_precision_param(param: Tensor) -> bool:
    """Whether some live registered module currently holds ``param`` under a registered name."""
    for module in list(_registry):
        for n in module.__dict__[_ATTR].names:
            if module._parameters.get(n) is param:
                return True
    return False
