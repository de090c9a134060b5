"""Shared Triton helpers: rounding, launch geometry and input checks for every qshard kernel.

Everything here is used by the kernel modules of this package; nothing is public.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from qshard._triton import on_device_of

# 1.5 * 2**23. Adding and subtracting it rounds an fp32 |t| < 2**22 to an integer with the
# FPU's round-half-to-even, the rounding torch.round uses. [Note: rint] libdevice.rint does the
# same on CUDA but Triton's interpreter cannot run it, and one formula for both keeps the
# interpreter tests honest about what the GPU executes. Every caller rounds values bounded by
# a few hundred; NaN stays NaN. The two adds must not be reassociated, which LLVM never does
# without fast-math flags, and there is no multiply before them to contract into an FMA.
_RINT_MAGIC = 12582912.0

# [Note: no FMA] Every launch passes enable_fp_fusion=False: a contracted a * b + c rounds once
# where the torch reference (and the interpreter) rounds twice, e.g. qgZ's `acc + code * scale`.
# The kernels are memory-bound, so the lost FMAs cost nothing measurable.

# Elements one program handles; enough for wide vector loads and latency hiding on
# Hopper-class GPUs without spilling registers. Block sizes above it get one row per program.
_TILE_ELEMENTS = 4096


@triton.jit
def rint(t):
    """Round fp32 to the nearest integer, ties to even (valid for |t| < 2**22). See [Note: rint]."""
    return (t + 12582912.0) - 12582912.0


@triton.jit
def store_as(ptr, y, mask):
    """Store fp32 `y` into `ptr`'s dtype, rounding to nearest even as torch's `.to()` does.

    [Note: bf16 cast] Triton's interpreter truncates fp32 -> bf16 (and its "rtne" mode rounds
    ties up), while CUDA rounds to nearest even. Rounding the bits by hand gives torch's result
    on both, so interpreter tests check exactly what the GPU stores; it is a few integer ops in
    a memory-bound kernel.
    """
    if ptr.dtype.element_ty == tl.bfloat16 or ptr.dtype.element_ty == tl.int16:
        # int16 pointers are bf16 tensors viewed as bits (see `kernel_view`).
        bits = y.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(y != y, 0x7FC0, rounded)
        tl.store(ptr, rounded.to(tl.uint16).to(ptr.dtype.element_ty, bitcast=True), mask=mask)
    else:
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_f32(ptr, mask, BF16_BITS: tl.constexpr):
    """Load floats as fp32. With BF16_BITS, `ptr` holds bf16 bit patterns viewed as int16.

    [Note: bf16 load] bf16 -> fp32 is exact: the 16 bits become the top half of the fp32.
    Doing that shift by hand is what CUDA does anyway, and it sidesteps Triton's interpreter,
    which flushes bf16 subnormals to zero on load (tests would then check the wrong thing).
    """
    if BF16_BITS:
        bits = tl.load(ptr, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


def kernel_view(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(tensor to hand a kernel, BF16_BITS flag for `load_f32`)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16), True
    return t, False


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def rows_per_program(block_size: int, tile_elements: int = _TILE_ELEMENTS) -> int:
    """How many quantization blocks one program owns so that a tile has ~tile_elements."""
    return max(1, tile_elements // next_pow2(block_size))


def num_warps_for(tile: int) -> int:
    if tile >= 8192:
        return 8
    if tile >= 2048:
        return 4
    return 2


def check_device(*tensors: torch.Tensor) -> None:
    """All kernel inputs must live on one device: CUDA, or CPU under TRITON_INTERPRET=1."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(
                f"qshard Triton kernels need all tensors on one device; got {device} and {t.device}"
            )


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous for the Triton kernel; call .contiguous()")


