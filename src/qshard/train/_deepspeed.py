"""``qshard train --deepspeed-config FILE``: what a DeepSpeed config fixes for a run.

[Note: DeepSpeed config and flags] The file is read with
:func:`qshard.integrations.deepspeed.read_deepspeed_config`. Its settings that have a flag
(``--optim``, ``--zeropp``, ``--lr``, ``--beta1``/``--beta2``, ``--weight-decay``,
``--grad-clip``, ``--dtype``, ``--batch-size``, ``--grad-accum-steps``) replace those flags'
defaults; a flag given explicitly with another value is refused, naming both (one exception:
``--optim adamw8bit`` with the file's Adam/AdamW keeps its hyperparameters and quantizes the
state). Flags the file
does not speak to (model size, steps, schedule, checkpoints) keep theirs, except that the
file's ``lr`` (the schedule's peak) also moves ``--min-lr``'s default with it (the defaults'
ratio, 1/10) unless ``--min-lr`` is given. Settings with no
flag (the 1-bit optimizers' schedules, ZeRO++'s prefetch and wire dtype) reach every rank
through ``TrainConfig.deepspeed_config``, which :mod:`qshard.train._parallel` reads again; a
file without an optimizer section leaves ``--optim`` (with the app's run-sized 1-bit
schedules) to the flag, as DeepSpeed then takes the script's optimizer.
The batch keys are read as DeepSpeed reads them on ``--nproc`` ranks (``train_batch_size =
micro batch x gradient_accumulation_steps x world size``, a missing one derived from the
others) into ``--batch-size`` and ``--grad-accum-steps``.
What the app cannot run (Adam with L2 decay, bf16 gradient reduction, stage 0 with an optimizer
that is not 1-bit or stage 3 with one (the file's optimizer, or ``--optim``'s when the file has
no optimizer section), an lr of 0, batch keys that do not fit the ranks) is refused with the key
and the fix.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from qshard.integrations.deepspeed import (
    DeepSpeedConfigError,
    DeepSpeedTranslation,
    HpzSizeUncheckedWarning,
    read_deepspeed_config,
)
from qshard.train.config import (
    DATA_PARALLEL_OPTIMIZERS,
    TrainConfig,
    parse_zeropp,
)

__all__ = ["apply_deepspeed", "translation"]

_APP_EPS = 1e-8  # the app's Adam eps (no flag)
# The 1-bit optimizers' names in a file (optimizer.type), by their --optim names.
_ONE_BIT_TYPES = {"onebit_adam": "OneBitAdam", "zero_one_adam": "ZeroOneAdam"}
# 1-bit optimizer arguments the app derives from the run unless a DeepSpeed config gives them.
SCHEDULE_KWARGS = (
    "freeze_step",
    "var_freeze_step",
    "var_update_scaler",
    "local_step_scaler",
    "local_step_clipper",
)


# Where each flag's value comes from in a file, for the conflict error: a value the file does
# not write is DeepSpeed's default, and the error said "which sets 0.0" of a file without a
# gradient_clipping key.
_FILE_SOURCE = {
    "optim": "its optimizer.type",
    "lr": "its optimizer.params.lr",
    "beta1": "its optimizer.params.betas",
    "beta2": "its optimizer.params.betas",
    "weight_decay": "its optimizer.params.weight_decay",
    "zeropp": "its zero_optimization section; off at stage 0 or without the section",
    "dtype": "bf16 when its bf16 section is enabled, else fp32",
    "grad_clip": "its gradient_clipping; 0.0, no clipping, where the key is absent",
    "batch_size": (
        "its train_batch_size, or train_micro_batch_size_per_gpu x gradient_accumulation_steps "
        "x --nproc"
    ),
    "grad_accum_steps": (
        "its gradient_accumulation_steps, or train_batch_size / (train_micro_batch_size_per_gpu "
        "x --nproc)"
    ),
}


def translation(path: str, *, ranks_per_node: int | None = None) -> DeepSpeedTranslation:
    """The config at ``path``, translated (raises :class:`DeepSpeedConfigError`). Read without
    ``ranks_per_node``, the library warns that ``zero_hpz_partition_size`` goes unchecked; the
    app checks it against the launch's node size once (:func:`qshard.train.cli.config_from_args`),
    so its other reads stay quiet."""
    with warnings.catch_warnings():
        if ranks_per_node is None:
            warnings.simplefilter("ignore", HpzSizeUncheckedWarning)
        return read_deepspeed_config(path, ranks_per_node=ranks_per_node)


def _flag_values(
    t: DeepSpeedTranslation,
    *,
    nproc: int,
    optim: str,
    optim_given: bool,
    flag_accum: int,
    where: str,
) -> dict[str, Any]:
    """The flags ``t`` fixes. ``optim`` is ``--optim``'s value (``optim_given``: explicitly),
    which the run trains when the file has no ``optimizer`` section; ``flag_accum`` is
    ``--grad-accum-steps``'s, the count where the file gives only a micro batch."""

    def refuse(key: str, why: str) -> DeepSpeedConfigError:
        return DeepSpeedConfigError(f"{where}: {key}: {why}")

    values: dict[str, Any] = {}
    if t.optimizer == "adam":
        raise refuse(
            "optimizer.params.adam_w_mode",
            "false (Adam with L2 weight decay): qshard train trains AdamW; set it to true",
        )
    if t.optimizer is not None:
        kw = t.optimizer_kwargs
        if kw["lr"] <= 0:  # the library takes 0 (torch does); the app's schedule needs a peak
            raise refuse("optimizer.params.lr", f"{kw['lr']}: qshard train needs a peak lr > 0")
        if kw["eps"] != _APP_EPS:
            raise refuse("optimizer.params.eps", f"{kw['eps']}: qshard train uses eps {_APP_EPS}")
        values.update(
            optim=t.optimizer,
            lr=kw["lr"],
            beta1=kw["betas"][0],
            beta2=kw["betas"][1],
            weight_decay=kw["weight_decay"],
        )
    # [Note: the optimizer of a file without one] A file with no optimizer section leaves
    # --optim to the flag (DeepSpeed takes the script's optimizer then), so the stage is
    # checked against the optimizer the run trains, and an error names where it came from: a
    # file holding only {"train_batch_size": 4} was refused as "stage 0 with Adam/AdamW" even
    # with --optim onebit_adam, which runs at stage 0.
    if t.optimizer is not None:
        named = f"the file's optimizer {t.optimizer}"
        one_bit = "set optimizer.type " + " or ".join(_ONE_BIT_TYPES.values())
    else:
        default = "" if optim_given else "its default; "
        named = f"--optim {optim} ({default}the file has no optimizer section)"
        one_bit = "pass --optim " + " or ".join(DATA_PARALLEL_OPTIMIZERS)
    trained = t.optimizer or optim
    if t.zeropp is None:
        if trained not in DATA_PARALLEL_OPTIMIZERS:
            raise refuse(
                "zero_optimization.stage",
                f"0 (also what no zero_optimization section means) with {named} is plain data "
                "parallel, which qshard train does not run: it shards with FSDP2; set "
                f'"zero_optimization": {{"stage": 3}}, or {one_bit} (the 1-bit optimizers '
                "run replicated, at stage 0)",
            )
        values["zeropp"] = "off"
    elif trained in DATA_PARALLEL_OPTIMIZERS:  # the file's own 1-bit optimizer: refused there
        raise refuse(
            "zero_optimization.stage",
            f"3 with {named}: the 1-bit optimizers replicate the model and compress their own "
            "communication (DeepSpeed refuses them with ZeRO too); set stage 0 (or drop the "
            "zero_optimization section), or pass another --optim",
        )
    else:
        on = [name for name in ("qwz", "hpz", "qgz") if getattr(t.zeropp, name)]
        values["zeropp"] = ",".join(on) or "off"
    if t.mp_policy is not None and t.communication_data_type != "fp32":
        raise refuse(
            "communication_data_type",
            'DeepSpeed reduces bf16 gradients in bf16 unless it is "fp32"; qshard train reduces '
            'them in fp32: set "communication_data_type": "fp32"',
        )
    values["dtype"] = "fp32" if t.mp_policy is None else "bf16"
    values["grad_clip"] = t.gradient_clipping
    values.update(_batch_values(t, nproc=nproc, flag_accum=flag_accum, refuse=refuse))
    return values


