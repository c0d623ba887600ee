"""A sum or mean reduced by the triton kernels themselves (the ``Reduces`` protocol), split
rows merged by their last program, and the upstream gradient read in its strides: against
the float64 dense reference, and bit for bit against what the core's reduction and the
separate finishing kernel give. On CPU through Triton's interpreter (small shapes); the
``gpu`` tests run the same checks on CUDA at 1, 16 and 1024 rows of V = 151936.
"""

import dataclasses
import os

import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime import outputs
from vtp_runtime.backends.triton import CUDA_CONFIG, INTERPRETER_CONFIG, TritonBackend
from vtp_runtime.ops import get_spec
from vtp_runtime.registry import hookimpl, registered
from vtp_runtime.testing import conformance
from vtp_runtime.testing.reference import values

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

# every loss op the triton backend claims, and "<op>_topk" (an [N, k] index) where it claims topk
_TOPK = conformance.ops_with("topk", backend="triton")
OPS = tuple(f for op in conformance.ops_with(backend="triton") for f in ((op, f"{op}_topk") if op in _TOPK else (op,)))


class _Separate(TritonBackend):
    """The triton kernels with split rows finished by a launch of their own (as at TP > 1)."""

    name = "triton_separate"
    priority = -5


class _SeparatePlugin:
    def __init__(self, config):
        self.config = config

    @hookimpl
    def vtp_runtime_register_backends(self, register):
        register(_Separate(dataclasses.replace(self.config, merge_rows=False)))


def _inputs(op: str, n: int, v: int, dtype: torch.dtype, device: str, seed: int = 0):
    """``(args, options, index, mask)`` of one call: logits (and a teacher), some tokens
    ignored or masked."""
    spec = get_spec(op.removesuffix("_topk"))
    g = torch.Generator(device=device).manual_seed(seed)
    z = (torch.randn(n, v, device=device, generator=g) * 3).to(dtype)
    args: list = [z]
    options: dict = {"beta": 0.3} if spec.name == "jsd" else {}
    index = mask = None
    if len(spec.inputs) == 2:
        args.append((torch.randn(n, v, device=device, generator=g) * 3).to(dtype))
    if spec.index:
        shape = (n, 3) if op.endswith("_topk") else (n,)
        index = torch.randint(0, v, shape, device=device, generator=g)
        index[torch.rand(shape, device=device, generator=g) < 0.25] = -100
        args.append(index)
    else:
        mask = torch.rand(n, device=device, generator=g) > 0.25
        options["mask"] = mask
    return args, options, index, mask


