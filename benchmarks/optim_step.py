"""Time one optimizer step of 8-bit AdamW against fp32 AdamW, side by side in one run.

For each size (default ~10M and ~50M parameters, as one (N/1024, 1024) fp32 matrix), each
optimizer gets its own copy of the same parameter and gradient, takes ``--warmup`` untimed steps
(the first creates the state), then ``--repeat`` rounds of one step of every optimizer,
interleaved, so a change of the shared host's speed during the run hits all of them alike (the
same optimizer timed in separate blocks moved by up to 1.7x between runs here). All run with the
same number of threads. Columns: ns per parameter (median step), ratio to
``torch.optim.AdamW(fused=True)`` (median of the per-round ratios), optimizer-state bytes per
parameter, and the memory-traffic limit (below). bitsandbytes' 8-bit and torchao's 8-bit and
4-bit AdamW are included when importable and skipped (with a note) otherwise. Each table's notes
give the host load average before and after it (the machine is shared).

At the sizes in ``--fp32-sizes`` (default 10M) the table also times the fp32-state path of
``AdamW8bit``: the 2-D parameter with ``optim_bits=32`` and a 1-D parameter of the same size
(fp32 state by rule), each with the default flags (torch's default, the for-loop update on CPU,
also timed as a torch row) and with ``fused=True``.

Memory-traffic limit (this benchmark's definition): the bytes a step must move per parameter,
every tensor read once and every updated tensor written once (fp32 AdamW: p, g, m, v read and
p, m, v written = 28 B; 8-bit AdamW: p, g read, p written, two code bytes read and written and
the two absmaxes per 256 elements = 16.06 B; write-allocate traffic not counted), divided by the
streaming bandwidth of the machine: an in-place triad ``a += s*b`` on two fp32 arrays of 64M
elements (512 MiB in all, out of every cache; at 10M elements part of the pair stayed cached and
measured 2x more) at the same thread count, 12 B per element (a and b read, a written), three
times in each interleaved round; the best of all is the bandwidth (a bound is optimistic, and on
the shared host a single sample moved by up to 7x). In place, as every optimizer here writes: a
triad into a third array also pays the write-allocate reads of it and measured ~1.5x less
bandwidth on this host. ``limit x fused`` is the bound over the fused fp32 step's median time
(the best ratio the state format allows), ``x limit`` the median step time over the bound.

With ``--phases`` it times instead where AdamW8bit's step goes: variants of the fused kernel
built from the same C source with one phase taken out by a ``-DQS_PHASE_*`` define (see the
timing hooks in ``qshard.optim._kernels``; each writes wrong values, so it is timing only),
side by side with the full kernel and the fused fp32 step in interleaved rounds. A phase's cost
is the median over rounds of (full step - variant); phases overlap in the core, so the costs
need not add up to the step.

    python benchmarks/optim_step.py                       # 10M and 50M, all threads
    python benchmarks/optim_step.py --phases --sizes 10M --threads 1 --cpu-time
    python benchmarks/optim_step.py --sizes 1M --threads 1,2 --out-md /tmp/optim_step.md
    python benchmarks/optim_step.py --models gpt2,lora,lora8,small --threads 1,2 --cpu-time

With ``--models`` each table is instead one model's parameter list (GPT-2 small, LoRA adapters
of rank 16 and 8, 2,000 small matrices; ``MODELS``), where what a step costs per tensor shows:
the same candidates, plus qshard's 8- and 4-bit AdamW with one kernel call per tensor (what a step cost
before the multi-tensor call).

Target (issue 3): AdamW8bit <= 3x fused fp32 AdamW on CPU; state <= 2.04 bytes/param.
Targets (issue 15): the fp32-state path <= 1.1x fused fp32 AdamW; the 8-bit step <= 1.2x.
Target (issue 17): AdamW4bit <= 2x fused fp32 AdamW on CPU; state <= 1.1 bytes/param.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Report, add_report_args, at_least, cpu_vendor, vector_isa
from qshard import _native
from qshard.optim import AdamW4bit, AdamW8bit, _kernels, optimizer_state_bytes
from qshard.optim._base8bit import _QuantizedPlan


def _parse_size(s: str) -> int:
    """``10M`` -> 10,000,000 (K, M, G suffixes); an empty or malformed size is an error naming
    it (``--sizes 10M,`` raised IndexError)."""
    text = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    try:
        size = int(float(text[:-1] if mult != 1 else text) * mult)
    except ValueError:
        size = 0
    if size <= 0:
        raise SystemExit(
            f"optim_step.py: bad size {s!r}: pass a positive count such as 10M or 500K"
        )
    return size


def _candidates() -> tuple[list[tuple[str, Callable]], list[str]]:
    """(name, factory(params) -> optimizer) of everything available, and notes on skips."""
    out: list[tuple[str, Callable]] = [
        ("torch AdamW fused (fp32)", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)),
        ("torch AdamW foreach (fp32)", lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)),
        ("qshard AdamW8bit", lambda ps: AdamW8bit(ps, lr=1e-3)),
        ("qshard AdamW4bit", lambda ps: AdamW4bit(ps, lr=1e-3)),
    ]
    notes = []
    try:
        import bitsandbytes as bnb

        out.append(("bitsandbytes AdamW8bit", lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3)))
    except Exception as e:  # not installed, or no CPU backend
        notes.append(f"bitsandbytes skipped ({type(e).__name__}: {e})")
    try:
        from torchao.optim import AdamW4bit as AoAdamW4bit
        from torchao.optim import AdamW8bit as AoAdamW8bit

        out.append(("torchao AdamW8bit", lambda ps: AoAdamW8bit(ps, lr=1e-3)))
        out.append(("torchao AdamW4bit", lambda ps: AoAdamW4bit(ps, lr=1e-3)))
    except Exception as e:
        notes.append(f"torchao skipped ({type(e).__name__}: {e})")
    return out, notes


# Minimum bytes a step moves per parameter (module docstring), by row name; None: not derived.
_FP32_BYTES = 28.0
_8BIT_BYTES = 16.0 + 2 * 2 * 4 / 256
_TRIAD_BYTES = 12.0


def _traffic_bytes(name: str) -> float | None:
    if "fp32" in name or "optim_bits=32" in name or "1-D" in name:
        return _FP32_BYTES
    if "8bit" in name:
        return _8BIT_BYTES
    return None


def _fp32_state_candidates() -> list[tuple[str, Callable, bool]]:
    """(name, factory, 1-D parameter?): AdamW8bit's fp32-state path and torch's default."""
    return [
        ("torch AdamW default flags (fp32)", lambda ps: torch.optim.AdamW(ps, lr=1e-3), False),
        ("qshard AdamW8bit optim_bits=32", lambda ps: AdamW8bit(ps, optim_bits=32), False),
        (
            "qshard AdamW8bit optim_bits=32 fused=True",
            lambda ps: AdamW8bit(ps, optim_bits=32, fused=True),
            False,
        ),
        ("qshard AdamW8bit 1-D", lambda ps: AdamW8bit(ps, lr=1e-3), True),
        ("qshard AdamW8bit 1-D fused=True", lambda ps: AdamW8bit(ps, fused=True), True),
    ]


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    # Counts every tensor in the state, including tensor subclasses (torchao) by storage size.
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                inner = [v] if type(v) is torch.Tensor else None
                if inner is None and hasattr(v, "__tensor_flatten__"):
                    names, _ = v.__tensor_flatten__()
                    inner = [getattr(v, n) for n in names]
                for t in inner or [v]:
                    total += t.numel() * t.element_size()
    return total if total else optimizer_state_bytes(opt)


def _problem(size: int, args: argparse.Namespace):
    """The timed problem of one table: a (size/1024, 1024) parameter and gradient (seeded, with
    the generator for more draws), the clock (process CPU time for one-thread tables with ``--cpu-time``), and the load before."""
    cols = 1024
    rows = max(size // cols, 1)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(rows, cols, generator=gen)
    grad = torch.randn(rows, cols, generator=gen) * 1e-2
    cpu_time = args.cpu_time and torch.get_num_threads() == 1
    clock = time.process_time if cpu_time else time.perf_counter
    return rows * cols, gen, base, grad, cpu_time, clock, os.getloadavg()


def _rounds(opts, repeat: int, clock, before: Callable[[], None] | None = None):
    """Rounds of one step per optimizer, interleaved, so a change of machine speed during the
    run (shared host) hits every optimizer alike (the ratio columns are medians of per-round
    ratios to the fused step of the same round); ``before`` runs first in every round. Returns
    each optimizer's step times."""
    samples: list[list[float]] = [[] for _ in opts]
    for _ in range(repeat):
        if before is not None:
            before()
        for i, opt in enumerate(opts):
            t0 = clock()
            opt.step()
            samples[i].append(clock() - t0)
    return samples


