"""vtp_runtime inside torch.compile(fullgraph=True): every op as one custom op, no graph
break at TP 1 and TP 2 (gloo ranks), values and gradients against the float64 reference
and against eager mode, with the eager backend (float64) and the triton backend under
Triton's interpreter (float32). AOT autograd runs (``backend="aot_eager"``), so the fake
implementations and the autograd registration are what the graph is built from; inductor's
code generation is left to the GPU tests. Compiling is slow: one step function covers
every op, and each test compiles it once."""

from typing import Any

import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime import library
from vtp_runtime.errors import BackendUnavailable
from vtp_runtime.testing.reference import values as reference

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # Triton's interpreter on -inf/NaN

B, S, V = 2, 3, 37
SIZES = {1: [V], 2: [17, 20]}  # uneven shards at TP 2
DTYPE = {"eager": torch.float64, "triton": torch.float32}
TOL: dict[torch.dtype, dict[str, Any]] = {
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
    torch.float32: {"rtol": 2e-5, "atol": 2e-5},
}


def step(z, t, y, k, m, w, group, backend):
    """Every op, several options and reductions; returns the outputs and one scalar to
    differentiate (``w`` weighs the per-token outputs)."""
    common = dict(tp_group=group, backend=backend)
    ce = vtp.cross_entropy(z, y, label_smoothing=0.1, z_loss=1e-3, reduction="mean", **common)
    lp, ent = vtp.logprobs(z, k, temperature=1.5, return_entropy=True, **common)  # top-k: [B, S, 2], [B, S]
    h = vtp.entropy(z, mask=m, reduction="sum", **common)
    rkl = vtp.kl(z, t, reverse=True, temperature=2.0, **common)
    jsd = vtp.jsd(z, t, beta=0.3, labels=y, reduction="sum", normalizer=7, **common)
    fkl = vtp.jsd(z, t.detach(), beta=0.0, **common)  # a KL endpoint, detached teacher
    total = ce + (lp * w[..., None]).sum() + (ent * w).sum() + h + (rkl * w).sum() + jsd + (fkl * w).sum()
    return total, (ce, lp, ent, h, rkl, jsd, fkl)


def _inputs(seed: int, dtype):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, S, V, generator=g, dtype=torch.float64) * 3
    t = torch.randn(B, S, V, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, V, (B, S), generator=g)
    y[0, 1] = -100
    k = torch.randint(0, V, (B, S, 2), generator=g)
    m = torch.rand(B, S, generator=g) > 0.3
    w = torch.randn(B, S, generator=g, dtype=torch.float64)
    return z.to(dtype), t.to(dtype), y, k, m, w.to(dtype)


def _reference(z, t, y, k, m, w):
    """The float64 outputs of ``step`` on the full logits, and the gradients of its total."""
    z, t = (x.detach().double().requires_grad_() for x in (z, t))
    n = B * S
    flat = lambda x: x.reshape(n, V)  # noqa: E731
    ce = reference("cross_entropy", (flat(z),), y.reshape(n), label_smoothing=0.1, z_loss=1e-3)
    ce = ce.sum() / (y != -100).sum()
    lp = reference("logprobs", (flat(z),), k.reshape(n, 2), temperature=1.5).view(B, S, 2)
    ent = reference("entropy", (flat(z),), temperature=1.5).view(B, S)
    h = reference("entropy", (flat(z),), mask=m.reshape(n)).sum()
    rkl = reference("kl", (flat(z), flat(t)), reverse=True, temperature=2.0).view(B, S)
    jsd = reference("jsd", (flat(z), flat(t)), beta=0.3, labels=y.reshape(n)).sum() / 7
    fkl = reference("jsd", (flat(z), flat(t).detach()), beta=0.0).view(B, S)
    w = w.double()
    total = ce + (lp * w[..., None]).sum() + (ent * w).sum() + h + (rkl * w).sum() + jsd + (fkl * w).sum()
    grads = torch.autograd.grad(total, (z, t))
    return (ce, lp, ent, h, rkl, jsd, fkl), grads


