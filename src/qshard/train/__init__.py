"""qshard.train: the training application (``qshard train``) and its reusable pieces.

* :mod:`qshard.train.model` — a small readable GPT (:class:`GPT`, :class:`GPTConfig`);
* :mod:`qshard.train.data` — the byte-level corpus (Python stdlib by default), cached and split;
* :mod:`qshard.train.config` — :class:`TrainConfig`, one validated dataclass per run;
* :mod:`qshard.train.loop` — :func:`train`, the per-rank loop;
* :mod:`qshard.train.schedule` — the learning-rate schedule;
* :mod:`qshard.train.checkpoint` — atomic DCP checkpoints, resume, safetensors export;
* :mod:`qshard.train.estimate` — analytic memory and cross-node bytes;
* :mod:`qshard.train.cli` / :mod:`qshard.train.report` — the ``qshard train`` and
  ``qshard report`` commands.

Only the model and config are imported eagerly; the rest load on use.
"""

from qshard.train.config import TrainConfig
from qshard.train.model import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "TrainConfig"]
