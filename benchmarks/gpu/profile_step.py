"""Profile qshard's optimizer step and GPT training step on one GPU: ncu + torch.profiler.

ON THE DEVICE (one H200, ~150 s in all), from the repository root:

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/gpu/profile_step.py --budget-s 150

(device tool: `run` with timeout_s >= 180). Output directory: `$OUT` when set, else
`--out-dir`, else a new /tmp/qshard-profile-* directory; three plain-text files, each rewritten
(ncu.txt: appended) as soon as a part ends, so a run stopped early keeps what was measured:

- profile.md: date, git revision, GPU, versions, each part's status and seconds; a table of the
  main ncu numbers per kernel; torch.profiler's tables (self CPU time, self device time), the
  counts of device-to-host syncs and launches, and the synchronizing calls
  `torch.cuda.set_sync_debug_mode("warn")` reports for one step;
- ncu.txt: Nsight Compute's text report of each profiled kernel launch, under a header;
- log.txt: each child process's command, exit status, seconds and output tail.

Parts, each in a child process with its own time cap, all within --budget-s:

1. ncu (when found on PATH or under /usr/local/cuda*, /opt/nvidia): one launch each of the
   8-bit AdamW step kernel `_step8_multi_kernel` (`AdamW8bit.step()`, one parameter of 134M
   fp32 elements), the 4-bit one `_step4_multi_kernel` (`AdamW4bit`), torch's fused AdamW on
   the same parameter, and qgZ's `_reorder_quantize_kernel` (2 nodes x 4 ranks, INT4). The
   driver (`_profile_target.py`) warms each up outside cudaProfilerStart/Stop (Triton compiles
   there) and makes one call inside; ncu profiles the first launch in it whose demangled name
   matches (`--profile-from-start off --kernel-name regex:... --launch-skip 0 --launch-count 1
   --clock-control none`; torch's: `.*[Aa]dam.*`, else the second multi_tensor_apply_kernel)
   with the sections in SECTIONS and the metrics in METRICS. Sections and metrics that
   `ncu --list-sections` / `--query-metrics` do not list are left out, and any a run rejects
   are dropped for one retry;
2. torch.profiler, CPU and CUDA activities: (a) `AdamW8bit.step()` on 150 parameters of
   768x768, 5 steps; (b) run_all.py's GPT step "AdamW8bit + qwZ INT8 + qgZ INT4 codecs per FSDP
   unit" (12x768, batch 8x1024), 3 steps; both after 3 warm-up steps.

    python benchmarks/gpu/profile_step.py [--budget-s 150] [--out-dir DIR] [--skip-ncu]
    python benchmarks/gpu/profile_step.py --smoke   # CPU, Triton interpreter, toy sizes, no ncu

`--smoke` checks the control flow here: the drivers run without ncu, the profiles on CPU.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TARGET = os.path.join(HERE, "_profile_target.py")
sys.path.insert(0, HERE)

import _profile_target as T  # noqa: E402
from _harness import md_table, write_atomic  # noqa: E402

SECTIONS = (
    "SpeedOfLight",
    "MemoryWorkloadAnalysis",
    "ComputeWorkloadAnalysis",
    "WarpStateStats",
    "Occupancy",
    "LaunchStats",
    "SchedulerStats",
)
# Is the 8-bit step bound by L1 gather wavefronts / LSU throttle, by issue slots, or by DRAM?
METRICS = (
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_lg.sum",
    "l1tex__data_pipe_lsu_wavefronts.sum",
    "smsp__inst_executed.sum",
    "smsp__inst_executed_pipe_lsu.sum",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "dram__bytes.sum",
    "gpu__time_duration.sum",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "smsp__average_warp_latency_issue_stalled_lg_throttle.ratio",
    "smsp__pcsamp_warps_issue_stalled_lg_throttle",
)
# ncu text lines worth a row in profile.md's summary (first occurrence of each label).
SUMMARY_LABELS = (
    "Duration",
    "DRAM Throughput",
    "Memory Throughput",
    "L1/TEX Cache Throughput",
    "L2 Cache Throughput",
    "Compute (SM) Throughput",
    "Issue Slots Busy",
    "Executed Ipc Active",
    "No Eligible",
    "Warp Cycles Per Issued Instruction",
    "Achieved Occupancy",
    "Registers Per Thread",
    "Grid Size",
    "Block Size",
    "L1/TEX Hit Rate",
    "Mem Pipes Busy",
    *METRICS,
)
NCU_GLOBS = (
    "/usr/local/cuda*/bin/ncu",
    "/usr/local/cuda*/nsight-compute*/ncu",
    "/opt/nvidia/nsight-compute/*/ncu",
    "/usr/local/NVIDIA-Nsight-Compute*/ncu",
)
NCU_CAP_S = 45.0  # one kernel: python + torch + CUDA init, Triton compile, ~30 replay passes
TORCH_CAPS_S = {"many8": 25.0, "gpt": 55.0}
RESERVE_S = 70.0  # budget kept for part 2 while ncu runs
MIN_CHILD_S = 12.0  # no child starts with less left than this
NCU_BLOCK_CHARS = 220_000  # per attempt in ncu.txt: 8 (4 kernels x 2) stay under 2 MB
LOG_TAIL_CHARS = 12_000


@dataclass
class Child:
    """How a child process ended."""

    status: str  # ok / failed (rc) / timeout
    rc: int | None
    seconds: float
    output: str


@dataclass
class Report:
    """profile.md, ncu.txt and log.txt under `out_dir`, rewritten after every update."""

    out_dir: str
    header: list[str]
    parts: list[tuple[str, str, str, str]] = field(default_factory=list)
    ncu_rows: dict[str, dict[str, str]] = field(default_factory=dict)
    body: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def part(self, name: str, status: str, seconds: float, note: str = "") -> None:
        self.parts.append((name, status, f"{seconds:.1f}", note))
        self.write()

    def add(self, text: str) -> None:
        self.body.append(text.rstrip("\n"))
        self.write()

    def child(self, cmd: list[str], res: Child) -> None:
        self.log.append(
            f"===== $ {' '.join(cmd)}\n{res.status} (exit {res.rc}) after {res.seconds:.1f} s\n"
            f"{res.output[-LOG_TAIL_CHARS:]}"
        )
        self.write()

    def ncu(self, text: str) -> None:
        with open(os.path.join(self.out_dir, "ncu.txt"), "a") as f:
            f.write(text.rstrip("\n") + "\n\n")

    def write(self) -> None:
        md = [*self.header, "", "## Parts", ""]
        md.append(md_table(["part", "status", "seconds", "note"], self.parts or [("none yet",)]))
        if self.ncu_rows:
            names = list(self.ncu_rows)
            labels = [x for x in SUMMARY_LABELS if any(x in r for r in self.ncu_rows.values())]
            rows = [(x, *(self.ncu_rows[n].get(x, "") for n in names)) for x in labels]
            md += ["", "## ncu: main numbers (full reports in ncu.txt)", ""]
            md.append(md_table(["metric", *names], rows or [("no numbers parsed",)]))
        md += ["", *self.body, ""]
        write_atomic(os.path.join(self.out_dir, "profile.md"), "\n".join(md))
        write_atomic(os.path.join(self.out_dir, "log.txt"), "\n".join(self.log) + "\n")


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _run(cmd: list[str], cap_s: float, env: dict[str, str] | None = None) -> Child:
    """`cmd` in a new process group, killed (the whole group: ncu and its target) at `cap_s`."""
    t0, out = time.monotonic(), ""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=env,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=cap_s)
        status = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                out, _ = proc.communicate(timeout=3)
                break
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                break
        status = "timeout"
    return Child(status, proc.returncode, time.monotonic() - t0, out)


def _quick(cmd: list[str], timeout: float = 20) -> str:
    """stdout + stderr of a short command, or why there is none."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        return (out.stdout + out.stderr).strip()
    except Exception as e:
        return f"unavailable ({type(e).__name__}: {e})"


