"""Every kernel variant compiles for an H100/H200 (sm_90) without a GPU, and the PTX has the
properties the numerics rely on.

The interpreter checks semantics on CPU but never runs Triton's compiler, so a kernel could pass
there and fail to compile on the GPU. Triton compiles ahead of time for a named target with
its bundled ptxas, no device needed; this test does that for each kernel and constexpr variant.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="the GPU kernels need triton (pip install qshard[gpu])")

# 24 compilations take ~1-5 minutes of CPU: out of the default suite.
pytestmark = pytest.mark.slow

# Compiling needs kernels defined in compiler mode, so run in a fresh process without
# TRITON_INTERPRET (this pytest process may have it set for the interpreter tests).
SCRIPT = textwrap.dedent(
    """
    import json, os, re, sys
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from qshard._triton import _blockwise as B, _optim8bit as O, _qgz as Q, _signs as S

    target = GPUTarget("cuda", 90, 32)
    out = {}

    SIZES = {"numel", "n_blocks", "n_bytes", "row_numel", "blocks_per_slot"}
    # qgZ's wire-row strides (row bytes, row words) are multiples of 16 by construction
    # ([Note: 4-block rows] in zeropp.reduce_scatter), and the JIT specializes them as such.
    SIZES |= {"scale_stride", "code_stride", "in_scale_stride", "in_code_stride",
              "out_scale_stride", "out_code_stride"}

    def comp(name, fn, sig, consts, num_warps=4):
        # What the JIT specializes at launch for 16-byte-aligned tensors and sizes divisible
        # by 16 (the common case): without it no vector load could be proven safe.
        attrs = {
            (fn.arg_names.index(a),): [["tt.divisibility", 16]]
            for a, ty in sig.items()
            if ty.startswith("*") or a in SIZES
        }
        sig = dict(sig)
        for k in consts:
            sig[k] = "constexpr"
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        k = triton.compile(src, target=target, options=dict(num_warps=num_warps, enable_fp_fusion=False))
        ptx = k.asm["ptx"]
        out[name] = dict(
            fma=ptx.count("fma.rn.f32"),
            div_rn=ptx.count("div.rn.f32"),
            div_approx=ptx.count("div.approx") + ptx.count("div.full"),
            sqrt_rn=ptx.count("sqrt.rn.f32"),
            sqrt_approx=ptx.count("sqrt.approx"),
            v4=len(re.findall(r"ld\\.global[.\\w:]*\\.v4", ptx)),
            st_v4=len(re.findall(r"st\\.global[.\\w:]*\\.v4", ptx)),
            cubin=len(k.asm["cubin"]),
            # the region encoder's one explicit fma per element a thread holds, per state
            region_fma=consts["BLOCK_N"] * consts["G"] // (32 * num_warps)
            * (int(consts["REGION1"]) + int(consts["HAS2"] and consts["REGION2"]))
            if "REGION1" in consts else 0,
        )

    q = {"x_ptr": "*fp32", "codes_ptr": "*i8", "scales_ptr": "*fp32", "n_blocks": "i32", "numel": "i64", "seed": "i32"}
    base = {"BS": 256, "BLOCK_N": 256, "ROWS": 16, "QMAX": 127, "PACK": False, "STOCHASTIC": False, "BF16": False}
    comp("quantize_int8_fp32", B._quantize_kernel, q, base)
    comp("quantize_int4_pack_bf16", B._quantize_kernel, {**q, "x_ptr": "*i16", "codes_ptr": "*u8"},
         {**base, "QMAX": 7, "PACK": True, "BF16": True})
    comp("quantize_stochastic_odd_block", B._quantize_kernel, q, {**base, "BS": 100, "BLOCK_N": 128, "ROWS": 32, "STOCHASTIC": True})
    d = {"codes_ptr": "*i8", "scales_ptr": "*fp32", "out_ptr": "*bf16", "n_blocks": "i32", "numel": "i64"}
    comp("dequantize_int8_bf16", B._dequantize_kernel, d, {"BS": 256, "BLOCK_N": 256, "ROWS": 16, "PACK": False, "QMAX": 127})
    comp("dequantize_int4_fp32", B._dequantize_kernel, {**d, "codes_ptr": "*u8", "out_ptr": "*fp32"},
         {"BS": 2048, "BLOCK_N": 2048, "ROWS": 2, "PACK": True, "QMAX": 7})
    comp("pack_int4", B._pack_int4_kernel, {"codes_ptr": "*i8", "out_ptr": "*u8", "n_bytes": "i32", "numel": "i32"}, {"BLOCK": 4096})
    comp("unpack_int4", B._unpack_int4_kernel, {"packed_ptr": "*u8", "out_ptr": "*i8", "numel": "i32"}, {"BLOCK": 4096})
    rq = {"x_ptr": "*fp32", "offsets_ptr": "*i64", "lengths_ptr": "*i64", "codes_ptr": "*u8", "scales_ptr": "*fp32",
          "blocks_per_slot": "i32", "blocks_per_row": "i32", "scale_stride": "i32", "code_stride": "i32",
          "seed": "i32"}
    rq_consts = {"BS": 256, "BLOCK_N": 256, "ROWS": 16, "QMAX": 7, "PACK": True, "STOCHASTIC": False, "BF16": False,
                 "ALIGNED": False}
    _, rq_rows, rq_warps = Q._reorder_geometry(256, True)  # (its default geometry)
    rq_consts = {**rq_consts, "ROWS": rq_rows}
    comp("reorder_quantize_int4", Q._reorder_quantize_kernel, rq, rq_consts, num_warps=rq_warps)
    comp("reorder_quantize_int4_aligned", Q._reorder_quantize_kernel, rq, {**rq_consts, "ALIGNED": True},
         num_warps=rq_warps)
    rr = {"codes_ptr": "*u8", "scales_ptr": "*fp32", "out_codes_ptr": "*u8", "out_scales_ptr": "*fp32",
          "n_peers": "i32", "n_blocks": "i32", "in_scale_stride": "i32", "in_code_stride": "i32",
          "out_blocks_per_row": "i32", "out_scale_stride": "i32", "out_code_stride": "i32", "seed": "i32"}
    comp("dequant_reduce_requant", Q._dequant_reduce_requant_kernel, rr,
         {"BS": 256, "BLOCK_N": 256, "ROWS": 16, "PACK_IN": True, "QMAX_IN": 7, "QMAX": 7, "PACK_OUT": True,
          "STOCHASTIC": False})
    comp("dequant_reduce", Q._dequant_reduce_kernel,
         {"codes_ptr": "*u8", "scales_ptr": "*fp32", "out_ptr": "*bf16", "n_peers": "i32", "n_blocks": "i32",
          "numel": "i64", "in_scale_stride": "i32", "in_code_stride": "i32", "factor": "fp32"},
         {"BS": 256, "BLOCK_N": 256, "ROWS": 16, "PACK": True, "QMAX_IN": 7, "DIVIDE": False, "MULTIPLY": True})
    comp("pack_signs", S._pack_signs_kernel, {"x_ptr": "*fp32", "out_ptr": "*u8", "numel": "i64", "n_bytes": "i64"},
         {"BYTES": 1024, "BF16": False})
    comp("unpack_signs", S._unpack_signs_kernel, {"packed_ptr": "*u8", "out_ptr": "*fp32", "numel": "i64"}, {"BYTES": 1024})
    # The optimizer kernels take a launch table ([Note: multi-tensor launch]), at the default
    # geometry ([Note: step geometry]: 256 elements a warp) of the block sizes below.
    _, g8, w8 = O._geometry(256)
    _, g8_2048, w8_2048 = O._geometry(2048)
    msig = {"meta_ptr": "*i64", "hpf_ptr": "*fp32", "n_tensors": "i32", "code1_ptr": "*fp32", "mid1_ptr": "*fp32",
            "lut1_ptr": "*i32", "reg1_ptr": "*i32", "zero1": "i32", "code2_ptr": "*fp32", "mid2_ptr": "*fp32",
            "lut2_ptr": "*i32", "reg2_ptr": "*i32", "zero2": "i32"}
    ob = {"LOG_T": 8, "ALIGNED": True, "KIND": 0, "FLAGS": 3, "HAS2": True, "SIGNED1": True, "SIGNED2": False,
          "BS": 256, "BLOCK_N": 256, "G": g8, "P_BF16": False, "G_BF16": False, "LUT1": True, "LUT2": True,
          "REGION1": False, "REGION2": False}
    comp("adam8bit", O._step8_multi_kernel, msig, ob, w8)
    comp("adam8bit_region", O._step8_multi_kernel, msig, {**ob, "REGION1": True, "REGION2": True}, w8)
    comp("adam8bit_unaligned", O._step8_multi_kernel, msig, {**ob, "ALIGNED": False}, w8)
    comp("adam8bit_bnb_bf16_2048_region", O._step8_multi_kernel, msig,
         {**ob, "LOG_T": 1, "FLAGS": 4, "BS": 2048, "BLOCK_N": 2048, "G": g8_2048, "P_BF16": True, "G_BF16": True,
          "REGION1": True, "REGION2": True}, w8_2048)
    comp("adam8bit_binary_search", O._step8_multi_kernel, msig, {**ob, "LUT1": False, "LUT2": False}, w8)
    for kind, has2, s1, s2 in ((1, False, True, True), (2, False, True, True), (3, True, False, True), (4, False, False, True)):
        comp(f"optim_kind{kind}", O._step8_multi_kernel, msig,
             {**ob, "KIND": kind, "FLAGS": 19, "HAS2": has2, "SIGNED1": s1, "SIGNED2": s2}, w8)
    from qshard._triton import _optim4bit as O4
    m4 = {"meta_ptr": "*i64", "hpf_ptr": "*fp32", "n_tensors": "i32", "code1_ptr": "*fp32", "mid1_ptr": "*fp32",
          "lut1_ptr": "*i32", "code2_ptr": "*fp32", "mid2_ptr": "*fp32", "lut2_ptr": "*i32"}
    _, g4, w4 = O4._geometry(128)
    o4 = {"LOG_T": 8, "ALIGNED": True, "BS": 128, "HALF_N": 64, "G": g4, "P_BF16": False, "G_BF16": False,
          "LUT1": True, "LUT2": True}
    comp("adam4bit", O4._step4_multi_kernel, m4, o4, w4)
    comp("adam4bit_bf16_unaligned", O4._step4_multi_kernel, m4,
         {**o4, "ALIGNED": False, "P_BF16": True, "G_BF16": True}, w4)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def compiled() -> dict:
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "No such file" in proc.stderr:
        pytest.skip("triton's bundled ptxas is missing")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_to_a_cubin(compiled):
    assert len(compiled) == 24
    for name, facts in compiled.items():
        assert facts["cubin"] > 0, name


