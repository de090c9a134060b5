"""4-bit Adam and AdamW: both moments in 4 bits, two codes a byte (about 1.06 bytes of state per
parameter with 128-element blocks, against 2.03 for 8 bits and 8 for fp32).

The formats (see [Note: 4-bit layout] in ``_qstate4.py`` and ``docs/optim4bit.md`` for the
measurements behind them): the first moment on the signed 4-bit dynamic map, the second on a
linear map WITHOUT a zero code (a zero code sends small second moments to 0 and their update to
``m / eps``), both in blocks of 128 elements along each row. Eligibility and block layout come
from the global parameter, as for the 8-bit optimizers, so an FSDP2 shard holds whole blocks,
the sharded step is the unsharded arithmetic (no collective), and DCP reshards the state.

State per parameter (``optimizer.state[p]``): ``step`` (fp32 scalar); 4-bit: ``exp_avg_codes``
and ``exp_avg_sq_codes`` (uint8 ``(dim0, ceil(row_numel / 2))``), ``exp_avg_absmax`` and
``exp_avg_sq_absmax`` (fp32 ``(dim0, blocks_per_row)``); fp32: ``exp_avg``, ``exp_avg_sq``. For a
DTensor parameter each is a DTensor on its mesh with its placements.

Paths, same numerics (bit for bit): the Triton kernel (CUDA, fp32/bf16), the fused C kernel
(CPU fp32, contiguous) and the torch reference :func:`qshard.optim._qstate4.adam4bit_reference` (everything else).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qshard import _triton
from qshard.optim import _kernels4, _qstate4
from qshard.optim._blockwise_base import BlockwiseOptimizer
from qshard.optim._multi_tensor import (
    _TRITON_DTYPES,
    _hparam_table,
    _Item,
    _Launches,
    _multi_tensor_entry,
    _triton_launches,
)
from qshard.optim._options import (
    _check_lr,
    check_numbers,
    check_params_and_torch_flags,
    refuse_maximize,
    whole_int,
)
from qshard.optim._overrides import is_full_precision_param
from qshard.optim._qstate import blocks_per_row, row_view
from qshard.optim._state_layout import _check_layout, _full_state_dtype, _local, _wrap_like
from qshard.optim.adam8bit import adam_group_hparams, torch_adam_group

__all__ = ["Adam4bit", "AdamW4bit"]

_STATES = ("exp_avg", "exp_avg_sq")
_SPECS = (("exp_avg", True), ("exp_avg_sq", False))

#: [Note: the map the codes were written with] The second moment's codes mean nothing without
#: the map that wrote them, and ``second_moment_map`` is a group option a user can change
#: between steps: the codes were then read with the other map (a silently wrong second
#: moment). The map's name rides on the codes tensor as this attribute, set when the state is
#: made, again after a load (which restores the saved group's options with its state: the
#: group's map is the codes' map then; an in-place DCP load keeps the old tensors), or at its
#: first check for state made elsewhere, and each check compares it with the group's. Nothing
#: is added to the state_dict: checkpoints keep their keys.
_MAP_ATTR = "_qshard_second_moment_map"


class Adam4bit(BlockwiseOptimizer):
    """Adam with 4-bit block-wise state; ``torch.optim.Adam`` semantics (L2 weight decay).

    Args:
        params: parameters or parameter groups (groups may override every option below).
        lr, betas, eps, weight_decay: as ``torch.optim.Adam``.
        amsgrad: must be False (not supported with quantized state).
        maximize: must be False (accepted as torch.optim takes it; the kernels minimize).
        optim_bits: 4 (quantized state for eligible tensors) or 32 (fp32 state).
        min_4bit_size: tensors with fewer (global) elements keep fp32 state; 1-D tensors always
            do (their rows would be single elements).
        block_size: elements per absmax block along a row, even, 2..4096 (128 default: the
            measured choice; 2048 lost accuracy on the first moment).
        second_moment_map: ``"linear"`` (default, zero-free), ``"dynamic"`` (zero-free dynamic)
            or ``"linear-zero"`` (the naive map with a zero code, kept as the ablation that
            shows the zero-point problem; do not train with it).
        foreach, fused: as ``torch.optim.Adam``, for the tensors with fp32 state, which take
            torch's own update in one call per group: the same bits as ``torch.optim.Adam``
            with the same flags (the step loop and this path are the 8-bit optimizers',
            :class:`qshard.optim._blockwise_base.BlockwiseOptimizer`).
    """

    _decoupled = False

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        optim_bits: int = 4,
        min_4bit_size: int = 4096,
        block_size: int = 128,
        second_moment_map: str = "linear",
        foreach: bool | None = None,
        fused: bool | None = None,
        maximize: bool = False,
    ) -> None:
        refuse_maximize(maximize, type(self).__name__)
        if amsgrad:
            raise ValueError(f"{type(self).__name__} does not support amsgrad; use amsgrad=False")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            optim_bits=optim_bits,
            min_4bit_size=min_4bit_size,
            block_size=block_size,
            second_moment_map=second_moment_map,
            foreach=foreach,
            fused=fused,
        )
        super().__init__(params, defaults)

    # -- options ----------------------------------------------------------------------------

    def _validate_common(self, group: dict[str, Any]) -> None:
        name = type(self).__name__
        bits = whole_int(group["optim_bits"])
        if bits not in (4, 32):
            raise ValueError(f"{name}: optim_bits must be 4 or 32; got {group['optim_bits']!r}")
        size = whole_int(group["min_4bit_size"])
        if size is None or size < 0:
            raise ValueError(
                f"{name}: min_4bit_size must be an int >= 0; got {group['min_4bit_size']!r}"
            )
        bs = whole_int(group["block_size"])
        if bs is None or not 2 <= bs <= _kernels4.MAX_BLOCK or bs % 2:
            raise ValueError(
                f"{name}: block_size must be an even int in 2..{_kernels4.MAX_BLOCK} (two codes "
                f"share a byte; 128 is the default); got {group['block_size']!r}"
            )
        group.update(optim_bits=bits, min_4bit_size=size, block_size=bs)
        if group["second_moment_map"] not in _qstate4.SECOND_MOMENT_MAPS:
            raise ValueError(
                f"{name}: second_moment_map must be one of {_qstate4.SECOND_MOMENT_MAPS}; got "
                f"{group['second_moment_map']!r}"
            )
        _check_lr(group["lr"], name)
        check_numbers(group, name, ("betas", "eps", "weight_decay"))
        b1, b2 = group["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"{name}: betas must be in [0, 1); got {group['betas']}")
        if not (group["eps"] >= 0 and group["weight_decay"] >= 0):  # NaN too, as torch.optim
            raise ValueError(
                f"{name}: eps and weight_decay must be >= 0; got eps={group['eps']!r}, "
                f"weight_decay={group['weight_decay']!r}"
            )
        check_params_and_torch_flags(group, name, f"{name}: 4-bit state")

    # -- state ------------------------------------------------------------------------------

    def _state_specs(self, group: dict[str, Any]) -> tuple[tuple[str, bool], ...]:
        return _SPECS

    def _neutral_options(self) -> dict[str, Any]:
        # torch.optim.Adam and AdamW are one class that records the decay kind in the group
        return {**super()._neutral_options(), "decoupled_weight_decay": self._decoupled}

    def uses_4bit_state(self, p: Tensor, group: dict[str, Any]) -> bool:
        """Whether ``p`` gets 4-bit state: decided from its global shape only."""
        return (
            group["optim_bits"] == 4
            and p.dim() >= 2
            and p.numel() >= group["min_4bit_size"]
            and p.is_floating_point()
            and not is_full_precision_param(p)
        )

    def _maps(self, group: dict[str, Any]):
        return _qstate4.qmap4("signed-dynamic"), _qstate4.qmap4(group["second_moment_map"])

    def _init_state(self, p: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        if not self.uses_4bit_state(p, group):
            for name in _STATES:
                state[name] = torch.zeros_like(p, dtype=_full_state_dtype(p))
            return
        local = _local(p)
        rows, row_numel = row_view(local.shape)
        nbr = blocks_per_row(row_numel, group["block_size"])
        nbytes = _qstate4.packed_row(row_numel)
        for name, q in zip(_STATES, self._maps(group)):
            # All zeros: absmax 0 and, per element, the code the encoder gives 0.0.
            zero = int(torch.bucketize(torch.tensor(0.0), q.mid))
            codes = torch.full((rows, nbytes), zero | (zero << 4), dtype=torch.uint8)
            codes = codes.to(local.device)
            absmax = torch.zeros(rows, nbr, dtype=torch.float32, device=local.device)
            state[f"{name}_codes"] = _wrap_like(p, codes, (p.shape[0], nbytes))
            state[f"{name}_absmax"] = _wrap_like(p, absmax, (p.shape[0], nbr))
        setattr(state[f"{_STATES[1]}_codes"], _MAP_ATTR, group["second_moment_map"])

    def _after_load(self) -> None:
        # The loaded codes were written with the loaded group's map. An in-place load (DCP's
        # get_state_dict -> dcp.load -> set_state_dict) keeps the codes tensors this optimizer
        # made, stamped with its constructor's map: stamp them again.
        for group in self.param_groups:
            for p in group["params"]:
                codes = self.state.get(p, {}).get(f"{_STATES[1]}_codes")
                if codes is not None:
                    setattr(codes, _MAP_ATTR, group["second_moment_map"])

    def _check_map(self, group: dict[str, Any], state: dict[str, Any]) -> None:
        """Refuse state whose second moment was written with another map than the group's
        ([Note: the map the codes were written with])."""
        codes = state.get(f"{_STATES[1]}_codes")
        if codes is None:
            return
        want = group["second_moment_map"]
        made = getattr(codes, _MAP_ATTR, None)
        if made is None:
            setattr(codes, _MAP_ATTR, want)
        elif made != want:
            raise ValueError(
                f"{type(self).__name__}: second_moment_map is {want!r} but this group's "
                f"second-moment state was written with {made!r}, and its codes mean nothing "
                f"under another map. Set the group's second_moment_map back to {made!r}, or "
                "start from fresh state (a new optimizer) to use another map"
            )

    def _check_state(self, p: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        self._check_map(group, state)
        p_l = _local(p)
        if f"{_STATES[0]}_codes" not in state or p_l.numel() == 0:
            return
        codes = [_local(state[f"{n}_codes"]) for n in _STATES]
        absmax = [_local(state[f"{n}_absmax"]) for n in _STATES]
        rows, row_numel = row_view(p_l.shape)
        packed = (rows, _qstate4.packed_row(row_numel))
        _check_layout(type(self).__name__, p_l, codes, absmax, packed, group["block_size"])

    # -- step -------------------------------------------------------------------------------

    def _torch_update(self, group, params, grads, states, steps) -> None:
        torch_adam_group(
            group, params, grads, states[0], states[1], steps, decoupled=self._decoupled
        )

    def _plan_backends(self) -> tuple:
        return (_triton.serves, _kernels4.library())

    def _multi_tensor_row(
        self, group: dict[str, Any], p: Tensor, state: dict[str, Any]
    ) -> tuple[list[int], Tensor] | None:
        """Taken: fp32 contiguous CPU parameters; the entry is ``adam4bit_multi``'s
        ``tensor4_t`` up to its hyperparameters."""
        if _kernels4.library() is None:
            return None
        self._check_map(group, state)
        return _multi_tensor_entry(
            type(self).__name__,
            p,
            state,
            list(_STATES),
            group["block_size"],
            packed_row=_qstate4.packed_row,
        )

    def _multi_tensor_step(
        self,
        gi: int,
        group: dict[str, Any],
        items: list[_Item],
        rows: np.ndarray,
        steps: list[int],
    ) -> None:
        """``adam4bit_multi``: each entry completed with its hyperparameters' address."""
        hp_table, hp_at = _hparam_table(
            steps,
            lambda step: adam_group_hparams(
                group, step, decoupled=self._decoupled, inverse_bc2=True
            ),
        )
        table = np.empty((len(items), _kernels4.TENSOR4_FIELDS), dtype=np.int64)
        table[:, :8] = rows
        table[:, 8] = hp_at
        qm, qv = self._maps(group)
        bs = group["block_size"]
        rc = _kernels4.library().adam4bit_multi(
            table.ctypes.data,
            len(items),
            qm.code.data_ptr(),
            qm.mid_padded.data_ptr(),
            qm.lut.data_ptr(),
            2 if _qstate4.symmetric_signed(qm) else 0,  # 8 compares on |x|
            qv.code.data_ptr(),
            qv.mid_padded.data_ptr(),
            qv.lut.data_ptr(),
            int(group["second_moment_map"] == "linear"),  # arithmetic encoder, no table
            bs,
            torch.get_num_threads(),
        )
        del hp_table  # (held until the kernel has read its rows)
        if rc != 0:
            raise RuntimeError(f"fused 4-bit kernel rejected block_size={bs}")

    def _triton_takes(self, group: dict[str, Any], p: Tensor) -> bool:
        """CUDA tensors the Triton kernel serves: contiguous fp32 / bf16."""
        p_l = _local(p)
        return _triton.serves(p_l) and p_l.dtype in _TRITON_DTYPES and p_l.is_contiguous()

    def _plan_group_key(self, group: dict[str, Any]) -> tuple:
        return (group["block_size"], group["second_moment_map"])

    def _triton_prepare(
        self, group: dict[str, Any], items: list[_Item]
    ) -> tuple[_Launches, list[Tensor]]:
        """The Triton twin of ``adam4bit_multi`` ([Note: multi-tensor launch] in
        ``qshard._triton._common``): one launch for each (parameter dtype, gradient dtype,
        device) among ``items``; same numerics."""
        states = {}
        for moment, name in zip("mv", _STATES):
            states |= {f"{moment}_codes": f"{name}_codes", f"{moment}_absmax": f"{name}_absmax"}
        calls, copies = _triton_launches(items, states)
        qm, qv = self._maps(group)
        launches = []
        for positions, call in calls:
            launch = _triton.prepare_optim4bit_multi(
                m_code=qm.code,
                m_mid=qm.mid,
                v_code=qv.code,
                v_mid=qv.mid,
                block_size=group["block_size"],
                m_lut=qm.lut,
                v_lut=qv.lut,
                **call,
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
        hps: dict[int, list[float]] = {}
        for step in steps:
            if step not in hps:
                hps[step] = adam_group_hparams(
                    group, step, decoupled=self._decoupled, inverse_bc2=True
                )
        for launch, positions in launches:
            launch.run([hps[steps[i]] for i in positions])

    def _step_param(
        self,
        p: Tensor,
        group: dict[str, Any],
        state: dict[str, Any],
        step: int,
        index: tuple[int, int],
    ) -> None:
        """The 4-bit step of one tensor neither the CPU kernel (:meth:`_multi_tensor_row`) nor the
        Triton kernel (:meth:`_triton_takes`) takes: the torch reference (fp32 state goes
        through ``_torch_update``)."""
        p_l, g_l = _local(p), _local(p.grad)
        if p_l.numel() == 0:
            return
        codes = [_local(state[f"{n}_codes"]) for n in _STATES]
        absmax = [_local(state[f"{n}_absmax"]) for n in _STATES]
        qm, qv = self._maps(group)
        bs = group["block_size"]
        rows, row_numel = row_view(p_l.shape)
        packed = (rows, _qstate4.packed_row(row_numel))
        _check_layout(type(self).__name__, p_l, codes, absmax, packed, bs)
        hp = adam_group_hparams(group, step, decoupled=self._decoupled, inverse_bc2=True)
        # (CUDA tensors the Triton kernel takes were stepped by _triton_run.)
        _qstate4.adam4bit_reference(
            p_l,
            g_l,
            codes[0],
            absmax[0],
            codes[1],
            absmax[1],
            m_map=qm,
            v_map=qv,
            block_size=bs,
            hp=hp,
        )


class AdamW4bit(Adam4bit):
    """AdamW (decoupled weight decay, default 1e-2) with 4-bit block-wise state; arguments as
    :class:`Adam4bit`, semantics of ``torch.optim.AdamW``."""

    _decoupled = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        optim_bits: int = 4,
        min_4bit_size: int = 4096,
        block_size: int = 128,
        second_moment_map: str = "linear",
        foreach: bool | None = None,
        fused: bool | None = None,
        maximize: bool = False,
    ) -> None:
        # Spelled out (not **kwargs) so that help() shows every option and a misspelt one is
        # refused naming this class; tests pin the signature to Adam4bit's.
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            optim_bits=optim_bits,
            min_4bit_size=min_4bit_size,
            block_size=block_size,
            second_moment_map=second_moment_map,
            foreach=foreach,
            fused=fused,
            maximize=maximize,
        )
