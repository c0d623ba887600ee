"""Sequence parallelism against the float64 reference on the full (unsharded) data, on gloo
ranks: ``Head(sequence_parallel=True)`` (Megatron SP) at TP 2, 3 and 4 with even, uneven and
empty token shards, every op, teacher Heads sequence-parallel or not, gradients of each
rank's hidden rows, weight and bias shards (``head_cases.run_head_case``), against a
Megatron ``ColumnParallelLinear(sequence_parallel=True)``-style head built by hand, and
never holding every rank's hidden rows at once; ``sp_group=`` alone and on a 2 x 2 TP x SP
grid (plain groups, DTensors on a 2-D mesh, Heads), sum and mean with ignore_index and a
normalizer; and mismatches between ranks, which raise on every rank and leave every rank
able to make the next call."""

import datetime
import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import vtp_runtime as vtp
from tests.helpers import ROOT, run_main, torchrun_examples
from vtp_runtime import sequence
from vtp_runtime.backend import ALL_DTYPES, HeadSupport, OpCapability
from vtp_runtime.backends.eager import EagerBackend
from vtp_runtime.registry import registered
from vtp_runtime.testing.distributed import outcome
from vtp_runtime.testing.head_cases import HeadCase, run_head_case, token_split

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's -inf arithmetic

TIMEOUT = 20  # seconds: the collective timeout of the groups the jobs make


def _id(case):
    return f"{case.id}-N{'x'.join(map(str, case.shape))}"


# -- Megatron SP: Head(sequence_parallel=True) --------------------------------------------------


def _sp(op, sequence, shape=(9,), **kw):
    return HeadCase(op, shape=shape, sequence=sequence, chunk_rows=kw.pop("chunk_rows", 4), **kw)


SP_CASES = [
    _sp(
        "cross_entropy",
        "uneven",
        options=(("label_smoothing", 0.1), ("reduction", "mean")),
        masked="labels",
        bias=True,
        layout="uneven",
    ),
    _sp("cross_entropy", "empty", options=(("label_smoothing", 0.2), ("z_loss", 1e-3)), layout="empty"),
    _sp("cross_entropy", "even", shape=(6, 2), options=(("reduction", "sum"),), bias=True, layout="explicit"),
    _sp("jsd", "uneven", options=(("beta", 0.3), ("reduction", "sum")), masked="mask", bias=True),
    _sp("jsd", "empty", options=(("beta", 0.6),), grads=(True, True)),
    _sp("jsd", "uneven", options=(("reduction", "mean"),), sequence_inputs=(True, False)),  # teacher replicated
    _sp("kl", "uneven", options=(("reverse", True),), heads=(True, False)),  # teacher logits
    _sp("logprobs", "empty", topk=2, masked="labels", options=(("return_entropy", True),)),
    _sp("logprobs", "uneven", options=(("temperature", 0.7), ("reduction", "mean"))),
    _sp("entropy", "uneven", options=(("reduction", "sum"),), chunk_rows=1),
    _sp("entropy", "empty", shape=(0,)),
]
TRITON_SP = [
    _sp(
        "cross_entropy",
        "uneven",
        shape=(7,),
        options=(("label_smoothing", 0.1), ("reduction", "mean")),
        backend="triton",
        bias=True,
    ),
    _sp("jsd", "empty", shape=(7,), options=(("beta", 0.3),), backend="triton", dtype="bfloat16"),
]


# TP 4 runs the ops other than kl and logprobs: the suite shares two cores
SP_WORLDS = [
    (world, case) for case in SP_CASES for world in (2, 3, 4) if world < 4 or case.op not in ("kl", "logprobs")
]


@pytest.mark.parametrize("world, case", SP_WORLDS, ids=[f"{w}-{_id(c)}" for w, c in SP_WORLDS])
def test_sequence_parallel_head(ranks, world, case):
    ranks(world, run_head_case, case, timeout=180)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", TRITON_SP, ids=_id)
