"""The triton backend's fused-head logits GEMM (``backends/triton/head_gemm.py``): the Triton
matmul writing each vocabulary tile's softmax statistics, the forward merging them in place
of its statistics pass, chosen by capability with ``torch.mm`` (cuBLAS chunks) as the fallback.

On the CPU under Triton's interpreter (tiny shapes): values and the hidden, weight and bias
gradients against the float64 reference (``head_cases.run_head_case``) at TP 1-3 with even,
uneven and empty shards (uneven shards put ranks on both paths in one call: their partials
gather together), bias, teacher heads, sequence-parallel heads, per-token results; which path
each rank took; the capability gate's reasons; the fallback where the GEMM cannot run, and
``VTP_HEAD_GEMM=cublas``; what ``vtp.explain`` says. On a CUDA GPU (marked ``gpu``) at
N = 8192, H = 4096, V = 151936 / TP, bf16: both paths in one test against float64 and
against each other.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

import vtp_runtime as vtp  # noqa: E402
from vtp_runtime.backends.triton import head_gemm  # noqa: E402
from vtp_runtime.testing import conformance  # noqa: E402
from vtp_runtime.testing.cases import DTYPES, shard_sizes  # noqa: E402
from vtp_runtime.testing.head_cases import TOKEN_SPLITS, HeadCase, run_head_case  # noqa: E402


@contextmanager
def _counting_gemm():
    """Count the epilogue GEMM's launches (one per Head input and chunk that took it)."""
    calls: list[int] = []
    original = head_gemm.logits_with_statistics

    def spy(cfg, call, hidden, weight, bias, out):
        calls.append(hidden.shape[0])
        return original(cfg, call, hidden, weight, bias, out)

    head_gemm.logits_with_statistics = spy
    try:
        yield calls
    finally:
        head_gemm.logits_with_statistics = original


@contextmanager
def _head_gemm_env(value: str):
    before = os.environ.get("VTP_HEAD_GEMM")
    os.environ["VTP_HEAD_GEMM"] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ["VTP_HEAD_GEMM"]
        else:
            os.environ["VTP_HEAD_GEMM"] = before


def _case_counting(rank, world, group, case, force=""):
    """``run_head_case`` on this rank; returns the epilogue GEMM's launches here."""
    with _head_gemm_env(force), _counting_gemm() as calls:
        run_head_case(rank, world, group, case)
    return len(calls)


def _aligned(v_local: int, dtype: str) -> bool:
    return v_local > 0 and (v_local * DTYPES[dtype].itemsize) % 16 == 0


# hidden size 8 and 48 columns: 16-byte rows in fp32 and bf16 at TP 1, 2 and 3 (even shards)
BASE = HeadCase("cross_entropy", hidden=8, vocab=48, backend="triton", shape=(3, 7), chunk_rows=8, scale=4.0)
CASES = {
    "ce-bias-ignored": BASE.with_(bias=True, masked="labels", options=(("reduction", "mean"),)),
    "ce-zloss-temperature-none": BASE.with_(options=(("reduction", "none"), ("z_loss", 1e-3), ("temperature", 0.7))),
    "ce-bf16": BASE.with_(dtype="bfloat16", bias=True, options=(("reduction", "sum"),)),
    "logprobs-topk": BASE.with_(op="logprobs", topk=3, options=(("reduction", "none"),)),
    "jsd-teacher-head-masked": BASE.with_(
        op="jsd", masked="mask", bias=True, options=(("reduction", "mean"), ("beta", 0.3))
    ),
    "jsd-teacher-grad-none": BASE.with_(op="jsd", options=(("reduction", "none"), ("beta", 0.6))),
}


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_epilogue_gemm_matches_float64(ranks, name, world):
    """Even shards: every rank takes the epilogue GEMM, values and gradients exact."""
    case = CASES[name].with_(layout="even")
    counts = ranks(world, _case_counting, case, timeout=300)
    assert all(c > 0 for c in counts), counts


@pytest.mark.parametrize(
    "name,layout",
    [
        ("ce-bias-ignored", "uneven"),
        ("ce-bias-ignored", "explicit"),
        ("logprobs-topk", "uneven"),
        ("jsd-teacher-head-masked", "uneven"),
        ("jsd-teacher-head-masked", "empty"),
    ],
)
def test_ranks_on_either_path_agree(ranks, name, layout):
    """Uneven shards at TP 3: a rank whose V_local gives 16-byte rows takes the GEMM, the
    others (and an empty shard) torch.mm; their partials gather and merge together."""
    case = CASES[name].with_(layout=layout, vocab=53, seed=5)
    counts = ranks(3, _case_counting, case, timeout=300)
    sizes, _ = shard_sizes(layout, case.vocab, 3, case.seed)
    assert [c > 0 for c in counts] == [_aligned(v, case.dtype) for v in sizes], (sizes, counts)


