"""``sp_group=``, ranks holding other tokens of the batch (Ulysses, context parallelism),
against the float64 reference on the full (unsharded) data, on gloo ranks: alone and on a
2 x 2 TP x SP grid (plain groups, DTensors on a 2-D mesh, Heads), sum and mean with
ignore_index and a normalizer; mismatches between ranks, which raise on every rank and leave
every rank able to make the next call; the guide's examples as written. The Megatron
layout, ``Head(sequence_parallel=True)``, is in test_head_sequence_parallel.py."""

import datetime
import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import vtp_runtime as vtp
from tests.helpers import ROOT, run_main, torchrun_examples
from vtp_runtime.testing.distributed import outcome
from vtp_runtime.testing.head_cases import token_split

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's -inf arithmetic

TIMEOUT = 20  # seconds: the collective timeout of the groups the jobs make


# -- sp_group: ranks holding other tokens of the batch ------------------------------------------

_GROUPS: dict = {}


def _new_group(members):
    return dist.new_group(members, timeout=datetime.timedelta(seconds=TIMEOUT))


def _grid(rank):
    """The 2 x 2 TP x SP grid of a 4-rank pool (made once per rank process; new_group is a
    collective of every rank): rank = 2 * s + t holds token shard s, vocabulary shard t."""
    if "grid" not in _GROUPS:
        tp = [_new_group(m) for m in ([0, 1], [2, 3])]
        sp = [_new_group(m) for m in ([0, 2], [1, 3])]
        _GROUPS["grid"] = tp, sp
    tp, sp = _GROUPS["grid"]
    s, t = divmod(rank, 2)
    return tp[s], sp[t], s, t


VOCAB_SIZES = (6, 5)  # the two vocabulary shards of the grid: uneven


def _full_data(n, v, seed):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::4] = -100
    return student, teacher, labels


def _reduced(values, reduction, count, normalizer):
    if reduction == "none":  # per token (a normalizer divides each)
        return values if normalizer is None else values / normalizer
    total = values.sum()
    if normalizer is not None:
        return total / normalizer
    return total / max(count, 1) if reduction == "mean" else total


# (op, options, token split): each runs with reductions sum and mean, and a normalizer
SP_GROUP_CASES = [
    ("cross_entropy", (("label_smoothing", 0.1),), "uneven"),
    ("cross_entropy", (("z_loss", 1e-3), ("ignore_index", -100)), "empty"),
    ("jsd", (("beta", 0.3),), "uneven"),
    ("entropy", (), "even"),
    ("logprobs", (("return_entropy", True),), "uneven"),
]


