"""shard(): FSDP2 per block, then the root, with ZeRO++'s comms, hpZ and prefetching applied.

The one place qshard touches FSDP2 modules: every hook and comm it installs is set here.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_leaves

from qshard import _replicas
from qshard._fsdp import fsdp_param_groups
from qshard._stack import user_stacklevel
from qshard.comm.topology import Topology
from qshard.zeropp._blocks import _class_name, find_blocks
from qshard.zeropp._meshes import cached_hsdp_mesh, shared_post_forward_meshes
from qshard.zeropp._overlap import OverlapQueue
from qshard.zeropp._prefetch import prefetch
from qshard.zeropp.all_gather import QuantizedAllGather, RecordingAllGather
from qshard.zeropp.all_reduce import RecordingAllReduceHook, ReplicateAllReduce
from qshard.zeropp.config import ZeroPPConfig
from qshard.zeropp.reduce_scatter import HierarchicalQuantizedReduceScatter, RecordingReduceScatter

__all__ = ["HSDP_MESH_DIMS", "find_blocks", "hsdp_mesh", "shard"]

#: The dim names of an HSDP mesh: ``replicate`` spans nodes, ``shard`` the ranks of one node.
HSDP_MESH_DIMS = ("replicate", "shard")


def _shard_sizes(module: FSDPModule) -> Callable[[], list[int]] | None:
    """A callable giving the padded per-parameter shard sizes of ``module``'s flat all-gather
    input, in FSDP2's order (see [Note: qwZ block layout]); None if FSDP2's internals differ."""
    groups = fsdp_param_groups(module)
    if groups is None or len(groups) != 1:
        return None
    fsdp_params = groups[0].fsdp_params

    def sizes() -> list[int]:
        return [fp._sharded_param_data.numel() for fp in fsdp_params]

    try:
        sizes()
    except AttributeError:
        return None
    return sizes


def hsdp_mesh(topology: Topology, device_type: str = "cpu") -> DeviceMesh:
    """The 2-D HSDP mesh of ``topology``: ``(num_nodes, ranks_per_node)`` with dims
    :data:`HSDP_MESH_DIMS`; row ``n`` is node ``n``'s ranks (node-major numbering).
    Collective (creates the mesh's process groups)."""
    return init_device_mesh(
        device_type,
        (topology.num_nodes, topology.ranks_per_node),
        mesh_dim_names=HSDP_MESH_DIMS,
    )


def _check_hsdp_mesh(mesh: DeviceMesh, topology: Topology) -> None:
    if tuple(mesh.mesh_dim_names or ()) != HSDP_MESH_DIMS:
        raise ValueError(
            f"an HSDP mesh needs dims named {HSDP_MESH_DIMS}; got {mesh.mesh_dim_names}: "
            "build it with qshard.zeropp.hsdp_mesh(topology) or init_device_mesh(..., "
            f"mesh_dim_names={HSDP_MESH_DIMS})"
        )
    ranks = mesh.mesh.tolist()
    if len(ranks) * len(ranks[0]) != topology.world_size:
        raise ValueError(f"the HSDP mesh must span all {topology.world_size} ranks; got {mesh}")
    for row in ranks:
        if not topology.is_intra_node(row):
            raise ValueError(
                f"the HSDP mesh's shard dim {row} crosses nodes ({topology}); its shard dim "
                f"must be one node's ranks: use a mesh of shape (num_nodes, ranks_per_node) = "
                f"({topology.num_nodes}, {topology.ranks_per_node}), e.g. "
                "qshard.zeropp.hsdp_mesh(topology)"
            )


def _device_type(model: nn.Module) -> str:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def shard(
    model: nn.Module,
    *,
    topology: Topology,
    config: ZeroPPConfig | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    blocks: Sequence[nn.Module] | tuple[type, ...] | type | None = None,
    mesh: DeviceMesh | None = None,
) -> FSDPModule:
    """Shard ``model`` with FSDP2 (ZeRO-3) and apply the ZeRO++ features of ``config``.

    Call on every rank, after ``init_process_group`` (collective: it creates the topology's
    process groups). Applies ``fully_shard`` to each block (see :func:`find_blocks`), then to
    the root, and on every FSDP module installs:

    * all-gather: :class:`~qshard.zeropp.QuantizedAllGather` if ``qwz``, else the recording
      plain one (16-bit wire if ``wire_dtype``);
    * ``reshard_after_forward=topology.ranks_per_node`` if ``hpz`` (else ``True``) on every
      block but the last ``config.kept_blocks`` and the root, which backward needs first and
      which stay unsharded from their forward to their backward; every unit of
      every shard() call sharing one node-sized secondary mesh (two process groups per rank
      per job, see [Note: one secondary mesh per job] in :mod:`qshard.zeropp._meshes`);
    * reduce-scatter: :class:`~qshard.zeropp.HierarchicalQuantizedReduceScatter` if ``qgz``,
      else the recording plain one; one per unit, overlapping the rest of backward when
      ``overlap_reduce_scatter`` (by default: with any ZeRO++ feature) allows it;
    * with ``prefetch``: each block prefetches the next ``prefetch_depth`` blocks in forward
      and the previous ones in backward, and unshards run asynchronously.
    * a model's ``generate()`` (Hugging Face's) is registered as a forward method of the root,
      see [Note: generate() is a forward].

    HSDP (``config.hsdp`` or a 2-D ``mesh`` with dims :data:`HSDP_MESH_DIMS`): shard inside a
    node, replicate across nodes. With a full-precision replicate reduction it is
    ``fully_shard(mesh=<the 2-D mesh>)`` per block and root (FSDP2's own all-reduce, recorded
    in the ledger by an all-reduce hook); with ``replicate_bits``, a 16-bit ``wire_dtype`` or
    ``replicate_reduce=False`` it is ``fully_shard(mesh=mesh["shard"])`` plus a
    :class:`~qshard.zeropp.ReplicateAllReduce` hook, see [Note: HSDP through the all-reduce
    hook] in :mod:`qshard.zeropp.all_reduce`. With ``replicate_reduce=False`` the hook is a
    one-shot guard instead: the first backward that reduces gradients raises unless
    :class:`~qshard.optim.OneBitAdam` / :class:`~qshard.optim.ZeroOneAdam` was built over every
    trainable parameter (any other optimizer would let the node replicas drift apart; see
    [Note: replica sync] in :mod:`qshard._replicas`), then it removes itself.

    With every feature off, ``wire_dtype=None`` and ``prefetch=False`` it is ``fully_shard``
    per block and root, plus recording comms that call FSDP2's own collectives: training is
    bit-identical to plain FSDP2 (and prefetching changes only timing).

    Args:
        model: the model, on its compute device (or meta, to be materialized later).
        topology: the job's nodes; must match the initialized world.
        config: the ZeRO++ features (default: all off).
        mp_policy: FSDP2 mixed precision (``param_dtype`` is what the all-gather moves).
        blocks: what to wrap one by one (see :func:`find_blocks`).
        mesh: a 1-D data-parallel mesh over the world, or a 2-D HSDP mesh (default: created
            here from ``topology``).

    Returns:
        ``model``, now an :class:`FSDPModule`.
    """
    _check_arguments(model, topology, config, mp_policy, mesh)
    if isinstance(model, FSDPModule):
        # before finding blocks: a sharded model without a ModuleList (blocks= passed the first
        # time) was refused as "found no blocks ... pass blocks=", not as sharded
        raise _already_sharded(f"the model ({_class_name(model)})")
    config = config or ZeroPPConfig()
    if not dist.is_initialized():
        raise RuntimeError("shard() needs torch.distributed: call init_process_group() first")
    if topology.world_size != dist.get_world_size() or topology.rank != dist.get_rank():
        raise ValueError(
            f"topology {topology} does not describe this process (world "
            f"{dist.get_world_size()}, rank {dist.get_rank()}); build it with Topology.from_env()"
        )
    if mesh is not None and mesh.ndim == 2 and not config.hsdp:
        features = [f for f in ("qwz", "hpz", "qgz") if getattr(config, f)]
        if features:
            raise ValueError(
                f"a 2-D mesh asks shard() for HSDP, which excludes {', '.join(features)} (they "
                "change the world-wide gathers and reduce-scatter HSDP does not have); pass a "
                f"1-D mesh over all {topology.world_size} ranks (or none) for ZeRO++, or drop "
                f"{', '.join(f + '=True' for f in features)} for HSDP"
            )
        config = dataclasses.replace(config, hsdp=True)  # a 2-D mesh asks for HSDP
    if config.hsdp:
        return _shard_hsdp(model, topology, config, mp_policy, blocks, mesh)
    if mesh is None:
        mesh = init_device_mesh(_device_type(model), (topology.world_size,))
    elif mesh.ndim != 1 or mesh.size() != topology.world_size:
        raise ValueError(
            f"shard() needs a 1-D mesh over all {topology.world_size} ranks (ZeRO-3) or a 2-D "
            f"mesh with dims {HSDP_MESH_DIMS} (HSDP); got {mesh}"
        )
    elif config.hpz:
        _check_hpz_mesh(mesh, topology)
    # Collective, every rank at the same point: the groups of qgZ's hops and qwZ's, and on
    # gloo the twins of every installed comm's 2-rank exchanges ([Note: gloo exchanges are
    # half duplex] in qshard.comm.duplex).
    if topology.world_size > 1 and (config.qgz or (config.qwz and topology.num_nodes > 1)):
        topology.init_groups()
    elif topology.world_size > 1 and (config.record or config.wire_dtype is not None):
        topology.init_twins()
    reshard = _hpz_reshard(topology) if config.hpz else True
    fsdp_kwargs: dict = {"mesh": mesh, "reshard_after_forward": reshard}
    if mp_policy is not None:
        fsdp_kwargs["mp_policy"] = mp_policy

    block_list = find_blocks(model, blocks)
    with shared_post_forward_meshes():  # hpZ: one secondary mesh, see its Note
        _fully_shard_units(model, block_list, fsdp_kwargs, config)
    root = model  # now an FSDPModule

    def make_all_gather(module: FSDPModule):
        if config.qwz:
            return QuantizedAllGather(
                topology=topology,
                bits=config.weight_bits,
                block_size=config.weight_block_size,
                wire_dtype=config.wire_dtype,
                segment_sizes=_shard_sizes(module),
            )
        if config.record or config.wire_dtype is not None:
            return RecordingAllGather(wire_dtype=config.wire_dtype, topology=topology)
        return None

    # One qgZ comm per FSDP unit (deferral checks what FSDP2 does after the unit's call), one
    # progress queue for all of them (they share the process groups; see [Note: deferred qgZ]).
    queue = OverlapQueue()
    overlap = config.overlap_reduce_scatter
    if overlap is None:
        overlap = config.any_feature  # the ZeRO-3 baseline keeps FSDP2's synchronous call

    def make_reduce_scatter(module: FSDPModule):
        if config.qgz:
            return HierarchicalQuantizedReduceScatter(
                topology=topology,
                bits=config.grad_bits,
                block_size=config.grad_block_size,
                pipeline_stages=config.pipeline_stages,
                unit=module,
                overlap=overlap,
                queue=queue,
            )
        if config.record or config.wire_dtype is not None or overlap:
            return RecordingReduceScatter(
                wire_dtype=config.wire_dtype,
                unit=module,
                overlap=overlap,
                queue=queue,
                topology=topology,
            )
        return None

    fsdp_modules = [m for m in root.modules() if isinstance(m, FSDPModule)]
    for m in fsdp_modules:
        if (all_gather := make_all_gather(m)) is not None:
            m.set_custom_all_gather(all_gather)
        if (reduce_scatter := make_reduce_scatter(m)) is not None:
            m.set_custom_reduce_scatter(reduce_scatter)

    prefetch(root, block_list, config)
    return root  # type: ignore[return-value]


def _check_arguments(
    model: object, topology: object, config: object, mp_policy: object, mesh: object
) -> None:
    """Refuse arguments of the wrong type before anything is built: they failed with an
    ``AttributeError`` deep inside (a ``dict`` config or topology), or, for a ``dict``
    ``mp_policy``, only at the first forward inside FSDP2's lazy init."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard() takes an nn.Module; got {type(model).__name__}")
    if not isinstance(topology, Topology):
        raise TypeError(
            f"topology must be a qshard.comm.Topology; got {type(topology).__name__}: use "
            "Topology.from_env() (or Topology(world_size=..., ranks_per_node=...))"
        )
    for name, value, cls in (
        ("config", config, ZeroPPConfig),
        ("mp_policy", mp_policy, MixedPrecisionPolicy),
    ):
        if value is not None and not isinstance(value, cls):
            hint = f"; build it with {cls.__name__}(**{name})" if isinstance(value, dict) else ""
            raise TypeError(
                f"{name} must be a {cls.__name__} or None; got {type(value).__name__}{hint}"
            )
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a DeviceMesh or None; got {type(mesh).__name__}: build it with "
            "init_device_mesh() or qshard.zeropp.hsdp_mesh(topology), or leave it out"
        )


def _already_sharded(what: str) -> ValueError:
    return ValueError(
        f"{what} is already sharded (fully_shard or shard() was applied to it): "
        "shard() applies fully_shard to the blocks and the root itself; pass the model "
        "before any fully_shard (a model is sharded once: to change the ZeRO++ "
        "features, build it again and shard the new one)"
    )


def _check_units(model: nn.Module, block_list: list[nn.Module]) -> None:
    """[Note: refuse what FSDP2 would refuse later] Before any ``fully_shard``: a unit that is
    already sharded (``shard()`` called twice, or on a model or block the user wrapped with
    ``fully_shard``) would fail on FSDP2's "applied to a module once" assertion, possibly
    after the blocks before it were wrapped; a parameter tied across two units (a block's
    weight reused by the root or another block) is accepted by ``fully_shard`` and refused at
    the first forward, with advice (``fully_shard([a, b])``) that ``shard()`` has no way to
    follow. Both are refused here, naming what to change. A module the user wrapped *inside*
    a block is fine: FSDP2 nests it, and ``shard()`` installs its comms on it too."""
    units = [*block_list, model]
    names = {id(m): name for name, m in model.named_modules()}

    def label(i: int) -> str:
        if i == len(block_list):
            return f"the root ({type(model).__name__})"
        return f"blocks[{i}] ({names.get(id(units[i])) or type(units[i]).__name__})"

    for i, unit in enumerate(units):
        if isinstance(unit, FSDPModule):
            raise _already_sharded(label(i))
    # Which unit owns each parameter, as FSDP2 assigns them: units wrapped in order, each
    # taking the parameters of its modules not already inside a unit wrapped before it (or
    # inside a module the user wrapped).
    param_names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        param_names.setdefault(id(p), name)
    # FSDP2 shards along dim 0 and refuses a 0-dim parameter (CLIP's logit_scale) in the
    # fully_shard of the unit holding it: the root, after every block had been wrapped, so the
    # model was left half sharded and shard() again, after the fix FSDP2 names, was refused as
    # "already sharded"
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:
        name = scalars[0]
        raise ValueError(
            f"parameter {name!r} is a scalar (0-dim) and FSDP2 shards every parameter along "
            f"dim 0: make {'them' if len(scalars) > 1 else 'it'} 1-D with one element before "
            f"shard(), e.g. model.{name} = nn.Parameter(model.{name}.detach().reshape(1))"
            + (f" (also {', '.join(map(repr, scalars[1:]))})" if len(scalars) > 1 else "")
        )
    # A trainable parameter with no elements (nn.Linear(d, 0)) wraps and runs forward, then
    # fails FSDP2's reduce-scatter copy-in at the first backward ("_chunk_cat expects
    # non-empty tensor", torch 2.13, plain fully_shard alike); frozen, it trains
    empty = [name for name, p in model.named_parameters() if p.numel() == 0 and p.requires_grad]
    if empty:
        name = empty[0]
        raise ValueError(
            f"parameter {name!r} has no elements (shape "
            f"{tuple(model.get_parameter(name).shape)}) and FSDP2's gradient reduce-scatter "
            "fails on an empty gradient at the first backward: remove it from the model, or "
            f"freeze it before shard(): model.get_parameter({name!r}).requires_grad_(False)"
            + (f" (also {', '.join(map(repr, empty[1:]))})" if len(empty) > 1 else "")
        )
    renormed = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Embedding) and m.max_norm is not None
    ]
    if renormed:
        # F.embedding renormalises the looked-up rows of the weight it is given in place: under
        # FSDP2 that is the gathered copy, and the shards the optimizer steps never are (plain
        # fully_shard alike; a first-user probe: row norms 1.09 where max_norm=0.5 keeps 0.5)
        warnings.warn(
            f"{renormed[0]!r} is an embedding with max_norm: under FSDP2 its renormalisation "
            "changes the gathered copy in each forward, not the sharded weights the optimizer "
            "steps, so training differs from the unsharded model's. Renormalise the rows "
            "yourself after each optimizer step (under torch.no_grad(), on the local shard: "
            "weight.to_local().renorm_(2, 0, max_norm)), or train without max_norm",
            stacklevel=user_stacklevel(),
        )
    wrapped = {id(m) for m in model.modules() if isinstance(m, FSDPModule)}
    owner: dict[int, int] = {}
    for i, unit in enumerate(units):
        stack = [unit]
        dtypes: dict[torch.dtype, int] = {}  # a trainable parameter of each dtype in the unit
        while stack:
            mod = stack.pop()
            for p in mod.parameters(recurse=False):
                if p.requires_grad:
                    dtypes.setdefault(p.dtype, id(p))
                j = owner.setdefault(id(p), i)
                if j != i:
                    name = param_names.get(id(p), "?")
                    raise ValueError(
                        f"parameter {name!r} is shared by {label(j)} and {label(i)}: shard() "
                        "makes each block an FSDP unit of its own and FSDP2 keeps a tied "
                        "parameter in one unit; leave the blocks holding it out of blocks= "
                        "(their parameters then join the root unit), or tie it inside one block"
                    )
            stack.extend(c for c in mod.children() if id(c) not in wrapped)
        if len(dtypes) > 1:
            # FSDP2 accepts the unit and fails at the first forward with a bare "FSDP expects
            # uniform original parameter dtype but got {...}" naming no parameter
            (d1, p1), (d2, p2) = list(dtypes.items())[:2]
            n1, n2 = param_names.get(p1, "?"), param_names.get(p2, "?")
            raise ValueError(
                f"{label(i)} holds trainable parameters of several dtypes ({n1!r} is {d1}, "
                f"{n2!r} is {d2}) and FSDP2 keeps one dtype per unit: cast the model to one "
                "dtype before shard() (model.to(torch.bfloat16)), and use a MixedPrecisionPolicy "
                "(mp_policy=) for lower-precision compute"
            )
        wrapped.add(id(unit))


def _check_hpz_mesh(mesh: DeviceMesh, topology: Topology) -> None:
    """hpZ's secondary shard groups are FSDP2's rows of ``ranks_per_node`` consecutive mesh
    entries: with a mesh not in node order (``[0, 2, 4, 1, 3, 5]`` on 3 nodes of 2) they
    crossed nodes, and the backward gathers hpZ keeps inside a node went over the network
    without a word (more inter-node bytes than hpZ off, measured on 3 x 2)."""
    rows = mesh.mesh.reshape(-1, topology.ranks_per_node).tolist()
    crossing = next((row for row in rows if not topology.is_intra_node(row)), None)
    if crossing is not None:
        raise ValueError(
            f"hpZ's secondary shards are rows of {topology.ranks_per_node} consecutive ranks of "
            f"the mesh, and this mesh's row {crossing} crosses nodes ({topology}): its backward "
            "gathers would leave the node. Pass a mesh in node-major rank order "
            f"(init_device_mesh(device, ({topology.world_size},)), or none), or hpz=False"
        )


def _hpz_reshard(topology: Topology) -> bool | int:
    """FSDP2's ``reshard_after_forward`` for hpZ: the node's size, FSDP2's secondary shard.
    With one rank per node the secondary shard is the whole parameter, which FSDP2 spells
    ``False`` (it warns about ``1`` and keeps it unsharded all the same); a single node
    reshards to its whole world, which is ``True``."""
    if topology.ranks_per_node == 1:
        return False
    if topology.ranks_per_node == topology.world_size:
        return True
    return topology.ranks_per_node


def _fully_shard_units(
    model: nn.Module, block_list: list[nn.Module], fsdp_kwargs: dict, config: ZeroPPConfig
) -> None:
    """``fully_shard`` each block, then the root. The root never reshards after forward (what
    FSDP2 does for a root left at its default; an explicit ``reshard_after_forward`` would
    reshard it), nor do the last ``config.kept_blocks`` blocks: backward needs them first, so
    resharding them would only gather them again with little to overlap. Every unit that does
    not fully reshard after forward (the root, kept blocks, hpZ's node-sized secondary shards)
    is watched so that no copy outlives an optimizer step: [Note: no backward, no stale copy]."""
    _check_units(model, block_list)
    keep = {**fsdp_kwargs, "reshard_after_forward": False}
    first_kept = len(block_list) - config.kept_blocks
    guard = _StaleCopyGuard()
    for i, block in enumerate(block_list):
        kwargs = keep if i >= first_kept else fsdp_kwargs
        fully_shard(block, **kwargs)
        if kwargs["reshard_after_forward"] is not True:
            guard.watch(block, reshard_without_grad=True)
    fully_shard(model, **keep)
    guard.watch(model, reshard_without_grad=False)
    guard.track(m for m in model.modules() if isinstance(m, FSDPModule))
    if callable(getattr(type(model), "generate", None)):
        # [Note: generate() is a forward] A Hugging Face encoder-decoder's generate() calls
        # its encoder directly (model.get_encoder()(...)), not the root's forward, so the
        # root's parameters (the shared embedding) were still sharded: "aten.embedding got
        # mixed torch.Tensor and DTensor" (plain FSDP2 alike). FSDP2's way to declare another
        # entry point: its pre-forward gathers the root for the whole call.
        register_fsdp_forward_method(model, "generate")


class _StaleCopyGuard:
    """[Note: no backward, no stale copy] A unit that does not fully reshard after forward (the
    root, a kept block, an hpZ block with its node-sized secondary shard) keeps that copy for
    its backward. FSDP2 reuses a unit's unsharded or secondary copy at its next unshard, so a
    forward that no backward of this unit follows (evaluation under ``torch.no_grad()``, a
    metric computed with autograd on, a loss skipped for being NaN) would leave the copy in
    place across an optimizer step, and the next forward would compute with the old weights
    without a word (plain FSDP2 has this for its root: it keeps the root unsharded after every
    forward and asks users to call ``reshard()``). Here:

    - a watched block's forward under ``no_grad`` reshards it at once (no backward can come);
    - any other forward of a watched unit marks it pending until backward reaches its outputs
      (a multi-grad hook, as FSDP2's own pre-backward);
    - every optimizer step (``torch.optim``'s global step post-hook: every
      ``torch.optim.Optimizer``, qshard's included) reshards the pending units first, so the
      next forward gathers the new weights.

    A training step (forward, backward, step) leaves nothing pending, so it changes nothing
    there; an evaluation loop keeps the root unsharded between its batches as FSDP2 does. A
    weight changed in place outside an optimizer step (a checkpoint loaded into the sharded
    parameters after such a forward) still needs ``model.reshard()``.

    Two more copies are dropped by every optimizer step outside backward (found by probes;
    tests/zeropp/test_first_user.py):

    - ``set_reshard_after_backward(False)`` (FSDP2's knob for gradient accumulation) leaves
      every unit unsharded after its backward, and FSDP2's next forward computes with that
      copy: left on across an optimizer step, plain FSDP2 (and ``shard()`` before this) ran
      every later forward with the weights gathered before the first step. Such units are
      resharded; the micro-batches of an accumulation (no step in between) keep their copy,
      as FSDP2 intends. Resharding is local (no collective). The same holds for the copies
      ``set_keep_weights_after_backward`` keeps (whole, or hpZ's secondary shard: [Note:
      weights kept across micro-batches]).
    - A forward prefetch (``shard()``'s explicit ``set_modules_to_forward_prefetch``) issued in
      a forward that then skips the prefetched block (an evaluation path or early exit that
      leaves a block out) stays pending; FSDP2 drops such a gather only at the end of a
      backward, and the next forward used it as is: after an optimizer step in between, the
      block computed with its old weights (with every feature off, where plain FSDP2, which
      prefetches nothing in forward, gathers the new ones). It is waited for and dropped, as
      FSDP2's ``finalize_backward`` does, in the model's unit order on every rank (qwZ's
      second hop is a collective)."""

    def __init__(self) -> None:
        self._pending: dict[int, nn.Module] = {}
        self._units: list[weakref.ref[nn.Module]] = []
        self._deferred_task: int | None = None  # the backward whose end reshards
        _GUARDS.add(self)
        _install_step_hook()

    def track(self, units: Iterable[nn.Module]) -> None:
        """Every FSDP unit of the model, in module order, checked at each optimizer step for
        a copy kept by ``set_reshard_after_backward(False)`` or a prefetch nobody used."""
        self._units.extend(weakref.ref(u) for u in units)

    def watch(self, unit: nn.Module, *, reshard_without_grad: bool) -> None:
        # registered after FSDP2's own post-forward hook, so it runs after it
        def after_forward(module: nn.Module, args: object, output: object) -> None:
            if not torch.is_grad_enabled() and reshard_without_grad:
                module.reshard()  # type: ignore[operator]
                return
            key = id(module)
            self._pending[key] = module
            outputs = [
                t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if torch.is_grad_enabled() and outputs:
                register_multi_grad_hook(
                    outputs, lambda _grads: self._pending.pop(key, None), mode="any"
                )

        # [Note: hooks outside the compiled graph] A block compiled in place
        # (``block.compile()``, before or after shard(); or ``torch.compile(block)`` after it)
        # runs its hooks inside the compiled call, and dynamo traced this one:
        # register_multi_grad_hook is untraceable, so every watched unit's call had a graph
        # break, and ``fullgraph=True`` (torchtitan's setting) failed on the first forward
        # ("NestedUserFunctionVariable()"). FSDP2's own hooks are dynamo-disabled; so is this
        # one: it runs eagerly on the real outputs, and the block's graph is whole
        # (tests/zeropp/test_compile.py).
        unit.register_forward_hook(
            torch._dynamo.disable(after_forward, recursive=True, reason="qshard stale-copy hook")
        )

    def reshard_pending(self) -> None:
        """After an optimizer step. A step inside backward (per-parameter optimizers stepped
        from post-accumulate-grad hooks, torchtune's optimizer in backward) defers all of it to
        the end of that backward: the units still pending then are those whose backward has
        not run, and resharding them pulled a copy from under FSDP2 (hpZ's secondary shard
        with its backward gather in flight: "split_with_sizes expects split_sizes to sum
        exactly to 68"). Their backward uses the forward's weights anyway; what is pending when
        the backward ends had none, and a unit kept by ``set_reshard_after_backward(False)`` is
        stale after the steps: both are resharded then."""
        task = torch._C._current_graph_task_id()
        if task != -1:
            if self._deferred_task != task:
                self._deferred_task = task
                Variable._execution_engine.queue_callback(self._after_backward)
            return
        self._reshard_now()

    def _after_backward(self) -> None:
        self._deferred_task = None
        self._reshard_now()

    def _reshard_now(self) -> None:
        pending, self._pending = list(self._pending.values()), {}
        for module in pending:
            module.reshard()  # type: ignore[operator]
        left_on = False
        for ref in self._units:
            if (unit := ref()) is None:
                continue
            groups = fsdp_param_groups(unit) or ()
            for group in groups:
                _drop_unused_gather(group)
            if any(_kept_copy(g) for g in groups):
                left_on |= any(getattr(g, KEEP_ATTR, None) is not None for g in groups)
                unit.reshard()  # type: ignore[operator]
        if left_on:
            _warn_keep_left_on()

    def tracks(self, unit: nn.Module) -> bool:
        return any(ref() is unit for ref in self._units)


#: The attribute :func:`qshard.zeropp.set_keep_weights_after_backward` sets on a parameter
#: group it manages (None: never managed).
KEEP_ATTR = "_qshard_keep_weights"


def _kept_copy(group: object) -> bool:
    """Whether a parameter group holds, at an optimizer step, a copy of its weights kept after
    backward on purpose: by FSDP2's ``set_reshard_after_backward(False)``, or by
    ``set_keep_weights_after_backward`` (whole, or hpZ's secondary shard). A unit left unsharded
    by a failed step is FSDP2's to recover (``reset_iter_state()``), as with plain FSDP2."""
    unsharded = getattr(group, "is_unsharded", False)
    if getattr(group, "reshard_after_backward", True) is False and unsharded:
        return True
    managed = getattr(group, KEEP_ATTR, None) is not None
    return managed and (unsharded or getattr(group, "is_sharded_post_forward", False))


def _warn_keep_left_on() -> None:
    warnings.warn(
        "qshard.zeropp: an optimizer step found weights kept by set_keep_weights_after_backward "
        "(it was on for the step's last backward); they are dropped now, so the next forward "
        "gathers the new weights, but until then model.parameters() were those copies, "
        "without the gradients: a clip_grad_norm_ or a gradient read before this step saw "
        "none of theirs. Turn it off before the last micro-batch: "
        "set_keep_weights_after_backward(model, False)",
        stacklevel=user_stacklevel(),
    )


def guards_model(unit: nn.Module) -> bool:
    """Whether ``unit`` belongs to a model :func:`shard` built (its stale-copy guard tracks
    it)."""
    return any(guard.tracks(unit) for guard in list(_GUARDS))


def _drop_unused_gather(group: object) -> None:
    """Wait for and drop a parameter group's all-gather that no forward consumed, as FSDP2's
    ``finalize_backward`` does at the end of a backward (see :class:`_StaleCopyGuard`)."""
    result = getattr(group, "_all_gather_result", None)
    if result is None:
        return
    if (event := getattr(result, "all_gather_event", None)) is not None:
        torch.accelerator.current_stream().wait_event(event)
    work = getattr(result, "all_gather_work", None)
    if isinstance(work, dist.distributed_c10d.Work):
        work.wait()
    group._all_gather_result = None  # type: ignore[attr-defined]


_GUARDS: weakref.WeakSet[_StaleCopyGuard] = weakref.WeakSet()
_STEP_HOOK: list[object] = []  # the global step post-hook's handle, once installed


def _install_step_hook() -> None:
    if not _STEP_HOOK:

        def before_next_forward(optimizer: object, args: object, kwargs: object) -> None:
            for guard in list(_GUARDS):
                guard.reshard_pending()

        _STEP_HOOK.append(register_optimizer_step_post_hook(before_next_forward))


def _shard_hsdp(
    model: nn.Module,
    topology: Topology,
    config: ZeroPPConfig,
    mp_policy: MixedPrecisionPolicy | None,
    blocks: Sequence[nn.Module] | tuple[type, ...] | type | None,
    mesh: DeviceMesh | None,
) -> FSDPModule:
    """HSDP: see :func:`shard`. The 2-D mesh is checked (or built) here."""
    if mesh is None:  # built once per job, as hpZ's mesh ([Note: one secondary mesh per job])
        mesh = cached_hsdp_mesh(
            _device_type(model), topology.num_nodes, topology.ranks_per_node, HSDP_MESH_DIMS
        )
    _check_hsdp_mesh(mesh, topology)
    replicate_group = mesh.get_group("replicate")
    native = config.replicate_native
    fsdp_kwargs: dict = {"mesh": mesh if native else mesh["shard"], "reshard_after_forward": True}
    if mp_policy is not None:
        fsdp_kwargs["mp_policy"] = mp_policy
    block_list = find_blocks(model, blocks)
    _fully_shard_units(model, block_list, fsdp_kwargs, config)
    root = model
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    record = config.record or config.wire_dtype is not None
    hook = not native and config.replicate_reduce
    if topology.world_size > 1 and (record or hook):
        topology.init_twins()  # the twins of 2-rank exchanges (gloo), as in shard()
    twin = topology.twin_for(dist.get_process_group_ranks(replicate_group)) if hook else None
    # One progress queue for every unit's hook: they share the replicate group, whose
    # collectives every rank must issue in one order ([Note: deferred replicate all-reduce]).
    queue = OverlapQueue("replicate all-reduce")
    overlap = config.overlap_reduce_scatter is not False
    for m in units:
        if record:
            m.set_custom_all_gather(
                RecordingAllGather(wire_dtype=config.wire_dtype, topology=topology)
            )
            m.set_custom_reduce_scatter(
                RecordingReduceScatter(wire_dtype=config.wire_dtype, topology=topology)
            )
        if native:
            if config.record:
                m.set_all_reduce_hook(RecordingAllReduceHook(replicate_group))
        elif config.replicate_reduce:
            m.set_all_reduce_hook(
                ReplicateAllReduce(
                    group=replicate_group,
                    bits=config.replicate_bits,
                    block_size=config.replicate_block_size,
                    wire_dtype=config.wire_dtype,
                    error_feedback=config.replicate_error_feedback,
                    module=m,  # [Note: set_requires_all_reduce on the hook path]
                    twin=twin,
                    overlap=overlap,
                    queue=queue,
                )
            )
    # [Note: replica sync] in qshard._replicas: the 1-D DTensors of a compressed reduction and
    # of replicate_reduce=False look alike; the record tells them apart, and the latter's units
    # get a one-shot guard (their all-reduce hook) refusing a backward no 1-bit optimizer syncs.
    if not native:  # FSDP2's own HSDP needs no record: its DTensors are on the 2-D mesh
        kind = _replicas.REDUCED if config.replicate_reduce else _replicas.OPTIMIZER
        _replicas.record_units(units, kind)
    prefetch(root, block_list, config)
    return root  # type: ignore[return-value]
