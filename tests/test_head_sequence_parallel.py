"""Megatron sequence parallelism, ``Head(sequence_parallel=True)``, against the float64
reference on the full (unsharded) data, on gloo ranks: TP 2, 3 and 4 with even, uneven and
empty token shards, every op, teacher Heads sequence-parallel or not, gradients of each rank's
hidden rows, weight and bias shards (``head_cases.run_head_case``), against a Megatron
``ColumnParallelLinear(sequence_parallel=True)``-style head built by hand, and never holding
every rank's hidden rows at once; DTensor hidden rows; mismatches between ranks, which raise
on every rank; the benchmark on CPU. ``sp_group=`` is in test_sequence_parallel.py, the GPU
runs in test_head_sequence_parallel_gpu.py."""

import pytest
import torch
import torch.distributed as dist

import vtp_runtime as vtp
from tests.helpers import ROOT, head_case_id, pool_mesh
from vtp_runtime import head_gather
from vtp_runtime.backend import ALL_DTYPES, HeadSupport, OpCapability
from vtp_runtime.backends.eager import EagerBackend
from vtp_runtime.registry import registered
from vtp_runtime.testing import conformance
from vtp_runtime.testing.distributed import outcome
from vtp_runtime.testing.head_cases import HeadCase, run_head_case, token_split

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's -inf arithmetic

TIMEOUT = 20  # seconds: the collective timeout of the groups the jobs make


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


@pytest.mark.parametrize("world, case", SP_WORLDS, ids=[f"{w}-{head_case_id(c)}" for w, c in SP_WORLDS])
def test_sequence_parallel_head(ranks, world, case):
    ranks(world, run_head_case, case, timeout=180)


@pytest.mark.parametrize("world", conformance.tp_sizes(2, 3))
@pytest.mark.parametrize("case", TRITON_SP, ids=head_case_id)
def test_sequence_parallel_head_triton(ranks, world, case):
    ranks(world, run_head_case, case, timeout=180)


def by_reduce_scatter(rank, world, group, case):
    """The all-gather and reduce-scatter NCCL and XCCL run, here on gloo (which otherwise
    broadcasts each rank's block and all-reduces the gradient in place)."""
    original = head_gather.on_gloo
    head_gather.on_gloo = lambda group, device: False
    try:
        return run_head_case(rank, world, group, case)
    finally:
        head_gather.on_gloo = original


@pytest.mark.parametrize("case", [SP_CASES[0], SP_CASES[4], SP_CASES[7]], ids=head_case_id)
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
    original_start, original_rows = head_gather.HiddenChunks.start_gather, head_gather.HiddenChunks.rows

    def start(self, c):
        if c < self.layout.chunks and c not in self.in_flight:
            events.append(("gather", c))
        return original_start(self, c)

    def rows(self, c):
        out = original_rows(self, c)
        events.append(("use", c))
        gathered.extend(b.shape[0] for b in self.gathered if b is not None)
        return out

    # spies patched onto the class for this job, restored below (mypy refuses assigning to a method)
    head_gather.HiddenChunks.start_gather, head_gather.HiddenChunks.rows = start, rows  # type: ignore[method-assign]
    try:
        n, h = 24, 8
        x = torch.randn(n // world, h, requires_grad=True)
        w = torch.randn(11 - rank, h, requires_grad=True)
        y = torch.randint(0, 21, (n,))
        vtp.cross_entropy(
            vtp.Head(x, w, sequence_parallel=True, chunk_rows=8), y, reduction="mean", tp_group=group
        ).backward()
    finally:
        head_gather.HiddenChunks.start_gather, head_gather.HiddenChunks.rows = original_start, original_rows  # type: ignore[method-assign]
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


# -- DTensor hidden rows; info and explain ----------------------------------------------------


def dtensor_sequence_parallel_head(rank, world, group, two_d):
    """A Head of DTensors whose hidden is placed Shard(0) on the vocabulary's mesh dimension
    is a sequence-parallel Head (the placement says so); on an (sp, tp) mesh with sp_group
    the sequence's tokens are split over both."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    shape, names = ((2, 2), ("sp", "tp")) if two_d else ((world,), ("tp",))
    mesh = pool_mesh(world, shape, names)
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


# -- the benchmark ---------------------------------------------------------------------------------


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
