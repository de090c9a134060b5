"""Cross-node bytes per training step: ZeRO-3 (FSDP2) vs qwZ, hpZ, qgZ and ZeRO++, by the ledger.

Trains a small GPT for a few steps on emulated nodes (gloo, ranks grouped node-major) under
each configuration and prints, per collective (forward all-gather, backward all-gather,
gradient reduce-scatter), the bytes leaving the busiest node in one step, in units of M (the
model's size in bf16 bytes, 2 bytes per parameter, as in the paper's Table 1), next to the
paper's numbers. Scales and padding are included: the ledger counts the bytes the
collectives move (see qshard.comm.ledger, [Note: ledger cost model]).

Configurations: ZeRO-3 with an fp32 wire (what CPU training does by default) and with a
16-bit wire (the paper's fp16 baseline); each ZeRO++ feature alone (the other collectives on
a 16-bit wire); ZeRO++ (all three); ZeRO++ with INT4 weights.

    python benchmarks/comm_volume.py                 # 2x2 and 4x2
    python benchmarks/comm_volume.py --topologies 2x2 --out-md docs/results/comm_volume.md
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Report, add_report_args, at_least, topologies

PAPER = {  # the paper's Table 1 (ZeRO-3, ZeRO++) and its per-feature terms, in units of M
    "ZeRO-3 (fp32 wire)": None,
    "ZeRO-3 (16-bit wire)": (1.0, 1.0, 1.0),
    "qwZ": (0.5, 0.5, 1.0),  # without hpZ, the backward gather crosses nodes and is quantized
    "hpZ": (1.0, 0.0, 1.0),
    "qgZ": (1.0, 1.0, 0.25),
    "ZeRO++": (0.5, 0.0, 0.25),
    "ZeRO++ INT4 weights": None,
}

COLLECTIVES = (
    ("fwd_all_gather", "forward all-gather"),
    ("bwd_all_gather", "backward all-gather"),
    ("grad_reduce_scatter", "gradient reduce-scatter"),
)


def _configs():
    import torch

    from qshard.zeropp import ZeroPPConfig

    bf16 = torch.bfloat16
    return {
        "ZeRO-3 (fp32 wire)": ZeroPPConfig(),
        "ZeRO-3 (16-bit wire)": ZeroPPConfig(wire_dtype=bf16),
        "qwZ": ZeroPPConfig(qwz=True, wire_dtype=bf16),
        "hpZ": ZeroPPConfig(hpz=True, wire_dtype=bf16),
        "qgZ": ZeroPPConfig(qgz=True, wire_dtype=bf16),
        "ZeRO++": ZeroPPConfig(qwz=True, hpz=True, qgz=True, wire_dtype=bf16),
        "ZeRO++ INT4 weights": ZeroPPConfig(
            qwz=True, hpz=True, qgz=True, weight_bits=4, wire_dtype=bf16
        ),
    }


def _world(rank: int, world: int, rpn: int, model_kwargs: dict, steps: int) -> dict:
    import torch

    from qshard.comm import CommLedger, Topology, recording
    from qshard.train.model import GPT, GPTConfig
    from qshard.zeropp import shard

    topo = Topology(world_size=world, ranks_per_node=rpn)
    cfg = GPTConfig(**model_kwargs)
    out: dict = {}
    g = torch.Generator().manual_seed(rank)
    for name, zcfg in _configs().items():
        model = shard(GPT(cfg), topology=topo, config=zcfg)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        ledger = CommLedger(topo)
        for _ in range(steps):
            idx = torch.randint(0, cfg.vocab_size, (2, cfg.context + 1), generator=g)
            with recording(ledger):
                _, loss = model(idx[:, :-1], idx[:, 1:])
                loss.backward()
            opt.step()
            opt.zero_grad()
            ledger.step()
        ledger.reset()  # measure one steady-state step exactly (all ranks' shares summed)
        idx = torch.randint(0, cfg.vocab_size, (2, cfg.context + 1), generator=g)
        with recording(ledger):
            _, loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
        opt.zero_grad()
        s = ledger.gather_summary()
        out[name] = {tag: (s.inter(tag=tag), s.intra(tag=tag)) for tag, _ in COLLECTIVES} | {
            "events": dict(s.events)
        }
        out["params"] = sum(p.numel() for p in model.parameters())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--topologies", type=topologies, default="2x2,4x2", help="NODESxRANKS_PER_NODE list"
    )
    parser.add_argument("--n-embd", type=at_least(1), default=128)
    parser.add_argument("--n-layer", type=at_least(1), default=4)
    parser.add_argument(
        "--steps", type=at_least(0), default=1, help="warm-up steps before measuring"
    )
    add_report_args(parser)
    args = parser.parse_args(argv)
    one_node = [f"{n}x{r}" for n, r in args.topologies if n < 2]
    if one_node:
        parser.error(
            f"--topologies {','.join(one_node)}: one node has no cross-node bytes to count; "
            "pass 2 or more nodes (e.g. 2x2)"
        )

    from qshard.testing import run_world

    model_kwargs = dict(
        vocab_size=256, context=32, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd
    )
    report = Report("Cross-node communication volume per step: ZeRO-3 vs ZeRO++")
    summary_rows = []
    for nodes, rpn in args.topologies:
        topo = f"{nodes}x{rpn}"
        res = run_world(
            _world,
            nodes * rpn,
            args=(rpn, model_kwargs, args.steps),
            timeout_s=1200,
            env={"OMP_NUM_THREADS": "1"},
        )[0]
        params = res.pop("params")
        m = 2 * params  # model size in bf16 bytes
        base16 = sum(v[0] for k, v in res["ZeRO-3 (16-bit wire)"].items() if k != "events")
        base32 = sum(v[0] for k, v in res["ZeRO-3 (fp32 wire)"].items() if k != "events")
        # The paper's baseline priced as bandwidth-optimal rings: three collectives of the
        # 16-bit model, (P-1)/P of it across each node boundary. Our measured 16-bit baseline
        # differs both ways (its reduce-scatter is an all-to-all, more than a ring; its kept last
        # blocks skip their backward gathers), so a target is met only against both.
        p = nodes * rpn
        ring16 = 3 * (p - 1) / p * m
        rows = []
        for name, per in res.items():
            inter = [per[tag][0] / m for tag, _ in COLLECTIVES]
            total = sum(inter)
            paper = PAPER[name]
            rows.append(
                [
                    name,
                    *[round(v, 3) for v in inter],
                    round(total, 3),
                    "/".join(f"{v:g}" for v in paper) + f" = {sum(paper):g}" if paper else "-",
                    round(base32 / (total * m), 2),
                    round(base16 / (total * m), 2),
                    round(ring16 / (total * m), 2),
                ]
            )
            if name.startswith("ZeRO++"):
                ring, measured = ring16 / (total * m), base16 / (total * m)
                target = 6.0 if "INT4" in name else 4.0
                met = "yes" if min(ring, measured) >= target else "NO"
                summary_rows.append(
                    [topo, name, round(ring, 2), round(measured, 2), f">= {target:g}x", met]
                )
        report.table(
            f"{topo} ({nodes} nodes x {rpn} ranks), GPT of {params:,} parameters, "
            f"M = {m:,} bytes (bf16); cross-node bytes per node per step, in M",
            [
                "config",
                "fwd all-gather",
                "bwd all-gather",
                "grad reduce-scatter",
                "total",
                "paper (Table 1 terms)",
                "reduction vs fp32-wire ZeRO-3",
                "reduction vs 16-bit ZeRO-3 (measured)",
                "reduction vs 16-bit ZeRO-3 (ring model)",
            ],
            rows,
        )
    report.table(
        "Targets: >= 4x vs 16-bit-wire ZeRO-3 (ZeRO++), >= 6x with INT4 weights",
        [
            "topology",
            "config",
            "vs 16-bit ZeRO-3, ring model",
            "vs 16-bit ZeRO-3, measured",
            "target",
            "met (vs both)",
        ],
        summary_rows,
    )
    report.note(
        "Ring all-gather / reduce-scatter over P ranks send (P-1)/P of the tensor across each "
        "node boundary, so ZeRO-3's per-collective volume is (P-1)/P M, not M; qgZ's inter-node "
        "hop is a direct all-to-all among N nodes, (N-1)/N of the node's quantized partials. "
        "The ledger records each collective as the backend runs it: the measured 16-bit-wire "
        "baseline's reduce-scatter is an all-to-all (more bytes than a ring) and its kept last "
        "blocks are not gathered again in backward (fewer), so it can sit either side of the "
        "ring model; a target counts as met only against both (the smaller ratio)."
    )
    report.write(args.out_md)


if __name__ == "__main__":
    main()
