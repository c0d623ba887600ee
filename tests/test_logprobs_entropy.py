"""``logprobs(..., return_entropy=True)``: the log-probs and the entropy from one read of the
logits, against the float64 reference (through ``run_case``, which checks both outputs and
the gradient of ``sum(lp * g_lp) + sum(H * g_H)``), on eager and on triton under the
interpreter at TP 1, 2 and 4 with uneven and empty shards; the top-k masking rule; dispatch
refusing a backend that does not declare the feature; DTensor logits."""

from typing import Any, cast

import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime.backend import ALL_DTYPES, OpCapability
from vtp_runtime.backends.eager import EagerBackend
from vtp_runtime.errors import BackendUnavailable, ShardError
from vtp_runtime.registry import hookimpl, registered
from vtp_runtime.testing import conformance
from vtp_runtime.testing.cases import Case, run_case
from vtp_runtime.testing.reference import values_and_grads

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN/inf edges in the interpreter

ON = (("return_entropy", True),)

# TP 4 on triton: uneven and empty shards, a [N] and an [N, k] index, masked entries, temperature
TRITON_TP4 = [
    Case("logprobs", layout="uneven", shape=(2, 3), options=ON, backend="triton", seed=1),
    Case(
        "logprobs",
        layout="empty",
        shape=(2, 3),
        topk=3,
        masked="labels",
        backend="triton",
        seed=2,
        options=ON + (("temperature", 0.7), ("reduction", "mean")),
    ),
    Case(
        "logprobs",
        layout="explicit",
        shape=(2, 3),
        topk=2,
        dtype="bfloat16",
        backend="triton",
        seed=3,
        options=ON + (("reduction", "sum"), ("normalizer", 5)),
    ),
    # an [N] index reduced in the kernels (both outputs, one count), an empty shard
    Case(
        "logprobs",
        layout="empty",
        shape=(2, 3),
        masked="labels",
        backend="triton",
        seed=4,
        options=ON + (("reduction", "mean"),),
    ),
]
TRITON_TP2 = [c.with_(layout={"explicit": "uneven"}.get(c.layout, c.layout)) for c in TRITON_TP4]


@pytest.mark.parametrize("case", TRITON_TP4, ids=lambda c: c.id)
def test_triton_tp4(ranks, case):
    ranks(4, run_case, case, timeout=300)


@pytest.mark.parametrize("case", TRITON_TP2, ids=lambda c: c.id)
def test_triton_tp2(ranks, case):
    ranks(2, run_case, case, timeout=300)


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reduced_pair_of_a_token_index(backend, reduction):
    """Both outputs of an ``[N]`` index summed or averaged in one reduction (they count the same
    tokens): values and the gradient of ``sum(lp * g_lp) + sum(H * g_H)`` against float64, with
    about a quarter of the labels ignored; with every label ignored, both 0 and no gradient."""
    options = ON + (("reduction", reduction),)
    for seed in (4, 5):
        case = Case("logprobs", shape=(2, 5), masked="labels", backend=backend, seed=seed, options=options)
        run_case(0, 1, None, case)
    z = torch.randn(3, 40, requires_grad=True)
    lp, h = vtp.logprobs(z, torch.full((3,), -100), backend=backend, **dict(options))
    (lp * 2 + h * 3).backward()
    assert lp.item() == 0.0 and h.item() == 0.0 and z.grad is not None and (z.grad == 0).all()


@pytest.mark.parametrize("world", conformance.tp_sizes(2, 4))
def test_eager_float64_uneven_and_empty(ranks, world):
    for layout in ("uneven", "empty"):
        for topk in (0, 3):
            case = Case("logprobs", dtype="float64", layout=layout, topk=topk, masked="labels", options=ON, seed=topk)
            ranks(world, run_case, case, timeout=120)


