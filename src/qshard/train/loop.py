"""The per-rank training loop of ``qshard train``: :func:`train` runs on every rank.

One step: the global batch of the step (a pure function of seed and step, see
:mod:`qshard.train.data`), forward and backward (in micro-batches with
``--grad-accum-steps``), gradient clipping on the global norm, optimizer
step, ledger step. Every ``eval_interval`` steps a validation estimate; every
``checkpoint_interval`` steps (and at the end) an atomic DCP checkpoint; at the end a
safetensors export and the summary: loss drop, throughput, measured vs estimated memory and
cross-node bytes next to a ZeRO-3 baseline.

The run's parts are built once, each by one function that owns it: the data
(:func:`_load_data`), the model, its parallel layout and the optimizer (:func:`build`, over
:mod:`qshard.train._parallel`), the resume point (:func:`_resume`), the estimates and the
summary (:mod:`qshard.train._summary`), the per-step metrics (:class:`_Recorder`). :func:`_train`
is the loop over them and reads top to bottom.

[Note: fresh runs] A run without ``--resume`` in an ``--out`` that holds an earlier run's
complete checkpoints is refused, unless ``--overwrite`` asks to replace that run: then rank 0
removes its checkpoints, summary and export before any rank goes on (metrics are truncated in
any fresh run). Only the first attempt of the job checks and removes: a restarted attempt must
find this run's own checkpoints. Left in place, the earlier checkpoints were newer than this
run's first saves: a restart (``--max-restarts``) or a later ``--resume`` continued the earlier
run instead (ending at once if it had reached ``--steps``), and keeping the newest
``--keep-checkpoints`` deleted this run's saves as they were written; removed without asking,
a forgotten ``--resume`` would have deleted a long run's checkpoints.

[Note: exact resume] Everything random in a step is derived from ``(seed, step, rank)``: the
batch, and the dropout RNG (reseeded at the start of each step). Together with the model and
optimizer state in the checkpoint, a resumed run replays the uninterrupted one bit for bit
on the same number of ranks.
"""

from __future__ import annotations

import errno
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from qshard.comm import CommLedger, Topology, recording
from qshard.optim import optimizer_state_bytes
from qshard.train import _faults, _runtime, _summary
from qshard.train import checkpoint as ckpt
from qshard.train._in_backward import BackwardStepping
from qshard.train._metrics import MetricsWriter, peak_memory_bytes
from qshard.train._micro import accumulate, micro_batches
from qshard.train._parallel import build_optimizer, distribute, forward_context
from qshard.train.config import (
    DATA_PARALLEL_OPTIMIZERS,
    TrainConfig,
    accumulation_problem,
    resume_mismatches,
    resume_refusal,
)
from qshard.train.data import Corpus, _mix, batch_for_step, load_corpus
from qshard.train.llama import Llama, LlamaSpec
from qshard.train.model import GPT, GPTConfig
from qshard.train.schedule import learning_rate

__all__ = [
    "RankFailure",
    "RunDirError",
    "TrainResult",
    "build",
    "gpt_config_of",
    "learning_rate",
    "llama_spec_of",
    "model_of",
    "run_dir_problem",
    "train",
]

# A failed rank's diagnosis, raised by train(): defined beside the fault handling
# (qshard.train._faults) but public here, where tracebacks and pickles name it.
RankFailure = _faults.RankFailure
RankFailure.__module__ = __name__

TrainResult = dict[str, Any]
"""What :func:`train` returns on every rank: ``losses`` (step -> train loss),
``val_losses`` (step -> val loss), ``skipped_steps`` (steps skipped as non-finite),
``start_step``, ``num_params``, ``checkpoint`` (path),
``ledger`` (per-step inter/intra bytes) and the summary numbers."""


