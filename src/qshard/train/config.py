"""``TrainConfig``: every option of one ``qshard train`` run, validated before any rank starts.

The CLI (:mod:`qshard.train.cli`) is a thin argparse layer over this dataclass: one flag per
field, same name with dashes. Combinations that cannot work are refused here, with the fix in
the message, so a bad run fails in the launcher instead of on every rank.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DTYPES",
    "ON_NONFINITE",
    "OPTIMIZERS",
    "RESUME_MUST_MATCH",
    "ZEROPP_FEATURES",
    "TrainConfig",
    "accumulation_problem",
    "corpus_source",
    "launch_ranks_per_node",
    "parse_zeropp",
    "resume_mismatches",
    "resume_refusal",
]

ZEROPP_FEATURES: tuple[str, ...] = ("qwz", "hpz", "qgz")
"""The three ZeRO++ features: quantized weights, hierarchical partitioning, quantized grads."""

OPTIMIZERS: tuple[str, ...] = ("adamw", "adamw8bit", "adamw4bit", "onebit_adam", "zero_one_adam")
"""Optimizers ``qshard train`` knows."""

MODELS: tuple[str, ...] = ("gpt", "llama")
"""Models ``qshard train`` trains: its own GPT, or ``transformers``' Llama (optional package)."""

DATA_PARALLEL_OPTIMIZERS: tuple[str, ...] = ("onebit_adam", "zero_one_adam")
"""Optimizers that own their communication: replicated model, no FSDP, no ZeRO++."""

ON_NONFINITE: tuple[str, ...] = ("stop", "skip")
"""What the loop does with a non-finite loss or gradient norm (``--on-nonfinite``)."""

PARALLELISMS: tuple[str, ...] = ("zero3", "hsdp")
"""How ``--parallel`` lays the model out: ``zero3`` shards over every rank (FSDP2, with
``--zeropp``); ``hsdp`` shards inside a node and replicates across nodes (docs/hsdp.md)."""

REPLICATE_GRADS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4")
"""Wire formats of HSDP's inter-node gradient all-reduce (``--replicate-grads``)."""

DTYPES: tuple[str, ...] = ("auto", "fp32", "bf16")
"""Compute dtypes: ``auto`` is fp32 on CPU (bf16 matmuls are ~65x slower there) and bf16 on
CUDA."""


def parse_zeropp(spec: str) -> frozenset[str]:
    """``"off"`` -> {}, ``"all"`` -> all three, else a comma list such as ``"qwz,hpz"``."""
    spec = spec.strip().lower()
    if spec == "off":
        return frozenset()
    if spec == "all":
        return frozenset(ZEROPP_FEATURES)
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    unknown = [p for p in parts if p not in ZEROPP_FEATURES]
    if unknown or not parts:
        raise ValueError(
            f"--zeropp {spec!r} is not understood; use off, all, or a comma list of "
            f"{', '.join(ZEROPP_FEATURES)} (e.g. qwz,hpz)"
        )
    return frozenset(parts)


