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

import contextlib
import math
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from qshard.comm.ledger import active_ledger
from qshard.quant.signs import _unpack_signs_into, pack_signs, unpack_signs

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


@torch.no_grad()
def compressed_all_reduce(
    tensors: Sequence[torch.Tensor],
    worker_errors: Sequence[torch.Tensor],
    server_errors: Sequence[torch.Tensor],
    *,
    masks: Sequence[torch.Tensor | None] | None = None,
    group: dist.ProcessGroup | None = None,
    tag: str = "compressed_all_reduce",
    out: Sequence[torch.Tensor] | None = None,
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
        out: optional contiguous float32 tensors of the inputs' shapes to write the results
            into (outside autograd); ``out[i]`` may be ``tensors[i]`` itself (1-bit Adam
            averages its momenta in place) and may share memory with nothing else (refused).
            On a CPU the round then allocates only its server slice (1/n of the bucket) and
            one tensor's scratch; see [Note: two implementations]. If a collective fails,
            ``out`` (and so an input it aliases) holds unspecified values; the error buffers
            are left as they were.

    Returns:
        The compressed average of ``tensors``, identical on every rank: ``out`` when given,
        new tensors otherwise.
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
    if out is not None:
        _check_out(tensors, out, [*worker_errors, *server_errors])
    if n > 1:
        _check_same_layout(tensors, masks, group, group_ranks, tag)
    bucket = _Bucket(
        tensors,
        worker_errors,
        server_errors,
        masks,
        numels,
        chunks,
        n,
        rank,
        group,
        group_ranks,
        tag,
    )
    if _per_tensor(bucket):
        if out is None:
            out = [torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in tensors]
        return _per_tensor_round(bucket, list(out))
    results = _vectorized_round(bucket)
    if out is None:
        return results
    for o, result in zip(out, results):
        o.copy_(result)
    return list(out)


def _check_out(
    tensors: Sequence[torch.Tensor], out: Sequence[torch.Tensor], errors: Sequence[torch.Tensor]
) -> None:
    """Refuse an ``out`` the round cannot write, before anything is touched."""
    if len(out) != len(tensors):
        raise ValueError(
            f"need one out tensor per tensor; got {len(out)} for {len(tensors)}"
            + _single_tensor_hint(out)
        )
    for i, (o, t) in enumerate(zip(out, tensors)):
        if (
            o.dtype != torch.float32
            or o.shape != t.shape
            or o.device != t.device
            or not o.is_contiguous()
        ):
            raise ValueError(
                f"out[{i}] must be a contiguous float32 tensor of shape {tuple(t.shape)} on "
                f"{t.device}; got {o.dtype} of shape {tuple(o.shape)} on {o.device} "
                f"(contiguous={o.is_contiguous()})"
            )
    _refuse_overlaps(tensors, out, errors)


def _refuse_overlaps(tensors, out, errors) -> None:
    """``out[i]`` may be ``tensors[i]`` itself and share memory with nothing else: the round
    writes ``out[i]`` before it reads later inputs and before it writes the errors, so another
    input, another ``out`` or an error buffer under it came back silently wrong."""
    out_storages = {o.untyped_storage().data_ptr() for o in out if o.numel()}
    shared: dict[int, list[tuple[str, int, torch.Tensor]]] = {}
    for kind, group in (("tensors", tensors), ("out", out), ("an error buffer", errors)):
        for j, t in enumerate(group):
            if t.numel() and (ptr := t.untyped_storage().data_ptr()) in out_storages:
                shared.setdefault(ptr, []).append((kind, j, t))
    for entries in shared.values():
        if len(entries) == 2 and _is_own_input(*entries):  # out=tensors: the common case
            continue
        for kind, i, o in entries:
            if kind != "out":
                continue
            for other_kind, j, t in entries:
                if (other_kind, j) == ("out", i) or not _overlap(o, t):
                    continue
                if other_kind == "tensors" and j == i and _same_memory(o, t):
                    continue
                other = (
                    "an error buffer" if other_kind == "an error buffer" else f"{other_kind}[{j}]"
                )
                raise ValueError(
                    f"out[{i}] shares memory with {other}: out[i] may be tensors[i] itself "
                    "and nothing else (the round writes it before it reads the other inputs "
                    "and before it writes the errors); pass separate tensors"
                )


def _is_own_input(a: tuple[str, int, torch.Tensor], b: tuple[str, int, torch.Tensor]) -> bool:
    return a[0] == "tensors" and b[0] == "out" and a[1] == b[1] and _same_memory(a[2], b[2])


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges that ``a`` and ``b`` span (first to last element) intersect."""

    def span(t: torch.Tensor) -> tuple[int, int]:
        extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
        return t.data_ptr(), t.data_ptr() + t.element_size() * extent

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


# [Note: two implementations] One round is the same arithmetic in two shapes. On a CPU
# (gloo) `_per_tensor_round` walks the tensors: tensor i's values are one contiguous slice (its
# ``out`` tensor), its scale a norm of that slice, its signs and scales applied per slice, and
# the destination-major wire rows are assembled from the tensors' packed bytes. On an
# accelerator `_vectorized_round` handles the whole bucket in a few large kernels and finds
# each element's tensor through a per-element index (``seg_ids``), with no host sync. The index
# costs little on a GPU, but on a CPU the gather / scatter-add by index and ``torch.where``
# with scalars run 5-30x slower than plain elementwise passes, and the bucket-sized buffers
# are page-faulted anew on every call: on a 2-core host the vectorized round of a 3.26 M
# element, 52-tensor bucket took 168-239 ms, the per-tensor one 28-29 ms, 15-17 ms with
# ``out=`` the inputs (`benchmarks/onebit_step.py`, docs/results/onebit_step.md). They differ only in the order of floating-point sums
# (a scale's last bits) and in the signs sent for padding, which no one reads; every
# reference and property test runs on both.
class _Bucket(NamedTuple):
    tensors: Sequence[torch.Tensor]
    worker_errors: Sequence[torch.Tensor]
    server_errors: Sequence[torch.Tensor]
    masks: Sequence[torch.Tensor | None]
    numels: list[int]
    chunks: list[int]
    n: int
    rank: int
    group: dist.ProcessGroup | None
    group_ranks: list[int]
    tag: str


def _per_tensor(bucket: _Bucket) -> bool:
    """Which implementation runs; see [Note: two implementations]."""
    return bucket.tensors[0].device.type == "cpu"


@contextlib.contextmanager
def _forced_round(name: str):
    """Run every round with implementation ``name`` (``"per_tensor"`` or ``"vectorized"``),
    whatever the device: for tests and benchmarks that compare the two."""
    if name not in ("per_tensor", "vectorized"):
        raise ValueError(f"name must be 'per_tensor' or 'vectorized'; got {name!r}")
    global _per_tensor
    saved = _per_tensor
    _per_tensor = lambda bucket: name == "per_tensor"  # noqa: E731
    try:
        yield
    finally:
        _per_tensor = saved


def _exchange_workers(b: _Bucket, scales: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Send every destination its row ``[scales | packed signs | pad]`` (``signs``: (n,
    width / 8) bytes, destination-major) and return the rows received, one per source rank."""
    num = len(b.tensors)
    row = _row_bytes(num, signs.shape[1])  # see [Note: wire rows]
    send = torch.empty(b.n, row, dtype=torch.uint8, device=signs.device)
    send.view(torch.float32)[:, :num] = scales
    send[:, 4 * num : 4 * num + signs.shape[1]] = signs
    send[:, 4 * num + signs.shape[1] :] = 0
    if b.n == 1:  # one rank is its own server: nothing to exchange
        return send
    recv = torch.empty_like(send)
    _record("all_to_all", b.group_ranks, send.numel(), b.tag)
    dist.all_to_all_single(recv, send, group=b.group)
    return recv


def _exchange_servers(b: _Bucket, scales: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """All-gather every server's row ``[scales | packed signs | pad]``: (n, row) bytes."""
    num = len(b.tensors)
    row = _row_bytes(num, signs.numel())
    payload = torch.empty(row, dtype=torch.uint8, device=signs.device)
    payload.view(torch.float32)[:num] = scales
    payload[4 * num : 4 * num + signs.numel()] = signs
    payload[4 * num + signs.numel() :] = 0
    if b.n == 1:
        return payload.view(1, row)
    gathered = torch.empty(b.n, row, dtype=torch.uint8, device=signs.device)
    _record("all_gather", b.group_ranks, gathered.numel(), b.tag)
    _all_gather_single(gathered, payload, b.group)
    return gathered


def _per_tensor_round(b: _Bucket, outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One round, tensor by tensor (CPU; see [Note: two implementations]). Tensor i's value
    ``x = error + input`` is built in ``outs[i]`` (which may be the input itself) and replaced
    there by the result at the end; its padding, always invalid, is not stored: it sends no
    sign that anyone reads and its error stays zero."""
    n, rank, num = b.n, b.rank, len(b.tensors)
    masks = [None if m is None else m.reshape(-1) for m in b.masks]
    scratch = torch.empty(n * max(b.chunks), dtype=torch.float32)  # one tensor's signs

    # Worker side.
    xs, counts = [], []
    for t, ew, out, mask, k in zip(b.tensors, b.worker_errors, outs, masks, b.numels):
        x = out.view(-1)
        torch.add(ew.reshape(-1)[:k], t.detach().reshape(-1), out=x)  # errors of any layout
        if mask is not None:
            x.mul_(mask)  # invalid elements carry no value and no error
        xs.append(x)
        counts.append(k if mask is None else int(mask.sum()))
    worker_scales = torch.stack(torch._foreach_norm(xs)) / _root(counts)
    packed = [pack_signs(x) for x in xs]  # ceil(k / 8) bytes each; chunks start on bytes
    row_signs = torch.zeros(n, sum(b.chunks) // 8, dtype=torch.uint8)  # destination-major
    for p, c, cols in zip(packed, b.chunks, _byte_columns(row_signs, b.chunks)):
        padded = torch.zeros(n * c // 8, dtype=torch.uint8)
        padded[: p.numel()] = p
        cols.copy_(padded.view(n, c // 8))
    recv = _exchange_workers(b, worker_scales, row_signs)

    # Server side: this rank reduces chunk `rank` of every tensor, into its slice of y.
    sign_bytes = row_signs.shape[1]
    recv_scales = recv.view(torch.float32)[:, :num]  # (n, num), a view: rows are 4-aligned
    finite = torch.isfinite(recv_scales).all(0)  # [Note: non-finite inputs]
    y_all = torch.empty(sum(b.chunks), dtype=torch.float32)
    ys = list(y_all.split(b.chunks))
    mine = []  # per tensor: the valid prefix of this rank's chunk, and the mask over it
    cols = _byte_columns(recv[:, 4 * num : 4 * num + sign_bytes], b.chunks)
    for i, (y, col, c, k, mask) in enumerate(zip(ys, cols, b.chunks, b.numels, masks)):
        signs = scratch[: n * c]
        _unpack_signs_into(col.reshape(-1), signs)
        torch.mv(signs.view(n, c).t(), recv_scales[:, i], out=y)
        length = min(max(k - rank * c, 0), c)
        mine.append((length, None if mask is None else mask[rank * c : rank * c + length]))
    y_all.div_(n)
    for y, (length, part) in zip(ys, mine):
        _zero_invalid(y, length, part)
    torch._foreach_add_(ys, [es.reshape(-1) for es in b.server_errors])
    my_counts = [length if part is None else int(part.sum()) for length, part in mine]
    server_scales = torch.stack(torch._foreach_norm(ys)) / _root(my_counts)
    server_scales = torch.where(finite, server_scales, math.nan)
    server_packed = pack_signs(y_all)  # chunks are whole bytes: tensor i's are contiguous
    gathered = _exchange_servers(b, server_scales, server_packed)

    # The errors are written only now (see _vectorized_round): what the signs on the wire
    # (unpacked from the bytes sent) times the scale missed, zero where invalid.
    out_scales = gathered.view(torch.float32)[:, :num]  # (n, num)
    ok = (finite & torch.isfinite(out_scales).all(0)).tolist()
    server_signs = server_packed.split([c // 8 for c in b.chunks])
    cols = _byte_columns(gathered[:, 4 * num : 4 * num + sign_bytes], b.chunks)
    for i, (x, y, ew, es, col) in enumerate(zip(xs, ys, b.worker_errors, b.server_errors, cols)):
        c, k, mask, out = b.chunks[i], b.numels[i], masks[i], outs[i].view(-1)
        if not ok[i]:  # the errors stay as they were; see [Note: non-finite inputs]
            out.fill_(math.nan)
            continue
        sent = scratch[:k]
        _unpack_signs_into(packed[i], sent)
        _zero_invalid(sent, k, mask)
        _store(ew, x, sent, worker_scales[i])
        length, part = mine[i]
        sent = scratch[:c]
        _unpack_signs_into(server_signs[i], sent)
        _zero_invalid(sent, length, part)
        _store(es, y, sent, server_scales[i])
        # the result, row by row (row r: server r's chunk, at its scale), over the values
        full, rest = divmod(k, c)
        _unpack_signs_into(col.reshape(-1)[: -(-k // 8)], out)
        out[: full * c].view(full, c).mul_(out_scales[:full, i : i + 1])
        if rest:
            out[full * c :].mul_(out_scales[full, i])
        if mask is not None:
            out.mul_(mask)
    return outs


def _root(counts: list[int]) -> torch.Tensor:
    """``sqrt(max(count, 1))`` per tensor: the divisor that makes a norm an RMS scale."""
    return torch.tensor(counts, dtype=torch.float32).clamp_min(1).sqrt()


def _store(buffer: torch.Tensor, x: torch.Tensor, sent: torch.Tensor, scale: torch.Tensor) -> None:
    """An error buffer (any shape and strides, read flat) <- ``x - sent * scale`` over its first
    ``x.numel()`` elements and zero beyond (the padding carries no error)."""
    k = x.numel()
    contiguous = buffer.is_contiguous()
    flat = buffer.view(-1) if contiguous else torch.empty(buffer.numel())
    torch.addcmul(x, sent, scale, value=-1, out=flat[:k])
    if k < flat.numel():
        flat[k:].zero_()
    if not contiguous:
        buffer.copy_(flat.view(buffer.shape))


def _byte_columns(rows: torch.Tensor, chunks: list[int]) -> list[torch.Tensor]:
    """Views of a 2-D tensor of packed signs, one block of columns per tensor (chunk ``c``
    of a tensor is ``c / 8`` bytes)."""
    return list(rows.split([c // 8 for c in chunks], dim=1))


def _zero_invalid(values: torch.Tensor, length: int, mask: torch.Tensor | None) -> None:
    """Zero flat ``values`` outside its valid elements: a prefix of ``length``, under
    ``mask`` (of ``length`` elements)."""
    if length < values.numel():
        values[length:].zero_()
    if mask is not None:
        values[:length].mul_(mask)


def _vectorized_round(b: _Bucket) -> list[torch.Tensor]:
    """One round over the whole bucket at once, segments found by a per-element index (for
    accelerators; see [Note: two implementations])."""
    tensors, worker_errors, server_errors, masks = (
        b.tensors,
        b.worker_errors,
        b.server_errors,
        b.masks,
    )
    numels, chunks, n, rank = b.numels, b.chunks, b.n, b.rank
    num = len(tensors)
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
    recv = _exchange_workers(b, worker_scales, pack_signs(signs.reshape(-1)).view(n, sign_bytes))

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

    gathered = _exchange_servers(b, server_scales, pack_signs(server_signs))

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
