"""The fused head (``vtp.Head``) beyond the conformance kit's cases through it (every op,
feature, dtype and shard layout a backend declares head inputs for, against the float64
reference on ``h @ W.T + b``: tests/test_eager.py, tests/test_triton.py): the triton backward
writing over the chunk buffer, dispatch of head inputs, malformed heads, cross-rank
agreement, the hidden-gradient modes, chunking and memory, and ``VocabParallelHead``."""

import math
from typing import Any, cast

import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime import head_chunks as head_mod
from vtp_runtime.backend import ALL_DTYPES, HeadSupport, OpCapability
from vtp_runtime.backends.eager import EagerBackend
from vtp_runtime.backends.triton import TritonBackend
from vtp_runtime.errors import BackendUnavailable, ShardError
from vtp_runtime.nn import VocabParallelHead, shard_bounds
from vtp_runtime.registry import REGISTRY, registered
from vtp_runtime.testing import conformance

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's -inf arithmetic


def test_triton_writes_the_gradient_over_the_chunk_buffer(monkeypatch):
    """Under the fused head the triton backward gets its scratch flags and needs no
    gradient buffer of its own: the chunk's logits buffer receives it."""
    seen = []
    backend = REGISTRY.get("triton")
    assert isinstance(backend, TritonBackend)
    original = type(backend).head_backward

    def spy(self, call, state, grad, scratch):
        out = original(self, call, state, grad, scratch)
        seen.append((scratch, out[0].data_ptr() == state.logits.data_ptr()))
        return out

    monkeypatch.setattr(type(backend), "head_backward", spy)
    h = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(11, 4, requires_grad=True)
    vtp.cross_entropy(
        vtp.Head(h, w, chunk_rows=4), torch.randint(0, 11, (6,)), reduction="sum", backend="triton"
    ).backward()
    assert seen == [((True,), True), ((True,), True)]  # two chunks, each in place


# -- dispatch -----------------------------------------------------------------------------------


class _LogitsOnly(EagerBackend):
    name = "logits_only"
    priority = 100  # above every built-in: chosen for logits, never for a Head
    ops = {"cross_entropy": OpCapability(device_types=None, dtypes=ALL_DTYPES)}
    head_ops: dict[str, HeadSupport] = {}


class _NoPerToken(EagerBackend):
    name = "no_per_token"
    priority = 101
    ops = {"cross_entropy": OpCapability(device_types=None, dtypes=ALL_DTYPES)}
    head_ops = {"cross_entropy": HeadSupport(per_token=False)}


class _Plugin:
    def __init__(self, *classes):
        self.classes = classes

    @vtp.hookimpl
    def vtp_runtime_register_backends(self, register):
        for cls in self.classes:
            register(cls())


def test_a_backend_without_head_inputs_is_never_handed_a_head():
    h, w = torch.randn(5, 4), torch.randn(9, 4)
    y = torch.randint(0, 9, (5,))
    with registered(_Plugin(_LogitsOnly), name="logits_only"):
        assert vtp.explain("cross_entropy", h @ w.T, y).backend == "logits_only"
        ex = vtp.explain("cross_entropy", vtp.Head(h, w), y)
        assert ex.backend != "logits_only" and ex.request.head_inputs
        assert ex.reasons["logits_only"] == [
            "head inputs not supported (pass logits, or force a backend that takes vtp.Head)"
        ]
        assert "inputs=head" in str(ex)
        with pytest.raises(BackendUnavailable, match="head inputs not supported"):
            vtp.cross_entropy(vtp.Head(h, w), y, backend="logits_only")


def test_head_per_token_is_a_separate_capability():
    h, w = torch.randn(5, 4), torch.randn(9, 4)
    y = torch.randint(0, 9, (5,))
    with registered(_Plugin(_NoPerToken), name="no_per_token"):
        assert vtp.explain("cross_entropy", vtp.Head(h, w), y, reduction="mean").backend == "no_per_token"
        ex = vtp.explain("cross_entropy", vtp.Head(h, w), y)
        assert ex.backend == "triton" and "per-token result not supported" in ex.reasons["no_per_token"][0]


@pytest.mark.parametrize(
    "bad,err,match",
    [
        (lambda h, w: vtp.Head(h, w[:, :3]), ValueError, r"weight must be \[V_local, H\]"),
        (lambda h, w: vtp.Head(h, w, torch.zeros(4)), ValueError, r"bias must be \[V_local\]"),
        (lambda h, w: vtp.Head(h.double(), w), TypeError, "must share one dtype"),
        (lambda h, w: vtp.Head(h, w.long()), TypeError, "floating"),
        (lambda h, w: vtp.Head(h, w, chunk_rows=0), ValueError, "chunk_rows"),
        (lambda h, w: vtp.Head(h, w, reduce_hidden_grad=cast(Any, 1)), TypeError, "reduce_hidden_grad"),
    ],
)
def test_malformed_heads_are_rejected(bad, err, match):
    h, w = torch.randn(5, 4), torch.randn(9, 4)
    with pytest.raises(err, match=match):
        vtp.cross_entropy(bad(h, w), torch.randint(0, 9, (5,)))


