"""Host time of the block-wise optimizers' step: the Python a step spends per tensor around its
kernels, which a model of many small tensors pays on top of the kernel time.

Two tables, each side by side in one process:

1. The CPU multi-tensor call with its kernel replaced by a no-op (what is left is Python and
   the call's table): microseconds per tensor and step, AdamW8bit and AdamW4bit, with the plan
   kept across steps (the default, [Note: prepared launch] in qshard._triton._common) and
   planned anew each step (what every step paid before plans were kept);
2. FSDP2 on one gloo rank in this process: `--units` Linear(D, D) modules, each `fully_shard`ed
   (new gradient tensors every step, as in training), median `opt.step()` in ms for AdamW8bit
   with torch's default flags for its fp32-state tensors (the biases) and with `fused=True`,
   beside torch.optim.AdamW(fused=True).

The Triton path's host time is benchmarks/gpu/dispatch_overhead.py's. To compare with another
revision, run this script with that revision's library first on PYTHONPATH.

    python benchmarks/optim_host_overhead.py [--tensors 2000] [--shape 16x256] [--units 200]
                                             [--dim 64] [--steps 20] [--out-md FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if importlib.util.find_spec("qshard") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from _common import Report, add_report_args, at_least, load_text, matrix_shape  # noqa: E402


class _NoOpKernels:
    """A C kernel library whose multi-tensor step entries do nothing (every other symbol is the
    real library's)."""

    def __init__(self, lib) -> None:
        self._lib = lib

    def __getattr__(self, name):
        if name in ("step8_multi", "adam4bit_multi"):
            return lambda *args: 0
        return getattr(self._lib, name)


def _us_per_tensor(opt, kept: bool, args: argparse.Namespace) -> float:
    """Best of 5 runs of ``args.steps`` steps, in microseconds per tensor and step; ``kept``:
    the plan kept across steps, else dropped before each."""

    def step() -> None:
        if not kept:
            opt.__dict__.pop("_plan_cache", None)
        opt.step()

    for _ in range(3):
        step()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        best = min(best, (time.perf_counter() - t0) / args.steps / args.tensors)
    return best * 1e6


def _cpu_call_rows(args: argparse.Namespace) -> list[list[object]]:
    import torch

    from qshard.optim import AdamW4bit, AdamW8bit, _kernels, _kernels4

    rows = []
    for cls, module in ((AdamW8bit, _kernels), (AdamW4bit, _kernels4)):
        lib = module.library()
        if lib is None:
            rows.append([cls.__name__, "-", "-", "no C compiler: the kernel is not built"])
            continue
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(args.shape)) for _ in range(args.tensors)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = cls(params, lr=1e-3)
        opt.step()  # the states, with the real kernel
        real, fake = module.library, _NoOpKernels(lib)
        module.library = lambda: fake  # noqa: B023 (restored below, before the next one)
        try:
            per = {kept: _us_per_tensor(opt, kept, args) for kept in (True, False)}
        finally:
            module.library = real
        rows.append([cls.__name__, f"{per[True]:.2f}", f"{per[False]:.2f}", f"load {load_text()}"])
    return rows


def _fsdp_rows(args: argparse.Namespace) -> list[list[object]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from qshard.optim import AdamW8bit

    if dist.is_initialized():
        raise RuntimeError("the FSDP2 table starts its own one-rank process group")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1
        )
        try:
            rows = []
            candidates = (
                ("qshard AdamW8bit (fp32-state tensors: torch's default flags)", dict()),
                ("qshard AdamW8bit(fused=True)", dict(fused=True)),
                ("torch AdamW(fused=True), fp32 state", None),
            )
            for name, kw in candidates:
                torch.manual_seed(0)
                model = torch.nn.Sequential(
                    *[torch.nn.Linear(args.dim, args.dim) for _ in range(args.units)]
                )
                for unit in model:
                    fully_shard(unit)
                fully_shard(model)
                if kw is None:
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
                else:
                    opt = AdamW8bit(model.parameters(), lr=1e-4, min_8bit_size=1, **kw)
                x = torch.randn(4, args.dim)
                times = []
                for i in range(args.steps + 3):
                    model(x).sum().backward()
                    t0 = time.perf_counter()
                    opt.step()
                    if i >= 3:
                        times.append(time.perf_counter() - t0)
                    opt.zero_grad()
                ms = statistics.median(times) * 1e3
                rows.append(
                    [name, f"{ms:.2f}", f"{ms / args.units * 1e3:.1f}", f"load {load_text()}"]
                )
            return rows
        finally:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=at_least(1), default=2000, help="CPU call table")
    parser.add_argument(
        "--shape", type=matrix_shape, default=(16, 256), help="their shape, ROWSxCOLS"
    )
    parser.add_argument("--units", type=at_least(1), default=200, help="FSDP2 Linear units")
    parser.add_argument("--dim", type=at_least(1), default=64, help="their in/out features")
    parser.add_argument("--steps", type=at_least(1), default=20, help="timed steps")
    add_report_args(parser)
    args = parser.parse_args(argv)
    report = Report("Optimizer step: host time around the kernels (CPU)")
    rows, cols = args.shape
    report.table(
        f"CPU multi-tensor call, kernel a no-op: {args.tensors} tensors of {rows} x {cols}, "
        f"us per tensor and step (best of 5 x {args.steps} steps)",
        ["optimizer", "plan kept (default)", "planned each step", "note"],
        _cpu_call_rows(args),
    )
    report.table(
        f"FSDP2, one gloo rank: {args.units} Linear({args.dim}, {args.dim}) units, "
        f"opt.step() median of {args.steps}",
        ["optimizer", "ms", "us per unit", "note"],
        _fsdp_rows(args),
    )
    report.write(args.out_md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
