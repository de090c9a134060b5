"""CPU cost of ZeRO++'s passes around its transfers, fused vs the composition they replace.

On the CPU every byte qwZ and qgZ quantize or dequantize is CPU time the ranks' compute does not
get (the emulated cluster runs 4 ranks on 2 cores, so a step is bound by the CPU it spends:
docs/zeropp.md). This times, on one thread and one process, the work one rank does per step
around the transfers of the throughput GPT (``benchmarks/throughput.py``'s model, its FSDP units
sharded over ``--nodes`` x ``--ranks-per-node`` ranks as FSDP2 shards them: dim 0 chunked, the
last chunk padded), each pass two ways in the same run:

- ``composition``: the passes as they ran before ``RowCodec``'s fused methods (see
  [Note: fused wire rows] in ``qshard/zeropp/_wire.py``): qgZ's ``reorder_slices`` copy then
  ``encode``; ``decode`` of the received rows, ``sum_rows``, then ``encode`` of the node
  partials; ``decode`` and ``sum_rows`` of the last hop; qwZ's zero-padded copy of the shard
  then ``encode``; ``decode`` of the gathered rows then the copy of each parameter out of them;
- ``fused``: ``encode_slots``, ``reduce_encode``, ``reduce``, ``encode_slots``,
  ``decode_slots``: the same bytes and values (checked here, bit for bit, before timing).

Received rows are what the peers would send: the same encoder applied to other ranks' data.
Times are medians of ``--repeat`` calls per unit, summed over the model's units (qwZ's gather
runs once a step with hpZ: the backward's gather stays inside the node, unquantized).

    python benchmarks/wire_passes.py --out-md docs/results/wire_passes.md
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Report, add_report_args, time_call


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeat", type=int, default=30, help="timed calls per pass and unit")
    add_report_args(p)
    args = p.parse_args(argv)
    for name in ("n_layer", "n_embd", "nodes", "ranks_per_node", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def _units(args: argparse.Namespace) -> list[tuple[str, list[int]]]:
    """Per FSDP unit (each block, then the root's own parameters), one rank's padded shard size
    of every parameter: FSDP2 chunks dim 0 over the world and pads the last chunk."""
    from qshard.train.model import GPT, GPTConfig

    world = args.nodes * args.ranks_per_node
    model = GPT(
        GPTConfig(
            n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, context=args.context
        )
    )

    def shard_sizes(params) -> list[int]:
        out = []
        for p in params:
            rows = -(-p.shape[0] // world) if p.dim() else 1
            out.append(rows * (p[0].numel() if p.dim() else 1))
        return out

    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    units = [(f"block {i}", shard_sizes(b.parameters())) for i, b in enumerate(model.blocks)]
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    units.append(("root", shard_sizes(root)))
    return units


def _passes(sizes: list[int], args: argparse.Namespace):
    """The five passes of one unit, (name, composition, fused), each a zero-argument call; the
    fused results are checked against the composition's first."""
    import torch

    from qshard.zeropp._common import sum_rows
    from qshard.zeropp._wire import RowCodec
    from qshard.zeropp.all_gather import _padded_layout
    from qshard.zeropp.reduce_scatter import _stage_slots, reorder_slices

    nodes, per_node, bs = args.nodes, args.ranks_per_node, args.block_size
    world = nodes * per_node
    g = torch.Generator().manual_seed(0)
    size = sum(sizes)  # the reduce-scatter's output per rank = the all-gather's input
    unit = 4 * bs  # qgZ pads each slot to whole 4-block rows ([Note: 4-block rows])
    padded = -(-size // unit) * unit
    q4, q8 = RowCodec(bits=4, block_size=bs), RowCodec(bits=8, block_size=bs)
    grads = torch.randn(world * size, generator=g)
    slots = _stage_slots(nodes, per_node, 1, size, padded)[0]
    m1 = nodes * padded

    def hop1_old():
        x = reorder_slices(grads.view(world, size), nodes, per_node, 1, padded)
        return q4.encode(x[0].view(per_node, m1))

    def hop1_new():
        return q4.encode_slots(grads, slots, per_node)

    # hop 1 delivers one row from every local peer; hop 2 one row from every node
    recv1 = torch.cat([q4.encode(torch.randn(1, m1, generator=g)) for _ in range(per_node)])
    recv2 = torch.cat([q4.encode(torch.randn(1, padded, generator=g)) for _ in range(nodes)])
    dst = torch.empty(padded)

    def mid_old():
        return q4.encode(sum_rows(q4.decode(recv1, m1)).view(nodes, padded))

    def mid_new():
        return q4.reduce_encode(recv1, m1, nodes)

    def last_old():
        return sum_rows(q4.decode(recv2, padded), out=dst).clone()

    def last_new():
        return q4.reduce(recv2, padded, out=dst).clone()

    row_len, qslots = _padded_layout(sizes, bs)
    shard = torch.randn(size, generator=g)

    def qwz_q_old():
        row, pos = torch.zeros(1, row_len), 0
        for start, length, pad in qslots:
            row[0, pos : pos + length].copy_(shard[start : start + length])
            pos += pad
        return q8.encode(row)

    def qwz_q_new():
        return q8.encode_slots(shard, qslots, 1)

    gathered = torch.cat([q8.encode_slots(shard * (r + 1), qslots, 1) for r in range(world)])
    out = torch.empty(world, size)

    def qwz_dq_old():
        values, pos = q8.decode(gathered, row_len), 0
        for start, length, pad in qslots:
            out[:, start : start + length].copy_(values[:, pos : pos + length])
            pos += pad
        return out.clone()

    rows = list(out.unbind(0))

    def qwz_dq_new():
        q8.decode_slots(gathered, row_len, rows, qslots)
        return out.clone()

    passes = [
        ("qgZ hop-1 quantize (reorder + encode)", hop1_old, hop1_new),
        ("qgZ middle hop (dequantize, sum, requantize)", mid_old, mid_new),
        ("qgZ last hop (dequantize, sum)", last_old, last_new),
        ("qwZ quantize (pad + encode)", qwz_q_old, qwz_q_new),
        ("qwZ dequantize (decode + copy out)", qwz_dq_old, qwz_dq_new),
    ]
    for name, old, new in passes:
        a, b = old(), new()
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            raise AssertionError(f"{name}: the fused pass differs from the composition")
    return passes


def main(argv: list[str] | None = None) -> int:
    import torch

    args = _args(argv)
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    units = _units(args)
    totals: dict[str, list[float]] = {}
    for _, sizes in units:
        for name, old, new in _passes(sizes, args):
            t_old = time_call(old, repeat=args.repeat, warmup=2).median
            t_new = time_call(new, repeat=args.repeat, warmup=2).median
            acc = totals.setdefault(name, [0.0, 0.0])
            acc[0] += t_old
            acc[1] += t_new
    load1 = os.getloadavg()[0]
    rows = [
        [n, f"{o * 1e3:.3f}", f"{f * 1e3:.3f}", f"{o / f:.2f}x"] for n, (o, f) in totals.items()
    ]
    old_all = sum(o for o, _ in totals.values())
    new_all = sum(f for _, f in totals.values())
    rows.append(
        [
            "all five, per rank and step",
            f"{old_all * 1e3:.3f}",
            f"{new_all * 1e3:.3f}",
            f"{old_all / new_all:.2f}x",
        ]
    )
    shards = sum(sum(s) for _, s in units)
    rep = Report("ZeRO++'s passes around its transfers: fused vs the composition")
    rep.note(
        f"The throughput GPT ({args.n_layer} layers, width {args.n_embd}, context {args.context}): "
        f"{len(units)} FSDP units, {shards:,} elements per rank's shards, sharded over "
        f"{args.nodes} nodes x {args.ranks_per_node} ranks; qgZ INT4 and qwZ INT8, blocks of "
        f"{args.block_size}; one thread; medians of {args.repeat} calls per unit and pass, summed "
        f"over the units (ms per rank and step: qwZ's gather once, as with hpZ). Same bytes and "
        f"values both ways (checked). Host load average {load0:.1f} at the start, {load1:.1f} at "
        "the end."
    )
    rep.table(
        "CPU ms per rank and step",
        ["pass", "composition ms", "fused ms", "speed-up"],
        rows,
    )
    rep.write(args.out_md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
