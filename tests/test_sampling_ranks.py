"""vtp.argmax and vtp.sample on gloo ranks with even, uneven, empty and out-of-order shards,
eager and triton (Triton's interpreter on CPU): the tokens of one process on every rank, bad
input refused on every rank, DTensor logits, and argmax of a Head. By default triton's
tokens are tested on every layout for one set of options; ``VTP_TEST_DEPTH=full`` tests
each option alone as well, as for eager."""

import math
from typing import Any

import pytest
import torch

import vtp_runtime as vtp
from tests.helpers import SAMPLING_VOCAB as V
from tests.helpers import random_logits
from vtp_runtime.testing import conformance, reference
from vtp_runtime.testing.distributed import outcome

# the built-in backends that sample on CPU; all but eager run in Triton's (slow) interpreter here
BACKENDS = conformance.backends_with("sample")
FULL = conformance.current_depth() == "full"

# where each rank's shard starts and ends, as fractions of V
LAYOUTS = {
    "tp2_uneven": [(0, 0.4), (0.4, 1)],
    "tp3_reversed": [(0.65, 1), (0.17, 0.65), (0, 0.17)],  # explicit bounds, not in rank order
    "tp4_empty": [(0, 0.26), (0.26, 0.26), (0.26, 0.74), (0.74, 1)],
}


def _bounds(layout: str, rank: int, v: int) -> tuple[int, int]:
    a, b = LAYOUTS[layout][rank]
    return int(a * v), int(b * v)


def _shard(full: torch.Tensor, bounds) -> torch.Tensor:
    start, end = bounds
    return full[..., start:end]


# -- gloo ranks --------------------------------------------------------------------------------


def _call(rank, group, x, layout, fn):
    bounds = _bounds(layout, rank, x.shape[-1])
    kw = {"vocab_start": bounds[0], "vocab_end": bounds[1]} if layout == "tp3_reversed" else {}
    return fn(_shard(x, bounds), tp_group=group, **kw)


RANK_CASES = [{}, {"top_k": 5}, {"top_p": 0.7}, {"min_p": 0.1}, {"top_k": 7, "top_p": 0.8, "min_p": 0.05}]
# what each backend samples on every layout: triton in its interpreter every restriction at once
LAYOUT_CASES = {b: RANK_CASES if b == "eager" or FULL else RANK_CASES[-1:] for b in BACKENDS}


def _layout_logits(n: int, v: int, device: str) -> torch.Tensor:
    x = random_logits(n, v, seed=13)
    x[:4] = torch.randint(0, 3, (4, v), generator=torch.Generator().manual_seed(1)).float()  # ties across shards
    return x.to(device)


def layout_job(rank, world, group, layout, backend, cases, n=40, v=V, device="cpu", dtype=torch.float32):
    """argmax and every case on this layout: the ids of every rank, to compare with one process."""
    x = _layout_logits(n, v, device).to(dtype)
    out: dict[str | int, torch.Tensor] = {
        "argmax": _call(rank, group, x, layout, lambda z, **kw: vtp.argmax(z, backend=backend, **kw))
    }
    for i, options in enumerate(cases):
        out[i] = _call(
            rank, group, x, layout, lambda z, o=options, **kw: vtp.sample(z, seed=77, backend=backend, **o, **kw)
        )
    return {k: t.cpu() for k, t in out.items()}


def _check_layout(results, backend, cases, n=40, v=V, device="cpu", dtype=torch.float32):
    x = _layout_logits(n, v, device).to(dtype)
    assert all(torch.equal(r[key], results[0][key]) for r in results for key in results[0])
    assert torch.equal(results[0]["argmax"], reference.argmax(x).cpu())
    for i, options in enumerate(cases):
        assert torch.equal(results[0][i], vtp.sample(x, seed=77, backend=backend, **options).cpu()), options


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_same_tokens_on_every_rank_and_every_layout(ranks, layout, backend):
    """TP 2, 3 and 4 (uneven, out of rank order, an empty shard) give the tokens of one process."""
    results = ranks(len(LAYOUTS[layout]), layout_job, layout, backend, LAYOUT_CASES[backend], timeout=300)
    _check_layout(results, backend, LAYOUT_CASES[backend])


