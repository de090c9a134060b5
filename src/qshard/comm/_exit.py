"""Let collective threads release their tensors before the interpreter shuts down.

[Note: exit after collectives] A collective's ``Work`` holds references to the tensors it
reads and writes. ProcessGroupGloo runs every collective on its own worker threads, and the
worker often drops the last reference to a finished ``Work`` after the Python caller has
already dropped its own: destroying it then frees the tensors' Python objects, which needs
the GIL. If the main thread keeps the GIL from there until the interpreter is finalizing
(the last collective of a script, then a few lines of Python and the end of the script),
CPython makes the worker exit as it takes the GIL; the exit unwinds through a ``noexcept``
C++ frame and the process dies with ``terminate called without an active exception``
(SIGABRT): a job that trained and saved everything is reported failed by ``torchrun``.
The process groups stay alive to the end whenever anything still references them (FSDP2's
meshes, a :class:`~qshard.comm.Topology`), ``destroy_process_group()`` notwithstanding.

The atexit handler here runs before finalization starts and releases the GIL a few times
(a few milliseconds each), so a worker waiting for it finishes its work first. It covers
collectives that completed; one still in flight at exit (an ``async_op=True`` work never
waited on) can still end the same way. Importing :mod:`qshard.comm` installs it.
"""

from __future__ import annotations

import atexit
import time

__all__: list[str] = []

# 10 x 5 ms: on a loaded 2-core machine a woken thread may wait a scheduler quantum or two.
_ROUNDS = 10
_PAUSE_S = 0.005


def _yield_to_collective_threads() -> None:
    import torch.distributed as dist

    if not dist.is_available():
        return
    for _ in range(_ROUNDS):
        time.sleep(_PAUSE_S)  # releases the GIL: see [Note: exit after collectives]


atexit.register(_yield_to_collective_threads)
