"""Every GPU claim of qshard in one prepared run on a CUDA machine (issue 8).

ON THE DEVICE (one H200, ~10 minutes of device time in all), from the repository root:

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/gpu/run_all.py

(device tool: `run` with timeout_s=600; the default --budget-s 510 ends the run, summary
written, well before that). Output directory: `$OUT` when set (the device tool copies back
what is under it), else `--out-dir`, else a new /tmp/qshard-gpu-* directory; it receives
at most five files (the tool returns 8):

- summary.md: each section's status (ok / failed / timeout / crashed / skipped), seconds,
  and the traceback or log tail of each that was not ok;
- results.md: every table, in section order (paste into docs/RESULTS.md; `--out-md FILE`
  also writes a copy there);
- results.json: the same data (environment facts, tables, errors) for scripts;
- logs.txt: each section's stdout/stderr (tail); a section stopped at its cap has every
  thread's stack dumped there by faulthandler;
- all rewritten after every section and every 5 s while one runs, so a run killed from
  outside still leaves what was measured ("IN PROGRESS" in summary.md says it was killed).

Sections, most valuable first, each in its own child process (a CUDA error or a hung kernel
poisons only its own process) with its own time cap, all within the global --budget-s:

1. env: torch / triton / CUDA / driver versions, GPU name, SMs, memory, L2, clocks,
   `nvidia-smi` (run first; without CUDA the run stops there with status 2);
2. correctness: each Triton kernel vs the torch reference path on CUDA tensors, bit for bit;
3. kernels: GB/s of bytes read + written per kernel (quantize/dequantize INT8/INT4, signs,
   qgZ reorder+quantize) and the fraction of a same-run device-to-device copy (the HBM
   bandwidth actually reachable). Target (H200): >= 0.70;
4. adamw8bit: one 8-bit AdamW step (kernel alone and whole `AdamW8bit.step()`) vs
   torch.optim.AdamW(fused=True) on 128M parameters. Target: <= 1.0x;
5. adamw4bit: the fused 4-bit step (`AdamW4bit.step()`) vs the same baseline;
6. qgz_middle_hop: qgZ's fused dequantize+reduce+requantize on wire rows vs a plain
   dequantize of the same codes (target <= 1.3x) and vs the unfused torch path;
7. qgz_reduce_scatter: qgZ's whole reduce-scatter as one rank of 2 nodes x 4 computes it
   (all-to-alls replaced by local copies): fused vs RowCodec on plain kernels vs torch, bit for
   bit, fused calls counted;
8. gpu_tests: `pytest tests/gpu` (not slow) on the GPU: the interpreter-verified tests on the
   real kernels;
9. gpt_step: a single-GPU training step of qshard's GPT with the quantized paths on vs
   fp32 AdamW (qwZ/qgZ codecs per FSDP unit: one flat buffer a transformer block);
9b. onebit_round: the 1-bit compressed all-reduce's vectorized round (the accelerators'
   default) vs the per-tensor one (the CPU's) in a world of one, results cross-checked, and
   OneBitAdam's compressed step vs torch's fused Adam;
9c. step_in_backward: the same GPT under FSDP2 (`shard()` in a world of one), the optimizer
    (torch's fused AdamW, AdamW8bit) stepped after backward and inside it (StepInBackward):
    the final parameters compared bit for bit, and ms/step (no memory figure: on one device
    every unit lands at the end of backward);
10. sweep: benchmarks/gpu/sweep.py's tables (launch geometry and encoder variants of the
    optimizer and quantize kernels, each byte-checked against the default; ~100 s);
11. sm90_ptx: tests/gpu/test_compile_sm90.py (sm_90 cubins, IEEE div/sqrt, no FMA, v4 loads)
    with the device's triton.

Timings: CUDA events around each call after warm-up calls (median of --repeat).

Layout: this file holds the orchestration and the environment, correctness, kernel-bandwidth,
test and sweep sections; `_step_sections.py` the optimizer-step and GPT-step sections,
`_qgz_sections.py` the qgZ ones, `_onebit_sections.py` the 1-bit one, `_sib_sections.py`
the StepInBackward one, `_device.py` the device the sections run on and their shared
helpers, `_harness.py` the child-process machinery.

    python benchmarks/gpu/run_all.py [--quick] [--budget-s 510] [--sections a,b] [--skip c]
                                     [--cap name=SECONDS] [--out-dir DIR] [--out-md FILE]
    python benchmarks/gpu/run_all.py --smoke       # = --dry-run

Without CUDA it stops after `env` with status 2 and says so. `--smoke` (`--dry-run`) runs
every section on CPU under Triton's interpreter at toy sizes, to check the script and its
control flow, not to measure. `QSHARD_GPU_RUN_INJECT="kernels=raise,adamw4bit=hang"` (modes
raise / hang / crash) makes sections fail on purpose, to test that the others' results
survive (tests/gpu/test_benchmark_smoke.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
if importlib.util.find_spec("qshard") is None:  # not installed (the device machine): the tree's
    sys.path.insert(0, os.path.join(REPO, "src"))

import _device as D  # noqa: E402
import _harness  # noqa: E402
from _device import _err, _gbs, _ms, _Rows, _TorchPath  # noqa: E402
from _harness import Recorder, Section  # noqa: E402
from _onebit_sections import onebit_round  # noqa: E402
from _qgz_sections import (  # noqa: E402
    _qgz_rows_correctness,
    qgz_first_hop,
    qgz_middle_hop,
    qgz_reduce_scatter,
)
from _sib_sections import step_in_backward  # noqa: E402
from _step_sections import adamw4bit, adamw8bit, gpt_step  # noqa: E402


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


def env(rec: Recorder, args) -> None:
    """Environment facts first, each guarded: whatever can be read is recorded."""
    import platform

    facts: dict[str, object] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "argv": sys.argv,
        "env": {
            k: v
            for k, v in os.environ.items()
            if k.startswith(("CUDA", "TRITON", "QSHARD", "NVIDIA", "PYTORCH"))
        },
    }
    rec.fact(**facts)

    def guarded(key: str, fn) -> None:
        try:
            rec.fact(**{key: fn()})
        except Exception as e:
            rec.fact(**{key: f"unavailable ({_err(e)})"})

    def git() -> str:
        out = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", REPO, "status", "--short"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() + (
            f" (+{len(dirty.stdout.splitlines())} changed files)" if dirty.stdout else ""
        )

    guarded("git", git)
    import torch

    rec.fact(
        torch=torch.__version__, torch_cuda=torch.version.cuda, torch_git=torch.version.git_version
    )
    guarded("cudnn", lambda: torch.backends.cudnn.version())
    guarded("triton", lambda: __import__("triton").__version__)
    guarded("numpy", lambda: __import__("numpy").__version__)
    rec.fact(
        cuda_available=torch.cuda.is_available(),
        triton_interpret=os.environ.get("TRITON_INTERPRET"),
    )
    rows = [(k, v) for k, v in rec.facts.items() if k not in ("env", "argv")]
    if torch.cuda.is_available():
        guarded("device_count", torch.cuda.device_count)
        guarded("driver_version", _driver_version)
        guarded("cuda_runtime", lambda: torch._C._cuda_getCompiledVersion())
        props = torch.cuda.get_device_properties(0)
        p = {
            a: getattr(props, a)
            for a in dir(props)
            if not a.startswith("_") and not callable(getattr(props, a))
        }
        rec.fact(device_properties=p)
        guarded("capability", lambda: torch.cuda.get_device_capability(0))
        guarded("sm_clock_mhz_nvml", lambda: torch.cuda.clock_rate(0))
        guarded("mem_get_info", lambda: torch.cuda.mem_get_info(0))
        # A first context, allocation and kernel: a broken install fails here, named.
        x = torch.ones(1 << 20, device="cuda")
        rec.fact(first_kernel_sum=float((x * 2).sum()))
        rows += [
            ("GPU", props.name),
            ("SMs", props.multi_processor_count),
            ("memory GiB", f"{props.total_memory / 2**30:.1f}"),
            ("L2 MiB", f"{getattr(props, 'L2_cache_size', 0) / 2**20:.0f}"),
            ("driver", rec.facts.get("driver_version")),
            ("SM clock (NVML)", rec.facts.get("sm_clock_mhz_nvml")),
        ]
    rec.table("Environment", ["fact", "value"], rows)
    smi = []
    for cmd in (
        ["nvidia-smi"],
        [
            "nvidia-smi",
            "--query-gpu=name,driver_version,pstate,clocks.sm,clocks.mem,clocks.max.sm,"
            "clocks.max.mem,power.limit,temperature.gpu,memory.total,ecc.mode.current",
            "--format=csv",
        ],
    ):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
            smi.append(f"$ {' '.join(cmd)}\n{out.stdout}{out.stderr}")
        except Exception as e:
            smi.append(f"$ {' '.join(cmd)}: {_err(e)}")
    rec.fact(nvidia_smi="\n".join(smi))
    print("\n".join(smi), flush=True)
    tv = str(rec.facts.get("triton", ""))
    try:
        tv_minor = tuple(int(x) for x in tv.split(".")[:2])
    except ValueError:  # "unavailable (...)" or a local build's odd version string
        tv_minor = None
    if tv_minor is not None and tv_minor not in _TESTED_TRITON:
        tested = " and ".join(".".join(map(str, v)) for v in _TESTED_TRITON)
        rec.note(
            f"note: triton {tv} here; qshard's kernels need triton >= 3.6 and are tested on "
            f"{tested} (README, docs/gpu.md)"
        )


# The triton versions README and docs/gpu.md say the kernels are tested on; env notes others.
_TESTED_TRITON = ((3, 6), (3, 9))


def _driver_version() -> str:
    """The NVIDIA driver version, from the first source that answers: nvidia-smi, NVML (torch
    2.11 has no `torch._C._cuda_getDriverVersion`, which this read before)."""
    errors = []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        first = out.stdout.strip().splitlines()[:1]
        if out.returncode == 0 and first and first[0].strip():
            return first[0].strip()
        errors.append(f"nvidia-smi: exit {out.returncode} {out.stderr.strip()[:80]}")
    except Exception as e:
        errors.append(f"nvidia-smi: {_err(e)}")
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception as e:
        errors.append(f"pynvml: {_err(e)}")
    raise RuntimeError("; ".join(errors))


def _pytest_section(rec: Recorder, heading: str, pytest_args: list[str]) -> None:
    """pytest in this process (a SIGINT at the cap makes it stop and still report); the
    outcome of every test as a table, failures with their message."""
    import xml.etree.ElementTree as ET

    import pytest

    xml = os.path.join(tempfile.mkdtemp(prefix="qshard-pytest-"), "junit.xml")
    os.chdir(REPO)
    rc = pytest.main([*pytest_args, "-p", "no:cacheprovider", "-q", "-rfE", f"--junitxml={xml}"])
    rows, counts = [], {}
    try:
        root = ET.parse(xml).getroot()
        for case in root.iter("testcase"):
            outcome, msg = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome, msg = tag, (el.get("message") or "")[:300]
            counts[outcome] = counts.get(outcome, 0) + 1
            if outcome != "passed":
                rows.append((f"{case.get('classname')}::{case.get('name')}", outcome, msg))
    except (OSError, ET.ParseError) as e:
        rows.append(("(no junit report)", _err(e), ""))
    counts_s = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    rec.table(
        f"{heading}: {counts_s or 'nothing ran'} (pytest exit {int(rc)})",
        ["test", "outcome", "message"],
        rows or [("all", "passed", "")],
    )
    if int(rc) not in (0, 5):
        raise RuntimeError(f"pytest exit status {int(rc)} ({counts_s})")


def gpu_tests(rec: Recorder, args) -> None:
    _pytest_section(rec, "tests/gpu on the device", args.gpu_tests.split())


def sweep_section(rec: Recorder, args) -> None:
    """benchmarks/gpu/sweep.py's tables: launch geometry and encoder variants of the optimizer
    and quantize kernels, each checked byte for byte against the default."""
    import sweep  # benchmarks/gpu, on sys.path

    n = 2 * 4096 if args.smoke else max(4096, args.params // 4096 * 4096)
    repeat = 1 if args.smoke else max(5, args.repeat // 2)
    sweep.run(n, repeat, {"step8", "step4", "quantize"}, args.smoke, lambda t: rec.table(*t))


def sm90_ptx(rec: Recorder, args) -> None:
    sel = (
        ["--co"] if args.smoke else ["-m", "slow"]
    )  # smoke: collect only (18 compiles take minutes)
    _pytest_section(rec, "sm_90 compile checks", ["tests/gpu/test_compile_sm90.py", *sel])


def correctness(rec: Recorder, args) -> None:
    import torch

    from qshard import _triton
    from qshard.quant import blockwise, signs

    dev = D.DEVICE
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(4096, 256, device=dev, generator=g) * 3
    x[1] = 0
    x[2, 5] = float("nan")
    rows = _Rows(
        rec,
        "On-device correctness (Triton vs torch reference on CUDA, bit for bit)",
        ["kernel", "equal"],
    )

    def check(name: str, fn) -> None:  # one kernel that fails to compile or run: its row says so
        try:
            rows.append((name, bool(fn())))
        except Exception as e:
            rows.append((name, _err(e)))

    def quantize(bits: int) -> bool:
        want = blockwise._quantize_blocks_reference(
            x, blockwise.qmax_for_bits(bits), "nearest", None
        )
        got = _triton.quantize_blocks(x, bits=bits)
        return torch.equal(got[0], want[0]) and torch.equal(
            got[1].nan_to_num(-1), want[1].nan_to_num(-1)
        )

    def dequantize(bits: int) -> bool:
        want = blockwise._quantize_blocks_reference(
            x, blockwise.qmax_for_bits(bits), "nearest", None
        )
        deq = _triton.dequantize_blocks(*want, bits=bits, dtype=torch.bfloat16)
        with _TorchPath():
            ref_deq = blockwise.dequantize_blocks(*want, bits=bits, dtype=torch.bfloat16)
        return torch.equal(deq.nan_to_num(0), ref_deq.nan_to_num(0))

    def fused_pack() -> bool:
        want = blockwise._quantize_blocks_reference(x, 7, "nearest", None)
        packed, _ = _triton.quantize_blocks(x, bits=4, pack=True)
        with _TorchPath():
            ref_packed = blockwise.pack_int4(want[0])
        return torch.equal(packed.view(-1), ref_packed)

    def pack_signs() -> bool:
        v = torch.randn(1_000_003, device=dev, generator=g)
        with _TorchPath():
            ref_signs = signs.pack_signs(v)
        return torch.equal(_triton.pack_signs(v), ref_signs)

    for bits in (8, 4):
        check(f"INT{bits} quantize", lambda bits=bits: quantize(bits))
        check(f"INT{bits} dequantize -> bf16", lambda bits=bits: dequantize(bits))
    check("INT4 fused pack", fused_pack)
    check("pack_signs", pack_signs)
    try:
        for row in _qgz_rows_correctness(g):
            rows.append(row)
    except Exception as e:
        rows.append(("qgZ wire-row kernels", _err(e)))
    bad = [r[0] for r in rows if r[1] is not True]
    if bad:
        raise RuntimeError(f"not bit-exact or failed on the device: {', '.join(bad)}")


def kernels(rec: Recorder, args) -> None:
    import torch

    from qshard import _triton
    from qshard.quant import blockwise

    n = args.numel
    bs = 256
    rep = args.repeat
    src = torch.randn(n, device=D.DEVICE)
    dst = torch.empty_like(src)
    copy_ms = _ms(lambda: dst.copy_(src), rep)
    copy_gbs = _gbs(8 * n, copy_ms)
    nb = n // bs
    x_bf16 = src.bfloat16()
    c8, s8 = _triton.quantize_flat(src, block_size=bs, bits=8)
    c4, s4 = _triton.quantize_flat(src, block_size=bs, bits=4, pack=True)
    out32 = torch.empty(n, device=D.DEVICE)
    out16 = torch.empty(n, device=D.DEVICE, dtype=torch.bfloat16)
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
    off, lens = off.to(D.DEVICE), lens.to(D.DEVICE)
    first_hop, _ = qgz_first_hop(src, off, lens, slot, bs, per_node, math.gcd(size, slot))
    cases.append(("qgZ reorder+INT4 quantize (2x4)", first_hop, 4 * n + n // 2 + 4 * nb))
    rows = []
    heading = (
        f"Kernel bandwidth, {n / 1e6:.0f}M elements, block 256 "
        f"(copy: {copy_gbs:.0f} GB/s; target >= 0.70)"
    )
    for name, fn, nbytes in cases:
        try:  # one kernel that fails must not lose the others' rows
            ms = _ms(fn, rep)
            gbs = _gbs(nbytes, ms)
            rows.append((name, f"{ms:.3f}", f"{gbs:.0f}", f"{gbs / copy_gbs:.2f}"))
        except Exception as e:
            rows.append((name, _err(e), "", ""))
        rec.table(heading, ["kernel", "ms", "GB/s", "x copy"], rows)
    if any(not r[2] for r in rows):
        raise RuntimeError("some kernels failed: " + "; ".join(r[0] for r in rows if not r[2]))


# (name, function, cap in seconds for a full run, what) in order of value: see the docstring.
SECTIONS = [
    ("env", env, 45, "versions, GPU, clocks, nvidia-smi"),
    ("correctness", correctness, 75, "kernels vs torch path on CUDA, bit for bit"),
    ("kernels", kernels, 75, "quantize/dequantize GB/s vs copy bandwidth"),
    ("adamw8bit", adamw8bit, 60, "8-bit AdamW step vs torch fused AdamW"),
    ("adamw4bit", adamw4bit, 45, "4-bit AdamW step vs torch fused AdamW"),
    ("qgz_middle_hop", qgz_middle_hop, 45, "qgZ fused middle hop vs dequantize / torch"),
    ("qgz_reduce_scatter", qgz_reduce_scatter, 60, "qgZ reduce-scatter per rank, 3 paths"),
    ("gpu_tests", gpu_tests, 150, "pytest tests/gpu on the GPU"),
    ("gpt_step", gpt_step, 75, "GPT training step, quantized paths vs fp32"),
    ("onebit_round", onebit_round, 40, "1-bit all-reduce: vectorized vs per-tensor round"),
    ("step_in_backward", step_in_backward, 50, "StepInBackward on CUDA: same bits, time"),
    ("sweep", sweep_section, 110, "launch geometry / encoder variants (benchmarks/gpu/sweep.py)"),
    ("sm90_ptx", sm90_ptx, 60, "sm_90 AOT compile + PTX checks (slow test)"),
]
_FNS = {name: fn for name, fn, _, _ in SECTIONS}

# What tests/gpu runs on the device (most valuable first); the smoke run takes one quick test.
GPU_TESTS = (
    "tests/gpu/test_blockwise.py tests/gpu/test_optim8bit.py tests/gpu/test_optim4bit.py "
    "tests/gpu/test_qgz.py tests/gpu/test_signs.py tests/gpu/test_dispatch.py "
    "tests/gpu/test_qgz_dispatch.py tests/gpu/test_search_table.py -x --maxfail=20"
)
GPU_TESTS_SMOKE = "tests/gpu/test_signs.py::test_unpack_rejects_wrong_byte_count"
DEFAULT_BUDGET_S = 510  # 8.5 min: the device tool's command limit is 10 min


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a short GPU run)")
    parser.add_argument(
        "--smoke",
        "--dry-run",
        action="store_true",
        help="check the script itself on CPU under TRITON_INTERPRET=1 with tiny sizes "
        "(its numbers mean nothing)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"the whole run's time limit in seconds (default {DEFAULT_BUDGET_S})",
    )
    parser.add_argument("--sections", help="comma-separated sections to run (default: all)")
    parser.add_argument("--skip", default="", help="comma-separated sections to leave out")
    parser.add_argument(
        "--cap",
        action="append",
        default=[],
        metavar="NAME=SECONDS",
        help="override a section's time cap (repeatable)",
    )
    parser.add_argument(
        "--out-dir",
        help="where the results go (default: $OUT, else a new /tmp/qshard-gpu-* directory)",
    )
    parser.add_argument("--out-md", metavar="FILE", help="also copy results.md to FILE")
    parser.add_argument("--gpu-tests", help="pytest arguments of the gpu_tests section")
    parser.add_argument("--repeat", type=int, help="timed calls per measurement")
    # The child side (one section in this process): set by the parent.
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--deadline-s", type=float, help=argparse.SUPPRESS)
    return parser


def _sizes(args) -> None:
    if args.smoke:
        args.numel, args.params, repeat = 1 << 13, 4 * 4096, 1
        args.layers, args.embd, args.context, args.batch = 1, 48, 16, 2
    else:
        args.numel = 1 << (24 if args.quick else 28)  # 16M or 256M elements (1 GiB of fp32)
        args.params = 16 * 4096 * 256 if args.quick else 128 * 1024 * 1024  # 128M parameters
        repeat = 5 if args.quick else 20
        args.layers, args.embd = (2, 768) if args.quick else (12, 768)
        args.context, args.batch = 1024, 8
    args.repeat = args.repeat or repeat
    if not args.gpu_tests:
        args.gpu_tests = GPU_TESTS_SMOKE if args.smoke else GPU_TESTS


def _child(args) -> int:
    if args.smoke:
        # Must precede the first kernel import: Triton picks interpreter vs compiler then.
        os.environ["TRITON_INTERPRET"] = "1"
        D.DEVICE = "cpu"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
        D.DEVICE = "cuda"
    _sizes(args)
    fn = _FNS[args.section]
    return _harness.run_child_section(
        args.scratch, args.section, lambda rec: fn(rec, args), args.deadline_s
    )


def _selected(args) -> list[Section]:
    caps = {}
    for item in args.cap:
        name, _, secs = item.partition("=")
        caps[name] = float(secs)
    names = [s for s in (args.sections or "").split(",") if s] or [s[0] for s in SECTIONS]
    skip = {s for s in args.skip.split(",") if s}
    unknown = (set(names) | skip | set(caps)) - set(_FNS)
    if unknown:
        sys.exit(f"unknown sections {sorted(unknown)}; known: {[s[0] for s in SECTIONS]}")
    if "env" not in names:
        names = ["env", *names]  # the facts are always recorded
    out = []
    for name, _, cap, what in SECTIONS:  # always in the order of value
        if name in names and name not in skip:
            out.append(Section(name, caps.get(name, cap * (2 if args.smoke else 1)), what))
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.section:
        return _child(args)
    if not args.smoke and os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run_all.py measures GPU kernels; unset TRITON_INTERPRET (it is 1)")
    out_dir = args.out_dir or os.environ.get("OUT") or tempfile.mkdtemp(prefix="qshard-gpu-")
    os.makedirs(out_dir, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="qshard-gpu-sections-")
    sections = _selected(args)
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    paths = [p for p in (env.get("PYTHONPATH"), os.path.join(REPO, "src")) if p]
    if importlib.util.find_spec("qshard") is not None:
        paths = paths[:1]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if args.smoke:
        env["TRITON_INTERPRET"] = "1"
    passthrough = [
        *(["--smoke"] if args.smoke else []),
        *(["--quick"] if args.quick else []),
        *(["--repeat", str(args.repeat)] if args.repeat else []),
        *(["--gpu-tests", args.gpu_tests] if args.gpu_tests else []),
    ]

    def child_cmd(sec: Section, cap: float) -> list[str]:
        return [
            sys.executable,
            os.path.abspath(__file__),
            "--section",
            sec.name,
            "--scratch",
            scratch,
            "--deadline-s",
            f"{cap:.0f}",
            *passthrough,
        ]

    def stop_after(entry: dict) -> str | None:
        if entry["section"] != "env" or args.smoke:
            return None
        facts = orch.section_data("env").get("facts", {})
        if facts.get("cuda_available") is not True:
            return "no CUDA device (env: torch.cuda.is_available() is not True)"
        return None

    mode = (
        "smoke (CPU, Triton interpreter, toy sizes)"
        if args.smoke
        else ("quick" if args.quick else "full")
    )
    orch = _harness.Orchestrator(
        out_dir=out_dir,
        scratch=scratch,
        budget_s=args.budget_s,
        child_cmd=child_cmd,
        child_env=env,
        title="qshard GPU run (benchmarks/gpu/run_all.py)",
        header_lines=[
            f"- command: `{' '.join(sys.argv)}`",
            f"- date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
            f"- mode: {mode}; budget {args.budget_s:.0f} s; output {out_dir}",
        ],
    )
    print(f"[run_all] writing to {out_dir} ({mode}, budget {args.budget_s:.0f} s)", flush=True)
    results = orch.run(sections, stop_after=stop_after)
    if args.out_md:
        os.makedirs(os.path.dirname(os.path.abspath(args.out_md)), exist_ok=True)
        with open(os.path.join(out_dir, "results.md")) as src, open(args.out_md, "w") as dst:
            dst.write(src.read())
    bad = [r for r in results if r["status"] != _harness.OK]
    print(
        f"[run_all] done: {len(results) - len(bad)}/{len(results)} sections ok; "
        f"summary in {os.path.join(out_dir, 'summary.md')}",
        flush=True,
    )
    if not args.smoke and results and results[0]["section"] == "env":
        facts = orch.section_data("env").get("facts", {})
        if facts.get("cuda_available") is not True:
            sys.stderr.write(
                "run_all.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                f"environment facts are in {out_dir}\n"
            )
            return 2
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
