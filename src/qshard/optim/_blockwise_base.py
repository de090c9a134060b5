"""The block-wise quantized-state optimizer base (:class:`BlockwiseOptimizer`): what the 8-bit
optimizers (``_base8bit.py``) and the 4-bit ones (``adam4bit.py``) share. The part that does
not depend on the state format: the param-group option check, the step loop over plain and
FSDP2 (DTensor) parameters (missing and sparse gradients, lazy state), the one kept plan per
group of quantized tensors and its dispatch to a multi-tensor kernel call (CPU) or prepared
Triton launches, the fp32-state tensors of a group through torch's own update, and a
``load_state_dict`` that keeps dtypes. Its helpers live in sibling modules, one job each:
``_options.py`` (the common options and their checks), ``_state_layout.py`` (local shards,
state dtypes and the quantized-layout check), ``_multi_tensor.py`` (the entries of one
multi-tensor kernel call, the step bank and the plan types) and ``_state_dict.py`` (checking a
foreign state_dict before it loads).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from qshard import _replicas, _triton
from qshard.optim import _state_dict
from qshard.optim._multi_tensor import (
    _advance_steps,
    _device_steps,
    _Item,
    _KeptPlan,
    _Launches,
    _plan_fingerprint,
    _plan_held,
    _QuantizedPlan,
    _step_bank,
    _steps_off_device,
)
from qshard.optim._options import SCHEDULER_KEYS, _check_lr, eager_only, listed_once
from qshard.optim._state_layout import _full_state_dtype, _local

__all__ = ["BlockwiseOptimizer"]


class BlockwiseOptimizer(torch.optim.Optimizer):
    """What the block-wise quantized-state optimizers (8-bit in ``_base8bit.py``, 4-bit in
    ``adam4bit.py``)
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

    #: States an option switched on after a parameter stepped adds at its next step (see
    #: :meth:`_add_missing_state`): a loaded state may lack them.
    _optional_states: ClassVar[frozenset[str]] = frozenset()

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
        super().add_param_group(listed_once(param_group, type(self).__name__))
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
            # The step counters stay CPU tensors (the kernels read them on the host): torch's
            # load moves them to the parameter's device when the group says fused=True, and a
            # CUDA counter then failed to pin at the next fused step (or synced every step).
            step = self.state[p].get("step")
            if isinstance(step, Tensor) and not step.is_cpu:
                self.state[p]["step"] = step.detach().to("cpu", torch.float32)
            for k, v in st.items():
                if isinstance(v, Tensor) and k != "step":
                    quantized = k.endswith("_codes") or k.endswith("_absmax")
                    if v.is_floating_point() and not quantized:  # a full-precision state
                        v = v.to(dtype=_full_state_dtype(p))
                    self.state[p][k] = v.to(device=p.device)
        self._after_load()
        for post_hook in post.values():
            post_hook(self)

    def _after_load(self) -> None:
        """Called once the loaded state and groups are in place (before the post-hooks)."""

    # -- step -------------------------------------------------------------------------------

    @torch.no_grad()
    @eager_only
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if (
            torch.backends.cuda.is_built()
            and torch.cuda.is_initialized()
            and torch.cuda.is_current_stream_capturing()
        ):
            # the kernels read the step counters and hyperparameters on the host: a captured
            # step would replay the captured lr and bias correction forever
            raise RuntimeError(
                f"{type(self).__name__}.step() cannot be captured in a CUDA graph (its step "
                "counters and hyperparameters are read on the host each step); step outside "
                "the captured region"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Refuse before any tensor moves: a group's tensors are stepped group by group, so an
        # error in a later group would leave a half-applied step.
        neutral = self._neutral_options()
        for gi, group in enumerate(self.param_groups):
            # a torch-only option set by hand after the group was added (the constructor,
            # add_param_group and load_state_dict refuse it) stepped as if it were not there
            by_hand = {
                k: group[k]
                for k in neutral
                if k in group and k not in self.defaults and group[k] != neutral[k]
            }
            # an lr written into param_groups by hand (a Tensor one is refused at
            # construction: the update reads a number, and a checkpoint would round it)
            _check_lr(group["lr"], f"{type(self).__name__}: param group {gi}")
            if by_hand:
                k, v = next(iter(by_hand.items()))
                raise ValueError(
                    f"{type(self).__name__}: param group {gi} has {k}={v!r}, set by hand in "
                    f"param_groups; {type(self).__name__} does not take {k} and computes what "
                    f"torch.optim does with {k}={neutral[k]!r}, so the step would ignore it. "
                    f"Set it back (opt.param_groups[{gi}][{k!r}] = {neutral[k]!r}) or use an "
                    "optimizer that takes it"
                )
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
        slot = _slot(gi, items)
        kept = cache.get(slot)
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
        cache.pop(slot, None)
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
            cache[slot] = _KeptPlan(
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
            steps = _advance_steps(plan.batch, banks, (_slot(gi, plan.batch), "batch"))
            self._multi_tensor_step(gi, group, plan.batch, plan.rows, steps)
        if plan.triton:
            steps = _advance_steps(plan.triton, banks, (_slot(gi, plan.triton), "triton"))
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
        bank = _step_bank(live, banks, (_slot(gi, live), "full")) if off_device else None
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


def _slot(gi: int, items: list[_Item]) -> tuple[int, int | None]:
    """Where group ``gi``'s kept plan and step banks for ``items`` are filed: the group's index
    and the first item's parameter, so that a step over a few of the group's parameters (one
    FSDP unit's at a time, :class:`qshard.zeropp.StepInBackward`: the others' gradients hidden)
    keeps a plan per unit instead of rebuilding the group's at every call (the kept plan's
    fingerprint still checks every tensor)."""
    return gi, (id(items[0][1]) if items else None)
