"""The 1-bit compressed all-reduce with worker and server error feedback (1-bit Adam, 0/1 Adam).

This module owns the collective that 1-bit Adam and 0/1 Adam use instead of an fp32 all-reduce
(`docs/zero_one_adam.md`; the math is restated in ``shared/papers/zero-one-adam-algorithm.md``).
For every tensor of a bucket, each rank

1. adds its *worker error* to the input, sends ``scale * sign(x)`` (one bit per element plus one
   fp32 scale per tensor) and keeps what the compression lost as the new worker error;
2. acts as the *server* of one ``1/n`` chunk of every tensor: averages the n workers' compressed
   chunks, adds its *server error*, compresses the result again and keeps that loss;
3. all-gathers the server chunks, so every rank reconstructs the same averaged tensor.

A whole bucket (all tensors of an optimizer step) travels in exactly two collectives: one
all-to-all (packed worker signs + worker scales, as bytes) and one all-gather (packed server signs
+ server scales). Each tensor keeps its own scale, so tensors of very different magnitudes do not
share one.

[Note: valid elements] 1 bit cannot encode 0, so elements that must stay exactly zero are
*invalid*: the padding that makes every chunk a whole number of bytes, and the structurally zero
elements named by an optional mask. Invalid elements are excluded from every scale, their error
stays zero, and they are zero in the result. All ranks must pass the same masks (the mask is a
property of the model, which is replicated).

[Note: non-finite inputs] If any element of a tensor (masked ones included) is NaN or +-Inf on
any rank, or its sum of squares overflows float32 (elements beyond ~1e19) on any rank or on any
server (whose chunk adds its error to the ranks' mean), that tensor comes back all NaN on every
rank, and the worker and server error buffers of that tensor are left as
they were on every rank, so a later round with finite inputs is unaffected. Sign compression
alone would not propagate it: 1 bit has no NaN (``sign(NaN)`` packs as +1) and the errors would
keep the NaN or Inf forever. The decision is per tensor and made from the per-tensor scales,
which every rank receives from every rank and every server: no extra pass over the data and no
extra message, and every rank takes the same decision (the error buffers are written after the
all-gather, when the servers' scales are known). Other tensors of the bucket are unaffected.

[Note: wire rows] What one rank sends to one destination (a row of the all-to-all buffer, or its
all-gather payload) is ``[num fp32 scales | packed signs | 0-3 zero bytes]``: the scales come
first and every row is a multiple of 4 bytes, so the scales are read in place as a float32 view
of the received bytes at any world size and any tensor sizes (the packed signs of a destination
are ``width / 8`` bytes, which is not a multiple of 4 in general).

[Note: same tensors on every rank] Every rank must pass the same number of tensors with the same
shapes (and masks on the same tensors). Nothing in the two collectives can tell otherwise: a
bucket whose chunks happen to pad to the same width was silently mixed (rank 0's 7 elements
averaged with rank 1's 5, each rank returning its own shape), and one of another width aborted
the gloo process ("Received data size doesn't match expected size") or, under NCCL, can hang.
So the first call with a new bucket layout on a group checks it with one all-gather of four
integers per rank (recorded as ``<tag>/layout_check``) and raises on every rank, naming what
each rank passed; a layout that passed is remembered per group, so a steady state of the same
buckets costs no extra message. Ranks that agree keep identical caches (every new layout is
checked on every rank), so they stay in step. Not caught before the transport: a rank that
changes its bucket after every rank used the old one (its new layout is checked, the others'
cached one is not, so the check's all-gather meets their all-to-all).

[Note: one process] With a group of one rank (an initialised world of size 1, or no process
group at all when ``group`` is None) the same compression and error feedback run and the two
collectives are skipped (a rank sends nothing to itself; nothing is recorded in the ledger). The
result is bit-identical either way, so a single-process run behaves as one rank of a cluster
run, compression error included.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from qshard.comm.ledger import active_ledger
from qshard.quant.signs import pack_signs, unpack_signs

__all__ = [
    "compressed_all_reduce",
    "padded_numel",
    "server_error_numel",
]


def padded_numel(numel: int, world_size: int) -> int:
    """Length of a tensor's worker error buffer: ``numel`` rounded up so that it splits into
    ``world_size`` chunks of whole bytes of packed signs (a multiple of ``8 * world_size``)."""
    if numel < 0 or world_size < 1:
        raise ValueError(f"need numel >= 0 and world_size >= 1; got {numel}, {world_size}")
    step = 8 * world_size
    return max(1, math.ceil(numel / step)) * step


def server_error_numel(numel: int, world_size: int) -> int:
    """Length of a tensor's server error buffer: one rank's chunk of the padded tensor."""
    return padded_numel(numel, world_size) // world_size


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int, list[int]]:
    if not dist.is_available() or not dist.is_initialized():
        if group is None:  # a single process; see [Note: one process]
            return 1, 0, [0]
        raise RuntimeError(
            "compressed_all_reduce was given a process group but torch.distributed is not "
            "initialised; call torch.distributed.init_process_group first (or pass group=None "
            "in a single process)"
        )
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"global rank {dist.get_rank()} is not a member of the process group it was given; "
            "call it only on the group's members"
        )
    return dist.get_world_size(group), rank, dist.get_process_group_ranks(group)


def _segment_sums(values: torch.Tensor, segment_ids: torch.Tensor, num_segments: int):
    out = torch.zeros(num_segments, dtype=values.dtype, device=values.device)
    return out.index_add_(0, segment_ids, values)


def compressed_all_reduce(
    tensors: Sequence[torch.Tensor],
    worker_errors: Sequence[torch.Tensor],
    server_errors: Sequence[torch.Tensor],
    *,
    masks: Sequence[torch.Tensor | None] | None = None,
    group: dist.ProcessGroup | None = None,
    tag: str = "compressed_all_reduce",
) -> list[torch.Tensor]:
    """Average ``tensors`` over ``group`` with 1-bit compression and error feedback.

    Args:
        tensors: float32 tensors of any shapes (the same shapes on every rank: checked once per
            layout, a ``ValueError`` otherwise; see [Note: same tensors on every rank]). Not
            modified.
        worker_errors: one float32 buffer of ``qshard.comm.padded_numel(t.numel(), n)``
            elements per tensor (any shape, read flat), this rank's worker error; updated in
            place. Start from zeros.
        server_errors: one float32 buffer of ``qshard.comm.server_error_numel(t.numel(), n)``
            elements per tensor (any shape), this rank's server error; updated in place. Start
            from zeros.
        masks: optional bool tensor per tensor (shape of the tensor, or ``None``): ``False``
            marks structurally zero elements, which are sent as nothing and come back exactly 0
            (see [Note: valid elements]). Must be identical on every rank. Any other dtype is
            refused (a float mask would weight the values instead of selecting them).
        group: the process group (default: the world; a single process without an initialised
            process group, see [Note: one process]).
        tag: name under which the two collectives are recorded in the active comm ledger.

    Returns:
        New tensors, identical on every rank: the compressed average of ``tensors``.
    """
    n, rank, group_ranks = _group_info(group)
    num = len(tensors)
    if len(worker_errors) != num or len(server_errors) != num:
        raise ValueError(
            f"need one worker and one server error buffer per tensor; got {num} tensors, "
            f"{len(worker_errors)} worker and {len(server_errors)} server buffers"
            + _single_tensor_hint(tensors, worker_errors, server_errors)
        )
    if masks is None:
        masks = [None] * num
    elif len(masks) != num:
        raise ValueError(
            f"need one mask (or None) per tensor; got {len(masks)} for {num}"
            + _single_tensor_hint(tensors, masks)
        )
    if num == 0:
        return []

    numels = [t.numel() for t in tensors]
    chunks = [padded_numel(k, n) // n for k in numels]
    for i, (t, ew, es) in enumerate(zip(tensors, worker_errors, server_errors)):
        if t.dtype != torch.float32 or ew.dtype != torch.float32 or es.dtype != torch.float32:
            raise TypeError(
                f"tensor {i}: compressed_all_reduce works in float32; got input {t.dtype}, "
                f"errors {ew.dtype}/{es.dtype} (cast the input, keep fp32 error buffers)"
            )
        if ew.numel() != chunks[i] * n or es.numel() != chunks[i]:
            raise ValueError(
                f"tensor {i} ({numels[i]} elements, world {n}) needs a worker error of "
                f"{chunks[i] * n} and a server error of {chunks[i]} elements; got "
                f"{ew.numel()} and {es.numel()} (allocate them with padded_numel / "
                f"server_error_numel for this group's size)"
            )
        mask = masks[i]
        if mask is not None and (mask.dtype != torch.bool or mask.shape != t.shape):
            # a float mask would weight the values (0.5 halves them) instead of selecting them
            fix = "pass mask != 0" if mask.dtype != torch.bool else "reshape it like the tensor"
            raise ValueError(
                f"tensor {i}: a mask is a bool tensor of the tensor's shape {tuple(t.shape)} "
                f"(False: structurally zero); got {mask.dtype} of shape {tuple(mask.shape)} "
                f"({fix})"
            )
    if n > 1:
        _check_same_layout(tensors, masks, group, group_ranks, tag)
    width = sum(chunks)  # elements per destination rank; a multiple of 8
    device = tensors[0].device  # every buffer lives where the data is (CPU/gloo, GPU/NCCL)
    seg_ids = torch.repeat_interleave(
        torch.arange(num, device=device), torch.tensor(chunks, device=device)
    )

    # Worker side, laid out destination-major: row r holds chunk r of every tensor.
    x = torch.empty(n, width, dtype=torch.float32, device=device)
    valid = torch.empty(n, width, dtype=torch.float32, device=device)
    offset = 0
    for t, ew, mask, k, c in zip(tensors, worker_errors, masks, numels, chunks):
        vp = torch.zeros(n * c, dtype=torch.float32, device=device)
        if mask is None:
            vp[:k] = 1.0
        else:
            vp[:k] = mask.reshape(-1).to(torch.float32)
        xp = ew.reshape(-1).clone()  # buffers of any shape (and strides) with the right numel
        xp[:k] += t.detach().reshape(-1)
        xp.mul_(vp)  # invalid elements carry no value and no error
        x[:, offset : offset + c] = xp.view(n, c)
        valid[:, offset : offset + c] = vp.view(n, c)
        offset += c
    counts = _segment_sums(valid.sum(0), seg_ids, num)
    worker_scales = (
        _segment_sums(x.square().sum(0), seg_ids, num).sqrt() / counts.clamp_min(1).sqrt()
    )
    signs = torch.where(x >= 0, 1.0, -1.0)
    sent = signs * worker_scales[seg_ids] * valid
    new_worker_error = x - sent  # stored once every rank's scales are known (non-finite note)

    sign_bytes = width // 8
    row = _row_bytes(num, sign_bytes)  # see [Note: wire rows]
    send = torch.empty(n, row, dtype=torch.uint8, device=device)
    send.view(torch.float32)[:, :num] = worker_scales
    send[:, 4 * num : 4 * num + sign_bytes] = pack_signs(signs.reshape(-1)).view(n, sign_bytes)
    send[:, 4 * num + sign_bytes :] = 0
    if n > 1:
        recv = torch.empty_like(send)
        _record("all_to_all", group_ranks, send.numel(), tag)
        dist.all_to_all_single(recv, send, group=group)
    else:  # one rank is its own server: nothing to exchange
        recv = send

    # Server side: this rank reduces chunk `rank` of every tensor.
    recv_scales = recv.view(torch.float32)[:, :num]  # (n, num), a view: rows are 4-aligned
    recv_signs = unpack_signs(recv[:, 4 * num : 4 * num + sign_bytes].reshape(-1), n * width).view(
        n, width
    )
    # Every rank receives every rank's scale of every tensor, so all agree on which tensors
    # had a non-finite input somewhere; see [Note: non-finite inputs].
    finite = torch.isfinite(recv_scales).all(0)  # (num,)
    my_valid = valid[rank]
    server_err = torch.cat([es.reshape(-1) for es in server_errors])
    y = (recv_signs * recv_scales[:, seg_ids]).sum(0).div_(n).mul_(my_valid).add_(server_err)
    my_counts = _segment_sums(my_valid, seg_ids, num)
    server_scales = _segment_sums(y.square(), seg_ids, num).sqrt() / my_counts.clamp_min(1).sqrt()
    server_scales = torch.where(finite, server_scales, math.nan)
    server_signs = torch.where(y >= 0, 1.0, -1.0)
    server_sent = server_signs * server_scales[seg_ids] * my_valid

    payload = torch.empty(row, dtype=torch.uint8, device=device)
    payload.view(torch.float32)[:num] = server_scales
    payload[4 * num : 4 * num + sign_bytes] = pack_signs(server_signs)
    payload[4 * num + sign_bytes :] = 0
    if n > 1:
        gathered = torch.empty(n, row, dtype=torch.uint8, device=device)
        _record("all_gather", group_ranks, gathered.numel(), tag)
        _all_gather_single(gathered, payload, group)
    else:
        gathered = payload.view(1, row)

    # The errors are written only now: every rank also has every server's scales, so a server
    # sum of squares that overflowed (the server error added to the mean can exceed what any
    # rank sent) counts as a non-finite input on every rank too.
    ok = finite & torch.isfinite(gathered.view(torch.float32)[:, :num]).all(0)  # (num,)
    keep = ok[seg_ids]
    new_server_error = torch.where(keep, y - server_sent, server_err)
    offset = 0
    for ew, es, c in zip(worker_errors, server_errors, chunks):
        part = slice(offset, offset + c)  # no host sync: a where, not an if
        old = ew.reshape(n, c)
        ew.copy_(torch.where(keep[part], new_worker_error[:, part], old).reshape(ew.shape))
        es.copy_(new_server_error[part].reshape(es.shape))
        offset += c

    out_scales = gathered.view(torch.float32)[:, :num]  # (n, num)
    out_signs = unpack_signs(
        gathered[:, 4 * num : 4 * num + sign_bytes].reshape(-1), n * width
    ).view(n, width)
    result = out_signs.mul_(out_scales[:, seg_ids]).mul_(valid)
    result = torch.where(keep, result, math.nan)  # an overflowed server scale gave +-Inf
    outputs = []
    offset = 0
    for t, k, c in zip(tensors, numels, chunks):
        flat = result[:, offset : offset + c].reshape(-1)[:k]
        outputs.append(flat.reshape(t.shape).clone())
        offset += c
    return outputs


_CHECKED_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_CHECKED_LAYOUTS = 256  # cleared beyond this, on every rank alike (same calls, same cache)


def _check_same_layout(
    tensors: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor | None],
    group: dist.ProcessGroup | None,
    group_ranks: list[int],
    tag: str,
) -> None:
    """Refuse tensors (or masks) that differ across the ranks of ``group``, once per layout;
    see [Note: same tensors on every rank]."""
    layout = tuple((tuple(t.shape), m is not None) for t, m in zip(tensors, masks))
    key = group if group is not None else dist.group.WORLD
    seen = _CHECKED_LAYOUTS.setdefault(key, set())
    if layout in seen:
        return
    digest = 0
    for shape, masked in layout:
        for d in (*shape, -1 - masked):
            digest = (digest * 1_000_003 + d + 7) % (2**61 - 1)
    mine = torch.tensor(
        [len(tensors), sum(t.numel() for t in tensors), sum(m for _, m in layout), digest],
        dtype=torch.int64,
        device=tensors[0].device,
    )
    gathered = torch.empty(len(group_ranks), mine.numel(), dtype=torch.int64, device=mine.device)
    _record("all_gather", group_ranks, gathered.numel() * 8, f"{tag}/layout_check")
    _all_gather_single(gathered, mine, group)
    if not bool((gathered == mine).all()):
        per_rank = "; ".join(
            f"rank {r}: {int(c)} tensors, {int(k)} elements, {int(m)} masks"
            for r, (c, k, m, _) in zip(group_ranks, gathered.tolist())
        )
        if bool((gathered[:, :3] == mine[:3]).all()):
            per_rank += "; the same totals in other shapes or another order"
        shapes = [s for s, _ in layout]
        raise ValueError(
            f"{tag}: the ranks of the group passed different tensors "
            f"({per_rank}; shapes on rank {group_ranks[dist.get_rank(group)]}: "
            f"{shapes[:8]}{' ...' if len(shapes) > 8 else ''}). "
            "Every rank must pass the same number of tensors, with the same shapes, in the "
            "same order, and masks on the same tensors; for OneBitAdam / ZeroOneAdam: the "
            "same trainable parameters (requires_grad) on every rank"
        )
    if len(seen) >= _MAX_CHECKED_LAYOUTS:
        seen.clear()
    seen.add(layout)


def _single_tensor_hint(*args: object) -> str:
    """A tensor is a sequence of its rows: one 1-D tensor of k elements passed where a list
    was meant counts as k one-element tensors, and the count mismatch alone misleads."""
    shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
    if not shapes:
        return ""
    return (
        f" (a single tensor of shape {shapes[0]} was passed as a list: it counts as its rows; "
        "pass a list with one entry per tensor, e.g. [tensor])"
    )


def _row_bytes(num_tensors: int, sign_bytes: int) -> int:
    """Bytes one rank sends to one destination in each of the two collectives (see
    [Note: wire rows])."""
    return 4 * num_tensors + 4 * -(-sign_bytes // 4)


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out.view(-1), inp.reshape(-1), group=group)  # gloo wants a flat output


def _record(op: str, group_ranks: list[int], tensor_bytes: int, tag: str) -> None:
    ledger = active_ledger()
    if ledger is not None:
        ledger.record(op, group_ranks=group_ranks, tensor_bytes=tensor_bytes, tag=tag)
