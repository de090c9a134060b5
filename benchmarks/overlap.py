"""Does communication overlap compute? Step time with and without explicit prefetching.

On CPU there are no streams: FSDP2 overlaps nothing unless the unshard is asynchronous and
the next block's all-gather is prefetched (``ZeroPPConfig.prefetch``). gloo then runs the
collective on its own threads while this rank computes the current block, and qwZ's
dequantization runs in the work handle's ``wait()`` (see qshard.zeropp._common,
[Note: deferred dequantization]). This benchmark trains a GPT on emulated nodes and reports
the median forward+backward time per step with prefetching off and on, for ZeRO-3 and ZeRO++,
measured side by side in one run (the configurations alternate step by step, so machine load
affects them alike).

    python benchmarks/overlap.py --topology 2x2 --steps 8

``--netsim RATES`` (needs root) asks the other overlap question on the emulated cluster of
``benchmarks/throughput.py`` (2 nodes x 2 ranks, tbf-shaped node links, the same GPT and batch
shape): does the deferred reduce-scatter (``ZeroPPConfig.overlap_reduce_scatter``, see
[Note: deferred qgZ] in qshard/zeropp/_overlap.py) hide its transfers behind backward? Per rate
it trains ``zero3-bf16`` (the 16-bit-wire ZeRO-3), each ZeRO++ feature alone and all three,
each with ``overlap_reduce_scatter`` off and on, and ZeRO++ with ``prefetch_depth=2``,
alternating the models step by step in one world so machine load falls on all of them alike; a step is barrier -> forward, backward, AdamW step, timed on
each rank, the slowest rank's time counts. Prints the median and min per model and rate.

    python benchmarks/overlap.py --netsim 100,400 --steps 6
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Report, add_report_args, topology


def _world(rank: int, world: int, rpn: int, model_kwargs: dict, steps: int) -> dict:
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from qshard.comm import Topology
    from qshard.train.model import GPT, GPTConfig
    from qshard.zeropp import ZeroPPConfig, shard

    topo = Topology(world_size=world, ranks_per_node=rpn)
    cfg = GPTConfig(**model_kwargs)
    variants = {}
    for name, base in (
        ("ZeRO-3", dict()),
        ("ZeRO++", dict(qwz=True, hpz=True, qgz=True, pipeline_stages=2)),
    ):
        for prefetch in (False, True):
            zcfg = ZeroPPConfig(prefetch=prefetch, record=False, **base)
            variants[(name, prefetch)] = shard(GPT(cfg), topology=topo, config=zcfg)
    g = torch.Generator().manual_seed(rank)
    times: dict = {k: [] for k in variants}
    for step in range(steps + 1):
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.context + 1), generator=g)
        for key, model in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            _, loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            dist.barrier()
            if step > 0:  # the first step pays lazy initialization
                times[key].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    return {k: statistics.median(v) for k, v in times.items()}


# The --netsim models: ZeroPPConfig keywords, and the model each is compared with (or None).
NETSIM_MODELS: dict[str, tuple[dict, str | None]] = {
    "zero3-bf16": ({"wire_dtype": "bf16"}, None),
    "qwz sync": ({"qwz": True, "overlap_reduce_scatter": False}, None),
    "qwz overlap": ({"qwz": True}, "qwz sync"),
    "hpz sync": ({"hpz": True, "overlap_reduce_scatter": False}, None),
    "hpz overlap": ({"hpz": True}, "hpz sync"),
    "qgz sync": ({"qgz": True, "overlap_reduce_scatter": False}, None),
    "qgz overlap": ({"qgz": True}, "qgz sync"),
    "all sync": ({"qwz": True, "hpz": True, "qgz": True, "overlap_reduce_scatter": False}, None),
    "all overlap": ({"qwz": True, "hpz": True, "qgz": True}, "all sync"),
    "all overlap depth 2": (
        {"qwz": True, "hpz": True, "qgz": True, "prefetch_depth": 2},
        "all overlap",
    ),
}


def _netsim_worker(args: argparse.Namespace) -> int:
    import json
    import statistics
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from netsim.link import set_link_rate
    from qshard.comm import Topology
    from qshard.train.model import GPT, GPTConfig
    from qshard.zeropp import ZeroPPConfig, shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=3000))
    rank = dist.get_rank()
    topo = Topology.from_env()
    cfg = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, context=128, seed=0)
    models, opts = {}, {}
    for name, (kw, _) in NETSIM_MODELS.items():
        kw = dict(kw)
        if kw.get("wire_dtype") == "bf16":
            kw["wire_dtype"] = torch.bfloat16
        models[name] = shard(GPT(cfg), topology=topo, config=ZeroPPConfig(**kw))
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(rank)
    out: dict = {}
    for rate in [int(r) for r in args.netsim.split(",")]:
        set_link_rate(rate)
        times: dict = {k: [] for k in models}
        for step in range(args.steps + 2):  # two untimed warm-up steps
            idx = torch.randint(0, cfg.vocab_size, (2, cfg.context + 1), generator=g)
            for name, model in models.items():
                dist.barrier()
                t0 = time.perf_counter()
                _, loss = model(idx[:, :-1], idx[:, 1:])
                loss.backward()
                opts[name].step()
                opts[name].zero_grad(set_to_none=True)
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if step >= 2:
                    times[name].append(t.item())
        out[str(rate)] = {k: [statistics.median(v), min(v)] for k, v in times.items()}
        if rank == 0:
            print(f"[overlap] {rate} Mbit/s: {out[str(rate)]}", flush=True)
    if rank == 0:
        with open(args.result_json, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _netsim(args: argparse.Namespace, argv: list[str]) -> None:
    from netsim.cluster import needs_root, run_in_cluster

    if needs_root("overlap --netsim") is not None:
        sys.exit(77)
    run = run_in_cluster(
        __file__,
        argv,
        nodes=2,
        ranks_per_node=2,
        rate_mbit=int(args.netsim.split(",")[0]),
        rank_timeout_s=3000,
        prefix="qov",
    )
    if run.rc != 0 or run.data is None:
        sys.exit(f"overlap --netsim: the emulated cluster run failed with status {run.rc}")
    report = Report("Overlap of the reduce-scatter with backward (emulated 2 nodes x 2 ranks)")
    report.note(
        f"GPT {args.n_layer} layers, width {args.n_embd}, context 128, 2 sequences per rank, "
        f"torch AdamW; models alternate step by step; {args.steps} timed steps after 2 warm-up "
        f"steps per rate; host load average {run.load[0]:.1f} at the start, {run.load[1]:.1f} "
        "at the end (the machine is shared: times are indicative, ratios are side by side)."
    )
    rows = []
    for rate, res in run.data.items():
        base = res["zero3-bf16"][0]
        for name, (med, mn) in res.items():
            ref = NETSIM_MODELS[name][1] if name in NETSIM_MODELS else None
            gain = f"{res[ref][0] / med:.2f}x ({ref})" if ref in res else "-"
            rows.append([rate, name, f"{med:.3f}", f"{mn:.3f}", f"{base / med:.2f}x", gain])
    report.table(
        "Step time (s, slowest rank)",
        ["Mbit/s", "model", "median s", "min s", "vs zero3-bf16", "speed-up vs"],
        rows,
    )
    report.write(args.out_md)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", type=topology, default="2x2", help="NODESxRANKS_PER_NODE")
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--netsim", metavar="RATES", help="Mbit/s list: qgZ overlap on the emulated cluster"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-json", help=argparse.SUPPRESS)
    add_report_args(parser)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1 (the medians need a timed step); got {args.steps}")
    if args.netsim and args.worker:
        sys.exit(_netsim_worker(args))
    if args.netsim:
        _netsim(args, argv)
        return

    from qshard.testing import run_world

    nodes, rpn = args.topology
    model_kwargs = dict(
        vocab_size=256, context=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd
    )
    load0 = os.getloadavg()[0]  # the host's, so a reader can judge the times
    res = run_world(
        _world,
        nodes * rpn,
        args=(rpn, model_kwargs, args.steps),
        timeout_s=1800,
        env={"OMP_NUM_THREADS": "1"},
    )[0]
    load1 = os.getloadavg()[0]
    report = Report("Overlap of communication with compute (explicit prefetch, async unshard)")
    rows = []
    for name in ("ZeRO-3", "ZeRO++"):
        off, on = res[(name, False)], res[(name, True)]
        rows.append([name, round(off * 1e3, 1), round(on * 1e3, 1), round(off / on, 3)])
    report.table(
        f"{nodes}x{rpn}, GPT n_layer={args.n_layer} n_embd={args.n_embd}: median fwd+bwd "
        f"ms per step over {args.steps} steps (rank 0)",
        ["config", "no prefetch (ms)", "prefetch + async (ms)", "speedup"],
        rows,
    )
    report.note(
        f"Host load average {load0:.1f} at the start, {load1:.1f} at the end (the machine is "
        "shared: times are indicative, the configurations alternate step by step)."
    )
    report.write(args.out_md)


if __name__ == "__main__":
    main()
