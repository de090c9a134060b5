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
]


def init_distributed() -> bool:
    """Join the job's process group (torchrun / elastic launch env); True if we created it."""
    if dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=10))
    return True


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
