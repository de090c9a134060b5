"""Cost of the 8-bit (or, with ``--bits 4``, the 4-bit) kernel's non-finite handling: one
optimizer step with the kernel of a base revision (``--base``, default ``HEAD~1``) and with the
working tree's, side by side.

The two builds run interleaved (A B, B A, ...) on the same parameter and state, one thread; the
table shows the fastest round of each and their ratio, with the host load average (other work on
the machine shifts both alike, the minimum over many rounds is the least disturbed figure).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time

import torch

from qshard import _native
from qshard import optim as qoptim
from qshard.optim import _kernels, _kernels4


def _repo_root() -> str:
    """The checkout this script lives in (not the caller's working directory, which may be
    anywhere)."""
    return subprocess.run(
        ["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "--show-toplevel"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def _has_revision(rev: str) -> bool:
    """Whether ``rev`` names a commit of this checkout."""
    found = subprocess.run(
        ["git", "-C", _repo_root(), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        capture_output=True,
    )
    return found.returncode == 0


def _source_at(rev: str, module_name: str) -> str:
    """The C source of ``qshard.optim.<module_name>`` as revision ``rev`` builds it: the whole
    package of that revision is extracted and imported in a child process (the kernel text is
    put together from several modules, ``qshard.optim._kernel_common`` and
    ``qshard.quant._codetable`` among them, so the base module alone next to the working tree's
    helpers would mix two revisions)."""
    root = _repo_root()
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", root, "archive", rev, "src/qshard"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        code = f"import qshard.optim.{module_name} as k, sys; sys.stdout.write(k._SOURCE)"
        env = {**os.environ, "PYTHONPATH": os.path.join(tmp, "src")}
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
        ).stdout


def _declare_like(lib: ctypes.CDLL, like: ctypes.CDLL) -> None:
    """Give ``lib`` the argument and result types ``like`` declares, for the functions it has."""
    for fname, f in vars(like).items():
        if isinstance(f, ctypes._CFuncPtr):
            try:
                g = getattr(lib, fname)
            except AttributeError:
                continue
            g.argtypes, g.restype = f.argtypes, f.restype


class _OneTensorEntry:
    """A revision from before the multi-tensor call (``step8`` / ``adam4bit_step``, one tensor
    each) behind the ``step8_multi`` / ``adam4bit_multi`` the optimizers call now: each row of
    the table becomes one call of the old entry (the optimizers' old per-tensor calls)."""

    def __init__(self, lib: ctypes.CDLL, bits: int) -> None:
        p, i64, i32, u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64
        self._lib, self._bits = lib, bits
        if bits == 8:
            lib.step8.restype = i32
            lib.step8.argtypes = [i32, p, p, p, p, p, p, p, i32, i32, p, p, p, p, p, i32, i32]
            lib.step8.argtypes += [i64, i64, i64, p, i32, u64, i64, i32]
        else:
            lib.adam4bit_step.restype = i32
            lib.adam4bit_step.argtypes = [p, p, p, p, p, p, p, i32, p, p, p, p, p, i32, i64]
            lib.adam4bit_step.argtypes += [i64, i64, p, i32]

    def __getattr__(self, name):
        return getattr(self._lib, name)

    @staticmethod
    def _rows(table: int, n: int, width: int) -> list[list[int]]:
        words = (ctypes.c_int64 * (n * width)).from_address(table)
        return [list(words[i * width : (i + 1) * width]) for i in range(n)]

    def step8_multi(self, kind, table, n, code1, regions1, lut1, zero1, signed1, code2,
                    regions2, lut2, zero2, signed2, block, threads):  # fmt: skip
        for p, g, c1, a1, c2, a2, rows, row_numel, hp, flags, seed, off in self._rows(table, n, 12):
            rc = self._lib.step8(
                kind, p, g, c1, a1, code1, regions1, lut1, zero1, signed1, c2 or None,
                a2 or None, code2, regions2, lut2, zero2, signed2, rows, row_numel, block, hp,
                flags, seed % 2**64, off, threads,
            )  # fmt: skip
            if rc != 0:
                return rc
        return 0

    def adam4bit_multi(self, table, n, code1, mid1, lut1, linear1, code2, mid2, lut2, linear2,
                       block, threads):  # fmt: skip
        for p, g, c1, a1, c2, a2, rows, row_numel, hp in self._rows(table, n, 9):
            rc = self._lib.adam4bit_step(
                p, g, c1, a1, code1, mid1, lut1, linear1, c2, a2, code2, mid2, lut2, linear2,
                rows, row_numel, block, hp, threads,
            )  # fmt: skip
            if rc != 0:
                return rc
        return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", default="HEAD~1", help="git revision of the base kernel")
    parser.add_argument("--numel", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=61, help="interleaved rounds (>= 1)")
    parser.add_argument("--bits", type=int, choices=(8, 4), default=8)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(
            f"--rounds must be >= 1 (the table shows the fastest round); got {args.rounds}"
        )
    if not _has_revision(args.base):
        parser.error(
            f"--base {args.base!r} is not a commit of this checkout; pass a revision git knows "
            "(e.g. HEAD~1, a tag or a commit hash)"
        )
    if args.numel < 1000 or args.numel % 1000:
        parser.error(
            f"--numel must be a positive multiple of 1000 (rows of 1000); got {args.numel}"
        )
    kernels = _kernels if args.bits == 8 else _kernels4
    classes = (qoptim.AdamW8bit, qoptim.Lion8bit) if args.bits == 8 else (qoptim.AdamW4bit,)
    libs = {}
    base_src = _source_at(args.base, kernels.__name__.rsplit(".", 1)[1])
    for name, src in (("tree", kernels._SOURCE), ("base", base_src)):
        tag = f"optim{args.bits}bit_cost_{name}"
        lib = _native.build_library(tag, src, _native.DEFAULT_FLAGS)
        if name == "tree":
            kernels._declare(lib)
        else:  # the tree's signatures of the entry points the base has
            _declare_like(lib, libs["tree"])
            if not hasattr(lib, "step8_multi" if args.bits == 8 else "adam4bit_multi"):
                lib = _OneTensorEntry(lib, args.bits)
        libs[name] = lib
    torch.set_num_threads(1)
    print(f"{args.bits}-bit, numel {args.numel}, {args.rounds} interleaved rounds, 1 thread")
    for cls in classes:
        p = torch.nn.Parameter(torch.randn(args.numel // 1000, 1000))
        opt = cls([p], lr=1e-3)
        p.grad = torch.randn_like(p) * 0.1
        opt.step()
        times: dict[str, list[float]] = {"base": [], "tree": []}
        original = kernels.library
        try:
            for r in range(args.rounds):
                for name in ("base", "tree") if r % 2 else ("tree", "base"):
                    kernels.library = lambda lib=libs[name]: lib
                    t0 = time.perf_counter()
                    opt.step()
                    times[name].append(time.perf_counter() - t0)
        finally:
            kernels.library = original
        best = {k: min(v) for k, v in times.items()}
        print(
            f"{cls.__name__:10s} base {best['base'] * 1e3:7.2f} ms  "
            f"tree {best['tree'] * 1e3:7.2f} ms  tree/base {best['tree'] / best['base']:.3f}"
        )
    print("load average (1, 5, 15 min):", ", ".join(f"{x:.1f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
