"""Checkpoints of a training run: atomic DCP saves, resume, and a streamed safetensors export.

Layout under ``<run>/checkpoints``::

    step_00000100/          a complete checkpoint (DCP files + .metadata + qshard.json)
    .step_00000200.partial/ a save in progress (or one a crash interrupted): never loaded

[Note: atomic checkpoints] Every rank writes its DCP shard into the ``.partial`` folder; only
after all ranks are done (a barrier) does rank 0 write ``qshard.json``, fsync it, and rename the
folder to its final name (a rename within one file system is atomic). A crash at any point
before the rename leaves only a ``.partial`` folder, which :func:`latest_checkpoint` ignores
and the next save removes. Old checkpoints are renamed to ``.step_*.deleting`` before they are
deleted (a deletion killed half way never leaves a ``step_*`` folder with ``qshard.json`` but
missing shards), and a checkpoint replaced by a new save of the same step is moved aside the
same way, so a crash anywhere leaves every ``step_*`` folder whole. Multi-node runs need
``<run>`` on a shared file system, as DCP itself does.

[Note: checkpoint layout] ``qshard.json`` also records the layout of the state: every model
tensor's global shape and dtype, the optimizer's class, its param-group sizes and the
settings that shape its state (``block_size``, ``optim_bits``, ``min_8bit_size``), and every
optimizer state tensor's shape and dtype. :func:`load_checkpoint` compares them with the model
and optimizer it is given and refuses a checkpoint of another configuration with a message that
names the differences, before DCP would fail on a missing key, or an 8-bit optimizer would
silently take the saved block size over its own.

Every state file's size and CRC-32 is recorded in ``qshard.json`` at the save and checked
before a load ([Note: checkpoint checksums] in :mod:`qshard.train._checksums`, which also holds
:func:`checkpoint_info`, the file checks and the errors). Finding the newest complete, or newest
intact, checkpoint is :mod:`qshard.train._fallback`'s.

The state holds the model and optimizer (through ``torch.distributed.checkpoint.state_dict``,
so FSDP2-sharded tensors are saved by their global layout and load on any number of ranks),
the step (which is also the data position: batches are a pure function of the step, see
:mod:`qshard.train.data`) and rank 0's RNG states.

[Note: per-rank checkpoints] The data-parallel 1-bit optimizers keep per-rank state (error
buffers; 0/1 Adam's momentum and parameters between syncs), which DCP can hold only at a sync
and reload only on the same layout ([Note: DCP checkpoints] in :mod:`qshard.optim._onebit`),
while a run saves on a fixed step and may resume on another number of nodes. Their checkpoints are one ``torch.save`` file per rank
(``rank_00000.pt``...; model, ``optimizer.state_dict()``, step, RNG) inside the same atomic
folder protocol. At the same world size every rank continues bit for bit; at another world
size every rank loads rank 0's file.

[Note: restart fallback] A restarted job (``--max-restarts``) resumes from the newest
checkpoint that loads (:func:`load_newest` with ``fall_back=True``). "Loads" means the real
load: ``qshard.json`` reads, the state files are there, and the state loads on every rank (DCP
finds a truncated shard only by reading it; a per-rank file is read by its own rank alone). The
ranks agree in two steps per candidate, each one ``all_gather_object`` of every rank's outcome:
the file checks (so no rank enters DCP's collectives alone), then the load; a damaged outcome on
any rank moves every rank on to the previous checkpoint, so a rank whose own shard is cut short
takes the others with it. Rank 0 renames a damaged folder to ``step_N.damaged`` (``.damaged.2``
... when taken), which no lookup matches and nothing here deletes, so it is never picked again
and stays for inspection. A failed load may have written part of the model and optimizer
state; the next checkpoint's load overwrites all of it (DCP and ``load_state_dict`` load every
key). A checkpoint of another configuration is refused, never passed over: an older one of the
same run would not fit either. An explicit ``--resume`` (``fall_back=False``) refuses a damaged
newest checkpoint and names the newest earlier one that passes the file checks. A ``step_N``
folder without ``qshard.json``, which no save leaves, is a damaged checkpoint here too ([Note:
a step folder without qshard.json] in :mod:`qshard.train._fallback`).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from qshard._fs import fsync_path
from qshard.train import _faults
from qshard.train._checksums import (
    _DAMAGED,
    _META,
    CheckpointError,
    DamagedCheckpointError,
    _check_files,
    _file_sum,
    _from_rank0,
    _gather_sums,
    _rank,
    _verify_sums,
    _world,
    checkpoint_info,
)
from qshard.train._fallback import (
    _STEP_DIR,
    _agree,
    _checkpoint_folders,
    _complete_checkpoints,
    _earlier_intact_hint,
    damaged_newest_hint,
    latest_checkpoint,
    newest_folder,
    newest_intact,
)

__all__ = [
    "CheckpointError",
    "DamagedCheckpointError",
    "Loaded",
    "checkpoint_info",
    "damaged_newest_hint",
    "export_safetensors",
    "latest_checkpoint",
    "load_checkpoint",
    "load_newest",
    "newest_folder",
    "newest_intact",
    "save_checkpoint",
]

# The errors live beside the checks that raise most of them (qshard.train._checksums) but are
# this module's public ones: tracebacks and pickles name them here.
CheckpointError.__module__ = DamagedCheckpointError.__module__ = __name__


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_checkpoint(
    root: str | os.PathLike[str],
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any] | None = None,
    keep: int = 2,
    per_rank: bool = False,
) -> Path:
    """Save a complete checkpoint of ``step`` under ``root`` atomically (collective).

    ``meta`` (JSON-able, e.g. the run config) goes into ``qshard.json``. Keeps the ``keep``
    newest checkpoints. ``per_rank`` writes one ``torch.save`` file per rank instead of DCP
    (for the data-parallel optimizers, see [Note: per-rank checkpoints]). Returns the final
    folder.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        # (keep=0 kept every checkpoint: [:-0] of the list of old ones is empty)
        raise ValueError(f"keep must be an int >= 1 (the newest checkpoints kept); got {keep!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0; got {step!r}")
    root = Path(root)
    final = root / f"step_{step:08d}"
    partial = root / f".step_{step:08d}.partial"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".step_*"):  # left by crashed saves or deletions
            if stale.name.endswith((".partial", ".deleting")):
                shutil.rmtree(stale, ignore_errors=True)
        partial.mkdir()
    _barrier()
    train_state = {"step": torch.tensor(step, dtype=torch.int64), "rng": _rng_state()}
    if per_rank:
        # [Note: per-rank checkpoints] see the module docstring.
        model_sd, optim_sd = model.state_dict(), optimizer.state_dict()
        state = {"model": model_sd, "optim": optim_sd, "train": train_state}
        path = partial / f"rank_{_rank():05d}.pt"
        torch.save(state, path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        mine = (path,)
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "train": train_state}
        try:
            dcp.save(state, checkpoint_id=partial)
        except CheckpointException as exc:  # a BaseException, see load_checkpoint
            raise CheckpointError(f"saving {final} failed: {_last_line(exc)}") from exc
        mine = tuple(sorted(partial.glob(f"__{_rank()}_*.distcp")))  # DCP's names for this rank
    # [Note: checkpoint checksums] (in qshard.train._checksums) each rank sums the files it
    # wrote, as they are on disk.
    sums = {file.name: _file_sum(file) for file in mine}
    # [Note: fault injection] in qshard.train._faults
    _faults.fire(_faults.fault_plan(_rank()), step=step, at="save", files=mine)
    # Also the barrier: every shard is on disk before the folder may look complete.
    files = _gather_sums(sums)
    if _rank() == 0:
        for file in sorted(partial.iterdir()):  # what no rank claimed: DCP's .metadata
            if file.is_file() and file.name not in files:
                files[file.name] = _file_sum(file)
        info = {
            "step": step,
            "world_size": _world(),
            "format": "per_rank" if per_rank else "dcp",
            "layout": _layout(model_sd, optim_sd, optimizer),
            "files": dict(sorted(files.items())),
        }
        info.update(meta or {})
        _write_json_atomic(partial / _META, info)
        fsync_path(partial)
        if final.exists():  # a save of the same step: move the old one aside first
            _discard(final)
        os.rename(partial, final)
        fsync_path(root)
        for old in _complete_checkpoints(root)[:-keep]:
            _discard(old[1])
    _barrier()
    return final