def misuse_job(rank, world, group):
    """Bad calls on one rank or all, each followed by nothing stuck: then a normal call."""
    x = random_logits(8, V, seed=6)
    z = _shard(x, _bounds("tp2_uneven", rank, V))
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = ("no error", "")
        except Exception as exc:
            out[name] = (type(exc).__name__, str(exc))

    bad = rank == 1
    attempt("top_k", lambda: vtp.sample(z, seed=1, top_k=0 if bad else 3, tp_group=group, backend="eager"))
    attempt("top_p", lambda: vtp.sample(z, seed=1, top_p=1.5, tp_group=group, backend="eager"))
    attempt("temperature", lambda: vtp.sample(z, seed=1, temperature=-1.0 if bad else 1.0, tp_group=group))
    # a float seed on one rank on purpose (the TypeError and the other rank's ShardError are checked)
    attempt("seed_type", lambda: vtp.sample(z, seed=1.0 if bad else 1, tp_group=group, backend="eager"))  # type: ignore[arg-type]
    attempt("options", lambda: vtp.sample(z, seed=1, top_p=0.5 if bad else 0.6, tp_group=group, backend="eager"))
    for backend in BACKENDS:
        vtp.sample(z, seed=1, tp_group=group, backend=backend)  # planned: later seeds are per-call data
        attempt(f"seed_{backend}", lambda b=backend: vtp.sample(z, seed=2 + rank, tp_group=group, backend=b))
        vtp.sample(z, seed=1, top_k=3, tp_group=group, backend=backend)
        attempt(f"seed_topk_{backend}", lambda b=backend: vtp.sample(z, seed=rank, top_k=3, tp_group=group, backend=b))
    healthy = vtp.sample(z, seed=5, top_p=0.9, tp_group=group, backend="eager")
    return out, healthy, torch.equal(vtp.argmax(z, tp_group=group), x.argmax(-1))


def test_bad_input_raises_on_every_rank_and_nothing_hangs(ranks):
    results = ranks(2, misuse_job, timeout=300)
    (out0, healthy0, ok0), (out1, healthy1, ok1) = results
    assert ok0 and ok1 and torch.equal(healthy0, healthy1)
    x = random_logits(8, V, seed=6)
    assert torch.equal(healthy0, vtp.sample(x, seed=5, top_p=0.9, backend="eager"))
    assert out1["top_k"][0] == "ValueError" and out0["top_k"][0] == "ShardError" and "rank 1" in out0["top_k"][1]
    assert out0["top_p"] == out1["top_p"] and out0["top_p"][0] == "ValueError"
    assert out1["temperature"][0] == "ValueError" and out0["temperature"][0] == "ShardError"
    assert out1["seed_type"][0] == "TypeError" and out0["seed_type"][0] == "ShardError"
    for out in (out0, out1):
        assert out["options"][0] == "ShardError" and "top_p: rank 0 = 0.6, rank 1 = 0.5" in out["options"][1]
        for key in ("seed_eager", "seed_triton", "seed_topk_eager", "seed_topk_triton"):
            kind, msg = out[key]
            assert kind == "ShardError" and "disagree on sample's seed" in msg, (key, kind, msg)
    assert "rank 0 = 2, rank 1 = 3" in out0["seed_eager"][1]


EXTREME_LAYOUTS = {"tp2_uneven": [(0, 0.4), (0.4, 1)], "tp3_empty": [(0, 0.4), (0.4, 0.4), (0.4, 1)]}
# what the ranks sample at the extremes (options, scale, offset), both backends on every layout
EXTREME_RANK_CASES: list[tuple[dict[str, Any], float, float]] = [
    ({"temperature": 1e-40}, 1.0, 0.0),
    ({"temperature": 1e-40, "top_p": 0.9}, 1.0, 0.0),
    ({}, 1.0, 1e7),
    ({"top_p": 0.8}, 1.0, -1e7),
    ({"min_p": 0.05}, 1e29, -1e30),
    ({"top_k": 5, "temperature": 1e300}, 1e30, 0.0),
]


def _extreme_logits(n: int, scale: float, offset: float) -> torch.Tensor:
    x = _layout_logits(n, V, "cpu") * scale + offset  # fp32: ties across shards where the offset rounds
    x[:, 2::7] = -math.inf  # a masked vocabulary
    return x


