"""Whether a checkpoint's files are the ones its save wrote: ``qshard.json`` readable as a JSON
object (:func:`checkpoint_info`), every state file there at the size it was saved with
(:func:`_check_files`, which reads no file), and every state file's CRC-32 as recorded at the
save (:func:`_verify_sums`, collective); the errors these checks raise, which are
:mod:`qshard.train.checkpoint`'s (it re-exports them); and the two object collectives by which
every rank learns every rank's verdict.

[Note: checkpoint checksums] Neither DCP nor ``torch.load`` checks what it reads: a shard with
a flipped bit, or the zeros a lost write can leave at the right size, loaded as weights and
optimizer state without a word (seen: a resumed run went NaN a step later). So every rank sums
the files it wrote (CRC-32, as they are on disk after the save: read back from the page cache,
about 2 GB/s per rank), rank 0 sums what no rank claimed (DCP's ``.metadata``), and
``qshard.json`` lists every state file with its size and CRC-32 (``"files"``). The sizes are
checked with the other file checks (no read; before any rank starts, for an explicit
``--resume``); the contents by :func:`~qshard.train.checkpoint.load_checkpoint` before anything
is loaded, each rank reading its share of the files (one extra read of the checkpoint in all),
and every rank learns every verdict, so all raise the same :class:`DamagedCheckpointError` and
a restart falls back ([Note: restart fallback] in :mod:`qshard.train.checkpoint`). A CRC
catches corruption, not tampering. Checkpoints written before have no ``"files"`` and load as
before.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = [
    "_DAMAGED",
    "_META",
    "CheckpointError",
    "DamagedCheckpointError",
    "_check_files",
    "_file_sum",
    "_from_everyone",
    "_from_rank0",
    "_gather_sums",
    "_rank",
    "_verify_sums",
    "_world",
    "checkpoint_info",
]

_META = "qshard.json"
_DAMAGED = (
    "it is damaged (or not qshard's): move it out of the checkpoints folder to resume from the "
    "previous one, or start a new --out"
)


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was asked for, or one of another configuration."""


class DamagedCheckpointError(CheckpointError):
    """A complete-looking checkpoint whose files cannot be read: a ``qshard.json`` that is not a
    JSON object, missing state files, a shard cut short or overwritten. A restart passes over
    such a checkpoint ([Note: restart fallback] in qshard.train.checkpoint); one of another
    configuration is a plain :class:`CheckpointError`."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _from_everyone(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``all_gather_object``; ``[obj]`` in one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def _from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (``broadcast_object_list``)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``qshard.json`` of a checkpoint (step, world size, run metadata); raises
    :class:`CheckpointError` naming the file when it cannot be read as a JSON object."""
    file = Path(path) / _META
    # [Note: a step folder without qshard.json] in qshard.train._fallback
    if not file.exists() and Path(path).is_dir():
        raise DamagedCheckpointError(
            f"{path} has no {_META}, which a save writes before the folder takes its name: "
            f"{_DAMAGED}"
        )
    try:
        info = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DamagedCheckpointError(f"{file} cannot be read ({exc}): {_DAMAGED}") from exc
    if not isinstance(info, dict):
        raise DamagedCheckpointError(
            f"{file} holds {type(info).__name__}, not an object: {_DAMAGED}"
        )
    return info


def _file_sum(file: Path) -> dict[str, Any]:
    """A file's size and CRC-32 as ``qshard.json`` records them ([Note: checkpoint checksums])."""
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return {"bytes": file.stat().st_size, "crc32": f"{crc:08x}"}


def _gather_sums(mine: dict[str, Any]) -> dict[str, Any]:
    """Every rank's file sums, merged (a collective, so also a barrier)."""
    return {name: s for sums in _from_everyone(mine) for name, s in sums.items()}


def _check_files(path: Path, info: dict[str, Any]) -> None:
    """Refuse a checkpoint whose ``qshard.json`` is there but whose state files are not, or not
    at the sizes they were saved with (cheap: no file is read; see [Note: checkpoint
    checksums] for the contents)."""
    if info.get("format") == "per_rank":
        world = info.get("world_size")
        names = [f"rank_{r:05d}.pt" for r in range(world if isinstance(world, int) else 1)]
    else:
        names = ["DCP .metadata"]
    recorded = _recorded_files(path, info)
    names += [n for n in recorded if n not in names and f"DCP {n}" not in names]
    missing = [n for n in names if not (path / n.removeprefix("DCP ")).is_file()]
    if missing:
        raise DamagedCheckpointError(f"{path} has {_META} but no {', '.join(missing)}: {_DAMAGED}")
    for name, saved in recorded.items():
        size = (path / name).stat().st_size
        if size != saved["bytes"]:
            raise DamagedCheckpointError(
                f"{path / name} cannot be loaded (it has {size} bytes, {saved['bytes']} when "
                f"saved): {_DAMAGED}"
            )


def _recorded_files(path: Path, info: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The state files ``qshard.json`` lists with their sizes and CRC-32s (empty for a
    checkpoint written before they were recorded); a malformed list is damage."""
    files = info.get("files")
    if files is None:
        return {}
    ok = isinstance(files, dict) and all(
        isinstance(name, str)
        and name == Path(name).name
        and name not in ("", ".", "..", _META)
        and isinstance(s, dict)
        and type(s.get("bytes")) is int
        and isinstance(s.get("crc32"), str)
        for name, s in files.items()
    )
    if not ok:
        raise DamagedCheckpointError(f'{path / _META} has a malformed "files" entry: {_DAMAGED}')
    return files


def _verify_sums(path: Path, info: dict[str, Any]) -> None:
    """Refuse a checkpoint whose state files do not match the CRC-32s recorded at the save
    (collective: the files are split over the ranks, and every rank gets every verdict, so all
    raise alike); see [Note: checkpoint checksums]."""
    files = _recorded_files(path, info)
    world = _world()
    problems: list[str] = []
    for name in sorted(files)[_rank() :: world]:
        saved = files[name]
        try:
            got = _file_sum(path / name)
        except OSError as exc:
            problems.append(f"{path / name} cannot be read ({exc.strerror or exc})")
            continue
        if got != {"bytes": saved["bytes"], "crc32": saved["crc32"]}:
            problems.append(
                f"{path / name} cannot be loaded (its contents changed since the save: "
                f"{got['bytes']} bytes with CRC-32 {got['crc32']}, {saved['bytes']} bytes "
                f"with CRC-32 {saved['crc32']} when saved)"
            )
    problems = [p for theirs in _from_everyone(problems) for p in theirs]
    if problems:
        more = f" (and {len(problems) - 1} more files)" if len(problems) > 1 else ""
        raise DamagedCheckpointError(f"{problems[0]}{more}: {_DAMAGED}")
