"""What a ``--resume`` must keep (``resume_mismatches``) and how its refusal says what to do
(``resume_refusal``), with the advice for options a DeepSpeed config sets (``resume_advice``)."""

from __future__ import annotations

import pytest

from qshard.train.cli import config_from_args
from qshard.train.config import TrainConfig, corpus_source, resume_mismatches
from tests.integrations.test_deepspeed import ZEROPP, _write


def _saved(config: TrainConfig) -> dict[str, object]:
    """A checkpoint's qshard.json as a run of ``config`` writes it (the parts a resume reads)."""
    return {
        "step": 10,
        "config": config.to_dict(),
        "corpus": {"source": corpus_source(config.data)},
    }


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"seed": 1}, "--seed 0 (now 1)"),
        ({"batch_size": 16}, "--batch-size 8 (now 16)"),
        ({"val_fraction": 0.1}, "--val-fraction 0.05 (now 0.1)"),
        ({"n_embd": 128}, "--n-embd 256 (now 128)"),
        ({"optim": "adamw"}, "--optim adamw8bit (now adamw)"),
    ],
)
def test_resume_refuses_what_changes_the_model_or_the_data_stream(change, named):
    """Before, --seed, --batch-size and --val-fraction (the batch of every step, the split)
    were not compared: the resumed run trained on other data while claiming to continue."""
    base = TrainConfig()
    assert resume_mismatches(_saved(base), base.replace(**change)) == [named]


def test_resume_names_parallel_only_for_a_one_bit_checkpoint():
    # An adamw8bit checkpoint may change --parallel; resumed with --optim onebit_adam it was
    # told to put back --parallel as well (chosen by the new run's optimizer).
    base = TrainConfig(parallel="hsdp", zeropp="off")
    assert resume_mismatches(_saved(base), base.replace(optim="onebit_adam", parallel="zero3")) == [
        "--optim adamw8bit (now onebit_adam)"
    ]
    one_bit = TrainConfig(optim="onebit_adam", zeropp="off", parallel="hsdp")
    assert resume_mismatches(_saved(one_bit), one_bit.replace(parallel="zero3")) == [
        "--parallel hsdp (now zero3)"
    ]


def test_resume_refuses_another_corpus_and_accepts_the_same_one_by_another_path(
    tmp_path, monkeypatch
):
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.txt").write_text("b")
    run = TrainConfig(data=str(tmp_path / "a.txt"))
    saved = _saved(run)
    assert resume_mismatches(saved, run.replace(data=str(tmp_path / "b.txt"))) == [
        f"--data {tmp_path / 'a.txt'} (now {tmp_path / 'b.txt'})"
    ]
    assert resume_mismatches(saved, run.replace(data=None)) == [
        f"--data {tmp_path / 'a.txt'} (now (the Python standard library))"
    ]
    monkeypatch.chdir(tmp_path)
    assert resume_mismatches(saved, run.replace(data="a.txt")) == []
    # A checkpoint written before the corpus was recorded: the flag as given.
    old = {"step": 10, "config": run.to_dict()}
    assert resume_mismatches(old, run.replace(data="b.txt")) == [
        f"--data {tmp_path / 'a.txt'} (now {tmp_path / 'b.txt'})"
    ]


def test_resume_accepts_what_may_change_when_a_run_continues():
    """Extending a run, its schedule, intervals, world size, ZeRO++ features and fault options
    are not part of what it trains on; a checkpoint of an older qshard is not compared on
    options it did not record."""
    base = TrainConfig()
    later = base.replace(
        steps=400,
        lr=1e-3,
        min_lr=1e-4,
        warmup_steps=10,
        eval_interval=0,
        eval_batches=2,
        checkpoint_interval=7,
        keep_checkpoints=5,
        nproc=2,
        ranks_per_node=1,
        zeropp="off",
        dtype="bf16",
        export=False,
        progress=False,
        max_restarts=2,
        collective_timeout=60.0,
        on_nonfinite="skip",
        out="elsewhere",
        cache_dir="cache",
        resume=True,
    )
    assert resume_mismatches(_saved(base), later) == []
    assert resume_mismatches({"step": 10, "config": {"n_embd": 256}}, base.replace(seed=3)) == []


