"""ZeroPPConfig: which ZeRO++ optimizations :func:`qshard.zeropp.shard` applies, and how."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qshard.zeropp._common import WIRE_DTYPES

__all__ = ["ZeroPPConfig"]


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
        weight_block_size: elements per qwZ quantization block (one fp32 scale each).
        grad_bits: qgZ code width, 4 (the paper) or 8.
        grad_block_size: elements per qgZ quantization block.
        pipeline_stages: qgZ chunks pipelined through the two hops (1 = no pipelining); the
            inter-node hop of chunk ``k`` overlaps the intra-node hop of chunk ``k+1``.
        wire_dtype: ``None`` sends unquantized collectives in the parameter / reduce dtype;
            ``torch.bfloat16`` or ``torch.float16`` casts them to 16 bits on the wire while
            computing and reducing in fp32 (the paper's fp16 ZeRO-3 baseline, on hardware
            where computing in 16 bits is slow). Applies to every all-gather that qwZ does
            not quantize and to the gradient reduce-scatter when qgZ is off.
        prefetch: prefetch the next block's all-gather explicitly and run unshards
            asynchronously, so communication (and qwZ's dequantization, done in the work
            handle's ``wait()``) overlaps the current block's compute. Numerics unchanged.
        record: install recording comms for FSDP2's own collectives when a feature is off,
            so the active :class:`~qshard.comm.CommLedger` measures the baseline with the same
            ruler. They call the same plain collectives (numerics unchanged).
    """

    qwz: bool = False
    hpz: bool = False
    qgz: bool = False
    weight_bits: int = 8
    weight_block_size: int = 256
    grad_bits: int = 4
    grad_block_size: int = 256
    pipeline_stages: int = 1
    wire_dtype: torch.dtype | None = None
    prefetch: bool = True
    record: bool = True

    def __post_init__(self) -> None:
        for name in ("qwz", "hpz", "qgz", "prefetch", "record"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool; got {getattr(self, name)!r}")
        if self.weight_bits not in (4, 8):
            raise ValueError(f"weight_bits must be 8 or 4; got {self.weight_bits}")
        if self.grad_bits not in (4, 8):
            raise ValueError(f"grad_bits must be 4 or 8; got {self.grad_bits}")
        for name in ("weight_block_size", "grad_block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 8 or v % 8:
                raise ValueError(
                    f"{name} must be a positive multiple of 8 (INT4 packs two codes a byte and "
                    f"scales stay 4-byte aligned on the wire); got {v!r}"
                )
        if not isinstance(self.pipeline_stages, int) or self.pipeline_stages < 1:
            raise ValueError(f"pipeline_stages must be an int >= 1; got {self.pipeline_stages!r}")
        if self.wire_dtype is not None and self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(
                f"wire_dtype must be None, torch.bfloat16 or torch.float16; got {self.wire_dtype}"
            )

    @property
    def any_feature(self) -> bool:
        """Whether any ZeRO++ optimization is on."""
        return self.qwz or self.hpz or self.qgz
