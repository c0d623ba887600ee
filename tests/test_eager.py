"""The eager backend against the float64 dense reference: the conformance kit's cases (every
op, feature, dtype and shard layout it declares, on TP 1 and 2; at ``VTP_TEST_DEPTH=full``
every dtype on every layout and TP 3 and 4 as well), then what the kit does not check: row
chunking, collectives that do not depend on the shard size, gradcheck, tensor normalizers,
result dtypes, no teacher-gradient work for a frozen teacher, second-order refusal."""

from typing import Any

import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime.testing import conformance
from vtp_runtime.testing.cases import Case, run_case


@conformance.parametrize("eager")
def test_conformance(ranks, conformance_case):
    conformance.check(conformance_case, runner=ranks, timeout=120)


def test_chunking_matches_unchunked(monkeypatch):
    """Row chunks much smaller than the batch give the same values and gradients."""
    import vtp_runtime.backends.eager as eager

    monkeypatch.setattr(eager, "CHUNK_ELEMENTS", 64)  # 64 // 37 -> one row per chunk
    cases: list[tuple[str, dict[str, Any]]] = [
        ("cross_entropy", {"options": (("label_smoothing", 0.1),)}),
        ("jsd", {"masked": "mask"}),
        ("logprobs", {"topk": 2}),
        ("entropy", {}),
        ("kl", {}),
    ]
    for op, fields in cases:
        run_case(0, 1, None, Case(op, shape=(5, 3), **fields))


def test_collective_count_does_not_depend_on_vocab(monkeypatch):
    """Uneven shards must issue the same collectives, or ranks would deadlock."""
    import vtp_runtime.backends.eager as eager

    calls = []

    def all_reduce(t, group, op="sum"):
        calls.append(op)
        return t

    monkeypatch.setattr(eager, "all_reduce", all_reduce)
    monkeypatch.setattr(eager, "CHUNK_ELEMENTS", 256)
    for op in ("cross_entropy", "logprobs", "entropy", "kl", "jsd"):
        counts = []
        for v in (3, 50, 1000):
            calls.clear()
            z = torch.randn(6, v, requires_grad=True)
            args = (
                (z, torch.zeros(6, dtype=torch.long))
                if op in ("cross_entropy", "logprobs")
                else (z, torch.randn(6, v))
                if op in ("kl", "jsd")
                else (z,)
            )
            vtp.loss(op, *args, backend="eager").sum().backward()
            counts.append(list(calls))
        assert all(c == counts[0] for c in counts), f"{op}: collectives differ with V_local: {counts}"


def test_gradcheck_float64():
    torch.manual_seed(0)
    z = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    t = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([1, -100, 5])
    checks = [
        lambda z, t: vtp.cross_entropy(z, y, label_smoothing=0.1, z_loss=0.01, temperature=1.3, backend="eager"),
        lambda z, t: vtp.logprobs(z, torch.tensor([[0, 2], [1, 1], [5, -100]]), backend="eager"),
        lambda z, t: vtp.entropy(z, temperature=0.8, backend="eager"),
        lambda z, t: vtp.kl(z, t, backend="eager"),
        lambda z, t: vtp.kl(z, t, reverse=True, temperature=2.0, backend="eager"),
        lambda z, t: vtp.jsd(z, t, beta=0.3, backend="eager"),
        lambda z, t: vtp.jsd(z, t, beta=0.0, backend="eager"),
        lambda z, t: vtp.jsd(z, t, beta=1.0, mask=torch.tensor([True, False, True]), reduction="mean", backend="eager"),
    ]
    for fn in checks:
        assert torch.autograd.gradcheck(fn, (z, t), eps=1e-6, atol=1e-6)


def test_tensor_normalizer_like_num_items_in_batch():
    z = torch.randn(3, 4, 11, requires_grad=True)
    y = torch.randint(0, 11, (3, 4))
    num_items = torch.tensor(7)
    out = vtp.cross_entropy(z, y, reduction="sum", normalizer=num_items, backend="eager")
    want = torch.nn.functional.cross_entropy(z.view(-1, 11), y.view(-1), reduction="sum") / 7
    assert torch.allclose(out, want)
    with pytest.raises(ValueError, match="one-element tensor"):
        vtp.cross_entropy(z, y, normalizer=torch.ones(2), backend="eager")


def test_outputs_are_fp32_for_low_precision_inputs():
    z = torch.randn(4, 9, dtype=torch.bfloat16, requires_grad=True)
    out = vtp.entropy(z, backend="eager")
    assert out.dtype == torch.float32
    out.sum().backward()
    assert z.grad is not None and z.grad.dtype == torch.bfloat16


def test_detached_teacher_gets_no_gradient_work(monkeypatch):
    """A frozen teacher costs no teacher-gradient computation (and gets no gradient)."""
    from vtp_runtime.backends.eager import EagerBackend

    seen = []
    original = EagerBackend.backward

    def spy(self, call, state, grad):
        seen.append(call.needs_grad)
        return original(self, call, state, grad)

    monkeypatch.setattr(EagerBackend, "backward", spy)
    s = torch.randn(4, 9, requires_grad=True)
    t = torch.randn(4, 9)
    vtp.jsd(s, t, beta=0.4, backend="eager").sum().backward()
    assert seen == [(True, False)]
    assert s.grad is not None and t.grad is None


def test_double_backward_raises_instead_of_a_wrong_second_order_gradient():
    """Backward recomputes from detached statistics, so its result is not differentiable:
    create_graph=True must lead to an error, never to a silently wrong Hessian term."""
    z = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    message = "second-order gradients through vtp_runtime ops are not supported"
    (g,) = torch.autograd.grad(vtp.entropy(z, backend="eager").sum(), z, create_graph=True)
    with pytest.raises(RuntimeError, match=message):
        g.sum().backward()
    upstream = torch.ones(4, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(vtp.entropy(z, backend="eager"), z, upstream, create_graph=True)
    with pytest.raises(RuntimeError, match=message):
        g.sum().backward()