def _time_size(report: Report, candidates, size: int, args: argparse.Namespace) -> None:
    """One table: every candidate on one (size/1024, 1024) parameter, interleaved rounds."""
    numel, gen, base, grad, cpu_time, clock, load_before = _problem(size, args)
    opts = []
    for cand in candidates:
        one_d = len(cand) > 2 and cand[2]
        p = torch.nn.Parameter(base.clone().reshape(-1) if one_d else base.clone())
        p.grad = grad.clone().reshape(p.shape)
        opt = cand[1]([p])
        for _ in range(args.warmup):
            opt.step()
        opts.append(opt)
    # The streaming-bandwidth probe of the traffic limit, timed in the same rounds.
    probe = max(numel, 1 << 26)
    arrays = [torch.randn(probe, generator=gen) for _ in range(2)]

    def triad() -> None:
        arrays[0].add_(arrays[1], alpha=1e-7)

    triad()
    triads: list[float] = []

    def three_triads() -> None:
        for _ in range(3):
            t0 = clock()
            triad()
            triads.append(clock() - t0)

    samples = _rounds(opts, args.repeat, clock, before=three_triads)
    per_byte = min(triads) / (_TRIAD_BYTES * probe)  # seconds per byte at the best bandwidth
    fused_s = statistics.median(samples[0])
    rows_out = []
    for cand, opt, times in zip(candidates, opts, samples):
        name = cand[0]
        ratio = statistics.median(t / f for t, f in zip(times, samples[0]))
        ns = statistics.median(times) / numel * 1e9
        nbytes = _traffic_bytes(name)
        if nbytes is None:
            lim, vs_lim = "-", "-"
        else:
            lim = nbytes * per_byte * numel / fused_s
            vs_lim = statistics.median(times) / (nbytes * per_byte * numel)
        rows_out.append((name, ns, ratio, _state_bytes(opt) / numel, nbytes or "-", lim, vs_lim))
    del opts
    arrays.clear()
    gc.collect()
    bw = 1.0 / per_byte / 1e9
    report.table(
        f"{numel / 1e6:.1f}M parameters, {torch.get_num_threads()} threads, "
        f"{'CPU' if cpu_time else 'wall'} time",
        [
            "optimizer",
            "ns/param",
            "x fused fp32",
            "state bytes/param",
            "traffic B/param",
            "limit x fused",
            "x limit",
        ],
        rows_out,
    )
    report.note(
        f"In-place triad bandwidth (best of {len(triads)}): {bw:.1f} GB/s; load average before "
        f"{_load(load_before)}, after {_load(os.getloadavg())}."
    )