def _batch_values(
    t: DeepSpeedTranslation, *, nproc: int, flag_accum: int, refuse: Any
) -> dict[str, int]:
    """``batch_size`` and ``grad_accum_steps`` as DeepSpeed derives them on ``nproc`` ranks from
    the keys the file gives (``train_batch_size = micro x accumulation x world size``; a missing
    accumulation count is ``train_batch_size / (micro x world)``, a missing micro batch
    ``train_batch_size / (accumulation x world)``); only what the file determines. A file with a
    micro batch and neither other key leaves the count to ``--grad-accum-steps``
    (``flag_accum``), and its micro batch stays the per-rank micro batch."""
    batch, micro, accum = t.train_batch_size, t.micro_batch_size, t.gradient_accumulation_steps
    out: dict[str, int] = {}
    if micro is not None:
        if accum is None and batch is not None:
            if batch % (micro * nproc):
                raise refuse("train_batch_size", _batch_mismatch(t, nproc=nproc))
            accum = batch // (micro * nproc)  # DeepSpeed derives it
        if batch is not None and batch != micro * (accum or 1) * nproc:
            raise refuse("train_batch_size", _batch_mismatch(t, nproc=nproc))
        batch = micro * (accum or flag_accum) * nproc
    if accum is not None:
        out["grad_accum_steps"] = accum
    if batch is not None:
        out["batch_size"] = batch
    return out