def _reference(op: str, args, index, mask, reduction: str, options) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 sum or mean of the dense reference's per-token values, differentiable in
    the (float64) first input."""
    ref_op = op.removesuffix("_topk")
    floats = [a.detach().double() for a in args if a.is_floating_point()]
    floats[0].requires_grad_(True)
    opts = {k: val for k, val in options.items() if k != "mask"}
    per_token = values(ref_op, tuple(floats), index, mask=mask, **opts)
    if reduction == "sum":
        return per_token.sum(), floats[0]
    count = (index != -100).sum() if index is not None else mask.sum()
    return per_token.sum() / count.clamp(min=1), floats[0]


def _run(op: str, args, options, reduction: str, backend: str):
    z = args[0].detach().requires_grad_(True)
    out = vtp.loss(op.removesuffix("_topk"), z, *args[1:], reduction=reduction, backend=backend, **options)
    return out, z


def _check(op, n, v, dtype, device, backend, separate, atol):
    args, options, index, mask = _inputs(op, n, v, dtype, device)
    for reduction in ("sum", "mean"):
        out, z = _run(op, args, options, reduction, backend)
        assert out.dim() == 0 and out.dtype == torch.float32
        ref, leaf = _reference(op, args, index, mask, reduction, options)
        torch.testing.assert_close(out.double(), ref.detach(), rtol=5e-5, atol=atol)
        # a scaled upstream: the gradient of g * loss against float64
        upstream = torch.tensor(0.75, device=device)
        (grad,) = torch.autograd.grad(out, z, upstream)
        (ref_grad,) = torch.autograd.grad(ref * 0.75, leaf)
        err = (grad.double() - ref_grad).norm() / ref_grad.norm().clamp_min(1e-30)
        assert err.item() < (1e-5 if dtype == torch.float32 else 8e-3), f"{op} {reduction}: {err.item():.3g}"
        # a plain backward: bit for bit what the core's reduction of the per-token values
        # sends (exactly 1 / count for a mean, outputs.plain_upstream)
        out, z = _run(op, args, options, reduction, backend)
        (plain,) = torch.autograd.grad(out, z)
        per_token, z2 = _run(op, args, options, "none", backend)
        kept = {"mask": mask} if mask is not None else {}
        core = outputs.reduce(per_token, {"reduction": reduction, **kept}, index, mask, -100)
        (by_core,) = torch.autograd.grad(core, z2)
        assert torch.equal(plain, by_core), f"{op} {reduction}: not the core's gradient bits"
        # split rows merged by their last program: the separate finishing kernel's bits
        merged, _ = _run(op, args, options, "none", backend)
        alone, _ = _run(op, args, options, "none", separate)
        assert torch.equal(merged, alone), f"{op}: merged rows differ from the finishing kernel's"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [1, 4, 40])
def test_reduced_in_the_kernels(op, n):
    """4 and 1 rows split over the vocabulary (merged by their last program), 40 whole rows
    (several reducing programs) under the interpreter's configuration."""
    with registered(_SeparatePlugin(INTERPRETER_CONFIG), name="separate"):
        _check(op, n, 64, torch.float32, "cpu", "triton", "triton_separate", atol=1e-5)


def _check_pair(n: int, v: int, dtype: torch.dtype, device: str, atol: float) -> None:
    """Log-probs of an ``[N]`` index with the entropy, both reduced in the kernels over one
    count: against float64, the gradient of ``0.75 lp + 0.5 H`` too; a plain backward's bits
    as the core's reduction of the per-token pair sends them; merged rows as the separate
    finishing kernel reduces them."""
    g = torch.Generator(device=device).manual_seed(n)
    z = (torch.randn(n, v, device=device, generator=g) * 3).to(dtype)
    index = torch.randint(0, v, (n,), device=device, generator=g)
    index[torch.rand(n, device=device, generator=g) < 0.25] = -100
    if n > 1:
        index[0] = -100
    kept = index != -100
    for reduction in ("sum", "mean"):

        def run(backend: str, reduction: str = reduction):
            leaf = z.detach().requires_grad_(True)
            lp, h = vtp.logprobs(leaf, index, return_entropy=True, reduction=reduction, backend=backend)
            return lp, h, leaf

        lp, h, leaf = run("triton")
        assert lp.dim() == 0 and h.dim() == 0
        ref = z.detach().double().requires_grad_(True)
        count = kept.sum().clamp(min=1) if reduction == "mean" else 1
        ref_lp = values("logprobs", (ref,), index).sum() / count
        ref_h = values("entropy", (ref,), mask=kept).sum() / count
        torch.testing.assert_close(lp.double(), ref_lp.detach(), rtol=5e-5, atol=atol)
        torch.testing.assert_close(h.double(), ref_h.detach(), rtol=5e-5, atol=atol)
        (grad,) = torch.autograd.grad(0.75 * lp + 0.5 * h, leaf)
        (ref_grad,) = torch.autograd.grad(0.75 * ref_lp + 0.5 * ref_h, ref)
        err = (grad.double() - ref_grad).norm() / ref_grad.norm().clamp_min(1e-30)
        assert err.item() < (1e-5 if dtype == torch.float32 else 8e-3), f"{reduction}: {err.item():.3g}"
        lp, h, leaf = run("triton")
        (plain,) = torch.autograd.grad(lp + h, leaf)
        lp_t, h_t, leaf_t = run("triton", "none")
        (by_core,) = torch.autograd.grad(lp_t.sum() / count + h_t.sum() / count, leaf_t)
        assert torch.equal(plain, by_core), f"{reduction}: not the core's gradient bits"
        lp_alone, h_alone, _ = run("triton_separate")
        lp, h, _ = run("triton")
        assert torch.equal(lp, lp_alone) and torch.equal(h, h_alone), f"{reduction}: merged rows reduce otherwise"


