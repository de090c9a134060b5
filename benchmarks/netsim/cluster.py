"""The launcher side of a benchmark that runs inside the emulated cluster: start ``netsim.sh``
with the benchmark script itself as every rank's command (``--worker --result-json FILE``), wait,
and hand back what rank 0 wrote.

Only the standard library; importable from any script under ``benchmarks/`` as
``from netsim.cluster import ...`` (``sys.path`` holds the script's folder).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ClusterRun", "needs_root", "run_in_cluster"]

NETSIM = Path(__file__).resolve().parent / "netsim.sh"
BENCHMARKS = NETSIM.parent.parent


def needs_root(name: str) -> int | None:
    """None as root; otherwise print why ``name`` cannot run and return its exit status (77)."""
    if os.geteuid() == 0:
        return None
    print(
        f"{name}: needs root to build the emulated cluster (network namespaces, tc); run as root",
        file=sys.stderr,
    )
    return 77


@dataclass(frozen=True, slots=True)
class ClusterRun:
    """What one launch gave: the cluster's exit status, rank 0's JSON (None if it wrote none),
    and the host load average at the start and at the end."""

    rc: int
    data: dict | None
    load: tuple[float, float]


def run_in_cluster(
    script: str | os.PathLike[str],
    argv: list[str],
    *,
    nodes: int,
    ranks_per_node: int,
    rate_mbit: int,
    rank_timeout_s: int,
    prefix: str,
) -> ClusterRun:
    """Run ``python script *argv --worker --result-json FILE`` on every rank of a ``nodes`` x
    ``ranks_per_node`` cluster whose links start at ``rate_mbit``; ``prefix`` names its
    namespaces (kept short: interface names are at most 15 characters). The workers find
    ``benchmarks/`` on ``PYTHONPATH`` and run with ``OMP_NUM_THREADS=1`` unless it is set."""
    fd, result_json = tempfile.mkstemp(prefix=f"qshard-{prefix}", suffix=".json")
    os.close(fd)
    cmd = [
        "bash", str(NETSIM),
        "-p", f"{prefix}{os.getpid() % 100000}-",
        "-n", str(nodes), "-r", str(ranks_per_node),
        "-b", str(rate_mbit), "-t", str(rank_timeout_s),
        "run", "--",
        sys.executable, str(Path(script).resolve()), *argv,
        "--worker", "--result-json", result_json,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCHMARKS), env.get("PYTHONPATH")]))
    load_start = os.getloadavg()[0]
    try:
        rc = subprocess.run(cmd, env=env).returncode
        try:
            with open(result_json) as f:
                data = json.load(f)
        except (OSError, ValueError):  # no file, or rank 0 died before writing it
            data = None
    finally:
        if os.path.exists(result_json):
            os.unlink(result_json)
    return ClusterRun(rc=rc, data=data, load=(load_start, os.getloadavg()[0]))
