"""Faults of a running job: the testing hook that injects them, and the diagnosis of a failed
collective (which rank is gone, at which step, which checkpoint to resume from).

[Note: fault injection] ``QSHARD_FAULT`` is a testing hook, read once per process: a ``;``-list
of ``kind:key=value:...`` items, e.g. ``kill:rank=1:step=3`` or
``stop:rank=1:step=2;nan_grad:rank=0:step=4``. Keys: ``rank`` (required), ``step`` (required,
the loop's 0-based step, or with ``at=save`` the step number of the checkpoint), ``at``
(``step``: before that step's forward, the default; ``save``: inside the save of checkpoint
``step_<step>``, after this rank's shard is on disk and before the save is complete),
``restart`` (the ``TORCHELASTIC_RESTART_COUNT`` it fires in; 0 by default, so a restarted job
does not fault again). Kinds:

* ``kill``: SIGKILL this rank (a crashed host or an OOM kill);
* ``stop``: SIGSTOP this rank (a hung process: alive, holding its sockets, never answering);
* ``nan_grad``: this rank's loss is multiplied by NaN before backward, so its local gradients
  are NaN and travel through the gradient collectives (qgZ included) like a real overflow;
* ``corrupt`` (only ``at=save``): cut the files this rank wrote into checkpoint ``step`` to
  half their size, after which the save completes: a complete-looking checkpoint with a
  shard cut short (a lost write, a full disk), found only when it is loaded.

Unset, the hook costs one ``is None`` test per step. Anything malformed is an error at start,
never a silently ignored fault.

[Note: roll call] When a collective fails (a peer's socket closed, or nothing arrived within
``--collective-timeout``), the surviving ranks do not know which peer is gone. Each writes
"I am alive at step s" into the job's key-value store (hosted by the launcher's agent, so it
works while a rank is stopped or dead) and waits a short grace for the others; the ranks that
never answer are the lost ones (a rank blocked waiting for a peer that failed first is among
them too). A lost rank on this host that is stopped (procfs state ``T``) is sent SIGKILL by a
small watcher once the reporting rank has exited and been reaped ([Note: reaped first]): torch
elastic's agent would SIGTERM it, which a stopped process never acts on, and SIGKILL it only
after its fixed 30 s grace; killed before the reporting rank's error is recorded, its death
would be all the agent reports. The error names the lost ranks, the step and the newest
complete checkpoint.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from qshard.train._runtime import restart_count

__all__ = [
    "Fault",
    "RankFailure",
    "at_step",
    "clip",
    "current_step",
    "diagnose",
    "fault_plan",
    "fire",
    "is_collective_failure",
    "poison",
    "register_rank",
]

ENV = "QSHARD_FAULT"
KINDS = ("kill", "stop", "nan_grad", "corrupt")
_PLACES = ("step", "save")


class RankFailure(RuntimeError):
    """The job cannot continue: a peer rank is lost or a value became non-finite. The message
    names the rank(s), the step and the checkpoint to resume from."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """One injected fault (see [Note: fault injection])."""

    kind: str
    rank: int
    step: int
    at: str = "step"
    restart: int = 0


def parse(spec: str) -> tuple[Fault, ...]:
    """``QSHARD_FAULT``'s value -> faults (raises ``ValueError`` naming the bad item)."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        kind, *pairs = item.split(":")
        if kind not in KINDS:
            raise ValueError(f"{ENV}: unknown fault {kind!r} in {item!r}; kinds: {KINDS}")
        fields: dict[str, object] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or key not in ("rank", "step", "at", "restart"):
                raise ValueError(
                    f"{ENV}: bad field {pair!r} in {item!r} (rank=, step=, at=, restart=)"
                )
            if key == "at":
                fields[key] = value
            elif value.isascii() and value.isdigit():  # no sign, no space
                fields[key] = int(value)
            else:
                raise ValueError(
                    f"{ENV}: {key}= takes a whole number >= 0; got {pair!r} in {item!r}"
                )
        if "rank" not in fields or "step" not in fields:
            raise ValueError(f"{ENV}: {item!r} needs rank= and step=")
        if fields.get("at", "step") not in _PLACES:
            raise ValueError(f"{ENV}: at= must be one of {_PLACES} in {item!r}")
        if kind == "corrupt" and fields.get("at") != "save":
            raise ValueError(f"{ENV}: corrupt cuts a checkpoint's files: it needs at=save")
        faults.append(Fault(kind=kind, **fields))  # type: ignore[arg-type]
    return tuple(faults)


