"""The shared machinery of the 8-bit optimizers: state creation, the step loop over plain and
FSDP2 (DTensor) parameters and its dispatch to the kernels, the fp32-state path through torch's
own updates, and checkpoint loading. The part that does not depend on the state format
(:class:`BlockwiseOptimizer`: step loop, fp32-state batching, ``load_state_dict``) also carries
the 4-bit optimizers (``adam4bit.py``). Its helpers live in sibling modules, one job each:
``_options.py`` (the common options and their checks), ``_state_layout.py`` (local shards,
state dtypes and the quantized-layout check), ``_multi_tensor.py`` (the entries of one
multi-tensor kernel call) and ``_state_dict.py`` (checking a foreign state_dict before it loads).

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
  fused kernel one tensor at a time.

For a DTensor parameter every state tensor is a DTensor on the parameter's mesh with its
placements (``Shard(0)`` and/or ``Replicate()``), so ``state_dict()`` and DCP see ordinary
sharded tensors and DCP can load them on any number of ranks. The step itself runs on local
shards only; no collective is issued.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from qshard import _replicas, _triton
from qshard.optim import _kernels, _qstate, _state_dict

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


class BlockwiseOptimizer(torch.optim.Optimizer):
    """What the block-wise quantized-state optimizers (8-bit here, 4-bit in ``adam4bit.py``)
    share: the param-group option check, the step loop (missing and sparse gradients, lazy
    state), the fp32-state tensors of a group in one ``_torch_update`` call, and a
    ``load_state_dict`` that keeps dtypes. Not used directly.

    Subclasses implement :meth:`_state_specs`, :meth:`_validate_common`, :meth:`_init_state`
    and :meth:`_step_param` (the quantized step), and :meth:`_torch_update` where torch has
    the optimizer (else fp32 state takes :meth:`_step_param` one tensor at a time).
    Quantized state is recognised by ``<first state>_codes`` in the parameter's state.
    """

    # -- hooks ------------------------------------------------------------------------------

    def _state_specs(self, group: dict[str, Any]) -> tuple[tuple[str, bool], ...]:
        """(state name, signed map?) for each state this group keeps."""
        raise NotImplementedError

    def _validate_common(self, group: dict[str, Any]) -> None:
        """Check the options every optimizer of the family takes."""
        raise NotImplementedError

    def _validate_group(self, group: dict[str, Any]) -> None:
        """Check the optimizer-specific options of a group (subclasses extend)."""

    def _init_state(self, p: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _step_param(
        self,
        p: Tensor,
        group: dict[str, Any],
        state: dict[str, Any],
        step: int,
        index: tuple[int, int],
    ) -> None:
        """One step of ``p`` (``step`` already counted; ``index``: (group, param) positions)."""
        raise NotImplementedError

    def _add_missing_state(self, p: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """Create the states that ``group``'s options now ask for and ``state`` lacks (an option
        such as SGD's momentum switched on after ``p`` stepped); by default there are none."""

    def _check_state(self, p: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """Refuse ``p``'s quantized state if its layout no longer fits ``p`` and the group (for
        the tensors :meth:`_step_param` steps; the multi-tensor rows check their own)."""

    #: What the sparse-gradient error points to (torch's optimizers that take them).
    _sparse_alternative = "torch.optim.SparseAdam"

    # -- options ----------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        unknown = sorted(
            set(param_group) - set(self.defaults) - {"params", "param_names"} - SCHEDULER_KEYS
        )
        if unknown:
            raise ValueError(
                f"{type(self).__name__}: unknown param-group option(s) {unknown}; known options:"
                f" {sorted(self.defaults)}"
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            # HSDP with replicate_reduce=False: no gradient crosses nodes and this optimizer
            # does not sync the replicas ([Note: replica sync] in qshard._replicas)
            _replicas.refuse_unsynced(group["params"], type(self).__name__)
            self._validate_common(group)
            self._validate_group(group)
        except Exception:
            self.param_groups.pop()  # a refused group must not stay in the optimizer
            raise

    #: ``torch.optim`` options these optimizers do not take, each with the value at which torch
    #: computes what they compute: a ``torch.optim`` state_dict carrying them loads only then.
    _torch_neutral_options: ClassVar[dict[str, Any]] = {
        "amsgrad": False,
        "maximize": False,
        "capturable": False,
        "differentiable": False,
        "centered": False,
    }

    def _neutral_options(self) -> dict[str, Any]:
        """:attr:`_torch_neutral_options` for this optimizer (Adam/AdamW add
        ``decoupled_weight_decay``)."""
        return self._torch_neutral_options

    def _missing_step(self, state: dict[str, Any]) -> float | None:
        """The step count of a loaded state saved without one (``torch.optim.SGD`` keeps no
        counter), or None when it cannot be known (the load is then refused)."""
        return None

    def _checked_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` with its param groups and states made loadable, or an error that says
        why not, before anything is loaded ([Note: loading foreign state_dicts] in
        ``_state_dict.py``)."""
        return _state_dict.checked_state_dict(self, state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.load_state_dict`` keeping every state tensor's dtype.

        torch casts each loaded state tensor to its parameter's dtype (which would turn codes
        into floats and, for bf16 parameters, round absmax and fp32 states); here only the
        device follows the parameter, so a round trip is bit-exact. The saved groups' options
        are checked first, and a ``torch.optim`` state_dict loads where this optimizer computes
        the same ([Note: loading foreign state_dicts] in ``_state_dict.py``). Hooks registered
        with ``register_load_state_dict_pre_hook``/``_post_hook`` run as in torch: the
        pre-hooks before the check (so one can adapt a checkpoint), the post-hooks on the
        loaded state with its dtypes.
        """
        # The hooks run in torch's order around our work: the pre-hooks on the state_dict as
        # given (a hook may adapt a checkpoint that the check would refuse, and its changes
        # to state tensors are the ones loaded), the post-hooks once the dtypes are restored.
        # torch's own call runs with neither (they used to run inside it, after the check, and
        # the restore below then overwrote what a pre-hook had changed).
        self.__dict__.pop("_plan_cache", None)  # (it holds the states being replaced)
        self.__dict__.pop("_step_banks", None)
        state_dict = state_dict.copy()  # shallow, as torch
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        state_dict = self._checked_state_dict(state_dict)
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        originals = {p: saved[i] for i, p in zip(ids, params) if i in saved}
        pre, post = (
            self._optimizer_load_state_dict_pre_hooks,
            self._optimizer_load_state_dict_post_hooks,
        )
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        try:
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks = pre
            self._optimizer_load_state_dict_post_hooks = post
        for p, st in originals.items():
            for k, v in st.items():
                if isinstance(v, Tensor) and k != "step":
                    quantized = k.endswith("_codes") or k.endswith("_absmax")
                    if v.is_floating_point() and not quantized:  # a full-precision state
                        v = v.to(dtype=_full_state_dtype(p))
                    self.state[p][k] = v.to(device=p.device)
        for post_hook in post.values():
            post_hook(self)

    # -- step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Refuse before any tensor moves: a group's tensors are stepped group by group, so an
        # error in a later group would leave a half-applied step.
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError(
                        f"{type(self).__name__} does not support sparse gradients (got one for a "
                        f"parameter of shape {tuple(p.shape)}); build the embedding with "
                        f"sparse=False, or step those parameters with {self._sparse_alternative}"
                    )
        # Every group's states are made and every layout checked before any tensor moves: a
        # refusal in a later group or tensor must not leave a half-applied step (or a counter
        # advanced for a step that did not happen).
        plans = []
        for gi, group in enumerate(self.param_groups):
            full: list[_Item] = []  # fp32 state: one batch
            quantized: list[_Item] = []
            # (the per-tensor checks spelled out here: a step asks them of every tensor)
            specs = self._state_specs(group)
            names = [(name, f"{name}_codes") for name, _ in specs]
            first_codes = names[0][1] if names else None
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, group, state)
                else:
                    for n, c in names:
                        if n not in state and c not in state:
                            self._add_missing_state(p, group, state)
                            break
                if first_codes in state:  # (quantized state: its first state's codes)
                    quantized.append((pi, p, state))
                else:
                    full.append((pi, p, state))
            plans.append((group, full, self._plan_quantized(gi, group, quantized)))
        for gi, (group, full, plan) in enumerate(plans):
            self._step_quantized(gi, group, plan)
            if full:
                self._step_full_precision(gi, group, full)
        return loss

    def _plan_quantized(self, gi: int, group: dict[str, Any], items: list[_Item]) -> _QuantizedPlan:
        """Split group ``gi``'s quantized tensors (``(index in the group, parameter, state)``)
        into those the Triton kernel takes (CUDA: prepared launches, :meth:`_triton_prepare`),
        those the CPU kernel takes as they are, in one multi-tensor call ([Note: multi-tensor
        step] in ``qshard.optim._kernels``; :meth:`_multi_tensor_row`), and the others (the
        torch reference: one :meth:`_step_param` each), checking every layout; nothing moves.
        The split, the CPU call's rows and the prepared launches of the last step are kept
        while the tensors are the same ([Note: prepared launch] in ``qshard._triton._common``;
        ``_plan_fingerprint``; the gradients' new addresses are written into them): then only
        the others' layouts are checked again."""
        keys = self._plan_state_keys(group)
        seen = _plan_fingerprint(items, keys)
        fingerprint = None
        if seen is not None:
            fingerprint = (self._plan_group_key(group), self._plan_backends(), keys, seen[0])
        cache = self.__dict__.setdefault("_plan_cache", {})
        kept = cache.get(gi)
        if fingerprint is not None and kept is not None and kept.fingerprint == fingerprint:
            grads = seen[1]  # (this step's gradients: the kept rows take their addresses)
            kept.rows[:, 1] = [grads[i] for i in kept.batch]
            for launch, positions in kept.launches:
                launch.rebind_grads([grads[kept.triton[j]] for j in positions])
            plan = _QuantizedPlan(
                batch=[items[i] for i in kept.batch],
                rows=kept.rows,
                triton=[items[i] for i in kept.triton],
                launches=kept.launches,
                rest=[items[i] for i in kept.rest],
            )
            for _, p, state in plan.rest:
                self._check_state(p, group, state)
            return plan
        cache.pop(gi, None)
        plan = _QuantizedPlan()
        where: tuple[list[int], list[int], list[int]] = ([], [], [])  # batch, triton, rest
        rows = []
        for i, item in enumerate(items):
            if self._triton_takes(group, item[1]):
                plan.triton.append(item)
                where[1].append(i)
                continue
            entry = self._multi_tensor_row(group, item[1], item[2])
            if entry is None:
                self._check_state(item[1], group, item[2])
                plan.rest.append(item)
                where[2].append(i)
            else:
                plan.batch.append(item)
                rows.append(entry[0])
                plan.grads.append(entry[1])  # (held until the kernel has read them)
                where[0].append(i)
        plan.rows = np.array(rows, dtype=np.int64).reshape(-1, 8)  # (entries of 8 words)
        if plan.triton:
            for _, p, state in plan.triton:
                self._check_state(p, group, state)
            plan.launches, plan.grads_triton = self._triton_prepare(group, plan.triton)
        copied = plan.grads_triton or any(
            g.data_ptr() != _local(p.grad).data_ptr()
            for g, (_, p, _) in zip(plan.grads, plan.batch)
        )
        if fingerprint is not None and not copied:
            held = _plan_held(items, keys)
            cache[gi] = _KeptPlan(
                fingerprint, where[0], plan.rows, where[1], plan.launches, where[2], held
            )
        return plan

    def _step_quantized(self, gi: int, group: dict[str, Any], plan: _QuantizedPlan) -> None:
        """Step group ``gi``'s quantized tensors as :meth:`_plan_quantized` split them (a lone
        tensor the kernel takes is a call of one)."""
        for pi, p, state in plan.rest:
            state["step"] += 1
            self._step_param(p, group, state, int(state["step"].item()), (gi, pi))
        banks = self.__dict__.setdefault("_step_banks", {})  # ([Note: step bank])
        if plan.batch:
            steps = _advance_steps(plan.batch, banks, (gi, "batch"))
            self._multi_tensor_step(gi, group, plan.batch, plan.rows, steps)
        if plan.triton:
            steps = _advance_steps(plan.triton, banks, (gi, "triton"))
            self._triton_run(group, plan.triton, plan.launches, steps)

    def _multi_tensor_row(
        self, group: dict[str, Any], p: Tensor, state: dict[str, Any]
    ) -> tuple[list[int], Tensor] | None:
        """``p``'s entry of the multi-tensor call (addresses and sizes, its layout checked) and
        the gradient it points at, or None when the call does not take it (then
        :meth:`_step_param` steps it)."""
        return None

    def _multi_tensor_step(
        self,
        gi: int,
        group: dict[str, Any],
        items: list[_Item],
        rows: np.ndarray,
        steps: list[int],
    ) -> None:
        """One kernel call for ``items``, with their :meth:`_multi_tensor_row` entries and their
        step counts (already advanced)."""
        raise NotImplementedError

    def _triton_takes(self, group: dict[str, Any], p: Tensor) -> bool:
        """Whether the Triton kernel steps ``p`` (a CUDA tensor it serves: :meth:`_triton_prepare`,
        :meth:`_triton_run`); else :meth:`_step_param` or the CPU kernel does."""
        return False

    def _plan_state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The state keys of the tensors the kernels read (a kept plan holds their identities)."""
        return tuple(f"{n}_{k}" for n, _ in self._state_specs(group) for k in ("codes", "absmax"))

    def _plan_group_key(self, group: dict[str, Any]) -> tuple:
        """The group options a kept plan depends on (:meth:`_plan_quantized`): the block size
        (the layouts) and what decides which kernel takes a tensor."""
        return (group["block_size"], group.get("stochastic_rounding"))

    def _plan_backends(self) -> tuple:
        """The kernels a kept plan was split for (:meth:`_plan_quantized`): Triton's dispatch
        predicate and the C library; tests and benchmarks swap them between steps."""
        return (_triton.serves,)

    def _triton_prepare(
        self, group: dict[str, Any], items: list[_Item]
    ) -> tuple[_Launches, list[Tensor]]:
        """The checked Triton launches of ``items`` (one per parameter dtype, gradient dtype and
        device), each with its items' positions, and the gradient copies they read
        (``_triton_launches``)."""
        raise NotImplementedError

    def _triton_run(
        self,
        group: dict[str, Any],
        items: list[_Item],
        launches: _Launches,
        steps: list[int],
    ) -> None:
        """Run :meth:`_triton_prepare`'s ``launches`` of ``items`` at their step counts (already
        advanced)."""
        raise NotImplementedError

    def _torch_update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        states: list[list[Tensor]],
        steps: list[Tensor],
    ) -> None:
        """Step all fp32-state tensors of a group in one call (see ``_step_full_precision``).

        ``params``/``grads`` are fp32 local tensors, ``states[i]`` the list of state
        ``_state_specs()[i]``, ``steps`` the step counters before this step; the update advances
        every counter by one, as torch's functional optimizers do. Optimizers that torch has call
        its functional update with the group's ``foreach``/``fused`` flags (the arguments
        ``torch.optim`` passes, so the same bits); without an override each tensor takes the
        per-tensor reference path.
        """
        raise NotImplementedError

    def _step_full_precision(self, gi: int, group: dict[str, Any], items: list[_Item]) -> None:
        """The fp32-state tensors of group ``gi``: one ``_torch_update`` call for all of them."""
        if type(self)._torch_update is BlockwiseOptimizer._torch_update:
            for pi, p, state in items:
                state["step"] += 1
                self._step_param(p, group, state, int(state["step"].item()), (gi, pi))
            return
        live = []
        for item in items:
            if _local(item[1]).numel() == 0:  # an empty shard: only its counter moves
                item[2]["step"] += 1
            else:
                live.append(item)
        if not live:
            return
        params, grads, back = [], [], []
        for _, p, _ in live:
            p_l, g_l = _local(p), _local(p.grad)
            if p_l.dtype == _full_state_dtype(p_l):  # fp32 or fp64: as torch.optim
                params.append(p_l)
                grads.append(g_l.to(p_l.dtype))
            else:  # fp32 math and state for low-precision parameters, as on the 8-bit path
                p32 = p_l.float()
                params.append(p32)
                grads.append(g_l.float())
                back.append((p_l, p32))
        states = [[_local(st[name]) for _, _, st in live] for name, _ in self._state_specs(group)]
        # torch keeps a fused optimizer's step counters on the parameter's device; here they
        # stay CPU tensors (the checkpoint format), so a fused kernel elsewhere gets copies,
        # and the CPU counters advance as one buffer ([Note: step bank]) or one foreach call.
        off_device = group.get("fused") and _steps_off_device(params)
        banks = self.__dict__.setdefault("_step_banks", {})
        bank = _step_bank(live, banks, (gi, "full")) if off_device else None
        steps = [st["step"] for _, _, st in live]  # (after the bank: it may replace them)
        if not off_device:
            self._torch_update(group, params, grads, states, steps)
        else:
            self._torch_update(group, params, grads, states, _device_steps(steps, params, bank))
            if bank is None:
                torch._foreach_add_(steps, 1)
            else:
                bank.add_(1)
        for p_l, p32 in back:
            p_l.copy_(p32)


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
