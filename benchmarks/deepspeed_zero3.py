"""DeepSpeed ZeRO-3 on CPU as a second throughput baseline next to ``benchmarks/throughput.py``,
and what DeepSpeed's own ZeRO++ options (qwZ, hpZ, qgZ) do on a CPU-only machine.

The same GPT (``qshard.train.model``, fp32 compute and master weights), sizes, batches, seed,
optimizer (torch AdamW with ``fused=True``, lr 1e-3, no weight decay; ``--optimizer``) and
emulated cluster (``netsim.sh``: 2 nodes x 2 ranks, tbf-shaped node links) as
``throughput.py``, but sharded by ``deepspeed.initialize``
with ``zero_optimization.stage = 3`` over gloo instead of by FSDP2 / ``qshard.zeropp``. One
launch runs every variant at every rate:

- ``ds-zero3``: ZeRO stage 3 as the paper's baseline and FSDP2 run it: every parameter
  partitioned (``stage3_param_persistence_threshold`` 0) and all-gathered again for backward.
  That takes ``stage3_max_reuse_distance`` 0 and ``stage3_prefetch_bucket_size`` 0: DeepSpeed
  keeps a parameter it prefetched until a later use, and with any prefetch here (DeepSpeed's
  5e7 elements, or one block's 789,760) no parameter was all-gathered in backward at all;
- ``ds-defaults``: ZeRO stage 3 with DeepSpeed's default thresholds (persistence 1e5, reuse
  distance 1e9, prefetch 5e7 elements: sized for billion-parameter models). On this model every
  gathered parameter then stays from forward to backward: ZeRO-3 without its backward all-gather;
- ``ds-qwz``: + ``zero_quantized_weights``; ``ds-hpz``: + ``zero_hpz_partition_size`` = ranks per
  node; ``ds-qgz``: + ``zero_quantized_gradients``; ``ds-all``: all three.

A variant that fails (DeepSpeed's quantizer kernels exist for CUDA only: on the CPU accelerator
its op builder raises ``This op had not been implemented on CPU backend``) is recorded with the
phase and exact error instead of numbers. Step time is the slowest rank's time from a barrier to
the end of ``engine.step()``; median and min over ``--steps`` timed steps after ``--warmup``
untimed ones. Link MiB/step is the busiest node's ``eth0`` tx counter over the timed steps.

DeepSpeed is not a qshard dependency. Set it up in a separate venv (torch pinned, so pip keeps
the CPU build), from the repository root:

    python -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install deepspeed==0.19.8 torch==2.13.0
    /tmp/dsvenv/bin/pip install --no-deps -e .

and run it as root (network namespaces) with that venv's Python, e.g.

    /tmp/dsvenv/bin/python benchmarks/deepspeed_zero3.py --rates 100 --steps 10 \\
        --out-md docs/results/deepspeed_zero3.md

``DS_ACCELERATOR=cpu`` and ``TORCH_EXTENSIONS_DIR`` (a scratch folder for DeepSpeed's JIT-built
ops) are set by the script unless given. ``--optimizer ds-cpu-adam`` uses DeepSpeed's CPU Adam
instead of torch AdamW: its C++ op is compiled once by the launcher before the ranks start
(minutes on 2 cores, cached in ``TORCH_EXTENSIONS_DIR``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import Report, add_report_args  # noqa: E402

# Quantized ZeRO++ options last: on CPU their deepspeed.initialize fails part-way and leaves
# DeepSpeed state behind that changes later engines in the same process (measured: ds-zero3 built
# after a failed ds-all no longer all-gathers in backward, 28.1 instead of 37.9 MiB/step).
ALL_VARIANTS = ("ds-zero3", "ds-defaults", "ds-hpz", "ds-qwz", "ds-qgz", "ds-all")
# torch-adamw-fused: torch AdamW(fused=True), throughput.py's default (--optimizer fused);
# torch-adamw: its default flags (the for-loop on CPU; throughput.py --optimizer default).
OPTIMIZERS = ("torch-adamw-fused", "torch-adamw", "ds-cpu-adam")
BASELINE = "ds-zero3"
SETUP_HINT = (
    "set up DeepSpeed in its own venv (see this script's docstring): python -m venv /tmp/dsvenv; "
    "/tmp/dsvenv/bin/pip install torch==2.13.0; "
    "DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install deepspeed==0.19.8 torch==2.13.0; "
    "/tmp/dsvenv/bin/pip install --no-deps -e . ; then run /tmp/dsvenv/bin/python "
    "benchmarks/deepspeed_zero3.py"
)
# The lr and weight decay throughput.py gives torch AdamW.
LR = 1e-3
WEIGHT_DECAY = 0.0


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    from netsim.cluster import add_cluster_args, check_cluster_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_cluster_args(p, default_variants=ALL_VARIANTS)
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="torch-adamw-fused",
        help="torch-adamw-fused (torch AdamW with fused=True, as throughput.py's default), "
        "torch-adamw (torch's default flags: throughput.py --optimizer default) or DeepSpeed's "
        "JIT-compiled CPU Adam (AdamW mode)",
    )
    p.add_argument(
        "--persistence-threshold",
        type=int,
        default=0,
        help="stage3_param_persistence_threshold: parameters with fewer elements stay whole on "
        "every rank (0: all partitioned, like FSDP2; DeepSpeed's default is 100000); every "
        "variant but ds-defaults",
    )
    p.add_argument(
        "--reuse-distance",
        type=int,
        default=0,
        help="stage3_max_reuse_distance in elements: a gathered parameter used again within it "
        "is kept (0: re-gathered for backward, like FSDP2's reshard_after_forward; DeepSpeed's "
        "default is 1e9); every variant but ds-defaults",
    )
    p.add_argument(
        "--prefetch-bucket",
        type=int,
        default=0,
        help="stage3_prefetch_bucket_size in elements (0: no prefetch, which the backward "
        "all-gather needs here, see above; DeepSpeed's default is 5e7); every variant but "
        "ds-defaults",
    )
    add_report_args(p)
    args = p.parse_args(argv)
    check_cluster_args(p, args, variants=ALL_VARIANTS)
    if args.persistence_threshold < 0 or args.reuse_distance < 0 or args.prefetch_bucket < 0:
        p.error("--persistence-threshold, --reuse-distance and --prefetch-bucket must be >= 0")
    return args


def zeropp_options(variant: str, ranks_per_node: int) -> dict[str, object]:
    """The ``zero_optimization`` keys that turn DeepSpeed's ZeRO++ features on for ``variant``."""
    qwz = {"zero_quantized_weights": True}
    hpz = {"zero_hpz_partition_size": ranks_per_node}
    qgz = {"zero_quantized_gradients": True}
    table: dict[str, dict[str, object]] = {
        "ds-zero3": {},
        "ds-defaults": {},
        "ds-qwz": qwz,
        "ds-hpz": hpz,
        "ds-qgz": qgz,
        "ds-all": {**qwz, **hpz, **qgz},
    }
    if variant not in table:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(ALL_VARIANTS)}")
    return dict(table[variant])