def train(config: TrainConfig) -> TrainResult:
    """Run ``config`` on this rank of the current job (initializes the process group from the
    torchrun environment if none exists) and return what it measured."""
    created_group = _runtime.init_distributed(timeout_s=config.collective_timeout)
    _faults.register_rank()
    try:
        return _train(config)
    except Exception as exc:
        if isinstance(exc, (_faults.RankFailure, ckpt.CheckpointError, RunDirError)):
            raise  # its message is the diagnosis (a path may well contain "socket")
        if not _faults.is_collective_failure(exc):
            raise
        # A peer is hung or dead: name it, the step and the checkpoint ([Note: roll call]).
        checkpoints = Path(config.out) / "checkpoints"
        raise _faults.diagnose(
            exc,
            step=_faults.current_step(),
            timeout_s=config.collective_timeout,
            latest=ckpt.latest_checkpoint(checkpoints),
            checkpoints=checkpoints,
        ) from exc
    finally:
        if created_group and dist.is_initialized():
            dist.destroy_process_group()


def _train(config: TrainConfig) -> TrainResult:
    job = _Job.of(config)
    corpus = _load_data(config)
    model, optimizer, layout = build(config, topology=job.topology, device=job.device)
    _runtime.set_collective_timeout(config.collective_timeout)  # also the groups build() made
    start_step = _resume(config, job, model, optimizer)
    stepping = None
    if config.step_in_backward:
        stepping = BackwardStepping(model, optimizer)
        layout += "; the optimizer steps inside backward"
    if config.grad_accum_steps > 1:
        micro = config.batch_size // (job.world * config.grad_accum_steps)
        layout += f"; {config.grad_accum_steps} micro-batches of {micro} per rank per step"
    estimates = _summary.estimate_run(config, model, job.topology, job.compute_dtype)
    if job.is_main:
        _announce(config, job, model, layout, corpus, estimates, start_step)
    ledger = CommLedger(job.topology)
    recorder = _Recorder.open(config, job, start_step)
    last_ckpt: Path | None = None
    t_train = time.perf_counter()
    with recording(ledger):
        for step in range(start_step, config.steps):
            t0 = time.perf_counter()
            lr = _set_learning_rate(optimizer, step, config)
            stats = _step(model, optimizer, corpus.train, config, job, step, stepping)
            due = _Due.at(step, config)
            if due.evaluate or due.save:
                _synchronize(optimizer)
            record = recorder.step(step, stats, lr, ledger.step(), t0)
            if due.evaluate:
                # Evaluation traffic goes to a scratch ledger: the run's ledger counts training.
                with recording(CommLedger(job.topology)):
                    recorder.validate(record, _evaluate(model, corpus.val, config))
            recorder.write(record)
            if due.save:
                last_ckpt = _save(config, job, model, optimizer, corpus, step + 1)
    train_time = time.perf_counter() - t_train
    recorder.close_bar()
    return _finish(
        config, job, model, optimizer, recorder, ledger, estimates, last_ckpt, train_time
    )


# ----------------------------------------------------------------------------------------------
# The run's parts, each built once.


@dataclass(frozen=True, kw_only=True, slots=True)
class _Job:
    """Where this rank runs: its place in the world, device, dtype and run folder."""

    rank: int
    world: int
    topology: Topology
    device: torch.device
    compute_dtype: torch.dtype
    run_dir: Path

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @classmethod
    def of(cls, config: TrainConfig) -> _Job:
        rank, world = dist.get_rank(), dist.get_world_size()
        if config.batch_size % world:
            raise ValueError(
                f"--batch-size {config.batch_size} must be divisible by the world size {world}"
            )
        problem = accumulation_problem(config.batch_size, world, config.grad_accum_steps)
        if problem:  # under torchrun the world is not --nproc
            raise ValueError(problem)
        device = _runtime.device()
        job = cls(
            rank=rank,
            world=world,
            topology=Topology.from_env(ranks_per_node=config.ranks_per_node),
            device=device,
            compute_dtype=_runtime.compute_dtype(config, device),
            run_dir=Path(config.out),
        )
        fresh = not config.resume and _runtime.restart_count() == 0
        if fresh and not config.overwrite:  # every rank: none may start on a refused run
            ckpt.refuse_earlier_run(config.out, job.checkpoints)
        problem = None
        if job.is_main:
            problem = run_dir_problem(config.out, create=True)
            if problem is None and fresh:
                _clear_previous_run(job)
        # [Note: run directory] every rank learns rank 0's verdict and fails with it.
        verdict = ckpt._from_rank0(problem)
        if verdict is not None:
            raise RunDirError(verdict)
        return job


