"""qshard._native: build once into the cache, load, fall back to None with one message."""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import pytest

from qshard import _native

SOURCE = "int add3(int a) { return a + 3; }\n"


def declare(lib: ctypes.CDLL) -> None:
    lib.add3.restype = ctypes.c_int
    lib.add3.argtypes = [ctypes.c_int]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QSHARD_KERNEL_CACHE", str(tmp_path))
    return tmp_path


def sos(path) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".so"))


def test_builds_once_per_source_and_loads_from_cache(cache):
    try:
        _native._compiler()
    except RuntimeError:
        pytest.skip("no C compiler")
    lib = _native.NativeLibrary("t", SOURCE, declare=declare, what="t", fallback="x")
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(lib.get())) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(got) == 6 and all(g is got[0] for g in got) and got[0] is not None
    assert got[0].add3(4) == 7
    (built,) = sos(cache)
    mtime = os.path.getmtime(cache / built)
    # A second process (a fresh NativeLibrary) reuses the file; a new source gets a new one.
    again = _native.NativeLibrary("t", SOURCE, declare=declare, what="t", fallback="x").get()
    assert again.add3(1) == 4 and sos(cache) == [built]
    assert os.path.getmtime(cache / built) == mtime
    _native.build_library("t", SOURCE + "int one(void) { return 1; }\n")
    assert len(sos(cache)) == 2
    assert not [f for f in os.listdir(cache) if not f.endswith(".so")]  # no temp leftovers


def test_failures_give_none_and_say_why_once(cache, caplog, monkeypatch):
    """Said once, through the 'qshard' logger only (a second line printed to stderr could not
    be silenced and doubled the message); a kernel switched off on purpose is said at INFO."""
    broken = _native.NativeLibrary(
        "bad", "int f( {", declare=declare, what="demo kernel", fallback="torch path"
    )
    with caplog.at_level(logging.INFO, logger="qshard"):
        assert broken.get() is None and broken.get() is None
    said = [r for r in caplog.records if "demo kernel unavailable" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and broken.failure

    caplog.clear()
    monkeypatch.setenv("QSHARD_TEST_OFF", "1")
    off = _native.NativeLibrary(
        "t", SOURCE, declare=declare, what="t", fallback="x", disable_env="QSHARD_TEST_OFF"
    )
    with caplog.at_level(logging.INFO, logger="qshard"):
        assert off.get() is None and off.failure == "disabled by QSHARD_TEST_OFF"
    assert [r.levelno for r in caplog.records] == [logging.INFO]

    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(_native.shutil, "which", lambda name: None)
    none = _native.NativeLibrary("t", SOURCE, declare=declare, what="t", fallback="x")
    assert none.get() is None and "no C compiler" in none.failure
    assert sos(cache) == []


def test_huge_page_advice_is_advice_only(monkeypatch):
    import sys

    import torch

    # Small buffers and non-Linux platforms are skipped; a large one is advised (where THP is
    # compiled in) without touching its contents.
    small = torch.arange(1000, dtype=torch.int32)
    assert _native.advise_huge_pages(small.data_ptr(), small.numel() * 4) is False
    big = torch.arange(4 << 20, dtype=torch.int32)  # 16 MiB
    before = big.clone()
    advised = _native.advise_huge_pages(big.data_ptr(), big.numel() * 4)
    assert isinstance(advised, bool)
    assert torch.equal(big, before)
    calls: list[tuple[int, int, int]] = []

    class FakeLibc:
        def madvise(self, start: int, length: int, advice: int) -> int:
            calls.append((start, length, advice))
            return 0

    monkeypatch.setattr(_native, "_libc", FakeLibc())
    monkeypatch.setattr(sys, "platform", "linux")
    ptr = (5 << 21) + 12345  # unaligned start: only the 2 MiB-aligned interior is advised
    assert _native.advise_huge_pages(ptr, 9 << 20) is True
    assert calls == [(6 << 21, (ptr + (9 << 20)) // (1 << 21) * (1 << 21) - (6 << 21), 14)]
    monkeypatch.setattr(sys, "platform", "darwin")
    assert _native.advise_huge_pages(ptr, 9 << 20) is False and len(calls) == 1


def test_cc_keeps_its_launcher_and_flags(cache, monkeypatch):
    """CC="ccache gcc" (a launcher) or CC="gcc -DX=1" (flags) kept only the first word: the
    build ran `ccache -O3 ...` or dropped the flags, failed, and every kernel fell back to the
    slow torch path. `env` stands in for ccache here (a launcher that runs the rest)."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    env = shutil.which("env")
    if cc is None or env is None:
        pytest.skip("needs a C compiler and env")
    monkeypatch.setenv("CC", f"{env} {cc} -DQSHARD_TEST_ADD=3")
    lib = _native.NativeLibrary(
        "t",
        "int add3(int a) { return a + QSHARD_TEST_ADD; }\n",
        declare=declare,
        what="t",
        fallback="x",
    )
    assert lib.get() is not None, lib.failure
    assert lib.get().add3(4) == 7
    assert _native._compiler() == [env, cc, "-DQSHARD_TEST_ADD=3"]
    # A CC whose program is missing still falls back to the default compiler.
    monkeypatch.setenv("CC", "no-such-compiler -O1")
    assert _native._compiler() in ([cc], [shutil.which("gcc")])


def test_a_torn_library_is_built_again_not_loaded(cache):
    # [Note: a torn library]: a cached .so cut short (a crash before its data reached the
    # disk) was mapped by CDLL and the process died of SIGBUS, on every later run. In a child
    # process, so that a regression kills the child, not the test run.
    import subprocess
    import sys

    try:
        _native._compiler()
    except RuntimeError:
        pytest.skip("no C compiler")
    _native.build_library("t", SOURCE)
    (built,) = sos(cache)
    assert _native._complete_library(str(cache / built))
    # A new file of that name (cutting the mapped one in place would SIGBUS this process)
    torn = cache / "torn.tmp"
    torn.write_bytes((cache / built).read_bytes()[:1000])
    os.replace(torn, cache / built)
    assert not _native._complete_library(str(cache / built))
    child = (
        "from qshard import _native; import ctypes\n"
        f"lib = _native.build_library('t', {SOURCE!r})\n"
        "lib.add3.restype = ctypes.c_int; print(lib.add3(4))\n"
    )
    env = {**os.environ, "QSHARD_KERNEL_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "7", (out.returncode, out.stderr)
    assert "is torn" in out.stderr
    assert _native._complete_library(str(cache / built)) and sos(cache) == [built]


def test_cache_dir_ignores_an_empty_or_relative_xdg_cache_home(tmp_path, monkeypatch):
    # an empty XDG_CACHE_HOME put the kernel cache in the current directory
    monkeypatch.delenv("QSHARD_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    default = str(tmp_path / ".cache" / "qshard" / "kernels")
    for xdg in ("", "rel"):
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        assert _native.cache_dir() == default
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _native.cache_dir() == str(tmp_path / "xdg" / "qshard" / "kernels")
    monkeypatch.setenv("QSHARD_KERNEL_CACHE", "~/k")
    assert _native.cache_dir() == str(tmp_path / "k")
