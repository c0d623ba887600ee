"""Second-order gradients: differentiating a gradient of a vtp_runtime op raises a clear
RuntimeError on every backend -- never a silently missing second-order term -- while a plain
``create_graph=True`` that never differentiates the gradient keeps working.

At TP 1 and 2 the conformance kit checks the same for every op of every backend
(``Case(second_order=True)``); here the user-level patterns, in process.
"""

import contextlib

import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime.ops import OPS
from vtp_runtime.registry import REGISTRY, registered
from vtp_runtime.testing import conformance
from vtp_runtime.testing.reference import values_and_grads

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

MESSAGE = "second-order gradients through vtp_runtime ops are not supported"
V = 24

EXAMPLE = "example_blockwise"


def _example_backend():
    """The example plugin's backend: registered where it is installed, else from its source."""
    if EXAMPLE in REGISTRY.backends():
        return REGISTRY.get(EXAMPLE)
    import vtp_example_backend  # on sys.path through tests/test_conformance.py

    return vtp_example_backend.BlockwiseBackend()


# every op each built-in backend claims on CPU (liger: under Triton's interpreter, at TP 1),
# and the example plugin's
BACKEND_OPS = {b: conformance.ops_with(backend=b) for b in conformance.backends_with(device_type="cpu")}
BACKEND_OPS[EXAMPLE] = conformance.ops_with(backend=_example_backend())
CASES = [(b, op) for b, ops in BACKEND_OPS.items() for op in ops]


@contextlib.contextmanager
def _backend(name):
    if name == "liger":
        pytest.importorskip("liger_kernel")
    if name == EXAMPLE and name not in REGISTRY.backends():
        import vtp_example_backend  # on sys.path through tests/test_conformance.py or installed

        with registered(vtp_example_backend):
            yield
        return
    yield


def _loss(op, logits, backend, teacher, labels):
    spec = OPS[op]
    args = (logits, teacher)[: len(spec.inputs)] + ((labels,) if spec.index else ())
    return vtp.loss(op, *args, backend=backend, reduction="sum")


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, V, generator=g), torch.randint(0, V, (4,), generator=g)


@pytest.mark.parametrize("backend,op", CASES)
def test_gradient_penalty_raises(backend, op):
    """The exact pattern: g = grad(loss, logits, create_graph=True); (loss + |g|^2).backward()."""
    with _backend(backend):
        teacher, labels = _inputs(1)
        logits = _inputs(0)[0].requires_grad_()
        loss = _loss(op, logits, backend, teacher, labels)
        (g,) = torch.autograd.grad(loss, logits, create_graph=True)
        with pytest.raises(RuntimeError, match=MESSAGE):
            (loss + g.pow(2).sum()).backward()


@pytest.mark.parametrize("backend,op", CASES)
def test_penalty_through_a_head_raises_with_autograd_grad(backend, op):
    """A penalty on parameter gradients, differentiated only w.r.t. the parameters:
    autograd.grad prunes every node that does not lead to them, so the error must lie on
    the path from the gradient to the parameters."""
    with _backend(backend):
        teacher, labels = _inputs(1)
        h = torch.randn(4, 6)
        w = torch.randn(V, 6, requires_grad=True)
        loss = _loss(op, h @ w.T, backend, teacher, labels)
        (gw,) = torch.autograd.grad(loss, w, create_graph=True)
        with pytest.raises(RuntimeError, match=MESSAGE):
            torch.autograd.grad(loss + gw.pow(2).sum(), w)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
@pytest.mark.parametrize("backend,op", CASES)
def test_plain_create_graph_keeps_working(backend, op):
    """create_graph=True whose gradient is only used as a value: the first-order gradient,
    equal to the float64 reference, and .backward(create_graph=True) fills .grad."""
    with _backend(backend):
        teacher, labels = _inputs(1)
        z, _ = _inputs(0)
        logits = z.clone().requires_grad_()
        (g,) = torch.autograd.grad(_loss(op, logits, backend, teacher, labels), logits, create_graph=True)
        floats = (z, teacher)[: len(OPS[op].inputs)]
        index = labels if OPS[op].index else None
        _, (ref, *_) = values_and_grads(op, floats, index, needs_grad=(True,) + (False,) * (len(floats) - 1))
        torch.testing.assert_close(g.detach().double(), ref, rtol=2e-4, atol=1e-6)
        _loss(op, logits, backend, teacher, labels).backward(create_graph=True)
        torch.testing.assert_close(logits.grad.detach(), g.detach())
        logits.grad = None  # the graph of .grad refers back to logits


def test_upstream_gradient_that_requires_grad():
    """``w * loss`` with a learnable ``w``: the op's gradient depends on ``w``; differentiating
    it w.r.t. ``w`` raises as well."""
    logits = _inputs(0)[0].requires_grad_()
    w = torch.tensor(2.0, requires_grad=True)
    loss = w * vtp.entropy(logits, backend="eager", reduction="sum")
    (g,) = torch.autograd.grad(loss, logits, create_graph=True)
    with pytest.raises(RuntimeError, match=MESSAGE):
        torch.autograd.grad(g.sum(), w)


def test_teacher_gradient_penalty_raises():
    """Co-distillation: the teacher's gradient is guarded like the student's."""
    s, _ = _inputs(0)
    t = _inputs(1)[0].requires_grad_()
    loss = vtp.jsd(s.requires_grad_(), t, beta=0.3, backend="eager", reduction="sum")
    (gt,) = torch.autograd.grad(loss, t, create_graph=True)
    with pytest.raises(RuntimeError, match=MESSAGE):
        torch.autograd.grad(gt.pow(2).sum(), t)
