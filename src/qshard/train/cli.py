"""``qshard train``: a thin argparse layer over :class:`TrainConfig`, and the local launcher.

Every field of :class:`TrainConfig` is a flag of the same name with dashes (booleans also have
``--no-...``); the help text is the field's docstring. Started by hand, the command checks the
whole configuration and builds the corpus cache, then starts ``--nproc`` ranks on this machine
through PyTorch's elastic launcher (``torch.distributed.launcher.api``, the engine of
``torchrun``). Started by torchrun (``torchrun ... -m qshard.train ...``) it runs the rank it is.

[Note: restarts] ``--max-restarts N`` is torch elastic's own restart (the launcher's agent, or
torchrun's ``--max-restarts`` under torchrun): when a rank fails, the agent stops every rank
and starts the group again with ``TORCHELASTIC_RESTART_COUNT`` raised. A restarted rank resumes
from the newest complete checkpoint by itself (:func:`resume_after_restart`), which together
with the loop's [Note: exact resume] makes the restarted job finish as the uninterrupted one
would; a newest checkpoint that does not load is moved aside and the previous one loaded
([Note: restart fallback] in qshard.train.checkpoint). A job out of restarts ends with a report
naming the failed ranks (:func:`_report`); their tracebacks go to ``OUT/failures.log`` ([Note:
rank tracebacks]).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import errno
import fcntl
import inspect
import itertools
import logging
import os
import re
import socket
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from qshard.train import config as config_module
from qshard.train._runtime import restart_count
from qshard.train.config import (
    DTYPES,
    MODELS,
    ON_NONFINITE,
    OPTIMIZERS,
    TrainConfig,
    launch_ranks_per_node,
    resume_mismatches,
    resume_refusal,
)

__all__ = [
    "build_parser",
    "claim_run_dir",
    "config_from_args",
    "launch",
    "main",
    "resume_after_restart",
]

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _field_docs() -> dict[str, str]:
    """Attribute docstrings of TrainConfig (the string right after each field)."""
    tree = ast.parse(inspect.getsource(config_module))
    docs: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "TrainConfig":
            body = node.body
            for stmt, nxt in itertools.pairwise(body):
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ):
                    docs[stmt.target.id] = _plain_text(" ".join(nxt.value.value.split()))
    return docs


def _plain_text(doc: str) -> str:
    """Docstring markup -> terminal text: ``:data:`NAME``` becomes the tuple's values."""
    doc = re.sub(
        r":data:`(\w+)`", lambda m: "{" + ", ".join(getattr(config_module, m.group(1))) + "}", doc
    )
    return doc.replace("``", "")


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``qshard train`` argument parser (one flag per :class:`TrainConfig` field)."""
    parser = argparse.ArgumentParser(
        prog="qshard train",
        description=(
            "Train a small GPT with ZeRO++ / 8-bit / 1-bit optimizers on N local ranks "
            "(emulated nodes), with checkpoints, metrics and a summary of the bytes saved."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    docs = _field_docs()
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        annotation = str(field.type).replace("None", "").replace("|", "").strip()
        kind = _TYPES[annotation]
        help_text = docs.get(field.name, "").replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": field.name, "default": field.default, "help": help_text}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind
            if field.name == "optim":
                kwargs["choices"] = OPTIMIZERS
            elif field.name == "model":
                kwargs["choices"] = MODELS
            elif field.name == "dtype":
                kwargs["choices"] = DTYPES
            elif field.name == "parallel":
                kwargs["choices"] = config_module.PARALLELISMS
            elif field.name == "replicate_grads":
                kwargs["choices"] = config_module.REPLICATE_GRADS
            elif field.name == "on_nonfinite":
                kwargs["choices"] = ON_NONFINITE
            kwargs["metavar"] = field.name.upper() if kind is str else kind.__name__.upper()
        parser.add_argument(flag, **kwargs)
    return parser


def config_from_args(argv: Sequence[str]) -> TrainConfig:
    """Parse ``argv`` into a validated :class:`TrainConfig` (raises ``ValueError`` with the fix;
    argparse exits on unknown flags). Under torchrun, ``nproc`` is the job's world size."""
    args = vars(build_parser().parse_args(list(argv)))
    if _under_torchrun():
        args["nproc"] = int(os.environ["WORLD_SIZE"])
    explicit = _explicit_fields(argv)
    notes = _fit_defaults(args, explicit)
    if not args.get("deepspeed_config"):
        config = TrainConfig(**args)
    else:
        from qshard.train import _deepspeed

        config = TrainConfig(**_deepspeed.apply_deepspeed(args, explicit=explicit))
        # hpZ's secondary group is one node: check the file's partition size against this launch.
        local = os.environ.get("LOCAL_WORLD_SIZE") if _under_torchrun() else None
        rpn = config.ranks_per_node or (int(local) if local else config.local_ranks_per_node())
        _deepspeed.translation(config.deepspeed_config, ranks_per_node=rpn)
    if os.environ.get("RANK", "0") == "0":  # once per job under torchrun; after the checks
        for note in notes:
            print(f"qshard train: note: {note}", file=sys.stderr)
    return config