def test_head_and_logits_must_agree_in_shape():
    h, w = torch.randn(5, 4), torch.randn(9, 4)
    with pytest.raises(ValueError, match="same shape"):
        vtp.kl(vtp.Head(h, w), torch.randn(6, 9))
    with pytest.raises(ValueError, match="labels has shape"):
        vtp.cross_entropy(vtp.Head(h, w), torch.randint(0, 9, (6,)))


def _mixed_kinds(rank, world, group):
    h, w = torch.randn(5, 4), torch.randn(9, 4)
    y = torch.randint(0, 9, (5,))
    arg = vtp.Head(h, w) if rank == 0 else h @ w.T
    with pytest.raises(ShardError, match=r"inputs: rank 0 = head:.*rank 1 = \(not given\)") as info:
        vtp.cross_entropy(arg, y, tp_group=group)
    return str(info.value)


def test_ranks_passing_a_head_and_logits_raise_the_same_error(ranks):
    messages = ranks(2, _mixed_kinds, timeout=60)
    assert messages[0] == messages[1]


def _differing_reduce(rank, world, group):
    h, w = torch.randn(5, 4, requires_grad=True), torch.randn(9, 4)
    with pytest.raises(ShardError, match="disagree"):
        vtp.entropy(vtp.Head(h, w, reduce_hidden_grad=rank == 0), tp_group=group)


def test_ranks_differing_in_reduce_hidden_grad_raise(ranks):
    ranks(2, _differing_reduce, timeout=60)


# -- the hidden gradient: complete on every rank, or this rank's partial sum ---------------------


def _hidden_grads(rank, world, group, reduce):
    torch.manual_seed(0)  # the same full tensors on every rank
    n, d, v = 7, 5, 23
    hidden = torch.randn(n, d, dtype=torch.float64)
    weight = torch.randn(v, d, dtype=torch.float64)
    labels = torch.randint(0, v, (n,))
    start, end = shard_bounds(v, world, rank)
    h = hidden.clone().requires_grad_(True)
    loss = vtp.cross_entropy(
        vtp.Head(h, weight[start:end], reduce_hidden_grad=reduce), labels, reduction="mean", tp_group=group
    )
    loss.backward()
    full = hidden.clone().requires_grad_(True)
    torch.nn.functional.cross_entropy(full @ weight.T, labels).backward()
    partial = torch.zeros(n, v, dtype=torch.float64)  # this rank's share: dlogits over its columns only
    dlogits = torch.softmax(hidden @ weight.T, -1) - torch.nn.functional.one_hot(labels, v)
    partial[:, start:end] = dlogits[:, start:end] / n
    return h.grad, full.grad, partial @ weight


@pytest.mark.parametrize("world", conformance.tp_sizes(2, 4))
def test_hidden_gradient_is_complete_on_every_rank(ranks, world):
    for got, full, _ in ranks(world, _hidden_grads, True, timeout=60):
        torch.testing.assert_close(got, full, rtol=1e-10, atol=1e-12)


