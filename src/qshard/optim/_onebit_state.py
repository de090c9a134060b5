"""The checkpoint half of the data-parallel 1-bit optimizers (:class:`OneBitAdam`,
:class:`ZeroOneAdam`): ``state_dict`` / ``load_state_dict`` per rank and through
``torch.distributed.checkpoint``, and the per-rank error buffers' layout. A base class of
``qshard.optim._onebit._DataParallelOneBitOptimizer``, which holds the state it reads.

[Note: per-rank state] The error buffers are per rank (each rank's own compression residue), and
so are the momentum, parameters and sync anchor of 0/1 Adam between two syncs. Every rank saves
and loads its own ``state_dict()``. Loading a state saved by another rank, or at another world
size, keeps everything replicated and resets the error buffers to zero (with a warning): they
cannot be re-split meaningfully, and error feedback restarts from zero exactly as at the start
of compression (the lost residue is at most one step's compression error).

[Note: DCP checkpoints] ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``
(and ``set_``, as torchtitan checkpoints) names each parameter's state by matching
``param_groups`` against ``model.named_parameters()`` and keeps only ``"state"`` and
``"param_groups"``; DCP then saves one copy of every tensor that is not a DTensor (or of every
equal DTensor shard) and loads into a template built from a fresh optimizer after one
zero-lr step. So: ``param_groups`` and ``state`` are keyed by the model's own parameters (on
HSDP the DTensors: before, the local tensors, and the name lookup raised a bare ``KeyError``);
every live group holds the extra state under ``"qshard"``, which ``state_dict()`` fills in (it
was a top-level entry only, which DSD dropped); on HSDP m, v, the sync anchor and the mask are
exported as DTensors of the parameter's layout, one copy per shard across nodes; the error
buffers, the only per-rank tensors at a sync, are exported as DTensors with one row per rank
(``[group size, length]``, on HSDP ``[nodes, ranks per node, longest shard's length]``, zero
padded), and are allocated with m and v so that the fresh template has them. The round trip at
the same layout continues bit for bit. Not representable: 0/1 Adam between two syncs, when
every rank has its own momentum and parameters (DCP would keep one rank's of each, the
model's parameters included): such a state is refused on load naming ``synchronize()`` and the
per-rank path. On another number of ranks the error buffers' global shape differs and DCP's
load refuses them with a size mismatch; the per-rank path covers that case.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.distributed as dist

from qshard.comm.compressed import padded_numel, server_error_numel
from qshard.optim._replicate import _dtensor_type, _root_mesh

__all__: list[str] = []

_EXTRA_KEY = "qshard"
_ERROR_KEYS = ("worker_error", "server_error")
_SHARD_KEYS = ("exp_avg", "exp_avg_sq", "sync_anchor", "zero_mask")  # parameter-shaped


def _global_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class _OneBitCheckpoint:
    """``state_dict`` / ``load_state_dict`` of the 1-bit optimizers (a base class before
    ``torch.optim.Optimizer``, whose methods ``super()`` reaches), and the error buffers'
    sizes. Reads the optimizer's ``_extra``, ``_algorithm``, ``world_size``, ``rank``,
    ``process_group``, ``_shards`` and ``_local``."""

    def state_dict(self) -> dict[str, Any]:
        """The torch state (per-parameter tensors, including error buffers, masks and 0/1
        Adam's sync anchor) plus the algorithm's counters and schedule positions, the group
        size and this rank. Per rank: see [Note: per-rank state]; through
        ``torch.distributed.checkpoint``: see [Note: DCP checkpoints]."""
        sd = super().state_dict()
        extra = {
            "algorithm": self._algorithm,
            "world_size": self.world_size,
            "rank": self.rank,
            "global_world_size": _global_world_size(),
            "in_sync": self.in_sync,
            **self._extra,
        }
        params = [p for g in self.param_groups for p in g["params"]]
        state = dict(sd["state"])
        for i, p in enumerate(params):  # masks set before the first step ride along
            pending = self._pending_masks.get(p)
            if pending is not None:
                state[i] = {**state.get(i, {}), "zero_mask": pending}
        # positions (in the groups' order) of the parameters with a zero mask: a DCP load
        # keeps only the states the fresh optimizer has, and drops a mask it has none for
        extra["masked"] = sorted(i for i, st in state.items() if "zero_mask" in st)
        sd[_EXTRA_KEY] = extra
        for group in sd["param_groups"]:
            group[_EXTRA_KEY] = copy.deepcopy(extra)
        sd["state"] = {i: self._export_state(params[i], st) for i, st in state.items()}
        return sd

    def _export_state(self, key: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """A new dict (the live one is not touched): on HSDP the shard-shaped tensors as
        DTensors of the parameter's layout, and the error buffers as DTensors with one row per
        rank (see [Note: DCP checkpoints])."""
        out = dict(state)
        p = self._local(key)
        if "exp_avg" in out and "worker_error" not in out:  # dropped by a load: restart at 0
            out["worker_error"], out["server_error"] = self._fresh_error_buffers(p)
        if self._shards is not None:
            from torch.distributed.tensor import DTensor

            for k in _SHARD_KEYS:
                v = out.get(k)
                if isinstance(v, torch.Tensor) and v.shape == p.shape:
                    out[k] = DTensor.from_local(
                        v,
                        key.device_mesh,
                        key.placements,
                        run_check=False,
                        shape=key.shape,
                        stride=key.stride(),
                    )
        for k in _ERROR_KEYS:
            if isinstance(out.get(k), torch.Tensor):
                out[k] = self._export_error(key, k, out[k])
        return out

    def _error_numel(self, name: str, numel: int) -> int:
        """The length of error buffer ``name`` for a tensor of ``numel`` elements."""
        length = server_error_numel if name == "server_error" else padded_numel
        return length(numel, self.world_size)

    def _fresh_error_buffers(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero error buffers (worker, server) for the stepped tensor ``p``."""
        return tuple(  # type: ignore[return-value]
            torch.zeros(self._error_numel(k, p.numel()), device=p.device) for k in _ERROR_KEYS
        )

    def _export_error(self, key: torch.Tensor, name: str, buf: torch.Tensor) -> torch.Tensor:
        """One rank's error buffer as a row of a DTensor over every rank that holds one:
        ``[group size, length]`` over the data-parallel group, or on HSDP ``[nodes, ranks per
        node, longest length]`` over the 2-D mesh (shards differ in length; zero-padded)."""
        if not (dist.is_available() and dist.is_initialized()) or self.process_group is None:
            return buf  # one process: nothing is per rank
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        if self._shards is None:
            if self._error_mesh is None:
                self._error_mesh = DeviceMesh.from_group(self.process_group, buf.device.type)
            shape = (self.world_size, buf.numel())
            return DTensor.from_local(
                buf.reshape(1, -1),
                self._error_mesh,
                [Shard(0)],
                run_check=False,
                shape=shape,
                stride=(shape[1], 1),
            )
        mesh = _root_mesh(key.device_mesh)
        shard_dim = key.placements[0].dim
        size = key.shape[shard_dim]
        rows = [c.shape[0] for c in torch.empty(size, device="meta").chunk(key.device_mesh.size())]
        rest = key.numel() // size if size else 0
        longest = max(self._error_numel(name, r * rest) for r in [*rows, 0])
        row = buf.new_zeros(1, 1, longest)
        row[0, 0, : buf.numel()] = buf
        shape = (mesh.size(0), mesh.size(1), longest)
        stride = (shape[1] * shape[2], shape[2], 1)
        return DTensor.from_local(
            row, mesh, [Shard(0), Shard(1)], run_check=False, shape=shape, stride=stride
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (of this rank, or through ``torch.distributed.checkpoint``).
        At the same world size and rank the run continues bit for bit; otherwise the error
        buffers restart from zero (see [Note: per-rank state] and [Note: DCP checkpoints])."""
        name = type(self).__name__
        state_dict = dict(state_dict)
        groups = [dict(g) for g in state_dict.get("param_groups", [])]
        in_groups = [g.pop(_EXTRA_KEY, None) for g in groups]
        extra = state_dict.pop(_EXTRA_KEY, None)
        # torch.distributed.checkpoint.state_dict keeps "state" and "param_groups" only.
        through_dcp = extra is None and in_groups and isinstance(in_groups[0], dict)
        if through_dcp:
            extra = in_groups[0]
        if extra is None:
            raise ValueError(
                f"{name}.load_state_dict: this state_dict has no {_EXTRA_KEY!r} entry; it was "
                f"not saved by {name} (a torch.optim state cannot restore the error buffers "
                "and schedules)"
            )
        extra = dict(extra)
        if extra.pop("algorithm") != self._algorithm:
            raise ValueError(f"{name}.load_state_dict: state_dict was saved by another optimizer")
        saved_world, saved_rank = extra.pop("world_size"), extra.pop("rank")
        saved_global = extra.pop("global_world_size", None)
        saved_in_sync = extra.pop("in_sync", True)
        masked = extra.pop("masked", ())  # (absent in checkpoints written before it)
        if through_dcp and not saved_in_sync:
            raise ValueError(
                f"{name}.load_state_dict: this state went through torch.distributed.checkpoint "
                "between two syncs of 0/1 Adam's local steps, when every rank holds its own "
                "momentum and parameters; a DCP checkpoint keeps one copy of each, so the other "
                "ranks' local steps are lost. Call optimizer.synchronize() on every rank before "
                "get_optimizer_state_dict / dcp.save, or save optimizer.state_dict() per rank "
                "(qshard train's per-rank checkpoints)"
            )
        missing = set(self._extra) - set(extra)
        if missing:
            raise ValueError(f"{name}.load_state_dict: state_dict lacks {sorted(missing)}")
        same_world = saved_world == self.world_size and saved_global in (
            None,
            _global_world_size(),
        )
        # Per rank, the buffers are this rank's when it saved them; through DCP every rank
        # read its own row of the per-rank DTensors.
        own_errors = same_world and (through_dcp or saved_rank == self.rank)
        saved_params = [p for g in groups for p in g["params"]]
        here = [p for g in self.param_groups for p in g["params"]]
        key_of = dict(zip(saved_params, here))
        saved_state = state_dict.get("state", {})
        for k, st in saved_state.items():
            moments = [m for m in ("exp_avg", "exp_avg_sq") if m in st]
            if len(moments) == 1:  # (a bare KeyError at the next step)
                raise ValueError(
                    f"{name}.load_state_dict: the state of parameter {k} has {moments[0]!r} "
                    f"without {'exp_avg_sq' if moments[0] == 'exp_avg' else 'exp_avg'!r} (keys "
                    f"{sorted(st)}): a stepped parameter keeps both moments"
                )
        lost = [
            i
            for i in masked
            if i < len(saved_params) and "zero_mask" not in saved_state.get(saved_params[i], {})
        ]
        if lost:
            # [Note: zero masks through DCP] DCP loads into a template, a fresh optimizer's
            # state after one zero-lr step, which has a mask only where set_zero_mask was
            # called on it: the saved masks were dropped and the masked elements trained on
            # without a word. A mask set before that step waits for it (_pending_masks in
            # qshard.optim._onebit), so the template holds it and DCP loads the saved one.
            raise ValueError(
                f"{name}.load_state_dict: the checkpoint has zero masks (set_zero_mask) for "
                f"{len(lost)} parameter(s) (positions {lost} in the param groups) that this "
                "state_dict lacks: torch.distributed.checkpoint loads only the states the fresh "
                "optimizer holds. Call set_zero_mask(param, mask) on this optimizer, with the "
                "masks of the saved run, before get_state_dict / get_optimizer_state_dict"
            )
        state = {
            k: self._import_state(key_of.get(k), st, own_errors) for k, st in saved_state.items()
        }
        super().load_state_dict({**state_dict, "state": state, "param_groups": groups})
        self._extra = {k: extra[k] for k in self._extra}
        self._link_extra()
        for key, mask in list(self._pending_masks.items()):
            st = self.state.get(key)
            if st is not None and "exp_avg" in st:  # loaded: a mask set before, kept
                st.setdefault("zero_mask", mask)
                del self._pending_masks[key]
        for st in self.state.values():  # saved before per-parameter counts existed
            if "exp_avg_sq" in st and "variance_updates" not in st:
                st["variance_updates"] = self._variance_updates_done()
        if not own_errors:
            warnings.warn(
                f"{name}: state saved by rank {saved_rank} of {saved_world} loaded on rank "
                f"{self.rank} of {self.world_size}: error buffers restart from zero "
                "(everything else is kept)",
                stacklevel=2,
            )

    def _import_state(
        self, key: torch.Tensor | None, state: dict[str, Any], own_errors: bool
    ) -> dict[str, Any]:
        """Saved per-parameter state as the live layout: DTensors to their local tensors,
        error buffers to this rank's unpadded buffer (or dropped, when not this rank's)."""
        dtensor = _dtensor_type()
        out = {}
        for k, v in state.items():
            if dtensor is not None and isinstance(v, dtensor):
                v = v.to_local()
            if k in _ERROR_KEYS:
                if not own_errors:
                    continue
                if key is not None and isinstance(v, torch.Tensor):
                    v = v.reshape(-1)[: self._error_numel(k, self._local(key).numel())].clone()
            out[k] = v
        return out
