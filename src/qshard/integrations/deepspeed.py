"""Read a DeepSpeed config (a dict or a JSON file) into qshard's: a :class:`ZeroPPConfig` for
``qshard.shard``, an optimizer class with its keyword arguments, a ``MixedPrecisionPolicy``,
the clipping norm and the batch sizes (:class:`DeepSpeedTranslation`).

Every key of the config ends in one of three places, never silently dropped:

* mapped: its value sets a qshard setting (``zero_optimization.zero_quantized_weights`` ->
  ``ZeroPPConfig.qwz``, ``optimizer.params.var_freeze_step`` -> ``ZeroOneAdam``'s, ...);
* no equivalent: it tunes something qshard does not have and does not change what training
  computes (DeepSpeed's bucket sizes, logging, ...); it is accepted and listed, with the reason,
  in :attr:`DeepSpeedTranslation.no_equivalent`;
* refused: a key, or a value, that would change the training math in a way qshard cannot
  reproduce (ZeRO stage 1/2, fp16 loss scaling, offload, an lr ``scheduler``, ``"auto"``
  placeholders in keys qshard reads, unknown keys): :class:`DeepSpeedConfigError` names the key and the fix.

Defaults are DeepSpeed's (checked against DeepSpeed 0.19.8's config classes; the 1-bit
optimizers against 0.17.6, the 0.19 series no longer lists them), so an absent key means what
it means to DeepSpeed: no ``gradient_clipping`` is no clipping, no ``bf16``/``fp16`` section is
fp32, a missing optimizer parameter is DeepSpeed's optimizer default. docs/deepspeed.md maps
every option and names the behaviours that differ. The tables of keys, section by section, are
in :mod:`qshard.integrations._deepspeed_keys`; this module reads a config against them.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from qshard._stack import user_stacklevel
from qshard.integrations._deepspeed_keys import (
    _ACTIVATION_CHECKPOINTING_KEYS,
    _ADAM_DEFAULTS,
    _ADAM_NO_EQUIVALENT,
    _BF16_NO_EQUIVALENT,
    _BF16_ONLY_DEFAULT,
    _DISABLED_SECTION_KEYS,
    _FP16_NO_EQUIVALENT,
    _HF_AUTO_SOURCES,
    _OFFLOAD_KEYS,
    _ONEBIT_DEFAULTS,
    _ONEBIT_NO_EQUIVALENT,
    _OPTIMIZER_TYPES,
    _TOP_MAPPED,
    _TOP_NO_EQUIVALENT,
    _TOP_ONLY_DEFAULT,
    _TOP_REFUSED,
    _TORCH_ADAMW_WEIGHT_DECAY,
    _ZERO_ALIASES,
    _ZERO_MAPPED,
    _ZERO_NO_EQUIVALENT,
    _ZERO_ONE_DEFAULTS,
    _ZERO_ONLY_DEFAULT,
    _auto_is_moot,
    _is_default,
)
from qshard.zeropp.config import ZeroPPConfig

__all__ = [
    "DeepSpeedConfigError",
    "DeepSpeedTranslation",
    "HpzSizeUncheckedWarning",
    "read_deepspeed_config",
]


class HpzSizeUncheckedWarning(UserWarning):
    """A file's ``zero_hpz_partition_size`` read without ``ranks_per_node`` to check it against
    (a caller that checks it elsewhere filters this category)."""


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config qshard cannot reproduce; the message names the key and the fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepSpeedTranslation:
    """What a DeepSpeed config says, in qshard's terms (see the module docstring)."""

    zeropp: ZeroPPConfig | None
    """For ``qshard.shard(model, topology=..., config=...)``; ``None`` at ZeRO stage 0 (the
    model stays replicated: a data-parallel optimizer, or your DDP)."""
    optimizer: str | None
    """``adam`` (L2 decay), ``adamw``, ``onebit_adam`` or ``zero_one_adam``; ``None`` when the
    config has no ``optimizer`` section (DeepSpeed then uses the script's own optimizer)."""
    optimizer_class: type[torch.optim.Optimizer] | None
    optimizer_kwargs: dict[str, Any]
    """Every hyperparameter, DeepSpeed's defaults filled in (``lr`` is the peak value)."""
    mp_policy: MixedPrecisionPolicy | None
    """bf16 compute (``bf16.enabled``); ``None``: fp32."""
    gradient_clipping: float
    """Global-norm clipping threshold; 0 (DeepSpeed's default): no clipping."""
    train_batch_size: int | None
    micro_batch_size: int | None
    gradient_accumulation_steps: int | None
    hpz_partition_size: int
    """``zero_hpz_partition_size``: with hpZ it must equal the ranks per node."""
    communication_data_type: str | None
    no_equivalent: dict[str, str] = field(default_factory=dict)
    """Keys present in the config that tune nothing qshard has -> why."""

    def build_optimizer(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        """The optimizer over ``params`` (parameters or param groups)."""
        if self.optimizer_class is None:
            raise DeepSpeedConfigError(
                "the DeepSpeed config has no optimizer section: build your own optimizer"
            )
        return self.optimizer_class(params, **self.optimizer_kwargs)


def read_deepspeed_config(
    source: Mapping[str, Any] | str | os.PathLike[str], *, ranks_per_node: int | None = None
) -> DeepSpeedTranslation:
    """Translate a DeepSpeed config (a dict, or the path of its JSON file).

    ``ranks_per_node`` (optional) checks ``zero_hpz_partition_size`` against the topology:
    qshard's hpZ secondary group is always one node.
    """
    where = "the DeepSpeed config"
    if isinstance(source, Mapping):
        cfg = dict(source)
    elif not isinstance(source, (str, os.PathLike)):
        raise DeepSpeedConfigError(
            f"read_deepspeed_config takes a dict or the path of a JSON file; got "
            f"{type(source).__name__} {source!r:.80}"
        )
    else:
        where = str(source)
        try:
            text = Path(source).read_text()
        except OSError as exc:
            raise DeepSpeedConfigError(f"cannot read DeepSpeed config {where}: {exc}") from exc
        cfg = _parse(text, where)
    if not isinstance(cfg, dict):
        raise DeepSpeedConfigError(f"{where} must hold a JSON object at the top level")
    return _Reader(where).read(cfg, ranks_per_node)


def _parse(text: str, where: str) -> Any:
    """The JSON of a DeepSpeed config file, read as DeepSpeed reads it as far as JSON goes.

    [Note: DeepSpeed's file syntax] DeepSpeed loads a config file with ``hjson.load`` and
    refuses duplicate keys (``dict_raise_error_on_duplicate_keys``). Files written for it
    therefore often carry comments and trailing commas; here they are blanked out (comments
    ``//``, ``#``, ``/* */`` and a comma before ``}``/``]``, outside strings, character for
    character, so an error's line and column stay the file's) and the rest is read as JSON. A
    key given twice is refused, as DeepSpeed refuses it (``json`` alone keeps the last one, which
    silently dropped the first). Hjson's other liberties (unquoted keys and strings, multi-line
    strings) are refused by the JSON reader, with what to change.
    """

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise DeepSpeedConfigError(
                    f"{where}: {key!r} is given twice in one object (DeepSpeed refuses duplicate "
                    "keys too); keep one"
                )
            out[key] = value
        return out

    try:
        return json.loads(_strip_comments(text), object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        raise DeepSpeedConfigError(
            f"cannot read DeepSpeed config {where}: {exc} (DeepSpeed reads Hjson; qshard reads "
            "JSON with comments and trailing commas: quote every key and string value)"
        ) from exc


def _strip_comments(text: str) -> str:
    """``text`` with comments and trailing commas outside strings blanked (see
    [Note: DeepSpeed's file syntax]); the same length, newlines kept. One pass: a comma is
    trailing when the next character that is neither blank nor inside a comment closes the
    object or array."""
    out = list(text)
    i, n = 0, len(text)
    in_string = False
    comma = None  # the last comma outside strings, while only blanks and comments followed it
    while i < n:
        c = text[i]
        if in_string:
            if c == "\\":
                i += 2
                continue
            in_string = c != '"'
        elif c == "#" or text.startswith("//", i) or text.startswith("/*", i):
            if c == "#" or text[i + 1] == "/":
                end = text.find("\n", i)
                end = n if end < 0 else end
            else:
                end = text.find("*/", i + 2)
                end = n if end < 0 else end + 2
            out[i:end] = [ch if ch == "\n" else " " for ch in text[i:end]]
            i = end
            continue
        elif c in "}]" and comma is not None:
            out[comma] = " "
            comma = None
        elif c == ",":
            comma = i
        elif c not in " \t\r\n":
            comma = None
            in_string = c == '"'
        i += 1
    return "".join(out)


class _Reader:
    def __init__(self, where: str) -> None:
        self.where = where
        self.no_equivalent: dict[str, str] = {}

    def fail(self, key: str, why: str) -> DeepSpeedConfigError:
        return DeepSpeedConfigError(f"{self.where}: {key}: {why}")

    def section(self, cfg: dict[str, Any], name: str) -> dict[str, Any]:
        value = cfg.get(name)
        if value is None:  # absent, or null
            return {}
        if not isinstance(value, dict):  # [], false, 0 too: not "absent"
            raise self.fail(name, f"must be a JSON object; got {value!r}")
        return value

    def check_values(self, prefix: str, obj: Any) -> None:
        # [Note: "auto" values]
        # "auto" is a placeholder the Hugging Face Trainer fills in from its TrainingArguments
        # (and the model's hidden size); here nothing fills it. Where the key tunes nothing
        # qshard has (reduce_bucket_size, stage3_prefetch_bucket_size, ... in the Trainer's
        # stock ZeRO-3 config) its value is never read, so "auto" is accepted there and the key
        # listed in no_equivalent like any other value; everywhere else it is refused, naming
        # the TrainingArguments field the Trainer would have taken it from.
        if isinstance(obj, dict):
            for k, v in obj.items():
                if not prefix and k in _TOP_REFUSED:
                    continue  # refused whatever it holds: say that, not "fill in this auto"
                self.check_values(f"{prefix}.{k}" if prefix else k, v)
        elif obj == "auto" and not _auto_is_moot(prefix):
            source = _HF_AUTO_SOURCES.get(prefix)
            raise self.fail(
                prefix,
                '"auto" is filled in by the Hugging Face Trainer'
                + (f" (from TrainingArguments {source})" if source else "")
                + "; give the value here",
            )

    def sort_keys(
        self,
        prefix: str,
        section: dict[str, Any],
        *,
        mapped: Iterable[str],
        no_equivalent: Mapping[str, str],
        only_default: Mapping[str, tuple[Any, str]] | None = None,
        refused: Mapping[str, str] | None = None,
        written: Mapping[str, str] | None = None,
    ) -> None:
        """Every key of ``section``: mapped, no equivalent (recorded), at its only accepted
        value, or refused. ``written``: a key's spelling in the user's file where ``section``
        holds it under another name (an alias), so that reports name what the file says."""
        mapped = set(mapped)
        for key, value in section.items():
            name = f"{prefix}{(written or {}).get(key, key)}"
            if key in mapped:
                continue
            if key in no_equivalent:
                self.no_equivalent[name] = no_equivalent[key]
            elif only_default is not None and key in only_default:
                default, why = only_default[key]
                if not _is_default(value, default):
                    raise self.fail(name, f"{value!r} has no equivalent: {why}; remove it")
            elif refused is not None and key in refused:
                raise self.fail(name, f"{refused[key]}; remove it")
            else:
                raise self.fail(
                    name,
                    "is not an option qshard knows (a typo, or a DeepSpeed feature qshard does "
                    "not have; docs/deepspeed.md lists every option it reads); remove it",
                )

    def read(self, cfg: dict[str, Any], ranks_per_node: int | None) -> DeepSpeedTranslation:
        self.check_values("", cfg)
        if "scheduler" in cfg:
            raise self.fail("scheduler", _scheduler_refusal(cfg["scheduler"]))
        if "bfloat16" in cfg:  # DeepSpeed's old name of the bf16 section
            if "bf16" in cfg:
                raise self.fail("bfloat16", "give either bf16 or its old name bfloat16, not both")
            cfg = {("bf16" if k == "bfloat16" else k): v for k, v in cfg.items()}
        if isinstance(cfg.get("zero_optimization"), bool):
            # DeepSpeed's old form of the section: false is stage 0, true stage 1.
            if cfg["zero_optimization"]:
                raise self.fail(
                    "zero_optimization",
                    "true is DeepSpeed's old form of stage 1, which has no equivalent: qshard "
                    "shards parameters, gradients and optimizer state together (FSDP2 = "
                    'ZeRO-3); use {"stage": 3}, or false / {"stage": 0} for data parallel',
                )
            cfg = {**cfg, "zero_optimization": {"stage": 0}}
        self.sort_keys(
            "",
            cfg,
            mapped=_TOP_MAPPED,
            no_equivalent=_TOP_NO_EQUIVALENT,
            only_default=_TOP_ONLY_DEFAULT,
            refused=_TOP_REFUSED,
        )
        stage = self.zero_stage(cfg)
        name, cls, kwargs = self.optimizer(cfg, stage)
        mp_policy, comm = self.precision(cfg)
        zeropp, hpz_size = self.zeropp(cfg, stage, comm, mp_policy, ranks_per_node)
        clip = cfg.get("gradient_clipping", 0.0)
        if (
            not isinstance(clip, (int, float))
            or isinstance(clip, bool)
            or not math.isfinite(clip)
            or clip < 0
        ):
            raise self.fail(
                "gradient_clipping", f"must be a finite number >= 0 (0: no clipping); got {clip!r}"
            )
        batch = self.batch_sizes(cfg)
        return DeepSpeedTranslation(
            zeropp=zeropp,
            optimizer=name,
            optimizer_class=cls,
            optimizer_kwargs=kwargs,
            mp_policy=mp_policy,
            gradient_clipping=float(clip),
            train_batch_size=batch[0],
            micro_batch_size=batch[1],
            gradient_accumulation_steps=batch[2],
            hpz_partition_size=hpz_size,
            communication_data_type=comm,
            no_equivalent=dict(self.no_equivalent),
        )

    def batch_sizes(self, cfg: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
        """``train_batch_size``, the micro batch and the accumulation steps; DeepSpeed requires
        ``train_batch_size == micro batch x accumulation steps x world size``, so a global
        batch that is no multiple of the others is wrong at every world size."""
        batch = self.positive(cfg, "train_batch_size")
        micro = self.positive(cfg, "train_micro_batch_size_per_gpu")
        accum = self.positive(cfg, "gradient_accumulation_steps")
        given = [
            (name, n)
            for name, n in (
                ("train_micro_batch_size_per_gpu", micro),
                ("gradient_accumulation_steps", accum),
            )
            if n is not None
        ]
        if batch is not None and given and batch % math.prod(n for _, n in given):
            what = " x ".join(f"{name} {n}" for name, n in given)
            raise self.fail(
                "train_batch_size",
                f"{batch} is not a multiple of {what}: DeepSpeed requires train_batch_size = "
                "train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size; "
                "fix one of them",
            )
        return batch, micro, accum

    def positive(self, cfg: dict[str, Any], key: str) -> int | None:
        value = cfg.get(key)
        if value is None:
            return None
        whole = _whole(value)
        if whole is None or whole < 1:
            raise self.fail(key, f"must be an int >= 1; got {value!r}")
        return whole

    def zero_stage(self, cfg: dict[str, Any]) -> int:
        zero = self.section(cfg, "zero_optimization")
        stage = _whole(zero.get("stage", 0))
        if stage not in (0, 1, 2, 3):
            raise self.fail(
                "zero_optimization.stage", f"must be 0, 1, 2 or 3; got {zero.get('stage')!r}"
            )
        if stage in (1, 2):
            raise self.fail(
                "zero_optimization.stage",
                f"{stage} has no equivalent: qshard shards parameters, gradients and optimizer "
                "state together (FSDP2 = ZeRO-3); use stage 3, or stage 0 for data parallel",
            )
        return stage

    def optimizer(
        self, cfg: dict[str, Any], stage: int
    ) -> tuple[str | None, type[torch.optim.Optimizer] | None, dict[str, Any]]:
        opt = self.section(cfg, "optimizer")
        for key in opt:
            if key == "legacy_fusion":  # DeepSpeed reads it for its fp16 optimizer only
                self.no_equivalent["optimizer.legacy_fusion"] = (
                    "read only by DeepSpeed's fp16 optimizer (fp16 is refused)"
                )
            elif key not in ("type", "params"):
                raise self.fail(
                    f"optimizer.{key}",
                    "is not an optimizer key (type, params, legacy_fusion); optimizer "
                    "hyperparameters go in optimizer.params",
                )
        if not opt:  # DeepSpeed then takes the optimizer the script passes in
            return None, None, {}
        if opt.get("type") is None:  # absent or null ("None has no equivalent" said before)
            raise self.fail(
                "optimizer.type",
                "is missing: give the optimizer's type (Adam, AdamW, OneBitAdam or ZeroOneAdam), "
                "or remove the optimizer section to build your own optimizer",
            )
        kind = str(opt["type"]).lower()
        if kind not in _OPTIMIZER_TYPES:
            raise self.fail(
                "optimizer.type",
                f"{opt.get('type')!r} has no qshard equivalent; use Adam, AdamW, OneBitAdam or "
                "ZeroOneAdam (qshard.optim.AdamW8bit takes AdamW's arguments)",
            )
        params = opt.get("params")
        if params is None:  # absent or null: every parameter at DeepSpeed's default
            params = {}
        if not isinstance(params, dict):  # [], false, 0 too: not "absent"
            raise self.fail("optimizer.params", f"must be a JSON object; got {params!r}")
        params = dict(params)
        if "max_grad_norm" in params:  # DeepSpeed refuses it too
            raise self.fail(
                "optimizer.params.max_grad_norm", "use the top-level gradient_clipping instead"
            )
        if params.get("amsgrad") is not None and _flag(
            self, params, "amsgrad", where="optimizer.params"
        ):
            raise self.fail(
                "optimizer.params.amsgrad",
                "DeepSpeed's FusedAdam and 1-bit optimizers refuse AMSGrad; set it to false",
            )
        prefix = "optimizer.params."
        if kind in ("adam", "adamw"):
            # DeepSpeed: type Adam is AdamW unless adam_w_mode is false. Both switches are JSON
            # true/false only (see _flag): the string "false" is truthy and would be read as on.
            where = "optimizer.params"
            adam_w_mode = _flag(self, params, "adam_w_mode", where=where, default=True)
            torch_adam = _flag(self, params, "torch_adam", where=where, default=False)
            w_mode = kind == "adamw" or adam_w_mode
            if params.get("bias_correction", True) is not True:
                raise self.fail(
                    f"{prefix}bias_correction", "torch's Adam/AdamW always correct the bias"
                )
            self.sort_keys(
                prefix,
                params,
                mapped=(*_ADAM_DEFAULTS, "adam_w_mode", "amsgrad", "bias_correction"),
                no_equivalent=_ADAM_NO_EQUIVALENT,
            )
            kwargs = self.hyper(params, _ADAM_DEFAULTS)
            if torch_adam and w_mode and "weight_decay" not in params:
                # DeepSpeed then builds torch.optim.AdamW(**params): torch's default decay.
                kwargs["weight_decay"] = _TORCH_ADAMW_WEIGHT_DECAY
            return (
                ("adamw", torch.optim.AdamW, kwargs)
                if w_mode
                else ("adam", torch.optim.Adam, kwargs)
            )
        if stage != 0:
            raise self.fail(
                "zero_optimization.stage",
                f"{stage} with {opt['type']}: 1-bit optimizers replicate the model and compress "
                "their own communication (DeepSpeed refuses them with ZeRO too); use stage 0, or "
                "in qshard HSDP: ZeroPPConfig(hsdp=True, replicate_reduce=False)",
            )
        defaults = _ONEBIT_DEFAULTS if kind == "onebitadam" else _ZERO_ONE_DEFAULTS
        self.sort_keys(
            prefix,
            params,
            mapped=(*defaults, "amsgrad"),
            no_equivalent=_ONEBIT_NO_EQUIVALENT,
        )
        kwargs = self.hyper(params, defaults)
        from qshard.optim import OneBitAdam, ZeroOneAdam

        if kind == "onebitadam":
            return "onebit_adam", OneBitAdam, kwargs
        return "zero_one_adam", ZeroOneAdam, kwargs

    def hyper(self, params: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, default in defaults.items():
            value = params.get(key, default)
            if key == "betas":
                if (
                    not isinstance(value, (list, tuple))
                    or len(value) != 2
                    or not all(
                        isinstance(b, (int, float)) and not isinstance(b, bool) for b in value
                    )
                ):
                    raise self.fail(
                        f"optimizer.params.{key}", f"must be two numbers; got {value!r}"
                    )
                if not all(0.0 <= b < 1.0 for b in value):  # torch's optimizers refuse others
                    raise self.fail(
                        f"optimizer.params.{key}", f"must both be in [0, 1); got {list(value)}"
                    )
                value = (float(value[0]), float(value[1]))
            elif isinstance(default, int):
                whole = _whole(value)
                if whole is None or whole < 1:
                    raise self.fail(
                        f"optimizer.params.{key}", f"must be an int >= 1; got {value!r}"
                    )
                value = whole
            elif (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
            ):
                unquote = " (write it without quotes)" if isinstance(value, str) else ""
                raise self.fail(
                    f"optimizer.params.{key}", f"must be a number; got {value!r}{unquote}"
                )
            elif value < 0:  # lr, eps, weight_decay: torch's optimizers refuse them negative
                raise self.fail(f"optimizer.params.{key}", f"must be >= 0; got {value!r}")
            else:
                value = float(value)
            out[key] = value
        return out

    def precision(self, cfg: dict[str, Any]) -> tuple[MixedPrecisionPolicy | None, str | None]:
        bf16, fp16 = self.section(cfg, "bf16"), self.section(cfg, "fp16")
        self.sort_keys(
            "bf16.",
            bf16,
            mapped=("enabled",),
            no_equivalent=_BF16_NO_EQUIVALENT,
            only_default=_BF16_ONLY_DEFAULT,
        )
        if _flag(self, fp16, "enabled", where="fp16"):
            raise self.fail(
                "fp16.enabled",
                "qshard has no fp16 loss scaling; use bf16 (bf16.enabled) or fp32 instead",
            )
        self.sort_keys("fp16.", fp16, mapped=("enabled",), no_equivalent=_FP16_NO_EQUIVALENT)
        for name in ("amp", "torch_autocast"):
            section = self.section(cfg, name)
            if _flag(self, section, "enabled", where=name):
                raise self.fail(
                    f"{name}.enabled",
                    "qshard's mixed precision is FSDP2's MixedPrecisionPolicy: use bf16.enabled",
                )
            for key in section:
                if key == "enabled":
                    continue
                if key not in _DISABLED_SECTION_KEYS[name]:  # a typo is refused, as in fp16
                    raise self.fail(
                        f"{name}.{key}",
                        f"is not an option of DeepSpeed's {name} section ("
                        f"{', '.join(_DISABLED_SECTION_KEYS[name])}); remove it",
                    )
                self.no_equivalent[f"{name}.{key}"] = f"read only when {name} is enabled"
        self.activation_checkpointing(cfg)
        types = self.section(cfg, "data_types")
        for key, value in types.items():
            if key != "grad_accum_dtype":
                raise self.fail(f"data_types.{key}", "is not an option qshard knows; remove it")
            if value not in (None, "fp32"):
                raise self.fail(
                    "data_types.grad_accum_dtype",
                    f"{value!r}: FSDP2 accumulates gradients in the parameters' dtype (fp32); "
                    "set fp32",
                )
        comm = cfg.get("communication_data_type")
        if isinstance(comm, str):  # DeepSpeed lower-cases it: "FP32" is fp32
            comm = comm.lower()
        if comm not in (None, "fp32", "fp16", "bf16"):
            raise self.fail("communication_data_type", f"must be fp32, fp16 or bf16; got {comm!r}")
        if not _flag(self, bf16, "enabled", where="bf16"):
            return None, comm
        # DeepSpeed reduces bf16 gradients in bf16 unless communication_data_type says fp32.
        reduce = torch.float32 if comm == "fp32" else torch.bfloat16
        if comm == "fp16":
            raise self.fail(
                "communication_data_type", "fp16 with bf16 compute has no equivalent; use bf16/fp32"
            )
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce), comm

    def activation_checkpointing(self, cfg: dict[str, Any]) -> None:
        section = self.section(cfg, "activation_checkpointing")
        why = (
            "DeepSpeed's activation checkpointing is a function your model calls; with qshard "
            "call torch.utils.checkpoint (or a Hugging Face model's "
            "activation_checkpointing_enable())"
        )
        for key in section:
            name = f"activation_checkpointing.{key}"
            if key in ("partition_activations", "cpu_checkpointing") and _flag(
                self, section, key, where="activation_checkpointing"
            ):
                raise self.fail(name, "qshard does not partition or offload activations")
            if key not in _ACTIVATION_CHECKPOINTING_KEYS:
                raise self.fail(name, "is not an option qshard knows; remove it")
            self.no_equivalent[name] = why

    def zeropp(
        self,
        cfg: dict[str, Any],
        stage: int,
        comm: str | None,
        mp_policy: MixedPrecisionPolicy | None,
        ranks_per_node: int | None,
    ) -> tuple[ZeroPPConfig | None, int]:
        given = self.section(cfg, "zero_optimization")
        zero = {_ZERO_ALIASES.get(k, k): v for k, v in given.items()}
        self.sort_keys(
            "zero_optimization.",
            zero,
            written={_ZERO_ALIASES.get(k, k): k for k in given},  # stage3_prefetch_bucket_size
            mapped=_ZERO_MAPPED,
            no_equivalent=_ZERO_NO_EQUIVALENT,
            only_default={**_ZERO_ONLY_DEFAULT, **_offload_values(self, zero)},
        )
        size = _whole(zero.get("zero_hpz_partition_size", 1))
        if size is None or size < 0:
            raise self.fail(
                "zero_optimization.zero_hpz_partition_size",
                f"must be an int >= 0; got {zero.get('zero_hpz_partition_size')!r}",
            )
        qwz = _flag(self, zero, "zero_quantized_weights")
        qgz = _flag(self, zero, "zero_quantized_gradients")
        hpz = size > 1
        overlap = zero.get("overlap_comm")
        if overlap is not None:  # absent / null: DeepSpeed's default at stage 3, on
            overlap = _flag(self, zero, "overlap_comm")  # checked at stage 0 too
        if stage == 0:
            for key, on in (
                ("zero_quantized_weights", qwz),
                ("zero_hpz_partition_size", hpz),
                ("zero_quantized_gradients", qgz),
            ):
                if on:
                    raise self.fail(f"zero_optimization.{key}", "ZeRO++ needs stage 3")
            if comm in ("fp16", "bf16") and mp_policy is None:
                raise self.fail(
                    "communication_data_type",
                    "16-bit gradient communication without sharding has no equivalent here "
                    "(use stage 3, where it is ZeroPPConfig.wire_dtype)",
                )
            return None, size
        if hpz and ranks_per_node is None and size > 1:
            # Unchecked, the file's size was dropped without a word: shard() sizes hpZ's
            # secondary group by the topology's node, whatever the file said.
            warnings.warn(
                f"{self.where}: zero_optimization.zero_hpz_partition_size {size} is not checked: "
                "qshard's hpZ secondary group is one node of the Topology given to shard(); "
                "pass read_deepspeed_config(..., ranks_per_node=...) to check the file against it",
                HpzSizeUncheckedWarning,
                stacklevel=user_stacklevel(),
            )
        if hpz and ranks_per_node is not None and size != ranks_per_node:
            raise self.fail(
                "zero_optimization.zero_hpz_partition_size",
                f"{size}: qshard's hpZ secondary group is one node ({ranks_per_node} "
                f"rank{'s' if ranks_per_node != 1 else ''}); "
                + (
                    f"set {ranks_per_node}, or 1 to turn hpZ off"
                    if ranks_per_node != 1
                    else "set 1 (hpZ off)"
                )
                + f", or make a node {size} ranks (Topology(ranks_per_node={size}); qshard "
                f"train --ranks-per-node {size} with --nproc a multiple of {size})",
            )
        wire = None
        if mp_policy is None and comm in ("fp16", "bf16"):
            # fp32 compute, 16-bit gradients on the wire (reduced in fp32 here, see the docs).
            wire = torch.float16 if comm == "fp16" else torch.bfloat16
        return (
            ZeroPPConfig(
                qwz=qwz,
                hpz=hpz,
                qgz=qgz,
                prefetch=True if overlap is None else overlap,
                wire_dtype=wire,
            ),
            size,
        )


def _scheduler_refusal(section: Any) -> str:
    """Why a ``scheduler`` section is refused, saying what DeepSpeed would have computed (its
    defaults are easy to miss: the warm-up is logarithmic unless ``warmup_type`` is
    ``"linear"``) so the user can reproduce it."""
    kind = section.get("type") if isinstance(section, dict) else None
    what = _SCHEDULES.get(str(kind).lower()) if isinstance(kind, str) else None
    said = f"DeepSpeed's {kind} {what}; " if what else ""
    return (
        f"{said}qshard does not own the learning-rate schedule: remove the section and set the "
        "lr in your loop (e.g. a torch.optim.lr_scheduler.LambdaLR stepped once per optimizer "
        "step, as DeepSpeed steps its scheduler); qshard train's own schedule is a linear "
        "warm-up to --lr over --warmup-steps, then a cosine decay to --min-lr"
    )


_WARMUP = (
    'over warmup_num_steps (default 1000), logarithmically (warmup_type default "log": '
    'log(step + 1) / log(warmup_num_steps)) unless warmup_type is "linear"'
)
_SCHEDULES = {
    "warmuplr": (
        "raises the lr from warmup_min_lr (default 0) to warmup_max_lr (default 0.001) "
        f"{_WARMUP}, then holds it"
    ),
    "warmupdecaylr": (
        "raises the lr from warmup_min_lr (default 0) to warmup_max_lr (default 0.001) "
        f"{_WARMUP}, then decays it linearly to 0 at total_num_steps"
    ),
    "warmupcosinelr": (
        "scales the optimizer's lr by a ratio rising from warmup_min_ratio (default 0) to 1 "
        f"{_WARMUP}, then falling along a cosine to cos_min_ratio (default 0.0001) at "
        "total_num_steps"
    ),
    "onecycle": "cycles the lr (and momentum) between cycle_min_lr and cycle_max_lr",
    "lrrangetest": "grows the lr from lr_range_test_min_lr for a learning-rate range test",
}


def _whole(value: Any) -> int | None:
    """``value`` as an int when it is one: a JSON integer, or a number written with a point or
    an exponent that is whole (``1e5``, ``8.0``; DeepSpeed's pydantic fields and its 1-bit
    optimizers take those as the integer); else ``None`` (booleans, fractions, strings)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _flag(
    reader: _Reader,
    section: dict[str, Any],
    key: str,
    *,
    where: str = "zero_optimization",
    default: bool = False,
) -> bool:
    # JSON true/false only: DeepSpeed's pydantic configs read the string "false" as False, so
    # truthiness (bool("false") is True) would silently invert such a value.
    value = section.get(key, default)
    if not isinstance(value, bool):
        unquote = " (JSON true/false, without quotes)" if isinstance(value, str) else ""
        raise reader.fail(f"{where}.{key}", f"must be true or false; got {value!r}{unquote}")
    return value


def _offload_values(reader: _Reader, zero: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    # An offload section whose device is "none" is DeepSpeed's way of writing "no offload"; its
    # other keys are then read by nothing, but a key DeepSpeed does not define (a typo) is
    # refused, as DeepSpeed's config model refuses it.
    out = {}
    for key in ("offload_param", "offload_optimizer"):
        value = zero.get(key)
        if not isinstance(value, dict):
            continue
        device = value.get("device", "none")
        if not isinstance(device, str) or device.lower() != "none":
            continue  # refused below as offload
        known = (*_OFFLOAD_KEYS[key], "pin_memory")
        for sub in value:
            if sub not in known:
                raise reader.fail(
                    f"zero_optimization.{key}.{sub}",
                    f"is not an option of DeepSpeed's {key} section ({', '.join(known)}); "
                    "remove it",
                )
        out[key] = (value, "")
    return out