def extremes_job(rank, world, group, layout, backend, cases, n):
    """Each extreme case on this layout, and the rows split over two calls (row_offset)."""
    a, b = EXTREME_LAYOUTS[layout][rank]
    bounds = (int(a * V), int(b * V))
    out = []
    for options, scale, offset in cases:
        z = _shard(_extreme_logits(n, scale, offset), bounds)
        whole = vtp.sample(z, seed=31, tp_group=group, backend=backend, **options)
        k = n // 2
        parts = [
            vtp.sample(z[:k], seed=31, tp_group=group, backend=backend, **options),
            vtp.sample(z[k:], seed=31, row_offset=k, tp_group=group, backend=backend, **options),
        ]
        out.append((whole, torch.cat(parts)))
    return out


EXTREME_CASES = {b: EXTREME_RANK_CASES if b == "eager" or FULL else EXTREME_RANK_CASES[1::2] for b in BACKENDS}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", list(EXTREME_LAYOUTS))
def test_extremes_give_the_same_tokens_on_every_layout(ranks, layout, backend):
    """Tiny and huge temperatures, large offsets, masked tokens: the tokens of one process on
    every rank, at TP 2 (uneven) and 3 (an empty shard); rows split over two calls by
    row_offset draw the same."""
    n = 16 if backend == "eager" else 6
    cases = EXTREME_CASES[backend]
    results = ranks(len(EXTREME_LAYOUTS[layout]), extremes_job, layout, backend, cases, n, timeout=300)
    for i, (options, scale, offset) in enumerate(cases):
        want = vtp.sample(_extreme_logits(n, scale, offset), seed=31, backend=backend, **options)
        for result in results:
            whole, split = result[i]
            assert torch.equal(whole, want) and torch.equal(split, want), (options, scale, offset)


