"""vtp_runtime/testing/distributed.py: a pool whose collective broke (one rank raised before
it, the other timed out in it) is torn down, so that the next job runs on a new one instead
of failing against the broken group."""

import pytest
import torch
import torch.distributed as dist

from vtp_runtime.testing.distributed import RankFailure, RankPool


def _one_rank_raises_first(rank, world, group):
    if rank == 1:
        raise ValueError("rank 1 fails before the collective")
    dist.all_reduce(torch.ones(1), group=group)  # waits for rank 1, until gloo's timeout


def _sum_of_ranks(rank, world, group):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=group)
    return t.item()


def test_a_broken_collective_tears_the_pool_down():
    pool = RankPool(2, collective_timeout=2.0)
    try:
        with pytest.raises(RankFailure, match="rank 1 fails before the collective"):
            pool.run(_one_rank_raises_first, timeout=60)
        assert not pool.alive
    finally:
        pool.close(force=True)
    fresh = RankPool(2, collective_timeout=2.0)
    try:
        assert fresh.run(_sum_of_ranks, timeout=60) == [1.0, 1.0]
        with pytest.raises(RankFailure, match="ValueError"):  # a failure of every rank alike
            fresh.run(_raises_everywhere, timeout=60)
        assert fresh.alive and fresh.run(_sum_of_ranks, timeout=60) == [1.0, 1.0]
    finally:
        fresh.close()


def _raises_everywhere(rank, world, group):
    raise ValueError(f"rank {rank}")
