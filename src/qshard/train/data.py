"""The training corpus: byte-level tokens from text files, cached, split by file, sampled by step.

Default corpus: the ``.py`` files of the running interpreter's standard library (every Python
install carries them; nothing is downloaded). A user may point ``--data`` at a text file or a
folder instead (every regular file under it, recursively, hidden ones skipped).

* Tokens are bytes (vocab 256); files are joined with a NUL byte as separator.
* The train/validation split is by file and depends only on the file's relative path (a CRC of
  it), so adding or removing one file never moves another between splits.
* The token arrays are cached once (``<cache>/<key>/{train,val}.bin``) with an atomic write; the
  key hashes the relative paths, sizes and modification times, so an edited corpus is re-read.
* Batches are a pure function of ``(seed, step)``: the *global* batch of a step is the same at
  any world size, each rank takes its rows. The data position to checkpoint is just the step.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qshard._fs import cache_home
from qshard.train.config import corpus_source

__all__ = [
    "Corpus",
    "CorpusError",
    "batch_for_step",
    "corpus_files",
    "default_cache_dir",
    "load_corpus",
]

_SEPARATOR = b"\x00"
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class CorpusError(ValueError):
    """The corpus could not be built: a missing path, no readable files, or too little text."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Corpus:
    """Token arrays of one corpus (read-only memory maps of the cache files)."""

    train: np.ndarray
    """Training tokens, uint8."""
    val: np.ndarray
    """Validation tokens, uint8."""
    source: str
    """Where the text came from (a path, or ``"python-stdlib"``)."""
    num_files: int
    """Number of files read."""
    key: str
    """Cache key (hash of relative paths, sizes and mtimes, split fraction)."""


def default_cache_dir() -> Path:
    """``$QSHARD_CACHE`` or ``$XDG_CACHE_HOME/qshard`` or ``~/.cache/qshard``."""
    if env := os.environ.get("QSHARD_CACHE"):
        return Path(env).expanduser()
    return Path(cache_home()) / "qshard"


