"""The emulated cluster (benchmarks/netsim): a real 2-node x 2-rank gloo world across shaped links.

Runs only where it can (root, network namespaces, veth, bridge, tbf); skips with the reason
otherwise. Asserts on bytes, which are deterministic, never on time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NETSIM = ROOT / "benchmarks" / "netsim" / "netsim.sh"
CHECK = ROOT / "benchmarks" / "netsim" / "check.py"
EXIT_UNAVAILABLE = 77


def _netns_usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, unshare --uts)"
    for tool in ("ip", "tc", "unshare", "timeout"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed"
    return None


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        ["bash", str(NETSIM), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def test_usage_errors_name_the_fix():
    bad = _run("-n", "0", "run", "--", "true")
    assert bad.returncode == 2 and "-n NODES must be 1..200" in bad.stderr
    bad = _run("-p", "Bad_Prefix", "up")
    assert bad.returncode == 2 and "-p PREFIX must match" in bad.stderr
    bad = _run("up")
    assert bad.returncode == 2 and "give -p PREFIX" in bad.stderr
    # help is asked for, not a usage error: the text on stdout, exit 0 (it was exit 2, and
    # --help an "illegal option")
    for flag in ("-h", "--help"):
        res = _run(flag)
        assert res.returncode == 0 and "Usage:" in res.stdout and not res.stderr, flag
    bad = _run("-x")
    assert bad.returncode == 2 and "Usage:" in bad.stderr


def test_rank_failure_propagates_and_tears_down():
    reason = _netns_usable()
    if reason:
        pytest.skip(reason)
    prefix = f"qstf{os.getpid() % 10000}-"
    res = _run(
        "-p", prefix, "-n", "2", "-r", "2", "-b", "100", "run", "--",
        "sh", "-c", 'echo "$RANK $NODE_RANK $LOCAL_RANK $(hostname)"; [ "$RANK" != 3 ] || { sleep 2; exit 7; }; sleep 30',
    )  # fmt: skip
    # Rank 3 fails after the others have printed (an immediate exit races their echo).
    if res.returncode == EXIT_UNAVAILABLE:
        pytest.skip(res.stderr.strip())
    assert res.returncode == 7, res.stderr
    assert "rank 3 exited with status 7" in res.stderr
    lines = sorted(line for line in res.stdout.splitlines() if line[:1].isdigit())
    assert lines == [
        f"0 0 0 {prefix}node0",
        f"1 0 1 {prefix}node0",
        f"2 1 0 {prefix}node1",
        f"3 1 1 {prefix}node1",
    ]
    assert _namespaces(prefix) == []
    assert not Path(f"/etc/netns/{prefix}n0").exists()


REPS = 2  # timed calls per collective in the check


def test_gloo_bytes_across_the_link_match_the_ring_model():
    reason = _netns_usable()
    if reason:
        pytest.skip(reason)
    prefix = f"qstc{os.getpid() % 10000}-"
    res = _run(
        "-p", prefix, "-n", "2", "-r", "2", "-b", "400", "-t", "150", "run", "--",
        sys.executable, str(CHECK), "--mib-per-rank", "1", "--reps", str(REPS), "--json",
        timeout=170,
    )  # fmt: skip
    if res.returncode == EXIT_UNAVAILABLE:
        pytest.skip(res.stderr.strip())
    if res.returncode == 124 and "NETSIM_CHECK_READY" not in res.stdout:
        # Four processes importing torch did not all start within the budget (a host loaded by
        # other jobs). A hang after start-up is a failure; this is not a verdict on netsim.
        pytest.skip("the 4 ranks did not start within 150 s on this loaded host")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("NETSIM_CHECK "))
    ops = json.loads(line.removeprefix("NETSIM_CHECK "))["rates"]["400"]
    chunk = (2**20 // 4) * 4

    def most(model_tx: float) -> float:
        # headers add < 1%, barriers a few hundred bytes per call, and a TCP retransmission of
        # one segment (up to 64 KiB with segmentation offload) may land in any measurement:
        # spread over the calls. Seen once in a clean-clone CI run: the reduce-scatter at
        # 1.5409 chunks per call against 1.5086-1.5092 in six reruns (not confirmed as a
        # retransmission: the namespaces' TCP counters are not read).
        return model_tx * 1.01 + 16384 + 65536 / REPS

    fp32 = ops["all_gather fp32, world"]
    int8 = ops["all_gather int8, world"]
    intra = ops["all_gather fp32, inside node"]
    a2a = ops["all_to_all fp32, world"]
    assert fp32["model_tx"] == 3 * chunk
    for node_tx in fp32["node_tx"]:  # ring: 3 chunks leave each node; headers add < 1%
        assert 3 * chunk <= node_tx <= most(3 * chunk)
    for f, i in zip(fp32["node_tx"], int8["node_tx"]):  # int8 is exactly a quarter on the wire
        assert 3.9 <= f / i <= 4.05
    for node_tx in intra["node_tx"]:  # inside a node: only the barriers' few hundred bytes
        assert node_tx < 16384
    for node_tx in a2a["node_tx"]:  # all-to-all: half of each rank's input leaves its node
        assert chunk <= node_tx <= most(chunk)
    # gloo's reduce-scatter is an all-reduce keeping a slice: twice a ring reduce-scatter's bytes,
    # the same as the all-reduce. A cost model for FSDP2 on gloo has to know this.
    rs, ar = ops["reduce_scatter fp32, world (gloo)"], ops["all_reduce fp32, world"]
    for rs_tx, ar_tx in zip(rs["node_tx"], ar["node_tx"]):
        assert 1.5 * chunk <= rs_tx <= most(1.5 * chunk)
        assert 1.5 * chunk <= ar_tx <= most(1.5 * chunk)
    assert _namespaces(prefix) == []
