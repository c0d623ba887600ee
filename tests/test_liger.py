"""The ``liger`` backend under TRITON_INTERPRET=1 on CPU: the conformance kit's cases at TP 1
and 2 against the float64 reference (a smoke selection by default, ``VTP_TEST_DEPTH=full``
for the kit's full matrix: Liger's kernels run in Triton's interpreter); the reasons of its
refusals, and dispatch passing it over where it cannot run; its second-backward guard; its
probe."""

from __future__ import annotations

import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime.backend import Request
from vtp_runtime.errors import BackendUnavailable
from vtp_runtime.testing import conformance
from vtp_runtime.testing.cases import DTYPES, make_inputs
from vtp_runtime.testing.head_cases import HeadCase
from vtp_runtime.testing.reference import values_and_grads

liger_kernel = pytest.importorskip("liger_kernel")

from vtp_runtime.backends import liger as liger_backend  # noqa: E402
from vtp_runtime.backends.liger import SecondBackwardError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# a second backward through its cross entropy raises (SecondBackwardError): the kit accepts that
@conformance.parametrize("liger", depth=conformance.current_depth(slow=True), shape=(2, 3))
def test_conformance(ranks, conformance_case):
    conformance.check(conformance_case, runner=ranks, timeout=120)


# -- refusals --------------------------------------------------------------------------------


def _forced_error(rank, world, group, layout):
    sizes = {"uneven": [7, 9], "permuted": [8, 8], "empty": [16, 0]}[layout]
    start = {"uneven": [0, 7], "permuted": [8, 0], "empty": [0, 16]}[layout][rank]
    z = torch.randn(4, sizes[rank])
    labels = torch.randint(0, 16, (4,))
    extra = {"vocab_start": start, "vocab_end": start + sizes[rank]} if layout == "permuted" else {}
    try:
        vtp.cross_entropy(z, labels, tp_group=group, backend="liger", **extra)
    except BackendUnavailable as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("layout", ["uneven", "permuted", "empty"])
def test_forced_on_uneven_shards_raises_same_error_on_every_rank(ranks, layout):
    msgs = ranks(2, _forced_error, layout, timeout=60)
    assert msgs[0] == msgs[1], msgs
    assert "backend 'liger' was forced" in msgs[0]
    if layout == "empty":
        assert "empty vocabulary shard" in msgs[0]
    else:
        assert "needs even vocabulary shards in rank order" in msgs[0]


def _auto_uneven(rank, world, group):
    """Unforced, uneven shards: dispatch never picks liger, and the answer is right."""
    sizes, starts = [7, 9], [0, 7]
    g = torch.Generator().manual_seed(3)
    full = torch.randn(4, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 16, (4,), generator=g)
    z = full[:, starts[rank] : starts[rank] + sizes[rank]].float()
    ex = vtp.explain("cross_entropy", z, labels, tp_group=group, gather=True)
    out = vtp.cross_entropy(z, labels, tp_group=group)
    ref, _ = values_and_grads("cross_entropy", (full,), labels)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    return ex.backend, ex.reasons["liger"]


def test_auto_selection_skips_liger_on_uneven_shards(ranks):
    for backend, why in ranks(2, _auto_uneven, timeout=60):
        assert backend != "liger"
        assert any("even vocabulary shards" in r for r in why)


def _tp2_jsd(rank, world, group):
    z = torch.randn(3, 8, requires_grad=True)
    try:
        vtp.jsd(z, torch.randn(3, 8), tp_group=group, backend="liger")
    except BackendUnavailable as exc:
        return str(exc)
    return "no error"


def test_jsd_refused_at_tp2(ranks):
    msgs = ranks(2, _tp2_jsd, timeout=60)
    assert msgs[0] == msgs[1] and "TP size 2 not supported (supports [1])" in msgs[0]


# the kit's refusals of liger on logits at TP 1: every op, feature and dtype it does not claim
REFUSED = [
    cc
    for cc in conformance.conformance_cases("liger", world_sizes=(1,))
    if cc.expect == "refused" and not isinstance(cc.case, HeadCase)
]


def _reason(why: str) -> str:
    """What dispatch's refusal says, for the kit's ``why`` of a refused case."""
    what = why.split()[-1]
    if why.startswith("does not implement"):
        return f"does not implement op '{what}'"
    return f"dtype {what} not supported" if what in DTYPES else f"does not support {what}"


@pytest.mark.parametrize("cc", REFUSED, ids=str)
def test_capability_refusals(cc):
    case = cc.case
    logits, index, extra = make_inputs(case, 8)
    tensors = [z.requires_grad_(need) for z, need in zip(logits, case.grads)] + ([index] if index is not None else [])
    kwargs = {**dict(case.options), **extra}
    with pytest.raises(BackendUnavailable, match="backend 'liger' was forced") as info:
        vtp.loss(case.op, *tensors, backend="liger", **kwargs)
    assert _reason(cc.why) in str(info.value)
    # and without forcing, dispatch picks another backend that can
    assert vtp.explain(case.op, *tensors, **kwargs).backend not in (None, "liger")


