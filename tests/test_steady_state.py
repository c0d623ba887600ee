"""Plans: after the first call of a signature, later calls skip the checks, the dispatch and
(on a device-only group, or with VTP_CHECK=once) the metadata gather; every rank of a group
plans and reuses together, through sequences of calls that repeat, change token counts on
every rank (one plan for every token count), alternate ops, and overflow the plan cache.
Values are checked against float64. Many token counts, one plan: test_plan_tokens.py.
The device side (no device-to-host copy, CUDA graph capture) is in test_native_gpu.py."""

import os
from typing import Any

import pytest
import torch

import vtp_runtime as vtp
from tests.helpers import PlanCounts
from vtp_runtime import plans as plan
from vtp_runtime.errors import ShardError
from vtp_runtime.testing.reference import values as reference

SIZES = {1: [23], 2: [9, 14], 4: [6, 0, 9, 8]}  # uneven shards; an empty one at TP 4


class _Env:
    def __init__(self, **values):
        self.values = values

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.values}
        for k, v in self.values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _call(kind: int, n: int, rank: int, world: int, group, seed: int, sizes=None) -> float:
    """One of a few calls (kind) on ``n`` tokens; returns its largest deviation from float64."""
    sizes = sizes or SIZES[world]
    v = sum(sizes)
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=g, dtype=torch.float64)
    t = torch.randn(n, v, generator=g, dtype=torch.float64)
    y = torch.randint(0, v, (n,), generator=g)
    start = sum(sizes[:rank])
    zl = z[:, start : start + sizes[rank]].clone().requires_grad_()
    tl = t[:, start : start + sizes[rank]]
    common: dict[str, Any] = {"tp_group": group if world > 1 else None, "backend": "eager"}
    zr = z.clone().requires_grad_()
    if kind == 0:
        out = vtp.cross_entropy(zl, y, label_smoothing=0.1, **common)
        want = reference("cross_entropy", (zr,), y, label_smoothing=0.1)
    elif kind == 1:
        out = vtp.jsd(zl, tl, beta=0.3, reduction="sum", normalizer=float(n + seed), **common)
        want = reference("jsd", (zr, t), beta=0.3).sum() / (n + seed)
    else:
        out = vtp.entropy(zl.view(1, n, sizes[rank]), mask=(y % 3 != 0).view(1, n), **common).view(n)
        want = reference("entropy", (zr,), mask=y % 3 != 0)
    (grad,) = torch.autograd.grad(out.sum(), zl)
    (want_grad,) = torch.autograd.grad(want.sum(), zr)
    return max(_err(out, want), _err(grad, want_grad[:, start : start + sizes[rank]]))


def _err(a, b) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


# a sequence: repeats, token counts changing on every rank, ops alternating
SEQUENCE = [(0, 5), (0, 5), (1, 5), (0, 5), (1, 5), (2, 5), (0, 7), (0, 7), (2, 7), (1, 5), (2, 5), (0, 5)]


def _sequence(rank, world, group, check, max_plans=None):
    """Run SEQUENCE under ``VTP_CHECK=check``; per call: (full preparations, gathers), and
    the largest deviation from float64 over the whole sequence."""
    plan.clear()
    saved_max = plan.MAX_PLANS
    if max_plans:
        plan.MAX_PLANS = max_plans
    counts, worst = [], 0.0
    try:
        with _Env(VTP_CHECK=check), PlanCounts() as c:
            for i, (kind, n) in enumerate(SEQUENCE):
                worst = max(worst, _call(kind, n, rank, world, group, seed=i))
                counts.append(c.take())
    finally:
        plan.MAX_PLANS = saved_max
        plan.clear()
    return counts, worst


# (full preparations, gathers) per call of SEQUENCE: the first call of each kind is planned;
# a token count changing on every rank reuses the kind's plan
FIRST = [i in (0, 2, 5) for i in range(len(SEQUENCE))]


def test_tp1_plans_once_per_signature():
    counts, worst = _sequence(0, 1, None, None)
    assert worst < 1e-10
    assert counts == [(1, 0) if first else (0, 0) for first in FIRST]  # no gather at TP 1


