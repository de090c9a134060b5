"""The corpus: deterministic file order and split, atomic cache, batches independent of the
world size, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qshard.train.data import CorpusError, _is_val, batch_for_step, corpus_files, load_corpus


def _folder(tmp_path, n=30):
    root = tmp_path / "text"
    for i in range(n):
        sub = root / f"d{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i:02d}.txt").write_bytes(f"file {i}\n".encode() * (50 + i))
    (root / ".hidden").write_text("never read")
    return root


def test_stdlib_corpus_is_sorted_and_deterministic(tmp_path):
    root, files = corpus_files(None)
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and len(rel) > 100
    assert not any("site-packages" in r for r in rel)
    a = load_corpus(None, cache_dir=tmp_path / "a")
    b = load_corpus(None, cache_dir=tmp_path / "b")  # built again from scratch
    assert a.key == b.key and a.source == "python-stdlib"
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert 0.02 < a.val.size / (a.train.size + a.val.size) < 0.10
    assert a.train.dtype == np.uint8


def test_folder_corpus_split_by_file_and_cached(tmp_path):
    root = _folder(tmp_path)
    c1 = load_corpus(root, cache_dir=tmp_path / "cache", val_fraction=0.2)
    total = sum(f.stat().st_size for f in root.rglob("f*.txt"))
    # every byte of every non-hidden file lands in exactly one split (plus NUL separators)
    assert c1.train.size + c1.val.size == total + c1.num_files - 2
    assert b"never read" not in bytes(c1.train) + bytes(c1.val)
    assert c1.num_files == 30
    # second load reads the cache (same key, same bytes) ...
    c2 = load_corpus(root, cache_dir=tmp_path / "cache", val_fraction=0.2)
    assert c2.key == c1.key and np.array_equal(c1.train, c2.train)
    # ... and an edited corpus gets a new key
    (root / "d0" / "f00.txt").write_text("changed\n" * 100)
    c3 = load_corpus(root, cache_dir=tmp_path / "cache", val_fraction=0.2)
    assert c3.key != c1.key
    # no temp files left behind
    assert not list((tmp_path / "cache").rglob("*.tmp"))


def test_copies_with_the_same_names_sizes_and_mtimes_keep_their_own_text(tmp_path):
    # Keyed by relative paths, sizes and mtimes alone, v2/train.txt (a copy with v1's mtime,
    # as cp -p or rsync -a leave it) read v1's cached text while naming v2.
    import os

    paths = []
    for name, letter in (("v1", "A"), ("v2", "B")):
        (tmp_path / name).mkdir()
        paths.append(tmp_path / name / "train.txt")
        paths[-1].write_text(letter * 5000)
    os.utime(paths[1], ns=(paths[0].stat().st_atime_ns, paths[0].stat().st_mtime_ns))
    a, b = (load_corpus(p, cache_dir=tmp_path / "cache") for p in paths)
    assert a.key != b.key
    assert set(bytes(a.train)) == {ord("A")} and set(bytes(b.train)) == {ord("B")}


def test_a_tiny_file_alone_in_a_split_names_the_split(tmp_path):
    # A folder whose split by path put a 20-byte file alone in validation was refused with
    # "give more text", while it held plenty.
    root = tmp_path / "data"
    root.mkdir()
    (root / "big.txt").write_text("text " * 20_000)
    for i in range(200):  # a name whose hash puts it in validation
        if _is_val(f"tiny{i}.bin", 0.05) and not _is_val("big.txt", 0.05):
            (root / f"tiny{i}.bin").write_bytes(b"x" * 20)
            break
    with pytest.raises(
        CorpusError,
        match=r"20 validation tokens, fewer than the 33 one sample needs \(the split by file "
        r"path put 1 of 2 files there: pass another --val-fraction",
    ):
        load_corpus(root, cache_dir=tmp_path / "cache", min_tokens=33)


def test_single_file_splits_by_position(tmp_path):
    path = tmp_path / "one.txt"
    path.write_bytes(bytes(range(256)) * 40)
    c = load_corpus(path, cache_dir=tmp_path / "c", val_fraction=0.1)
    assert c.train.size == int(256 * 40 * 0.9)
    assert bytes(c.train) + bytes(c.val) == path.read_bytes()


def test_errors(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        load_corpus(tmp_path / "nope", cache_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="holds no"):
        load_corpus(tmp_path / "empty", cache_dir=tmp_path)
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(CorpusError, match="is empty"):
        load_corpus(tmp_path / "e.txt", cache_dir=tmp_path)
    (tmp_path / "s.txt").write_text("x" * 100)
    with pytest.raises(CorpusError, match="fewer than the 65 one sample needs"):
        load_corpus(tmp_path / "s.txt", cache_dir=tmp_path, min_tokens=65)
    # A cache that cannot be written (here: under a file) is a CorpusError naming the fix,
    # which the launcher prints; it was a bare OSError traceback.
    with pytest.raises(
        CorpusError, match=r"cannot write the corpus cache under .*pass --cache-dir"
    ):
        load_corpus(tmp_path / "s.txt", cache_dir=tmp_path / "s.txt")


@settings(max_examples=25, deadline=None)
@given(
    world=st.sampled_from([1, 2, 3, 4, 6]),
    step=st.integers(0, 10_000),
    seed=st.integers(0, 2**31),
)
def test_global_batch_is_independent_of_world_size(world, step, seed):
    tokens = np.arange(5000, dtype=np.int64).astype(np.uint8)
    kwargs = dict(step=step, seed=seed, global_batch=12, context=16)
    xs, ys = batch_for_step(tokens, **kwargs)
    parts = [batch_for_step(tokens, **kwargs, rank=r, world_size=world) for r in range(world)]
    assert np.array_equal(np.concatenate([p[0] for p in parts]), xs.numpy())
    assert np.array_equal(np.concatenate([p[1] for p in parts]), ys.numpy())
    # targets are inputs shifted by one token
    assert np.array_equal(xs[:, 1:].numpy(), ys[:, :-1].numpy())
    other = batch_for_step(tokens, **{**kwargs, "step": step + 1})[0]
    assert not np.array_equal(other.numpy(), xs.numpy())
