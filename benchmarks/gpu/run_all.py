"""Every GPU claim of qshard in one prepared run on a CUDA machine (issue 8).

Measured side by side in one process, so the reference and the kernels share the device state:

1. on-device correctness: each Triton kernel vs the torch reference path on CUDA tensors
   (bit for bit), so the numbers below are for kernels that compute the right thing;
2. per kernel: GB/s of bytes actually read + written, and the fraction of a same-run
   device-to-device copy (the achievable memory bandwidth). Target (H200): >= 0.70;
3. qgZ's middle hop (dequantize K peers, sum, requantize) as the reduce-scatter dispatches it
   (on RowCodec wire rows) vs a plain dequantize of the same codes, and vs the unfused torch
   path. Target: fused <= 1.3x plain dequantize; then qgZ's whole reduce-scatter as one rank
   of 2 nodes x 4 computes it (the all-to-alls replaced by local copies): the fused dispatch vs
   RowCodec on the plain block kernels vs the torch path, with the outputs compared bit for bit;
4. one 8-bit AdamW step (Triton) vs torch.optim.AdamW(fused=True) on 100M+ parameters.
   Target: <= 1.0x;
5. a single-GPU training step of qshard's GPT with the quantized paths on (AdamW8bit, and each
   weight INT8 quantize/dequantize + each gradient INT4 qgZ encode/decode as a rank does them)
   vs the plain fp32-AdamW step.

    python benchmarks/gpu/run_all.py [--quick] [--out-md docs/results/gpu.md]

Without CUDA it exits at once with status 2 and says so (`--smoke` instead runs every section
on CPU under Triton's interpreter at toy sizes, to check the script, not to measure). Sections are independent: one that
fails prints its error and the run goes on.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import Report, add_report_args, time_call


def _require_cuda() -> None:
    import torch

    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run_all.py measures GPU kernels; unset TRITON_INTERPRET (it is 1)")
    if not torch.cuda.is_available():
        sys.stderr.write(
            "run_all.py needs a CUDA GPU (torch.cuda.is_available() is False). The kernels are "
            "verified on CPU by `pytest tests/gpu` under Triton's interpreter; this script only "
            "measures speed.\n"
        )
        sys.exit(2)
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("run_all.py needs triton: pip install 'qshard[gpu]'")


def _ms(fn, repeat: int) -> float:
    return time_call(fn, repeat=repeat, warmup=2).median * 1e3


def _gbs(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def _optimizer_dispatches_to_triton() -> bool:
    """AdamW8bit steps CUDA parameters through the Triton kernel (not the CPU C kernel)."""
    import inspect

    from qshard.optim import _base8bit

    return "_triton" in inspect.getsource(_base8bit)


def _section(report: Report, name: str, fn, *args) -> None:
    try:
        fn(report, *args)
    except Exception:  # one broken section must not lose the others' numbers
        report.note(f"**{name} failed:**\n```\n{traceback.format_exc()[-3000:]}```")


class _TorchPath:
    """References must not dispatch to the kernels they check: force qshard's torch path."""

    def __enter__(self) -> None:
        os.environ["QSHARD_DISABLE_TRITON"] = "1"

    def __exit__(self, *exc: object) -> None:
        os.environ.pop("QSHARD_DISABLE_TRITON", None)


def correctness(report: Report, args) -> None:
    import torch

    from qshard import _triton
    from qshard.quant import blockwise, signs

    dev = DEVICE
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(4096, 256, device=dev, generator=g) * 3
    x[1] = 0
    x[2, 5] = float("nan")
    rows = []
    for bits in (8, 4):
        want = blockwise._quantize_blocks_reference(
            x, blockwise.qmax_for_bits(bits), "nearest", None
        )
        got = _triton.quantize_blocks(x, bits=bits)
        same = torch.equal(got[0], want[0]) and torch.equal(
            got[1].nan_to_num(-1), want[1].nan_to_num(-1)
        )
        deq = _triton.dequantize_blocks(*got, bits=bits, dtype=torch.bfloat16)
        with _TorchPath():
            ref_deq = blockwise.dequantize_blocks(*want, bits=bits, dtype=torch.bfloat16)
        rows.append((f"INT{bits} quantize", same))
        rows.append(
            (f"INT{bits} dequantize -> bf16", torch.equal(deq.nan_to_num(0), ref_deq.nan_to_num(0)))
        )
    packed, _ = _triton.quantize_blocks(x, bits=4, pack=True)
    with _TorchPath():
        ref_packed = blockwise.pack_int4(want[0])
    rows.append(("INT4 fused pack", torch.equal(packed.view(-1), ref_packed)))
    v = torch.randn(1_000_003, device=dev, generator=g)
    with _TorchPath():
        ref_signs = signs.pack_signs(v)
    rows.append(("pack_signs", torch.equal(_triton.pack_signs(v), ref_signs)))
    rows += _qgz_rows_correctness(g)
    report.table(
        "On-device correctness (Triton vs torch reference on CUDA, bit for bit)",
        ["kernel", "equal"],
        rows,
    )


