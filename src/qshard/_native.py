"""Build a C source string into a cached shared library and load it with :mod:`ctypes`.

Shared by the fused CPU kernels (``qshard.optim._kernels``, ``qshard.quant._native_kernels``).
Why C through ctypes: no torch headers and no build step at install time; ``cc -O3
-march=native -fopenmp`` on a few hundred lines takes about a second, once per machine.

* The library lives in a per-user cache (``$QSHARD_KERNEL_CACHE``, else
  ``$XDG_CACHE_HOME/qshard/kernels``, else ``~/.cache/qshard/kernels``), named by a hash of the
  source, the flags, the compiler and the CPU (``-march=native`` builds are only valid on this
  kind of CPU), so an edit or a new machine rebuilds and nothing stale is ever loaded.
* It is built into a private temporary directory and renamed into place, so concurrent
  processes (the ranks of one job) never load a partial file; the worst case is two builds.
* :class:`NativeLibrary` loads lazily under a lock (thread-safe) and, when the build fails (no
  compiler, or disabled), answers ``None`` forever and says why once (log + stderr), so callers
  fall back to their torch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable, Sequence

from qshard._env import env_flag
from qshard._fs import cache_home, fsync_path

__all__ = ["DEFAULT_FLAGS", "NativeLibrary", "advise_huge_pages", "build_library", "cache_dir"]

log = logging.getLogger(__name__)

#: ``-ffp-contract=off``: no fused multiply-add, so results match torch's separate rounding
#: steps bit for bit. ``-fno-math-errno`` lets ``sqrtf``/``rintf`` compile to one instruction.
DEFAULT_FLAGS: tuple[str, ...] = (
    "-O3",
    "-Werror=implicit-function-declaration",
    "-march=native",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fPIC",
)


def cache_dir() -> str:
    """The per-user directory holding built libraries (created if missing): $QSHARD_KERNEL_CACHE,
    else $XDG_CACHE_HOME/qshard/kernels, else ~/.cache/qshard/kernels. An empty or relative
    XDG_CACHE_HOME is ignored, as the XDG spec says (an empty one put the cache in the current
    directory)."""
    root = os.path.expanduser(os.environ.get("QSHARD_KERNEL_CACHE") or "") or os.path.join(
        cache_home(), "qshard", "kernels"
    )
    os.makedirs(root, exist_ok=True)
    return root


def _complete_library(path: str) -> bool:
    """Whether the cached build at ``path`` is whole. [Note: a torn library] The build is
    renamed into place whole, but a crash before its data reached the disk can leave a short
    file of that name; ``ctypes.CDLL`` maps it and the process dies of SIGBUS, on every later
    run, with no message. On Linux the file must be an ELF file at least as long as its header
    says (the section header table, which the linker writes last, ends inside it)."""
    if not sys.platform.startswith("linux"):
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[5] not in (1, 2):
        return False
    order = "<" if head[5] == 1 else ">"
    if head[4] == 2:  # 64-bit
        (shoff,) = struct.unpack_from(order + "Q", head, 0x28)
        shentsize, shnum = struct.unpack_from(order + "HH", head, 0x3A)
    else:
        (shoff,) = struct.unpack_from(order + "I", head, 0x20)
        shentsize, shnum = struct.unpack_from(order + "HH", head, 0x2E)
    return size >= shoff + shentsize * shnum


def _cpu_identity() -> str:
    ident = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    ident += line
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    return ident


def _compiler() -> list[str]:
    """The compiler command as an argument list.

    [Note: CC is a command] ``$CC`` (and sysconfig's ``CC``) is a shell word list, often with a
    launcher or flags: ``ccache gcc``, ``gcc -pthread``. Keeping only its first word ran
    ``ccache -O3 ...`` (ccache's own option parser rejects that), so with ``CC="ccache gcc"`` the
    build failed and every kernel silently fell back to the slow torch path. The whole list is
    kept; when its program is not on ``PATH``, plain ``cc`` / ``gcc`` is used instead.
    """
    raw = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    try:
        cmd = shlex.split(raw)
    except ValueError:  # unbalanced quotes: treat it as a program name that will not be found
        cmd = [raw]
    if not cmd or shutil.which(cmd[0]) is None:
        cc = shutil.which("cc") or shutil.which("gcc") or ""
        cmd = [cc] if cc else []
    if not cmd:
        raise RuntimeError("no C compiler found (set CC)")
    return cmd


def build_library(name: str, source: str, flags: Sequence[str] = DEFAULT_FLAGS) -> ctypes.CDLL:
    """Compile ``source`` (or reuse the cached build) and load it. Raises on failure."""
    cc = _compiler()
    digest = hashlib.sha256(
        (source + " ".join(flags) + " ".join(cc) + _cpu_identity()).encode()
    ).hexdigest()[:16]
    path = os.path.join(cache_dir(), f"{name}_{digest}.so")
    if os.path.exists(path) and not _complete_library(path):
        log.warning("qshard: %s is torn (shorter than its header says); building it again", path)
        with contextlib.suppress(OSError):  # another rank removed or replaced it first
            os.remove(path)
    if not os.path.exists(path):
        # Build into a private temp file and rename: concurrent ranks never see a partial .so.
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            src = os.path.join(tmp, f"{name}.c")
            with open(src, "w") as f:
                f.write(source)
            out = os.path.join(tmp, f"{name}.so")
            proc = subprocess.run(
                [*cc, *flags, "-shared", src, "-o", out, "-lm"], capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cc)} failed:\n{proc.stderr[-2000:]}")
            fsync_path(out)  # on the disk before its name is ([Note: a torn library])
            os.replace(out, path)
            with contextlib.suppress(OSError):  # a filesystem that cannot sync a folder
                fsync_path(os.path.dirname(path))
    return ctypes.CDLL(path)


class NativeLibrary:
    """A lazily built library: :meth:`get` returns the loaded :class:`ctypes.CDLL` or ``None``.

    Args:
        name: file-name stem of the build (also used in messages).
        source: the C source.
        declare: sets ``restype``/``argtypes`` of the exported functions after loading.
        what: how the failure message names the feature ("qshard.optim: fused 8-bit kernel").
        fallback: what the message says is used instead.
        disable_env: environment variable that, when set non-empty, disables the build.
        flags: compiler flags.
    """

    def __init__(
        self,
        name: str,
        source: str,
        *,
        declare: Callable[[ctypes.CDLL], None],
        what: str,
        fallback: str,
        disable_env: str | None = None,
        flags: Sequence[str] = DEFAULT_FLAGS,
    ) -> None:
        self.name = name
        self.source = source
        self.flags = tuple(flags)
        self._declare = declare
        self._what = what
        self._fallback = fallback
        self._disable_env = disable_env
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self.failure: str | None = None

    def get(self) -> ctypes.CDLL | None:
        """The library, building it on first use; ``None`` when unavailable (said once)."""
        if self._lib is not None or self.failure is not None:
            return self._lib
        with self._lock:
            if self._lib is None and self.failure is None:
                if self._disable_env and env_flag(self._disable_env, False):
                    self.failure = f"disabled by {self._disable_env}"
                else:
                    try:
                        lib = build_library(self.name, self.source, self.flags)
                        self._declare(lib)
                        self._lib = lib
                    except Exception as e:  # any build problem -> the caller's torch path
                        self.failure = str(e)
                if self.failure is not None:
                    # Through the 'qshard' logger only (a second, unconditional line on stderr
                    # could not be silenced and doubled the message): a WARNING reaches stderr
                    # once without any logging set up; switched off on purpose, INFO.
                    deliberate = self.failure.startswith("disabled by ")
                    log.log(
                        logging.INFO if deliberate else logging.WARNING,
                        "%s unavailable (%s); using the %s",
                        self._what,
                        self.failure,
                        self._fallback,
                    )
        return self._lib


#: Below this size a fresh buffer's page faults are cheap next to the kernel writing it.
HUGE_PAGE_MIN_BYTES = 8 << 20
_HUGE = 1 << 21  # x86-64 / arm64 transparent huge page size
_MADV_HUGEPAGE = 14
_libc: ctypes.CDLL | bool | None = False  # False: not looked up yet; None: unavailable


def advise_huge_pages(ptr: int, nbytes: int) -> bool:
    """Ask Linux to back the 2 MiB-aligned interior of a fresh buffer with transparent huge
    pages (``madvise(MADV_HUGEPAGE)``, honoured when THP is in "madvise" or "always" mode).

    Why: a 64 MiB output freshly ``mmap``-ed by malloc takes 16K page faults when a kernel
    first writes it; measured on this machine (64M-element dynamic-map quantize, 2 threads)
    that halved throughput (0.37x ``copy_`` allocating vs 0.59x into a reused buffer), and
    the advice recovered most of it (0.52x). Advice only: contents and semantics never
    change, and any failure (other OS, no libc symbol, EINVAL) is ignored. Returns whether
    the call was made and succeeded. Buffers below :data:`HUGE_PAGE_MIN_BYTES` are skipped.
    """
    global _libc
    if nbytes < HUGE_PAGE_MIN_BYTES or not sys.platform.startswith("linux"):
        return False
    if _libc is False:
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            lib.madvise.restype = ctypes.c_int
            _libc = lib
        except (OSError, AttributeError):
            _libc = None
    if _libc is None:
        return False
    start = (ptr + _HUGE - 1) & ~(_HUGE - 1)
    end = (ptr + nbytes) & ~(_HUGE - 1)
    if end <= start:
        return False
    return _libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0
