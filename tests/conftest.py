import os

# The Triton backends run their kernels on CPU tensors through Triton's interpreter in CI.
# It must be set before triton is imported anywhere; spawned rank processes inherit it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from vtp_runtime.testing import conformance  # noqa: E402


@pytest.fixture(scope="session")
def ranks():
    """``ranks(world, fn, *args, timeout=..., **kwargs)`` runs ``fn(rank, world, group, *args,
    **kwargs)`` on ``world`` gloo ranks. The pools are the conformance kit's, so that the
    kit's own runs (``conformance.check`` without a runner) start no second pool of a size."""
    yield conformance.default_runner
    conformance.close_pools()


@pytest.fixture(scope="session")
def trl_models(tmp_path_factory):
    """The folder of the tiny Llamas TRL's trainers run on (tests/trl_job.py): the policy, and
    GKD's teacher."""
    from tests.trl_job import save_models

    path = str(tmp_path_factory.mktemp("tiny"))
    save_models(path)
    return path
