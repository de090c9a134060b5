"""The building blocks of one multi-tensor kernel call for a group's quantized tensors
([Note: multi-tensor step] in ``qshard.optim._kernels``): which tensors the CPU kernel takes,
each tensor's entry (addresses and sizes, its layout checked), the hyperparameter table, the
step counters advanced together, and the plan that splits a group between the call and the
one-by-one path. Shared by the 8-bit and 4-bit optimizers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from operator import is_
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from qshard import _triton
from qshard.optim import _qstate
from qshard.optim._state_layout import _check_layout, _layout_fits, _local

__all__ = [
    "_TRITON_DTYPES",
    "_Item",
    "_KeptPlan",
    "_Launches",
    "_QuantizedPlan",
    "_advance_steps",
    "_device_steps",
    "_hparam_table",
    "_kernel_takes",
    "_multi_tensor_entry",
    "_plan_fingerprint",
    "_plan_held",
    "_step_bank",
    "_steps_off_device",
    "_triton_launches",
]

#: The parameter and gradient dtypes of the Triton kernels.
_TRITON_DTYPES = (torch.float32, torch.bfloat16)

#: A parameter met by ``step``: its index in the group, the parameter, its state.
_Item = tuple[int, Tensor, dict[str, Any]]

#: A group's prepared Triton launches, each with its items' positions in the group's list.
_Launches = list[tuple[Any, list[int]]]


@dataclass
class _QuantizedPlan:
    """A group's quantized tensors for one step, their layouts checked: ``batch`` for one
    multi-tensor kernel call (with its ``rows``, an (n, 8) int64 array of the entries'
    addresses and sizes, and the ``grads`` they point at), ``triton``
    for the Triton kernel's multi-tensor launches (CUDA; prepared as ``launches``, each with its
    positions in ``triton``, reading the gradient copies ``grads_triton``), ``rest`` for
    :meth:`BlockwiseOptimizer._step_param` one by one."""

    batch: list[_Item] = field(default_factory=list)
    rows: Any = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    triton: list[_Item] = field(default_factory=list)
    launches: _Launches = field(default_factory=list)
    grads_triton: list[Tensor] = field(default_factory=list)
    rest: list[_Item] = field(default_factory=list)


def _advance_steps(items: list[_Item], banks: dict, key: Any) -> list[int]:
    """Add one to the step counters of ``items`` (``(index, parameter, state)``) and return the
    new counts. The counters are views of one buffer kept in ``banks[key]`` (a dict the
    optimizer keeps; [Note: step bank]), advanced and read in one call each; counters a bank
    cannot hold advance in one foreach call, as ``torch.optim``'s fused AdamW."""
    buf = _step_bank(items, banks, key)
    if buf is None:
        counters = [state["step"] for _, _, state in items]
        torch._foreach_add_(counters, 1)
        buf = torch.stack(counters)
    else:
        buf.add_(1)
    return [int(s) for s in buf.tolist()]


def _step_bank(items: list[_Item], banks: dict, key: Any) -> Tensor | None:
    """The 1-D CPU buffer whose elements are the step counters of ``items`` in order, kept in
    ``banks[key]``: the last one when the counters are still its views, else a new one that
    the counters become views of (their values kept); None when the counters cannot share one
    (not all 0-d CPU tensors of one dtype). [Note: step bank]"""
    counters = [state["step"] for _, _, state in items]
    bank = banks.get(key)
    if bank is not None and len(bank[1]) == len(counters) and all(map(is_, counters, bank[1])):
        return bank[0]
    banks.pop(key, None)
    dtype = counters[0].dtype
    if not all(c.dim() == 0 and c.is_cpu and c.dtype == dtype for c in counters):
        return None
    buf = torch.stack(counters)
    views = buf.unbind()
    for (_, _, state), view in zip(items, views):
        state["step"] = view
    banks[key] = (buf, views)
    return buf


# [Note: step bank]
# torch keeps a parameter's step count as a 0-d CPU tensor in its state (the checkpoint
# format), and a step advances every one: 150 tensors took one foreach add (a loop of 150 adds
# on the CPU: ~1.5 us a tensor here, 6 us on a GPU machine's host), a stack and a read-back, a
# large part of the host time of a many-tensor step on CUDA whose kernel is one launch. A
# bank makes the counters of a group's batch views of one 1-D buffer (their values and dtype
# kept): one add advances them and one read returns them. They stay tensors in the state, so
# state_dict, torch.save and DCP see what they did (torch.save keeps the shared storage once;
# DCP writes each counter as its own tensor). A counter replaced (load_state_dict, a
# parameter joining or leaving the batch) is not the bank's view: the bank is built again
# from the counters' current values.


