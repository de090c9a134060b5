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
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Report, add_report_args


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="2x2", help="NODESxRANKS_PER_NODE")
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    add_report_args(parser)
    args = parser.parse_args(argv)

    from qshard.testing import run_world

    nodes, rpn = (int(v) for v in args.topology.split("x"))
    model_kwargs = dict(
        vocab_size=256, context=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd
    )
    res = run_world(
        _world,
        nodes * rpn,
        args=(rpn, model_kwargs, args.steps),
        timeout_s=1800,
        env={"OMP_NUM_THREADS": "1"},
    )[0]
    report = Report("Overlap of communication with compute (explicit prefetch, async unshard)")
    rows = []
    for name in ("ZeRO-3", "ZeRO++"):
        off, on = res[(name, False)], res[(name, True)]
        rows.append([name, round(off * 1e3, 1), round(on * 1e3, 1), round(off / on, 3)])
    report.table(
        f"{args.topology}, GPT n_layer={args.n_layer} n_embd={args.n_embd}: median fwd+bwd "
        f"ms per step over {args.steps} steps (rank 0)",
        ["config", "no prefetch (ms)", "prefetch + async (ms)", "speedup"],
        rows,
    )
    report.write(args.out_md)


if __name__ == "__main__":
    main()