def _qgz_rows_correctness(g) -> list[tuple[str, bool]]:
    """qgZ's wire-row kernels vs RowCodec's torch path on CUDA (what the reduce-scatter sends)."""
    import torch

    from qshard import _triton
    from qshard.zeropp._wire import RowCodec

    rows = []
    bs, peers, nodes = 256, 4, 2
    m = nodes * 16 * bs  # elements per received row
    x = torch.randn(peers, m, device=DEVICE, generator=g) * 3
    x[0, :bs] = 0
    for bits in (4, 8):
        codec = RowCodec(bits=bits, block_size=bs)
        with _TorchPath():
            recv = codec.encode(x)
            summed = codec.decode(recv, m).sum(dim=0)
            want_rows = codec.encode(summed.view(nodes, m // nodes))
            want_out = (codec.decode(want_rows, m // nodes).sum(dim=0) * 0.125).bfloat16()
        out = torch.empty(nodes, codec.row_bytes(m // nodes), dtype=torch.uint8, device=DEVICE)
        got_rows = _triton.dequant_reduce_requant_rows(recv, block_size=bs, bits=bits, out=out)
        got_out = torch.empty(m // nodes, dtype=torch.bfloat16, device=DEVICE)
        _triton.dequant_reduce_rows(got_rows, block_size=bs, bits=bits, out=got_out, scale=0.125)
        rows.append((f"qgZ INT{bits} middle hop on wire rows", torch.equal(got_rows, want_rows)))
        rows.append((f"qgZ INT{bits} last hop -> bf16 (x 1/8)", torch.equal(got_out, want_out)))
    return rows


def kernels(report: Report, args) -> None:
    import torch

    from qshard import _triton
    from qshard.quant import blockwise

    n = args.numel
    bs = 256
    rep = args.repeat
    src = torch.randn(n, device=DEVICE)
    dst = torch.empty_like(src)
    copy_ms = _ms(lambda: dst.copy_(src), rep)
    copy_gbs = _gbs(8 * n, copy_ms)
    nb = n // bs
    x_bf16 = src.bfloat16()
    c8, s8 = _triton.quantize_flat(src, block_size=bs, bits=8)
    c4, s4 = _triton.quantize_flat(src, block_size=bs, bits=4, pack=True)
    out32 = torch.empty(n, device=DEVICE)
    out16 = torch.empty(n, device=DEVICE, dtype=torch.bfloat16)
    signs = _triton.pack_signs(src)
    cases = [
        ("copy fp32 (reference)", lambda: dst.copy_(src), 8 * n),
        (
            "INT8 quantize fp32",
            lambda: _triton.quantize_flat(src, block_size=bs, bits=8),
            4 * n + n + 4 * nb,
        ),
        (
            "INT8 quantize bf16",
            lambda: _triton.quantize_flat(x_bf16, block_size=bs, bits=8),
            2 * n + n + 4 * nb,
        ),
        (
            "INT4 quantize+pack fp32",
            lambda: _triton.quantize_flat(src, block_size=bs, bits=4, pack=True),
            4 * n + n // 2 + 4 * nb,
        ),
        (
            "INT8 dequantize -> fp32",
            lambda: _triton.dequantize_blocks(c8, s8, bits=8, out=out32, numel=n),
            n + 4 * nb + 4 * n,
        ),
        (
            "INT8 dequantize -> bf16",
            lambda: _triton.dequantize_blocks(c8, s8, bits=8, out=out16, numel=n),
            n + 4 * nb + 2 * n,
        ),
        (
            "INT4 dequantize -> fp32",
            lambda: _triton.dequantize_blocks(c4, s4, block_size=bs, out=out32, numel=n),
            n // 2 + 4 * nb + 4 * n,
        ),
        ("pack_signs fp32", lambda: _triton.pack_signs(src), 4 * n + n // 8),
        ("unpack_signs -> fp32", lambda: _triton.unpack_signs(signs, n), n // 8 + 4 * n),
        (
            "torch reference INT8 quantize fp32",
            lambda: blockwise._quantize_blocks_reference(src.view(nb, bs), 127, "nearest", None),
            4 * n + n + 4 * nb,
        ),
    ]
    # qgZ's first step: 2 nodes x 4 ranks, 2 pipeline stages, INT4, fused reorder.
    nodes, per_node = 2, 4
    size = n // (nodes * per_node)
    off, lens, slot = _triton.qgz_slots(
        nodes=nodes, ranks_per_node=per_node, stages=2, size=size, block_size=bs
    )
    off, lens = off.to(DEVICE), lens.to(DEVICE)
    cases.append(
        (
            "qgZ reorder+INT4 quantize (2x4)",
            lambda: _triton.reorder_quantize(
                src, off, lengths=lens, slot_numel=slot, block_size=bs
            ),
            4 * n + n // 2 + 4 * nb,
        )
    )
    rows = []
    for name, fn, nbytes in cases:
        ms = _ms(fn, rep)
        gbs = _gbs(nbytes, ms)
        rows.append((name, f"{ms:.3f}", f"{gbs:.0f}", f"{gbs / copy_gbs:.2f}"))
    report.table(
        f"Kernel bandwidth, {n / 1e6:.0f}M elements, block 256 (copy: {copy_gbs:.0f} GB/s; target >= 0.70)",
        ["kernel", "ms", "GB/s", "x copy"],
        rows,
    )


def _middle_hop_row(peers: int, args) -> tuple:
    import torch

    from qshard import _triton
    from qshard.zeropp._wire import RowCodec

    bs, rep, nodes = 256, args.repeat, 2
    m = args.numel // peers // bs // nodes * nodes  # blocks per peer: K * m * bs ~ numel codes
    x = torch.randn(peers * m, bs, device=DEVICE)
    codes, scales = _triton.quantize_blocks(x, bits=4, pack=True)
    codes, scales = codes.view(peers, m, bs // 2), scales.view(peers, m)
    out32 = torch.empty(peers * m * bs, device=DEVICE)
    # What qgZ's middle hop receives and sends: RowCodec rows, one per peer / per node.
    codec = RowCodec(bits=4, block_size=bs)
    recv = torch.cat([scales.view(torch.uint8), codes.view(peers, -1)], dim=1).contiguous()
    send = torch.empty(nodes, codec.row_bytes(m // nodes * bs), dtype=torch.uint8, device=DEVICE)

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
        with _TorchPath():
            return codec.encode(codec.decode(recv, m * bs).sum(dim=0).view(nodes, -1))

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


def qgz_middle_hop(report: Report, args) -> None:

    rows = [_middle_hop_row(peers, args) for peers in (4, 8)]
    report.table(
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


def qgz_reduce_scatter(report: Report, args) -> None:
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
    grads = torch.randn(world * size, device=DEVICE)
    rows = []

    @contextlib.contextmanager
    def route():
        # --smoke: CPU tensors take the CUDA dispatch (in the interpreter), as in tests/gpu.
        if DEVICE != "cpu":
            yield
            return
        from qshard.quant import _fastpath

        with (
            mock.patch.object(_triton, "serves", lambda t: True),
            mock.patch.object(_fastpath, "use_native", lambda t: False),
            mock.patch.object(_fastpath, "use_native_out", lambda t: False),
        ):
            yield

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
            out = torch.empty(size, device=DEVICE)
            with contextlib.ExitStack() as stack:
                stack.enter_context(_LocalAllToAll())
                if name.startswith("torch"):
                    stack.enter_context(_TorchPath())
                else:
                    stack.enter_context(route())
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
    report.table(
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


def adamw8bit(report: Report, args) -> None:
    import math

    import torch

    from qshard import _triton
    from qshard.quant.dynamic import dynamic_map

    n, rep = args.params, args.repeat
    bs = 256
    p32 = torch.randn(n, device=DEVICE)
    grad = torch.randn(n, device=DEVICE) * 1e-2
    rows_ = []
    # torch fused fp32 AdamW (the target's baseline).
    p_ref = torch.nn.Parameter(p32.clone())
    p_ref.grad = grad.clone()
    opt = torch.optim.AdamW([p_ref], lr=1e-3, weight_decay=0.01, fused=True)
    t_fused = _ms(opt.step, rep)
    rows_.append(
        (
            "torch AdamW(fused=True) fp32",
            f"{t_fused:.3f}",
            "1.00",
            f"{_gbs(28 * n, t_fused):.0f}",
            "8",
        )
    )
    p_f = torch.nn.Parameter(p32.clone())
    p_f.grad = grad.clone()
    opt_f = torch.optim.AdamW([p_f], lr=1e-3, weight_decay=0.01, foreach=True)
    t_foreach = _ms(opt_f.step, rep)
    rows_.append(
        (
            "torch AdamW(foreach=True) fp32",
            f"{t_foreach:.3f}",
            f"{t_foreach / t_fused:.2f}",
            f"{_gbs(28 * n, t_foreach):.0f}",
            "8",
        )
    )
    del opt, opt_f, p_ref, p_f
    code1, code2 = dynamic_map(signed=True).to(DEVICE), dynamic_map(signed=False).to(DEVICE)
    mid1, mid2 = (code1[:-1] + code1[1:]) / 2, (code2[:-1] + code2[1:]) / 2
    z1, z2 = int((code1 == 0).nonzero()[0]), int((code2 == 0).nonzero()[0])
    p = p32.clone()
    rows, row_numel = n // 4096, 4096
    c1 = torch.full((n,), z1, dtype=torch.uint8, device=DEVICE)
    c2 = torch.full((n,), z2, dtype=torch.uint8, device=DEVICE)
    a1 = torch.zeros(rows * (row_numel // bs), device=DEVICE)
    a2 = torch.zeros_like(a1)
    step = [0]

    def step8() -> None:
        step[0] += 1
        k = step[0]
        _triton.adam8bit_step(
            param=p,
            grad=grad,
            codes1=c1,
            absmax1=a1,
            code1=code1,
            mid1=mid1,
            zero1=z1,
            signed1=True,
            codes2=c2,
            absmax2=a2,
            code2=code2,
            mid2=mid2,
            zero2=z2,
            signed2=False,
            rows=rows,
            row_numel=row_numel,
            block_size=bs,
            hp=[
                1e-3,
                0.9,
                0.999,
                1e-8,
                0.01,
                1e-3 / (1 - 0.9**k),
                math.sqrt(1 - 0.999**k),
                1 - 1e-5,
            ],
            flags=3,
        )

    t8 = _ms(step8, rep)
    rows_.append(
        (
            "qshard Triton AdamW8bit step",
            f"{t8:.3f}",
            f"{t8 / t_fused:.2f}",
            f"{_gbs(16 * n + 8 * (n // bs), t8):.0f}",
            "2.03",
        )
    )
    try:
        from qshard.optim import AdamW8bit

        if not _optimizer_dispatches_to_triton():
            raise RuntimeError("qshard.optim has no CUDA dispatch")
        pq = torch.nn.Parameter(p32.clone().view(rows, row_numel))
        pq.grad = grad.view(rows, row_numel).clone()
        optq = AdamW8bit([pq], lr=1e-3, weight_decay=0.01)
        t_opt = _ms(optq.step, rep)
        rows_.append(
            (
                "qshard.optim.AdamW8bit.step() (whole optimizer)",
                f"{t_opt:.3f}",
                f"{t_opt / t_fused:.2f}",
                "",
                "2.03",
            )
        )
    except Exception as e:  # the optimizer's CUDA dispatch may not exist yet
        rows_.append((f"qshard.optim.AdamW8bit.step(): {type(e).__name__}", "", "", "", ""))
    try:
        from qshard.optim import AdamW8bit

        # The fp32-state path (biases, norms, small or optim_bits=32 tensors): torch's own fused
        # kernel through the optimizer, with device copies of its CPU step counters.
        p32s = torch.nn.Parameter(p32.clone())
        p32s.grad = grad.clone()
        opt32 = AdamW8bit([p32s], lr=1e-3, weight_decay=0.01, optim_bits=32, fused=True)
        t_32 = _ms(opt32.step, rep)
        rows_.append(
            (
                "qshard.optim.AdamW8bit(optim_bits=32, fused=True).step()",
                f"{t_32:.3f}",
                f"{t_32 / t_fused:.2f}",
                f"{_gbs(28 * n, t_32):.0f}",
                "8",
            )
        )
        del opt32, p32s
    except Exception as e:
        rows_.append((f"AdamW8bit(optim_bits=32, fused=True): {type(e).__name__}", "", "", "", ""))
    report.table(
        f"AdamW step on {n / 1e6:.0f}M fp32 parameters (target: 8-bit <= 1.0x fused fp32)",
        ["optimizer", "ms", "x fused fp32", "GB/s moved", "state bytes/param"],
        rows_,
    )


def _gpt_step_ms(name: str, cfg, data, repeat: int) -> float:
    import torch

    from qshard import _triton
    from qshard.train.model import GPT

    model = GPT(cfg).to(DEVICE)
    params = [p for p in model.parameters() if p.requires_grad]
    if name.startswith("fp32"):
        opt = torch.optim.AdamW(params, lr=3e-4, fused=True)
    else:
        from qshard.optim import AdamW8bit

        opt = AdamW8bit(params, lr=3e-4, fused=True)  # fp32-state tensors: the same kernel
    codecs = "codecs" in name
    offset0 = torch.zeros(1, dtype=torch.int64, device=DEVICE)

    def step() -> None:
        if codecs:
            # What one rank runs for qwZ (quantize its weights, dequantize the gathered ones)
            # and for qgZ (encode its gradients, decode the reduced ones), without the
            # network: the kernels' cost inside a real training step.
            with torch.no_grad():
                for p in params:
                    c, s = _triton.quantize_flat(p.data.view(-1), block_size=256, bits=8)
                    _triton.dequantize_blocks(c, s, bits=8, numel=p.numel(), out=p.data.view(-1))
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            _, loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        if codecs:
            with torch.no_grad():
                for p in params:
                    flat = p.grad.view(-1)
                    c, s = _triton.reorder_quantize(
                        flat, offset0, slot_numel=flat.numel(), block_size=256
                    )
                    _triton.dequant_reduce(
                        c.unsqueeze(0), s.unsqueeze(0), block_size=256, numel=flat.numel(), out=flat
                    )
        opt.step()
        opt.zero_grad(set_to_none=False)

    return _ms(step, repeat)


def gpt_step(report: Report, args) -> None:
    import torch

    from qshard.train.model import GPT, GPTConfig

    cfg = GPTConfig(
        vocab_size=256, context=args.context, n_layer=args.layers, n_head=12, n_embd=args.embd
    )
    batch = args.batch
    rows = []
    data = torch.randint(0, 256, (batch, cfg.context + 1), device=DEVICE)
    base_ms = None
    for name in ("fp32 AdamW(fused)", "AdamW8bit", "AdamW8bit + qwZ INT8 + qgZ INT4 codecs"):
        if name != "fp32 AdamW(fused)" and not _optimizer_dispatches_to_triton():
            rows.append((name, "skipped: qshard.optim has no CUDA dispatch", "", ""))
            continue
        ms = _gpt_step_ms(name, cfg, data, max(3, args.repeat // 2))
        base_ms = base_ms or ms
        tokens = batch * cfg.context
        rows.append((name, f"{ms:.1f}", f"{ms / base_ms:.2f}", f"{tokens / (ms * 1e-3):,.0f}"))
        torch.cuda.empty_cache()
    n_params = GPT(cfg).num_params()
    report.table(
        f"Single-GPU GPT training step ({n_params / 1e6:.0f}M params, {cfg.n_layer}x{cfg.n_embd}, "
        f"batch {batch}x{cfg.context}, bf16 autocast)",
        ["configuration", "ms/step", "x fp32 AdamW", "tokens/s"],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a short GPU run)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="check the script itself on CPU under TRITON_INTERPRET=1 with tiny sizes "
        "(its numbers mean nothing)",
    )
    add_report_args(parser)
    args = parser.parse_args()
    global DEVICE
    if args.smoke:
        # Must precede the first kernel import: Triton picks interpreter vs compiler then.
        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE = "cpu"
    else:
        _require_cuda()
    import torch

    if args.smoke:
        args.numel, args.params, args.repeat = 1 << 13, 4 * 4096, 1
        args.layers, args.embd, args.context, args.batch = 1, 48, 16, 2
    else:
        args.numel = 1 << (24 if args.quick else 28)  # 16M or 256M elements (1 GiB of fp32)
        args.params = 16 * 4096 * 256 if args.quick else 128 * 1024 * 1024  # 128M parameters
        args.repeat = 5 if args.quick else 20
        args.layers, args.embd = (2, 768) if args.quick else (12, 768)
        args.context, args.batch = 1024, 8
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (interpreter smoke run)"
    report = Report(f"GPU kernels on {name}")
    for name, fn in (
        ("correctness", correctness),
        ("kernels", kernels),
        ("qgz_middle_hop", qgz_middle_hop),
        ("qgz_reduce_scatter", qgz_reduce_scatter),
        ("adamw8bit", adamw8bit),
        ("gpt_step", gpt_step),
    ):
        _section(report, name, fn, args)
        torch.cuda.empty_cache()
    report.write(args.out_md)


if __name__ == "__main__":
    main()
