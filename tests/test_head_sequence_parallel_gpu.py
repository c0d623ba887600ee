"""Megatron sequence parallelism, ``Head(sequence_parallel=True)``, on the GPU (marked gpu:
the GPU machine runs them): TP 2 and 3 on one GPU, the memory against the gather, and no
host sync over NCCL on two GPUs. The CPU tests are in test_head_sequence_parallel.py."""

from typing import Any

import pytest
import torch

import vtp_runtime as vtp
from tests.helpers import head_case_id
from vtp_runtime.testing.head_cases import HeadCase, run_head_case

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's -inf arithmetic

TIMEOUT = 20  # seconds: the collective timeout of the groups the jobs make


def _need_cuda(devices=1):
    import os

    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.device_count() < devices:
        pytest.skip(f"needs {devices} CUDA GPU(s) with compiled Triton: TRITON_INTERPRET=0 python -m pytest -m gpu")


def _on_gpu(op, sequence, shape, **kw):
    """A case on CUDA tensors: bf16 on the triton backend, V = 32003, H = 256, 128-row
    chunks, unless ``kw`` says otherwise."""
    fields: dict[str, Any] = dict(vocab=32003, hidden=256, dtype="bfloat16", backend="triton", chunk_rows=128) | kw
    return HeadCase(op, shape=shape, sequence=sequence, device="cuda", **fields)


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
@pytest.mark.parametrize("case", GPU_CASES, ids=head_case_id)
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