def sp_group_call(rank, world, group, op, options, split, reduction, normalizer, grid, backend="eager"):
    """One call with sp_group (and on the grid a tp_group too) against the reference on every
    token: the value, replicated, and this rank's gradient of the global loss."""
    n, v = 11, sum(VOCAB_SIZES)
    student, teacher, labels = _full_data(n, v, seed=len(op) + 3 * len(options))
    if grid:
        tp, sp, s, t = _grid(rank)
        sp_rank, sp_size = s, 2
        start = sum(VOCAB_SIZES[:t])
        vocab = slice(start, start + VOCAB_SIZES[t])
    else:
        tp, sp, sp_rank, sp_size, vocab = None, group, rank, world, slice(None)
    rows = token_split(split, n, sp_size, 1)
    first = sum(rows[:sp_rank])
    mine = slice(first, first + rows[sp_rank])
    opts = dict(options)
    dtype = torch.float64 if backend == "eager" else torch.float32
    tol: dict[str, Any] = dict(rtol=1e-10, atol=1e-12) if backend == "eager" else dict(rtol=2e-5, atol=1e-6)
    x = student[mine, vocab].to(dtype).requires_grad_(True)
    tensors = [x]
    kw = dict(opts, reduction=reduction, tp_group=tp, sp_group=sp, backend=backend)
    if normalizer is not None:
        kw["normalizer"] = normalizer if normalizer != "tensor" else torch.tensor(7)
    if op in ("cross_entropy",):
        tensors.append(labels[mine])
    elif op == "logprobs":
        tensors.append(torch.where(labels[mine] < 0, labels[mine], (labels[mine] * 3) % v))
    elif op == "jsd":
        tensors.append(teacher[mine, vocab].to(dtype))
        kw["labels"] = labels[mine]
    else:
        kw["mask"] = labels[mine] >= 0
    out = vtp.loss(op, *tensors, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    sum(o.sum() * (i + 1) for i, o in enumerate(outs)).backward()

    # the reference: every token, reduced as one batch
    ref_opts = {k: val for k, val in opts.items() if k != "return_entropy"}
    index = None
    if op == "cross_entropy":
        index = labels
    elif op == "logprobs":
        index = torch.where(labels < 0, labels, (labels * 3) % v)
    leaves = [student.clone().requires_grad_(True)]
    if op == "jsd":
        leaves.append(teacher.clone())
        ref_opts["labels"] = labels
    if op == "entropy":
        ref_opts["mask"] = labels >= 0
    from vtp_runtime.testing.reference import values as ref_values

    value = ref_values(op, tuple(leaves), index, **ref_opts)
    kept = (labels >= 0).sum().item()
    norm = None if normalizer is None else 7.0
    refs = [_reduced(value, reduction, kept, norm)]
    if op == "logprobs":
        entropy = ref_values("entropy", (leaves[0],), None, mask=labels >= 0)
        refs.append(_reduced(entropy, reduction, kept, norm))
    sum(r.sum() * (i + 1) for i, r in enumerate(refs)).backward()
    for got, want in zip(outs, refs):
        want = want if reduction != "none" else want[mine]
        torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(x.grad.double(), leaves[0].grad[mine, vocab], **tol)
    return outs[0].detach() if reduction != "none" else None


@pytest.mark.parametrize("normalizer", [None, 7, "tensor"])
@pytest.mark.parametrize("op,options,split", SP_GROUP_CASES, ids=[c[0] + "-" + c[2] for c in SP_GROUP_CASES])
def test_sp_group_alone(ranks, op, options, split, normalizer):
    for reduction in ("mean", "sum", "none"):
        results = ranks(2, sp_group_call, op, options, split, reduction, normalizer, False, timeout=90)
        if reduction != "none":
            assert torch.equal(results[0], results[1])  # replicated


@pytest.mark.parametrize("op,options,split", SP_GROUP_CASES[::2], ids=[c[0] + "-" + c[2] for c in SP_GROUP_CASES[::2]])
def test_sp_group_on_a_tp_sp_grid(ranks, op, options, split):
    for reduction, normalizer in (("mean", None), ("sum", 7)):
        results = ranks(4, sp_group_call, op, options, split, reduction, normalizer, True, timeout=120)
        assert all(torch.equal(r, results[0]) for r in results)


@pytest.mark.parametrize("op,options,split", SP_GROUP_CASES[:3:2], ids=["cross_entropy", "jsd"])
def test_sp_group_on_the_grid_triton(ranks, op, options, split):
    ranks(4, sp_group_call, op, options, split, "mean", None, True, "triton", timeout=180)


def heads_on_the_grid(rank, world, group, megatron):
    """A Head with sp_group on the grid: a plain Head (hidden replicated over tp_group), or
    Megatron SP inside each TP group (each TP rank holding half of its group's tokens) with
    context parallelism across the groups."""
    tp, sp, s, t = _grid(rank)
    g = torch.Generator().manual_seed(21)
    n, h, v = 10, 5, sum(VOCAB_SIZES)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    bias = torch.randn(v, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[1] = labels[6] = -100
    rows = token_split("uneven", n, 2, 4)
    first = sum(rows[:s])
    group_tokens = slice(first, first + rows[s])  # the tokens of this rank's TP group
    if megatron:
        inner = token_split("empty" if s else "uneven", rows[s], 2, 2)
        lo = first + sum(inner[:t])
        mine = slice(lo, lo + inner[t])
    else:
        mine = group_tokens
    start = sum(VOCAB_SIZES[:t])
    vocab = slice(start, start + VOCAB_SIZES[t])
    x = hidden[mine].clone().requires_grad_(True)
    w, b = weight[vocab].clone().requires_grad_(True), bias[vocab].clone().requires_grad_(True)
    loss = vtp.cross_entropy(
        vtp.Head(x, w, b, sequence_parallel=megatron, chunk_rows=2),
        labels[group_tokens],
        label_smoothing=0.1,
        reduction="mean",
        tp_group=tp,
        sp_group=sp,
    )
    loss.backward()
    ref_h, ref_w, ref_b = (t_.clone().requires_grad_(True) for t_ in (hidden, weight, bias))
    ref = torch.nn.functional.cross_entropy(ref_h @ ref_w.T + ref_b, labels, label_smoothing=0.1)
    ref.backward()
    assert ref_h.grad is not None and ref_w.grad is not None and ref_b.grad is not None
    assert w.grad is not None and b.grad is not None
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x.grad, ref_h.grad[mine], rtol=1e-10, atol=1e-12)
    # weight and bias: this rank's vocabulary rows, from its TP group's tokens (the SP ranks'
    # parts sum to the full gradient, as data-parallel weight gradients do)
    dw, db = w.grad.clone(), b.grad.clone()
    dist.all_reduce(dw, group=sp)
    dist.all_reduce(db, group=sp)
    torch.testing.assert_close(dw, ref_w.grad[vocab], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(db, ref_b.grad[vocab], rtol=1e-10, atol=1e-12)
    return True


@pytest.mark.parametrize("megatron", [False, True], ids=["plain_head", "megatron_sp_head"])
def test_heads_with_sp_group_on_the_grid(ranks, megatron):
    ranks(4, heads_on_the_grid, megatron, timeout=120)


def dtensor_on_a_2d_mesh(rank, world, group, reduction):
    """Logits DTensor on an (sp, tp) mesh: tokens on "sp", the vocabulary on "tp"; sp_group
    is the group of "sp". A reduced result is the loss of every token, Replicate() on both."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    if "mesh" not in _GROUPS:
        _GROUPS["mesh"] = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("sp", "tp"))
    mesh = _GROUPS["mesh"]
    n, v = 7, 9  # torch's chunking: tokens 4 + 3, vocabulary 5 + 4
    student, _, labels = _full_data(n, v, seed=2)
    x = distribute_tensor(student, mesh, [Shard(0), Shard(1)]).requires_grad_(True)
    y = distribute_tensor(labels, mesh, [Shard(0), Replicate()])
    loss = vtp.cross_entropy(x, y, label_smoothing=0.1, reduction=reduction, sp_group=mesh.get_group("sp"))
    assert isinstance(loss, DTensor)
    assert tuple(loss.placements) == (Replicate(), Replicate())
    loss.backward()
    ref = student.clone().requires_grad_(True)
    want = torch.nn.functional.cross_entropy(ref, labels, label_smoothing=0.1, reduction=reduction)
    want.backward()
    assert isinstance(x.grad, DTensor)
    torch.testing.assert_close(loss.full_tensor(), want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x.grad.full_tensor(), ref.grad, rtol=1e-10, atol=1e-12)
    wrong = outcome(lambda: vtp.cross_entropy(x, y, reduction="mean", sp_group=mesh.get_group("tp")))
    return wrong


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_dtensor_logits_on_a_2d_mesh(ranks, reduction):
    for kind, msg in ranks(4, dtensor_on_a_2d_mesh, reduction, timeout=120):
        assert kind == "ShardError" or kind == "ValueError"
        assert "sp_group is not the process group of a mesh dimension that shards the logits' tokens" in msg


def topk_with_sp_group(rank, world, group):
    n, v, k = 9, 8, 3
    student, teacher, labels = _full_data(n, v, seed=9)
    lp = torch.log_softmax(teacher, -1)
    top = lp.topk(k, -1)
    rows = token_split("uneven", n, world, 3)
    first = sum(rows[:rank])
    mine = slice(first, first + rows[rank])
    x = student[mine].clone().requires_grad_(True)
    loss = vtp.kl(
        x,
        vtp.TopK(top.values[mine], top.indices[mine]),
        tail=True,
        labels=labels[mine],
        reduction="mean",
        sp_group=group,
    )
    loss.backward()
    from vtp_runtime.testing.reference import topk_kl

    ref = student.clone().requires_grad_(True)
    per_token = topk_kl(ref, top.values, top.indices, tail=True, labels=labels)
    want = per_token.sum() / (labels >= 0).sum()
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x.grad, ref.grad[mine], rtol=1e-9, atol=1e-12)
    return True


def test_topk_teacher_with_sp_group(ranks):
    assert all(ranks(2, topk_with_sp_group, timeout=60))


# -- sp_group mismatches: every rank raises, none hangs -----------------------------------------


def _healthy_sp(rank, sp, tp=None, t=None) -> float:
    n, v = 9, sum(VOCAB_SIZES)
    student, _, labels = _full_data(n, v, seed=40)
    rows = token_split("uneven", n, dist.get_world_size(sp), 0)
    first = sum(rows[: dist.get_rank(sp)])
    mine = slice(first, first + rows[dist.get_rank(sp)])
    vocab = slice(None) if t is None else slice(sum(VOCAB_SIZES[:t]), sum(VOCAB_SIZES[: t + 1]))
    got = vtp.cross_entropy(student[mine, vocab], labels[mine], reduction="mean", tp_group=tp, sp_group=sp)
    want = torch.nn.functional.cross_entropy(student, labels)
    return abs(got.item() - want.item())


def sp_mismatches(rank, world, group, once):
    import os

    saved = os.environ.get("VTP_CHECK")
    if once:  # a device-only group's mode, here on gloo: the first call of each kind is checked
        os.environ["VTP_CHECK"] = "once"
    try:
        x, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 6, (4,))
        smoothing: dict[str, Any] = {("label_smothing" if rank == 1 else "label_smoothing"): 0.1}  # rank 1 misspells it
        out = [
            outcome(lambda: vtp.cross_entropy(x, y, label_smoothing=[0.1, 0.2][rank], reduction="sum", sp_group=group)),
            outcome(lambda: vtp.cross_entropy(x, y, reduction=["sum", "none"][rank], sp_group=group)),
            outcome(lambda: vtp.cross_entropy(x, y, reduction="sum", normalizer=[3, 4][rank], sp_group=group)),
            outcome(
                lambda: vtp.cross_entropy(
                    x,
                    y,
                    sp_group=group,
                    reduction="mean",
                    **smoothing,
                )
            ),
            outcome(lambda: vtp.cross_entropy(x.float() if rank else x, y, reduction="mean", sp_group=group)),
            # equal values of other types agree
            outcome(
                lambda: vtp.cross_entropy(
                    x,
                    y,
                    reduction="sum",
                    normalizer=[np.float32(3.0), 3][rank],
                    label_smoothing=[0.5, torch.tensor(0.5)][rank],
                    sp_group=group,
                )
            ),
            outcome(lambda: vtp.cross_entropy(x, y, reduction="sum", tp_group=group, sp_group=group)),
        ]
        return out, _healthy_sp(rank, group)
    finally:
        if saved is None:
            os.environ.pop("VTP_CHECK", None)
        else:
            os.environ["VTP_CHECK"] = saved


@pytest.mark.parametrize("once", [False, True], ids=["gather", "once"])
def test_sp_group_mismatches_raise_on_every_rank(ranks, once):
    results = ranks(2, sp_mismatches, once, timeout=90)
    (ls, red, norm, typo, dtype, alike, same), _ = results[0]
    assert alike == results[1][0][5] == ("no error", "")
    assert same[0] == results[1][0][6][0] == "ValueError" and "sp_group is tp_group" in same[1]
    assert ls == results[1][0][0] and ls[0] == "ShardError" and "label_smoothing: rank 0 = 0.1, rank 1 = 0.2" in ls[1]
    assert red == results[1][0][1] and "reduction: rank 0 = 'sum', rank 1 = 'none'" in red[1]
    assert norm == results[1][0][2] and "normalizer: rank 0 = 3.0, rank 1 = 4.0" in norm[1]
    assert typo[0] == "ShardError" and "failed on rank 1 of sp_group" in typo[1] and "label_smothing" in typo[1]
    assert results[1][0][3][0] == "TypeError"
    assert dtype == results[1][0][4] and dtype[0] == "ShardError" and "dtype" in dtype[1]
    assert max(err for _, err in results) < 1e-12


def grid_failures(rank, world, group):
    """A failure in one TP group reaches the other TP group's ranks through sp_group; then a
    normal call on every rank."""
    tp, sp, s, t = _grid(rank)
    x = torch.randn(4, VOCAB_SIZES[t], dtype=torch.float64)
    y = torch.randint(0, sum(VOCAB_SIZES), (4,))
    bad = outcome(
        lambda: vtp.cross_entropy(
            x, y, tp_group=tp, sp_group=sp, reduction="mean", label_smoothing=2.0 if rank == 0 else 0.0
        )
    )
    differ = outcome(
        lambda: vtp.cross_entropy(x, y, tp_group=tp, sp_group=sp, reduction="mean", label_smoothing=0.1 * s)
    )
    return (bad, differ), _healthy_sp(rank, sp, tp, t)


def test_a_failure_in_one_tp_group_raises_on_the_whole_grid(ranks):
    results = ranks(4, grid_failures, timeout=120)
    bads = [out[0] for out, _ in results]
    assert bads[0][0] == "ValueError" and "label_smoothing must be in [0, 1]" in bads[0][1]
    assert bads[1][0] == "ShardError" and "rank 0 of tp_group" in bads[1][1]
    for kind, msg in bads[2:]:  # the other TP group: through sp_group
        assert kind == "ShardError" and "of sp_group" in msg, msg
    differs = [out[1] for out, _ in results]
    assert all(k == "ShardError" and "label_smoothing: rank 0 = 0.0, rank 1 = 0.1" in m for k, m in differs)
    assert max(err for _, err in results) < 1e-12


def compiled_sp_group(rank, world, group):
    def step(x, y):
        return vtp.cross_entropy(x * 2, y, reduction="mean", sp_group=group) + 1

    x = torch.randn(3 + rank, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 5, (3 + rank,), generator=torch.Generator().manual_seed(rank))
    got = torch.compile(step, backend="eager")(x, y)
    return got, step(x, y)


def test_sp_group_inside_torch_compile_runs_eagerly(ranks):
    """The agreement over sp_group reads the host: inside a compiled function the call is a
    graph break, and runs as it does outside."""
    results = ranks(2, compiled_sp_group, timeout=120)
    for got, want in results:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)


def test_sp_group_must_be_a_process_group():
    with pytest.raises(TypeError, match="sp_group must be a torch.distributed ProcessGroup or None"):
        vtp.cross_entropy(torch.randn(3, 5), torch.randint(0, 5, (3,)), sp_group="sp")
    # a group of one: nothing to sum over (None behaves alike)
    got = vtp.cross_entropy(
        torch.randn(3, 5, dtype=torch.float64), torch.randint(0, 5, (3,)), sp_group=None, reduction="mean"
    )
    assert got.shape == ()


def test_sequence_sum_backward_is_the_identity():
    parts = torch.tensor([2.0, 3.0], dtype=torch.float64, requires_grad=True)
    from vtp_runtime.outputs import SequenceSum

    out = SequenceSum.apply(parts, None)  # no group: the sum of one rank
    (out * torch.tensor([5.0, 7.0], dtype=torch.float64)).sum().backward()
    assert parts.grad is not None
    assert parts.grad.tolist() == [5.0, 7.0]
    assert not math.isnan(out.sum().item())


def _guide_examples():
    section = (ROOT / "docs" / "guide.md").read_text().split("## Sequence parallelism", 1)[1].split("\n## ", 1)[0]
    return torchrun_examples(section)


def _run_guide_example(rank, world, group, block):
    return run_main(block, "docs/guide.md")


def test_the_guide_has_both_examples():
    assert sorted(world for world, _ in _guide_examples()) == [2, 4]


@pytest.mark.parametrize("index", range(len(_guide_examples())))
def test_guide_example_runs(ranks, index):
    world, block = _guide_examples()[index]
    losses = ranks(world, _run_guide_example, block, timeout=120)
    assert len(set(losses)) == 1, losses  # replicated on every rank
    torch.manual_seed(0)
    if world == 2:  # Megatron SP: the loss of the full head on every token
        s, b, h, v = 8, 2, 64, 1000
        hidden, labels = torch.randn(s, b, h), torch.randint(0, v, (s, b))
        weight = torch.randn(v, h) * h**-0.5
        want = torch.nn.functional.cross_entropy(
            (hidden @ weight.T).reshape(-1, v), labels.reshape(-1), label_smoothing=0.1
        )
    else:  # the mean over every token of the 2 x 2 grid
        n, v = 16, 1000
        logits, labels = torch.randn(n, v), torch.randint(0, v, (n,))
        labels[::3] = -100
        want = torch.nn.functional.cross_entropy(logits, labels)
    assert losses[0] == pytest.approx(want.item(), rel=1e-5)
