"""``kl(student, TopK(logprobs, index), tail=...)``: distillation from a teacher given by its
top-k log-probs and global ids, against the float64 reference (``reference.topk_kl``, which
sums the student's residual mass over the complement of the k ids directly), at TP 1, 2
and 4 with uneven and empty shards (the k ids of a token fall on different ranks), forward
and reverse, tail on and off, masked tokens, padded entries, reductions, the teacher's
gradient; repeated ids rejected on every rank; the residual where the k ids hold almost all
of the student's mass; inside torch.compile (no graph break, NaN for a bad token), and
log-probs that are not log-probabilities refused."""

import math
from dataclasses import dataclass, replace
from typing import Any, cast

import pytest
import torch

import vtp_runtime as vtp
from tests.helpers import FullInputs, max_error
from vtp_runtime.errors import ShardError
from vtp_runtime.testing import conformance
from vtp_runtime.testing.cases import DTYPES, shard_sizes
from vtp_runtime.testing.reference import topk_kl

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN/inf edges in the interpreter

VALUE_RTOL = {"float64": 1e-9, "float32": 2e-5, "bfloat16": 2e-5}
GRAD_RTOL = {"float64": 1e-7, "float32": 2e-4, "bfloat16": 2e-2}


@dataclass(frozen=True)
class TopKCase:
    k: int = 4
    shape: tuple = (3, 4)
    vocab: int = 37
    layout: str = "uneven"
    dtype: str = "float64"
    tail: bool = False
    reverse: bool = False
    masked: str = ""  # "", "mask" or "labels": about a quarter of the tokens dropped
    pad: bool = False  # some entries of the index are ignore_index
    options: tuple = ()  # (name, value) pairs: temperature, reduction, normalizer
    teacher_grad: bool = False
    backend: str = "eager"
    seed: int = 0

    @property
    def id(self) -> str:
        parts = [
            self.dtype,
            self.layout,
            f"k{self.k}",
            "tail" if self.tail else "",
            "reverse" if self.reverse else "",
            self.masked,
            "pad" if self.pad else "",
            "tgrad" if self.teacher_grad else "",
            self.backend,
            ",".join(f"{k}={v}" for k, v in self.options),
        ]
        return "-".join(p for p in parts if p)


def _inputs(case: TopKCase, vocab: int):
    """Full inputs, the same on every rank: student logits, the teacher's top-k (shuffled
    along k, so that order carries nothing), the masking options."""
    g = torch.Generator().manual_seed(case.seed)
    n = math.prod(case.shape)
    student = torch.randn(*case.shape, vocab, generator=g, dtype=torch.float64) * 3
    teacher = torch.log_softmax(torch.randn(n, vocab, generator=g, dtype=torch.float64) * 3, -1)
    lp, ids = teacher.topk(case.k, dim=-1)
    order = torch.argsort(torch.rand(n, case.k, generator=g), dim=-1)
    lp, ids = lp.gather(1, order), ids.gather(1, order)
    if case.pad:
        drop = torch.rand(n, case.k, generator=g) < 0.3
        ids[drop] = -100
        lp[drop] = 0.0  # padding: whatever is stored there is never read
    extra = {}
    if case.masked:
        keep = torch.rand(case.shape, generator=g) >= 0.25
        if case.masked == "mask":
            extra["mask"] = keep
        else:
            labels = torch.randint(0, vocab, case.shape, generator=g)
            labels[~keep] = -100
            extra["labels"] = labels
    return student, lp.view(*case.shape, case.k), ids.view(*case.shape, case.k), extra


