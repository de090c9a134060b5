"""What a run is expected to cost and what it reports: the analytic estimates (memory per rank,
cross-node bytes of this run and of its ZeRO-3 / DDP baselines), rank 0's start-up header, and
the end-of-run summary (terminal text, ``summary.txt``, ``summary.json``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from qshard.comm import Topology
from qshard.train._metrics import encode_record, format_bytes, table
from qshard.train._parallel import zeropp_blocks, zeropp_kept_blocks
from qshard.train.config import DATA_PARALLEL_OPTIMIZERS, TrainConfig
from qshard.train.estimate import (
    CommEstimate,
    ddp_allreduce_bytes,
    estimate_comm,
    estimate_hsdp_comm,
    estimate_memory,
    memory_by_layout,
    quantized_state_bytes,
)

__all__ = ["Estimates", "estimate_run", "header", "summary", "write_summary"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimates:
    """The analytic numbers a run is compared with (bytes; comm per step and node)."""

    memory: dict[str, float]
    """Memory per rank by component (tensors only)."""
    comm: Any | None
    """This run's cross-node bytes; ``None`` for data-parallel optimizers, whose volume
    follows their own schedules."""
    zero3_fp32: Any
    zero3_16: Any
    ddp_fp32: float
    hsdp_fp32: Any = None
    """HSDP's cross-node bytes with FSDP2's fp32 replicate all-reduce (same model and nodes)."""
    layouts: dict[str, float] = field(default_factory=dict)
    """Total memory per rank of the same model and optimizer as ZeRO-3, HSDP and replicated."""


def _per_step(micro: CommEstimate, config: TrainConfig, *, repeated: float) -> CommEstimate:
    """A ZeRO-3 layout's bytes of one micro-batch, for the step's micro-batches ([Note:
    gradient accumulation in the app]): each reduce-scatters, and gathers in backward, across
    nodes; after the first, the forward gathers across nodes only the ``repeated`` share of the
    weights (the units that keep no copy for the next forward: 0 with hpZ, where every unit
    keeps one; the blocks fully resharded after forward without it)."""
    k = config.grad_accum_steps
    return CommEstimate(
        fwd_all_gather=(1 + (k - 1) * repeated) * micro.fwd_all_gather,
        bwd_all_gather=k * micro.bwd_all_gather,
        grad_reduce_scatter=k * micro.grad_reduce_scatter,
    )


def _regathered_share(model: nn.Module, config: TrainConfig) -> float:
    """The share of the weights a ZeRO-3 run's later micro-batches gather across nodes in
    forward: those of the blocks :func:`qshard.zeropp.shard` reshards fully after forward (all
    but the last ``kept_blocks``; none with hpZ, whose secondary shards stay in the node)."""
    if "hpz" in config.zeropp_features:
        return 0.0
    total = sum(p.numel() for p in model.parameters())
    return _resharded_block_params(model, config) / max(total, 1)


def _largest_unit_params(model: nn.Module) -> int:
    # FSDP units: each block, and the root (embeddings, final norm, head).
    in_blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]  # type: ignore[union-attr]
    total = sum(p.numel() for p in model.parameters())
    return max(*in_blocks, total - sum(in_blocks))


def _resharded_block_params(model: nn.Module, config: TrainConfig) -> int:
    # The blocks before the kept last ones (shard()'s _fully_shard_units), which reshard after
    # forward (with hpZ to their secondary shards); the kept blocks and the root stay unsharded
    # through backward.
    blocks = list(model.blocks)  # type: ignore[union-attr]
    first_kept = max(0, len(blocks) - zeropp_kept_blocks(config))
    return sum(p.numel() for b in blocks[:first_kept] for p in b.parameters())


def _fp32_state(p: nn.Parameter, stable: Any) -> bool:
    # What an 8-/4-bit optimizer keeps in 32 bits: 1-D tensors, tensors under its min_8bit_size
    # / min_4bit_size (4096 elements, the default) and the StableEmbedding weight.
    return p.dim() < 2 or p.numel() < 4096 or p is stable


def _state_sizes(model: nn.Module, config: TrainConfig) -> dict[str, Any]:
    """``fp32_state_params`` and, for the 8-/4-bit optimizers, ``quantized_state`` (bytes, by
    each parameter's rows: [Note: state blocks are per row] in qshard.train.estimate)."""
    stable = model.tok_emb.weight if config.stable_embedding else None  # type: ignore[union-attr]
    quantized = config.optim in ("adamw8bit", "adamw4bit")
    fp32_state_params = quantized_state = 0
    for p in model.parameters():
        if _fp32_state(p, stable):
            fp32_state_params += p.numel()
        elif quantized:
            quantized_state += quantized_state_bytes(config.optim, tuple(p.shape))
    sizes: dict[str, Any] = {"fp32_state_params": fp32_state_params}
    if quantized:
        sizes["quantized_state"] = quantized_state
    return sizes


def estimate_run(
    config: TrainConfig,
    model: nn.Module,
    topology: Topology,
    compute_dtype: torch.dtype,
) -> Estimates:
    """The estimates for ``model`` trained as ``config`` says on ``topology``."""
    world_size, ranks_per_node = topology.world_size, topology.ranks_per_node
    num_params = sum(p.numel() for p in model.parameters())
    replicated = config.optim in DATA_PARALLEL_OPTIMIZERS
    hsdp = config.parallel == "hsdp"
    features = config.zeropp_features
    common = dict(
        num_params=num_params,
        largest_unit_params=_largest_unit_params(model),
        compute_bytes=torch.finfo(compute_dtype).bits // 8,
        **_state_sizes(model, config),
    )
    memory = estimate_memory(
        **common,
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        features=features,
        optim=config.optim,
        sharded=hsdp or not replicated,
        shard_ranks=ranks_per_node if hsdp else None,
        hpz_params=_resharded_block_params(model, config) if "hpz" in features else None,
    )
    sizes = dict(num_params=num_params, world_size=world_size, ranks_per_node=ranks_per_node)
    if hsdp and not replicated:
        grads = config.replicate_grads
        comm = estimate_hsdp_comm(
            **sizes,
            wire_bytes=2.0 if grads == "bf16" else 4.0,
            bits={"int8": 8, "int4": 4}.get(grads),
        )
    elif replicated:
        comm = None
    else:
        # FSDP2 gathers the parameters in the compute dtype (MixedPrecisionPolicy's param_dtype)
        # and reduces gradients in fp32 (reduce_dtype): a bf16 run's plain gathers send 2 bytes.
        comm = _per_step(
            estimate_comm(
                **sizes,
                features=features,
                wire_bytes=float(common["compute_bytes"]),
                grad_wire_bytes=4.0,
                **zeropp_blocks(config),
            ),
            config,
            repeated=_regathered_share(model, config),
        )
    return Estimates(
        memory=memory,
        comm=comm,
        # the paper's ZeRO-3 baselines gather every weight for every micro-batch
        zero3_fp32=_per_step(estimate_comm(**sizes, wire_bytes=4.0), config, repeated=1.0),
        zero3_16=_per_step(estimate_comm(**sizes, wire_bytes=2.0), config, repeated=1.0),
        ddp_fp32=ddp_allreduce_bytes(**sizes),
        hsdp_fp32=estimate_hsdp_comm(**sizes),
        layouts=memory_by_layout(
            **common, world_size=world_size, ranks_per_node=ranks_per_node, optim=config.optim
        ),
    )


def _plural(n: int, noun: str) -> str:
    """``1 step``, ``3 steps``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _count(n: float) -> str:
    """A count in three significant digits: ``950``, ``38.3k``, ``3.26M``, ``1.20B``. Before,
    the header wrote every count in millions, and a small corpus read ``0.0M train``."""
    if round(n) < 1000:
        return f"{n:.0f}"
    for suffix, scale in (("k", 1e3), ("M", 1e6), ("B", 1e9)):
        v = float(f"{n / scale:.3g}")  # 999.6k rounds to 1000k: the next unit says 1.00M
        if v < 1000 or suffix == "B":
            digits = 2 if v < 10 else 1 if v < 100 else 0
            return f"{v:.{digits}f}{suffix}"
    raise AssertionError


def _seconds(t: float) -> str:
    """``238.8 s``; under a second in milliseconds (a tiny run's ``0.0 s`` said nothing)."""
    return f"{t:.1f} s" if t >= 1 else f"{t * 1000:.0f} ms"


def header(
    config: TrainConfig,
    *,
    num_params: int,
    layout: str,
    compute_dtype: torch.dtype,
    corpus: Any,
    estimates: Estimates,
) -> str:
    """Rank 0's start-up lines: what runs where, and the memory estimate."""
    first = (
        f"qshard train: {_count(num_params)} params, {layout}, optimizer {config.optim}, "
        f"{compute_dtype} compute, corpus {corpus.source} "
        f"({_count(corpus.train.size)} train / {_count(corpus.val.size)} val tokens)"
    )
    memory = table(
        ["component", "bytes per rank"],
        [[k, format_bytes(v)] for k, v in estimates.memory.items()],
        title="estimate: memory per rank (tensors only)",
    )
    if estimates.layouts:
        memory += "\n" + table(
            ["same model and optimizer as", "bytes per rank"],
            [[k, format_bytes(v)] for k, v in estimates.layouts.items()],
            title="estimate: memory per rank by layout (tensors only)",
        )
    return f"{first}\n{memory}"


def finished_step(run_dir: Path) -> int | None:
    """The step at which the run in ``run_dir`` last finished, by its ``summary.json`` (its
    launch's ``start_step + steps_trained``): None without one or when it cannot be read. A
    summary of an earlier launch of an extended run names an earlier step ([Note: finishing a
    run] in qshard.train.cli)."""
    try:
        data = json.loads((run_dir / "summary.json").read_text())
        return int(data["start_step"]) + int(data["steps_trained"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_summary(run_dir: Path, text: str, result: dict[str, Any]) -> None:
    """``summary.txt`` (the text) and ``summary.json`` (the result less per-step series; strict
    JSON, a NaN validation loss of a skipped run as ``null`` named under ``"nonfinite"``, [Note:
    non-finite metrics] in qshard.train._metrics)."""
    (run_dir / "summary.txt").write_text(text + "\n")
    kept = {k: v for k, v in result.items() if k not in ("losses", "ledger")}
    (run_dir / "summary.json").write_text(encode_record(kept, indent=1))


def _loss_line(losses: dict[int, float], val_losses: dict[int, float], skipped: Any = ()) -> str:
    """``loss A (step i) -> B (step j), mean of last N M, val loss V``. The mean is over the
    last 10 steps that updated: a step skipped as non-finite (``--on-nonfinite skip``) has a
    NaN/Inf loss that would make it NaN."""
    first, last = losses[min(losses)], losses[max(losses)]
    updated = [s for s in sorted(losses) if s not in set(skipped)]
    tail = [losses[s] for s in updated[-10:]]
    mean = f"{sum(tail) / len(tail):.4f}" if tail else "n/a"
    skipped_text = f" ({len(set(skipped))} skipped)" if skipped else ""
    val_text = f", val loss {val_losses[max(val_losses)]:.4f}" if val_losses else ""
    if len(losses) == 1:  # no drop and no mean to show
        return f"loss {first:.4f} (step {min(losses)}, the only step){skipped_text}{val_text}"
    return (
        f"loss {first:.4f} (step {min(losses)}) -> {last:.4f} (step {max(losses)}), "
        f"mean of last {len(tail)} {mean}{skipped_text}{val_text}"
    )


def summary(
    config: TrainConfig,
    result: dict[str, Any],
    measured: Any,
    steps_run: int,
    estimates: Estimates,
) -> str:
    """The end-of-run text: loss drop, throughput, measured vs estimated bytes and memory. Its
    figures are this launch's: a resumed run says from which step ([Note: resumed summary])."""
    losses = result["losses"]
    lines = []
    start = result.get("start_step", 0)
    if start:
        lines.append(_resumed_line(start, losses, config.steps))
    if losses:
        lines.append(_loss_line(losses, result["val_losses"], result.get("skipped_steps", ())))
        tokens = config.batch_size * config.context * len(losses)
        seconds = result["train_time_s"]
        lines.append(
            f"{_plural(len(losses), 'step')} in {_seconds(seconds)} (validation and checkpoint "
            f"saves included), {tokens / max(seconds, 1e-9):,.0f} tokens/s "
            "(metrics.jsonl has each step's own)"
        )
        lines.extend(_comm_lines(config, result, measured, steps_run, estimates))
    # What peak_memory_bytes measured: the rule of _runtime.device() (a GPU whenever CUDA is there).
    if torch.cuda.is_available():
        peak_label = "measured peak allocated (max over ranks)"
        peak_note = (
            "(measured on CUDA is torch.cuda.max_memory_allocated: it includes activations and "
            "temporaries, which the estimate leaves out)"
        )
    else:
        peak_label = "measured peak RSS (max over ranks)"
        peak_note = (
            "(measured on CPU is the process's peak RSS, which includes the runtime itself: "
            "not comparable with the tensor-only estimate)"
        )
    lines.append(
        table(
            ["memory per rank", "bytes"],
            [
                ["estimate (tensors only)", format_bytes(estimates.memory["total (tensors only)"])],
                [peak_label, format_bytes(result["peak_memory_bytes"])],
                [
                    f"optimizer state ({config.optim}), measured (max over ranks)",
                    format_bytes(result["optimizer_state_bytes"]),
                ],
            ],
        )
        + "\n"
        + peak_note
    )
    return "\n\n".join(["=== qshard train summary ===", *lines])


def _resumed_line(start: int, losses: dict[int, float], steps: int) -> str:
    """[Note: resumed summary] A resumed launch (``--resume``, or a restart, which resumes)
    measures only the steps it trains: its loss line, throughput, bytes per step and
    ``summary.json`` (``resumed_from_step``, ``steps_trained``, ``train_time_s``) cover those
    steps. Whole-run figures would mix launches (another world size, other timings, a ledger
    that starts afresh), so the summary says which steps it covers instead; ``metrics.jsonl``
    keeps one record per step of the run. Before, a resumed summary read like the whole run's.
    """
    if not losses:  # a restart after the final checkpoint: nothing left to train
        return (
            f"resumed from the step-{start} checkpoint, which is --steps {steps}: this launch "
            "trained no step, so it measured no loss, throughput or communication"
        )
    first, last = min(losses), max(losses)
    span = f"step {first}" if first == last else f"steps {first}-{last}"
    return (
        f"resumed from the step-{start} checkpoint: the figures below cover this launch only, "
        f"{span} ({len(losses)} of the run's {_plural(steps, 'step')}; metrics.jsonl has the "
        "earlier launches' steps)"
    )


def _comm_lines(
    config: TrainConfig,
    result: dict[str, Any],
    measured: Any,
    steps_run: int,
    estimates: Estimates,
) -> list[str]:
    """The communication table and what it shows: the savings, or why nothing crossed nodes."""
    comm_est, zero3_fp32, zero3_16 = estimates.comm, estimates.zero3_fp32, estimates.zero3_16

    def per_step(x: float) -> str:
        return format_bytes(x / steps_run)

    rows = []
    tags = [(e.tag, e.op) for e in measured.entries]
    for tag, op in tags:
        rows.append(
            [
                f"measured {tag} ({op})",
                per_step(measured.intra(tag=tag, op=op)),
                per_step(measured.inter(tag=tag, op=op)),
            ]
        )
    rows.append(
        ["measured total", per_step(measured.intra_node_bytes), per_step(measured.inter_node_bytes)]
    )
    if comm_est is not None:
        rows.append(["estimate, this run (analytic)", "", format_bytes(comm_est.total)])
    else:
        ddp = result["ddp_fp32_inter_node_bytes_per_step"]
        rows.append(["DDP baseline, fp32 all-reduce (analytic)", "", format_bytes(ddp)])
    rows.append(["ZeRO-3 baseline, fp32 wire (analytic)", "", format_bytes(zero3_fp32.total)])
    rows.append(["ZeRO-3 baseline, 16-bit wire (analytic)", "", format_bytes(zero3_16.total)])
    if estimates.hsdp_fp32 is not None:
        hsdp_fp32 = format_bytes(estimates.hsdp_fp32.total)
        rows.append(["HSDP baseline, fp32 all-reduce (analytic)", "", hsdp_fp32])
    lines = [
        table(
            ["per step, per node", "intra-node", "inter-node"],
            rows,
            title="communication (comm ledger; bytes leaving each node)",
        )
    ]
    as_all_reduce = dict(tag="grad_reduce_scatter", op="all_reduce")
    if measured.inter(**as_all_reduce) + measured.intra(**as_all_reduce) > 0:
        # [Note: record what the backend sends] in qshard.zeropp.reduce_scatter. On one node too:
        # its intra-node row is the all-reduce's, twice a reduce-scatter's.
        lines.append(
            "gloo has no reduce-scatter: the plain gradient reduce-scatter ran as an all-reduce, "
            "which sends twice the ring reduce-scatter's bytes that the analytic rows count"
        )
    inter = measured.inter_node_bytes / steps_run
    world, nodes = result.get("world_size"), result.get("num_nodes")
    if inter > 0:
        if comm_est is None:
            ddp = result["ddp_fp32_inter_node_bytes_per_step"]
            lines.append(f"cross-node bytes saved vs a fp32 DDP all-reduce: {ddp / inter:.2f}x")
        lines.append(
            f"cross-node bytes saved vs ZeRO-3: {zero3_fp32.total / inter:.2f}x vs the fp32 wire, "
            f"{zero3_16.total / inter:.2f}x vs the 16-bit wire (the paper's baseline)"
        )
    elif world == 1:
        # Before: "plain FSDP2 does not report to it", whatever the layout (ZeRO++ included).
        lines.append("one rank: nothing is communicated, so every row above is 0")
    elif not measured.entries:
        lines.append(
            "the ledger recorded no collectives (plain FSDP2 without qshard.zeropp does not "
            "report to it); the analytic rows above stand alone"
        )
    elif nodes == 1:
        lines.append(
            f"no cross-node bytes measured: the {world} ranks are one node, and the analytic rows "
            "(cross-node bytes) are 0 too"
        )
    else:
        lines.append("no cross-node bytes measured")
    return lines
