"""Run a function on a local multi-process gloo world: the harness of qshard's multi-rank tests
and single-machine benchmarks.

One world is spawned per call, and the function is expected to run many sub-cases inside it
(FSDP2's ``run_subtests`` pattern): importing torch costs ~5-10 s per process on a small machine.
Every call is bounded in time, and every process is stopped on failure or timeout.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

__all__ = ["WorldError", "run_world"]


class WorldError(RuntimeError):
    """A rank of a :func:`run_world` world failed, or the world ran past its timeout."""


def _worker(
    rank: int,
    world_size: int,
    init_file: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    timeout_s: float,
    results: Any,
) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        out = fn(rank, world_size, *args)
        dist.barrier()
        # pickled here: a tensor put on torch's queue as is travels as shared memory that dies
        # with this process, before the parent may have read it
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report everything, including KeyboardInterrupt in a child
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    ``fn`` must be importable by name (a module-level function) and its return value picklable
    (tensors included: it travels pickled, not as shared memory).
    Returns the per-rank return values, ordered by rank. Raises :class:`WorldError` with the
    failing ranks' tracebacks if any rank raises, exits abnormally, or the world outlives
    ``timeout_s``; all processes are stopped before returning either way.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="qshard-world-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, init_file, fn, args, dict(env or {}), timeout_s, results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        outcomes: dict[int, tuple[bool, Any]] = {}
        try:
            while len(outcomes) < world_size:
                while not results.empty():
                    rank, ok, payload = results.get()
                    outcomes[rank] = (ok, payload)
                if any(not ok for ok, _ in outcomes.values()):
                    time.sleep(0.5)  # let peers report their side of the failure
                    while not results.empty():
                        rank, ok, payload = results.get()
                        outcomes[rank] = (ok, payload)
                    break
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if r not in outcomes and p.exitcode is not None and results.empty()
                ]
                if dead:
                    time.sleep(0.2)
                    if results.empty():
                        for r in dead:
                            outcomes[r] = (False, f"exited with code {procs[r].exitcode}")
                        break
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(outcomes))
                    raise WorldError(
                        f"world of {world_size} ran past its {timeout_s:.0f} s timeout; "
                        f"ranks {missing} did not finish"
                    )
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    failures = {r: payload for r, (ok, payload) in sorted(outcomes.items()) if not ok}
    if failures:
        details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures.items())
        raise WorldError(f"{len(failures)} of {world_size} ranks failed:\n{details}")
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]