_PLAN: tuple[Fault, ...] | None = None
_PLAN_READ = False
_STEP = -1  # the step this rank is in, for the diagnosis of a failure


def current_step() -> int:
    """The loop step this rank last started (-1 before the first)."""
    return _STEP


def at_step(step: int) -> bool:
    """Called by the loop at the start of every step: records it and fires this rank's faults
    due before it; True if a ``nan_grad`` fault is due (the loop poisons its loss)."""
    global _STEP
    _STEP = step
    return fire(fault_plan_of_this_rank(), step=step, at="step")


def fault_plan_of_this_rank() -> tuple[Fault, ...] | None:
    if _PLAN_READ:
        return _PLAN
    return fault_plan(dist.get_rank() if dist.is_initialized() else 0)


def fault_plan(rank: int) -> tuple[Fault, ...] | None:
    """This rank's faults for this incarnation of the job, or ``None`` (the usual case)."""
    global _PLAN, _PLAN_READ
    if not _PLAN_READ:
        spec = os.environ.get(ENV)
        mine = parse(spec) if spec else ()
        mine = tuple(f for f in mine if f.rank == rank and f.restart == restart_count())
        _PLAN, _PLAN_READ = (mine or None), True
    return _PLAN


def fire(
    plan: tuple[Fault, ...] | None, *, step: int, at: str, files: tuple[Path, ...] = ()
) -> bool:
    """Carry out the faults of ``plan`` due at ``(step, at)``; True if a ``nan_grad`` is due
    (the caller poisons its loss). ``kill`` and ``stop`` do not return normally; ``corrupt``
    cuts ``files`` (this rank's files of the checkpoint being saved) to half their size."""
    if plan is None:
        return False
    nan = False
    for f in plan:
        if f.step != step or f.at != at:
            continue
        if f.kind == "nan_grad":
            nan = True
        elif f.kind == "corrupt":
            for file in files:
                os.truncate(file, file.stat().st_size // 2)
            names = ", ".join(file.name for file in files)
            print(
                f"qshard fault injection: corrupt rank {f.rank} at {at} {step}: cut {names} "
                f"to half (time {time.time():.3f})",
                flush=True,
            )
        else:
            print(
                f"qshard fault injection: {f.kind} rank {f.rank} at {at} {step} "
                f"(time {time.time():.3f})",
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP)
    return nan


def poison(loss: torch.Tensor) -> torch.Tensor:
    """``loss * NaN``: every gradient of this rank becomes NaN (the ``nan_grad`` fault)."""
    return loss * math.nan


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


#: A rank that answers the roll call this long after the caller reached it is named as stalled.
_LATE_S = 1.0


def _key(kind: str, rank: int) -> str:
    return f"qshard/{kind}/{restart_count()}/{rank}"


def register_rank() -> None:
    """Record this rank's host and pid in the job's store (read by :func:`diagnose`)."""
    store = _store()
    if store is not None:
        store.set(_key("pid", dist.get_rank()), f"{socket.gethostname()}:{os.getpid()}")


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed collective (a timeout or a lost connection), which is what a
    hung or dead peer looks like from here."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("timed out", "timeout", "connection", "gloo", "nccl", "socket")
    )


