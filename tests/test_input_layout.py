"""Input memory layouts: what each backend declares (``Backend.input_layout``), the core's
copy exactly when an input is not in that layout, the launchers' guards, and gradients of
strided inputs (a transposed linear head) against float64.

Values and gradients of every op in every layout on every backend are checked by the
conformance kit (``cases.VIEWS``; tests/test_conformance.py, test_triton.py, test_liger.py).
"""

import pytest
import torch

import vtp_runtime as vtp
from vtp_runtime.autograd import rows as _rows
from vtp_runtime.backend import INPUT_LAYOUTS, OpCapability, check_backend, meets_layout
from vtp_runtime.backends.eager import EagerBackend
from vtp_runtime.registry import REGISTRY
from vtp_runtime.testing import conformance

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

V = 10


def _inputs():
    """name -> (tensor [..., V], number of rows)."""
    full = torch.randn(2, 4, V + 3)
    return {
        "contiguous": (torch.randn(2, 3, V), 6),
        "causal_shift": (full[:, :-1, :V], 6),  # 3-D rows without one stride
        "sliced_rows": (torch.randn(6, V + 3)[:, :V], 6),  # 2-D, row stride V + 3
        "transposed": (torch.randn(V + 2, 6).T[:, 1 : V + 1], 6),  # vocabulary stride 6
        "every_other": (torch.randn(6, 2 * V)[:, ::2], 6),
        "expanded": (torch.randn(1, V).expand(6, V), 6),  # row stride 0
        "4d_unflattenable": (torch.randn(2, 2, 4, V)[:, :, :-1], 12),
        "zero_tokens_every_other": (torch.randn(0, 2 * V)[:, ::2], 0),
        "empty_shard_transposed": (torch.randn(0, 6).T, 6),  # V_local = 0
    }


# which inputs each layout takes as they are (a view), the rest are copied
KEPT = {
    "contiguous": {"contiguous", "zero_tokens_every_other", "empty_shard_transposed"},
    "unit_vocab_stride": {"contiguous", "sliced_rows", "expanded", "zero_tokens_every_other", "empty_shard_transposed"},
    "unit_vocab_stride_3d": {
        "contiguous",
        "sliced_rows",
        "expanded",
        "causal_shift",
        "zero_tokens_every_other",
        "empty_shard_transposed",
    },
    "any": {
        "contiguous",
        "sliced_rows",
        "expanded",
        "transposed",
        "every_other",
        "zero_tokens_every_other",
        "empty_shard_transposed",
    },
}


@pytest.mark.parametrize("layout", list(INPUT_LAYOUTS))
@pytest.mark.parametrize("name", list(_inputs()))
def test_rows_copies_exactly_when_the_layout_is_not_met(layout, name):
    t, n = _inputs()[name]
    rows = _rows(t, n, layout)
    assert meets_layout(rows, layout)
    assert torch.equal(rows.reshape(n, t.shape[-1]), t.reshape(n, t.shape[-1]))
    shares = rows.numel() == 0 or rows.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    if name in KEPT[layout]:
        assert shares, f"{layout}: {name} was copied though it is in the layout"
        assert rows.dim() == (3 if name == "causal_shift" else 2)
    else:
        assert not shares and rows.is_contiguous() and rows.shape == (n, t.shape[-1]), (
            f"{layout}: {name} reached the backend without the copy its layout needs"
        )


def test_unknown_layout_is_refused_at_registration():
    class Odd(EagerBackend):
        name = "odd_layout"
        input_layout = "rows"
        ops = {"entropy": OpCapability(device_types=None)}

    with pytest.raises(ValueError, match="input_layout must be one of contiguous, unit_vocab_stride"):
        check_backend(Odd())


def test_triton_launcher_refuses_what_it_did_not_declare():
    """Called directly (not through the core), the triton launcher raises on a vocabulary
    stride other than 1 instead of reading the wrong elements."""
    from vtp_runtime.backends.triton.backend import geometry

    with pytest.raises(RuntimeError, match="stride 1 on the vocabulary dim"):
        geometry(torch.randn(4, 2 * V)[:, ::2])
    with pytest.raises(RuntimeError, match="stride 1 on the vocabulary dim"):
        geometry(torch.randn(V, 4).T)
    assert geometry(torch.randn(2, 5, V)[:, :-1]) == (4, 5 * V, V)


def test_liger_refuses_what_it_did_not_declare():
    liger = pytest.importorskip("vtp_runtime.backends.liger")
    with pytest.raises(RuntimeError, match="must be contiguous"):
        liger.LigerBackend().forward(None, (torch.randn(V, 4).T,), torch.zeros(4, dtype=torch.long), None)


# each built-in backend that runs entropy on CPU, and whether its layout copies a transposed input
DECLARED = [(b, "transposed" not in KEPT[REGISTRY.get(b).input_layout]) for b in conformance.backends_with("entropy")]


@pytest.mark.parametrize("backend,copied", DECLARED)
def test_transposed_input_reaches_the_backend_as_declared(monkeypatch, backend, copied):
    cls = type(REGISTRY.get(backend))
    seen: list[tuple[int, tuple[int, ...]]] = []
    original = cls.forward

    def spy(self, call, inputs, index, mask):
        seen.extend((t.data_ptr(), t.stride()) for t in inputs)
        return original(self, call, inputs, index, mask)

    monkeypatch.setattr(cls, "forward", spy)
    base = torch.randn(V, 5)
    vtp.entropy(base.T, backend=backend)
    if copied:
        assert seen[0] != (base.data_ptr(), (1, 5)) and seen[0][1] == (V, 1)
    else:
        assert seen == [(base.data_ptr(), (1, 5))]


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_transposed_linear_head_gradients(backend):
    """``logits = (W @ h.T).T``: the gradients reaching W and h through the strided logits
    match float64 autograd on the same head."""
    torch.manual_seed(0)
    w = torch.randn(24, 8, requires_grad=True)
    h = torch.randn(5, 8, requires_grad=True)
    t = torch.randn(5, 24)
    y = torch.randint(0, 24, (5,))
    logits = (w @ h.T).T
    assert logits.stride(-1) != 1
    loss = (
        vtp.cross_entropy(logits, y, backend=backend).sum()
        + vtp.jsd(logits, t[:, :24], beta=0.3, backend=backend).sum()
    )
    gw, gh = torch.autograd.grad(loss, (w, h))
    w64, h64 = w.detach().double().requires_grad_(), h.detach().double().requires_grad_()
    z = h64 @ w64.T
    lp, lt = z.log_softmax(-1), t.double().log_softmax(-1)
    m = (0.3 * lt.exp() + 0.7 * lp.exp()).log()
    ref = torch.nn.functional.cross_entropy(z, y, reduction="sum") + (
        0.3 * (lt.exp() * (lt - m)).sum() + 0.7 * (lp.exp() * (lp - m)).sum()
    )
    rw, rh = torch.autograd.grad(ref, (w64, h64))
    torch.testing.assert_close(gw.double(), rw, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gh.double(), rh, rtol=1e-4, atol=1e-5)
