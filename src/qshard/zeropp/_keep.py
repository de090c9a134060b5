"""Weights kept across the micro-batches of one accumulated step:
:func:`set_keep_weights_after_backward`.

[Note: weights kept across micro-batches] Between its forward and its backward a ZeRO++ unit
holds a copy of its weights: hpZ's node-local secondary shard (FSDP2's
``reshard_after_forward=ranks_per_node``), or the whole weights for the root and the last
``keep_last_blocks`` blocks (never resharded after forward). After backward FSDP2 frees it, and
the next forward gathers from the primary shard, across nodes. Between the micro-batches of a
gradient accumulation no optimizer step changes the weights, so that cross-node gather brings
back the values the copy held. With ``keep`` on, a unit's post-backward reshard keeps its copy
instead: an hpZ unit goes to its secondary shard (``_to_sharded_post_forward``, FSDP2's own
post-forward step) and the next forward's all-gather reads it over the node-local group, as
backward does; a unit kept whole stays whole and the next forward gathers nothing. A step of K
micro-batches then sends its forward weights across nodes once instead of K times, as
DeepSpeed's ZeRO++ does (its secondary partition lives from the first forward after an optimizer
step until the next step). The bits are the same: the copy is of the weights the forward
computed with (qwZ's dequantized ones included), which gathering the primary shard again would
rebuild exactly. Units fully resharded after forward (blocks without hpZ) are not kept: that
would hold every block's whole weights.

Turn it off for the last micro-batch's backward (its units then reshard as usual). A kept copy
never outlives an optimizer step: :func:`qshard.zeropp.shard`'s stale-copy guard reshards every
unit this function manages that is left unsharded or in its secondary shard before the next
forward ([Note: no backward, no stale copy]), and warns: until then ``model.parameters()``
yielded the copies, which hold no gradient (a clip before the step saw none of theirs). A
weight changed in place outside an optimizer step needs ``model.reshard()``, as documented
there. The price is memory: each kept unit holds its copy from its backward to the next
micro-batch's forward, instead of only from its forward to its backward.
"""

from __future__ import annotations

import types
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from qshard._fsdp import fsdp_param_groups
from qshard.zeropp.shard import KEEP_ATTR as _KEEP
from qshard.zeropp.shard import guards_model

__all__ = ["set_keep_weights_after_backward"]


def set_keep_weights_after_backward(model: nn.Module, keep: bool) -> int:
    """Whether the units of ``model`` (sharded by :func:`qshard.zeropp.shard`) keep after
    backward the copy of their weights they held since forward (hpZ's node-local secondary
    shard, or the whole weights of the root and the kept last blocks), for the next
    micro-batch's forward: on for every micro-batch but the last of an accumulated step
    ([Note: weights kept across micro-batches]). Returns the number of units that keep a copy
    (units fully resharded after forward keep none). Like ``FSDPModule.set_requires_all_reduce``
    it holds until set again."""
    if not isinstance(keep, bool):
        raise TypeError(f"keep must be True or False; got {keep!r}")
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units or not guards_model(units[0]):
        raise ValueError(
            "set_keep_weights_after_backward: the model was not sharded by "
            "qshard.zeropp.shard(), whose guard drops a kept copy at the next optimizer step; "
            "shard it with shard() first"
        )
    applied = 0
    for unit in units:
        groups = fsdp_param_groups(unit)
        if groups is None:
            raise RuntimeError(
                "set_keep_weights_after_backward: this torch's FSDP2 keeps its parameter "
                "groups elsewhere; qshard supports torch 2.9-2.14"
            )
        for group in groups:
            if getattr(group, "_reshard_after_forward", True) and not getattr(
                group, "_use_post_forward_mesh", False
            ):
                continue  # fully resharded after forward: nothing to keep
            _install(group)
            setattr(group, _KEEP, keep)
            applied += 1
    return applied


def _install(group: Any) -> None:
    """Wrap ``group.reshard`` once (an instance attribute over FSDP2's method)."""
    if getattr(group, _KEEP, None) is not None:
        return
    plain = group.reshard

    def reshard(self: Any) -> None:
        after_backward = getattr(self._training_state, "name", "") == "POST_BACKWARD"
        if not (getattr(self, _KEEP, False) and after_backward and self.is_unsharded):
            plain()
        elif self._use_post_forward_mesh:  # hpZ: FSDP2's post-forward reshard, after backward
            self._to_sharded_post_forward()
            event = self.device_handle.Event()
            if event is not None:
                event.record()
            self._reshard_after_forward_event = event
        # else: a unit kept whole from forward to backward stays whole

    group.reshard = types.MethodType(reshard, group)
    setattr(group, _KEEP, False)
