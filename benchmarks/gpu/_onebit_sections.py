"""run_all.py's 1-bit section: the compressed all-reduce's two rounds on the GPU ([Note: two
implementations] in qshard.comm.compressed: accelerators take the vectorized round, a CPU the
per-tensor one, a choice made on CPU timings alone) and OneBitAdam's compressed step against
torch's fused Adam."""

from __future__ import annotations

import os
import sys

import _device as D
from _device import _err, _ms, _Rows
from _harness import Recorder

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/


def onebit_round(rec: Recorder, args) -> None:
    """A world of one (no process group: the same compression and error feedback, no
    collective) on the device, the throughput GPT's 52 shapes at ``width`` and a bucket of many
    small tensors; each round's result checked against the other's."""
    import torch

    from onebit_step import gpt_shapes
    from qshard.comm.compressed import (
        _forced_round,
        compressed_all_reduce,
        padded_numel,
        server_error_numel,
    )
    from qshard.optim import OneBitAdam

    width = 16 if args.smoke else (256 if args.quick else 1024)
    small = 8 if args.smoke else 1000
    rep = args.repeat
    buckets = {
        f"GPT width {width} (52 tensors)": gpt_shapes(width),
        f"{small} x 16x64": [(16, 64)] * small,
    }
    rows = _Rows(
        rec,
        "1-bit compressed_all_reduce on the device, world of one (ms per call)",
        [
            "bucket",
            "M elements",
            "vectorized (default)",
            "per-tensor",
            "per-tensor out=inputs",
            "max abs difference / max abs result",
        ],
    )
    for name, shapes in buckets.items():
        try:
            g = torch.Generator(device=D.DEVICE).manual_seed(0)
            xs = [torch.randn(s, device=D.DEVICE, generator=g) for s in shapes]
            ms, results = {}, {}
            for kind, into in (("vectorized", None), ("per_tensor", None), ("in_place", "in")):
                ew = [torch.zeros(padded_numel(x.numel(), 1), device=D.DEVICE) for x in xs]
                es = [torch.zeros(server_error_numel(x.numel(), 1), device=D.DEVICE) for x in xs]
                inputs = [x.clone() for x in xs] if into else xs
                with _forced_round("vectorized" if kind == "vectorized" else "per_tensor"):
                    results[kind] = [
                        r.clone() for r in compressed_all_reduce(xs, ew, es)
                    ]  # first call, from zero errors: the results compared below
                    ms[kind] = _ms(
                        lambda inputs=inputs, ew=ew, es=es, into=into: compressed_all_reduce(
                            inputs, ew, es, out=inputs if into else None
                        ),
                        rep,
                    )
            scale = max(float(r.abs().max()) for r in results["vectorized"]) or 1.0
            diff = max(
                float((a - b).abs().max())
                for a, b in zip(results["vectorized"], results["per_tensor"])
            )
            numel = sum(x.numel() for x in xs)
            rows.append(
                (
                    name,
                    f"{numel / 1e6:.2f}",
                    f"{ms['vectorized']:.3f}",
                    f"{ms['per_tensor']:.3f}",
                    f"{ms['in_place']:.3f}",
                    f"{diff / scale:.1e}",
                )
            )
        except Exception as e:
            rows.append((f"{name}: {_err(e)}", "", "", "", "", ""))
    steps = _Rows(
        rec,
        f"OneBitAdam compressed step vs torch Adam, GPT width {width} (ms per step)",
        ["optimizer", "round", "ms", "x torch Adam fused"],
    )
    g = torch.Generator(device=D.DEVICE).manual_seed(1)
    params = [
        torch.nn.Parameter(torch.randn(s, device=D.DEVICE, generator=g)) for s in gpt_shapes(width)
    ]
    grads = [torch.randn(p.shape, device=D.DEVICE, generator=g) * 1e-2 for p in params]

    def stepper(opt, warm: int):
        def step():
            for p, gr in zip(params, grads):
                p.grad = gr
            opt.step()

        for _ in range(warm):  # into the compressed phase
            step()
        return step

    fused = _ms(stepper(torch.optim.Adam(params, lr=1e-4, fused=D.DEVICE == "cuda"), 1), rep)
    steps.append(("torch Adam (fused=True)", "-", f"{fused:.3f}", "1.00"))
    for kind in ("vectorized", "per_tensor"):
        try:
            with _forced_round(kind):
                t = _ms(stepper(OneBitAdam(params, lr=1e-4, freeze_step=2), 3), rep)
            steps.append(("OneBitAdam", kind, f"{t:.3f}", f"{t / fused:.2f}"))
        except Exception as e:
            steps.append((f"OneBitAdam {kind}: {_err(e)}", "", "", ""))