def _run(rank: int, world: int, group, backend: str) -> dict:
    """Compile ``step`` for this rank's shards, run it on two batches, and compare each
    output and gradient with the float64 reference and with eager mode."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    dtype = DTYPE[backend]
    start = sum(SIZES[world][:rank])
    shard = slice(start, start + SIZES[world][rank])
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    tol = TOL[dtype]
    for seed in (0, 1):  # the second batch reuses the graph
        z, t, y, k, m, w = _inputs(seed, dtype)
        zl, tl = (x[..., shard].clone().requires_grad_() for x in (z, t))
        g = group if world > 1 else None
        total, outs = compiled(zl, tl, y, k, m, w, g, backend)
        grads = torch.autograd.grad(total, (zl, tl))
        ref_outs, ref_grads = _reference(z, t, y, k, m, w)
        for got, want in zip(outs, ref_outs):
            torch.testing.assert_close(got.double(), want.detach(), **tol)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got.double(), want[..., shard], **tol)
        # eager mode: the same numbers (the same backend runs the same kernels)
        ze, te = (x.detach().clone().requires_grad_() for x in (zl, tl))
        total_e, outs_e = step(ze, te, y, k, m, w, g, backend)
        for got, want in zip((*outs, *grads), (*outs_e, *torch.autograd.grad(total_e, (ze, te)))):
            torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=1e-7)
    return {"graph_breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"]}


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_tp1_fullgraph(backend):
    result = _run(0, 1, None, backend)
    assert result == {"graph_breaks": 0, "graphs": 1}


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_tp2_fullgraph(ranks, backend):
    results = ranks(2, _run, backend, timeout=600)
    assert results == [{"graph_breaks": 0, "graphs": 1}] * 2


def test_dynamic_token_count():
    """A graph compiled with a symbolic token count serves several batch sizes."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(
        lambda z, y: vtp.cross_entropy(z, y, label_smoothing=0.2, backend="eager"),
        backend="aot_eager",
        fullgraph=True,
        dynamic=True,
    )
    for n in (5, 9, 13):
        g = torch.Generator().manual_seed(n)
        z = torch.randn(n, V, generator=g, dtype=torch.float64, requires_grad=True)
        y = torch.randint(0, V, (n,), generator=g)
        out = f(z, y)
        (grad,) = torch.autograd.grad(out.sum(), z)
        zr = z.detach().requires_grad_()
        want = reference("cross_entropy", (zr,), y, label_smoothing=0.2)
        (want_grad,) = torch.autograd.grad(want.sum(), zr)
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-10)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_custom_ops_pass_opcheck():
    """torch.library.opcheck: schema, fake implementations against real outputs, autograd
    registration, and AOT dispatch, for a one-input and a two-input op."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, V, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(4, V, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, V, (4,), generator=g)
    mask = torch.tensor([True, False, True, True])

    def scalars(**given):
        common = dict(group_name="", backend="eager", backend_source="the backend= argument", topk=False)
        return tuple({**common, **given}.get(name) for name, _ in library.FIELDS)

    ce = scalars(temperature=1.0, ignore_index=-100, label_smoothing=0.1, z_loss=0.0, needs_grad=[True])
    jsd = scalars(temperature=1.0, ignore_index=-100, beta=0.5, needs_grad=[True, True])
    torch.library.opcheck(library.forward_op, ("cross_entropy", [z], y, None, *ce))
    torch.library.opcheck(library.forward_op, ("jsd", [z, t], None, mask, *jsd))


def test_backend_that_cannot_run_compiled_says_so():
    """liger keeps [N, V_local] buffers: forced inside a compiled graph (here by use_backend,
    read when tracing) it raises with the reason; unforced, dispatch passes it over."""
    z = torch.randn(4, V, requires_grad=True)
    y = torch.randint(0, V, (4,))
    f = torch.compile(lambda z, y: vtp.cross_entropy(z, y), backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    with vtp.use_backend("liger"), pytest.raises(BackendUnavailable, match="cannot run inside torch.compile"):
        f(z, y)
    torch._dynamo.reset()
    torch.testing.assert_close(f(z, y), vtp.cross_entropy(z, y, backend="triton"), rtol=1e-5, atol=1e-5)


def test_bad_argument_fails_when_tracing():
    """A call that eager mode rejects is rejected when tracing, with the same message."""
    z = torch.randn(4, V)
    y = torch.randint(0, V, (4,))
    torch._dynamo.reset()
    f = torch.compile(lambda z, y: vtp.cross_entropy(z, y, label_smoothing=2.0), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"label_smoothing must be in \[0, 1\], got 2.0"):
        f(z, y)
    g = torch.compile(lambda z, y: vtp.cross_entropy(z, y, label_smoothing=2.0), backend="aot_eager")
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\], got 2.0"):
        g(z, y)  # without fullgraph, dynamo falls back to eager mode, which raises the ValueError
