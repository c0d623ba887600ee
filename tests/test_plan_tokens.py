"""One plan for every token count: calls that differ only in their token count (the logits'
leading dims, and with them the index's, the mask's, the labels' and a Head's hidden rows)
share one plan, at TP 1 and on gloo at TP 2 and 3 in every ``VTP_CHECK`` mode, with values
and gradients right against float64 for every count (a Head's chunk rows sized per call).
Where the metadata is gathered on every call, a rank whose token count differs from the
others' after planning still makes every rank raise; a call whose tensors do not share the
first input's token dims still raises; dispatch reads of the token count only whether there
is any (a call without tokens has a signature of its own). A sequence-parallel Head across
ranks keeps its token dims in its signature (its chunk layout comes from every rank's
token count)."""

import contextlib
import os
from typing import Any

import pytest
import torch

import vtp_runtime as vtp
from tests.helpers import FullInputs, PlanCounts, max_error, shard
from vtp_runtime import head_chunks, plans
from vtp_runtime.backend import Request
from vtp_runtime.invocation import Invocation
from vtp_runtime.ops import OPS
from vtp_runtime.registry import REGISTRY
from vtp_runtime.testing.distributed import environ, outcome
from vtp_runtime.testing.reference import values as reference

SIZES = {1: [13], 2: [5, 8], 3: [4, 0, 9]}  # uneven shards; an empty one at TP 3
COUNTS = (3, 1, 8, 5, 2, 11, 6)  # distinct token counts, in no order
KINDS = ("cross_entropy", "logprobs top-k", "entropy [1, N]", "kl labels", "Head per token", "Head mean")
CHUNK_ROWS = 4  # the rows a small CHUNK_BYTES gives: a Head's chunk count changes with N


@contextlib.contextmanager
def _check_mode(check: str | None):
    """``VTP_CHECK=check`` inside the block (None: unset, the transport decides)."""
    if check is None:
        assert "VTP_CHECK" not in os.environ
        yield
    else:
        with environ(VTP_CHECK=check):
            yield


@contextlib.contextmanager
def _small_chunks(v_local: int):
    """``CHUNK_BYTES`` holding ``CHUNK_ROWS`` float64 rows of the widest shard."""
    saved = head_chunks.CHUNK_BYTES
    head_chunks.CHUNK_BYTES = CHUNK_ROWS * v_local * 8
    try:
        yield
    finally:
        head_chunks.CHUNK_BYTES = saved


def _call(kind: str, n: int, seed: int, rank: int, world: int, group) -> float:
    """One call of ``kind`` on ``n`` tokens, forward and backward: its largest deviation from
    float64 (values and gradients)."""
    sizes = SIZES[world]
    d = FullInputs(n, seed, sum(sizes))
    common: dict[str, Any] = {"tp_group": group if world > 1 else None, "backend": "eager"}
    zl = shard(d.z, rank, sizes).requires_grad_()
    zr = d.z.clone().requires_grad_()
    if kind == "cross_entropy":
        got = vtp.cross_entropy(zl, d.y, label_smoothing=0.1, **common)
        want = reference("cross_entropy", (zr,), d.y, label_smoothing=0.1)
    elif kind == "logprobs top-k":
        lp, ent = vtp.logprobs(zl, d.idx, return_entropy=True, **common)
        got = torch.cat([lp, ent[:, None]], 1)
        want = torch.cat([reference("logprobs", (zr,), d.idx), reference("entropy", (zr,))[:, None]], 1)
    elif kind == "entropy [1, N]":
        got = vtp.entropy(zl.view(1, n, zl.shape[-1]), mask=d.m.view(1, n), **common).view(n)
        want = reference("entropy", (zr,), mask=d.m)
    elif kind == "kl labels":
        got = vtp.kl(zl, shard(d.t, rank, sizes), labels=d.y, **common)
        want = reference("kl", (zr, d.t), labels=d.y)
    else:  # a Head: its chunk rows come from N (CHUNK_BYTES holds CHUNK_ROWS rows)
        h, w = d.h.clone().requires_grad_(), shard(d.w, rank, sizes, dim=0).requires_grad_()
        hr, wr = d.h.clone().requires_grad_(), d.w.clone().requires_grad_()
        per_token = reference("cross_entropy", (hr @ wr.T,), d.y)
        with _small_chunks(max(sizes)):
            if kind == "Head per token":
                got = vtp.cross_entropy(vtp.Head(h, w), d.y, **common)
                want = per_token
            else:
                got = vtp.cross_entropy(vtp.Head(h, w), d.y, reduction="mean", **common)
                want = per_token.sum() / (d.y != -100).sum()
            got.sum().backward()
        want.sum().backward()
        assert wr.grad is not None and hr.grad is not None
        want_w = shard(wr.grad, rank, sizes, dim=0)
        return max(max_error(got, want), max_error(h.grad, hr.grad), max_error(w.grad, want_w))
    got.sum().backward()
    want.sum().backward()
    assert zr.grad is not None
    return max(max_error(got, want), max_error(zl.grad, shard(zr.grad, rank, sizes)))