def run_topk_case(rank, world, group, case: TopKCase):
    vocab = case.vocab - case.vocab % world if case.layout == "even" else case.vocab
    sizes, _ = shard_sizes(case.layout, vocab, world, case.seed)
    vocab = sum(sizes)
    student, lp_t, ids, extra = _inputs(case, vocab)
    start = sum(sizes[:rank])
    end = start + sizes[rank]
    n = math.prod(case.shape)
    opts = dict(case.options)
    local = student[..., start:end].to(DTYPES[case.dtype]).contiguous().requires_grad_()
    teacher_lp = lp_t.clone().requires_grad_(case.teacher_grad)
    out = vtp.kl(
        local,
        vtp.TopK(teacher_lp, ids),
        tail=case.tail,
        reverse=case.reverse,
        backend=case.backend,
        tp_group=group if world > 1 else None,
        **opts,
        **extra,
    )

    full = student.to(DTYPES[case.dtype]).double().reshape(n, vocab).requires_grad_()
    ref_lp = lp_t.reshape(n, case.k).clone().requires_grad_()
    # k = V: both residuals are 0 and the tail adds nothing (the reference's 1 - sum of the
    # teacher's probabilities is a rounding error there, of either sign)
    ref = topk_kl(
        full,
        ref_lp,
        ids.reshape(n, case.k),
        temperature=opts.get("temperature", 1.0),
        reverse=case.reverse,
        tail=case.tail and case.k < vocab,
        **{k: v.reshape(n) for k, v in extra.items()},
    )
    reduction = opts.get("reduction", "none")
    if reduction == "none":
        ref_out = ref.view(case.shape)
    else:
        keep = torch.ones(n, dtype=torch.bool)
        if "mask" in extra:
            keep &= extra["mask"].reshape(n)
        if "labels" in extra:
            keep &= extra["labels"].reshape(n) != -100
        div = opts.get("normalizer") or (1 if reduction == "sum" else max(int(keep.sum()), 1))
        ref_out = ref.sum() / div
    _close("value", out.detach().double(), ref_out.detach(), VALUE_RTOL[case.dtype])
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(case.seed + 7), dtype=torch.float64)
    (out.double() * upstream).sum().backward()
    (ref_out * upstream).sum().backward()
    want = full.grad.view(*case.shape, vocab)[..., start:end]
    assert local.grad.dtype == local.dtype
    _close("student grad", local.grad.double(), want, GRAD_RTOL[case.dtype])
    if case.teacher_grad:
        _close("teacher grad", teacher_lp.grad.double(), ref_lp.grad.view(lp_t.shape), GRAD_RTOL[case.dtype])
    return True


def _close(what, got, want, rtol):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN where the reference has none"
    finite = torch.isfinite(want)
    assert torch.equal(torch.isinf(got), torch.isinf(want)), f"{what}: infinities differ"
    scale = want[finite].abs().max().item() if finite.any() else 0.0
    err = (got[finite] - want[finite]).abs()
    bad = err > rtol * max(scale, 1e-3) + rtol * want[finite].abs()
    assert not bad.any(), f"{what}: max error {err.max().item():.3g} (rtol {rtol:g}, scale {scale:.3g})"


BASE = TopKCase()
TP1 = [
    BASE,
    replace(BASE, tail=True),
    replace(BASE, reverse=True),
    replace(BASE, reverse=True, tail=True, seed=1),
    replace(BASE, tail=True, masked="mask", options=(("reduction", "mean"),), seed=2),
    replace(BASE, tail=True, reverse=True, masked="labels", pad=True, seed=3),
    replace(BASE, tail=True, teacher_grad=True, options=(("temperature", 0.7),), seed=4),
    replace(
        BASE, reverse=True, tail=True, teacher_grad=True, options=(("reduction", "sum"), ("normalizer", 5)), seed=5
    ),
    replace(BASE, k=1, tail=True, seed=6),
    replace(BASE, k=37, vocab=37, tail=True, seed=7),  # k = V: no residual
    replace(BASE, dtype="float32", tail=True, masked="labels", seed=8),
    replace(BASE, dtype="bfloat16", reverse=True, tail=True, seed=9),
    replace(BASE, dtype="float32", tail=True, pad=True, backend="triton", shape=(2, 3), seed=10),
    replace(BASE, dtype="float32", reverse=True, tail=True, masked="mask", backend="triton", shape=(2, 3), seed=11),
]
TPN = [
    replace(BASE, layout="uneven", tail=True, masked="labels", seed=20),
    replace(BASE, layout="empty", reverse=True, tail=True, pad=True, seed=21),
    replace(BASE, layout="uneven", teacher_grad=True, options=(("temperature", 2.0), ("reduction", "mean")), seed=22),
]


@pytest.mark.parametrize("case", TP1, ids=lambda c: c.id)
def test_tp1(case):
    assert run_topk_case(0, 1, None, case)


