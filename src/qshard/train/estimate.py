"""What a run should cost before it starts: per-rank memory by component and cross-node bytes per
step from the ZeRO++ paper's analytic model, in the comm ledger's units.

Cross-node bytes follow [Note: ledger cost model] in :mod:`qshard.comm.ledger`: bytes leaving
each node per step, for bandwidth-optimal algorithms. For ``M`` parameters on ``N`` nodes of
``D`` ranks (``P = N * D``) and wire bytes per element ``w``:

* ZeRO-3 (FSDP2): forward all-gather, backward all-gather and gradient reduce-scatter are rings
  over the world, each sends ``(P-1)/P * M * w`` out of every node: the paper's ``3M`` (Table 1)
  with ``w = 2`` and large ``P``.
* qwZ: the forward all-gather carries INT8 codes plus one fp32 scale per block,
  ``w = 1 + 4 / block``, in two hops (see [Note: qwZ route] in :mod:`qshard.zeropp.all_gather`):
  each rank's row among its peers on the other nodes, then inside the node, so only the other
  nodes' rows cross: ``(N-1)/N * M * w`` per node, not the flat ring's ``(P-1)/P * M * w``
  (the same with one rank per node). The backward gather without hpZ is qwZ's too.
* hpZ: the backward all-gather stays inside the node: 0 cross-node bytes.
* qgZ: gradients are reduced inside the node first, then each rank sends its node's partial
  sums of ``M / D`` elements, as INT4 with fp32 block scales, to the ``N - 1`` other nodes in an
  all-to-all: ``(N-1)/N * M * (0.5 + 4 / block)`` per node, the paper's ``0.25M`` (in fp16 units).
* HSDP: gathers and the reduce-scatter stay inside the node; each rank all-reduces its gradient
  shard of ``M / D`` elements across the ``N`` nodes (ring, or the compressed reduce-scatter +
  all-gather of the same volume): ``2 (N-1)/N * M * w`` per node, ``w`` the wire bytes per element
  (4 fp32, 2 bf16, ``bits / 8 + 4 / block`` quantized). 1-bit Adam / 0/1 Adam on HSDP send no
  gradient at all (their sync volume follows their schedules).

Memory is per rank, in bytes, counting tensors only (no allocator slack, no activations, no
framework overhead), so it is a floor the measured peak is compared against.
"""

from __future__ import annotations

from dataclasses import dataclass

from qshard._layout import blocks_per_row, packed_row, row_view

__all__ = [
    "CommEstimate",
    "ddp_allreduce_bytes",
    "estimate_comm",
    "estimate_hsdp_comm",
    "estimate_memory",
    "memory_by_layout",
    "optimizer_state_bytes_per_param",
    "quantized_state_bytes",
]

_OPTIM_STATE_BYTES = {
    # exp_avg + exp_avg_sq in fp32
    "adamw": 8.0,
    # two 8-bit states plus one fp32 absmax per 256-element block each
    "adamw8bit": 2.0 + 2 * 4 / 256,
    # two 4-bit states (two codes a byte) plus one fp32 absmax per 128-element block each
    "adamw4bit": 1.0 + 2 * 4 / 128,
    # fp32 momentum and variance, plus worker error (fp32, padded) ...
    "onebit_adam": 12.0,
    # ... and 0/1 Adam's fp32 sync anchor (the parameter at the last sync, [Note: sync anchor]
    # in qshard.optim.zero_one_adam)
    "zero_one_adam": 16.0,
}

# The 8-/4-bit optimizers' defaults (what the app builds): elements per absmax block along a row.
_STATE_BLOCK = {"adamw8bit": 256, "adamw4bit": 128}


def optimizer_state_bytes_per_param(optim: str, *, world_size: int = 1) -> float:
    """Optimizer state bytes per parameter *held by a rank* for one of the app's optimizers.

    The data-parallel optimizers add a server error buffer of 1/world of the model (4 bytes).
    """
    if optim not in _OPTIM_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optim!r}; expected one of {list(_OPTIM_STATE_BYTES)}")
    extra = 4.0 / world_size if optim in ("onebit_adam", "zero_one_adam") else 0.0
    return _OPTIM_STATE_BYTES[optim] + extra