def dtensor_job(rank, world, group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = DeviceMesh("cpu", list(range(world)))
    x = random_logits(2 * 5, 9, seed=9).view(2, 5, 9)  # V=9 on 2 ranks: torch's chunks 5 + 4
    dt = DTensor.from_local(
        x[..., rank * 5 : (rank + 1) * 5], mesh, [Shard(2)], run_check=False, shape=x.shape, stride=x.stride()
    )
    ids = vtp.sample(dt, seed=3, top_k=4, backend="eager")
    top = vtp.argmax(dt)
    assert isinstance(ids, DTensor) and ids.placements == (Replicate(),) and ids.shape == (2, 5)
    assert isinstance(top, DTensor)
    return ids.to_local(), top.to_local()


def test_dtensor_logits(ranks):
    results = ranks(2, dtensor_job, timeout=120)
    x = random_logits(2 * 5, 9, seed=9).view(2, 5, 9)
    for ids, top in results:
        assert torch.equal(ids, vtp.sample(x, seed=3, top_k=4, backend="eager"))
        assert torch.equal(top, x.argmax(-1))


def dp_tp_job(rank, world, group):
    """A (dp=2, tp=2) mesh: logits [4, 3, 9] sharded over the batch (dp) and the vocabulary
    (tp, 5 + 4), the two batch halves equal. Ids of the DTensor, and of plain local tensors
    numbered by row_offset; then a batch sharded past the first dimension, refused on every
    rank, and a normal call."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh("cpu", torch.arange(world).view(2, 2), mesh_dim_names=("dp", "tp"))
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    dp, tp = coordinate
    tp_group = mesh.get_group("tp")
    x = random_logits(6, 9, seed=10).view(2, 3, 9).repeat(2, 1, 1)  # [4, 3, 9]: batch rows 2, 3 = rows 0, 1
    cols = slice(0, 5) if tp == 0 else slice(5, 9)
    local = x[2 * dp : 2 * dp + 2, :, cols]
    dt = DTensor.from_local(local, mesh, [Shard(0), Shard(2)], run_check=False, shape=x.shape, stride=x.stride())
    out: dict[str, Any] = {}
    for name, options in (("plain", {}), ("top_k", {"top_k": 3}), ("top_p", {"top_p": 0.8})):
        ids = vtp.sample(dt, seed=5, **options)
        assert isinstance(ids, DTensor)
        out[name] = ids.full_tensor()
        out[name + "_local"] = vtp.sample(local, seed=5, row_offset=6 * dp, tp_group=tp_group, **options)
    top = vtp.argmax(dt)
    assert isinstance(top, DTensor)
    out["argmax"] = top.full_tensor()
    rows = slice(0, 2) if dp == 0 else slice(2, 3)  # the sequence (dim 1, of 3) sharded: 2 + 1
    by_sequence = DTensor.from_local(
        x[:, rows, cols], mesh, [Shard(1), Shard(2)], run_check=False, shape=x.shape, stride=x.stride()
    )
    refused = outcome(lambda: vtp.sample(by_sequence, seed=5))
    after = vtp.sample(dt, seed=5)
    assert isinstance(after, DTensor)
    return out, refused, after.full_tensor()


def test_a_dtensor_numbers_its_rows_over_the_global_batch(ranks):
    """vtp.sample(dtensor).full_tensor() is vtp.sample(full_logits): each batch shard draws
    its global rows (two shards holding equal logits draw differently); plain tensors on the
    data-parallel ranks do the same with row_offset."""
    x = random_logits(6, 9, seed=10).view(2, 3, 9).repeat(2, 1, 1)
    results = ranks(4, dp_tp_job, timeout=180)
    for name, options in (("plain", {}), ("top_k", {"top_k": 3}), ("top_p", {"top_p": 0.8})):
        want = vtp.sample(x, seed=5, **options)
        assert not torch.equal(want[:2], want[2:])  # equal logits, other rows: other tokens
        for r, (out, _, _) in enumerate(results):
            assert torch.equal(out[name], want), (name, r)
            dp = r // 2
            assert torch.equal(out[name + "_local"], want[2 * dp : 2 * dp + 2]), (name, r)
    for out, (kind, msg), after in results:
        assert torch.equal(out["argmax"], x.argmax(-1))
        assert kind == "ValueError" and "not one run of the global rows" in msg, (kind, msg)
        assert torch.equal(after, vtp.sample(x, seed=5))


# -- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpu_same_tokens_at_every_layout(ranks, layout):
    """TP 2, 3, 4 as processes sharing cuda:0 over gloo, V = 151936, bf16: the tokens of one process."""
    kw = {"n": 64, "v": 151936, "device": "cuda", "dtype": torch.bfloat16}
    results = ranks(len(LAYOUTS[layout]), layout_job, layout, "triton", RANK_CASES, timeout=600, **kw)
    _check_layout(results, "triton", RANK_CASES, **kw)


# -- argmax of a Head --------------------------------------------------------------------------


def head_argmax_job(rank, world, group, backend):
    """argmax of a Head (hidden [2, 7, 6], weight rows split unevenly, chunks of 3 tokens)
    on every rank, and the dense argmax of the full logits in float64."""
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(2, 7, 6, generator=g)
    weight = torch.randn(23, 6, generator=g)
    bias = torch.randn(23, generator=g)
    weight[5] = weight[17]  # a tie across the shards: the lowest id wins
    bias[5] = bias[17]
    start, end = (0, 9) if rank == 0 else (9, 23)
    head = vtp.Head(hidden, weight[start:end], bias[start:end], chunk_rows=3)
    got = vtp.argmax(head, tp_group=group, backend=backend)
    want = (hidden.double() @ weight.double().T + bias.double()).argmax(-1)
    return got, want


@pytest.mark.parametrize("backend", conformance.backends_with("argmax"))
def test_argmax_of_a_head(ranks, backend):
    """argmax straight from the hidden states, the logits formed one token chunk at a time:
    the dense argmax of hidden @ W.T + b on every rank."""
    for got, want in ranks(2, head_argmax_job, backend, timeout=120):
        assert torch.equal(got, want)


def sequence_parallel_argmax_job(rank, world, group):
    """argmax of a sequence-parallel Head: refused with its reason on every rank, then a
    normal call."""
    hidden = torch.randn(3, 6)  # this rank's token shard
    weight = torch.randn(11, 6)
    try:
        vtp.argmax(vtp.Head(hidden, weight, sequence_parallel=True), tp_group=group)
    except Exception as exc:  # the test compares what each rank raised
        got = f"{type(exc).__name__}: {exc}"
    else:
        got = "no error"
    return got, vtp.argmax(torch.randn(3, 11, generator=torch.Generator().manual_seed(3)), tp_group=group)


def test_argmax_refuses_a_sequence_parallel_head(ranks):
    """argmax takes a Head chunk by chunk over this rank's hidden rows; a sequence-parallel
    Head (each rank a shard of the tokens) it refuses rather than answering for a shard."""
    results = ranks(2, sequence_parallel_argmax_job, timeout=120)
    for got, _ in results:
        assert "sequence-parallel head inputs not supported" in got, got
    assert torch.equal(results[0][1], results[1][1])