def test_selected_when_it_can_run():
    z = torch.randn(3, 8)
    ex = vtp.explain("cross_entropy", z, torch.randint(0, 8, (3,)))
    assert ex.reasons["liger"] == []
    ex = vtp.explain("jsd", z, torch.randn(3, 8), beta=0.2)
    assert ex.reasons["liger"] == []


# -- the second-backward guard --------------------------------------------------------------


def _ce_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(5, 16, generator=g) * 3).to(dtype).requires_grad_(True)
    labels = torch.randint(0, 16, (5,), generator=g)
    labels[1] = -100
    return z, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_second_backward_through_retained_graph_raises(dtype):
    z, labels = _ce_inputs(dtype)
    before = z.detach().clone()
    loss = vtp.cross_entropy(z, labels, backend="liger", reduction="mean")
    (first,) = torch.autograd.grad(loss, z, retain_graph=True)
    _, (ref,) = values_and_grads("cross_entropy", (z.detach(),), labels, torch.full((5,), 1 / 4, dtype=torch.float64))
    torch.testing.assert_close(first.double(), ref, rtol=2e-2 if dtype == torch.bfloat16 else 2e-4, atol=1e-3)
    kept = first.clone()
    with pytest.raises(SecondBackwardError, match="backward already ran once"):
        torch.autograd.grad(loss, z)
    assert torch.equal(first, kept), "the failed second backward changed the first gradient"
    assert torch.equal(z.detach(), before), "the input was modified"


def test_create_graph_gives_first_gradient_then_a_clear_error():
    z, labels = _ce_inputs()
    loss = vtp.cross_entropy(z, labels, backend="liger").sum()
    (first,) = torch.autograd.grad(loss, z, create_graph=True)
    _, (ref,) = values_and_grads("cross_entropy", (z.detach(),), labels)
    torch.testing.assert_close(first.double(), ref, rtol=2e-4, atol=1e-5)
    # the core makes differentiating a gradient an error, never a silently missing
    # second-order term
    with pytest.raises(RuntimeError, match="second-order gradients through vtp_runtime ops are not supported"):
        torch.autograd.grad(first.square().sum(), z)
    with pytest.raises(SecondBackwardError):
        torch.autograd.grad(loss, z)  # create_graph retained the graph: a second pass


def test_divergence_second_backward_is_exact():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(4, 16, generator=g, requires_grad=True)
    t = torch.randn(4, 16, generator=g)
    loss = vtp.jsd(s, t, beta=0.4, backend="liger").sum()
    (a,) = torch.autograd.grad(loss, s, retain_graph=True)
    (b,) = torch.autograd.grad(loss, s)
    assert torch.equal(a, b)


def test_out_of_range_labels_give_nan_rows_only():
    z, labels = _ce_inputs()
    labels[2], labels[3] = 16, -5
    out = vtp.cross_entropy(z, labels, backend="liger")
    out.sum().backward()
    bad = torch.tensor([False, False, True, True, False])
    assert torch.isnan(out[bad]).all() and torch.isfinite(out[~bad]).all()
    assert out[1] == 0  # ignore_index: exactly 0
    assert torch.isnan(z.grad[bad]).all() and torch.isfinite(z.grad[~bad]).all()
    assert torch.equal(z.grad[1], torch.zeros(16))


def test_why_label_smoothing_is_refused():
    """Liger's global label smoothing takes log(exp(x - max)) in fp32: a logit 1e4 below the
    max (a padded vocabulary) makes the loss inf where the true value is finite."""
    from liger_kernel.ops import vocab_parallel_cross_entropy as mod

    z = torch.randn(2, 8)
    z[:, 0] = -1e4
    labels = torch.tensor([1, 2])
    got = mod.LigerVocabParallelCEFunction.apply(z.unsqueeze(1), labels, None, -100, 0.1, "pytorch", "global")
    want, _ = values_and_grads("cross_entropy", (z,), labels, label_smoothing=0.1)
    assert torch.isfinite(want).all() and not torch.isfinite(got).all()


# -- probe ---------------------------------------------------------------------------------


def test_probe_reasons(monkeypatch):
    backend = liger_backend.LigerBackend()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.probe("cpu") == []
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert backend.probe("cpu") == ["cpu tensors need TRITON_INTERPRET=1 (Triton's interpreter; for tests)"]
    assert backend.probe("xpu") == []  # the capabilities refuse xpu, with their own reason
    assert "device type 'xpu' not supported (supports cpu, cuda)" in backend.capability_reasons(
        Request("jsd", "xpu", torch.float32, 1, 8, 3, True, False)
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backend.probe("cuda") == ["no CUDA device (torch.cuda.is_available() is False)"]
    monkeypatch.setattr(liger_backend, "liger_version", lambda: None)
    assert "not installed" in backend.probe("cuda")[0]
    monkeypatch.setattr(liger_backend, "liger_version", lambda: "0.7.2")
    assert "0.7.2 is too old (needs >= 0.8.1" in backend.probe("cuda")[0]


def test_importing_the_backend_does_not_import_liger():
    import subprocess
    import sys

    code = (
        "import sys, vtp_runtime.backends.liger as m; "
        "assert not any(k.startswith('liger_kernel') for k in sys.modules), 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
