"""The framework-independent pieces of ``vtp_runtime.integrations``: the copy into the TP
region, DTensor logits (torch.chunk layout: uneven and empty shards), and the causal-LM
loss on them, against the float64 reference. Only torch is needed."""

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from vtp_runtime.integrations import copy_to_tp_region
from vtp_runtime.integrations.transformers import causal_lm_loss
from vtp_runtime.testing import conformance, reference


def _copy_job(rank, world, group):
    hidden = torch.linspace(-1, 1, 6, dtype=torch.float64).requires_grad_()
    out = copy_to_tp_region(hidden, group)
    assert torch.equal(out, hidden)
    (out * (rank + 1)).sum().backward()  # each rank's partial gradient differs
    return hidden.grad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", conformance.tp_sizes(2, 4))
def test_copy_to_tp_region_sums_gradients(ranks, world):
    grads = ranks(world, _copy_job, timeout=60)
    expected = torch.full((6,), float(sum(range(1, world + 1))), dtype=torch.float64)
    for g in grads:
        torch.testing.assert_close(g, expected, rtol=0, atol=0)


def test_copy_to_tp_region_without_group_is_identity():
    hidden = torch.randn(3, requires_grad=True)
    assert copy_to_tp_region(hidden, None) is hidden


def _shifted(labels, ignore_index=-100):
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _inputs(v, dtype=torch.float32):
    g = torch.Generator().manual_seed(v)
    logits = (3 * torch.randn(2, 5, v, generator=g)).to(dtype)
    labels = torch.randint(0, v, (2, 5), generator=g)
    labels[0, :2] = -100
    return logits, labels


def _expected(logits, labels, num_items):
    """float64 reference: HF's causal-LM loss (mean over counted shifted tokens, or sum / num_items)."""
    v = logits.shape[-1]
    target = _shifted(labels).reshape(-1)
    denominator = float(num_items) if num_items is not None else float((target != -100).sum())
    value, (grad,) = reference.values_and_grads(
        "cross_entropy",
        (logits.reshape(-1, v),),
        target,
        grad_output=torch.full(target.shape, 1 / denominator, dtype=torch.float64),
    )
    assert grad is not None
    return value.sum() / denominator, grad.view(logits.shape)


def _dtensor_job(rank, world, group, v, num_items):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    logits, labels = _inputs(v)
    chunk = -(-v // world)
    start = min(rank * chunk, v)
    local = logits[..., start : min(start + chunk, v)].clone().requires_grad_()
    mesh = DeviceMesh.from_group(group, "cpu")
    full = DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=logits.shape, stride=logits.stride())
    loss = causal_lm_loss(full, labels, v, num_items_in_batch=num_items)
    loss.backward()
    return loss.detach(), local.grad, start


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,v", [(2, 11), (4, 5)])  # 6/5; 2/2/1/0 (an empty shard)
@pytest.mark.parametrize("num_items", [None, torch.tensor(5)])
def test_dtensor_logits_causal_lm_loss(ranks, world, v, num_items):
    logits, labels = _inputs(v)
    value, grad = _expected(logits, labels, num_items)
    results = ranks(world, _dtensor_job, v, num_items, timeout=60)
    sizes = [r[1].shape[-1] for r in results]
    assert sizes == [len(c) for c in torch.arange(v).chunk(world)] + [0] * (world - len(torch.arange(v).chunk(world)))
    for loss, _, _ in results:
        torch.testing.assert_close(loss.double(), value, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([r[1] for r in results], -1).double(), grad, rtol=1e-5, atol=1e-6)


