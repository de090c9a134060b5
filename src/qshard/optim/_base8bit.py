"""The shared machinery of the 8-bit optimizers (:class:`Optimizer8bit`): their states, the
reference path and the kernels' rows and launches for them, on top of the format-free base
:class:`BlockwiseOptimizer` (``_blockwise_base.py``: the step loop, the kept plans, the
fp32-state path through torch's own updates, checkpoint loading), which also carries the 4-bit
optimizers (``adam4bit.py``).

A concrete optimizer only says which states it keeps and supplies its update: a pure function
from :mod:`qshard.optim._functional` (reference path) and its hyperparameters for the fused
kernel (fast path). Everything about quantized state lives here and in :mod:`._qstate`.

State of one parameter (``optimizer.state[p]``), decided once from the *global* parameter:

* ``step``: fp32 scalar tensor, as in ``torch.optim``.
* 8-bit: ``<name>_codes`` (uint8, the parameter's shape) and ``<name>_absmax`` (fp32,
  ``(dim0, blocks_per_row)``) per state, see [Note: row-block layout] in ``_qstate.py``.
* 32-bit: ``<name>`` (fp32, the parameter's shape). These tensors of a group are stepped
  together by torch's own functional update (``_torch_update``: one call per group, with the
  group's ``foreach``/``fused`` flags, the same bits as ``torch.optim``); the 8-bit ones run the
  fused kernels, one multi-tensor call (or set of Triton launches) per group.

For a DTensor parameter every state tensor is a DTensor on the parameter's mesh with its
placements (``Shard(0)`` and/or ``Replicate()``), so ``state_dict()`` and DCP see ordinary
sharded tensors and DCP can load them on any number of ranks. The step itself runs on local
shards only; no collective is issued.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qshard import _triton
from qshard.optim import _functional, _kernels, _qstate
from qshard.optim._blockwise_base import BlockwiseOptimizer

# The names imported from _multi_tensor, _options and _state_layout were defined here before
# those modules were split off; they stay importable from here (adam4bit.py, tests/ and
# benchmarks/ imported some), hence re-exported (noqa: F401) where this module does not use them.
from qshard.optim._multi_tensor import (  # noqa: F401
    _TRITON_DTYPES,
    _advance_steps,
    _device_steps,
    _hparam_table,
    _Item,
    _KeptPlan,
    _kernel_takes,
    _Launches,
    _multi_tensor_entry,
    _plan_fingerprint,
    _plan_held,
    _QuantizedPlan,
    _step_bank,
    _steps_off_device,
    _triton_launches,
)
from qshard.optim._options import (  # noqa: F401
    COMMON_DEFAULTS,
    SCHEDULER_KEYS,
    _check_lr,
    _check_placements,
    _check_real,
    check_common_options,
)
from qshard.optim._overrides import is_full_precision_param
from qshard.optim._state_layout import (  # noqa: F401
    _check_layout,
    _contiguous_stride,
    _full_state_dtype,
    _global_row_offset,
    _layout_fits,
    _local,
    _wrap_like,
)

__all__ = ["BlockwiseOptimizer", "Optimizer8bit", "optimizer_state_bytes", "state_bytes_per_param"]


def _mix_seed(*parts: int) -> int:
    h = 0x243F6A8885A308D3
    for x in parts:
        h = ((h ^ (x & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


class Optimizer8bit(BlockwiseOptimizer):
    """Base class of the 8-bit block-wise optimizers (not used directly).

    Subclasses set ``_kind`` (the kernel's update kind) and implement :meth:`_state_specs`,
    :meth:`_reference_update` and :meth:`_kernel_hparams`.
    """

    _kind: int = -1

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        super().__init__(params, {**COMMON_DEFAULTS, **defaults})

    # -- hooks ------------------------------------------------------------------------------

    def _reference_update(
        self, p: Tensor, g: Tensor, states: list[Tensor], group: dict[str, Any], step: int
    ) -> None:
        """Apply the pure update function to fp32 ``p``/``g``/``states`` in place."""
        raise NotImplementedError

    def _kernel_hparams(self, group: dict[str, Any], step: int) -> list[float]:
        raise NotImplementedError

    def _initial_state_value(self, group: dict[str, Any], name: str) -> float:
        return 0.0

    # -- the multi-tensor step --------------------------------------------------------------

    def _plan_backends(self) -> tuple:
        return (_triton.serves, _kernels.library())

    def _multi_tensor_row(
        self, group: dict[str, Any], p: Tensor, state: dict[str, Any]
    ) -> tuple[list[int], Tensor] | None:
        """Taken: fp32 contiguous CPU parameters (``_kernel_takes``); the entry is
        ``step8_multi``'s ``tensor_t`` up to its hyperparameters."""
        if _kernels.library() is None:
            return None
        names = [n for n, _ in self._state_specs(group)]
        return _multi_tensor_entry(type(self).__name__, p, state, names, group["block_size"])

    def _multi_tensor_step(
        self,
        gi: int,
        group: dict[str, Any],
        items: list[_Item],
        rows: np.ndarray,
        steps: list[int],
    ) -> None:
        """``step8_multi``: each entry completed with its hyperparameters' address, its flags
        (the first step's for SGD's buffer), and its rounding seed and element offset."""
        specs = self._state_specs(group)
        bs = group["block_size"]
        rounding = _qstate.Rounding.make(
            bnb_compat=group["bnb_compat"], stochastic=group["stochastic_rounding"]
        )
        base_flags = rounding.flags()
        hp_table, hp_at = _hparam_table(steps, lambda step: self._kernel_hparams(group, step))
        table = np.empty((len(items), _kernels.TENSOR_FIELDS), dtype=np.int64)
        table[:, :8] = rows
        table[:, 8] = hp_at
        table[:, 9] = base_flags
        table[:, 10:] = 0  # the rounding seed and element offset, read by stochastic rounding
        if 1 in steps:
            table[np.asarray(steps) == 1, 9] |= _kernels.FLAG_FIRST_STEP
        if rounding.stochastic:
            for k, ((pi, p, _), step) in enumerate(zip(items, steps)):
                seed = _mix_seed(gi, pi, step)
                table[k, 10] = seed - ((seed >> 63) << 64)  # as int64, the kernel's word
                table[k, 11] = _global_row_offset(p) * int(table[k, 7])
        lib = _kernels.library()
        maps = [_qstate.qmap(signed) for _, signed in specs]
        m2 = maps[1] if len(maps) == 2 else None
        rc = lib.step8_multi(
            self._kind,
            table.ctypes.data,
            len(items),
            maps[0].code.data_ptr(),
            maps[0].regions.data_ptr(),
            maps[0].lut.data_ptr(),
            maps[0].zero_idx,
            int(maps[0].signed),
            m2.code.data_ptr() if m2 is not None else None,
            m2.regions.data_ptr() if m2 is not None else None,
            m2.lut.data_ptr() if m2 is not None else None,
            m2.zero_idx if m2 is not None else 0,
            int(m2.signed) if m2 is not None else 0,
            bs,
            torch.get_num_threads(),
        )
        del hp_table  # (held until the kernel has read its rows)
        if rc != 0:
            raise RuntimeError(f"fused 8-bit kernel rejected block_size={bs}")

    def _triton_takes(self, group: dict[str, Any], p: Tensor) -> bool:
        """CUDA tensors (``_triton.serves``), contiguous fp32 / bf16, unless stochastic rounding
        is on (no Triton kernel: the torch path)."""
        p_l = _local(p)
        return (
            _triton.serves(p_l)
            and p_l.dtype in _TRITON_DTYPES
            and p_l.is_contiguous()
            and not group["stochastic_rounding"]
        )

    def _triton_prepare(
        self, group: dict[str, Any], items: list[_Item]
    ) -> tuple[_Launches, list[Tensor]]:
        """The Triton twin of ``step8_multi`` ([Note: multi-tensor launch] in
        ``qshard._triton._common``): one launch for each (parameter dtype, gradient dtype,
        device) among ``items``, usually one for the group; same numerics (docs/gpu.md)."""
        specs = self._state_specs(group)
        maps = [_qstate.qmap(signed) for _, signed in specs]
        states = {}
        for k, (name, _) in enumerate(specs, start=1):
            states |= {f"codes{k}": f"{name}_codes", f"absmax{k}": f"{name}_absmax"}
        two = {}
        if len(maps) == 2:
            m = maps[1]
            two = dict(code2=m.code, mid2=m.mid, zero2=m.zero_idx, signed2=m.signed, lut2=m.lut)
        calls, copies = _triton_launches(items, states)
        launches = []
        for positions, call in calls:
            launch = _triton.prepare_optim8bit_multi(
                kind=self._kind,
                code1=maps[0].code,
                mid1=maps[0].mid,
                zero1=maps[0].zero_idx,
                signed1=maps[0].signed,
                lut1=maps[0].lut,
                block_size=group["block_size"],
                **call,
                **two,
            )
            launches.append((launch, positions))
        return launches, copies

    def _triton_run(
        self,
        group: dict[str, Any],
        items: list[_Item],
        launches: _Launches,
        steps: list[int],
    ) -> None:
        """Each launch with its tensors' hyperparameters (one list per distinct step count) and
        flags; a launch whose tensors need different flags (SGD's first step beside later
        ones) is prepared again for each flag value."""
        base_flags = _qstate.Rounding.make(
            bnb_compat=group["bnb_compat"], stochastic=group["stochastic_rounding"]
        ).flags()
        # Only SGD's kernel reads the first-step flag: for the other kinds it would compile a
        # second kernel and split the launch at a tensor's first step, for nothing.
        first = _kernels.FLAG_FIRST_STEP if self._kind == _kernels.KIND_SGD else 0
        hps: dict[int, list[float]] = {}
        for launch, positions in launches:
            by_flags: dict[int, list[int]] = {}
            for i in positions:
                step = steps[i]
                if step not in hps:
                    hps[step] = self._kernel_hparams(group, step)
                by_flags.setdefault(base_flags | (first if step == 1 else 0), []).append(i)
            if len(by_flags) == 1:
                launch.run([hps[steps[i]] for i in positions], flags=next(iter(by_flags)))
                continue
            for flags, subset in by_flags.items():
                sub_launches, copies = self._triton_prepare(group, [items[i] for i in subset])
                for sub, sub_positions in sub_launches:
                    sub.run([hps[steps[subset[j]]] for j in sub_positions], flags=flags)
                del copies  # (held until the launches above have read them)

    # -- options ----------------------------------------------------------------------------

    def _validate_common(self, group: dict[str, Any]) -> None:
        check_common_options(group, type(self).__name__)

    # -- state ------------------------------------------------------------------------------

    def uses_8bit_state(self, p: Tensor, group: dict[str, Any]) -> bool:
        """Whether ``p`` gets quantized state: decided from its global shape only."""
        return (
            group["optim_bits"] == 8
            and p.dim() >= 2
            and p.numel() >= group["min_8bit_size"]
            and p.is_floating_point()
            and not is_full_precision_param(p)
        )

    def _init_state(self, p: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        specs = self._state_specs(group)
        if specs:
            self._make_states(p, group, state, specs, self.uses_8bit_state(p, group))

    def _make_states(
        self,
        p: Tensor,
        group: dict[str, Any],
        state: dict[str, Any],
        specs: tuple[tuple[str, bool], ...],
        quantized: bool,
    ) -> None:
        """Create the states ``specs`` of ``p`` at their initial values, quantized or fp32."""
        local = _local(p)
        if quantized:
            bs = group["block_size"]
            rows, row_numel = _qstate.row_view(local.shape)
            nbr = _qstate.blocks_per_row(row_numel, bs)
            for name, signed in specs:
                q = _qstate.qmap(signed)
                init = self._initial_state_value(group, name)
                codes = torch.full(local.shape, q.zero_idx, dtype=torch.uint8, device=local.device)
                absmax = torch.zeros(rows, nbr, dtype=torch.float32, device=local.device)
                if init != 0.0:  # a constant encodes exactly as code 1.0 times |init|
                    codes.fill_(int((q.code == math.copysign(1.0, init)).nonzero()[0, 0]))
                    absmax.fill_(abs(init))
                state[f"{name}_codes"] = _wrap_like(p, codes, tuple(p.shape))
                state[f"{name}_absmax"] = _wrap_like(p, absmax, (p.shape[0], nbr))
        else:
            for name, _ in specs:
                init = self._initial_state_value(group, name)
                state[name] = torch.full_like(p, init, dtype=_full_state_dtype(p))

    def _add_missing_state(self, p: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """States an option switched on later asks for (SGD's or RMSprop's momentum buffer):
        made as at the first step, quantized if ``p``'s other states are (else as
        :meth:`uses_8bit_state` decides); then :meth:`_states_added`."""
        specs = self._state_specs(group)
        missing = tuple(s for s in specs if s[0] not in state and f"{s[0]}_codes" not in state)
        if not missing:
            return
        present = [s[0] for s in specs if s not in missing]
        if present:
            quantized = f"{present[0]}_codes" in state
        else:
            quantized = self.uses_8bit_state(p, group)
        self._make_states(p, group, state, missing, quantized)
        self._states_added(state)

    def _states_added(self, state: dict[str, Any]) -> None:
        """Called after :meth:`_add_missing_state` made states for a tensor that had stepped."""

    def _check_state(self, p: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        specs = self._state_specs(group)
        p_l = _local(p)
        if not specs or f"{specs[0][0]}_codes" not in state or p_l.numel() == 0:
            return
        codes = [_local(state[f"{n}_codes"]) for n, _ in specs]
        absmax = [_local(state[f"{n}_absmax"]) for n, _ in specs]
        _check_layout(
            type(self).__name__, p_l, codes, absmax, tuple(p_l.shape), group["block_size"]
        )

    # -- step -------------------------------------------------------------------------------

    def _step_param(
        self,
        p: Tensor,
        group: dict[str, Any],
        state: dict[str, Any],
        step: int,
        index: tuple[int, int],
    ) -> None:
        p_l, g_l = _local(p), _local(p.grad)
        if p_l.numel() == 0:
            return
        specs = self._state_specs(group)
        eight = bool(specs) and f"{specs[0][0]}_codes" in state
        rounding = _qstate.Rounding.make(
            bnb_compat=group["bnb_compat"], stochastic=group["stochastic_rounding"]
        )
        seed = _mix_seed(index[0], index[1], step)
        bs = group["block_size"]
        if not eight:
            states = [_local(state[name]) for name, _ in specs]
            dt = _full_state_dtype(p_l)
            p32 = p_l if p_l.dtype == dt else p_l.to(dt)
            self._reference_update(p32, g_l.to(dt), states, group, step)
            if p32 is not p_l:
                p_l.copy_(p32)
            return
        codes = [_local(state[f"{n}_codes"]) for n, _ in specs]
        absmax = [_local(state[f"{n}_absmax"]) for n, _ in specs]
        # The layout was checked by _plan_quantized (_check_state) before any tensor moved.
        maps = [_qstate.qmap(signed) for _, signed in specs]
        # (CUDA tensors the Triton kernel takes were stepped by _triton_run.)
        # Reference path: dequantize, pure update in fp32 (fp64 for fp64 parameters), requantize.
        dt = _full_state_dtype(p_l)
        states = [
            _qstate.dequantize_rows(c, a, q, bs).to(dt) for c, a, q in zip(codes, absmax, maps)
        ]
        p32 = p_l if p_l.dtype == dt else p_l.to(dt)
        g32 = g_l.to(dt)
        if rounding.canonical_zero:
            g32 = g32 + 0.0
        if p_l.dtype == torch.float32:  # the kernel's bits ([Note: the kernel's order])
            hp = self._kernel_hparams(group, step)
            _functional.kernel8_update(self._kind, p32, g32, states, hp, first_step=step == 1)
        else:
            self._reference_update(p32, g32, states, group, step)
        if p32 is not p_l:
            p_l.copy_(p32)
        gen = None
        if rounding.stochastic:
            gen = torch.Generator(device=p_l.device).manual_seed(seed & 0x7FFFFFFFFFFFFFFF)
        for s, c, a, q in zip(states, codes, absmax, maps):
            nc, na = _qstate.quantize_rows(s, q, bs, rounding, gen)
            c.copy_(nc)
            a.copy_(na)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` on this rank (local shards of DTensors)."""
    total = 0
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, Tensor):
                t = _local(v)
                total += t.numel() * t.element_size()
    return total


def state_bytes_per_param(optimizer: torch.optim.Optimizer) -> float:
    """Optimizer-state bytes per parameter element on this rank (8-bit Adam: ~2.03)."""
    numel = sum(
        _local(p).numel()
        for g in optimizer.param_groups
        for p in g["params"]
        if p in optimizer.state
    )
    return optimizer_state_bytes(optimizer) / max(numel, 1)