@pytest.mark.parametrize("n", [1, 4, 40])
def test_reduced_pair_in_the_kernels(n):
    with registered(_SeparatePlugin(INTERPRETER_CONFIG), name="separate"):
        _check_pair(n, 64, torch.float32, "cpu", atol=1e-5)


def test_the_core_reduces_for_other_backends():
    """The eager backend (no ``Reduces``) still gets per-token calls; a normalizer, or
    ``return_entropy`` with an ``[N, k]`` index, keeps the core's reduction on the triton
    backend too; ``return_entropy`` with an ``[N]`` index is reduced in the kernels."""
    seen: list[str] = []
    real = TritonBackend.forward

    def spy(self, call, inputs, index, mask):
        seen.append(call.reduction)
        return real(self, call, inputs, index, mask)

    z, y = torch.randn(4, 64), torch.randint(0, 64, (4,))
    TritonBackend.forward = spy  # type: ignore[method-assign]
    try:
        vtp.cross_entropy(z, y, reduction="mean", backend="triton")
        vtp.cross_entropy(z, y, reduction="sum", normalizer=3.0, backend="triton")
        vtp.cross_entropy(z, y, reduction="none", backend="triton")
        lp, h = vtp.logprobs(z, y, reduction="mean", return_entropy=True, backend="triton")
        lp_k, h_k = vtp.logprobs(z, y[:, None].repeat(1, 2), reduction="mean", return_entropy=True, backend="triton")
    finally:
        TritonBackend.forward = real  # type: ignore[method-assign]
    assert seen == ["mean", "none", "none", "mean", "none"]
    assert lp.dim() == 0 and h.dim() == 0 and lp_k.dim() == 0 and h_k.dim() == 0
    eager = vtp.cross_entropy(z.double(), y, reduction="mean", backend="eager")
    torch.testing.assert_close(eager, torch.nn.functional.cross_entropy(z.double(), y))


def test_an_expanded_upstream_is_read_in_place():
    """A per-token result summed or weighted by torch: the kernels read the upstream
    gradient in its strides (stride 0, or every other element of a larger tensor)."""
    z, y = torch.randn(4, 64, dtype=torch.float64), torch.randint(0, 64, (4,))
    weights = torch.randn(8, dtype=torch.float64)[::2]  # a non-contiguous upstream
    for upstream in (torch.ones((), dtype=torch.float64).expand(4), weights):
        s = z.float().requires_grad_(True)
        (grad,) = torch.autograd.grad(vtp.cross_entropy(s, y, backend="triton"), s, upstream.float())
        ref = z.clone().requires_grad_(True)
        (ref_grad,) = torch.autograd.grad(torch.nn.functional.cross_entropy(ref, y, reduction="none"), ref, upstream)
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-6)


# -- on CUDA ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [1, 16, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduced_in_the_kernels_on_cuda(op, n, dtype):
    """1 and 16 rows are split over V = 151936 (merged by their last program), 1024 rows
    whole (1024 reducing programs); the same checks, three times over (the last program to
    arrive changes from run to run, the bits must not)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with compiled Triton (TRITON_INTERPRET=0)")
    with registered(_SeparatePlugin(CUDA_CONFIG), name="separate"):
        for _ in range(3):
            _check(op, n, 151936, dtype, "cuda", "triton", "triton_separate", atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 16, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduced_pair_in_the_kernels_on_cuda(n, dtype):
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with compiled Triton (TRITON_INTERPRET=0)")
    with registered(_SeparatePlugin(CUDA_CONFIG), name="separate"):
        for _ in range(3):
            _check_pair(n, 151936, dtype, "cuda", atol=1e-4)
