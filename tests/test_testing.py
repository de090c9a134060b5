"""The multi-process harness itself: results come back by rank, failures and hangs are reported
and every process is stopped."""

import pytest
import torch
import torch.distributed as dist

from qshard.testing import WorldError, run_world


def _all_reduce_rank(rank: int, world_size: int) -> tuple[float, torch.Tensor]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    # a tensor too: put on torch's queue as is, it travelled as shared memory that died with
    # the rank before the parent read it
    return t.item(), torch.arange(3) + rank


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")


def _hang(rank: int, world_size: int) -> None:
    if rank == 0:
        import time

        time.sleep(60)


def test_run_world_results_failures_and_timeout():
    out = run_world(_all_reduce_rank, 3, timeout_s=120)
    assert [total for total, _ in out] == [3.0, 3.0, 3.0]
    assert all(torch.equal(t, torch.arange(3) + r) for r, (_, t) in enumerate(out))
    with pytest.raises(WorldError, match="boom on rank one"):
        run_world(_fail_on_rank_one, 2, timeout_s=120)
    with pytest.raises(WorldError, match="timeout"):
        run_world(_hang, 2, timeout_s=15)
