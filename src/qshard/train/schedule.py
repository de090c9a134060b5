"""The learning-rate schedule of ``qshard train``: one pure function of step and config.

It lives apart from the loop so the optimizer builder (:mod:`qshard.train._parallel`, which
derives 0/1 Adam's schedule from it) and the loop both import it, and neither the other.
"""

from __future__ import annotations

import math

from qshard.train.config import TrainConfig

__all__ = ["learning_rate"]


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))