def _tqdm_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("tqdm") is None


def _fit_defaults(args: dict[str, Any], explicit: set[str]) -> list[str]:
    """[Note: defaults that cannot fit] Two schedule defaults depend on flags a user does
    give: the warm-up must end before the run (TrainConfig refuses ``--warmup-steps`` >=
    ``--steps``) and the floor may not exceed the peak (``--min-lr`` <= ``--lr``). A short run
    (``--steps 5``, a smoke test) or a small ``--lr 1e-4`` was refused for a flag its user never
    gave (and ``--steps 1`` ran silently at a twentieth of ``--lr``). Left at its default, such
    a flag now takes the defaults' ratio instead (a warm-up of a tenth of the run, 20 of 200,
    none below 10 steps; a floor of a tenth of ``--lr``, 3e-4 of 3e-3, as with a DeepSpeed
    config's lr) and the command notes it; a flag given explicitly is never changed, and is
    refused when it does not fit. ``args`` is changed in place; returns the notes."""
    notes = []
    steps, warmup = args.get("steps"), args.get("warmup_steps")
    if (
        "warmup_steps" not in explicit
        and isinstance(steps, int)
        and isinstance(warmup, int)
        and 1 <= steps <= warmup
    ):
        fitted = args["warmup_steps"] = steps // 10
        instead = (
            f"warming up over {fitted} step{'s' if fitted > 1 else ''} instead (a tenth of the run)"
            if fitted
            else "no warm-up instead (a tenth of the run rounds to 0)"
        )
        notes.append(
            f"--warmup-steps defaults to {warmup}, which does not end before --steps {steps}; "
            f"{instead}; pass --warmup-steps to choose"
        )
    if args.get("progress") and "progress" not in explicit and _tqdm_missing():
        args["progress"] = False
        notes.append(
            "no progress bar: tqdm is not installed (pip install 'qshard[train]' installs what "
            "the training application uses); --no-progress says so without this note"
        )
    lr, floor = args.get("lr"), args.get("min_lr")
    if (
        "min_lr" not in explicit
        and not args.get("deepspeed_config")  # the file's lr moves the floor by itself
        and isinstance(lr, float)
        and isinstance(floor, float)
        and 0 < lr < floor  # NaN, inf and lr <= 0 fail this: left to TrainConfig's errors
    ):
        defaults = TrainConfig()
        args["min_lr"] = lr * defaults.min_lr / defaults.lr
        notes.append(
            f"--min-lr defaults to {floor:g}, above --lr {lr:g}; decaying to {args['min_lr']:g} "
            "instead (a tenth of --lr); pass --min-lr to choose"
        )
    return notes


def _explicit_fields(argv: Sequence[str]) -> set[str]:
    """The TrainConfig fields whose flags ``argv`` gives (``--x``, ``--x=v``, ``--no-x``)."""
    names = set()
    for arg in argv:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0]
            names.add(name.removeprefix("no-").replace("-", "_"))
    return names


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resume_after_restart(config: TrainConfig) -> TrainConfig:
    """``config`` with ``resume`` set when this process is a restart of a failed job (torch
    elastic's ``TORCHELASTIC_RESTART_COUNT > 0``) and a checkpoint folder exists; see
    [Note: restarts]. Without one the restart starts from step 0, which replays the same run.
    A restarted rank falls back past damaged checkpoints ([Note: restart fallback] in
    qshard.train.checkpoint), a ``step_N`` folder without ``qshard.json`` included."""
    if config.resume or restart_count() == 0:
        return config
    from qshard.train.checkpoint import newest_folder

    # [Note: a step folder without qshard.json] in qshard.train._fallback
    if newest_folder(os.path.join(config.out, "checkpoints")) is None:
        return config
    return config.replace(resume=True)


