"""TRL: ``generalized_jsd_loss`` gives what the installed trl's
``GKDTrainer.generalized_jsd_loss`` gives on the full logits — every reduction, beta 0 / 0.5
/ 1, temperature 1 and 2, with and without labels and ``num_items_in_batch`` — at TP=1, on
uneven TP=2 shards and on DTensor shards (an empty one at TP=4). The trainers themselves are
in ``test_integrations_trl_trainers.py`` and
``test_integrations_trl_launched.py``."""

import importlib.util
import os

import pytest
import torch

import vtp_runtime as vtp
import vtp_runtime.integrations.trl as vtp_trl

# trl is imported by the tests that need it, not at module level: the rank processes import
# this module to find their jobs, and those need only torch
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("trl") is None, reason="trl is not installed (pip install -e '.[integrations]')"
)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
REDUCTIONS = ("batchmean", "sum", "mean", "none")


def _inputs(v, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    student = (2 * torch.randn(2, 4, v, generator=g)).to(dtype)
    teacher = (2 * torch.randn(2, 4, v, generator=g)).to(dtype)
    labels = torch.randint(0, v, (2, 4), generator=g)
    labels[0, :2] = -100
    labels[1, 3] = -100
    return student, teacher, labels


def _upstream(reduction):
    """A fixed upstream gradient: per-token ([2, 4], as _inputs) for "none", 1 for a scalar."""
    if reduction != "none":
        return torch.tensor(1.0, dtype=torch.float64)
    return torch.linspace(0.5, 1.5, 8, dtype=torch.float64).view(2, 4)


def _trl(student, teacher, labels, beta, temperature, reduction, num_items=None):
    """TRL's value and gradients on full logits; "none" summed over the vocabulary (TRL
    keeps it per entry) and scattered back to [batch, seq] with 0 at ignored tokens."""
    s, t = student.detach().requires_grad_(), teacher.detach().requires_grad_()
    out = vtp_trl.trl_trainer("GKD").generalized_jsd_loss(s, t, labels, beta, temperature, reduction, num_items)
    if reduction == "none" and num_items is None:
        per_token = out.sum(-1)
        if labels is not None:
            per_token = torch.zeros(labels.shape, dtype=out.dtype).masked_scatter(labels != -100, per_token)
        out = per_token
    (out.double() * _upstream(reduction if num_items is None else "sum")).sum().backward()
    return out.detach(), s.grad, t.grad


def _ours(student, teacher, labels, beta, temperature, reduction, num_items=None, **layout):
    s, t = student.detach().requires_grad_(), teacher.detach().requires_grad_()
    out = vtp_trl.generalized_jsd_loss(s, t, labels, beta, temperature, reduction, num_items, **layout)
    (out.double() * _upstream(reduction if num_items is None else "sum")).sum().backward()
    return out.detach(), s.grad, t.grad


def _close(got, want, tol=1e-10):
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_tp1_equals_trl(reduction, beta, temperature):
    student, teacher, labels = _inputs(13)
    for lab in (None, labels):
        _close(
            _ours(student, teacher, lab, beta, temperature, reduction),
            _trl(student, teacher, lab, beta, temperature, reduction),
        )


@pytest.mark.parametrize("num_items", [5, torch.tensor(5)])
@pytest.mark.parametrize("reduction", ["batchmean", "mean"])
def test_tp1_num_items_in_batch_overrides_reduction(num_items, reduction):
    student, teacher, labels = _inputs(13)
    for lab in (None, labels):
        _close(
            _ours(student, teacher, lab, 0.5, 1.0, reduction, num_items),
            _trl(student, teacher, lab, 0.5, 1.0, reduction, num_items),
        )


def test_tp1_float32():
    student, teacher, labels = _inputs(13, torch.float32)
    _close(
        _ours(student, teacher, labels, 0.3, 2.0, "batchmean"),
        _trl(student, teacher, labels, 0.3, 2.0, "batchmean"),
        tol=1e-5,
    )


def test_all_tokens_ignored():
    student, teacher, labels = _inputs(13)
    ignored = torch.full_like(labels, -100)
    for reduction in REDUCTIONS:  # TRL's "mean" gives NaN here (a mean of nothing); 0 here
        value, s_grad, t_grad = _ours(student, teacher, ignored, 0.5, 1.0, reduction)
        assert not value.any() and not s_grad.any() and not t_grad.any(), reduction


def test_bad_reduction():
    student, teacher, _ = _inputs(13)
    with pytest.raises(ValueError, match="batchmean"):
        vtp_trl.generalized_jsd_loss(student, teacher, reduction="avg")


# -- shards ---------------------------------------------------------------------------------

V = 11
CASES = [
    (reduction, beta, num_items) for reduction in REDUCTIONS for beta in (0.0, 0.5, 1.0) for num_items in (None,)
] + [("batchmean", 0.5, torch.tensor(6))]


def _shard_job(rank, world, group, kind):
    v = V if world == 2 else 5
    student, teacher, labels = _inputs(v)
    if kind == "uneven":  # explicit bounds, not torch.chunk's: [0, 3), [3, 11)
        start, end = [0, 3, v][rank : rank + 2]
    else:
        chunk = -(-v // world)
        start = min(rank * chunk, v)
        end = min(start + chunk, v)
    results = []
    with vtp.use_backend("eager"):  # the adapter is under test, not the kernels
        for reduction, beta, num_items in CASES:
            for lab in (None, labels):
                s, t = (x[..., start:end] for x in (student, teacher))
                if kind == "uneven":
                    layout = {"tp_group": group, "vocab_start": start, "vocab_end": end}
                    results.append(_ours(s, t, lab, beta, 2.0, reduction, num_items, **layout))
                else:
                    results.append(_ours_dtensor(s, t, student, group, lab, beta, reduction, num_items))
    return results


def _ours_dtensor(s, t, full, group, labels, beta, reduction, num_items):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(group, "cpu")
    s, t = (x.clone().requires_grad_() for x in (s, t))
    ds, dt = (
        DTensor.from_local(x, mesh, [Shard(2)], run_check=False, shape=full.shape, stride=full.stride()) for x in (s, t)
    )
    out = vtp_trl.generalized_jsd_loss(ds, dt, labels, beta, 2.0, reduction, num_items)
    (out.double() * _upstream(reduction if num_items is None else "sum")).sum().backward()
    return out.detach(), s.grad, t.grad


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world,kind", [(2, "uneven"), (2, "dtensor"), (4, "dtensor")])
def test_shards_equal_trl(ranks, world, kind):
    v = V if world == 2 else 5  # TP=4 over 5 entries: 2, 2, 1 and an empty shard
    student, teacher, labels = _inputs(v)
    per_rank = ranks(world, _shard_job, kind, timeout=150)
    i = 0
    for reduction, beta, num_items in CASES:
        for lab in (None, labels):
            want = _trl(student, teacher, lab, beta, 2.0, reduction, num_items)
            for rank_results in per_rank:
                torch.testing.assert_close(rank_results[i][0], want[0], rtol=1e-10, atol=1e-10)
            for k in (1, 2):
                got = torch.cat([rank_results[i][k] for rank_results in per_rank], -1)
                torch.testing.assert_close(got, want[k], rtol=1e-10, atol=1e-10)
            i += 1