def quantized_state_bytes(optim: str, shape: tuple[int, ...]) -> int:
    """Bytes of the two quantized Adam states (codes and absmax) of one parameter of global
    ``shape`` in ``adamw8bit`` / ``adamw4bit`` with the app's block sizes.

    [Note: state blocks are per row] The 8- and 4-bit optimizers cut each *row* (``shape[0]``
    rows of ``prod(shape[1:])`` elements) into blocks with one fp32 absmax each, so a row shorter
    than the block still holds a whole absmax: a 64-wide model's rows cost ``4 / 64`` absmax
    bytes an element per state, not the ``4 / 256`` of a flat layout (and 4-bit codes round up
    to whole bytes per row). The per-parameter constants of
    :func:`optimizer_state_bytes_per_param` are the large-row limit; this is the layout itself
    (:mod:`qshard._layout`: [Note: row-block layout] in :mod:`qshard.optim._qstate`, [Note: 4-bit
    layout] in :mod:`qshard.optim._qstate4`).
    """
    if optim not in _STATE_BLOCK:
        raise ValueError(f"optim must be one of {list(_STATE_BLOCK)}; got {optim!r}")
    rows, row_numel = row_view(shape)
    absmax = rows * blocks_per_row(row_numel, _STATE_BLOCK[optim]) * 4
    codes = rows * (row_numel if optim == "adamw8bit" else packed_row(row_numel))
    return 2 * (codes + absmax)


