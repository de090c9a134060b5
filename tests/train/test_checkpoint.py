"""Checkpoints refuse what they cannot load and never look complete when they are not: a
checkpoint of another configuration (model shape, optimizer, 8-bit block size) is refused with a
message naming the difference; a damaged one (shards missing) is refused; a torn save or a torn
deletion never counts as complete; a restarted job resumes only where a checkpoint exists, and
falls back past damaged ones to the newest that loads on every rank (an explicit resume refuses
them, naming the newest intact one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from qshard.testing import run_world
from qshard.train import checkpoint as ckpt
from qshard.train.cli import resume_after_restart
from qshard.train.config import TrainConfig


def _model_and_optimizer(
    n_embd: int = 32, optim: str = "8bit", block_size: int = 256, v_map: str = "linear"
):
    from qshard.optim import AdamW4bit, AdamW8bit
    from qshard.train.model import GPT, GPTConfig

    model = GPT(GPTConfig(context=16, n_layer=1, n_head=2, n_embd=n_embd))
    if optim == "8bit":
        opt = AdamW8bit(model.parameters(), lr=1e-3, block_size=block_size, min_8bit_size=1024)
    elif optim == "4bit":
        opt = AdamW4bit(model.parameters(), lr=1e-3, min_4bit_size=1024, second_moment_map=v_map)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model(x, x)[1].backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _4bit():
    return _model_and_optimizer(optim="4bit")


def _unlist_files(path: Path) -> None:
    """Make ``path`` look written before ``qshard.json`` listed the files and their CRC-32s."""
    info = json.loads((path / "qshard.json").read_text())
    info.pop("files", None)
    (path / "qshard.json").write_text(json.dumps(info))


def _flip(file: Path, *, zero: bool = False) -> None:
    """Change bytes in the middle of ``file`` (or all of them to zeros), keeping its size."""
    data = bytearray(file.read_bytes())
    if zero:
        data = bytearray(len(data))
    else:
        for i in range(len(data) // 2, len(data) // 2 + 8):
            data[i] ^= 0x10
    file.write_bytes(bytes(data))


def _refusal(path: Path, **kw) -> str:
    model, opt = _model_and_optimizer(**kw)
    try:
        ckpt.load_checkpoint(path, model=model, optimizer=opt)
    except ckpt.CheckpointError as exc:
        return str(exc)
    return "loaded"


def _cases(rank: int, world: int, tmp: str) -> dict[str, str]:
    root = Path(tmp) / "ckpt"
    model, opt = _model_and_optimizer()
    path = ckpt.save_checkpoint(root, step=1, model=model, optimizer=opt, keep=5)
    out = {
        "same": _refusal(path),
        "block": _refusal(path, block_size=128),
        "optimizer": _refusal(path, optim="adamw"),
        "model": _refusal(path, n_embd=64),
    }
    # 4-bit: the second moment's code map shapes the meaning of the saved codes.
    path4 = ckpt.save_checkpoint(
        Path(tmp) / "ckpt4", step=1, **dict(zip(("model", "optimizer"), _4bit())), keep=5
    )
    out["4bit_same"] = _refusal(path4, optim="4bit")
    out["4bit_v_map"] = _refusal(path4, optim="4bit", v_map="dynamic")
    # Per-rank (torch.save) checkpoints compare the same layout.
    per_rank = ckpt.save_checkpoint(
        Path(tmp) / "per_rank", step=1, model=model, optimizer=opt, per_rank=True
    )
    out["per_rank_model"] = _refusal(per_rank, n_embd=64)
    # Damaged: complete-looking, shards gone.
    damaged = Path(tmp) / "damaged" / "step_00000001"
    shutil.copytree(path, damaged)
    (damaged / ".metadata").unlink()
    out["damaged"] = _refusal(damaged)
    # Damaged differently: a truncated shard (DCP raised its CheckpointException, a
    # BaseException that escaped every `except Exception`), an unreadable or foreign qshard.json.
    truncated = Path(tmp) / "truncated" / "step_00000001"
    shutil.copytree(path, truncated)
    shard = sorted(truncated.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    out["truncated"] = _refusal(truncated)
    # The same in a checkpoint written before qshard.json listed the files: DCP finds it.
    _unlist_files(truncated)
    out["truncated_unlisted"] = _refusal(truncated)
    # Same size, other bytes (a flipped bit, the zeros of a lost write): DCP and torch.load
    # read them as weights and optimizer state without a word; the CRC-32s refuse them.
    for name, pattern, source in (
        ("flipped", "*.distcp", path),
        ("zeroed", ".metadata", path),
        ("per_rank_flipped", "rank_*.pt", per_rank),
    ):
        bad = Path(tmp) / name / "step_00000001"
        shutil.copytree(source, bad)
        _flip(sorted(bad.glob(pattern))[0], zero=name == "zeroed")
        out[name] = _refusal(bad)
    for name, text in (("bad_json", '{"step": 1'), ("json_list", "[1, 2]")):
        bad = Path(tmp) / name / "step_00000001"
        shutil.copytree(path, bad)
        (bad / "qshard.json").write_text(text)
        out[name] = _refusal(bad)
    per_rank_cut = Path(tmp) / "per_rank_cut" / "step_00000001"
    shutil.copytree(per_rank, per_rank_cut)
    (per_rank_cut / "rank_00000.pt").write_bytes(b"PK\x03\x04 not a whole file")
    out["per_rank_truncated"] = _refusal(per_rank_cut)
    # keep=1 moves older checkpoints to a .deleting name before removing them.
    path2 = ckpt.save_checkpoint(root, step=2, model=model, optimizer=opt, keep=1)
    out["after_keep"] = ",".join(sorted(p.name for p in root.iterdir()))
    out["latest"] = ckpt.latest_checkpoint(root).name
    # A save of the same step replaces the old one whole.
    ckpt.save_checkpoint(root, step=2, model=model, optimizer=opt, keep=1)
    out["resaved"] = ",".join(sorted(p.name for p in root.iterdir()))
    out["resaved_loads"] = _refusal(path2)
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return run_world(_cases, 1, args=(str(tmp_path_factory.mktemp("ckpt")),), timeout_s=240)[0]


def test_a_checkpoint_of_the_same_configuration_loads(cases):
    assert cases["same"] == "loaded"
    assert cases["resaved_loads"] == "loaded"


def test_another_block_size_is_refused_by_name(cases):
    assert "was saved from another configuration" in cases["block"]
    assert "optimizer param group 0 block_size 256 in the checkpoint, 128 here" in cases["block"]


def test_another_4bit_second_moment_map_is_refused_by_name(cases):
    assert cases["4bit_same"] == "loaded"
    assert (
        "optimizer param group 0 second_moment_map linear in the checkpoint, dynamic here"
        in cases["4bit_v_map"]
    ), cases["4bit_v_map"]


def test_another_optimizer_is_refused_by_name(cases):
    assert (
        "optimizer qshard.optim.adam8bit.AdamW8bit in the checkpoint, torch.optim.adamw.AdamW here"
        in cases["optimizer"]
    )


def test_another_model_is_refused_by_name(cases):
    for key in ("model", "per_rank_model"):
        assert "model tensor tok_emb.weight is float32[256, 32] in the checkpoint, " in cases[key]
        assert "float32[256, 64] here" in cases[key]


def test_a_damaged_checkpoint_is_refused(cases):
    assert "has qshard.json but no DCP .metadata: it is damaged" in cases["damaged"]
    fix = "move it out of the checkpoints folder to resume from the previous one"
    assert fix in cases["damaged"]
    for key, what in (
        ("truncated", "truncated/step_00000001/__0_0.distcp cannot be loaded (it has 1000 bytes, "),
        ("truncated_unlisted", "truncated/step_00000001 cannot be loaded ("),
        ("bad_json", "qshard.json cannot be read (Expecting ',' delimiter"),
        ("json_list", "qshard.json holds list, not an object"),
        ("per_rank_truncated", "rank_00000.pt cannot be loaded (it has 21 bytes, "),
    ):
        assert what in cases[key] and fix in cases[key], (key, cases[key])


def test_a_checkpoint_whose_bytes_changed_at_the_same_size_is_refused(cases):
    # Before: loaded without a word (a resumed run went NaN a step later).
    for key, file in (
        ("flipped", "flipped/step_00000001/__0_0.distcp"),
        ("zeroed", "zeroed/step_00000001/.metadata"),
        ("per_rank_flipped", "per_rank_flipped/step_00000001/rank_00000.pt"),
    ):
        assert f"{file} cannot be loaded (its contents changed since the save: " in cases[key], (
            key,
            cases[key],
        )
        assert " with CRC-32 " in cases[key] and "move it out of the checkpoints" in cases[key]


def test_old_checkpoints_and_replaced_saves_leave_nothing_behind(cases):
    assert cases["after_keep"] == "step_00000002"
    assert cases["latest"] == "step_00000002"
    assert cases["resaved"] == "step_00000002"


def test_torn_saves_and_deletions_never_count_as_complete(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step_00000002", ".step_00000004.partial", ".step_00000001.deleting"):
        (root / name).mkdir(parents=True)
        (root / name / "qshard.json").write_text('{"step": 0}')
    (root / "step_00000003").mkdir()  # no qshard.json: not complete (and no save leaves one)
    assert ckpt.latest_checkpoint(root).name == "step_00000002"
    # ... but a resume starts from it, and refuses it as damaged (see the fallback tests)
    assert ckpt.newest_folder(root).name == "step_00000003"


def test_a_restart_resumes_only_where_a_checkpoint_exists(tmp_path, monkeypatch):
    config = TrainConfig(out=str(tmp_path), nproc=1)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert resume_after_restart(config).resume is False
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resume_after_restart(config).resume is False  # nothing saved yet: start over
    (tmp_path / "checkpoints/step_00000002").mkdir(parents=True)
    (tmp_path / "checkpoints/step_00000002/qshard.json").write_text("{}")
    assert resume_after_restart(config).resume is True
    # A step folder without qshard.json alone: the restart resumes, and its fallback moves the
    # folder aside as damaged (docs/train.md) rather than training over it from step 0.
    (tmp_path / "checkpoints/step_00000002/qshard.json").unlink()
    assert resume_after_restart(config).resume is True


def _stamped(step: float):
    """The small model and optimizer with every parameter set to ``step``: the checkpoint a
    load came from shows in the weights."""
    model, opt = _model_and_optimizer()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(step)
    return model, opt


def _weights_step(model) -> float:
    values = {float(v) for p in model.parameters() for v in p.detach().flatten()[:3]}
    return values.pop() if len(values) == 1 else float("nan")


def _names(root: Path) -> str:
    return ",".join(sorted(p.name for p in root.iterdir()))


def _fallback_cases(rank: int, world: int, tmp: str) -> dict[str, object]:
    """Two ranks: which checkpoint load_newest picks, and what it moves aside or refuses."""
    import torch.distributed as dist

    def save(root: Path, steps, **kw) -> None:
        for step in steps:
            model, opt = _stamped(step)
            ckpt.save_checkpoint(root, step=step, model=model, optimizer=opt, keep=9, **kw)

    def damage(path: Path, how: str) -> None:
        if rank == 0:
            if how == "truncate":
                shard = max(path.glob("*.distcp"), key=lambda f: f.stat().st_size)
                shard.write_bytes(shard.read_bytes()[:1000])
            elif how == "json":
                (path / "qshard.json").write_text('{"step": 3')
            elif how == "metadata":
                (path / ".metadata").unlink()
            elif how == "nometa":  # the shards are there, qshard.json is not
                (path / "qshard.json").unlink()
            elif how == "flip":  # rank 0's shard, same size: verified by rank 1
                _flip(path / "__0_0.distcp")
            else:  # only rank 1's own per-rank file: rank 0 loads its file fine (a checkpoint
                # without the file list, whose sizes would find it on every rank)
                (path / "rank_00001.pt").write_bytes(b"PK\x03\x04 not a whole file")
                _unlist_files(path)
        dist.barrier()

    def load(root: Path, *, fall_back: bool, **kw) -> dict[str, object]:
        model, opt = _model_and_optimizer(**kw)
        try:
            got = ckpt.load_newest(root, model=model, optimizer=opt, fall_back=fall_back)
        except ckpt.CheckpointError as exc:
            kind = type(exc).__name__
            return {"error": f"{kind}: {exc}", "names": _names(root)}
        if got is None:
            return {"none": True, "names": _names(root)}
        return {
            "step": got.step,
            "path": got.path.name,
            "weights": _weights_step(model),
            "passed_over": list(got.passed_over),
            "names": _names(root),
        }

    out: dict[str, object] = {}
    base = Path(tmp)
    # DCP: a shard cut short (found only by loading), a qshard.json that is not JSON, no
    # .metadata; each newest, with intact checkpoints before it.
    for how in ("truncate", "json", "metadata", "flip", "nometa"):
        root = base / f"dcp_{how}"
        save(root, (1, 2, 3))
        damage(root / "step_00000003", how)
        out[f"explicit_{how}"] = load(root, fall_back=False)  # --resume: refused, nothing moved
        out[f"restart_{how}"] = load(root, fall_back=True)
    # Per-rank files: rank 1's own file damaged, rank 0's fine: both ranks fall back alike.
    root = base / "per_rank"
    save(root, (1, 2), per_rank=True)
    damage(root / "step_00000002", "rank1")
    out["per_rank"] = load(root, fall_back=True)
    # Two damaged in a row, and a name already taken by an earlier damaged folder.
    root = base / "two"
    save(root, (1, 2, 3))
    damage(root / "step_00000003", "truncate")
    damage(root / "step_00000002", "json")
    if rank == 0:
        (root / "step_00000003.damaged").mkdir()
    dist.barrier()
    out["two"] = load(root, fall_back=True)
    # Nothing loads: refused naming every folder, all moved aside; then there is no checkpoint.
    root = base / "none"
    save(root, (1,))
    damage(root / "step_00000001", "metadata")
    out["none_loads"] = load(root, fall_back=True)
    out["after_none"] = load(root, fall_back=True)
    # Another configuration is refused, never passed over.
    root = base / "config"
    save(root, (1, 2))
    out["config"] = load(root, fall_back=True, block_size=128)
    # A failure that is no verdict on the checkpoint (a disk error, a bug) on rank 1 alone:
    # raised there, and named on rank 0, which used to wait for rank 1 at the next collective.
    root = base / "crash"
    save(root, (1,))
    real = ckpt._check_files

    def crash(path, info):
        if rank == 1:
            raise OSError(5, "Input/output error")
        return real(path, info)

    ckpt._check_files = crash
    try:
        out["crash"] = load(root, fall_back=True)
    except OSError as exc:
        out["crash"] = {"error": f"OSError: {exc}"}
    finally:
        ckpt._check_files = real
    return out


@pytest.fixture(scope="module")
def fallback(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("fallback"))
    ranks = run_world(_fallback_cases, 2, args=(tmp,), timeout_s=300)
    return Path(tmp), ranks


def test_a_restart_falls_back_past_a_damaged_newest_checkpoint(fallback):
    tmp, (r0, r1) = fallback
    for how, why in (
        ("truncate", "cannot be loaded (it has 1000 bytes, "),
        ("json", "qshard.json cannot be read (Expecting ',' delimiter"),
        ("metadata", "has qshard.json but no DCP .metadata"),
        ("flip", "__0_0.distcp cannot be loaded (its contents changed since the save: "),
        # was passed over without a word: an explicit --resume went on from step 2
        ("nometa", "has no qshard.json, which a save writes before the folder takes its name"),
    ):
        for got in (r0, r1):
            restart = got[f"restart_{how}"]
            assert restart["step"] == 2 and restart["weights"] == 2.0, (how, restart)
            assert restart["names"] == "step_00000001,step_00000002,step_00000003.damaged"
            (line,) = restart["passed_over"]
            assert line.startswith(f"{tmp}/dcp_{how}/step_00000003 ("), line
            assert why in line and line.endswith("moved aside to step_00000003.damaged"), line
    # The damaged folder is kept whole, only renamed.
    assert (tmp / "dcp_truncate/step_00000003.damaged/qshard.json").is_file()


def test_an_explicit_resume_refuses_a_damaged_newest_checkpoint_naming_the_intact_one(fallback):
    tmp, (r0, r1) = fallback
    for how in ("truncate", "json", "metadata", "flip", "nometa"):
        for got in (r0, r1):
            refused = got[f"explicit_{how}"]
            assert refused["error"].startswith("DamagedCheckpointError: "), refused
            assert "move it out of the checkpoints folder" in refused["error"]
            assert (
                "the newest earlier checkpoint that passes the file checks (qshard.json and "
                f"state files there) is {tmp}/dcp_{how}/step_00000002" in refused["error"]
            ), refused
            assert refused["names"] == "step_00000001,step_00000002,step_00000003"


def test_one_ranks_damaged_file_takes_every_rank_to_the_same_fallback(fallback):
    _, (r0, r1) = fallback
    for got in (r0["per_rank"], r1["per_rank"]):
        assert got["step"] == 1 and got["weights"] == 1.0, got
        (line,) = got["passed_over"]
        assert "rank_00001.pt cannot be loaded (" in line and line.endswith(
            " on rank 1): moved aside to step_00000002.damaged"
        ), line


def test_several_damaged_checkpoints_are_passed_over_and_none_deleted(fallback):
    _, (r0, r1) = fallback
    assert r0["two"] == r1["two"]
    two = r0["two"]
    assert two["step"] == 1 and two["weights"] == 1.0
    assert [line.rsplit(" ", 1)[-1] for line in two["passed_over"]] == [
        "step_00000003.damaged.2",
        "step_00000002.damaged",
    ]
    assert two["names"] == (
        "step_00000001,step_00000002.damaged,step_00000003.damaged,step_00000003.damaged.2"
    )
    none = r0["none_loads"]
    assert none["error"].startswith("DamagedCheckpointError: no checkpoint under "), none
    assert "moved aside to step_00000001.damaged" in none["error"]
    assert "a further restart (if any is left) starts from step 0" in none["error"]
    assert r0["after_none"] == {"none": True, "names": "step_00000001.damaged"}


def test_a_checkpoint_of_another_configuration_is_not_passed_over(fallback):
    _, (r0, r1) = fallback
    for got in (r0["config"], r1["config"]):
        assert got["error"].startswith("CheckpointError: "), got
        assert "block_size 256 in the checkpoint, 128 here" in got["error"]
        assert got["names"] == "step_00000001,step_00000002"


def test_a_rank_that_fails_to_read_takes_every_rank_out_with_it(fallback):
    _, (r0, r1) = fallback
    assert r1["crash"] == {"error": "OSError: [Errno 5] Input/output error"}
    assert r0["crash"]["error"].startswith("CheckpointError: reading ")
    assert r0["crash"]["error"].endswith("failed on rank 1: OSError: [Errno 5] Input/output error")
    assert "step_00000001" in r0["crash"]["names"]  # nothing moved aside


@pytest.mark.parametrize(
    "kw, match",
    [
        # keep=0 kept every checkpoint ([:-0] of the old ones is empty)
        ({"keep": 0}, "keep must be an int >= 1"),
        ({"keep": True}, "keep must be an int >= 1"),
        ({"step": -1}, "step must be an int >= 0"),
        ({"step": 2.0}, "step must be an int >= 0"),
    ],
)
def test_save_refuses_a_keep_or_step_it_cannot_honour(tmp_path, kw, match):
    model, opt = _model_and_optimizer()
    with pytest.raises(ValueError, match=match):
        ckpt.save_checkpoint(tmp_path / "c", **{"step": 1, "model": model, "optimizer": opt, **kw})
    assert not (tmp_path / "c").exists()


def test_a_per_rank_load_restores_the_cuda_generator_it_saved(tmp_path, monkeypatch):
    """Checkpoints save the CUDA RNG state where there is one; the per-rank load (the 1-bit
    optimizers' checkpoints) restored only the CPU's (the DCP load restores both). A CUDA
    machine is stood in for by its RNG calls."""
    saved = torch.arange(8, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: saved.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", restored.append)
    model, opt = _model_and_optimizer()
    path = ckpt.save_checkpoint(tmp_path, step=1, model=model, optimizer=opt, per_rank=True)
    ckpt.load_checkpoint(path, model=model, optimizer=opt)
    assert len(restored) == 1 and torch.equal(restored[0], saved)