def clip(text: str, limit: int = 300) -> str:
    """``text`` cut to about ``limit`` characters at a word boundary, marked with `` ...``
    (a report line; the whole error is in the rank's traceback)."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip(" ,;:(") + " ..."


def diagnose(
    exc: BaseException, *, step: int, timeout_s: float, latest: Path | None, checkpoints: Path
) -> RankFailure:
    """The error a surviving rank raises after a failed collective: see [Note: roll call]."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lost: list[int] = []
    killed: list[int] = []
    late: dict[int, float] = {}  # rank -> seconds into the roll call when it answered
    store = _store()
    if store is not None:
        try:
            store.set(_key("alive", rank), str(step))
            start = time.monotonic()
            deadline = start + min(10.0, max(2.0, timeout_s / 2))
            keys = {r: _key("alive", r) for r in range(world) if r != rank}
            waiting = dict(keys)
            while waiting and time.monotonic() < deadline:
                for r, k in list(waiting.items()):
                    if store.check([k]):
                        del waiting[r]
                        if (waited := time.monotonic() - start) >= _LATE_S:
                            late[r] = waited
                if waiting:
                    time.sleep(0.2)
            lost = [r for r, k in keys.items() if not store.check([k])]
            killed = _kill_local(store, lost)
        except Exception:  # the store may be gone too: report what we know
            pass
    if lost:
        who = (
            f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} did not answer "
            f"(hung or dead)"
        )
    elif late:
        # A rank that answered well after this one reached the roll call was stalled while the
        # collective timed out (stopped, swapping, or starved of CPU), not the network.
        who = "every rank answered afterwards, " + ", ".join(
            f"rank {r} only after {t:.1f} s" for r, t in sorted(late.items())
        )
        who += f" (stalled: {'they were' if len(late) > 1 else 'it was'} stopped, swapping or "
        who += "starved of CPU while the collective timed out?)"
    else:
        who = "every rank answered afterwards (a transient network failure?)"
    if killed:
        who += f"; stopped rank{'s' if len(killed) > 1 else ''} "
        who += ", ".join(map(str, killed)) + " on this host: killed with this rank"
    resume = (
        f"resume from {latest} with --resume (or run with --max-restarts N to restart "
        "automatically)"
        if latest is not None
        else f"no complete checkpoint under {checkpoints} yet: rerun from the start"
    )
    reason = clip(str(exc).strip().splitlines()[0]) if str(exc).strip() else type(exc).__name__
    return RankFailure(
        f"rank {rank} stopped at step {step}: a collective failed or did not complete within "
        f"--collective-timeout {timeout_s:g} s ({type(exc).__name__}: {reason}); {who}; {resume}"
    )


def _kill_local(store: dist.Store, lost: list[int]) -> list[int]:
    """Arrange for the lost ranks on this host that are stopped to get SIGKILL once this process
    has exited: killed earlier, the stopped peer's death is what the agent sees first, and it
    stops this rank before its error (the diagnosis) is recorded. A small watcher process
    waits for this one to end. Only stopped ranks: one merely blocked in a collective waiting
    for us did not answer either, and is left to fail by itself or to the agent.

    [Note: reaped first] "Ended" must mean reaped by the agent, not merely exited (a zombie):
    the launcher's agent (torch's spawn context) polls every 0.2 s, and when it finds two
    ranks dead at one poll it reports the one of lower local rank alone. The watcher used to
    kill the stopped peer as soon as this rank was a zombie, so a stopped rank 0 reported by
    rank 1 was usually found dead at the same poll, and the job's only report was "rank 0 was
    killed by SIGKILL": the diagnosis (hung, at which step, the checkpoint) was lost. Once the
    agent has reaped this rank it has recorded its error; a parent that does not reap within
    5 s does not hold the kill back longer."""
    host = socket.gethostname()
    killed: list[int] = []
    pids: list[int] = []
    for r in lost:
        key = _key("pid", r)
        if not store.check([key]):
            continue
        where, _, pid = store.get(key).decode().rpartition(":")
        if where != host or _proc_state(int(pid)) != "T":
            continue
        pids.append(int(pid))
        killed.append(r)
    if pids:
        subprocess.Popen(
            [sys.executable, "-S", "-c", _WATCHER, str(os.getpid()), *map(str, pids)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
    return killed


# Waits (at most 10 minutes) until the rank that started it has exited and its parent (the
# agent) has reaped it, or 5 s after it exited if no parent reaps it, then SIGKILLs the given
# pids that are still stopped (state T). [Note: reaped first] in _kill_local.
_WATCHER = """
import os, signal, sys, time
def state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return None
rank, pids = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
end = time.monotonic() + 600
exited = None
while time.monotonic() < end:
    now, s = time.monotonic(), state(rank)
    if s in (None, "X"):
        break
    if s == "Z":
        exited = exited or now
        if now - exited > 5:
            break
    time.sleep(0.05)
for pid in pids:
    if state(pid) == "T":
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
"""


def _proc_state(pid: int) -> str | None:
    """The state letter of ``pid`` (``T``: stopped, ``Z``: zombie), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return "?"  # no procfs: unknown
    return stat.rpartition(")")[2].split()[0]
