"""ZeroPPConfig: which ZeRO++ optimizations :func:`qshard.zeropp.shard` applies, and how."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qshard.zeropp._common import WIRE_DTYPES

__all__ = ["ZeroPPConfig"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroPPConfig:
    """Switches and knobs of ZeRO++ on FSDP2. All features off is plain FSDP2 (ZeRO-3).

    Attributes:
        qwz: quantized weight all-gather (block-quantized shard -> all-gather -> dequantize).
            Gathers inside one node (hpZ's backward gather) stay full precision.
        hpz: hierarchical partitioning: after forward, reshard to a node-sized group
            (``reshard_after_forward=ranks_per_node``), so the backward all-gather never
            leaves the node; costs ``1/ranks_per_node`` of the weights per rank instead of
            ``1/world_size`` between forward and backward.
        qgz: hierarchical quantized gradient reduce-scatter (two all-to-all hops, intra-node
            then inter-node, quantized on the wire, reduced in fp32).
        weight_bits: qwZ code width, 8 (the paper) or 4.
        weight_block_size: elements per qwZ quantization block (one fp32 scale each); like
            the other two block sizes, a multiple of 8.
        grad_bits: qgZ code width, 4 (the paper) or 8.
        grad_block_size: elements per qgZ quantization block.
        pipeline_stages: qgZ chunks pipelined through the two hops (1 = no pipelining); the
            inter-node hop of chunk ``k`` overlaps the intra-node hop of chunk ``k+1``.
        overlap_reduce_scatter: let the gradient reduce-scatter (qgZ's two hops, or the plain
            one) return from FSDP2's call after issuing its collective, and finish it while the
            next blocks' backward runs; every pending reduce-scatter is finished before
            ``backward()`` returns (see [Note: deferred qgZ] in ``qshard/zeropp/_overlap.py``).
            Used only where FSDP2 does nothing with the output but view it (no accumulation
            into an existing gradient, post-accumulate-grad hook, dtype cast or post-divide);
            elsewhere the call is synchronous. ``None`` (default): on whenever a ZeRO++ feature
            is on, off for plain ZeRO-3 (which keeps FSDP2's synchronous reduce-scatter and
            costs what it always cost); ``True`` / ``False`` force it. Numerics and bytes
            unchanged. With ``hsdp`` it is the compressed replicate all-reduce (``replicate_bits``
            or ``wire_dtype``) that overlaps the next units' backward ([Note: deferred replicate
            all-reduce] in ``qshard/zeropp/all_reduce.py``; on by default, as a ZeRO++ feature);
            ``True`` with FSDP2's own full-precision all-reduce, or with
            ``replicate_reduce=False``, is refused (nothing of ours to overlap).
        wire_dtype: ``None`` sends unquantized collectives in the parameter / reduce dtype;
            ``torch.bfloat16`` or ``torch.float16`` casts them to 16 bits on the wire while
            computing and reducing in fp32 (the paper's fp16 ZeRO-3 baseline, on hardware
            where computing in 16 bits is slow). Applies to every all-gather that qwZ does
            not quantize and to the gradient reduce-scatter when qgZ is off.
        prefetch: prefetch the next block's all-gather explicitly and run unshards
            asynchronously, so communication (and qwZ's dequantization, done in the work
            handle's ``wait()``) overlaps the current block's compute. The prefetches are
            issued before FSDP2 waits for the block's own gather (FSDP2 issues them after), so
            the next gather is queued behind the one in flight ([Note: issue the prefetch
            before the wait] in ``qshard.zeropp._prefetch``). Numerics unchanged.
        prefetch_depth: with ``prefetch``, how many blocks ahead each block prefetches (1: the
            next one; another value without ``prefetch`` is refused, it would be ignored).
            Depth 2 keeps two gathers in flight and, through ``keep_last_blocks``' default,
            one more block unsharded from forward to backward (fewer backward gathers), at the
            memory of one more unsharded block.
        keep_last_blocks: how many of the last blocks (in forward order) stay unsharded from
            their forward to their backward instead of resharding. Backward runs them first, so
            resharding them would only gather them again right away, with little or nothing to
            overlap the gathers. ``None`` (default): ``prefetch_depth + 1`` (2 without
            ``prefetch``: FSDP2's implicit backward prefetch), the unsharded blocks a step holds
            at its peak anyway (the computing block and the prefetched ones), so the peak does
            not grow. More trades memory for fewer gathers; ``0`` reshards every block (the
            least memory after a forward with autograd on and no backward, where kept blocks
            stay unsharded until the next optimizer step; after one under
            ``torch.no_grad()`` they reshard at once, see [Note: no backward, no stale copy]).
            The root (what ``shard()`` wraps last: embeddings, final norm, head) never
            reshards after forward, as in FSDP2. Numerics unchanged.
        record: install recording comms for FSDP2's own collectives when a feature is off,
            so the active :class:`~qshard.comm.CommLedger` measures the baseline with the same
            ruler. They call the same plain collectives (numerics unchanged), except that a
            2-rank gather or 16-bit exchange on gloo runs both ways at once
            (:mod:`qshard.comm.duplex`; same bits).
        hsdp: HSDP instead of ZeRO-3: shard inside a node, replicate across nodes (a 2-D mesh
            ``("replicate", "shard")`` built from the topology). The only inter-node traffic
            of a step is the replicate reduction of the gradient shards. Excludes qwZ, hpZ and
            qgZ (they change the world gathers and reduce-scatter HSDP does not have).
        replicate_bits: HSDP only. ``None`` reduces the gradient shards across nodes in full
            precision (FSDP2's own all-reduce; with ``wire_dtype``, in 16 bits); 8 or 4 sends
            them block-quantized in qgZ's format, reduced in fp32 between the two hops (see
            :class:`~qshard.zeropp.ReplicateAllReduce`).
        replicate_block_size: elements per quantization block of the replicate reduction
            (with ``replicate_bits`` only: the full-precision and 16-bit reductions have no
            blocks, so another value there is refused, as without ``hsdp``).
        replicate_error_feedback: keep what quantizing the replicate reduction lost and add it
            to the next step's gradients (per FSDP unit and rank).
        replicate_reduce: HSDP only. ``False``: no gradient crosses nodes; each node's
            optimizer steps on its own node-averaged gradients and a data-parallel optimizer
            (:class:`~qshard.optim.ZeroOneAdam`, :class:`~qshard.optim.OneBitAdam`) owns the
            inter-node sync. Only those may step these parameters: qshard's 8-bit / 4-bit
            optimizers refuse them when built, and the first backward that reduces gradients
            raises if no such optimizer covers every trainable parameter (torch's optimizers
            included; see [Note: replica sync] in :mod:`qshard._replicas`).
    """

    qwz: bool = False
    hpz: bool = False
    qgz: bool = False
    weight_bits: int = 8
    weight_block_size: int = 256
    grad_bits: int = 4
    grad_block_size: int = 256
    pipeline_stages: int = 1
    overlap_reduce_scatter: bool | None = None
    wire_dtype: torch.dtype | None = None
    prefetch: bool = True
    prefetch_depth: int = 1
    keep_last_blocks: int | None = None
    record: bool = True
    hsdp: bool = False
    replicate_bits: int | None = None
    replicate_block_size: int = 256
    replicate_error_feedback: bool = False
    replicate_reduce: bool = True

    def __post_init__(self) -> None:
        for name in (
            "qwz",
            "hpz",
            "qgz",
            "prefetch",
            "record",
            "hsdp",
            "replicate_error_feedback",
            "replicate_reduce",
        ):
            value = getattr(self, name)
            if name == "hpz" and _is_int(value) and value > 1:
                # DeepSpeed's zero_hpz_partition_size is a rank count; here it is the node
                raise TypeError(
                    f"hpz must be a bool; got {value!r}: hpZ's secondary partition is one node "
                    "(DeepSpeed's zero_hpz_partition_size), whose size the topology gives: set "
                    f"hpz=True with Topology.from_env(ranks_per_node={value}) (or "
                    f"Topology(world_size=..., ranks_per_node={value}))"
                )
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool; got {value!r}")
        # ints, not floats or bools: 8.0 == 8 would pass a membership test and break the
        # wire layout's byte arithmetic in the first collective
        if not _is_int(self.weight_bits) or self.weight_bits not in (4, 8):
            raise ValueError(f"weight_bits must be 8 or 4 (an int); got {self.weight_bits!r}")
        if not _is_int(self.grad_bits) or self.grad_bits not in (4, 8):
            raise ValueError(f"grad_bits must be 4 or 8 (an int); got {self.grad_bits!r}")
        if self.replicate_bits is not None and (
            not _is_int(self.replicate_bits) or self.replicate_bits not in (4, 8)
        ):
            raise ValueError(
                f"replicate_bits must be None, 8 or 4 (an int); got {self.replicate_bits!r}"
            )
        for name in ("weight_block_size", "grad_block_size", "replicate_block_size"):
            v = getattr(self, name)
            if not _is_int(v) or v < 8 or v % 8:
                raise ValueError(
                    f"{name} must be a positive multiple of 8 (the wire rows keep every "
                    f"block's fp32 scale 4-byte aligned, and INT4 packs two codes a byte); "
                    f"got {v!r}"
                )
        if self.overlap_reduce_scatter is not None and not isinstance(
            self.overlap_reduce_scatter, bool
        ):
            raise TypeError(
                f"overlap_reduce_scatter must be None or a bool; got {self.overlap_reduce_scatter!r}"
            )
        if not _is_int(self.prefetch_depth) or self.prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be an int >= 1; got {self.prefetch_depth!r}")
        if self.keep_last_blocks is not None and (
            not _is_int(self.keep_last_blocks) or self.keep_last_blocks < 0
        ):
            raise ValueError(
                f"keep_last_blocks must be None (prefetch_depth + 1) or an int >= 0 (0 reshards "
                f"every block); got {self.keep_last_blocks!r}"
            )
        if not _is_int(self.pipeline_stages) or self.pipeline_stages < 1:
            raise ValueError(f"pipeline_stages must be an int >= 1; got {self.pipeline_stages!r}")
        if self.wire_dtype is not None and self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(
                f"wire_dtype must be None, torch.bfloat16 or torch.float16; got {self.wire_dtype}"
            )

        # A knob of a feature that is off would be ignored without a word (weight_bits=4
        # without qwz sends fp32): refused, as HSDP's knobs are without hsdp.
        for feature, knobs in (
            ("qwz", (("weight_bits", 8), ("weight_block_size", 256))),
            ("qgz", (("grad_bits", 4), ("grad_block_size", 256), ("pipeline_stages", 1))),
        ):
            if getattr(self, feature):
                continue
            for name, default in knobs:
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} configures {feature}, which is off; set "
                        f"{feature}=True (or leave {name}={default!r})"
                    )
        if not self.prefetch and self.prefetch_depth != 1:
            raise ValueError(
                f"prefetch_depth={self.prefetch_depth!r} configures prefetch, which is off; set "
                "prefetch=True (or leave prefetch_depth=1)"
            )
        if self.hsdp:
            self._check_hsdp()
        else:
            for name, default in (
                ("replicate_bits", None),
                ("replicate_block_size", 256),
                ("replicate_error_feedback", False),
                ("replicate_reduce", True),
            ):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{name} configures HSDP's inter-node reduction; set hsdp=True (or "
                        f"leave {name}={default!r} for ZeRO-3 / ZeRO++)"
                    )

    def _check_hsdp(self) -> None:
        if self.hpz:
            raise ValueError(
                "hpz=True with hsdp=True: HSDP already shards inside a node, so its backward "
                "all-gather never leaves the node; drop hpz"
            )
        if self.qwz:
            raise ValueError(
                "qwz=True with hsdp=True: qwZ quantizes weight gathers that cross nodes, and "
                "HSDP gathers only inside a node; drop qwz"
            )
        if self.qgz:
            raise ValueError(
                "qgz=True with hsdp=True: HSDP's inter-node reduction is the replicate "
                "all-reduce, not qgZ's world reduce-scatter; use replicate_bits=4 instead"
            )
        if not self.replicate_reduce and (
            self.replicate_bits is not None
            or self.replicate_error_feedback
            or self.replicate_block_size != 256
        ):
            raise ValueError(
                "replicate_reduce=False sends no gradient across nodes, so replicate_bits / "
                "replicate_block_size / replicate_error_feedback have nothing to compress; drop "
                "them"
            )
        if self.replicate_bits is None and self.replicate_block_size != 256:
            # the full-precision / 16-bit replicate reduction has no blocks: the size would
            # change nothing on the wire (the ledger's bytes stay the same)
            raise ValueError(
                f"replicate_block_size={self.replicate_block_size!r} configures the quantized "
                "replicate reduction, which is off (replicate_bits=None); set replicate_bits=8 "
                "or 4 (or leave replicate_block_size=256)"
            )
        if self.overlap_reduce_scatter and (self.replicate_native or not self.replicate_reduce):
            raise ValueError(
                "overlap_reduce_scatter=True with hsdp=True and "
                + (
                    "FSDP2's own full-precision replicate all-reduce (replicate_bits=None, no "
                    "wire_dtype), which needs its output at once"
                    if self.replicate_reduce
                    else "replicate_reduce=False, which sends nothing across nodes to overlap"
                )
                + ": drop overlap_reduce_scatter, or "
                + ("" if self.replicate_reduce else "set replicate_reduce=True and ")
                + "compress the replicate reduction (replicate_bits=8/4 or "
                "wire_dtype=torch.bfloat16), which overlaps backward"
            )
        if (
            self.replicate_error_feedback
            and self.replicate_bits is None
            and (self.wire_dtype is None)
        ):
            raise ValueError(
                "replicate_error_feedback needs a lossy replicate reduction: set "
                "replicate_bits=8/4 or wire_dtype=torch.bfloat16"
            )

    @property
    def replicate_native(self) -> bool:
        """HSDP whose inter-node reduction is FSDP2's own full-precision all-reduce."""
        return (
            self.hsdp
            and self.replicate_reduce
            and self.replicate_bits is None
            and self.wire_dtype is None
        )

    @property
    def kept_blocks(self) -> int:
        """How many of the last blocks stay unsharded from forward to backward (see
        ``keep_last_blocks``)."""
        if self.keep_last_blocks is not None:
            return self.keep_last_blocks
        return (self.prefetch_depth if self.prefetch else 1) + 1

    @property
    def any_feature(self) -> bool:
        """Whether any ZeRO++ optimization is on."""
        return self.qwz or self.hpz or self.qgz