class RunDirError(ValueError):
    """``--out`` cannot be the run directory (a file, or a folder this process cannot write);
    the message names the path, the reason and the fix."""


def run_dir_problem(out: str | os.PathLike[str], *, create: bool) -> str | None:
    """Why ``out`` cannot be the run directory, or ``None`` when it can: it must be a folder
    this process can write in, or a path where one can be made. ``create`` makes the folder
    (rank 0 of the job); without it (the launcher's check) nothing is left behind: the probe
    file goes into the nearest folder that exists.

    [Note: run directory] Every file of a run lives under ``--out``, and rank 0 alone creates
    it. Unchecked, an ``--out`` under a file or in a folder without write permission failed on
    rank 0 only, with a bare ``OSError`` traceback, while the other ranks waited at the next
    barrier until the launcher killed them, and the launcher then suggested ``--max-restarts``,
    which would fail the same way. The launcher checks the path before any rank starts
    (:func:`qshard.train.cli.preflight`); under torchrun rank 0 checks it, and every rank
    raises its verdict, so the job ends at once with one message naming the fix."""
    path = Path(out)
    where = path
    if not create:  # the folder would be made in the nearest one that exists
        while not where.exists() and where != where.parent:
            where = where.parent
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        elif not where.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(where))
        # Permission bits do not tell (root, read-only mounts, ACLs): write a file and remove it.
        try:
            fd, probe = tempfile.mkstemp(dir=where, prefix=".qshard-write-test.")
        except OSError as exc:  # name the folder, not the probe file
            raise OSError(exc.errno, f"cannot write in it ({exc.strerror})", str(where)) from exc
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        why = f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc)
        return (
            f"--out {out} cannot be the run directory ({why}); pass --out a folder you can "
            "write to (or a path where one can be made)"
        )
    return None


#: ``--model llama``'s export: [Note: a Llama export transformers loads].
_HF_EXPORT = ("hf/model.safetensors", "hf/config.json", "hf/generation_config.json")


def _clear_previous_run(job: _Job) -> None:
    """Rank 0 of a fresh run: remove what an earlier run left in the run folder ([Note: fresh
    runs]); the other ranks wait for its run-directory verdict (:meth:`_Job.of`)."""
    removed = ckpt._discard_all(job.checkpoints)
    for name in ("summary.txt", "summary.json", "model.safetensors", *_HF_EXPORT):
        (job.run_dir / name).unlink(missing_ok=True)
    if (job.run_dir / "hf").is_dir() and not any((job.run_dir / "hf").iterdir()):
        (job.run_dir / "hf").rmdir()
    if removed:
        print(
            f"qshard train: a new run in {job.run_dir}: removed the earlier run's checkpoints "
            f"({', '.join(removed)}); pass --resume to continue a run instead",
            flush=True,
        )


def _load_data(config: TrainConfig) -> Corpus:
    """The token corpus. The launcher built the cache already; under torchrun the first rank
    of each node builds it while the others wait, so they never race on the same files."""

    def load() -> Corpus:
        return load_corpus(
            config.data,
            cache_dir=config.cache_dir,
            val_fraction=config.val_fraction,
            min_tokens=config.context + 1,
        )

    corpus = load() if _runtime.is_local_leader() else None
    dist.barrier()
    return corpus if corpus is not None else load()


def model_of(config: TrainConfig) -> GPT | Llama:
    """The model a run trains (``--model``), initialized from the seed, on the CPU."""
    if config.model == "llama":
        return Llama(llama_spec_of(config))
    return GPT(gpt_config_of(config))


def llama_spec_of(config: TrainConfig) -> LlamaSpec:
    """The Llama of ``--model llama``: sizes from the GPT's flags (see qshard.train.llama)."""
    return LlamaSpec(
        context=config.context,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_kv_head=LlamaSpec.kv_heads_for(config.n_head),
        n_embd=config.n_embd,
        seed=config.seed,
    )


