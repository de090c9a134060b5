"""The report of ``benchmarks/throughput.py``: its tables, notes and the issue's targets, from
the numbers a launch wrote (``--out-json``), so ``--from-json`` re-reports without a cluster."""

from __future__ import annotations

import argparse
import json
import os
import statistics

from _common import Report
from _limits import PHASES, UNSHAPED, limits, phase_limits

# What a JSON written before --optimizer existed ran.
LEGACY_OPTIMIZER = "default"
SHORT = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}  # the phase table's headings


def optimizer_text(name: str) -> str:
    """How the report's header names ``--optimizer name``."""
    what = {
        "fused": "fused=True, torch's fused kernel",
        "foreach": "foreach=True",
        "default": "torch's default flags: the for-loop update on CPU",
    }[name]
    return (
        f"torch AdamW ({what}; --optimizer {name}) for every variant but hsdp-1bit / hsdp-01 "
        "(1-bit Adam / 0/1 Adam)"
    )


ZEROPP = ("qwz", "hpz", "qgz", "all")
# Opt-in rows stepped inside backward (throughput.STEP_IN_BACKWARD), and the row each extends:
# their x limit is also taken against that row's limit where it is lower (a slower compute-only
# step of their own would flatter them).
STEPPED = {"all-sib": "all"}
# The issue's targets: ZeRO++ (all) over the 16-bit-wire ZeRO-3 per rate, and x limit.
SPEEDUP_TARGETS = {100: 4.0, 400: 1.4}
LIMIT_TARGET = 1.2


def _overhead(data: dict) -> float:
    from netsim.link import wire_overhead

    return wire_overhead(int(data.get("mtu", 1500)))


def rate_name(rate: int | str) -> str:
    return "unshaped" if str(rate) == UNSHAPED else f"{int(rate)} Mbit/s"


def issue_targets(data: dict, lim: dict) -> list[str]:
    """The issue's step-time targets, met or missed, from this launch's numbers."""
    out = []
    for rate, by_variant in data["results"].items():
        if rate == UNSHAPED:
            continue
        need = SPEEDUP_TARGETS.get(int(rate))
        base = by_variant.get("zero3-bf16")
        for name in ("all", "all-sib"):
            zpp = by_variant.get(name)
            if need is None or base is None or zpp is None:
                continue
            speed = statistics.median(base["times"]) / statistics.median(zpp["times"])
            out.append(
                f"ZeRO++ ({name}) at {rate} Mbit/s: {speed:.2f}x zero3-bf16 (target >= "
                f"{need}x: {'met' if speed >= need else 'NOT met'})"
            )
        rows = lim.get(rate, {})
        for variant in (*ZEROPP, *STEPPED):
            if (row := rows.get(variant)) is None:
                continue
            x, limit, whose, bound = row["x_limit"], row["limit_s"], "its", row["bound"]
            if (plain := rows.get(STEPPED.get(variant, ""))) and plain["limit_s"] < limit:
                limit, whose, bound = plain["limit_s"], f"{STEPPED[variant]}'s", plain["bound"]
                x = row["median_s"] / limit
            out.append(
                f"{variant} at {rate} Mbit/s: {x:.2f}x {whose} limit {limit:.3f} s "
                f"({bound}-bound; target <= {LIMIT_TARGET}x: "
                f"{'met' if x <= LIMIT_TARGET else 'NOT met'})"
            )
    return out


#: The command line's settings the report's header describes. [Note: re-reported settings]
#: A launch records them in its JSON (``settings``, with ``measured``: the launch's command,
#: date and machine), and ``--from-json`` describes the run that made the numbers from them:
#: taken from the command line, a re-report with the defaults described a ``--steps 3
#: --n-layer 2`` run as 10 steps of 4 layers next to the file's own parameter count, and named
#: the machine that rebuilt the tables as the one that measured them. A JSON from before they
#: were recorded still takes the command line's (a warning says so).
SETTINGS = (
    "n_layer",
    "n_embd",
    "n_head",
    "context",
    "batch_per_rank",
    "nodes",
    "ranks_per_node",
    "steps",
    "warmup",
    "seed",
    "zero_one_interval",
    "prefetch_depth",
)


