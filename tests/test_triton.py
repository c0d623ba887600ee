"""The triton backend against the float64 dense reference, on CPU tensors through Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1): the conformance kit's cases at TP 1
and 2, a smoke selection of them by default (one case of every check: ``VTP_TEST_DEPTH=full``
runs the kit's full matrix), also for a configuration that never splits a row. Every call
forces its backend, so nothing falls back silently. The interpreter is slow: the kit's main
cases are 6 tokens, and the launch configuration for CPU (INTERPRETER_CONFIG) uses
16/32-column tiles so that these shapes still cover several tiles per chunk and several
chunks (splits) per row.
"""

import dataclasses

import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime.backends.triton import INTERPRETER_CONFIG, LaunchConfig, TritonBackend
from vtp_runtime.registry import hookimpl, registered
from vtp_runtime.testing import conformance

# numpy warns about the NaN/inf arithmetic the edge cases exercise on purpose
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

T = "triton"
DEPTH = conformance.current_depth(slow=True)  # smoke unless VTP_TEST_DEPTH=full
SHAPE = (2, 3)  # 6 tokens: the interpreter's cost grows with rows x splits x tiles


@conformance.parametrize(T, depth=DEPTH, shape=SHAPE)
def test_conformance(ranks, conformance_case):
    conformance.check(conformance_case, runner=ranks, timeout=120)


# Rows that are neither split nor sharded are finished by the program that reads them (one
# launch: stats1/stats2 with FINISH, jsd_row_kernel). A backend whose configuration never
# splits a row takes that path for every call at TP 1, on the same test matrix and edges.
ROW_CONFIG = dataclasses.replace(INTERPRETER_CONFIG, target_programs=1, max_splits=1)


class _WholeRows(TritonBackend):
    name = "triton_whole_rows"
    priority = -5


class _WholeRowsPlugin:
    @hookimpl
    def vtp_runtime_register_backends(self, register):
        register(_WholeRows(ROW_CONFIG))


WHOLE_ROWS = _WholeRowsPlugin()  # the rank processes register it as "tests.test_triton:WHOLE_ROWS"


@pytest.fixture(scope="module")
def whole_rows():
    with registered(WHOLE_ROWS, name="triton_whole_rows"):
        yield _WholeRows.name


@conformance.parametrize(
    _WholeRows(ROW_CONFIG), world_sizes=(1,), plugin="tests.test_triton:WHOLE_ROWS", depth=DEPTH, shape=SHAPE
)
def test_whole_rows_conformance(ranks, conformance_case):
    conformance.check(conformance_case, runner=ranks, timeout=120)


def test_whole_rows_is_one_launch_per_forward(whole_rows, monkeypatch):
    """The single-launch path is the one taken: no finishing or divergence kernel runs."""
    from vtp_runtime.backends.triton import kernels

    launched: list[str] = []
    for name in (
        "stats1_kernel",
        "finish1_kernel",
        "stats2_kernel",
        "jsd_div_kernel",
        "finish2_kernel",
        "jsd_row_kernel",
    ):
        kernel = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, _Recorder(kernel, name, launched))
    z, t = torch.randn(3, 40), torch.randn(3, 40)
    vtp.cross_entropy(z, torch.randint(0, 40, (3,)), backend=whole_rows)
    vtp.kl(z, t, backend=whole_rows)
    vtp.jsd(z, t, beta=0.3, backend=whole_rows)
    vtp.jsd(z, t, beta=0.3, backend=T)  # the split path, for contrast: its rows merged by their last program
    assert launched == [
        "stats1_kernel",
        "stats2_kernel",
        "jsd_row_kernel",
        "stats2_kernel",
        "jsd_div_kernel",
    ]


class _Recorder:
    def __init__(self, kernel, name, launched):
        self.kernel, self.name, self.launched = kernel, name, launched

    def __getitem__(self, grid):
        self.launched.append(self.name)
        return self.kernel[grid]


def test_probe_reasons_never_raise(monkeypatch):
    b = TritonBackend()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert any("TRITON_INTERPRET=1" in r for r in b.probe("cpu"))
    assert b.probe("xpu")  # not this backend's device type: a reason, not an exception
    if not torch.cuda.is_available():
        assert any("cuda" in r.lower() for r in b.probe("cuda"))


