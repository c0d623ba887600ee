"""argmax and sample at TP = 1 on the triton backend: one kernel launch per call
(``backends/triton/sampling.decode``), the ids of the rounds of ``vtp_runtime.sampling.run``
(which TP > 1 takes) for every op and option, edge values included, and the same tokens as
TP 2 and 3 ranks (uneven, an empty shard); no host read; the per-signature plans bounded.
Triton's interpreter on CPU at small V; the ``gpu`` tests at V = 151936."""

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime import plans, sampling
from vtp_runtime.backends.triton import TritonBackend
from vtp_runtime.backends.triton import sampling as triton_sampling
from vtp_runtime.invocation import Invocation

V = 23

CASES: list[dict[str, Any]] = [
    {},
    {"top_k": 1},
    {"top_k": 4},
    {"top_k": V - 1},
    {"top_p": 0.6},
    {"top_p": 0.05},
    {"min_p": 0.15},
    {"min_p": 1.0},
    {"temperature": 0.7, "top_k": 6, "top_p": 0.8},
    {"temperature": 1.5, "top_p": 0.9, "min_p": 0.05},
    {"top_k": 8, "top_p": 0.7, "min_p": 0.1},
    {"top_k": 3, "min_p": 0.3, "row_offset": 2**32 - 3},
    {"temperature": 0.0, "top_p": 0.5},
]


def _id(options: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in options.items()) or "plain"


