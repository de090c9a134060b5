"""The per-rank training loop of ``qshard train``: :func:`train` runs on every rank.

One step: the global batch of the step (a pure function of seed and step, see
:mod:`qshard.train.data`), forward, backward, gradient clipping on the global norm, optimizer
step, ledger step. Every ``eval_interval`` steps a validation estimate; every
``checkpoint_interval`` steps (and at the end) an atomic DCP checkpoint; at the end a
safetensors export and the summary: loss drop, throughput, measured vs estimated memory and
cross-node bytes next to a ZeRO-3 baseline.

[Note: exact resume] Everything random in a step is derived from ``(seed, step, rank)``: the
batch, and the dropout RNG (reseeded at the start of each step). Together with the model and
optimizer state in the checkpoint, a resumed run replays the uninterrupted one bit for bit
on the same number of ranks.
"""

from __future__ import annotations

import json
import math
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from qshard.comm import CommLedger, Topology, recording
from qshard.train import checkpoint as ckpt
from qshard.train._metrics import MetricsWriter, format_bytes, peak_memory_bytes, table
from qshard.train._parallel import build_optimizer, distribute, zeropp_blocks
from qshard.train.config import DATA_PARALLEL_OPTIMIZERS, TrainConfig
from qshard.train.data import _mix, batch_for_step, load_corpus
from qshard.train.estimate import ddp_allreduce_bytes, estimate_comm, estimate_memory
from qshard.train.model import GPT, GPTConfig

__all__ = ["TrainResult", "build", "gpt_config_of", "learning_rate", "train"]

TrainResult = dict[str, Any]
"""What :func:`train` returns on every rank: ``losses`` (step -> train loss),
``val_losses`` (step -> val loss), ``start_step``, ``num_params``, ``checkpoint`` (path),
``ledger`` (per-step inter/intra bytes) and the summary numbers."""


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


def _init_distributed() -> bool:
    """Join the job's process group (torchrun / elastic launch env); True if we created it."""
    if dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=10))
    return True