# [Note: device copies of code maps] The optimizers' code maps and midpoints are small CPU
# tensors, cached by the optimizer for its lifetime; a copy to the kernel's device every step
# would be a synchronous host-to-device transfer per parameter. One copy per (map, device) is
# kept for as long as the map itself lives: the cache holds the map weakly, so an optimizer
# that is dropped takes its copies with it, and a new map that reuses a freed one's address
# never finds the old copy (an id-keyed dict would hand it the dead map's values).
_device_copies: WeakIdKeyDictionary = WeakIdKeyDictionary()


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, copied once per (tensor, device): [Note: device copies of code maps]."""
    if t.device == device:
        return t
    copies = _device_copies.get(t)
    if copies is None:
        copies = _device_copies[t] = {}
    key = str(device)
    if key not in copies:
        copies[key] = t.to(device)
    return copies[key]


def search_table_on(name: str, lut: torch.Tensor | None, device: torch.device):
    """``lut`` (a map's int32 search table of `qshard.quant._codetable`, 8192 entries) on
    ``device``, copied once ([Note: device copies of code maps]); None stays None. The kernels
    index it by raw pointer, so anything else is refused."""
    if lut is None:
        return None
    if lut.shape != (8192,) or lut.dtype != torch.int32:
        raise ValueError(
            f"{name}: expected the int32 (8192,) search table of qshard.quant._codetable; got "
            f"{lut.dtype} {tuple(lut.shape)}"
        )
    return on_device(lut, device)


def region_table_on(name: str, regions: torch.Tensor | None, signed: bool, device: torch.device):
    """``regions`` (a map's (129,) int32 region table, `QMap.regions`, on the CPU) on ``device``,
    copied once, for `region_code`; None where it is None or all zeros (a map without region
    table: the kernel keeps the search table). Its kind word must match ``signed``: a signed
    table read as unsigned would give wrong codes, not an error."""
    if regions is None:
        return None
    if regions.shape != (129,) or regions.dtype != torch.int32 or regions.device.type != "cpu":
        raise ValueError(
            f"{name}: expected the CPU int32 (129,) region table of qshard.quant._codetable "
            f"(QMap.regions); got {regions.dtype} {tuple(regions.shape)} on {regions.device}"
        )
    kind = int(regions[128])
    if kind == 0:
        return None
    if kind != (1 if signed else 2):
        raise ValueError(
            f"{name}: the region table of a {'signed' if kind == 1 else 'unsigned'} map, given "
            f"for a state whose map is {'signed' if signed else 'unsigned'}; pass the state's own "
            "QMap.regions"
        )
    return on_device(regions, device)


@triton.jit
def _table_index(b):
    """The search-table entry of fp32 bits `b` (sign, then the top 15 bits of the magnitude
    clamped to [2**-31, 2): 96 << 7 buckets below)."""
    t = ((b & 0x7FFFFFFF) >> 16) - 12288
    t = tl.minimum(tl.maximum(t, 0), 4095)
    return tl.where(b < 0, t + 4096, t)


@triton.jit
def _table_finish(x, b, e):
    """The code of `x` (bits `b`) from its table entry `e`: base plus one 16-bit compare."""
    key = (b ^ (b >> 31)) & 0xFFFF
    code = (e >> 16) + tl.where(key > (e & 0xFFFF), 1, 0)
    return tl.where(x == x, code, 0)


@triton.jit
def table_code(x, lut_ptr):
    """The code of fp32 `x` by the exact nearest-code search table of `qshard.quant._codetable`
    (`NEAREST_C` there, the C kernels' rule): one table gather and one integer compare where a
    binary search over 255 midpoints takes 8 dependent gathers (on an H200 those gathers, not
    HBM traffic, bounded the 8-bit step). `lut_ptr`: the map's int32 table (`QMap.lut`).
    NaN -> 0, as the binary search gives."""
    b = x.to(tl.int32, bitcast=True)
    return _table_finish(x, b, tl.load(lut_ptr + _table_index(b)))


@triton.jit
def region_code(x, reg_ptr, lut_ptr, SIGNED: tl.constexpr):
    """`table_code(x, lut_ptr)` for `x` in [-1, 1] by [Note: the region encoder] of
    `qshard.quant._codetable` (the C kernel's AVX-512 rule, same steps): five loads from the
    129-word region table `reg_ptr` (`QMap.regions`; each indexes at most 32 words, one 128-byte
    line, so a warp's load is one L1 wavefront), a fused multiply-add and a clamp; only the lanes
    flagged near a midpoint (about 1 in 2000) load the 32 KiB search table, whose gathers touch
    up to 32 lines a warp. Exact: the flagged lanes take the table's code, and the builder
    proves the others. NaN and |x| > 1 (non-finite blocks, whose codes the caller replaces) give
    some code in 0..255."""
    b = x.to(tl.int32, bitcast=True)
    neg = b < 0
    ab = b & 0x7FFFFFFF
    if SIGNED:  # the float above |x| on negative lanes: "midpoints <= |x|" -> "< it"
        ab = ab + tl.where(neg, 1, 0)
    a = ab.to(tl.float32, bitcast=True)
    t = tl.minimum(tl.maximum((ab >> 23) - 96, 0), 31)  # the binade; the upper clamp: NaN, Inf
    thr = tl.load(reg_ptr + t).to(tl.float32, bitcast=True)
    r = tl.load(reg_ptr + 32 + t) + tl.where(a > thr, 1, 0)
    slope = tl.load(reg_ptr + 64 + r).to(tl.float32, bitcast=True)
    icpt = tl.load(reg_ptr + 80 + r).to(tl.float32, bitcast=True)
    top = tl.load(reg_ptr + 112 + r).to(tl.float32, bitcast=True)
    zi = tl.minimum(tl.fma(a, slope, icpt), top).to(tl.int32, bitcast=True)
    near = ((zi + 4) & 0x3FF8) == 0  # within REGION_EPS of an integer count
    cnt = (zi >> 14) & 0xFF
    if SIGNED:
        cnt = tl.where(neg, tl.maximum(254 - cnt, 0), cnt)
    else:  # every midpoint of an unsigned map is positive
        cnt = tl.where(neg, 0, cnt)
    e = tl.load(lut_ptr + _table_index(b), mask=near, other=0)
    return tl.where(near, _table_finish(x, b, e), cnt)


# [Note: multi-tensor launch] One launch steps every tensor of a list (the 8- and 4-bit
# optimizer kernels): each tensor's row of an int64 table holds its addresses and sizes, with
# the number of its first program in field FIRST and its fp32 hyperparameters in the row's
# upper words (the same buffer read as fp32). A program finds its tensor by a binary search over
# the rows' first programs (`find_row`), then runs the one-tensor body on its own blocks. One
# launch and one small host-to-device copy replace a launch and its host checks per tensor.
TABLE_WORDS = 16  # int64 words a row


@triton.jit
def find_row(meta_ptr, pid, n_rows, LOG_T: tl.constexpr, FIRST: tl.constexpr):
    """The last row (of `n_rows` <= 2**LOG_T, 16 int64 words each) whose first program (word
    FIRST) is <= `pid`: the tensor program `pid` works on (empty tensors share their first
    program with the next row and lose the tie)."""
    t = pid * 0
    for k in tl.static_range(LOG_T):
        cand = t + (1 << (LOG_T - 1 - k))
        first = tl.load(meta_ptr + cand * 16 + FIRST, mask=cand < n_rows, other=pid + 1)
        t = tl.where(first <= pid, cand, t)
    return t


@triton.jit
def read_row(meta_ptr, t, P_BF16: tl.constexpr, G_BF16: tl.constexpr, ALIGNED: tl.constexpr):
    """Row `t`'s ten leading fields, as both optimizer kernels lay them out: the pointers of
    param, grad (int16 for bf16 bits), codes 1, absmax 1, codes 2, absmax 2, then n_blocks,
    blocks_per_row, row_numel and the first program. ALIGNED: the host checked that the
    pointers the vectors read and row_numel are multiples of 16, as the JIT would have
    specialized them in a one-tensor launch (16-byte vector access)."""
    row = meta_ptr + t * 16
    if P_BF16:
        p_ptr = tl.load(row).to(tl.pointer_type(tl.int16))
    else:
        p_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
    if G_BF16:
        g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.int16))
    else:
        g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    c1_ptr = tl.load(row + 2).to(tl.pointer_type(tl.uint8))
    a1_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    c2_ptr = tl.load(row + 4).to(tl.pointer_type(tl.uint8))
    a2_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
    n_blocks = tl.load(row + 6).to(tl.int32)
    blocks_per_row = tl.load(row + 7).to(tl.int32)
    row_numel = tl.load(row + 8).to(tl.int32)
    first = tl.load(row + 9).to(tl.int32)
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        c1_ptr = tl.multiple_of(c1_ptr, 16)
        c2_ptr = tl.multiple_of(c2_ptr, 16)
        row_numel = tl.multiple_of(row_numel, 16)
    return p_ptr, g_ptr, c1_ptr, a1_ptr, c2_ptr, a2_ptr, n_blocks, blocks_per_row, row_numel, first


def check_tensor(name: str, t: torch.Tensor, dtype: torch.dtype | None, count: int) -> None:
    """Refuse a kernel input that is not contiguous or not `count` elements of `dtype` (None:
    any float dtype)."""
    check_contiguous(name, t)
    if t.numel() != count or (dtype is not None and t.dtype != dtype):
        raise ValueError(
            f"{name}: expected {count} elements of {dtype or 'float'}; got {t.dtype} {t.numel()}"
        )


def explain_row(i: int, named, p_dtype, g_dtype) -> None:
    """Raise the error that says why tensor `i` of a multi-tensor launch failed
    `row_tensors_fine`; `named`: its (name, tensor, dtype, count) in the order of the launch's
    lists, param and grad first."""
    (_, p, _, _), (_, gr, _, _) = named[:2]
    if p.dtype != p_dtype or gr.dtype != g_dtype:
        raise ValueError(
            f"tensor {i}: param {p.dtype} / grad {gr.dtype} in a call for {p_dtype} / "
            f"{g_dtype}; split the list by dtype"
        )
    for name, t, dtype, count in named:
        check_tensor(f"{name}[{i}]", t, dtype, count)
    check_device(*(t for _, t, _, _ in named))
    raise AssertionError(f"tensor {i} refused without a reason")  # (not reached)


def row_tensors_fine(
    tensors, p_dtype, g_dtype, numel: int, code_count: int, n_blocks: int, dev_index: int
) -> bool:
    """Whether one tensor's (param, grad, codes1, absmax1, codes2, absmax2) of a multi-tensor
    launch are what its kernel reads by raw pointer: the call's param and grad dtypes, uint8
    codes of `code_count` bytes, fp32 absmax of `n_blocks`, all contiguous, all on device
    `dev_index` (`get_device()`: an int, cheaper to compare than torch.device objects). One
    expression: a step asks it of every tensor; the named checks run only when it says no."""
    p, gr, c1, a1, c2, a2 = tensors
    u8, f32 = torch.uint8, torch.float32
    return (
        p.dtype is p_dtype and gr.dtype is g_dtype and c1.dtype is u8 and c2.dtype is u8
        and a1.dtype is f32 and a2.dtype is f32
        and p.numel() == numel and gr.numel() == numel and c1.numel() == code_count
        and c2.numel() == code_count and a1.numel() == n_blocks and a2.numel() == n_blocks
        and p.is_contiguous() and gr.is_contiguous() and c1.is_contiguous()
        and c2.is_contiguous() and a1.is_contiguous() and a2.is_contiguous()
        and all(t.get_device() == dev_index for t in tensors)
    )  # fmt: skip


class PreparedLaunch:
    """A checked multi-tensor launch ([Note: multi-tensor launch]) without its hyperparameters.

    [Note: prepared launch] Checking a launch's tensors and building its table is the host's
    work per tensor; a training step passes the same parameters and states every time, and
    gradients of the same shapes, only with new hyperparameters. The kernel entries check and
    build once (`prepare_*`), and `run` fills the hyperparameter words of a copy of the table
    and launches: a caller that knows its tensors did not change (the optimizers compare their
    identities, addresses, shapes and dtypes) keeps the prepared launch across steps, and
    points it at each step's gradients (`rebind_grads`: FSDP2 and `zero_grad` make new gradient
    tensors each step, on the CPU at a new address every time). It holds no tensor of the
    launch, only their addresses: the caller keeps them alive, and unchanged, until `run` has
    been called. The optimizers keep their CPU kernel's multi-tensor rows the same way
    (`BlockwiseOptimizer._plan_quantized`): on 2000 tensors of 16x256 the Python per tensor and
    step went from 11.5 to 2.7-2.9 us.
    """

    __slots__ = ("_args", "_consts", "_device", "_grid", "_hp_at", "_kernel", "_rows", "_scalars")

    def __init__(self, kernel, rows: list[list[int]], programs: int, hp_at: int, device,
                 args: tuple, consts: dict, scalars) -> None:  # fmt: skip
        """`rows`: each tensor's int fields; `programs`: the grid; `hp_at`: the first fp32 word
        of the hyperparameters; `args`: the kernel's arguments after (table, fp32 view, rows);
        `consts`: its constexprs and launch options; `scalars`: one tensor's hyperparameter
        list -> the fp32 words the kernel reads."""
        self._rows = np.zeros((len(rows), TABLE_WORDS), dtype=np.int64)
        if rows:
            self._rows[:, : len(rows[0])] = rows
        self._kernel, self._grid, self._hp_at = kernel, (programs,), hp_at
        self._device, self._args, self._consts, self._scalars = device, args, consts, scalars

    def __len__(self) -> int:
        return len(self._rows)

    def rebind_grads(self, addresses: list[int]) -> None:
        """Point the launch at new gradient tensors: tensor i's at ``addresses[i]`` (word 1 of
        every multi-tensor kernel's row). Each must have the old one's shape, dtype and device,
        which the caller ensures (the optimizers' fingerprint); a launch compiled for 16-byte
        vectors refuses an address off that alignment."""
        if len(addresses) != len(self._rows):
            raise ValueError(f"{len(addresses)} gradient addresses for {len(self._rows)} params")
        if self._consts.get("ALIGNED") and any(a % 16 for a in addresses):
            raise ValueError("a gradient is not 16-byte aligned; prepare the launch again")
        self._rows[:, 1] = addresses

    def run(self, hps, **consts) -> None:
        """Launch with tensor i's hyperparameters `hps[i]` (each distinct list object converted
        once) and the constexprs `consts` on top of the prepared ones."""
        if len(hps) != len(self._rows):
            raise ValueError(f"hps has {len(hps)} entries for {len(self._rows)} params")
        if self._grid[0] == 0:
            return
        at: dict[int, int] = {}
        words: list[list[float]] = []
        index = []
        for hp in hps:
            k = at.get(id(hp))
            if k is None:
                k = at[id(hp)] = len(words)
                words.append(self._scalars(hp))
            index.append(k)
        table = self._rows.copy()
        fp32 = np.asarray(words, dtype=np.float32)[index]
        table.view(np.float32)[:, self._hp_at : self._hp_at + fp32.shape[1]] = fp32
        out = torch.from_numpy(table)
        if self._device.type != "cpu":  # pinned, so the copy need not wait for the stream
            out = out.pin_memory().to(self._device, non_blocking=True)
        with on_device_of((out,)):  # [Note: launch on the tensors' device]
            self._kernel[self._grid](
                out, out.view(torch.float32), len(self._rows), *self._args, **self._consts,
                **consts,
            )  # fmt: skip