@record
def _entrypoint(config: TrainConfig) -> dict[str, Any]:
    from qshard.train.loop import train

    result = train(resume_after_restart(config))
    # Only small, picklable facts travel back to the launcher.
    return {k: v for k, v in result.items() if k != "ledger"}


def preflight(config: TrainConfig) -> None:
    """Everything that can be refused before a rank starts: unavailable options, an ``--out``
    that cannot be written, a bad corpus, ``--resume`` without a checkpoint (or with a damaged
    one, or a ``metrics.jsonl`` with a line that is not a record). Builds the corpus cache as a
    side effect."""
    from qshard.train._metrics import _records
    from qshard.train._parallel import missing_features
    from qshard.train.checkpoint import (
        DamagedCheckpointError,
        _check_files,
        checkpoint_info,
        damaged_newest_hint,
        newest_folder,
        refuse_earlier_run,
    )
    from qshard.train.data import load_corpus
    from qshard.train.loop import run_dir_problem

    problems = missing_features(config)
    if problems:
        raise ValueError("; ".join(problems))
    problem = run_dir_problem(config.out, create=False)  # [Note: run directory]
    if problem:
        raise ValueError(problem)
    load_corpus(
        config.data,
        cache_dir=config.cache_dir,
        val_fraction=config.val_fraction,
        min_tokens=config.context + 1,
    )
    if not config.resume and not config.overwrite:
        refuse_earlier_run(config.out, os.path.join(config.out, "checkpoints"))
    if config.resume:
        # The newest step_N folder: one without qshard.json is refused as damaged below, not
        # passed over ([Note: a step folder without qshard.json] in qshard.train._fallback).
        latest = newest_folder(os.path.join(config.out, "checkpoints"))
        if latest is None:
            raise ValueError(
                f"--resume: no complete checkpoint under {config.out}/checkpoints; "
                "run without --resume to start fresh"
            )

        def refuse_damaged(exc: DamagedCheckpointError) -> DamagedCheckpointError:
            # The user decides (no fallback here): name the newest intact one.
            hint = damaged_newest_hint(os.path.join(config.out, "checkpoints"), latest)
            return DamagedCheckpointError(f"--resume: {exc}{hint}")

        try:
            info = checkpoint_info(latest)
        except DamagedCheckpointError as exc:
            raise refuse_damaged(exc) from exc
        step = info.get("step")
        # [Note: finishing a run] A run stopped after its final checkpoint (a rank died while
        # exporting or writing the summary) is finished by a --resume at the same --steps: the
        # loop trains nothing and writes the export and summary. Only a finished run (a summary
        # written at --steps; an extended run keeps its earlier launch's summary and export
        # until its last launch replaces them) has nothing left to do.
        unfinished = step == config.steps and not _finished(config)
        if isinstance(step, int) and step >= config.steps and not unfinished:
            raise ValueError(
                f"--resume: {latest} is at step {step}, so --steps {config.steps} leaves nothing "
                f"to train; pass --steps above {step} to continue that run"
            )
        changed = resume_mismatches(info, config)
        if changed:
            from qshard.train._deepspeed import resume_advice

            advice = resume_advice(config, info)
            raise ValueError(resume_refusal(latest, changed, advice=advice))
        _refuse_per_rank_layout(latest, info, config)
        try:
            _check_files(latest, info)
        except DamagedCheckpointError as exc:
            raise refuse_damaged(exc) from exc
        # The records rank 0 keeps on resume: a bad line (other than a torn last one) was found
        # only there, after the model was built, and the failure report then named the old
        # file's last step as this launch's.
        metrics = Path(config.out) / "metrics.jsonl"
        if metrics.is_file():
            try:
                _records(metrics)
            except (OSError, ValueError) as exc:
                raise ValueError(f"--resume: {exc}") from exc


