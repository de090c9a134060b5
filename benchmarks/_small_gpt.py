"""The optimizer benchmarks' training problem: the app's small GPT (``qshard.train.model.GPT``)
trained in one process on the embedded corpus with the app's AdamW settings (betas 0.9/0.95,
eps 1e-8, weight decay 0.1 on matrices and embeddings, linear warm-up then cosine to lr/10,
gradient clipping at 1.0). Shared by ``optim4bit_formats.py`` (simulated state formats) and
``optim_side_by_side.py`` (real optimizers)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch

from _common import at_least
from qshard.train.data import batch_for_step
from qshard.train.model import GPT, GPTConfig

BETAS, EPS, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 0.1


def add_problem_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=at_least(1), default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=at_least(0), default=15)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--eval-batches", type=int, default=8)


def describe(args: argparse.Namespace) -> str:
    return (
        f"GPT {args.n_layer} layers, width {args.n_embd}, context {args.context}; {args.steps} "
        f"steps, batch {args.batch_size}, lr {args.lr} (warm-up {args.warmup_steps}, cosine to "
        "lr/10), clip 1.0, one process, 1 thread"
    )


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    t = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr / 10 + (args.lr - args.lr / 10) * 0.5 * (1 + math.cos(math.pi * t))


def model_and_groups(args: argparse.Namespace, seed: int) -> tuple[GPT, list[dict]]:
    """The GPT from ``seed`` and its AdamW parameter groups (decay on matrices only)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, context=args.context))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return model, [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def train(
    model: GPT, corpus, args: argparse.Namespace, seed: int, step_fn: Callable[[int], None]
) -> dict:
    """Train ``args.steps`` steps (``step_fn(step)`` updates after the clipped backward) and
    return the final validation loss (the same batches for every seed), the mean train loss of
    the last 10% of steps and the largest train loss after warm-up (NaN val on divergence)."""
    losses = []
    for step in range(args.steps):
        x, y = batch_for_step(
            corpus.train, step=step, seed=seed, global_batch=args.batch_size, context=args.context
        )
        _, loss = model(x, y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        step_fn(step)
        losses.append(float(loss.detach()))
    val = []
    with torch.no_grad():
        for i in range(args.eval_batches):
            x, y = batch_for_step(
                corpus.val,
                step=i,
                seed=0,
                global_batch=args.batch_size,
                context=args.context,
                stream=1,
            )
            val.append(float(model(x, y)[1]))
    tail = losses[-max(1, args.steps // 10) :]
    after = losses[args.warmup_steps :] or losses
    finite = all(math.isfinite(v) for v in losses + val)
    return dict(
        val=sum(val) / len(val) if finite else float("nan"),
        train=sum(tail) / len(tail),
        peak=max(after),
    )