def _steps_off_device(params: list[Tensor]) -> bool:
    """Whether torch's fused kernels need the step counters of ``params`` on another device."""
    return any(p.device.type != "cpu" for p in params)


def _device_steps(
    steps: list[Tensor], params: list[Tensor], bank: Tensor | None = None
) -> list[Tensor]:
    """Copies of the CPU step counters ``steps`` on their parameters' devices, for torch's fused
    kernels: one copy per device, through pinned memory on CUDA, so it does not wait for the
    stream. (A copy per counter waited for every kernel queued before it: one host sync per
    fp32-state tensor per step.) The copies are views of one buffer each; the kernels advance
    them, and the caller the CPU counters. ``bank``: the counters' buffer when they are its
    views ([Note: step bank])."""
    by_device: dict[torch.device, list[int]] = {}
    for i, p in enumerate(params):
        by_device.setdefault(p.device, []).append(i)
    copies: list[Tensor] = list(steps)
    for device, where in by_device.items():
        # (one device: the counters' bank, when they have one, is their stack)
        one = bank is not None and len(where) == len(steps)
        host = bank if one else torch.stack([steps[i] for i in where])
        if device.type == "cuda":
            host = host.pin_memory()
        on_device = host.to(device, non_blocking=device.type == "cuda", copy=True)
        for j, i in enumerate(where):
            copies[i] = on_device[j]
    return copies


class _KeptPlan(NamedTuple):
    """A group's plan kept across steps (:meth:`BlockwiseOptimizer._plan_quantized`): what it
    depends on, the positions (in the group's quantized items) of its CPU batch, Triton and
    one-by-one tensors, the CPU call's rows, the Triton launches, and the objects whose ids the
    fingerprint holds (kept alive so no id is reused)."""

    fingerprint: tuple
    batch: list[int]
    rows: np.ndarray
    triton: list[int]
    launches: _Launches
    rest: list[int]
    held: list[Any]


def _hparam_table(
    steps: list[int], hparams: Callable[[int], list[float]]
) -> tuple[Tensor, list[int]]:
    """The fp32 hyperparameter rows of a multi-tensor kernel call: one row per distinct step
    count (usually one for a whole group), padded with zeros, and each step's row address."""
    distinct = dict.fromkeys(steps)  # (in order of first appearance)
    lists = [hparams(step) for step in distinct]
    width = max(len(h) for h in lists) + 8  # the zeros the kernels may read past the last
    table = torch.tensor([h + [0.0] * (width - len(h)) for h in lists], dtype=torch.float32)
    base = table.data_ptr()
    if len(lists) == 1:
        return table, [base] * len(steps)
    at = {step: base + 4 * width * k for k, step in enumerate(distinct)}
    return table, [at[step] for step in steps]


def _kernel_takes(p_l: Tensor, g_l: Tensor) -> bool:
    """Whether the CPU kernel steps the local parameter ``p_l`` in place: a non-empty fp32
    contiguous CPU tensor whose gradient ``g_l`` is a CPU tensor of its shape (the entry makes
    an fp32 contiguous copy of a gradient that is not)."""
    return (
        p_l.dtype == torch.float32
        and p_l.is_cpu  # (8x cheaper than .device.type: a step asks this of every tensor)
        and g_l.is_cpu
        and p_l.is_contiguous()
        and g_l.shape == p_l.shape
        and p_l.numel() > 0
    )


def _multi_tensor_entry(
    name: str,
    p: Tensor,
    state: dict[str, Any],
    states: list[str],
    block_size: int,
    packed_row: Callable[[int], int] | None = None,
) -> tuple[list[int], Tensor] | None:
    """``p``'s entry of a multi-tensor kernel call (``tensor_t`` / ``tensor4_t`` up to the
    hyperparameters): the addresses of p, g and the (one or two) ``states``' codes and absmax,
    rows, row_numel; with the gradient it points at (an fp32 contiguous copy where the
    gradient is not: keep it until the call). None when the kernel does not take ``p``
    (``_kernel_takes``) or the Triton kernel does (``_triton.serves``, also patched by tests).
    A state whose layout does not fit is refused by :func:`_check_layout`. ``packed_row``: the
    code bytes of a row (4-bit: two codes a byte), else one per element."""
    p_l, g_l = _local(p), _local(p.grad)
    if _triton.serves(p_l) or not _kernel_takes(p_l, g_l):  # the Triton kernel's tensors first
        return None
    if g_l.dtype != torch.float32 or not g_l.is_contiguous():
        g_l = g_l.float().contiguous()
    codes = [_local(state[f"{n}_codes"]) for n in states]
    absmax = [_local(state[f"{n}_absmax"]) for n in states]
    rows, row_numel = _qstate.row_view(p_l.shape)
    codes_shape = p_l.shape if packed_row is None else (rows, packed_row(row_numel))
    absmax_shape = (rows, _qstate.blocks_per_row(row_numel, block_size))
    on_cpu = all(t.is_cpu for t in codes) and all(t.is_cpu for t in absmax)
    if not (on_cpu and _layout_fits(codes_shape, codes, absmax, absmax_shape)):
        _check_layout(name, p_l, codes, absmax, tuple(codes_shape), block_size)
        return None  # (not reached: the check says what does not fit)
    two = len(states) == 2
    row = [
        p_l.data_ptr(),
        g_l.data_ptr(),
        codes[0].data_ptr(),
        absmax[0].data_ptr(),
        codes[1].data_ptr() if two else 0,
        absmax[1].data_ptr() if two else 0,
        rows,
        row_numel,
    ]
    return row, g_l