def gpt_config_of(config: TrainConfig) -> GPTConfig:
    """The GPT of ``--model gpt``."""
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
) -> tuple[GPT | Llama, torch.optim.Optimizer, str]:
    """The run's model (initialized from the seed, distributed as configured) and optimizer,
    plus a one-line description of the layout. Collective (call on every rank)."""
    device = device or _runtime.device()
    model = model_of(config).to(device)
    layout = distribute(
        model, config, topology=topology, compute_dtype=_runtime.compute_dtype(config, device)
    )
    return model, build_optimizer(model, config), layout


#: Param-group options the configuration sets that a ``--resume`` applies over the checkpoint's
#: ([Note: resumed hyperparameters]).
_RESUMED_OPTIONS = ("betas", "weight_decay")


def _resume(
    config: TrainConfig, job: _Job, model: nn.Module, optimizer: torch.optim.Optimizer
) -> int:
    """The step to start from: 0, or (``--resume``) the newest checkpoint's, loaded. A restarted
    job falls back past damaged checkpoints, an explicit ``--resume`` refuses them ([Note:
    restart fallback] in qshard.train.checkpoint)."""
    if not config.resume:
        return 0
    # [Note: resumed hyperparameters] Loading restores the saved param groups, and with them
    # the betas and weight decay the checkpointed run used: a --beta2 or --weight-decay changed
    # on --resume was silently dropped (while config.json recorded it). They may change like
    # --lr (which the loop sets every step), so the built optimizer's values are put back after
    # the load. The 1-bit optimizers' schedules (freeze step, sync intervals) keep the
    # checkpoint's: recomputed for another --steps they could unfreeze a frozen variance.
    configured = [
        {k: group[k] for k in _RESUMED_OPTIONS if k in group} for group in optimizer.param_groups
    ]
    loaded = ckpt.load_newest(
        job.checkpoints,
        model=model,
        optimizer=optimizer,
        fall_back=_runtime.restart_count() > 0,
    )
    if loaded is None:
        raise ckpt.CheckpointError(
            f"--resume: no complete checkpoint under {job.checkpoints}; run without --resume"
        )
    if loaded.passed_over and job.is_main:
        print(
            f"qshard train: WARNING: restart {_runtime.restart_count()}: the newest "
            f"checkpoint{'s' if len(loaded.passed_over) > 1 else ''} could not be loaded: "
            f"{'; '.join(loaded.passed_over)}. Falling back to {loaded.path} (step "
            f"{loaded.step}): the steps after it are trained again",
            file=sys.stderr,
            flush=True,
        )
    for group, values in zip(optimizer.param_groups, configured, strict=True):
        group.update(values)
    # The launcher compared the options before any rank started; under torchrun none did.
    saved = ckpt.checkpoint_info(loaded.path)
    changed = resume_mismatches(saved, config)
    if changed:
        from qshard.train._deepspeed import resume_advice

        advice = resume_advice(config, saved)
        raise ckpt.CheckpointError(resume_refusal(loaded.path, changed, advice=advice))
    if loaded.step > config.steps:  # the loop would run no step and report an empty run
        raise ckpt.CheckpointError(
            f"--resume: {loaded.path} is at step {loaded.step}, past --steps {config.steps}; "
            f"pass --steps above {loaded.step} to train further, or a new --out to start fresh"
        )
    return loaded.step


def _save(
    config: TrainConfig,
    job: _Job,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    corpus: Corpus,
    step: int,
) -> Path:
    """An atomic checkpoint of the state after ``step`` optimizer steps. Its meta holds the
    run's config and corpus, which a ``--resume`` must continue (:func:`resume_mismatches`)."""
    return ckpt.save_checkpoint(
        job.checkpoints,
        step=step,
        model=model,
        optimizer=optimizer,
        meta={"config": config.to_dict(), "corpus": {"source": corpus.source, "key": corpus.key}},
        keep=config.keep_checkpoints,
        per_rank=config.optim in DATA_PARALLEL_OPTIMIZERS,
    )


