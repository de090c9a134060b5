"""Check an emulated cluster end to end: gloo collectives across the shaped links, with the bytes
each node's link carried next to the bandwidth-optimal model, and times next to bytes / rate.

Run one process per rank under netsim.sh (it sets the torchrun environment):

    benchmarks/netsim/netsim.sh -n 2 -r 2 -b 100 run -- python benchmarks/netsim/check.py

Model (node-major ranks, P ranks, N nodes, R ranks per node, S bytes per rank):
- ring all-gather: each node boundary is crossed by one ring edge per direction, and that edge
  carries P-1 chunks, so every node sends (P-1)*S;
- all-gather inside a node (a per-node subgroup): 0 bytes on the link;
- all-to-all (direct exchange): every rank sends (P-R)/P of its input off-node, a node R times that;
- ring all-reduce of S bytes per rank: 2*(P-1)*S/P per node. gloo's reduce-scatter moves the same
  bytes (it is an all-reduce keeping a slice), twice a ring reduce-scatter's (P-1)*S/P.
int8 moves exactly a quarter of fp32. Byte counts are deterministic; times depend on the host load.
Exit status 1 if a node's measured bytes differ from the model by more than ``--tolerance``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from _common import Report
from netsim.link import NodeLinkMeter, set_link_rate, wire_overhead
from qshard.comm import Topology, duplex

warnings.filterwarnings("ignore", category=FutureWarning)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mib-per-rank", type=float, default=1.0, help="fp32 payload per rank (MiB)")
    p.add_argument("--reps", type=int, default=3, help="timed calls per op (after one warm-up)")
    p.add_argument("--tolerance", type=float, default=0.03, help="relative byte tolerance")
    p.add_argument("--json", action="store_true", help="print one 'NETSIM_CHECK {...}' line")
    p.add_argument(
        "--rates", default="", help="re-shape to each of these Mbit/s in turn (e.g. 100,400)"
    )
    p.add_argument("--out-md", metavar="FILE", help="also write the tables as markdown (rank 0)")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    rpn = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = world // rpn
    rate = int(os.environ.get("NETSIM_RATE_MBIT", "0"))  # as launched
    node_group, _ = dist.new_subgroups(group_size=rpn)  # node-major: ranks n*rpn .. n*rpn+rpn-1
    dist.barrier()
    if rank == 0:  # every rank is up: a timeout after this line is a hang, not a slow start
        print("NETSIM_CHECK_READY", flush=True)

    numel = int(args.mib_per_rank * 2**20) // 4
    numel -= numel % world
    fp32 = torch.full((numel,), float(rank))
    int8 = torch.full((numel,), rank, dtype=torch.int8)

    def gather(x: torch.Tensor, group=None) -> torch.Tensor:
        n = dist.get_world_size(group)
        out = torch.empty(n * x.numel(), dtype=x.dtype)
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    def reduce_scatter(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.numel() // world, dtype=x.dtype)
        dist.reduce_scatter_tensor(out, x)
        return out

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y)
        return y

    def all_to_all(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return out

    # The same exchanges among a rank's peers (one rank per node), as gloo runs them and as
    # qshard's duplex path does: each direction of a pair on a group of its own (a 2-rank
    # group; larger ones fall back to the collective). [Note: gloo exchanges are half duplex]
    topo = Topology(world_size=world, ranks_per_node=rpn)
    topo.init_groups()
    peers, twin = topo.inter_node_group, topo.twin_group("inter")

    def peer_gather(x: torch.Tensor, use_twin: bool) -> torch.Tensor:
        out = torch.empty(nodes * x.numel(), dtype=x.dtype)
        duplex.all_gather_single(out, x, peers, twin=twin if use_twin else None)
        return out

    def peer_all_to_all(x: torch.Tensor, use_twin: bool) -> torch.Tensor:
        out = torch.empty_like(x)
        duplex.all_to_all_single(out, x, peers, twin=twin if use_twin else None)
        return out

    chunk = numel * 4
    ops = {
        "all_gather fp32, world": (lambda: gather(fp32), (world - 1) * chunk),
        "all_gather int8, world": (lambda: gather(int8), (world - 1) * chunk // 4),
        "all_gather fp32, inside node": (lambda: gather(fp32, node_group), 0),
        "all_to_all fp32, world": (lambda: all_to_all(fp32), rpn * (world - rpn) * chunk // world),
        # gloo has no ring reduce-scatter: it all-reduces and keeps a slice, so it moves twice the
        # ring model's bytes (a cost model for FSDP2 on gloo must count it as an all-reduce).
        "reduce_scatter fp32, world (gloo)": (
            lambda: reduce_scatter(fp32),
            2 * (world - 1) * chunk // world,
        ),
        "all_reduce fp32, world": (lambda: all_reduce(fp32), 2 * (world - 1) * chunk // world),
        "all_gather fp32, peers (gloo)": (
            lambda: peer_gather(fp32, False),
            rpn * (nodes - 1) * chunk,
        ),
        "all_gather fp32, peers (duplex)": (
            lambda: peer_gather(fp32, True),
            rpn * (nodes - 1) * chunk,
        ),
        "all_to_all fp32, peers (gloo)": (
            lambda: peer_all_to_all(fp32, False),
            rpn * (nodes - 1) * (chunk // nodes),
        ),
        "all_to_all fp32, peers (duplex)": (
            lambda: peer_all_to_all(fp32, True),
            rpn * (nodes - 1) * (chunk // nodes),
        ),
    }
    # Correctness first: every rank holds every rank's value in the right place.
    got = gather(fp32).view(world, -1)[:, 0]
    assert torch.equal(got, torch.arange(world, dtype=torch.float32)), got
    got8 = gather(int8).view(world, -1)[:, 0]
    assert torch.equal(got8, torch.arange(world, dtype=torch.int8)), got8
    for use_twin in (False, True):
        got = peer_gather(fp32, use_twin).view(nodes, -1)[:, 0]
        assert torch.equal(got, torch.tensor(topo.peer_ranks(topo.local_rank), dtype=torch.float32))

    meter = NodeLinkMeter()
    rates = [int(r) for r in args.rates.split(",") if r.strip()] or [rate]
    rep = Report("Emulated cluster check: gloo collectives across shaped links")
    results, ok = {}, True
    for rate in rates:
        if args.rates:
            set_link_rate(rate)
        rows, results[str(rate)] = [], {}
        for name, (fn, model_tx) in ops.items():
            fn()  # warm-up: connections and buffers
            times = []
            meter.start()
            for _ in range(args.reps):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's time is the op's
                times.append(dt.item())
            per_node = meter.stop()
            tx = [b.tx / args.reps for b in per_node]
            # Barriers and the time reduction add a few hundred bytes per call: allow 16 KiB.
            slack = args.tolerance * model_tx + 16384
            good = all(abs(t - model_tx) <= slack for t in tx)
            ok &= good
            pred = model_tx * wire_overhead() * 8 / (rate * 1e6) if rate else float("nan")
            rows.append(
                [
                    name,
                    f"{model_tx / 2**20:.3f}",
                    " / ".join(f"{t / 2**20:.3f}" for t in tx),
                    f"{max(tx) / model_tx:.4f}" if model_tx else f"{max(tx):.0f} B",
                    "yes" if good else "NO",
                    f"{statistics.median(times):.4f}",
                    f"{min(times):.4f}",
                    f"{pred:.4f}",
                ]
            )
            results[str(rate)][name] = {
                "model_tx": model_tx,
                "node_tx": tx,
                "times": times,
                "bytes_ok": good,
            }
        if rank == 0:
            rep.table(
                f"{nodes} nodes x {rpn} ranks, {rate or 'unshaped'} Mbit/s, "
                f"{args.mib_per_rank} MiB fp32 per rank, {args.reps} calls per op",
                [
                    "op",
                    "model tx/node (MiB)",
                    "measured tx per node (MiB)",
                    "measured/model",
                    "bytes ok",
                    "median s",
                    "min s",
                    "bytes x (MTU+14)/(MTU-52) / rate, s",
                ],
                rows,
            )
    if rank == 0:
        rep.note(
            "Launched as one rank per process by `benchmarks/netsim/netsim.sh -n "
            f"{nodes} -r {rpn} -b {rates[0]} run -- python benchmarks/netsim/check.py ...`. "
            "Times are the slowest rank's, per call; bytes are each node's eth0 tx counter "
            "(read after a barrier) per call. gloo's reduce-scatter is an all-reduce that keeps a "
            "slice: its model here is the all-reduce's bytes, twice a ring reduce-scatter's. "
            "'peers': the ranks of one local rank, one per node; '(duplex)': qshard.comm.duplex, "
            "which sends the two directions of a 2-rank exchange on two groups (gloo takes "
            "turns on one connection; with more than 2 nodes it is the collective again)."
        )
        rep.write(args.out_md)
        if args.json:
            print("NETSIM_CHECK " + json.dumps({"ok": ok, "rates": results}))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
