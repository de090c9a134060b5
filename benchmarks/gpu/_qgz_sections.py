"""run_all.py's qgZ sections: the fused middle hop and one rank's whole reduce-scatter."""

from __future__ import annotations

import _device as D
from _device import _gbs, _ms, _route, _TorchPath
from _harness import Recorder


def qgz_first_hop(src, offsets, lengths, slot: int, bs: int, per_node: int, aligned_to: int):
    """qgZ's first hop as zeropp's reduce-scatter dispatches it on CUDA: per pipeline stage (2),
    `reorder_quantize_rows` of the stage's slots straight into the all-to-all's wire rows (one
    row per local peer), on trusted slots (`check=False`: the public `reorder_quantize` checks
    them on the host, a device sync a call) with zeropp's promise `aligned_to` = gcd(partition
    size, slot) ([Note: aligned slots]; 1: none). Returns (run, the send buffers it writes)."""
    import torch

    from qshard import _triton

    per_stage = offsets.numel() // 2
    m = per_stage // per_node * slot  # elements a row: its N slots
    sends = [
        torch.empty((per_node, 4 * (m // bs) + m // 2), dtype=torch.uint8, device=src.device)
        for _ in range(2)
    ]

    def run() -> None:
        for k, send in enumerate(sends):
            sl = slice(k * per_stage, (k + 1) * per_stage)
            _triton.reorder_quantize_rows(
                src, offsets[sl], lengths[sl], slot_numel=slot, block_size=bs, bits=4,
                out=send, check=False, aligned_to=aligned_to,
            )  # fmt: skip

    return run, sends


def _qgz_rows_correctness(g) -> list[tuple[str, bool]]:
    """qgZ's wire-row kernels vs RowCodec's torch path on CUDA (what the reduce-scatter sends)."""
    import torch

    from qshard import _triton
    from qshard.zeropp._wire import RowCodec

    rows = []
    bs, peers, nodes = 256, 4, 2
    m = nodes * 16 * bs  # elements per received row
    x = torch.randn(peers, m, device=D.DEVICE, generator=g) * 3
    x[0, :bs] = 0
    for bits in (4, 8):
        codec = RowCodec(bits=bits, block_size=bs)
        with _TorchPath():  # RowCodec's own sums: rows added in row order (sum_rows)
            recv = codec.encode(x)
            want_rows = codec.reduce_encode(recv, m, nodes)
            want_out = (codec.reduce(want_rows, m // nodes) * 0.125).bfloat16()
        out = torch.empty(nodes, codec.row_bytes(m // nodes), dtype=torch.uint8, device=D.DEVICE)
        got_rows = _triton.dequant_reduce_requant_rows(recv, block_size=bs, bits=bits, out=out)
        got_out = torch.empty(m // nodes, dtype=torch.bfloat16, device=D.DEVICE)
        _triton.dequant_reduce_rows(got_rows, block_size=bs, bits=bits, out=got_out, scale=0.125)
        rows.append((f"qgZ INT{bits} middle hop on wire rows", torch.equal(got_rows, want_rows)))
        rows.append((f"qgZ INT{bits} last hop -> bf16 (x 1/8)", torch.equal(got_out, want_out)))
    return rows


def _middle_hop_row(peers: int, args) -> tuple:
    import torch

    from qshard import _triton
    from qshard.zeropp._wire import RowCodec

    bs, rep, nodes = 256, args.repeat, 2
    m = args.numel // peers // bs // nodes * nodes  # blocks per peer: K * m * bs ~ numel codes
    x = torch.randn(peers * m, bs, device=D.DEVICE)
    codes, scales = _triton.quantize_blocks(x, bits=4, pack=True)
    codes, scales = codes.view(peers, m, bs // 2), scales.view(peers, m)
    out32 = torch.empty(peers * m * bs, device=D.DEVICE)
    # What qgZ's middle hop receives and sends: RowCodec rows, one per peer / per node.
    codec = RowCodec(bits=4, block_size=bs)
    recv = torch.cat([scales.view(torch.uint8), codes.view(peers, -1)], dim=1).contiguous()
    send = torch.empty(nodes, codec.row_bytes(m // nodes * bs), dtype=torch.uint8, device=D.DEVICE)

    def dispatched():
        return _triton.dequant_reduce_requant_rows(recv, block_size=bs, bits=4, out=send)

    def fused():
        return _triton.dequant_reduce_requant(codes, scales, block_size=bs, bits=4)

    def plain_dequantize():
        return _triton.dequantize_blocks(
            codes.view(peers * m, -1),
            scales.view(-1),
            block_size=bs,
            out=out32,
            numel=out32.numel(),
        )

    def unfused_torch():
        # qshard's own path (what reduce_scatter runs without the kernels): decode, add the rows
        # in row order (`sum_rows`), re-encode. Not `decode(...).sum(dim=0)`: torch's CUDA
        # reduction of 8 rows adds in another order (H200, torch 2.11), so it is no reference.
        with _TorchPath():
            return codec.reduce_encode(recv, m * bs, nodes)

    t_rows, t_fused = _ms(dispatched, rep), _ms(fused, rep)
    t_plain, t_torch = _ms(plain_dequantize, rep), _ms(unfused_torch, rep)
    with _TorchPath():
        same = torch.equal(dispatched(), unfused_torch())
    nbytes = peers * m * (bs // 2 + 4) + m * (bs // 2 + 4)
    return (
        peers,
        f"{t_rows:.3f}",
        f"{t_fused:.3f}",
        f"{t_plain:.3f}",
        f"{t_rows / t_plain:.2f}",
        f"{t_torch:.3f}",
        f"{t_torch / t_rows:.1f}",
        f"{_gbs(nbytes, t_rows):.0f}",
        same,
    )


def qgz_middle_hop(rec: Recorder, args) -> None:

    rows = [_middle_hop_row(peers, args) for peers in (4, 8)]
    rec.table(
        "qgZ middle hop: fused dequantize+reduce+requantize (INT4) as dispatched, on wire rows, vs "
        "a plain dequantize of the same codes (target <= 1.3x)",
        [
            "peers",
            "fused rows ms",
            "fused 2-tensor ms",
            "dequantize ms",
            "fused rows/dequantize",
            "torch RowCodec ms",
            "speed-up vs torch",
            "fused GB/s",
            "bit-exact vs torch",
        ],
        rows,
    )


class _LocalTopology:
    """Rank 0 of `nodes` x `per_node` without process groups: the all-to-alls are local."""

    def __init__(self, nodes: int, per_node: int) -> None:
        self.num_nodes, self.ranks_per_node = nodes, per_node
        self.world_size = nodes * per_node
        self.intra_node_group = self.inter_node_group = object()
        self.node = self.local_rank = 0

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def peer_ranks(self, local_rank: int) -> list[int]:
        return list(range(local_rank, self.world_size, self.ranks_per_node))

    def twin_group(self, kind: str) -> None:  # no groups, so no duplex exchanges
        return None

    def twin_for(self, ranks: list[int]) -> None:
        return None


class _LocalAllToAll:
    """Replace dist.all_to_all_single by a copy of the send buffer into the receive buffer:
    one rank's computation of the reduce-scatter, with the network taken out."""

    class _Done:
        def wait(self) -> bool:
            return True

    def __enter__(self) -> None:
        import torch.distributed as dist

        self._saved = dist.all_to_all_single

        def a2a(recv, send, group=None, async_op=False):
            recv.copy_(send)
            return self._Done() if async_op else None

        dist.all_to_all_single = a2a

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.all_to_all_single = self._saved


def qgz_reduce_scatter(rec: Recorder, args) -> None:
    """The whole qgZ reduce-scatter as dispatched, per rank, without the network."""
    import contextlib
    import types
    from unittest import mock

    import torch

    from qshard import _triton
    from qshard.zeropp import HierarchicalQuantizedReduceScatter, reduce_scatter

    nodes, per_node, rep = 2, 4, args.repeat
    world = nodes * per_node
    size = args.numel // world
    grads = torch.randn(world * size, device=D.DEVICE)
    rows = []

    for stages in (1, 2):
        rs = HierarchicalQuantizedReduceScatter(
            topology=_LocalTopology(nodes, per_node), bits=4, block_size=256, pipeline_stages=stages
        )
        outputs, found = {}, []
        for name in (
            "fused kernels (dispatched)",
            "RowCodec on plain Triton kernels",
            "torch path (QSHARD_DISABLE_TRITON=1)",
        ):
            out = torch.empty(size, device=D.DEVICE)
            with contextlib.ExitStack() as stack:
                stack.enter_context(_LocalAllToAll())
                if name.startswith("torch"):
                    stack.enter_context(_TorchPath())
                else:
                    stack.enter_context(_route())
                if name.startswith("RowCodec"):
                    no_fused = types.SimpleNamespace(serves=lambda t: False)
                    stack.enter_context(mock.patch.object(reduce_scatter, "_triton", no_fused))
                calls = stack.enter_context(
                    mock.patch.object(
                        _triton,
                        "dequant_reduce_requant_rows",
                        wraps=_triton.dequant_reduce_requant_rows,
                    )
                )
                ms = _ms(lambda out=out, rs=rs: rs._reduce(out, grads, 1.0 / world), rep)
            outputs[name] = out
            found.append((name, ms, calls.call_count))
        base = found[0][1]
        want = outputs["torch path (QSHARD_DISABLE_TRITON=1)"]
        for name, ms, n_calls in found:
            same = torch.equal(outputs[name], want)
            # Only the dispatched path may run the fused kernels, and it must.
            expected = (n_calls > 0) == name.startswith("fused")
            rows.append((stages, name, f"{ms:.3f}", f"{ms / base:.2f}", n_calls, expected, same))
    rec.table(
        f"qgZ reduce-scatter per rank, INT4, {nodes} nodes x {per_node} ranks, "
        f"{world * size / 1e6:.1f}M fp32 gradient elements (all-to-alls replaced by local copies)",
        [
            "stages",
            "path",
            "ms",
            "x fused",
            "fused middle-hop calls",
            "dispatch as expected",
            "output = torch path",
        ],
        rows,
    )
