"""The workloads `profile_step.py` profiles, each run in a child process of its own.

    python benchmarks/gpu/_profile_target.py ncu NAME [--smoke]
        warm NAME up (Triton compiles here), then run one more call between
        cudaProfilerStart/Stop: what `ncu --profile-from-start off` profiles;
    python benchmarks/gpu/_profile_target.py torch NAME --out FILE [--smoke]
        3 warm-up steps, then NAME's steps under torch.profiler and one step under
        `torch.cuda.set_sync_debug_mode("warn")`; markdown appended to FILE as it is produced.

The workloads are the ones run_all.py's sections measure, built from their helpers: sizes as
in `_step_sections.py`'s adamw8bit / adamw4bit sections (134M fp32 parameters), qgZ's first hop
as `_qgz_sections.py` builds it, the GPT step as `_step_sections._gpt_step_ms` builds it.
`--smoke` runs them on CPU under Triton's interpreter at toy sizes (control flow only).
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import math
import os
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
if importlib.util.find_spec("qshard") is None:  # not installed (the device machine): the tree's
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))

import _device as D  # noqa: E402  (benchmarks/gpu: this script's directory is on sys.path)
from _harness import md_table  # noqa: E402

Step = Callable[[], object]

N_PARAMS = 128 * 1024 * 1024  # 134M: run_all.py's --params of the adamw8bit/adamw4bit sections
ROW = 4096  # the sections' row length
WARMUP = 3
GPT_CODECS = "AdamW8bit + qwZ INT8 + qgZ INT4 codecs per FSDP unit"  # gpt_step's row name


@dataclass(frozen=True)
class Kernel:
    """What ncu profiles of a workload: the first launch whose demangled name matches `regex`
    in the profiled call; `fallback` (regex, launches to skip) if that matches none."""

    regex: str
    what: str
    fallback: tuple[str, int] | None = None


NCU_WORKLOADS: dict[str, Kernel] = {
    "step8": Kernel("_step8_multi_kernel", "AdamW8bit.step(), one 134M-element fp32 parameter"),
    "step4": Kernel("_step4_multi_kernel", "AdamW4bit.step(), one 134M-element fp32 parameter"),
    # multi_tensor_apply_kernel<..., FusedAdamMathFunctor<...>>; the fallback skips the step
    # counters' _foreach_add_ launch (also a multi_tensor_apply_kernel) that precedes it.
    "torch_adamw": Kernel(
        ".*[Aa]dam.*",
        "torch.optim.AdamW(fused=True), same parameter",
        ("multi_tensor_apply_kernel", 1),
    ),
    "qgz": Kernel("_reorder_quantize_kernel", "qgZ reorder+INT4 quantize, 2 nodes x 4 ranks"),
}
# Workload: (profiled steps, what it is).
TORCH_WORKLOADS: dict[str, tuple[int, str]] = {
    "many8": (5, "AdamW8bit.step() on 150 CUDA parameters of 768x768"),
    "gpt": (3, f"GPT training step, {GPT_CODECS}"),
}
SYNC_EVENTS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpyAsync",
    "cudaMemcpy",
    "aten::item",
    "aten::_local_scalar_dense",
)


def _routed(fn: Step) -> Step:
    """Each call under `_device._route()` (smoke: CPU tensors take the Triton dispatch)."""

    def run() -> object:
        with D._route():
            return fn()

    return run


def _param(n: int, row: int = ROW, seed: int = 0):
    """A `row`-wide fp32 parameter of `n` elements with a gradient, as the sections make them."""
    import torch

    g = torch.Generator(device=D.DEVICE).manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n // row, row, device=D.DEVICE, generator=g))
    p.grad = torch.randn(n // row, row, device=D.DEVICE, generator=g) * 1e-2
    return p


def _step8(smoke: bool) -> Step:
    from qshard.optim import AdamW8bit

    p = _param(ROW if smoke else N_PARAMS)
    return _routed(AdamW8bit([p], lr=1e-3, weight_decay=0.01).step)


def _step4(smoke: bool) -> Step:
    from qshard.optim import AdamW4bit

    p = _param(ROW if smoke else N_PARAMS)
    return _routed(AdamW4bit([p], lr=1e-3, weight_decay=0.01).step)


def _torch_adamw(smoke: bool) -> Step:
    import torch

    p = _param(ROW if smoke else N_PARAMS)
    return torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True).step


def _qgz(smoke: bool) -> Step:
    """run_all.py's kernels section's qgZ case: 2 stages of `reorder_quantize_rows` (two
    launches of `_reorder_quantize_kernel` a call)."""
    import torch
    from _qgz_sections import qgz_first_hop

    from qshard import _triton

    n, bs, nodes, per_node = (1 << 13) if smoke else N_PARAMS, 256, 2, 4
    size = n // (nodes * per_node)
    off, lens, slot = _triton.qgz_slots(
        nodes=nodes, ranks_per_node=per_node, stages=2, size=size, block_size=bs
    )
    src = torch.randn(n, device=D.DEVICE)
    run, _ = qgz_first_hop(
        src, off.to(D.DEVICE), lens.to(D.DEVICE), slot, bs, per_node, math.gcd(size, slot)
    )
    return run


def _many8(smoke: bool) -> Step:
    """`_step_sections._many_tensors`'s workload: 150 tensors of 768x768 (smoke: 3 of 32x32,
    8-bit from 1024 elements: the interpreter took ~25 s, the part's cap, for 3 of 64x64 on a
    Zen 4 host)."""
    from qshard.optim import AdamW8bit

    count, side = (3, 32) if smoke else (150, 768)
    ps = [_param(side * side, side, seed=i) for i in range(count)]
    small = dict(min_8bit_size=1024) if smoke else {}
    return _routed(AdamW8bit(ps, lr=1e-3, weight_decay=0.01, **small).step)


def _gpt(smoke: bool) -> Step:
    """The step closure `_step_sections._gpt_step_ms` builds and times: its timer is replaced
    by one that keeps the closure (run_all.py's sizes: 12x768, batch 8x1024)."""
    from unittest import mock

    import _step_sections
    import torch

    from qshard.train.model import GPTConfig

    layers, embd, context, batch = (1, 48, 16, 2) if smoke else (12, 768, 1024, 8)
    cfg = GPTConfig(vocab_size=256, context=context, n_layer=layers, n_head=12, n_embd=embd)
    data = torch.randint(0, 256, (batch, context + 1), device=D.DEVICE)
    built: list[Step] = []

    def keep(fn: Step, repeat: int) -> float:
        built.append(fn)
        return 0.0

    with mock.patch.object(_step_sections, "_ms", keep):
        _step_sections._gpt_step_ms(GPT_CODECS, cfg, data, 1)
    return built[0]


BUILDERS: dict[str, Callable[[bool], Step]] = {
    "step8": _step8,
    "step4": _step4,
    "torch_adamw": _torch_adamw,
    "qgz": _qgz,
    "many8": _many8,
    "gpt": _gpt,
}


def ncu_target(name: str, smoke: bool) -> None:
    import torch

    step = BUILDERS[name](smoke)
    for _ in range(WARMUP):
        step()
    D._sync()
    cuda = D.DEVICE == "cuda"
    t0 = time.perf_counter()
    if cuda:
        torch.cuda.profiler.start()
    step()
    D._sync()
    if cuda:
        torch.cuda.profiler.stop()
    print(f"[target] {name}: profiled call took {time.perf_counter() - t0:.2f} s", flush=True)


class _Md:
    """Markdown appended to a file and flushed at once (a killed child keeps what it wrote)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, text: str) -> None:
        with open(self.path, "a") as f:
            f.write(text.rstrip("\n") + "\n\n")


def _kernel_us(evt) -> float:
    """Device time (us) of a key_averages entry that is device work (a kernel, a copy), as
    torch's table sums its "Self CUDA time total" (user annotations and CPU ops: 0)."""
    from torch.autograd import DeviceType

    if evt.device_type == DeviceType.CPU or getattr(evt, "is_user_annotation", False):
        return 0.0
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(evt, attr):
            return float(getattr(evt, attr))
    return 0.0


def _profile_tables(prof, steps: int, wall_s: float, md: _Md) -> None:
    avgs = prof.key_averages()
    busy_ms = sum(_kernel_us(e) for e in avgs) / 1e3 / steps
    md(
        f"wall {wall_s / steps * 1e3:.2f} ms/step under the profiler ({steps} steps, one "
        f"synchronize after the last); device work {busy_ms:.2f} ms/step"
    )
    md(
        "Sort by self_cpu_time_total:\n\n```\n"
        + avgs.table(sort_by="self_cpu_time_total", row_limit=25)
        + "\n```"
    )
    errors = []
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            table = avgs.table(sort_by=key, row_limit=25)
        except Exception as e:
            errors.append(f"{key}: {D._err(e)}")
            continue
        md(f"Sort by {key}:\n\n```\n{table}\n```")
        break
    else:
        md("Device-time table unavailable: " + "; ".join(errors))
    rows = []
    for e in avgs:
        if e.key in SYNC_EVENTS or "LaunchKernel" in e.key:
            rows.append((e.key, e.count, f"{e.count / steps:g}", f"{e.cpu_time_total / 1e3:.3f}"))
    md(
        "Host-device syncs and launches (the script's own torch.cuda.synchronize() after the "
        "last step is one cudaDeviceSynchronize):\n\n"
        + md_table(
            ["event", "count", "per step", "total CPU ms"], sorted(rows) or [("none", 0, "0", "")]
        )
    )


def _sync_debug(step: Step, md: _Md) -> None:
    """One step under torch.cuda.set_sync_debug_mode("warn"): every synchronizing call
    warns; each warning's source line and the Python stack above it are recorded."""
    import warnings

    import torch

    seen: list[tuple[str, str, str]] = []

    def hook(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if not f.filename.endswith(("warnings.py", "_profile_target.py"))
        ]
        top = " <- ".join(
            f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[::-1][:4]
        )
        seen.append((f"{filename}:{lineno}", str(message).splitlines()[0][:80], top))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    D._sync()
    counts = Counter(seen)
    rows = [(n, src, msg, top) for (src, msg, top), n in counts.most_common(10)]
    md(
        f"set_sync_debug_mode('warn'), one step: {len(seen)} synchronizing calls, "
        f"{len(counts)} distinct (first 10 by count):\n\n"
        + md_table(
            ["count", "warned at", "message", "stack top (innermost first)"],
            rows or [(0, "", "", "")],
        )
    )


def torch_target(name: str, smoke: bool, out: str) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    md = _Md(out)
    steps = TORCH_WORKLOADS[name][0]
    cuda = D.DEVICE == "cuda"
    where = torch.cuda.get_device_name(0) if cuda else "CPU (smoke)"
    md(f"torch {torch.__version__}, triton {_triton_version()}, {where}")
    t0 = time.perf_counter()
    step = BUILDERS[name](smoke)
    for _ in range(WARMUP):
        step()
    D._sync()
    md(f"built + {WARMUP} warm-up steps: {time.perf_counter() - t0:.1f} s")
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        D._sync()
        wall_s = time.perf_counter() - t0
    _profile_tables(prof, steps, wall_s, md)
    try:
        _sync_debug(step, md)
    except Exception as e:
        md(f"set_sync_debug_mode('warn'): unavailable ({D._err(e)})")


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "not installed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["ncu", "torch"])
    parser.add_argument("name", choices=sorted(BUILDERS))
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, toy sizes")
    parser.add_argument("--out", help="markdown file (torch mode)")
    parser.add_argument("--cap-s", type=float, help="dump every thread's stack just before this")
    args = parser.parse_args(argv)
    if args.cap_s:
        faulthandler.dump_traceback_later(max(args.cap_s - 2, 1), exit=False)
    if args.smoke:  # before the first kernel import: Triton picks interpreter vs compiler then
        os.environ["TRITON_INTERPRET"] = "1"
        D.DEVICE = "cpu"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
        D.DEVICE = "cuda"
    if args.mode == "ncu":
        ncu_target(args.name, args.smoke)
    else:
        torch_target(args.name, args.smoke, args.out or os.devnull)
    return 0


if __name__ == "__main__":
    sys.exit(main())