def edge_logits(n: int, v: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """Random rows, then rows of ties, NaN, +-inf, all -inf, a large offset, equal maxima."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * 2
    x[0] = torch.randint(0, 3, (v,), generator=g).float()  # many ties at every cut
    x[1, 5] = math.nan
    x[2] = -math.inf
    x[3, 4] = math.inf
    x[3, 9] = math.inf
    x[4, : v // 2] = -math.inf
    x[5] = x[5] + 1e6  # keys relative to the max
    x[6] = 3.0
    x[7, [1, 7, 11]] = 9.0  # tied maxima
    return x.to(device)


def _plan(x: torch.Tensor, op: str, options: dict[str, Any]) -> plans.Plan:
    return plans.plan_for(Invocation(op, (x,), {"backend": "triton", **options}))


def one_launch_and_rounds(
    x: torch.Tensor, op: str, options: dict[str, Any], rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids of ``decode`` (one launch; ``rows`` per program) and of ``sampling.run``'s
    rounds, on the same call."""
    given = {"backend": "triton", **options}
    made = _plan(x, op, options)
    call = made.call(None, given)
    cfg = TritonBackend().config_for(x.device)
    z = x.reshape(-1, x.shape[-1])
    rounds = sampling.run(call, z, triton_sampling.TritonKernels(cfg))
    one_launch = cfg if rows is None else dataclasses.replace(cfg, decode_rows=rows)
    return triton_sampling.decode(one_launch, call, z), rounds


@pytest.mark.parametrize("options", CASES, ids=_id)
def test_one_launch_gives_the_ids_of_the_rounds(options):
    x = edge_logits(12, V, seed=1)
    for seed in (0, 7, 2**64 - 1):
        one, rounds = one_launch_and_rounds(x, "sample", {"seed": seed, **options})
        assert torch.equal(one, rounds), (seed, one, rounds)
    one, rounds = one_launch_and_rounds(x, "argmax", {})
    assert torch.equal(one, rounds)


@pytest.mark.parametrize("rows", [1, 4])
def test_rows_per_program_change_no_id(rows):
    """One row per program (the GPU's configuration) and a count that leaves a program part
    empty give the same ids."""
    x = edge_logits(10, V, seed=8)
    for options in ({}, {"top_k": 5, "top_p": 0.6}, {"top_p": 0.3, "min_p": 0.2}):
        one, rounds = one_launch_and_rounds(x, "sample", {"seed": 4, **options}, rows)
        assert torch.equal(one, rounds), options
    one, rounds = one_launch_and_rounds(x, "argmax", {}, rows)
    assert torch.equal(one, rounds)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_p_first_probe_far_above_the_min_changes_no_id(dtype):
    """Rows spread over many binades (a cut far above the row's min: top-p's first probe is
    its bound on the cut, not the midpoint), with ties at the cut and at the probe."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(12, V, generator=g) * 8
    x[1] = torch.randint(-40, 12, (V,), generator=g).float()  # ties everywhere
    x[2, :5] = 1e4  # tied maxima far above the rest
    x[3] = torch.linspace(-300, 30, V)
    x = x.to(dtype)
    for seed in (0, 9):
        for options in ({"top_p": 0.3}, {"top_p": 0.9}, {"top_p": 0.999}, {"top_p": 0.95, "temperature": 0.25}):
            one, rounds = one_launch_and_rounds(x, "sample", {"seed": seed, **options})
            assert torch.equal(one, rounds), options


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_launch_gives_the_ids_of_the_rounds_in_half_precision(dtype):
    """bf16 and fp16 logits: the cuts are searched in their coarser steps."""
    x = edge_logits(10, V, seed=2).to(dtype)
    for options in ({"top_k": 5}, {"top_p": 0.7}, {"top_k": 9, "top_p": 0.6, "min_p": 0.05}, {}):
        one, rounds = one_launch_and_rounds(x, "sample", {"seed": 3, **options})
        assert torch.equal(one, rounds), options


@pytest.mark.parametrize(
    "options,scale,offset",
    [
        ({}, 1.0, 1e30),
        ({"top_p": 0.7, "temperature": 1e27}, 1e27, 1e30),
        ({"top_k": 6, "temperature": 1e-30}, 1e-30, 0.0),
        ({"min_p": 0.1, "temperature": 0.5}, 1.0, 1e6),
        ({"top_p": 0.9, "temperature": 1e-44}, 3.0, 0.0),
        ({"top_p": 0.9, "min_p": 0.05, "temperature": 1e300}, 1e3, -1e6),
        ({"top_k": 4, "top_p": 0.5, "temperature": 5e-324}, 1.0, -1e30),
    ],
)
def test_one_launch_gives_the_ids_of_the_rounds_at_extremes(options, scale, offset):
    """Extreme temperatures and offsets (keys relative to the max, decided in the kernel),
    tiny-temperature ties."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, V, generator=g) * scale + offset
    x[0, [2, 6, 13]] = x[0].max() + scale  # tied maxima
    one, rounds = one_launch_and_rounds(x, "sample", {"seed": 5, **options})
    assert torch.equal(one, rounds)


def test_three_dimensional_logits_and_strided_rows():
    x = edge_logits(12, V, seed=3).view(3, 4, V)[:, 1:]  # [3, 3, V], no single row stride
    cases: list[dict[str, Any]] = [{}, {"top_p": 0.8}]
    for options in cases:
        got = vtp.sample(x, seed=9, backend="triton", **options)
        assert torch.equal(got, vtp.sample(x.contiguous(), seed=9, backend="triton", **options))
        made = _plan(x, "sample", {"seed": 9, **options})
        call = made.call(None, {"seed": 9, **options})
        cfg = TritonBackend().config_for(x.device)
        rounds = sampling.run(call, x, triton_sampling.TritonKernels(cfg))
        assert torch.equal(got.view(-1), rounds)


# -- launches and host reads -------------------------------------------------------------------


@contextmanager
def counting_launches() -> Iterator[list[str]]:
    """The names of the Triton kernels launched inside (Triton's interpreter)."""
    from triton.runtime.interpreter import InterpretedFunction

    launched: list[str] = []
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launched.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    InterpretedFunction.run = counted  # type: ignore[method-assign]
    try:
        yield launched
    finally:
        InterpretedFunction.run = run  # type: ignore[method-assign]


HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


@contextmanager
def no_host_reads() -> Iterator[None]:
    """Every way Python reads a tensor's values raises inside, but in a kernel launch (the
    interpreter reads its arguments on the host as a device would on the device)."""
    from triton.runtime.interpreter import InterpretedFunction

    inside = [0]
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def guard(name):
        real = saved[name]

        def read(self, *args, **kwargs):
            if not inside[0]:
                raise AssertionError(f"a host read: Tensor.{name}")
            return real(self, *args, **kwargs)

        return read

    run = InterpretedFunction.run

    def in_kernel(self, *args, **kwargs):
        inside[0] += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            inside[0] -= 1

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, guard(name))
        InterpretedFunction.run = in_kernel  # type: ignore[method-assign]
        yield
    finally:
        for name, real in saved.items():
            setattr(torch.Tensor, name, real)
        InterpretedFunction.run = run  # type: ignore[method-assign]


OPS: list[tuple[str, dict[str, Any]]] = [("argmax", {})] + [("sample", {"seed": 1, **o}) for o in CASES]


