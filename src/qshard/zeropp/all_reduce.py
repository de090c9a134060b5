"""HSDP's inter-node gradient reduction: the replicate all-reduce, compressed or recorded.

FSDP2's HSDP reduce-scatters each FSDP unit's gradients inside the node, then all-reduces the
shard across the ``replicate`` mesh dim (the ranks with the same local rank on every node):
the only cross-node traffic of a step. Two FSDP2 seams carry it (torch 2.13):

* native HSDP (``fully_shard(mesh=<2-D mesh>)``): FSDP2 runs its own ``dist.all_reduce`` and
  then calls the module's all-reduce hook on the result; :class:`RecordingAllReduceHook` only
  records that all-reduce in the active ledger (numerics untouched);
* [Note: HSDP through the all-reduce hook] FSDP2 has no switch that skips its replicate
  all-reduce and still hands back gradients: ``set_requires_all_reduce(False)`` keeps the
  reduce-scattered shard in a private accumulator and leaves ``param.grad`` unset until an
  all-reduce runs (gradient accumulation; checked in torch 2.13). So a compressed reduction is
  FSDP2 over the node-sized ``mesh["shard"]`` (whose root mesh is the 2-D HSDP mesh), with
  :class:`ReplicateAllReduce` installed by ``set_all_reduce_hook``: FSDP2 calls it on every
  unit's reduce-scattered shard (already the node's mean) before writing the gradients.

[Note: replicate all-reduce hops] ``ReplicateAllReduce`` is a reduce-scatter plus all-gather
over the ``N`` replicate ranks, each hop in qgZ's wire format (:class:`~qshard.zeropp._wire.
RowCodec`: rows of ``[fp32 block absmax | INT8/INT4 codes]``, or 16-bit values): the shard of
``S`` elements is zero-padded to ``N`` chunks of ``c`` elements (``c`` a multiple of 4 blocks,
as qgZ's rows); hop 1 (all-to-all) sends chunk ``j`` to rank ``j``, which dequantizes the ``N``
received chunks and sums them in fp32, divides by ``N``, and re-quantizes its mean chunk; hop 2
(all-gather) gives every rank every mean chunk, dequantized. Every rank decodes the same bytes
(the owner decodes its own chunk too), so replicas stay bit-identical.

[Note: the shard size travels with hop 1] Each hop-1 row ends in 8 bytes holding the sender's
shard size ``S``. FSDP2 reduce-scatters only the parameters that got a gradient, so a parameter
used on one node's ranks and not on another's in the same step (a data-dependent branch, an MoE
expert without tokens) gives the nodes shards of different sizes. When those pad to the same
``N * c``, hop 1 averaged misaligned elements without a word: wrong gradients for the unit's
other parameters and replicas that drifted apart (a first-user probe: relative gradient error
0.3-0.8 where INT8 gives 0.009). FSDP2's own HSDP fails there with a gloo error. Every rank
receives every sender's size, so all refuse a mismatch alike, before hop 2, naming
``set_reduce_scatter_unused_params(True)``. Cost: ``8 N`` bytes per unit and step.

[Note: deferred replicate all-reduce] FSDP2 calls the all-reduce hook synchronously, and on
CPU both hops crossed the slow inter-node link while the backward thread waited: HSDP with a
compressed reduction overlapped no communication with compute. After the hook FSDP2 does with
the output only what it does after a reduce-scatter ([Note: deferred qgZ] in
``qshard/zeropp/_overlap.py``), so under the same conditions (no accumulation into an existing
gradient, no post-accumulate-grad hook, cast or post-divide) the hook defers: it encodes and
issues hop 1 and returns; the next unit's hook call (every rank at the same program point) waits
for hop 1, which had that unit's backward to arrive, reduces and issues hop 2; a later call or
the end of backward writes the mean once hop 2 has arrived (CPU only: on CUDA the hook runs on
FSDP2's all-reduce stream, which overlaps it already). ``backward()`` returns with every
gradient written, as before. :class:`_Reduction` is the one sequence of steps both paths run,
so the bits and bytes are the same. A size mismatch between nodes is then raised at the step
that reads hop 1, from the next call or the drain, wrapped in the queue's error.

Error bound (per element of block ``k``, ``q = 2**(bits-1) - 1``, round to nearest): with
``A_i`` the absmax of block ``k`` of rank ``i``'s input and ``B`` the absmax of the mean
block that hop 2 quantizes, ``|out - mean_i x_i| <= (sum_i A_i / N + B) / (2 q)`` plus fp32
rounding (a few ulps of those absmaxes). With error feedback, each hop adds what it lost the
previous step to its input (worker error per rank, server error per owned chunk).

[Note: non-finite replicate reduction] A NaN or +-Inf gradient makes its block dequantize to
NaN (the block format's contract), the fp32 sum keeps it, and hop 2 sends the NaN block: a
non-finite input never comes back finite. An error-feedback buffer that became non-finite is
zeroed after the step, so one bad step does not poison every later one.

[Note: set_requires_all_reduce on the hook path] On FSDP2 over ``mesh["shard"]`` (1-D) FSDP2
has no all-reduce group, so ``set_requires_all_reduce(False)`` changes nothing there: it calls
the all-reduce hook after every backward anyway (torch 2.13 ``foreach_reduce``). A torchtitan
user's HSDP gradient accumulation (reduce-scatter every micro-batch, cross the nodes once at
the last) therefore sent the compressed reduction of every micro-batch across nodes: K times
the bytes for K micro-batches (found by a probe: 960 inter-node bytes per micro-batch for
INT8 where FSDP2's HSDP sends 0, 0, then its one all-reduce). Given its ``module``,
:class:`ReplicateAllReduce` honours the flag as FSDP2's native HSDP does: while the unit's
``all_reduce_grads`` is off it adds the node-reduced shard to its own fp32 accumulator and
zeroes the output (FSDP2 then accumulates zeros into ``param.grad``); the next call with it on
adds the accumulator and reduces the sum once. Every step is linear (FSDP2's post-divide runs
after the hook on the sum), so the gradient is the mean over micro-batches and nodes.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from qshard._fsdp import fsdp_param_groups
from qshard.comm import duplex
from qshard.comm.ledger import active_ledger, record
from qshard.zeropp._common import (
    WIRE_DTYPES,
    SizeVerdict,
    frame_numel,
    group_ranks,
    log_once,
    logger,
    unequal_shards,
)
from qshard.zeropp._overlap import OverlapQueue, defer_reason
from qshard.zeropp._wire import RowCodec, int64_bytes, int64s

__all__ = ["TAG", "RecordingAllReduceHook", "ReplicateAllReduce"]

TAG = "grad_all_reduce"


class RecordingAllReduceHook:
    """Records native HSDP's replicate all-reduce (FSDP2 ran it before calling this hook).

    FSDP2 all-reduces the reduce-scattered shard in the reduce dtype over ``group``; gloo and
    NCCL run it as a ring (the ledger's ``all_reduce`` cost model). Numerics untouched.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.ranks = group_ranks(group)

    def __call__(self, output: torch.Tensor) -> None:
        record(
            "all_reduce",
            group_ranks=self.ranks,
            tensor_bytes=output.numel() * output.element_size(),
            tag=TAG,
        )


#: Bytes of the shard-size header each hop-1 row carries ([Note: the shard size travels with
#: hop 1]).
_SIZE_BYTES = 8


class ReplicateAllReduce:
    """The mean of a gradient shard over HSDP's replicate group, in two compressed hops.

    See [Note: replicate all-reduce hops]. Installed per FSDP unit with
    ``FSDPModule.set_all_reduce_hook`` on FSDP2 over ``mesh["shard"]`` (see
    [Note: HSDP through the all-reduce hook]); callable on any flat tensor, in place.

    Args:
        group: the replicate group (one rank per node, same local rank).
        bits: 8 or 4 (block-quantized, qgZ's format), or ``None`` to send ``wire_dtype``.
        block_size: elements per quantization block (multiple of 8).
        wire_dtype: with ``bits=None``: ``torch.bfloat16`` / ``torch.float16`` (16-bit wire)
            or ``None`` (fp32; then this is a plain all-reduce with ``AVG``).
        error_feedback: keep each hop's compression loss and add it to the next call's input
            (buffers per call size: one instance serves one FSDP unit).
        module: the FSDP unit this hook is installed on. With it, the unit's
            ``set_requires_all_reduce(False)`` defers the cross-node reduction to the next
            backward with it on, as on FSDP2's native HSDP (see [Note: set_requires_all_reduce
            on the hook path]); without it every call reduces.
        twin: a second group of the ranks of a 2-rank ``group``
            (:meth:`qshard.comm.Topology.twin_for`): on gloo both hops then exchange both ways
            at once (:mod:`qshard.comm.duplex`); same bits.
        overlap: inside backward, where FSDP2 only views the output afterwards, return after
            issuing hop 1 and finish while the next units' backward runs (see [Note: deferred
            replicate all-reduce]; needs ``module``); same bits and bytes.
        queue: the progress queue shared by every hook over the same ``group`` (they must
            issue their collectives in one order); each hook makes its own otherwise.
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup,
        bits: int | None,
        block_size: int = 256,
        wire_dtype: torch.dtype | None = None,
        error_feedback: bool = False,
        module: torch.nn.Module | None = None,
        twin: dist.ProcessGroup | None = None,
        overlap: bool = False,
        queue: OverlapQueue | None = None,
    ) -> None:
        if bits not in (None, 4, 8):
            raise ValueError(f"bits must be 4, 8 or None; got {bits}")
        if not isinstance(block_size, int) or block_size < 8 or block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8; got {block_size!r}")
        if wire_dtype is not None and wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be None, bf16 or fp16; got {wire_dtype}")
        if error_feedback and bits is None and wire_dtype is None:
            raise ValueError("error_feedback needs a lossy wire: set bits or wire_dtype")
        self.group = group
        self.twin = twin
        self.ranks = group_ranks(group)
        self.bits = bits
        self.block_size = block_size
        self.wire_dtype = wire_dtype
        self.error_feedback = error_feedback
        self.codec = RowCodec(bits=bits, block_size=block_size, wire_dtype=wire_dtype)
        # Quantized chunks hold whole groups of 4 blocks, as qgZ's rows (16-byte aligned).
        self._unit = 4 * block_size if bits is not None else 8
        # keyed by (shard size, chunk): the chunk follows the frame, which a frozen parameter
        # changes for the same shard size ([Note: the shard size travels with hop 1])
        self._errors: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        if module is not None and not callable(getattr(module, "_get_fsdp_state", None)):
            raise TypeError(
                f"module must be the FSDP unit the hook is installed on (fully_shard's result); "
                f"got {type(module).__name__}: pass the module set_all_reduce_hook is called on, "
                "or leave module=None"
            )
        self._module = weakref.ref(module) if module is not None else None
        self._pending: torch.Tensor | None = None  # micro-batches whose reduction is deferred
        self._warned_resize = False
        self._sizes = SizeVerdict(self._refuse_sizes)  # hop 1's senders' shard sizes
        self.overlap = bool(overlap)
        self.queue = queue if queue is not None else OverlapQueue("replicate all-reduce")

    def chunk_numel(self, numel: int) -> int:
        """Elements of one rank's chunk for a shard of ``numel`` elements (padded)."""
        n = len(self.ranks)
        return max(1, -(-numel // (n * self._unit))) * self._unit

    def wire_bytes(self, numel: int) -> int:
        """Bytes this rank sends in hop 1 (its whole all-to-all input, each row with its
        8-byte size header) for ``numel`` elements; hop 2 sends one row of
        ``codec.row_bytes(chunk_numel(numel))``."""
        c = self.chunk_numel(numel)
        return len(self.ranks) * (self.codec.row_bytes(c) + _SIZE_BYTES)

    def reset(self) -> None:
        """Forget the error-feedback buffers and any deferred micro-batches."""
        self._errors.clear()
        self._pending = None

    def _frame_size(self, numel: int) -> int:
        """The shard size hop 1's rows are framed for (:func:`frame_numel`): a node whose
        shard lacks a parameter's gradient sends rows of the other nodes' length, so every
        rank refuses the sizes alike (sizes far apart made gloo abort the process)."""
        return frame_numel(self._module() if self._module is not None else None, numel)

    def _requires_all_reduce(self) -> bool:
        """The unit's ``set_requires_all_reduce`` flag (FSDP2 keeps it on its param groups)."""
        module = self._module() if self._module is not None else None
        if module is None:
            return True
        groups = fsdp_param_groups(module) or ()  # [Note: FSDP2 across torch versions]
        return all(getattr(g, "all_reduce_grads", True) for g in groups)

    def __call__(self, output: torch.Tensor) -> None:
        # see [Note: set_requires_all_reduce on the hook path]
        if not self._requires_all_reduce():
            if self._pending is None:
                self._pending = output.detach().to(torch.float32, copy=True)
            else:
                self._check_pending(output)
                self._pending += output
            output.zero_()
            return
        if self._pending is not None:
            self._check_pending(output)
            pending, self._pending = self._pending, None
            output.copy_(pending.add_(output))
        n = len(self.ranks)
        if n == 1:
            log_once("replicate-one-node", "HSDP on one node: no replicate all-reduce")
            if (ledger := active_ledger()) is not None:
                ledger.count("replicate_single_node")
            return
        if self.bits is None and self.wire_dtype is None:
            self.queue.drain()
            record(
                "all_reduce",
                group_ranks=self.ranks,
                tensor_bytes=output.numel() * output.element_size(),
                tag=TAG,
            )
            dist.all_reduce(output, op=dist.ReduceOp.AVG, group=self.group)
            return
        module = self._module() if self._module is not None else None
        if (
            self.overlap
            and output.device.type == "cpu"  # CUDA: FSDP2's all-reduce stream overlaps already
            and output.is_contiguous()
            and defer_reason(module, output, in_all_reduce_hook=True) is None
        ):
            self.queue.prepare()  # older reductions issue what they can first
            self.queue._push(_Reduction(self, output.view(-1), out=output))
            if (ledger := active_ledger()) is not None:
                ledger.count("replicate_overlapped")
            return
        self.queue.drain()
        output.copy_(self.reduce(output.reshape(-1)).view(output.shape))

    def _refuse_sizes(self, sizes: list[int]) -> None:
        """[Note: the shard size travels with hop 1]: the nodes' shards differ in size."""
        module = self._module() if self._module is not None else None
        raise RuntimeError(
            "HSDP's replicate all-reduce got gradient shards of different sizes from the "
            f"nodes (elements per replicate rank {self.ranks}: {sizes}): "
            + unequal_shards("nodes' ranks", module)
        )

    def _check_pending(self, output: torch.Tensor) -> None:
        if self._pending.shape != output.shape:
            raise RuntimeError(
                f"the gradient shard of this FSDP unit changed size ({tuple(output.shape)} vs "
                f"{tuple(self._pending.shape)}) between micro-batches whose all-reduce was "
                "deferred by set_requires_all_reduce(False): a parameter got a gradient in some "
                "micro-batches only. Give every trainable parameter of the unit a gradient in "
                "every micro-batch, or use set_requires_gradient_sync(False) instead"
            )

    def _warn_resize(self, size: int) -> None:
        """[Note: error feedback keyed by size] FSDP2 hands the hook a unit's gradient shard
        and nothing about which parameters it holds; the buffers are kept per shard size and
        chunk (the chunk follows the frame of [Note: the shard size travels with hop 1], which
        a frozen or unfrozen parameter changes for the same shard size: one buffer per size
        raised a shape error on the step after an unused parameter was frozen). A unit whose
        set of parameters with a gradient changes between steps (a branch or an expert unused
        in some steps) shows up here as a new size: its residuals are kept apart, but two
        different sets of equal size would share a buffer. Warned once per hook."""
        self._warned_resize = True
        module = self._module() if self._module is not None else None
        if module is not None and callable(
            getattr(module, "set_reduce_scatter_unused_params", None)
        ):
            fix = (
                "call set_reduce_scatter_unused_params(True) on the model (FSDP2 then reduces "
                "every trainable parameter in every step, zeros for unused ones, so the shard "
                "keeps one size)"
            )
        else:
            fix = "give every trainable parameter of the unit a gradient in every step"
        sizes = sorted({numel for numel, _ in self._errors})
        change = (
            f"changed size ({sizes} -> {size} elements)"
            if size not in sizes
            else f"kept its size ({size} elements) under another set of trainable parameters"
        )
        logger.warning(
            "replicate error feedback: this FSDP unit's gradient shard %s: a parameter got no "
            "gradient in some steps, or was frozen or unfrozen. The error buffers are kept per "
            "size, so two different sets of parameters of equal size would share one. To keep "
            "them matched, %s, or turn replicate_error_feedback off.",
            change,
            fix,
        )

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The compressed mean of flat ``x`` over the group (a new fp32 tensor, same on every
        rank). Collective."""
        reduction = _Reduction(self, x.reshape(-1))
        reduction.issue()
        reduction.finish(block=True)
        return reduction.mean


class _Reduction:
    """One replicate all-reduce as a state machine: construction encodes the input and issues
    hop 1 (all-to-all), :meth:`issue` waits for it, reduces in fp32, re-encodes the owned mean
    chunk and issues hop 2 (all-gather), :meth:`finish` decodes what hop 2 delivered into
    ``out`` (or into :attr:`mean` without one). The synchronous call runs the steps at once,
    the deferred one spreads them over the backward ([Note: deferred replicate all-reduce]);
    the arithmetic is the same."""

    __slots__ = ("c", "comm", "errors", "gathered", "hop1", "hop2", "mean", "out", "rb", "size")

    def __init__(
        self, comm: ReplicateAllReduce, x: torch.Tensor, *, out: torch.Tensor | None = None
    ) -> None:
        comm._sizes.check()  # a GPU call's sizes outside a backward, read one call late
        n = len(comm.ranks)
        size = x.numel()
        c = comm.chunk_numel(comm._frame_size(size))
        codec = comm.codec
        self.comm, self.size, self.c = comm, size, c
        self.out = out
        self.mean: torch.Tensor | None = None
        self.hop2: dist.Work | None = None
        self.gathered: torch.Tensor | None = None
        errors = None
        if comm.error_feedback:
            errors = comm._errors.get((size, c))
            if errors is None:
                if comm._errors and not comm._warned_resize:
                    comm._warn_resize(size)
                errors = tuple(
                    torch.zeros(k, dtype=torch.float32, device=x.device) for k in (n * c, c)
                )
                comm._errors[size, c] = errors
            # error + input in the worker error itself, which takes the residual below: no
            # bucket-sized temporary (the same sums: float addition commutes)
            xin = errors[0]
            xin[size:].zero_()  # the padding carries nothing
            xin[:size].add_(x)
        elif size == n * c and x.dtype == torch.float32 and x.is_contiguous():
            xin = x  # read in place: nothing to pad
        else:
            xin = torch.zeros(n * c, dtype=torch.float32, device=x.device)
            xin[:size] = x
        self.errors = errors
        # [Note: the shard size travels with hop 1] Every row carries the sender's shard size
        # (8 bytes), so every rank sees every other's and all refuse a mismatch alike; the
        # codec writes and reads the rows in place ([Note: a trailer after each row]).
        rb = self.rb = codec.row_bytes(c)
        framed = torch.empty((n, rb + _SIZE_BYTES), dtype=torch.uint8, device=x.device)
        send = codec.encode(xin.view(n, c), out=framed[:, :rb])
        framed[:, rb:] = int64_bytes([size], x.device)
        if errors is not None:
            torch.sub(xin, codec.decode(send, c).view(-1), out=errors[0])
        recv = torch.empty_like(framed)
        record("all_to_all", group_ranks=comm.ranks, tensor_bytes=framed.numel(), tag=TAG)
        work = duplex.all_to_all_single(recv, framed, comm.group, twin=comm.twin, async_op=True)
        self.hop1: tuple[dist.Work, torch.Tensor] | None = (work, recv)

    def issue(self) -> None:
        """Wait for hop 1, reduce, and issue hop 2 (once)."""
        if self.hop1 is None:
            return
        comm, c, rb, errors, codec = self.comm, self.c, self.rb, self.errors, self.comm.codec
        work, recv = self.hop1
        self.hop1 = None
        work.wait()
        comm._sizes.put(int64s(recv[:, rb:]))
        n = len(comm.ranks)
        mean = codec.reduce(recv[:, :rb], c).div_(n)  # fp32 between the hops
        if errors is not None:
            mean += errors[1]
        own = codec.encode(mean.view(1, c))
        if errors is not None:
            torch.sub(mean, codec.decode(own, c).view(-1), out=errors[1])
            for e in errors:  # see [Note: non-finite replicate reduction]
                torch.nan_to_num_(e, nan=0.0, posinf=0.0, neginf=0.0)
        gathered = torch.empty((n, own.shape[1]), dtype=torch.uint8, device=mean.device)
        record("all_gather", group_ranks=comm.ranks, tensor_bytes=gathered.numel(), tag=TAG)
        self.hop2 = duplex.all_gather_single(
            gathered.view(-1), own.view(-1), comm.group, twin=comm.twin, async_op=True
        )
        self.gathered = gathered

    def finish(self, *, block: bool) -> bool:
        """Decode hop 2 once it arrived (waiting, if ``block``) and write the output; True once
        written. Issues nothing."""
        if self.gathered is None:
            return False  # hop 2 not issued yet
        if self.hop2 is not None:
            if not block and not self.hop2.is_completed():
                return False
            self.hop2.wait()
            self.hop2 = None
        gathered, c, size, out = self.gathered, self.c, self.size, self.out
        self.gathered = None
        codec = self.comm.codec
        if out is None or not out.is_contiguous() or codec.bits is None:
            mean = codec.decode(gathered, c).view(-1)[:size]
            if out is None:
                self.mean = mean
            else:
                out.copy_(mean.view(out.shape))
            return True
        # quantized rows decoded straight into ``out``, a partial last one through a temporary
        flat, full = out.view(-1), size // c
        rows = [flat[r * c : (r + 1) * c] for r in range(full)]
        if full:
            codec.decode_slots(gathered[:full], c, rows, [(0, c, c)])
        if size > full * c:
            last = codec.decode(gathered[full : full + 1], c).view(-1)
            flat[full * c :].copy_(last[: size - full * c])
        return True