def test_ieee_division_and_sqrt_no_contraction(compiled):
    """The reference rounds x / scale and sqrt(v) correctly and never fuses a * b + c. The
    8-bit step's region encoder has one fma of its own (the C kernel's, exact by the table
    builder's proof): one per element and state, no more."""
    assert compiled["adam8bit_region"]["region_fma"] == 16  # 8 elements a thread, 2 states
    for name, facts in compiled.items():
        assert facts["fma"] == facts["region_fma"], name
        assert facts["div_approx"] == 0 and facts["sqrt_approx"] == 0, name
    for name in ("quantize_int8_fp32", "dequant_reduce_requant", "adam8bit"):
        assert compiled[name]["div_rn"] > 0, name
    assert compiled["adam8bit"]["sqrt_rn"] > 0


def test_wide_vector_loads_where_the_input_is_contiguous(compiled):
    """fp32 inputs are read with 16-byte loads (the bandwidth design, checked in the PTX)."""
    for name in ("quantize_int8_fp32", "pack_signs", "adam8bit", "adam8bit_region",
                 "reorder_quantize_int4_aligned"):  # fmt: skip
        assert compiled[name]["v4"] > 0, (name, compiled[name])


def test_qgz_wire_rows_use_wide_vector_accesses(compiled):
    """qgZ's kernels read and write the packed codes of 16-byte-aligned wire rows with 16-byte
    accesses (without the alignment they fall back to one load or store per byte)."""
    assert compiled["dequant_reduce_requant"]["v4"] > 0, compiled["dequant_reduce_requant"]
    assert compiled["dequant_reduce_requant"]["st_v4"] > 0, compiled["dequant_reduce_requant"]
    assert compiled["dequant_reduce"]["v4"] > 0, compiled["dequant_reduce"]
    assert compiled["reorder_quantize_int4"]["st_v4"] > 0, compiled["reorder_quantize_int4"]
