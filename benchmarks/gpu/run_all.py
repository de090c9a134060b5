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
10. sweep: benchmarks/gpu/sweep.py's tables (launch geometry and encoder variants of the
    optimizer and quantize kernels, each byte-checked against the default; ~100 s);
11. sm90_ptx: tests/gpu/test_compile_sm90.py (sm_90 cubins, IEEE div/sqrt, no FMA, v4 loads)
    with the device's triton.

Timings: CUDA events around each call after warm-up calls (median of --repeat).

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
import contextlib
import importlib.util
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

import _harness  # noqa: E402
from _harness import Recorder, Section  # noqa: E402

# "cuda" on the GPU; the smoke run switches it to "cpu" (interpreter) before any section runs.
DEVICE = "cuda"


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


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _ms(fn, repeat: int, warmup: int = 2) -> float:
    """`_harness.median_ms` on this run's device."""
    return _harness.median_ms(fn, repeat, DEVICE == "cuda", warmup)


def _gbs(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def _optimizer_dispatches_to_triton() -> bool:
    """AdamW8bit steps CUDA parameters through the Triton kernel (not the CPU C kernel)."""
    import inspect

    from qshard.optim import _base8bit

    return "_triton" in inspect.getsource(_base8bit)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


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


def adamw4bit(rec: Recorder, args) -> None:
    """The fused 4-bit AdamW step (`AdamW4bit.step()`, which dispatches CUDA parameters to
    `_triton.optim4bit_step`) vs torch's fused fp32 AdamW on the same parameters."""
    from unittest import mock

    import torch

    from qshard import _triton
    from qshard.optim import AdamW4bit

    n, rep, row = args.params, args.repeat, 4096
    rows_ = []
    heading = f"AdamW4bit step on {n / 1e6:.0f}M fp32 parameters (vs torch AdamW fused=True)"
    header = ["optimizer", "ms", "x fused fp32", "kernel calls/step", "state bytes/param"]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    p32 = torch.randn(n // row, row, device=DEVICE, generator=g)
    grad = torch.randn(n // row, row, device=DEVICE, generator=g) * 1e-2
    p_ref = torch.nn.Parameter(p32.clone())
    p_ref.grad = grad.clone()
    opt = torch.optim.AdamW([p_ref], lr=1e-3, weight_decay=0.01, fused=DEVICE == "cuda")
    t_fused = _ms(opt.step, rep)
    rows_.append(("torch AdamW(fused=True) fp32", f"{t_fused:.3f}", "1.00", "", "8"))
    rec.table(heading, header, rows_)
    del opt, p_ref
    for dtype in (torch.float32, torch.bfloat16):
        try:
            pq = torch.nn.Parameter(p32.clone().to(dtype))
            pq.grad = grad.clone().to(dtype)
            optq = AdamW4bit([pq], lr=1e-3, weight_decay=0.01)
            with (
                _route(),
                mock.patch.object(_triton, "optim4bit_step", wraps=_triton.optim4bit_step) as k,
            ):
                optq.step()  # the states exist from here on
                k.reset_mock()
                t4 = _ms(optq.step, rep)
                calls = k.call_count / (rep + 2)
            rows_.append(
                (
                    f"qshard AdamW4bit.step() {str(dtype)[6:]} params",
                    f"{t4:.3f}",
                    f"{t4 / t_fused:.2f}",
                    f"{calls:g}",
                    "~1.06",
                )
            )
            del optq, pq
        except Exception as e:
            rows_.append((f"AdamW4bit {dtype}: {_err(e)}", "", "", "", ""))
        rec.table(heading, header, rows_)


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


class _Rows(list):
    """A table's rows, written to the section's files at every append (a section stopped
    half-way keeps what it measured)."""

    def __init__(self, rec: Recorder, heading: str, header: list[str]) -> None:
        super().__init__()
        self.rec, self.heading, self.header = rec, heading, header

    def append(self, row) -> None:
        super().append(row)
        self.rec.table(self.heading, self.header, self)


@contextlib.contextmanager
def _route():
    """--smoke: CPU tensors take the CUDA dispatch (in the interpreter), as in tests/gpu."""
    if DEVICE != "cpu":
        yield
        return
    from unittest import mock

    from qshard import _triton
    from qshard.quant import _fastpath

    with (
        mock.patch.object(_triton, "serves", lambda t: True),
        mock.patch.object(_fastpath, "use_native", lambda t: False),
        mock.patch.object(_fastpath, "use_native_out", lambda t: False),
    ):
        yield


class _TorchPath:
    """References must not dispatch to the kernels they check: force qshard's torch path."""

    def __enter__(self) -> None:
        os.environ["QSHARD_DISABLE_TRITON"] = "1"

    def __exit__(self, *exc: object) -> None:
        os.environ.pop("QSHARD_DISABLE_TRITON", None)


def correctness(rec: Recorder, args) -> None:
    import torch

    from qshard import _triton
    from qshard.quant import blockwise, signs

    dev = DEVICE
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
        with _TorchPath():  # RowCodec's own sums: rows added in row order (sum_rows)
            recv = codec.encode(x)
            want_rows = codec.reduce_encode(recv, m, nodes)
            want_out = (codec.reduce(want_rows, m // nodes) * 0.125).bfloat16()
        out = torch.empty(nodes, codec.row_bytes(m // nodes), dtype=torch.uint8, device=DEVICE)
        got_rows = _triton.dequant_reduce_requant_rows(recv, block_size=bs, bits=bits, out=out)
        got_out = torch.empty(m // nodes, dtype=torch.bfloat16, device=DEVICE)
        _triton.dequant_reduce_rows(got_rows, block_size=bs, bits=bits, out=got_out, scale=0.125)
        rows.append((f"qgZ INT{bits} middle hop on wire rows", torch.equal(got_rows, want_rows)))
        rows.append((f"qgZ INT{bits} last hop -> bf16 (x 1/8)", torch.equal(got_out, want_out)))
    return rows


def kernels(rec: Recorder, args) -> None:
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
    grads = torch.randn(world * size, device=DEVICE)
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
            out = torch.empty(size, device=DEVICE)
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


def adamw8bit(rec: Recorder, args) -> None:
    import math

    import torch

    from qshard import _triton
    from qshard.quant.dynamic import dynamic_map

    n, rep = args.params, args.repeat
    bs = 256
    p32 = torch.randn(n, device=DEVICE)
    grad = torch.randn(n, device=DEVICE) * 1e-2
    rows_ = _Rows(
        rec,
        f"AdamW step on {n / 1e6:.0f}M fp32 parameters (target: 8-bit <= 1.0x fused fp32)",
        ["optimizer", "ms", "x fused fp32", "GB/s moved", "state bytes/param"],
    )
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
    from qshard.optim._qstate import qmap

    code1, code2 = dynamic_map(signed=True).to(DEVICE), dynamic_map(signed=False).to(DEVICE)
    # The maps' search tables: the encoder's one-gather path, as AdamW8bit dispatches it.
    lut1, lut2 = qmap(True).lut, qmap(False).lut
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
            lut1=lut1,
            lut2=lut2,
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
        with _route():
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


def _fsdp_units(model) -> list[list]:
    """``model``'s parameters grouped as qshard.train wraps a GPT with ``fully_shard``: one unit
    per transformer block, then the root's (embeddings, final norm, head; a tied head once)."""
    units = [[p for p in block.parameters() if p.requires_grad] for block in model.blocks]
    in_blocks = {id(p) for unit in units for p in unit}
    root = [p for p in model.parameters() if p.requires_grad and id(p) not in in_blocks]
    return [unit for unit in [*units, root] if unit]


def _copy_out(flat, tensors) -> None:
    """FSDP's copy-out: ``flat`` split into ``tensors`` (contiguous, in order), one launch."""
    import torch

    outs = [t.view(-1) for t in tensors]
    torch.split_with_sizes_copy(flat, [t.numel() for t in outs], out=outs)


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
    units = _fsdp_units(model)
    offset0 = torch.zeros(1, dtype=torch.int64, device=DEVICE)

    def step() -> None:
        # What one rank runs for qwZ (quantize its weights, dequantize the gathered ones) and
        # for qgZ (encode its gradients, decode the reduced ones), without the network: the
        # kernels' cost inside a real training step. Per FSDP unit, as ZeRO++ on FSDP2 runs
        # them: each block's (and the root's) parameters go through one flat buffer (FSDP's
        # copy-in, the codec on the whole buffer, FSDP's copy-out). Per parameter (~150 small
        # tensors, 4 launches each) the row measured Python and launch overhead instead (3.0x
        # fp32 on an H200), a cost no FSDP2 step pays.
        if codecs:
            with torch.no_grad():
                for unit in units:
                    flat = torch.cat([p.data.view(-1) for p in unit])
                    c, s = _triton.quantize_flat(flat, block_size=256, bits=8)
                    _triton.dequantize_blocks(c, s, bits=8, numel=flat.numel(), out=flat)
                    _copy_out(flat, [p.data for p in unit])
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            _, loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        if codecs:
            with torch.no_grad():
                for unit in units:
                    flat = torch.cat([p.grad.view(-1) for p in unit])
                    c, s = _triton.reorder_quantize(
                        flat, offset0, slot_numel=flat.numel(), block_size=256
                    )
                    _triton.dequant_reduce(
                        c.unsqueeze(0), s.unsqueeze(0), block_size=256, numel=flat.numel(), out=flat
                    )
                    _copy_out(flat, [p.grad for p in unit])
        opt.step()
        opt.zero_grad(set_to_none=False)

    return _ms(step, repeat)


def gpt_step(rec: Recorder, args) -> None:
    import torch

    from qshard.train.model import GPT, GPTConfig

    cfg = GPTConfig(
        vocab_size=256, context=args.context, n_layer=args.layers, n_head=12, n_embd=args.embd
    )
    batch = args.batch
    n_params = GPT(cfg).num_params()
    rows = _Rows(
        rec,
        f"Single-GPU GPT training step ({n_params / 1e6:.0f}M params, {cfg.n_layer}x{cfg.n_embd}, "
        f"batch {batch}x{cfg.context}, bf16 autocast)",
        ["configuration", "ms/step", "x fp32 AdamW", "tokens/s"],
    )
    data = torch.randint(0, 256, (batch, cfg.context + 1), device=DEVICE)
    base_ms = None
    for name in (
        "fp32 AdamW(fused)",
        "AdamW8bit",
        "AdamW8bit + qwZ INT8 + qgZ INT4 codecs per FSDP unit",
    ):
        if name != "fp32 AdamW(fused)" and not _optimizer_dispatches_to_triton():
            rows.append((name, "skipped: qshard.optim has no CUDA dispatch", "", ""))
            continue
        ms = _gpt_step_ms(name, cfg, data, max(3, args.repeat // 2))
        base_ms = base_ms or ms
        tokens = batch * cfg.context
        rows.append((name, f"{ms:.1f}", f"{ms / base_ms:.2f}", f"{tokens / (ms * 1e-3):,.0f}"))
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


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
    global DEVICE
    if args.smoke:
        # Must precede the first kernel import: Triton picks interpreter vs compiler then.
        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE = "cpu"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
        DEVICE = "cuda"
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
