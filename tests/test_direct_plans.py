"""Direct plans: ``vtp.argmax`` and ``vtp.sample`` on one plain tensor without a group find
their plan by the call as passed (``plans.direct_key``) and skip the input forms and the
signature: the ids are those of the regular path and of float64, whatever changes between
calls re-plans, the seed is checked on every call, and what is kept is bounded, cleared with
the plans and holds no tensor."""

import gc
import weakref

import pytest
import torch

import vtp_runtime as vtp
from tests.helpers import PlanCounts
from vtp_runtime import pipeline, plans


@pytest.fixture(autouse=True)
def _fresh_plans():
    plans.clear()
    yield
    plans.clear()


def _logits(n=5, v=37, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, v, generator=g, dtype=torch.float64) * 3).to(dtype)


def _no_signature(*args, **kwargs):
    raise AssertionError("a planned direct call computed its signature")


def test_a_repeated_call_skips_the_signature_and_gives_the_regular_ids(monkeypatch):
    x = _logits()
    first = vtp.argmax(x, backend="eager")
    drawn = vtp.sample(x, seed=3, top_p=0.8, backend="eager")
    monkeypatch.setattr(plans, "signature_and_tokens", _no_signature)
    for step in range(4):
        assert torch.equal(vtp.argmax(x, backend="eager"), torch.argmax(x.double(), -1))
        again = vtp.sample(x, seed=3 + step, top_p=0.8, backend="eager")
        monkeypatch.undo()  # the regular path computes the signature
        options = {"seed": 3 + step, "temperature": 1.0, "row_offset": 0, "top_p": 0.8, "backend": "eager"}
        regular = pipeline.run("sample", (x,), options)
        monkeypatch.setattr(plans, "signature_and_tokens", _no_signature)
        assert torch.equal(again, regular)
    assert torch.equal(first, torch.argmax(x.double(), -1))
    assert drawn.shape == (5,) and drawn.dtype == torch.int64


@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
def test_leading_dims_and_grad(lead):
    x = _logits(n=6).view(*lead, -1, 37) if lead else _logits(n=1)[0]
    x.requires_grad_(True)
    for _ in range(2):  # planned, then direct
        got = vtp.argmax(x, backend="eager")
        assert got.shape == x.shape[:-1] and got.grad_fn is None
        assert torch.equal(got, torch.argmax(x.detach().double(), -1))


def test_what_changes_the_plan_plans_again(monkeypatch):
    x = _logits()
    vtp.argmax(x, backend="eager")
    with PlanCounts() as counts:
        vtp.argmax(x, backend="eager")
        assert counts.prepared == 0
        vtp.argmax(x.to(torch.bfloat16), backend="eager")  # another dtype: another signature
        assert counts.prepared == 1
        vtp.argmax(_logits(n=9), backend="eager")  # other token dims: the signature's plan, for them
        assert counts.prepared == 1
        vtp.argmax(x)  # no forced backend
        assert counts.prepared == 2
        with vtp.use_backend("eager"):  # forced another way
            vtp.argmax(x)
        assert counts.prepared == 3
        monkeypatch.setenv("VTP_BACKEND", "eager")
        vtp.argmax(x)
        assert counts.prepared == 4
        vtp.argmax(x)
        assert counts.prepared == 4
        monkeypatch.setenv("VTP_BACKEND", "nosuch")  # a forced backend that is not there raises
        with pytest.raises(Exception, match="nosuch"):
            vtp.argmax(x)
    assert plans.direct_size() == 6  # one per spelling of the call, the other token dims included


def test_the_seed_is_checked_on_every_call():
    x = _logits()
    vtp.sample(x, seed=1, backend="eager")
    vtp.sample(x, seed=2, backend="eager")  # direct
    for _ in range(2):
        with pytest.raises(TypeError, match="seed"):
            vtp.sample(x, seed=1.5, backend="eager")  # type: ignore[arg-type]
    assert torch.equal(vtp.sample(x, seed=2, backend="eager"), vtp.sample(x, seed=2, backend="eager"))


def test_bounded_cleared_and_holding_no_tensor(monkeypatch):
    monkeypatch.setattr(plans, "MAX_DIRECT", 4)
    for n in range(1, 12):
        x = _logits(n=n)
        vtp.argmax(x, backend="eager")
        assert plans.direct_size() <= 4
    ref = weakref.ref(x)
    del x
    gc.collect()
    assert ref() is None
    assert plans.direct_size() > 0
    plans.clear()
    assert plans.direct_size() == 0


def test_calls_with_a_group_or_a_head_take_the_regular_path():
    x = _logits()
    head = vtp.Head(torch.randn(4, 8), torch.randn(37, 8))
    assert plans.direct_key("argmax", x, {"tp_group": object()}) is None
    assert plans.direct_key("argmax", x, {"sp_group": object()}) is None
    assert plans.direct_key("argmax", head, {}) is None
    assert plans.direct_key("argmax", x, {"temperature": torch.tensor(1.0)}) is None
    assert plans.direct_key("argmax", x, {}) is not None
    got = vtp.argmax(head, backend="eager")
    assert torch.equal(got, torch.argmax(head.hidden.double() @ head.weight.double().T, -1))
    assert plans.direct_size() == 0
