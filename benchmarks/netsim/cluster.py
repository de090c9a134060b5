"""The launcher side of a benchmark that runs inside the emulated cluster: start ``netsim.sh``
with the benchmark script itself as every rank's command (``--worker --result-json FILE``), wait,
and hand back what rank 0 wrote.

Only the standard library; importable from any script under ``benchmarks/`` as
``from netsim.cluster import ...`` (``sys.path`` holds the script's folder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ClusterRun",
    "add_cluster_args",
    "check_cluster_args",
    "needs_root",
    "run_cluster_args",
    "run_in_cluster",
]

NETSIM = Path(__file__).resolve().parent / "netsim.sh"
BENCHMARKS = NETSIM.parent.parent


def add_cluster_args(p: argparse.ArgumentParser, *, default_variants: tuple[str, ...]) -> None:
    """The options every training benchmark in the emulated cluster shares (the same GPT,
    batches, cluster and timing), so their tables compare row for row."""
    p.add_argument("--rates", default="100,200,400", help="link rates in Mbit/s, comma separated")
    p.add_argument("--variants", default=",".join(default_variants), help="comma separated")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant and rate")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch-per-rank", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rank-timeout", type=int, default=3000, help="seconds, per rank")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-json", help=argparse.SUPPRESS)


def check_cluster_args(
    p: argparse.ArgumentParser, args: argparse.Namespace, *, variants: tuple[str, ...]
) -> None:
    """Validate :func:`add_cluster_args`' options; sets ``args.rate_list`` and
    ``args.variant_list``."""
    try:
        args.rate_list = [int(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        p.error(f"--rates must list whole Mbit/s values, e.g. 100,200,400; got {args.rates!r}")
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variant_list if v not in variants]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(variants)}")
    if not args.variant_list:
        p.error(f"--variants is empty; choose from {', '.join(variants)}")
    if not args.rate_list or any(r < 1 for r in args.rate_list):
        p.error("--rates must list positive Mbit/s values, e.g. 100,200,400")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.nodes < 1 or args.ranks_per_node < 1 or args.batch_per_rank < 1:
        p.error("--nodes, --ranks-per-node and --batch-per-rank must be >= 1")
    if args.n_embd % args.n_head:
        p.error(f"--n-embd must be divisible by --n-head; got {args.n_embd} and {args.n_head}")


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


def run_cluster_args(
    script: str | os.PathLike[str], argv: list[str], args, *, prefix: str
) -> ClusterRun:
    """:func:`run_in_cluster` with the cluster of :func:`add_cluster_args`' options (``--nodes``,
    ``--ranks-per-node``, the first of ``--rates``, ``--rank-timeout``)."""
    return run_in_cluster(
        script,
        argv,
        nodes=args.nodes,
        ranks_per_node=args.ranks_per_node,
        rate_mbit=args.rate_list[0],
        rank_timeout_s=args.rank_timeout,
        prefix=prefix,
    )