@pytest.mark.parametrize("world", conformance.tp_sizes(2, 4))
@pytest.mark.parametrize("case", TPN, ids=lambda c: c.id)
def test_tp(ranks, world, case):
    assert ranks(world, run_topk_case, case, timeout=120) == [True] * world


def test_tp2_triton(ranks):
    case = replace(
        BASE, dtype="float32", layout="empty", tail=True, masked="labels", backend="triton", shape=(2, 3), seed=30
    )
    assert ranks(2, run_topk_case, case, timeout=300) == [True, True]


def test_the_ids_of_a_token_fall_on_several_ranks():
    """The cases above are not all one-rank lookups: with the 4-way uneven shards of TPN, the
    k ids of some token live on at least three different ranks."""
    case = TPN[0]
    sizes, _ = shard_sizes(case.layout, case.vocab, 4, case.seed)
    _, _, ids, _ = _inputs(case, sum(sizes))
    bounds = torch.tensor(sizes).cumsum(0)
    owners = torch.bucketize(ids.reshape(-1, case.k), bounds, right=True)
    assert max(len(set(row.tolist())) for row in owners) >= 3


def _repeated(rank, world, group):
    z = torch.randn(2, 10, dtype=torch.float64)
    ids = torch.tensor([[0, 3, 9], [4, 7, 4]])
    lp = torch.full((2, 3), -2.0, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"repeats an id on token \(1,\)"):
        vtp.kl(z, vtp.TopK(lp, ids), tp_group=group)
    padded = torch.tensor([[0, -100, -100], [4, 7, 9]])  # repeated padding is fine
    assert torch.isfinite(vtp.kl(z, vtp.TopK(lp, padded), tp_group=group, tail=True)).all()
    # an id outside [0, V) gives NaN for its token only, as for logprobs
    out = vtp.kl(z, vtp.TopK(lp, torch.tensor([[0, 1, 2], [4, 7, 10 * world]])), tp_group=group)
    assert torch.isfinite(out[0]) and torch.isnan(out[1])
    return True


def test_repeated_ids_are_rejected_on_every_rank(ranks):
    assert _repeated(0, 1, None)
    assert ranks(2, _repeated, timeout=60) == [True, True]


def _one_rank_fails(rank, world, group):
    z = torch.randn(2, 10)
    ids = torch.tensor([[0, 3], [4, 7]])
    lp = torch.full((2, 2), -2.0)
    teacher = vtp.TopK(lp[:, :1], ids) if rank == 1 else vtp.TopK(lp, ids)  # a wrong shape on rank 1
    with pytest.raises((ValueError, ShardError)) as info:
        vtp.kl(z, teacher, tail=True, tp_group=group)
    return type(info.value).__name__


def test_a_bad_teacher_on_one_rank_raises_on_every_rank(ranks):
    """Rank 1's TopK fails its local checks; rank 0 is already in the log-probs' metadata
    gather: both raise (rank 1 its own error, rank 0 one naming rank 1), neither hangs."""
    assert ranks(2, _one_rank_fails, timeout=60) == ["ShardError", "ValueError"]


def _confident(dtype):
    """A student with all but about 1e-8 of its mass on the teacher's k ids; the teacher's
    residual is 0.05."""
    v = 64
    z = torch.full((2, v), -12.0, dtype=torch.float64)
    ids = torch.tensor([[3, 17, 40, 63], [0, 1, 2, 5]])
    z.scatter_(1, ids, torch.tensor([[10.0, 9.0, 8.0, 7.5], [9.0, 9.5, 8.0, 8.0]], dtype=torch.float64))
    lp_t = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05], [0.4, 0.4, 0.1, 0.05]], dtype=torch.float64))
    student = z.to(dtype, copy=True).requires_grad_()
    out = vtp.kl(student, vtp.TopK(lp_t, ids), tail=True)
    out.sum().backward()
    full = z.clone().requires_grad_()  # the float64 logits: rounding them to fp32 moves r_s by ~1e-15
    ref = topk_kl(full, lp_t, ids, tail=True)
    ref.sum().backward()
    r_s = torch.softmax(z, -1).scatter(1, ids, 0.0).sum(-1)
    assert student.grad is not None
    return out.detach().double(), ref.detach(), student.grad.double(), full.grad, r_s


