"""vtp_runtime as a native part of a CUDA training step (marked ``gpu``; run on the GPU
machine with ``TRITON_INTERPRET=0 python -m pytest -m gpu tests/test_native_gpu.py``):

- after the first call of a signature, calls issue no device-to-host copy: checked with
  ``torch.cuda.set_sync_debug_mode("error")`` at TP=1, and at TP=2 with two processes
  sharing the GPU over gloo (where gloo's own collectives of CUDA tensors go through the
  host: those are let through, any other sync fails the test);
- a training step (a linear head, the triton loss, backward, an SGD update) captured in a
  CUDA graph and replayed on new data gives the losses and weights of the same steps run
  eagerly;
- with two GPUs, both at TP=2 over NCCL: no sync in steady state (NCCL included), and the
  CUDA-graph step on a vocabulary-sharded head;
- ``torch.compile(fullgraph=True)`` with inductor compiles a step using every op with no
  graph break, with the values and gradients of eager mode.
"""

import contextlib
import os

import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime import plans as plan

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _need_cuda():
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        pytest.skip(
            "needs a CUDA GPU with compiled Triton (torch.cuda.is_available() is False "
            "or TRITON_INTERPRET=1); run on the GPU machine: TRITON_INTERPRET=0 pytest -m gpu"
        )