def _gpt2_shapes() -> list[tuple[int, ...]]:
    """GPT-2 small (124M; the token embedding tied with the output layer): 148 tensors, 50 of
    them matrices with 8-bit state, the rest biases and norms (fp32 state)."""
    d = 768
    layer = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,)]
    layer += [(4 * d, d), (d,)]
    return [(50257, d), (1024, d), *layer * 12, (d,), (d,)]


#: Parameter lists of whole models (``--models``), where a step's cost per tensor shows.
MODELS: dict[str, tuple[str, Callable[[], list[tuple[int, ...]]]]] = {
    "gpt2": ("GPT-2 small", _gpt2_shapes),
    # LoRA r=16 on q/k/v/o of a 32-layer, 4096-wide model: A (16, 4096) and B (4096, 16); the
    # B matrices' rows of 16 are each one partial block (the row-block layout).
    "lora": ("LoRA adapters, r=16, 32 layers x 4", lambda: [(16, 4096), (4096, 16)] * 128),
    "lora8": ("LoRA adapters, r=8, 32 layers x 4", lambda: [(8, 4096), (4096, 8)] * 128),
    "small": ("2,000 matrices of 16 x 256", lambda: [(16, 256)] * 2000),
}


def _one_call_per_tensor(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt`` (8- or 4-bit) stepping each quantized tensor in a kernel call of its own (what
    the step cost before the multi-tensor call): every group's plan (``_QuantizedPlan``, made
    and checked by ``_plan_quantized`` before any tensor moves) is stepped as one plan per
    tensor, the multi-tensor call taking a batch of one."""
    step_quantized = type(opt)._step_quantized

    def one_by_one(gi: int, group: dict, plan: _QuantizedPlan) -> None:
        if plan.rest:
            step_quantized(opt, gi, group, _QuantizedPlan(rest=plan.rest))
        for item, row in zip(plan.batch, plan.rows, strict=True):  # (plan.grads: held copies)
            step_quantized(opt, gi, group, _QuantizedPlan(batch=[item], rows=[row]))

    opt._step_quantized = one_by_one
    return opt


def _time_model(report: Report, candidates, model: str, args: argparse.Namespace) -> None:
    """One table: every candidate on one model's parameter list, interleaved rounds."""
    title, shapes_of = MODELS[model]
    shapes = shapes_of()
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen) * 1e-2 for s in shapes]
    numel = sum(t.numel() for t in base)
    cpu_time = args.cpu_time and torch.get_num_threads() == 1
    clock = time.process_time if cpu_time else time.perf_counter
    load_before = os.getloadavg()
    opts = []
    for cand in candidates:
        ps = [torch.nn.Parameter(b.clone()) for b in base]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt = cand[1](ps)
        for _ in range(args.warmup):
            opt.step()
        opts.append(opt)
    samples = _rounds(opts, args.repeat, clock)
    rows_out = []
    for cand, opt, times in zip(candidates, opts, samples):
        med = statistics.median(times)
        ratio = statistics.median(t / f for t, f in zip(times, samples[0]))
        rows_out.append((cand[0], med * 1e3, med / numel * 1e9, ratio, _state_bytes(opt) / numel))
    del opts
    gc.collect()
    report.table(
        f"{title}: {len(shapes)} tensors, {numel / 1e6:.1f}M parameters, "
        f"{torch.get_num_threads()} threads, {'CPU' if cpu_time else 'wall'} time",
        ["optimizer", "ms/step", "ns/param", "x fused fp32", "state bytes/param"],
        rows_out,
    )
    report.note(f"Load average before {_load(load_before)}, after {_load(os.getloadavg())}.")


