"""This rank's place in the job: process group, device, compute dtype, and the two cross-rank
reductions the loop's metrics need (mean and max of one number)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from qshard.train.config import TrainConfig

__all__ = [
    "comm_device",
    "compute_dtype",
    "device",
    "init_distributed",
    "is_local_leader",
    "max_over_ranks",
    "mean_over_ranks",
    "restart_count",
    "set_collective_timeout",
]


def init_distributed(*, timeout_s: float = 600.0) -> bool:
    """Join the job's process group (torchrun / elastic launch env) with collectives that
    fail after ``timeout_s`` seconds (``--collective-timeout``); True if we created it."""
    if dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=timeout_s)
    restart = restart_count()
    if restart > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # A restarted group (--max-restarts): torch elastic hands every attempt the same shared
        # store, where the failed attempt's keys (gloo's peer addresses) are still set, so a
        # new rank could dial a dead peer's port. Each attempt gets its own key space.
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout
        )
        store = dist.PrefixStore(f"qshard/attempt_{restart}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        return True
    dist.init_process_group(backend, timeout=timeout)
    return True


def restart_count() -> int:
    """Which attempt of the job this is: torch elastic's ``TORCHELASTIC_RESTART_COUNT`` (0
    for the first, and outside torch elastic)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def set_collective_timeout(timeout_s: float) -> None:
    """Give every process group of this process the collective timeout ``timeout_s``.

    ``torch.distributed.new_group`` does not inherit the world's timeout (it takes the
    backend's default, 30 minutes for gloo), so the node groups of hpZ/qgZ would otherwise
    wait that long for a hung peer; call this after the groups exist."""
    td = timedelta(seconds=timeout_s)
    for group in list(dist.distributed_c10d._world.pg_map):
        group.set_timeout(td)


def device() -> torch.device:
    """This rank's device: its ``LOCAL_RANK``'s GPU when there is CUDA, else the CPU."""
    if torch.cuda.is_available():
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def is_local_leader() -> bool:
    """True on the first rank of this node (the one that builds node-local caches)."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def compute_dtype(config: TrainConfig, dev: torch.device) -> torch.dtype:
    """The dtype forward and backward run in (``--dtype``; ``auto`` is bf16 on CUDA only)."""
    if config.dtype == "fp32":
        return torch.float32
    if config.dtype == "bf16":
        return torch.bfloat16
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


def comm_device() -> torch.device:
    """Where a tensor must live to be reduced: NCCL takes only CUDA tensors, gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of a one-element tensor over all ranks (a collective)."""
    value = value.detach().float().reshape(1).to(comm_device(), copy=True)
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def max_over_ranks(value: int) -> int:
    """The maximum of an integer over all ranks (a collective)."""
    t = torch.tensor([value], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
