"""A failure on one rank raises on every rank and leaves none waiting, in the newer code
paths: the DTensor layout checks (a global vocabulary size, labels sharded over the batch, a
Head without its hidden gradient's reduction, vocabulary bounds given with DTensor logits, a
misplaced top-k index) and a bad TopK teacher (a repeated id, log-probs that are not), on one
rank only. The job of each test keeps its rank processes alive and then makes a normal call
on every rank, checked against float64. The jobs run in this file's own pools of gloo ranks
with a short collective timeout, so that a hang fails its test in seconds."""

import pytest
import torch

import vtp_runtime as vtp
from tests.helpers import SHARD_SIZES, FullInputs, QuickPools, as_dtensor, healthy_calls, max_error, shard
from vtp_runtime.testing.distributed import outcome
from vtp_runtime.testing.reference import topk_kl
from vtp_runtime.testing.reference import values as reference

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN/inf edges

COLLECTIVE_TIMEOUT = 15.0
_POOLS = QuickPools(COLLECTIVE_TIMEOUT, job_timeout=30.0)
_own = _POOLS.run  # this file's rank pools: a short collective timeout, so that a hang fails fast


@pytest.fixture(scope="module", autouse=True)
def _close_own_pools():
    yield
    _POOLS.close()


# == 4. a one-rank failure in the DTensor layout checks ======================================

# case -> a piece of the message of the ValueError the failing rank raises
DTENSOR_FAILURES = {
    "global_vocab_size": "global_vocab_size",
    "labels_sharded_over_the_batch": "labels",
    "head_without_hidden_grad_reduction": "reduce_hidden_grad",
    "vocab_bounds_with_dtensor_logits": "vocab_start",
    "topk_index_misplaced": "index",
}


def dtensor_failure_on_one_rank(rank, world, group, case, bad_rank):
    """The call of ``case`` on DTensors of a 1-D mesh, faulty on ``bad_rank`` only (every
    rank builds the same DTensors, without communication), then normal calls."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", list(range(world)))
    d = FullInputs(4, seed=5, vocab=9)
    bad = rank == bad_rank

    def dt(x, placement):
        return distribute_tensor(x, mesh, [placement], src_data_rank=None)

    z = dt(d.z, Shard(1))
    if case == "global_vocab_size":
        call = lambda: vtp.cross_entropy(z, d.y, global_vocab_size=10 if bad else 9)  # noqa: E731
    elif case == "labels_sharded_over_the_batch":
        labels = dt(d.y, Shard(0) if bad else Replicate())
        call = lambda: vtp.cross_entropy(z, labels)  # noqa: E731
    elif case == "head_without_hidden_grad_reduction":
        head = vtp.Head(dt(d.h, Replicate()), dt(d.w, Shard(0)), reduce_hidden_grad=not bad)
        call = lambda: vtp.entropy(head)  # noqa: E731
    elif case == "vocab_bounds_with_dtensor_logits":
        bounds = {"vocab_start": 0, "vocab_end": 5} if bad else {}
        call = lambda: vtp.cross_entropy(z, d.y, **bounds)  # noqa: E731
    else:
        placement = Shard(0) if bad else Replicate()
        teacher = vtp.TopK(dt(d.lp, placement), dt(d.ids, placement))
        call = lambda: vtp.kl(z, teacher)  # noqa: E731
    got = outcome(call)
    after = max_error(as_dtensor(vtp.cross_entropy(z, d.y)).to_local(), reference("cross_entropy", (d.z,), d.y))
    return got, max(after, healthy_calls(rank, world, group))


@pytest.mark.parametrize("case", list(DTENSOR_FAILURES))
def test_a_dtensor_failure_on_one_rank_raises_on_every_rank(case):
    """Item 4: a DTensor layout error on one rank (raised while normalizing the input forms)
    travels through the failure-tolerant metadata gather like any local error: that rank
    raises its ValueError, every other rank a ShardError naming it, none waits; then a
    DTensor call and a plain call on every rank match float64."""
    bad_rank = 1
    results = _own(2, dtensor_failure_on_one_rank, case, bad_rank)
    (bad_type, bad_msg), _ = results[bad_rank]
    assert bad_type == "ValueError" and DTENSOR_FAILURES[case] in bad_msg, results[bad_rank]
    for rank, ((kind, msg), _) in enumerate(results):
        if rank != bad_rank:
            assert kind == "ShardError" and f"rank {bad_rank}" in msg and bad_msg in msg, (kind, msg)
    assert max(err for _, err in results) < 1e-10


# == 6, 8. a bad TopK teacher on one rank ===================================================

# case -> (student given as a Head, tail)
TOPK_FAILURES = {
    "repeated_id_head_student": (True, False),
    "repeated_id_logits_student": (False, False),
    "not_logprobs_head_student": (True, False),
    "not_logprobs_tail": (False, True),
}


def topk_failure_on_one_rank(rank, world, group, case, bad_rank):
    """``kl(student, TopK)`` forward and backward, the TopK faulty on ``bad_rank`` only (a
    repeated id, or raw logits given as log-probs), then the same call healthy."""
    sizes = SHARD_SIZES[world]
    d = FullInputs(4, seed=6, vocab=sum(sizes))
    head, tail = TOPK_FAILURES[case]
    lp, ids = d.lp.clone(), d.ids.clone()
    if rank == bad_rank:
        if case.startswith("repeated_id"):
            ids[2, 1] = ids[2, 0]
        else:
            lp[1] = torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64)  # raw logits: probabilities sum to 12.7

    def student():
        if head:
            return vtp.Head(d.h.clone().requires_grad_(), shard(d.w, rank, sizes, 0).requires_grad_())
        return shard(d.h @ d.w.T, rank, sizes).requires_grad_()

    def call(lp, ids):
        out = vtp.kl(student(), vtp.TopK(lp, ids), tail=tail, tp_group=group)
        out.sum().backward()
        return out

    got = outcome(lambda: call(lp, ids))
    err = max_error(call(d.lp, d.ids), topk_kl(d.h @ d.w.T, d.lp, d.ids, tail=tail))
    return got, max(err, healthy_calls(rank, world, group))


@pytest.mark.parametrize("case", list(TOPK_FAILURES))
def test_a_bad_topk_teacher_on_one_rank_raises_on_every_rank(case):
    """Items 6 and 8 at TP 2: a TopK teacher with a repeated id, or log-probs that are not
    log-probabilities (raw logits: the k probabilities sum above 1), on one rank only. That
    rank raises a ValueError naming TopK, every other rank a ShardError naming it, before
    any rank enters a collective the raising rank skips (with a Head student, the hidden
    gradient's all-reduce in backward); then the healthy call matches float64."""
    bad_rank = 1
    results = _own(2, topk_failure_on_one_rank, case, bad_rank)
    (bad_type, bad_msg), _ = results[bad_rank]
    assert bad_type == "ValueError" and "TopK" in bad_msg, results[bad_rank]
    for rank, ((kind, msg), _) in enumerate(results):
        if rank != bad_rank:
            assert kind == "ShardError" and f"rank {bad_rank}" in msg and bad_msg in msg, (kind, msg)
    assert max(err for _, err in results) < 1e-10