def _topk_masking(backend):
    """Row 0: every entry ignored (masked: entropy exactly 0, gradient exactly 0); row 1: one
    entry ignored (its entropy counts); row 2: none ignored."""
    torch.manual_seed(0)
    z = (torch.randn(3, 40, dtype=torch.float64) * 2).float().requires_grad_()
    index = torch.tensor([[-100, -100], [5, -100], [7, 39]])
    lp, h = vtp.logprobs(z, index, return_entropy=True, backend=backend)
    g_lp, g_h = torch.randn(3, 2, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    (lp.double() * g_lp).sum().add((h.double() * g_h).sum()).backward()
    kept = torch.tensor([False, True, True])
    ref_h, (ref_gh,) = values_and_grads("entropy", (z.detach(),), None, g_h, mask=kept)
    ref_lp, (ref_glp,) = values_and_grads("logprobs", (z.detach(),), index, g_lp)
    assert z.grad is not None and ref_gh is not None and ref_glp is not None
    assert h[0].item() == 0.0 and (z.grad[0] == 0).all()
    torch.testing.assert_close(h.double(), ref_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(z.grad.double(), ref_gh + ref_glp, atol=1e-5, rtol=1e-4)
    # mean: the entropy over the tokens with some entry kept (2), the log-probs over entries (3)
    lp_mean, h_mean = vtp.logprobs(z, index, return_entropy=True, reduction="mean", backend=backend)
    torch.testing.assert_close(h_mean.double(), ref_h.sum() / 2)
    torch.testing.assert_close(lp_mean.double(), ref_lp.sum() / 3)


@pytest.mark.parametrize("backend", conformance.backends_with("logprobs", "return_entropy", "topk"))
def test_topk_token_is_masked_only_when_every_entry_is_ignored(backend):
    _topk_masking(backend)


def test_entropy_bonus_objective_backpropagates():
    """The RL objective ``(lp * adv).sum() + c * ent.sum()`` against float64 autograd."""
    torch.manual_seed(1)
    z = torch.randn(2, 5, 30, requires_grad=True)
    y = torch.randint(0, 30, (2, 5))
    adv = torch.randn(2, 5)
    lp, ent = vtp.logprobs(z, y, return_entropy=True)
    ((lp * adv).sum() + 0.01 * ent.sum()).backward()
    z64 = z.detach().double().requires_grad_()
    logp = torch.log_softmax(z64, -1)
    want_ent = -(logp.exp() * logp).sum(-1)
    ((logp.gather(-1, y[..., None]).squeeze(-1) * adv).sum() + 0.01 * want_ent.sum()).backward()
    torch.testing.assert_close(ent.double(), want_ent.detach(), atol=1e-5, rtol=1e-5)
    assert z.grad is not None
    torch.testing.assert_close(z.grad.double(), z64.grad, atol=1e-6, rtol=1e-4)


class _NoEntropy(EagerBackend):
    name = "lp_no_entropy"
    priority = -5
    ops = {"logprobs": OpCapability(device_types=None, dtypes=ALL_DTYPES, features=frozenset({"topk", "temperature"}))}


class _Plugin:
    @hookimpl
    def vtp_runtime_register_backends(self, register):
        register(_NoEntropy())


def test_dispatch_refuses_a_backend_that_does_not_declare_it():
    z, y = torch.randn(3, 8), torch.randint(0, 8, (3,))
    with registered(_Plugin(), name="lp-no-entropy"):
        assert vtp.explain("logprobs", z, y, return_entropy=True).request.features == {"return_entropy"}
        out = vtp.logprobs(z, y, backend="lp_no_entropy")
        assert isinstance(out, torch.Tensor) and out.shape == (3,)
        with pytest.raises(BackendUnavailable, match="does not support return_entropy"):
            vtp.logprobs(z, y, return_entropy=True, backend="lp_no_entropy")
        with pytest.raises(BackendUnavailable, match="does not implement op 'logprobs'"):
            vtp.logprobs(z, y, return_entropy=True, backend="liger")


def test_option_must_be_a_bool():
    with pytest.raises(ValueError, match="return_entropy must be a bool"):
        vtp.logprobs(torch.randn(2, 5), torch.tensor([1, 2]), return_entropy=cast(Any, 1))  # not a bool, on purpose


def _disagree(rank, world, group):
    z, y = torch.randn(3, 4), torch.randint(0, 8, (3,))
    with pytest.raises(ShardError):
        vtp.logprobs(z, y, return_entropy=rank == 0, tp_group=group)
    return True


def test_ranks_that_disagree_raise_on_every_rank(ranks):
    assert ranks(2, _disagree, timeout=60) == [True, True]


def _dtensor_pair(rank, world, group):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tests.helpers import as_dtensor, pool_mesh

    mesh = pool_mesh(world, (world,))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 10, generator=gen) * 2
    y = torch.randint(0, 10, (4, 3), generator=gen)
    y[1, 2] = -100
    dx = distribute_tensor(x, mesh, (Shard(2),)).requires_grad_()
    out = vtp.logprobs(dx, distribute_tensor(y, mesh, (Replicate(),)), return_entropy=True, backend="eager")
    lp, h = (as_dtensor(o) for o in out)
    assert lp.placements == h.placements == (Replicate(),) and h.shape == (4, 3)
    (lp.sum() + h.sum()).backward()
    n = y.numel()
    keep = y.reshape(n) != -100
    ref_lp, (g_lp,) = values_and_grads("logprobs", (x.reshape(n, 10),), y.reshape(n))
    ref_h, (g_h,) = values_and_grads("entropy", (x.reshape(n, 10),), None, mask=keep)
    torch.testing.assert_close(lp.full_tensor().double(), ref_lp.view(4, 3))
    torch.testing.assert_close(h.full_tensor().double(), ref_h.view(4, 3))
    assert g_lp is not None and g_h is not None
    torch.testing.assert_close(
        as_dtensor(dx.grad).full_tensor().double(), (g_lp + g_h).view(x.shape), atol=1e-6, rtol=1e-5
    )
    return True


def test_dtensor_logits_give_a_pair_of_dtensors(ranks):
    assert ranks(4, _dtensor_pair, timeout=120) == [True] * 4
