"""``shard()``'s explicit prefetching: which blocks each block prefetches in forward and
backward, and the hooks that issue those gathers before FSDP2 waits for the block's own
([Note: issue the prefetch before the wait])."""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from qshard._fsdp import prefetch_unshard
from qshard.zeropp.config import ZeroPPConfig

__all__ = ["prefetch"]


def prefetch(root: nn.Module, block_list: list[nn.Module], config: ZeroPPConfig) -> None:
    """With ``config.prefetch``: each block's forward and backward prefetch lists (FSDP2's
    explicit prefetching), the hooks that issue them early, and asynchronous unshards."""
    if config.prefetch and len(block_list) > 1:
        depth = config.prefetch_depth
        for i, block in enumerate(block_list):
            # Forward runs blocks in list order, backward in reverse: prefetch the next `depth`
            # (a kept block is unsharded already, and its prefetch a no-op: prefetching past it
            # would hold one more unsharded block than the step's peak).
            if ahead := block_list[i + 1 : i + 1 + depth]:
                block.set_modules_to_forward_prefetch(ahead)  # type: ignore[union-attr]
                _issue_before_wait(block, ahead)
            if behind := block_list[max(0, i - depth) : i][::-1]:
                block.set_modules_to_backward_prefetch(behind)  # type: ignore[union-attr]
                _issue_before_backward_wait(block, behind)
        root._set_unshard_async_op(True)  # type: ignore[union-attr]


def _issue_before_wait(block: nn.Module, ahead: list[nn.Module]) -> None:
    """Issue ``block``'s gather and its forward prefetches before FSDP2 waits for the first.

    [Note: issue the prefetch before the wait] FSDP2's pre-forward waits for a block's own
    all-gather and only then issues the gathers it prefetches. With the link as the
    bottleneck, that leaves the link idle between two gathers: from the end of block ``k``'s
    gather until every rank has woken, copied it out and issued block ``k + 1``'s (a collective
    starts when its last rank issues it). Issued here, in a pre-hook that runs before FSDP2's
    (``prepend=True`` after ``fully_shard``), block ``k + 1``'s gather waits behind block ``k``'s
    in the process group's queue and starts as soon as it ends. It is the gather FSDP2 was about
    to issue, a wait earlier: the same collectives in the same order on every rank (the block's
    own first, a no-op when a prefetch already issued it), and the same blocks unsharded at once
    (block ``k - 1`` resharded at its post-forward), so no extra memory beyond the gather buffer
    of ``k + 1`` existing during ``k``'s copy-out. FSDP2's own prefetch after the wait finds the
    gather issued and does nothing. On the emulated cluster (2 x 2) qgZ's link-bound forward
    idled 98 ms of 940 at 100 Mbit/s before, 16 after (``benchmarks/step_profile.py``'s link
    table; docs/zeropp.md, "Where the link idles, sampled").

    The gathers are issued through FSDP2's own prefetch function (``prefetch_unshard`` in
    :mod:`qshard._fsdp`), so FSDP2's checks for the pass apply as to its own prefetch. Not inside
    backward (a forward recomputed by activation checkpointing), where FSDP2 prefetches nothing
    in forward either. The hook runs eagerly under ``torch.compile``, as FSDP2's own hooks do
    ([Note: hooks outside the compiled graph])."""
    units = [block, *ahead]

    def issue(module: nn.Module, args: object) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        for unit in units:
            prefetch_unshard(unit, "forward")

    block.register_forward_pre_hook(
        torch._dynamo.disable(issue, recursive=True, reason="qshard prefetch issue"),
        prepend=True,
    )


def _issue_before_backward_wait(block: nn.Module, behind: list[nn.Module]) -> None:
    """The backward's side of [Note: issue the prefetch before the wait]: FSDP2's pre-backward
    (a hook on each of the block's forward outputs) waits for the block's gather, then issues
    the gathers of the blocks backward runs next. A gradient hook registered on the same outputs
    before FSDP2's (from a forward hook that runs before FSDP2's post-forward, which registers
    FSDP2's) issues them first. Once per backward (a multi-grad hook, ``mode="any"``), as
    FSDP2's pre-backward runs once; nothing in a forward without autograd or one recomputed
    inside backward (FSDP2 registers no pre-backward hook there). Issued as FSDP2's backward
    prefetch, so a unit set not to unshard in backward stays sharded."""
    units = [block, *behind]

    def issue(_grad: object) -> None:
        for unit in units:
            prefetch_unshard(unit, "backward")

    def after_forward(module: nn.Module, args: object, output: object) -> None:
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        outputs = [
            t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if outputs:
            register_multi_grad_hook(outputs, issue, mode="any")

    block.register_forward_hook(
        torch._dynamo.disable(after_forward, recursive=True, reason="qshard prefetch issue"),
        prepend=True,
    )