def test_a_resume_the_file_changes_names_the_key_to_change(tmp_path):
    """A file with train_micro_batch_size_per_gpu resumed on another --nproc makes another
    global batch. The refusal said "pass the same options", and --batch-size with the
    checkpoint's value was then refused as a conflict with the file: a circle. It now names
    the file's key (``resume_advice``), only for what the file sets, with a fix the file can
    express, and still names the flags it does not set."""
    from qshard.train._deepspeed import resume_advice
    from qshard.train.config import resume_mismatches, resume_refusal

    del_batch = {k: v for k, v in ZEROPP.items() if k != "train_batch_size"}
    (tmp_path / "micro").mkdir()
    path = _write(tmp_path / "micro", {**del_batch, "train_micro_batch_size_per_gpu": 2})
    four = config_from_args(["--deepspeed-config", path, "--nproc", "4", "--ranks-per-node", "2"])
    two = config_from_args(["--deepspeed-config", path, "--nproc", "2", "--ranks-per-node", "2"])
    saved = {"config": four.to_dict()}

    def refusal(config, saved=saved) -> str:
        changed = resume_mismatches(saved, config)
        return resume_refusal("ckpt", changed, advice=resume_advice(config, saved))

    message = refusal(two)
    assert message.startswith("--resume: ckpt was written with --batch-size 8 (now 4); ")
    assert (
        f"--batch-size comes from {path} (its train_batch_size, or "
        "train_micro_batch_size_per_gpu x gradient_accumulation_steps x --nproc): set "
        '"train_batch_size": 8 there, without train_micro_batch_size_per_gpu (or with it at 4 '
        "on these 2 ranks) (a resume"
    ) in message
    # with accumulation in the file, the micro batch that fits is the share over both
    (tmp_path / "accum").mkdir()
    accum = {**del_batch, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2}
    accum_path = _write(tmp_path / "accum", accum)
    accum_two = ["--deepspeed-config", accum_path, "--nproc", "2", "--ranks-per-node", "2"]
    assert "(or with it at 2 on these 2 ranks)" in refusal(config_from_args(accum_two))
    # --grad-accum-steps itself may change on a resume (the same global batch)
    assert resume_mismatches(saved, four.replace(grad_accum_steps=2)) == []
    assert "pass the same options" not in message
    # a flag the file does not set is still named, beside the file's fix
    message = refusal(two.replace(seed=5))
    assert "--seed 0 (now 5), --batch-size 8 (now 4)" in message
    assert "; pass the checkpoint's --seed (a resume" in message
    # following the advice resumes: the file's global batch is the checkpoint's on 2 ranks
    fixed = _write(tmp_path, {**del_batch, "train_batch_size": 8})
    again = config_from_args(["--deepspeed-config", fixed, "--nproc", "2", "--ranks-per-node", "2"])
    assert resume_mismatches(saved, again) == []
    # the optimizer: an 8-bit run under the file's AdamW is --optim adamw8bit; a 4-bit one has
    # no optimizer.type, so the file's section goes and the flag chooses
    for old, fix in (
        ("adamw8bit", "pass --optim adamw8bit (the file's AdamW, with 8-bit state)"),
        ("adamw4bit", "remove the file's optimizer section and pass --optim adamw4bit"),
    ):
        other = {"config": {**four.to_dict(), "optim": old}}
        assert fix in refusal(four, other)
    # an AdamW run resumed with the swap to 8-bit state: the flag goes
    swapped = four.replace(optim="adamw8bit")
    assert "drop --optim adamw8bit (the file's AdamW is the run's)" in refusal(swapped)
    # a file without an optimizer or batch section: those flags are the user's to pass back
    (tmp_path / "bare").mkdir()
    bare = _write(tmp_path / "bare", {"zero_optimization": {"stage": 3}})
    flags = config_from_args(["--deepspeed-config", bare, "--nproc", "4", "--optim", "adamw"])
    message = refusal(flags, {"config": {**flags.to_dict(), "optim": "adamw8bit", "batch_size": 4}})
    assert "pass the same options to resume it" in message and "comes from" not in message
    assert resume_advice(four.replace(deepspeed_config=None), saved) == {}
