"""The triton backend on a CUDA GPU at realistic sizes (V = 151936 and 262144, N up to
16384, fp32/bf16/fp16), against the float64 reference computed on the GPU in row chunks.
Marked ``gpu``: CI has no GPU and skips them with the reason; run on the GPU machine with
``python -m pytest tests/test_triton_gpu.py -m gpu``.

Per-rank shards of a TP group are exercised with ``vocab_start``/``global_vocab_size`` at
TP = 1 on one device only through the interpreter tests; here every call is a full, real
GPU launch at the sizes users run.
"""

import math
import os
from typing import Any

import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime.ops import OPS
from vtp_runtime.testing import conformance
from vtp_runtime.testing.reference import values_and_grads

pytestmark = pytest.mark.gpu

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# relative L2 error of the gradient against float64 (rounded to the input dtype)
GRAD_TOL = {"float32": 1e-5, "bfloat16": 8e-3, "float16": 1e-3}


@pytest.fixture(autouse=True)
def _need_cuda():
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        pytest.skip(
            "needs a CUDA GPU with compiled Triton (torch.cuda.is_available() is False "
            "or TRITON_INTERPRET=1); run on the GPU machine: TRITON_INTERPRET=0 pytest -m gpu"
        )


def _reference(op, logits, index, grad, chunk_rows, **opts):
    """float64 values and student gradient, computed chunk by chunk of rows on the GPU."""
    n = logits[0].shape[0]
    vals, grads = [], []
    for lo in range(0, n, chunk_rows):
        hi = min(n, lo + chunk_rows)
        part = tuple(z[lo:hi] for z in logits)
        idx = None if index is None else index[lo:hi]
        extra = {k: (v[lo:hi] if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
        v, g = values_and_grads(op, part, idx, grad[lo:hi], needs_grad=(True,) + (False,) * (len(part) - 1), **extra)
        vals.append(v)
        assert g[0] is not None
        grads.append(g[0].to(logits[0].dtype))
        del v, g
    return torch.cat(vals), torch.cat(grads)


def _check(op, dtype, n, v, seed=0, **opts):
    dt = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(seed)
    z = (torch.randn(n, v, device="cuda", generator=g) * 3).to(dt).requires_grad_(True)
    args = [z]
    index = None
    if len(OPS[op].inputs) == 2:
        args.append((torch.randn(n, v, device="cuda", generator=g) * 3).to(dt))
    if OPS[op].index:
        index = torch.randint(0, v, (n,), device="cuda", generator=g)
        index[torch.rand(n, device="cuda", generator=g) < 0.1] = -100
        args.append(index)
    upstream = torch.randn(n, device="cuda", generator=g, dtype=torch.float64)
    out = vtp.loss(op, *args, backend="triton", **opts)
    (grad,) = torch.autograd.grad(out, (z,), upstream.float())
    assert grad.dtype == dt
    chunk = max(1, (1 << 26) // v)
    ref_opts = {k: val for k, val in opts.items()}
    ref_v, ref_g = _reference(
        op, tuple(a.detach() for a in args if a.is_floating_point()), index, upstream, chunk, **ref_opts
    )
    # values: fp32 accumulation over V elements
    torch.testing.assert_close(out.double(), ref_v, rtol=5e-5, atol=5e-5 * max(1.0, ref_v.abs().max().item()))
    err = (grad.double() - ref_g.double()).norm() / ref_g.double().norm().clamp_min(1e-30)
    assert err.item() < GRAD_TOL[dtype], f"{op} {dtype} N={n} V={v}: gradient relative L2 error {err.item():.3g}"


CASES: list[tuple[str, dict[str, Any]]] = [
    ("cross_entropy", {}),
    ("cross_entropy", {"label_smoothing": 0.1, "z_loss": 1e-4}),
    ("logprobs", {}),
    ("entropy", {"temperature": 0.7}),
    ("kl", {}),
    ("kl", {"reverse": True}),
    ("jsd", {"beta": 0.5}),
    ("jsd", {"beta": 0.1, "temperature": 2.0}),
    ("jsd", {"beta": 0.0}),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op,opts", CASES, ids=[f"{o}-{','.join(f'{k}={v}' for k, v in p.items())}" for o, p in CASES])
def test_realistic_v151936(op, opts, dtype):
    _check(op, dtype, 1024, 151936, **opts)


@pytest.mark.parametrize("op", conformance.ops_with(backend="triton"))
def test_v262144_many_tokens(op):
    _check(op, "bfloat16", 4096, 262144, seed=1)


@pytest.mark.parametrize("op", ["cross_entropy", "jsd"])
def test_n16384(op):
    _check(op, "bfloat16", 16384, 151936, seed=2)


@pytest.mark.parametrize("v_local", [18992, 37984, 75968])
def test_tp_shard_sizes_few_tokens(v_local):
    """Per-rank shard sizes of TP 8/4/2 with few tokens: many vocabulary splits per row."""
    _check("jsd", "bfloat16", 64, v_local, seed=3, beta=0.3)
    _check("cross_entropy", "bfloat16", 64, v_local, seed=4)


def test_strided_causal_shift_view():
    z = torch.randn(4, 257, 32000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 32000, (4, 256), device="cuda")
    out = vtp.cross_entropy(z[:, :-1], labels, backend="triton")
    ref = torch.nn.functional.cross_entropy(z[:, :-1].float().reshape(-1, 32000), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(out.reshape(-1), ref, rtol=2e-5, atol=2e-5)
    (g,) = torch.autograd.grad(out.sum(), (z,))
    assert torch.equal(g[:, -1], torch.zeros_like(g[:, -1]))


def test_edge_rows_on_gpu():
    """-inf vocabulary slices, an all -inf row, masked rows and a 1e4 offset on real kernels."""
    n, v = 64, 151936
    z = torch.randn(n, v, device="cuda") * 3
    z[:, : v // 5] = -math.inf
    z[3] = -math.inf
    z[5] += 1e4
    t = torch.randn(n, v, device="cuda") * 3
    t[3] = -math.inf
    mask = torch.ones(n, dtype=torch.bool, device="cuda")
    mask[7] = False
    zz = z.bfloat16().requires_grad_(True)
    out = vtp.jsd(zz, t.bfloat16(), beta=0.3, mask=mask, backend="triton")
    assert torch.isnan(out[3]) and out[7] == 0
    assert torch.isfinite(out[torch.arange(n, device="cuda") != 3]).all()
    (g,) = torch.autograd.grad(out.nan_to_num().sum(), (zz,))
    assert torch.equal(g[7], torch.zeros_like(g[7]))
    others = torch.ones(n, dtype=torch.bool, device="cuda")
    others[3] = False
    assert torch.isfinite(g[others]).all()


def test_cuda_graph_capture():
    """No host synchronization: forward + backward capture in a CUDA graph and replay right."""
    z = torch.randn(256, 32000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randn(256, 32000, device="cuda", dtype=torch.bfloat16)

    def step():
        out = vtp.jsd(z, t, beta=0.5, backend="triton")
        return torch.autograd.grad(out.sum(), (z,))[0]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        expected = step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [0, 4])
def test_logprobs_with_entropy_v151936(dtype, k):
    """logprobs(return_entropy=True) on real kernels: both outputs, and the gradient of
    sum(lp * g_lp) + sum(H * g_H), against float64 (a quarter of the tokens fully masked)."""
    n, v = 1024, 151936
    dt = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(5)
    z = (torch.randn(n, v, device="cuda", generator=g) * 3).to(dt).requires_grad_(True)
    index = torch.randint(0, v, (n, k) if k else (n,), device="cuda", generator=g)
    index[torch.rand(n, device="cuda", generator=g) < 0.25] = -100
    kept = index != -100 if not k else (index != -100).any(-1)
    g_lp = torch.randn(index.shape, device="cuda", generator=g, dtype=torch.float64)
    g_h = torch.randn(n, device="cuda", generator=g, dtype=torch.float64)
    lp, h = vtp.logprobs(z, index, return_entropy=True, backend="triton")
    (grad,) = torch.autograd.grad((lp, h), (z,), (g_lp.float(), g_h.float()))
    chunk = max(1, (1 << 26) // v)
    ref_lp, ref_g_lp = _reference("logprobs", (z.detach(),), index, g_lp, chunk)
    ref_h, ref_g_h = _reference("entropy", (z.detach(),), None, g_h, chunk, mask=kept)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=5e-5, atol=5e-5 * max(1.0, ref_lp.abs().max().item()))
    torch.testing.assert_close(h.double(), ref_h, rtol=5e-5, atol=5e-5 * max(1.0, ref_h.abs().max().item()))
    ref_g = ref_g_lp.double() + ref_g_h.double()
    err = (grad.double() - ref_g).norm() / ref_g.norm().clamp_min(1e-30)
    assert err.item() < GRAD_TOL[dtype], f"k={k} {dtype}: gradient relative L2 error {err.item():.3g}"


@pytest.mark.parametrize("upstream", [1.0, 0.375])
def test_scaling_a_heads_gradients_on_gpu(upstream):
    """The fused head's weight-sized gradient times the upstream gradient, bit for bit as
    torch's multi-tensor multiply rounds it (nearest even), past 2**31 elements (64-bit
    offsets) and over more tiles than programs; inside a CUDA graph too (the scale read on
    the device)."""
    from vtp_runtime.backends.triton import TritonBackend

    g = torch.Generator(device="cuda").manual_seed(5)
    grads = [
        torch.randn(151936 * 4096 + 7, device="cuda", generator=g).bfloat16(),
        torch.randn(8192, 4096, device="cuda"),
    ]
    want = [x.clone() for x in grads]
    scale = torch.full((1,), upstream, device="cuda").reshape(-1)[0]
    torch._foreach_mul_(want, scale)
    backend = TritonBackend()
    backend.scale_gradients(grads, scale)
    assert all(torch.equal(a, b) for a, b in zip(grads, want))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.scale_gradients(grads, scale)
    graph.replay()
    torch._foreach_mul_(want, scale)
    assert all(torch.equal(a, b) for a, b in zip(grads, want))
