"""Convergence of ZeRO++ and of the compressed optimizers against their full-precision baselines
(the ZeRO++ paper's Table 4 and the 8-bit optimizers paper's Table 1, in miniature).

Every variant trains the same GPT from the same seed on the same batches of the embedded corpus
(the Python standard library, byte-level) with ``qshard.train``'s own loop
(:func:`qshard.train.loop.train`: warm-up + cosine schedule, gradient clipping, evaluation), on 4
local gloo ranks grouped as 2 emulated nodes of 2, all variants one after another inside ONE
spawned world (importing torch costs ~10 s per process here). The network is not shaped: this is
about numerics, not time.

Variants (reference in brackets):
- ZeRO++ (``zero3``, plain FSDP2 + AdamW): ``hpz``, ``qwz+hpz``, ``all`` (qwZ+hpZ+qgZ),
  ``all-qgz50`` (qgZ only for the first 50% of steps, the paper's interleaving),
  ``qwz-1block`` (qwZ with one quantization block per parameter shard: the paper's "basic
  quantization", one scale per tensor shard rather than per 256 values);
- 8-bit optimizers: ``adamw8bit`` and the 4-bit ``adamw4bit`` (``zero3``: the same run as the
  ZeRO++ baseline),
  ``adamw+stable`` and ``adamw8bit+stable`` (StableEmbedding, untied head);
- data-parallel compressed Adam (replicated model): ``onebit_adam`` and ``zero_one_adam``
  (``zero3``: AdamW, whose gradients are averaged exactly); ``zero_one_adam-k16`` is 0/1 Adam
  with its paper's kappa = 16 instead of the app's 32 (``zero_one_adam_schedule``);
- HSDP (``--parallel hsdp``: sharded inside a node, replicated across the 2 nodes): ``hsdp``
  (AdamW, FSDP2's fp32 replicate all-reduce; ``zero3``), and against it ``hsdp-bf16`` /
  ``hsdp-int4`` (the replicate all-reduce on a 16-bit / INT4 wire), ``hsdp-1bit`` /
  ``hsdp-01`` (1-bit Adam / 0/1 Adam syncing the replicas; no gradient crosses nodes).

Three variants need what ``TrainConfig`` does not expose (a qwZ block size, switching qgZ off
mid-run, 0/1 Adam's kappa): for the first two the script hands
:func:`qshard.train.loop.train` its own ``distribute``, which calls the public
:func:`qshard.zeropp.shard` and ``FSDPModule.set_custom_reduce_scatter``; for the third it sets
``qshard.train._parallel.APP_VAR_UPDATE_SCALER`` for that run.

Raw numbers go to ``--results`` (JSON, merged across runs so variants can be run separately);
the table and the overlaid loss curves (PNG) are rebuilt from it. Example (the default, 600 steps
x 12 variants; estimated 30-40 minutes on 2 quiet cores):

    python benchmarks/convergence.py --steps 600 --out-md docs/results/convergence.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import Report, add_report_args  # noqa: E402


@dataclass(frozen=True, kw_only=True, slots=True)
class Variant:
    """One training run of the comparison."""

    name: str
    """Row name."""
    group: str
    """Which comparison it belongs to (one table block and one plot per group)."""
    reference: str | None
    """The variant it is compared with (``None`` for a reference)."""
    target_pct: float | None
    """The issue's target: final val loss within this many percent of the reference."""
    zeropp: str = "off"
    """``TrainConfig.zeropp``."""
    optim: str = "adamw"
    """``TrainConfig.optim``."""
    stable_embedding: bool = False
    """``TrainConfig.stable_embedding``."""
    zeropp_overrides: dict = field(default_factory=dict)
    """Extra ``ZeroPPConfig`` fields (through our own ``distribute``)."""
    qgz_fraction: float | None = None
    """Use qgZ for this fraction of the steps, then FSDP2's plain reduce-scatter."""
    zero_one_kappa: int | None = None
    """0/1 Adam's ``var_update_scaler`` instead of the app's (``APP_VAR_UPDATE_SCALER``)."""
    parallel: str = "zero3"
    """``TrainConfig.parallel``."""
    replicate_grads: str = "fp32"
    """``TrainConfig.replicate_grads`` (HSDP)."""