def test_sequence_parallel_head_triton(ranks, world, case):
    ranks(world, run_head_case, case, timeout=180)


def by_reduce_scatter(rank, world, group, case):
    """The all-gather and reduce-scatter NCCL and XCCL run, here on gloo (which otherwise
    broadcasts each rank's block and all-reduces the gradient in place)."""
    original = sequence._on_gloo
    sequence._on_gloo = lambda group, device: False
    try:
        return run_head_case(rank, world, group, case)
    finally:
        sequence._on_gloo = original


@pytest.mark.parametrize("case", [SP_CASES[0], SP_CASES[4], SP_CASES[7]], ids=_id)
def test_sequence_parallel_head_through_reduce_scatter(ranks, case):
    ranks(3, by_reduce_scatter, case, timeout=180)


def test_token_split():
    assert token_split("even", 7, 3, 0) == [3, 2, 2]
    assert token_split("empty", 9, 3, 0)[1] == 0 and sum(token_split("empty", 9, 3, 0)) == 9
    for world in (2, 3, 4):
        parts = token_split("uneven", 9, world, 1)
        assert sum(parts) == 9 and min(parts) >= 1


class _AllGatherTokens(torch.autograd.Function):
    """Megatron's gather_from_sequence_parallel_region: all-gather the token shards forward,
    reduce-scatter the gradient backward (even shards, as Megatron has them)."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group = group
        world = dist.get_world_size(group)
        out = local.new_empty(world * local.shape[0], *local.shape[1:])
        dist.all_gather_into_tensor(out, local.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        out = grad.new_empty(grad.shape[0] // world, *grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def megatron_by_hand(rank, world, group, reduction, op):
    """The SP head against ColumnParallelLinear(sequence_parallel=True) + vtp on the gathered
    hidden states (the reduce-scatter of their gradient is the hidden all-reduce: the Head
    leaves its partial sum, reduce_hidden_grad=False). The same numbers."""
    g = torch.Generator().manual_seed(3)
    s_local, b, h, v = 4, 2, 6, 17
    hidden = torch.randn(world * s_local, b, h, generator=g, dtype=torch.float64)  # Megatron's [s, b, h]
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    teacher = torch.randn(v, h, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (world * s_local, b), generator=g)
    labels[1, 0] = -100
    start, end = vtp.nn.shard_bounds(v, world, rank)
    mine = slice(rank * s_local, (rank + 1) * s_local)
    out = {}
    for arm in ("sp_head", "by_hand"):
        x = hidden[mine].clone().requires_grad_(True)
        w = weight[start:end].clone().requires_grad_(True)
        if arm == "sp_head":
            student = vtp.Head(x, w, sequence_parallel=True, chunk_rows=3)
            t_head = vtp.Head(hidden[mine], teacher[start:end], sequence_parallel=True, chunk_rows=3)
        else:
            full = _AllGatherTokens.apply(x, group)
            student = vtp.Head(full, w, reduce_hidden_grad=False)
            t_head = vtp.Head(_AllGatherTokens.apply(hidden[mine], group), teacher[start:end])
        if op == "cross_entropy":
            loss = vtp.cross_entropy(student, labels, label_smoothing=0.1, reduction=reduction, tp_group=group)
        else:
            loss = vtp.jsd(student, t_head, beta=0.4, labels=labels, reduction=reduction, tp_group=group)
        (loss if reduction != "none" else loss.sum()).backward()
        out[arm] = (loss.detach(), x.grad, w.grad)
    for a, b_ in zip(out["sp_head"], out["by_hand"]):
        torch.testing.assert_close(a, b_, rtol=1e-12, atol=1e-13)
    return True


@pytest.mark.parametrize("op", ["cross_entropy", "jsd"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_the_same_numbers_as_megatron_column_parallel_linear(ranks, reduction, op):
    assert all(ranks(2, megatron_by_hand, reduction, op, timeout=120))


def never_all_hidden(rank, world, group):
    """With several chunks no gather buffer holds every rank's hidden rows, and a chunk's
    gather is issued before the previous chunk's rows are used (one chunk ahead)."""
    events: list[tuple[str, int]] = []
    gathered: list[int] = []
    original_start, original_rows = sequence.HiddenChunks._start, sequence.HiddenChunks.rows

    def start(self, c):
        if c < self.layout.chunks and c not in self._in_flight:
            events.append(("gather", c))
        return original_start(self, c)

    def rows(self, c):
        out = original_rows(self, c)
        events.append(("use", c))
        gathered.extend(b.shape[0] for b in self._gathered if b is not None)
        return out

    # spies patched onto the class for this job, restored below (mypy refuses assigning to a method)
    sequence.HiddenChunks._start, sequence.HiddenChunks.rows = start, rows  # type: ignore[method-assign]
    try:
        n, h = 24, 8
        x = torch.randn(n // world, h, requires_grad=True)
        w = torch.randn(11 - rank, h, requires_grad=True)
        y = torch.randint(0, 21, (n,))
        vtp.cross_entropy(
            vtp.Head(x, w, sequence_parallel=True, chunk_rows=8), y, reduction="mean", tp_group=group
        ).backward()
    finally:
        sequence.HiddenChunks._start, sequence.HiddenChunks.rows = original_start, original_rows  # type: ignore[method-assign]
    return events, max(gathered)


def test_never_holds_every_ranks_hidden_rows(ranks):
    events, most = ranks(2, never_all_hidden, timeout=60)[0]
    assert events == [("gather", 0), ("gather", 1), ("use", 0), ("gather", 2), ("use", 1), ("use", 2)]
    assert most == 8  # two buffers of one chunk's 8 rows, never the 24 of every rank


def collectives_allocate(rank, world, group):
    """What the collectives of a planned sequence-parallel call allocate on the calling
    thread (torch's profiler sees the allocations inside them): ``[(op, bytes)]``."""
    n, h, rows = 64, 256, 16
    x = torch.randn(n // world, h, requires_grad=True)
    w = torch.randn(10, h, requires_grad=True)
    y = torch.randint(0, 10 * world, (n,))

    def call():
        head = vtp.Head(x, w, sequence_parallel=True, chunk_rows=rows)
        vtp.cross_entropy(head, y, reduction="mean", tp_group=group).backward()

    call()  # the plan
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    found = []
    for e in prof.events():
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("c10d::"):
            parent = parent.cpu_parent
        if parent is not None and e.self_cpu_memory_usage > 0:
            found.append((parent.name, e.self_cpu_memory_usage))
    return found, rows * h * x.element_size()


def test_the_chunk_collectives_allocate_no_chunk_buffer_on_gloo(ranks):
    """torch's gloo all-gather allocates a tensor of its whole output each time it is issued
    (its work's getOutputTensors, on the output's device: one more chunk buffer at the peak,
    in GPU memory too); the chunks' broadcasts and in-place all-reduces allocate none (the
    metadata gather's few int64 are all there is)."""
    for found, chunk in ranks(2, collectives_allocate, timeout=60):
        assert all(size < chunk // 8 for _, size in found), (found, chunk)


# -- what the ranks must agree on, and what is refused ------------------------------------------


def _healthy_sp_head(rank, world, group) -> float:
    """A normal call on every rank afterwards: its largest deviation from float64."""
    g = torch.Generator().manual_seed(11)
    hidden, weight = (
        torch.randn(7, 4, generator=g, dtype=torch.float64),
        torch.randn(9, 4, generator=g, dtype=torch.float64),
    )
    labels = torch.randint(0, 9, (7,), generator=g)
    rows = token_split("uneven", 7, world, 0)
    first = sum(rows[:rank])
    start, end = vtp.nn.shard_bounds(9, world, rank)
    got = vtp.cross_entropy(
        vtp.Head(hidden[first : first + rows[rank]], weight[start:end], sequence_parallel=True), labels, tp_group=group
    )
    want = torch.nn.functional.cross_entropy(hidden @ weight.T, labels, reduction="none")
    return (got - want).abs().max().item()


def sp_head_mismatches(rank, world, group):
    h, w = torch.randn(3, 4), torch.randn(5, 4)
    y = torch.randint(0, 5 * world, (3 * world,))
    out = [
        # H differs between the ranks
        outcome(
            lambda: vtp.cross_entropy(
                vtp.Head(torch.randn(3, 4 + rank), torch.randn(5, 4 + rank), sequence_parallel=True), y, tp_group=group
            )
        ),
        # labels that do not cover every rank's tokens
        outcome(lambda: vtp.cross_entropy(vtp.Head(h, w, sequence_parallel=True), y[:-1], tp_group=group)),
        # a sequence-parallel Head on one rank only
        outcome(lambda: vtp.entropy(vtp.Head(h, w, sequence_parallel=rank == 0), tp_group=group)),
        # the other token dims differ
        outcome(lambda: vtp.entropy(vtp.Head(torch.randn(3, 1 + rank, 4), w, sequence_parallel=True), tp_group=group)),
        # reduce_hidden_grad=False on one rank: refused there before the gather
        outcome(
            lambda: vtp.entropy(vtp.Head(h, w, reduce_hidden_grad=rank != 1, sequence_parallel=True), tp_group=group)
        ),
    ]
    return out, _healthy_sp_head(rank, world, group)


def test_sequence_parallel_mismatches_raise_on_every_rank(ranks):
    results = ranks(2, sp_head_mismatches, timeout=90)
    (h, cover, one, dims, partial), _ = results[0]
    assert h[0] == "ShardError" and "H=4" in h[1] and "H=5" in h[1]
    assert cover[0] == "ShardError" and "cover 5 tokens" in cover[1] and "add up to 6" in cover[1]
    assert one[0] == "ShardError" and "sequence_parallel" in one[1]
    assert dims[0] == "ShardError" and "[S_r, 1]" in dims[1]
    assert partial[0] == "ShardError" and "rank 1" in partial[1]
    other = results[1][0]
    assert other[:4] == results[0][0][:4]  # the same error on every rank
    assert other[4][0] == "ValueError" and "reduce_hidden_grad=False" in other[4][1]
    assert max(err for _, err in results) < 1e-12


def test_reduce_hidden_grad_false_is_refused():
    h, w = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match="reduce_hidden_grad=False, .* does not apply"):
        vtp.entropy(vtp.Head(h, w, reduce_hidden_grad=False, sequence_parallel=True))
    with pytest.raises(ValueError, match=r"hidden \[S_r, \.\.\., H\]"):
        vtp.entropy(vtp.Head(torch.randn(4), w, sequence_parallel=True))


def test_at_one_rank_a_sequence_parallel_head_is_a_plain_head():
    torch.manual_seed(0)
    h, w = torch.randn(6, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    y = torch.randint(0, 9, (6,))
    got = vtp.cross_entropy(vtp.Head(h, w, sequence_parallel=True), y, reduction="mean")
    torch.testing.assert_close(got, torch.nn.functional.cross_entropy(h @ w.T, y))


class _NoSequence(EagerBackend):
    name = "no_sequence"
    priority = 100
    ops = {"cross_entropy": OpCapability(device_types=None, dtypes=ALL_DTYPES)}
    head_ops = {"cross_entropy": HeadSupport()}


class _Plugin:
    @vtp.hookimpl
    def vtp_runtime_register_backends(self, register):
        register(_NoSequence())


def explain_sequence(rank, world, group):
    h, w = torch.randn(3, 4), torch.randn(5, 4)
    y = torch.randint(0, 10, (6,))
    with registered(_Plugin(), name="no-sequence"):
        plain = vtp.explain("cross_entropy", vtp.Head(torch.randn(6, 4), w), y, tp_group=group, gather=True)
        sp = vtp.explain("cross_entropy", vtp.Head(h, w, sequence_parallel=True), y, tp_group=group, gather=True)
    return plain.backend, sp.backend, sp.reasons.get("no_sequence"), str(sp)


def test_dispatch_knows_which_backends_take_sequence_parallel_heads(ranks):
    plain, sp, why, text = ranks(2, explain_sequence, timeout=60)[0]
    assert plain == "no_sequence" and sp == "triton"
    assert why == [
        "sequence-parallel head inputs not supported (Head(sequence_parallel=True) at TP > 1: gather "
        "the hidden states and pass a plain Head, or force a backend that declares them)"
    ]
    assert "inputs=sequence-parallel head" in text


def changing_shards(rank, world, group):
    """Shards that change on some ranks only, with the token count and this rank's shard the
    same (rank 2 here): every rank plans again (gloo gathers the metadata on every call)."""
    g = torch.Generator().manual_seed(5)
    hidden, weight = (
        torch.randn(9, 4, generator=g, dtype=torch.float64),
        torch.randn(8, 4, generator=g, dtype=torch.float64),
    )
    labels = torch.randint(0, 8, (9,), generator=g)
    start, end = vtp.nn.shard_bounds(8, world, rank)
    want = torch.nn.functional.cross_entropy(hidden @ weight.T, labels, reduction="none")
    errors = []
    for rows in ([3, 3, 3], [4, 2, 3], [4, 2, 3], [2, 4, 3]):
        first = sum(rows[:rank])
        got = vtp.cross_entropy(
            vtp.Head(hidden[first : first + rows[rank]], weight[start:end], sequence_parallel=True, chunk_rows=3),
            labels,
            tp_group=group,
        )
        errors.append((got - want).abs().max().item())
    return max(errors)


def test_shards_changing_on_some_ranks_only(ranks):
    assert max(ranks(3, changing_shards, timeout=90)) < 1e-12


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


def dtensor_sequence_parallel_head(rank, world, group, two_d):
    """A Head of DTensors whose hidden is placed Shard(0) on the vocabulary's mesh dimension
    is a sequence-parallel Head (the placement says so); on an (sp, tp) mesh with sp_group
    the sequence's tokens are split over both."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    key = ("sp_mesh", two_d)
    if key not in _GROUPS:
        shape, names = ((2, 2), ("sp", "tp")) if two_d else ((world,), ("tp",))
        _GROUPS[key] = DeviceMesh("cpu", torch.arange(world).reshape(shape), mesh_dim_names=names)
    mesh = _GROUPS[key]
    g = torch.Generator().manual_seed(8)
    s, b, h, v = 7, 2, 5, 9  # torch's chunking of 7 tokens: uneven shards
    hidden = torch.randn(s, b, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (s, b), generator=g)
    labels[0, 1] = -100
    hp = [Shard(0), Shard(0)] if two_d else [Shard(0)]
    wp = [Replicate(), Shard(0)] if two_d else [Shard(0)]
    x = distribute_tensor(hidden, mesh, hp).requires_grad_(True)
    w = distribute_tensor(weight, mesh, wp).requires_grad_(True)
    y = distribute_tensor(labels, mesh, [Shard(0), Replicate()] if two_d else [Replicate()])
    sp = mesh.get_group("sp") if two_d else None
    loss = vtp.cross_entropy(vtp.Head(x, w, sequence_parallel=True), y, reduction="mean", sp_group=sp)
    loss.backward()
    ref_h, ref_w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    want = torch.nn.functional.cross_entropy((ref_h @ ref_w.T).reshape(-1, v), labels.reshape(-1))
    want.backward()
    assert isinstance(loss, DTensor) and isinstance(x.grad, DTensor) and isinstance(w.grad, DTensor)
    torch.testing.assert_close(loss.full_tensor(), want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x.grad.full_tensor(), ref_h.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad.full_tensor(), ref_w.grad, rtol=1e-10, atol=1e-12)
    per_token = vtp.cross_entropy(vtp.Head(x.detach(), w.detach()), y)
    assert isinstance(per_token, DTensor)
    torch.testing.assert_close(
        per_token.full_tensor(),
        torch.nn.functional.cross_entropy(
            (hidden @ weight.T).reshape(-1, v), labels.reshape(-1), reduction="none"
        ).reshape(s, b),
    )
    plain = outcome(lambda: vtp.entropy(vtp.Head(hidden[:2], w, sequence_parallel=True)))
    return plain


@pytest.mark.parametrize("two_d", [False, True], ids=["tp_mesh", "sp_tp_mesh"])
def test_dtensor_sequence_parallel_head(ranks, two_d):
    for kind, msg in ranks(4 if two_d else 2, dtensor_sequence_parallel_head, two_d, timeout=120):
        assert "takes hidden as a DTensor placed Shard(0)" in msg or "2-D mesh" in msg, (kind, msg)


def test_info_and_explain_show_the_capability(capsys):
    from vtp_runtime import info

    data = info.collect()
    assert data["backends"]["eager"]["ops"]["jsd"]["head_sequence_parallel"]
    assert data["backends"]["triton"]["ops"]["cross_entropy"]["head_sequence_parallel"]
    text = info.render_plain(data)
    line = (
        "eager:               cross_entropy, logprobs, entropy, kl, jsd (per-token, sequence-parallel);"
        " argmax (per-token)"
    )
    assert line in text
    with registered(_Plugin(), name="no-sequence"):
        r = info.simulated_request("cross_entropy", torch.float32, 1000, 2, head="sequence-parallel")
        assert r.head_sequence_parallel
        from vtp_runtime import dispatch

        ex = dispatch.explain_request(r, None)
        assert (
            ex.backend != "no_sequence"
            and "sequence-parallel head inputs not supported" in ex.reasons["no_sequence"][0]
        )
    assert not info.simulated_request(
        "cross_entropy", torch.float32, 1000, 1, head="sequence-parallel"
    ).head_sequence_parallel  # at TP 1 it is a plain Head


# -- the benchmark, and on the GPU (marked gpu: the GPU machine runs them) --------------------------


def test_the_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/sequence_parallel.py at tiny sizes on gloo CPU ranks: both arms, the same numbers."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the eager backend: quick
    out = tmp_path / "sp.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sequence_parallel.py"), "--cpu", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(out.read_text())
    assert set(data) >= {"sp_head", "gather_by_hand", "relative_difference"}
    assert max(data["relative_difference"].values()) < 2e-2  # bf16, chunked differently


def _need_cuda(devices=1):
    import os

    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.device_count() < devices:
        pytest.skip(f"needs {devices} CUDA GPU(s) with compiled Triton: TRITON_INTERPRET=0 python -m pytest -m gpu")


def _on_gpu(op, sequence, shape, **kw):
    """A case on CUDA tensors: bf16 on the triton backend, V = 32003, H = 256, 128-row
    chunks, unless ``kw`` says otherwise."""
    fields = dict(vocab=32003, hidden=256, dtype="bfloat16", backend="triton", chunk_rows=128) | kw
    return _sp(op, sequence, shape, device="cuda", **fields)


GPU_CASES = [
    _on_gpu("cross_entropy", "uneven", (512,), bias=True, options=(("label_smoothing", 0.1), ("reduction", "mean"))),
    _on_gpu("jsd", "empty", (384,), options=(("beta", 0.3),)),
    _on_gpu(
        "logprobs",
        "uneven",
        (256, 2),
        vocab=5003,
        hidden=128,
        dtype="float32",
        backend="eager",
        chunk_rows=100,
        topk=3,
        options=(("return_entropy", True),),
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_id)
def test_sequence_parallel_head_on_one_gpu(ranks, case):
    """Two ranks sharing one GPU over gloo (CUDA tensors), the kernels compiled."""
    _need_cuda()
    ranks(2, run_head_case, case, timeout=300)


def memory_against_the_gather(rank, world, group):
    """At N = 8192, H = 2048, V = 151936 (bf16; four chunks): the same numbers as gathering the
    hidden states by hand, and a peak at least the gathered [N, H] hidden lower."""
    import benchmarks.sequence_parallel as bench

    dev = torch.device("cuda", torch.cuda.current_device())
    n, h, v = 8192, 2048, 151936
    g = torch.Generator(device=dev).manual_seed(0)
    full = torch.randn(n, h, device=dev, generator=g).bfloat16()
    x = full[rank * n // world : (rank + 1) * n // world].clone().requires_grad_(True)
    w = (torch.randn(v // world, h, device=dev, generator=g) * h**-0.5).bfloat16().requires_grad_(True)
    y = torch.randint(0, v, (n,), device=dev, generator=g)
    del full
    out = {}
    for arm in bench.ARMS:
        bench.step(arm, "cross_entropy", x, w, y, None, None, group)  # warm up: compile, plan
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = bench.step(arm, "cross_entropy", x, w, y, None, None, group)
        torch.cuda.synchronize()
        out[arm] = (torch.cuda.max_memory_allocated() - base, result)
    (sp_peak, sp), (hand_peak, hand) = out["sp_head"], out["gather_by_hand"]
    for a, b in zip(sp, hand):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)
    return sp_peak, hand_peak, n * h * 2, n * 8


@pytest.mark.gpu
def test_sequence_parallel_head_memory_on_one_gpu(ranks):
    """By hand a rank holds the gathered [N, H] and its [N, H] gradient; the sequence-parallel
    Head two chunk buffers and this rank's [N / TP, H] gradient: at TP 2 with four chunks,
    [N, H] less, but for the O(N) int64 token order and reordered labels."""
    _need_cuda()
    for sp_peak, hand_peak, nh_bytes, order_bytes in ranks(2, memory_against_the_gather, timeout=300):
        assert hand_peak - sp_peak >= nh_bytes - 2 * order_bytes, (sp_peak, hand_peak, nh_bytes)


def no_host_sync_over_nccl(rank, world, group):
    """Over NCCL (a device-only group) a planned call syncs nothing: the Megatron-SP head's
    chunk gathers and reduce-scatters, and a sum over sp_group, once their first call is made."""
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(0)
    n, h, v = 1024, 256, 8000
    full = torch.randn(n, h, device=dev, generator=g)
    x = full[rank * n // 2 : (rank + 1) * n // 2].clone().bfloat16().requires_grad_(True)
    w = (torch.randn(v // 2, h, device=dev, generator=g) * h**-0.5).bfloat16().requires_grad_(True)
    y = torch.randint(0, v, (n,), device=dev, generator=g)
    logits = torch.randn(300, v, device=dev, generator=g).requires_grad_(True)
    labels = torch.randint(0, v, (300,), device=dev, generator=g)

    def calls():
        vtp.cross_entropy(
            vtp.Head(x, w, sequence_parallel=True, chunk_rows=256), y, reduction="mean", tp_group=group
        ).backward()
        vtp.cross_entropy(logits, labels, reduction="mean", sp_group=group).backward()

    calls()  # plans, and the agreement over sp_group
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        calls()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return True


@pytest.mark.gpu
def test_no_host_sync_over_nccl_on_two_gpus():
    _need_cuda(2)
    from vtp_runtime.testing.distributed import RankPool

    pool = RankPool(2, backend="nccl", env={"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    try:
        assert all(pool.run(no_host_sync_over_nccl, timeout=300))
        assert all(pool.run(run_head_case, GPU_CASES[0], timeout=300))
    finally:
        pool.close()


# -- the guide's examples, as written, on as many gloo ranks as they say ------------------------------


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
