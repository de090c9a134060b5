"""qwZ: the quantized weight all-gather, and the recording (plain) all-gather of the baseline.

Both implement FSDP2's ``AllGather`` comm interface (``allocate`` + ``__call__``) and are
installed with ``FSDPModule.set_custom_all_gather`` by :func:`qshard.zeropp.shard`. FSDP2
hands them one flat buffer per FSDP unit: this rank's shards of all the unit's parameters,
concatenated, in ``param_dtype``; the output is the same for every rank, rank-major.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
from torch.profiler import record_function

from qshard.comm import duplex
from qshard.comm.ledger import active_ledger, record
from qshard.comm.topology import Topology
from qshard.zeropp._common import DeferredWork, WireComm, group_ranks, log_once, phase_tag
from qshard.zeropp._wire import RowCodec, Slot

__all__ = ["QuantizedAllGather", "RecordingAllGather"]

_QUANTIZABLE = (torch.float32, torch.bfloat16, torch.float16)


def _padded_layout(sizes: Sequence[int], block_size: int) -> tuple[int, tuple[Slot, ...]]:
    """The padded row of [Note: qwZ block layout]: (its length, its slots for
    ``RowCodec.encode_slots``), one slot per parameter shard, each padded to whole blocks, so
    every shard starts on a block boundary; a single slot for one segment."""
    n = sum(sizes)
    if len(sizes) <= 1:
        padded = -(-n // block_size) * block_size
        return padded, ((0, n, padded),)
    slots, start = [], 0
    for size in sizes:
        slots.append((start, size, -(-size // block_size) * block_size))
        start += size
    return sum(p for _, _, p in slots), tuple(slots)


class RecordingAllGather(WireComm, AllGather):
    """FSDP2's plain all-gather, recorded in the active ledger (tags ``fwd_all_gather`` /
    ``bwd_all_gather``).

    Args:
        wire_dtype: ``None`` gathers the input as is (bit-identical to FSDP2's default);
            ``torch.bfloat16`` / ``torch.float16`` casts a wider float input to 16 bits for
            the wire and back to the input dtype after (the paper's 16-bit ZeRO-3 baseline).
        topology: when given, a gather over a 2-rank group of its inter-node or intra-node
            members (2 nodes of one rank, or hpZ's node-sized group of 2) exchanges both ways
            at once on gloo (:mod:`qshard.comm.duplex`); same bits.
    """

    def _plain(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        ranks: list[int],
        async_op: bool,
    ) -> dist.Work | None:
        wire = self.wire_dtype
        tag = phase_tag("all_gather")
        if (
            wire is None
            or not input_tensor.is_floating_point()
            or input_tensor.element_size() <= wire.itemsize
        ):
            record(
                "all_gather",
                group_ranks=ranks,
                tensor_bytes=output_tensor.numel() * output_tensor.element_size(),
                tag=tag,
            )
            with record_function("qshard::all_gather::transfer"):  # all of it when sync
                work = duplex.all_gather_single(
                    output_tensor, input_tensor, group, twin=self.twin(group), async_op=async_op
                )
            # FSDP2 waits on a raw handle inside its copy-out; this one's wait is its own range.
            return DeferredWork([work], label="all_gather") if async_op else work
        with record_function("qshard::all_gather::quantize"):
            wire_in = input_tensor.to(wire)
        wire_out = torch.empty(output_tensor.shape, dtype=wire, device=output_tensor.device)
        record(
            "all_gather",
            group_ranks=ranks,
            tensor_bytes=wire_out.numel() * wire.itemsize,
            tag=tag,
        )
        with record_function("qshard::all_gather::transfer"):  # all of it when sync
            work = duplex.all_gather_single(
                wire_out, wire_in, group, twin=self.twin(group), async_op=async_op
            )
        return _finish(work, lambda: output_tensor.copy_(wire_out), async_op, "all_gather")

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        return self._plain(output_tensor, input_tensor, group, group_ranks(group), async_op)


def _finish(work: dist.Work | None, finish, async_op: bool, label: str) -> dist.Work | None:
    """Return a handle that runs ``finish`` after ``work`` (async), or run it now (sync);
    ``label`` names the profiler ranges (see :class:`DeferredWork`)."""
    handle = DeferredWork([work], finish, label=label)
    if async_op:
        return handle
    handle.wait()
    return None


class QuantizedAllGather(RecordingAllGather):
    """qwZ: block-quantize this rank's shard, all-gather codes and scales, dequantize.

    Every rank (this one included) dequantizes the same gathered codes, so all ranks compute
    with bit-identical weights. The shard is cut into blocks of ``block_size`` elements
    (zero-padded at the end; the padding is never written to the output); each block has
    its fp32 absmax (the quant core's block format: the block's largest magnitude comes back
    exactly), so the error per element is at most half a step, ``absmax_block / (2 * qmax)``
    (``qmax`` = 127 for INT8, 7 for INT4), plus the rounding of the result to the parameter
    dtype.

    [Note: qwZ block layout] FSDP2's flat input concatenates the shards of all the unit's
    parameters. Given ``segment_sizes`` (the per-parameter shard sizes, which
    :func:`qshard.zeropp.shard` reads from FSDP2's parameter group), every parameter's shard
    is padded to a whole number of blocks, so no block mixes two parameters: a LayerNorm
    weight of ones never sets the scale of a block of 0.02-sized matrix entries. Without it
    (or when the sizes do not add up to the input) the buffer is cut as one segment.

    [Note: qwZ route] A ring all-gather over all ``P`` ranks (gloo's, a NCCL ring) carries
    ``(P-1)/P`` of the gathered payload on every node's outgoing link, though only the other
    nodes' rows, ``(N-1)/N`` of it with ``N`` nodes, have to cross. So a cross-node gather
    over the topology's whole world in rank order (FSDP2's default 1-D mesh) with more than
    one rank per node runs in two hops:

    1. inter-node: this rank's wire row is all-gathered among its peers, the ranks with its
       local rank on every node (``Topology.inter_node_group``): ``N`` rows, in node order;
       each node sends ``(N-1)/N`` of the payload across nodes in all;
    2. intra-node: those ``N`` rows are all-gathered inside the node
       (``Topology.intra_node_group``), so every rank holds all rows, ordered
       ``[local rank][node]``.

    The rows are decoded in the order they arrived (each row decodes alone, so its values do
    not depend on where it sits) and written through a permuted view of the output into rank
    order (``rank = node * ranks_per_node + local_rank``): the output is bit-identical to the
    flat gather's, with no extra pass over the codes. With one rank per node hop 1 alone is
    the flat gather; a group that is not the world in rank order (a custom mesh) keeps the
    flat gather (logged once, counted as ledger event ``qwz_flat_gather``). The ledger records
    each hop over its own group, so its inter-node bytes are what the links carry. The price
    is a second collective's latency: on unshaped loopback links one block unit of the
    throughput GPT gathered in 1.24-1.27x the flat gather's time (docs/zeropp.md has the
    numbers); wherever the node link is the bottleneck the bytes saved count for more.
    Profiler ranges: ``qshard::qwz::transfer`` (issuing hop 1; both hops when synchronous),
    ``qshard::qwz::wait`` (blocked on hop 1), ``qshard::qwz::wait_intra`` (hop 2, issued and
    waited inside ``qshard::qwz::finish``, whose own time is the decoding).

    [Note: qwZ hop order] Every rank must issue the collectives of one process group in the
    same order. Hop 1 is issued at the call. Hop 2 is issued inside the handle's ``wait()``
    (just before dequantizing) on gloo, whose ``wait()`` blocks the host; on CUDA at the call,
    right behind hop 1's ``wait()``, which on NCCL makes the stream wait, not the host (not yet
    run on a GPU). Never from a future callback or another thread. FSDP2 calls its
    all-gathers and waits on their handles at the same program points on every rank (block
    order, its prefetches, the wait in ``finalize_backward`` of a prefetch nobody used), so
    with several gathers in flight (``prefetch_depth > 1``) the inter-node group sees the
    hop 1s in call order and the intra-node group the hop 2s in wait order (CUDA: call
    order), alike on every rank. qgZ's deferred reduce-scatter issues its hops on the same
    two groups, also at program points only (its call, a later qgZ call, the drain callback; see
    [Note: deferred qgZ]), so what a rank has issued on each group is a function of its
    program point alone, never of timing. A rank blocks only waiting for a collective that
    every rank issues at an earlier program point (hop 1 at the call, before its wait; hop 2
    is issued and waited at once), so the waits complete: no cross-group deadlock.

    A gather whose group lies inside one node (hpZ's backward gather, handed a node-sized
    group by FSDP2) is not quantized: it is the plain all-gather, in ``wire_dtype`` if set. On
    a single node that is every gather: logged once, counted as ledger event
    ``qwz_single_node``.

    With ``async_op=True`` the (first) collective starts now and the returned handle's
    ``wait()`` finishes the transfer and dequantizes (see [Note: deferred dequantization]).

    Args:
        topology: tells intra-node groups from cross-node ones; its groups carry the two hops
            (created on first use, collectively; :func:`qshard.zeropp.shard` creates them).
        bits: 8 (the paper) or 4 (two codes per byte).
        block_size: elements per block (multiple of 8).
        wire_dtype: the 16-bit wire format of the unquantized (intra-node) gathers, or None.
        segment_sizes: per-parameter shard sizes of the flat input, or a callable returning
            them (read at call time), or None; see [Note: qwZ block layout].
        hierarchical: ``False`` always takes the flat one-hop gather (same output bits, more
            inter-node bytes; the tests' reference); see [Note: qwZ route].
    """

    def __init__(
        self,
        *,
        topology: Topology,
        bits: int = 8,
        block_size: int = 256,
        wire_dtype: torch.dtype | None = None,
        segment_sizes: Sequence[int] | Callable[[], Sequence[int]] | None = None,
        hierarchical: bool = True,
    ) -> None:
        if not isinstance(topology, Topology):  # (None failed inside the first forward)
            raise TypeError(
                f"topology must be a qshard.comm.Topology; got {type(topology).__name__}: use "
                "Topology.from_env() (or Topology(world_size=..., ranks_per_node=...))"
            )
        super().__init__(wire_dtype=wire_dtype, topology=topology)
        if bits not in (4, 8):
            raise ValueError(f"bits must be 8 or 4; got {bits}")
        if block_size < 8 or block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8; got {block_size}")
        self.topology: Topology = topology
        self.codec = RowCodec(bits=bits, block_size=block_size)
        self.hierarchical = bool(hierarchical)
        self._segment_sizes = segment_sizes
        self._layouts: dict[tuple[int, ...], tuple[int, tuple[Slot, ...]]] = {}

    def _layout(self, n: int) -> tuple[int, tuple[Slot, ...]]:
        """(padded length, the slots of the padded row): see :func:`_padded_layout`."""
        sizes = self._segment_sizes() if callable(self._segment_sizes) else self._segment_sizes
        sizes = tuple(sizes) if sizes is not None and sum(sizes) == n else (n,)
        if sizes not in self._layouts:
            self._layouts[sizes] = _padded_layout(sizes, self.codec.block_size)
        return self._layouts[sizes]

    def _hop2_at_call(self, device: torch.device) -> bool:
        """Whether an async two-hop gather on ``device`` issues hop 2 at the call (CUDA, where
        ``Work.wait()`` makes the stream wait, not the host) rather than in the handle's
        ``wait()`` (gloo, whose ``wait()`` blocks); see [Note: qwZ hop order]."""
        return device.type == "cuda"

    def _two_hops(self, ranks: list[int]) -> bool:
        """Whether this cross-node gather over ``ranks`` takes the route of [Note: qwZ route]."""
        topo = self.topology
        if not self.hierarchical or topo.ranks_per_node == 1:
            return False  # one rank per node: hop 1 alone is the flat gather
        if ranks == list(range(topo.world_size)):
            return True
        log_once(
            f"qwz-flat-{ranks}",
            f"qwZ gathers over ranks {ranks}, not the topology's world in rank order "
            f"({topo}): using the flat one-hop gather, which carries more inter-node bytes "
            "(counted as event 'qwz_flat_gather' in the ledger)",
        )
        if (ledger := active_ledger()) is not None:
            ledger.count("qwz_flat_gather")
        return False

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        ranks = group_ranks(group)
        if self.topology.is_intra_node(ranks):
            if self.topology.num_nodes == 1 and len(ranks) > 1:
                log_once(
                    "qwz-one-node",
                    "qwZ on a single node: every gather stays inside the node and is sent "
                    "unquantized (counted as event 'qwz_single_node' in the ledger)",
                )
                if (ledger := active_ledger()) is not None:
                    ledger.count("qwz_single_node")
            return self._plain(output_tensor, input_tensor, group, ranks, async_op)
        if input_tensor.numel() == 0:
            # A unit whose parameters are all empty (frozen; shard() refuses trainable ones):
            # nothing to quantize, and wire rows of no elements divided by zero in the slot check
            return self._plain(output_tensor, input_tensor, group, ranks, async_op)
        if input_tensor.dtype not in _QUANTIZABLE:
            log_once(
                f"qwz-dtype-{input_tensor.dtype}",
                f"qwZ cannot quantize {input_tensor.dtype} all-gather inputs; sending them "
                "unquantized (counted as event 'qwz_unquantized_dtype' in the ledger)",
            )
            if (ledger := active_ledger()) is not None:
                ledger.count("qwz_unquantized_dtype")
            return self._plain(output_tensor, input_tensor, group, ranks, async_op)
        world = len(ranks)
        n = input_tensor.numel()
        padded, slots = self._layout(n)
        two_hops = self._two_hops(ranks)
        with record_function("qshard::qwz::quantize"):
            # Each parameter's shard quantized straight into its blocks of the wire row (see
            # [Note: fused wire rows] in qshard.zeropp._wire): no padded copy of the input.
            payload = self.codec.encode_slots(input_tensor.reshape(-1), slots, 1).view(-1)
        gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=payload.device)
        tag = phase_tag("all_gather")
        if two_hops:
            topo = self.topology
            nodes, per_node = topo.num_nodes, topo.ranks_per_node
            inter_group, intra_group = topo.inter_node_group, topo.intra_node_group
            peer_rows = torch.empty(
                nodes * payload.numel(), dtype=torch.uint8, device=payload.device
            )
            # Both hops recorded now, with the call's phase tag, so one gather's bytes always
            # land in the same ledger step.
            record(
                "all_gather",
                group_ranks=topo.peer_ranks(topo.local_rank),
                tensor_bytes=peer_rows.numel(),
                tag=tag,
            )
            record(
                "all_gather",
                group_ranks=topo.node_ranks(topo.node),
                tensor_bytes=gathered.numel(),
                tag=tag,
            )
            # Rows arrive [local rank][node]; the output is [node][local rank].
            out3 = output_tensor.view(nodes, per_node, n)
            dest = [out3[g % nodes, g // nodes] for g in range(world)]

            pending_hop: Callable[[], None] | None = None
            # Each hop both ways at once on gloo ([Note: gloo exchanges are half duplex]).
            inter_twin = topo.twin_for(topo.peer_ranks(topo.local_rank))
            intra_twin = topo.twin_for(topo.node_ranks(topo.node))
            with record_function("qshard::qwz::transfer"):  # both hops when sync
                work = duplex.all_gather_single(
                    peer_rows, payload, inter_group, twin=inter_twin, async_op=async_op
                )
                if not async_op:
                    duplex.all_gather_single(gathered, peer_rows, intra_group, twin=intra_twin)
                elif self._hop2_at_call(payload.device):  # a stream wait: the host goes on
                    work.wait()
                    work = duplex.all_gather_single(
                        gathered, peer_rows, intra_group, twin=intra_twin, async_op=True
                    )
                else:  # hop 2 issued in the handle's wait(), see [Note: qwZ hop order]

                    def issue_and_wait() -> None:
                        with record_function("qshard::qwz::wait_intra"):  # issue, wait at once
                            duplex.all_gather_single(
                                gathered, peer_rows, intra_group, twin=intra_twin
                            )

                    pending_hop = issue_and_wait
        else:
            record("all_gather", group_ranks=ranks, tensor_bytes=gathered.numel(), tag=tag)
            dest = list(output_tensor.view(world, n).unbind(0))
            pending_hop = None
            with record_function("qshard::qwz::transfer"):  # all of it when sync
                work = duplex.all_gather_single(
                    gathered, payload, group, twin=self.twin(group), async_op=async_op
                )

        def dequantize() -> None:
            if pending_hop is not None:
                pending_hop()
            # Each row's parameters decoded straight into their places in the output.
            self.codec.decode_slots(gathered.view(world, -1), padded, dest, slots)

        return _finish(work, dequantize, async_op, "qwz")
