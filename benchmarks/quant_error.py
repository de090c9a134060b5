"""Quantization error: tensor-wise vs block-wise INT8/INT4, and dynamic vs linear 8-bit maps.

Weight-like data: normal(0, 0.02) with rare large outliers (1 in 10^4 at 20 sigma by
default). Adam-state-like data: a first moment (heavy-tailed, signed) and a second moment
(squared, spanning many decades, unsigned). Errors are relative L2 (``||x̂ - x|| / ||x||``)
and max absolute error. Tensor-wise = one block covering the whole tensor.

``--checkpoint FILE`` adds the weights of a saved ``state_dict`` (``torch.save``) — e.g. the
training model's, once it exists — every floating tensor of >= 4096 elements; of a checkpoint
that wraps one (``{"model": state_dict, "optim": ...}``), the model's (``checkpoint_weights``).
A file with no such tensor is refused, naming what it holds.

    python benchmarks/quant_error.py
    python benchmarks/quant_error.py --numel 1000000 --out-md docs/results/quant_error.md
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

import qshard.quant as Q
from _common import Report, add_report_args, at_least


def errors(x: torch.Tensor, d: torch.Tensor) -> tuple[float, float]:
    diff = (d.double() - x.double()).reshape(-1)
    return (diff.norm() / x.double().norm()).item(), diff.abs().max().item()


def int_error(x: torch.Tensor, bits: int, block_size: int | None) -> tuple[float, float]:
    bs = x.numel() + (x.numel() % 2) if block_size is None else block_size
    q = Q.quantize_blockwise(x, bits=bits, block_size=bs)
    return errors(x, Q.dequantize_blockwise(q, dtype=torch.float32))


def codebook_error(
    x: torch.Tensor, code: torch.Tensor, block_size: int
) -> tuple[float, float, float]:
    codes, absmax = Q.quantize_codebook(x, code, block_size=block_size)
    d = Q.dequantize_codebook(codes, absmax, code, block_size=block_size)
    rel, mx = errors(x, d)
    nz = x != 0
    # Mean relative error per element: where small magnitudes matter (Adam's denominator).
    per_elem = ((d[nz] - x[nz]).abs() / x[nz].abs()).clamp(max=1.0).mean().item()
    return rel, mx, per_elem


def weight_like(n: int, outlier_rate: float, outlier_sigma: float, gen) -> torch.Tensor:
    x = torch.randn(n, generator=gen) * 0.02
    mask = torch.rand(n, generator=gen) < outlier_rate
    signs = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    return torch.where(mask, signs * outlier_sigma * 0.02, x)


#: Where a checkpoint that is not a bare ``state_dict`` keeps the model's: ``qshard.train``'s
#: per-rank files and most training loops (``model``), Lightning / timm (``state_dict``),
#: DeepSpeed (``module``).
_MODEL_KEYS = ("model", "state_dict", "module")
_MIN_CHECKPOINT_NUMEL = 4096


def checkpoint_weights(state: object, path: str) -> list[torch.Tensor]:
    """The floating tensors of >= 4096 elements of a loaded checkpoint, flattened to fp32.

    A bare ``state_dict`` gives its own; a checkpoint that wraps one (``{"model": sd,
    "optim": ..., ...}``, as ``qshard.train``'s per-rank files are) gives the model's under the
    first of ``_MODEL_KEYS`` it has (never the optimizer's moments). Raises ``SystemExit``
    naming what the file holds when nothing qualifies: the table would otherwise be left out
    without a word."""

    def of(sd: object) -> list[torch.Tensor]:
        if not isinstance(sd, dict):
            return []
        return [
            t.detach().float().reshape(-1)
            for t in sd.values()
            if isinstance(t, torch.Tensor)
            and t.is_floating_point()
            and t.numel() >= _MIN_CHECKPOINT_NUMEL
        ]

    weights = of(state)
    if not weights and isinstance(state, dict):
        for key in _MODEL_KEYS:
            if isinstance(state.get(key), dict):
                weights = of(state[key])
                break
    if not weights:
        keys = list(state)[:10] if isinstance(state, dict) else type(state).__name__
        raise SystemExit(
            f"quant_error: --checkpoint {path} has no floating tensor of >= "
            f"{_MIN_CHECKPOINT_NUMEL} elements at its top level or under "
            f"{'/'.join(repr(k) for k in _MODEL_KEYS)} (it holds {keys}); pass a file saved "
            f"with torch.save(model.state_dict(), FILE)"
        )
    return weights


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=at_least(1), default=4 * 2**20)
    parser.add_argument("--outlier-rate", type=float, default=1e-4)
    parser.add_argument("--outlier-sigma", type=float, default=20.0)
    parser.add_argument("--block-sizes", type=at_least(1), nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument(
        "--checkpoint",
        help="a torch.save'd state_dict (or a checkpoint holding one under 'model', "
        "'state_dict' or 'module') whose weights to add",
    )
    add_report_args(parser)
    args = parser.parse_args(argv)

    # Errors are the same bits on either path; the reference path skips compiling a kernel
    # per block size swept here.
    Q.set_fastpath(False)
    torch.manual_seed(0)  # the Student-t samples below use the global generator
    gen = torch.Generator().manual_seed(0)
    report = Report(title="qshard.quant error: tensor-wise vs block-wise, dynamic vs linear")
    datasets = {
        f"weight-like (1 in {1 / args.outlier_rate:,.0f} at {args.outlier_sigma:g} sigma)": (
            weight_like(args.numel, args.outlier_rate, args.outlier_sigma, gen)
        ),
        "normal, no outliers": torch.randn(args.numel, generator=gen) * 0.02,
    }
    if args.checkpoint:
        state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        weights = checkpoint_weights(state, args.checkpoint)
        datasets[f"checkpoint {os.path.basename(args.checkpoint)} ({len(weights)} tensors)"] = (
            torch.cat(weights)
        )

    for name, x in datasets.items():
        rows = []
        for bits in (8, 4):
            t_rel, t_max = int_error(x, bits, None)
            rows.append([f"INT{bits}", "tensor-wise", t_rel, t_max, 1.0])
            for bs in args.block_sizes:
                rel, mx = int_error(x, bits, bs)
                rows.append([f"INT{bits}", f"block {bs}", rel, mx, t_rel / rel])
        report.table(
            f"{name}, {x.numel():,} elements",
            ["format", "scaling", "rel. L2 error", "max abs error", "tensor-wise / this (L2)"],
            rows,
        )

    # Adam-state-like data, as an 8-bit optimizer stores it.
    g = torch.distributions.StudentT(3.0).sample((args.numel,)) * 1e-3
    exp_avg = g
    exp_avg_sq = (torch.distributions.StudentT(3.0).sample((args.numel,)) * 1e-3) ** 2 * 10.0 ** (
        torch.rand(args.numel, generator=gen) * 4 - 2
    )
    rows = []
    for state_name, x, signed in (("exp_avg", exp_avg, True), ("exp_avg_sq", exp_avg_sq, False)):
        for map_name, code in (
            ("dynamic", Q.dynamic_map(signed=signed)),
            ("linear", Q.linear_map(signed=signed)),
        ):
            for bs in (256, 2048):
                rows.append([state_name, map_name, bs, *codebook_error(x, code, bs)])
    report.table(
        "Adam-state-like data, 8-bit codebooks",
        ["state", "map", "block", "rel. L2 error", "max abs error", "mean rel. error / elem"],
        rows,
    )

    try:
        import bitsandbytes.functional as bnbf
    except Exception as e:  # absent: skip cleanly
        report.note(
            f"bitsandbytes not importable ({type(e).__name__}); code-agreement table skipped"
        )
    else:
        rows = []
        for state_name, x, signed in (
            ("exp_avg", exp_avg, True),
            ("exp_avg_sq", exp_avg_sq, False),
        ):
            code = Q.dynamic_map(signed=signed)
            ours, _ = Q.quantize_codebook(x, code, block_size=256)
            theirs, _ = bnbf.quantize_blockwise(x, code=code, blocksize=256)
            wrong = (ours != theirs.reshape(-1)).float().mean().item()
            rows.append([state_name, f"{100 * wrong:.2f}%"])
        report.table(
            "bitsandbytes CPU quantize_blockwise: codes differing from the exact nearest code",
            ["state", "codes differing"],
            rows,
        )
    report.write(args.out_md)


if __name__ == "__main__":
    main()