VARIANTS: tuple[Variant, ...] = (
    Variant(name="zero3", group="zeropp", reference=None, target_pct=None),
    Variant(name="hpz", group="zeropp", reference="zero3", target_pct=0.0, zeropp="hpz"),
    Variant(name="qwz+hpz", group="zeropp", reference="zero3", target_pct=1.0, zeropp="qwz,hpz"),
    Variant(name="all", group="zeropp", reference="zero3", target_pct=1.0, zeropp="all"),
    Variant(
        name="all-qgz50",
        group="zeropp",
        reference="zero3",
        target_pct=1.0,
        zeropp="all",
        qgz_fraction=0.5,
    ),
    Variant(
        name="qwz-1block",
        group="zeropp",
        reference="zero3",
        target_pct=None,
        zeropp="qwz",
        zeropp_overrides={"weight_block_size": "shard"},
    ),
    Variant(name="adamw8bit", group="8bit", reference="zero3", target_pct=0.5, optim="adamw8bit"),
    Variant(name="adamw4bit", group="8bit", reference="zero3", target_pct=1.0, optim="adamw4bit"),
    Variant(
        name="adamw+stable", group="8bit", reference=None, target_pct=None, stable_embedding=True
    ),
    Variant(
        name="adamw8bit+stable",
        group="8bit",
        reference="adamw+stable",
        target_pct=0.5,
        optim="adamw8bit",
        stable_embedding=True,
    ),
    Variant(
        name="onebit_adam", group="dp", reference="zero3", target_pct=None, optim="onebit_adam"
    ),
    Variant(
        name="zero_one_adam", group="dp", reference="zero3", target_pct=1.0, optim="zero_one_adam"
    ),
    Variant(
        name="zero_one_adam-k16",
        group="dp",
        reference="zero3",
        target_pct=None,
        optim="zero_one_adam",
        zero_one_kappa=16,
    ),
    Variant(name="hsdp", group="hsdp", reference="zero3", target_pct=None, parallel="hsdp"),
    Variant(
        name="hsdp-bf16",
        group="hsdp",
        reference="hsdp",
        target_pct=1.0,
        parallel="hsdp",
        replicate_grads="bf16",
    ),
    Variant(
        name="hsdp-int4",
        group="hsdp",
        reference="hsdp",
        target_pct=1.0,
        parallel="hsdp",
        replicate_grads="int4",
    ),
    Variant(
        name="hsdp-1bit",
        group="hsdp",
        reference="hsdp",
        target_pct=1.0,
        parallel="hsdp",
        optim="onebit_adam",
    ),
    Variant(
        name="hsdp-01",
        group="hsdp",
        reference="hsdp",
        target_pct=1.0,
        parallel="hsdp",
        optim="zero_one_adam",
    ),
)
BY_NAME = {v.name: v for v in VARIANTS}
GROUP_TITLES = {
    "zeropp": "ZeRO++ vs ZeRO-3 (AdamW)",
    "8bit": "8-bit AdamW vs 32-bit AdamW",
    "dp": "1-bit Adam and 0/1 Adam vs AdamW (exact gradient averaging)",
    "hsdp": "HSDP variants vs HSDP with AdamW (fp32 replicate all-reduce)",
}


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=600, help="optimizer steps per variant")
    p.add_argument("--variants", default=",".join(BY_NAME), help="comma separated")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32, help="global sequences per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of the steps")
    p.add_argument("--eval-interval", type=int, default=None, help="default: 10%% of the steps")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole world")
    p.add_argument(
        "--results",
        default=str(HERE.parent / "docs" / "results" / "convergence.json"),
        help="raw results (JSON), merged with what is there (same settings only)",
    )
    p.add_argument("--plot-dir", default=None, help="PNG folder (default: next to --results)")
    p.add_argument("--report-only", action="store_true", help="rebuild table and plots only")
    add_report_args(p)
    args = p.parse_args(argv)
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variant_list if v not in BY_NAME]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(BY_NAME)}")
    if args.steps < 2:
        p.error("--steps must be >= 2")
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.steps // 20)
    if args.eval_interval is None:
        args.eval_interval = max(1, args.steps // 10)
    return args


def _settings(args: argparse.Namespace) -> dict:
    """What must match for two runs' numbers to be comparable."""
    keys = ("steps", "n_layer", "n_embd", "n_head", "context", "batch_size", "lr")
    keys += ("warmup_steps", "eval_interval", "eval_batches", "seed", "nproc", "ranks_per_node")
    return {k: getattr(args, k) for k in keys}


# ----------------------------------------------------------------------------------------------
# Inside the world: every rank runs every variant through qshard.train.loop.train.


class _SwitchingReduceScatter:
    """FSDP2 reduce-scatter comm: ``first`` for the first ``switch_after`` calls, then ``then``.

    FSDP2 calls the reduce-scatter once per FSDP unit per step, so a call count is a step count.
    """

    def __init__(self, first, then, switch_after: int) -> None:
        self.first, self.then, self.switch_after, self.calls = first, then, switch_after, 0

    def allocate(self, size, *, dtype, device):
        return self.first.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        comm = self.first if self.calls < self.switch_after else self.then
        self.calls += 1
        return comm(output_tensor, input_tensor, group, op, async_op)


def _shard_block_size(model, world: int) -> int:
    """A qwZ block size that gives every parameter's shard exactly one block (one scale).

    FSDP2 shards each parameter along dim 0 (padded to a multiple of the world); qwZ pads every
    parameter's shard to whole blocks so no block mixes two parameters (see [Note: qwZ block
    layout] in qshard.zeropp.all_gather). A block as large as the largest shard therefore means
    one absmax scale per tensor shard: the paper's "basic quantization". Smaller shards are
    zero-padded to it, so this variant's wire bytes grow; only its numerics matter here.
    """
    largest = max(
        -(-p.shape[0] // world) * (p.numel() // max(1, p.shape[0])) for p in model.parameters()
    )
    return -(-largest // 8) * 8  # ZeroPPConfig wants a multiple of 8


def _custom_distribute(variant: Variant, steps: int):
    """A ``distribute`` for :func:`qshard.train.loop.train` with what TrainConfig cannot say."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    from qshard.train.config import parse_zeropp
    from qshard.zeropp import RecordingReduceScatter, ZeroPPConfig, shard

    class Switching(_SwitchingReduceScatter, ReduceScatter):
        pass

    def distribute(model, config, *, topology, compute_dtype):
        features = parse_zeropp(variant.zeropp)
        overrides = dict(variant.zeropp_overrides)
        if overrides.get("weight_block_size") == "shard":
            overrides["weight_block_size"] = _shard_block_size(model, topology.world_size)
        zcfg = ZeroPPConfig(
            qwz="qwz" in features,
            hpz="hpz" in features,
            qgz="qgz" in features,
            **overrides,
        )
        shard(model, topology=topology, config=zcfg)
        desc = f"FSDP2 + ZeRO++ ({variant.zeropp}; {variant.zeropp_overrides or ''})"
        if variant.qgz_fraction is not None:
            units = [m for m in model.modules() if isinstance(m, FSDPModule)]
            qgz = units[0]._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
            switch = Switching(
                qgz, RecordingReduceScatter(), int(variant.qgz_fraction * steps) * len(units)
            )
            for m in units:
                m.set_custom_reduce_scatter(switch)
            desc += f", qgZ for the first {variant.qgz_fraction:.0%} of steps"
        return desc

    return distribute


def _world(rank: int, world: int, settings: dict, names: list[str], run_root: str) -> dict:
    import warnings

    import torch

    from qshard.train import _parallel, loop
    from qshard.train.config import TrainConfig

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out: dict[str, dict] = {}
    original = loop.distribute
    for name in names:
        v = BY_NAME[name]
        cfg = TrainConfig(
            out=os.path.join(run_root, name),
            nproc=world,
            ranks_per_node=settings["ranks_per_node"],
            n_layer=settings["n_layer"],
            n_head=settings["n_head"],
            n_embd=settings["n_embd"],
            context=settings["context"],
            stable_embedding=v.stable_embedding,
            zeropp=v.zeropp,
            optim=v.optim,
            parallel=v.parallel,
            replicate_grads=v.replicate_grads,
            steps=settings["steps"],
            batch_size=settings["batch_size"],
            lr=settings["lr"],
            min_lr=settings["lr"] / 10,
            warmup_steps=settings["warmup_steps"],
            eval_interval=settings["eval_interval"],
            eval_batches=settings["eval_batches"],
            seed=settings["seed"],
            export=False,
            progress=False,
        )
        custom = v.zeropp_overrides or v.qgz_fraction is not None
        loop.distribute = _custom_distribute(v, cfg.steps) if custom else original
        app_kappa = _parallel.APP_VAR_UPDATE_SCALER
        if v.zero_one_kappa is not None:
            _parallel.APP_VAR_UPDATE_SCALER = v.zero_one_kappa
        t0 = time.perf_counter()
        # The loop's own summary goes to the run folder's summary.txt; keep the console short.
        try:
            with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
                res = loop.train(cfg)
        finally:
            loop.distribute = original
            _parallel.APP_VAR_UPDATE_SCALER = app_kappa
        if rank == 0:
            print(
                f"[convergence] {name}: final val loss {res['val_losses'][cfg.steps - 1]:.4f} "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
            out[name] = {
                "losses": [res["losses"][s] for s in sorted(res["losses"])],
                "val_losses": {str(s): x for s, x in sorted(res["val_losses"].items())},
                "inter_node_bytes_per_step": res["inter_node_bytes_per_step"],
                "num_params": res["num_params"],
                "train_time_s": res["train_time_s"],
            }
    return out


# ----------------------------------------------------------------------------------------------
# Report: table and plots from the raw results.


def _final_val(r: dict) -> float:
    return r["val_losses"][max(r["val_losses"], key=int)]


def report(args: argparse.Namespace, data: dict) -> None:
    runs, s = data["runs"], data["settings"]
    any_run = next(iter(runs.values()))
    rep = Report(
        f"Convergence over {s['steps']} steps: ZeRO++ and compressed optimizers vs full precision"
    )
    rep.note(
        f"GPT of {any_run['num_params'] / 1e6:.2f} M parameters ({s['n_layer']} layers, width "
        f"{s['n_embd']}, context {s['context']}), fp32, byte-level Python stdlib corpus; "
        f"{s['steps']} steps, global batch {s['batch_size']}, lr {s['lr']} (warm-up "
        f"{s['warmup_steps']}, cosine to lr/10), seed {s['seed']}; {s['nproc']} ranks as "
        f"{s['nproc'] // s['ranks_per_node']} emulated nodes of {s['ranks_per_node']} (gloo, "
        "unshaped); qshard.train's loop. Validation loss: mean over "
        f"{s['eval_batches']} fixed global batches (0/1 Adam: of its synchronised model; the loop "
        "syncs before evaluating). Train loss: mean of the last 10% of steps."
        + (
            f" Host load average {data['load'][0]:.1f} at the start, {data['load'][1]:.1f} at "
            "the end (times only; the losses do not depend on it)."
            if "load" in data
            else ""
        )
    )
    rows = []
    for v in VARIANTS:
        if v.name not in runs:
            continue
        r = runs[v.name]
        val = _final_val(r)
        tail = r["losses"][-max(1, len(r["losses"]) // 10) :]
        ref = runs.get(v.reference) if v.reference else None
        delta = (val / _final_val(ref) - 1) * 100 if ref else None
        verdict = "-"
        if delta is not None and v.target_pct is not None:
            ok = abs(delta) <= v.target_pct if v.target_pct else delta == 0
            verdict = ("met" if ok else "NOT met") + f" (<= {v.target_pct}%)"
        rows.append(
            [
                GROUP_TITLES[v.group].split(" vs ")[0],
                v.name,
                v.optim,
                v.zeropp
                + (" +stable" if v.stable_embedding else "")
                + (f" hsdp/{v.replicate_grads}" if v.parallel == "hsdp" else ""),
                f"{val:.4f}",
                v.reference or "-",
                f"{delta:+.2f}%" if delta is not None else "-",
                verdict,
                f"{sum(tail) / len(tail):.4f}",
                f"{r['inter_node_bytes_per_step'] / 2**20:.3f}",
                f"{r['train_time_s']:.0f}",
            ]
        )
    rep.table(
        "Final validation loss",
        [
            "group",
            "variant",
            "optimizer",
            "zeropp",
            "val loss",
            "reference",
            "vs reference",
            "target",
            "train loss",
            "inter-node MiB/step (ledger)",
            "time s",
        ],
        rows,
    )
    for png in _plots(args, runs):
        rel = os.path.relpath(png, os.path.dirname(os.path.abspath(args.out_md or png)))
        rep.note(f"![{Path(png).stem}]({rel})")
    rep.write(args.out_md)


def _plots(args: argparse.Namespace, runs: dict) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("convergence: matplotlib is not installed; no plots", file=sys.stderr)
        return []
    plot_dir = Path(args.plot_dir or Path(args.results).parent)
    plot_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for group, title in GROUP_TITLES.items():
        names = [v.name for v in VARIANTS if v.group == group and v.name in runs]
        if "zero3" in runs and "zero3" not in names:
            names.insert(0, "zero3")
        if len(names) < 2:
            continue
        fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(11, 4))
        for name in names:
            losses = runs[name]["losses"]
            k = max(1, len(losses) // 50)  # moving average over 2% of the run
            smooth = [
                sum(losses[max(0, i - k + 1) : i + 1]) / len(losses[max(0, i - k + 1) : i + 1])
                for i in range(len(losses))
            ]
            ax_t.plot(range(1, len(losses) + 1), smooth, label=name, lw=1)
            steps = sorted(int(s) for s in runs[name]["val_losses"])
            ax_v.plot(
                [s + 1 for s in steps],
                [runs[name]["val_losses"][str(s)] for s in steps],
                marker="o",
                ms=3,
                label=name,
                lw=1,
            )
        ax_t.set(title="train loss (moving average)", xlabel="step", ylabel="loss")
        ax_v.set(title="validation loss", xlabel="step")
        for ax in (ax_t, ax_v):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        lo = min(min(runs[n]["val_losses"].values()) for n in names)
        ax_v.set_ylim(lo - 0.05, lo + 1.0)
        fig.suptitle(title)
        fig.tight_layout()
        path = plot_dir / f"convergence_{group}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(str(path))
    return out


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    settings = _settings(args)
    results = Path(args.results)
    data = {"settings": settings, "runs": {}}
    if results.exists():
        old = json.loads(results.read_text())
        if old.get("settings") == settings or args.report_only:
            data = old
        else:
            print(f"convergence: {results} holds runs with other settings; starting afresh")
    if not args.report_only:
        from qshard.testing import run_world

        with tempfile.TemporaryDirectory(prefix="qshard-convergence-") as run_root:
            t0 = time.perf_counter()
            load_start = os.getloadavg()[0]
            out = run_world(
                _world,
                args.nproc,
                args=(settings, args.variant_list, run_root),
                env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
                timeout_s=args.timeout,
            )
            print(f"[convergence] world finished in {time.perf_counter() - t0:.0f} s")
        data["load"] = [load_start, os.getloadavg()[0]]
        data["runs"].update(out[0])
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(data, indent=1))
    if not data["runs"]:
        print("convergence: no results to report", file=sys.stderr)
        return 1
    report(args, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
