"""Finding the checkpoint a run resumes from, without changing anything on disk: the complete
checkpoints under a run's ``checkpoints`` folder, the newest one, the newest one whose files
pass the checks of :mod:`qshard.train._checksums` (and the hint naming it when a newer one is
refused), and every rank's agreement on one candidate's outcome. The folder protocol and the
fallback that moves a damaged checkpoint aside are :mod:`qshard.train.checkpoint`'s
([Note: atomic checkpoints] and [Note: restart fallback] there).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qshard.train._checksums import (
    _DAMAGED,
    _META,
    CheckpointError,
    DamagedCheckpointError,
    _check_files,
    _from_everyone,
    _rank,
    _verify_sums,
    _world,
    checkpoint_info,
)

__all__ = [
    "_STEP_DIR",
    "_agree",
    "_checkpoint_folders",
    "_complete_checkpoints",
    "_earlier_intact_hint",
    "damaged_newest_hint",
    "latest_checkpoint",
    "newest_folder",
    "newest_intact",
]

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def _checkpoint_folders(root: Path) -> list[tuple[int, Path]]:
    """Every ``step_N`` folder under ``root``, oldest first, whether it holds ``qshard.json``
    or not.

    [Note: a step folder without qshard.json] A save writes ``qshard.json`` into the
    ``.partial`` folder, fsyncs it, and only then renames the folder to ``step_N`` ([Note:
    atomic checkpoints] in qshard.train.checkpoint); old ones lose the name before anything in
    them is deleted. So qshard never leaves a ``step_N`` folder without it: one that has none
    was changed since (the file deleted, the run folder copied in part) and is a damaged
    checkpoint, not a save still in progress. Passed over as if absent, it made an explicit
    ``--resume`` continue silently from an older checkpoint; resuming treats it as damaged
    instead (:func:`~qshard.train.checkpoint.load_newest` refuses it or, on a restart, moves it
    aside), as the launcher's check and the failure report do."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child))
    return sorted(found)


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    # qshard.json is written after every rank finished (see [Note: atomic checkpoints]
    # in qshard.train.checkpoint).
    return [(step, path) for step, path in _checkpoint_folders(root) if (path / _META).is_file()]


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``root`` (``None`` if there is none)."""
    found = _complete_checkpoints(Path(root))
    return found[-1][1] if found else None


def newest_folder(root: str | os.PathLike[str]) -> Path | None:
    """The newest ``step_N`` folder under ``root``, complete or not (``None`` if there is
    none): the checkpoint a resume starts from, or refuses as damaged ([Note: a step folder
    without qshard.json])."""
    found = _checkpoint_folders(Path(root))
    return found[-1][1] if found else None


def newest_intact(root: str | os.PathLike[str]) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint under ``root`` whose files pass every check, sizes and
    CRC-32s included (one process: it reads the files; for a failed job's hint), and the newer
    ones that did not, newest first, each with what is wrong."""
    damaged: list[tuple[Path, str]] = []
    for _, path in reversed(_checkpoint_folders(Path(root))):  # [Note: a step folder without...
        try:
            info = checkpoint_info(path)
            _check_files(path, info)
            _verify_sums(path, info)
        except DamagedCheckpointError as exc:
            damaged.append((path, _reason(str(exc), path)))
            continue
        return path, damaged
    return None, damaged


@dataclass(frozen=True, slots=True)
class _Outcome:
    """Every rank's outcome of one step of :func:`~qshard.train.checkpoint.load_newest` on one
    checkpoint, the same on every rank: ``ok``, or the first failed rank's message (``damaged``
    or another configuration)."""

    ok: bool
    damaged: bool
    step: int
    message: str
    why: str


def _agree(path: Path, attempt: Any) -> _Outcome:
    """Run ``attempt`` on every rank and gather the outcomes (one ``all_gather_object``).
    Any other exception (a disk error, a bug) is no verdict on the checkpoint: it is gathered
    too, then raised on its rank, and every other rank raises a :class:`CheckpointError` naming
    it, so no rank is left waiting for the failed one at the next collective."""
    error: Exception | None = None
    try:
        result = attempt()
        mine: tuple[str, Any] = ("ok", result if isinstance(result, int) else -1)
    except DamagedCheckpointError as exc:
        mine = ("damaged", str(exc))
    except CheckpointError as exc:
        mine = ("refused", str(exc))
    except Exception as exc:
        error, mine = exc, ("error", f"{type(exc).__name__}: {exc}")
    world = _world()
    outcomes = _from_everyone(mine)
    if error is not None:
        raise error
    crashed = [(r, o[1]) for r, o in enumerate(outcomes) if o[0] == "error"]
    if crashed:
        rank, message = crashed[0]
        raise CheckpointError(f"reading {path} failed on rank {rank}: {message}")
    failed = [(r, o) for r, o in enumerate(outcomes) if o[0] != "ok"]
    if not failed:
        return _Outcome(True, False, int(mine[1]), "", "")
    # A configuration refusal outranks damage: it must reach the user, not be passed over.
    refused = [(r, o) for r, o in failed if o[0] == "refused"]
    first_rank, (kind, message) = (refused or failed)[0]
    ranks = [r for r, o in failed if o[0] == kind]
    why = _reason(message, path)
    if world > 1:
        why += f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        if first_rank != _rank():
            message = f"rank {first_rank}: {message}"
    return _Outcome(False, kind == "damaged", -1, message, why)


def _reason(message: str, path: Path) -> str:
    """The middle of a damage message: what is wrong, without the folder and the fix."""
    text = message.split(f": {_DAMAGED}")[0]
    return text.replace(f"{path}/", "").replace(str(path), "").strip() or message


def _passes_file_checks(path: Path) -> bool:
    try:
        _check_files(path, checkpoint_info(path))
    except CheckpointError:
        return False
    return True


def _earlier_intact_hint(earlier: list[Path]) -> str:
    """``; the newest earlier checkpoint that passes the file checks is X`` (or that there is
    none), for the refusal of a damaged checkpoint; ``earlier`` is newest first."""
    intact = next((p for p in earlier if _passes_file_checks(p)), None)
    if intact is None:
        return "; no earlier checkpoint passes the file checks"
    return (
        f"; the newest earlier checkpoint that passes the file checks ({_META} and state files "
        f"there) is {intact}"
    )


def damaged_newest_hint(root: str | os.PathLike[str], newest: str | os.PathLike[str]) -> str:
    """The hint :func:`~qshard.train.checkpoint.load_newest` adds to the refusal of a damaged
    ``newest`` checkpoint under ``root`` (for the launcher's own check of ``--resume``)."""
    newest = Path(newest)
    found = [p for _, p in reversed(_complete_checkpoints(Path(root))) if p != newest]
    return _earlier_intact_hint(found)