def _refuse_per_rank_layout(latest: Path, info: dict[str, Any], config: TrainConfig) -> None:
    """Refuse before launch a ``--resume`` of per-rank HSDP checkpoints (the 1-bit optimizers'
    ``--parallel hsdp``) with another number of ranks per node: each rank's file holds its
    shard of the node's model, so the ranks refused it only after they had started, and the
    failure report then suggested rerunning with ``--resume`` or ``--max-restarts``, which fail
    alike."""
    saved = info.get("config")
    if info.get("format") != "per_rank" or config.parallel != "hsdp":
        return
    if not isinstance(saved, dict) or not isinstance(saved.get("nproc"), int):
        return  # an older checkpoint: the ranks' own check
    rpn = saved.get("ranks_per_node")
    was = launch_ranks_per_node(saved["nproc"], rpn if isinstance(rpn, int) else None)
    now = config.local_ranks_per_node()
    if was != now:
        raise ValueError(
            f"--resume: {latest} holds per-rank HSDP checkpoints of {was} ranks per node "
            f"({saved['nproc']} ranks), {now} here: each rank's file holds its shard of its "
            f"node's model, so they load only with {was} ranks per node; pass --ranks-per-node "
            f"{was} (and an --nproc that is a multiple of it), or a new --out to start fresh"
        )


def launch(config: TrainConfig) -> dict[int, dict[str, Any]]:
    """Run ``config`` on ``config.nproc`` local ranks through the elastic launcher; returns the
    per-rank results (the summary numbers of :func:`qshard.train.loop.train`)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = config.replace(ranks_per_node=config.local_ranks_per_node())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=config.nproc,
        run_id=f"qshard-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=config.max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
    )
    return elastic_launch(launch_config, _entrypoint)(config)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``qshard train [ARGS...]`` (``argv`` defaults to ``sys.argv[1:]``): launch the
    ranks, or train this rank under torchrun; return the exit code (2: a bad argument or run
    directory, with the reason on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config = config_from_args(argv)
    except ValueError as exc:
        print(f"qshard train: error: {exc}", file=sys.stderr)
        return 2
    from qshard.train.checkpoint import CheckpointError

    if _under_torchrun():
        from qshard.train.loop import RunDirError, train

        try:
            train(resume_after_restart(config))
        except KeyboardInterrupt:  # Ctrl-C reaches every rank: the launcher says what is left
            return 130
        except RunDirError as exc:  # every rank has it ([Note: run directory]): say it once
            if os.environ.get("RANK", "0") == "0":
                print(f"qshard train: error: {exc}", file=sys.stderr)
            return 2
        return 0
    with contextlib.ExitStack() as claimed:
        try:
            # An --out that exists is claimed before it is read: a run in progress there has
            # no checkpoint yet, or one the checks below would take for an earlier run's.
            claim = claim_run_dir(config.out, create=False)
            if claim is not None:
                claimed.enter_context(claim)
            preflight(config)
            if claim is None:
                claimed.enter_context(claim_run_dir(config.out, create=True))
        except (ValueError, CheckpointError) as exc:
            print(f"qshard train: error: {exc}", file=sys.stderr)
            return 2
        return _launch_and_report(config)


_LOCK = ".qshard.lock"


def claim_run_dir(out: str, *, create: bool) -> IO[str] | None:
    """Claim ``--out`` for this job: an exclusive ``flock`` on ``OUT/.qshard.lock``, held by
    the open file returned (closing it, or the launcher's exit, releases it).

    [Note: one job per run directory] Two jobs in one ``--out`` (a command started twice, two
    ``./run.sh``) truncated each other's ``metrics.jsonl``, saved their checkpoints side by side
    and overwrote each other's summary and export, and with ``--overwrite`` one removed the
    other's checkpoints mid-run, all without a word. The launcher holds the claim from before
    it reads the folder until the job ends, so a second job is refused, naming the holder.
    Under torchrun the launcher is torchrun's, and nothing claims the folder.

    Without ``create``, an ``out`` that is not a folder this process can write in is left to
    :func:`preflight` to refuse (returns ``None``)."""
    path = Path(out)
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        lock = open(path / _LOCK, "a+")  # noqa: SIM115 - held until the job ends
    except OSError as exc:
        if not create:
            return None
        raise ValueError(
            f"--out {out} cannot be the run directory ({exc}); pass --out a folder you can write to"
        ) from exc
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise ValueError(
            f"--out {out} is in use by another qshard train job ({holder}); wait for it to "
            "end, or pass another --out"
        ) from None
    try:
        lock.truncate(0)
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        lock.flush()
    except OSError as exc:  # a full disk: creating the empty file needed no space
        with contextlib.suppress(OSError):  # (its flush fails again; the file is closed)
            lock.close()
        raise ValueError(
            f"--out {out}: cannot write {path / _LOCK} ({exc.strerror or exc}); "
            f"{_FULL_DISK if exc.errno == errno.ENOSPC else 'pass --out a folder you can write to'}"
        ) from exc
    return lock


_FAILURES_LOG = "failures.log"
"""The file under ``--out`` that holds every failed rank's traceback ([Note: rank tracebacks])."""

_ELASTIC_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _RankTracebacks(logging.Filter):
    """[Note: rank tracebacks] When a rank fails, torch elastic's process context logs the
    rank's whole traceback as an error (``logger.exception`` in ``MultiprocessContext._poll``:
    37 ``E...`` lines for one failed rank, its frames inside torch's spawn wrappers and
    ``@record``), before the launcher's own diagnosis, which holds the line that matters. This
    filter on that logger writes such a record (every line of it, with the time) to
    ``OUT/failures.log`` instead of the terminal, and the report names that file; with
    ``--max-restarts``, where a restart follows and nothing else on the terminal says why, it
    also prints the rank's last line. It takes only the records that carry a rank's
    ``ProcessRaisedException``/``ProcessExitedException``; every other record of the logger
    goes on as before, and so does this one if the file cannot be written, so nothing is lost.
    Under torchrun the launcher is torchrun's and prints them as before."""

    def __init__(self, config: TrainConfig) -> None:
        super().__init__()
        self.path = Path(config.out) / _FAILURES_LOG
        self.note = config.max_restarts > 0
        self.written = False
        self._format = logging.Formatter("%(asctime)s %(message)s")

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, (ProcessRaisedException, ProcessExitedException)):
            return True
        try:
            with open(self.path, "a") as f:
                f.write(self._format.format(record) + "\n\n")
        except OSError:
            return True  # on the terminal then, as before
        self.written = True
        if self.note:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            # "qshard.train.loop.RankFailure: ..." -> "RankFailure: ...", as the report says it
            last = re.sub(r"^(\w+\.)+(?=\w+:)", "", lines[-1]) if lines else type(exc).__name__
            print(
                f"qshard train: rank {exc.error_index} (pid {exc.error_pid}) failed: {last}; "
                f"its traceback is in {self.path}",
                file=sys.stderr,
                flush=True,
            )
        return False

    @contextlib.contextmanager
    def installed(self) -> Any:
        logger = logging.getLogger(_ELASTIC_LOGGER)
        logger.addFilter(self)
        try:
            yield self
        finally:
            logger.removeFilter(self)