def prefetch_text(depth: int | None) -> str:
    """The report header's words for ``--prefetch-depth`` (nothing for the library's default)."""
    if depth is None:
        return ""
    return (
        f"; shard() with ZeroPPConfig(prefetch_depth={depth}) for every variant but fsdp2 "
        f"(--prefetch-depth {depth}; the last {depth + 1} blocks kept from forward to backward)"
    )


def run_settings(args: argparse.Namespace) -> dict:
    """``args``' values of :data:`SETTINGS` (what a launch's JSON records)."""
    return {k: getattr(args, k) for k in SETTINGS}


def report(
    args: argparse.Namespace, data: dict, wall_s: float, *, origin: dict | None = None
) -> None:
    """The tables and notes of ``data`` (a launch's numbers); the header's settings are the
    file's where it records them (``settings``), else ``args``'. ``origin``: the measuring
    run's command, date and machine, for a report rebuilt from its JSON."""
    results, skipped = data["results"], data["skipped"]
    args = argparse.Namespace(**{**vars(args), **data.get("settings", {})})
    lim = limits(data)
    try:
        plim, plim_error = phase_limits(data), None
    except ValueError as exc:  # an unmapped tag: report the rest, say why this part is missing
        plim, plim_error = {}, str(exc)
    rep = Report("Throughput: ZeRO-3 vs ZeRO++ vs HSDP on an emulated slow network", origin=origin)
    rep.note(
        f"GPT of {data['n_params'] / 1e6:.2f} M parameters ({args.n_layer} layers, width "
        f"{args.n_embd}, context {args.context}), fp32 compute and master weights, "
        f"{args.batch_per_rank} sequences per rank; {args.nodes} nodes x {args.ranks_per_node} "
        f"ranks (netns + tbf, intra-node over loopback); "
        f"{optimizer_text(data.get('optimizer', LEGACY_OPTIMIZER))}"
        f"{prefetch_text(getattr(args, 'prefetch_depth', None))}; {args.steps} timed steps "
        f"after {args.warmup} warm-up steps per variant and rate, "
        + (
            "the variants' timed steps interleaved round by round (the order rotating; "
            "benchmarks/throughput.py, [Note: interleaved rows])"
            if data.get("interleaved")
            else "one variant after another"
        )
        + f"; whole run {wall_s:.0f} s"
        + (
            f" (host load average {data['load'][0]:.1f} at the start, {data['load'][1]:.1f} at the "
            "end: step times are noisy when the machine is shared; bytes are not). "
            if "load" in data
            else ". "
        )
        + "The load column is the host's 1-minute load average as the row started (an x limit "
        "below 1 means the load changed between the unshaped pass and the row). CPU busy: the "
        "host's non-idle share of all its cores' time over the row's timed steps (/proc/stat, "
        "every process on the machine counted): near 100% the step is bound by the cores the "
        "ranks and gloo share, not by the link. "
        "Speed-up is ZeRO-3's median step time over the variant's (min over min in brackets). "
        "Link MiB/step: the busiest node's eth0 tx bytes over the timed steps; ledger: "
        "CommLedger's inter-node bytes of the busiest node (it records each collective as the "
        "backend runs it: gloo's reduce-scatter is an all-reduce that keeps a slice, the 16-bit "
        "wire reduce-scatter an all-to-all). "
        "fsdp2 is plain fully_shard without explicit prefetch; zero3 is "
        "qshard.zeropp.shard with every feature off (prefetch on, as in every qshard variant). "
        + (
            "Limit = max(compute-only step, link time): the compute-only step is the variant's "
            "median in the 'unshaped' rows (the same launch, model, ranks, kernels and bytes "
            "with no tbf on the links, run first), the link time the busiest node link "
            f"direction's bytes per step x (MTU+14)/(MTU-52) = {_overhead(data):.4f} (tbf "
            "charges every segment's headers; iperf3 carried 95.2-95.6% of 100 Mbit/s as TCP "
            "payload) over the rate; "
            "x limit = median / limit (benchmarks/throughput.py, [Note: the limit column])."
            if lim
            else "No unshaped pass (--no-limit): no limit column."
        )
        + (
            " Phase limit = sum over the phases forward, backward (to the end of "
            "loss.backward()) and optimizer step of max(the phase's compute-only time, its link "
            "time): no byte overlaps another phase's compute, as in a step that prefetches "
            "nothing across its boundary (the forward's gathers carry the weights the last "
            "optimizer step wrote). A phase's compute-only time is its median in the unshaped "
            "rows, each phase timed on every rank with no extra barrier and its end taken as "
            "the last rank's (so the phases add up to the step time); its link time is the "
            "row's link time x the phase's share of the row's ledger bytes (tags: forward "
            "all-gathers -> forward; backward all-gathers, reduce-scatters, HSDP all-reduces "
            "-> backward; 1-bit / 0/1 Adam's collectives -> optimizer); x phase limit = "
            "median / phase limit; '-' where the ledger has no bytes to split (fsdp2)."
            if plim
            else ""
        )
    )
    rows = []
    targets = []
    for rate, by_variant in results.items():
        base = by_variant.get("zero3") or by_variant.get("fsdp2")
        hsdp = by_variant.get("hsdp")
        for variant, r in by_variant.items():
            med, mn = statistics.median(r["times"]), min(r["times"])
            link = max(r["node_tx"])
            speed = statistics.median(base["times"]) / med if base else float("nan")
            speed_min = min(base["times"]) / mn if base else float("nan")
            ledger = r["ledger_inter"]
            ratio = ledger / link if link else float("nan")
            vs_hsdp = "-"
            if hsdp is not None and variant.startswith("hsdp"):
                vs_hsdp = f"{statistics.median(hsdp['times']) / med:.2f}x"
            row_lim = lim.get(rate, {}).get(variant)
            row_plim = plim.get(rate, {}).get(variant)
            rows.append(
                [
                    rate_name(rate).removesuffix(" Mbit/s"),
                    variant,
                    f"{med:.3f}",
                    f"{row_lim['limit_s']:.3f}" if row_lim else "-",
                    f"{row_lim['x_limit']:.2f}x" if row_lim else "-",
                    f"{row_plim['phase_limit_s']:.3f}" if row_plim else "-",
                    f"{row_plim['x_phase_limit']:.2f}x" if row_plim else "-",
                    f"{mn:.3f}",
                    f"{speed:.2f}x ({speed_min:.2f}x)" if base else "-",
                    vs_hsdp,
                    f"{link / 2**20:.2f}",
                    f"{ledger / 2**20:.2f}" if ledger else "-",
                    f"{ratio:.3f}" if ledger else "-",
                    f"{r['loss_last']:.3f}",
                    f"{r['load']:.1f}" if "load" in r else "-",
                    f"{100 * r['cpu_busy']:.0f}%" if r.get("cpu_busy") is not None else "-",
                ]
            )
            if variant == "all" and rate != UNSHAPED and int(rate) == 100 and base:
                targets.append(
                    f"ZeRO++ (all) at 100 Mbit/s: {speed:.2f}x ZeRO-3 (target >= 2x: "
                    f"{'met' if speed >= 2 else 'NOT met'})"
                )
            if rate != UNSHAPED:
                targets += _hsdp_targets(rate, variant, r, by_variant)
            if ledger and rate != UNSHAPED:
                targets.append(
                    f"ledger/link at {rate} Mbit/s, {variant}: {ratio:.3f} "
                    f"({'within' if abs(ratio - 1) <= 0.10 else 'NOT within'} 10%)"
                )
    rep.table(
        "Step time and link bytes per step",
        [
            "Mbit/s",
            "variant",
            "median s",
            "limit s",
            "x limit",
            "phase limit s",
            "x phase limit",
            "min s",
            "speed-up vs zero3",
            "vs hsdp",
            "link MiB/step",
            "ledger MiB/step",
            "ledger/link",
            "last loss",
            "load",
            "CPU busy",
        ],
        rows,
    )
    if lim:
        rep.table(
            "The limit: compute-only step (unshaped) and link time per step",
            ["Mbit/s", "variant", "compute-only s", "link s", "limit s", "bound", "x limit"],
            [
                [
                    rate,
                    variant,
                    f"{row['compute_s']:.3f}",
                    f"{row['link_s']:.3f}",
                    f"{row['limit_s']:.3f}",
                    row["bound"],
                    f"{row['x_limit']:.2f}x",
                ]
                for rate, by_variant in lim.items()
                for variant, row in by_variant.items()
            ],
        )
    if blocks := [
        [rate_name(rate), variant, f"{statistics.median(r['times']):.3f}"]
        + [f"{b:.3f}" for b in r["back_to_back"]]
        for rate, by_variant in results.items()
        for variant, r in by_variant.items()
        if r.get("back_to_back")
    ]:
        n = max(len(row) for row in blocks) - 3
        rep.table(
            "Back to back: s/step of each block of --steps steps run without barriers between "
            "them (--back-to-back; [Note: back-to-back blocks] in benchmarks/throughput.py)",
            ["rate", "variant", "interleaved median s", *(f"block {i + 1} s" for i in range(n))],
            [row + ["-"] * (n + 3 - len(row)) for row in blocks],
        )
    if plim:
        rep.table(
            "The phase limit: compute-only (unshaped) and link time per phase (s per step)",
            [
                "Mbit/s",
                "variant",
                *(f"{SHORT[ph]} {part}" for ph in PHASES for part in ("compute", "link")),
                "phase limit s",
                "x phase limit",
                "limit s",
            ],
            [
                [
                    rate,
                    variant,
                    *(
                        f"{row['phases'][ph][part]:.3f}"
                        for ph in PHASES
                        for part in ("compute_s", "link_s")
                    ),
                    f"{row['phase_limit_s']:.3f}",
                    f"{row['x_phase_limit']:.2f}x",
                    f"{lim[rate][variant]['limit_s']:.3f}" if variant in lim.get(rate, {}) else "-",
                ]
                for rate, by_variant in plim.items()
                for variant, row in by_variant.items()
            ],
        )
    if plim_error:
        rep.note(f"No phase limit: {plim_error}.")
    first = next(iter(results.values()), {})
    tag_rows = []
    for variant, r in first.items():
        for tag, op, inter, intra in r["ledger_by_tag"]:
            tag_rows.append([variant, tag, op, f"{inter / 2**20:.3f}", f"{intra / 2**20:.3f}"])
    if tag_rows:
        rep.table(
            "Ledger per collective (per step, busiest node; same at every rate)",
            ["variant", "tag", "op", "inter-node MiB", "intra-node MiB"],
            tag_rows,
        )
    issue = issue_targets(data, lim)
    for line in issue + targets:
        rep.note(f"- {line}")
    for variant, why in skipped.items():
        rep.note(f"- {variant} not run: {why}")
    rep.note(
        "- DeepSpeed ZeRO-3 baseline: `benchmarks/deepspeed_zero3.py` (its own virtual "
        "environment with deepspeed; the same GPT, batches and emulated cluster), reported "
        "in its own section; its ZeRO++ options have no CPU kernels."
    )
    rep.write(args.out_md)
    if args.out_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.out_json)), exist_ok=True)
        with open(args.out_json, "w") as f:
            json.dump(
                dict(data, wall_s=wall_s, limits=lim, phase_limits=plim, targets=issue + targets),
                f,
                indent=1,
            )