def test_residual_when_the_ids_hold_almost_all_the_mass():
    # fp64: r_s ~ 1e-8 is resolved; values and gradients match the reference, which sums the
    # student's residual over the complement of the ids directly
    out, ref, grad, ref_grad, r_s = _confident(torch.float64)
    assert (r_s < 2e-8).all()
    torch.testing.assert_close(out, ref, rtol=1e-7, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-9)
    # fp32: r_s is below what fp32 log-probs resolve (1 - sum p_s rounds to 0). log r_s is
    # floored at log(eps): finite value and gradient, below the truth by r_t log(eps / r_s)
    out, ref, grad, _, r_s = _confident(torch.float32)
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()
    floor_gap = 0.05 * torch.log(torch.finfo(torch.float32).eps / r_s)
    torch.testing.assert_close(ref - out, floor_gap, rtol=1e-3, atol=1e-4)


def test_options_and_errors():
    z = torch.randn(3, 10)
    ids = torch.tensor([[1, 2], [3, 4], [5, 6]])
    lp = torch.full((3, 2), -1.5)
    with pytest.raises(ValueError, match="tail= applies to a teacher given as vtp.TopK"):
        vtp.kl(z, torch.randn(3, 10), tail=True)
    with pytest.raises(ValueError, match="same shape"):
        vtp.kl(z, vtp.TopK(lp[:, :1], ids))
    with pytest.raises(ValueError, match="student's token shape"):
        vtp.kl(z, vtp.TopK(lp[:2], ids[:2]))
    with pytest.raises(TypeError, match="TopK.index must be an integer"):
        vtp.kl(z, vtp.TopK(lp, ids.float()))
    with pytest.raises(TypeError, match="unknown option"):
        vtp.kl(z, vtp.TopK(lp, ids), beta=0.5)
    with pytest.raises(ValueError, match="tail must be a bool"):
        vtp.kl(z, vtp.TopK(lp, ids), tail=cast(Any, 1))  # not a bool, on purpose
    # the entry points agree, and explain names what runs the student's log-probs
    a = vtp.kl(z, vtp.TopK(lp, ids), tail=True, reduction="sum")
    b = vtp.loss("kl", z, vtp.TopK(lp, ids), tail=True, reduction="sum")
    assert torch.equal(a, b)
    ex = vtp.explain("kl", z, vtp.TopK(lp, ids), tail=True, backend="eager")
    assert ex.backend == "eager" and ex.request.op == "logprobs" and "topk" in ex.request.features


def _dtensor_student(rank, world, group):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from tests.helpers import pool_mesh

    mesh = pool_mesh(world, (world,))
    case = replace(BASE, vocab=10, tail=True, masked="labels", seed=40)
    student, lp_t, ids, extra = _inputs(case, 10)
    ds = distribute_tensor(student, mesh, (Shard(2),)).requires_grad_()
    labels = distribute_tensor(extra["labels"], mesh, (Replicate(),))
    out = vtp.kl(ds, vtp.TopK(lp_t, ids), tail=True, labels=labels, reduction="sum", backend="eager")
    assert isinstance(out, DTensor) and out.placements == (Replicate(),)
    out.backward()
    full = student.reshape(-1, 10).clone().requires_grad_()
    ref = topk_kl(
        full, lp_t.reshape(-1, case.k), ids.reshape(-1, case.k), tail=True, labels=extra["labels"].reshape(-1)
    ).sum()
    ref.backward()
    torch.testing.assert_close(out.full_tensor(), ref.detach())
    assert isinstance(ds.grad, DTensor) and full.grad is not None
    torch.testing.assert_close(ds.grad.full_tensor(), full.grad.view(student.shape))
    return True


def test_dtensor_student(ranks):
    assert ranks(4, _dtensor_student, timeout=120) == [True] * 4


# == 7, 8. kl with a TopK teacher inside torch.compile; log-probs that are not ===============


def _topk_step(z, lp, ids):
    return (
        vtp.kl(z, vtp.TopK(lp, ids), backend="eager"),
        vtp.kl(z, vtp.TopK(lp, ids), reverse=True, tail=True, backend="eager"),
    )


_COMPILED: dict = {}


def _compiled_topk_step():
    if "topk" not in _COMPILED:
        _COMPILED["topk"] = torch.compile(_topk_step, backend="aot_eager", fullgraph=True)
    return _COMPILED["topk"]