def corpus_files(data: str | os.PathLike[str] | None) -> tuple[Path, list[Path]]:
    """The root and the sorted list of files of a corpus (``None``: the Python stdlib)."""
    if data is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(
            (p for p in root.rglob("*.py") if _SKIP_DIRS.isdisjoint(p.relative_to(root).parts)),
            key=lambda p: p.relative_to(root).as_posix(),
        )
        if not files:
            raise CorpusError(
                f"no .py files found in the Python standard library at {root}; "
                "pass --data PATH to train on your own text"
            )
        return root, files
    path = Path(data).expanduser()
    if not path.exists():
        raise CorpusError(f"--data {str(data)!r} does not exist; pass a text file or a folder")
    if path.is_file():
        return path.parent, [path]
    if not path.is_dir():
        raise CorpusError(f"--data {str(data)!r} is neither a regular file nor a folder")
    files = sorted(
        (
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        ),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    if not files:
        raise CorpusError(f"--data folder {str(data)!r} holds no (non-hidden) files")
    return path, files


def _is_val(rel: str, val_fraction: float) -> bool:
    return zlib.crc32(rel.encode()) % 10_000 < round(val_fraction * 10_000)


def _cache_key(root: Path, files: list[Path], val_fraction: float) -> str:
    # The corpus's own resolved path leads: keyed by relative paths alone, two corpora with the
    # same file names, sizes and mtimes (a copy made by cp -p, rsync -a or tar) shared one entry,
    # and a run on the second trained on the first's text while naming the second.
    h = hashlib.sha256(f"v2|{val_fraction}|{root.resolve()}".encode())
    for p in files:
        st = p.stat()
        h.update(f"|{p.relative_to(root).as_posix()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_corpus(
    data: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    val_fraction: float = 0.05,
    min_tokens: int = 1,
) -> Corpus:
    """Build (or read from cache) the byte-level corpus of ``data``.

    ``min_tokens`` is the least number of tokens each split must hold (one training sample
    needs ``context + 1``). A single file, or a folder whose files all fall on one side of the
    split, is split by position instead: the last ``val_fraction`` of its bytes validate.
    Raises :class:`CorpusError` with the fix when the corpus cannot serve.
    """
    if not 0.0 < val_fraction < 1.0:
        raise CorpusError(f"val_fraction must be in (0, 1); got {val_fraction}")
    root, files = corpus_files(data)
    key = _cache_key(root, files, val_fraction)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = cache / "corpus" / key
    meta_path = folder / "meta.json"
    source = corpus_source(None if data is None else str(data))
    if not meta_path.exists():
        train_parts: list[bytes] = []
        val_parts: list[bytes] = []
        for p in files:
            try:
                text = p.read_bytes()
            except OSError as exc:
                raise CorpusError(f"cannot read corpus file {p}: {exc}") from exc
            if text:
                rel = p.relative_to(root).as_posix()
                (val_parts if _is_val(rel, val_fraction) else train_parts).append(text)
        if not train_parts and not val_parts:
            raise CorpusError(
                f"the corpus at {source!r} is empty (all {len(files)} files are empty)"
            )
        split_files: dict[str, int] = {}
        if not train_parts or not val_parts:
            # One file (or an unlucky split): split the joined text by position instead.
            joined = _SEPARATOR.join(train_parts + val_parts)
            cut = int(len(joined) * (1.0 - val_fraction))
            train_bytes, val_bytes = joined[:cut], joined[cut:]
        else:
            train_bytes, val_bytes = _SEPARATOR.join(train_parts), _SEPARATOR.join(val_parts)
            split_files = {"training": len(train_parts), "validation": len(val_parts)}
        meta = {"source": source, "num_files": len(files), "val_fraction": val_fraction}
        meta.update(
            split_files=split_files, train_tokens=len(train_bytes), val_tokens=len(val_bytes)
        )
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _atomic_write(folder / "train.bin", train_bytes)
            _atomic_write(folder / "val.bin", val_bytes)
            # meta.json is written last: its presence marks a complete cache entry.
            _atomic_write(meta_path, json.dumps(meta, indent=1).encode())
        except OSError as exc:  # a read-only or full cache: say which, and how to move it
            raise CorpusError(
                f"cannot write the corpus cache under {cache} ({exc}); pass --cache-dir a "
                "folder you can write to (or set $QSHARD_CACHE)"
            ) from exc
    meta = json.loads(meta_path.read_text())
    train = _read_tokens(folder / "train.bin", meta["train_tokens"])
    val = _read_tokens(folder / "val.bin", meta["val_tokens"])
    for name, arr in (("training", train), ("validation", val)):
        if arr.size < min_tokens:
            # A folder split by file paths can put a tiny file alone on one side while the
            # corpus holds plenty: say so (it said only "give more text").
            split = meta.get("split_files", {})
            why = (
                f" (the split by file path put {split[name]} of {len(files)} files there: "
                "pass another --val-fraction, which picks the files by a hash of their paths, "
                "or add or rename files)"
                if name in split
                else ""
            )
            raise CorpusError(
                f"the corpus at {source!r} has {arr.size} {name} tokens, fewer than the "
                f"{min_tokens} one sample needs{why}; give more text or a shorter --context"
            )
    return Corpus(train=train, val=val, source=source, num_files=len(files), key=key)


def _read_tokens(path: Path, expected: int) -> np.ndarray:
    if expected == 0:
        return np.zeros(0, dtype=np.uint8)
    arr = np.memmap(path, dtype=np.uint8, mode="r")
    if arr.size != expected:
        raise CorpusError(f"corpus cache file {path} is corrupt; delete {path.parent} to rebuild")
    return arr


def _mix(*values: int) -> int:
    """A stable 63-bit seed from a few ints (Python's ``hash`` is not promised stable)."""
    h = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFF_FFFF_FFFF_FFFF


def batch_for_step(
    tokens: np.ndarray,
    *,
    step: int,
    seed: int,
    global_batch: int,
    context: int,
    rank: int = 0,
    world_size: int = 1,
    stream: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows ``(inputs, targets)`` of the global batch of ``step``.

    The global batch is ``global_batch`` windows of ``context + 1`` tokens at offsets drawn
    from a generator seeded by ``(seed, stream, step)``, so it does not depend on the world size
    or on what ran before: resuming at step ``s`` on any number of ranks sees the same data.
    ``stream`` separates independent streams (0 training, 1 validation).
    """
    if global_batch % world_size:
        raise ValueError(f"global_batch {global_batch} is not divisible by world_size {world_size}")
    n_windows = tokens.size - context
    if n_windows < 1:
        raise ValueError(f"{tokens.size} tokens are too few for context {context}")
    gen = torch.Generator().manual_seed(_mix(seed, stream, step))
    offsets = torch.randint(0, n_windows, (global_batch,), generator=gen)
    per_rank = global_batch // world_size
    mine = offsets[rank * per_rank : (rank + 1) * per_rank].tolist()
    window = np.stack([np.asarray(tokens[o : o + context + 1]) for o in mine]).astype(np.int64)
    window_t = torch.from_numpy(window)
    return window_t[:, :-1].contiguous(), window_t[:, 1:].contiguous()