def _hsdp_targets(rate: str, variant: str, r: dict, by_variant: dict) -> list[str]:
    """The issue's HSDP targets at 100 Mbit/s, measured side by side in this launch."""
    hsdp, zpp = by_variant.get("hsdp"), by_variant.get("all")
    if int(rate) != 100 or hsdp is None or variant not in ("hsdp-int4", "hsdp-01"):
        return []
    med = statistics.median(r["times"])
    speed = statistics.median(hsdp["times"]) / med
    need = 3.5 if variant == "hsdp-01" else 2.5
    out = [
        f"{variant} at 100 Mbit/s: {speed:.2f}x plain HSDP (target >= {need}x: "
        f"{'met' if speed >= need else 'NOT met'})"
    ]
    if zpp is not None:
        faster = med < statistics.median(zpp["times"])
        out.append(
            f"{variant} at 100 Mbit/s: {med:.3f} s vs ZeRO++ (all) "
            f"{statistics.median(zpp['times']):.3f} s (target faster: "
            f"{'met' if faster else 'NOT met'})"
        )
    if variant == "hsdp-01":
        frac = max(r["node_tx"]) / max(hsdp["node_tx"])
        out.append(
            f"hsdp-01 link bytes/step {frac:.4f} of plain HSDP's "
            f"(target <= 1/20: {'met' if frac <= 0.05 else 'NOT met'}); timed over "
            f"{r.get('steps')} steps after {r.get('warmup')}"
        )
    return out