def _batch_mismatch(t: DeepSpeedTranslation, *, nproc: int) -> str:
    """Why a ``train_batch_size`` that is not the micro batch x the accumulation steps x the
    ranks cannot run, and what would: the ranks that fit (the reader checked that the product of
    the per-rank keys divides the global batch), ``train_batch_size`` at the product, or one
    key left out for DeepSpeed's rule to derive."""
    batch, micro, accum = t.train_batch_size, t.micro_batch_size, t.gradient_accumulation_steps
    assert batch is not None and micro is not None
    ranks = f"{nproc} rank{'s' if nproc != 1 else ''}"
    per_rank = micro * (accum or 1)
    product = f"train_micro_batch_size_per_gpu {micro}"
    if accum is not None:
        product += f" x gradient_accumulation_steps {accum}"
    why = f"{batch} is not {product} x {ranks} = {per_rank * nproc}"
    drop = (
        "leave out gradient_accumulation_steps (DeepSpeed derives it)"
        if accum is not None
        else "give only one of the two keys"
    )
    return (
        f"{why}; run on --nproc {batch // per_rank}, set train_batch_size to "
        f"{per_rank * nproc}, or {drop}"
    )


# The app's optimizers a file's optimizer.type names (the 8-bit / 4-bit ones have no type).
_FILE_OPTIMIZER_TYPES = {"adamw": "AdamW", **_ONE_BIT_TYPES}


def resume_advice(config: TrainConfig, saved: Mapping[str, object]) -> dict[str, str]:
    """How to resume a checkpoint (``saved``: its ``qshard.json``) whose run had another value
    of an option that ``config``'s DeepSpeed file sets: the fix for each such flag, by flag
    (empty without a file, or where the file sets none of the changed options; a flag the file
    leaves alone is passed as usual). The flag itself cannot be passed (it would conflict with
    the file), so "pass the same options" sent the user in a circle: a file with
    ``train_micro_batch_size_per_gpu``, resumed on another ``--nproc``, makes another global
    batch, and ``--batch-size`` with the checkpoint's value was refused as a conflict."""
    if not config.deepspeed_config:
        return {}
    before = saved.get("config")
    before = before if isinstance(before, Mapping) else {}
    path = config.deepspeed_config
    t = translation(path)
    ranks = config.nproc  # the world size under torchrun

    def changed(name: str) -> bool:
        return name in before and before[name] != getattr(config, name)

    fixes: dict[str, str] = {}
    if changed("optim") and t.optimizer is not None:
        old = str(before["optim"])
        if old == t.optimizer:  # the file names the run's: the flag swapped it (adamw8bit)
            fix = f"drop --optim {config.optim} (the file's {_FILE_OPTIMIZER_TYPES[old]} is the run's)"
        elif old == "adamw8bit" and t.optimizer == "adamw":
            fix = "pass --optim adamw8bit (the file's AdamW, with 8-bit state)"
        elif old in _FILE_OPTIMIZER_TYPES:
            fix = f'set "optimizer": {{"type": "{_FILE_OPTIMIZER_TYPES[old]}", ...}} there'
        else:  # no optimizer.type names it: the flag chooses where the file has no optimizer
            fix = f"remove the file's optimizer section and pass --optim {old}"
        fixes["--optim"] = f"--optim comes from {path} ({_FILE_SOURCE['optim']}): {fix}"
    if changed("batch_size") and (t.train_batch_size or t.micro_batch_size):
        old = before["batch_size"]
        fix = f'set "train_batch_size": {old} there, without train_micro_batch_size_per_gpu'
        share = ranks * (t.gradient_accumulation_steps or 1)  # micro x accumulation x ranks
        if isinstance(old, int) and old % share == 0:
            fix += (
                f" (or with it at {old // share} on these {ranks} rank{'s' if ranks > 1 else ''})"
            )
        fixes["--batch-size"] = (
            f"--batch-size comes from {path} ({_FILE_SOURCE['batch_size']}): {fix}"
        )
    return fixes


