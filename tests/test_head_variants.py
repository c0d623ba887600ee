"""The candidate arrangements of the fused head's cross entropy (``benchmarks/head_variants.py``)
and the kernels they launch (``vtp_runtime.backends.triton.head_kernels``): every variant's
loss and gradients to the hidden states and the weight against the float64 reference, on the
CPU under Triton's interpreter (tiny shapes; the matmul through TMA descriptors and through
pointer loads; second streams are no-ops there), and on a CUDA GPU at the sizes of the
performance model (marked ``gpu``: ``TRITON_INTERPRET=0 python -m pytest -m gpu
tests/test_head_variants.py``)."""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton")

import benchmarks.head_variants as hv  # noqa: E402
from vtp_runtime.testing import reference  # noqa: E402

LOG2E = 1.4426950408889634


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _float64(h, w, y, upstream=None):
    """float64 reference: the mean (or, with ``upstream``, ``sum(values * upstream)``) of the
    cross entropy of ``h @ w.T`` and its gradients to h and w."""
    hd, wd = h.double().requires_grad_(True), w.double().requires_grad_(True)
    values = reference.values("cross_entropy", (hd @ wd.T,), y)
    if upstream is None:
        target = values.sum() / (y != hv.IGNORE).sum()
    else:
        target = (values * upstream.double()).sum()
    dh, dw = torch.autograd.grad(target, (hd, wd))
    return target.detach(), dh, dw


def _inputs(n, hidden, v, seed=0, ignored=0):
    h, w, y, upstream = hv.inputs(n, hidden, v, "cpu", dtype=torch.float32, seed=seed)
    w = w * 4  # logits of a few units: probabilities far from uniform
    y[:ignored] = hv.IGNORE
    return h, w, y, upstream


def _check(name, h, w, y, upstream, cfg=None, rows=16, tol=1e-5):
    variant = hv.VARIANTS[name]
    values, dh, dw = hv.run_variant(variant, h, w, y, cfg or hv.MatmulConfig(), upstream, rows=rows)
    if variant.reduction == "none":
        loss = (values * upstream).sum()
        want = _float64(h, w, y, upstream)
    else:
        loss = values
        want = _float64(h, w, y)
    for what, got, ref in zip(("loss", "dh", "dW"), (loss, dh, dw), want):
        assert _rel(got, ref) < tol, (name, what, _rel(got, ref))


# 52 columns of fp32 are 16-byte rows: the matmul reads and writes through TMA descriptors
@pytest.mark.parametrize("name", list(hv.VARIANTS))
def test_variant_matches_float64(name):
    h, w, y, upstream = _inputs(37, 24, 52, ignored=3)
    assert hv.tma_ok(hv.MatmulConfig(), h, w, torch.empty(16, 52))
    _check(name, h, w, y, upstream)


# 50 columns: rows not 16-byte aligned, so the pointer loads
@pytest.mark.parametrize("name", ["epilogue", "none_epilogue"])
def test_variant_matches_float64_without_tma(name):
    h, w, y, upstream = _inputs(29, 24, 50, seed=1)
    _check(name, h, w, y, upstream, cfg=hv.MatmulConfig(tma=False))


@pytest.mark.parametrize("name", ["epilogue", "none_epilogue"])
def test_variant_in_bf16(name):
    """bf16 inputs and logits: errors at bf16 level (the interpreter rounds to bf16 its own
    way; the GPU test holds them to twice the materialized path's)."""
    h, w, y, upstream = _inputs(40, 32, 64, seed=2)
    _check(name, h.bfloat16(), w.bfloat16(), y, upstream, tol=2e-2)


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_epilogues(tma, bias):
    """Each epilogue of the matmul on a shard that starts at column 100 of the vocabulary:
    the logits (with a bias), the partial states merged into the shard's log-sum-exp, the
    label's logit where the shard owns it, the gradient from given row statistics; rows and
    columns past a tile's edge."""
    n, hidden, v, start, vocab = 21, 24, 52, 100, 300
    g = torch.Generator().manual_seed(3)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(v, hidden, generator=g)
    b = torch.randn(v, generator=g) if bias else None
    y = torch.randint(0, vocab, (n,), generator=g)
    y[:4] = torch.tensor([start, start + v - 1, start - 1, hv.IGNORE])
    cfg = hv.MatmulConfig(tma=tma)
    z_ref = h.double() @ w.double().T + (0 if b is None else b.double())
    own = (y >= start) & (y < start + v)

    z = torch.full((n, v), math.nan)
    tiles = hv.vocab_tiles(v, cfg, h.device)
    part = torch.full((tiles, 2, n), math.nan)
    hv.matmul("stats", h, w, cfg, out=z, bias=b, part=part, vocab_start=start, vocab_size=vocab)
    assert _rel(z, z_ref) < 1e-6
    values, stats = torch.empty(n), torch.empty(n, 2)
    hv.finish(part, tiles, y, values, stats, z=z, vocab_start=start, vocab_size=vocab, v_local=v)
    lse = (stats[:, 0].double() * LOG2E + stats[:, 1].double()) / LOG2E
    assert torch.allclose(lse, torch.logsumexp(z_ref, 1), rtol=1e-6, atol=1e-5)

    part_only, label = torch.full((tiles, 2, n), math.nan), torch.zeros(n)
    hv.matmul("stats_only", h, w, cfg, bias=b, part=part_only, label=label, y=y, vocab_start=start, vocab_size=vocab)
    assert torch.equal(part_only, part)
    picked = z_ref.gather(1, (y - start).clamp(0, v - 1)[:, None])[:, 0]
    assert torch.allclose(label.double(), torch.where(own, picked, 0.0), rtol=1e-6, atol=1e-5)

    upstream = torch.rand(n, generator=g)
    dz = torch.full((n, v), math.nan)
    hv.matmul("grad", h, w, cfg, out=dz, bias=b, y=y, stats=stats, grad=upstream, vocab_start=start, vocab_size=vocab)
    onehot = torch.zeros(n, v, dtype=torch.float64)
    onehot[own, (y - start)[own]] = 1.0
    keep = (y != hv.IGNORE).double()[:, None]
    want = (torch.softmax(z_ref, 1) - onehot) * upstream.double()[:, None] * keep
    assert torch.allclose(dz.double(), want, rtol=1e-5, atol=1e-7)