def _topk_reference(z, lp, ids):
    return topk_kl(z, lp, ids), topk_kl(z, lp, ids, reverse=True, tail=True)


def test_topk_kl_compiles_with_no_graph_break():
    """Item 7: ``kl(student, vtp.TopK(...))`` under ``torch.compile(fullgraph=True)``
    compiles with no graph break (the repeated-id check may not read the device on the
    host there), and its values and student gradient match float64 and eager mode."""
    from torch._dynamo.utils import counters

    counters.clear()
    d = FullInputs(6, seed=3, vocab=13)
    z = d.z.clone().requires_grad_()
    got = _compiled_topk_step()(z, d.lp, d.ids)
    (grad,) = torch.autograd.grad(got[0].sum() + got[1].sum(), z)
    zr = d.z.clone().requires_grad_()
    want = _topk_reference(zr, d.lp, d.ids)
    (want_grad,) = torch.autograd.grad(want[0].sum() + want[1].sum(), zr)
    ze = d.z.clone().requires_grad_()
    eager = _topk_step(ze, d.lp, d.ids)
    (eager_grad,) = torch.autograd.grad(eager[0].sum() + eager[1].sum(), ze)
    for g, w, e in zip((*got, grad), (*want, want_grad), (*eager, eager_grad)):
        assert max_error(g, w) < 1e-10 and max_error(g, e) < 1e-12
    assert not counters["graph_break"]


def test_compiled_topk_kl_gives_nan_for_a_bad_token():
    """Items 7 and 8 inside torch.compile, where the host cannot read the device: a token
    whose TopK repeats an id, and one whose log-probs are raw logits (probabilities summing
    above 1), give NaN in every output (tail or not); every other token matches float64."""
    d = FullInputs(6, seed=4, vocab=13)
    lp, ids = d.lp.clone(), d.ids.clone()
    ids[1, 2] = ids[1, 0]
    lp[3] = torch.tensor([2.5, 1.5, 0.5], dtype=torch.float64)
    got = _compiled_topk_step()(d.z, lp, ids)
    good = [0, 2, 4, 5]
    want = _topk_reference(d.z[good], d.lp[good], d.ids[good])
    for g, w in zip(got, want):
        assert g[[1, 3]].isnan().all(), g
        assert max_error(g[good], w) < 1e-10


@pytest.mark.parametrize("tail", [False, True])
def test_topk_logprobs_that_are_not_logprobs_raise(tail):
    """Item 8 in eager mode: TopK log-probs whose k probabilities sum above 1 (raw logits
    passed by mistake, or a distribution that is not one) raise a ValueError, forward and
    reverse, with ``tail=True`` (which would otherwise drop the residual silently) and
    without. Log-probs that sum to 1 up to rounding (all V of them, in float32) and padded
    entries holding anything are accepted and match float64."""
    d = FullInputs(5, seed=8, vocab=13)
    raw = d.lp.clone()
    raw[2] = torch.tensor([3.0, 2.0, 0.5], dtype=torch.float64)
    over = d.lp.clone()
    over[4] = torch.tensor([0.6, 0.5, 0.2], dtype=torch.float64).log()  # sums to 1.3
    for bad in (raw, over):
        for reverse in (False, True):
            with pytest.raises(ValueError, match="logprobs"):
                vtp.kl(d.z, vtp.TopK(bad, d.ids), tail=tail, reverse=reverse)

    full = torch.log_softmax(d.t.float() * 3, -1)  # k = V: sums to 1 up to float32 rounding
    ids = torch.arange(13).expand(5, 13).contiguous()
    got = vtp.kl(d.z, vtp.TopK(full, ids), tail=tail)
    # all V ids: no residual mass, with or without the tail term (the rounding's residual
    # against the student's exact 0 gives the float64 reference an infinite tail term)
    assert max_error(got, topk_kl(d.z, full.double(), ids)) < 1e-5
    padded_lp, padded_ids = d.lp.clone(), d.ids.clone()
    padded_lp[:, -1], padded_ids[:, -1] = 5.0, -100  # padding: never read
    got = vtp.kl(d.z, vtp.TopK(padded_lp, padded_ids), tail=tail)
    assert max_error(got, topk_kl(d.z, padded_lp, padded_ids, tail=tail)) < 1e-10