@pytest.mark.parametrize("sequence", TOKEN_SPLITS)
@pytest.mark.parametrize("name", ["ce-bias-ignored", "jsd-teacher-head-masked"])
def test_sequence_parallel_heads(ranks, name, sequence):
    case = CASES[name].with_(layout="even", sequence=sequence, shape=(9, 2))
    counts = ranks(2, _case_counting, case, timeout=300)
    assert all(c > 0 for c in counts), counts


def test_forced_fallback_on_ranks(ranks):
    """VTP_HEAD_GEMM=cublas on every rank: no GEMM launch, the same exact results."""
    counts = ranks(2, _case_counting, CASES["ce-bias-ignored"].with_(layout="even"), force="cublas", timeout=300)
    assert counts == [0, 0]


@pytest.mark.parametrize("op", [op for op in conformance.ops_with() if op not in head_gemm.OPS])
def test_ops_the_epilogue_does_not_serve_run_through_torch_mm(ranks, op):
    case = BASE.with_(op=op, options=(("reduction", "mean"),), layout="even")
    assert ranks(2, _case_counting, case, timeout=300) == [0, 0]


@pytest.mark.parametrize(
    "options", [(("label_smoothing", 0.1), ("reduction", "mean")), (("beta", 1.0), ("reduction", "mean"))]
)
def test_options_the_epilogue_does_not_serve_run_through_torch_mm(ranks, options):
    op = "jsd" if dict(options).get("beta") is not None else "cross_entropy"
    case = BASE.with_(op=op, options=options, layout="even")
    assert ranks(1, _case_counting, case, timeout=300) == [0]


def test_both_paths_agree_closely():
    """The same call both ways in one process: fp32 values and gradients within 1e-5."""
    g = torch.Generator().manual_seed(7)
    h = torch.randn(45, 16, generator=g).requires_grad_(True)
    w = (torch.randn(64, 16, generator=g) * 0.8).requires_grad_(True)
    b = torch.randn(64, generator=g).requires_grad_(True)
    y = torch.randint(0, 64, (45,), generator=g)
    out = []
    for force, launches in (("", 3), ("cublas", 0)):
        with _head_gemm_env(force), _counting_gemm() as calls:
            loss = vtp.cross_entropy(vtp.Head(h, w, b, chunk_rows=16), y, reduction="mean", backend="triton")
            out.append((loss.detach(), *torch.autograd.grad(loss, (h, w, b))))
        assert len(calls) == launches
    for got, want in zip(*out):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bench_times_both_paths():
    """``vtp-runtime bench --head``'s ``fused_cublas`` arm is ``fused`` through torch.mm, and
    leaves the environment as it found it."""
    from vtp_runtime.tools import bench_head

    g = torch.Generator().manual_seed(2)
    h = torch.randn(20, 8, generator=g).requires_grad_(True)
    w = torch.randn(48, 8, generator=g).requires_grad_(True)
    y = torch.randint(0, 48, (20,), generator=g)
    got = {}
    for arm in ("fused", "fused_cublas"):
        with _counting_gemm() as calls:
            got[arm] = bench_head.head_arm("cross_entropy", arm, "triton", h, w, y, None, None, 0.5)()
        assert bool(calls) == (arm == "fused")
    assert "VTP_HEAD_GEMM" not in os.environ
    for a, b in zip(got["fused"], got["fused_cublas"]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


# -- the capability gate ----------------------------------------------------------------------------


def _tensors(v=48, hidden=8, dtype=torch.bfloat16):
    return torch.randn(5, hidden).to(dtype), torch.randn(v, hidden).to(dtype), torch.randn(v).to(dtype)


def test_gate_allows_the_interpreter_with_aligned_tensors():
    h, w, b = _tensors()
    assert head_gemm.refusal(torch.device("cpu"), torch.bfloat16, "cross_entropy", parts=[(h, w, b)]) is None
    assert head_gemm.refusal(torch.device("cpu"), torch.float32, "logprobs", features={"topk"}) is None
    assert head_gemm.refusal(torch.device("cpu"), torch.float16, "jsd", options={"beta": 0.5}) is None


@pytest.mark.parametrize(
    "op,features,options,dtype,match",
    [
        ("entropy", (), None, torch.bfloat16, "entropy needs each row's sum of p log p"),
        ("kl", (), None, torch.bfloat16, "reads student and teacher together"),
        ("argmax", (), None, torch.bfloat16, "argmax: its forward does not take"),
        ("cross_entropy", ("label_smoothing",), None, torch.bfloat16, "label_smoothing needs"),
        ("logprobs", ("return_entropy",), None, torch.bfloat16, "return_entropy needs"),
        ("jsd", (), {"beta": 0.0}, torch.bfloat16, "jsd at beta 0 or 1 runs as a KL"),
        ("cross_entropy", (), None, torch.float64, "dtype float64: the epilogue GEMM takes bf16 and fp16"),
    ],
)
def test_gate_refuses_what_the_epilogue_cannot_serve(op, features, options, dtype, match):
    why = head_gemm.refusal(torch.device("cpu"), dtype, op, features, options)
    assert why is not None and match in why, why


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda h, w, b: (h, w[:0], b[:0]), "empty vocabulary shard"),
        (lambda h, w, b: (h, w[:44], b[:44]), "logits rows of V_local = 44 bfloat16 are not a multiple of 16 bytes"),
        (lambda h, w, b: (h[:, :6], w[:, :6], b), "hidden rows of 6 bfloat16 elements"),
        (lambda h, w, b: (h, w.t().contiguous().t(), b), "weight is not contiguous along its last dimension"),
        (lambda h, w, b: (h.reshape(-1)[1:33].reshape(4, 8), w, b), "hidden does not start at a 16-byte aligned"),
        (lambda h, w, b: (h, w, torch.randn(96).bfloat16()[::2]), "the bias is not contiguous"),
    ],
)
def test_gate_refuses_tensors_tma_cannot_take(change, match):
    why = head_gemm.tensors_refusal(*change(*_tensors()))
    assert why is not None and match in why, why


