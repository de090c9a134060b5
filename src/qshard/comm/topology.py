"""Topology: which ranks share a node, and the process groups ZeRO++ needs.

A *node* is a set of ``ranks_per_node`` consecutive ranks with fast links between them.
Ranks are numbered node-major, as torchrun numbers them: ``rank = node * ranks_per_node +
local_rank``. On one machine, nodes are emulated simply by choosing ``ranks_per_node``
smaller than the world.

The topology is derived from the launch environment (``LOCAL_WORLD_SIZE`` under torchrun) or
given explicitly, never from the number of visible devices: a node with 8 GPUs may run 8 ranks
or 1, and only the launcher knows.

Process groups (``intra_node_group``, ``inter_node_group``) are created lazily on first
access. [Note: collective group creation] ``torch.distributed.new_group`` is collective over
the whole world: the first access to each of these properties must happen on every rank, in
the same order (or call :meth:`Topology.init_groups` once on every rank right after
``init_process_group``).

[Note: one set of groups per job] The groups are kept per job, not per ``Topology``: every
topology of the same world and node size (a new ``Topology.from_env()`` per ``shard()``, a
sweep re-sharding model after model) gets the groups the first one created. Kept per object,
each new topology made 4 more groups and 12 gloo threads per rank at every ``shard()`` with
qwZ/qgZ, never freed (43 groups and 132 threads after 10 calls, measured on 2 x 2); with NCCL
each would be a communicator. The cache belongs to one default process group: after
``destroy_process_group`` and a new ``init_process_group`` its entries are dropped, not reused.
Every rank creates and finds the same entries at the same calls, so the collective creation
stays in step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from qshard._env import env_int
from qshard.comm._job import per_job

# The launch variables' errors end with this.
_UNSET = " (as the launcher sets it), or unset it"

__all__ = ["Topology"]


class Topology:
    """World size, ranks per node, and this rank's place in them.

    Args:
        world_size: number of ranks in the job (>= 1).
        ranks_per_node: ranks per node; must divide ``world_size``.
        rank: this process's global rank; defaults to ``torch.distributed.get_rank()`` when a
            default process group exists, else 0. Pass it to describe another rank's view.
    """

    __slots__ = ("_groups", "_rank", "_ranks_per_node", "_world_size")

    def __init__(self, *, world_size: int, ranks_per_node: int, rank: int | None = None) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1; got {world_size!r}")
        if (
            isinstance(ranks_per_node, bool)
            or not isinstance(ranks_per_node, int)
            or ranks_per_node < 1
        ):
            raise ValueError(
                f"ranks_per_node must be an int >= 1; got {ranks_per_node!r} "
                "(set LOCAL_WORLD_SIZE or pass ranks_per_node explicitly)"
            )
        if world_size % ranks_per_node != 0:
            raise ValueError(
                f"world_size must be a multiple of ranks_per_node (nodes hold equal numbers of "
                f"ranks); got world {world_size}, ranks_per_node {ranks_per_node}: use a "
                f"ranks_per_node that divides {world_size}"
            )
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        # the world size first: a world_size=2 topology in a world of 4 blamed the rank on
        # ranks 2 and 3 and the world size on ranks 0 and 1
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() != world_size:
            raise ValueError(
                f"world_size {world_size} differs from the initialized process group's "
                f"{dist.get_world_size()}; use Topology.from_env() or pass the real world size"
            )
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            # a float rank gave float nodes (1.5 // 2 == 0.0); a str failed on '<='
            raise ValueError(f"rank must be an int in [0, {world_size}); got {rank!r}")
        self._world_size = world_size
        self._ranks_per_node = ranks_per_node
        self._rank = rank
        # kind -> (the default group it was made under, the group): a topology kept across
        # destroy_process_group / init_process_group (a notebook, a module-scoped fixture)
        # handed out the old job's groups ("not initialized in the world group map")
        self._groups: dict[str, tuple[Any, dist.ProcessGroup]] = {}

    @classmethod
    def from_env(cls, ranks_per_node: int | None = None) -> Topology:
        """The topology of the running job.

        World size and rank come from the default process group if one is initialized, else
        from ``WORLD_SIZE``/``RANK`` (default 1/0). ``ranks_per_node`` is the argument if
        given (to emulate nodes), else ``LOCAL_WORLD_SIZE`` (set by torchrun), else an error:
        it is never guessed from device counts. With ``LOCAL_WORLD_SIZE``, torchrun's
        ``LOCAL_RANK``, ``GROUP_RANK`` and ``GROUP_WORLD_SIZE`` (when set) must agree with it:
        nodes of different sizes are refused (see [Note: uneven nodes]).
        """
        initialized = dist.is_available() and dist.is_initialized()
        if initialized:
            world_size, rank = dist.get_world_size(), dist.get_rank()
        else:
            world_size = env_int("WORLD_SIZE", 1, minimum=1, hint=_UNSET)
            rank = env_int("RANK", 0, minimum=0, hint=_UNSET)
            if rank >= world_size:
                raise ValueError(
                    f"RANK={rank} is not below WORLD_SIZE={world_size}; the launcher's "
                    "environment is inconsistent (RANK must be in [0, WORLD_SIZE))"
                )
        if ranks_per_node is None:
            if os.environ.get("LOCAL_WORLD_SIZE") is None:
                if world_size == 1:
                    ranks_per_node = 1
                else:
                    raise ValueError(
                        "cannot tell how many ranks share a node: LOCAL_WORLD_SIZE is not set "
                        "(launch with torchrun) and ranks_per_node was not given; pass "
                        "Topology.from_env(ranks_per_node=...)"
                    )
            else:
                ranks_per_node = env_int("LOCAL_WORLD_SIZE", 1, minimum=1, hint=_UNSET)
                world = (
                    f"the process group's world size {world_size}"
                    if initialized
                    else f"WORLD_SIZE={world_size}"
                )
                if world_size % ranks_per_node:
                    raise ValueError(
                        f"LOCAL_WORLD_SIZE={ranks_per_node} does not divide {world} (nodes "
                        "hold equal numbers of ranks); fix the launch environment or pass "
                        "Topology.from_env(ranks_per_node=...)"
                    )
                _check_nodes(world_size, rank, ranks_per_node)
                local = os.environ.get("LOCAL_RANK")
                if local is not None:
                    local_rank = env_int("LOCAL_RANK", 0, minimum=0, hint=_UNSET)
                    if local_rank != rank % ranks_per_node:
                        raise ValueError(
                            f"LOCAL_RANK={local_rank} does not match rank {rank} under "
                            f"LOCAL_WORLD_SIZE={ranks_per_node}: qshard numbers ranks node-major "
                            f"(local rank = rank % ranks_per_node = {rank % ranks_per_node}, as "
                            "torchrun does); launch with node-major ranks or pass "
                            "Topology.from_env(ranks_per_node=...)"
                        )
        return cls(world_size=world_size, ranks_per_node=ranks_per_node, rank=rank)

    # ----------------------------------------------------------------- numbering
    @property
    def world_size(self) -> int:
        """Number of ranks in the job."""
        return self._world_size

    @property
    def ranks_per_node(self) -> int:
        """Ranks on each node (every node holds the same number)."""
        return self._ranks_per_node

    @property
    def num_nodes(self) -> int:
        """Number of nodes: ``world_size // ranks_per_node``."""
        return self._world_size // self._ranks_per_node

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self._rank

    @property
    def node(self) -> int:
        """This rank's node."""
        return self.node_of(self._rank)

    @property
    def local_rank(self) -> int:
        """This rank's index inside its node."""
        return self.local_rank_of(self._rank)

    def _check(self, rank: int) -> int:
        if not 0 <= rank < self._world_size:
            raise ValueError(f"rank must be in [0, {self._world_size}); got {rank}")
        return rank

    def node_of(self, rank: int) -> int:
        """The node holding global ``rank``."""
        return self._check(rank) // self._ranks_per_node

    def local_rank_of(self, rank: int) -> int:
        """The index of global ``rank`` inside its node."""
        return self._check(rank) % self._ranks_per_node

    def global_rank(self, node: int, local_rank: int) -> int:
        """The global rank of ``local_rank`` on ``node`` (node-major numbering)."""
        if not 0 <= node < self.num_nodes or not 0 <= local_rank < self._ranks_per_node:
            raise ValueError(
                f"(node, local_rank) must be in [0, {self.num_nodes}) x "
                f"[0, {self._ranks_per_node}); got ({node}, {local_rank})"
            )
        return node * self._ranks_per_node + local_rank

    def node_ranks(self, node: int) -> list[int]:
        """Global ranks of ``node``, in local-rank order (the intra-node group of that node)."""
        return [self.global_rank(node, lr) for lr in range(self._ranks_per_node)]

    def peer_ranks(self, local_rank: int) -> list[int]:
        """Global ranks with ``local_rank`` on every node, in node order (an inter-node group)."""
        return [self.global_rank(n, local_rank) for n in range(self.num_nodes)]

    def nodes_of(self, ranks: Sequence[int]) -> set[int]:
        """The set of nodes spanned by ``ranks``."""
        return {self.node_of(r) for r in ranks}

    def is_intra_node(self, ranks: Sequence[int]) -> bool:
        """Whether all ``ranks`` lie inside one node (so a collective over them never leaves it)."""
        return len(self.nodes_of(ranks)) <= 1

    # ----------------------------------------------------------------- groups
    def _make_groups(self, kind: str) -> dist.ProcessGroup:
        # See [Note: collective group creation]: every rank creates every group of this kind,
        # in the same order, and keeps the one it belongs to.
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "process groups need torch.distributed: call init_process_group() first"
            )
        if (self._world_size, self._rank) != (dist.get_world_size(), dist.get_rank()):
            # A topology built before init_process_group has rank 0 on every process (and an
            # unchecked world size): every rank took node 0's group, a group it is not in.
            raise RuntimeError(
                f"this Topology describes rank {self._rank} of a world of {self._world_size}, "
                f"but this process is rank {dist.get_rank()} of {dist.get_world_size()}: only "
                "a topology of this process can create its process groups. Build it after "
                "init_process_group (Topology.from_env(), or Topology(world_size=..., "
                "ranks_per_node=...) without rank=)"
            )
        if kind.startswith("intra"):
            all_ranks = [self.node_ranks(n) for n in range(self.num_nodes)]
            mine = self.node
        else:
            all_ranks = [self.peer_ranks(lr) for lr in range(self._ranks_per_node)]
            mine = self.local_rank
        return per_job(  # [Note: one set of groups per job]
            ("topology", self._world_size, self._ranks_per_node, kind),
            lambda: [dist.new_group(ranks) for ranks in all_ranks][mine],
        )

    @property
    def intra_node_group(self) -> dist.ProcessGroup:
        """This rank's node: ``ranks_per_node`` ranks. Created on first access (collective)."""
        return self._group("intra")

    @property
    def inter_node_group(self) -> dist.ProcessGroup:
        """The ranks with this rank's local rank on every node: ``num_nodes`` ranks, one per
        node. Created on first access (collective)."""
        return self._group("inter")

    def twin_group(self, kind: str) -> dist.ProcessGroup:
        """A second group of the same ranks as ``intra_node_group`` (``kind="intra"``) or
        ``inter_node_group`` (``"inter"``), so that a gloo exchange can send each direction of a
        pair on a connection of its own ([Note: gloo exchanges are half duplex] in
        :mod:`qshard.comm.duplex`). Created on first access (collective, like the groups)."""
        if kind not in ("intra", "inter"):
            raise ValueError(f"kind must be 'intra' or 'inter'; got {kind!r}")
        return self._group(f"{kind}_twin")

    def _group(self, kind: str) -> dist.ProcessGroup:
        """This rank's group of ``kind``, made once per job (:meth:`_make_groups`)."""
        world = dist.group.WORLD
        hit = self._groups.get(kind)
        if hit is None or hit[0] is not world:
            hit = self._groups[kind] = (world, self._make_groups(kind))
        return hit[1]

    def twin_for(self, ranks: Sequence[int]) -> dist.ProcessGroup | None:
        """The twin (:meth:`twin_group`) of a 2-rank group with the members of this rank's
        inter-node or intra-node group, whoever created it (an FSDP2 mesh's group, HSDP's
        replicate group): a twin serves every group of its ranks, as all ranks issue on it in
        one order. ``None`` for any other group (larger groups need none), and when the job's
        backend is not gloo (NCCL is full duplex: no twin communicator is made)."""
        ranks = list(ranks)
        if len(ranks) != 2 or not _gloo_job():
            return None
        if ranks == self.peer_ranks(self.local_rank):
            return self.twin_group("inter")
        if ranks == self.node_ranks(self.node):
            return self.twin_group("intra")
        return None

    def init_twins(self) -> None:
        """Create the two twins now on a gloo job; nothing on any other backend (collective;
        call on every rank)."""
        if _gloo_job():
            _ = self.twin_group("intra")
            _ = self.twin_group("inter")

    def init_groups(self) -> None:
        """Create the groups now, and on a gloo job their twins (collective; call on every
        rank)."""
        _ = self.intra_node_group
        _ = self.inter_node_group
        self.init_twins()

    def __reduce__(self) -> tuple:
        # Pickled or deep-copied, a Topology is its three numbers: its process groups cannot be
        # pickled ("cannot pickle ProcessGroup" once they existed; a deepcopy failed alike) and
        # belong to this process. A copy in this job finds the same groups ([Note: one set of
        # groups per job]); one in another process makes its own when asked.
        return (
            _unpickle,
            (self._world_size, self._ranks_per_node, self._rank),
        )

    def __repr__(self) -> str:
        return (
            f"Topology(world_size={self._world_size}, ranks_per_node={self._ranks_per_node}, "
            f"rank={self._rank}; {self.num_nodes} nodes)"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return (self._world_size, self._ranks_per_node, self._rank) == (
            other._world_size,
            other._ranks_per_node,
            other._rank,
        )

    def __hash__(self) -> int:
        return hash((self._world_size, self._ranks_per_node, self._rank))


def _gloo_job() -> bool:
    """Whether the default process group is gloo alone (where 2-rank exchanges need twins)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"


def _check_nodes(world_size: int, rank: int, ranks_per_node: int) -> None:
    """Check torchrun's node variables against ``LOCAL_WORLD_SIZE`` (when they are set).

    [Note: uneven nodes] torchrun lets nodes run different numbers of ranks (``--nproc-per-node``
    per node) and then numbers the ranks by cumulative sum, so ``LOCAL_WORLD_SIZE`` differs
    between nodes. Each rank alone may see a ``LOCAL_WORLD_SIZE`` that divides the world (nodes
    of 2, 1 and 1 ranks: 2 and 1 both divide 4), and the ranks would build different topologies,
    then mismatched process groups (a hang, or wrong sums). ``GROUP_WORLD_SIZE`` (the number of
    nodes) tells it apart with no communication: ``nodes * LOCAL_WORLD_SIZE == WORLD_SIZE``
    holds on every rank only if every node has the average size, so in an uneven layout some
    rank fails and torchrun stops the job. ``GROUP_RANK`` (this node's index) must then be
    ``rank // LOCAL_WORLD_SIZE``, as torchrun numbers ranks node-major.
    """
    hint = _UNSET
    if os.environ.get("GROUP_WORLD_SIZE") is not None:
        nodes = env_int("GROUP_WORLD_SIZE", 1, minimum=1, hint=hint)
        if nodes * ranks_per_node != world_size:
            raise ValueError(
                f"GROUP_WORLD_SIZE={nodes} nodes of LOCAL_WORLD_SIZE={ranks_per_node} ranks are "
                f"{nodes * ranks_per_node} ranks, not the world's {world_size}: qshard needs "
                "every node to run the same number of ranks (launch with the same "
                "--nproc-per-node on every node)"
            )
    if os.environ.get("GROUP_RANK") is not None:
        node = env_int("GROUP_RANK", 0, minimum=0, hint=hint)
        if node != rank // ranks_per_node:
            raise ValueError(
                f"GROUP_RANK={node} does not match rank {rank} under LOCAL_WORLD_SIZE="
                f"{ranks_per_node}: qshard numbers ranks node-major (node = rank // "
                f"ranks_per_node = {rank // ranks_per_node}, as torchrun does when every node "
                "runs the same number of ranks); launch with the same --nproc-per-node on "
                "every node or pass Topology.from_env(ranks_per_node=...)"
            )


def _unpickle(world_size: int, ranks_per_node: int, rank: int) -> Topology:
    return Topology(world_size=world_size, ranks_per_node=ranks_per_node, rank=rank)