def _same_value(name: str, given: Any, value: Any) -> bool:
    """Whether a flag's value agrees with the file's (``--zeropp`` by the features it names:
    ``all`` and ``qgz,hpz,qwz`` are the file's ``qwz,hpz,qgz``)."""
    if name == "zeropp":
        try:
            return parse_zeropp(str(given)) == parse_zeropp(str(value))
        except ValueError:
            return False
    return given == value


def apply_deepspeed(args: dict[str, Any], *, explicit: set[str]) -> dict[str, Any]:
    """``args`` (the parsed flags) with the DeepSpeed config's values applied; see
    [Note: DeepSpeed config and flags]."""
    path = args["deepspeed_config"]
    t = translation(path)
    if args.get("parallel", "zero3") != "zero3":
        raise DeepSpeedConfigError(
            f"--parallel {args['parallel']} with --deepspeed-config {path}: the file describes "
            "ZeRO-3 (stage 3) or data parallel (stage 0); drop --parallel"
        )
    values = _flag_values(
        t,
        nproc=args["nproc"],
        optim=args["optim"],
        optim_given="optim" in explicit,
        flag_accum=args["grad_accum_steps"],
        where=path,
    )
    out = dict(args)
    for name, value in values.items():
        given = args[name]
        if name == "optim" and value == "adamw" and given == "adamw8bit" and name in explicit:
            continue  # the one swap: same hyperparameters, 8-bit state
        if name in explicit and not _same_value(name, given, value):
            flag = "--" + name.replace("_", "-")
            raise DeepSpeedConfigError(
                f"{flag} {given} conflicts with {path}, which sets {value} "
                f"({_FILE_SOURCE[name]}); drop {flag} or change the file"
            )
        out[name] = value
    if "batch_size" in values:  # after the conflicts: a flag given otherwise is named first
        _check_batch_splits(
            values["batch_size"],
            nproc=args["nproc"],
            accum=out["grad_accum_steps"],
            accum_from_flag="grad_accum_steps" not in values,
            where=path,
        )
    if "lr" in values and "min_lr" not in explicit:
        # The app's cosine schedule stays (the file's lr is its peak); its floor keeps the
        # defaults' ratio, or a file's lr below the default --min-lr would be refused.
        defaults = TrainConfig()
        out["min_lr"] = values["lr"] * defaults.min_lr / defaults.lr
    return out


def _check_batch_splits(
    batch: int, *, nproc: int, accum: int, accum_from_flag: bool, where: str
) -> None:
    """The file's global batch must split evenly over the ranks and their ``accum``
    micro-batches; said of its key (TrainConfig would name ``--batch-size``, a flag not given,
    and suggest a value that then conflicts)."""
    if batch % (nproc * accum):
        fits = next((n for n in range(nproc, 0, -1) if batch % (n * accum) == 0), None)
        each = f"{nproc} ranks" if accum == 1 else f"{nproc} ranks x {accum} micro-batches"
        fixes = f"set a multiple of {nproc * accum} (e.g. "
        fixes += f"{nproc * accum * max(1, batch // (nproc * accum))})"
        if fits is not None:
            fixes += f", or run on --nproc {fits}"
        if accum_from_flag and accum > 1:
            fixes += f", or pass a --grad-accum-steps that divides {batch // nproc}"
        raise DeepSpeedConfigError(
            f"{where}: train_batch_size: {batch} does not split evenly over {each} "
            "(DeepSpeed requires train_batch_size = train_micro_batch_size_per_gpu x "
            f"gradient_accumulation_steps x world size); {fixes}"
        )
