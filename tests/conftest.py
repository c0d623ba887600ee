import os

# The Triton backends run their kernels on CPU tensors through Triton's interpreter in CI.
# It must be set before triton is imported anywhere; spawned rank processes inherit it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from vtp_runtime.testing.distributed import RankPool  # noqa: E402

_POOLS: dict[int, RankPool] = {}


def run_ranks(world: int, fn, *args, timeout: float = 120.0, **kwargs):
    """Run ``fn(rank, world, group, *args)`` on ``world`` gloo ranks (pools are reused)."""
    pool = _POOLS.get(world)
    if pool is None or not pool.alive:
        pool = _POOLS[world] = RankPool(world)
    return pool.run(fn, *args, timeout=timeout, **kwargs)


@pytest.fixture(scope="session")
def ranks():
    yield run_ranks
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