#: Fields that name files or folders (``os.PathLike`` accepted, kept as ``str``).
_PATH_FIELDS = frozenset({"out", "data", "cache_dir", "deepspeed_config"})


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """One training run. Defaults: the README's main job (a few minutes on 2 CPU cores)."""

    # --- where
    out: str = "runs/default"
    """Run directory: metrics, checkpoints, export and plots go there."""
    data: str | None = None
    """A text file or folder to train on; ``None`` uses the Python standard library."""
    cache_dir: str | None = None
    """Where the token cache lives; ``None``: ``$QSHARD_CACHE`` or ``~/.cache/qshard``."""
    val_fraction: float = 0.05
    """Fraction of files (by path hash) held out for validation."""
    resume: bool = False
    """Continue from the newest checkpoint in ``out`` (error if there is none)."""
    overwrite: bool = False
    """Start a new run in an ``out`` that holds an earlier run's checkpoints, removing them
    (without it such a run is refused: pass ``--resume`` to continue the earlier one; with
    ``--resume`` it changes nothing)."""
    # --- launch
    nproc: int = 4
    """Ranks to start on this machine (ignored under torchrun, which starts them)."""
    ranks_per_node: int | None = None
    """Ranks per (emulated) node. ``None``: ``LOCAL_WORLD_SIZE`` under torchrun; on a local
    launch two emulated nodes (``nproc // 2``) when ``nproc`` is even, else one node."""
    # --- model
    model: str = "gpt"
    """One of :data:`MODELS`: ``gpt`` (qshard.train.model) or ``llama`` (transformers'
    LlamaForCausalLM: RoPE, grouped-query attention, RMSNorm, SwiGLU; needs transformers)."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads."""
    n_embd: int = 256
    """Model width."""
    context: int = 128
    """Tokens per training sequence."""
    stable_embedding: bool = False
    """Use ``qshard.nn.StableEmbedding`` (implies an untied head)."""
    # --- distribution and optimizer
    zeropp: str = "all"
    """ZeRO++ features: ``off`` (plain FSDP2 ZeRO-3), ``all``, or a list like ``qwz,hpz``."""
    optim: str = "adamw8bit"
    """One of :data:`OPTIMIZERS`."""
    parallel: str = "zero3"
    """``zero3`` (shard over every rank; ZeRO++ with ``--zeropp``) or ``hsdp`` (shard inside a
    node, replicate across nodes; needs ``--zeropp off``); one of :data:`PARALLELISMS`. With
    ``hsdp``, 1-bit Adam / 0/1 Adam sync the replicas themselves (no gradient crosses nodes)."""
    replicate_grads: str = "fp32"
    """HSDP's inter-node gradient all-reduce: ``fp32`` (FSDP2's own), ``bf16`` (16-bit wire),
    ``int8`` / ``int4`` (block-quantized, fp32 between hops); one of :data:`REPLICATE_GRADS`."""
    dtype: str = "auto"
    """Compute dtype, one of :data:`DTYPES` (parameters and reductions stay fp32)."""
    deepspeed_config: str | None = None
    """A DeepSpeed JSON config to take the run's settings from (ZeRO++ features, optimizer and
    its hyperparameters, precision, clipping, batch): its values replace the matching flags'
    defaults, an explicit flag with another value is refused (docs/deepspeed.md)."""
    # --- schedule
    steps: int = 200
    """Optimizer steps (total, counting resumed ones)."""
    batch_size: int = 8
    """Global batch in sequences; split evenly over the ranks."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step: each rank runs its share of the global batch as this
    many forward/backward passes and sums their gradients before the step (the same update,
    less activation memory; DeepSpeed's ``gradient_accumulation_steps``). Under ZeRO-3 each
    micro-batch's gradients are reduce-scattered (cross-node bytes grow with it); under HSDP
    only the last one's cross the nodes."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate the cosine decay ends at, at step ``steps`` (one past the last step run:
    the last step trains a little above it). Left at this default with an ``lr`` below it, it
    becomes a tenth of ``lr`` (the command notes it)."""
    warmup_steps: int = 20
    """Linear warm-up steps to ``lr``; must be below ``steps``. Left at this default on a run
    of 20 steps or fewer, it becomes a tenth of ``steps`` (the command notes it)."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices and embeddings (not on biases and norms)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    step_in_backward: bool = False
    """Step the optimizer inside backward, one FSDP unit at a time as its reduced gradient
    lands, and free that gradient at once (``qshard.zeropp.StepInBackward``): less gradient
    memory, the same bits as the usual step. Needs ``--grad-clip 0`` (the first units step
    before the global norm exists), ``--on-nonfinite stop``, ``--parallel zero3`` and an
    optimizer that steps locally (not 1-bit Adam / 0/1 Adam)."""
    seed: int = 0
    """Seed of the model init, the data order and dropout."""
    # --- observation
    eval_interval: int = 50
    """Evaluate validation loss every N steps (and at the end); 0: only at the end."""
    eval_batches: int = 4
    """Global batches per validation estimate."""
    checkpoint_interval: int = 0
    """Save a DCP checkpoint every N steps (always at the end); 0: only at the end."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept in ``out/checkpoints``."""
    export: bool = True
    """Write ``out/model.safetensors`` at the end."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    # --- faults (docs/reliability.md)
    max_restarts: int = 0
    """Restart the job up to N times when a rank fails (torch elastic's restarts; with torchrun
    pass torchrun's own ``--max-restarts``): every restart resumes from the newest complete
    checkpoint by itself, so set ``--checkpoint-interval`` to bound the work redone."""
    collective_timeout: float = 600.0
    """Seconds a collective may wait for its peers before the job stops with an error naming
    the ranks that did not answer, the step and the checkpoint to resume from."""
    on_nonfinite: str = "stop"
    """When the loss or the global gradient norm is NaN/Inf on any rank: ``stop`` with an error
    naming the step and the rank(s), or ``skip`` the step on every rank (no update, the
    optimizer state untouched) and go on; one of :data:`ON_NONFINITE`."""

    def __post_init__(self) -> None:
        self._check_types()
        # "--out=~/runs" reaches us unexpanded (the shell expands ~ only at a word's start):
        # it made a folder named "~" in the current directory
        for name in _PATH_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str) and value.startswith("~"):
                object.__setattr__(self, name, os.path.expanduser(value))

        def positive(name: str, *, zero_ok: bool = False) -> None:
            value = getattr(self, name)
            if (
                not isinstance(value, int)
                or isinstance(value, bool)
                or value < (0 if zero_ok else 1)
            ):
                bound = ">= 0" if zero_ok else ">= 1"
                raise ValueError(
                    f"--{name.replace('_', '-')} must be an int {bound}; got {value!r}"
                )

        for name in ("nproc", "n_layer", "n_head", "n_embd", "context", "steps", "batch_size"):
            positive(name)
        positive("grad_accum_steps")
        for name in ("warmup_steps", "eval_interval", "checkpoint_interval", "seed"):
            positive(name, zero_ok=True)
        positive("eval_batches")
        positive("keep_checkpoints")
        positive("max_restarts", zero_ok=True)
        if self.seed >= 2**64:  # torch.Generator.manual_seed takes 64 bits
            raise ValueError(f"--seed must be below 2**64; got {self.seed}")
        if not 0 < self.collective_timeout <= _MAX_TIMEOUT_S:  # also refuses NaN and inf
            raise ValueError(
                f"--collective-timeout must be > 0 and at most {_MAX_TIMEOUT_S:g} seconds; "
                f"got {self.collective_timeout}"
            )
        if self.on_nonfinite not in ON_NONFINITE:
            raise ValueError(
                f"--on-nonfinite {self.on_nonfinite!r} is unknown; choose from "
                f"{', '.join(ON_NONFINITE)}"
            )
        if self.ranks_per_node is not None:
            positive("ranks_per_node")
        if not self.out:
            raise ValueError("--out must name a run directory")
        for name, default in (
            ("data", "the Python standard library"),
            ("cache_dir", "the default"),
            # was read as "no file": the run took the flags' defaults without a word
            ("deepspeed_config", "the flags' own settings"),
        ):
            if getattr(self, name) == "":  # Path("") is the working directory
                raise ValueError(
                    f"--{name.replace('_', '-')} is an empty string; omit it to use {default}"
                )
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"--val-fraction must be in (0, 1); got {self.val_fraction}")
        if self.n_embd % self.n_head:
            raise ValueError(f"--n-embd {self.n_embd} must be divisible by --n-head {self.n_head}")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            # NaN fails every comparison, so it is refused by name; grad_clip may be inf (off).
            if math.isnan(value) or (math.isinf(value) and name != "grad_clip"):
                what = "a number" if math.isnan(value) else "finite"
                raise ValueError(f"--{name.replace('_', '-')} must be {what}; got {value}")
            if name == "lr" and value <= 0:
                raise ValueError(f"--lr must be > 0; got {value}")
            if value < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0; got {value}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} must not exceed --lr {self.lr}")
        if self.warmup_steps >= self.steps:  # --steps 1 too: it trained at lr / warmup_steps
            raise ValueError(
                f"--warmup-steps {self.warmup_steps} must be below --steps {self.steps} (e.g. "
                f"--warmup-steps {self.steps // 10})"
            )
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name} must be in [0, 1); got {getattr(self, name)}")
        if self.optim not in OPTIMIZERS:
            raise ValueError(
                f"--optim {self.optim!r} is unknown; choose from {', '.join(OPTIMIZERS)}"
            )
        if self.model not in MODELS:
            raise ValueError(f"--model {self.model!r} is unknown; choose from {', '.join(MODELS)}")
        if self.model == "llama" and self.stable_embedding:
            raise ValueError(
                "--stable-embedding replaces the GPT's token embedding; drop it for --model llama"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is unknown; choose from {', '.join(DTYPES)}")
        features = parse_zeropp(self.zeropp)  # raises with the fix
        self._check_parallel(features)
        self._check_step_in_backward()
        if self.optim in DATA_PARALLEL_OPTIMIZERS and features:
            raise ValueError(
                f"--optim {self.optim} is data-parallel (it replicates the model and compresses "
                f"its own communication), so it cannot run with ZeRO++ sharding "
                f"(--zeropp {self.zeropp}); pass --zeropp off"
            )
        if self.ranks_per_node is not None and self.nproc % self.ranks_per_node:
            raise ValueError(
                f"--nproc {self.nproc} must be a multiple of --ranks-per-node "
                f"{self.ranks_per_node} (nodes hold equal numbers of ranks); e.g. "
                f"--ranks-per-node {_largest_divisor_at_most(self.nproc, self.ranks_per_node)}"
            )
        if self.batch_size % self.nproc:
            if self.resume:  # the batch size is the checkpointed run's (RESUME_MUST_MATCH)
                ranks = [n for n in range(1, self.batch_size + 1) if self.batch_size % n == 0]
                raise ValueError(
                    f"--batch-size {self.batch_size} must be divisible by the number of ranks "
                    f"{self.nproc}, and a --resume keeps the run's batch size: pass --nproc "
                    f"among {', '.join(map(str, ranks))}"
                )
            raise ValueError(
                f"--batch-size {self.batch_size} must be divisible by the number of ranks "
                f"{self.nproc}; e.g. --batch-size {self.nproc * max(1, self.batch_size // self.nproc)}"
            )
        problem = accumulation_problem(self.batch_size, self.nproc, self.grad_accum_steps)
        if problem:
            raise ValueError(problem)

    def _check_types(self) -> None:
        """Each field's kind, named with its flag: built in Python (not by the CLI's parser),
        ``resume="no"`` resumed (a non-empty string is true), ``lr="0.001"`` failed with
        "must be real number, not str" and ``zeropp=None`` with an AttributeError. Paths may
        be ``os.PathLike`` (kept as their string)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            flag = f"--{f.name.replace('_', '-')}"
            optional = f.type.endswith("| None")
            if value is None and optional:
                continue
            kind = f.type.removesuffix(" | None")
            if kind == "str" and f.name in _PATH_FIELDS and isinstance(value, os.PathLike):
                object.__setattr__(self, f.name, os.fspath(value))
                continue
            ok = {
                "bool": isinstance(value, bool),
                "int": isinstance(value, int) and not isinstance(value, bool),
                "float": isinstance(value, (int, float)) and not isinstance(value, bool),
                "str": isinstance(value, str),
            }[kind]
            if not ok:
                what = {"bool": "True or False", "int": "an int", "float": "a number"}.get(
                    kind, "a path" if f.name in _PATH_FIELDS else "a string"
                )
                raise TypeError(
                    f"TrainConfig.{f.name} ({flag}) must be {what}"
                    f"{' or None' if optional else ''}; got {value!r} ({type(value).__name__})"
                )

    def _check_parallel(self, features: frozenset[str]) -> None:
        if self.parallel not in PARALLELISMS:
            raise ValueError(
                f"--parallel {self.parallel!r} is unknown; choose from {', '.join(PARALLELISMS)}"
            )
        if self.replicate_grads not in REPLICATE_GRADS:
            raise ValueError(
                f"--replicate-grads {self.replicate_grads!r} is unknown; choose from "
                f"{', '.join(REPLICATE_GRADS)}"
            )
        if self.parallel != "hsdp":
            if self.replicate_grads != "fp32":
                raise ValueError(
                    f"--replicate-grads {self.replicate_grads} sets HSDP's inter-node all-reduce; "
                    "pass --parallel hsdp (or drop --replicate-grads)"
                )
            return
        if features:
            raise ValueError(
                f"--parallel hsdp shards inside a node only, so ZeRO++'s cross-node features "
                f"have nothing to act on (--zeropp {self.zeropp}); pass --zeropp off and choose "
                "the inter-node gradient format with --replicate-grads"
            )
        if self.optim in DATA_PARALLEL_OPTIMIZERS and self.replicate_grads != "fp32":
            raise ValueError(
                f"--optim {self.optim} on HSDP sends no gradient across nodes (it syncs the "
                f"replicas itself), so --replicate-grads {self.replicate_grads} has nothing to "
                "compress; drop it"
            )

    def _check_step_in_backward(self) -> None:
        if not self.step_in_backward:
            return
        why = "--step-in-backward steps each FSDP unit as its gradient lands"
        if self.grad_clip and not math.isinf(self.grad_clip):
            fix = (  # a DeepSpeed file sets the clip: the flag would conflict with it
                f'set "gradient_clipping": 0 in {self.deepspeed_config}'
                if self.deepspeed_config
                else "pass --grad-clip 0"
            )
            raise ValueError(
                f"{why}, before the global gradient norm exists, so it cannot clip to it: "
                f"{fix}, or drop --step-in-backward"
            )
        if self.on_nonfinite == "skip":
            raise ValueError(
                f"{why}, before the last gradients are known, so a non-finite step cannot be "
                "skipped: pass --on-nonfinite stop (the job stops; resume from the newest "
                "checkpoint), or drop --step-in-backward"
            )
        if self.optim in DATA_PARALLEL_OPTIMIZERS:
            raise ValueError(
                f"{why}, and --optim {self.optim} communicates in its step (a collective over "
                "every gradient); pick a local optimizer (adamw, adamw8bit, adamw4bit) or drop "
                "--step-in-backward"
            )
        if self.parallel == "hsdp":
            raise ValueError(
                f"{why}, and HSDP's gradient is final only after its inter-node all-reduce; pass "
                "--parallel zero3, or drop --step-in-backward"
            )

    def local_ranks_per_node(self) -> int:
        """``ranks_per_node`` for a launch on this machine (see the field's doc)."""
        return launch_ranks_per_node(self.nproc, self.ranks_per_node)

    @property
    def zeropp_features(self) -> frozenset[str]:
        """The enabled ZeRO++ features."""
        return parse_zeropp(self.zeropp)

    def replace(self, **changes: object) -> TrainConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