@pytest.mark.parametrize("world", [2, 4])
def test_device_only_mode_gathers_once_per_signature(ranks, world):
    """VTP_CHECK=once (the default on a device-only group such as NCCL): a planned call
    gathers nothing; every rank plans on the same calls."""
    results = ranks(world, _sequence, "once", timeout=180)
    for counts, worst in results:
        assert worst < 1e-10
        assert counts == [(1, 1) if first else (0, 0) for first in FIRST]


def test_host_gather_mode_gathers_every_call(ranks):
    """The default on a group with a CPU transport (gloo): one host gather per call and no
    full preparation once the table is the planned one."""
    for counts, worst in ranks(2, _sequence, None, timeout=180):
        assert worst < 1e-10
        assert counts == [(1, 1) if first else (0, 1) for first in FIRST]


def test_check_mode_prepares_every_call(ranks):
    for counts, worst in ranks(2, _sequence, "1", timeout=180):
        assert worst < 1e-10
        assert counts == [(1, 1)] * len(SEQUENCE)


def test_plan_cache_turns_over_on_every_rank_together(ranks):
    """With room for one plan per generation, the sequence's three signatures evict each
    other; the ranks still plan on the same calls (the count decides, the same on every
    rank), and no call waits for a collective another rank skipped."""
    results = ranks(2, _sequence, "once", max_plans=1, timeout=180)
    assert results[0] == results[1]
    counts, worst = results[0]
    assert worst < 1e-10
    assert sum(p for p, _ in counts) > sum(FIRST)  # evictions made some calls plan again


def _shard_change_on_one_rank(rank, world, group, check):
    """The vocabulary changes between calls on rank 1 only (rank 0's shard, and so its
    signature, stays the same): a change no rank-local signature shows."""
    plan.clear()
    worst = 0.0
    with _Env(VTP_CHECK=check):
        for i, sizes in enumerate([[9, 14], [9, 15], [9, 14], [9, 15]]):
            worst = max(worst, _call(0, 5, rank, world, group, seed=i, sizes=sizes))
    plan.clear()
    return worst


@pytest.mark.parametrize("check", [None, "1"])
def test_shard_change_on_one_rank_with_a_gather_per_call(ranks, check):
    """Gathering on every call (host transport, or VTP_CHECK=1) sees it: right values."""
    assert max(ranks(2, _shard_change_on_one_rank, check, timeout=120)) < 1e-10


def _error_after_planning(rank, world, group, check):
    """A call planned on every rank, then the same call with a wrong option on rank 1 only,
    then the healthy call again."""
    plan.clear()
    with _Env(VTP_CHECK=check), PlanCounts() as counts:
        healthy = [_call(0, 5, rank, world, group, seed=0), _call(0, 5, rank, world, group, seed=1)]
        z = torch.randn(5, SIZES[world][rank], dtype=torch.float64, requires_grad=True)  # the planned signature
        y = torch.randint(0, sum(SIZES[world]), (5,))
        try:
            vtp.cross_entropy(z, y, label_smoothing=0.3 if rank == 1 else 0.1, tp_group=group, backend="eager")
            raised = "no error"
        except ShardError as exc:
            raised = str(exc)
        prepared_before_error = counts.take()[0]
        healthy.append(_call(0, 5, rank, world, group, seed=2))
    plan.clear()
    return raised, max(healthy), prepared_before_error


@pytest.mark.parametrize("check", [None, "1"])
def test_one_rank_error_after_planning_raises_on_every_rank(ranks, check):
    """With a gather per call a one-rank change after the plan was made is still raised on
    every rank, and the next call runs. (With VTP_CHECK=once it is not seen: the ranks would
    issue different collectives; see docs/guide.md, "No host sync".)"""
    results = ranks(2, _error_after_planning, check, timeout=120)
    for raised, worst, _ in results:
        assert "disagree" in raised and "options" in raised
        assert worst < 1e-10
    # rank 0 made the planned call: with a host gather it ran no full preparation until the
    # gathered table differed from the planned one (then one, like rank 1)
    assert [prepared for _, _, prepared in results] == ([2, 2] if check is None else [3, 3])