def _dtensor_errors_job(rank, world, group):
    """The DTensor path is the ops' own: a DTensor carries its bounds, and pending sums are refused."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Placement, Shard

    mesh = DeviceMesh.from_group(group, "cpu")
    local, labels = torch.randn(1, 3, 4), torch.zeros(1, 3, dtype=torch.long)
    errors = []
    cases: list[tuple[Placement, dict[str, Any]]] = [(Shard(2), {"vocab_start": 0, "vocab_end": 2}), (Partial(), {})]
    for placement, kw in cases:
        full = DTensor.from_local(local, mesh, [placement], run_check=False)
        try:
            causal_lm_loss(full, labels, **kw)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.timeout(120)
def test_dtensor_errors(ranks):
    for errors in ranks(2, _dtensor_errors_job, timeout=60):
        assert len(errors) == 2
        assert "vocab_start/vocab_end come from the logits DTensor" in errors[0]
        assert "pending reduction (Partial)" in errors[1]


@pytest.mark.parametrize("num_items", [None, 7, torch.tensor(7)])
def test_causal_lm_loss_single_rank(num_items):
    logits, labels = _inputs(13, torch.float64)
    logits.requires_grad_()
    value, grad = _expected(logits, labels, num_items)
    loss = causal_lm_loss(logits, labels, 13, num_items_in_batch=num_items)
    loss.backward()
    torch.testing.assert_close(loss, value)
    torch.testing.assert_close(logits.grad, grad)


def test_causal_lm_loss_shift_labels_and_all_ignored():
    logits, labels = _inputs(13, torch.float64)
    shifted = _shifted(labels)
    torch.testing.assert_close(causal_lm_loss(logits, shift_labels=shifted), causal_lm_loss(logits, labels))
    ignored = torch.full_like(labels, -100)
    logits.requires_grad_()
    loss = causal_lm_loss(logits, ignored)  # transformers gives NaN (0 / 0) here
    loss.backward()
    assert loss.item() == 0 and not logits.grad.any()


def test_gathered_logits_are_refused():
    logits, labels = _inputs(10)
    with pytest.raises(ValueError, match="colwise"):
        causal_lm_loss(logits, labels, vocab_start=0, vocab_end=5)


def test_deprecated_names_still_work():
    """``VocabParallelCausalLMLoss`` (DeepSpeed's loss has that name) and ``vocab_shard`` (the
    ops take DTensors directly) keep working, with a DeprecationWarning."""
    from vtp_runtime.integrations import vocab_shard
    from vtp_runtime.integrations.transformers import VocabParallelCausalLMLoss, VtpCausalLMLoss

    logits, labels = _inputs(13, torch.float64)
    with pytest.warns(DeprecationWarning, match="VtpCausalLMLoss"):
        loss_fn = VocabParallelCausalLMLoss()
    assert isinstance(loss_fn, VtpCausalLMLoss)
    torch.testing.assert_close(loss_fn(logits, labels), causal_lm_loss(logits, labels))
    with pytest.warns(DeprecationWarning, match="directly"):
        shard = vocab_shard(logits)
    assert shard.logits is logits and shard.options()["tp_group"] is None


def test_head_logits_slice_tokens_fold_scalars_and_refuse_the_rest():
    """The stand-in for a fused head's logits: token slices and positive scalar factors are
    exact (the factor becomes a temperature), anything else raises UnfusableLogits."""
    import vtp_runtime as vtp
    from vtp_runtime.integrations.lm_head import HeadLogits, UnfusableLogits

    torch.manual_seed(0)
    head = torch.nn.Linear(4, 7, dtype=torch.float64)
    hidden = torch.randn(2, 5, 4, dtype=torch.float64)
    labels = torch.randint(0, 7, (2, 4))
    fused = (HeadLogits(hidden, head, None) * 3.0 / 2)[:, :-1]  # Cohere / Granite style, then a causal shift
    assert fused.shape == (2, 4, 7) and fused.scale == 1.5
    op_head, options = fused.vtp_inputs(temperature=0.5)
    with vtp.use_backend("eager"):
        got = vtp.logprobs(op_head, labels, **options)
    want = torch.log_softmax(head(hidden)[:, :-1] * 1.5 / 0.5, -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(got, want)
    for bad in (
        lambda x: x + 1,
        lambda x: -x,
        lambda x: x * -2.0,
        lambda x: torch.tanh(x),
        lambda x: x[..., :3],
        lambda x: x.float(),
    ):
        with pytest.raises(UnfusableLogits):
            bad(fused)
    assert not hasattr(fused, "float")  # probes answer False rather than raising