def _announce(
    config: TrainConfig,
    job: _Job,
    model: nn.Module,
    layout: str,
    corpus: Corpus,
    estimates: _summary.Estimates,
    start_step: int,
) -> None:
    """Rank 0: the run's config file and the start-up lines."""
    (job.run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
    num_params = sum(p.numel() for p in model.parameters())
    text = _summary.header(
        config,
        num_params=num_params,
        layout=layout,
        compute_dtype=job.compute_dtype,
        corpus=corpus,
        estimates=estimates,
    )
    print(text, flush=True)
    if start_step:
        print(f"resumed from step {start_step}", flush=True)


# ----------------------------------------------------------------------------------------------
# One step.


def _set_learning_rate(optimizer: torch.optim.Optimizer, step: int, config: TrainConfig) -> float:
    lr = learning_rate(step, config)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def _step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: Any,
    config: TrainConfig,
    job: _Job,
    step: int,
    stepping: BackwardStepping | None = None,
) -> _StepStats:
    """Forward and backward (in ``--grad-accum-steps`` micro-batches: :mod:`._micro`), clip,
    optimizer step (unless the step is non-finite, see
    :func:`_check_finite`); returns the loss mean over ranks and the grad norm (global, or for
    a replicated run the mean of the ranks' norms) as :class:`_StepStats`. With ``stepping``
    (``--step-in-backward``) the optimizer steps inside backward, and the norm is the one its
    per-unit steps saw ([Note: stepping inside backward in the app])."""
    poison = _faults.at_step(step)  # the testing hook, [Note: fault injection]
    torch.manual_seed(_mix(config.seed, step, job.rank))  # see [Note: exact resume]
    x, y = batch_for_step(
        tokens,
        step=step,
        seed=config.seed,
        global_batch=config.batch_size,
        context=config.context,
        rank=job.rank,
        world_size=job.world,
    )
    loss = accumulate(model, x, y, config, job, poison=poison, stepping=stepping)
    if stepping is None:
        stats = _StepStats.reduce(loss, _global_grad_norm(model, config.grad_clip), config, job)
    else:
        stats = _StepStats.reduce(loss, stepping.take_squared_norm(), config, job, squared=True)
    if _check_finite(stats, loss, config, job, step) and stepping is None:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stats


@dataclass(frozen=True, slots=True)
class _StepStats:
    """A step's loss and grad norm, reduced over the ranks in one collective before the
    optimizer steps, so that every rank sees the same non-finite values and takes the same
    decision (the loss mean was reduced after the step before; the values are the same)."""

    loss: float
    grad_norm: float
    finite: bool

    @classmethod
    def reduce(
        cls,
        loss: torch.Tensor,
        grad_norm: float,
        config: TrainConfig,
        job: _Job,
        *,
        squared: bool = False,
    ) -> _StepStats:
        """``squared``: ``grad_norm`` is this rank's sum of squares over its shards (summed
        over the ranks here), not FSDP's global norm."""
        local = torch.stack([loss.detach().float().reshape(()), torch.tensor(grad_norm)])
        total = local.to(_runtime.comm_device())
        dist.all_reduce(total)
        loss_sum, norm_sum = (float(v) for v in total.cpu())
        # FSDP's norm is already global (the same on every rank); a replicated run reports
        # the mean of the ranks' local norms.
        replicated = config.optim in DATA_PARALLEL_OPTIMIZERS
        norm = norm_sum / job.world if replicated else grad_norm
        if squared:
            norm = math.sqrt(norm_sum)  # (a sum of squares: NaN or >= 0)
        finite = math.isfinite(loss_sum) and math.isfinite(norm_sum)
        return cls(loss=loss_sum / job.world, grad_norm=norm, finite=finite)