def ds_config(args: argparse.Namespace, variant: str, world_size: int) -> dict[str, object]:
    """The DeepSpeed config of one variant: ZeRO-3, fp32 (no fp16/bf16 section), one micro-batch
    of ``batch_per_rank`` sequences per rank and step, no gradient clipping (as throughput.py)."""
    zero: dict[str, object] = {"stage": 3}
    if variant != "ds-defaults":
        zero["stage3_param_persistence_threshold"] = args.persistence_threshold
        zero["stage3_max_reuse_distance"] = args.reuse_distance
        zero["stage3_prefetch_bucket_size"] = args.prefetch_bucket
    zero.update(zeropp_options(variant, args.ranks_per_node))
    return {
        "train_micro_batch_size_per_gpu": args.batch_per_rank,
        "gradient_accumulation_steps": 1,
        "train_batch_size": args.batch_per_rank * world_size,
        "zero_optimization": zero,
        # A client optimizer (torch AdamW) under ZeRO needs this; DeepSpeed's CPU Adam does not.
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _origin(exc: BaseException) -> str:
    """Where DeepSpeed asked for what failed: the innermost frame outside its op builders
    (``op_builder/*/no_impl.py`` only raises), as ``deepspeed/path.py:line function``."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "op_builder" not in f.filename]
    if not frames:
        return "?"
    f = frames[-1]
    path = f.filename
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    return f"{path}:{f.lineno} {f.name}"


# ----------------------------------------------------------------------------------------------
# Worker: one process per rank, inside the emulated cluster.


def _make_optimizer(name: str, params):
    import torch

    if name == "ds-cpu-adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    fused = {"fused": True} if name == "torch-adamw-fused" else {}
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **fused)


def _measure(variant, args, corpus, rank, world):
    """Build, warm up and time one variant; raises with ``.phase`` set where it failed."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from netsim.link import NodeLinkMeter
    from qshard.train.data import batch_for_step
    from qshard.train.model import GPT, GPTConfig

    phase = "deepspeed.initialize"
    try:
        torch.manual_seed(args.seed)
        model = GPT(
            GPTConfig(
                n_layer=args.n_layer,
                n_embd=args.n_embd,
                n_head=args.n_head,
                context=args.context,
                seed=args.seed,
            )
        )
        opt = _make_optimizer(args.optimizer, model.parameters())
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=opt, config=ds_config(args, variant, world)
        )
        meter = NodeLinkMeter()

        def step(i: int) -> float:
            nonlocal phase
            x, y = batch_for_step(
                corpus.train,
                step=i,
                seed=args.seed,
                global_batch=args.batch_per_rank * world,
                context=args.context,
                rank=rank,
                world_size=world,
            )
            phase = f"step {i} forward"
            _, loss = engine(x, y)
            phase = f"step {i} backward"
            engine.backward(loss)
            phase = f"step {i} engine.step"
            engine.step()
            return loss.item()

        losses = [step(i) for i in range(args.warmup)]
        times = []
        meter.start()
        for i in range(args.warmup, args.warmup + args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            losses.append(step(i))
            times.append(time.perf_counter() - t0)
        per_node = meter.stop()
    except Exception as exc:
        exc.phase = phase  # type: ignore[attr-defined]
        raise
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    engine.destroy()
    return {
        "times": t.tolist(),
        "node_tx": [b.tx / args.steps for b in per_node],
        "node_rx": [b.rx / args.steps for b in per_node],
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def worker(args: argparse.Namespace) -> int:
    import logging
    import warnings

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from netsim.link import set_link_rate
    from qshard.train.data import load_corpus
    from qshard.train.model import GPT, GPTConfig

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.rank_timeout))
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group made above
    deepspeed.utils.logger.setLevel(logging.WARNING)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        load_corpus(min_tokens=args.context + 1)  # build the cache once, before the others read it
    dist.barrier()
    corpus = load_corpus(min_tokens=args.context + 1)
    n_params = GPT(
        GPTConfig(
            n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, context=args.context
        )
    ).num_params()
    data: dict[str, object] = {
        "results": {},
        "failed": {},
        "n_params": n_params,
        "versions": {
            "deepspeed": deepspeed.__version__,
            "torch": torch.__version__,
            "accelerator": get_accelerator().device_name(),
            "backend": dist.get_backend(),
            "python": sys.executable,
        },
        "configs": {v: ds_config(args, v, world) for v in args.variant_list},
        "done": False,
    }

    def save() -> None:
        # Written after every variant, so a hang or crash later still leaves the numbers so far.
        if rank == 0 and args.result_json:
            with open(args.result_json, "w") as f:
                json.dump(data, f)

    for rate in args.rate_list:
        data["results"][str(rate)] = {}
    # Variant-major, in ALL_VARIANTS' order: every working variant is measured at every rate
    # before any option that fails on CPU is tried (see ALL_VARIANTS).
    order = sorted(args.variant_list, key=ALL_VARIANTS.index)
    for variant, rate in ((v, r) for v in order for r in args.rate_list):
        if variant in data["failed"]:
            continue  # a failure of DeepSpeed's own setup does not depend on the link rate
        set_link_rate(rate)
        t0 = time.perf_counter()
        try:
            res = _measure(variant, args, corpus, rank, world)
        except Exception as exc:
            why = {
                "phase": getattr(exc, "phase", "?"),
                "error": _first_line(exc),
                "origin": _origin(exc),
                "rate": rate,
            }
            if rank == 0:
                print(
                    f"[deepspeed_zero3] {rate} Mbit/s {variant}: failed in {why['phase']}: "
                    f"{why['error']}",
                    flush=True,
                )
                traceback.print_exc(limit=-4)
            errors: list[object] = [None] * world
            dist.all_gather_object(errors, why)  # every rank's failure, and back in step
            data["failed"][variant] = why
            data["failed"][variant]["ranks_failed"] = sum(e is not None for e in errors)
            gc.collect()
            save()
            continue
        gc.collect()  # the previous variant's engine goes before the next is built
        data["results"][str(rate)][variant] = res
        save()
        if rank == 0:
            print(
                f"[deepspeed_zero3] {rate} Mbit/s {variant:>8}: median "
                f"{statistics.median(res['times']):.3f} s/step, link "
                f"{max(res['node_tx']) / 2**20:.2f} MiB/step "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    data["done"] = True
    save()
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------------------------
# Launcher: checks DeepSpeed, starts the emulated cluster, turns the workers' numbers into tables.


def deepspeed_problem() -> str | None:
    """None if DeepSpeed imports in this Python, else a message naming the fix."""
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install failing at import time
        return (
            f"DeepSpeed is not importable with {sys.executable} ({_first_line(exc)}); {SETUP_HINT}"
        )
    return None


def prebuild_ops(optimizer: str) -> tuple[float, str | None]:
    """JIT-compile the DeepSpeed ops the ranks will load, once, before they start (four ranks
    compiling at once on 2 cores would wait on each other's lock for minutes): the shared-memory
    comm op every ``deepspeed.init_distributed`` on the CPU accelerator builds, and the CPU Adam
    op for ``--optimizer ds-cpu-adam``. Returns (seconds spent, None or what failed)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    t0 = time.perf_counter()
    names = ["ShareMemCommBuilder"] + (["CPUAdamBuilder"] if optimizer == "ds-cpu-adam" else [])
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or (
            name == "ShareMemCommBuilder"
            and not deepspeed.ops.__compatible_ops__.get(builder.NAME, False)
        ):
            if name == "CPUAdamBuilder":
                return time.perf_counter() - t0, (
                    "DeepSpeed has no CPU Adam op for this accelerator; "
                    "use --optimizer torch-adamw-fused"
                )
            continue  # DeepSpeed itself skips the shm op where it is not compatible
        try:
            builder.load()
        except Exception as exc:
            return time.perf_counter() - t0, (
                f"DeepSpeed's {name} op does not build here ({_first_line(exc)})"
                + ("; use --optimizer torch-adamw-fused" if name == "CPUAdamBuilder" else "")
            )
    return time.perf_counter() - t0, None


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    from netsim.cluster import needs_root, run_cluster_args

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault(
        "TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), "qshard-deepspeed-ext")
    )
    problem = deepspeed_problem()
    if problem:
        print(f"deepspeed_zero3: {problem}", file=sys.stderr)
        return 2
    refused = needs_root("deepspeed_zero3")
    if refused is not None:
        return refused
    build_s, problem = prebuild_ops(args.optimizer)
    if problem:
        print(f"deepspeed_zero3: {problem}", file=sys.stderr)
        return 2
    print(f"deepspeed_zero3: DeepSpeed ops ready ({build_s:.0f} s)", flush=True)
    t0 = time.perf_counter()
    run = run_cluster_args(__file__, argv, args, prefix="qds")
    rc, data = run.rc, run.data
    if data is None:
        print(
            f"deepspeed_zero3: the emulated cluster run failed with status {rc} before any "
            "variant finished (the rank logs above say why)",
            file=sys.stderr,
        )
        return rc or 1
    data["load"] = list(run.load)
    data["rc"] = rc
    data["build_s"] = build_s
    report(args, data, time.perf_counter() - t0)
    if rc != 0:
        print(f"deepspeed_zero3: the run stopped early with status {rc}", file=sys.stderr)
    return rc


def report(args: argparse.Namespace, data: dict, wall_s: float) -> Report:
    """The tables of one run (``data`` as the workers wrote it); printed, and written to
    ``--out-md`` when given."""
    results, failed = data["results"], data["failed"]
    v = data.get("versions", {})
    opt = {
        "torch-adamw-fused": "torch AdamW (fused=True, torch's fused kernel, as throughput.py's "
        "default)",
        "torch-adamw": "torch AdamW (default flags: the for-loop on CPU; compare with "
        "throughput.py --optimizer default)",
    }.get(args.optimizer, "DeepSpeed CPU Adam (JIT-compiled op, AdamW mode)")
    rep = Report("Throughput: DeepSpeed ZeRO-3 on CPU on an emulated slow network")
    load = data.get("load")
    rep.note(
        f"DeepSpeed {v.get('deepspeed', '?')} (accelerator {v.get('accelerator', '?')}, backend "
        f"{v.get('backend', '?')}), torch {v.get('torch', '?')}, run with "
        f"{v.get('python', '?')} (the command line above names it python). GPT of "
        f"{data['n_params'] / 1e6:.2f} M parameters ({args.n_layer} layers, width {args.n_embd}, "
        f"context {args.context}), fp32 compute and master weights, {args.batch_per_rank} "
        f"sequences per rank; {args.nodes} nodes x {args.ranks_per_node} ranks (netns + tbf, "
        f"intra-node over loopback); {opt}, lr {LR:g}; ZeRO stage 3 with "
        f"stage3_param_persistence_threshold {args.persistence_threshold} and "
        f"stage3_max_reuse_distance {args.reuse_distance}, stage3_prefetch_bucket_size "
        f"{args.prefetch_bucket} (ds-defaults: DeepSpeed's 1e5, 1e9 and 5e7), "
        f"other settings DeepSpeed's defaults; {args.steps} timed steps after {args.warmup} "
        f"warm-up steps per variant and rate; whole run {wall_s:.0f} s"
        + (f" after {data['build_s']:.0f} s of DeepSpeed op builds" if "build_s" in data else "")
        + (
            f" (host load average {load[0]:.1f} at the start, {load[1]:.1f} at the end: step "
            "times are noisy when the machine is shared; bytes are not). "
            if load
            else ". "
        )
        + "Link MiB/step: the busiest node's eth0 tx bytes over the timed steps. Compare with "
        "benchmarks/throughput.py's fsdp2/zero3 rows from the same machine and load."
    )
    rows = []
    for rate, by_variant in results.items():
        base = by_variant.get(BASELINE)
        for variant, r in by_variant.items():
            med, mn = statistics.median(r["times"]), min(r["times"])
            speed = statistics.median(base["times"]) / med if base else float("nan")
            speed_min = min(base["times"]) / mn if base else float("nan")
            rows.append(
                [
                    rate,
                    variant,
                    f"{med:.3f}",
                    f"{mn:.3f}",
                    f"{speed:.2f}x ({speed_min:.2f}x)",
                    f"{max(r['node_tx']) / 2**20:.2f}",
                    f"{r['loss_last']:.3f}",
                ]
            )
    if rows:
        rep.table(
            "Step time and link bytes per step",
            [
                "Mbit/s",
                "variant",
                "median s",
                "min s",
                f"speed-up vs {BASELINE}",
                "link MiB/step",
                "last loss",
            ],
            rows,
        )
    option_rows = []
    for variant in args.variant_list:
        keys = {
            k: val
            for k, val in data.get("configs", {})
            .get(variant, {})
            .get("zero_optimization", {})
            .items()
            if k.startswith("zero_")
        }
        shown = ", ".join(f"{k}={json.dumps(val)}" for k, val in keys.items()) or (
            "(none; DeepSpeed's default thresholds)" if variant == "ds-defaults" else "(none)"
        )
        if variant in failed:
            f = failed[variant]
            outcome = (
                f"failed in {f['phase']} on {f.get('ranks_failed', '?')} rank(s): {f['error']}"
            )
            origin = f.get("origin", "?")
        elif any(variant in by for by in results.values()):
            outcome, origin = "ran", "-"
        else:
            outcome, origin = "not reached (the run stopped before it)", "-"
        option_rows.append([variant, shown, outcome.replace("|", "/"), origin.replace("|", "/")])
    rep.table(
        "DeepSpeed ZeRO++ options on the CPU accelerator",
        ["variant", "zero_optimization", "result", "raised from"],
        option_rows,
    )
    if not data.get("done", True):
        rep.note(
            f"- The run stopped early (status {data.get('rc', '?')}): tables hold what finished."
        )
    rep.write(args.out_md)
    return rep


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    if args.worker:
        return worker(args)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