_MAX_TIMEOUT_S = 1e9
"""The longest ``--collective-timeout`` (~31 years): a ``timedelta`` overflows near 8.6e13 s."""


RESUME_MUST_MATCH: tuple[str, ...] = (
    # The state in the checkpoint depends on these: other values cannot load it.
    "model",
    "n_layer",
    "n_head",
    "n_embd",
    "context",
    "stable_embedding",
    "optim",
    # The data stream: the global batch of a step is a function of the corpus, its split, the
    # seed and the batch size (qshard.train.data); other values train on other data, or on the
    # held-out files, while the run claims to continue.
    "seed",
    "batch_size",
    "val_fraction",
)
"""Fields a ``--resume`` must keep (plus ``--data``, compared by :func:`corpus_source`, and
``--parallel`` for the data-parallel optimizers' per-rank state). Everything else may change:
the schedule (``--steps`` to extend a run, ``--lr``, ...), ``--nproc`` (DCP reshards),
``--grad-accum-steps`` (the same global batch in other micro-batches), the intervals and the
launch and fault options."""


def launch_ranks_per_node(nproc: int, ranks_per_node: int | None) -> int:
    """The ranks per emulated node of a launch of ``nproc`` local ranks: ``ranks_per_node``,
    else two nodes of ``nproc // 2`` when ``nproc`` is even, else one node."""
    if ranks_per_node is not None:
        return ranks_per_node
    return nproc // 2 if nproc % 2 == 0 else nproc