#: (what is taken out, -D flags) of the --phases variants; the first is the full kernel.
_PHASES: list[tuple[str, tuple[str, ...]]] = [
    ("nothing (the full 8-bit step)", ()),
    ("decode of m and v", ("-DQS_PHASE_NO_DECODE",)),
    ("Adam update + absmax (and the p, g traffic)", ("-DQS_PHASE_NO_UPDATE",)),
    ("sqrt and division in the update", ("-DQS_PHASE_NO_DIVSQRT",)),
    ("division by the absmax in the encoder", ("-DQS_PHASE_ENCODE_MUL",)),
    ("encode of m and v", ("-DQS_PHASE_NO_ENCODE",)),
    (
        "decode, update and encode (left: loads, stores, loop)",
        ("-DQS_PHASE_NO_DECODE", "-DQS_PHASE_NO_UPDATE", "-DQS_PHASE_NO_ENCODE"),
    ),
]


def _time_phases(report: Report, size: int, args: argparse.Namespace) -> None:
    """One table: AdamW8bit with each phase taken out of the kernel, vs the full kernel."""
    libs = []
    for i, (_, defines) in enumerate(_PHASES):
        lib = _native.build_library(
            f"optim8bit_phase{i}", _kernels._SOURCE, (*_native.DEFAULT_FLAGS, *defines)
        )
        _kernels._declare(lib)
        libs.append(lib)
    numel, _, base, grad, cpu_time, clock, load_before = _problem(size, args)
    saved = _kernels.library
    try:
        fused_p = torch.nn.Parameter(base.clone())
        fused_p.grad = grad.clone()
        fused = torch.optim.AdamW([fused_p], lr=1e-3, fused=True)
        opts = []
        for _ in libs:
            p = torch.nn.Parameter(base.clone())
            p.grad = grad.clone()
            opt = AdamW8bit([p], lr=1e-3)
            _kernels.library = lambda: libs[0]  # real states: warm up with the full kernel
            for _ in range(args.warmup):
                opt.step()
            opts.append(opt)
        for _ in range(args.warmup):
            fused.step()
        samples: list[list[float]] = [[] for _ in opts]
        fused_t: list[float] = []
        for _ in range(args.repeat):
            t0 = clock()
            fused.step()
            fused_t.append(clock() - t0)
            for i, opt in enumerate(opts):
                _kernels.library = lambda lib=libs[i]: lib
                t0 = clock()
                opt.step()
                samples[i].append(clock() - t0)
    finally:
        _kernels.library = saved
    full = samples[0]
    rows_out = []
    for (what, _), times in zip(_PHASES, samples):
        ns = statistics.median(times) / numel * 1e9
        ratio = statistics.median(t / f for t, f in zip(times, fused_t))
        cost = statistics.median(a - b for a, b in zip(full, times)) / numel * 1e9
        share = cost / (statistics.median(full) / numel * 1e9)
        rows_out.append((what, ns, ratio, cost, share))
    report.table(
        f"Where AdamW8bit's step goes: {numel / 1e6:.1f}M parameters, "
        f"{torch.get_num_threads()} threads, {'CPU' if cpu_time else 'wall'} time",
        ["taken out", "ns/param", "x fused fp32", "phase cost ns/param", "share of the step"],
        rows_out,
    )
    report.note(
        f"Fused fp32 AdamW: {statistics.median(fused_t) / numel * 1e9:.3f} ns/param. "
        f"Load average before {_load(load_before)}, after {_load(os.getloadavg())}."
    )