def many_counts(rank, world, group, check):
    """Every kind of call at every count of COUNTS, under ``VTP_CHECK=check``: (full
    preparations, gathers) per call, the plans held after each round of counts, and the
    largest deviation from float64."""
    plans.clear()
    counts, held, worst = [], [], 0.0
    try:
        with _check_mode(check), PlanCounts() as c:
            for i, n in enumerate(COUNTS):
                for kind in KINDS:
                    worst = max(worst, _call(kind, n, i, rank, world, group))
                    counts.append(c.take())
                held.append(plans.size(group if world > 1 else None))
    finally:
        plans.clear()
    return counts, held, worst


def _first_calls(world: int, check: str | None) -> list[tuple[int, int]]:
    """(full preparations, gathers) per call of many_counts: each kind planned once."""
    gathers = 0 if world == 1 else 1
    first, later = (1, gathers), (0, gathers if check is None else 0)
    if check == "1":
        later = first
    return [first if i < len(KINDS) else later for i in range(len(COUNTS) * len(KINDS))]


def test_many_token_counts_one_plan_per_kind_at_tp1():
    counts, held, worst = many_counts(0, 1, None, None)
    assert worst < 1e-10
    assert held == [len(KINDS)] * len(COUNTS)
    assert counts == _first_calls(1, None)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("check", [None, "once", "1"])
def test_many_token_counts_one_plan_per_kind_on_every_rank(ranks, world, check):
    """gloo: a host gather per call by default, none with VTP_CHECK=once, the full path every
    call with VTP_CHECK=1; in every mode one plan per kind of call, whatever the count."""
    for counts, held, worst in ranks(world, many_counts, check, timeout=300):
        assert worst < 1e-10
        assert held == [len(KINDS)] * len(COUNTS)
        assert counts == _first_calls(world, check)


def test_a_planned_call_is_made_for_its_token_count():
    """The plan a call gets carries its own token count, leading shape, Request and chunk
    rows, whichever count the signature was planned with."""
    plans.clear()
    w = torch.randn(13, 4, dtype=torch.float64)
    rows = []
    with _small_chunks(13):
        for n in (9, 2, 30, 1, 9):
            h, y = torch.randn(n, 4, dtype=torch.float64), torch.randint(0, 13, (n,))
            plan = plans.plan_for(Invocation("cross_entropy", (vtp.Head(h, w), y), {"backend": "eager"}))
            assert (plan.num_tokens, plan.lead, plan.head_rows) == (n, (n,), head_chunks.chunk_rows(n, 13, 8))
            assert plan.call(None).request.num_tokens == n
            rows.append(plan.head_rows)
    assert rows == [CHUNK_ROWS, 2, CHUNK_ROWS, 1, CHUNK_ROWS]
    assert plans.size() == 1
    plans.clear()
    for n in (5, 0, 7, 0, 1):  # no token at all: a signature of its own, whatever the other dims
        z = torch.randn(n, 2, 13, requires_grad=True)
        out = vtp.cross_entropy(z, torch.zeros(n, 2, dtype=torch.int64), backend="eager")
        assert out.shape == (n, 2)
    assert plans.size() == 2
    plans.clear()