def test_strided_rows_reach_the_kernels_without_a_copy(monkeypatch):
    """A causal-shift view ``logits[:, :-1]`` arrives as the 3-D view itself, not a copy."""
    seen: list[tuple] = []
    original = TritonBackend.forward

    def spy(self, call, inputs, index, mask):
        seen.extend((t.dim(), t.data_ptr(), t.stride()) for t in inputs)
        return original(self, call, inputs, index, mask)

    monkeypatch.setattr(TritonBackend, "forward", spy)
    full = torch.randn(2, 6, 20)
    view = full[:, :-1]
    labels = torch.randint(0, 20, (2, 5))
    out = vtp.cross_entropy(view, labels, backend=T)
    assert seen == [(3, full.data_ptr(), full.stride())]
    ref = torch.nn.functional.cross_entropy(view.reshape(-1, 20), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(out.reshape(-1), ref, rtol=1e-5, atol=1e-5)


def test_second_backward_and_inputs_untouched():
    z = torch.randn(4, 30, requires_grad=True)
    t = torch.randn(4, 30, requires_grad=True)
    before = (z.detach().clone(), t.detach().clone())
    out = vtp.jsd(z, t, beta=0.4, backend=T).sum()
    g1 = torch.autograd.grad(out, (z, t), retain_graph=True)
    g2 = torch.autograd.grad(out, (z, t))
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    assert torch.equal(z.detach(), before[0]) and torch.equal(t.detach(), before[1])


def test_launch_config_is_a_parameter():
    """A subclass with its own name and LaunchConfig launches the same kernels (the XPU
    backend does exactly this); a different tiling gives the same numbers."""

    class Other(TritonBackend):
        name = "triton_config_test"
        priority = -5

    cfg = LaunchConfig(
        block_stats=64,
        block_div=32,
        block_bwd=64,
        target_programs=4,
        max_splits=2,
        bwd_target_programs=4,
        block_rows=8,
        warps_stats=1,
        warps_div=1,
        warps_bwd=1,
        warps_finish=1,
        fast_log2=False,
    )
    assert cfg != INTERPRETER_CONFIG

    class Plugin:
        @hookimpl
        def vtp_runtime_register_backends(self, register):
            register(Other(cfg))

    with registered(Plugin(), name="triton_config_test"):
        z = torch.randn(5, 150, requires_grad=True)
        t = torch.randn(5, 150)
        a = vtp.jsd(z, t, beta=0.3, backend="triton_config_test")
        b = vtp.jsd(z, t, beta=0.3, backend=T)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        (ga,) = torch.autograd.grad(a.sum(), z)
        (gb,) = torch.autograd.grad(b.sum(), z)
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-7)
        y = torch.randint(0, 150, (5,))  # the one-input kernels too
        torch.testing.assert_close(
            vtp.cross_entropy(z, y, backend="triton_config_test"),
            vtp.cross_entropy(z, y, backend=T),
            rtol=1e-5,
            atol=1e-6,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("upstream", [1.0, 0.375, -3.0])
def test_scaling_a_heads_gradients_matches_torch(dtype, upstream):
    """The fused head's gradients (computed in forward) times the upstream gradient as torch's
    multi-tensor multiply gives them, fp32 math rounded once: sizes that are not a whole
    number of tiles, more tiles than programs (each program strides), one element, none.
    Triton's interpreter rounds fp32 to bf16 toward zero where the GPU rounds to nearest
    even, so a bf16 element may also be the product truncated."""
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=g).to(dtype) for n in (203, 37, 1, 0)] + [torch.randn(5, 7, generator=g)]
    products = [x.float() * upstream for x in grads]
    want = [x.clone() for x in grads]
    scale = torch.tensor([upstream], dtype=torch.float32).reshape(-1)[0]  # a 0-dim view, as backward passes it
    torch._foreach_mul_(want, scale)
    TritonBackend().scale_gradients(grads, scale)
    for got, ref, product in zip(grads, want, products):
        assert got.dtype == ref.dtype
        truncated = (product.view(torch.int32) & -65536).view(torch.float32).to(got.dtype)
        assert bool(((got == ref) | ((got == truncated) & (got.dtype == torch.bfloat16))).all())