def test_partial_hidden_gradients_sum_to_the_full_one(ranks):
    results = ranks(2, _hidden_grads, False, timeout=60)
    for got, _, partial in results:
        torch.testing.assert_close(got, partial, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(results[0][0], results[0][1])  # a partial sum is not the full gradient
    torch.testing.assert_close(sum(r[0] for r in results), results[0][1], rtol=1e-10, atol=1e-12)


# -- chunking, memory, second backward ------------------------------------------------------------


def test_chunk_rows_rule():
    assert head_mod.chunk_rows(8192, 151936, 2) == 1280  # at most 1280 (384 MiB of bf16 rows): 7 chunks
    assert head_mod.chunk_rows(8192, 151936 // 2, 2) == 2048  # at most 2560: 4 chunks of 2048
    assert head_mod.chunk_rows(8192, 151936 // 4, 2) == 4096  # at most 5120, balanced over 2 chunks
    assert head_mod.chunk_rows(2048, 151936, 2) == 1024  # two chunks of 1024, not 1280 + 768
    assert head_mod.chunk_rows(100, 151936, 2) == 100  # never more rows than tokens
    assert head_mod.chunk_rows(8192, 10**9, 4) == 1  # at least one row
    assert head_mod.chunk_rows(8192, 151936, 2, requested=512) == 512
    assert head_mod.chunk_rows(0, 151936, 2) == 1


def test_scalar_results_hand_their_gradients_over_once():
    h, w = torch.randn(6, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    loss = vtp.cross_entropy(vtp.Head(h, w), torch.randint(0, 9, (6,)), reduction="mean")
    loss.backward(retain_graph=True)
    with pytest.raises(head_mod.HeadGradientConsumed, match="reduction='none'"):
        loss.backward()


# (op, vtp call on Head inputs, the float64 reference reduction of reference.values on h @ W.T)
_SCALAR_CASES = {
    "ce_mean_ignored": lambda h, w, y, m, ref: (
        vtp.cross_entropy(vtp.Head(h, w, chunk_rows=4), y, reduction="mean", backend="eager"),
        ref("cross_entropy", (h @ w.T,), y).sum() / (y != -100).sum(),
    ),
    "ce_sum": lambda h, w, y, m, ref: (
        vtp.cross_entropy(vtp.Head(h, w, chunk_rows=4), y, reduction="sum", backend="eager"),
        ref("cross_entropy", (h @ w.T,), y).sum(),
    ),
    "entropy_masked_mean": lambda h, w, y, m, ref: (
        vtp.entropy(vtp.Head(h, w), mask=m, reduction="mean", backend="eager"),
        (ref("entropy", (h @ w.T,)) * m).sum() / m.sum(),
    ),
    "logprobs_topk_mean": lambda h, w, y, m, ref: (
        vtp.logprobs(vtp.Head(h, w), torch.stack([y.clamp(min=0), y.clamp(min=1) - 1], 1), reduction="mean"),
        ref("logprobs", (h @ w.T,), torch.stack([y.clamp(min=0), y.clamp(min=1) - 1], 1)).mean(),
    ),
    "jsd_mean": lambda h, w, y, m, ref: (
        vtp.jsd(vtp.Head(h, w), vtp.Head(h.detach() * 2, w.detach()), reduction="mean", backend="eager"),
        ref("jsd", (h @ w.T, (h.detach() * 2) @ w.detach().T)).mean(),
    ),
}


@pytest.mark.parametrize("case", sorted(_SCALAR_CASES))
def test_a_plain_backward_of_a_scalar_result_scales_by_exactly_one(monkeypatch, case):
    """The gradients a sum/mean computes in forward are for the upstream gradient a plain
    ``loss.backward()`` sends each token (1 / count for a mean), so the backward's scale is
    exactly 1 (the triton backend then skips its pass); another upstream gradient is the
    scale itself. The gradients equal the float64 reference's either way."""
    from vtp_runtime.testing import reference

    seen: list[float] = []
    original = EagerBackend.scale_gradients

    def spy(self, grads, scale):
        seen.append(float(scale))
        original(self, grads, scale)

    monkeypatch.setattr(EagerBackend, "scale_gradients", spy)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 11, (7,), generator=g)
    y[2] = -100
    m = torch.tensor([True, False, True, True, False, True, True])
    for upstream in (1.0, 2.5):
        ours, ref = _SCALAR_CASES[case](h, w, y, m, reference.values)
        got = torch.autograd.grad(ours * upstream, (h, w))
        want = torch.autograd.grad(ref * upstream, (h, w))
        torch.testing.assert_close(ours, ref.to(ours.dtype), rtol=1e-12, atol=1e-12)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert seen[0] == 1.0 and seen[1] == pytest.approx(2.5, rel=1e-15) and len(seen) == 2


def test_per_token_results_release_their_buffers_until_backward(monkeypatch):
    sizes = []
    original = head_mod.ChunkedDriver.backward

    def spy(self, run, grad):
        sizes.append([x.buffer.untyped_storage().nbytes() for x in run.inputs])
        original(self, run, grad)
        sizes.append([x.buffer.untyped_storage().nbytes() for x in run.inputs])

    monkeypatch.setattr(head_mod.ChunkedDriver, "backward", spy)
    h, w = torch.randn(10, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    out = vtp.entropy(vtp.Head(h, w, chunk_rows=4), backend="eager")
    out.sum().backward()
    assert sizes == [[0], [0]]  # released after forward and again after backward


def test_no_grad_forward_keeps_nothing():
    h, w = torch.randn(6, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    y = torch.randint(0, 9, (6,))
    with torch.no_grad():
        out = vtp.cross_entropy(vtp.Head(h, w), y)
    assert out.grad_fn is None
    torch.testing.assert_close(out, torch.nn.functional.cross_entropy(h @ w.T, y, reduction="none").detach())


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_differentiating_a_head_gradient_raises(reduction):
    """create_graph=True gives the right first gradient; a second-order term is refused, as
    for logits (vtp_runtime/second_order.py), never silently missing."""
    h, w = torch.randn(6, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    y = torch.randint(0, 9, (6,))
    out = vtp.cross_entropy(vtp.Head(h, w), y, reduction=reduction).sum()
    gh, gw = torch.autograd.grad(out, (h, w), create_graph=True)
    ref = torch.autograd.grad(torch.nn.functional.cross_entropy(h @ w.T, y, reduction=reduction).sum(), (h, w))
    torch.testing.assert_close((gh.detach(), gw.detach()), ref)
    with pytest.raises(RuntimeError, match="second-order gradients"):
        torch.autograd.grad(gh.pow(2).sum() + gw.pow(2).sum(), (h, w))


def test_modifying_an_input_before_backward_raises():
    h, w = torch.randn(6, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    out = vtp.entropy(vtp.Head(h, w))
    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# -- VocabParallelHead ----------------------------------------------------------------------------


def test_shard_bounds_follow_torch_chunk():
    for v, t in [(10, 4), (151936, 4), (151937, 2), (5, 4), (3, 8)]:
        chunks = torch.arange(v).chunk(t)
        for r in range(t):
            start, end = shard_bounds(v, t, r)
            want = chunks[r].tolist() if r < len(chunks) else []
            assert list(range(start, end)) == want


def test_vocab_parallel_head_single_rank():
    torch.manual_seed(0)
    full_w, full_b = torch.randn(13, 6), torch.randn(13)
    m = VocabParallelHead.from_full(full_w, full_b)
    assert (m.vocab_start, m.vocab_end) == (0, 13) and m.weight.shape == (13, 6)
    h = torch.randn(2, 3, 6, requires_grad=True)
    torch.testing.assert_close(m.logits(h), h @ full_w.T + full_b)
    y = torch.randint(0, 13, (2, 3))
    loss = vtp.cross_entropy(m(h), y, reduction="mean")
    loss.backward()
    ref_h = h.detach().clone().requires_grad_(True)
    ref_w, ref_b = full_w.clone().requires_grad_(True), full_b.clone().requires_grad_(True)
    torch.nn.functional.cross_entropy((ref_h @ ref_w.T + ref_b).reshape(6, 13), y.reshape(6)).backward()
    for got, want in [(h.grad, ref_h.grad), (m.weight.grad, ref_w.grad), (m.bias.grad, ref_b.grad)]:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    fresh = VocabParallelHead(6, 13, bias=True)
    assert abs(fresh.weight).max() <= 1 / math.sqrt(6)
    fresh.load_state_dict(m.state_dict())
    assert torch.equal(fresh.weight, m.weight)
    assert m.state_dict()["_extra_state"] == {
        "vocab_start": 0,
        "vocab_end": 13,
        "vocab_size": 13,
        "hidden_size": 6,
        "tp_size": 1,
    }


def _module_on_ranks(rank, world, group):
    torch.manual_seed(0)
    full_w = torch.randn(10, 4, dtype=torch.float64)
    hidden = torch.randn(5, 4, dtype=torch.float64)
    labels = torch.randint(0, 10, (5,))
    m = VocabParallelHead.from_full(full_w, tp_group=group)
    h = hidden.clone().requires_grad_(True)
    loss = vtp.cross_entropy(m(h), labels, reduction="sum", tp_group=group)
    loss.backward()
    full = m.logits(hidden, gather=True)
    other = VocabParallelHead(4, 10, tp_group=group, dtype=torch.float64)
    wrong = {**m.state_dict(), "_extra_state": {**m.state_dict()["_extra_state"], "vocab_start": -1}}
    with pytest.raises(ValueError, match="same TP size"):
        other.load_state_dict(wrong)
    return (m.vocab_start, m.vocab_end), loss.item(), h.grad, m.weight.grad, full


def test_vocab_parallel_head_on_four_ranks(ranks):
    torch.manual_seed(0)
    full_w = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    hidden = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 10, (5,))
    want = torch.nn.functional.cross_entropy(hidden @ full_w.T, labels, reduction="sum")
    want.backward()
    results = ranks(4, _module_on_ranks, timeout=60)
    assert [r[0] for r in results] == [(0, 3), (3, 6), (6, 9), (9, 10)]  # torch.chunk's split
    assert full_w.grad is not None
    for (start, end), loss, dh, dw, full in results:
        assert loss == pytest.approx(want.item(), rel=1e-12)
        torch.testing.assert_close(dh, hidden.grad)
        torch.testing.assert_close(dw, full_w.grad[start:end])
        torch.testing.assert_close(full, (hidden @ full_w.T).detach())
