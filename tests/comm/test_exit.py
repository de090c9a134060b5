"""A process whose last collective's tensors are freed on gloo's worker thread exits cleanly.

See [Note: exit after collectives] in ``qshard/comm/_exit.py``. The child scripts force the
race that otherwise shows up at random at the end of a training script: rank 1 joins an
all-gather late, so rank 0's worker thread finishes it (and drops the last reference to its
tensors) while rank 0's main thread holds the GIL (a huge switch interval keeps it) until
the script ends. Without the handler rank 0 dies with SIGABRT in every run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import sys, time
    import torch
    import torch.distributed as dist
    import qshard.comm  # installs the exit handler

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sys.setswitchinterval(1000.0)  # the main thread never hands the GIL over by itself
    if rank == 1:
        time.sleep(0.3)
    mine = torch.full((1000,), float(rank))
    out = [torch.empty(1000) for _ in range(dist.get_world_size())]
    work = dist.all_gather(out, mine, async_op=True)
    if rank == 1:
        work.wait()
    del work, out, mine  # the worker thread holds the last references now
    if rank == 0:
        end = time.perf_counter() + 0.8  # past the late rank: the gather finishes meanwhile
        while time.perf_counter() < end:
            pass
    print("done", flush=True)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_exit_after_a_collective_finished_on_the_worker_thread():
    env_base = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE="2",
        OMP_NUM_THREADS="1",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            env=dict(env_base, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert "done" in out, f"rank {rank} did not finish:\n{err[-3000:]}"
        assert "terminate called" not in err, f"rank {rank} aborted at exit:\n{err[-3000:]}"
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{err[-3000:]}"
