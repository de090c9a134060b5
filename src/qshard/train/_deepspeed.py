"""``qshard train --deepspeed-config FILE``: what a DeepSpeed config fixes for a run.

[Note: DeepSpeed config and flags] The file is read with
:func:`qshard.integrations.deepspeed.read_deepspeed_config`. Its settings that have a flag
(``--optim``, ``--zeropp``, ``--lr``, ``--beta1``/``--beta2``, ``--weight-decay``,
``--grad-clip``, ``--dtype``, ``--batch-size``) replace those flags' defaults; a flag given
explicitly with another value is refused, naming both (one exception: ``--optim adamw8bit``
with the file's Adam/AdamW keeps its hyperparameters and quantizes the state). Flags the file
does not speak to (model size, steps, schedule, checkpoints) keep theirs, except that the
file's ``lr`` (the schedule's peak) also moves ``--min-lr``'s default with it (the defaults'
ratio, 1/10) unless ``--min-lr`` is given. Settings with no
flag (the 1-bit optimizers' schedules, ZeRO++'s prefetch and wire dtype) reach every rank
through ``TrainConfig.deepspeed_config``, which :mod:`qshard.train._parallel` reads again.
What the app cannot run (gradient accumulation, Adam with L2 decay, bf16 gradient reduction,
stage 0 with Adam, an lr of 0, a ``train_batch_size`` that does not split over the ranks) is
refused with the key and the fix.
"""

from __future__ import annotations

import warnings
from typing import Any

from qshard.integrations.deepspeed import (
    DeepSpeedConfigError,
    DeepSpeedTranslation,
    HpzSizeUncheckedWarning,
    read_deepspeed_config,
)
from qshard.train.config import TrainConfig, parse_zeropp

__all__ = ["apply_deepspeed", "translation"]

_APP_EPS = 1e-8  # the app's Adam eps (no flag)
# 1-bit optimizer arguments the app derives from the run unless a DeepSpeed config gives them.
SCHEDULE_KWARGS = (
    "freeze_step",
    "var_freeze_step",
    "var_update_scaler",
    "local_step_scaler",
    "local_step_clipper",
)


def translation(path: str, *, ranks_per_node: int | None = None) -> DeepSpeedTranslation:
    """The config at ``path``, translated (raises :class:`DeepSpeedConfigError`). Read without
    ``ranks_per_node``, the library warns that ``zero_hpz_partition_size`` goes unchecked; the
    app checks it against the launch's node size once (:func:`qshard.train.cli.config_from_args`),
    so its other reads stay quiet."""
    with warnings.catch_warnings():
        if ranks_per_node is None:
            warnings.simplefilter("ignore", HpzSizeUncheckedWarning)
        return read_deepspeed_config(path, ranks_per_node=ranks_per_node)


def _flag_values(t: DeepSpeedTranslation, *, nproc: int, where: str) -> dict[str, Any]:
    """The flags ``t`` fixes."""

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
    if t.zeropp is None:
        if t.optimizer in (None, "adamw"):
            raise refuse(
                "zero_optimization.stage",
                "0 with Adam/AdamW is plain data parallel, which qshard train does not run: it "
                "shards with FSDP2; set stage 3",
            )
        values["zeropp"] = "off"
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
    if (t.gradient_accumulation_steps or 1) > 1:
        raise refuse(
            "gradient_accumulation_steps",
            f"{t.gradient_accumulation_steps}: qshard train has no gradient accumulation; set 1 "
            "and give the global batch as train_batch_size",
        )
    batch = t.train_batch_size
    if t.micro_batch_size is not None:
        if batch is not None and batch != t.micro_batch_size * nproc:
            raise refuse(
                "train_batch_size",
                f"{batch} is not train_micro_batch_size_per_gpu {t.micro_batch_size} x "
                f"{nproc} ranks",
            )
        batch = t.micro_batch_size * nproc
    if batch is not None:
        values["batch_size"] = batch
    return values


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
    values = _flag_values(t, nproc=args["nproc"], where=path)
    out = dict(args)
    for name, value in values.items():
        given = args[name]
        if name == "optim" and value == "adamw" and given == "adamw8bit" and name in explicit:
            continue  # the one swap: same hyperparameters, 8-bit state
        if name in explicit and not _same_value(name, given, value):
            flag = "--" + name.replace("_", "-")
            raise DeepSpeedConfigError(
                f"{flag} {given} conflicts with {path}, which sets {value}; drop {flag} or "
                "change the file"
            )
        out[name] = value
    if "batch_size" in values:  # after the conflicts: a flag given otherwise is named first
        _check_batch_splits(values["batch_size"], nproc=args["nproc"], where=path)
    if "lr" in values and "min_lr" not in explicit:
        # The app's cosine schedule stays (the file's lr is its peak); its floor keeps the
        # defaults' ratio, or a file's lr below the default --min-lr would be refused.
        defaults = TrainConfig()
        out["min_lr"] = values["lr"] * defaults.min_lr / defaults.lr
    return out


def _check_batch_splits(batch: int, *, nproc: int, where: str) -> None:
    """The file's global batch must split evenly over the ranks; said of its key (TrainConfig
    would name ``--batch-size``, a flag not given, and suggest a value that then conflicts)."""
    if batch % nproc:
        fits = next(n for n in range(nproc, 0, -1) if batch % n == 0)
        raise DeepSpeedConfigError(
            f"{where}: train_batch_size: {batch} does not split evenly over {nproc} ranks "
            "(DeepSpeed requires train_batch_size = train_micro_batch_size_per_gpu x "
            f"gradient_accumulation_steps x world size); set a multiple of {nproc} (e.g. "
            f"{nproc * max(1, batch // nproc)}), or run on --nproc {fits}"
        )
