"""Measure candidate 4-bit formats of Adam's two moments on a real problem, side by side.

Every candidate trains the app's small GPT (``qshard.train.model.GPT``; default 2 layers, width
128, context 64, as the convergence benchmark) in ONE process from the same seed on the same
batches of the embedded corpus with AdamW (betas 0.9/0.95, weight decay 0.1, eps 1e-8, warm-up
then cosine to lr/10, gradient clipping at 1.0, the app's settings), where each state of a
tensor with >= 4096 elements and >= 2 dims is stored in 4 bits between steps: decoded,
updated by the pure AdamW function (``qshard.optim._functional.adam_update``), re-encoded
(exact nearest code). Smaller and 1-D tensors keep fp32 state, as in ``AdamW4bit``.

Candidates (first moment m / second moment v):

* ``fp32``: no quantization (the reference);
* ``m-dyn128 / v-<map><block>``: m on the signed 4-bit dynamic map in blocks of 128 (or 2048),
  v on ``linear-zero`` (``linspace(0, 1, 16)``: the naive map, 0 is a code), ``linear``
  (``(i+1)/16``: zero-free, Li et al. 2023) or ``dynamic`` (unsigned 4-bit dynamic map with its
  0 replaced by 1e-3), in blocks of 128 or with rank-1 normalisation (``r1``: the scale of
  element (i, j) of a 2-D tensor is ``min(max_j' |v_ij'|, max_i' |v_i'j|)``, Li et al.).

Columns: final validation loss (mean over fixed batches), its difference to fp32 in percent,
mean train loss of the last 10% of steps, and the largest train loss after warm-up (a spike or
divergence shows there). Deterministic: the numbers do not depend on the host's load.

    python benchmarks/optim4bit_formats.py --steps 300 --out-md docs/results/optim4bit_formats.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

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
from qshard.optim import _functional, _qstate4
from qshard.train.data import load_corpus


@dataclass(frozen=True)
class Format:
    name: str
    m_block: int | None  # None: fp32 state
    v_map: str | None
    v_block: int | str | None  # an int, or "r1" for rank-1 normalisation


FORMATS = (
    Format("fp32", None, None, None),
    Format("m-dyn128 / v-linear-zero128 (naive)", 128, "linear-zero", 128),
    Format("m-dyn128 / v-linear128", 128, "linear", 128),
    Format("m-dyn2048 / v-linear128", 2048, "linear", 128),
    Format("m-dyn128 / v-dynamic128", 128, "dynamic", 128),
    Format("m-dyn128 / v-linear-r1", 128, "linear", "r1"),
    Format("m-dyn128 / v-dynamic-r1", 128, "dynamic", "r1"),
)


def _rank1_roundtrip(v: torch.Tensor, q) -> torch.Tensor:
    """Quantize-dequantize a 2-D (rows, row_numel view) tensor with rank-1 normalisation."""
    x = v.reshape(v.shape[0], -1)
    a = x.abs()
    scale = torch.minimum(a.amax(dim=1, keepdim=True), a.amax(dim=0, keepdim=True))
    d = torch.where(scale > 0, scale, torch.ones_like(scale))
    idx = torch.bucketize(x / d, q.mid)
    return (q.code[idx] * scale).reshape(v.shape)


def _roundtrip(t: torch.Tensor, map_name: str, block: int | str) -> torch.Tensor:
    q = _qstate4.qmap4(map_name)
    if block == "r1":
        return _rank1_roundtrip(t, q)
    codes, absmax = _qstate4.quantize_rows4(t, q, block)
    return _qstate4.dequantize_rows4(codes, absmax, q, block, t.shape)


class _SimulatedAdamW:
    """AdamW whose states of eligible tensors are kept as 4-bit round trips between steps."""

    def __init__(self, groups, fmt: Format, *, lr, betas, eps) -> None:
        self.groups, self.fmt = groups, fmt
        self.lr, self.betas, self.eps = lr, betas, eps
        self.state: dict[torch.Tensor, list] = {}
        self.step_count = 0

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.step_count += 1
        f = self.fmt
        for g in self.groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state.setdefault(p, [torch.zeros_like(p), torch.zeros_like(p)])
                _functional.adam_update(
                    p.data,
                    p.grad + 0.0,
                    st[0],
                    st[1],
                    step=self.step_count,
                    lr=lr,
                    beta1=self.betas[0],
                    beta2=self.betas[1],
                    eps=self.eps,
                    weight_decay=g["weight_decay"],
                    decoupled=True,
                )
                if f.m_block is not None and p.dim() >= 2 and p.numel() >= 4096:
                    st[0] = _roundtrip(st[0], "signed-dynamic", f.m_block)
                    st[1] = _roundtrip(st[1], f.v_map, f.v_block)


def _run(fmt: Format, corpus, args) -> dict:
    model, groups = model_and_groups(args, seed=0)
    opt = _SimulatedAdamW(groups, fmt, lr=args.lr, betas=BETAS, eps=EPS)
    t0 = time.perf_counter()
    result = train(model, corpus, args, 0, lambda step: opt.step(lr_at(step, args)))
    return {**result, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_problem_args(p)
    p.add_argument("--formats", default="", help="comma separated indices into the list (all)")
    add_report_args(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    corpus = load_corpus()
    chosen = FORMATS
    if args.formats:
        try:
            chosen = tuple(FORMATS[int(i)] for i in args.formats.split(","))
        except (ValueError, IndexError):
            p.error(
                f"--formats: {args.formats!r}; pass comma separated indices 0-{len(FORMATS) - 1} "
                "into the list in --help"
            )
    report = Report("4-bit optimizer state formats (AdamW, small GPT)")
    report.note(
        f"{describe(args)}, seed 0. Load average at start: "
        f"{os.getloadavg()[0]:.1f} (times only; losses are deterministic)."
    )
    rows = []
    ref = None
    for fmt in chosen:
        r = _run(fmt, corpus, args)
        if fmt.m_block is None:
            ref = r["val"]
        delta = "-" if ref is None or fmt.m_block is None else f"{100 * (r['val'] / ref - 1):+.2f}%"
        rows.append(
            [
                fmt.name,
                f"{r['val']:.4f}",
                delta,
                f"{r['train']:.4f}",
                f"{r['peak']:.3f}",
                f"{r['seconds']:.0f}",
            ]
        )
        print(rows[-1], flush=True)
    report.table(
        f"{args.steps} steps",
        [
            "format (m / v)",
            "val loss",
            "vs fp32",
            "train loss (last 10%)",
            "max train loss after warm-up",
            "time s",
        ],
        rows,
    )
    report.write(args.out_md)


if __name__ == "__main__":
    main()