def test_tensors_not_led_by_the_token_dims_still_raise():
    """After a signature is planned, a call whose other tensors do not share the first
    input's token dims takes the full path, which says what is wrong."""
    plans.clear()
    z, y, m = torch.randn(5, 13), torch.randint(0, 13, (5,)), torch.ones(5, dtype=torch.bool)
    vtp.cross_entropy(z, y, backend="eager")
    vtp.logprobs(z, torch.randint(0, 13, (5, 2)), backend="eager")
    vtp.entropy(z, mask=m, backend="eager")
    vtp.cross_entropy(vtp.Head(torch.randn(5, 4), torch.randn(13, 4)), y, backend="eager")
    held = plans.size()
    with pytest.raises(ValueError, match="labels has shape"):
        vtp.cross_entropy(z, y[:4], backend="eager")
    with pytest.raises(ValueError, match="labels has shape"):
        vtp.cross_entropy(z[:4], y, backend="eager")
    with pytest.raises(ValueError, match="index has shape"):
        vtp.logprobs(z, torch.randint(0, 13, (4, 2)), backend="eager")
    with pytest.raises(ValueError, match="mask has shape"):
        vtp.entropy(z, mask=m[:3], backend="eager")
    with pytest.raises(ValueError, match="labels has shape"):
        vtp.cross_entropy(vtp.Head(torch.randn(6, 4), torch.randn(13, 4)), y, backend="eager")
    assert plans.size() == held
    plans.clear()


def one_rank_changes_its_count(rank, world, group, check, changed_rank):
    """A call planned on every rank, then the same call with another token count on
    ``changed_rank`` only, then a healthy call on a new count everywhere."""
    plans.clear()
    with _check_mode(check):
        healthy = [_call("cross_entropy", 5, 0, rank, world, group)]
        n = 6 if rank == changed_rank else 5
        raised = outcome(lambda: _call("cross_entropy", n, 1, rank, world, group))
        healthy.append(_call("cross_entropy", 7, 2, rank, world, group))
        held = plans.size(group)
    plans.clear()
    return raised, max(healthy), held


@pytest.mark.parametrize("changed_rank", [0, 1])
@pytest.mark.parametrize("check", [None, "1"])
def test_one_rank_changing_its_token_count_raises_on_every_rank(ranks, check, changed_rank):
    """With a gather per call (gloo's default, or VTP_CHECK=1) each rank sends its own token
    count: the table is not the planned one for any rank's count, so every rank raises."""
    for (kind, message), worst, held in ranks(2, one_rank_changes_its_count, check, changed_rank, timeout=120):
        assert kind == "ShardError" and "disagree on the number of tokens" in message, message
        assert worst < 1e-10
        assert held == 1


def test_dispatch_reads_no_token_count():
    """Every registered backend gives the same reasons for any count of tokens, so a plan's
    backend serves every count of its signature."""
    for name, backend in REGISTRY.backends().items():
        for op in OPS:
            for head in (False, True):
                base = Request(op, "cpu", torch.float32, 1, 13, 1, True, False, head_inputs=head)
                reasons = {tuple(backend.reasons(Request(**{**base.__dict__, "num_tokens": n}))) for n in (1, 7, 10**6)}
                assert len(reasons) == 1, (name, op, reasons)


def sequence_parallel_counts(rank, world, group):
    """A sequence-parallel Head whose token count and split change on every rank: values
    and gradients against float64, and one plan per split (its token dims stay in the
    signature)."""
    plans.clear()
    worst, splits = 0.0, ([2, 3], [4, 1], [2, 3], [5, 5])
    for i, rows in enumerate(splits):
        n = sum(rows)
        d = FullInputs(n, i, sum(SIZES[world]))
        first = sum(rows[:rank])
        h = d.h[first : first + rows[rank]].clone().requires_grad_()
        hr, wr = d.h.clone().requires_grad_(), d.w.clone().requires_grad_()
        w = shard(d.w, rank, SIZES[world], dim=0).requires_grad_()
        got = vtp.cross_entropy(vtp.Head(h, w, sequence_parallel=True, chunk_rows=2), d.y, tp_group=group)
        want = reference("cross_entropy", (hr @ wr.T,), d.y)
        got.sum().backward()
        want.sum().backward()
        assert wr.grad is not None and hr.grad is not None
        want_w = shard(wr.grad, rank, SIZES[world], dim=0)
        worst = max(worst, max_error(got, want), max_error(h.grad, hr.grad[first : first + rows[rank]]))
        worst = max(worst, max_error(w.grad, want_w))
    held = plans.size(group)
    plans.clear()
    return worst, held


def test_sequence_parallel_head_keeps_its_token_dims(ranks):
    for worst, held in ranks(2, sequence_parallel_counts, timeout=120):
        assert worst < 1e-10
        assert held == 3  # three splits of four calls
