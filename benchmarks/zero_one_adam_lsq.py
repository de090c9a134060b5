"""0/1 Adam's local steps at a constant learning rate, on a realizable least-squares problem
(docs/zero_one_adam.md, "Local steps need a decaying learning rate").

Every rank draws its own minibatches (32 rows) of one 512 x 32 system ``A x = y`` with an exact
solution; all runs start from 0 with the same data stream and a constant lr. Adam averages its
gradients with an fp32 all-reduce; 1-bit Adam freezes at step 100; 0/1 Adam freezes its
variance at step 100 and then syncs every H steps (``local_step_scaler`` 20, so the interval
reaches ``local_step_clipper`` = H within 80 steps; H = 1 is no local steps), with the 1-bit
sync or, for comparison, an exact fp32 average of the drift. Prints the full-data mse after
``--steps`` steps (default 2000; the optimum is 0; 0/1 Adam also syncs half-way, where the mse is
taken but not printed). Deterministic (no timing).

    python benchmarks/zero_one_adam_lsq.py --ranks 2,4 --lrs 3e-3,1e-2,3e-2,1e-1
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Report, add_report_args

DIM, ROWS_PER_RANK, BATCH, FREEZE = 32, 256, 32, 100


def _run(rank: int, world: int, kind: str, lr: float, clipper: int, exact: bool, steps: int):
    import torch
    import torch.distributed as dist

    from qshard.optim import OneBitAdam, ZeroOneAdam

    g = torch.Generator().manual_seed(0)
    x_star = torch.randn(DIM, generator=g)
    a = torch.randn(world * ROWS_PER_RANK, DIM, generator=g)
    y = a @ x_star
    p = torch.nn.Parameter(torch.zeros(DIM))
    if kind == "adam":
        opt = torch.optim.Adam([p], lr=lr)
    elif kind == "onebit":
        opt = OneBitAdam([p], lr=lr, freeze_step=FREEZE)
    else:
        scaler = 20 if clipper > 1 else 10**9
        opt = ZeroOneAdam(
            [p], lr=lr, var_freeze_step=FREEZE, local_step_scaler=scaler, local_step_clipper=clipper
        )
        if exact:  # the drift averaged in fp32 instead of 1 bit
            opt._compressed_mean = lambda params, ts, tag: opt._all_reduce_mean(
                [t.clone() for t in ts], tag
            )
    data = torch.Generator().manual_seed(100 + rank)
    mse = {}
    for step in range(1, steps + 1):
        idx = torch.randint(0, a.shape[0], (BATCH,), generator=data)
        p.grad = a[idx].T @ (a[idx] @ p.detach() - y[idx]) / BATCH
        if kind == "adam":
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if step in (steps // 2, steps):
            if kind == "zero_one":
                opt.synchronize()
            mse[step] = float(((a @ p.detach() - y) ** 2).mean())
    return mse


def _world(rank: int, world: int, cases: list, steps: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")  # the interval warning is the point of the H > 2 rows
    return {name: _run(rank, world, *case, steps) for name, case in cases}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--lrs", default="3e-3,1e-2,3e-2,1e-1")
    parser.add_argument("--steps", type=int, default=2000)
    add_report_args(parser)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(
            f"--steps must be >= 1 (the table shows the loss after the last); got {args.steps}"
        )
    from qshard.testing import run_world

    report = Report("0/1 Adam's local steps at a constant lr: least squares")
    load = os.getloadavg()[0]
    table = []
    for world in (int(r) for r in args.ranks.split(",")):
        cases, rows = [], []
        for lr in (float(x) for x in args.lrs.split(",")):
            row = [("adam", lr, 1, False), ("onebit", lr, 1, False)]
            row += [("zero_one", lr, h, False) for h in (1, 2, 4, 16)]
            row += [("zero_one", lr, 16, True)]
            names = [f"{k}/{lr}/{h}/{e}" for k, lr, h, e in row]
            cases += [(n, c) for n, c in zip(names, row)]
            rows.append((lr, names))
        out = run_world(_world, world, args=(cases, args.steps), timeout_s=3000)[0]
        for lr, names in rows:
            table.append([world, f"{lr:g}", *(f"{out[n][args.steps]:.1e}" for n in names)])
    report.table(
        f"Full-data mse after {args.steps} steps (optimum 0)",
        ["ranks", "lr", "Adam", "1-bit Adam", "0/1 H=1", "H=2", "H=4", "H=16", "H=16 exact sync"],
        table,
    )
    report.note(
        f"Host load average {load:.1f} at the start (no times are measured; the numbers are "
        "deterministic)."
    )
    report.write(args.out_md)


if __name__ == "__main__":
    main()
