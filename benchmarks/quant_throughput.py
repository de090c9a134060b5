"""Throughput of the qshard.quant CPU kernels, each as a ratio to a same-run ``copy_``.

Every kernel is timed interleaved with ``dst.copy_(src)`` of the same fp32 buffer (copy,
kernel, copy, kernel, ...; best of ``--repeat``; the ``--reference`` rows best of 2, that path
being 10-100x slower), so machine noise hits both sides alike.
GB/s counts the fp32 bytes of the tensor being (de)quantized (``numel * 4``), for copy too.
The first call of each kernel (which builds or loads the C kernel library, or compiles the
torch.compile kernel / loads it from inductor's cache) is reported separately; the fast path
is the C kernels for fp32 input (qshard.quant._native_kernels) when a C compiler exists. bitsandbytes' CPU ``quantize_blockwise`` is measured when importable.

    python benchmarks/quant_throughput.py                 # 64M elements
    python benchmarks/quant_throughput.py --numel 4000000 --out-md /tmp/quant_throughput.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

import qshard.quant as Q
from _common import Report, add_report_args, at_least
from qshard.quant import _fastpath, _native_kernels


def interleaved(fn, baseline, repeat: int) -> tuple[float, float]:
    """Best-of-``repeat`` seconds of ``fn`` and of ``baseline``, timed alternately."""
    best_fn = best_base = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        baseline()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        best_base = min(best_base, t1 - t0)
        best_fn = min(best_fn, t2 - t1)
    return best_fn, best_base


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=at_least(1), default=64 * 2**20, help="elements (fp32)")
    parser.add_argument("--repeat", type=at_least(1), default=5, help="timed calls per kernel")
    parser.add_argument("--block-size", type=at_least(1), default=Q.DEFAULT_BLOCK_SIZE)
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also time the plain reference path (best of 2 calls per kernel)",
    )
    parser.add_argument("--no-bnb", action="store_true", help="skip bitsandbytes")
    add_report_args(parser)
    args = parser.parse_args(argv)

    n, bs = args.numel, args.block_size
    load0 = os.getloadavg()[0]  # the host's, so a reader can judge the times
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen)
    dst = torch.empty_like(x)
    gb = n * 4 / 1e9
    code = Q.dynamic_map(signed=True)

    first_call: dict[str, float] = {}

    def first(name: str, fn):
        t0 = time.perf_counter()
        result = fn()
        first_call[name] = time.perf_counter() - t0
        return result

    # The first call of each kernel compiles it (or loads it from inductor's cache).
    q8 = first("INT8 quantize", lambda: Q.quantize_blockwise(x, bits=8, block_size=bs))
    q4 = first("INT4 quantize", lambda: Q.quantize_blockwise(x, bits=4, block_size=bs))
    cb = first("dynamic-map quantize", lambda: Q.quantize_codebook(x, code, block_size=bs))
    signs = first("sign pack", lambda: Q.pack_signs(x))
    out = torch.empty_like(x)
    # Quantize into preallocated state buffers as the 8-bit optimizers do (a fresh 1-byte-per-
    # element output costs page faults comparable to the encoder; measured in its own row).
    cb_out = (torch.empty_like(cb[0]), torch.empty_like(cb[1]))
    kernels = {
        "INT8 quantize": lambda: Q.quantize_blockwise(x, bits=8, block_size=bs),
        "INT8 dequantize": lambda: Q.dequantize_blockwise(q8, out=out),
        "INT4 quantize": lambda: Q.quantize_blockwise(x, bits=4, block_size=bs),
        "INT4 dequantize": lambda: Q.dequantize_blockwise(q4, out=out),
        "dynamic-map quantize": lambda: Q.quantize_codebook(x, code, block_size=bs, out=cb_out),
        "dynamic-map quantize (allocating)": lambda: Q.quantize_codebook(x, code, block_size=bs),
        "dynamic-map dequantize": lambda: Q.dequantize_codebook(*cb, code, block_size=bs, out=out),
        "sign pack": lambda: Q.pack_signs(x),
        "sign unpack": lambda: Q.unpack_signs(signs, n, out=out),
    }
    copy = lambda: dst.copy_(x)  # noqa: E731

    report = Report(title="qshard.quant CPU throughput")
    report.note(
        f"{n:,} fp32 elements ({gb:.3f} GB), block size {bs}, {torch.get_num_threads()} threads, "
        f"fast path {'on' if Q.fastpath_enabled() else 'off'}; ratio = kernel GB/s / copy_ GB/s"
    )

    rows = []
    paths = [("fast", True)] + ([("reference", False)] if args.reference else [])
    for path, enabled in paths:
        Q.set_fastpath(enabled and Q.fastpath_enabled())
        for name, fn in kernels.items():
            if path == "fast" and name not in first_call:
                first(name, fn)
            t_fn, t_copy = interleaved(fn, copy, args.repeat if path == "fast" else 2)
            rows.append([name, path, gb / t_fn, gb / t_copy, t_copy / t_fn])
        Q.set_fastpath(True)

    bnb_q = None
    if not args.no_bnb:
        try:
            import bitsandbytes.functional as bnbf

            bnb_code = bnbf.create_dynamic_map(signed=True)
            bnbf.quantize_blockwise(x, code=bnb_code, blocksize=bs)
            t_fn, t_copy = interleaved(
                lambda: bnbf.quantize_blockwise(x, code=bnb_code, blocksize=bs),
                copy,
                args.repeat,
            )
            bnb_q = gb / t_fn
            rows.append(
                ["bitsandbytes quantize_blockwise", "bnb CPU", bnb_q, gb / t_copy, t_copy / t_fn]
            )
        except Exception as e:  # absent or unsupported: skip cleanly
            report.note(f"bitsandbytes skipped: {type(e).__name__}: {e}")

    report.table(
        "Throughput (GB/s of fp32 input)", ["kernel", "path", "GB/s", "copy_ GB/s", "x copy_"], rows
    )
    report.table(
        "First call (compile or cache load + one run)",
        ["kernel", "seconds"],
        [[k, v] for k, v in first_call.items()],
    )
    if bnb_q is not None:
        # Both as ratios to their own interleaved copy_, so load changes between the two
        # measurements cancel; raw GB/s ratios are shown too.
        ours = {r[0]: (r[2], r[4]) for r in rows if r[1] == "fast"}
        bnb_ratio = next(r[4] for r in rows if r[1] == "bnb CPU")
        names = ["dynamic-map quantize", "dynamic-map quantize (allocating)", "INT8 quantize"]
        report.table(
            "vs bitsandbytes CPU quantize_blockwise (dynamic map)",
            ["kernel", "speed-up (x copy_ ratios)", "speed-up (raw GB/s)"],
            [[k, ours[k][1] / bnb_ratio, ours[k][0] / bnb_q] for k in names],
        )
    report.note(
        f"C kernels: {'used' if _native_kernels.available() else 'unavailable'}; "
        f"torch.compile kernels compiled: {', '.join(_fastpath.compiled_kernels()) or 'none'}"
    )
    report.note(
        f"Host load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
        "(other work on the machine moves the times; ratios to copy_ are side by side)."
    )
    report.write(args.out_md)


if __name__ == "__main__":
    main()