def _launch_and_report(config: TrainConfig) -> int:
    tracebacks = _RankTracebacks(config)
    if not config.resume:
        # An earlier run's tracebacks (preflight has let this fresh run replace it). The
        # launcher, not rank 0's fresh-run cleanup, removes them: a restart that finds no
        # checkpoint starts afresh and would remove the failed attempt's.
        tracebacks.path.unlink(missing_ok=True)
    try:
        with tracebacks.installed():  # [Note: rank tracebacks]
            launch(config)
    except ChildFailedError as exc:
        where = tracebacks.path if tracebacks.written else None
        print(_report(exc, config, tracebacks=where), file=sys.stderr)
        return 1
    except (SignalException, KeyboardInterrupt) as exc:
        what = getattr(exc, "sigval", None)
        name = what.name if what is not None else "SIGINT"
        print(f"qshard train: stopped by {name}; {_resume_hint(config)}", file=sys.stderr)
        return 130
    return 0


def _report(exc: ChildFailedError, config: TrainConfig, *, tracebacks: Path | None = None) -> str:
    """What a failed job tells its user: each failed rank and why (a signal, or the first line
    of its error, which for a lost peer or a non-finite value names rank, step and checkpoint),
    where the ranks' tracebacks are (``tracebacks``, [Note: rank tracebacks]; else they were
    printed above), the step the run had reached, and how to continue."""
    lines = []
    # Ranks that raised (their messages carry the diagnosis) before ranks that were killed.
    failures = sorted(exc.failures.items(), key=lambda kv: (kv[1].exitcode < 0, kv[0]))
    for rank, failure in failures:
        if failure.exitcode < 0:
            what = f"was killed by {failure.signal_name()}"
        else:
            text = _failure_message(failure, tracebacks).strip().splitlines()
            what = f"failed (exit code {failure.exitcode}): {text[-1] if text else 'no message'}"
        lines.append(f"  rank {rank} (pid {failure.pid}) {what}")
    if tracebacks is not None:
        lines.append(f"  (the tracebacks are in {tracebacks})")
    if any(os.strerror(errno.ENOSPC) in line for line in lines):
        lines.append(f"  (a disk is full: {_FULL_DISK}; --out is {config.out})")
    reached = _last_logged_step(config)
    restarts = (
        f" after {config.max_restarts} restart{'s' if config.max_restarts != 1 else ''}"
        if config.max_restarts
        else ""
    )
    head = f"qshard train: error: the job failed{restarts}"
    if reached is not None:
        head += f" (rank 0 had logged step {reached})"
    hint = _resume_hint(config)
    if not config.max_restarts:
        hint += ", or pass --max-restarts N to restart automatically"
    return "\n".join([head + ":", *lines, hint])