def _device() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _compute_dtype(config: TrainConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "fp32":
        return torch.float32
    if config.dtype == "bf16":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _global_grad_norm(model: nn.Module, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def _comm_device() -> torch.device:
    # NCCL reduces only CUDA tensors; gloo takes CPU ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().reshape(1).to(_comm_device(), copy=True)
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def _synchronize(optimizer: torch.optim.Optimizer) -> None:
    """Bring every rank to the same replica before it is evaluated or saved.

    Between two syncs of an optimizer with local steps (0/1 Adam, phase B) each rank holds its
    own replica; the run's model is the synchronised one. ``synchronize()`` is a collective that
    communicates only when a local step happened since the last sync, and its bytes are training
    traffic (it sets the parameters and momentum every later step starts from), so they go to
    the run's ledger.
    """
    sync = getattr(optimizer, "synchronize", None)
    if callable(sync):
        sync()


@torch.no_grad()
def _evaluate(model: nn.Module, tokens: Any, config: TrainConfig, step: int) -> float:
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = next(model.parameters()).device
    total = torch.zeros((), device=device)
    for i in range(config.eval_batches):
        # Fixed validation batches (stream 1, index i) so every estimate sees the same data.
        x, y = batch_for_step(
            tokens,
            step=i,
            seed=config.seed,
            global_batch=config.batch_size,
            context=config.context,
            rank=rank,
            world_size=world,
            stream=1,
        )
        _, loss = model(x.to(device), y.to(device))
        total += loss.float()
    model.train()
    return _mean_over_ranks(total / config.eval_batches)


def _ledger_record(summary: Any) -> dict[str, dict[str, float]]:
    return {
        f"{e.tag}/{e.op}": {"intra": e.intra_node_bytes, "inter": e.inter_node_bytes}
        for e in summary.entries
    }


def gpt_config_of(config: TrainConfig) -> GPTConfig:
    """The model a run trains."""
    return GPTConfig(
        context=config.context,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
        tie_head=not config.stable_embedding,
        stable_embedding=config.stable_embedding,
        seed=config.seed,
    )


def build(
    config: TrainConfig, *, topology: Topology, device: torch.device | None = None
) -> tuple[GPT, torch.optim.Optimizer, str]:
    """The run's model (initialized from the seed, distributed as configured) and optimizer,
    plus a one-line description of the layout. Collective (call on every rank)."""
    device = device or _device()
    model = GPT(gpt_config_of(config)).to(device)
    layout = distribute(
        model, config, topology=topology, compute_dtype=_compute_dtype(config, device)
    )
    return model, build_optimizer(model, config), layout


def _largest_unit_params(model: GPT) -> int:
    # FSDP units: each block, and the root (embeddings, final norm, head).
    in_blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    return max(*in_blocks, model.num_params() - sum(in_blocks))


def _fp32_state_params(model: GPT, config: TrainConfig) -> int:
    # What an 8-bit optimizer keeps in 32 bits: 1-D tensors, tensors under its min_8bit_size
    # (4096 elements, the default) and the StableEmbedding weight.
    stable = model.tok_emb.weight if config.stable_embedding else None
    return sum(
        p.numel() for p in model.parameters() if p.dim() < 2 or p.numel() < 4096 or p is stable
    )


def train(config: TrainConfig) -> TrainResult:
    """Run ``config`` on this rank of the current job (initializes the process group from the
    torchrun environment if none exists) and return what it measured."""
    created_group = _init_distributed()
    try:
        return _train(config)
    finally:
        if created_group and dist.is_initialized():
            dist.destroy_process_group()


def _train(config: TrainConfig) -> TrainResult:
    rank, world = dist.get_rank(), dist.get_world_size()
    if config.batch_size % world:
        raise ValueError(
            f"--batch-size {config.batch_size} must be divisible by the world size {world}"
        )
    topology = Topology.from_env(ranks_per_node=config.ranks_per_node)
    device = _device()
    compute_dtype = _compute_dtype(config, device)
    run_dir = Path(config.out)
    is_main = rank == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)

    # The launcher built the token cache already; under torchrun the first rank of each node
    # builds it while the others wait, so they never race on the same files.
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        corpus = load_corpus(
            config.data,
            cache_dir=config.cache_dir,
            val_fraction=config.val_fraction,
            min_tokens=config.context + 1,
        )
    dist.barrier()
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        corpus = load_corpus(
            config.data,
            cache_dir=config.cache_dir,
            val_fraction=config.val_fraction,
            min_tokens=config.context + 1,
        )

    model, optimizer, layout = build(config, topology=topology, device=device)
    gpt_config = model.config
    num_params = model.num_params()
    unit_params = _largest_unit_params(model)
    replicated = config.optim in DATA_PARALLEL_OPTIMIZERS
    features = config.zeropp_features

    start_step = 0
    checkpoints = run_dir / "checkpoints"
    if config.resume:
        latest = ckpt.latest_checkpoint(checkpoints)
        if latest is None:
            raise ckpt.CheckpointError(
                f"--resume: no complete checkpoint under {checkpoints}; run without --resume"
            )
        start_step = ckpt.load_checkpoint(latest, model=model, optimizer=optimizer)

    mem_est = estimate_memory(
        num_params=num_params,
        largest_unit_params=unit_params,
        world_size=world,
        ranks_per_node=topology.ranks_per_node,
        features=features,
        optim=config.optim,
        compute_bytes=torch.finfo(compute_dtype).bits // 8,
        sharded=not replicated,
        fp32_state_params=_fp32_state_params(model, config),
    )
    comm_kwargs = dict(
        num_params=num_params, world_size=world, ranks_per_node=topology.ranks_per_node
    )
    comm_est = (
        None  # data-parallel optimizers: their volume follows their own schedules
        if replicated
        else estimate_comm(**comm_kwargs, features=features, **zeropp_blocks(config))
    )
    zero3_fp32 = estimate_comm(**comm_kwargs, wire_bytes=4.0)
    zero3_16 = estimate_comm(**comm_kwargs, wire_bytes=2.0)
    if is_main:
        (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
        print(
            f"qshard train: {num_params / 1e6:.2f}M params, {layout}, optimizer {config.optim}, "
            f"{compute_dtype} compute, corpus {corpus.source} "
            f"({corpus.train.size / 1e6:.1f}M train / {corpus.val.size / 1e6:.2f}M val tokens)",
            flush=True,
        )
        print(
            table(
                ["component", "bytes per rank"],
                [[k, format_bytes(v)] for k, v in mem_est.items()],
                title="estimate: memory per rank (tensors only)",
            ),
            flush=True,
        )
        if start_step:
            print(f"resumed from step {start_step}", flush=True)

    ledger = CommLedger(topology)
    writer = (
        MetricsWriter(run_dir, resume_step=start_step if config.resume else None)
        if is_main
        else None
    )
    bar = None
    if is_main and config.progress:
        from tqdm import tqdm

        bar = tqdm(total=config.steps, initial=start_step, desc="train", dynamic_ncols=True)

    losses: dict[int, float] = {}
    val_losses: dict[int, float] = {}
    ledger_steps: list[dict[str, float]] = []
    tokens_per_step = config.batch_size * config.context
    last_ckpt: Path | None = None
    t_train = time.perf_counter()
    with recording(ledger):
        for step in range(start_step, config.steps):
            t0 = time.perf_counter()
            lr = learning_rate(step, config)
            for group in optimizer.param_groups:
                group["lr"] = lr
            torch.manual_seed(_mix(config.seed, step, rank))  # see [Note: exact resume]
            x, y = batch_for_step(
                corpus.train,
                step=step,
                seed=config.seed,
                global_batch=config.batch_size,
                context=config.context,
                rank=rank,
                world_size=world,
            )
            _, loss = model(x.to(device), y.to(device))
            loss.backward()
            grad_norm = _global_grad_norm(model, config.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            last = step + 1 == config.steps
            evaluating = bool(config.eval_interval and (step + 1) % config.eval_interval == 0)
            saving = bool(
                config.checkpoint_interval and (step + 1) % config.checkpoint_interval == 0
            )
            if evaluating or saving or last:
                _synchronize(optimizer)
            step_ledger = ledger.step()
            loss_value = _mean_over_ranks(loss)
            if replicated:  # local gradients: report the mean of the ranks' norms
                grad_norm = _mean_over_ranks(torch.tensor(grad_norm))
            dt = time.perf_counter() - t0
            losses[step] = loss_value
            record: dict[str, Any] = {
                "step": step,
                "loss": loss_value,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": tokens_per_step / dt,
                "step_time_s": dt,
                "peak_memory_bytes": peak_memory_bytes(device),
                "intra_node_bytes": step_ledger.intra_node_bytes,
                "inter_node_bytes": step_ledger.inter_node_bytes,
                "ledger": _ledger_record(step_ledger),
            }
            ledger_steps.append(
                {"intra": step_ledger.intra_node_bytes, "inter": step_ledger.inter_node_bytes}
            )
            if evaluating or last:
                # Evaluation traffic goes to a scratch ledger: the run's ledger counts training.
                with recording(CommLedger(topology)):
                    val_losses[step] = _evaluate(model, corpus.val, config, step)
                record["val_loss"] = val_losses[step]
            if writer is not None:
                writer.write(record)
            if bar is not None:
                bar.set_postfix(
                    loss=f"{loss_value:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}", refresh=False
                )
                bar.update(1)
            if saving or last:
                last_ckpt = ckpt.save_checkpoint(
                    checkpoints,
                    step=step + 1,
                    model=model,
                    optimizer=optimizer,
                    meta={"config": config.to_dict()},
                    keep=config.keep_checkpoints,
                    per_rank=replicated,
                )
    train_time = time.perf_counter() - t_train
    if bar is not None:
        bar.close()
    export_path = None
    if config.export and start_step < config.steps:
        export_path = ckpt.export_safetensors(
            model,
            run_dir / "model.safetensors",
            metadata={"gpt_config": json.dumps(_gpt_dict(gpt_config))},
        )
    measured = ledger.gather_summary()
    peak = _max_over_ranks(peak_memory_bytes(device))
    steps_run = max(1, config.steps - start_step)
    result: TrainResult = {
        "losses": losses,
        "val_losses": val_losses,
        "start_step": start_step,
        "num_params": num_params,
        "world_size": world,
        "checkpoint": str(last_ckpt) if last_ckpt else None,
        "export": str(export_path) if export_path else None,
        "ledger": ledger_steps,
        "inter_node_bytes_per_step": measured.inter_node_bytes / steps_run,
        "intra_node_bytes_per_step": measured.intra_node_bytes / steps_run,
        "estimate_inter_node_bytes_per_step": comm_est.total if comm_est else None,
        "ddp_fp32_inter_node_bytes_per_step": ddp_allreduce_bytes(**comm_kwargs),
        "zero3_fp32_inter_node_bytes_per_step": zero3_fp32.total,
        "zero3_16bit_inter_node_bytes_per_step": zero3_16.total,
        "peak_memory_bytes": peak,
        "train_time_s": train_time,
    }
    if is_main:
        summary = _summary(
            config, result, measured, steps_run, mem_est, comm_est, zero3_fp32, zero3_16
        )
        print(summary, flush=True)
        (run_dir / "summary.txt").write_text(summary + "\n")
        (run_dir / "summary.json").write_text(
            json.dumps({k: v for k, v in result.items() if k not in ("losses", "ledger")}, indent=1)
        )
        assert writer is not None
        writer.close()
    return result


def _gpt_dict(cfg: GPTConfig) -> dict[str, Any]:
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}


def _max_over_ranks(value: int) -> int:
    t = torch.tensor([value], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _summary(
    config: TrainConfig,
    result: TrainResult,
    measured: Any,
    steps_run: int,
    mem_est: dict[str, float],
    comm_est: Any,
    zero3_fp32: Any,
    zero3_16: Any,
) -> str:
    losses = result["losses"]
    lines = []
    if losses:
        first, last = losses[min(losses)], losses[max(losses)]
        tail = [losses[s] for s in sorted(losses)[-10:]]
        val = result["val_losses"]
        val_text = f", val loss {val[max(val)]:.4f}" if val else ""
        lines.append(
            f"loss {first:.4f} (step {min(losses)}) -> {last:.4f} (step {max(losses)}), "
            f"mean of last {len(tail)} {sum(tail) / len(tail):.4f}{val_text}"
        )
        tokens = config.batch_size * config.context * len(losses)
        lines.append(
            f"{len(losses)} steps in {result['train_time_s']:.1f} s, "
            f"{tokens / result['train_time_s']:,.0f} tokens/s"
        )

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
    lines.append(
        table(
            ["per step, per node", "intra-node", "inter-node"],
            rows,
            title="communication (comm ledger; bytes leaving each node)",
        )
    )
    inter = measured.inter_node_bytes / steps_run
    if inter > 0 and comm_est is None:
        ddp = result["ddp_fp32_inter_node_bytes_per_step"]
        lines.append(f"cross-node bytes saved vs a fp32 DDP all-reduce: {ddp / inter:.2f}x")
    if inter > 0:
        lines.append(
            f"cross-node bytes saved vs ZeRO-3: {zero3_fp32.total / inter:.2f}x vs the fp32 wire, "
            f"{zero3_16.total / inter:.2f}x vs the 16-bit wire (the paper's baseline)"
        )
    elif measured.entries:
        lines.append("no cross-node bytes measured (one node)")
    else:
        lines.append(
            "the ledger recorded no collectives (plain FSDP2 does not report to it); "
            "the analytic rows above stand alone"
        )
    lines.append(
        table(
            ["memory per rank", "bytes"],
            [
                ["estimate (tensors only)", format_bytes(mem_est["total (tensors only)"])],
                ["measured peak (max over ranks)", format_bytes(result["peak_memory_bytes"])],
            ],
        )
        + "\n(measured on CPU is the process's peak RSS, which includes the runtime itself)"
    )
    return "\n\n".join(["=== qshard train summary ===", *lines])
