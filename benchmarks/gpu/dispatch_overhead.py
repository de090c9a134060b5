"""Host time AdamW8bit spends per tensor on its Triton path, without a GPU.

On CUDA the optimizer steps a group's tensors in one kernel launch ([Note: multi-tensor launch]
in qshard._triton._common; until 2026-12-04 one launch per tensor), checked and built once and
kept across steps ([Note: prepared launch]), plus its Python per tensor (state lookups, the
check that the tensors are the same). `--prepare-each-step` drops the kept launch before every
step (the dispatch before it was kept: every layout checked, the table built). For a model of many small tensors
that host time, not the kernel, can set the step time (docs/gpu.md). This measures the Python
part on the CPU: the optimizer dispatches to the Triton path as on a GPU, and the launch itself
is replaced by a no-op, so what is left is what a faster dispatch would save. The launch
table's copy to the GPU (one pinned host-to-device copy a launch) is not in it.

    python benchmarks/gpu/dispatch_overhead.py [--tensors 150] [--steps 50] [--optimizer adamw4bit]
                                               [--prepare-each-step]

Prints microseconds per tensor per step (median of 5 runs) and the load average.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if importlib.util.find_spec("qshard") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=150, help="768x768 parameters")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--optimizer", choices=["adamw8bit", "adamw4bit"], default="adamw8bit")
    parser.add_argument(
        "--prepare-each-step", action="store_true", help="drop the kept launch before each step"
    )
    args = parser.parse_args(argv)
    if args.tensors < 1 or args.steps < 1:
        parser.error("--tensors and --steps must be at least 1")
    os.environ["TRITON_INTERPRET"] = "1"  # import the kernels without a GPU
    import torch

    from qshard import _triton
    from qshard._triton import _optim4bit, _optim8bit
    from qshard.optim import AdamW4bit, AdamW8bit

    # one launch a group ([Note: multi-tensor launch]), here a no-op
    _optim8bit._step8_multi_kernel = _NoLaunch()
    _optim4bit._step4_multi_kernel = _NoLaunch()
    _triton.serves = lambda t: True  # the CUDA dispatch decision, for CPU tensors
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(768, 768)) for _ in range(args.tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = (AdamW8bit if args.optimizer == "adamw8bit" else AdamW4bit)(params, lr=1e-3)

    def step() -> None:
        if args.prepare_each_step:
            opt.__dict__.pop("_plan_cache", None)
        opt.step()

    for _ in range(3):
        step()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        runs.append((time.perf_counter() - t0) / args.steps / args.tensors * 1e6)
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"{type(opt).__name__} Triton path"
        f"{', launch prepared each step' if args.prepare_each_step else ''}, host time per "
        "tensor per step (launch excluded): "
        f"{statistics.median(runs):.1f} us (median of 5; {args.tensors} tensors; load {load})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