def _header(args: argparse.Namespace, out_dir: str, ncu: str | None) -> list[str]:
    rev = _quick(["git", "-C", REPO, "rev-parse", "HEAD"], 10)
    if not re.fullmatch(r"[0-9a-f]{40}", rev):
        rev = "unknown"
    else:
        dirty = _quick(["git", "-C", REPO, "status", "--short", "--untracked-files=no"], 10)
        rev += f" (+{len(dirty.splitlines())} changed files)" if dirty else ""
    gpu = "CPU (smoke)"
    if not args.smoke:
        gpu = _quick(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    mode = "smoke (CPU, Triton interpreter, toy sizes)" if args.smoke else "device"
    ncu_line = "not found"
    if ncu:
        ncu_line = f"{ncu} ({' '.join(_quick([ncu, '--version']).split())[-80:]})"
    return [
        "# qshard profile (benchmarks/gpu/profile_step.py)",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
        f"- command: `{' '.join(sys.argv)}`; mode: {mode}; budget {args.budget_s:.0f} s",
        f"- git: {rev}",
        f"- GPU: {gpu}",
        f"- python {sys.version.split()[0]}, torch {version('torch')}, triton {version('triton')}",
        f"- ncu: {ncu_line}",
        f"- output: {out_dir}",
    ]


def _read(path: str) -> str:
    """A child's file ("" if it wrote none)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _find_ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in NCU_GLOBS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def _known(ncu: str, wanted: tuple[str, ...], query: list[str]) -> tuple[list[str], list[str]]:
    """(`wanted` names that ncu's listing `query` names, the others); all of them when the
    listing fails or names none of them. Metrics are looked up by base name."""
    names = {w.strip("\"'") for w in _quick([ncu, *query], 15).split()}
    keep = [w for w in wanted if w.split(".")[0] in names]
    if not keep:
        return list(wanted), []
    return keep, [w for w in wanted if w not in keep]


def _ncu_cmd(
    ncu: str,
    name: str,
    kernel: tuple[str, int],
    sections: list[str],
    metrics: list[str],
    log: str,
    cap: float,
) -> list[str]:
    cmd = [
        ncu,
        "--target-processes",
        "application-only",
        "--profile-from-start",
        "off",
        "--kernel-name-base",
        "demangled",
        "--kernel-name",
        f"regex:{kernel[0]}",
        "--launch-skip",
        str(kernel[1]),
        "--launch-count",
        "1",
        "--clock-control",
        "none",
    ]
    for s in sections:
        cmd += ["--section", s]
    if metrics:
        cmd += ["--metrics", ",".join(metrics)]
    target = [sys.executable, TARGET, "ncu", name, "--cap-s", f"{cap:.0f}"]
    return [*cmd, "--log-file", log, *target]


def _ncu_numbers(text: str) -> dict[str, str]:
    """SUMMARY_LABELS -> "value unit" from ncu's text report (first occurrence of each)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        cols = re.split(r"\s{2,}", line.strip())
        if len(cols) in (2, 3) and cols[0] in SUMMARY_LABELS and cols[0] not in found:
            found[cols[0]] = f"{cols[2]} {cols[1]}" if len(cols) == 3 else cols[1]
    return found


def _rejected(text: str, names: list[str]) -> list[str]:
    """`names` that ncu's error lines mention."""
    errors = [ln for ln in text.splitlines() if "ERROR" in ln or "rror:" in ln]
    return [n for n in names if any(n.split(".")[0] in ln for ln in errors)]


def ncu_part(ncu: str, report: Report, budget: Budget, env: dict[str, str], scratch: str) -> None:
    sections, dropped_s = _known(ncu, SECTIONS, ["--list-sections"])
    metrics, dropped_m = _known(ncu, METRICS, ["--query-metrics"])  # the device's chip
    if dropped_s or dropped_m:
        report.add(f"ncu does not list, so not asked for: {', '.join(dropped_s + dropped_m)}")
    for name, spec in T.NCU_WORKLOADS.items():
        t0 = time.monotonic()
        status, text, kernel = "skipped (budget)", "", (spec.regex, 0)
        for attempt in (1, 2):
            cap = min(NCU_CAP_S, budget.left() - RESERVE_S)
            if cap < MIN_CHILD_S:
                break
            log = os.path.join(scratch, f"ncu-{name}-{attempt}.txt")
            cmd = _ncu_cmd(ncu, name, kernel, sections, metrics, log, cap)
            res = _run(cmd, cap, env)
            report.child(cmd, res)
            text = _read(log)
            if "Section:" not in text and "Section:" in res.output:  # report went to stdout
                text = res.output
            report.ncu(
                f"===== {name}: {spec.what}; kernel regex:{kernel[0]}, skip {kernel[1]} (attempt "
                f"{attempt}: {res.status}, exit {res.rc}, {res.seconds:.1f} s)\n"
                f"$ {' '.join(cmd)}\n\n" + (text or res.output[-LOG_TAIL_CHARS:])[:NCU_BLOCK_CHARS]
            )
            if "Section:" in text or "gpu__time_duration" in text:
                status = "ok" if attempt == 1 else "ok (retry)"
                break
            status = f"no report ({res.status})"
            if "ERR_NVGPUCTRPERM" in text:
                status += ": no permission for the GPU's performance counters"
                break
            if "No kernels were profiled" in text:
                status += ": no kernel matched"
                if spec.fallback is None or kernel == spec.fallback:
                    break
                kernel = spec.fallback
                report.add(f"ncu {name}: regex:{spec.regex} matched no kernel; trying {kernel}")
                continue
            bad = _rejected(text, sections + metrics)
            if res.status == "timeout" or not (bad or metrics):
                break
            # Drop what ncu rejected (or, if it named nothing, all extra metrics) and retry.
            sections = [s for s in sections if s not in bad]
            metrics = [m for m in metrics if m not in bad] if bad else []
            report.add(f"ncu rejected {bad or 'the --metrics list'}: retrying without")
        report.ncu_rows[name] = _ncu_numbers(text)
        note = f"regex:{kernel[0]}" + (f", skip {kernel[1]}" if kernel[1] else "")
        report.part(f"1. ncu {name}", status, time.monotonic() - t0, note)
        if "permission" in status:
            report.add("ncu: no permission for GPU performance counters; later kernels skipped")
            return


def smoke_drivers(report: Report, budget: Budget, env: dict[str, str]) -> None:
    """Smoke: each ncu driver without ncu (its control flow, at toy sizes)."""
    for name in T.NCU_WORKLOADS:
        cap = min(NCU_CAP_S, budget.left())
        if cap < MIN_CHILD_S:
            report.part(f"1. driver {name} (no ncu)", "skipped (budget)", 0.0, "smoke")
            continue
        cmd = [sys.executable, TARGET, "ncu", name, "--smoke", "--cap-s", f"{cap:.0f}"]
        res = _run(cmd, cap, env)
        report.child(cmd, res)
        report.part(f"1. driver {name} (no ncu)", res.status, res.seconds, "smoke")


def torch_part(
    name: str, report: Report, budget: Budget, env: dict[str, str], scratch: str, smoke: bool
) -> None:
    steps, what = T.TORCH_WORKLOADS[name]
    cap = min(TORCH_CAPS_S[name], budget.left())
    if cap < MIN_CHILD_S:
        report.part(f"2. torch.profiler {name}", "skipped (budget)", 0.0)
        return
    out = os.path.join(scratch, f"torch-{name}.md")
    cmd = [sys.executable, TARGET, "torch", name, "--out", out, "--cap-s", f"{cap:.0f}"]
    cmd += ["--smoke"] if smoke else []
    res = _run(cmd, cap, env)
    report.child(cmd, res)
    text = _read(out)
    tail = "" if res.status == "ok" else f"\n**{res.status}**:\n\n```\n{res.output[-3000:]}\n```"
    report.add(f"## 2. torch.profiler: {what}, {steps} steps\n\n{text}{tail}")
    report.part(f"2. torch.profiler {name}", res.status, res.seconds)


def _child_env(smoke: bool) -> dict[str, str]:
    """run_all.py's: the tree's src on PYTHONPATH unless qshard is installed."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [p for p in (env.get("PYTHONPATH"), os.path.join(REPO, "src")) if p]
    if importlib.util.find_spec("qshard") is not None:
        paths = paths[:1]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if smoke:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=150.0, help="whole run, seconds")
    parser.add_argument("--out-dir", help="where the files go (default: $OUT, else a temp dir)")
    parser.add_argument("--skip-ncu", action="store_true", help="torch.profiler parts only")
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, Triton interpreter, toy sizes, no ncu"
    )
    args = parser.parse_args(argv)
    t_start = time.monotonic()
    budget = Budget(args.budget_s - 3)  # the last writes
    out_dir = os.environ.get("OUT") or args.out_dir or tempfile.mkdtemp(prefix="qshard-profile-")
    os.makedirs(out_dir, exist_ok=True)
    for stale in ("profile.md", "ncu.txt", "log.txt"):
        if os.path.exists(os.path.join(out_dir, stale)):
            os.remove(os.path.join(out_dir, stale))
    scratch = tempfile.mkdtemp(prefix="qshard-profile-scratch-")
    env = _child_env(args.smoke)
    ncu = None if args.smoke or args.skip_ncu else _find_ncu()
    report = Report(out_dir, _header(args, out_dir, ncu))
    report.part("0. header", "ok", time.monotonic() - t_start)
    print(f"[profile_step] writing to {out_dir}", flush=True)
    t0 = time.monotonic()
    try:
        if args.smoke:
            smoke_drivers(report, budget, env)
        elif ncu:
            ncu_part(ncu, report, budget, env, scratch)
        else:
            why = "--skip-ncu" if args.skip_ncu else f"not on PATH nor {', '.join(NCU_GLOBS)}"
            report.part("1. ncu", "skipped", 0.0, why)
    except Exception as e:  # one part's bug must not lose the next part
        report.part("1. ncu", f"error: {type(e).__name__}: {e}", time.monotonic() - t0)
    for name in T.TORCH_WORKLOADS:
        t0 = time.monotonic()
        try:
            torch_part(name, report, budget, env, scratch, args.smoke)
        except Exception as e:
            report.part(f"2. {name}", f"error: {type(e).__name__}: {e}", time.monotonic() - t0)
    report.part("total", "done", time.monotonic() - t_start)
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"[profile_step] done in {time.monotonic() - t_start:.0f} s: {out_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
