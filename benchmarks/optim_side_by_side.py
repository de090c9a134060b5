"""The low-bit optimizers a user would otherwise pick, side by side with qshard's on one training
run: the same GPT, init, batches and schedule for each, one process.

Every optimizer trains the app's small GPT (``_small_gpt.py``: ``qshard.train.model.GPT``,
default 2 layers, width 128, context 64, as ``optim4bit_formats.py``) on the embedded corpus
with the app's AdamW settings (betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices and
embeddings, none on biases and norms; linear warm-up, cosine to lr/10, gradient clipping at 1.0),
once per ``--seeds`` seed of the data order (the init is the GPT's own, the same for every run).
Rows: ``torch.optim.AdamW`` (fused, the fp32 reference), qshard's ``AdamW8bit`` and
``AdamW4bit``, and when importable torchao's ``AdamW8bit`` / ``AdamW4bit`` and bitsandbytes'
``AdamW8bit``, each with its own library's defaults for what is not named above (block sizes,
which tensors stay fp32).

Columns (each the mean over ``--seeds``; a table gives each seed's validation loss): final
validation loss (mean over fixed batches) and its difference to the fp32 run,
mean train loss of the last 10% of steps, the largest train loss after warm-up, optimizer-state
bytes per parameter (every tensor in the state, a tensor subclass by its inner tensors), and the
median optimizer-step time in ms (``opt.step()`` alone; the runs are sequential, so on a shared
host the step time is indicative: ``optim_step.py`` interleaves steps for ratios). The losses are
deterministic for a given build (the run prints the host load with the times).

    python benchmarks/optim_side_by_side.py --steps 1000 --warmup-steps 50 --seeds 0,1,2 --out-md FILE
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Report, add_report_args
from _small_gpt import (
    BETAS,
    EPS,
    add_problem_args,
    describe,
    lr_at,
    model_and_groups,
    train,
)
from optim_step import _state_bytes
from qshard.optim import AdamW4bit, AdamW8bit
from qshard.train.data import load_corpus


def _candidates() -> tuple[list[tuple[str, Callable]], list[str]]:
    """(name, factory(groups, lr) -> optimizer) of what is importable, and notes on the rest."""
    kw = dict(betas=BETAS, eps=EPS)
    out: list[tuple[str, Callable]] = [
        ("torch AdamW fused (fp32)", lambda g, lr: torch.optim.AdamW(g, lr=lr, fused=True, **kw)),
        ("qshard AdamW8bit", lambda g, lr: AdamW8bit(g, lr=lr, **kw)),
        ("qshard AdamW4bit", lambda g, lr: AdamW4bit(g, lr=lr, **kw)),
    ]
    notes = []
    try:
        from torchao.optim import AdamW4bit as AoAdamW4bit
        from torchao.optim import AdamW8bit as AoAdamW8bit

        out.append(("torchao AdamW8bit", lambda g, lr: AoAdamW8bit(g, lr=lr, **kw)))
        out.append(("torchao AdamW4bit", lambda g, lr: AoAdamW4bit(g, lr=lr, **kw)))
    except Exception as e:
        notes.append(f"torchao skipped ({type(e).__name__}: {e})")
    try:
        import bitsandbytes as bnb

        out.append(("bitsandbytes AdamW8bit", lambda g, lr: bnb.optim.AdamW8bit(g, lr=lr, **kw)))
    except Exception as e:
        notes.append(f"bitsandbytes skipped ({type(e).__name__}: {e})")
    return out, notes


def _set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):  # torchao keeps it a tensor (no recompiles)
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def _run(factory: Callable, corpus, args: argparse.Namespace, seed: int) -> dict:
    model, groups = model_and_groups(args, seed=0)  # one init: the seeds vary the data order
    opt = factory(groups, args.lr)
    step_ms = []

    def step(i: int) -> None:
        _set_lr(opt, lr_at(i, args))
        t0 = time.perf_counter()
        opt.step()
        step_ms.append((time.perf_counter() - t0) * 1e3)

    result = train(model, corpus, args, seed, step)
    return dict(
        **result,
        state=_state_bytes(opt) / sum(p.numel() for p in model.parameters()),
        # the first steps compile (torchao) or build state: the median of the second half
        step_ms=statistics.median(step_ms[len(step_ms) // 2 :]),
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_problem_args(p)
    p.add_argument("--only", default="", help="comma separated substrings of the rows to run")
    p.add_argument(
        "--seeds",
        default="0",
        help="comma separated seeds of the data order (one model init); each row is their mean",
    )
    add_report_args(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    corpus = load_corpus()
    candidates, notes = _candidates()
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        candidates = [c for c in candidates if any(w in c[0] for w in wanted)]
    report = Report("Low-bit AdamW side by side on one training run (small GPT)")
    report.note(
        f"{describe(args)}, seeds {args.seeds} (the data order; one init). Load average at "
        f"start: "
        f"{os.getloadavg()[0]:.1f}."
    )
    for note in notes:
        report.note(note)
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    rows, ref, per_seed = [], None, []
    for name, factory in candidates:
        runs = [_run(factory, corpus, args, seed) for seed in seeds]
        r = {k: statistics.fmean(run[k] for run in runs) for k in runs[0]}
        if "fp32" in name:
            ref = r["val"]
        delta = "-" if ref is None or "fp32" in name else f"{100 * (r['val'] / ref - 1):+.2f}%"
        rows.append(
            [
                name,
                f"{r['val']:.4f}",
                delta,
                f"{r['train']:.4f}",
                f"{r['peak']:.3f}",
                f"{r['state']:.3f}",
                f"{r['step_ms']:.2f}",
            ]
        )
        per_seed.append([name, *(f"{run['val']:.4f}" for run in runs)])
        print(rows[-1], per_seed[-1][1:], flush=True)
    report.note(f"Load average at the end: {os.getloadavg()[0]:.1f}.")
    report.table(
        f"{args.steps} steps, mean of seeds {args.seeds}",
        [
            "optimizer",
            "val loss",
            "vs fp32",
            "train loss (last 10%)",
            "max train loss after warm-up",
            "state B/param",
            "step ms (median)",
        ],
        rows,
    )
    if len(seeds) > 1:
        report.table(
            "Validation loss per seed",
            ["optimizer", *(f"seed {seed}" for seed in seeds)],
            per_seed,
        )
    report.write(args.out_md)


if __name__ == "__main__":
    main()