def estimate_memory(
    *,
    num_params: int,
    largest_unit_params: int,
    world_size: int,
    ranks_per_node: int,
    features: frozenset[str],
    optim: str,
    param_bytes: int = 4,
    compute_bytes: int = 4,
    sharded: bool = True,
    fp32_state_params: int = 0,
    shard_ranks: int | None = None,
    quantized_state: float | None = None,
    hpz_params: int | None = None,
) -> dict[str, float]:
    """Per-rank memory by component, in bytes.

    ``largest_unit_params`` is the largest FSDP unit (one transformer block, or the root's
    embeddings and head): FSDP holds at most about two units unsharded at a time (the current
    one and the prefetched next one). ``fp32_state_params`` counts the parameters an 8-bit
    optimizer keeps in 32-bit state (small tensors, biases and norms, StableEmbedding).
    ``shard_ranks`` is how many ranks share one copy of the model: ``world_size`` (ZeRO-3, the
    default) or ``ranks_per_node`` (HSDP: sharded inside a node, replicated across nodes).
    ``quantized_state`` is the whole model's 8-/4-bit state in bytes, summed over its quantized
    parameters with :func:`quantized_state_bytes`; ``None`` prices those parameters at
    :func:`optimizer_state_bytes_per_param` (the large-row limit). ``hpz_params`` counts the
    parameters of the units hpZ reshards to a node-sized secondary shard after forward: the
    blocks before the last ``ZeroPPConfig.kept_blocks`` (the kept blocks and the root stay
    unsharded through backward, the "unsharded units" row); ``None``: every parameter.
    """
    ways = world_size if shard_ranks is None else shard_ranks
    if not sharded:
        share = 1.0
        rows = {
            "parameters (replicated)": num_params * param_bytes,
            "gradients (replicated)": num_params * param_bytes,
        }
    else:
        share = 1.0 / ways
        rows = {
            "parameter shard": num_params * param_bytes * share,
            "gradient shard": num_params * param_bytes * share,
        }
        # hpZ on one node of several ranks reshards to the whole world, ZeRO-3's own shard
        # (qshard.zeropp.shard._hpz_reshard): no secondary copy there.
        if "hpz" in features and (ranks_per_node == 1 or ranks_per_node < world_size):
            resharded = num_params if hpz_params is None else hpz_params
            rows["hpZ secondary shard"] = resharded * compute_bytes / ranks_per_node
        rows["unsharded units (2 in flight)"] = 2 * largest_unit_params * compute_bytes
    # The 1-bit optimizers' server error is split over their sync group: every rank when
    # replicated, the nodes on HSDP.
    sync_ranks = world_size if not sharded else max(1, world_size // ways)
    per_param = optimizer_state_bytes_per_param(optim, world_size=sync_ranks)
    if optim in ("adamw8bit", "adamw4bit"):
        eight = num_params - fp32_state_params
        quantized = eight * per_param if quantized_state is None else quantized_state
        state = quantized + fp32_state_params * _OPTIM_STATE_BYTES["adamw"]
    else:
        state = num_params * per_param
    rows[f"optimizer state ({optim})"] = state * share
    rows["total (tensors only)"] = sum(rows.values())
    return rows


@dataclass(frozen=True, kw_only=True, slots=True)
class CommEstimate:
    """Cross-node bytes per step (per node) of the three ZeRO collectives."""

    fwd_all_gather: float
    bwd_all_gather: float
    grad_reduce_scatter: float

    @property
    def total(self) -> float:
        return self.fwd_all_gather + self.bwd_all_gather + self.grad_reduce_scatter


def estimate_comm(
    *,
    num_params: int,
    world_size: int,
    ranks_per_node: int,
    features: frozenset[str] = frozenset(),
    wire_bytes: float = 4.0,
    grad_wire_bytes: float | None = None,
    weight_block: int = 2048,
    grad_block: int = 512,
) -> CommEstimate:
    """Analytic cross-node bytes per step for ZeRO-3 with the given ZeRO++ ``features``.

    ``wire_bytes`` is the element size of the plain all-gather (4 for fp32 on CPU, 2 for the
    paper's fp16 baseline); ``grad_wire_bytes`` that of the plain reduce-scatter (default the
    same). Block sizes are those of qwZ and qgZ's quantization. As in the paper, backward
    gathers every weight again; :func:`qshard.zeropp.shard` keeps the root and the last blocks
    (``ZeroPPConfig.keep_last_blocks``) unsharded through backward, so the ledger of a run
    records less than ``bwd_all_gather``.
    """
    p, d = world_size, ranks_per_node
    n = p // d
    if n <= 1:
        return CommEstimate(fwd_all_gather=0.0, bwd_all_gather=0.0, grad_reduce_scatter=0.0)
    ring = (p - 1) / p * num_params
    grad_wire = wire_bytes if grad_wire_bytes is None else grad_wire_bytes
    # qwZ's two-hop gather: only the other nodes' rows cross (module docstring).
    gather = (n - 1) / n * num_params * (1 + 4 / weight_block) if "qwz" in features else None
    fwd = ring * wire_bytes if gather is None else gather
    if "hpz" in features:
        bwd = 0.0
    else:
        bwd = fwd
    if "qgz" in features:
        grad = (n - 1) / n * num_params * (0.5 + 4 / grad_block)
    else:
        grad = ring * grad_wire
    return CommEstimate(fwd_all_gather=fwd, bwd_all_gather=bwd, grad_reduce_scatter=grad)


def estimate_hsdp_comm(
    *,
    num_params: int,
    world_size: int,
    ranks_per_node: int,
    wire_bytes: float = 4.0,
    bits: int | None = None,
    block: int = 256,
) -> CommEstimate:
    """Analytic cross-node bytes per step of HSDP: its replicate all-reduce, reported as the
    gradient reduction (the gathers stay inside the node). ``bits`` 8/4: block-quantized."""
    n = world_size // ranks_per_node
    if n <= 1:
        return CommEstimate(fwd_all_gather=0.0, bwd_all_gather=0.0, grad_reduce_scatter=0.0)
    w = wire_bytes if bits is None else bits / 8 + 4 / block
    grad = 2 * (n - 1) / n * num_params * w
    return CommEstimate(fwd_all_gather=0.0, bwd_all_gather=0.0, grad_reduce_scatter=grad)


def memory_by_layout(
    *, world_size: int, ranks_per_node: int, optim: str, **sizes: object
) -> dict[str, float]:
    """Total per-rank memory (tensors only) of the same model and optimizer laid out as ZeRO-3
    (sharded over every rank), HSDP (sharded over a node's ranks) and replicated; ``sizes``
    are :func:`estimate_memory`'s other arguments."""
    kw = dict(sizes, world_size=world_size, ranks_per_node=ranks_per_node, optim=optim)
    kw["features"] = frozenset()

    def total(**layout: object) -> float:
        return estimate_memory(**kw, **layout)["total (tensors only)"]  # type: ignore[arg-type]

    return {
        f"ZeRO-3 / ZeRO++ (1/{world_size} per rank)": total(),
        f"HSDP (1/{ranks_per_node} per rank)": total(shard_ranks=ranks_per_node),
        "replicated (DDP, 1-bit optimizers)": total(sharded=False),
    }


def ddp_allreduce_bytes(
    *, num_params: int, world_size: int, ranks_per_node: int, wire_bytes: float = 4.0
) -> float:
    """Cross-node bytes per step (per node) of a data-parallel gradient all-reduce (ring):
    the baseline of the data-parallel 1-bit optimizers."""
    if world_size // ranks_per_node <= 1:
        return 0.0
    return 2 * (world_size - 1) / world_size * num_params * wire_bytes