def test_bad_label_and_ignored_rows():
    """A label outside the vocabulary: NaN value and NaN gradient row, the other rows exact;
    an ignored label: value 0, gradient row 0; both through the finish and gradient passes."""
    n, v = 6, 40
    g = torch.Generator().manual_seed(4)
    z = torch.randn(n, v, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    y[1], y[2] = v + 5, hv.IGNORE
    flat = torch.empty(2 * hv.MAX_SPLITS * n)
    part = hv.stats_pass(z, flat)
    values, stats = torch.empty(n), torch.empty(n, 2)
    hv.finish(part, part.shape[0], y, values, stats, z=z, vocab_size=v, v_local=v)
    want = reference.values("cross_entropy", (z,), y)
    assert math.isnan(values[1]) and values[2] == 0
    ok = torch.tensor([0, 3, 4, 5])
    assert torch.allclose(values[ok].double(), want[ok], rtol=1e-6)
    dz = z.clone()
    hv.grad_pass(dz, y, stats, torch.tensor(0.5), vocab_size=v)
    _, (dz_ref,) = reference.values_and_grads("cross_entropy", (z,), y, torch.full((n,), 0.5))
    assert dz_ref is not None
    assert torch.isnan(dz[1]).all() and (dz[2] == 0).all()
    assert torch.allclose(dz[ok].double(), dz_ref[ok], rtol=1e-5, atol=1e-7)


def test_rows_rule():
    """Buffers within the budget, rows a multiple of 256, balanced over the chunks."""
    assert hv.rows_for(8192, 151936, 2, hv.CHUNK_BYTES) == 1280
    assert hv.rows_for(8192, 151936, 2, hv.TWO_BUFFER_BYTES, 2) == 768
    assert hv.rows_for(8192, 151936 // 2, 2, hv.CHUNK_BYTES) == 2048
    assert hv.sub_rows(1280, 2) == 640 and hv.sub_rows(20, 2) == 10


# -- on a CUDA GPU ----------------------------------------------------------------------------------


def _need_cuda():
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with compiled Triton: TRITON_INTERPRET=0 pytest -m gpu")


def _float64_chunked(h, w, y, upstream, rows=1024):
    """float64 values and gradients of ``sum(values * upstream)``, row chunk by chunk."""
    h64, w64 = h.double(), w.double()
    vals, dh, dw = [], torch.empty_like(h64), torch.zeros_like(w64)
    for lo in range(0, h64.shape[0], rows):
        hi = min(lo + rows, h64.shape[0])
        v, (dz,) = reference.values_and_grads("cross_entropy", (h64[lo:hi] @ w64.T,), y[lo:hi], upstream[lo:hi])
        vals.append(v)
        assert dz is not None
        dh[lo:hi] = dz @ w64
        dw += dz.T @ h64[lo:hi]
    return torch.cat(vals), dh, dw


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", list(hv.VARIANTS))
def test_variant_on_gpu_as_accurate_as_materialized(name, tp):
    """N = 8192 (2048 for reduction="none"), H = 4096, V_local = 151936 / TP, bf16: relative
    errors against float64 within twice those of the materialized path and under 3e-2."""
    _need_cuda()
    import vtp_runtime as vtp

    variant = hv.VARIANTS[name]
    n = 2048 if variant.reduction == "none" else 8192
    h, w, y, upstream = hv.inputs(n, 4096, 151936 // tp, "cuda", seed=tp)
    per_token = upstream if variant.reduction == "none" else torch.full_like(upstream, 1.0 / n)
    values, dh, dw = hv.run_variant(variant, h, w, y, hv.GPU_CONFIGS[0], upstream)
    got = ((values * upstream).sum() if variant.reduction == "none" else values, dh, dw)
    ref_vals, ref_dh, ref_dw = _float64_chunked(h, w, y, per_token.double())
    want = ((ref_vals * per_token.double()).sum(), ref_dh, ref_dw)
    hg, wg = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    mat = (vtp.cross_entropy(hg @ wg.T, y, reduction="none", backend="triton") * per_token).sum()
    materialized = (mat.detach(), *torch.autograd.grad(mat, (hg, wg)))
    for what, g_t, m_t, r_t in zip(("loss", "dh", "dW"), got, materialized, want):
        e, e_mat = _rel(g_t, r_t), _rel(m_t, r_t)
        assert e <= max(2 * e_mat, 1e-3) and e < 3e-2, (what, e, e_mat)