def test_gate_on_devices(monkeypatch):
    assert "device type 'xpu'" in str(head_gemm.device_refusal(torch.device("xpu")))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "outside Triton's interpreter" in str(head_gemm.device_refusal(torch.device("cpu")))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert head_gemm.device_refusal(torch.device("cuda", 0)) == "no CUDA device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, verdict in (((8, 0), "CUDA sm_80: the epilogue GEMM needs sm_90 or later (TMA)"), ((9, 0), None)):
        head_gemm.cuda_refusal.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i, c=capability: c)
        assert head_gemm.device_refusal(torch.device("cuda", 0)) == verdict
    head_gemm.cuda_refusal.cache_clear()
    monkeypatch.setattr(head_gemm, "descriptors_refusal", lambda: "no triton.tools.tensor_descriptor in this Triton")
    assert "tensor_descriptor" in str(head_gemm.device_refusal(torch.device("cpu")))
    monkeypatch.setenv("VTP_HEAD_GEMM", "cublas")
    assert head_gemm.device_refusal(torch.device("cpu")) == "VTP_HEAD_GEMM=cublas"


def test_tensor_descriptors_exist_in_this_triton():
    assert head_gemm.descriptors_refusal() is None


def test_unaligned_shard_falls_back_and_stays_exact():
    """V_local = 50 fp32 columns (200-byte rows): torch.mm computes the logits."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(20, 8, generator=g, dtype=torch.float64).requires_grad_(True)
    w = torch.randn(50, 8, generator=g, dtype=torch.float64).requires_grad_(True)
    y = torch.randint(0, 50, (20,), generator=g)
    hf, wf = h.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    with _counting_gemm() as calls:
        loss = vtp.cross_entropy(vtp.Head(hf, wf, chunk_rows=8), y, reduction="mean", backend="triton")
        got = torch.autograd.grad(loss, (hf, wf))
    assert calls == []
    ref = torch.nn.functional.cross_entropy(h @ w.T, y)
    want = torch.autograd.grad(ref, (h, w))
    assert abs(loss.item() - ref.item()) < 1e-5 * abs(ref.item())
    for a, b in zip(got, want):
        assert torch.allclose(a.double(), b, rtol=1e-4, atol=1e-6)


def test_explain_names_the_route(monkeypatch):
    h, w, _ = _tensors(dtype=torch.float32)
    y = torch.randint(0, 48, (5,))
    text = str(vtp.explain("cross_entropy", vtp.Head(h, w), y, backend="triton"))
    assert "head logits: triton epilogue GEMM" in text
    text = str(vtp.explain("cross_entropy", vtp.Head(h, w[:43]), y, backend="triton"))
    assert "head logits: cuBLAS chunks (logits rows of V_local = 43 float32" in text
    monkeypatch.setenv("VTP_HEAD_GEMM", "cublas")
    text = str(vtp.explain("cross_entropy", vtp.Head(h, w), y, backend="triton"))
    assert "head logits: cuBLAS chunks (VTP_HEAD_GEMM=cublas)" in text
    assert "head logits" not in str(vtp.explain("cross_entropy", h @ w.T, y, backend="triton"))


# -- on a CUDA GPU ---------------------------------------------------------------------------------

N, H, V = 8192, 4096, 151936


def _need_sm90():
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with compiled Triton: TRITON_INTERPRET=0 pytest -m gpu")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the epilogue GEMM runs on sm_90 and later")


def _float64(op, h, w, y, teacher, rows=1024):
    """float64 values of ``op`` and the gradients of their sum to h and w, row chunk by chunk."""
    from vtp_runtime.testing.reference import values_and_grads

    h64, w64 = h.detach().double(), w.detach().double()
    vals, dh, dw = [], torch.empty_like(h64), torch.zeros_like(w64)
    for lo in range(0, h64.shape[0], rows):
        hi = min(lo + rows, h64.shape[0])
        z: tuple[torch.Tensor, ...] = (h64[lo:hi] @ w64.T,)
        if teacher is not None:
            z += (teacher[0][lo:hi].double() @ teacher[1].double().T,)
        index = None if y is None else y[lo:hi]
        opts = {"beta": 0.5} if op == "jsd" else {}
        v, (dz, *_) = values_and_grads(op, z, index, None, needs_grad=(True,) + (False,) * (len(z) - 1), **opts)
        vals.append(v)
        assert dz is not None
        dh[lo:hi] = dz @ w64
        dw += dz.T @ h64[lo:hi]
    return torch.cat(vals).sum(), dh, dw


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("op", head_gemm.OPS)
def test_gpu_both_paths_against_float64_and_each_other(op, tp):
    """The epilogue GEMM (default) and cuBLAS chunks (VTP_HEAD_GEMM=cublas) in one test,
    reduction "sum": each within bf16 error of float64 (the GEMM's no more than 1.5x the
    cuBLAS path's, or 1e-3), and the two within bf16 tolerance of each other."""
    _need_sm90()
    n = N if op == "cross_entropy" else 2048
    g = torch.Generator(device="cuda").manual_seed(tp)
    v_local = V // tp
    h = torch.randn(n, H, device="cuda", generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(v_local, H, device="cuda", generator=g) * 2 * H**-0.5).bfloat16().requires_grad_(True)
    y = torch.randint(0, v_local, (n,), device="cuda", generator=g)
    teacher = None
    if op == "jsd":
        teacher = (
            torch.randn(n, H, device="cuda", generator=g).bfloat16(),
            (torch.randn(v_local, H, device="cuda", generator=g) * 2 * H**-0.5).bfloat16(),
        )
    second = (vtp.Head(*teacher),) if teacher is not None else (y,)
    opts: dict[str, Any] = {"beta": 0.5} if op == "jsd" else {}
    # below the shard size where cuBLAS was measured faster the GEMM is taken only when asked
    gemm = "" if v_local >= head_gemm.MIN_CUDA_V_LOCAL else "triton"
    with _head_gemm_env(gemm):
        assert "triton epilogue GEMM" in str(vtp.explain(op, vtp.Head(h, w), *second, backend="triton", **opts))
    if gemm:
        with _head_gemm_env(""):
            assert "measured faster" in str(vtp.explain(op, vtp.Head(h, w), *second, backend="triton", **opts))
    runs = {}
    for force, used in ((gemm, True), ("cublas", False)):
        with _head_gemm_env(force), _counting_gemm() as calls:
            out = vtp.loss(op, vtp.Head(h, w), *second, reduction="sum", backend="triton", **opts)
            runs[force] = (out.detach(), *torch.autograd.grad(out, (h, w)))
            torch.cuda.synchronize()
        assert bool(calls) == used, (force, len(calls))
    ref = _float64(op, h, w, None if op == "jsd" else y, teacher)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    for i, what in enumerate(("value", "dh", "dW")):
        e_gemm, e_cublas = rel(runs[gemm][i], ref[i]), rel(runs["cublas"][i], ref[i])
        assert e_gemm <= max(1.5 * e_cublas, 1e-3) and e_gemm < 3e-2, (what, e_gemm, e_cublas)
        assert rel(runs[gemm][i], runs["cublas"][i]) < 2e-2, what
