"""Launch-geometry and search-mode sweep of qshard's memory-bound Triton kernels on one GPU.

The defaults in `qshard._triton` (elements per program, warps, the 8/4-bit state encoders'
nearest-code search) were chosen without a GPU; this measures the alternatives side by side in
one process, so a GPU session can pick them from numbers:

- the fused 8-bit Adam step (`_optim8bit`) and the fused 4-bit Adam step (`_optim4bit`): the
  state encoder's search ("table": the maps' one-gather search tables, as the optimizers
  dispatch; "region": the 8-bit kernel's gather-free region encoder, the search table only
  near a midpoint; "binary": the midpoints' binary search) and the tile / warp geometry, against
  torch's fused fp32 AdamW on the same parameters;
- blockwise quantize (INT8 fp32, INT8 bf16, INT4 unpacked and packed) and qgZ's first hop
  (reorder + INT4 quantize into wire rows, as zeropp dispatches it): tile / warps, against a
  device-to-device copy of the input.

Every variant's output is compared bit for bit with the default's (a geometry or search change
must not change a byte). Timings: CUDA events, median of --repeat after warm-up.

    PYTHONPATH=src python3 benchmarks/gpu/sweep.py [--numel N] [--repeat R] [--out FILE]
        [--only step8,step4,quantize] [--geometries 1024x4,2048x4r128] [--search table,...]
    python benchmarks/gpu/sweep.py --smoke      # CPU, Triton interpreter, toy sizes

Writes markdown to stdout and to --out (default: $OUT/sweep.md when $OUT is set).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if importlib.util.find_spec("qshard") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))

from _harness import median_ms  # noqa: E402


def _ms(fn, repeat: int, cuda: bool) -> float:
    return median_ms(fn, repeat, cuda)


Table = tuple[str, list[str], list[list[object]]]  # (title, header, rows)


def to_markdown(table: Table) -> str:
    title, header, rows = table
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


class _Patch:
    """Set module attributes for the duration of a block."""

    def __init__(self, module, **attrs) -> None:
        self.module, self.attrs, self.saved = module, attrs, {}

    def __enter__(self) -> None:
        for k, v in self.attrs.items():
            self.saved[k] = getattr(self.module, k)
            setattr(self.module, k, v)

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            setattr(self.module, k, v)


def _fixed_geometry(tile: int, warps: int, half: bool = False):
    """A kernel module's `_geometry` fixed to `tile` elements a program and `warps` warps
    (`half`: the 4-bit step's width is half a block; `pack`, the quantize kernels' argument,
    is ignored: the tile is the variant)."""
    from qshard._triton._common import next_pow2

    def geometry(block_size: int, pack: bool = False) -> tuple[int, int, int]:
        width = next_pow2(block_size // 2 if half else max(block_size, 2))
        return width, max(1, tile // next_pow2(max(block_size, 2))), warps

    return geometry


def _adam_baseline(n: int, device, repeat: int, cuda: bool) -> float:
    import torch

    p = torch.nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn(n, device=device) * 1e-2
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=cuda)
    return _ms(opt.step, repeat, cuda)


def _adam_problem(n: int, code_bytes: int, block: int, device):
    """(gradient, (param, codes1, absmax1, codes2, absmax2)): one random Adam state, the same
    for every variant of a sweep."""
    import torch

    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen) * 1e-2
    c1, c2 = (torch.randint(0, 256, (code_bytes,), generator=gen, dtype=torch.uint8) for _ in "ab")
    a1 = torch.rand(n // block, generator=gen) * 1e-2
    a2 = torch.rand(n // block, generator=gen) * 1e-4
    return grad.to(device), tuple(t.to(device) for t in (p0, c1, a1, c2, a2))


def _tables_for(search: str, tables: dict) -> dict:
    """The kernel arguments of a search mode: "region" all `tables` (search and region
    tables), "table" the search tables alone, "binary" none."""
    if search == "binary":
        return {}
    return {k: v for k, v in tables.items() if search == "region" or not k.startswith("regions")}


class _WithOptions:
    """A Triton kernel launched with extra compile options (e.g. `maxnreg`)."""

    def __init__(self, kernel, **options) -> None:
        self.kernel, self.options = kernel, options

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, **kwargs, **self.options)


def _step_variants(
    title, module, kernel, run, state0, tables, half, variants, base, n, nbytes, repeat, cuda
) -> Table:
    """Time `run(state, tables)` per (search, geometry) variant from the same `state0`
    (`tables`: the maps' tables, chosen per search by `_tables_for`); the first variant's one
    step is the reference every other variant's bytes must equal."""
    import torch

    out, ref = [], None
    for search, geometry in variants:
        state = [t.clone() for t in state0]
        luts = _tables_for(search, tables)
        patch = {}
        label = "default"
        if geometry is not None:
            patch["_geometry"] = _fixed_geometry(*geometry[:2], half=half)
            label = f"tile {geometry[0]}, {geometry[1]} warps"
            if len(geometry) == 3:  # a register cap: more resident warps, maybe spills
                patch[kernel] = _WithOptions(getattr(module, kernel), maxnreg=geometry[2])
                label += f", maxnreg {geometry[2]}"
        try:
            with _Patch(module, **patch):
                run(state, luts)  # one step from the common state: the bytes all must give
                same = "ref" if ref is None else all(torch.equal(a, b) for a, b in zip(ref, state))
                ref = ref or [t.clone() for t in state]
                ms = _ms(lambda s=state, t=luts: run(s, t), repeat, cuda)
        except Exception as e:  # one variant the compiler refuses: its row says so
            out.append([search, label, f"{type(e).__name__}: {str(e)[:80]}", "", "", ""])
            continue
        gbs = nbytes * n / ms / 1e6
        out.append([search, label, f"{ms:.3f}", f"{ms / base:.2f}", f"{gbs:.0f}", same])
    return (
        f"{title} (torch fused fp32 AdamW: {base:.3f} ms)",
        ["search", "geometry", "ms", "x fused fp32", "GB/s", "bytes = default"],
        out,
    )


def sweep_step8(n: int, device, repeat: int, cuda: bool, variants) -> Table:
    from qshard._triton import _optim8bit
    from qshard.optim._qstate import qmap

    bs, row = 256, 4096
    m1, m2 = qmap(True), qmap(False)
    grad, state0 = _adam_problem(n, n, bs, device)
    hp = [1e-3, 0.9, 0.999, 1e-8, 0.01, 1e-3 / 0.1, math.sqrt(1 - 0.999), 1 - 1e-5]

    def run(state, luts) -> None:
        p, c1, a1, c2, a2 = state
        _optim8bit.optim8bit_step(
            kind="adam", param=p, grad=grad, codes1=c1, absmax1=a1, code1=m1.code, mid1=m1.mid,
            zero1=m1.zero_idx, signed1=True, codes2=c2, absmax2=a2, code2=m2.code, mid2=m2.mid,
            zero2=m2.zero_idx, signed2=False, rows=n // row, row_numel=row, block_size=bs, hp=hp,
            flags=3, **luts,
        )  # fmt: skip

    return _step_variants(
        f"8-bit Adam step, {n / 1e6:.0f}M params, block {bs}", _optim8bit, "_step8_multi_kernel",
        run, state0,
        {"lut1": m1.lut, "lut2": m2.lut, "regions1": m1.regions, "regions2": m2.regions}, False,
        variants, _adam_baseline(n, device, repeat, cuda),
        n, 16, repeat, cuda,  # 16 bytes a parameter: 4+4+1+1 read, 4+1+1 written
    )  # fmt: skip


def sweep_step4(n: int, device, repeat: int, cuda: bool, variants) -> Table:
    from qshard._triton import _optim4bit
    from qshard.optim import _qstate4

    bs, row = 128, 4096
    qm, qv = _qstate4.qmap4("signed-dynamic"), _qstate4.qmap4(_qstate4.SECOND_MOMENT_MAPS[0])
    grad, state0 = _adam_problem(n, n // 2, bs, device)
    hp = _qstate4.adam_hparams(
        step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True
    )

    def run(state, luts) -> None:
        p, c1, a1, c2, a2 = state
        _optim4bit.optim4bit_step(
            param=p, grad=grad, m_codes=c1, m_absmax=a1, m_code=qm.code, m_mid=qm.mid,
            v_codes=c2, v_absmax=a2, v_code=qv.code, v_mid=qv.mid, rows=n // row, row_numel=row,
            block_size=bs, hp=hp, **luts,
        )  # fmt: skip

    return _step_variants(
        f"4-bit Adam step, {n / 1e6:.0f}M params, block {bs}", _optim4bit, "_step4_multi_kernel",
        run, state0,
        {"m_lut": qm.lut, "v_lut": qv.lut}, True, variants, _adam_baseline(n, device, repeat, cuda),
        n, 14, repeat, cuda,  # 14 bytes a parameter: 4+4+0.5+0.5 read, 4+0.5+0.5 written
    )  # fmt: skip


def sweep_quantize(n: int, device, repeat: int, cuda: bool, geometries) -> Table:
    import torch

    from qshard._triton import _blockwise

    x32 = torch.randn(n, device=device)
    xbf = x32.to(torch.bfloat16)
    out = []
    for name, x, bits, pack in (
        ("INT8 fp32", x32, 8, False),
        ("INT8 bf16", xbf, 8, False),
        ("INT4 fp32 unpacked", x32, 4, False),
        ("INT4 fp32 packed", x32, 4, True),
    ):
        dst = torch.empty_like(x)
        copy_ms = _ms(lambda d=dst, x=x: d.copy_(x), repeat, cuda)
        if x is x32:
            fp32_copy_ms = copy_ms
        ref = None
        for geometry in [None, *geometries]:
            ctx = _Patch(
                _blockwise,
                **({} if geometry is None else {"_geometry": _fixed_geometry(*geometry)}),
            )
            with ctx:

                def q(x=x, bits=bits, pack=pack):
                    return _blockwise.quantize_flat(x, block_size=256, bits=bits, pack=pack)

                got = q()
                same = "ref" if ref is None else all(torch.equal(a, b) for a, b in zip(ref, got))
                ref = ref or got
                ms = _ms(q, repeat, cuda)
            nbytes = x.numel() * x.element_size() + got[0].numel() + got[1].numel() * 4
            label = "default" if geometry is None else f"tile {geometry[0]}, {geometry[1]} warps"
            frac = copy_ms / ms * nbytes / (2 * x.numel() * x.element_size())
            out.append([name, label, f"{ms:.3f}", f"{frac:.2f}", same])
    out += _sweep_qgz_first_hop(x32, fp32_copy_ms, repeat, cuda, geometries)
    return (
        f"Blockwise quantize, {n / 1e6:.0f}M elements, block 256 (x copy: bytes moved per ms vs "
        "a device-to-device copy of the input)",
        ["kernel", "geometry", "ms", "x copy", "bytes = default"],
        out,
    )


def _sweep_qgz_first_hop(x, copy_ms: float, repeat: int, cuda: bool, geometries) -> list[list]:
    """qgZ's reorder + INT4 quantize into wire rows (2 nodes x 4 ranks, 2 stages, as zeropp
    dispatches it: `_qgz_sections.qgz_first_hop`) at each geometry of the packing kernels;
    `copy_ms`: the device-to-device copy of fp32 `x` the other rows are measured against."""
    import torch
    from _qgz_sections import qgz_first_hop

    from qshard import _triton
    from qshard._triton import _qgz

    bs, per_node = 256, 4
    off, lens, slot = _triton.qgz_slots(
        nodes=2, ranks_per_node=per_node, stages=2, size=x.numel() // 8, block_size=bs
    )
    off, lens = off.to(x.device), lens.to(x.device)
    nbytes = 4 * x.numel() + x.numel() // 2 + 4 * (x.numel() // bs)
    rows, ref = [], None
    aligned = math.gcd(x.numel() // 8, slot)  # zeropp's promise ([Note: aligned slots])
    for geometry, aligned_to in [(None, aligned), (None, 1), *((g, aligned) for g in geometries)]:
        patch = {} if geometry is None else {"_reorder_geometry": _fixed_geometry(*geometry)}
        with _Patch(_qgz, **patch):
            hop, sends = qgz_first_hop(x, off, lens, slot, bs, per_node, aligned_to)
            hop()
            got = [t.clone() for t in sends]
            same = "ref" if ref is None else all(torch.equal(a, b) for a, b in zip(ref, got))
            ref = ref or got
            ms = _ms(hop, repeat, cuda)
        label = "default" if geometry is None else f"tile {geometry[0]}, {geometry[1]} warps"
        if aligned_to == 1:
            label += ", scalar loads (no alignment promise)"
        frac = copy_ms / ms * nbytes / (2 * 4 * x.numel())
        rows.append(["qgZ reorder+INT4 (2x4)", label, f"{ms:.3f}", f"{frac:.2f}", same])
    return rows


def run(
    numel: int,
    repeat: int,
    only: set[str],
    smoke: bool,
    emit,
    geoms: list[tuple[int, ...]] | None = None,
    searches: tuple[str, ...] = ("table", "binary", "region"),
) -> None:
    """Every selected sweep (of "step8", "step4", "quantize"), each table handed to `emit` as
    soon as it is measured (run_all's `sweep` section records them); `geoms`: the (tile,
    warps) variants of the optimizer steps (default: six from 256 to 4096 elements);
    `searches`: the encoders timed beside the default table ("binary", "region")."""
    import torch

    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if cuda else "cpu")
    if geoms is None:
        # around the default of 256 elements a warp ([Note: step geometry]; runs 8-9 swept
        # 128-16384 elements, 1-16 warps)
        geoms = [(256, 2), (512, 1), (512, 2), (1024, 4), (2048, 4), (4096, 4)]
    if smoke:
        geoms = geoms[:1]
    variants = [("table", None)] + [(s, None) for s in searches if s == "binary"]
    variants += [("table", g) for g in geoms]
    if "step8" in only:
        # and the 8-bit kernel's gather-free region encoder ([Note: the region encoder]) at
        # every geometry beside the table's (run 6 on an H200: 1.25x the table's time)
        with_region = [*variants]
        if "region" in searches:
            with_region = [*variants[: 1 + ("binary" in searches)], ("region", None)]
            with_region += [(s, g) for g in geoms for s in ("table", "region")]
        emit(sweep_step8(numel, device, repeat, cuda, with_region))
    if "step4" in only:
        emit(sweep_step4(numel, device, repeat, cuda, variants))
    if "quantize" in only:
        # below 1024 elements too: never measured for these kernels (the optimizer steps gained
        # most from one warp per 256-element block)
        qgeoms = [(256, 1), (512, 2), (1024, 2), (2048, 4), (4096, 4), (8192, 8)]
        emit(sweep_quantize(2 * numel, device, repeat, cuda, qgeoms[: len(geoms)]))


def _parse_geometry(text: str) -> tuple[int, ...]:
    """ "1024x4" -> (1024, 4); "1024x4r128" -> (1024, 4, 128): with a register cap."""
    tile, rest = text.split("x")
    warps, _, maxnreg = rest.partition("r")
    return (int(tile), int(warps), int(maxnreg)) if maxnreg else (int(tile), int(warps))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=128 * 1024 * 1024)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, toy sizes")
    parser.add_argument("--only", default="step8,step4,quantize")
    parser.add_argument(
        "--geometries",
        help="the optimizer steps' variants as TILExWARPS[rMAXNREG],... (e.g. 1024x4,2048x4r128)",
    )
    parser.add_argument(
        "--search",
        default="table,binary,region",
        help="encoders to time (table always; binary, region beside it)",
    )
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    if unknown := only - {"step8", "step4", "quantize"}:
        parser.error(f"--only takes step8, step4, quantize; got {sorted(unknown)}")
    searches = tuple(args.search.split(","))
    if unknown := set(searches) - {"table", "binary", "region"}:
        parser.error(f"--search takes table, binary, region; got {sorted(unknown)}")
    geoms = None
    if args.geometries:
        try:
            geoms = [_parse_geometry(g) for g in args.geometries.split(",")]
        except ValueError:
            parser.error(f"--geometries takes TILExWARPS[rMAXNREG],...; got {args.geometries!r}")
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        args.numel, args.repeat = 2 * 4096, 1
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print("sweep.py needs CUDA (or --smoke)", file=sys.stderr)
        return 2
    numel = args.numel // 4096 * 4096
    if numel == 0:
        parser.error("--numel must be at least 4096")
    parts: list[str] = []

    def emit(table: Table) -> None:
        parts.append(to_markdown(table))
        print(parts[-1], flush=True)

    run(numel, args.repeat, only, args.smoke, emit, geoms, searches)
    out = args.out or (
        os.path.join(os.environ["OUT"], "sweep.md") if os.environ.get("OUT") else None
    )
    if out:
        with open(out, "w") as f:
            f.write("\n".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