def _call(op: str, x: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
    fn = vtp.argmax if op == "argmax" else vtp.sample
    return fn(x, backend="triton", **options)


@pytest.mark.parametrize("op,options", OPS, ids=[f"{op}-{_id(o)}" for op, o in OPS])
def test_one_launch_per_call_and_no_host_read(op, options):
    x = edge_logits(8, V, seed=5)
    want = _call(op, x, options)  # plans the signature
    with counting_launches() as launched, no_host_reads():
        got = _call(op, x, {**options, "seed": 2} if op == "sample" else options)
    assert launched == ["decode_kernel"]
    assert got.shape == want.shape == (8,)


def test_the_checks_catch_a_host_read_and_a_second_launch():
    """The two guards above fail on the rounds' path (TP > 1 takes it): the top-p rounds
    read a flag on the host and launch a kernel per round."""
    x = edge_logits(8, V, seed=5)
    made = _plan(x, "sample", {"seed": 1, "top_p": 0.6})
    call = made.call(None, {"seed": 1, "top_p": 0.6})
    kernels = triton_sampling.TritonKernels(TritonBackend().config_for(x.device))
    with pytest.raises(AssertionError, match="a host read"), no_host_reads():
        sampling.run(call, x, kernels)
    with counting_launches() as launched:
        sampling.run(call, x, kernels)
    assert len(launched) > 1


def test_plans_are_bounded_and_hold_no_tensor():
    triton_sampling.clear_decode_plans()
    for n in range(1, triton_sampling.MAX_DECODE_PLANS + 10):
        vtp.argmax(torch.zeros(n, 5), backend="triton")
        assert len(triton_sampling.decode_plans()) <= triton_sampling.MAX_DECODE_PLANS
    for plan in triton_sampling.decode_plans():
        bound = plan.launch
        held = [plan.n, plan.gumbel, bound.device, bound.dtypes, bound.aligned, *bound.args.values(), *bound.values]
        assert not any(isinstance(v, torch.Tensor) for v in held)
    x = edge_logits(8, V)
    vtp.sample(x, seed=1, backend="triton")
    size = len(triton_sampling.decode_plans())
    for seed in range(5):  # a new seed per call: the same plan
        vtp.sample(x, seed=seed, backend="triton")
    assert len(triton_sampling.decode_plans()) == size


# -- TP 2 and 3: the rounds on ranks give the tokens of one launch on one process ---------------

LAYOUTS = {
    "tp2_uneven": [(0, 9), (9, V)],
    "tp3_empty": [(0, 11), (11, 11), (11, V)],
}
RANK_CASES: list[dict[str, Any]] = [
    {},
    {"top_k": 4},
    {"top_p": 0.6},
    {"min_p": 0.15},
    {"top_k": 8, "top_p": 0.7, "min_p": 0.1},
]


def ranks_job(rank, world, group, layout, cases):
    x = edge_logits(12, V, seed=6)
    start, end = LAYOUTS[layout][rank]
    z = x[:, start:end]
    bounds = {"vocab_start": start, "vocab_end": end}
    out: dict[str | int, torch.Tensor] = {"argmax": vtp.argmax(z, tp_group=group, backend="triton", **bounds)}
    for i, options in enumerate(cases):
        out[i] = vtp.sample(z, seed=31, tp_group=group, backend="triton", **bounds, **options)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ranks_draw_the_tokens_of_one_launch(ranks, layout) -> None:
    results = ranks(len(LAYOUTS[layout]), ranks_job, layout, RANK_CASES, timeout=600)
    x = edge_logits(12, V, seed=6)
    for out in results:
        assert torch.equal(out["argmax"], vtp.argmax(x, backend="triton"))
        for i, options in enumerate(RANK_CASES):
            assert torch.equal(out[i], vtp.sample(x, seed=31, backend="triton", **options)), options


# -- GPU ---------------------------------------------------------------------------------------

GPU_V = 151936


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_one_launch_gives_the_ids_of_the_rounds(n, dtype):
    """V = 151936 on CUDA: every op and option, random and edge rows, three seeds."""
    x = (torch.randn(n, GPU_V, device="cuda") * 4).to(dtype)
    if n >= 8:
        x[:8] = edge_logits(8, GPU_V, seed=1, device="cuda").to(dtype)
    cases: list[tuple[str, dict[str, Any]]] = [*OPS, ("sample", {"top_k": 50}), ("sample", {"top_p": 0.9})]
    for op, options in cases:
        for seed in (0, 1, 2**40):
            given = {**options, "seed": seed} if op == "sample" else options
            one, rounds = one_launch_and_rounds(x, op, given)
            assert torch.equal(one, rounds), (op, given, (one != rounds).nonzero().flatten().tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("op,options", OPS, ids=[f"{op}-{_id(o)}" for op, o in OPS])
def test_gpu_one_kernel_and_no_sync_per_call(op, options):
    """One CUDA kernel per call (the profiler's count), and no synchronization
    (``torch.cuda.set_sync_debug_mode('error')`` raises on one)."""
    x = (torch.randn(8, GPU_V, device="cuda") * 4).bfloat16()
    _call(op, x, options)
    _call(op, x, options)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")
        try:
            _call(op, x, {**options, "seed": 5} if op == "sample" else options)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels and all("decode_kernel" in k for k in kernels) and len(kernels) == 1, kernels