def corpus_source(data: str | None) -> str:
    """What ``--data`` names, as :class:`qshard.train.data.Corpus` records it: the resolved
    path, or ``python-stdlib``."""
    return "python-stdlib" if data is None else str(Path(data).expanduser().resolve())


def resume_mismatches(saved: Mapping[str, object], config: TrainConfig) -> list[str]:
    """The options ``config`` changes against a checkpoint's ``qshard.json`` (``saved``: its
    ``config`` and ``corpus``) that a resume cannot take, each as ``--flag SAVED (now NOW)``;
    empty when ``config`` continues that run. Options the checkpoint does not record (written
    by an older qshard) are not compared."""
    saved_config = saved.get("config")
    saved_config = saved_config if isinstance(saved_config, Mapping) else {}
    must_match = RESUME_MUST_MATCH
    # Per-rank files (the checkpoint's optimizer is a 1-bit one): each rank's own part. By the
    # checkpoint's optimizer, not the new run's: an adamw8bit run resumed with --optim
    # onebit_adam was also told to put back its --parallel, which it may change.
    if saved_config.get("optim", config.optim) in DATA_PARALLEL_OPTIMIZERS:
        must_match += ("parallel",)
    changed = [
        f"--{name.replace('_', '-')} {saved_config[name]} (now {getattr(config, name)})"
        for name in must_match
        if name in saved_config and saved_config[name] != getattr(config, name)
    ]
    # The corpus by resolved path: a relative --data from another folder is the same corpus.
    corpus = saved.get("corpus")
    if isinstance(corpus, Mapping) and isinstance(corpus.get("source"), str):
        before = corpus["source"]
    elif "data" in saved_config:  # older checkpoints: the flag as given, resolved from here
        data = saved_config["data"]
        before = corpus_source(data if isinstance(data, str) else None)
    else:
        before = None
    now = corpus_source(config.data)
    if before is not None and before != now:

        def show(source: str) -> str:
            return "(the Python standard library)" if source == "python-stdlib" else source

        changed.append(f"--data {show(before)} (now {show(now)})")
    return changed