def _grad_as_is(g: Tensor) -> bool:
    """Whether the Triton kernels read the (local) gradient ``g`` in place: fp32 or bf16,
    contiguous."""
    return g.dtype in _TRITON_DTYPES and g.is_contiguous()


def _triton_launches(
    items: list[_Item], states: dict[str, str]
) -> tuple[list[tuple[list[int], dict[str, list]]], list[Tensor]]:
    """The Triton multi-tensor launches of ``items`` (``(index, parameter, state)``): one per
    (parameter dtype, gradient dtype, device), each as (its items' positions in ``items``, the
    keyword lists ``params``, ``grads``, ``layouts`` and, per entry of ``states`` (kernel
    argument name -> state key), the local state tensors); and the gradient copies the lists
    point at (gradients the kernels do not read as they are, :func:`_grad_as_is`: as fp32
    contiguous copies): hold them until the launches have run."""
    launches: dict[tuple, tuple[list[int], dict[str, list]]] = {}
    copies = []
    for i, (_, p, state) in enumerate(items):
        p_l, g_l = _local(p), _local(p.grad)
        if not _grad_as_is(g_l):
            g_l = (g_l if g_l.dtype in _TRITON_DTYPES else g_l.float()).contiguous()
            copies.append(g_l)
        key = (p_l.dtype, g_l.dtype, p_l.device)  # (a launch's tensors share one device)
        if key not in launches:
            launches[key] = ([], {k: [] for k in ("params", "grads", "layouts", *states)})
        positions, launch = launches[key]
        positions.append(i)
        launch["params"].append(p_l)
        launch["grads"].append(g_l)
        launch["layouts"].append(_qstate.row_view(p_l.shape))
        for arg, name in states.items():
            launch[arg].append(_local(state[name]))
    return list(launches.values()), copies


def _plan_fingerprint(
    items: list[_Item], state_keys: tuple[str, ...]
) -> tuple[tuple, list[int]] | None:
    """What a kept plan of ``items`` depends on ([Note: prepared launch] in
    ``qshard._triton._common``; :meth:`BlockwiseOptimizer._plan_quantized`) and the gradients'
    addresses, or None when it cannot be kept (a gradient the kernels read through a copy: the
    copy is new each step). Per item: the parameter (identity, address, shape, dtype), its
    gradient's shape, dtype (not always the parameter's: with ``p.grad_dtype = None``, torch
    >= 2.10, a bf16 gradient of an fp32 parameter one step and an fp32 one the next was read as
    the kept launch's dtype) and whether its address is 16-byte aligned, and the identities of
    the state tensors under
    ``state_keys``. A gradient's address is not part of it: FSDP2 and ``zero_grad`` give new
    gradient tensors each step, often elsewhere, and a kept plan takes the new addresses
    (``_plan_quantized``); its alignment is, because a Triton launch compiled for aligned
    vectors needs it. Identities are ``id()``s: the caller keeps the objects
    (:func:`_plan_held`) while it keeps the fingerprint, so no id is reused."""
    key: list = []
    grads: list[int] = []
    add, more, at = key.append, key.extend, grads.append
    for _, p, state in items:
        p_l, g_l = _local(p), _local(p.grad)
        if not _grad_as_is(g_l):
            return None
        g = g_l.data_ptr()
        at(g)
        more((id(p), p_l.data_ptr(), p_l.shape, p_l.dtype, g_l.shape, g_l.dtype, g % 16 == 0))
        for k in state_keys:
            add(id(state[k]))
    return tuple(key), grads


def _plan_held(items: list[_Item], state_keys: tuple[str, ...]) -> list[Any]:
    """The objects whose ``id()`` :func:`_plan_fingerprint` records."""
    return [p for _, p, _ in items] + [state[k] for _, _, state in items for k in state_keys]
