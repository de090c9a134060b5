"""The 1-bit compressed all-reduce and the 1-bit optimizers' step on a CPU: the per-tensor round
(the CPU default) beside the vectorized one (the accelerators' round, run on the CPU here), and
the compressed steps of OneBitAdam / ZeroOneAdam beside torch's Adam, side by side in one run.

Three tables ([Note: two implementations] in qshard.comm.compressed):

1. `compressed_all_reduce` in one process (a group of one: the same compression and error
   feedback, no collective), median ms per call, for buckets of the throughput GPT's 52
   parameter shapes (3.26 M elements) and of `--tensors` tensors of ROWSxCOLS; the per-tensor
   round also with ``out=`` the inputs (as the optimizers call it: averaged in place);
2. the same in a world of 2 gloo ranks (rank 0's median: the compute and the two collectives);
3. one optimizer step in the compressed phase, one process, the GPT's shapes, with each round,
   beside torch.optim.Adam (foreach and fused): what the 1-bit step costs on top of Adam's.

    python benchmarks/onebit_step.py [--width 256] [--tensors 1000] [--shape 16x64]
                                     [--steps 10] [--out-md FILE]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if importlib.util.find_spec("qshard") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from _common import Report, add_report_args, at_least, load_text, matrix_shape  # noqa: E402

ROUNDS = ("per_tensor", "vectorized")


def gpt_shapes(width: int = 256) -> list[tuple[int, ...]]:
    """The parameter shapes of benchmarks/throughput.py's GPT (4 layers, width 256, vocabulary
    256, context 128), at another ``width`` for a quick run."""
    w = width
    layer = [(3 * w, w), (3 * w,), (w, w), (w,), (4 * w, w), (4 * w,), (w, 4 * w), (w,)]
    layer += [(w,)] * 4  # the two LayerNorms' weights and biases
    return layer * 4 + [(256, w), (128, w), (w,), (w,)]


def round_kind(name: str):
    """Run every compressed round with implementation ``name`` (whatever the device)."""
    from qshard.comm.compressed import _forced_round

    return _forced_round(name)


def _median_ms(fn, steps: int) -> float:
    fn()  # warm-up: first-touch of the buffers, the layout check
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def _buckets(args) -> dict[str, list[tuple[int, ...]]]:
    rows, cols = args.shape
    return {
        f"GPT width {args.width} (52 tensors)": gpt_shapes(args.width),
        f"{args.tensors} x {rows}x{cols}": [args.shape] * args.tensors,
    }


def _all_reduce_rows(args, group=None) -> list[list[object]]:
    import torch
    import torch.distributed as dist

    from qshard.comm.compressed import compressed_all_reduce, padded_numel, server_error_numel

    n = dist.get_world_size(group) if dist.is_initialized() else 1
    out = []
    for name, shapes in _buckets(args).items():
        g = torch.Generator().manual_seed(0)
        tensors = [torch.randn(s, generator=g) for s in shapes]
        numel = sum(t.numel() for t in tensors)
        ms = {}
        for kind, into in (*((k, None) for k in ROUNDS), ("per_tensor", tensors)):
            ew = [torch.zeros(padded_numel(t.numel(), n)) for t in tensors]
            es = [torch.zeros(server_error_numel(t.numel(), n)) for t in tensors]
            with round_kind(kind):
                call = functools.partial(
                    compressed_all_reduce, tensors, ew, es, group=group, out=into
                )
                ms[kind if into is None else "in_place"] = _median_ms(call, args.steps)
        out.append(
            [
                name,
                f"{numel / 1e6:.2f}",
                f"{ms['per_tensor']:.1f}",
                f"{ms['in_place']:.1f}",
                f"{ms['vectorized']:.1f}",
                f"{ms['vectorized'] / ms['per_tensor']:.1f}x",
                load_text(),
            ]
        )
    return out


def _world_rows(rank: int, world: int, args) -> list[list[object]]:
    import torch

    torch.set_num_threads(1)  # two ranks on the host's cores
    return _all_reduce_rows(args)


def _optimizer_rows(args) -> list[list[object]]:
    import torch

    from qshard.optim import OneBitAdam, ZeroOneAdam

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in gpt_shapes(args.width)]
    grads = [torch.randn(p.shape, generator=g) * 1e-2 for p in params]

    def step_ms(opt, warm: int) -> float:
        def step():
            for p, gr in zip(params, grads):
                p.grad = gr.clone()
            opt.step()

        for _ in range(warm):  # through the full-precision warm-up into the compressed phase
            step()
        return _median_ms(step, args.steps)

    foreach = step_ms(torch.optim.Adam(params, lr=1e-4, foreach=True), 1)
    fused = step_ms(torch.optim.Adam(params, lr=1e-4, fused=True), 1)
    rows = [
        ["torch Adam (foreach=True)", "-", f"{foreach:.1f}", "1.0x", load_text()],
        ["torch Adam (fused=True)", "-", f"{fused:.1f}", f"{fused / foreach:.2f}x", load_text()],
    ]
    makers = {
        "OneBitAdam, compressed phase": lambda: OneBitAdam(params, lr=1e-4, freeze_step=2),
        # variance steps at 1, 2, 4, ..., 32, 64: the timed steps 33.. are all 1-bit
        "ZeroOneAdam, phase A (1-bit gradients)": lambda: ZeroOneAdam(
            params, lr=1e-4, var_freeze_step=10**6, var_update_scaler=1
        ),
    }
    for name, make in makers.items():
        for kind in ROUNDS:
            with round_kind(kind):
                ms = step_ms(make(), 32)
            rows.append([name, kind, f"{ms:.1f}", f"{ms / foreach:.1f}x", load_text()])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=at_least(1), default=256, help="the GPT's width")
    parser.add_argument("--tensors", type=at_least(1), default=1000, help="second bucket's size")
    parser.add_argument(
        "--shape", type=matrix_shape, default=(16, 64), help="its tensors, ROWSxCOLS"
    )
    parser.add_argument(
        "--steps", type=at_least(1), default=10, help="timed calls per row (at most 30)"
    )
    add_report_args(parser)
    args = parser.parse_args(argv)

    import torch

    from qshard.testing import run_world

    report = Report("The 1-bit compressed all-reduce and step on a CPU")
    header = ["bucket", "M elements", "per-tensor ms", "per-tensor, out=inputs ms"]
    header += ["vectorized ms", "vectorized / per-tensor"]
    torch.set_num_threads(1)
    report.table(
        f"compressed_all_reduce, one process, 1 thread (median of {args.steps})",
        [*header, "load 1/5/15"],
        _all_reduce_rows(args),
    )
    rank0 = run_world(_world_rows, 2, args=(args,), timeout_s=900)[0]
    report.table(
        f"compressed_all_reduce, 2 gloo ranks, 1 thread each (rank 0, median of {args.steps})",
        [*header, "load 1/5/15"],
        rank0,
    )
    report.table(
        f"One optimizer step, one process, 1 thread, the GPT's shapes (median of {args.steps})",
        ["optimizer", "round", "ms", "x torch Adam foreach", "load 1/5/15"],
        _optimizer_rows(args),
    )
    report.write(args.out_md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