def _discard(path: Path) -> None:
    """Delete a checkpoint folder so that no crash can leave it looking complete: rename it to
    a ``.deleting`` name first (atomic), then remove it."""
    doomed = path.with_name(f".{path.name}.deleting")
    if doomed.exists():
        shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def refuse_earlier_run(out: str, root: str | os.PathLike[str]) -> None:
    """Raise :class:`CheckpointError` when ``root`` (the checkpoints of ``--out`` ``out``) holds
    an earlier run's checkpoint: a fresh run without ``--overwrite`` is refused; see [Note:
    fresh runs] in qshard.train.loop. A ``step_N`` folder without ``qshard.json`` counts (a
    damaged checkpoint, [Note: a step folder without qshard.json] in qshard.train._fallback):
    passed over, the fresh run deleted it without a word."""
    latest = newest_folder(root)
    if latest is not None:
        raise CheckpointError(
            f"--out {out} holds an earlier run's checkpoints (newest: {latest}): pass --resume "
            "to continue that run, --overwrite to replace it (its checkpoints are removed), or "
            "another --out"
        )


def _discard_all(root: str | os.PathLike[str]) -> list[str]:
    """Remove every checkpoint under ``root`` (complete, damaged, torn and half-deleted ones)
    and return the names of the ``step_N`` folders removed; see [Note: fresh runs] in
    qshard.train.loop."""
    root = Path(root)
    if not root.is_dir():
        return []
    folders = _checkpoint_folders(root)
    for _, path in folders:
        if (path / _META).is_file():  # complete: renamed aside first ([Note: atomic checkpoints])
            _discard(path)
    for child in root.iterdir():
        if _STEP_DIR.match(child.name) or child.name.startswith(".step_"):
            shutil.rmtree(child, ignore_errors=True)
    return [path.name for _, path in folders]


