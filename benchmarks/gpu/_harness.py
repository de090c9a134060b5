"""The machinery of `run_all.py`: sections run one per child process under a global time
budget, results written to files as they are produced, a summary that names every failure.

Why one process per section: a CUDA error (an illegal address, a launch that hangs) poisons
the process's CUDA context, so every later section in the same process would fail too, and a
kernel stuck on the device cannot be interrupted from Python. A child can be killed at its cap;
the files it wrote up to then stay.

Files under the output directory (each rewritten atomically, so a kill never leaves half a file):

- ``summary.json`` / ``summary.md``: one entry per section (status ok / failed / timeout /
  crashed / skipped, seconds, the error's last lines), rewritten after every section, so the
  summary of a run killed from outside still lists what finished;
- ``<section>.json`` / ``<section>.md``: the section's tables, rewritten after every table
  update (sections add rows as they measure them), its status and traceback;
- ``<section>.log``: the child's stdout and stderr (Python's faulthandler dumps every thread's
  stack there shortly before the cap, so a hang says where it hung);
- ``results.md``: every table of every section in order, plus the failures (``--out-md`` gets a
  copy): what docs/RESULTS.md takes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# The statuses a section ends with.
OK, FAILED, TIMEOUT, CRASHED, SKIPPED = "ok", "failed", "timeout", "crashed", "skipped"

INJECT_ENV = "QSHARD_GPU_RUN_INJECT"  # "section=raise|hang|crash,..." (tests of the harness)


def median_ms(fn: Callable[[], object], repeat: int, cuda: bool, warmup: int = 2) -> float:
    """Median milliseconds of `fn`: on CUDA between two events recorded around each call (the
    device's time, no host timer read before the work is done); on CPU (smoke) wall clock."""
    import statistics

    import torch

    for _ in range(warmup):
        fn()
    if not cuda:
        samples = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)
    torch.cuda.synchronize()
    events = []
    for _ in range(repeat):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _cell(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [
        max([len(h), *(len(r[i]) for r in cells if i < len(r))]) for i, h in enumerate(header)
    ]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    return "\n".join(lines)


@dataclass
class Recorder:
    """A section's results, on disk after every update (`<name>.json` and `<name>.md`).

    `table(heading, header, rows)` replaces the table of that heading (sections call it again
    after each measured row, so a section killed half-way keeps its rows); `note` appends text;
    `facts` merges key/values (the environment section's)."""

    out_dir: str
    name: str
    status: str = "running"
    tables: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    error: str | None = None
    started: float = field(default_factory=time.time)

    def table(self, heading: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        entry = {
            "heading": heading,
            "header": list(header),
            "rows": [list(map(_jsonable, r)) for r in rows],
        }
        for i, t in enumerate(self.tables):
            if t["heading"] == heading:
                self.tables[i] = entry
                break
        else:
            self.tables.append(entry)
        self.flush()

    def note(self, text: str) -> None:
        print(text, flush=True)
        self.notes.append(text)
        self.flush()

    def fact(self, **kv: object) -> None:
        self.facts.update({k: _jsonable(v) for k, v in kv.items()})
        self.flush()

    def markdown(self) -> str:
        parts = []
        for t in self.tables:
            parts.append(f"### {t['heading']}\n\n{md_table(t['header'], t['rows'])}\n")
        parts += [n + "\n" for n in self.notes]
        if self.error:
            parts.append(f"**{self.name}: {self.status}**\n\n```\n{self.error}\n```\n")
        return "\n".join(parts)

    def flush(self) -> None:
        data = {
            "section": self.name,
            "status": self.status,
            "elapsed_s": round(time.time() - self.started, 3),
            "tables": self.tables,
            "notes": self.notes,
            "facts": self.facts,
            "error": self.error,
        }
        write_atomic(os.path.join(self.out_dir, f"{self.name}.json"), json.dumps(data, indent=1))
        write_atomic(os.path.join(self.out_dir, f"{self.name}.md"), self.markdown())


def _jsonable(v: object) -> object:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)


def injected(section: str) -> str | None:
    """The failure to inject into `section` (QSHARD_GPU_RUN_INJECT="name=mode,...")."""
    for item in os.environ.get(INJECT_ENV, "").split(","):
        name, _, mode = item.strip().partition("=")
        if name == section:
            return mode or "raise"
    return None


def inject(section: str) -> None:
    """Fail as asked (harness tests): raise, hang (past the cap), or crash the process."""
    mode = injected(section)
    if mode is None:
        return
    if mode == "raise":
        raise RuntimeError(f"injected failure in section {section!r} ({INJECT_ENV})")
    if mode == "hang":
        while True:
            time.sleep(1)
    if mode == "crash":
        sys.stdout.flush()
        os._exit(134)  # what an abort in a CUDA library looks like from outside
    raise ValueError(f"{INJECT_ENV}: unknown mode {mode!r} for {section!r}")


def run_child_section(
    out_dir: str, name: str, fn: Callable[[Recorder], None], deadline_s: float | None
) -> int:
    """In the child: run one section, record its status and traceback; exit status 0 / 1."""
    import faulthandler

    rec = Recorder(out_dir, name)
    rec.flush()
    if deadline_s:
        # Shortly before the parent's kill: every thread's stack into the log, even when the
        # main thread is blocked in C (a CUDA synchronize on a hung kernel ignores SIGINT).
        faulthandler.dump_traceback_later(max(1.0, deadline_s - 4.0), exit=False)
    try:
        inject(name)
        fn(rec)
        rec.status = OK
        return 0
    except KeyboardInterrupt:  # the parent's SIGINT at the cap
        rec.status = TIMEOUT
        rec.error = "interrupted at the section's time cap:\n" + traceback.format_exc()[-4000:]
        return 1
    except BaseException:  # every failure is a result to record
        rec.status = FAILED
        rec.error = traceback.format_exc()[-6000:]
        print(rec.error, file=sys.stderr, flush=True)
        return 1
    finally:
        if deadline_s:
            faulthandler.cancel_dump_traceback_later()
        rec.flush()


@dataclass
class Section:
    name: str
    cap_s: float  # at most this long, if the budget leaves it
    what: str


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _wait(proc: subprocess.Popen, cap: float, tick: Callable[[], None]) -> tuple[int | None, bool]:
    """(return code, timed out): wait up to `cap` s, calling `tick` every few seconds (the
    parent merges the child's partial results into the output files meanwhile). On the cap:
    SIGINT to the child's process group (Python raises KeyboardInterrupt: the section records
    where it was, pytest writes its report), then SIGKILL 10 s later."""
    end = time.time() + cap
    while True:
        try:
            return proc.wait(timeout=max(0.05, min(5.0, end - time.time()))), False
        except subprocess.TimeoutExpired:
            tick()
            if time.time() >= end:
                break
    for sig in (signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=10), True
        except subprocess.TimeoutExpired:
            continue
    return proc.poll(), True


LOG_TAIL_BYTES = 400_000  # per section in logs.txt (the device tool returns files <= 16 MiB)


@dataclass
class Orchestrator:
    """Runs sections as child processes in order, within `budget_s`, merging their results
    into the output directory's files (at most five: the device tool returns 8) after every
    section and every few seconds while one runs. The children work in `scratch`."""

    out_dir: str
    scratch: str
    budget_s: float
    child_cmd: Callable[[Section, float], list[str]]
    child_env: dict
    title: str
    header_lines: list[str] = field(default_factory=list)
    reserve_s: float = 8.0  # kept back for the summary and a kill's grace
    min_start_s: float = 12.0  # a section with less time left than this is skipped
    results: list[dict] = field(default_factory=list)
    running: dict | None = None
    t0: float = field(default_factory=time.time)

    def left(self) -> float:
        return self.budget_s - (time.time() - self.t0)

    def run(
        self, sections: Sequence[Section], stop_after: Callable[[dict], str | None] | None = None
    ):
        self.write_outputs()
        for i, sec in enumerate(sections):
            avail = self.left() - self.reserve_s
            if avail < self.min_start_s:
                self._skip(sections[i:], f"time budget spent ({self.budget_s:.0f} s)")
                break
            entry = self._run_section(sec, min(sec.cap_s, avail))
            self.results.append(entry)
            self.running = None
            self.write_outputs()
            why = stop_after(entry) if stop_after is not None else None
            if why:
                self._skip(sections[i + 1 :], why)
                break
        self.write_outputs(final=True)
        return self.results

    def _skip(self, sections: Sequence[Section], why: str) -> None:
        for sec in sections:
            self.results.append(
                {
                    "section": sec.name,
                    "status": SKIPPED,
                    "elapsed_s": 0.0,
                    "cap_s": 0.0,
                    "rc": None,
                    "error": why,
                    "what": sec.what,
                }
            )
            print(f"[run_all] {sec.name}: skipped ({why})", flush=True)

    def section_data(self, name: str) -> dict:
        return _read_json(os.path.join(self.scratch, f"{name}.json")) or {}

    def _run_section(self, sec: Section, cap: float) -> dict:
        print(
            f"[run_all] {sec.name}: start (cap {cap:.0f} s, {self.left():.0f} s of budget left)",
            flush=True,
        )
        json_path = os.path.join(self.scratch, f"{sec.name}.json")
        log_path = os.path.join(self.scratch, f"{sec.name}.log")
        if os.path.exists(json_path):
            os.remove(json_path)
        t = time.time()
        self.running = {
            "section": sec.name,
            "status": "running",
            "elapsed_s": 0.0,
            "cap_s": round(cap, 1),
            "rc": None,
            "error": None,
            "what": sec.what,
        }

        def tick() -> None:
            self.running["elapsed_s"] = round(time.time() - t, 1)
            self.write_outputs()

        try:
            with open(log_path, "w") as log:
                proc = subprocess.Popen(
                    self.child_cmd(sec, cap),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.child_env,
                    start_new_session=True,
                )
                rc, timed_out = _wait(proc, cap, tick)
        except Exception:  # the child could not even start
            rc, timed_out = None, False
            with open(log_path, "a") as f:
                f.write(traceback.format_exc())
        elapsed = time.time() - t
        data = self.section_data(sec.name)
        status, error = data.get("status"), data.get("error")
        if timed_out:
            status = TIMEOUT
            error = (
                error or ""
            ) + f"\nkilled at its cap of {cap:.0f} s; log tail:\n{_tail(log_path)}"
        elif rc != 0 and status in (None, "running", OK):
            status = CRASHED
            error = f"child exited with status {rc} without a result; log tail:\n{_tail(log_path)}"
        elif rc == 0 and status != OK:
            status = CRASHED
            error = f"child exited 0 but recorded status {status!r}; log tail:\n{_tail(log_path)}"
        entry = {
            "section": sec.name,
            "status": status,
            "elapsed_s": round(elapsed, 1),
            "cap_s": round(cap, 1),
            "rc": rc,
            "error": error.strip()[-4000:] if error else None,
            "what": sec.what,
        }
        print(f"[run_all] {sec.name}: {status} in {elapsed:.1f} s", flush=True)
        if error:
            print("  " + "\n  ".join(error.strip().splitlines()[-6:]), flush=True)
        return entry

    def _entries(self) -> list[dict]:
        return self.results + ([self.running] if self.running else [])

    def write_outputs(self, final: bool = False) -> None:
        """summary.md, results.json, results.md, logs.txt in out_dir (all rewritten)."""
        total = time.time() - self.t0
        entries = self._entries()
        bad = [r for r in entries if r["status"] != OK]
        sections = {r["section"]: self.section_data(r["section"]) for r in entries}
        state = "finished" if final else "IN PROGRESS (if you read this, the run was killed)"
        summary = {
            "title": self.title,
            "finished": final,
            "budget_s": self.budget_s,
            "elapsed_s": round(total, 1),
            "summary": entries,
            "not_ok": [r["section"] for r in bad],
            "sections": sections,
        }
        write_atomic(os.path.join(self.out_dir, "results.json"), json.dumps(summary, indent=1))
        rows = [
            (
                r["section"],
                r["status"],
                f"{r['elapsed_s']:.1f}",
                f"{r['cap_s']:.0f}",
                len(sections[r["section"]].get("tables", [])),
                r["what"],
            )
            for r in entries
        ]
        text = [
            f"# {self.title}: summary",
            "",
            *self.header_lines,
            "",
            f"- {state}: {total:.0f} s of a {self.budget_s:.0f} s budget",
            "- not ok: " + (", ".join(f"{r['section']} ({r['status']})" for r in bad) or "none"),
            "",
            md_table(["section", "status", "s", "cap s", "tables", "what"], rows),
            "",
        ]
        for r in bad:
            if r.get("error"):
                text += [f"## {r['section']}: {r['status']}", "", "```", r["error"], "```", ""]
        write_atomic(os.path.join(self.out_dir, "summary.md"), "\n".join(text))
        parts = [f"## {self.title}", "", *self.header_lines, ""]
        for r in entries:
            data = sections[r["section"]]
            for t in data.get("tables", []):
                parts += [f"### {t['heading']}", "", md_table(t["header"], t["rows"]), ""]
            parts += [n + "\n" for n in data.get("notes", [])]
            if r["status"] != OK:
                why = (r.get("error") or "").strip().splitlines()
                parts += [f"**{r['section']}: {r['status']}** ({why[-1] if why else ''})", ""]
        write_atomic(os.path.join(self.out_dir, "results.md"), "\n".join(parts))
        logs = []
        for r in entries:
            tail = _tail(os.path.join(self.scratch, f"{r['section']}.log"), LOG_TAIL_BYTES)
            logs.append(f"===== {r['section']} ({r['status']}) =====\n{tail}\n")
        write_atomic(os.path.join(self.out_dir, "logs.txt"), "\n".join(logs))