def _check_finite(
    stats: _StepStats, loss: torch.Tensor, config: TrainConfig, job: _Job, step: int
) -> bool:
    """Whether the step may update: a NaN/Inf loss or grad norm on any rank either skips the
    step on every rank (``--on-nonfinite skip``: all ranks decided on the same reduced values)
    or stops the job with an error naming the step and the ranks whose local loss was
    non-finite (``stop``). The quantized collectives keep non-finite values non-finite
    ([Note: non-finite blocks] in qshard.quant.blockwise), so a NaN on one rank reaches every
    rank's norm."""
    if stats.finite:
        return True
    flags: list[object] = [None] * job.world
    dist.all_gather_object(flags, bool(torch.isfinite(loss.detach()).item()))
    bad = [r for r, ok in enumerate(flags) if not ok]
    where = (
        f"local loss non-finite on rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}"
        if bad
        else "loss finite on every rank, the gradients non-finite"
    )
    what = f"step {step}: loss {stats.loss} / grad norm {stats.grad_norm} ({where})"
    if config.on_nonfinite == "skip":
        if job.is_main:
            print(f"qshard train: {what}; skipped on every rank (--on-nonfinite skip)", flush=True)
        return False
    latest = ckpt.latest_checkpoint(job.checkpoints)
    resume = f"the newest complete checkpoint is {latest}" if latest else "no checkpoint yet"
    # (--step-in-backward has stepped the units already: it cannot skip, the config refuses it)
    how = (
        "drop --step-in-backward and pass --on-nonfinite skip to skip such steps"
        if config.step_in_backward
        else "pass --on-nonfinite skip to skip such steps"
    )
    raise _faults.RankFailure(
        f"rank {job.rank}: {what}; stopped (--on-nonfinite stop; {how}); {resume}"
    )