# Param-group settings that shape an optimizer's state (see [Note: checkpoint layout]).
_LAYOUT_GROUP_KEYS = (
    "block_size",
    "optim_bits",
    "min_8bit_size",
    "min_4bit_size",
    "second_moment_map",  # 4-bit v codes mean other values under another map
)


def _describe(t: Any) -> str | None:
    if not isinstance(t, torch.Tensor):
        return None
    dtype = str(t.dtype).removeprefix("torch.")
    return f"{dtype}{list(t.shape)}"  # DTensor.shape is the global shape


def _layout(
    model_sd: dict[str, Any], optim_sd: dict[str, Any], optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The layout of a state (see [Note: checkpoint layout]); JSON-able."""
    cls = type(optimizer)
    state = {
        f"{fqn}.{key}": desc
        for fqn, entries in optim_sd.get("state", {}).items()
        for key, value in entries.items()
        if (desc := _describe(value)) is not None
    }
    groups = [
        {"params": len(g["params"]), **{k: g[k] for k in _LAYOUT_GROUP_KEYS if k in g}}
        for g in optim_sd.get("param_groups", [])
    ]
    return {
        "model": {k: d for k, v in model_sd.items() if (d := _describe(v)) is not None},
        "optimizer": f"{cls.__module__}.{cls.__qualname__}",
        "param_groups": groups,
        "state": state,
    }


def _layout_mismatches(saved: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """Human-readable differences between two layouts (empty when they agree)."""
    out: list[str] = []
    if saved["optimizer"] != here["optimizer"]:
        out.append(f"optimizer {saved['optimizer']} in the checkpoint, {here['optimizer']} here")

    def tensors(kind: str, a: dict[str, str], b: dict[str, str]) -> None:
        only_saved = [k for k in a if k not in b]
        only_here = [k for k in b if k not in a]
        if only_saved:
            out.append(
                f"{kind} {', '.join(only_saved[:3])} only in the checkpoint"
                + (f" (+{len(only_saved) - 3} more)" if len(only_saved) > 3 else "")
            )
        if only_here:
            out.append(
                f"{kind} {', '.join(only_here[:3])} only here"
                + (f" (+{len(only_here) - 3} more)" if len(only_here) > 3 else "")
            )
        differ = [k for k in a if k in b and a[k] != b[k]]
        for k in differ[:3]:
            out.append(f"{kind} {k} is {a[k]} in the checkpoint, {b[k]} here")
        if len(differ) > 3:
            out.append(f"{len(differ) - 3} more {kind} tensors differ")

    tensors("model tensor", saved["model"], here["model"])
    sg, hg = saved["param_groups"], here["param_groups"]
    if len(sg) != len(hg):
        out.append(f"{len(sg)} optimizer param groups in the checkpoint, {len(hg)} here")
    for i, (a, b) in enumerate(zip(sg, hg)):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                out.append(
                    f"optimizer param group {i} {k} {a.get(k)} in the checkpoint, {b.get(k)} here"
                )
    if saved["state"] and here["state"]:  # an optimizer that has not stepped has no state yet
        tensors("optimizer state", saved["state"], here["state"])
    return out


# [Note: per-rank state in the layout] The 1-bit optimizers' error buffers are per rank: their
# state_dict() exports them with one row per rank ([Note: DCP checkpoints] in
# qshard.optim._onebit), so their recorded global shapes follow the world and its layout, not
# the configuration. A per-rank checkpoint loads at another world by design (each rank takes a
# saved rank's file, the buffers restart from zero: [Note: per-rank checkpoints]), so they are
# not compared there; before, a resume on another number of ranks into an optimizer that had
# state already was refused as "saved from another configuration". A DCP checkpoint holds them
# by that global shape and cannot load them on another world or layout: it is refused naming
# the world sizes and the per-rank checkpoints that do load (before, the refusal said "another
# configuration" and asked for the same model, optimizer and block size, which the user had).
_PER_RANK_STATE = ("worker_error", "server_error")


def _split_per_rank(layout: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``layout`` without the per-rank optimizer state, and that state."""
    state = layout["state"]
    per_rank = {k: d for k, d in state.items() if k.rsplit(".", 1)[-1] in _PER_RANK_STATE}
    rest = {k: d for k, d in state.items() if k not in per_rank}
    return {**layout, "state": rest}, per_rank


def _check_layout(
    path: Path, info: dict[str, Any], here: dict[str, Any], *, world: int = 1
) -> None:
    saved = info.get("layout")
    if saved is None:  # written before layouts were recorded
        return
    saved, saved_per_rank = _split_per_rank(saved)
    here, here_per_rank = _split_per_rank(here)
    problems = _layout_mismatches(saved, here)
    if problems:
        raise CheckpointError(
            f"{path} was saved from another configuration: {'; '.join(problems)}. Load it with "
            "the model and optimizer it was saved with (same model shape, optimizer and block "
            "size), or start a new run directory"
        )
    # [Note: per-rank state in the layout]
    if info.get("format") == "per_rank" or not (saved["state"] and here["state"]):
        return
    if saved_per_rank == here_per_rank:
        return
    differ = sorted(
        set(saved_per_rank) ^ set(here_per_rank)
        | {k for k in saved_per_rank if saved_per_rank[k] != here_per_rank.get(k)}
    )
    first = differ[0]
    saved_world = info.get("world_size")
    name = saved["optimizer"].rsplit(".", 1)[-1]
    raise CheckpointError(
        f"{path} holds {name}'s error buffers, which are per rank (one row per rank: "
        f"{first} is {saved_per_rank.get(first, 'absent')} in the checkpoint, "
        f"{here_per_rank.get(first, 'absent')} here): this DCP checkpoint was saved on "
        f"{saved_world} ranks and loads only on the same number of ranks and layout (this job "
        f"has {world}). Resume on {saved_world} ranks with the same --parallel and ranks per "
        f"node, or use per-rank checkpoints (save_checkpoint(per_rank=True), which qshard "
        f"train writes for onebit_adam and zero_one_adam): they load on any number of ranks, "
        f"the error buffers restarting from zero"
    )


def _state_dtypes(optimizer: torch.optim.Optimizer) -> dict[tuple[int, str], torch.dtype]:
    return {
        (id(p), k): v.dtype
        for p, st in optimizer.state.items()
        for k, v in st.items()
        if isinstance(v, torch.Tensor)
    }


def _restore_state_dtypes(
    optimizer: torch.optim.Optimizer, dtypes: dict[tuple[int, str], torch.dtype]
) -> None:
    # [Note: optimizer state dtypes] torch.optim.Optimizer.load_state_dict casts every
    # floating-parameter state to the parameter's dtype, calling the base class's
    # _process_value_according_to_param_policy by name, so a subclass cannot opt out: the
    # uint8 codes of 8-bit optimizers come back as fp32. The cast is exact (codes are small
    # integers), so casting back to the dtype the optimizer created restores them bit for bit.
    for p, st in optimizer.state.items():
        for k, v in st.items():
            want = dtypes.get((id(p), k))
            if isinstance(v, torch.Tensor) and want is not None and v.dtype != want:
                st[k] = v.to(want)


def load_checkpoint(
    path: str | os.PathLike[str], *, model: nn.Module, optimizer: torch.optim.Optimizer
) -> int:
    """Load a checkpoint into ``model`` and ``optimizer`` (collective) and return its step.

    Works on a different number of ranks than the save (DCP reshards by global layout). Raises
    :class:`DamagedCheckpointError` for unreadable files or files that changed since the save
    ([Note: checkpoint checksums] in qshard.train._checksums), :class:`CheckpointError` for a
    checkpoint of another configuration.
    """
    path = Path(path)
    if not (path / _META).is_file():
        raise DamagedCheckpointError(f"{path} is not a complete qshard checkpoint (no {_META})")
    info = checkpoint_info(path)
    _check_files(path, info)
    _verify_sums(path, info)  # before anything is loaded: no garbage reaches the model
    if info.get("format") == "per_rank":
        return _load_per_rank(path, info, model=model, optimizer=optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # also initializes the state layout
    _check_layout(path, info, _layout(model_sd, optim_sd, optimizer), world=_world())
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "train": {"step": torch.tensor(-1, dtype=torch.int64), "rng": _rng_state()},
    }
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as exc:  # a BaseException: it would escape `except Exception`
        raise DamagedCheckpointError(
            f"{path} cannot be loaded ({_last_line(exc)}): {_DAMAGED}"
        ) from exc
    dtypes = _state_dtypes(optimizer)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    _restore_state_dtypes(optimizer, dtypes)
    _set_rng_state(state["train"]["rng"])
    return int(state["train"]["step"])


def _set_rng_state(rng: dict[str, torch.Tensor]) -> None:
    """Restore what :func:`_rng_state` saved (the per-rank load restored the CPU state only)."""
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def _load_per_rank(
    path: Path, info: dict[str, Any], *, model: nn.Module, optimizer: torch.optim.Optimizer
) -> int:
    world = _world()
    # Same world: each rank its own file. Otherwise every rank takes rank 0's, so the replicas
    # start identical (the optimizer then restarts its error feedback, with a warning).
    # On HSDP a rank holds one shard of each parameter: it takes the file of the saved rank with
    # the same local rank (node 0's), which needs the same ranks per node (docs/hsdp.md).
    source = _rank() if info["world_size"] == world else _hsdp_shard_index(model)
    file = path / f"rank_{source:05d}.pt"
    here = _layout(model.state_dict(), optimizer.state_dict(), optimizer)
    _check_layout(path, info, here, world=world)
    try:
        # tensors, numbers and strings only: a run folder's file runs no pickled code (every
        # optimizer's state, 1-bit and HSDP DTensors included, loads so; tests/train)
        state = torch.load(file, weights_only=True)
    except Exception as exc:  # a truncated or foreign file
        raise DamagedCheckpointError(
            f"{file} cannot be loaded ({_last_line(exc)}): {_DAMAGED}"
        ) from exc
    _load_model_state(model, state["model"], path=path)
    optimizer.load_state_dict(state["optim"])
    _set_rng_state(state["train"]["rng"])
    return int(state["train"]["step"])


@dataclass(frozen=True, kw_only=True, slots=True)
class Loaded:
    """What :func:`load_newest` loaded: the checkpoint, its step, and one line per damaged newer
    checkpoint it passed over (``"<folder> (<why>): moved aside to <name>"``)."""

    path: Path
    step: int
    passed_over: tuple[str, ...] = ()


def load_newest(
    root: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    fall_back: bool,
) -> Loaded | None:
    """Load the newest complete checkpoint under ``root`` (collective); ``None`` if there is
    none. With ``fall_back`` (a restarted job) a damaged one is moved aside and the previous one
    tried, until one loads on every rank; without, a damaged one is refused naming the newest
    earlier one that passes the file checks. See [Note: restart fallback]."""
    root = Path(root)
    # Every step_N folder: one without qshard.json is damaged, not passed over silently
    # ([Note: a step folder without qshard.json] in qshard.train._fallback).
    candidates = _from_rank0([p for _, p in reversed(_checkpoint_folders(root))])
    passed_over: list[str] = []
    for i, path in enumerate(candidates):
        checked = _agree(path, lambda p=path: _check_files(p, checkpoint_info(p)))
        loaded = (
            _agree(path, lambda p=path: load_checkpoint(p, model=model, optimizer=optimizer))
            if checked.ok
            else checked
        )
        if loaded.ok:
            return Loaded(path=path, step=loaded.step, passed_over=tuple(passed_over))
        if not loaded.damaged or not fall_back:
            hint = _earlier_intact_hint(candidates[i + 1 :]) if loaded.damaged else ""
            raise (DamagedCheckpointError if loaded.damaged else CheckpointError)(
                loaded.message + hint
            )
        aside = _from_rank0(_move_aside(path) if _rank() == 0 else None)
        passed_over.append(f"{path} ({loaded.why}): moved aside to {aside.name}")
    if not passed_over:
        return None
    raise DamagedCheckpointError(
        f"no checkpoint under {root} loads: {'; '.join(passed_over)}. Nothing was deleted; a "
        "further restart (if any is left) starts from step 0"
    )


def _move_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to ``step_N.damaged`` (``.damaged.2``, ... when taken): a
    name no lookup matches and nothing here deletes ([Note: restart fallback])."""
    for n in itertools.count(1):
        aside = path.with_name(f"{path.name}.damaged" + (f".{n}" if n > 1 else ""))
        if not aside.exists():
            break
    os.rename(path, aside)
    fsync_path(path.parent)
    return aside


def _last_line(exc: BaseException) -> str:
    """The line of an error that says what went wrong (DCP's message is a traceback per failed
    rank): the first operating-system error in it (``[Errno 28] No space left on device``: a
    full disk showed up as the torch.save error it led to, ``unexpected pos 704 vs 598``), else
    the last line."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    os_errors = [line for line in lines if _OS_ERROR.search(line)]
    return _faults.clip(os_errors[0] if os_errors else lines[-1])


_OS_ERROR = re.compile(r"\[Errno \d+\]")


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def _load_model_state(model: nn.Module, saved: dict[str, Any], *, path: Path) -> None:
    """``model.load_state_dict(saved)``; for HSDP-sharded models the file holds this rank's
    shards as DTensors of the saving job's mesh, which ``copy_`` refuses across jobs, so their
    local tensors are copied in place. A file of another layout (replicated vs HSDP, another
    number of ranks per node: other shards) is refused before anything is copied."""
    here = model.state_dict()
    for name, dst in here.items():
        src = saved.get(name)
        if isinstance(src, torch.Tensor) and _local(src).shape != _local(dst).shape:
            raise CheckpointError(
                f"{path}: model tensor {name} is {list(_local(src).shape)} on a rank in the "
                f"checkpoint, {list(_local(dst).shape)} here: per-rank checkpoints hold each "
                "rank's part of the model, so they load only with the layout they were saved "
                "with (the same --parallel and ranks per node); resume with those, or start a "
                "new --out"
            )
    if not any(isinstance(v, DTensor) for v in here.values()):
        model.load_state_dict(saved)
        return
    missing = sorted(set(here) - set(saved))
    if missing:
        raise CheckpointError(f"the checkpoint lacks model tensors {missing[:3]}")
    with torch.no_grad():
        for name, dst in here.items():
            src = saved[name]
            src = src.to_local() if isinstance(src, DTensor) else src
            (dst.to_local() if isinstance(dst, DTensor) else dst).copy_(src)


def _hsdp_shard_index(model: nn.Module) -> int:
    """This rank's shard index when ``model`` is HSDP-sharded for a data-parallel optimizer
    (DTensors on a node's 1-D ``shard`` mesh), else 0 (a replicated model)."""
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh.get_local_rank()
        break
    return 0


_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.bool: "BOOL",
}