_FULL_DISK = (
    "free space on the file system that holds --out (checkpoints, metrics, the export), or "
    "pass another --out"
)


def _finished(config: TrainConfig) -> bool:
    """Whether the run in ``--out`` wrote its summary (the last thing a run does) for
    ``--steps``: an extended run's earlier summary does not count."""
    from qshard.train._summary import finished_step

    return finished_step(Path(config.out)) == config.steps


def _resume_hint(config: TrainConfig) -> str:
    """How to continue a run that stopped: from its newest complete checkpoint, if any."""
    from qshard.train.checkpoint import checkpoint_info, newest_intact

    root = os.path.join(config.out, "checkpoints")
    intact, damaged = newest_intact(root)  # a refused newest one is not the way on
    if damaged:
        names = ", ".join(f"{p.name} ({why})" for p, why in damaged)
        moved = f"move {'them' if len(damaged) > 1 else 'it'} out of {root}"
        if intact is None:
            return f"no checkpoint passes its checks ({names}): rerun from the start"
        return (
            f"the newest complete checkpoint{'s' if len(damaged) > 1 else ''} {names} "
            f"{'are' if len(damaged) > 1 else 'is'} damaged: {moved} and rerun with --resume "
            f"to continue from {intact}"
        )
    if intact is None:
        return "no complete checkpoint was written: rerun from the start"
    if checkpoint_info(intact).get("step") == config.steps and not _finished(config):
        return (  # see [Note: finishing a run]
            f"the final checkpoint {intact} is complete: rerun with --resume to finish the run "
            "(the export and summary; nothing is trained again)"
        )
    return f"the newest complete checkpoint is {intact}: rerun with --resume to continue from it"


def _failure_message(failure: Any, tracebacks: Path | None = None) -> str:
    """A failed rank's error text. The error file holds ``{"message": {"message": ...}}`` when
    ``@record`` wrote it; without one (an exception that is not an ``Exception``, such as DCP's
    ``CheckpointException``, escapes ``@record``) torch elastic's placeholder is
    ``{"message": "<NONE>"}`` and the process's own message is all there is, with the
    traceback in ``tracebacks`` ([Note: rank tracebacks]) or printed above."""
    data = failure.error_file_data
    inner = data.get("message") if isinstance(data, dict) else None
    if isinstance(inner, dict) and inner.get("message"):
        return str(inner["message"])
    if isinstance(inner, str) and inner and inner != "<NONE>":
        return inner
    message = str(failure.message or "")
    if not message or message.startswith("To enable traceback see"):  # elastic's placeholder
        where = f"is in {tracebacks}" if tracebacks is not None else "is printed above"
        return f"no error recorded (its traceback {where})"
    return message


def _last_logged_step(config: TrainConfig) -> int | None:
    import json

    path = os.path.join(config.out, "metrics.jsonl")
    try:
        with open(path) as f:
            last = None
            for line in f:
                if line.strip():
                    last = line
        return None if last is None else int(json.loads(last)["step"])
    except (OSError, ValueError, KeyError):
        return None