def _global_grad_norm(model: nn.Module, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


@dataclass(frozen=True, slots=True)
class _Due:
    """What follows a step: a validation estimate, a checkpoint (both at the end, always)."""

    evaluate: bool
    save: bool

    @classmethod
    def at(cls, step: int, config: TrainConfig) -> _Due:
        done = step + 1

        def every(interval: int) -> bool:
            return bool(interval and done % interval == 0) or done == config.steps

        return cls(evaluate=every(config.eval_interval), save=every(config.checkpoint_interval))


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
def _evaluate(model: nn.Module, tokens: Any, config: TrainConfig) -> float:
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
        # in the training's micro-batches: a rank's whole share may not fit at once
        parts = micro_batches(x, y, config.grad_accum_steps)
        for xm, ym in parts:
            with forward_context(config, _runtime.compute_dtype(config, device), device):
                _, loss = model(xm.to(device), ym.to(device))
            total += loss.float() / len(parts)
    model.train()
    return _runtime.mean_over_ranks(total / config.eval_batches)


# ----------------------------------------------------------------------------------------------
# Metrics and the end of the run.


@dataclass(kw_only=True)
class _Recorder:
    """The per-step metrics: kept on every rank, written (JSONL, progress bar) on rank 0."""

    config: TrainConfig
    job: _Job
    start_step: int
    writer: MetricsWriter | None
    bar: Any
    losses: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)
    ledger_steps: list[dict[str, float]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    @classmethod
    def open(cls, config: TrainConfig, job: _Job, start_step: int) -> _Recorder:
        writer = bar = None
        if job.is_main:
            writer = MetricsWriter(job.run_dir, resume_step=start_step if config.resume else None)
        if job.is_main and config.progress:
            from tqdm import tqdm

            bar = tqdm(total=config.steps, initial=start_step, desc="train", dynamic_ncols=True)
        return cls(config=config, job=job, start_step=start_step, writer=writer, bar=bar)

    def step(
        self, step: int, stats: _StepStats, lr: float, ledger: Any, t0: float
    ) -> dict[str, Any]:
        """The step's record (the loss and norm were reduced over the ranks in :func:`_step`)."""
        dt = time.perf_counter() - t0
        self.losses[step] = stats.loss
        if not stats.finite:
            self.skipped.append(step)
        self.ledger_steps.append(
            {"intra": ledger.intra_node_bytes, "inter": ledger.inter_node_bytes}
        )
        return {
            "step": step,
            "loss": stats.loss,
            "lr": lr,
            "grad_norm": stats.grad_norm,
            **({} if stats.finite else {"skipped": True}),
            "tokens_per_s": self.config.batch_size * self.config.context / dt,
            "step_time_s": dt,
            "peak_memory_bytes": peak_memory_bytes(self.job.device),
            "intra_node_bytes": ledger.intra_node_bytes,
            "inter_node_bytes": ledger.inter_node_bytes,
            "ledger": {
                f"{e.tag}/{e.op}": {"intra": e.intra_node_bytes, "inter": e.inter_node_bytes}
                for e in ledger.entries
            },
        }

    def validate(self, record: dict[str, Any], val_loss: float) -> None:
        self.val_losses[record["step"]] = val_loss
        record["val_loss"] = val_loss

    def write(self, record: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.write(record)
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False
            )
            self.bar.update(1)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _finish(
    config: TrainConfig,
    job: _Job,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    recorder: _Recorder,
    ledger: CommLedger,
    estimates: _summary.Estimates,
    last_ckpt: Path | None,
    train_time: float,
) -> TrainResult:
    """Export, gather the measurements, and (rank 0) print and write the summary."""
    start_step = recorder.start_step
    trained = start_step < config.steps
    export_path = None
    # A restart after the final checkpoint (a rank died exporting) trains nothing, but the
    # export may be missing still; the file appears atomically, so present means complete.
    # [Note: a Llama export transformers loads] --model llama exports the wrapped
    # LlamaForCausalLM in its own tensor names with its config.json into --out/hf, the layout of
    # save_pretrained, so LlamaForCausalLM.from_pretrained(--out/hf) loads it (the run folder's
    # own config.json is the run's configuration). The JSON files go first: the model file
    # appears atomically, so its presence means all are there.
    llama = isinstance(model, Llama)
    target = job.run_dir / (_HF_EXPORT[0] if llama else "model.safetensors")
    # An extended run's earlier summary and export describe an earlier step: a launch that
    # trains nothing rewrites them unless they are this --steps' ([Note: finishing a run]).
    current = _summary.finished_step(job.run_dir) == config.steps
    if config.export and (trained or not current or not target.is_file()):
        shape = model.config  # type: ignore[union-attr]
        meta = {name: getattr(shape, name) for name in shape.__dataclass_fields__}
        if isinstance(model, FSDPModule):  # every rank: the root may be unsharded, see
            model.reshard()  # Llama.pretrained_files (nothing is sent; the next use gathers)
        if llama and job.is_main:
            target.parent.mkdir(exist_ok=True)
            for name, text in model.pretrained_files().items():  # type: ignore[union-attr]
                tmp = target.parent / f".{name}.tmp"
                tmp.write_text(text)
                os.replace(tmp, target.parent / name)
        export_path = ckpt.export_safetensors(
            model,
            target,
            metadata={f"{config.model}_config": json.dumps(meta)},
            prefix="hf." if llama else "",
        )
    measured = ledger.gather_summary()
    peak = _runtime.max_over_ranks(peak_memory_bytes(job.device))
    steps_run = max(1, config.steps - start_step)
    result: TrainResult = {
        "losses": recorder.losses,
        "val_losses": recorder.val_losses,
        "skipped_steps": recorder.skipped,
        "start_step": start_step,
        # The summary's figures are this launch's ([Note: resumed summary] in _summary).
        "resumed_from_step": start_step if start_step else None,
        "steps_trained": len(recorder.losses),
        "num_params": sum(p.numel() for p in model.parameters()),
        "world_size": job.world,
        "num_nodes": job.topology.num_nodes,
        "checkpoint": str(last_ckpt) if last_ckpt else None,
        "export": str(export_path) if export_path else None,
        "ledger": recorder.ledger_steps,
        "inter_node_bytes_per_step": measured.inter_node_bytes / steps_run,
        "intra_node_bytes_per_step": measured.intra_node_bytes / steps_run,
        "estimate_inter_node_bytes_per_step": estimates.comm.total if estimates.comm else None,
        "ddp_fp32_inter_node_bytes_per_step": estimates.ddp_fp32,
        "zero3_fp32_inter_node_bytes_per_step": estimates.zero3_fp32.total,
        "zero3_16bit_inter_node_bytes_per_step": estimates.zero3_16.total,
        "peak_memory_bytes": peak,
        "optimizer_state_bytes": _runtime.max_over_ranks(optimizer_state_bytes(optimizer)),
        "train_time_s": train_time,
    }
    if job.is_main:
        text = _summary.summary(config, result, measured, steps_run, estimates)
        print(text, flush=True)
        if trained or not current:  # keep the run's own
            _summary.write_summary(job.run_dir, text, result)
    recorder.close()
    return result