def _persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers ``state_dict()`` holds: a non-persistent one (transformers' rotary
    ``inv_freq``) is rebuilt by the module and is not part of a saved model."""
    return [
        (f"{mod_name}.{name}" if mod_name else name, buf)
        for mod_name, mod in model.named_modules()
        for name, buf in mod.named_buffers(recurse=False)
        if name not in mod._non_persistent_buffers_set
    ]


def export_safetensors(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    metadata: dict[str, str] | None = None,
    prefix: str = "",
) -> Path:
    """Write the full (unsharded) model to one ``.safetensors`` file (collective).

        Streamed: the header is written from the global shapes first, then each tensor is gathered
        (``DTensor.full_tensor``), written by rank 0 and dropped, so no rank ever holds more than
        one unsharded tensor. Parameters and persistent buffers are written, what ``state_dict()``
    holds. A parameter shared by two names (a tied head) is written once under
        its first name; the alias is listed in the metadata (``"aliases"``). The metadata says
        ``"format": "pt"``, as ``safetensors.torch.save_file`` writes and ``transformers`` requires.
        Only the tensors named under ``prefix`` are written, without it (``"hf."``: the wrapped
        ``transformers`` model of ``--model llama``, in its own names). The file appears atomically
        (written to a temp name, then renamed).
    """
    path = Path(path)
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + _persistent_buffers(
        model
    ):
        if not name.startswith(prefix):
            continue
        name = name[len(prefix) :]
        if id(t) in first_name:
            aliases[name] = first_name[id(t)]
            continue
        first_name[id(t)] = name
        names.append(name)
        tensors.append(t)
    header: dict[str, Any] = {}
    offset = 0
    for name, t in zip(names, tensors):
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"cannot export {name}: dtype {t.dtype} has no safetensors code")
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    meta = {"format": "pt", **(metadata or {})}
    if aliases:
        meta["aliases"] = json.dumps(aliases)
    header["__metadata__"] = meta
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format recommends 8-byte aligned data
    tmp = path.with_name(f".{path.name}.tmp")
    f = open(tmp, "wb") if _rank() == 0 else None  # noqa: SIM115 - only rank 0 writes
    try:
        if f is not None:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
        for t in tensors:
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if f is not None:
                data = full.detach().to("cpu").contiguous().reshape(-1)
                f.write(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
            del full
        if f is not None:
            f.flush()
            os.fsync(f.fileno())
            f.close()
            f = None
            os.replace(tmp, path)
    finally:
        if f is not None:
            f.close()
            tmp.unlink(missing_ok=True)
    _barrier()
    return path
