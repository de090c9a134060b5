"""``qshard train --deepspeed-config``: the batch keys (``train_batch_size``,
``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``) read as DeepSpeed derives
them on ``--nproc`` ranks into ``--batch-size`` and ``--grad-accum-steps``."""

from __future__ import annotations

import pytest

from qshard.integrations.deepspeed import DeepSpeedConfigError
from qshard.train.cli import config_from_args
from tests.integrations.test_deepspeed import _write


def test_cli_reads_the_batch_keys_as_deepspeed_does(tmp_path):
    """DeepSpeed's train_batch_size = micro batch x gradient_accumulation_steps x world size,
    a missing key derived from the others, maps to --batch-size and --grad-accum-steps on
    --nproc ranks (the app refused every accumulation before); keys that do not fit the ranks
    are refused with the fix: the --nproc that fits, the global batch that does, or the key
    DeepSpeed would derive left out."""

    def read(cfg: dict, *argv: str):
        path = _write(tmp_path, {**cfg, "zero_optimization": {"stage": 3}})
        c = config_from_args(["--deepspeed-config", path, *argv])
        return c.batch_size, c.grad_accum_steps

    def refused(cfg: dict, nproc: int) -> str:
        path = _write(tmp_path, {**cfg, "zero_optimization": {"stage": 3}})
        with pytest.raises(DeepSpeedConfigError) as info:
            config_from_args(["--deepspeed-config", path, "--nproc", str(nproc)])
        message = str(info.value)
        assert message.startswith(f"{path}: train_batch_size: "), message
        return message.removeprefix(f"{path}: train_batch_size: ")

    batches = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2}
    assert read(batches, "--nproc", "1") == (4, 2)  # DeepSpeed derives 2 micro-batches
    assert read(batches, "--nproc", "2") == (4, 1)
    assert refused(batches, 4) == (
        "4 is not train_micro_batch_size_per_gpu 2 x 4 ranks = 8; run on --nproc 2, set "
        "train_batch_size to 8, or give only one of the two keys"
    )
    assert "x 3 ranks = 6; run on --nproc 2, set" in refused(batches, 3)  # 4 does not split
    all_three = {**batches, "train_batch_size": 16, "gradient_accumulation_steps": 4}
    assert read(all_three, "--nproc", "2") == (16, 4)
    assert refused(all_three, 4) == (
        "16 is not train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 4 x 4 ranks = "
        "32; run on --nproc 2, set train_batch_size to 32, or leave out "
        "gradient_accumulation_steps (DeepSpeed derives it)"
    )
    no_micro = {"train_batch_size": 16, "gradient_accumulation_steps": 4}
    assert read(no_micro, "--nproc", "2") == (16, 4)  # micro batch 2
    assert refused(no_micro, 3) == (
        "16 does not split evenly over 3 ranks x 4 micro-batches (DeepSpeed requires "
        "train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world "
        "size); set a multiple of 12 (e.g. 12), or run on --nproc 2"
    )
    assert read(
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, "--nproc", "2"
    ) == (12, 3)
    # a micro batch alone: the count is the flag's, the micro batch stays the file's
    assert read(
        {"train_micro_batch_size_per_gpu": 1}, "--nproc", "3", "--grad-accum-steps", "2"
    ) == (6, 2)
    assert read(
        {"train_micro_batch_size_per_gpu": 2}, "--nproc", "2", "--grad-accum-steps", "2"
    ) == (8, 2)
    # a global batch the flag's count does not split (no rank count fits it either)
    path = _write(tmp_path, {"train_batch_size": 6, "zero_optimization": {"stage": 3}})
    with pytest.raises(DeepSpeedConfigError) as flag:
        config_from_args(["--deepspeed-config", path, "--nproc", "2", "--grad-accum-steps", "4"])
    assert str(flag.value).endswith(
        "set a multiple of 8 (e.g. 8), or pass a --grad-accum-steps that divides 3"
    )
    # accumulation alone: the batch stays the flag's
    assert read({"gradient_accumulation_steps": 2}, "--nproc", "2", "--batch-size", "8") == (8, 2)
    # the flag against the file: the same value passes, another is refused naming both
    assert read(all_three, "--nproc", "2", "--grad-accum-steps", "4") == (16, 4)
    with pytest.raises(DeepSpeedConfigError, match=r"--grad-accum-steps 2 conflicts with .*sets 4"):
        read(all_three, "--nproc", "2", "--grad-accum-steps", "2")