@contextlib.contextmanager
def _sync_debug(mode):
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _calls(
    n: int, v_local: int, vocab: int, group, seed: int, dev: torch.device | None = None, backend: str = "triton"
):
    """Every op with the options that add work on the device: masks, labels, top-k, the
    entropy with the log-probs, a tensor normalizer on the device, each reduction; and the
    two inputs that get gradients."""
    dev = dev or torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(seed)
    z = torch.randn(n, v_local, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
    t = torch.randn(n, v_local, device=dev, generator=g, dtype=torch.bfloat16)
    t_grad = t.clone().requires_grad_()  # a teacher trained too (co-distillation)
    y = torch.randint(0, vocab, (n,), device=dev, generator=g)  # the same on every rank: same seed
    k = torch.randint(0, vocab, (n, 3), device=dev, generator=g)
    mask = torch.rand(n, device=dev, generator=g) > 0.2
    count = torch.full((), float(n), device=dev)
    common = dict(tp_group=group, backend=backend)
    return (z, t_grad), [
        lambda: vtp.cross_entropy(z, y, label_smoothing=0.1, reduction="mean", **common),
        lambda: vtp.cross_entropy(z.view(2, n // 2, v_local), y.view(2, n // 2), z_loss=1e-4, **common).sum(),
        lambda: vtp.logprobs(z, k, reduction="sum", normalizer=count, **common),
        lambda: sum(x.sum() for x in vtp.logprobs(z, y, return_entropy=True, **common)),
        lambda: vtp.entropy(z, mask=mask, reduction="mean", **common),
        lambda: vtp.kl(z, t, reverse=True, temperature=2.0, **common).sum(),
        lambda: vtp.jsd(z, t_grad, beta=0.3, labels=y, reduction="sum", **common),
    ]


def _steady(group, relax_collectives: bool, v_local: int, vocab: int, n: int = 1024) -> list:
    """Plan every call (first call, sync allowed), then run each again, forward and
    backward, under sync debug mode "error"; the calls that raised, with their errors."""
    _, calls = _calls(n, v_local, vocab, group, seed=0)
    for call in calls:
        call().backward()
    torch.cuda.synchronize()
    failures = []
    with _sync_debug("error"), _relaxed_collectives() if relax_collectives else contextlib.nullcontext():
        for i, call in enumerate(calls):
            try:
                for _ in range(2):
                    call().backward()
            except RuntimeError as exc:
                failures.append((i, str(exc).splitlines()[0]))
    torch.cuda.synchronize()
    return failures


@contextlib.contextmanager
def _relaxed_collectives():
    """Sync debug mode off inside torch.distributed collectives of CUDA tensors (gloo stages
    them through the host); everything else -- vtp_runtime's own code, and the host gather
    of the metadata on gloo -- keeps it on."""
    dist = torch.distributed
    names = [n for n in ("all_gather_into_tensor", "all_gather_single", "all_reduce") if hasattr(dist, n)]
    saved = {n: getattr(dist, n) for n in names}

    def relaxed(fn):
        def call(tensor, *args, **kwargs):
            if not any(isinstance(a, torch.Tensor) and a.is_cuda for a in (tensor, *args)):
                return fn(tensor, *args, **kwargs)
            with _sync_debug(0):
                return fn(tensor, *args, **kwargs)

        return call

    for n in names:
        setattr(dist, n, relaxed(saved[n]))
    try:
        yield
    finally:
        for n in names:
            setattr(dist, n, saved[n])


def test_steady_state_issues_no_sync_tp1():
    plan.clear()
    assert _steady(None, relax_collectives=False, v_local=32000, vocab=32000) == []


def _steady_tp2(rank, world, group, relax, one_gpu=True):
    if one_gpu:
        torch.cuda.set_device(0)  # two processes, one GPU (gloo); NCCL ranks have a GPU each
    plan.clear()
    try:
        return _steady(group, relax_collectives=relax, v_local=16000 + rank, vocab=32001)  # uneven shards
    finally:
        plan.clear()


def test_steady_state_issues_no_sync_of_its_own_tp2(ranks):
    """Two ranks on one GPU over gloo (the default metadata mode there: a host gather on
    every call, which needs no device sync). Gloo's collectives of CUDA tensors are let
    through; nothing else may sync."""
    assert ranks(2, _steady_tp2, True, timeout=300) == [[], []]


def test_gloo_itself_under_sync_debug_mode(ranks):
    """Whether gloo's own collectives of CUDA tensors sync (a fact about gloo, recorded: the
    test above lets them through either way). Fails only if something other than a
    torch.distributed collective synced."""
    results = ranks(2, _steady_tp2, False, timeout=300)
    if results == [[], []]:
        return  # gloo issued no sync that the debug mode sees
    pytest.xfail(f"gloo's collectives of CUDA tensors sync (seen by sync debug mode): {results[0][:1]}")


# -- the low-overhead launch path ----------------------------------------------------------


@pytest.mark.parametrize("n", [1024, 100])  # one launch per pass / split rows with a finishing kernel
def test_fast_launch_gives_the_jit_results(n):
    """CUDA_CONFIG launches kept compiled kernels directly (launch.py); the same calls through
    Triton's JIT every time give bit-identical values and gradients, on every kernel."""
    import dataclasses

    from vtp_runtime.backends.triton import CUDA_CONFIG, TritonBackend
    from vtp_runtime.backends.triton import launch as launch_mod
    from vtp_runtime.registry import REGISTRY, register

    class JitOnly(TritonBackend):
        name, priority = "triton_jit_launch", -5

    class Plugin:
        @staticmethod
        def vtp_runtime_register_backends(register):
            register(JitOnly(dataclasses.replace(CUDA_CONFIG, fast_launch=False)))

    vtp.hookimpl(Plugin.vtp_runtime_register_backends)
    register(Plugin(), name="triton_jit_launch")
    try:
        for backend in ("triton", "triton_jit_launch"):
            results = []
            for seed in (0, 1, 2):  # the later calls take the kept kernels
                leaves, calls = _calls(n, 4000, 4000, None, seed, backend=backend)
                outs = []
                for call in calls:
                    out = call()
                    out.backward()
                    outs.append(out.detach())
                results.append(outs + [leaf.grad for leaf in leaves])
            if backend == "triton":
                fast = results
                assert launch_mod.kept_count(), "no compiled kernel was kept: the fast path never ran"
            else:
                for a, b in zip(fast, results):
                    for x, y in zip(a, b):
                        assert torch.equal(x, y)
    finally:
        REGISTRY.unregister("triton_jit_launch")


# -- CUDA graphs ---------------------------------------------------------------------------


def _head_step(head, opt, hidden, labels, teacher, group=None):
    opt.zero_grad(set_to_none=False)
    logits = head(hidden)
    loss = vtp.cross_entropy(logits, labels, reduction="mean", backend="triton", tp_group=group) + vtp.jsd(
        logits, teacher, beta=0.3, reduction="mean", backend="triton", tp_group=group
    )
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("n", [1024, 200])  # one launch per pass (rows not split) / split rows
def _graph_against_eager(
    head, opt, eager_head, eager_opt, batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], group=None
) -> list[float]:
    """Capture forward + backward + SGD of ``head`` once, replay it on ``batches[1:]`` copied
    into the static inputs, and step ``eager_head`` (a copy) eagerly on the same batches:
    the losses and weights must agree. The graph's losses."""
    hidden, labels, teacher = (x.clone() for x in batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels and plans the calls (one eager step)
        _head_step(head, opt, hidden, labels, teacher, group)
    torch.cuda.current_stream().wait_stream(side)
    eager_losses = [_head_step(eager_head, eager_opt, *batches[0], group=group).item()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = _head_step(head, opt, hidden, labels, teacher, group)

    graph_losses = []
    for batch in batches[1:]:
        for static, new in zip((hidden, labels, teacher), batch):
            static.copy_(new)
        graph.replay()
        graph_losses.append(static_loss.item())
        eager_losses.append(_head_step(eager_head, eager_opt, *batch, group=group).item())
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses[1:]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.weight, eager_head.weight, rtol=1e-5, atol=1e-6)
    return graph_losses


def _sgd_heads(weight: torch.Tensor) -> tuple:
    """Two bias-free linear heads holding ``weight`` ([V_local, H]), each with its SGD."""
    heads = []
    for _ in range(2):
        head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
        with torch.no_grad():
            head.weight.copy_(weight)
        heads += [head, torch.optim.SGD(head.parameters(), lr=0.5)]
    return tuple(heads)


@pytest.mark.parametrize("n", [1024, 200])  # one launch per pass (rows not split) / split rows
def test_training_step_in_a_cuda_graph(n):
    """Capture forward + backward + SGD once, replay on three new batches copied into the
    static inputs; an eager copy of the model stepping on the same batches gives the same
    losses and weights."""
    torch.manual_seed(0)
    h, v = 256, 32000
    dev = torch.device("cuda")
    initial = torch.randn(v, h, device=dev) * 0.05
    batches = [
        (torch.randn(n, h, device=dev), torch.randint(0, v, (n,), device=dev), torch.randn(n, v, device=dev))
        for _ in range(4)
    ]
    head, opt, eager_head, eager_opt = _sgd_heads(initial)
    _graph_against_eager(head, opt, eager_head, eager_opt, batches)
    assert (head.weight - initial).abs().max() > 1e-4  # the replays did update the weights


# -- TP=2 over NCCL (two GPUs) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def nccl_ranks():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for NCCL ({torch.cuda.device_count()} here); run on a 2-GPU machine")
    from vtp_runtime.testing.distributed import RankPool

    pool = RankPool(2, backend="nccl")
    yield pool.run
    pool.close()


def test_steady_state_issues_no_sync_nccl_tp2(nccl_ranks):
    """With NCCL the metadata is gathered on a signature's first call only (plan.py): after
    it, no call issues any device-to-host sync, NCCL's collectives included."""
    assert nccl_ranks(_steady_tp2, False, False, timeout=300) == [[], []]


def _graph_step_tp2(rank, world, group, n):
    """The CUDA-graph training step on a vocabulary-sharded head (16001 + 16000 rows)."""
    torch.manual_seed(0)  # the same full weight and batches on both ranks
    h, vocab, sizes = 256, 32001, (16001, 16000)
    dev = torch.device("cuda", torch.cuda.current_device())
    full = torch.randn(vocab, h, device=dev) * 0.05
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    batches = [
        (
            torch.randn(n, h, device=dev),
            torch.randint(0, vocab, (n,), device=dev),
            torch.randn(n, vocab, device=dev)[:, lo:hi].contiguous(),
        )
        for _ in range(4)
    ]
    head, opt, eager_head, eager_opt = _sgd_heads(full[lo:hi])
    losses = _graph_against_eager(head, opt, eager_head, eager_opt, batches, group)
    assert (head.weight - full[lo:hi]).abs().max() > 1e-4  # the replays did update it
    return losses


@pytest.mark.parametrize("n", [1024, 200])
def test_training_step_in_a_cuda_graph_nccl_tp2(nccl_ranks, n):
    losses = nccl_ranks(_graph_step_tp2, n, timeout=300)
    assert losses[0] == losses[1]  # one loss, the same on both ranks


# -- torch.compile with inductor -------------------------------------------------------------


def test_compile_inductor_fullgraph():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n, v = 512, 32000
    z = torch.randn(4, n // 4, v, device=dev, generator=g, dtype=torch.bfloat16)
    t = torch.randn(4, n // 4, v, device=dev, generator=g, dtype=torch.bfloat16)
    y = torch.randint(0, v, (4, n // 4), device=dev, generator=g)
    k = torch.randint(0, v, (4, n // 4, 2), device=dev, generator=g)

    def step(z, t, y, k):
        lp, ent = vtp.logprobs(z, k, return_entropy=True, backend="triton")
        return (
            vtp.cross_entropy(z, y, label_smoothing=0.1, reduction="mean", backend="triton")
            + lp.sum()
            + ent.sum()
            + vtp.entropy(z, labels=y, reduction="sum", backend="triton")
            + vtp.kl(z, t, reverse=True, reduction="sum", backend="triton")
            + vtp.jsd(z, t, beta=0.3, reduction="sum", backend="triton")
        )

    compiled = torch.compile(step, fullgraph=True)
    for _ in range(2):
        zc, ze = z.clone().requires_grad_(), z.clone().requires_grad_()
        tc, te = t.clone().requires_grad_(), t.clone().requires_grad_()
        got = compiled(zc, tc, y, k)
        want = step(ze, te, y, k)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
        # bf16 gradients of six ops are summed in bf16, in another order when compiled
        torch.testing.assert_close(zc.grad, ze.grad, rtol=1e-2, atol=1e-4)
        torch.testing.assert_close(tc.grad, te.grad, rtol=1e-2, atol=1e-4)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