def test_number_normalizer_is_checked_on_every_call():
    """A number normalizer is per-call data, not part of the signature: a planned call with
    a bad one still raises."""
    plan.clear()
    z = torch.randn(4, 11, requires_grad=True)
    t = torch.randn(4, 11)
    good = vtp.jsd(z, t, reduction="sum", normalizer=8, backend="eager")
    assert torch.isfinite(good)
    for bad in (0, -3.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="normalizer must be a finite number > 0"):
            vtp.jsd(z, t, reduction="sum", normalizer=bad, backend="eager")
    torch.testing.assert_close(vtp.jsd(z, t, reduction="sum", normalizer=4, backend="eager"), good * 2)


def test_signature_covers_what_the_plan_depends_on():
    """Calls that differ in anything the plan holds get their own plans; calls that differ
    only in per-call data or in their token count share one."""
    plan.clear()
    z = torch.randn(4, 11, requires_grad=True)
    y = torch.randint(0, 11, (4,))
    vtp.cross_entropy(z, y, backend="eager")
    vtp.cross_entropy(z.detach().clone(), y.flip(0), backend="eager")  # new values: same signature...
    assert plan.size() == 2  # ...but requires_grad differs
    vtp.cross_entropy(torch.randn(4, 11, requires_grad=True), torch.randint(0, 11, (4,)), backend="eager")
    vtp.cross_entropy(z[:3], y[:3], backend="eager")  # another token count
    assert plan.size() == 2
    variants: list[dict[str, Any]] = [{"label_smoothing": 0.1}, {"temperature": 2.0}, {"reduction": "sum"}]
    for variant in [*variants, {"backend": "triton"}]:
        vtp.cross_entropy(z, y, **{"backend": "eager", **variant})
    with torch.no_grad():
        vtp.cross_entropy(z, y, backend="eager")
    with vtp.use_backend("triton"):
        vtp.cross_entropy(z, y)
    vtp.cross_entropy(z.double(), y, backend="eager")
    vtp.cross_entropy(z.view(2, 2, 11), y.view(2, 2), backend="eager")  # the number of token dims
    assert plan.size() == 2 + 8
    vtp.jsd(z, z, reduction="sum", normalizer=3, backend="eager")
    vtp.jsd(z, z, reduction="sum", normalizer=5, backend="eager")  # a number normalizer is data
    assert plan.size() == 11
    plan.clear()


def test_options_as_passed_give_the_canonical_signature():
    """The signature's options part, looked up by the options as passed, is the one
    canonicalizing each option gives: in any order, spelled as ints, floats, numpy scalars or
    defaults, and a bool never taken for the int it equals. The lookup holds no tensor."""
    import numpy as np

    spec = vtp.OPS["cross_entropy"]
    spellings: list[dict[str, Any]] = [
        {"reduction": "sum", "temperature": 2, "label_smoothing": 0.0},
        {"label_smoothing": -0.0, "temperature": 2.0, "reduction": "sum"},
        {"temperature": np.float32(2.0), "reduction": "sum", "ignore_index": -100},
    ]
    parts = set()
    for given in spellings * 2:  # the second round is answered by the lookup
        parts.add(plan.options_signature(spec, given, lookup=True) or plan.options_signature(spec, given))
        assert plan.options_signature(spec, given, lookup=True) in (None, plan.options_signature(spec, given))
    assert len(parts) == 1
    # 1 and True hash alike: a bool option given 1 is another call (the checks refuse it)
    logprobs = vtp.OPS["logprobs"]
    assert plan.options_signature(logprobs, {"return_entropy": True}, lookup=True) != plan.options_signature(
        logprobs, {"return_entropy": 1}, lookup=True
    )
    mask = torch.ones(4, dtype=torch.bool)
    entropy = vtp.OPS["entropy"]
    assert plan.options_signature(entropy, {"mask": mask}, lookup=True) is None  # a tensor: computed every call
    held = [v for key in plan.plain_options_keys() for v in key if isinstance(v, torch.Tensor)]
    assert not held
    before = len(plan.plain_options_keys())  # other tests of the process may have added entries
    for seed in range(3):  # a per-call number: one entry, whatever its value
        plan.options_signature(vtp.OPS["sample"], {"seed": seed}, lookup=True)
    assert len(plan.plain_options_keys()) - before <= 1
    assert ("sample", "seed", int) in plan.plain_options_keys()