def resume_refusal(
    checkpoint: object, changed: list[str], *, advice: Mapping[str, str] | None = None
) -> str:
    """The error for a ``--resume`` that changes what :func:`resume_mismatches` found.
    ``advice`` holds the fix of each flag that cannot simply be passed again, by flag (a
    DeepSpeed config sets it: ``qshard.train._deepspeed.resume_advice``); the others are to be
    passed as the run had them."""
    advice = advice or {}
    flags = [c.split(" ", 1)[0] for c in changed]  # "--seed 0 (now 1)" -> "--seed"
    rest = [flag for flag in flags if flag not in advice]
    how = list(advice.values())
    if rest and how:
        how.append(f"pass the checkpoint's {', '.join(rest)}")
    elif not how:
        how.append("pass the same options to resume it")
    return (
        f"--resume: {checkpoint} was written with {', '.join(changed)}; {'; '.join(how)} (a "
        "resume continues that run: its model, optimizer and data), or a new --out to start "
        "fresh"
    )


def accumulation_problem(batch_size: int, world: int, steps: int) -> str | None:
    """Why ``--grad-accum-steps steps`` cannot split a rank's share of ``--batch-size`` over
    ``world`` ranks into equal micro-batches (each at least one sequence), with the fix; None
    when it can (``batch_size`` already divides by ``world``). Equal micro-batches keep the
    step's loss the mean over the whole global batch."""
    if steps == 1 or batch_size % world:
        return None
    per_rank = batch_size // world
    if per_rank % steps == 0:
        return None
    fits = [k for k in range(1, per_rank + 1) if per_rank % k == 0]
    return (
        f"--grad-accum-steps {steps} must divide each rank's {per_rank} "
        f"sequence{'s' if per_rank != 1 else ''} (--batch-size "
        f"{batch_size} over {world} rank{'s' if world != 1 else ''}) into equal micro-batches: "
        f"pass --grad-accum-steps among {', '.join(map(str, fits))}, or --batch-size "
        f"{world * steps * -(-per_rank // steps)}"
    )


def _largest_divisor_at_most(n: int, bound: int) -> int:
    return max(d for d in range(1, min(n, bound) + 1) if n % d == 0)