def _cpu_title() -> str:
    """'CPU, <vendor> <vector ISA>' for a table title: the ISA picks the kernel's path and the
    vendor's cores price its operations differently, so results of hosts that differ in either
    are different sections of docs/RESULTS.md."""
    host = " ".join(x for x in (cpu_vendor(), vector_isa()) if x)
    return f"CPU, {host}" if host else "CPU"


def _load(avg: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.2f}" for x in avg) + " (1/5/15 min)"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="10M,50M", help="comma-separated parameter counts")
    ap.add_argument("--repeat", type=at_least(1), default=5, help="timed steps per optimizer")
    ap.add_argument(
        "--fp32-sizes",
        default="10M",
        help="sizes (of --sizes) whose table adds the fp32-state rows ('' for none)",
    )
    ap.add_argument(
        "--warmup",
        type=at_least(0),
        default=4,
        help="untimed steps first (the first creates the state)",
    )
    ap.add_argument(
        "--threads",
        default="0",
        help="comma-separated torch thread counts, one table each (0: leave as is)",
    )
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time one-thread tables with process CPU time instead of wall time (robust on a "
        "shared machine); tables with more threads always use wall time (CPU time would be "
        "the sum over threads)",
    )
    ap.add_argument(
        "--models",
        default="",
        help=f"comma-separated parameter lists of whole models, one table each, instead of "
        f"--sizes: {', '.join(MODELS)}",
    )
    ap.add_argument(
        "--phases",
        action="store_true",
        help="time AdamW8bit's kernel with each phase taken out instead (module docstring)",
    )
    add_report_args(ap)
    args = ap.parse_args(argv)
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (the first step creates the state)")
    try:
        thread_counts = [int(t) for t in args.threads.split(",")]
    except ValueError:
        ap.error(f"--threads takes comma-separated integers; got {args.threads!r}")
    if any(t < 0 for t in thread_counts):
        ap.error("--threads must be >= 0")
    if args.phases:
        report = Report(
            f"Optimizer step: where AdamW8bit's fused kernel spends its time ({_cpu_title()})"
        )
        if not _kernels.available():
            ap.error("--phases needs the fused kernel (a C compiler)")
        default_threads = torch.get_num_threads()
        for size in (_parse_size(s) for s in args.sizes.split(",")):
            for threads in thread_counts:
                # 0: the process's default, not the previous table's count
                torch.set_num_threads(threads or default_threads)
                _time_phases(report, size, args)
        report.write(args.out_md)
        return
    report = Report(f"Optimizer step: 8-bit AdamW vs fp32 AdamW ({_cpu_title()})")
    report.note(
        "Threads and clock of each table: in its title (the machine line gives the default)."
    )
    candidates, notes = _candidates()
    for n in notes:
        report.note(n)
    default_threads = torch.get_num_threads()
    if args.models:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        if unknown := [m for m in models if m not in MODELS]:
            ap.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
        model_candidates = []
        for name, make in candidates:
            model_candidates.append((name, make))
            if name.startswith("qshard"):
                model_candidates.append(
                    (
                        f"{name}, one call per tensor",
                        lambda ps, make=make: _one_call_per_tensor(make(ps)),
                    )
                )
        for model in models:
            for threads in thread_counts:
                torch.set_num_threads(threads or default_threads)
                _time_model(report, model_candidates, model, args)
        report.write(args.out_md)
        return
    fp32_sizes = {_parse_size(s) for s in args.fp32_sizes.split(",") if s.strip()}
    for size in (_parse_size(s) for s in args.sizes.split(",")):
        extra = _fp32_state_candidates() if size in fp32_sizes else []
        for threads in thread_counts:
            torch.set_num_threads(threads or default_threads)
            _time_size(report, candidates + extra, size, args)
    report.write(args.out_md)


if __name__ == "__main__":
    main()
